"""Rebalance listeners, lifespan hooks, lag, Prometheus metrics and health against the real broker."""

from __future__ import annotations

import asyncio
import re
import threading
import time
import urllib.request
from typing import Any

import anyio
import pytest
from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families

from rmq_async import ConsumeResult, Message, MessageExt, MessageQueue, PushConsumer
from rmq_async.devbroker import LocalRocketMQ
from rmq_async.observability.prometheus import instrument, start_metrics_server
from tests.chaos.proxy import FaultProxy
from tests.helpers import AdminClient, produce, unique, wait_until, wait_until_async

pytestmark = pytest.mark.broker

Event = tuple[str, Any]


def _messages(topic: str, n: int) -> list[Message]:
    return [Message(topic, f"m{i:010d}".encode()) for i in range(n)]


def _spy_commits(consumer: PushConsumer, events: list[Event]) -> None:
    """Record every UPDATE_CONSUMER_OFFSET the consumer sends, in order with the hooks."""
    api = consumer.instance.api
    real = api.update_consumer_offset

    async def spy(addr: str, group: str, mq: MessageQueue, offset: int, *,
                  oneway: bool = True) -> None:
        events.append(("commit", (mq, offset)))
        await real(addr, group, mq, offset, oneway=oneway)

    api.update_consumer_offset = spy  # type: ignore[method-assign]


def _spy_pulls(consumer: PushConsumer, events: list[Event]) -> None:
    api = consumer.instance.api
    real = api.start_pull

    async def spy(addr: str, **kw: Any) -> Any:
        events.append(("pull", kw["mq"]))
        return await real(addr, **kw)

    api.start_pull = spy  # type: ignore[method-assign]


async def test_on_revoked_awaited_before_revoked_offsets_persist_and_lifespan_order(
        rocketmq: LocalRocketMQ) -> None:
    ns = rocketmq.namesrv_addr
    topic = unique("T_revoke")
    await rocketmq.create_topic(topic, queues=4)
    group = unique("G_revoke")
    # Offsets reach the broker only when a queue is given up or the consumer stops.
    opts: dict[str, Any] = dict(consume_from_where="CONSUME_FROM_FIRST_OFFSET",
                                persist_offset_interval=120.0, rebalance_interval=30.0)
    events: list[Event] = []
    consumed: list[tuple[str, int, int]] = []

    async def on(msgs: list[MessageExt]) -> ConsumeResult:
        consumed.extend((m.topic, m.queue_id, m.queue_offset) for m in msgs)
        return ConsumeResult.SUCCESS

    a = PushConsumer(group, namesrv=ns, **opts)
    a.subscribe(topic, listener=on)

    @a.on_startup
    async def startup() -> None:
        assert not a.process_queues, "startup runs before the first rebalance"
        events.append(("startup", None))
        _spy_commits(a, events)
        _spy_pulls(a, events)

    @a.on_assigned
    async def assigned(queues: frozenset[MessageQueue]) -> None:
        assert all(mq in a.process_queues for mq in queues)
        events.append(("assigned", queues))

    @a.on_revoked
    async def revoked(queues: frozenset[MessageQueue]) -> None:
        # The queues are still held (not dropped) while the listener runs.
        assert all(mq in a.process_queues and not a.process_queues[mq].dropped for mq in queues)
        events.append(("revoked", queues))
        await asyncio.sleep(0.3)  # awaited: nothing of these queues is persisted meanwhile
        events.append(("revoked_done", queues))

    @a.on_shutdown
    def shutdown() -> None:  # a plain function: runs in a worker thread
        assert not a.process_queues and not a.instance.remoting.closed
        events.append(("shutdown", None))

    b = PushConsumer(group, namesrv=ns, **opts)
    b.subscribe(topic, listener=on)
    placed: list[tuple[int, int]] = []
    t0 = time.monotonic()
    await a.start()
    try:
        placed = await produce(ns, topic, _messages(topic, 40), batch=5)
        await wait_until(lambda: len(consumed) == 40, 20, what="A consumed everything")
        first_assigned = next(q for kind, q in events if kind == "assigned")
        assert {mq for mq in first_assigned if mq.topic == topic} == {
            MessageQueue(topic, "broker-a", i) for i in range(4)}
        # on_assigned came before the first pull of each of its queues.
        first_pull = {q: i for i, (kind, q) in reversed(list(enumerate(events))) if kind == "pull"}
        i_assigned = next(i for i, (kind, _) in enumerate(events) if kind == "assigned")
        assert all(first_pull[mq] > i_assigned for mq in first_assigned if mq in first_pull)
        n_before = len(events)
        await b.start()  # a second member joins: A gives half of the topic's queues up
        await wait_until(lambda: any(k == "revoked_done" for k, _ in events[n_before:]), 20,
                         what="A's on_revoked")
        i_rev = next(i for i, (k, _) in enumerate(events) if k == "revoked")
        revoked_qs: frozenset[MessageQueue] = events[i_rev][1]
        assert len([mq for mq in revoked_qs if mq.topic == topic]) == 2
        await wait_until(lambda: all(any(k == "commit" and v[0] == mq for k, v in events[i_rev:])
                                     for mq in revoked_qs), 10, what="revoked offsets persisted")
        i_done = next(i for i, (k, _) in enumerate(events) if k == "revoked_done")
        commits_of_revoked = [(i, v) for i, (k, v) in enumerate(events)
                              if k == "commit" and v[0] in revoked_qs]
        # Every commit of a revoked queue comes after its listener returned.
        assert commits_of_revoked and all(i > i_done for i, _ in commits_of_revoked)
        per_queue = {q: sum(1 for qid, _ in placed if qid == q.queue_id) for q in revoked_qs}
        assert {v for _, v in commits_of_revoked} == {(q, n) for q, n in per_queue.items()}
        # B holds the revoked queues (it may have read their offsets before A persisted them:
        # rebalancing in RocketMQ is not coordinated, so delivery stays at least once).
        await wait_until(lambda: {mq for mq in b.process_queues if mq.topic == topic}
                         == {mq for mq in revoked_qs if mq.topic == topic}, 10, what="B's queues")
        assert len(set(consumed)) == 40
    finally:
        n_stop = len(events)
        await a.stop()
        await b.stop()
    stop_events = events[n_stop:]
    kinds = [k for k, _ in stop_events]
    # stop(): revoked for what A still held, then the final commits, then shutdown.
    assert kinds[0] == "revoked" and kinds[1] == "revoked_done" and kinds[-1] == "shutdown"
    assert "commit" in kinds and kinds.index("commit") > 1
    assert {v[0] for k, v in stop_events if k == "commit"} <= stop_events[0][1]
    print(f"\nrevoke: {len(revoked_qs)} queues revoked (listener 0.3 s) before "
          f"{len(commits_of_revoked)} commits; {time.monotonic() - t0:.1f} s")


async def test_stop_is_bounded_when_the_hooks_never_return(rocketmq: LocalRocketMQ) -> None:
    """An on_revoked that never returns and a plain on_shutdown blocked in its thread hold
    ``stop()`` for its timeout each, not for ever; the offsets are still persisted."""
    ns = rocketmq.namesrv_addr
    topic = unique("T_stuck_hooks")
    await rocketmq.create_topic(topic, queues=2)
    group = unique("G_stuck_hooks")
    release = threading.Event()
    consumed: list[int] = []
    consumer = PushConsumer(group, namesrv=ns, consume_from_where="CONSUME_FROM_FIRST_OFFSET",
                            persist_offset_interval=120.0)

    @consumer.subscribe(topic)
    async def on(msg: MessageExt) -> None:
        consumed.append(msg.queue_offset)

    @consumer.on_revoked
    async def revoked(queues: frozenset[MessageQueue]) -> None:
        await asyncio.Event().wait()

    @consumer.on_shutdown
    def shutdown() -> None:
        release.wait(60)

    placed = await produce(ns, topic, _messages(topic, 20), batch=5)
    await consumer.start()
    try:
        await wait_until(lambda: len(consumed) == 20, 20, what="everything consumed")
        began = time.monotonic()
        await asyncio.wait_for(consumer.stop(timeout=1.0), 20)
        took = time.monotonic() - began
    finally:
        release.set()
    assert took < 10, took
    async with AdminClient(ns) as admin:
        committed = await admin.committed_offsets(group, topic)
    per_queue = {q: sum(1 for qid, _ in placed if qid == q) for q in range(2)}
    assert {mq.queue_id: off for mq, off in committed.items()} == per_queue


def _progress_rows(out: str) -> dict[tuple[str, int], tuple[int, int, int]]:
    """``mqadmin consumerProgress`` rows: (topic, queue) -> (broker offset, consumer offset, diff)."""
    rows = re.findall(r"^(\S+)\s+broker-a\s+(\d+)\s+(\d+)\s+(\d+)\s+(-?\d+)\s", out, re.M)
    return {(t, int(q)): (int(b), int(c), int(d)) for t, q, b, c, d in rows}


async def _scrape(port: int) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    def get() -> str:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as resp:
            assert resp.status == 200
            return str(resp.read().decode())

    text = await anyio.to_thread.run_sync(get)
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


async def test_lag_matches_consumer_progress_and_metrics_endpoint(rocketmq: LocalRocketMQ) -> None:
    ns = rocketmq.namesrv_addr
    topic = unique("T_lag")
    await rocketmq.create_topic(topic, queues=4)
    group = unique("G_lag")

    async def on(msgs: list[MessageExt]) -> ConsumeResult:
        for m in msgs:
            if m.body.endswith(b"-poison"):
                raise RuntimeError("poison")  # retried once, then to the DLQ
        return ConsumeResult.SUCCESS

    consumer = PushConsumer(group, namesrv=ns, consume_from_where="CONSUME_FROM_FIRST_OFFSET",
                            persist_offset_interval=0.5, max_reconsume_times=1)
    consumer.subscribe(topic, listener=on)
    registry = CollectorRegistry()
    instrument(consumer, registry)
    server = start_metrics_server(0, addr="127.0.0.1", registry=registry)
    t0 = time.monotonic()
    try:
        async with consumer:
            first = await produce(ns, topic, _messages(topic, 40), batch=5)
            first += await produce(ns, topic, [Message(topic, b"m-poison")])
            totals = consumer.stats.totals
            await wait_until(lambda: topic in totals and totals[topic].consumed == 40
                             and totals[topic].dead_lettered == 1, 30,
                             what="the first 40 consumed and the poison dead-lettered")
            # Paused, the topic's next 40 messages stay on the broker: that is the lag.
            consumer.pause(topic)
            second = await produce(ns, topic, _messages(topic, 40), batch=5)
            expected = {MessageQueue(topic, "broker-a", q): (
                sum(1 for qid, _ in first + second if qid == q),
                sum(1 for qid, _ in first if qid == q)) for q in range(4)}

            def settled() -> bool:
                lag = consumer.lag()
                return all(mq in lag and (lag[mq].max_offset, lag[mq].committed_offset) == exp
                           for mq, exp in expected.items())

            await wait_until(settled, 10, what="lag() on the paused queues")
            # The broker has the committed offsets too (persist interval 0.5 s).
            async with AdminClient(ns) as admin:

                async def persisted() -> bool:
                    at_broker = {**await admin.committed_offsets(group, topic),
                                 **await admin.committed_offsets(group, consumer.retry_topic)}
                    return all(at_broker.get(mq) == ql.committed_offset
                               for mq, ql in consumer.lag().items())

                await wait_until_async(persisted, 10, what="the offsets persisted")
            out = await rocketmq.mqadmin("consumerProgress", "-g", group)
            rows = _progress_rows(out)
            lag = consumer.lag()
            diffs = {}
            for mq, ql in lag.items():
                broker_off, _consumer_off, diff = rows[(mq.topic, mq.queue_id)]
                assert ql.lag is not None
                assert abs(ql.lag - diff) <= consumer.options.pull_batch_size, (mq, ql, out)
                assert ql.max_offset == broker_off
                diffs[mq] = diff
            assert len(diffs) == 5  # the topic's 4 queues and the retry topic's one
            exact = sum(1 for mq, ql in lag.items() if ql.lag == diffs[mq])
            topic_lag = sum(ql.lag or 0 for mq, ql in lag.items() if mq.topic == topic)
            assert topic_lag == 40

            got = await _scrape(server.port)
            g = (("group", group), ("topic", topic))
            assert got[("rocketmq_consumer_messages_consumed_total", g)] == 40
            assert got[("rocketmq_consumer_messages_failed_total", g)] == 2
            assert got[("rocketmq_consumer_messages_retried_total", g)] == 1
            assert got[("rocketmq_consumer_messages_dlq_total", g)] == 1
            assert got[("rocketmq_consumer_messages_pulled_total", g)] >= 41
            assert got[("rocketmq_consumer_consume_duration_seconds_count", g)] == 42
            assert got[("rocketmq_consumer_consume_duration_seconds_bucket",
                        (*g[:1], ("le", "+Inf"), *g[1:]))] == 42
            assert got[("rocketmq_consumer_pull_duration_seconds_count", g)] >= 1
            assert got[("rocketmq_consumer_assigned_queues", (("group", group),))] == 5
            assert got[("rocketmq_consumer_healthy", (("group", group),))] == 1
            for mq, ql in consumer.lag().items():
                qlabels = tuple(sorted({"group": group, "topic": mq.topic,
                                        "broker": mq.broker_name,
                                        "queue_id": str(mq.queue_id)}.items()))
                assert got[("rocketmq_consumer_lag_messages", qlabels)] == ql.lag == diffs[mq]
                assert got[("rocketmq_consumer_max_offset", qlabels)] == ql.max_offset
                assert got[("rocketmq_consumer_committed_offset", qlabels)] == ql.committed_offset
                assert got[("rocketmq_consumer_cached_messages", qlabels)] == (
                    consumer.process_queues[mq].msg_count)
    finally:
        await anyio.to_thread.run_sync(server.close)
    assert consumer.lag() == {}
    print(f"\nlag: {len(diffs)} queues against consumerProgress, {exact} exactly equal "
          f"(topic lag {topic_lag}); {time.monotonic() - t0:.1f} s")


async def test_is_healthy_follows_the_brokers(rocketmq: LocalRocketMQ) -> None:
    ns = rocketmq.namesrv_addr
    topic = unique("T_health")
    await rocketmq.create_topic(topic, queues=2)
    broker = await FaultProxy(rocketmq.broker_addr, name="broker").start()
    namesrv = await FaultProxy(ns, name="namesrv",
                               rewrite={rocketmq.broker_addr: broker.addr}).start()
    interval = 2.0
    consumer = PushConsumer(unique("G_health"), namesrv=namesrv.addr,
                            heartbeat_interval=interval, pull_time_delay_when_exception=0.2)

    async def on(msgs: list[MessageExt]) -> ConsumeResult:
        return ConsumeResult.SUCCESS

    consumer.subscribe(topic, listener=on)
    assert not consumer.is_healthy()  # not started
    try:
        async with consumer:
            assert consumer.is_healthy()
            await wait_until(lambda: len(consumer.process_queues) >= 2, 10, what="queues")
            port = broker.port
            await broker.close()  # the only broker is gone: connections closed, connects refused
            lost = time.monotonic()
            await wait_until(lambda: not consumer.is_healthy(), 2 * interval + 1,
                             interval=0.02, what="unhealthy")
            to_unhealthy = time.monotonic() - lost
            for _ in range(int(1.5 * interval / 0.05)):  # stays unhealthy while it is gone
                await asyncio.sleep(0.05)
                assert not consumer.is_healthy()
            broker = await FaultProxy(rocketmq.broker_addr, name="broker").start(port)
            back = time.monotonic()
            await wait_until(consumer.is_healthy, 2 * interval + 1, interval=0.02, what="healthy")
            to_healthy = time.monotonic() - back
        assert not consumer.is_healthy()  # stopped
    finally:
        await broker.close()
        await namesrv.close()
    print(f"\nhealth: unhealthy {to_unhealthy:.2f} s after the broker went away, healthy "
          f"{to_healthy:.2f} s after it came back (heartbeat interval {interval} s)")
    # One heartbeat interval, plus a margin for a loaded CI machine (a second interval would
    # pass it).
    assert to_unhealthy <= interval + 1.0
    assert to_healthy <= interval + 1.0

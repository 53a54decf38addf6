"""The compatibility subset: the push consumer against every supported broker version.

Each scenario is a small version of a full-suite test (hundreds of messages, seconds each) and
runs on every version of ``RMQ_COMPAT_VERSIONS`` (see conftest.py): delivery and commit, retry
and DLQ, tags, orderly, broadcasting, reset offset by time, the Spark source's timestamp
positions, ACL.
"""

from __future__ import annotations

import asyncio
import bisect
import collections
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from rmq_async import (
    ConsumeResult,
    Message,
    MessageExt,
    NoPermissionError,
    Producer,
    PushConsumer,
)
from rmq_async.consumer.options import Credentials
from rmq_async.devbroker import LocalRocketMQ
from rmq_async.protocol.filter import java_string_hash
from rmq_async.protocol.types import MessageQueue
from rmq_async.sources.ranges import EARLIEST, Position, SourceOptions, open_client, resolve_offsets
from tests.compat.conftest import ACL_ACCOUNT
from tests.helpers import TEST_SEND_TIMEOUT, AdminClient, produce, simple_messages, unique, wait_until

pytestmark = pytest.mark.broker

ACL_CREDENTIALS = Credentials(ACL_ACCOUNT.access_key, ACL_ACCOUNT.secret_key)


def _consumer(namesrv: str, group: str, **opts: object) -> PushConsumer:
    opts.setdefault("consume_from_where", "CONSUME_FROM_FIRST_OFFSET")
    opts.setdefault("persist_offset_interval", 0.5)
    return PushConsumer(group, namesrv=namesrv, **opts)  # type: ignore[arg-type]


async def _committed_equals_max(namesrv: str, group: str, topic: str, timeout: float) -> None:
    async with AdminClient(namesrv) as admin:
        maxes = await admin.max_offsets(topic)
        deadline = time.monotonic() + timeout
        while (committed := await admin.committed_offsets(group, topic)) != maxes:
            assert time.monotonic() < deadline, f"committed {committed} != max {maxes}"
            await asyncio.sleep(0.1)


async def test_delivery_and_commit(compat_broker: LocalRocketMQ) -> None:
    ns = compat_broker.namesrv_addr
    topic = unique("T_cmp_basic")
    await compat_broker.create_topic(topic, queues=4)
    placed = await produce(ns, topic, simple_messages(topic, 400, size=64), batch=20)
    assert len(set(placed)) == 400
    group = unique("G_cmp_basic")
    seen: collections.Counter[tuple[int, int]] = collections.Counter()
    consumer = _consumer(ns, group)

    @consumer.subscribe(topic)
    async def on(msgs: list[MessageExt]) -> ConsumeResult:
        for m in msgs:
            seen[(m.queue_id, m.queue_offset)] += 1
        return ConsumeResult.SUCCESS

    async with consumer:
        await wait_until(lambda: len(seen) >= 400, 30, what="400 messages")
        await _committed_equals_max(ns, group, topic, 15)
    assert set(seen) == set(placed)
    assert set(seen.values()) == {1}

    # The group comes back: nothing acknowledged is delivered again, new messages are.
    again: list[MessageExt] = []
    consumer2 = _consumer(ns, group)

    @consumer2.subscribe(topic)
    async def on2(msgs: list[MessageExt]) -> ConsumeResult:
        again.extend(msgs)
        return ConsumeResult.SUCCESS

    async with consumer2:
        await wait_until(lambda: sum(mq.topic == topic for mq in consumer2.process_queues) == 4,
                         30, what="4 queues assigned")
        await produce(ns, topic, simple_messages(topic, 20, prefix="n"), batch=5)
        await wait_until(lambda: len(again) >= 20, 30, what="20 new messages")
        await asyncio.sleep(0.5)
    assert sorted(m.body[:11] for m in again) == sorted(f"n{i:010d}".encode() for i in range(20))


async def test_retry_and_dlq(compat_broker: LocalRocketMQ) -> None:
    ns = compat_broker.namesrv_addr
    topic = unique("T_cmp_retry")
    await compat_broker.create_topic(topic, queues=1)
    group = unique("G_cmp_retry")
    attempts: dict[bytes, list[int]] = collections.defaultdict(list)
    consumer = _consumer(ns, group, max_reconsume_times=2)

    @consumer.subscribe(topic)
    async def on(msgs: list[MessageExt]) -> ConsumeResult:
        for m in msgs:
            attempts[m.body].append(m.reconsume_times)
        m = msgs[0]
        if m.body == b"fail-once" and m.reconsume_times == 0:
            return ConsumeResult.RECONSUME_LATER
        if m.body == b"always-fail":
            raise RuntimeError("this message never succeeds")
        return ConsumeResult.SUCCESS

    async with consumer:
        async with Producer(unique("PG"), ns, send_timeout=TEST_SEND_TIMEOUT) as p:
            for body in (b"always-fail", b"fail-once", b"fine"):
                await p.send(Message(topic, body))
        await wait_until(lambda: len(attempts[b"always-fail"]) >= 3
                         and len(attempts[b"fail-once"]) >= 2, 30, what="the retries")
        await asyncio.sleep(1.5)  # would a fourth try of always-fail come? (delays are 1 s)
    assert attempts[b"always-fail"] == [0, 1, 2]
    assert attempts[b"fail-once"] == [0, 1]
    assert attempts[b"fine"] == [0]

    dlq = MessageQueue(f"%DLQ%{group}", compat_broker.broker_name, 0)
    async with AdminClient(ns) as admin:
        addr = await admin.instance.find_broker_master(compat_broker.broker_name, topic)

        async def dlq_bodies() -> list[bytes]:
            r = await admin.instance.api.pull_message(
                addr, group=unique("G_dlqread"), mq=dlq, queue_offset=0, suspend_timeout=0,
                subscription="*")
            return [m.body for m in r.decode()]

        deadline = time.monotonic() + 15
        while not (found := await dlq_bodies()):
            assert time.monotonic() < deadline, "the message never reached the DLQ"
            await asyncio.sleep(0.2)
    assert found == [b"always-fail"]


async def test_tags(compat_broker: LocalRocketMQ) -> None:
    ns = compat_broker.namesrv_addr
    topic = unique("T_cmp_tags")
    await compat_broker.create_topic(topic, queues=2)
    msgs = [Message(topic, f"{i}".encode(), tags=["a", "b", "c", "ab"][i % 4] if i % 5 else None)
            for i in range(200)]
    await produce(ns, topic, msgs, batch=1, concurrency=16)
    wanted = sorted(m.body for m in msgs if m.tags in ("a", "b"))
    got: list[MessageExt] = []
    consumer = _consumer(ns, unique("G_cmp_tags"))

    @consumer.subscribe(topic, tags="a || b")
    async def on(batch: list[MessageExt]) -> ConsumeResult:
        got.extend(batch)
        return ConsumeResult.SUCCESS

    async with consumer:
        await wait_until(lambda: len(got) >= len(wanted), 30, what="tagged messages")
        await asyncio.sleep(1.0)
    assert sorted(m.body for m in got) == wanted
    assert {m.tags for m in got} == {"a", "b"}


async def test_orderly(compat_broker: LocalRocketMQ) -> None:
    ns = compat_broker.namesrv_addr
    topic = unique("T_cmp_orderly")
    await compat_broker.create_topic(topic, queues=4, order=True)
    keys, per_key = 20, 20
    async with Producer(unique("PG"), ns, send_timeout=TEST_SEND_TIMEOUT) as producer:
        queues = await producer.instance.publish_queues(topic)
        per_queue: dict[MessageQueue, list[Message]] = collections.defaultdict(list)
        for seq in range(per_key):
            for key in range(keys):
                mq = queues[abs(java_string_hash(f"k{key}")) % len(queues)]
                per_queue[mq].append(Message(topic, f"{key}:{seq}".encode(), keys=[f"k{key}"]))

        async def send_queue(mq: MessageQueue, batch: list[Message]) -> None:
            for i in range(0, len(batch), 10):
                await producer.send_batch(batch[i:i + 10], queue=mq)

        await asyncio.gather(*(send_queue(mq, b) for mq, b in per_queue.items()))

    got: dict[int, list[int]] = collections.defaultdict(list)
    running: set[int] = set()
    overlaps: list[int] = []
    retried: set[bytes] = set()
    locked_seen: set[int] = set()
    consumer = _consumer(ns, unique("G_cmp_orderly"), consume_message_batch_max_size=3)

    @consumer.subscribe(topic, orderly=True)
    async def on(msgs: list[MessageExt]) -> ConsumeResult:
        qid = msgs[0].queue_id
        if qid in running:
            overlaps.append(qid)
        running.add(qid)
        try:
            pq = next((q for mq, q in consumer.process_queues.items()
                       if mq.topic == topic and mq.queue_id == qid), None)
            if pq is not None and pq.locked:
                locked_seen.add(qid)
            await asyncio.sleep(0.001)
            # One message per queue is refused once: orderly retries it in place, in order.
            first = msgs[0]
            if first.body.endswith(b":7") and first.body not in retried:
                retried.add(first.body)
                return ConsumeResult.SUSPEND_CURRENT_QUEUE_A_MOMENT
            for m in msgs:
                key, seq = (int(x) for x in m.body.decode().split(":"))
                got[key].append(seq)
            return ConsumeResult.SUCCESS
        finally:
            running.discard(qid)

    async with consumer:
        await wait_until(lambda: sum(map(len, got.values())) >= keys * per_key, 60,
                         what="every ordered message")
    assert overlaps == []
    assert retried, "no message was suspended"
    for key in range(keys):
        assert got[key] == list(range(per_key)), f"key {key}: {got[key]}"
    used = {mq.queue_id for mq in per_queue}
    assert locked_seen == used, "a queue was consumed without its broker lock"


def _counting_listener(
        counter: collections.Counter[bytes]) -> Callable[[list[MessageExt]], ConsumeResult]:
    def listener(msgs: list[MessageExt]) -> ConsumeResult:
        counter.update(m.body[:11] for m in msgs)
        return ConsumeResult.SUCCESS
    return listener


async def test_broadcasting(compat_broker: LocalRocketMQ, tmp_path: Path) -> None:
    ns = compat_broker.namesrv_addr
    topic = unique("T_cmp_bcast")
    await compat_broker.create_topic(topic, queues=4)
    group = unique("G_cmp_bcast")
    seen: dict[str, collections.Counter[bytes]] = {}
    members = []
    for name in ("one", "two"):
        counter: collections.Counter[bytes] = collections.Counter()
        seen[name] = counter
        c = PushConsumer(group, namesrv=ns, message_model="BROADCASTING", instance_name=name,
                         offset_store_dir=tmp_path / name,
                         consume_from_where="CONSUME_FROM_FIRST_OFFSET")

        c.subscribe(topic, listener=_counting_listener(counter))
        members.append(c)
    async with members[0], members[1]:
        for c in members:
            await wait_until(lambda c=c: sum(mq.topic == topic for mq in c.process_queues) == 4,
                             30, what="every queue on each member")
        await produce(ns, topic, simple_messages(topic, 200, size=32), batch=10)
        await wait_until(lambda: all(len(s) >= 200 for s in seen.values()), 30,
                         what="every message on both members")
        await asyncio.sleep(0.5)
    expected = {f"m{i:010d}".encode() for i in range(200)}
    for name, counter in seen.items():
        assert set(counter) == expected, name
        assert set(counter.values()) == {1}, name


async def test_reset_offset_by_time(compat_broker: LocalRocketMQ) -> None:
    ns = compat_broker.namesrv_addr
    topic = unique("T_cmp_reset")
    await compat_broker.create_topic(topic, queues=2)
    group = unique("G_cmp_reset")
    seen: collections.Counter[bytes] = collections.Counter()
    consumer = _consumer(ns, group, broker_suspend_max_time=2.0)

    @consumer.subscribe(topic)
    async def on(msgs: list[MessageExt]) -> ConsumeResult:
        seen.update(m.body[:12] for m in msgs)
        return ConsumeResult.SUCCESS

    async with consumer:
        await produce(ns, topic, simple_messages(topic, 20, size=20, prefix="a_"), batch=5)
        await wait_until(lambda: sum(seen.values()) >= 20, 30, what="batch a")
        # 4.x brokers answer a time between two messages with the offset of the nearer one
        # (5.x: the first at or after it): the stamp sits much nearer to batch b than to a.
        await asyncio.sleep(2.0)
        stamp = int(time.time() * 1000)
        await asyncio.sleep(0.05)
        await produce(ns, topic, simple_messages(topic, 20, size=20, prefix="b_"), batch=5)
        await wait_until(lambda: sum(seen.values()) >= 40, 30, what="batch b")
        await _committed_equals_max(ns, group, topic, 15)
        out = await compat_broker.mqadmin("resetOffsetByTime", "-g", group, "-t", topic,
                                          "-s", str(stamp))
        assert "Exception" not in out, out
        await wait_until(lambda: sum(seen.values()) >= 60, 30,
                         what=f"batch b again after the reset ({out!r})")
        await asyncio.sleep(0.5)
        await _committed_equals_max(ns, group, topic, 15)
    per_batch: dict[bytes, set[int]] = collections.defaultdict(set)
    for body, n in seen.items():
        per_batch[body[:2]].add(n)
    assert dict(per_batch) == {b"a_": {1}, b"b_": {2}}


async def test_a_timestamp_position_is_the_first_message_stored_since(
        compat_broker: LocalRocketMQ) -> None:
    """The Spark source's startingTimestamp / endingTimestamp: the first message stored at or
    after the time, whatever the broker's SEARCH_OFFSET_BY_TIMESTAMP answers (4.x: the nearest
    message)."""
    ns = compat_broker.namesrv_addr
    topic = unique("T_cmp_time")
    await compat_broker.create_topic(topic, queues=1)
    for prefix, batch in (("a_", 1), ("b_", 20), ("c_", 1)):
        # a: one message per send; b: one batch, which the broker stores in one millisecond
        await produce(ns, topic, simple_messages(topic, 20, size=20, prefix=prefix),
                      batch=batch, concurrency=1)
        await asyncio.sleep(0.2)
    opts = SourceOptions.parse({"namesrv": ns, "topics": topic}, streaming=False)
    client = open_client(opts, "test")
    try:
        async with AdminClient(ns) as admin:
            stored = sorted(await admin.read_all(topic), key=lambda m: m.queue_offset)
            (mq,) = await admin.queues(topic)
        assert [m.queue_offset for m in stored] == list(range(60))
        times = [m.store_timestamp for m in stored]
        addr = await client.find_broker_master(mq.broker_name, topic)
        cases = {"inside the batch": times[30], "just after a": times[19] + 1,
                 "just before c": times[40] - 1, "the first c": times[40],
                 "before all": times[0] - 1000, "after all": times[-1] + 1000}
        answers = {}
        for name, stamp in cases.items():
            expected = bisect.bisect_left(times, stamp)
            answers[name] = await client.api.search_offset(addr, mq, stamp)
            got = await resolve_offsets(client, Position("timestamp", timestamp_ms=stamp),
                                        {mq: (0, 60)}, default=EARLIEST, group=unique("G_time"))
            assert got == {mq: expected}, (name, stamp, answers[name], times)
    finally:
        await client.close()
    if compat_broker.version.startswith("4."):
        # What the correction is for: a 4.x broker answers the nearest message.
        assert answers["just after a"] == 19 and answers["after all"] == 59, answers


async def _signed_produce(rmq: LocalRocketMQ, topic: str, n: int) -> None:
    async with Producer(unique("PG_acl"), rmq.namesrv_addr, send_timeout=TEST_SEND_TIMEOUT) as producer:
        producer.instance.remoting.rpc_hook = ACL_CREDENTIALS.rpc_hook()
        msgs = simple_messages(topic, n)
        for i in range(0, n, 20):
            await producer.send_batch(msgs[i:i + 20])


async def test_acl(compat_acl_broker: LocalRocketMQ) -> None:
    rmq = compat_acl_broker
    topic = unique("T_cmp_acl")
    await rmq.create_topic(topic, queues=2)
    await _signed_produce(rmq, topic, 100)

    # Right keys: everything arrives and is committed (heartbeat, pull, offsets all signed).
    seen: set[tuple[int, int]] = set()
    group = unique("G_cmp_acl")
    consumer = _consumer(rmq.namesrv_addr, group,
                         credentials=ACL_CREDENTIALS)

    @consumer.subscribe(topic)
    async def on(msgs: list[MessageExt]) -> ConsumeResult:
        seen.update((m.queue_id, m.queue_offset) for m in msgs)
        return ConsumeResult.SUCCESS

    async with consumer:
        await wait_until(lambda: len(seen) == 100, 30, what="100 messages under ACL")
    committed = sum(v for v in (await _committed(rmq, group, topic)).values())
    assert committed == 100

    # Wrong secret, unknown user, no credentials: start() fails with a typed error.
    for creds in ((ACL_ACCOUNT.access_key, "wrong-secret-1"), ("mallory", "mallory-secret"),
                  None):
        denied = PushConsumer(unique("G_cmp_denied"), namesrv=rmq.namesrv_addr,
                              credentials=creds)
        denied.subscribe(topic, listener=lambda msgs: ConsumeResult.SUCCESS)
        started = time.monotonic()
        with pytest.raises(NoPermissionError) as info:
            await denied.start()
        assert time.monotonic() - started < 10
        assert denied.group in str(info.value), str(info.value)
        assert denied.running_tasks() == 0


async def _committed(rmq: LocalRocketMQ, group: str, topic: str) -> dict[MessageQueue, int]:
    """Committed offsets read with the account's signature (the broker checks every request)."""
    async with AdminClient(rmq.namesrv_addr) as admin:
        admin.instance.remoting.rpc_hook = ACL_CREDENTIALS.rpc_hook()
        return await admin.committed_offsets(group, topic)

"""Orderly consumption against the real broker: per-key order, lock exclusivity, local retry, DLQ."""

from __future__ import annotations

import asyncio
import collections
import itertools
import sys
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from rmq_async import ConsumeContext, ConsumeResult, Message, MessageExt, Producer, PushConsumer
from rmq_async.client.errors import MQClientError
from rmq_async.consumer.admin import build_running_info
from rmq_async.devbroker import LocalRocketMQ
from rmq_async.protocol.filter import java_string_hash
from rmq_async.protocol.types import MessageQueue
from tests.helpers import AdminClient, unique, wait_until, wait_until_async

pytestmark = pytest.mark.broker

REPO = Path(__file__).resolve().parents[2]

KEYS = 200
PER_KEY = 100
TOTAL = KEYS * PER_KEY


def by_key_hash(queues: list[MessageQueue], msg: Message) -> MessageQueue:
    """Queue selector: every message of one ordering key goes to the same queue."""
    key = msg.keys if isinstance(msg.keys, str) else (msg.keys or [""])[0]
    return queues[abs(java_string_hash(key)) % len(queues)]


def _body(key: int, seq: int) -> bytes:
    return f"k{key:03d}:{seq:05d}".encode()


def _parse(body: bytes) -> tuple[int, int]:
    key, seq = body.decode().split(":")
    return int(key[1:]), int(seq)


@dataclass
class Recorder:
    """What the orderly listeners of all clients saw, in the order they saw it."""

    deliveries: dict[int, list[tuple[int, str]]] = field(
        default_factory=lambda: collections.defaultdict(list))
    # queue id -> [(start, end, client id)] of every listener call
    intervals: dict[int, list[tuple[float, float, str]]] = field(
        default_factory=lambda: collections.defaultdict(list))
    running: dict[int, str] = field(default_factory=dict)
    overlaps: list[str] = field(default_factory=list)
    count: int = 0

    def listener(self, client: str) -> Callable[[list[MessageExt]], Awaitable[ConsumeResult]]:
        async def on(msgs: list[MessageExt]) -> ConsumeResult:
            qid = msgs[0].queue_id
            other = self.running.get(qid)
            if other is not None:
                self.overlaps.append(f"queue {qid}: {client} started while {other} consumed")
            self.running[qid] = client
            started = time.monotonic()
            try:
                for m in msgs:
                    key, seq = _parse(m.body)
                    self.deliveries[key].append((seq, client))
                    self.count += 1
                await asyncio.sleep(0.001)  # a listener call that takes time
            finally:
                del self.running[qid]
                self.intervals[qid].append((started, time.monotonic(), client))
            return ConsumeResult.SUCCESS
        return on


def _orderly_consumer(namesrv: str, group: str, topic: str, rec: Recorder, name: str,
                      **opts: object) -> PushConsumer:
    c = PushConsumer(group, namesrv=namesrv, instance_name=name,
                     consume_from_where="CONSUME_FROM_FIRST_OFFSET",
                     persist_offset_interval=1.0, consume_message_batch_max_size=4,
                     **opts)
    c.subscribe(topic, listener=rec.listener(c.client_id), orderly=True)
    return c


async def _produce_ordered(namesrv: str, topic: str, *, batch: int = 100,
                           pause: float = 0.0) -> dict[int, int]:
    """Send KEYS x PER_KEY messages; each key's messages in order to the queue of its hash.

    Every queue gets its own sender that sends its messages as batches, one after the other
    (a batch keeps its order in the queue). Returns the queue id of every key.
    """
    async with Producer(unique("PG_orderly"), namesrv) as producer:
        queues = await producer.instance.publish_queues(topic)
        per_queue: dict[MessageQueue, list[Message]] = collections.defaultdict(list)
        key_queue: dict[int, int] = {}
        for seq in range(PER_KEY):
            for key in range(KEYS):
                msg = Message(topic, _body(key, seq), keys=[f"order-{key}"], tags="o")
                mq = by_key_hash(queues, msg)
                key_queue[key] = mq.queue_id
                per_queue[mq].append(msg)

        async def send_queue(mq: MessageQueue, msgs: list[Message]) -> None:
            for i in range(0, len(msgs), batch):
                await producer.send_batch(msgs[i:i + batch], queue=mq)
                if pause:
                    await asyncio.sleep(pause)

        await asyncio.gather(*(send_queue(mq, msgs) for mq, msgs in per_queue.items()))
    return key_queue


def _check_order(rec: Recorder) -> tuple[int, int]:
    """Per key: consecutive sequence numbers, a step back only when the queue changed hands,
    and every message seen. Returns (duplicates, rewinds)."""
    duplicates = 0
    rewinds = 0
    for key in range(KEYS):
        got = rec.deliveries[key]
        assert got, f"key {key}: nothing delivered"
        assert got[0][0] == 0, f"key {key} starts at {got[0][0]}"
        for (prev, prev_client), (seq, client) in itertools.pairwise(got):
            if seq == prev + 1:
                continue
            assert seq <= prev, f"key {key}: gap {prev} -> {seq} (client {client})"
            assert client != prev_client, (
                f"key {key}: {client} went back from {prev} to {seq} without a handover")
            rewinds += 1
        seqs = [s for s, _ in got]
        assert set(seqs) == set(range(PER_KEY)), f"key {key}: missing messages"
        duplicates += len(seqs) - PER_KEY
    return duplicates, rewinds


def _check_exclusive(rec: Recorder) -> None:
    assert rec.overlaps == [], rec.overlaps[:5]
    for qid, spans in rec.intervals.items():
        spans = sorted(spans)
        for (s1, e1, c1), (s2, e2, c2) in itertools.pairwise(spans):
            if c1 != c2:
                assert s2 >= e1, f"queue {qid}: {c1} [{s1}, {e1}] overlaps {c2} [{s2}, {e2}]"


async def test_order_per_key_across_stop_and_join(rocketmq: LocalRocketMQ) -> None:
    topic = unique("T_orderly")
    await rocketmq.create_topic(topic, queues=8, order=True)
    group = unique("G_orderly")
    rec = Recorder()
    ns = rocketmq.namesrv_addr
    a = _orderly_consumer(ns, group, topic, rec, "ordA")
    b = _orderly_consumer(ns, group, topic, rec, "ordB")
    c = _orderly_consumer(ns, group, topic, rec, "ordC")
    started: list[PushConsumer] = []
    try:
        for consumer in (a, b):
            await consumer.start()
            started.append(consumer)

        def split(*cs: PushConsumer) -> bool:
            held = [{mq for mq, pq in x.process_queues.items()
                     if mq.topic == topic and pq.locked} for x in cs]
            return all(held) and sum(map(len, held)) == 8 and len(set().union(*held)) == 8

        await wait_until(lambda: split(a, b), 30, what="8 queues locked by two consumers")
        producing = asyncio.create_task(_produce_ordered(ns, topic, batch=50, pause=0.15))
        await wait_until(lambda: rec.count >= TOTAL // 4, 60, what="a quarter consumed")
        await a.stop()  # a hands its queues to b
        await wait_until(lambda: rec.count >= TOTAL // 2, 60, what="half consumed")
        await c.start()  # c takes half of the queues from b
        started.append(c)
        key_queue = await producing
        await wait_until(lambda: all(len({s for s, _ in rec.deliveries[k]}) == PER_KEY
                                     for k in range(KEYS)), 90, what="all 20,000 messages")
        await wait_until(lambda: split(b, c), 30, what="8 queues locked by b and c")
    finally:
        for consumer in started:
            await consumer.stop()

    duplicates, rewinds = _check_order(rec)
    _check_exclusive(rec)
    owners = collections.defaultdict(set)
    for qid, spans in rec.intervals.items():
        owners[qid] = {cl for _, _, cl in spans}
    print(f"\norderly: {TOTAL} messages, {KEYS} keys, {rec.count} deliveries, "
          f"{duplicates} duplicates, {rewinds} handover rewinds, "
          f"queues with more than one consumer: "
          f"{sorted(q for q, o in owners.items() if len(o) > 1)}")
    assert len(set(key_queue.values())) == 8
    # Every key was consumed from its own queue only.
    assert any(len(o) > 1 for o in owners.values()), "no queue changed hands"
    async with AdminClient(ns) as admin:
        committed = await admin.committed_offsets(group, topic)
        maxes = await admin.max_offsets(topic)
    assert committed == maxes


async def test_suspend_retries_in_place_then_dlq(rocketmq: LocalRocketMQ) -> None:
    topic = unique("T_ord_retry")
    await rocketmq.create_topic(topic, queues=1, order=True)
    group = unique("G_ord_retry")
    ns = rocketmq.namesrv_addr
    calls: list[tuple[int, int, float]] = []  # (message number, reconsume times, when)
    suspend_ms = 300

    consumer = PushConsumer(group, namesrv=ns, consume_from_where="CONSUME_FROM_FIRST_OFFSET",
                            suspend_current_queue_time=suspend_ms / 1000, max_reconsume_times=3,
                            persist_offset_interval=1.0)

    @consumer.subscribe(topic, orderly=True)
    async def on(msgs: list[MessageExt]) -> ConsumeResult:
        assert len(msgs) == 1
        n = int(msgs[0].body)
        calls.append((n, msgs[0].reconsume_times, time.monotonic()))
        if n == 3 and msgs[0].reconsume_times < 2:
            return ConsumeResult.SUSPEND_CURRENT_QUEUE_A_MOMENT
        if n == 6:
            raise RuntimeError("message 6 always fails")
        return ConsumeResult.SUCCESS

    async with Producer(unique("PG_ord_retry"), ns) as producer:
        mq = (await producer.instance.publish_queues(topic))[0]
        await producer.send_batch([Message(topic, str(i).encode()) for i in range(10)], queue=mq)
    async with consumer:
        await wait_until(lambda: any(n == 9 for n, _, _ in calls), 30, what="message 9")
        # Running info as the admin tools see it: an orderly consumer, every queue locked
        # (its retry queue included). The broker creates the retry topic on the first
        # heartbeat; when its route reached the name server only after the first rebalance
        # round, the next round takes it, and messages 0..9 may all be through before that.
        await wait_until(lambda: any(mq.topic == consumer.retry_topic
                                     for mq in consumer.process_queues), 30,
                         what="the retry queue taken")
        info = build_running_info(consumer)
        assert info.properties["PROP_CONSUMEORDERLY"] == "true"
        assert {mq.topic for mq in info.mq_table} == {topic, consumer.retry_topic}
        assert all(pq.locked for pq in info.mq_table.values())
    order = [n for n, _, _ in calls]
    # 3 is suspended twice and retried in place; nothing after it runs meanwhile.
    assert order[:6] == [0, 1, 2, 3, 3, 3], order
    assert [r for n, r, _ in calls if n == 3] == [0, 1, 2]
    t3 = [t for n, _, t in calls if n == 3]
    assert all(b - a >= suspend_ms / 1000 * 0.9 for a, b in itertools.pairwise(t3))
    # 6 fails every time: tried 1 + max_reconsume_times times, then sent to the DLQ, skipped.
    assert order[6:] == [4, 5, 6, 6, 6, 6, 7, 8, 9], order
    dlq: list[MessageExt] = []
    async with AdminClient(ns) as admin:

        async def dead_lettered() -> bool:
            try:
                dlq[:] = await admin.read_all(f"%DLQ%{group}")
            except MQClientError:  # the topic's route not yet at the name server
                return False
            return bool(dlq)

        await wait_until_async(dead_lettered, 30, what="the DLQ copy")
        committed = await admin.committed_offsets(group, topic)
    assert [m.body for m in dlq] == [b"6"]
    assert list(committed.values()) == [10]


async def test_without_auto_commit_the_broker_keeps_the_last_commit(
        rocketmq: LocalRocketMQ) -> None:
    """``ctx.auto_commit = False``: the offset the broker stores moves only on COMMIT; what was
    acknowledged with SUCCESS after it is consumed again by the group's next consumer."""
    topic = unique("T_ord_nocommit")
    await rocketmq.create_topic(topic, queues=1, order=True)
    group = unique("G_ord_nocommit")
    ns = rocketmq.namesrv_addr
    seen: list[list[int]] = [[], []]

    def consumer_for(run: int) -> PushConsumer:
        consumer = PushConsumer(group, namesrv=ns, persist_offset_interval=1.0,
                                consume_from_where="CONSUME_FROM_FIRST_OFFSET")

        @consumer.subscribe(topic, orderly=True)
        async def on(msg: MessageExt, ctx: ConsumeContext) -> ConsumeResult:
            ctx.auto_commit = False
            seen[run].append(int(msg.body))
            return ConsumeResult.COMMIT if int(msg.body) == 4 else ConsumeResult.SUCCESS

        return consumer

    async with Producer(unique("PG_ord_nocommit"), ns) as producer:
        mq = (await producer.instance.publish_queues(topic))[0]
        await producer.send_batch([Message(topic, str(i).encode()) for i in range(10)], queue=mq)
    for run in (0, 1):
        async with consumer_for(run):
            await wait_until(lambda got=seen[run]: got[-1:] == [9], 30, what="message 9")
        async with AdminClient(ns) as admin:
            committed = await admin.committed_offsets(group, topic)
        assert list(committed.values()) == [5], committed
    assert seen == [list(range(10)), list(range(5, 10))]


async def test_orderly_example_runs(rocketmq: LocalRocketMQ) -> None:
    repo = REPO
    topic = unique("T_ord_example")
    await rocketmq.create_topic(topic, queues=4, order=True)
    proc = await asyncio.create_subprocess_exec(
        sys.executable, str(repo / "examples" / "orderly.py"), "--namesrv", rocketmq.namesrv_addr,
        "--topic", topic, "--group", unique("G_ord_example"), "--orders", "12", "--seconds", "60",
        cwd=repo, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT)
    out, _ = await asyncio.wait_for(proc.communicate(), 90)
    text = out.decode()
    assert proc.returncode == 0, text[-3000:]
    assert "12 of 12 orders went through all steps in order" in text
    assert "suspending the queue" in text

"""Push consumer against the real broker: delivery, commits, group split, rebalance, shutdown."""

from __future__ import annotations

import asyncio
import collections
import time

import pytest

from rmq_async import ConsumeResult, MessageExt, PushConsumer
from tests.helpers import AdminClient, produce, simple_messages, unique, wait_until

pytestmark = pytest.mark.broker


def _consumer(namesrv: str, group: str, **opts: object) -> PushConsumer:
    opts.setdefault("consume_from_where", "CONSUME_FROM_FIRST_OFFSET")
    opts.setdefault("persist_offset_interval", 1.0)
    return PushConsumer(group, namesrv=namesrv, **opts)  # type: ignore[arg-type]


async def test_basic_delivery_commit_and_restart(rocketmq) -> None:
    topic = unique("T_basic")
    await rocketmq.create_topic(topic, queues=8)
    placed = await produce(rocketmq.namesrv_addr, topic, simple_messages(topic, 20_000, size=64))
    assert len(set(placed)) == 20_000
    group = unique("G_basic")
    seen: collections.Counter[tuple[int, int]] = collections.Counter()
    consumer = _consumer(rocketmq.namesrv_addr, group)

    @consumer.subscribe(topic)
    async def on_msgs(msgs: list[MessageExt]) -> ConsumeResult:
        for m in msgs:
            seen[(m.queue_id, m.queue_offset)] += 1
        return ConsumeResult.SUCCESS

    async with consumer:
        await wait_until(lambda: len(seen) >= 20_000, 120, what="all 20,000 messages")
    assert set(seen) == set(placed)

    async with AdminClient(rocketmq.namesrv_addr) as admin:
        committed = await admin.committed_offsets(group, topic)
        maxes = await admin.max_offsets(topic)
    assert committed == maxes, (committed, maxes)

    # A second run of the same group gets nothing that was acknowledged.
    again: list[MessageExt] = []
    consumer2 = _consumer(rocketmq.namesrv_addr, group)
    consumer2.subscribe(topic, listener=lambda msgs: again.extend(msgs), batch=True)
    assert not consumer2.is_running and consumer2.assignment() == frozenset()
    async with consumer2:
        assert consumer2.is_running
        # A plain handler runs on the consumer's own threads (consume_concurrency of them).
        handler = consumer2.subscriptions.topics[topic].listener
        assert handler is not None and handler.limiter is not None
        assert handler.limiter.total_tokens == consumer2.options.consume_concurrency
        await wait_until(lambda: sum(mq.topic == topic for mq in consumer2.assignment()) == 8, 30,
                         what="8 queues assigned")
        assert consumer2.assignment() >= {mq for mq in consumer2.process_queues if mq.topic == topic}
        await asyncio.sleep(3.0)
    assert not consumer2.is_running and consumer2.assignment() == frozenset()
    assert again == []


async def test_group_split_three_consumers(rocketmq) -> None:
    topic = unique("T_split")
    await rocketmq.create_topic(topic, queues=8)
    group = unique("G_split")
    received: dict[str, collections.Counter[tuple[int, int]]] = {}
    consumers = []
    for i in range(3):
        c = _consumer(rocketmq.namesrv_addr, group, instance_name=f"split{i}")
        bucket: collections.Counter[tuple[int, int]] = collections.Counter()
        received[c.client_id] = bucket

        def make(b: collections.Counter[tuple[int, int]]):
            async def on(msgs: list[MessageExt]) -> ConsumeResult:
                for m in msgs:
                    b[(m.queue_id, m.queue_offset)] += 1
                return ConsumeResult.SUCCESS
            return on

        c.subscribe(topic, listener=make(bucket))
        consumers.append(c)
    assert len({c.client_id for c in consumers}) == 3
    for c in consumers:
        await c.start()
    try:
        def split_done() -> bool:
            owned = [{mq for mq in c.process_queues if mq.topic == topic} for c in consumers]
            return all(owned) and sum(len(o) for o in owned) == 8 and len(set().union(*owned)) == 8

        await wait_until(split_done, 60, what="8 queues split among 3 consumers")
        owned = [{mq.queue_id for mq in c.process_queues if mq.topic == topic} for c in consumers]
        assert sorted(len(o) for o in owned) == [2, 3, 3]
        placed = await produce(rocketmq.namesrv_addr, topic, simple_messages(topic, 8000, size=32))
        await wait_until(lambda: sum(len(b) for b in received.values()) >= 8000, 60,
                         what="8000 messages")
        union: set[tuple[int, int]] = set()
        for c, o in zip(consumers, owned, strict=True):
            got = received[c.client_id]
            assert {q for q, _ in got} <= o, "a consumer got messages of a queue it does not own"
            union |= set(got)
        assert union == set(placed)
    finally:
        for c in consumers:
            await c.stop()


async def test_rebalance_join_and_leave_loses_nothing(rocketmq) -> None:
    topic = unique("T_rebal")
    await rocketmq.create_topic(topic, queues=8)
    group = unique("G_rebal")
    total = 50_000
    seen: collections.Counter[tuple[int, int]] = collections.Counter()
    owners: dict[tuple[int, int], set[str]] = collections.defaultdict(set)

    def make_consumer(i: int) -> PushConsumer:
        c = _consumer(rocketmq.namesrv_addr, group, instance_name=f"rebal{i}",
                      rebalance_interval=2.0)

        async def on(msgs: list[MessageExt]) -> ConsumeResult:
            for m in msgs:
                seen[(m.queue_id, m.queue_offset)] += 1
                owners[(m.queue_id, m.queue_offset)].add(c.client_id)
            return ConsumeResult.SUCCESS

        c.subscribe(topic, listener=on)
        return c

    consumers = [make_consumer(i) for i in range(3)]
    for c in consumers:
        await c.start()
    queue_owners: dict[int, set[str]] = collections.defaultdict(set)

    async def track_ownership() -> None:
        while True:
            for c in consumers:
                for mq in list(c.process_queues):
                    queue_owners[mq.queue_id].add(c.client_id)
            await asyncio.sleep(0.05)

    tracker = asyncio.create_task(track_ownership())
    placed: list[tuple[int, int]] = []
    try:
        msgs = simple_messages(topic, total, size=64)
        third = total // 3
        placed += await produce(rocketmq.namesrv_addr, topic, msgs[:third])
        joiner = make_consumer(3)
        consumers.append(joiner)
        await joiner.start()
        placed += await produce(rocketmq.namesrv_addr, topic, msgs[third:2 * third])
        leaver = consumers[0]
        await leaver.stop()
        placed += await produce(rocketmq.namesrv_addr, topic, msgs[2 * third:])
        await wait_until(lambda: set(placed) <= set(seen), 180, what="all 50,000 messages")
    finally:
        tracker.cancel()
        await asyncio.gather(tracker, return_exceptions=True)
        for c in consumers:
            await c.stop()
    assert set(seen) == set(placed), "lost or unexpected messages"
    duplicates = {k: n for k, n in seen.items() if n > 1}
    moved_queues = {q for q, who in queue_owners.items() if len(who) > 1}
    print(f"\nrebalance test: {total} messages, {len(duplicates)} delivered more than once, "
          f"queues that changed owner: {sorted(moved_queues)}")
    # Duplicates may only come from a queue handed from one consumer to another.
    assert {q for q, _ in duplicates} <= moved_queues


async def test_stop_under_load_commits_exactly_what_was_acked(rocketmq) -> None:
    topic = unique("T_stop")
    await rocketmq.create_topic(topic, queues=8)
    await produce(rocketmq.namesrv_addr, topic, simple_messages(topic, 30_000, size=64))
    group = unique("G_stop")
    acked: dict[int, set[int]] = collections.defaultdict(set)
    consumer = _consumer(rocketmq.namesrv_addr, group, consume_concurrency=8)

    @consumer.subscribe(topic)
    async def on(msgs: list[MessageExt]) -> ConsumeResult:
        await asyncio.sleep(0.001)
        for m in msgs:
            acked[m.queue_id].add(m.queue_offset)
        return ConsumeResult.SUCCESS

    before = set(asyncio.all_tasks())
    await consumer.start()
    await wait_until(lambda: sum(len(v) for v in acked.values()) > 3000, 60, what="consumption")
    started = time.monotonic()
    await consumer.stop(timeout=10.0)
    assert time.monotonic() - started < 15.0
    leftover = [t for t in asyncio.all_tasks() - before if not t.done()
                and t is not asyncio.current_task()]
    assert leftover == [], f"tasks left running after stop(): {leftover}"
    async with AdminClient(rocketmq.namesrv_addr) as admin:
        committed = await admin.committed_offsets(group, topic)
    for mq, off in committed.items():
        offs = acked.get(mq.queue_id, set())
        # The committed offset is the first offset not acknowledged: everything below it was
        # acknowledged, and it itself was not.
        expected = 0
        while expected in offs:
            expected += 1
        assert off in (expected, -1 if expected == 0 else expected), (mq, off, expected)

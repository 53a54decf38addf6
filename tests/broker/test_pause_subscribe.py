"""Pause/resume, subscription changes after start, and the consumer's statistics."""

from __future__ import annotations

import asyncio
import collections
import time

import pytest

from rmq_async import ConsumeResult, Message, MessageExt, PushConsumer
from rmq_async.consumer.admin import build_running_info
from rmq_async.devbroker import LocalRocketMQ
from tests.helpers import (
    AdminClient,
    produce,
    simple_messages,
    unique,
    wait_until,
    wait_until_async,
)

pytestmark = pytest.mark.broker


def _queues(consumer: PushConsumer, topic: str) -> int:
    return sum(1 for mq in consumer.process_queues if mq.topic == topic)


async def test_paused_topic_gets_nothing_until_resumed(rocketmq: LocalRocketMQ) -> None:
    ns = rocketmq.namesrv_addr
    paused, other = unique("T_paused"), unique("T_running")
    await rocketmq.create_topic(paused, queues=4)
    await rocketmq.create_topic(other, queues=4)
    got: dict[str, collections.Counter[tuple[int, int]]] = {
        paused: collections.Counter(), other: collections.Counter()}
    # Rebalance rounds every half second and a pull idle limit of three seconds, shorter than
    # the pause: a paused queue is held back, not idle (its pull loop looks again every
    # pull_time_delay_when_suspend, 1 s, and counts as pulling), so the rounds during the
    # pause must keep it (not drop and retake it). (At a limit of one second, the loop's own
    # period, a wake-up a little late on a loaded machine read as idle.)
    consumer = PushConsumer(unique("G_pause"), namesrv=ns,
                            consume_from_where="CONSUME_FROM_FIRST_OFFSET",
                            rebalance_interval=0.5, pull_max_idle_time=3.0)

    async def on(msgs: list[MessageExt]) -> ConsumeResult:
        for m in msgs:
            got[m.topic][(m.queue_id, m.queue_offset)] += 1
        return ConsumeResult.SUCCESS

    consumer.subscribe(paused, listener=on)
    consumer.subscribe(other, listener=on)
    async with consumer:
        await produce(ns, paused, simple_messages(paused, 100), batch=10)
        await wait_until(lambda: len(got[paused]) == 100, 30, what="first 100")
        # Every queue of the paused topic now waits in a long poll that the next message
        # would answer: pausing must give those up.
        consumer.pause(paused)
        assert consumer.is_paused(paused) and not consumer.is_paused(other)
        held = {mq: pq for mq, pq in consumer.process_queues.items() if mq.topic == paused}
        sent_paused = await produce(ns, paused, simple_messages(paused, 500), batch=10)
        sent_other = await produce(ns, other, simple_messages(other, 500), batch=10)
        await wait_until(lambda: len(got[other]) == 500, 30, what="the running topic")
        # Longer than the pause check interval (still nothing), and the pause as a whole
        # longer than the idle limit plus a rebalance round (a paused queue taken for idle
        # would have been dropped by now).
        await asyncio.sleep(3.6)
        assert len(got[paused]) == 100, "a paused topic received messages"
        assert _queues(consumer, paused) == 4  # paused, not given up
        assert all(consumer.process_queues.get(mq) is pq and not pq.dropped
                   for mq, pq in held.items()), "a paused queue was dropped as pull-expired"
        resumed = time.monotonic()
        consumer.resume(paused)
        await wait_until(lambda: len(got[paused]) == 600, 30, what="everything after resume")
        latency = time.monotonic() - resumed
    assert set(sent_paused) <= set(got[paused]) and set(sent_other) == set(got[other])
    assert set(got[paused].values()) == {1}
    print(f"\npause: 500 messages held while paused, delivered {latency:.2f} s after resume")
    assert latency < 5.0


async def test_a_plain_handler_pauses_and_resumes_from_its_worker_thread(
        rocketmq: LocalRocketMQ) -> None:
    """A plain (``def``) handler runs in a worker thread and pauses its topic there, as Java
    listeners call suspend(): the call reaches the consumer's loop, the message is
    acknowledged (no error reached the handler), and every queue keeps its pull task."""
    ns = rocketmq.namesrv_addr
    topic = unique("T_thread_pause")
    await rocketmq.create_topic(topic, queues=4)
    got: collections.Counter[tuple[int, int]] = collections.Counter()
    errors: list[BaseException] = []
    consumer = PushConsumer(unique("G_thread_pause"), namesrv=ns,
                            consume_from_where="CONSUME_FROM_FIRST_OFFSET")

    def on(msg: MessageExt) -> None:  # runs in a worker thread
        got[(msg.queue_id, msg.queue_offset)] += 1
        if msg.body == b"pause":
            try:
                consumer.pause(topic)
            except BaseException as exc:
                errors.append(exc)
                raise

    consumer.subscribe(topic, listener=on)
    async with consumer:
        await produce(ns, topic, simple_messages(topic, 40), batch=10)
        await wait_until(lambda: len(got) == 40, 30, what="the first 40")
        await produce(ns, topic, [Message(topic, b"pause")])
        await wait_until(lambda: consumer.is_paused(topic), 30, what="the pause")
        await asyncio.sleep(0.5)
        assert errors == []
        queues = [mq for mq in consumer.process_queues if mq.topic == topic]
        assert len(queues) == 4 and all(consumer.pull_service.is_pulling(mq) for mq in queues)
        await produce(ns, topic, simple_messages(topic, 60), batch=10)
        await asyncio.sleep(2.0)
        assert len(got) == 41, "a paused topic received messages"
        await asyncio.to_thread(consumer.resume, topic)  # from another thread as well
        await wait_until(lambda: len(got) == 101, 30, what="everything after resume")
    assert set(got.values()) == {1}, "a message came twice (the pausing call failed?)"


async def test_subscribe_and_unsubscribe_after_start_with_stats(rocketmq: LocalRocketMQ) -> None:
    ns = rocketmq.namesrv_addr
    first, later = unique("T_first"), unique("T_later")
    await rocketmq.create_topic(first, queues=2)
    await rocketmq.create_topic(later, queues=4)
    seen: collections.Counter[str] = collections.Counter()
    failed_once: set[bytes] = set()
    # Rebalance every 60 s: only the immediate rebalance of (un)subscribe can be this quick.
    consumer = PushConsumer(unique("G_resub"), namesrv=ns, rebalance_interval=60.0,
                            consume_from_where="CONSUME_FROM_FIRST_OFFSET")
    consumer.subscribe(first, listener=lambda msgs: ConsumeResult.SUCCESS)

    async def on_later(msgs: list[MessageExt]) -> ConsumeResult:
        for m in msgs:
            # Five messages fail on their first delivery (retried through %RETRY%).
            if int(m.body[1:11]) < 5 and m.body not in failed_once:
                failed_once.add(m.body)
                return ConsumeResult.RECONSUME_LATER
            seen[m.topic] += 1
        return ConsumeResult.SUCCESS

    async with consumer:
        await wait_until(lambda: _queues(consumer, first) == 2, 20, what="first topic")
        started = time.monotonic()
        consumer.subscribe(later, listener=on_later)
        await wait_until(lambda: _queues(consumer, later) == 4, 10, what="queues of a new topic")
        took = time.monotonic() - started
        await produce(ns, later, simple_messages(later, 200, size=32), batch=10)
        await wait_until(lambda: seen[later] == 200, 30, what="200 messages of the new topic")
        assert len(failed_once) == 5

        stats = consumer.stats_snapshot()
        assert set(stats) == {first, later, consumer.retry_topic}
        s = stats[later]
        assert s["consumeFailedMsgs"] == 5
        assert s["pullTPS"] > 0 and s["consumeOKTPS"] > 0 and s["pullRT"] >= 0
        assert stats[first]["consumeOKTPS"] == 0
        info = build_running_info(consumer)
        assert info.status_table[later].consume_failed_msgs == 5

        consumer.unsubscribe(later)
        await wait_until(lambda: _queues(consumer, later) == 0, 10, what="queues given up")
        await produce(ns, later, simple_messages(later, 50, prefix="x"), batch=10)
        await asyncio.sleep(1.5)
        assert seen[later] == 200, "an unsubscribed topic still delivered"
        assert later not in consumer.stats_snapshot()
    print(f"\nsubscribe after start: queues assigned {took:.2f} s after subscribe()")


async def test_orderly_subscription_after_start_locks_and_unsubscribe_unlocks(
        rocketmq: LocalRocketMQ) -> None:
    ns = rocketmq.namesrv_addr
    first, ordered = unique("T_first"), unique("T_ord_late")
    await rocketmq.create_topic(first, queues=1)
    await rocketmq.create_topic(ordered, queues=2)
    group = unique("G_ord_late")
    got: list[int] = []
    consumer = PushConsumer(group, namesrv=ns, rebalance_interval=60.0,
                            consume_from_where="CONSUME_FROM_FIRST_OFFSET")
    consumer.subscribe(first, listener=lambda msgs: ConsumeResult.SUCCESS)
    async with consumer:
        await wait_until(lambda: _queues(consumer, first) == 1, 20, what="first topic")

        async def on(msgs: list[MessageExt]) -> ConsumeResult:
            got.extend(int(m.body[1:11]) for m in msgs)
            return ConsumeResult.SUCCESS

        consumer.subscribe(ordered, listener=on, orderly=True)
        await wait_until(lambda: sum(pq.locked for mq, pq in consumer.process_queues.items()
                                     if mq.topic == ordered) == 2, 10, what="2 locked queues")
        await produce(ns, ordered, simple_messages(ordered, 100), batch=25)
        await wait_until(lambda: len(got) == 100, 30, what="100 messages")
        consumer.unsubscribe(ordered)
        await wait_until(lambda: _queues(consumer, ordered) == 0, 10, what="queues given up")
        # The broker locks were given back (the last unlock may still be on its way): another
        # client of the group gets them within seconds, not after the broker's 60 s expiry.
        async with AdminClient(ns) as admin:
            mqs = await admin.queues(ordered)
            addr = await admin.instance.find_broker_master(mqs[0].broker_name, ordered)

            async def all_locked() -> bool:
                locked = await admin.instance.api.lock_batch_mq(addr, group, "another-client", mqs)
                return locked == set(mqs)

            await wait_until_async(all_locked, 10, what="the locks given back")
    assert sorted(got) == list(range(100))


async def test_a_topic_subscribed_again_in_the_other_mode_is_taken_anew(
        rocketmq: LocalRocketMQ) -> None:
    """unsubscribe() and subscribe(orderly=True) of a topic in one go: the rebalance round
    sees the topic held all along, so its queues, taken in the concurrent mode, must be
    taken anew (locked) for the orderly service, which never started on the old ones; and
    back to concurrent the same way (unlocked, no orderly turn left on them)."""
    ns = rocketmq.namesrv_addr
    topic = unique("T_mode")
    await rocketmq.create_topic(topic, queues=2)
    concurrent: collections.Counter[tuple[int, int]] = collections.Counter()
    ordered: collections.Counter[tuple[int, int]] = collections.Counter()
    consumer = PushConsumer(unique("G_mode"), namesrv=ns,
                            consume_from_where="CONSUME_FROM_FIRST_OFFSET",
                            rebalance_interval=1.0)

    async def on_concurrent(msg: MessageExt) -> None:
        concurrent[(msg.queue_id, msg.queue_offset)] += 1

    in_turn: dict[int, list[int]] = collections.defaultdict(list)
    again: collections.Counter[tuple[int, int]] = collections.Counter()

    async def on_ordered(msg: MessageExt) -> None:
        ordered[(msg.queue_id, msg.queue_offset)] += 1
        in_turn[msg.queue_id].append(msg.queue_offset)

    async def on_concurrent_again(msg: MessageExt) -> None:
        again[(msg.queue_id, msg.queue_offset)] += 1

    consumer.subscribe(topic, listener=on_concurrent)
    async with consumer:
        await produce(ns, topic, simple_messages(topic, 20), batch=10)
        await wait_until(lambda: len(concurrent) == 20, 30, what="the concurrent 20")
        consumer.unsubscribe(topic)
        consumer.subscribe(topic, listener=on_ordered, orderly=True)
        await produce(ns, topic, simple_messages(topic, 20, prefix="o"), batch=10)
        # (Messages of the first 20 may come again: the queues are taken anew from the offset
        # the broker holds, as after any rebalance.)
        await wait_until(lambda: len(set(ordered) - set(concurrent)) == 20, 30,
                         what="the 20 sent after the change, to the orderly handler")
        queues = {mq: pq for mq, pq in consumer.process_queues.items() if mq.topic == topic}
        assert len(queues) == 2 and all(pq.locked and pq.ordered for pq in queues.values())
        assert all(offsets == sorted(offsets) for offsets in in_turn.values())
        seen = set(concurrent) | set(ordered)
        consumer.unsubscribe(topic)
        consumer.subscribe(topic, listener=on_concurrent_again)
        await produce(ns, topic, simple_messages(topic, 20, prefix="c"), batch=10)
        await wait_until(lambda: len(set(again) - seen) == 20, 30,
                         what="the 20 sent after going back, to the concurrent handler")
        queues = {mq: pq for mq, pq in consumer.process_queues.items() if mq.topic == topic}
        assert len(queues) == 2 and not any(pq.locked or pq.ordered or pq.dropped
                                            for pq in queues.values())
    assert set(concurrent.values()) == {1} and set(ordered.values()) == {1}
    assert set(again.values()) == {1}


async def test_a_topic_created_after_start_is_consumed_once_its_route_appears(
        rocketmq: LocalRocketMQ) -> None:
    """Java's start only warns about a subscribed topic the name server does not know (not
    created yet, or a name server restarted before the brokers registered again); the
    rebalancer takes it once its route appears. start() used to fail with NoRouteError."""
    from structlog.testing import capture_logs

    ns = rocketmq.namesrv_addr
    topic = unique("T_later")
    got: collections.Counter[tuple[int, int]] = collections.Counter()
    consumer = PushConsumer(unique("G_later"), namesrv=ns,
                            consume_from_where="CONSUME_FROM_FIRST_OFFSET",
                            rebalance_interval=0.5)

    async def on(msgs: list[MessageExt]) -> ConsumeResult:
        for m in msgs:
            got[(m.queue_id, m.queue_offset)] += 1
        return ConsumeResult.SUCCESS

    consumer.subscribe(topic, listener=on)
    with capture_logs() as logs:
        await consumer.start()
    try:
        assert [e["topic"] for e in logs if e["event"] == "consumer.topic_has_no_route"] \
            == [topic]
        assert not consumer.process_queues
        await rocketmq.create_topic(topic, queues=2)
        await wait_until(lambda: _queues(consumer, topic) == 2, 30, what="queues taken")
        await produce(ns, topic, simple_messages(topic, 40), batch=10)
        await wait_until(lambda: len(got) == 40, 30, what="40 consumed")
        assert set(got.values()) == {1}
    finally:
        await consumer.stop()

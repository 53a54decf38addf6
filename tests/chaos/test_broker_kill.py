"""Broker ``kill -9`` with many messages in flight, restart on the same store: the consumer
carries on by itself and, at the end, the committed offsets equal the max offsets."""

from __future__ import annotations

import asyncio
import time

import pytest

from rmq_async import Message
from rmq_async.devbroker import LocalRocketMQ
from tests.chaos.common import (
    FULL,
    Tally,
    body_of,
    consumer,
    offsets_settled,
    report,
    scaled,
    wait_for,
)
from tests.helpers import produce, unique

pytestmark = [pytest.mark.broker, pytest.mark.chaos]


@pytest.mark.timeout(1200 if FULL else 300)
async def test_broker_kill9_and_restart_mid_drain(own_rocketmq: LocalRocketMQ) -> None:
    rmq = own_rocketmq
    topic = unique("T_chaos_kill")
    await rmq.create_topic(topic, queues=8)
    group = unique("G_chaos_kill")
    n = scaled(20_000, 100_000)
    keys = [body_of("kill", i).decode() for i in range(n)]
    await produce(rmq.namesrv_addr, topic, [Message(topic, k.encode()) for k in keys],
                  batch=200, concurrency=4)
    tally = Tally(delay=0.002)
    c = consumer(rmq.namesrv_addr, group, consume_message_batch_max_size=8)
    c.subscribe(topic, listener=tally.listener("c1"))
    async with c:
        await wait_for(lambda: tally.count >= n // 3, 120, "a third consumed")
        in_flight = sum(pq.msg_count for mq, pq in c.process_queues.items() if mq.topic == topic)
        killed_at = time.monotonic()
        seen_at_kill = tally.count
        rmq.kill_broker()
        await asyncio.sleep(2.0)
        await rmq.start()
        restarted_at = time.monotonic()
        await wait_for(lambda: tally.has_all(keys), 600 if FULL else 180, f"all {n} messages")
        after_restart = tally.first_after(restarted_at)
    committed, maxes = await offsets_settled(rmq.namesrv_addr, group, topic)
    lost = tally.lost(keys)
    dups = tally.duplicates()
    report("broker-kill9", sent=n, lost=len(lost), duplicates=sum(dups.values()),
           recovery=(restarted_at - killed_at) + (after_restart or 0.0),
           extra=f"cached_at_kill={in_flight} consumed_at_kill={seen_at_kill} "
                 f"restart_took={restarted_at - killed_at:.2f}s "
                 f"first_delivery_after_restart={after_restart:.2f}s")
    assert not lost
    assert committed == maxes
    assert sum(maxes.values()) == n

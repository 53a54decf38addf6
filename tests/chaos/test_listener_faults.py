"""Listeners that misbehave: one that never returns, and a retry storm."""

from __future__ import annotations

import asyncio
import collections
import random
import time
from dataclasses import dataclass
from typing import Any

import pytest

from rmq_async import ConsumeResult, Message, MessageExt
from rmq_async.devbroker import LocalRocketMQ
from tests.chaos.common import (
    FULL,
    body_of,
    consumer,
    key_of,
    offsets_settled,
    report,
    scaled,
    wait_for,
)
from tests.helpers import AdminClient, produce, unique

pytestmark = [pytest.mark.broker, pytest.mark.chaos]

HANG_TIMEOUT = 3.0  # consume_timeout, seconds


@dataclass
class HangRun:
    keys: list[str]
    hang: set[str]
    done: dict[str, list[int]]
    recovery: float
    committed: dict[Any, int]
    maxes: dict[Any, int]
    stop_took: float

    @property
    def resent_after_success(self) -> list[str]:
        """Messages consumed successfully, then sent back and consumed again."""
        return sorted(k for k in self.keys if k not in self.hang and len(self.done[k]) > 1)


async def _hang_scenario(rocketmq: LocalRocketMQ, name: str) -> HangRun:
    """consume_timeout (Java cleanExpiredMsg): a message whose listener hangs is sent back for
    retry after the timeout, its queue moves on, the retried copy is consumed."""
    topic = unique("T_chaos_hang")
    await rocketmq.create_topic(topic, queues=2)
    group = unique("G_chaos_hang")
    n = 300
    keys = [body_of("hang", i).decode() for i in range(n)]
    hang = {keys[10], keys[150], keys[290]}
    hung_at: dict[str, float] = {}
    done: dict[str, list[int]] = collections.defaultdict(list)
    done_at: dict[str, float] = {}
    never = asyncio.Event()
    c = consumer(rocketmq.namesrv_addr, group, consume_timeout=HANG_TIMEOUT)

    @c.subscribe(topic)
    async def on(msgs: list[MessageExt]) -> ConsumeResult:
        for m in msgs:
            k = key_of(m)
            if k in hang and m.reconsume_times == 0:
                hung_at[k] = time.monotonic()
                await never.wait()  # never returns
            done[k].append(m.reconsume_times)
            done_at.setdefault(k, time.monotonic())
        return ConsumeResult.SUCCESS

    await produce(rocketmq.namesrv_addr, topic, [Message(topic, k.encode()) for k in keys])
    await c.start()
    try:
        await wait_for(lambda: all(k in done for k in keys), 60, "every message, hung ones too")
    finally:
        stopping = time.monotonic()
        await c.stop(timeout=5.0)
        stop_took = time.monotonic() - stopping
    committed, maxes = await offsets_settled(rocketmq.namesrv_addr, group, topic)
    assert set(hung_at) == hang
    run = HangRun(keys, hang, done, max(done_at[k] - hung_at[k] for k in hang), committed,
                  maxes, stop_took)
    dups = sum(len(v) - 1 for v in done.values())
    report(name, sent=n, lost=sum(1 for k in keys if k not in done), duplicates=dups,
           recovery=run.recovery,
           extra=f"hung={len(hang)} consume_timeout={HANG_TIMEOUT:.0f}s "
                 f"resent_after_success={len(run.resent_after_success)} "
                 f"stop_took={stop_took:.2f}s")
    return run


async def test_listener_that_never_returns_is_sent_back(rocketmq: LocalRocketMQ) -> None:
    run = await _hang_scenario(rocketmq, "listener-hang")
    for k in run.hang:  # consumed again from the retry topic
        assert run.done[k] == [1], (k, run.done[k])
    assert all(k in run.done for k in run.keys)
    # The queues holding the hung messages moved on past them.
    assert run.committed == run.maxes
    assert run.recovery < 60
    # Only the stuck messages went back: those answered before them in the same pulled chunk
    # were settled by the cleaner, not sent back and consumed twice.
    assert run.resent_after_success == []


@pytest.mark.timeout(900 if FULL else 240)
async def test_retry_storm_ends_consumed_or_in_dlq(rocketmq: LocalRocketMQ) -> None:
    """Half of all listener calls fail at random: every message ends consumed once or in the
    DLQ after max_reconsume_times retries, never both, never neither."""
    topic = unique("T_chaos_storm")
    await rocketmq.create_topic(topic, queues=4)
    group = unique("G_chaos_storm")
    n = scaled(2_000, 50_000)
    max_reconsume = 2
    keys = [body_of("storm", i).decode() for i in range(n)]
    rng = random.Random(20261123)
    ok: collections.Counter[str] = collections.Counter()
    attempts: dict[str, list[int]] = collections.defaultdict(list)
    doomed: set[str] = set()  # failed on their last allowed attempt
    c = consumer(rocketmq.namesrv_addr, group, max_reconsume_times=max_reconsume,
                 consume_concurrency=32)

    @c.subscribe(topic)
    async def on(msgs: list[MessageExt]) -> ConsumeResult:
        m = msgs[0]
        k = key_of(m)
        attempts[k].append(m.reconsume_times)
        if rng.random() < 0.5:
            if m.reconsume_times >= max_reconsume:
                doomed.add(k)
            return ConsumeResult.RECONSUME_LATER
        ok[k] += 1
        return ConsumeResult.SUCCESS

    await produce(rocketmq.namesrv_addr, topic, [Message(topic, k.encode()) for k in keys],
                  batch=200)
    started = time.monotonic()
    async with c, AdminClient(rocketmq.namesrv_addr) as admin:
        await wait_for(lambda: len(ok) + len(doomed - set(ok)) >= n, 600 if FULL else 120,
                       "every message succeeded or failed its last attempt")
        dlq: list[MessageExt] = []
        deadline = time.monotonic() + 60
        while True:
            dlq = await admin.read_all(f"%DLQ%{group}")
            if len(dlq) >= len(doomed) or time.monotonic() > deadline:
                break
            await asyncio.sleep(0.5)
        settled_in = time.monotonic() - started
    committed, maxes = await offsets_settled(rocketmq.namesrv_addr, group, topic)
    r_committed, r_maxes = await offsets_settled(rocketmq.namesrv_addr, group, c.retry_topic)
    in_dlq = collections.Counter(key_of(m) for m in dlq)
    lost = [k for k in keys if k not in ok and k not in in_dlq]
    dups = sum(v - 1 for v in ok.values()) + sum(v - 1 for v in in_dlq.values())
    calls = sum(len(v) for v in attempts.values())
    report("retry-storm", sent=n, lost=len(lost), duplicates=dups, recovery=None,
           extra=f"listener_calls={calls} consumed={len(ok)} dlq={len(in_dlq)} "
                 f"max_reconsume_times={max_reconsume} settled_in={settled_in:.2f}s")
    assert not lost
    assert set(in_dlq) == doomed
    assert not (set(ok) & set(in_dlq))
    assert dups == 0
    assert all(max(a) <= max_reconsume for a in attempts.values())
    assert committed == maxes
    assert r_committed == r_maxes

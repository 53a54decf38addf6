"""Shared pieces of the chaos scenarios: sizes, the listener-side tally, a steady producer,
the broker-side checks and the one-line figures each scenario prints."""

from __future__ import annotations

import asyncio
import collections
import itertools
import os
import time
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from rmq_async import ConsumeResult, Message, MessageExt, Producer, PushConsumer
from tests.helpers import AdminClient, unique

#: ``make chaos`` sets RMQ_CHAOS_FULL=1: the scenarios run at their full sizes.
FULL = os.environ.get("RMQ_CHAOS_FULL") == "1"

#: Figures of every scenario run in this session, printed at the end of the run.
REPORT: list[str] = []


def scaled(ci: int, full: int) -> int:
    return full if FULL else ci


def report(scenario: str, *, sent: int, lost: int, duplicates: int, recovery: float | None,
           extra: str = "") -> str:
    rec = "n/a" if recovery is None else f"{recovery:.2f}s"
    line = (f"CHAOS {scenario}: sent={sent} lost={lost} duplicates={duplicates} "
            f"recovery={rec}{(' ' + extra) if extra else ''}")
    print("\n" + line)
    REPORT.append(line)
    return line


def body_of(prefix: str, i: int) -> bytes:
    return f"{prefix}-{i:08d}".encode()


def key_of(m: MessageExt) -> str:
    return m.body.decode()


def consumer(namesrv: str, group: str, **opts: Any) -> PushConsumer:
    """A push consumer with the request timeouts of the chaos tests (short, so that a silent
    peer is found within seconds) and frequent offset commits and rebalances."""
    defaults: dict[str, Any] = dict(
        consume_from_where="CONSUME_FROM_FIRST_OFFSET",
        persist_offset_interval=1.0,
        rebalance_interval=2.0,
        # The broker answers a held pull up to 5 s after its suspend time (its hold service
        # checks every 5 s), so the client's pull timeout must exceed suspend + 5 s.
        broker_suspend_max_time=1.0,
        consumer_timeout_when_suspend=8.0,
        api_timeout=3.0,
        pull_time_delay_when_exception=0.5,
    )
    defaults.update(opts)
    return PushConsumer(group, namesrv=namesrv, **defaults)


@dataclass
class Tally:
    """Every listener call: which key, in which queue, by whom, when."""

    seen: collections.Counter[str] = field(default_factory=collections.Counter)
    queue_of: dict[str, int] = field(default_factory=dict)
    owners: dict[int, set[str]] = field(default_factory=lambda: collections.defaultdict(set))
    times: list[float] = field(default_factory=list)
    count: int = 0
    delay: float = 0.0

    def record(self, m: MessageExt, member: str) -> None:
        k = key_of(m)
        self.seen[k] += 1
        self.queue_of[k] = m.queue_id
        self.owners[m.queue_id].add(member)
        self.times.append(time.monotonic())
        self.count += 1

    def listener(self, member: str) -> Callable[[list[MessageExt]], Awaitable[ConsumeResult]]:
        async def on(msgs: list[MessageExt]) -> ConsumeResult:
            for m in msgs:
                self.record(m, member)
            if self.delay:
                await asyncio.sleep(self.delay)
            return ConsumeResult.SUCCESS
        return on

    def has_all(self, keys: Iterable[str]) -> bool:
        return all(k in self.seen for k in keys)

    def lost(self, keys: Iterable[str]) -> list[str]:
        return [k for k in keys if k not in self.seen]

    def duplicates(self) -> dict[str, int]:
        return {k: n - 1 for k, n in self.seen.items() if n > 1}

    def longest_gap(self, since: float, until: float | None = None) -> float:
        """Longest time without a delivery between ``since`` and the last delivery (or
        ``until``): how long the consumer took to get going again after a fault."""
        ts = [t for t in self.times if t >= since and (until is None or t <= until)]
        if not ts:
            return float("inf")
        gap = ts[0] - since
        for a, b in itertools.pairwise(ts):
            gap = max(gap, b - a)
        return gap

    def first_after(self, since: float) -> float | None:
        for t in self.times:
            if t >= since:
                return t - since
        return None


class SteadyProducer:
    """Sends numbered messages: a backlog at once, then ``rate`` per second until stopped."""

    def __init__(self, namesrv: str, topic: str, prefix: str, *, backlog: int, rate: int,
                 batch: int = 50) -> None:
        self.namesrv = namesrv
        self.topic = topic
        self.prefix = prefix
        self.backlog = backlog
        self.rate = rate
        self.batch = batch
        self.sent: list[str] = []
        self._stop = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self.backlog_sent = asyncio.Event()

    async def _send(self, producer: Producer, n: int) -> None:
        start = len(self.sent)
        msgs = [Message(self.topic, body_of(self.prefix, i), keys=[f"{self.prefix}{i}"])
                for i in range(start, start + n)]
        await producer.send_batch(msgs)
        self.sent.extend(m.body.decode() for m in msgs)

    async def _run(self) -> None:
        async with Producer(unique("PG_chaos"), self.namesrv) as producer:
            remaining = self.backlog
            while remaining > 0:
                n = min(self.batch * 4, remaining)
                await self._send(producer, n)
                remaining -= n
            self.backlog_sent.set()
            interval = self.batch / self.rate if self.rate else 0.0
            while self.rate and not self._stop.is_set():
                await self._send(producer, self.batch)
                try:
                    await asyncio.wait_for(self._stop.wait(), interval)
                except TimeoutError:
                    pass

    def start(self) -> SteadyProducer:
        self._task = asyncio.create_task(self._run(), name="chaos-producer")
        return self

    async def stop(self) -> list[str]:
        self._stop.set()
        if self._task is not None:
            await self._task
        return self.sent


async def offsets_settled(namesrv: str, group: str, topic: str,
                          timeout: float = 30.0) -> tuple[dict[Any, int], dict[Any, int]]:
    """Committed and max offsets of ``topic`` once they agree (or the last read after
    ``timeout``)."""
    deadline = time.monotonic() + timeout
    async with AdminClient(namesrv) as admin:
        while True:
            committed = await admin.committed_offsets(group, topic)
            maxes = await admin.max_offsets(topic)
            if committed == maxes or time.monotonic() > deadline:
                return committed, maxes
            await asyncio.sleep(0.5)


async def wait_for(predicate: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        await asyncio.sleep(0.05)


async def produce_paced(namesrv: str, topic: str, bodies: list[bytes], seconds: float, *,
                        batch: int = 100) -> list[tuple[int, int]]:
    """Send ``bodies`` in batches spread evenly over ``seconds``; (queue id, offset) of each."""
    placed: list[tuple[int, int]] = []
    chunks = [bodies[i:i + batch] for i in range(0, len(bodies), batch)]
    pause = seconds / max(1, len(chunks))
    async with Producer(unique("PG_chaos_paced"), namesrv) as producer:
        for chunk in chunks:
            started = time.monotonic()
            r = await producer.send_batch([Message(topic, b) for b in chunk])
            placed.extend((r.queue_id, r.queue_offset + i) for i in range(len(chunk)))
            await asyncio.sleep(max(0.0, pause - (time.monotonic() - started)))
    return placed

"""Consumer process ``kill -9`` mid-batch, then a new process: nothing lost; duplicates only
from the uncommitted window of the killed process."""

from __future__ import annotations

import asyncio
import collections
import os
import signal
import sys
import time
from pathlib import Path

import pytest

from rmq_async import Message
from rmq_async.devbroker import LocalRocketMQ
from tests.chaos.common import FULL, body_of, offsets_settled, report, scaled
from tests.helpers import produce, unique

pytestmark = [pytest.mark.broker, pytest.mark.chaos]

ROOT = Path(__file__).resolve().parents[2]


class ConsumerProc:
    def __init__(self, *args: str) -> None:
        self.args = args
        self.seen: collections.Counter[str] = collections.Counter()
        self.queues: set[int] = set()
        self.first_at: float | None = None
        self.proc: asyncio.subprocess.Process | None = None
        self.ready = asyncio.Event()
        self.stopped = asyncio.Event()
        self._reader: asyncio.Task[None] | None = None

    async def start(self) -> ConsumerProc:
        self.proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "tests.chaos.consumer_proc", *self.args, cwd=ROOT,
            stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE)
        self._reader = asyncio.create_task(self._read())
        await asyncio.wait_for(self.ready.wait(), 60)
        return self

    async def _read(self) -> None:
        assert self.proc is not None and self.proc.stdout is not None
        while line := await self.proc.stdout.readline():
            text = line.decode().strip()
            if text.startswith("M "):
                _, key, qid = text.split()
                self.seen[key] += 1
                self.queues.add(int(qid))
                if self.first_at is None:
                    self.first_at = time.monotonic()
            elif text == "READY":
                self.ready.set()
            elif text == "STOPPED":
                self.stopped.set()

    def kill9(self) -> None:
        assert self.proc is not None
        os.kill(self.proc.pid, signal.SIGKILL)

    async def close(self) -> int:
        assert self.proc is not None and self.proc.stdin is not None
        if self.proc.returncode is None:
            self.proc.stdin.close()
        rc = await asyncio.wait_for(self.proc.wait(), 60)
        if self._reader is not None:
            await self._reader
        return rc


@pytest.mark.timeout(900 if FULL else 240)
async def test_consumer_process_kill9_mid_batch(rocketmq: LocalRocketMQ) -> None:
    topic = unique("T_chaos_ckill")
    await rocketmq.create_topic(topic, queues=4)
    group = unique("G_chaos_ckill")
    n = scaled(10_000, 50_000)
    keys = [body_of("ckill", i).decode() for i in range(n)]
    await produce(rocketmq.namesrv_addr, topic, [Message(topic, k.encode()) for k in keys],
                  batch=200)
    args = (rocketmq.namesrv_addr, topic, group)
    first = await ConsumerProc(*args, "victim").start()
    procs = [first]
    try:
        deadline = time.monotonic() + 120
        while sum(first.seen.values()) < n // 3:
            assert time.monotonic() < deadline, "the first process consumed too little"
            await asyncio.sleep(0.01)
        first.kill9()
        killed_at = time.monotonic()
        assert await asyncio.wait_for(first.proc.wait(), 30) == -signal.SIGKILL  # type: ignore[union-attr]
        second = await ConsumerProc(*args, "survivor").start()
        procs.append(second)
        deadline = time.monotonic() + (600 if FULL else 120)
        while not all(k in first.seen or k in second.seen for k in keys):
            assert time.monotonic() < deadline, "not every message was consumed"
            await asyncio.sleep(0.1)
        assert await second.close() == 0
        assert second.stopped.is_set()
    finally:
        for p in procs:
            if p.proc is not None and p.proc.returncode is None:
                p.kill9()
                await p.proc.wait()
    committed, maxes = await offsets_settled(rocketmq.namesrv_addr, group, topic)
    total = first.seen + second.seen
    lost = [k for k in keys if k not in total]
    dups = sum(v - 1 for v in total.values())
    recovery = (second.first_at or killed_at) - killed_at
    report("consumer-kill9", sent=n, lost=len(lost), duplicates=dups, recovery=recovery,
           extra=f"before_kill={sum(first.seen.values())} after_restart={sum(second.seen.values())}")
    assert not lost
    assert committed == maxes
    # Duplicates only where ownership changed: messages the killed process had consumed.
    assert all(k in first.seen for k, v in total.items() if v > 1), \
        "a message consumed twice that the killed process never had"

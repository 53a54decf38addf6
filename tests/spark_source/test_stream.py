"""``spark.readStream.format("rocketmq")`` into Parquet against the real broker.

The driver runs as a subprocess (``tests/spark_source/stream_driver.py``) so it can be killed
with SIGKILL mid-stream and started again from its checkpoint. Sizes: RMQ_SPARK_SOURCE_FULL=1
produces the acceptance size (500,000 messages of 1 KiB while the stream runs); the default run
produces 30,000 messages of 100 B.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import signal
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

from rmq_async.devbroker import LocalRocketMQ
from rmq_async.protocol.types import MessageQueue
from tests.helpers import AdminClient, produce, simple_messages, unique, wait_until
from tests.spark_source.common import stored_offsets
from tests.spark_source.session import FULL

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

pytestmark = [pytest.mark.broker, pytest.mark.spark]

REPO = Path(__file__).resolve().parents[2]
STREAM_MESSAGES = 500_000 if FULL else 30_000
STREAM_BODY = 1024 if FULL else 100
PER_TRIGGER = 50_000 if FULL else 4_000


class Driver:
    """One run of the stream driver subprocess; its output goes to ``log``."""

    def __init__(self, proc: asyncio.subprocess.Process, log: Path) -> None:
        self.proc = proc
        self.log = log

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    async def wait(self, timeout: float) -> int:
        try:
            async with asyncio.timeout(timeout):
                return await self.proc.wait()
        except TimeoutError:
            raise AssertionError(f"driver still running after {timeout}s:\n{self.output()[-4000:]}")


@contextlib.asynccontextmanager
async def driver(spec: dict[str, Any], log: Path) -> AsyncIterator[Driver]:
    out = log.open("ab")
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "tests.spark_source.stream_driver", json.dumps(spec),
        cwd=REPO, stdout=out, stderr=asyncio.subprocess.STDOUT, start_new_session=True)
    try:
        yield Driver(proc, log)
    finally:
        out.close()
        # The driver's JVM and Python workers are in its session: none may outlive the test.
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        await proc.wait()


def committed_batches(checkpoint: Path) -> int:
    commits = checkpoint / "commits"
    if not commits.is_dir():
        return 0
    return sum(1 for p in commits.iterdir() if p.name.isdigit())


async def produce_paced(namesrv: str, topic: str, n: int, body: int, chunks: int,
                        pause: float) -> None:
    msgs = simple_messages(topic, n, size=body)
    step = -(-n // chunks)
    for i in range(0, n, step):
        await produce(namesrv, topic, msgs[i:i + step], batch=128 if body <= 1024 else 16)
        await asyncio.sleep(pause)


def check_exactly_once(spark: SparkSession, path: Path, maxes: dict[MessageQueue, int]) -> int:
    """Every offset of every queue once (read through the file sink's commit log)."""
    df = spark.read.parquet(str(path))
    table = df.select("queue_id", "queue_offset").toArrow()
    rows = table.num_rows
    seen: dict[int, list[int]] = {}
    for qid, off in zip(table.column("queue_id").to_pylist(),
                        table.column("queue_offset").to_pylist(), strict=True):
        seen.setdefault(qid, []).append(off)
    expected = sum(maxes.values())
    for mq, top in maxes.items():
        offsets = sorted(seen.get(mq.queue_id, []))
        assert offsets == list(range(top)), (
            f"queue {mq.queue_id}: {len(offsets)} rows, {len(set(offsets))} distinct, "
            f"expected 0..{top - 1}")
    assert rows == expected
    return rows


@pytest.mark.slow(seconds=100)
@pytest.mark.timeout(900 if FULL else 300)
async def test_stream_killed_mid_stream_restarts_from_checkpoint_exactly_once(
        rocketmq: LocalRocketMQ, topic: str, spark: SparkSession, tmp_path: Path) -> None:
    ns = rocketmq.namesrv_addr
    out = tmp_path / "out"
    checkpoint = tmp_path / "checkpoint"
    log = tmp_path / "driver.log"
    group = unique("G_stream")
    spec = {"namesrv": ns, "topic": topic, "path": str(out), "checkpoint": str(checkpoint),
            "options": {"maxMessagesPerTrigger": PER_TRIGGER, "commitToGroup": group}}
    t0 = time.monotonic()
    # A tenth is there when the query starts; the rest arrives while it runs (from its first
    # committed micro-batch on), and the driver is killed after its third.
    first = STREAM_MESSAGES // 10
    await produce(ns, topic, simple_messages(topic, first, size=STREAM_BODY, prefix="p"), batch=128)
    producer: asyncio.Task[None] | None = None
    try:
        async with driver(spec, log) as run:
            def batches(n: int) -> bool:
                return committed_batches(checkpoint) >= n or run.proc.returncode is not None

            await wait_until(lambda: batches(1), 120, interval=0.1, what="a committed micro-batch")
            producer = asyncio.create_task(produce_paced(
                ns, topic, STREAM_MESSAGES - first, STREAM_BODY, chunks=40, pause=0.25))
            await wait_until(lambda: batches(3), 120, interval=0.1, what="three micro-batches")
            assert run.proc.returncode is None, run.output()[-4000:]
            killed_after = committed_batches(checkpoint)
            os.kill(run.proc.pid, signal.SIGKILL)  # the driver process only
            await run.wait(10)
            # Its JVM exits once the driver's pipe closes; give it a moment before the restart.
            with contextlib.suppress(AssertionError):
                await wait_until(lambda: not _session_alive(run.proc.pid), 15, interval=0.2)
        assert producer is not None
        produced_during = producer.done()
        await producer
    finally:
        if producer is not None:
            producer.cancel()
    kill_at = time.monotonic() - t0
    maxes = await stored_offsets(ns, topic, STREAM_MESSAGES)
    assert sum(maxes.values()) == STREAM_MESSAGES

    async with driver({**spec, "available_now": True}, log) as run:
        rc = await run.wait(600 if FULL else 150)
        assert rc == 0, run.output()[-6000:]
    done = [line for line in run.output().splitlines() if line.startswith("DONE ")]
    assert done, run.output()[-4000:]
    batch_rows = json.loads(done[-1][5:])["batch_rows"]
    # maxMessagesPerTrigger bounds every micro-batch of the restarted query.
    assert len(batch_rows) > 1 and max(batch_rows) <= PER_TRIGGER, batch_rows
    rows = check_exactly_once(spark, out, maxes)
    # commitToGroup: the group's offsets are the stream's, at the end of the topic, and mqadmin
    # consumerProgress shows no lag.
    async with AdminClient(ns) as admin:
        assert await admin.committed_offsets(group, topic) == maxes
    progress = await rocketmq.mqadmin("consumerProgress", "-g", group)
    # Columns: topic (cut to 64 characters), broker, queue, broker offset, consumer offset, diff.
    lines = re.findall(rf"^{re.escape(topic[:40])}\S*\s+broker-a\s+(\d+)\s+(\d+)\s+(\d+)\s+(-?\d+)\s",
                       progress, re.M)
    assert len(lines) == len(maxes), progress
    for qid, broker_offset, consumer_offset, diff in lines:
        assert int(broker_offset) == int(consumer_offset) == maxes[MessageQueue(topic, "broker-a", int(qid))]
        assert int(diff) == 0, progress
    assert re.search(r"Diff Total:\s*0\b", progress), progress
    print(f"\nstream: killed after {killed_after} committed batches at {kill_at:.1f}s "
          f"(production finished before the kill: {produced_during}); "
          f"{rows} rows exactly once after the restart; batches after the restart {batch_rows}; "
          f"total {time.monotonic() - t0:.1f}s")


def _session_alive(sid: int) -> bool:
    """Is any process of session ``sid`` (the killed driver's JVM, its workers) still running?"""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[3]) == sid and fields[0] != "Z":
            return True
    return False

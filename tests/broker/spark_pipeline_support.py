"""What the Spark pipeline tests share: producing tracked messages, counting the rows read
back, the consumer run as a subprocess (``tests/broker/spark_consumer_proc.py``, so that it can
be killed with SIGKILL), and the heap size of a pulled message."""

from __future__ import annotations

import asyncio
import collections
import contextlib
import json
import os
import sys
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rmq_async import Message, MessageQueue, Producer
from tests.helpers import TEST_SEND_TIMEOUT, AdminClient, send_batch_unchecked, unique

if TYPE_CHECKING:
    import pyarrow as pa

REPO = Path(__file__).resolve().parents[2]


def small_messages(topic: str, n: int, *, size: int = 100) -> list[Message]:
    pad = b"." * size
    return [Message(topic, (f"{i:09d}".encode() + pad)[:size], tags="t", keys=[f"k{i}"],
                    properties={"seq": str(i)}) for i in range(n)]


async def produce_tracked(namesrv: str, msgs: Sequence[Message], *, batch: int = 128,
                          in_flight: int = 4, queue: MessageQueue | None = None,
                          ) -> list[tuple[int, int]]:
    """Batch-send ``msgs``; returns ``(queue_id, queue_offset)`` of each, in order."""
    placed: list[tuple[int, int]] = [(-1, -1)] * len(msgs)
    async with Producer(unique("PG_spark"), namesrv, send_timeout=TEST_SEND_TIMEOUT) as producer:
        sem = asyncio.Semaphore(in_flight)

        async def send(start: int) -> None:
            chunk = list(msgs[start:start + batch])
            async with sem:
                # (Unchecked: the mixed messages' empty bodies, which the producer refuses
                # as Java's does, as another client stores them.)
                r = await send_batch_unchecked(producer, chunk, queue=queue)
            for i in range(len(chunk)):
                placed[start + i] = (r.queue_id, r.queue_offset + i)

        async with asyncio.TaskGroup() as tg:
            for start in range(0, len(msgs), batch):
                tg.create_task(send(start))
    assert len(set(placed)) == len(msgs)
    return placed


def key_counts(table: pa.Table) -> collections.Counter[tuple[str, int, int]]:
    """How often each (topic, queue_id, queue_offset) occurs (one broker in these tests)."""
    return collections.Counter(zip(table.column("topic").to_pylist(),
                                   table.column("queue_id").to_pylist(),
                                   table.column("queue_offset").to_pylist(), strict=True))


@dataclass
class ConsumerProcess:
    """The subprocess consumer of ``spark_consumer_proc``, read event by event."""

    proc: asyncio.subprocess.Process
    stderr_path: Path
    events: list[dict[str, Any]]

    async def next_event(self, predicate: Callable[[dict[str, Any]], bool],
                         timeout: float) -> dict[str, Any]:
        assert self.proc.stdout is not None
        async with asyncio.timeout(timeout):
            while True:
                line = await self.proc.stdout.readline()
                if not line:
                    await self.proc.wait()
                    raise AssertionError(f"consumer process exited ({self.proc.returncode}):\n"
                                         f"{self.stderr_tail()}")
                event: dict[str, Any] = json.loads(line)
                self.events.append(event)
                if predicate(event):
                    return event

    def stderr_tail(self, n: int = 4000) -> str:
        return self.stderr_path.read_text(errors="replace")[-n:]

    async def kill(self) -> None:
        if self.proc.returncode is None:
            self.proc.kill()  # SIGKILL
        await self.proc.wait()


@contextlib.asynccontextmanager
async def consumer_process(cfg: dict[str, Any], workdir: Path) -> AsyncIterator[ConsumerProcess]:
    err = workdir / f"{unique('consumer')}.err"
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    with err.open("wb") as err_file:
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "tests.broker.spark_consumer_proc", json.dumps(cfg),
            cwd=REPO, env=env, stdout=asyncio.subprocess.PIPE, stderr=err_file,
        )
    cp = ConsumerProcess(proc, err, [])
    try:
        yield cp
    finally:
        await cp.kill()


async def cached_bytes_per_message(namesrv: str, topic: str, sample: int = 4000) -> float:
    """Python heap bytes one pulled message of ``topic`` takes, measured on a sample."""
    import tracemalloc

    async with AdminClient(namesrv) as admin:
        tracemalloc.start()
        try:
            before = tracemalloc.get_traced_memory()[0]
            msgs = await admin.read_all(topic, max_per_queue=sample // 8)
            after = tracemalloc.get_traced_memory()[0]
        finally:
            tracemalloc.stop()
    return (after - before) / len(msgs)

"""An orderly worker survives a failing turn, and the queue gets its turn again."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

from structlog.testing import capture_logs

from rmq_async.consumer.options import ConsumerOptions
from rmq_async.consumer.orderly import OrderlyConsumeService
from rmq_async.consumer.process_queue import ProcessQueue
from rmq_async.protocol.types import MessageExt, MessageQueue


async def test_failing_turn_is_logged_rolled_back_and_retried() -> None:
    opts = ConsumerOptions.from_kwargs("G", consume_concurrency=1,
                                       suspend_current_queue_time=0.05)
    rt = SimpleNamespace(group="G", options=opts, stopping=False)
    service = OrderlyConsumeService(rt)  # type: ignore[arg-type]
    mq = MessageQueue("T", "broker-a", 0)
    pq = ProcessQueue()
    pulled = [MessageExt("T", b"m0", 0, 0), MessageExt("T", b"m1", 0, 1)]
    first = pq.put_messages(pulled)
    turns: list[list[int]] = []

    async def run_turn(mq: MessageQueue, pq: ProcessQueue) -> None:
        taken = pq.take_messages(1)
        turns.append([m.queue_offset for m in taken])
        if len(turns) == 1:
            raise KeyError("a bug in a turn")
        pq.commit()

    service._run_turn = run_turn  # type: ignore[method-assign]
    with capture_logs() as logs:
        service.start()
        service.submit(pulled, pq, mq, first)
        async with asyncio.timeout(5):
            while len(turns) < 2:
                await asyncio.sleep(0.01)
        await service.aclose()
    # The message the failed turn had taken is taken again first, by the same (only) worker.
    assert turns == [[0], [0]]
    assert [e["event"] for e in logs if e["log_level"] == "error"] == ["orderly.turn_failed"]

"""An orderly worker survives a failing turn, and the queue gets its turn again."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

from structlog.testing import capture_logs

from rmq_async.consumer.options import ConsumerOptions
from rmq_async.consumer.orderly import OrderlyConsumeService
from rmq_async.consumer.process_queue import ProcessQueue
from rmq_async.consumer.tasks import TaskOwner
from rmq_async.protocol.types import MessageExt, MessageQueue


async def test_failing_turn_is_logged_rolled_back_and_retried() -> None:
    opts = ConsumerOptions.from_kwargs("G", consume_concurrency=1,
                                       suspend_current_queue_time=0.05)
    rt = SimpleNamespace(tasks=TaskOwner("consumer[G]"), group="G", options=opts, stopping=False)
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


async def test_a_malformed_lock_answer_is_a_failed_lock_not_a_dead_renewal_loop() -> None:
    """A LOCK_BATCH_MQ answer that does not decode (ProtocolError) counts as a failed lock, as
    a broker error does: lock() says False, lock_all() leaves the queues' state alone and the
    lock renewal goes on, instead of its loop ending and every lock expiring at the broker."""
    from rmq_async.protocol.errors import ProtocolError

    mq = MessageQueue("T", "broker-a", 0)
    pq = ProcessQueue()
    pq.locked = True
    calls: list[str] = []

    async def master(broker_name: str, topic: str) -> str:
        return "127.0.0.1:10911"

    async def lock_batch_mq(*args: object) -> set[MessageQueue]:
        calls.append("lock")
        raise ProtocolError("LOCK_BATCH_MQ body: not JSON")

    opts = ConsumerOptions.from_kwargs("G")
    rt = SimpleNamespace(
        tasks=TaskOwner("consumer[G]"),
        group="G", client_id="c", options=opts, stopping=False, process_queues={mq: pq},
        subscriptions=SimpleNamespace(is_orderly=lambda topic: True),
        instance=SimpleNamespace(find_broker_master=master,
                                 api=SimpleNamespace(lock_batch_mq=lock_batch_mq)))
    service = OrderlyConsumeService(rt)  # type: ignore[arg-type]
    assert await service.lock(mq) is False
    await service.lock_all()
    assert calls == ["lock", "lock"]
    assert pq.locked is True  # a failed call changes nothing (Java); the broker's lock ages

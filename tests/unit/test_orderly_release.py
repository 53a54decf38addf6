"""Orderly queues given up by a rebalance and other ways out of an orderly queue: what the
listeners see after ``on_revoked``, the broker locks, and messages out of retries."""

from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace
from typing import Any

import pytest

from rmq_async import PushConsumer
from rmq_async.consumer import orderly as orderly_module
from rmq_async.consumer.offset_store import OFFSET_NOT_FOUND, _MemoryTable
from rmq_async.consumer.orderly import OrderlyConsumeService
from rmq_async.consumer.process_queue import ProcessQueue
from rmq_async.consumer.rebalance import Rebalancer
from rmq_async.consumer.stats import ConsumerStats
from rmq_async.consumer.tasks import TaskOwner
from rmq_async.protocol.types import MessageExt, MessageQueue

A = MessageQueue("T", "broker-a", 0)
B = MessageQueue("T", "broker-a", 1)


async def _nothing(*a: Any, **kw: Any) -> None:
    return None


async def test_no_queue_revoked_together_is_consumed_after_on_revoked(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A round gives up two orderly queues: the listeners hear ``on_revoked`` for both, then
    the queues were removed one after the other, each removal waiting for its queue's batch
    (up to UNLOCK_WAIT). The second queue was not dropped meanwhile: still pulled, and its
    messages still reached the handler after ``on_revoked`` had said it was gone."""
    monkeypatch.setattr(orderly_module, "UNLOCK_WAIT", 1.0)
    gate = asyncio.Event()
    revoked = asyncio.Event()
    after_revoke: list[tuple[int, int]] = []

    async def handler(msg: MessageExt) -> None:
        if revoked.is_set():
            after_revoke.append((msg.queue_id, msg.queue_offset))
        if msg.queue_id == 0:
            await gate.wait()  # A's batch runs on through the round

    consumer = PushConsumer("G", namesrv="127.0.0.1:9876", consume_concurrency=2)
    consumer.subscribe("T", listener=handler, orderly=True)
    pqs = {A: ProcessQueue(), B: ProcessQueue()}
    for pq in pqs.values():
        pq.locked = True
        pq.last_lock_timestamp = time.monotonic() + 3600
    rt = SimpleNamespace(
        tasks=TaskOwner("consumer[G]"),
        group="G", options=consumer.options, stopping=False, client_id="me",
        subscriptions=consumer.subscriptions, retry_topic=consumer.retry_topic,
        stats=ConsumerStats(), process_queues=dict(pqs),
        thresholds=SimpleNamespace(recompute=lambda *a: None),
        instance=SimpleNamespace(send_heartbeats=_nothing),
        offset_store=SimpleNamespace(update=lambda *a, **k: None, persist=_nothing,
                                     remove=lambda mq: None))
    service = OrderlyConsumeService(rt)  # type: ignore[arg-type]
    service.unlock = _nothing  # type: ignore[method-assign]

    async def fire_revoked(group: str, queues: Any) -> None:
        revoked.set()

    pull = SimpleNamespace(is_pulling=lambda mq: True, stop_queue=_nothing)
    rebalancer = Rebalancer(rt, pull, service,  # type: ignore[arg-type]
                            hooks=SimpleNamespace(fire_revoked=fire_revoked))  # type: ignore[arg-type]

    def pulled(mq: MessageQueue, offsets: range) -> None:
        msgs = [MessageExt("T", b"x", mq.queue_id, i) for i in offsets]
        pq = pqs[mq]
        service.submit(msgs, pq, mq, pq.put_messages(msgs))

    service.start()
    try:
        pulled(A, range(0, 1))
        await asyncio.sleep(0.05)
        round_ = asyncio.create_task(rebalancer.apply_allocation("T", set()))
        async with asyncio.timeout(5):
            await revoked.wait()
        pulled(B, range(0, 3))  # a pull of B answered while A's removal waits
        await asyncio.sleep(0.3)
        gate.set()
        async with asyncio.timeout(5):
            await round_
    finally:
        gate.set()
        await service.aclose()
    assert after_revoke == []
    assert pqs[A].dropped and pqs[B].dropped and rt.process_queues == {}


@pytest.mark.parametrize(("given", "pause"), [
    ({"millis": 60_000}, 30.0), ({"millis": 0}, 0.01), ({"millis": 250}, 0.25),
    ({"seconds": 120.0}, 30.0), ({"seconds": 0.0}, 0.01), ({"option": 45.0}, 30.0),
    ({"option": 0.0}, 0.01), ({}, 1.0),
])
def test_a_suspend_pause_is_kept_within_javas_bounds(given: dict[str, float],
                                                     pause: float) -> None:
    """Java's ``submitConsumeRequestLater`` keeps the pause within 10 ms and 30 s: a pause of
    0 retried a failing queue in a loop, a line logged each time; 60 s left it a minute."""
    from rmq_async import ConsumeContext
    from rmq_async.consumer.options import ConsumerOptions

    opts = ConsumerOptions.from_kwargs(
        "G", **({"suspend_current_queue_time": given["option"]} if "option" in given else {}))
    service = OrderlyConsumeService(SimpleNamespace(  # type: ignore[arg-type]
        tasks=TaskOwner("consumer[G]"),
        group="G", options=opts))
    ctx = ConsumeContext(message_queue=A)
    if "millis" in given:
        ctx.suspend_current_queue_time_millis = int(given["millis"])
    if "seconds" in given:
        ctx.suspend_current_queue_time = given["seconds"]
    assert service._suspend_time(ctx) == pause


async def test_out_of_retries_a_message_in_the_dead_letter_queue_is_not_handed_out_again() -> None:
    """Batch [0, 1] always fails, one retry allowed. Out of retries, 0 went to the dead-letter
    queue and 1's send failed: the retry in place handed 0 to the handler again and sent it
    to the dead-letter queue a second time (Java does the same; the dead-letter path of
    ``ctx.dead_letters`` already kept what it had sent)."""
    from rmq_async import ConsumeResult
    from tests.unit.test_orderly_settle import _Harness

    calls: list[list[int]] = []
    sent: list[int] = []
    refuse = {1}

    async def handler(msgs: list[MessageExt]) -> ConsumeResult:
        calls.append([m.queue_offset for m in msgs])
        return ConsumeResult.SUSPEND_CURRENT_QUEUE_A_MOMENT

    async def send_back(msg: MessageExt, level: int) -> bool:
        if msg.queue_offset in refuse:
            refuse.discard(msg.queue_offset)  # the broker is busy, once
            return False
        sent.append(msg.queue_offset)
        return True

    h = _Harness(handler, batch=True, batch_size=2, max_reconsume_times=1)
    h.rt.send_message_back = send_back
    await h.run(range(0, 2), lambda: h.offsets.updates[-1:] == [2])
    assert sent == [0, 1]
    assert calls == [[0, 1], [0, 1], [1]]


async def test_out_of_retries_only_the_poison_goes_to_the_dead_letter_queue(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Batch [0, 1]: the handler consumes 0 and puts 1 in ``ctx.dead_letters``, whose send to
    the dead-letter queue fails, so the call is tried again in place. Out of retries, both
    went to the dead-letter queue, 0 too, which the handler had consumed."""
    from rmq_async import ConsumeContext, ConsumeResult
    from tests.unit.test_orderly_settle import _Harness

    to_dead_letter_queue: list[int] = []

    async def handler(msgs: list[MessageExt], ctx: ConsumeContext) -> ConsumeResult:
        ctx.dead_letters.extend((m, "poison") for m in msgs if m.queue_offset == 1)
        return ConsumeResult.SUCCESS

    async def refused(rt: Any, msg: MessageExt, reason: str) -> bool:
        return False  # the broker is busy

    async def send_back(msg: MessageExt, level: int) -> bool:
        to_dead_letter_queue.append(msg.queue_offset)
        return True

    monkeypatch.setattr(orderly_module, "send_to_dlq", refused)
    h = _Harness(handler, batch=True, batch_size=2, max_reconsume_times=0)
    h.rt.send_message_back = send_back
    await h.run(range(0, 2), lambda: h.offsets.updates[-1:] == [2])
    assert to_dead_letter_queue == [1]


class _PersistingStore(_MemoryTable):
    """An offset store whose persist records what it would send."""

    def __init__(self) -> None:
        super().__init__()
        self.persisted: dict[MessageQueue, int] = {}

    async def persist(self, mq: MessageQueue) -> None:
        if self.read_memory(mq) >= 0:
            self.persisted[mq] = self.read_memory(mq)


async def _busy_queue_given_up(monkeypatch: pytest.MonkeyPatch, store: _PersistingStore,
                               pq: ProcessQueue) -> tuple[OrderlyConsumeService, asyncio.Lock]:
    """Queue A, locked at the broker just now, with a batch at its listener that stays there:
    A is given up, its release deferred, and (0.8 s on) given up when the broker's lock is
    about to lapse. Returns the service and A's consume lock, held for the batch."""
    from rmq_async.consumer.options import MessageModel

    monkeypatch.setattr(orderly_module, "UNLOCK_WAIT", 0.2)
    monkeypatch.setattr(orderly_module, "BROKER_LOCK_EXPIRY", 0.6)
    monkeypatch.setattr(orderly_module, "LOCK_EXPIRY_MARGIN", 0.05)
    instance = SimpleNamespace(api=SimpleNamespace(unlock_batch_mq=_nothing),
                               find_broker_master=_nothing)
    rt = SimpleNamespace(options=SimpleNamespace(message_model=MessageModel.CLUSTERING),
                         group="G", client_id="c", tasks=TaskOwner("c"), offset_store=store,
                         process_queues={}, stopping=False, instance=instance)
    service = OrderlyConsumeService(rt)  # type: ignore[arg-type]
    pq.locked = True
    pq.last_lock_timestamp = time.monotonic()
    lock = service.consume_lock(A)
    await lock.acquire()  # a batch is with the listener, and stays there
    pq.dropped = True
    assert await service.release(A, pq) is False  # deferred
    await asyncio.sleep(0.8)  # past the lapse: given up
    assert not service.releasing(A)
    return service, lock


async def test_a_release_that_gives_up_has_persisted_what_was_committed_and_a_reset(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A batch still running when the queue is given up (an admin reset froze a new offset
    meanwhile) defers the release, which gives up when the broker's lock lapses: what the
    store held at the release (the reset's offset) must have reached the broker by then."""
    store = _PersistingStore()
    store.update(A, 100, increase_only=False)
    store.freeze(A, 10)  # the reset
    service, lock = await _busy_queue_given_up(monkeypatch, store, ProcessQueue())
    assert store.persisted == {A: 10}
    lock.release()
    await service.aclose()


async def test_a_batch_ending_after_its_release_gave_up_leaves_no_offset_entry(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The release gives up (the broker's lock lapses before the batch ends) and drops the
    queue's offset entry; the batch's commit must not put it back (it stayed, persisted by
    nothing and reported in the consumer's status to admin tools, until the queue was taken
    again)."""
    store = _PersistingStore()
    store.update(A, 0, increase_only=False)
    pq = ProcessQueue()
    pq.put_messages([MessageExt("T", b"x", 0, i) for i in range(4)])
    taken = pq.take_messages(4)
    service, lock = await _busy_queue_given_up(monkeypatch, store, pq)
    assert store.read_memory(A) == OFFSET_NOT_FOUND
    service._commit(A, pq, taken[-1].queue_offset)  # the batch ends
    lock.release()
    assert store.read_memory(A) == OFFSET_NOT_FOUND
    await service.aclose()

"""How the orderly service settles a handler's calls: auto-commit on and off (Java
``ConsumeMessageOrderlyService.processConsumeResult``) and what its statistics count."""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import pytest
from structlog.testing import capture_logs

from rmq_async import ConsumeContext, ConsumeResult, DeadLetter, PushConsumer
from rmq_async.consumer import orderly as orderly_module
from rmq_async.consumer.options import MessageModel
from rmq_async.consumer.orderly import OrderlyConsumeService
from rmq_async.consumer.process_queue import ProcessQueue
from rmq_async.consumer.stats import ConsumerStats
from rmq_async.consumer.tasks import TaskOwner
from rmq_async.protocol.types import PROPERTY_RETRY_TOPIC, MessageExt, MessageQueue
from tests.helpers import NotAnException

MQ = MessageQueue("T", "broker-a", 0)


class _Offsets:
    def __init__(self) -> None:
        self.updates: list[int] = []

    def update(self, mq: MessageQueue, offset: int, increase_only: bool = False) -> None:
        self.updates.append(offset)


class _Harness:
    """One orderly queue of a real subscription, consumed by the real service, with the
    offset store and the broker calls recorded instead of sent."""

    def __init__(self, handler: Callable[..., Any], *, batch: bool = False,
                 batch_size: int = 1, broadcasting: bool = False,
                 model: type[Any] | None = None, **options: Any) -> None:
        kwargs: dict[str, Any] = {"consume_concurrency": 1, "suspend_current_queue_time": 0.05,
                                  "consume_message_batch_max_size": batch_size, **options}
        if broadcasting:
            kwargs["message_model"] = MessageModel.BROADCASTING
        consumer = PushConsumer("G_settle", namesrv="127.0.0.1:9876", **kwargs)
        consumer.subscribe("T", listener=handler, orderly=True, batch=batch, model=model)
        self.pq = ProcessQueue()
        self.pq.locked = True
        self.pq.last_lock_timestamp = time.monotonic() + 3600
        self.offsets = _Offsets()
        self.stats = ConsumerStats()
        self.rt = SimpleNamespace(
            tasks=TaskOwner("consumer[G_settle]"), group="G_settle", options=consumer.options, stopping=False,
            subscriptions=consumer.subscriptions, retry_topic=consumer.retry_topic,
            stats=self.stats, offset_store=self.offsets, process_queues={MQ: self.pq})
        self.service = OrderlyConsumeService(self.rt)  # type: ignore[arg-type]

    def put(self, offsets: range) -> None:
        msgs = [MessageExt("T", f"m{i}".encode(), 0, i) for i in offsets]
        first = self.pq.put_messages(msgs)
        self.service.submit(msgs, self.pq, MQ, first)

    async def run(self, offsets: range, done: Callable[[], bool]) -> None:
        """Start the service, hand it ``offsets``, wait for ``done()``, close it."""
        self.service.start()
        try:
            self.put(offsets)
            await self.until(done)
        finally:
            await self.service.aclose()

    async def until(self, done: Callable[[], bool]) -> None:
        async with asyncio.timeout(5):
            while not done():
                await asyncio.sleep(0.01)
        await asyncio.sleep(0.15)  # and nothing else happens after it (a late retry)


async def test_without_auto_commit_only_commit_moves_the_offset() -> None:
    """SUCCESS with ``auto_commit=False`` leaves the message taken and uncommitted, across
    turns; a later COMMIT commits everything taken before it (Java's consuming tree map)."""
    seen: list[int] = []

    async def handler(msg: MessageExt, ctx: ConsumeContext) -> ConsumeResult:
        ctx.auto_commit = False
        seen.append(msg.queue_offset)
        return ConsumeResult.COMMIT if msg.queue_offset == 3 else ConsumeResult.SUCCESS

    h = _Harness(handler)
    h.service.start()
    try:
        h.put(range(0, 2))
        await h.until(lambda: seen == [0, 1])
        assert h.offsets.updates == []  # nothing committed yet
        assert h.pq.msg_count == 2 and h.pq.consuming_count == 2  # still cached, taken
        h.put(range(2, 5))  # a later pull: a new turn
        await h.until(lambda: len(seen) == 5)
    finally:
        await h.service.aclose()
    assert seen == [0, 1, 2, 3, 4]  # each once: held messages are not handed over again
    assert h.offsets.updates == [4]  # the COMMIT at offset 3 commits 0..3
    assert h.pq.msg_count == 1 and h.pq.consuming_count == 1  # offset 4 waits for a COMMIT


async def test_rollback_without_auto_commit_consumes_every_uncommitted_message_again() -> None:
    calls: list[int] = []

    async def handler(msg: MessageExt, ctx: ConsumeContext) -> ConsumeResult:
        ctx.auto_commit = False
        calls.append(msg.queue_offset)
        if msg.queue_offset == 2:
            return ConsumeResult.COMMIT
        if msg.queue_offset == 1 and calls.count(1) == 1:
            return ConsumeResult.ROLLBACK
        return ConsumeResult.SUCCESS

    h = _Harness(handler)
    await h.run(range(0, 3), lambda: len(calls) == 5)
    # 0 held, 1 rolled back: both come again, in order, after the suspend time.
    assert calls == [0, 1, 0, 1, 2]
    assert h.offsets.updates == [3]
    assert h.pq.msg_count == 0
    # As Java's statistics: the rolled-back call counts its messages neither consumed nor
    # failed; the calls that answered SUCCESS or COMMIT count theirs as consumed.
    totals = h.stats.totals["T"]
    assert (totals.consumed, totals.failed) == (4, 0)


async def test_rollback_and_commit_with_auto_commit_acknowledge_as_java_does() -> None:
    """With auto-commit on (the default) Java treats COMMIT and ROLLBACK as SUCCESS, with a
    warning: the offset moves on and nothing is consumed again."""
    calls: list[int] = []

    async def handler(msg: MessageExt) -> ConsumeResult:
        calls.append(msg.queue_offset)
        return ConsumeResult.ROLLBACK if msg.queue_offset == 0 else ConsumeResult.COMMIT

    h = _Harness(handler)
    with capture_logs() as logs:
        h.service.start()
        try:
            h.put(range(0, 2))
            await h.until(lambda: h.offsets.updates[-1:] == [2])
        finally:
            await h.service.aclose()
    assert calls == [0, 1]
    assert h.offsets.updates == [1, 2]
    warned = [e["result"] for e in logs if e["event"] == "orderly.result_ignored_with_auto_commit"]
    assert warned == ["ROLLBACK", "COMMIT"]


async def test_a_suspend_after_successes_commits_them_and_retries_only_the_failing_one() -> None:
    calls: list[int] = []

    async def handler(msg: MessageExt) -> None:
        calls.append(msg.queue_offset)
        if msg.queue_offset == 1 and calls.count(1) == 1:
            raise ValueError("once")

    h = _Harness(handler, batch_size=3)
    await h.run(range(0, 3), lambda: len(calls) == 4)
    assert calls == [0, 1, 1, 2]
    assert h.offsets.updates == [1, 3]
    totals = h.stats.totals["T"]
    # The failed call counts its one message; offset 2, never handed over in the first
    # batch, is not counted failed.
    assert (totals.consumed, totals.failed) == (3, 1)
    # One duration sample per listener call: two in the first batch, two in the second.
    assert totals.consume_seconds.count == 4


async def test_dead_lettered_messages_count_as_failed_not_consumed() -> None:
    async def handler(msg: MessageExt) -> None:
        if msg.queue_offset == 1:
            raise DeadLetter("poison")

    h = _Harness(handler, batch_size=3, broadcasting=True)
    await h.run(range(0, 3), lambda: h.offsets.updates[-1:] == [3])
    totals = h.stats.totals["T"]
    assert (totals.consumed, totals.failed) == (2, 1)  # as the concurrent service counts


async def test_a_dead_letter_send_that_fails_midway_does_not_send_the_others_again() -> None:
    """Two poison messages in one call; the DLQ send of the second fails once. The call is
    tried again in place, without the first, which is in the dead-letter queue already (it
    was produced there twice and counted three times for two messages)."""
    from rmq_async.client.errors import MQClientError

    sent: list[int] = []
    failures = {1}
    calls: list[list[int]] = []

    async def handler(msgs: list[MessageExt]) -> None:
        calls.append([m.queue_offset for m in msgs])
        raise DeadLetter("poison")

    async def send_message(addr: str, mq: MessageQueue, **kw: Any) -> None:
        offset = int(kw["body"][1:])
        if offset in failures:
            failures.discard(offset)
            raise MQClientError("broker busy")
        sent.append(offset)

    async def master(*args: Any) -> str:
        return "127.0.0.1:10911"

    async def no_send_back(msg: MessageExt, level: int) -> bool:
        return False

    h = _Harness(handler, batch=True, batch_size=2)
    h.rt.instance = SimpleNamespace(find_broker_master=master,
                                    api=SimpleNamespace(send_message=send_message))
    h.rt.send_message_back = no_send_back
    await h.run(range(0, 2), lambda: h.offsets.updates[-1:] == [2])
    assert sent == [0, 1] and calls == [[0, 1], [1]]
    totals = h.stats.totals["T"]
    # Failed once per failed attempt: 0 once, 1 twice (the attempt whose DLQ send failed).
    assert (totals.dead_lettered, totals.failed, totals.consumed) == (2, 3, 0)
    assert h.pq.msg_count == 0


async def test_messages_settled_without_the_handler_do_not_commit_what_it_holds() -> None:
    """A body its model cannot read is dead-lettered before the handler runs: that settles
    it, but must not commit the messages the handler answered SUCCESS without auto-commit,
    which wait for its COMMIT (a crash before it redelivers them)."""
    seen: list[int] = []

    async def handler(order: dict[str, int], ctx: ConsumeContext) -> ConsumeResult:
        ctx.auto_commit = False
        seen.append(order["id"])
        return ConsumeResult.SUCCESS

    h = _Harness(handler, broadcasting=True, model=dict)
    bodies = [b'{"id": 0}', b'{"id": 1}', b"not json", b'{"id": 3}']
    msgs = [MessageExt("T", body, 0, i) for i, body in enumerate(bodies)]
    h.service.start()
    try:
        h.service.submit(msgs, h.pq, MQ, h.pq.put_messages(msgs))
        await h.until(lambda: seen == [0, 1, 3])
    finally:
        await h.service.aclose()
    assert h.offsets.updates == []  # nothing committed without a COMMIT
    # The dead-lettered one is done; the three the handler holds stay taken.
    assert (h.pq.msg_count, h.pq.consuming_count) == (3, 3)


async def test_a_rollback_does_not_dead_letter_a_message_again() -> None:
    calls: list[int] = []

    async def handler(msg: MessageExt, ctx: ConsumeContext) -> ConsumeResult:
        ctx.auto_commit = False
        calls.append(msg.queue_offset)
        if msg.queue_offset == 1:
            raise DeadLetter("poison")
        if msg.queue_offset == 2:
            return ConsumeResult.ROLLBACK if calls.count(2) == 1 else ConsumeResult.COMMIT
        return ConsumeResult.SUCCESS

    h = _Harness(handler, broadcasting=True)
    with capture_logs() as logs:
        h.service.start()
        try:
            h.put(range(0, 3))
            await h.until(lambda: h.offsets.updates[-1:] == [3])
        finally:
            await h.service.aclose()
    # 0 held, 1 dead-lettered, 2 rolled back with 0; then 0 and 2 again (not 1), committed.
    assert calls == [0, 1, 2, 0, 2]
    dead = [e["offset"] for e in logs if e["event"] == "orderly.broadcast_dead_letter_dropped"]
    assert dead == [1]
    assert h.pq.msg_count == 0


def test_no_duration_sample_without_a_listener_call() -> None:
    """Messages settled without a listener call (no handler for their tag) are counted, but
    add no 0 ms sample to the consume RT that mqadmin shows."""
    stats = ConsumerStats()
    stats.record_consume("T", 1, 0, 0.010, calls=1)
    stats.record_consume("T", 3, 0, 0.0, calls=0)
    totals = stats.totals["T"]
    assert totals.consumed == 4 and totals.consume_seconds.count == 1
    assert stats.snapshot("T")["consumeRT"] == 10.0


async def test_a_middleware_filtering_a_duplicate_out_commits_nothing_held() -> None:
    """A dedup middleware that hands the handler no message (a duplicate) answers for the
    call: that must not commit what the handler holds for its COMMIT."""
    seen: list[int] = []

    async def handler(msg: MessageExt, ctx: ConsumeContext) -> ConsumeResult:
        ctx.auto_commit = False
        seen.append(msg.queue_offset)
        return ConsumeResult.SUCCESS

    h = _Harness(handler, broadcasting=True)

    async def dedup(call: Any, call_next: Any) -> None:
        fresh = [m for m in call.messages if m.queue_offset != 2]
        await call_next(dataclasses.replace(call, messages=fresh))

    h.rt.subscriptions.middlewares.append(dedup)
    await h.run(range(0, 4), lambda: seen == [0, 1, 3])
    assert h.offsets.updates == []
    # 0, 1 and 3 held; the duplicate stays taken too, committed with them at the COMMIT.
    assert h.pq.consuming_count == 4


async def test_a_held_message_out_of_retries_is_not_handed_out_again_by_a_rollback() -> None:
    calls: list[int] = []

    async def handler(msg: MessageExt, ctx: ConsumeContext) -> ConsumeResult:
        ctx.auto_commit = False
        calls.append(msg.queue_offset)
        if msg.queue_offset == 1:
            return ConsumeResult.SUSPEND_CURRENT_QUEUE_A_MOMENT
        if msg.queue_offset == 2:
            return ConsumeResult.ROLLBACK if calls.count(2) == 1 else ConsumeResult.COMMIT
        return ConsumeResult.SUCCESS

    h = _Harness(handler, broadcasting=True, max_reconsume_times=1)
    with capture_logs() as logs:
        h.service.start()
        try:
            h.put(range(0, 3))
            await h.until(lambda: h.offsets.updates[-1:] == [3])
        finally:
            await h.service.aclose()
    # 1 tried twice, then out of retries; 2's ROLLBACK brings back 0, not 1.
    assert calls == [0, 1, 1, 2, 0, 2]
    exhausted = [e for e in logs if e["event"] == "orderly.broadcast_retries_exhausted"]
    assert len(exhausted) == 1


@pytest.mark.parametrize("raises", ["own-cancelled-error", "base-exception"])
async def test_a_handler_raising_cancelled_error_of_its_own_suspends_the_queue_only(
        raises: str) -> None:
    """A ``CancelledError`` the handler raised itself (it awaited a task that was cancelled),
    or a ``BaseException`` that is not an ``Exception``, is a failure, retried in place: it
    ended the only worker with the queue marked as consuming, and the queue was never
    consumed again."""
    calls: list[int] = []

    async def handler(msg: MessageExt) -> None:
        calls.append(msg.queue_offset)
        if msg.queue_offset == 1 and calls.count(1) == 1:
            if raises == "base-exception":
                raise NotAnException("pytest.fail() in the listener")
            task = asyncio.ensure_future(asyncio.sleep(10))
            await asyncio.sleep(0)
            task.cancel()
            await task

    h = _Harness(handler)
    h.service.start()
    try:
        h.put(range(0, 3))
        await h.until(lambda: h.offsets.updates[-1:] == [3])
        h.put(range(3, 5))
        await h.until(lambda: h.offsets.updates[-1:] == [5])
    finally:
        await h.service.aclose()
    assert calls == [0, 1, 1, 2, 3, 4]


def _held_batch(monkeypatch: pytest.MonkeyPatch) -> tuple[_Harness, asyncio.Event, list[int]]:
    """A harness whose handler holds each message until the event is set, with a short
    UNLOCK_WAIT; and the offsets handed to it."""
    monkeypatch.setattr(orderly_module, "UNLOCK_WAIT", 0.2)
    gate = asyncio.Event()
    calls: list[int] = []

    async def handler(msg: MessageExt) -> None:
        calls.append(msg.queue_offset)
        await gate.wait()

    return _Harness(handler), gate, calls


async def test_a_queue_given_up_while_its_batch_runs_is_not_unlocked(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The rebalance gives a queue up while a batch of it is still running past UNLOCK_WAIT:
    it was unlocked at the broker anyway (another client could consume the queue beside that
    batch) and its consume lock dropped (this client, taking the queue again, consumed it
    beside that batch). Java leaves the broker lock to expire."""
    h, gate, calls = _held_batch(monkeypatch)
    unlocked: list[MessageQueue] = []

    async def unlock(mq: MessageQueue) -> None:
        unlocked.append(mq)

    h.service.unlock = unlock  # type: ignore[method-assign]
    h.offsets.persist = lambda mq: asyncio.sleep(0)  # type: ignore[attr-defined]
    h.service.start()
    try:
        h.put(range(0, 1))
        await h.until(lambda: calls == [0])
        del h.rt.process_queues[MQ]  # what the rebalancer does before it releases the queue
        h.pq.dropped = True
        await h.service.release(MQ, h.pq)
        assert unlocked == []
        # Taken again by this client: its first turn waits for the batch still running.
        again = ProcessQueue()
        again.locked = True
        again.last_lock_timestamp = time.monotonic() + 3600
        h.rt.process_queues[MQ] = again
        msgs = [MessageExt("T", b"m1", 0, 1)]
        h.service.submit(msgs, again, MQ, again.put_messages(msgs))
        await asyncio.sleep(0.3)
        assert calls == [0]
        gate.set()
        await h.until(lambda: calls == [0, 1])
        await h.service.release(MQ, again)
        assert unlocked == [MQ]  # a queue whose batch ended is unlocked as before
    finally:
        gate.set()
        await h.service.aclose()


async def test_a_release_that_outlives_unlock_wait_during_stop_persists_and_ends(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """stop() lets a rebalance round under way finish after the orderly service's tasks are
    closed; a release whose batch still ran (a listener thread that ignores cancellation)
    then tried to defer on the closed task owner, failed, and the queue missed its persist."""
    monkeypatch.setattr(orderly_module, "UNLOCK_WAIT", 0.1)
    h = _Harness(lambda msg: None)
    persisted: list[MessageQueue] = []

    async def persist(mq: MessageQueue) -> None:
        persisted.append(mq)

    h.offsets.persist = persist  # type: ignore[attr-defined]
    h.service.start()
    running_batch = h.service.consume_lock(MQ)
    await running_batch.acquire()  # the batch that outlives the stop
    await h.service.aclose()
    h.rt.stopping = True
    del h.rt.process_queues[MQ]
    h.pq.dropped = True
    assert await h.service.release(MQ, h.pq) is False
    assert persisted == [MQ] and not h.pq.locked


async def _consume_retry_queue(h: _Harness, origins: str) -> None:
    """Hand ``h``'s service a retry queue whose messages 0, 1, ... were first sent to the
    topics ``origins`` names (a letter each), and wait until all of them are committed."""
    retry = MessageQueue(h.rt.retry_topic, "broker-a", 0)
    h.rt.process_queues[retry] = h.pq
    msgs = [MessageExt(h.rt.retry_topic, b"m", 0, i, properties={PROPERTY_RETRY_TOPIC: topic})
            for i, topic in enumerate(origins)]
    h.service.start()
    try:
        h.service.submit(msgs, h.pq, retry, h.pq.put_messages(msgs))
        await h.until(lambda: h.offsets.updates[-1:] == [len(msgs)])
    finally:
        await h.service.aclose()


async def test_a_retry_queue_batch_goes_to_each_topics_own_handler() -> None:
    """A consumer whose subscriptions are all orderly consumes its retry queue in order too;
    a batch of it can hold messages of several topics, and each went to the first one's
    handler (with ``model=``, a wrong model's decode failure dead-lettered it)."""
    got: dict[str, list[int]] = {"T": [], "U": []}

    def on_t(msgs: list[MessageExt]) -> None:
        got["T"].extend(m.queue_offset for m in msgs)

    def on_u(msgs: list[MessageExt]) -> None:
        got["U"].extend(m.queue_offset for m in msgs)

    h = _Harness(on_t, batch=True, batch_size=8)
    consumer_subs = h.rt.subscriptions
    other = PushConsumer("G_settle", namesrv="127.0.0.1:9876")
    other.subscribe("U", listener=on_u, orderly=True, batch=True)
    consumer_subs.add(other.subscriptions.topics["U"])
    await _consume_retry_queue(h, "TUUT")
    assert got == {"T": [0, 3], "U": [1, 2]}
    # ... and each topic's statistics count its own.
    assert {t: (h.stats.totals[t].consumed, h.stats.totals[t].failed) for t in "TU"} == {
        "T": (2, 0), "U": (2, 0)}



@pytest.mark.parametrize("send_back_fails_once", [False, True])
async def test_a_retry_message_of_a_topic_no_longer_subscribed_is_sent_back_not_held(
        send_back_fails_once: bool) -> None:
    """An all-orderly consumer's retry queue holds a message of a topic it no longer
    subscribes to: no handler takes it, and it was retried in place for ever (orderly
    retries are unlimited by default), holding every retry message behind it. It is sent
    back as failed now, as the concurrent service sends it (the dead-letter queue after
    max_reconsume_times); a send that fails is tried again after the pause."""
    got: list[int] = []
    sent_back: list[int] = []
    refuse = {1} if send_back_fails_once else set()

    def on_t(msgs: list[MessageExt]) -> None:
        got.extend(m.queue_offset for m in msgs)

    async def send_back(msg: MessageExt, level: int) -> bool:
        if msg.queue_offset in refuse:
            refuse.discard(msg.queue_offset)
            return False
        sent_back.append(msg.queue_offset)
        return True

    h = _Harness(on_t, batch=True, batch_size=8)
    h.rt.send_message_back = send_back
    await _consume_retry_queue(h, "TXXT")
    assert got == [0, 3] and sent_back == [1, 2]


async def test_a_retry_message_sent_back_while_others_wait_for_a_commit_goes_once() -> None:
    """Without auto-commit, earlier messages wait for a COMMIT: a retry message of a topic no
    longer subscribed, sent back meanwhile, stayed taken, and a ROLLBACK handed it out again
    to be sent back a second time."""
    sent_back: list[int] = []
    rolled_back: list[int] = []

    async def handler(msg: MessageExt, ctx: ConsumeContext) -> ConsumeResult:
        ctx.auto_commit = False
        if msg.queue_offset == 2:
            if not rolled_back:
                rolled_back.append(2)
                return ConsumeResult.ROLLBACK
            return ConsumeResult.COMMIT
        return ConsumeResult.SUCCESS

    async def send_back(msg: MessageExt, level: int) -> bool:
        sent_back.append(msg.queue_offset)
        return True

    h = _Harness(handler)
    h.rt.send_message_back = send_back
    await _consume_retry_queue(h, "TXT")
    assert sent_back == [1] and rolled_back == [2]


async def test_a_busy_queue_given_up_is_unlocked_once_its_batch_ends(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The queue given up while its batch ran on: once the batch ends, what it committed is
    persisted, then its offset entry dropped and the queue unlocked (it stayed locked until
    the broker's lock expired, and the batch's commit was never persisted: the next owner
    consumed it again). Meanwhile the queue is not to be taken again."""
    h, gate, calls = _held_batch(monkeypatch)
    steps: list[tuple[str, object]] = []

    async def unlock(mq: MessageQueue) -> None:
        steps.append(("unlock", mq))

    async def persist(mq: MessageQueue) -> None:
        steps.append(("persist", h.offsets.updates[-1] if h.offsets.updates else None))

    h.service.unlock = unlock  # type: ignore[method-assign]
    h.offsets.persist = persist  # type: ignore[attr-defined]
    h.offsets.remove = lambda mq: steps.append(("remove", mq))  # type: ignore[attr-defined]
    h.service.start()
    try:
        h.put(range(0, 1))
        await h.until(lambda: calls == [0])
        del h.rt.process_queues[MQ]
        h.pq.dropped = True
        assert await h.service.release(MQ, h.pq) is False  # deferred
        # What was committed at the release is persisted at once (nothing yet here), in
        # case the deferred release gives up.
        assert steps == [("persist", None)] and h.service.releasing(MQ)
        gate.set()
        await h.until(lambda: not h.service.releasing(MQ))
        # The batch's commit (offset 1), persisted before the entry goes and the unlock.
        assert steps == [("persist", None), ("persist", 1), ("remove", MQ), ("unlock", MQ)]
    finally:
        gate.set()
        await h.service.aclose()


@pytest.mark.parametrize("how", ["lock_lost", "lock_expired", "dropped", "stopping"])
async def test_a_batch_of_per_message_calls_stops_when_the_queue_may_not_go_on(
        how: str) -> None:
    """Between the per-message calls of one taken batch nothing was checked: with the lock
    lost to another client (or expired, the queue given up, the consumer stopping) the rest
    of the batch was still handled here, beside its new owner. The rest now goes back."""
    calls: list[int] = []
    h: _Harness

    async def handler(msg: MessageExt) -> None:
        calls.append(msg.queue_offset)
        if msg.queue_offset == 0:
            if how == "lock_lost":
                h.pq.locked = False  # lock_all: another client holds it now
            elif how == "lock_expired":
                h.pq.last_lock_timestamp = time.monotonic() - 3600
            elif how == "dropped":
                h.pq.dropped = True
            else:
                h.rt.stopping = True

    h = _Harness(handler, batch_size=8)
    relock = asyncio.Event()

    async def lock(mq: MessageQueue) -> bool:  # LOCK_BATCH_MQ, granted once let through
        await relock.wait()
        h.pq.locked = True
        h.pq.last_lock_timestamp = time.monotonic()
        return True

    h.service.lock = lock  # type: ignore[method-assign]
    h.service.start()
    try:
        h.put(range(0, 8))
        await h.until(lambda: len(calls) >= 1)
        assert calls == [0]
        assert h.offsets.updates == [1]  # the call made is settled
        if how in ("dropped", "stopping"):
            return
        assert h.pq.msg_count == 7  # the rest is back, to be consumed in order
        relock.set()  # the lock is taken again: the queue goes on where it stopped
        await h.until(lambda: len(calls) == 8)
        assert calls == list(range(8)) and h.offsets.updates[-1] == 8
    finally:
        relock.set()
        await h.service.aclose()

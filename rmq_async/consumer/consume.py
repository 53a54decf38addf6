"""Concurrent consumption: worker tasks run the handler on pulled chunks taken from an asyncio.Queue.

Each pulled chunk is queued as one request; each of the ``consume_concurrency`` workers takes
one chunk at a time and calls the handler on it: a batch handler in batches of
``consume_message_batch_max_size``, a per-message handler once per message (the batch size then
only sets how many messages a worker takes at a time). Each call goes through the middlewares
(:mod:`~rmq_async.consumer.middleware`), when there are any. The outcome of each call decides
what happens to every message of it:

* acknowledged (returned normally, or SUCCESS up to ``ack_index``): removed from the
  ProcessQueue;
* dead-lettered (``DeadLetter`` raised, or a body the ``model=`` could not decode): produced
  into ``%DLQ%<group>`` with the reason (:mod:`~rmq_async.consumer.dead_letter`), then removed;
* failed, clustering: sent back to the broker (CONSUMER_SEND_MSG_BACK), which redelivers it
  through ``%RETRY%<group>`` with a growing delay, or moves it to ``%DLQ%<group>`` after
  ``max_reconsume_times``; a message whose send-back fails stays cached and is consumed again
  locally after 5 s;
* failed, broadcasting: logged with its id and dropped (as the Java client does).

Once every batch of the chunk had its call, the chunk is settled at once: removing its messages
from the ProcessQueue yields the lowest offset still cached; that becomes the
queue's in-memory consume offset, unless the queue was dropped by a rebalance meanwhile, in
which case the result commits nothing.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import structlog

from rmq_async.consumer.dead_letter import send_to_dlq
from rmq_async.consumer.listener import Listener, ListenerAdapter
from rmq_async.consumer.middleware import Outcome, once_each, run_call
from rmq_async.consumer.options import MessageModel
from rmq_async.consumer.process_queue import ProcessQueue
from rmq_async.consumer.results import (
    ConsumeContext,
    ConsumeResult,
    DeadLetter,
    RetryLater,
    normalize_result,
)
from rmq_async.consumer.service import SEND_BACK_FAILED_RETRY_DELAY, BusyWorkers, PullRequest
from rmq_async.consumer.subscriptions import reset_retry_topic
from rmq_async.consumer.tasks import ABANDON_AFTER, TaskOwner, ends_the_caller
from rmq_async.protocol.message import put_each
from rmq_async.protocol.types import PROPERTY_CONSUME_START_TIME, MessageExt, MessageQueue

if TYPE_CHECKING:
    from rmq_async.consumer.runtime import ConsumerRuntime

log = structlog.get_logger(__name__)

__all__ = [
    "SEND_BACK_FAILED_RETRY_DELAY",
    "ConcurrentConsumeService",
    "ConsumeRequest",
    "Listener",
    "ListenerAdapter",
    "reset_retry_topic",
]


@dataclass(slots=True, eq=False)
class ConsumeRequest:
    """A pulled chunk, and how far its consumption got (read by the expired-message cleaner)."""

    msgs: list[MessageExt]
    pq: ProcessQueue
    mq: MessageQueue
    started_ms: int = 0
    """When the chunk's first call started (wall-clock ms)."""
    call_started_ms: int = 0
    """The ``CONSUME_START_TIME`` of its unanswered messages: the chunk's start, or when the
    cleaner last saw it answer more (its call in progress started before that)."""
    seen_done: int = 0
    """``done`` as the cleaner saw it last."""
    done: int = 0
    """Leading messages handed to the listener and answered (acknowledged or in ``failed``)."""
    failed: list[tuple[MessageExt, int]] = field(default_factory=list)
    dead: list[tuple[MessageExt, str]] = field(default_factory=list)
    """Messages bound for the dead-letter queue, with the reason."""
    settled: int = 0
    """Leading messages the cleaner already removed from the ProcessQueue (a stuck chunk)."""
    expired_seen: int = 0
    """``pq.expired_sent_back`` when the chunk started: while it is unchanged, the cleaner has
    sent back none of the queue's messages, so every message of the chunk is still cached."""
    skipped: int = 0
    """Messages of the chunk not handed to the listener because the cleaner sent them back."""


class ConcurrentConsumeService:
    """Runs the listener on pulled chunks with ``consume_concurrency`` worker tasks.

    The unit of work is the chunk one pull delivered (one :class:`ConsumeRequest`, one queue
    hop). A worker calls the listener on it in slices of ``consume_message_batch_max_size``,
    one after the other, then settles the whole chunk at once: one ProcessQueue removal, one
    offset update and one stats update, however many listener calls it took. Concurrency comes
    from the workers taking further chunks (of the same queue or others) meanwhile; a slow
    listener fills the ProcessQueues and the pull flow control holds the pulls back as usual.
    """

    #: Chunks of one queue may be with the listener at the same time.
    in_order = False

    def __init__(self, rt: ConsumerRuntime) -> None:
        self._rt = rt
        self._opts = rt.options
        self._queue: asyncio.Queue[ConsumeRequest] = asyncio.Queue()
        self._owner = TaskOwner(f"consume[{rt.group}]", family=rt.tasks)
        self._busy = BusyWorkers(rt.tasks.family)  # the workers with a chunk in hand
        self._draining = False
        self._inflight: set[ConsumeRequest] = set()
        # The consume-timeout cleaner and the settlements that send messages back take turns:
        # either could otherwise send back what the other is sending back or has just
        # acknowledged (a duplicate) while it awaits the broker. Settlements run side by side
        # (their chunks are apart); a look waits for those under way and holds new ones back.
        self._settling = 0
        self._settled = asyncio.Event()  # no settlement sending back
        self._settled.set()
        self._looked = asyncio.Event()  # no look of the cleaner under way
        self._looked.set()

    def start(self) -> None:
        for i in range(self._opts.consume_concurrency):
            self._owner.spawn(self._worker(), name=f"worker-{i}")
        self._owner.spawn(self._expired_cleaner(), name="expired-cleaner")

    @property
    def queued(self) -> int:
        return self._queue.qsize()

    def submit(self, msgs: list[MessageExt], pq: ProcessQueue, mq: MessageQueue,
               first: bool = False) -> None:
        """Queue one pulled chunk (all of one queue and one subscribed topic).

        When several handlers share the topic (by tag) the chunk is split, one request per
        handler, so that each request has one handler.
        """
        if not msgs:
            return
        subs = self._rt.subscriptions
        sub = subs.topics.get(subs.origin_topic(mq.topic, msgs))
        if sub is not None and sub.by_tag:
            parts: dict[int, list[MessageExt]] = {}
            for m in msgs:
                parts.setdefault(id(sub.adapter_for(m)), []).append(m)
            if len(parts) > 1:
                for part in parts.values():
                    self._queue.put_nowait(ConsumeRequest(part, pq, mq))
                return
        self._queue.put_nowait(ConsumeRequest(msgs, pq, mq))

    def pull_delay(self, topic: str) -> float:
        return 0.0  # the flow control on cached messages is enough

    async def pull_gate(self, req: PullRequest) -> float:
        return 0.0

    def submit_later(self, msgs: list[MessageExt], pq: ProcessQueue, mq: MessageQueue,
                     delay: float) -> None:
        self._owner.spawn(self._submit_after(msgs, pq, mq, delay), name=f"resubmit:{mq}")

    async def _submit_after(self, msgs: list[MessageExt], pq: ProcessQueue, mq: MessageQueue,
                            delay: float) -> None:
        await asyncio.sleep(delay)
        if not pq.dropped:
            # Not what the expired-message cleaner sent back meanwhile: it comes again
            # through the retry topic.
            msgs = [m for m in msgs if pq.contains(m)]
            if msgs:
                self.submit(msgs, pq, mq)

    async def wait_idle(self, caller: asyncio.Task[Any] | None = None) -> None:
        """Stop starting listener calls and wait until none is running but the one in
        ``caller`` (which called ``stop()``).

        Requests still queued stay unacknowledged in their ProcessQueues, so their offsets are
        not committed and they are delivered again later.
        """
        self._draining = True
        await self._busy.wait_idle(caller)

    async def aclose(self, *, abandon_after: float = ABANDON_AFTER) -> None:
        """End this service's tasks; one still running ``abandon_after`` seconds after its
        cancellation (a handler that swallows it) is left to end on its own, logged."""
        await self._owner.aclose(abandon_after=abandon_after)

    # ------------------------------------------------------------------ workers

    async def _worker(self) -> None:
        me = asyncio.current_task()
        assert me is not None
        busy = self._busy
        # (A worker spared by aclose, its handler having called stop(), ends here.)
        while not self._owner.closed:
            req = await self._queue.get()
            if req.pq.dropped or self._draining:
                continue
            call = busy.take(me)
            try:
                await self._consume(req)
            except BaseException as exc:
                if ends_the_caller(exc):
                    raise
                # A bug must not cost the consumer a worker. The chunk's messages are still
                # cached (nothing was removed), so they are consumed again after a pause.
                log.error("consume.chunk_failed", queue=str(req.mq), count=len(req.msgs),
                          error=f"{type(exc).__name__}: {exc}", exc_info=exc)
                if not req.pq.dropped and not self._draining:
                    self.submit_later(req.msgs, req.pq, req.mq, SEND_BACK_FAILED_RETRY_DELAY)
            finally:
                self._inflight.discard(req)
                busy.done(call)

    async def _consume(self, req: ConsumeRequest) -> None:
        rt = self._rt
        msgs = req.msgs
        pq = req.pq
        mq = req.mq
        if mq.topic == rt.retry_topic:
            reset_retry_topic(msgs, rt.retry_topic)
        topic = msgs[0].topic
        sub = rt.subscriptions.topics.get(topic)
        adapter = sub.adapter_for(msgs[0]) if sub is not None else None
        middlewares = rt.subscriptions.middlewares
        # The chunk is stamped once here. Its calls are not: the cleaner, which looks every
        # consume_timeout, stamps the unanswered messages of a chunk that answered more
        # since its last look, so only a call that made no progress for a whole interval is
        # taken for stuck (no clock read per call on this path).
        started_ms = int(time.time() * 1000)
        put_each(msgs, {PROPERTY_CONSUME_START_TIME: str(started_ms)})
        n = len(msgs)
        size = self._opts.consume_message_batch_max_size
        req.started_ms = req.call_started_ms = started_ms
        req.expired_seen = epoch = pq.expired_sent_back
        self._inflight.add(req)
        # Failed messages with the delay level their call asked for; poison with its reason.
        failed = req.failed
        dead = req.dead
        done = 0  # messages handed to the handler (acknowledged, failed or dead)
        calls = 0
        started = time.monotonic()
        if adapter is None:
            if sub is not None and sub.by_tag:
                # A redelivered message whose tag no handler takes any more: nothing wants it.
                log.info("consume.no_handler_for_tag", topic=topic, queue=str(mq),
                         tag=msgs[0].tags, count=n)
            else:
                log.warning("consume.no_listener", topic=topic, queue=str(mq))
                failed.extend((m, 0) for m in msgs)
            done = n
        elif not adapter.batch:
            # Per-message handler: one call per message, whatever the batch size (which stays
            # a throughput knob); a failing message fails alone, the others are acknowledged.
            fast = adapter.fn if adapter.plain and not middlewares else None
            success = ConsumeResult.SUCCESS
            for m in msgs:
                if calls and (self._draining or pq.dropped):
                    break  # no new handler call; the rest stays cached, unacknowledged
                if pq.expired_sent_back != epoch and not pq.contains(m):
                    # The cleaner sent it back while an earlier call of the chunk was stuck:
                    # it comes again through the retry topic, so no call here.
                    req.skipped += 1
                    done += 1
                    req.done = done
                    continue
                calls += 1
                if fast is not None:
                    try:
                        raw = await fast(m)
                    except DeadLetter as exc:
                        dead.append((m, exc.reason))
                    except BaseException as exc:
                        if ends_the_caller(exc):
                            raise
                        if not isinstance(exc, RetryLater):
                            log.warning("consume.handler_raised", topic=topic, queue=str(mq),
                                        offsets=[m.queue_offset], msg_ids=[m.msg_id],
                                        error=f"{type(exc).__name__}: {exc}")
                        failed.append((m, 0))
                    else:
                        if raw is not None and raw is not success \
                                and not normalize_result(raw).is_success:
                            failed.append((m, 0))
                else:
                    one = [m]
                    ctx = ConsumeContext(message_queue=mq)
                    outcome = await run_call(adapter, one, ctx, group=rt.group, topic=topic,
                                             queue=mq, orderly=False, middlewares=middlewares)
                    _apply_outcome(outcome, one, ctx, failed, dead)
                done += 1
                req.done = done
        else:
            # Batch handler. The direct form skips a coroutine layer per call for
            # ``async def f(msgs: list[MessageExt])``.
            direct = adapter.fn if adapter.plain and not middlewares else None
            success = ConsumeResult.SUCCESS
            while done < n:
                if calls and (self._draining or pq.dropped):
                    break  # no new handler call; the rest stays cached, unacknowledged
                batch = msgs[done:done + size] if (done or n > size) else msgs
                step = len(batch)
                if pq.expired_sent_back != epoch:
                    # Leave out what the cleaner sent back while an earlier call was stuck.
                    cached = [m for m in batch if pq.contains(m)]
                    req.skipped += step - len(cached)
                    if not cached:
                        done += step
                        req.done = done
                        continue
                    batch = cached
                calls += 1
                if direct is not None:
                    # The handler takes no context, so nothing can set an ack index or a
                    # delay level: a success acknowledges the whole call, a failure none.
                    try:
                        raw = await direct(batch)
                    except DeadLetter as exc:
                        dead.extend((m, exc.reason) for m in batch)
                        raw = success
                    except BaseException as exc:
                        if ends_the_caller(exc):
                            raise
                        if not isinstance(exc, RetryLater):
                            log.warning("consume.handler_raised", topic=topic, queue=str(mq),
                                        offsets=[m.queue_offset for m in batch[:16]],
                                        msg_ids=[m.msg_id for m in batch[:8]],
                                        error=f"{type(exc).__name__}: {exc}")
                        raw = ConsumeResult.RECONSUME_LATER
                    if raw is not None and raw is not success \
                            and not normalize_result(raw).is_success:
                        failed.extend((m, 0) for m in batch)
                else:
                    ctx = ConsumeContext(message_queue=mq)
                    outcome = await run_call(adapter, batch, ctx, group=rt.group, topic=topic,
                                             queue=mq, orderly=False, middlewares=middlewares)
                    _apply_outcome(outcome, batch, ctx, failed, dead)
                done += step
                req.done = done
        elapsed = time.monotonic() - started
        pq.last_consume_timestamp = time.monotonic()
        await self._settle(req, msgs[:done] if done < n else msgs, failed, elapsed, calls)

    async def _settle(self, req: ConsumeRequest, handled: list[MessageExt],
                      failed: list[tuple[MessageExt, int]], elapsed: float, calls: int) -> None:
        """One removal, one offset update and one stats update for the handled messages."""
        self._inflight.discard(req)
        if not (failed or req.dead):
            await self._settle_now(req, handled, failed, elapsed, calls)
            return
        while not self._looked.is_set():
            await self._looked.wait()
        self._settling += 1
        self._settled.clear()
        try:
            await self._settle_now(req, handled, failed, elapsed, calls)
        finally:
            self._settling -= 1
            if not self._settling:
                self._settled.set()

    async def _settle_now(self, req: ConsumeRequest, handled: list[MessageExt],
                          failed: list[tuple[MessageExt, int]], elapsed: float,
                          calls: int) -> None:
        rt = self._rt
        pq = req.pq
        dead = req.dead
        n_failed = len(failed) + len(dead)
        if (failed or dead) and (req.settled or pq.expired_sent_back != req.expired_seen):
            # The cleaner already sent back what it found expired: not twice.
            failed = [(m, level) for m, level in failed if pq.contains(m)]
            dead = [(m, reason) for m, reason in dead if pq.contains(m)]
        topic = handled[0].topic if handled else req.mq.topic
        if pq.dropped:
            # Rebalance took the queue away meanwhile: this result commits nothing, and its
            # messages come again, so only the calls' time is recorded (Java: the consume RT,
            # no OK or failed counts).
            rt.stats.record_consume(topic, 0, 0, elapsed, calls=calls)
            log.debug("consume.result_for_dropped_queue", queue=str(req.mq), count=len(handled))
            return
        # (Never below zero: a middleware's copies dead-lettered beside their originals.)
        ok = max(len(handled) - n_failed - req.skipped, 0)
        rt.stats.record_consume(topic, ok, n_failed, elapsed, calls=calls)
        to_remove = handled
        if failed or dead:
            if self._opts.message_model == MessageModel.BROADCASTING:
                if failed:
                    log.warning("consume.broadcast_failed_dropped", queue=str(req.mq),
                                msg_ids=[m.msg_id for m, _ in failed],
                                offsets=[m.queue_offset for m, _ in failed])
                for m, reason in dead:
                    log.warning("consume.broadcast_dead_letter_dropped", queue=str(req.mq),
                                msg_id=m.msg_id, offset=m.queue_offset, reason=reason)
            else:
                not_sent: list[MessageExt] = []
                for m, reason in dead:
                    if not await send_to_dlq(rt, m, reason):
                        not_sent.append(m)
                for m, level in failed:
                    if not await rt.send_message_back(m, level):
                        m.reconsume_times += 1
                        not_sent.append(m)
                if not_sent:
                    keep = {id(m) for m in not_sent}
                    to_remove = [m for m in handled if id(m) not in keep]
                    self.submit_later(not_sent, pq, req.mq, SEND_BACK_FAILED_RETRY_DELAY)
        if not to_remove:
            return
        offset = pq.remove_messages(to_remove)
        if offset >= 0 and not pq.dropped:
            rt.offset_store.update(req.mq, offset, increase_only=True)

    # ------------------------------------------------------------------ consume timeout

    async def _expired_cleaner(self) -> None:
        interval = self._opts.consume_timeout
        while True:
            await asyncio.sleep(interval)
            try:
                await self.clean_expired()
            except Exception as exc:  # a bug must not end consume-timeout handling for good
                log.error("consume.expired_cleaner_failed",
                          error=f"{type(exc).__name__}: {exc}", exc_info=exc)

    async def clean_expired(self) -> None:
        """Send back cached messages whose consumption started longer than consume_timeout ago.

        The messages of a chunk carry its start, and those unanswered are stamped again
        each time this finds that the chunk answered more since its last look, so a message
        expires only when its call (or the call it waits behind) made no progress for a whole
        interval, as in Java, where each call is stamped and the cleaner looks every
        ``consume_timeout``. A chunk running longer than the timeout has its messages answered
        so far removed first (they are acknowledged; only the settlement at the end of the
        chunk was missing), so that only a call stuck past the timeout and the messages
        behind it in its chunk, which no listener saw, go back to the broker, as in Java.
        Should the stuck call return after all, its worker hands none of the messages sent
        back to the listener (they come again through the retry topic) and sends none of them
        back a second time. A look waits for a chunk's settlement that is sending messages
        back, and a settlement that has some to send back waits for a look under way.
        """
        if self._opts.message_model != MessageModel.CLUSTERING:
            return
        while not self._looked.is_set():  # (a look called while another runs)
            await self._looked.wait()
        self._looked.clear()
        try:
            await self._settled.wait()
            await self._clean_expired()
        finally:
            self._looked.set()

    async def _clean_expired(self) -> None:
        rt = self._rt
        now_ms = int(time.time() * 1000)
        timeout_ms = int(self._opts.consume_timeout * 1000)
        for req in list(self._inflight):
            pq = req.pq
            done = req.done
            if done != req.seen_done:
                # It answered more since the last look: its call in progress started after
                # that, so its unanswered messages are stamped now; a call that answers
                # nothing until the next look has run a whole interval.
                req.seen_done = done
                if done < len(req.msgs):
                    put_each(req.msgs[done:], {PROPERTY_CONSUME_START_TIME: str(now_ms)})
                    req.call_started_ms = now_ms
            if pq.dropped or done <= req.settled or now_ms - req.started_ms <= timeout_ms:
                continue
            failed_ids = {id(m) for m, _ in req.failed} | {id(m) for m, _ in req.dead}
            acked = [m for m in req.msgs[req.settled:done] if id(m) not in failed_ids]
            req.settled = done
            # What the calls answered as failed or poison goes where its answer sends it now
            # (with its delay level, or to the dead-letter queue), not back with the expired
            # ones below (at level 3) because its stamp is old; the chunk's settlement skips
            # what is no longer cached.
            for m, level in list(req.failed):
                if pq.contains(m) and await rt.send_message_back(m, level):
                    acked.append(m)
            for m, reason in list(req.dead):
                if pq.contains(m) and await send_to_dlq(rt, m, reason):
                    acked.append(m)
            if acked:
                offset = pq.remove_messages(acked)
                if offset >= 0 and not pq.dropped:
                    rt.offset_store.update(req.mq, offset, increase_only=True)
                if now_ms - req.call_started_ms > timeout_ms:
                    log.info("consume.stuck_chunk_settled", queue=str(req.mq), count=len(acked),
                             stuck_offset=req.msgs[done].queue_offset
                             if done < len(req.msgs) else -1)
                else:
                    log.debug("consume.slow_chunk_settled", queue=str(req.mq), count=len(acked))
        for mq, pq in list(rt.process_queues.items()):
            if rt.subscriptions.is_orderly(mq.topic) or pq.dropped:
                continue
            expired = pq.clean_expired_messages(now_ms, timeout_ms)
            for m in expired:
                reset_retry_topic([m], rt.retry_topic)
                if await rt.send_message_back(m, 3):
                    pq.expired_sent_back += 1
                    offset = pq.remove_messages([m])
                    if offset >= 0 and not pq.dropped:
                        rt.offset_store.update(mq, offset, increase_only=True)
                    log.warning("consume.expired_sent_back", queue=str(mq),
                                offset=m.queue_offset, msg_id=m.msg_id)


def _apply_outcome(outcome: Outcome, batch: list[MessageExt], ctx: ConsumeContext,
                   failed: list[tuple[MessageExt, int]],
                   dead: list[tuple[MessageExt, str]]) -> None:
    """Sort the messages of one call into acknowledged (left alone), failed and dead."""
    rest = batch
    if outcome.acked:
        skipped = {id(m) for m in outcome.acked}
        rest = [m for m in rest if id(m) not in skipped]
    gone: set[int] = set()
    if ctx.dead_letters:
        poison = once_each(ctx.dead_letters, batch)
        dead.extend(poison)
        gone = {id(m) for m, _ in poison}
    # What ack_index counts over: the handler's own list, in its order, its dead letters in
    # place (a body its decoder left out never was in it); matched by queue offset, as a
    # middleware may have handed it copies. Not reached (a middleware answered): the call's.
    if ctx.messages:
        own = {m.queue_offset: m for m in rest}
        counted = [own.pop(m.queue_offset) for m in ctx.messages if m.queue_offset in own]
        counted += [m for m in own.values() if id(m) not in gone]
    else:
        counted = [m for m in rest if id(m) not in gone]
    if gone:
        rest = [m for m in rest if id(m) not in gone]
    if outcome.dead_reason is not None:
        dead.extend((m, outcome.dead_reason) for m in rest)
        return
    k = len(counted)
    ok = ctx.acked_count(k, outcome.result)
    if ok < k:
        level = ctx.delay_level_when_next_consume
        failed.extend((m, level) for m in counted[ok:] if id(m) not in gone)

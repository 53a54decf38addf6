"""Concurrent consumption: worker tasks run the listener on pulled chunks taken from an asyncio.Queue.

Each pulled chunk is queued as one request; each of the ``consume_concurrency`` workers takes
one chunk at a time and calls the listener on it in batches of ``consume_message_batch_max_size``.
The result of each call decides what happens to every message of its batch:

* acknowledged (SUCCESS up to ``ack_index``): removed from the ProcessQueue;
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

from rmq_async.consumer.listener import Listener, ListenerAdapter
from rmq_async.consumer.options import MessageModel
from rmq_async.consumer.process_queue import ProcessQueue
from rmq_async.consumer.results import ConsumeContext, ConsumeResult
from rmq_async.consumer.service import SEND_BACK_FAILED_RETRY_DELAY, PullRequest
from rmq_async.consumer.subscriptions import reset_retry_topic
from rmq_async.consumer.tasks import TaskOwner
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
    done: int = 0
    """Leading messages handed to the listener and answered (acknowledged or in ``failed``)."""
    failed: list[tuple[MessageExt, int]] = field(default_factory=list)
    settled: int = 0
    """Leading messages the cleaner already removed from the ProcessQueue (a stuck chunk)."""


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
        self._owner = TaskOwner(f"consume[{rt.group}]")
        self._in_flight = 0
        self._idle = asyncio.Event()
        self._idle.set()
        self._draining = False
        self._inflight: set[ConsumeRequest] = set()

    def start(self) -> None:
        for i in range(self._opts.consume_concurrency):
            self._owner.spawn(self._worker(), name=f"worker-{i}")
        self._owner.spawn(self._expired_cleaner(), name="expired-cleaner")

    @property
    def queued(self) -> int:
        return self._queue.qsize()

    def submit(self, msgs: list[MessageExt], pq: ProcessQueue, mq: MessageQueue,
               first: bool = False) -> None:
        """Queue one pulled chunk (all of one queue and one subscribed topic)."""
        if msgs:
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
            self.submit(msgs, pq, mq)

    async def wait_idle(self) -> None:
        """Stop starting listener calls and wait until none is running.

        Requests still queued stay unacknowledged in their ProcessQueues, so their offsets are
        not committed and they are delivered again later.
        """
        self._draining = True
        await self._idle.wait()

    async def aclose(self) -> None:
        await self._owner.aclose()

    # ------------------------------------------------------------------ workers

    async def _worker(self) -> None:
        while True:
            req = await self._queue.get()
            if req.pq.dropped or self._draining:
                continue
            self._in_flight += 1
            self._idle.clear()
            try:
                await self._consume(req)
            except Exception as exc:
                # A bug must not cost the consumer a worker. The chunk's messages are still
                # cached (nothing was removed), so they are consumed again after a pause.
                log.error("consume.chunk_failed", queue=str(req.mq), count=len(req.msgs),
                          error=f"{type(exc).__name__}: {exc}", exc_info=exc)
                if not req.pq.dropped and not self._draining:
                    self.submit_later(req.msgs, req.pq, req.mq, SEND_BACK_FAILED_RETRY_DELAY)
            finally:
                self._inflight.discard(req)
                self._in_flight -= 1
                if self._in_flight == 0:
                    self._idle.set()

    async def _consume(self, req: ConsumeRequest) -> None:
        rt = self._rt
        msgs = req.msgs
        pq = req.pq
        mq = req.mq
        if mq.topic == rt.retry_topic:
            reset_retry_topic(msgs, rt.retry_topic)
        topic = msgs[0].topic
        adapter = rt.subscriptions.listener_for(topic)
        started_ms = int(time.time() * 1000)
        now_ms = str(started_ms)
        for m in msgs:
            m.put_property(PROPERTY_CONSUME_START_TIME, now_ms)
        n = len(msgs)
        size = self._opts.consume_message_batch_max_size
        ctx = ConsumeContext(message_queue=mq)
        req.started_ms = started_ms
        self._inflight.add(req)
        # Failed messages with the delay level their call asked for.
        failed = req.failed
        done = 0  # messages handed to the listener (acknowledged or failed)
        calls = 0
        started = time.monotonic()
        if adapter is None:
            log.warning("consume.no_listener", topic=topic, queue=str(mq))
            failed.extend((m, 0) for m in msgs)
            done = n
        elif size == 1 and adapter.is_async and not adapter.wants_context:
            # The common case, one message per call of ``async def f(msgs)``: the listener is
            # awaited directly (no adapter coroutine) and cannot touch a context.
            fn = adapter.fn
            success = ConsumeResult.SUCCESS
            for m in msgs:
                if calls and (self._draining or pq.dropped):
                    break  # no new listener call; the rest stays cached, unacknowledged
                calls += 1
                try:
                    raw = await fn([m])
                except asyncio.CancelledError:
                    raise
                except Exception as exc:
                    log.warning("consume.listener_raised", topic=topic, queue=str(mq),
                                offsets=[m.queue_offset], msg_ids=[m.msg_id],
                                error=f"{type(exc).__name__}: {exc}")
                    raw = None
                if raw is not success and _as_concurrent_result(raw) is not success:
                    failed.append((m, 0))
                done += 1
                req.done = done
        else:
            # The direct form skips a coroutine layer per call for ``async def f(msgs)``.
            direct = adapter.fn if adapter.is_async and not adapter.wants_context else None
            while done < n:
                if calls and (self._draining or pq.dropped):
                    break  # no new listener call; the rest stays cached, unacknowledged
                batch = msgs[done:done + size] if (done or n > size) else msgs
                ctx.ack_index = None
                ctx.delay_level_when_next_consume = 0
                calls += 1
                try:
                    raw = await (direct(batch) if direct is not None else adapter(batch, ctx))
                    result = _as_concurrent_result(raw)
                except asyncio.CancelledError:
                    raise
                except Exception as exc:
                    log.warning("consume.listener_raised", topic=topic, queue=str(mq),
                                offsets=[m.queue_offset for m in batch],
                                msg_ids=[m.msg_id for m in batch[:8]],
                                error=f"{type(exc).__name__}: {exc}")
                    result = ConsumeResult.RECONSUME_LATER
                k = len(batch)
                ok = ctx.acked_count(k, result)
                if ok < k:
                    level = ctx.delay_level_when_next_consume
                    failed.extend((m, level) for m in batch[ok:])
                done += k
                req.done = done
        elapsed = time.monotonic() - started
        pq.last_consume_timestamp = time.monotonic()
        await self._settle(req, msgs[:done] if done < n else msgs, failed, elapsed, calls)

    async def _settle(self, req: ConsumeRequest, handled: list[MessageExt],
                      failed: list[tuple[MessageExt, int]], elapsed: float, calls: int) -> None:
        """One removal, one offset update and one stats update for the handled messages."""
        rt = self._rt
        pq = req.pq
        self._inflight.discard(req)
        if req.settled and failed:
            # The cleaner already sent back what it found expired: not twice.
            failed = [(m, level) for m, level in failed if pq.contains(m)]
        rt.stats.record_consume(handled[0].topic if handled else req.mq.topic,
                               len(handled) - len(failed), len(failed), elapsed, calls=calls)
        if pq.dropped:
            # Rebalance took the queue away meanwhile: this result commits nothing.
            log.debug("consume.result_for_dropped_queue", queue=str(req.mq), count=len(handled))
            return
        to_remove = handled
        if failed:
            if self._opts.message_model == MessageModel.BROADCASTING:
                log.warning("consume.broadcast_failed_dropped", queue=str(req.mq),
                            msg_ids=[m.msg_id for m, _ in failed],
                            offsets=[m.queue_offset for m, _ in failed])
            else:
                not_sent: list[MessageExt] = []
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
            await self.clean_expired()

    async def clean_expired(self) -> None:
        """Send back cached messages whose consumption started longer than consume_timeout ago.

        A chunk stuck in a listener call that does not return has its messages answered
        before that call removed first (they are acknowledged; only the settlement at the end
        of the chunk was missing), so that only the stuck message and those behind it, which
        no listener saw, go back to the broker, as in Java.
        """
        rt = self._rt
        if self._opts.message_model != MessageModel.CLUSTERING:
            return
        now_ms = int(time.time() * 1000)
        timeout_ms = int(self._opts.consume_timeout * 1000)
        for req in list(self._inflight):
            pq = req.pq
            done = req.done
            if pq.dropped or done <= req.settled or now_ms - req.started_ms <= timeout_ms:
                continue
            failed_ids = {id(m) for m, _ in req.failed}
            acked = [m for m in req.msgs[req.settled:done] if id(m) not in failed_ids]
            req.settled = done
            if acked:
                offset = pq.remove_messages(acked)
                if offset >= 0 and not pq.dropped:
                    rt.offset_store.update(req.mq, offset, increase_only=True)
                log.info("consume.stuck_chunk_settled", queue=str(req.mq), count=len(acked),
                         stuck_offset=req.msgs[done].queue_offset if done < len(req.msgs) else -1)
        for mq, pq in list(rt.process_queues.items()):
            if rt.subscriptions.is_orderly(mq.topic) or pq.dropped:
                continue
            expired = pq.clean_expired_messages(now_ms, timeout_ms)
            for m in expired:
                reset_retry_topic([m], rt.retry_topic)
                if await rt.send_message_back(m, 3):
                    offset = pq.remove_messages([m])
                    if offset >= 0 and not pq.dropped:
                        rt.offset_store.update(mq, offset, increase_only=True)
                    log.warning("consume.expired_sent_back", queue=str(mq),
                                offset=m.queue_offset, msg_id=m.msg_id)


def _as_concurrent_result(raw: Any) -> ConsumeResult:
    if isinstance(raw, ConsumeResult):
        return raw
    if raw is None:
        return ConsumeResult.RECONSUME_LATER
    log.warning("consume.unexpected_result", result=repr(raw))
    return ConsumeResult.RECONSUME_LATER

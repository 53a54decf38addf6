"""Sink consumption: pulled chunks go to the subscription's sink, which acknowledges them later.

A sink (:class:`~rmq_async.sinks.spark.SparkSink`) takes chunks with ``offer(msgs, ack)`` and
calls ``ack(ok)`` once their batch was written (or failed to be). Until then the messages stay
cached in their ProcessQueue, so the pull flow control bounds what the sink holds; the sink is
told that bound (``set_flow_limit``; its batches close at half of it) and is asked to close its
open batch early (``expedite``) when a queue stops pulling. While the sink has a closed batch
waiting for its writer, its topic is not pulled (:meth:`SinkConsumeService.pull_delay`). When
every queue of the topic has been read to the end the broker reported with its last chunk, the
sink hears so (``caught_up``; with ``flush_when_caught_up`` it writes its open batch as soon as
the writer is free instead of waiting for ``max_batch_latency``).

The verdict decides what happens to the chunk:

* written: removed from the ProcessQueue, the queue's offset moves to the lowest message still
  cached, unless the queue was dropped meanwhile (then nothing is committed);
* failed, clustering: each message is sent back (CONSUMER_SEND_MSG_BACK) and redelivered
  through ``%RETRY%<group>``; once handed back it no longer holds the offset. At most
  :data:`SEND_BACK_PARALLEL` send-backs are in flight over all of the consumer's failed chunks
  (a failed batch holds thousands of rows): the broker runs them on its send threads and sheds
  requests that waited in their queue longer than ``waitTimeMillsInSendQueue`` (200 ms by
  default) as SYSTEM_BUSY;
* failed, and not handed back (broadcasting, or the broker did not take it): it stays cached,
  so the offset cannot pass it, and is offered to the sink again after a pause. A sink's data
  is never dropped.

A sink subscription's pulls usually arrive undecoded, as one
:class:`~rmq_async.protocol.stored.StoredChunk` each (see :mod:`rmq_async.protocol.stored`):
the ProcessQueue holds it as one entry, the sink converts its body straight to Arrow, and only a
failed chunk is decoded into messages (to be sent back one by one).

Rows keep the coordinates of the queue they were read from (a redelivered message keeps
``%RETRY%<group>`` as its topic and carries RETRY_TOPIC), so that
``(topic, broker_name, queue_id, queue_offset)`` stays a unique, idempotent row key.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import weakref
from collections import Counter
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import structlog

from rmq_async.consumer.options import MessageModel
from rmq_async.consumer.service import SEND_BACK_FAILED_RETRY_DELAY
from rmq_async.protocol.stored import StoredChunk
from rmq_async.protocol.types import PROPERTY_MAX_OFFSET, PROPERTY_RETRY_TOPIC
from rmq_async.sinks import SinkClosedError

if TYPE_CHECKING:
    from rmq_async.consumer.process_queue import ProcessQueue
    from rmq_async.consumer.runtime import ConsumerRuntime
    from rmq_async.consumer.service import PullRequest
    from rmq_async.protocol.types import MessageExt, MessageQueue
    from rmq_async.sinks.spark import SparkSink

log = structlog.get_logger(__name__)

#: What the sink service hands a sink: a pull's messages, or its undecoded records.
Chunk = list["MessageExt"] | StoredChunk

#: Failed messages are sent back this many at a time, over all failed chunks of a consumer.
SEND_BACK_PARALLEL = 32


class SinkConsumeService:
    """Hands pulled chunks to the sinks of their subscriptions and commits what they wrote.

    The sinks' own tasks run in the consumer's task owner (``start_sinks``); a failed chunk's
    send-back runs there too, so ``stop()`` ends it.
    """

    #: Sink subscriptions consume concurrently (``subscribe`` refuses ``orderly=True``).
    in_order = False

    def __init__(self, rt: ConsumerRuntime) -> None:
        self._rt = rt
        self._opts = rt.options
        # Queues whose last chunk ended before the queue's max offset (the broker holds more).
        self._behind: set[MessageQueue] = set()
        self._started: list[SparkSink] = []  # sinks whose writer this consumer started
        # Shared by every failed chunk's send-back (see the module docstring).
        self._send_back_slots = asyncio.Semaphore(SEND_BACK_PARALLEL)
        # The ProcessQueue each queue's last chunk came from: a new one is a new assignment.
        self._assigned: dict[MessageQueue, weakref.ref[ProcessQueue]] = {}

    def start(self) -> None:
        """Nothing to start: the sinks are started by :meth:`start_sinks`."""

    async def start_sinks(self) -> None:
        """Start the writer of each sink subscription not started yet: all of them when the
        consumer starts, a sink subscribed later when its subscription is taken in."""
        for sink in self._rt.subscriptions.sinks():
            if not any(sink is started for started in self._started):
                self._started.append(sink)
                await sink.start(self._rt.tasks)

    def submit(self, msgs: list[MessageExt], pq: ProcessQueue, mq: MessageQueue,
               first: bool = False) -> None:
        rt = self._rt
        sink = rt.subscriptions.sink_for(rt.subscriptions.origin_topic(mq.topic, msgs))
        if sink is None:  # the router sends only chunks of sink subscriptions
            log.warning("sink.no_sink", queue=str(mq), count=len(msgs))
            return
        self._offer(sink, msgs, pq, mq)
        if msgs and mq.topic != rt.retry_topic:
            last = msgs[-1]
            raw = last.get_property(PROPERTY_MAX_OFFSET)
            try:
                behind = raw is not None and int(raw) > last.queue_offset + 1
            except ValueError:
                behind = False
            self._note_position(sink, mq, behind)

    def submit_stored(self, chunk: StoredChunk, pq: ProcessQueue, mq: MessageQueue) -> None:
        """Take an undecoded chunk of a sink subscription (never of the retry topic)."""
        sink = self._rt.subscriptions.sink_for(mq.topic)
        if sink is None:
            log.warning("sink.no_sink", queue=str(mq), count=chunk.count)
            return
        self._offer(sink, chunk, pq, mq)
        self._note_position(sink, mq, chunk.max_offset > chunk.last_offset + 1)

    def _note_position(self, sink: SparkSink, mq: MessageQueue, behind: bool) -> None:
        """Track whether ``mq`` is read to its end (``behind``: its last chunk ended before
        the queue's max offset); tell the sink once every queue of its topic is (queues that
        never delivered count as read: they had nothing)."""
        if behind:
            self._behind.add(mq)
            return
        self._behind.discard(mq)
        rt = self._rt
        if not any(q in self._behind for q, p in rt.process_queues.items()
                   if q.topic == mq.topic and not p.dropped):
            sink.caught_up()

    def pull_delay(self, topic: str) -> float:
        """Pause pulling ``topic`` while its sink has a closed batch waiting for the writer.

        The retry queue is bounded by its own thresholds and is shared by all subscriptions
        of the group, so a slow sink does not hold it.
        """
        sink = self._rt.subscriptions.sink_for(topic)
        if sink is None or sink.want_more():
            return 0.0
        return self._opts.pull_time_delay_when_flow_control

    async def pull_gate(self, req: PullRequest) -> float:
        return 0.0

    def _sinks(self) -> list[SparkSink]:
        """The sinks started here (an unsubscribed one among them: it may still hold rows)
        and those subscribed but not started."""
        sinks = list(self._started)
        for sink in self._rt.subscriptions.sinks():
            if not any(sink is known for known in sinks):
                sinks.append(sink)
        return sinks

    async def wait_idle(self, caller: asyncio.Task[Any] | None = None) -> None:
        """Each sink writes what it holds (``caller`` is not looked at: a write that
        calls ``stop()`` is waited for, up to the stop's timeout)."""
        for sink in self._sinks():
            await sink.flush()

    async def aclose(self) -> None:
        """Close every sink side by side: one whose last write hangs does not keep the others
        from writing their last batch (the caller bounds the whole by its timeout, and a
        cancellation reaches every close still running)."""

        async def close(sink: SparkSink) -> None:
            with contextlib.suppress(Exception):
                await sink.aclose()

        await asyncio.gather(*(close(sink) for sink in self._sinks()))

    # ------------------------------------------------------------------ offer / acknowledge

    def _offer(self, sink: SparkSink, msgs: Chunk, pq: ProcessQueue, mq: MessageQueue, *,
               redelivered: bool = False) -> None:
        rt = self._rt
        if mq.topic != rt.retry_topic:
            self._tell_flow_limit(sink)
        try:
            held = self._assigned.get(mq)
            previous = held() if held is not None else None
            if previous is not pq:
                # The queue was given up and taken again: pulled anew from its committed
                # offset, maybe after another consumer wrote rows of it meanwhile. The sink
                # closes a batch holding rows of the earlier assignment, whose offset range
                # would otherwise span the rows the other consumer wrote. (An earlier
                # ProcessQueue that is gone has no rows in any batch: each chunk's
                # acknowledgement holds its ProcessQueue.)
                if previous is not None:
                    _queue_reassigned(sink, mq)
                self._assigned[mq] = weakref.ref(pq)
            ack = _ChunkAck(self, sink, msgs, pq, mq)
            if redelivered and _takes_redelivered(sink):
                sink.offer(msgs, ack, redelivered=True)
            else:  # the form every sink takes (the flag is newer)
                sink.offer(msgs, ack)
        except SinkClosedError:
            # While stopping: the messages stay cached, their offsets never move.
            if rt.stopping:
                log.warning("sink.offer_after_close", queue=str(mq), count=len(msgs))
                return
            # Closed under a running consumer (its own aclose() called, or a sink shared
            # with a consumer that stopped): loudly, and offered again after a pause (a
            # sink started again takes it), rather than held cached for good in silence.
            log.error("sink.closed_while_consuming", queue=str(mq), count=len(msgs),
                      first_offset=_first_offset(msgs))
            self._offer_again_later(sink, msgs, pq, mq)
            return
        except Exception as exc:
            # A bug in the sink must not end the pull loop that offered (its queue would not
            # be pulled until its pull expiry): the chunk stays cached and is offered again
            # after a pause, as a concurrent worker resubmits a chunk it failed to settle.
            log.error("sink.offer_failed", queue=str(mq), count=len(msgs),
                      first_offset=_first_offset(msgs), error=f"{type(exc).__name__}: {exc}",
                      exc_info=exc)
            self._offer_again_later(sink, msgs, pq, mq)
            return
        if rt.thresholds.queue_blocked(mq.topic, pq):
            sink.expedite()

    def _offer_again_later(self, sink: SparkSink, msgs: Chunk, pq: ProcessQueue,
                           mq: MessageQueue) -> None:
        try:
            # Offered again out of pull order (chunks after it may be written meanwhile): as
            # a redelivered chunk, so that no batch's offset range spans theirs.
            self._rt.tasks.spawn(self._offer_later(sink, msgs, pq, mq), name="sink-offer-again")
        except RuntimeError:  # the consumer is stopping: nothing commits, all comes again
            pass

    async def _offer_later(self, sink: SparkSink, msgs: Chunk, pq: ProcessQueue,
                           mq: MessageQueue) -> None:
        await asyncio.sleep(SEND_BACK_FAILED_RETRY_DELAY)
        if not pq.dropped and not self._rt.stopping:
            self._offer(sink, msgs, pq, mq, redelivered=True)

    def _acked(self, ok: bool, sink: SparkSink, msgs: Chunk, pq: ProcessQueue,
               mq: MessageQueue) -> None:
        """The sink's verdict on an offered chunk."""
        if ok:
            self._commit(msgs, pq, mq)
            return
        try:
            self._rt.tasks.spawn(self._failed(sink, msgs, pq, mq), name="sink-failed")
        except RuntimeError:  # the consumer is stopping: nothing commits, all is redelivered
            log.warning("sink.failed_chunk_left_uncommitted", queue=str(mq), count=len(msgs),
                        first_offset=_first_offset(msgs))

    def _tell_flow_limit(self, sink: SparkSink) -> None:
        """Report to ``sink`` what the flow control lets it hold on this client: the sum over
        the topics it is subscribed to (one sink may take several).

        A topic's queues are those the rebalancer counted when it last changed the topic's
        allocation, with the per-queue thresholds it computed from them: no count per chunk.
        """
        rt = self._rt
        thresholds = rt.thresholds
        max_span = self._opts.consume_concurrently_max_span
        rows = size = 0
        for topic, sub in rt.subscriptions.topics.items():
            if sub.sink is not sink:
                continue
            queues = thresholds.queues.get(topic, 0)
            if queues == 0:
                continue
            # A queue pulls while it caches at most `count` messages spanning at most
            # `max_span` offsets, so each queue can always hold this many messages of the
            # sink's batches.
            rows += queues * (min(thresholds.count_for(topic), max_span) + 1)
            size += queues * thresholds.size_mib_for(topic) * 1024 * 1024
        if rows:
            sink.set_flow_limit(rows, size)

    def _commit(self, msgs: Chunk, pq: ProcessQueue, mq: MessageQueue,
                *, stored: bool = True) -> None:
        """``msgs`` are stored (or handed back): forget them, move the in-memory offset."""
        rt = self._rt
        if pq.dropped:
            # Rebalance took the queue away meanwhile: this result commits nothing (and its
            # messages come again: not counted).
            return
        if stored:
            self._record(msgs, mq, ok=True)
        offset = (pq.remove_chunk(msgs) if isinstance(msgs, StoredChunk)
                  else pq.remove_messages(msgs))
        if offset >= 0 and not pq.dropped:
            rt.offset_store.update(mq, offset, increase_only=True)

    def _record(self, msgs: Chunk, mq: MessageQueue, *, ok: bool) -> None:
        """Count a written (``ok``) or failed chunk under its subscribed topics (a chunk of
        the retry queue can hold messages of several topics bound for one sink)."""
        rt = self._rt
        if isinstance(msgs, StoredChunk) or mq.topic != rt.retry_topic:
            topics: Mapping[str, int] = {mq.topic: len(msgs)}
        else:
            topics = Counter(m.properties.get(PROPERTY_RETRY_TOPIC, mq.topic) for m in msgs)
        for topic, n in topics.items():
            rt.stats.record_consume(topic, n if ok else 0, 0 if ok else n, 0.0, calls=0)

    async def _failed(self, sink: SparkSink, chunk: Chunk, pq: ProcessQueue,
                      mq: MessageQueue) -> None:
        """A chunk the sink could not write: hand it back to the broker, or offer it again."""
        rt = self._rt
        if pq.dropped:
            return  # its messages come again: not counted
        self._record(chunk, mq, ok=False)
        if isinstance(chunk, StoredChunk):
            # Its messages are handed back (and acknowledged) one by one from now on.
            msgs = chunk.messages()
            if not pq.unpack_chunk(chunk, msgs):
                return
        else:
            msgs = chunk
        if pq.dropped or not msgs:
            return
        not_sent = msgs
        if self._opts.message_model == MessageModel.CLUSTERING:
            sent_flags: list[bool] = []
            for start in range(0, len(msgs), SEND_BACK_PARALLEL):
                part = msgs[start:start + SEND_BACK_PARALLEL]
                sent_flags += await asyncio.gather(*(self._send_back(m) for m in part))
            not_sent = [m for m, sent in zip(msgs, sent_flags, strict=True) if not sent]
            if len(not_sent) < len(msgs):
                keep = {id(m) for m in not_sent}
                self._commit([m for m in msgs if id(m) not in keep], pq, mq, stored=False)
            log.info("sink.chunk_sent_back", queue=str(mq), count=len(msgs) - len(not_sent),
                     not_sent=len(not_sent))
        if not not_sent:
            return
        log.warning("sink.chunk_retried_locally", queue=str(mq), count=len(not_sent),
                    delay=SEND_BACK_FAILED_RETRY_DELAY)
        await asyncio.sleep(SEND_BACK_FAILED_RETRY_DELAY)
        if not pq.dropped and not rt.stopping:
            self._offer(sink, not_sent, pq, mq, redelivered=True)

    async def _send_back(self, msg: MessageExt) -> bool:
        async with self._send_back_slots:
            return await self._rt.send_message_back(msg, 0)


class _ChunkAck:
    """The ``ack`` handed to the sink with one chunk.

    One small object per chunk instead of a closure (a function, its cells and their tuple):
    it lives until the chunk's batch is written, so it is seen by every garbage collection
    meanwhile, and fewer such objects mean fewer and shorter collections.
    """

    __slots__ = ("_mq", "_msgs", "_pq", "_service", "_sink")

    def __init__(self, service: SinkConsumeService, sink: SparkSink, msgs: Chunk,
                 pq: ProcessQueue, mq: MessageQueue) -> None:
        self._service = service
        self._sink = sink
        self._msgs = msgs
        self._pq = pq
        self._mq = mq

    def __call__(self, ok: bool) -> None:
        self._service._acked(ok, self._sink, self._msgs, self._pq, self._mq)


def _queue_reassigned(sink: object, mq: MessageQueue) -> None:
    """Tell ``sink`` that rows of ``mq`` offered from now on are of a new assignment of the
    queue (a sink written before :meth:`MessageSink.queue_reassigned` is not told)."""
    hook = getattr(sink, "queue_reassigned", None)
    if hook is not None:
        log.debug("sink.queue_reassigned", queue=str(mq))
        hook(mq)


def _takes_redelivered(sink: object) -> bool:
    """Does ``sink.offer`` take the ``redelivered`` flag (a sink, or a wrapper of its offer,
    written before the flag takes two arguments)?"""
    try:
        params = inspect.signature(sink.offer).parameters  # type: ignore[attr-defined]
    except (TypeError, ValueError):
        return False
    return "redelivered" in params or any(
        p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())


def _first_offset(chunk: Chunk) -> int:
    if isinstance(chunk, StoredChunk):
        return chunk.first_offset
    return chunk[0].queue_offset if chunk else -1

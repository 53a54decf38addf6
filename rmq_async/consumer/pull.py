"""The pull loop: one long-poll PULL_MESSAGE in flight per assigned queue.

Each assigned queue has one pull task (owned by :class:`PullService`). Before each pull it
applies the consumer's flow control (cached count / size per queue, the concurrent span, the
pause flag, the consumption service's own backpressure); each check that fails delays the next
pull of that queue only. Answers are handled as the Java client does: FOUND messages go into
the queue's ProcessQueue and, as one chunk, to the consumption service of their topic (see
:mod:`rmq_async.consumer.service`); NO_NEW_MSG / NO_MATCHED_MSG pull again at once from the
returned offset; OFFSET_ILLEGAL drops the queue, fixes and persists its offset and asks the
rebalancer to recreate it; errors delay the next pull (broker flow control briefly, anything
else by the exception delay).
"""

from __future__ import annotations

import asyncio
import collections
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import structlog

from rmq_async.client.api import PendingPull, PullResult, PullStatus
from rmq_async.client.errors import MQBrokerError, MQClientError, is_acl_refusal
from rmq_async.client.instance import MASTER_ID
from rmq_async.consumer.events import ConsumerError, ConsumerErrorKind
from rmq_async.consumer.options import MessageModel
from rmq_async.consumer.service import PullRequest
from rmq_async.consumer.tasks import ABANDON_AFTER, TaskOwner
from rmq_async.protocol.codes import ResponseCode
from rmq_async.protocol.filter import tag_matches
from rmq_async.protocol.message import ProtocolError, stamp_delivered
from rmq_async.protocol.salvage import decode_messages_salvaging
from rmq_async.protocol.stored import StoredChunk
from rmq_async.protocol.types import (
    PROPERTY_MAX_OFFSET,
    PROPERTY_MIN_OFFSET,
    MessageExt,
    MessageQueue,
)
from rmq_async.remoting.errors import RemotingError

if TYPE_CHECKING:
    from rmq_async.consumer.runtime import ConsumerRuntime
    from rmq_async.consumer.service import ServiceRouter

log = structlog.get_logger(__name__)

MiB = 1024 * 1024

__all__ = ["PullRequest", "PullService"]


class _RateLimitedCounter:
    """Counts an event and logs it at most once per ``every`` occurrences."""

    def __init__(self, event: str, every: int = 1000) -> None:
        self.event = event
        self.every = every
        self.count = 0

    def hit(self, **fields: object) -> None:
        self.count += 1
        if self.count % self.every == 1:
            log.warning(self.event, times=self.count, **fields)


class PullService:
    """One pull task per assigned queue; each pulled chunk goes to ``router``.

    ``on_queue_forgotten`` is called when a queue was given up by the pull loop itself
    (OFFSET_ILLEGAL), so that the rebalancer recreates it.
    """

    def __init__(self, rt: ConsumerRuntime, router: ServiceRouter,
                 on_queue_forgotten: Callable[[], None]) -> None:
        self._rt = rt
        self._router = router
        self._on_queue_forgotten = on_queue_forgotten
        self._opts = rt.options
        self._owner = TaskOwner(f"pull[{rt.group}]", family=rt.tasks)
        self.requests: dict[MessageQueue, PullRequest] = {}
        self.flow_count = _RateLimitedCounter("pull.flow_control.cached_count")
        self.flow_size = _RateLimitedCounter("pull.flow_control.cached_size")
        self.flow_span = _RateLimitedCounter("pull.flow_control.span")
        self.flow_broker = _RateLimitedCounter("pull.flow_control.broker_busy", every=100)
        self.pulls = 0
        #: Broker id each queue's next pull goes to, as the last answer suggested
        #: (``suggestWhichBrokerId``); absent means the master.
        self.pull_from: dict[MessageQueue, int] = {}
        #: (address, broker id) each queue was last pulled from.
        self.pulled_at: dict[MessageQueue, tuple[str, int]] = {}
        #: Queues pulled from another replica than the suggested one (it was not in the route).
        self.fallen_back: set[MessageQueue] = set()
        #: Pulls sent per (broker name, broker id).
        self.pulls_by_replica: collections.Counter[tuple[str, int]] = collections.Counter()
        #: Queues whose last pull the broker refused with NO_PERMISSION.
        self.refused: set[MessageQueue] = set()
        # Per-queue thresholds by topic, recomputed from the topic thresholds on rebalance.
        self.queue_count_threshold = rt.thresholds.count
        self.queue_size_threshold_mib = rt.thresholds.size_mib

    def start_queue(self, req: PullRequest, *, delay: float = 0.0) -> None:
        self.requests[req.mq] = req
        self._owner.spawn(self._loop(req, delay), name=f"pull:{req.mq}", key=req.mq)

    async def stop_queue(self, mq: MessageQueue) -> None:
        self.requests.pop(mq, None)
        self._forget_queue(mq)
        await self._owner.cancel(mq)

    def _forget_queue(self, mq: MessageQueue) -> None:
        """A queue given up: where it was pulled from, where to pull it next and whether its
        pulls were refused go with it (taken again, it starts at its master, the broker
        suggests anew, and a refusal is reported again)."""
        self.pull_from.pop(mq, None)
        self.pulled_at.pop(mq, None)
        self.fallen_back.discard(mq)
        self.refused.discard(mq)

    def interrupt(self, mq: MessageQueue) -> None:
        """Abandon what ``mq``'s pull task is waiting for and start its loop over.

        Used by pause/resume: a long poll in flight is given up at once (its answer, if any,
        is ignored and the offset does not move), so a paused topic pulls nothing more and a
        resumed one pulls without waiting for the pause delay to end. A chunk already cached
        is still handed to the consume service, as Java consumes what it pulled before a pause.
        """
        req = self.requests.get(mq)
        task = self._owner.get(mq)
        if req is None or task is None or task.done() or req.pq.dropped:
            return  # a dropped queue's task only finishes forgetting it: not cut short
        task.cancel()
        self._owner.spawn(self._restart(task, req), name=f"pull:{mq}", key=mq)

    async def _restart(self, old: asyncio.Task[object], req: PullRequest) -> None:
        await asyncio.gather(old, return_exceptions=True)
        await self._loop(req, 0.0)

    def is_pulling(self, mq: MessageQueue) -> bool:
        task = self._owner.get(mq)
        return task is not None and not task.done()

    async def aclose(self, *, abandon_after: float = ABANDON_AFTER) -> None:
        """End this service's tasks; one still running ``abandon_after`` seconds after its
        cancellation (a handler that swallows it) is left to end on its own, logged."""
        await self._owner.aclose(abandon_after=abandon_after)
        self.requests.clear()

    # ------------------------------------------------------------------ flow control

    def _flow_control_delay(self, req: PullRequest) -> float:
        opts = self._opts
        pq = req.pq
        topic = req.mq.topic
        if topic in self._rt.paused:
            return opts.pull_time_delay_when_suspend
        count_limit = self.queue_count_threshold.get(topic, opts.pull_threshold_for_queue)
        size_limit = self.queue_size_threshold_mib.get(topic, opts.pull_threshold_size_for_queue)
        if pq.msg_count > count_limit:
            # ``taken``: orderly messages with the listener or held for its COMMIT.
            self.flow_count.hit(queue=str(req.mq), cached=pq.msg_count, limit=count_limit,
                                taken=pq.consuming_count)
            return opts.pull_time_delay_when_flow_control
        if pq.msg_size > size_limit * MiB:
            self.flow_size.hit(queue=str(req.mq), cached_mib=pq.msg_size // MiB, limit=size_limit,
                               taken=pq.consuming_count)
            return opts.pull_time_delay_when_flow_control
        service = self._router.service_for(topic)
        if not service.in_order and pq.max_span > opts.consume_concurrently_max_span:
            self.flow_span.hit(queue=str(req.mq), span=pq.max_span,
                               limit=opts.consume_concurrently_max_span)
            return opts.pull_time_delay_when_flow_control
        service_delay = service.pull_delay(topic)
        if service_delay:
            return service_delay
        return 0.0

    # ------------------------------------------------------------------ the loop

    async def _loop(self, req: PullRequest, delay: float) -> None:
        rt = self._rt
        opts = self._opts
        if delay > 0:
            await asyncio.sleep(delay)
        # The next pull when it was sent before the last answer was processed (pipelining).
        ahead: PendingPull | None = None
        try:
            while not req.pq.dropped and not rt.stopping:
                # As Java's pullMessage, before the pause and flow-control checks: a queue held
                # back is not an idle one, which the rebalance would drop and take again.
                req.pq.last_pull_timestamp = time.monotonic()
                if ahead is None:
                    wait = self._flow_control_delay(req)
                    if wait > 0:
                        await asyncio.sleep(wait)
                        continue
                    service = self._router.service_for(req.mq.topic)
                    if self._mode_changed(req, service.in_order):
                        # Taken in the other consume mode: the rebalance round the change woke
                        # releases and retakes it; nothing more is pulled meanwhile.
                        await asyncio.sleep(opts.pull_time_delay_when_suspend)
                        continue
                    if service.in_order and opts.message_model == MessageModel.CLUSTERING:
                        wait = await service.pull_gate(req)
                        if wait > 0:
                            await asyncio.sleep(wait)
                            continue
                pending, ahead = ahead, None
                try:
                    wait, ahead = await self._pull_once(req, pending)
                except asyncio.CancelledError:
                    raise
                except MQBrokerError as exc:
                    wait = self._error_delay(req, exc)
                except (MQClientError, RemotingError, ProtocolError) as exc:
                    log.warning("pull.failed", queue=str(req.mq), offset=req.next_offset,
                                error=f"{type(exc).__name__}: {exc}")
                    wait = opts.pull_time_delay_when_exception
                if wait > 0:
                    await asyncio.sleep(wait)
        finally:
            if ahead is not None:
                ahead.cancel()

    def _decode(self, req: PullRequest, result: PullResult) -> tuple[list[MessageExt], int]:
        """The messages of a FOUND answer and the offset to pull next.

        A record that cannot be decoded is skipped, loudly: the messages before it are
        delivered, it is reported (``consumer.corrupt_record`` with its queue and offset, and
        a :class:`ConsumerError` to the ``on_error`` handlers), and the next pull starts right
        after it, so the records behind it are pulled again and delivered. (The Java client
        drops the bad record and everything after it in the same answer without a word.)
        Retrying the same bytes could only fail again and stall the queue for good.
        """
        try:
            return result.decode(), result.next_begin_offset
        except ProtocolError:
            pass
        msgs, bad = decode_messages_salvaging(result.body)
        assert bad is not None  # the whole body did not decode, so some record did not
        delta = result.offset_delta or 0
        if delta:
            for m in msgs:
                m.queue_offset += delta
        low = msgs[-1].queue_offset + 1 if msgs else req.next_offset
        bad_offset = low
        if bad.queue_offset is not None and low <= bad.queue_offset + delta < result.next_begin_offset:
            bad_offset = bad.queue_offset + delta
        self._rt.errors.report(ConsumerError(
            ConsumerErrorKind.CORRUPT_RECORD, req.mq.topic, req.mq, bad_offset,
            f"{bad.error}; skipped, {len(msgs)} message(s) before it delivered, "
            f"pulling again from offset {bad_offset + 1}"))
        return msgs, bad_offset + 1

    def _stored_chunk(self, mq: MessageQueue, result: PullResult,
                      pulled: dict[str, str]) -> StoredChunk | None:
        """A sink subscription's FOUND body kept undecoded, or None to decode it as usual.

        Kept when the queue's topic is subscribed with a sink and no tag filter (the retry
        topic, whose messages belong to several subscriptions, is decoded) and the body is one
        the columnar path takes (:meth:`StoredChunk.scan`; never without the compiled codec).
        """
        if mq.topic == self._rt.retry_topic or result.offset_delta:
            return None
        sub = self._rt.subscriptions.topics.get(mq.topic)
        if sub is None or sub.sink is None or sub.orderly or sub.data.tags_set:
            return None
        return StoredChunk.scan(result.body, mq.topic, mq.broker_name, pulled, result.max_offset)

    def _error_delay(self, req: PullRequest, exc: MQBrokerError) -> float:
        opts = self._opts
        if is_acl_refusal(exc.code, exc.remark):
            # Reported once when it starts and once when it ends, not on every retry.
            if req.mq not in self.refused:
                self.refused.add(req.mq)
                # (The route lookup a pull may make first can be the one refused: every
                # name server refusing this client's credentials.)
                who = "the name servers refuse this client the route of this queue's topic" \
                    if exc.request == "GET_ROUTEINFO_BY_TOPIC" \
                    else "the broker refuses to serve this queue"
                self._rt.errors.report(ConsumerError(
                    ConsumerErrorKind.PERMISSION_DENIED, req.mq.topic, req.mq, req.next_offset,
                    f"{who}: {exc.remark}"))
            return opts.pull_time_delay_when_exception
        if exc.code == ResponseCode.FLOW_CONTROL:
            self.flow_broker.hit(queue=str(req.mq), code=exc.code)
            return opts.pull_time_delay_when_broker_flow_control
        if exc.code == ResponseCode.SYSTEM_BUSY:
            # What the Apache broker really sends when it sheds load.
            self.flow_broker.hit(queue=str(req.mq), code=exc.code, remark=exc.remark)
            return opts.pull_time_delay_when_exception
        log.warning("pull.broker_error", queue=str(req.mq), offset=req.next_offset,
                    code=exc.code, remark=exc.remark)
        return opts.pull_time_delay_when_exception

    async def _send(self, req: PullRequest, offset: int) -> PendingPull | None:
        """Send the PULL_MESSAGE of ``req`` from ``offset``; ``None`` if not subscribed."""
        rt = self._rt
        opts = self._opts
        mq = req.mq
        sub = rt.subscriptions.subscription_data(mq.topic)
        if sub is None:
            return None
        commit_offset = -1
        if opts.message_model == MessageModel.CLUSTERING:
            commit_offset = rt.offset_store.read_memory(mq)
        wanted = self.pull_from.get(mq, MASTER_ID)
        addr, broker_id = await rt.instance.find_broker_in_subscribe(
            mq.broker_name, wanted, topic=mq.topic)
        self.pulls_by_replica[(mq.broker_name, broker_id)] += 1
        if broker_id != MASTER_ID:
            commit_offset = -1  # a slave does not take the piggy-backed commit (Java clears it)
        previous = self.pulled_at.get(mq)
        if previous != (addr, broker_id):
            self.pulled_at[mq] = (addr, broker_id)
            # A fall-back (the suggested replica is not in the route: a master down) and the
            # return from one are worth an info line; following the broker's suggestion, which
            # can alternate between master and slave on every pull, is not.
            fell_back = broker_id != wanted
            emit = log.info if fell_back or mq in self.fallen_back else log.debug
            if fell_back:
                self.fallen_back.add(mq)
            else:
                self.fallen_back.discard(mq)
            if previous is not None:
                emit("pull.replica_switched", queue=str(mq), broker=mq.broker_name,
                     broker_id=broker_id, addr=addr, from_broker_id=previous[1],
                     from_addr=previous[0], suggested_broker_id=wanted)
        return await rt.instance.api.start_pull(
            addr,
            group=rt.group,
            mq=mq,
            queue_offset=offset,
            max_msg_nums=opts.pull_batch_size,
            commit_offset=commit_offset,
            suspend_timeout=opts.broker_suspend_max_time,
            timeout=opts.consumer_timeout_when_suspend,
            subscription=sub if opts.post_subscription_when_pull else None,
            sub_version=sub.sub_version,
            expression_type=sub.expression_type,
        )

    @staticmethod
    def _mode_changed(req: PullRequest, in_order: bool) -> bool:
        """Was the queue taken in the other consume mode than its topic's now (subscribed
        again orderly, or no longer)? Its chunks would reach the service of the new mode on a
        ProcessQueue kept for the old one (an orderly turn beside concurrent workers)."""
        ordered = req.pq.ordered
        return ordered is not None and ordered != in_order

    def _may_pull_ahead(self, req: PullRequest) -> bool:
        """Concurrent consumption with no pull interval, and the flow control lets it pull."""
        return (self._opts.pull_interval <= 0
                and not self._router.service_for(req.mq.topic).in_order
                and self._flow_control_delay(req) <= 0)

    async def _pull_once(self, req: PullRequest,
                         pending: PendingPull | None) -> tuple[float, PendingPull | None]:
        """Complete one PULL_MESSAGE (sending it first unless ``pending`` already was).

        Returns how long to wait before the next pull, and that next pull when it was already
        sent: once a FOUND answer is decoded and cached, the queue's next pull is sent (if the
        flow control allows it, counting the new chunk) *before* the chunk is dispatched, so
        the broker works on it while the chunk is consumed.
        """
        rt = self._rt
        opts = self._opts
        mq = req.mq
        if pending is None:
            pending = await self._send(req, req.next_offset)
            if pending is None:
                return opts.pull_time_delay_when_exception, None
        try:
            result = await pending.result()
        finally:
            pending.cancel()  # a no-op once answered; forgets the request when interrupted
        self.pulls += 1
        elapsed = time.monotonic() - pending.sent_at
        # The replica the broker wants the next pull of this queue to go to (Java
        # PullAPIWrapper.updatePullFromWhichNode, on every answer).
        self.pull_from[mq] = result.suggest_which_broker_id
        if mq in self.refused:
            self.refused.discard(mq)
            rt.errors.report(ConsumerError(ConsumerErrorKind.PERMISSION_RESTORED, mq.topic, mq,
                                         req.next_offset, "the broker serves this queue again"))
        if req.pq.dropped:
            return 0.0, None
        status = result.status
        if status is PullStatus.FOUND:
            sub = rt.subscriptions.subscription_data(mq.topic)
            pulled = {PROPERTY_MIN_OFFSET: str(result.min_offset),
                      PROPERTY_MAX_OFFSET: str(result.max_offset)}
            chunk = self._stored_chunk(mq, result, pulled)
            msgs: list[MessageExt] | StoredChunk
            if chunk is not None:
                # A sink's chunk: kept undecoded, cached and acknowledged as one entry.
                rt.stats.record_pull(mq.topic, chunk.count, elapsed)
                req.next_offset = result.next_begin_offset
                msgs = chunk
                first = req.pq.put_chunk(chunk)
            else:
                msgs, req.next_offset = self._decode(req, result)
                if sub is not None and sub.tags_set:
                    msgs = [m for m in msgs if tag_matches(sub, m.tags)]
                # What the tag filter kept, as Java counts its pull TPS (the round trip counts
                # all the same).
                rt.stats.record_pull(mq.topic, len(msgs), elapsed)
                first = False
                if msgs:
                    # Does not parse the messages' properties.
                    stamp_delivered(msgs, mq.broker_name, pulled)
                    first = req.pq.put_messages(msgs)
            # The next pull goes out before this chunk is handed on, so the broker works on it
            # while the chunk is consumed; the flow control sees the chunk already cached. The
            # chunk is handed on whatever happens to that send, an interruption (pause, resume)
            # included: cached and past next_offset, it would otherwise never be consumed.
            ahead: PendingPull | None = None
            try:
                if sub is not None and self._may_pull_ahead(req):
                    try:
                        ahead = await self._send(req, req.next_offset)
                    except (MQClientError, RemotingError) as exc:
                        log.debug("pull.ahead_failed", queue=str(mq), error=str(exc))
            finally:
                if msgs and not req.pq.dropped and not self._mode_changed(
                        req, self._router.service_for(mq.topic).in_order):
                    # (A queue taken in the other mode keeps the chunk cached: it is retaken
                    # from its committed offset, and the chunk pulled again, by the new mode.)
                    try:
                        if isinstance(msgs, StoredChunk):
                            self._router.submit_stored(msgs, req.pq, mq, first)
                        else:
                            self._router.submit(msgs, req.pq, mq, first)
                    except BaseException:
                        if ahead is not None:
                            ahead.cancel()
                        raise
            # (Java waits pull_interval only after a chunk it dispatched; an answer the tag
            # filter emptied is followed at once.)
            return (opts.pull_interval if msgs else 0.0), ahead
        if status in (PullStatus.NO_NEW_MSG, PullStatus.NO_MATCHED_MSG):
            req.next_offset = result.next_begin_offset
            if req.pq.msg_count == 0:
                # Nothing cached: the consume offset can follow the pull offset (Java
                # "correctTagsOffset", in both message models: a broadcasting queue that got
                # nothing keeps its place in the offsets file for the next start).
                rt.offset_store.update(mq, req.next_offset, increase_only=True)
            return 0.0, None
        # OFFSET_ILLEGAL: the broker moved our offset (out of range, or an admin reset).
        log.warning("pull.offset_illegal", queue=str(mq), offset=req.next_offset,
                    next_offset=result.next_begin_offset, min_offset=result.min_offset,
                    max_offset=result.max_offset)
        req.pq.dropped = True
        await self._fix_offset_and_forget(mq, result.next_begin_offset)
        return 0.0, None

    async def _fix_offset_and_forget(self, mq: MessageQueue, offset: int) -> None:
        """OFFSET_ILLEGAL: persist the corrected offset, forget the queue, rebalance now."""
        rt = self._rt
        store = rt.offset_store
        if hasattr(store, "freeze"):
            store.freeze(mq, offset)
        else:
            store.update(mq, offset, increase_only=False)
        try:
            await store.persist(mq)
        except Exception as exc:  # the queue is forgotten all the same, else nothing would
            # pull it again; taken again, it starts from the stored offset (as in Java, where
            # a failed persist is logged and the queue removed)
            log.warning("pull.offset_fix_persist_failed", queue=str(mq), offset=offset,
                        error=f"{type(exc).__name__}: {exc}")
        pq = rt.process_queues.get(mq)
        self.requests.pop(mq, None)
        self._forget_queue(mq)
        if pq is not None and pq.dropped and pq.locked:
            # An orderly queue locked at the broker: left to the rebalancer's removal, which
            # waits for its batch, persists and gives the lock back (Java's
            # removeProcessQueue), and takes the queue again if it is still this client's.
            # Forgotten here, its lock stayed until it lapsed if another client got it.
            pq.offset_fixed = True
        else:
            if pq is not None and pq.dropped:
                del rt.process_queues[mq]
            store.remove(mq)
        log.info("pull.offset_fixed", queue=str(mq), offset=offset)
        self._on_queue_forgotten()

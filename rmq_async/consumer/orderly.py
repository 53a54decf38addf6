"""Orderly consumption (Java ``ConsumeMessageOrderlyService`` + the lock parts of ``RebalanceImpl``).

Messages of one queue reach the listener strictly in queue-offset order, one batch at a time,
and never in two workers at once. In clustering mode a queue is consumed only while this
client holds the broker's lock for it:

* a newly assigned queue is locked (LOCK_BATCH_MQ) before it is pulled; a queue whose lock
  fails is not pulled, and the next rebalance tries again;
* every ``rebalance_lock_interval`` (20 s) all held queues are locked again (renewal); a local
  lock older than ``rebalance_lock_max_live_time`` (30 s) counts as lost;
* a queue given up is unlocked (UNLOCK_BATCH_MQ) only after the batch being consumed on it has
  finished, so its next owner never overlaps with us.

A failing call (an exception, or SUSPEND_CURRENT_QUEUE_A_MOMENT returned) is put back and
retried after ``suspend_current_queue_time`` seconds; once a message has been retried
``max_reconsume_times`` times it is sent to the dead-letter queue and skipped.
"""

from __future__ import annotations

import asyncio
import time
from collections import defaultdict
from collections.abc import Hashable, Mapping
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import structlog

from rmq_async.client.errors import MQClientError
from rmq_async.consumer.dead_letter import send_to_dlq
from rmq_async.consumer.listener import ListenerAdapter
from rmq_async.consumer.middleware import once_each, run_call
from rmq_async.consumer.options import MessageModel
from rmq_async.consumer.process_queue import ProcessQueue
from rmq_async.consumer.results import ConsumeContext, ConsumeResult
from rmq_async.consumer.service import BusyWorkers
from rmq_async.consumer.subscriptions import Subscription, reset_retry_topic
from rmq_async.consumer.tasks import ABANDON_AFTER, TaskOwner, acquire_by, ends_the_caller
from rmq_async.protocol.errors import ProtocolError
from rmq_async.protocol.message import put_each
from rmq_async.protocol.types import PROPERTY_CONSUME_START_TIME, MessageExt, MessageQueue
from rmq_async.remoting.errors import RemotingError

if TYPE_CHECKING:
    from rmq_async.consumer.runtime import ConsumerRuntime
    from rmq_async.consumer.service import PullRequest

log = structlog.get_logger(__name__)

#: Delays of the Java client's orderly service, in seconds.
RETRY_LOCK_DELAY = 0.01          # lock lost: try to lock again after 10 ms
CONSUME_AFTER_LOCK_OK = 0.01     # ... then consume after 10 ms
CONSUME_AFTER_LOCK_FAILED = 3.0  # ... or try again after 3 s
YIELD_DELAY = 0.01               # after MAX_TIME_CONSUME_CONTINUOUSLY, resubmit after 10 ms
NOT_LOCKED_PULL_DELAY = 3.0      # a queue not locked is not pulled; look again after 3 s
UNLOCK_WAIT = 20.0               # longest wait for an in-flight batch before giving a queue up
SUSPEND_MIN, SUSPEND_MAX = 0.01, 30.0  # a suspended queue's pause, as Java bounds it
BROKER_LOCK_EXPIRY = 60.0        # a broker's queue lock lapses this long after its last renewal
LOCK_EXPIRY_MARGIN = 5.0         # a deferred release gives up this long before that


@dataclass(slots=True)
class _Turn:
    mq: MessageQueue
    pq: ProcessQueue


class OrderlyConsumeService:
    """Consumes each queue in offset order, one batch at a time, never two batches of a queue
    at once; in clustering mode only while this client holds the queue's broker lock."""

    #: A queue's messages reach the listener one batch after the other, in offset order.
    in_order = True

    def __init__(self, rt: ConsumerRuntime) -> None:
        self._rt = rt
        self._opts = rt.options
        self._queue: asyncio.Queue[_Turn] = asyncio.Queue()
        self._owner = TaskOwner(f"orderly[{rt.group}]", family=rt.tasks)
        # One lock per queue: held while a batch of that queue is with the listener.
        self._consume_locks: dict[MessageQueue, asyncio.Lock] = {}
        # Queues given up while a batch of theirs ran on, until that batch has ended and the
        # queue is persisted and unlocked (see release()).
        self._releasing: dict[MessageQueue, asyncio.Task[None]] = {}
        self._busy = BusyWorkers(rt.tasks.family)  # the workers with a turn in hand

    @property
    def clustering(self) -> bool:
        return self._opts.message_model == MessageModel.CLUSTERING

    def consume_lock(self, mq: MessageQueue) -> asyncio.Lock:
        lock = self._consume_locks.get(mq)
        if lock is None:
            lock = self._consume_locks[mq] = asyncio.Lock()
        return lock

    def start(self) -> None:
        for i in range(self._opts.consume_concurrency):
            self._owner.spawn(self._worker(), name=f"worker-{i}")
        if self.clustering:
            self._owner.spawn(self._lock_renewal_loop(), name="lock-renewal")

    async def wait_idle(self, caller: asyncio.Task[Any] | None = None) -> None:
        """Wait until no turn runs but the one in ``caller`` (which called ``stop()``);
        the turns end at their next batch, ``stop()`` having begun."""
        await self._busy.wait_idle(caller)

    async def aclose(self, *, abandon_after: float = ABANDON_AFTER) -> None:
        """End this service's tasks; one still running ``abandon_after`` seconds after its
        cancellation (a handler that swallows it) is left to end on its own, logged."""
        await self._owner.aclose(abandon_after=abandon_after)

    # ------------------------------------------------------------------ scheduling

    def submit(self, msgs: list[MessageExt], pq: ProcessQueue, mq: MessageQueue,
               first: bool) -> None:
        """Called after pulled messages were cached; a turn is queued when ``first`` (none
        was pending). The turn takes the messages from ``pq`` in offset order, not ``msgs``."""
        if first:
            self._queue.put_nowait(_Turn(mq, pq))

    def pull_delay(self, topic: str) -> float:
        return 0.0

    def submit_later(self, pq: ProcessQueue, mq: MessageQueue, delay: float) -> None:
        self._owner.spawn(self._later(pq, mq, delay), name=f"later:{mq}")

    async def _later(self, pq: ProcessQueue, mq: MessageQueue, delay: float) -> None:
        await asyncio.sleep(delay)
        if not pq.dropped:
            self._queue.put_nowait(_Turn(mq, pq))

    async def _worker(self) -> None:
        me = asyncio.current_task()
        assert me is not None
        # (A worker spared by aclose, its handler having called stop(), ends here.)
        while not self._owner.closed:
            turn = await self._queue.get()
            call = self._busy.take(me, turn.mq)
            try:
                await self._run_turn(turn.mq, turn.pq)
            except BaseException as exc:
                if ends_the_caller(exc):
                    raise
                # A bug must not cost the consumer a worker, nor the queue its turn (it would
                # stay marked as consuming and never be scheduled again).
                log.error("orderly.turn_failed", queue=str(turn.mq),
                          error=f"{type(exc).__name__}: {exc}", exc_info=exc)
                self._retry_turn_later(turn.mq, turn.pq)
            finally:
                self._busy.done(call)

    def _retry_turn_later(self, mq: MessageQueue, pq: ProcessQueue) -> None:
        if pq.dropped or self._rt.stopping:
            return
        pq.rollback()  # whatever the failed turn had taken is consumed again, in order
        self.submit_later(pq, mq, _within_suspend_bounds(self._opts.suspend_current_queue_time))

    async def _run_turn(self, mq: MessageQueue, pq: ProcessQueue) -> None:
        """Consume one queue for a while, one batch after the other, in offset order."""
        rt = self._rt
        if pq.dropped:
            return
        started = time.monotonic()
        batch_size = self._opts.consume_message_batch_max_size
        while True:
            if pq.dropped or rt.stopping:
                return
            if self.clustering and (not pq.locked or pq.is_lock_expired(
                    time.monotonic(), self._opts.rebalance_lock_max_live_time)):
                self._owner.spawn(self._try_lock_later(pq, mq), name=f"relock:{mq}")
                return
            if time.monotonic() - started > self._opts.max_time_consume_continuously:
                self.submit_later(pq, mq, YIELD_DELAY)
                return
            async with self.consume_lock(mq):
                if _dropped(pq):  # may have changed while waiting for the lock
                    return
                msgs = pq.take_messages(batch_size)
                if not msgs:
                    pq.consuming = False
                    return
                keep_going = await self._consume_batch(mq, pq, msgs)
            if not keep_going:
                return

    async def _consume_batch(self, mq: MessageQueue, pq: ProcessQueue,
                             msgs: list[MessageExt]) -> bool:
        """Run the handler call(s) of one taken batch, in offset order, and settle each.

        A batch handler gets the batch in one call; a per-message handler one call per message.
        Each call is settled as Java settles a batch (``processConsumeResult``): with
        ``ctx.auto_commit`` (the default) a success commits everything taken up to its last
        message; without it only COMMIT does, SUCCESS leaves the messages taken (and
        uncommitted) across turns, and ROLLBACK puts every uncommitted message back. The calls
        stop at the first failure: the failing call's messages are retried in place (or
        dead-lettered once out of retries), the ones after it are put back untouched.
        Returns whether the turn may go on with the next batch.
        """
        rt = self._rt
        reset_retry_topic(msgs, rt.retry_topic)
        topic = msgs[0].topic
        sub = rt.subscriptions.topics.get(topic)
        middlewares = rt.subscriptions.middlewares
        put_each(msgs, {PROPERTY_CONSUME_START_TIME: str(int(time.time() * 1000))})
        ok = failed = calls = handed = 0
        elapsed = 0.0
        through = -1  # the batch is committed up to this offset once its calls are settled
        stop: ConsumeResult | None = None  # SUSPEND_... or ROLLBACK: the turn ends
        failing: list[MessageExt] = []
        # When the call is retried because its ctx.dead_letters could not all be sent: those
        # not sent (the call's other messages were consumed; out of retries, they are not
        # the dead-letter queue's).
        poison_left: set[int] | None = None
        ctx = ConsumeContext(message_queue=mq)
        # Messages of earlier turns taken and left uncommitted (SUCCESS without auto-commit)
        # wait for the handler's COMMIT: nothing the handler did not answer itself commits them.
        holding = pq.consuming_count > len(msgs)
        if mq.topic == rt.retry_topic:
            # The retry queue holds messages of every subscribed topic: each to its own.
            plan = _plan_by_topic(rt.subscriptions.topics, msgs)
        else:
            plan = [(sub, adapter, part) for adapter, part in _plan_calls(sub, msgs)]
        counted = topic  # the topic the counts below are of (one per run of a retry batch)
        lost = False  # the queue was given up, its lock lost or the consumer is stopping
        for call_sub, adapter, part in plan:
            if calls and self._may_not_go_on(pq):
                # Between the per-message calls of a batch, as between batches: another
                # client may own the queue now (Java checks before each listener call, and
                # its calls are whole batches). The rest goes back, untouched.
                lost = True
                break
            if part[0].topic != counted:
                if calls or ok or failed:
                    rt.stats.record_consume(counted, ok, failed, elapsed, calls=calls)
                ok = failed = calls = 0
                elapsed = 0.0
                counted = part[0].topic
            handed += len(part)
            if adapter is None:
                if call_sub is not None and call_sub.by_tag:
                    log.info("orderly.no_handler_for_tag", queue=str(mq), tag=part[0].tags)
                    ok += len(part)
                    if not holding:
                        through = part[-1].queue_offset
                    continue
                if mq.topic == rt.retry_topic:
                    # A retry message of a topic no longer subscribed: no handler takes it.
                    # Sent back as failed, as the concurrent service sends it, so it reaches
                    # the dead-letter queue after max_reconsume_times; retried in place it
                    # held every message behind it in the retry queue for good (orderly
                    # retries are unlimited by default).
                    log.warning("orderly.no_listener", topic=part[0].topic, queue=str(mq),
                                count=len(part))
                    back_later = await self._send_back_all(part, 0)
                    if not back_later:
                        failed += len(part)
                        if not holding:
                            through = part[-1].queue_offset
                        else:  # sent: a ROLLBACK of what is held must not hand them out again
                            pq.forget_taken(part)
                        continue
                    sent = part[:len(part) - len(back_later)]  # the rest is a suffix
                    pq.forget_taken(sent)
                    failed += len(sent)
                    part = back_later
                stop, failing = ConsumeResult.SUSPEND_CURRENT_QUEUE_A_MOMENT, part
                break
            ctx = ConsumeContext(message_queue=mq)
            began = time.monotonic()
            outcome = await run_call(adapter, part, ctx, group=rt.group, topic=part[0].topic,
                                     queue=mq, orderly=True, middlewares=middlewares)
            elapsed += time.monotonic() - began
            calls += 1
            dead = once_each(ctx.dead_letters, part)
            result = outcome.result
            if outcome.dead_reason is not None:
                poison = {id(m) for m, _ in dead}
                dead.extend((m, outcome.dead_reason) for m in part if id(m) not in poison)
                result = ConsumeResult.SUCCESS  # handled: the messages leave the queue
            if result is ConsumeResult.SUSPEND_CURRENT_QUEUE_A_MOMENT:
                stop, failing = result, part
                break
            if result is ConsumeResult.ROLLBACK and not ctx.auto_commit:
                stop, failing = result, part
                break
            if result is not ConsumeResult.SUCCESS and ctx.auto_commit:
                # Java: COMMIT and ROLLBACK mean nothing with auto-commit on; it acknowledges.
                log.warning("orderly.result_ignored_with_auto_commit", queue=str(mq),
                            result=result.value, offsets=[m.queue_offset for m in part])
            if dead:
                unsent = await self._dead_letter(dead)
                if unsent:
                    # The call is tried again in place, without those already in the DLQ
                    # (sent and counted once; a ROLLBACK must not hand them out again).
                    keep = {id(m) for m in unsent}
                    sent = [m for m, _ in dead if id(m) not in keep]
                    pq.forget_taken(sent)
                    failed += len(sent)
                    gone = {id(m) for m in sent}
                    stop = ConsumeResult.SUSPEND_CURRENT_QUEUE_A_MOMENT
                    failing = [m for m in part if id(m) not in gone]
                    poison_left = keep
                    break
            ok += max(len(part) - len(dead), 0)
            failed += len(dead)
            last = part[-1].queue_offset
            seen = len(part) - len(outcome.acked or ())  # what the middlewares passed on
            if not outcome.reached or outcome.dead_reason is not None or len(dead) >= seen:
                # Not the handler's verdict (dead-lettered before it ran, answered by a
                # middleware): done, but it commits nothing held for the handler's COMMIT.
                if not holding:
                    through = last
            elif ctx.auto_commit or result is ConsumeResult.COMMIT:
                through, holding = last, False
            else:
                holding = True  # SUCCESS without auto-commit: taken until a COMMIT
            if dead and through < last:
                # In the dead-letter queue now; a ROLLBACK must not hand them out again.
                pq.forget_taken(m for m, _ in dead)
        if stop is not ConsumeResult.ROLLBACK:
            # A ROLLBACK is the handler's own decision, not a failure: Java counts its
            # messages neither consumed nor failed (they count when consumed again). A COMMIT
            # counts its messages consumed, where Java's counts nothing for it either (an
            # application committing every call would read a consume TPS of zero).
            failed += len(failing)
        if calls or ok or failed:
            rt.stats.record_consume(counted, ok, failed, elapsed, calls=calls)
        pq.last_consume_timestamp = time.monotonic()
        if through >= 0:
            # Committed even when the queue was just given up: it is released (persisted, then
            # unlocked) only after this batch ends, so the next owner starts after it.
            self._commit(mq, pq, through)
        if stop is None:
            if lost and not pq.dropped and msgs[handed:]:
                pq.make_message_to_consume_again(msgs[handed:])
            # (The turn looks again: a lost lock is taken again later, a stop ends it.)
            return not pq.dropped
        if pq.dropped:
            return False
        # The messages after the failing call were never handed over: put back, untouched.
        rest = msgs[handed:]
        if rest:
            pq.make_message_to_consume_again(rest)
        if stop is ConsumeResult.ROLLBACK:
            pq.rollback()  # every uncommitted message, from earlier turns too
            self.submit_later(pq, mq, self._suspend_time(ctx))
            return False
        # SUSPEND_CURRENT_QUEUE_A_MOMENT (or failure): retry in place, unless a message has used
        # up its retries, in which case it goes to the dead-letter queue and is skipped.
        not_sent = await self._retries_exhausted(
            failing if poison_left is None else [m for m in failing if id(m) in poison_left])
        if not_sent is not None and not not_sent:
            if ctx.auto_commit:
                self._commit(mq, pq, failing[-1].queue_offset)
            else:  # in the dead-letter queue now; a ROLLBACK must not hand them out again
                pq.forget_taken(failing)
            return True
        if not_sent:
            # Some went to the dead-letter queue before a send failed: those are done (not
            # handed out or sent again, as on the dead-letter path above); the rest is retried.
            keep = {id(m) for m in not_sent}
            pq.forget_taken(m for m in failing if id(m) not in keep)
            failing = not_sent
        for m in failing:
            m.reconsume_times += 1
        pq.make_message_to_consume_again(failing)
        log.info("orderly.suspended", queue=str(mq), offsets=[m.queue_offset for m in failing],
                 reconsume_times=failing[0].reconsume_times)
        self.submit_later(pq, mq, self._suspend_time(ctx))
        return False

    def _may_not_go_on(self, pq: ProcessQueue) -> bool:
        """The queue is given up, no longer (validly) locked here, or the consumer stops."""
        return (pq.dropped or self._rt.stopping
                or (self.clustering and (not pq.locked or pq.is_lock_expired(
                    time.monotonic(), self._opts.rebalance_lock_max_live_time))))

    async def _send_back_all(self, msgs: list[MessageExt], level: int) -> list[MessageExt]:
        """Send ``msgs`` back at delay ``level`` (-1: the dead-letter queue); those that could
        not be sent (the first failure and those after it), none when all went."""
        for i, m in enumerate(msgs):
            if not await self._rt.send_message_back(m, level):
                return msgs[i:]
        return []

    async def _dead_letter(self, dead: list[tuple[MessageExt, str]]) -> list[MessageExt]:
        """Send poison messages to the DLQ (broadcasting: log and drop); the ones that could
        not be sent (the first failure and those after it), none when all went."""
        if self._opts.message_model == MessageModel.BROADCASTING:
            for m, reason in dead:
                log.warning("orderly.broadcast_dead_letter_dropped", msg_id=m.msg_id,
                            offset=m.queue_offset, reason=reason)
            return []
        for i, (m, reason) in enumerate(dead):
            if not await send_to_dlq(self._rt, m, reason):
                return [m for m, _ in dead[i:]]
        return []

    def _suspend_time(self, ctx: ConsumeContext) -> float:
        """The pause before a suspended queue is consumed again: the call's own, else the
        option's, within 10 ms and 30 s as Java keeps it (``submitConsumeRequestLater``: no
        retry loop without a pause, no queue left for minutes)."""
        seconds: float = self._opts.suspend_current_queue_time
        given = ctx.suspend_current_queue_time
        millis = ctx.suspend_current_queue_time_millis
        if given is not None:
            seconds = given.total_seconds() if isinstance(given, timedelta) else float(given)
        elif millis is not None and millis >= 0:
            seconds = millis / 1000.0
        return _within_suspend_bounds(seconds)

    def _commit(self, mq: MessageQueue, pq: ProcessQueue, through: int) -> None:
        """Commit what was taken from ``pq`` up to offset ``through``.

        A dropped queue still commits while it is not held anew (its release waits for this
        batch, or defers to after it, and persists then), not once its release has given up
        (the entry would stay, persisted by nothing, until the queue is taken again); an
        offset frozen by a reset ignores the update.
        """
        offset = pq.commit(through)
        if offset < 0:
            return
        current = self._rt.process_queues.get(mq)
        if current is pq or (pq.dropped and current is None and not pq.abandoned):
            self._rt.offset_store.update(mq, offset, increase_only=False)

    async def _retries_exhausted(self, msgs: list[MessageExt]) -> list[MessageExt] | None:
        """When every message of the batch has been retried the maximum number of times, they
        go to the dead-letter queue (Java ``checkReconsumeTimes``): returns those that could
        not be sent (the first failure and those after it), empty when all went; None when
        the batch still has retries."""
        limit = self._opts.effective_max_reconsume_times(orderly=True)
        if not all(m.reconsume_times >= limit for m in msgs):
            return None
        if self._opts.message_model == MessageModel.BROADCASTING:
            log.warning("orderly.broadcast_retries_exhausted", msg_ids=[m.msg_id for m in msgs])
            return []
        # Delay level -1 asks the broker for the dead-letter queue directly.
        not_sent = await self._send_back_all(msgs, -1)
        for m in msgs[:len(msgs) - len(not_sent)]:
            log.warning("orderly.sent_to_dlq", msg_id=m.msg_id, offset=m.queue_offset,
                        reconsume_times=m.reconsume_times)
        return not_sent

    # ------------------------------------------------------------------ locks

    async def lock(self, mq: MessageQueue) -> bool:
        """LOCK_BATCH_MQ for one queue; True when this client now holds it."""
        rt = self._rt
        try:
            addr = await rt.instance.find_broker_master(mq.broker_name, mq.topic)
            locked = await rt.instance.api.lock_batch_mq(addr, rt.group, rt.client_id, [mq])
        except (MQClientError, RemotingError, ProtocolError) as exc:
            log.warning("orderly.lock_failed", queue=str(mq), error=str(exc))
            return False
        ok = mq in locked
        pq = rt.process_queues.get(mq)
        if pq is not None:
            pq.locked = ok
            if ok:
                pq.last_lock_timestamp = time.monotonic()
        log.debug("orderly.lock", queue=str(mq), locked=ok)
        return ok

    async def lock_all(self) -> None:
        rt = self._rt
        by_broker: dict[str, list[MessageQueue]] = defaultdict(list)
        for mq, pq in rt.process_queues.items():
            if rt.subscriptions.is_orderly(mq.topic) and not pq.dropped:
                by_broker[mq.broker_name].append(mq)
        for broker_name, mqs in by_broker.items():
            try:
                addr = await rt.instance.find_broker_master(broker_name, mqs[0].topic)
                locked = await rt.instance.api.lock_batch_mq(addr, rt.group, rt.client_id, mqs)
            except (MQClientError, RemotingError, ProtocolError) as exc:
                log.warning("orderly.lock_all_failed", broker=broker_name, error=str(exc))
                continue
            now = time.monotonic()
            for mq in mqs:
                held = rt.process_queues.get(mq)
                if held is None:
                    continue
                if mq in locked:
                    if not held.locked:
                        log.info("orderly.lock_regained", queue=str(mq))
                    held.locked = True
                    held.last_lock_timestamp = now
                else:
                    if held.locked:
                        log.warning("orderly.lock_lost", queue=str(mq))
                    held.locked = False

    async def unlock(self, mq: MessageQueue, *, oneway: bool = False) -> None:
        await self._unlock_on(mq.broker_name, [mq], oneway=oneway)

    async def unlock_all(self, mqs: list[MessageQueue]) -> None:
        """Give the locks of ``mqs`` back: one request per broker, all at once (Java
        ``unlockAll`` on shutdown, one broker after the other)."""
        by_broker: dict[str, list[MessageQueue]] = {}
        for mq in mqs:
            by_broker.setdefault(mq.broker_name, []).append(mq)
        await asyncio.gather(*(self._unlock_on(b, q) for b, q in by_broker.items()))

    async def _unlock_on(self, broker: str, mqs: list[MessageQueue], *,
                         oneway: bool = False) -> None:
        """UNLOCK_BATCH_MQ of ``mqs`` (all of ``broker``) on its master; failures are logged."""
        rt = self._rt
        try:
            addr = await rt.instance.find_broker_master(broker, mqs[0].topic)
            await rt.instance.api.unlock_batch_mq(addr, rt.group, rt.client_id, mqs,
                                                  oneway=oneway)
        except (MQClientError, RemotingError, ProtocolError) as exc:
            log.warning("orderly.unlock_failed", broker=broker,
                        queues=[str(mq) for mq in mqs], error=str(exc))

    async def _lock_renewal_loop(self) -> None:
        while True:
            await asyncio.sleep(self._opts.rebalance_lock_interval)
            await self.lock_all()

    async def _try_lock_later(self, pq: ProcessQueue, mq: MessageQueue) -> None:
        await asyncio.sleep(RETRY_LOCK_DELAY)
        if pq.dropped:
            return
        ok = await self.lock(mq)
        self.submit_later(pq, mq, CONSUME_AFTER_LOCK_OK if ok else CONSUME_AFTER_LOCK_FAILED)

    async def release(self, mq: MessageQueue, pq: ProcessQueue) -> bool:
        """Give a queue up: wait for its in-flight batch, persist its offset, unlock it.
        False when that is deferred (below): the offset store's entry is then the deferred
        release's to drop.

        A batch still running after :data:`UNLOCK_WAIT` keeps the queue locked, at the broker
        and here (the consume lock stays): another consumer of the queue beside the running
        batch would break the queue's order. A task then waits for the batch, persists the
        offset it committed and unlocks the queue, as Java's rebalance retries
        ``removeUnnecessaryMessageQueue`` until the batch has ended; meanwhile this client does
        not take the queue again (:meth:`releasing`). It gives up shortly before the broker's
        lock lapses (another client may own the queue then), and ``stop()`` waits for it
        within its timeout.
        """
        rt = self._rt
        lock = self.consume_lock(mq)
        if not await acquire_by(lock, asyncio.get_running_loop().time() + UNLOCK_WAIT):
            pq.locked = False
            if rt.stopping:
                # stop() has closed this service's tasks: nothing can wait for the batch any
                # more. What it committed so far is persisted (the queue is out of the table,
                # so stop()'s own persist leaves it out); the broker lock is left to lapse.
                log.warning("orderly.unlock_skipped_stopping", queue=str(mq),
                            waited=UNLOCK_WAIT)
                try:
                    await rt.offset_store.persist(mq)
                except Exception as exc:
                    log.warning("orderly.persist_on_release_failed", queue=str(mq),
                                error=f"{type(exc).__name__}: {exc}")
                return False
            log.warning("orderly.unlock_deferred_busy", queue=str(mq), waited=UNLOCK_WAIT)
            # What is committed now (or an offset an admin reset froze) is persisted at once,
            # as Java's removeUnnecessaryMessageQueue does first: the deferred release may give
            # up without persisting, when the broker's lock lapses before the batch ends.
            try:
                await rt.offset_store.persist(mq)
            except Exception as exc:
                log.warning("orderly.persist_on_release_failed", queue=str(mq),
                            error=f"{type(exc).__name__}: {exc}")
            self._releasing[mq] = self._owner.spawn(
                self._release_when_idle(mq, pq, lock), name=f"release:{mq}")
            return False
        try:
            await rt.offset_store.persist(mq)
            if self.clustering:
                await self.unlock(mq)
            pq.locked = False
        finally:
            lock.release()
            self._consume_locks.pop(mq, None)
        return True

    def releasing(self, mq: MessageQueue) -> bool:
        """Is ``mq`` still being given up (its batch running on)? Not to be taken again yet."""
        return mq in self._releasing

    async def finish_releases(self, timeout: float, caller_queue: Hashable | None = None) -> None:
        """Wait, for at most ``timeout`` seconds, for the deferred releases (``stop()``), but
        for that of ``caller_queue``: the queue whose turn called ``stop()`` (its release
        waits for that turn's batch, which waits for ``stop()``)."""
        waits = [task for mq, task in self._releasing.items() if mq != caller_queue]
        if waits:
            await asyncio.wait(waits, timeout=max(timeout, 0.0))

    async def _release_when_idle(self, mq: MessageQueue, pq: ProcessQueue,
                                 lock: asyncio.Lock) -> None:
        """The end of :meth:`release` for a queue whose batch ran on: once the batch ends,
        persist what it committed, unlock the queue and drop its offset entry."""
        rt = self._rt
        try:
            lapse = pq.last_lock_timestamp + BROKER_LOCK_EXPIRY - LOCK_EXPIRY_MARGIN
            deadline = asyncio.get_running_loop().time() + lapse - time.monotonic()
            if not await acquire_by(lock, deadline):
                # The broker's lock lapses: another client may own the queue by now, and
                # what this client would persist could be behind its progress.
                log.warning("orderly.unlock_given_up_busy", queue=str(mq))
                pq.abandoned = True
                if mq not in rt.process_queues:
                    rt.offset_store.remove(mq)
                return
            try:
                await rt.offset_store.persist(mq)
                if mq not in rt.process_queues:
                    rt.offset_store.remove(mq)
                    if self.clustering:
                        await self.unlock(mq)
                log.info("orderly.unlocked_after_batch", queue=str(mq))
            finally:
                lock.release()
                if self._consume_locks.get(mq) is lock:
                    del self._consume_locks[mq]
        finally:
            self._releasing.pop(mq, None)

    async def pull_gate(self, req: PullRequest) -> float:
        """Clustering: pull only a locked queue; re-read its offset on the first locked pull."""
        pq = req.pq
        if not pq.locked:
            return NOT_LOCKED_PULL_DELAY
        if not req.previously_locked:
            offset = await self._rt.compute_pull_from_where(req.mq)
            if offset < 0:
                return self._opts.pull_time_delay_when_exception
            req.previously_locked = True
            if offset != req.next_offset:
                log.info("orderly.offset_reloaded", queue=str(req.mq), offset=offset,
                         was=req.next_offset)
            req.next_offset = offset
        return 0.0


def _plan_calls(sub: Subscription | None, msgs: list[MessageExt],
                ) -> list[tuple[ListenerAdapter | None, list[MessageExt]]]:
    """The handler calls of a batch, in offset order: the batch for a batch handler, one call
    per message for a per-message handler, split by tag when several handlers share a topic."""
    if sub is None:
        return [(None, msgs)]
    if not sub.by_tag:
        adapter = sub.listener
        if adapter is None or adapter.batch or len(msgs) == 1:
            return [(adapter, msgs)]
        return [(adapter, [m]) for m in msgs]
    calls: list[tuple[ListenerAdapter | None, list[MessageExt]]] = []
    for m in msgs:
        adapter = sub.adapter_for(m)
        if calls and adapter is not None and adapter.batch and calls[-1][0] is adapter:
            calls[-1][1].append(m)
        else:
            calls.append((adapter, [m]))
    return calls


def _plan_by_topic(subs: Mapping[str, Subscription], msgs: list[MessageExt],
                   ) -> list[tuple[Subscription | None, ListenerAdapter | None,
                                   list[MessageExt]]]:
    """:func:`_plan_calls` for each run of one topic of a retry-queue batch, in offset order."""
    out: list[tuple[Subscription | None, ListenerAdapter | None, list[MessageExt]]] = []
    start = 0
    for i in range(1, len(msgs) + 1):
        if i == len(msgs) or msgs[i].topic != msgs[start].topic:
            sub = subs.get(msgs[start].topic)
            out.extend((sub, adapter, part) for adapter, part in _plan_calls(sub, msgs[start:i]))
            start = i
    return out


def _dropped(pq: ProcessQueue) -> bool:
    """Read ``pq.dropped`` afresh (it changes while this task waits)."""
    return pq.dropped


def _within_suspend_bounds(seconds: float) -> float:
    return min(max(seconds, SUSPEND_MIN), SUSPEND_MAX)

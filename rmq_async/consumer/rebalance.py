"""The rebalancer: decides which queues this client consumes, and applies the decision.

It runs on start, every ``rebalance_interval``, when a subscription changes and as soon as the
broker sends NOTIFY_CONSUMER_IDS_CHANGED. For each subscribed topic (clustering) it takes the
topic's readable queues from the route and the group's client ids from a broker, sorts both as
the Java client does and applies the allocation strategy; broadcasting takes every queue.

Applying an allocation (Java ``updateProcessQueueTableInRebalance``): a queue no longer
allocated, or not pulled for ``pull_max_idle_time``, is removed (marked dropped, its pull
stopped, its offset persisted; orderly: after the batch in flight, then unlocked); a newly
allocated one (locked first when consumed in order) gets a ProcessQueue, a start offset and a
pull task. When a topic's queues changed, its per-queue thresholds are recomputed and a heartbeat
with a new subscription version goes out before the pulls use it.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Iterable
from typing import TYPE_CHECKING, Any

import structlog

from rmq_async.client.errors import MQClientError, NoRouteError
from rmq_async.consumer.allocate import sort_inputs
from rmq_async.consumer.options import MessageModel
from rmq_async.consumer.process_queue import ProcessQueue
from rmq_async.consumer.service import PullRequest
from rmq_async.consumer.subscriptions import RETRY_GROUP_TOPIC_PREFIX
from rmq_async.consumer.tasks import enter_user_call
from rmq_async.protocol.errors import ProtocolError
from rmq_async.protocol.types import MessageQueue
from rmq_async.remoting.errors import RemotingError

if TYPE_CHECKING:
    from rmq_async.consumer.hooks import RebalanceHooks
    from rmq_async.consumer.orderly import OrderlyConsumeService
    from rmq_async.consumer.pull import PullService
    from rmq_async.consumer.runtime import ConsumerRuntime

log = structlog.get_logger(__name__)


class Rebalancer:
    """The rebalance loop and the table of queues it assigns (``rt.process_queues``).

    ``wakeup`` is the event that starts a round at once; the pull loop shares it to have a
    queue it gave up (OFFSET_ILLEGAL) recreated. ``hooks`` are the consumer's rebalance
    listeners: ``on_revoked`` is awaited before a round removes queues (so before their offsets
    are persisted), ``on_assigned`` after it added queues and before their first pull.
    """

    def __init__(self, rt: ConsumerRuntime, pull: PullService, orderly: OrderlyConsumeService,
                 *, wakeup: asyncio.Event | None = None,
                 hooks: RebalanceHooks | None = None) -> None:
        self._rt = rt
        self._hooks = hooks
        self._pull = pull
        self._orderly = orderly
        self._wakeup = wakeup if wakeup is not None else asyncio.Event()
        self.rounds = 0
        self._last_round_balanced = True
        self._retry = False
        self.table_lock = asyncio.Lock()
        """Held by a round, and by an admin offset reset while it drops queues and persists
        their new offsets (Java suspends the rebalance for a reset): a round that saw a queue
        half removed would take it again from the broker's old offset and lose the reset."""
        self.round_task: asyncio.Task[Any] | None = None
        """The task running a round, while it holds :attr:`table_lock` (``stop()`` called by
        a rebalance listener runs in it, and does not wait for the lock it holds)."""

    def retry_soon(self) -> None:
        """Mark this round unbalanced so the next one runs after a short pause."""
        self._retry = True

    def wake(self) -> None:
        """Run a rebalance round now (e.g. NOTIFY_CONSUMER_IDS_CHANGED arrived)."""
        self._wakeup.set()

    async def run(self) -> None:
        interval = self._rt.options.rebalance_interval
        while not self._rt.stopping:
            self._wakeup.clear()
            try:
                await self.rebalance_once()
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # a round must never end the loop
                log.exception("rebalance.round_failed", group=self._rt.group, error=str(exc))
                self._last_round_balanced = False
            # 5.x behaviour: an unbalanced round (a broker call failed) retries after 1 s.
            await self._pause(interval if self._last_round_balanced else min(1.0, interval))

    async def _pause(self, wait: float) -> None:
        """Until the next round: ``wait`` seconds or a wake-up, not at all when stopping (a
        rebalance listener called ``stop()``: the loop ends with the round)."""
        if self._rt.stopping:
            return
        # Not ``asyncio.wait_for``: on Python 3.11 it returns normally when the task is
        # cancelled in the same loop iteration as the event is set (a broker's
        # NOTIFY_CONSUMER_IDS_CHANGED arriving while stop() cancels this task), and the
        # swallowed cancellation left this loop running forever. ``asyncio.timeout``
        # delivers the cancellation to this task itself, so it is never lost.
        try:
            async with asyncio.timeout(wait):
                await self._wakeup.wait()
        except TimeoutError:
            pass

    async def rebalance_once(self) -> None:
        async with self.table_lock:
            self.round_task = asyncio.current_task()
            try:
                await self._round()
            finally:
                self.round_task = None

    async def _round(self) -> None:
        rt = self._rt
        self.rounds += 1
        balanced = True
        self._retry = False
        topics = rt.subscriptions.subscribed_topics()
        for topic in topics:
            if rt.stopping:  # (a rebalance listener called stop(): the round ends)
                return
            try:
                allocated = await self._allocate(topic)
            except NoRouteError as exc:
                # Java: a topic without a route is not there to balance (a round soon would
                # only ask the name servers again); it is taken when its route appears.
                if not topic.startswith(RETRY_GROUP_TOPIC_PREFIX):
                    log.warning("rebalance.topic_has_no_route", group=rt.group, topic=topic,
                                error=str(exc))
                continue
            except (MQClientError, RemotingError, ProtocolError, ValueError) as exc:
                # (ProtocolError: a broker's answer that does not decode; Java's
                # findConsumerIdList catches every exception and counts the topic unbalanced.)
                log.warning("rebalance.topic_failed", group=rt.group, topic=topic, error=str(exc))
                # Java never counts the retry topic's failures against the balance.
                if not topic.startswith(RETRY_GROUP_TOPIC_PREFIX):
                    balanced = False
                continue
            if allocated is None:
                balanced = False
                continue
            await self.apply_allocation(topic, allocated)
            if {mq for mq, pq in rt.process_queues.items()
                    if mq.topic == topic and not pq.dropped} != allocated:
                balanced = False  # a queue not taken (its start offset unknown): retry soon
        # Queues of topics no longer subscribed are given up.
        await self.drop_unsubscribed(set(topics))
        self._last_round_balanced = balanced and not self._retry

    async def _allocate(self, topic: str) -> set[MessageQueue] | None:
        rt = self._rt
        mq_all = await rt.instance.subscribe_queues(topic)
        if rt.options.message_model == MessageModel.BROADCASTING:
            # Every readable queue, none when the route has none (all of them lost the read
            # permission): Java's broadcasting rebalance applies that too and gives them up.
            return set(mq_all)
        if not mq_all:
            log.warning("rebalance.no_queues", group=rt.group, topic=topic)
            return None
        addr = await rt.instance.find_any_broker(topic)
        cid_all = await rt.instance.api.get_consumer_ids(addr, rt.group)
        if not cid_all:
            log.warning("rebalance.no_consumer_ids", group=rt.group, topic=topic)
            return None
        mq_sorted, cid_sorted = sort_inputs(mq_all, cid_all)
        strategy = rt.options.allocate_strategy
        started = time.monotonic()
        try:
            result = strategy.allocate(rt.group, rt.client_id, mq_sorted, cid_sorted)
        except Exception as exc:
            # A user's strategy that fails (a machine-room resolver without an entry, say):
            # this topic is left as it is and the round goes on with the others (Java's
            # rebalanceByTopic catches Throwable there and reports the topic unbalanced).
            log.error("rebalance.allocate_failed", group=rt.group, topic=topic,
                      strategy=strategy.name, error=f"{type(exc).__name__}: {exc}")
            return None
        log.debug("rebalance.allocated", group=rt.group, topic=topic, strategy=strategy.name,
                  consumers=len(cid_sorted), queues=len(mq_sorted), mine=len(result),
                  seconds=round(time.monotonic() - started, 6))
        return set(result)

    # ------------------------------------------------------------------ the queue table

    def _needs_lock(self, mq: MessageQueue) -> bool:
        rt = self._rt
        return (rt.options.message_model == MessageModel.CLUSTERING
                and rt.subscriptions.is_orderly(mq.topic))

    async def apply_allocation(self, topic: str, allocated: set[MessageQueue]) -> None:
        rt = self._rt
        changed = False
        now = time.monotonic()
        leaving: list[tuple[MessageQueue, str]] = []
        for mq, pq in list(rt.process_queues.items()):
            if mq.topic != topic:
                continue
            if mq not in allocated:
                leaving.append((mq, "reassigned"))
            elif pq.dropped and pq.offset_fixed:
                # Its pull loop ended on OFFSET_ILLEGAL (an orderly queue): released here,
                # then taken again below from the fixed offset.
                leaving.append((mq, "offset_illegal"))
            elif pq.dropped and not self._pull.is_pulling(mq):
                # Dropped but still here with no pull task (its forgetting was cut short):
                # taken out, then back in below, as Java's pull-expiry does after a while.
                log.warning("rebalance.dropped_queue_left_behind", queue=str(mq))
                leaving.append((mq, "dropped"))
            elif not self._pull.is_pulling(mq) and not rt.stopping:
                # Held with no pull task (a round that failed before starting it, a task that
                # crashed): it would wait for pull_max_idle_time. Taken out and back in.
                log.warning("rebalance.queue_without_pull_task", queue=str(mq))
                leaving.append((mq, "not_pulled"))
            elif (pq.ordered is not None and not pq.dropped
                  and pq.ordered != rt.subscriptions.is_orderly(topic)):
                # Subscribed again in the other mode (or a retry queue whose consumer's
                # subscriptions became all orderly, or no longer are): the queue's state
                # belongs to the old mode's service, so it is released and taken anew (an
                # orderly one locked first), from its committed offset.
                log.info("rebalance.consume_mode_changed", queue=str(mq),
                         orderly=not pq.ordered)
                leaving.append((mq, "mode_changed"))
            elif pq.is_pull_expired(now, rt.options.pull_max_idle_time) and not pq.dropped:
                log.warning("rebalance.queue_pull_expired", queue=str(mq))
                leaving.append((mq, "pull_expired"))
        if leaving:
            await self._revoke(mq for mq, _ in leaving)
            await self._remove_all(leaving)
            changed = True
        new_queues = [mq for mq in allocated if mq not in rt.process_queues]
        added: list[PullRequest] = []
        for mq in sorted(new_queues):
            if rt.stopping:
                return
            # The mode the queue is taken in: decided once, before the lock that goes with it
            # (a subscription changed during the awaits below is seen by the next round).
            ordered = rt.subscriptions.is_orderly(mq.topic)
            needs_lock = ordered and rt.options.message_model == MessageModel.CLUSTERING
            try:
                if not await self._queue_assigned(mq, needs_lock):
                    continue
                rt.offset_store.remove(mq)
                offset = await rt.compute_pull_from_where(mq)
            except Exception as exc:  # one queue's failure does not cost the others theirs
                log.warning("rebalance.queue_add_failed", queue=str(mq),
                            error=f"{type(exc).__name__}: {exc}")
                self.retry_soon()
                continue
            if offset < 0:
                log.warning("rebalance.start_offset_unknown", queue=str(mq))
                continue
            pq = ProcessQueue()
            pq.ordered = ordered
            if needs_lock:
                pq.locked = True
                pq.last_lock_timestamp = time.monotonic()
            rt.process_queues[mq] = pq
            added.append(PullRequest(mq, pq, offset))
            log.info("rebalance.queue_added", group=rt.group, queue=str(mq), offset=offset)
            changed = True
        if changed:
            await self._on_allocation_changed(topic)
        if added and self._hooks is not None:
            await self._listeners(self._hooks.fire_assigned, rt.group,
                                  frozenset(req.mq for req in added))
        for req in added:
            if not req.pq.dropped and not rt.stopping:
                self._pull.start_queue(req)

    def releasing(self, mq: MessageQueue) -> bool:
        """Is ``mq`` an orderly queue given up while its batch runs on (its release, offset
        persist included, deferred until that batch ends)?"""
        return self._orderly is not None and self._orderly.releasing(mq)

    async def _queue_assigned(self, mq: MessageQueue, needs_lock: bool) -> bool:
        """Called before a new queue is pulled: orderly clustering consumers lock it first."""
        if self.releasing(mq):
            # Given up while a batch of it ran on: taken again once that batch has ended.
            log.info("rebalance.queue_still_releasing", queue=str(mq))
            self.retry_soon()
            return False
        if needs_lock and not await self._orderly.lock(mq):
            log.info("rebalance.queue_lock_refused", queue=str(mq))
            self.retry_soon()
            return False
        return True

    async def remove_queue(self, mq: MessageQueue, *, reason: str) -> None:
        rt = self._rt
        pq = rt.process_queues.pop(mq, None)
        if pq is None:
            return
        pq.dropped = True
        await self._pull.stop_queue(mq)
        if self._needs_lock(mq) or pq.locked:
            # Unlock only after the batch being consumed on this queue has finished (also when
            # the topic was unsubscribed and no longer counts as orderly). A release deferred
            # past a batch running on drops the offset entry itself, once it has persisted it.
            if await self._orderly.release(mq, pq):
                rt.offset_store.remove(mq)
        else:
            await rt.offset_store.persist(mq)
            rt.offset_store.remove(mq)
        log.info("rebalance.queue_removed", group=rt.group, queue=str(mq), reason=reason)

    async def drop_unsubscribed(self, topics: set[str]) -> None:
        leaving = [mq for mq in self._rt.process_queues if mq.topic not in topics]
        if leaving:
            await self._revoke(leaving)
            await self._remove_all([(mq, "unsubscribed") for mq in leaving])

    async def _remove_all(self, leaving: list[tuple[MessageQueue, str]]) -> None:
        """Remove the queues revoked together. All are dropped first (nothing more of them
        is pulled or handed to a listener), as Java marks each leaving queue dropped before
        it waits for one: a removal waits for the queue's batch to end (an orderly queue up
        to UNLOCK_WAIT), and the queues behind it went on being consumed meanwhile, after
        the ``on_revoked`` listeners had been told they were gone."""
        for mq, _ in leaving:
            pq = self._rt.process_queues.get(mq)
            if pq is not None:
                pq.dropped = True
        for mq, reason in leaving:
            await self.remove_queue(mq, reason=reason)

    async def _revoke(self, queues: Iterable[MessageQueue]) -> None:
        """Await the ``on_revoked`` listeners while the queues are still held."""
        if self._hooks is not None:
            await self._listeners(self._hooks.fire_revoked, self._rt.group, frozenset(queues))

    async def _listeners(self, fire: Callable[[str, frozenset[MessageQueue]], Awaitable[None]],
                         group: str, queues: frozenset[MessageQueue]) -> None:
        """Run rebalance listeners as this task's user call (``stop()`` called by one of them
        does not wait for this round, nor for the table lock it holds)."""
        task = asyncio.current_task()
        assert task is not None
        with enter_user_call(task, self._rt.tasks.family):
            await fire(group, queues)

    async def _on_allocation_changed(self, topic: str) -> None:
        """New subscription version, new per-queue thresholds, and a heartbeat right away.

        The broker refuses a pull whose ``subVersion`` is newer than the one its last
        heartbeat registered (SUBSCRIPTION_NOT_LATEST), so the heartbeat carrying the new
        version goes out first and the pulls switch to it only once it was sent.
        """
        rt = self._rt
        rt.thresholds.recompute(topic, sum(1 for mq in rt.process_queues if mq.topic == topic))
        subs = rt.subscriptions
        data = subs.subscription_data(topic)
        if data is None:
            return
        new_version = max(int(time.time() * 1000), data.sub_version + 1)
        subs.version_override[topic] = new_version
        try:
            await rt.instance.send_heartbeats()
        finally:
            subs.version_override.pop(topic, None)
        data.sub_version = new_version

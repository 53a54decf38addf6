"""The rebalancer: decides which queues this client consumes, and applies the decision.

It runs on start, every ``rebalance_interval``, when a subscription changes and as soon as the
broker sends NOTIFY_CONSUMER_IDS_CHANGED. For each subscribed topic (clustering) it takes the
topic's readable queues from the route and the group's client ids from a broker, sorts both as
the Java client does and applies the allocation strategy; broadcasting takes every queue.
"""

from __future__ import annotations

import asyncio
import time
from typing import TYPE_CHECKING

import structlog

from rmq_async.client.errors import MQClientError
from rmq_async.consumer.allocate import sort_inputs
from rmq_async.consumer.options import MessageModel
from rmq_async.protocol.types import MessageQueue
from rmq_async.remoting.errors import RemotingError

if TYPE_CHECKING:
    from rmq_async.consumer.push import PushConsumer

log = structlog.get_logger(__name__)


class Rebalancer:
    def __init__(self, consumer: PushConsumer) -> None:
        self._consumer = consumer
        self._wakeup = asyncio.Event()
        self.rounds = 0
        self._last_round_balanced = True
        self._retry = False

    def retry_soon(self) -> None:
        """Mark this round unbalanced so the next one runs after a short pause."""
        self._retry = True

    def wake(self) -> None:
        """Run a rebalance round now (e.g. NOTIFY_CONSUMER_IDS_CHANGED arrived)."""
        self._wakeup.set()

    async def run(self) -> None:
        interval = self._consumer.options.rebalance_interval
        while not self._consumer.stopping:
            self._wakeup.clear()
            try:
                await self.rebalance_once()
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # a round must never end the loop
                log.exception("rebalance.round_failed", group=self._consumer.group, error=str(exc))
                self._last_round_balanced = False
            # 5.x behaviour: an unbalanced round (a broker call failed) retries after 1 s.
            wait = interval if self._last_round_balanced else min(1.0, interval)
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
        c = self._consumer
        self.rounds += 1
        balanced = True
        self._retry = False
        topics = c.subscribed_topics()
        for topic in topics:
            try:
                allocated = await self._allocate(topic)
            except (MQClientError, RemotingError, ValueError) as exc:
                log.warning("rebalance.topic_failed", group=c.group, topic=topic, error=str(exc))
                balanced = False
                continue
            if allocated is None:
                balanced = False
                continue
            await c.apply_allocation(topic, allocated)
        # Queues of topics no longer subscribed are given up.
        await c.drop_unsubscribed(set(topics))
        self._last_round_balanced = balanced and not self._retry

    async def _allocate(self, topic: str) -> set[MessageQueue] | None:
        c = self._consumer
        mq_all = await c.instance.subscribe_queues(topic)
        if not mq_all:
            log.warning("rebalance.no_queues", group=c.group, topic=topic)
            return None
        if c.options.message_model == MessageModel.BROADCASTING:
            return set(mq_all)
        addr = await c.instance.find_any_broker(topic)
        cid_all = await c.instance.api.get_consumer_ids(addr, c.group)
        if not cid_all:
            log.warning("rebalance.no_consumer_ids", group=c.group, topic=topic)
            return None
        mq_sorted, cid_sorted = sort_inputs(mq_all, cid_all)
        strategy = c.options.allocate_strategy
        started = time.monotonic()
        result = strategy.allocate(c.group, c.client_id, mq_sorted, cid_sorted)
        log.debug("rebalance.allocated", group=c.group, topic=topic, strategy=strategy.name,
                  consumers=len(cid_sorted), queues=len(mq_sorted), mine=len(result),
                  seconds=round(time.monotonic() - started, 6))
        return set(result)

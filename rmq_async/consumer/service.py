"""The consumption side as the pull loop sees it: peers behind one small interface.

Each pulled chunk (the messages one pull delivered for one queue, already cached in the queue's
:class:`ProcessQueue`) goes to exactly one consumption service:

* :class:`~rmq_async.consumer.consume.ConcurrentConsumeService`: listeners, concurrently;
* :class:`~rmq_async.consumer.orderly.OrderlyConsumeService`: listeners, in queue order;
* :class:`~rmq_async.consumer.sink_service.SinkConsumeService`: sinks (Spark).

The service acknowledges what was consumed by removing it from the ProcessQueue and moving the
queue's offset in the offset store; a queue dropped meanwhile commits nothing. The
:class:`ServiceRouter` picks the service of a chunk from the subscription of its topic.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from rmq_async.protocol.types import PROPERTY_RETRY_TOPIC

if TYPE_CHECKING:
    from rmq_async.consumer.process_queue import ProcessQueue
    from rmq_async.consumer.subscriptions import Subscriptions
    from rmq_async.protocol.stored import StoredChunk
    from rmq_async.protocol.types import MessageExt, MessageQueue

#: A message that could not be handed back to the broker is consumed again after this long.
SEND_BACK_FAILED_RETRY_DELAY = 5.0


@dataclass(slots=True)
class PullRequest:
    mq: MessageQueue
    pq: ProcessQueue
    next_offset: int
    #: Orderly mode: re-read the offset from the broker before the first pull after locking.
    previously_locked: bool = False


class ConsumeService(Protocol):
    """A consumption service, as the pull loop and the consumer's lifecycle use it."""

    in_order: bool
    """Queues are consumed in offset order: their pulls are neither span-limited nor sent
    ahead, and (clustering) wait for :meth:`pull_gate`."""

    def start(self) -> None:
        """Start the service's tasks."""

    def submit(self, msgs: list[MessageExt], pq: ProcessQueue, mq: MessageQueue,
               first: bool) -> None:
        """Take a pulled chunk of ``mq`` (cached in ``pq``; one subscribed topic).

        ``first``: ``pq`` had no consume turn pending (see ``ProcessQueue.put_messages``).
        """

    def pull_delay(self, topic: str) -> float:
        """Seconds the pulls of ``topic`` should wait for this service to catch up (0: none)."""

    async def pull_gate(self, req: PullRequest) -> float:
        """Seconds to wait before pulling ``req``'s queue (in-order services only)."""

    async def wait_idle(self) -> None:
        """Start nothing new and wait until what runs has ended (``stop()``)."""

    async def aclose(self) -> None:
        """End every task of the service."""


class StoredChunkService(ConsumeService, Protocol):
    """A consumption service that also takes undecoded chunks (the sink service)."""

    def submit_stored(self, chunk: StoredChunk, pq: ProcessQueue, mq: MessageQueue) -> None:
        """Take a pulled chunk of ``mq`` kept undecoded (cached in ``pq`` as one entry)."""


class ServiceRouter:
    """Hands each pulled chunk to the service that consumes its topic.

    Orderly subscriptions go to the orderly service (which takes the messages from the
    ProcessQueue itself, in offset order), sink subscriptions to the sink service, the rest to
    the concurrent service. One pull of ``%RETRY%<group>`` can carry messages of several
    subscribed topics: it is split by the topic each message was first sent to, except that
    the parts bound for one sink stay one chunk (in offset order). A sink's batch covers a
    contiguous offset range per queue; two parts of one pull offered apart could fall into
    two batches whose ranges of the retry queue interleave, and an idempotent write of one
    range (``replaceWhere``) would then delete rows the other batch wrote.
    """

    def __init__(self, subscriptions: Subscriptions, *, concurrent: ConsumeService,
                 orderly: ConsumeService, sink: StoredChunkService) -> None:
        self._subs = subscriptions
        self._retry_topic = subscriptions.retry_topic
        self.concurrent = concurrent
        self.orderly = orderly
        self.sink = sink

    def service_for(self, topic: str) -> ConsumeService:
        subs = self._subs
        if subs.is_orderly(topic):
            return self.orderly
        sub = subs.topics.get(topic)
        if sub is not None and sub.sink is not None:
            return self.sink
        return self.concurrent

    def submit(self, msgs: list[MessageExt], pq: ProcessQueue, mq: MessageQueue,
               first: bool) -> None:
        topic = mq.topic
        if self._subs.is_orderly(topic):
            self.orderly.submit(msgs, pq, mq, first)
            return
        if topic != self._retry_topic:
            self._submit_to(topic, msgs, pq, mq, first)
            return
        # One part per origin topic, or per sink for the topics of one sink, in offset order.
        parts: dict[str | int, tuple[str, list[MessageExt]]] = {}
        for m in msgs:
            origin = m.properties.get(PROPERTY_RETRY_TOPIC, topic)
            sink = self._subs.sink_for(origin)
            parts.setdefault(origin if sink is None else id(sink), (origin, []))[1].append(m)
        for origin, part in parts.values():
            self._submit_to(origin, part, pq, mq, first)

    def submit_stored(self, chunk: StoredChunk, pq: ProcessQueue, mq: MessageQueue,
                      first: bool) -> None:
        """Take a sink subscription's undecoded chunk (see :mod:`rmq_async.protocol.stored`)."""
        self.sink.submit_stored(chunk, pq, mq)

    def _submit_to(self, origin: str, msgs: list[MessageExt], pq: ProcessQueue,
                   mq: MessageQueue, first: bool) -> None:
        sub = self._subs.topics.get(origin)
        if sub is not None and sub.sink is not None:
            self.sink.submit(msgs, pq, mq, first)
            return
        self.concurrent.submit(msgs, pq, mq, first)


async def wait_all_idle(services: Iterable[ConsumeService], timeout: float) -> bool:
    """Wait for every service's :meth:`~ConsumeService.wait_idle` side by side, for at most
    ``timeout`` seconds in all; False when the time ran out (what still ran is cancelled).

    Side by side, so a sink's slow final write does not use up the time of listener calls
    that would have finished: each service drains for the whole ``timeout``.
    """
    try:
        async with asyncio.timeout(timeout), asyncio.TaskGroup() as tg:
            for service in services:
                tg.create_task(service.wait_idle())
    except TimeoutError:
        return False
    return True

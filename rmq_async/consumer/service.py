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
from collections.abc import Hashable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from rmq_async.consumer.tasks import UserCall, enter_user_call
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

    async def wait_idle(self, caller: asyncio.Task[Any] | None = None) -> None:
        """Start nothing new and wait until what runs has ended (``stop()``), but for a call
        running in ``caller``: the task that called ``stop()`` from a handler."""

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


class BusyWorkers:
    """Which worker tasks of a service have work in hand (a chunk, an orderly turn).

    :meth:`take` enters the work as the worker's :class:`~rmq_async.consumer.tasks.UserCall`
    (the handler calls it makes), :meth:`done` ends it. :meth:`wait_idle` waits until no
    worker has work in hand, but for the ``caller`` of ``stop()``: a handler that calls
    ``stop()`` is part of its worker's work, which cannot end before ``stop()`` does.
    """

    __slots__ = ("_busy", "_family", "_idle", "_spared")

    def __init__(self, family: object) -> None:
        self._family = family
        self._busy: set[asyncio.Task[Any]] = set()
        self._spared: set[asyncio.Task[Any]] = set()
        self._idle = asyncio.Event()
        self._idle.set()

    def take(self, worker: asyncio.Task[Any], queue: Hashable | None = None) -> UserCall:
        """Called by ``worker`` itself (its context is marked)."""
        self._busy.add(worker)
        self._idle.clear()
        return enter_user_call(worker, self._family, queue)

    def done(self, call: UserCall) -> None:
        call.done = True
        busy = self._busy
        busy.discard(call.task)
        if not busy or busy <= self._spared:
            self._idle.set()

    async def wait_idle(self, caller: asyncio.Task[Any] | None = None) -> None:
        self._spared = {caller} if caller is not None else set()
        while self._busy - self._spared:
            self._idle.clear()
            await self._idle.wait()


async def wait_all_idle(services: Iterable[ConsumeService], timeout: float,
                        caller: asyncio.Task[Any] | None = None) -> bool:
    """Wait for every service's :meth:`~ConsumeService.wait_idle` side by side, for at most
    ``timeout`` seconds in all; False when the time ran out (what still ran is cancelled).
    A call running in ``caller`` (``stop()`` called from a handler) is not waited for.

    Side by side, so a sink's slow final write does not use up the time of listener calls
    that would have finished: each service drains for the whole ``timeout``.
    """
    try:
        async with asyncio.timeout(timeout), asyncio.TaskGroup() as tg:
            for service in services:
                tg.create_task(service.wait_idle(caller))
    except TimeoutError:
        return False
    return True

"""Problems the consumer works around but the user must hear about.

Some failures do not stop a consumer and cannot be answered by a retry: a stored record that
cannot be decoded (skipped, see :class:`~rmq_async.consumer.pull.PullService`), a broker that
refuses this client a topic after it started. Each is reported once per occurrence (not once
per retry) as a :class:`ConsumerError` to the handlers registered with
:meth:`PushConsumer.on_error <rmq_async.consumer.push.PushConsumer.on_error>`, logged under a
stable event name, and counted per topic in :meth:`PushConsumer.stats_snapshot`.
"""

from __future__ import annotations

import asyncio
import inspect
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

import structlog

from rmq_async.consumer.hooks import call_user, is_async_callable
from rmq_async.consumer.tasks import TaskOwner, ends_the_caller, enter_user_call
from rmq_async.errors import IllegalStateError
from rmq_async.protocol.types import MessageQueue

log = structlog.get_logger(__name__)

__all__ = ["ConsumerError", "ConsumerErrorKind", "ErrorHandler", "ErrorReporter"]


class ConsumerErrorKind(StrEnum):
    CORRUPT_RECORD = "corrupt_record"
    """A pulled record could not be decoded; it was skipped (the records around it were not)."""
    PERMISSION_DENIED = "permission_denied"
    """A broker answered NO_PERMISSION for a queue; it is retried until the right comes back."""
    PERMISSION_RESTORED = "permission_restored"
    """A queue that was refused is pulled again."""


@dataclass(frozen=True, slots=True)
class ConsumerError:
    kind: ConsumerErrorKind
    topic: str
    queue: MessageQueue | None
    offset: int | None
    detail: str


ErrorHandler = Callable[[ConsumerError], Any]


class ErrorReporter:
    """Delivers :class:`ConsumerError` events to the registered handlers and counts them.

    While the consumer runs, the events go to the handlers in the order they were reported,
    one event at a time, from one task the consumer owns: an ``async def`` handler is awaited
    there, a plain one runs in a worker thread (as plain hooks do), so a handler that blocks
    (a webhook, a file) never stalls the event loop. A handler that raises is logged
    (``consumer.error_handler_failed``) and the others still get the event. Events reported
    while no consumer runs are counted and logged; plain handlers get them at once, in the
    reporting thread, and ``async def`` ones not at all (nothing would own their task).
    ``stop()`` lets the events reported before it reach the handlers (:meth:`drain`) within
    its timeout; what a hung handler still holds up then is dropped and logged.
    """

    def __init__(self) -> None:
        self.handlers: list[ErrorHandler] = []
        self.counts: Counter[tuple[str, str]] = Counter()  # (topic, kind) -> events
        self._owner: TaskOwner | None = None  # runs the deliveries while the consumer runs
        self._loop: asyncio.AbstractEventLoop | None = None  # the consumer's event loop
        self._pending: deque[ConsumerError] = deque()
        self._delivery: asyncio.Task[None] | None = None

    @property
    def owner(self) -> TaskOwner | None:
        return self._owner

    @owner.setter
    def owner(self, owner: TaskOwner | None) -> None:
        """Set by the consumer on its event loop when it starts (``None`` when it stops)."""
        self._owner = owner
        try:
            self._loop = asyncio.get_running_loop() if owner is not None else None
        except RuntimeError:
            self._loop = None

    def report(self, event: ConsumerError) -> None:
        loop = self._loop
        if loop is not None and self._owner is not None and not _on_loop(loop):
            # Reported from another thread (a plain handler calling report_error): the
            # event is taken on the consumer's loop, where the delivery task lives.
            loop.call_soon_threadsafe(self.report, event)
            return
        self.counts[(event.topic, str(event.kind))] += 1
        level = log.info if event.kind is ConsumerErrorKind.PERMISSION_RESTORED else log.error
        level(f"consumer.{event.kind}", topic=event.topic,
              queue=str(event.queue) if event.queue else None, offset=event.offset,
              detail=event.detail)
        if not self.handlers:
            return
        if self.owner is None:
            self._deliver_inline(event)
            return
        self._pending.append(event)
        if self._delivery is not None and not self._delivery.done():
            return  # the running delivery takes it in turn
        try:
            self._delivery = self.owner.spawn(self._deliver(), name="on-error")
        except IllegalStateError:  # the consumer is stopping: no task may start now
            self._pending.clear()

    async def drain(self, timeout: float, caller: asyncio.Task[Any] | None = None) -> bool:
        """Wait, for at most ``timeout`` seconds, until the events reported so far (and any
        reported meanwhile) have reached the handlers; False when some had not (``stop()``
        then cancels the delivery, and the undelivered events are logged as dropped).

        Not when the delivery is the ``caller`` (a handler called ``stop()``): it goes on
        with the events behind it once that handler has returned, and then ends.
        """
        loop = asyncio.get_running_loop()
        give_up_at = loop.time() + max(timeout, 0.0)
        # An event reported after a delivery ended (from a plain handler's thread, say)
        # starts the next one: wait for that too.
        while (delivery := self._delivery) is not None and not delivery.done():
            if delivery is caller:
                return True
            await asyncio.wait({delivery}, timeout=max(give_up_at - loop.time(), 0.0))
            if not delivery.done():
                log.warning("consumer.error_events_undelivered", pending=len(self._pending) + 1,
                            waited=round(max(timeout, 0.0), 3))
                return False
        return True

    async def _deliver(self) -> None:
        # Ends (and is done) as soon as nothing is pending: an event reported after that
        # starts the next delivery. Cancelled by stop() (after drain() gave it what was left
        # of stop's timeout), it leaves the rest undelivered.
        me = asyncio.current_task()
        assert me is not None
        family = self._owner.family if self._owner is not None else None
        try:
            while self._pending:
                event = self._pending.popleft()
                # (A handler that calls stop() is this task's user call: not waited for.)
                with enter_user_call(me, family):
                    for handler in list(self.handlers):
                        try:
                            await call_user(handler, event)
                        except BaseException as exc:
                            if ends_the_caller(exc):
                                raise
                            _handler_failed(handler, exc)
        except asyncio.CancelledError:
            self._pending.clear()
            raise

    def _deliver_inline(self, event: ConsumerError) -> None:
        for handler in list(self.handlers):
            if is_async_callable(handler):
                continue
            try:
                result = handler(event)
            except BaseException as exc:
                if isinstance(exc, SystemExit | KeyboardInterrupt):
                    raise
                _handler_failed(handler, exc)
                continue
            if inspect.iscoroutine(result):  # a plain function that returned a coroutine
                result.close()

    def topic_counts(self, topic: str) -> dict[str, int]:
        return {kind: n for (t, kind), n in self.counts.items() if t == topic}


def _on_loop(loop: asyncio.AbstractEventLoop) -> bool:
    try:
        return asyncio.get_running_loop() is loop
    except RuntimeError:  # no loop runs in this thread
        return False


def _handler_failed(handler: ErrorHandler, exc: BaseException) -> None:
    log.warning("consumer.error_handler_failed", handler=_name(handler),
                error=f"{type(exc).__name__}: {exc}")


def _name(fn: Callable[..., Any]) -> str:
    return getattr(fn, "__qualname__", repr(fn))

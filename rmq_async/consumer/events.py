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
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

import structlog

from rmq_async.consumer.tasks import TaskOwner
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
    """Delivers :class:`ConsumerError` events to the registered handlers and counts them."""

    def __init__(self) -> None:
        self.handlers: list[ErrorHandler] = []
        self.counts: Counter[tuple[str, str]] = Counter()  # (topic, kind) -> events
        self.owner: TaskOwner | None = None  # runs async handlers while the consumer runs

    def report(self, event: ConsumerError) -> None:
        self.counts[(event.topic, str(event.kind))] += 1
        level = log.info if event.kind is ConsumerErrorKind.PERMISSION_RESTORED else log.error
        level(f"consumer.{event.kind}", topic=event.topic,
              queue=str(event.queue) if event.queue else None, offset=event.offset,
              detail=event.detail)
        for handler in self.handlers:
            try:
                result = handler(event)
            except Exception as exc:
                log.warning("consumer.error_handler_failed", handler=_name(handler),
                            error=f"{type(exc).__name__}: {exc}")
                continue
            if inspect.isawaitable(result):
                self._run_async(handler, result)

    def _run_async(self, handler: ErrorHandler, awaitable: Any) -> None:
        async def run() -> None:
            try:
                await awaitable
            except Exception as exc:
                log.warning("consumer.error_handler_failed", handler=_name(handler),
                            error=f"{type(exc).__name__}: {exc}")

        if self.owner is None:
            # Reported outside a running consumer: nothing owns a task, so drop it cleanly.
            if asyncio.iscoroutine(awaitable):
                awaitable.close()
            return
        try:
            self.owner.spawn(run(), name=f"on-error:{_name(handler)}")
        except RuntimeError:  # the consumer is stopping
            if asyncio.iscoroutine(awaitable):
                awaitable.close()

    def topic_counts(self, topic: str) -> dict[str, int]:
        return {kind: n for (t, kind), n in self.counts.items() if t == topic}


def _name(fn: Callable[..., Any]) -> str:
    return getattr(fn, "__qualname__", repr(fn))

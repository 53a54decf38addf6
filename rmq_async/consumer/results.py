"""What a listener returns, and the context it may adjust.

One enum serves both listener kinds. Concurrent listeners return ``SUCCESS`` or
``RECONSUME_LATER`` (Java ``ConsumeConcurrentlyStatus``); orderly listeners return ``SUCCESS`` or
``SUSPEND_CURRENT_QUEUE_A_MOMENT`` (Java ``ConsumeOrderlyStatus``; its deprecated ``COMMIT`` and
``ROLLBACK`` are accepted too). Returning ``None`` or raising means "failed": RECONSUME_LATER for
a concurrent listener, SUSPEND_CURRENT_QUEUE_A_MOMENT for an orderly one.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta
from enum import Enum, StrEnum
from typing import Any

import structlog

from rmq_async.protocol.types import MessageQueue

log = structlog.get_logger(__name__)

__all__ = [
    "ConsumeContext",
    "ConsumeResult",
    "DirectConsumeResult",
    "direct_consume_result",
    "normalize_result",
]


class ConsumeResult(Enum):
    """A listener's verdict on a batch."""

    SUCCESS = "SUCCESS"
    """Every message (concurrent: up to ``ack_index``) is done; the offset may move past it."""
    RECONSUME_LATER = "RECONSUME_LATER"
    """Concurrent: redeliver the batch later through the group's retry topic."""
    SUSPEND_CURRENT_QUEUE_A_MOMENT = "SUSPEND_CURRENT_QUEUE_A_MOMENT"
    """Orderly: pause this queue, then hand the same batch to the listener again."""
    COMMIT = "COMMIT"
    """Orderly, deprecated: like SUCCESS, and commit the offset even without auto-commit."""
    ROLLBACK = "ROLLBACK"
    """Orderly, deprecated: with auto-commit off, consume the batch again at once."""

    @property
    def is_success(self) -> bool:
        return self is ConsumeResult.SUCCESS or self is ConsumeResult.COMMIT


_BY_NAME: dict[str, ConsumeResult] = {r.value: r for r in ConsumeResult}
# Java spellings a user may return as strings.
_BY_NAME["CONSUME_SUCCESS"] = ConsumeResult.SUCCESS


def normalize_result(value: Any, *, orderly: bool = False) -> ConsumeResult:
    """Turn whatever a listener produced into a result its consume service understands.

    ``None``, an exception object, or anything unrecognised means failure. For a concurrent
    listener the result is one of SUCCESS / RECONSUME_LATER (COMMIT counts as SUCCESS, the
    other orderly failures as RECONSUME_LATER). For an orderly listener RECONSUME_LATER
    becomes SUSPEND_CURRENT_QUEUE_A_MOMENT. Strings naming a result (Java spellings included)
    are accepted.
    """
    result: ConsumeResult | None
    if isinstance(value, ConsumeResult):
        result = value
    elif isinstance(value, str):
        result = _BY_NAME.get(value.upper())
    else:
        result = None
    if result is None:
        if value is not None and not isinstance(value, BaseException):
            log.warning("consume.unexpected_result", result=repr(value)[:200])
        result = ConsumeResult.RECONSUME_LATER
    if orderly:
        if result is ConsumeResult.RECONSUME_LATER:
            return ConsumeResult.SUSPEND_CURRENT_QUEUE_A_MOMENT
        return result
    if result is ConsumeResult.COMMIT:
        return ConsumeResult.SUCCESS
    if result is ConsumeResult.SUCCESS:
        return result
    return ConsumeResult.RECONSUME_LATER


@dataclass(slots=True)
class ConsumeContext:
    """Passed to a listener that takes a second argument; it may change the fields.

    Concurrent (Java ``ConsumeConcurrentlyContext``):

    * ``ack_index``: with SUCCESS, ``k`` acknowledges the first ``k + 1`` messages of the batch
      and the rest are treated as failed (sent back for retry). ``None`` (the default, Java's
      ``Integer.MAX_VALUE``) acknowledges the whole batch. Ignored for RECONSUME_LATER.
    * ``delay_level_when_next_consume``: delay level for messages sent back; ``0`` lets the
      broker pick (3 + reconsume times), ``-1`` sends them straight to the dead-letter queue.

    Orderly (Java ``ConsumeOrderlyContext``):

    * ``auto_commit``: commit the offset after SUCCESS (default). With ``False`` only COMMIT
      commits, and ROLLBACK re-consumes the batch at once.
    * ``suspend_current_queue_time``: seconds (or a ``timedelta``) to pause after
      SUSPEND_CURRENT_QUEUE_A_MOMENT; ``None`` uses the consumer's option.
      ``suspend_current_queue_time_millis`` is the Java field (milliseconds, ``-1`` = unset),
      read when ``suspend_current_queue_time`` is ``None``.
    """

    message_queue: MessageQueue
    ack_index: int | None = None
    delay_level_when_next_consume: int = 0
    auto_commit: bool = True
    suspend_current_queue_time_millis: int = -1
    suspend_current_queue_time: float | timedelta | None = None

    def acked_count(self, batch_size: int, result: ConsumeResult) -> int:
        """How many leading messages of a batch of ``batch_size`` count as consumed.

        Java ``processConsumeResult``: SUCCESS acknowledges ``ack_index + 1`` messages, capped
        to the batch; any other result acknowledges none.
        """
        if not result.is_success:
            return 0
        if self.ack_index is None or self.ack_index >= batch_size:
            return batch_size
        return max(self.ack_index, -1) + 1


class DirectConsumeResult(StrEnum):
    """``consumeResult`` of a CONSUME_MESSAGE_DIRECTLY answer (Java ``CMResult``)."""

    CR_SUCCESS = "CR_SUCCESS"
    CR_LATER = "CR_LATER"
    CR_ROLLBACK = "CR_ROLLBACK"
    CR_COMMIT = "CR_COMMIT"
    CR_THROW_EXCEPTION = "CR_THROW_EXCEPTION"
    CR_RETURN_NULL = "CR_RETURN_NULL"


def direct_consume_result(raw: Any) -> DirectConsumeResult:
    """Map a listener's raw return value (or raised exception) to a ``CMResult`` name."""
    if isinstance(raw, BaseException):
        return DirectConsumeResult.CR_THROW_EXCEPTION
    if raw is None:
        return DirectConsumeResult.CR_RETURN_NULL
    result = normalize_result(raw, orderly=True)
    if result is ConsumeResult.SUCCESS:
        return DirectConsumeResult.CR_SUCCESS
    if result is ConsumeResult.COMMIT:
        return DirectConsumeResult.CR_COMMIT
    if result is ConsumeResult.ROLLBACK:
        return DirectConsumeResult.CR_ROLLBACK
    return DirectConsumeResult.CR_LATER

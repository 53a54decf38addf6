"""What a handler returns or raises, and the context it may adjust.

A handler that returns normally (``None`` or any value that is not a result) acknowledges its
message(s); one that raises fails them: RECONSUME_LATER for a concurrent subscription (sent
back, redelivered later through ``%RETRY%<group>``), SUSPEND_CURRENT_QUEUE_A_MOMENT for an
orderly one (retried in place). :class:`DeadLetter` sends them to ``%DLQ%<group>`` at once.

Java's contract keeps working: one enum serves both listener kinds. Concurrent handlers may
return ``SUCCESS`` or ``RECONSUME_LATER`` (Java ``ConsumeConcurrentlyStatus``); orderly ones
``SUCCESS`` or ``SUSPEND_CURRENT_QUEUE_A_MOMENT`` (Java ``ConsumeOrderlyStatus``; its deprecated
``COMMIT`` and ``ROLLBACK`` are accepted too).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from datetime import timedelta
from enum import Enum, StrEnum
from typing import Any

import structlog

from rmq_async.errors import RocketMQError
from rmq_async.protocol.types import MessageExt, MessageQueue

log = structlog.get_logger(__name__)

__all__ = [
    "ConsumeContext",
    "ConsumeResult",
    "DeadLetter",
    "RetryLater",
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
    """Orderly, deprecated: with auto-commit off, commit every message taken so far; with it
    on (the default), the same as SUCCESS (Java logs a warning, and so do we)."""
    ROLLBACK = "ROLLBACK"
    """Orderly, deprecated: with auto-commit off, put every uncommitted message back and
    consume them again after the suspend time; with it on, the same as SUCCESS (as in Java:
    the messages are acknowledged, with a warning)."""

    @property
    def is_success(self) -> bool:
        """``True`` for the results that acknowledge the batch (SUCCESS, COMMIT)."""
        return self is ConsumeResult.SUCCESS or self is ConsumeResult.COMMIT


_BY_NAME: dict[str, ConsumeResult] = {r.value: r for r in ConsumeResult}
# Java spellings a user may return as strings.
_BY_NAME["CONSUME_SUCCESS"] = ConsumeResult.SUCCESS


class RetryLater(RocketMQError):
    """The call failed without an exception of its own: retry its messages.

    Raised through the middlewares when a handler returned a failing :class:`ConsumeResult`
    (RECONSUME_LATER, SUSPEND_CURRENT_QUEUE_A_MOMENT, ROLLBACK), so that they see a failure;
    a handler or middleware may raise it too. ``result`` is the Java result it stands for.
    """

    def __init__(self, result: ConsumeResult = ConsumeResult.RECONSUME_LATER) -> None:
        super().__init__(result.value)
        self.result = result


class DeadLetter(RocketMQError):
    """Raised by a handler or a middleware: send the message(s) of this call to the
    dead-letter queue ``%DLQ%<group>`` at once, without further retries.

    ``reason`` travels with each message as its ``RMQ_DLQ_REASON`` property. In broadcasting
    mode, where the broker keeps no dead-letter queue, the messages are logged and dropped.
    """

    def __init__(self, reason: object) -> None:
        # Whatever the handler passed (an exception, say) travels as text.
        text = reason if isinstance(reason, str) else str(reason)
        super().__init__(text)
        self.reason = text


def normalize_result(value: Any, *, orderly: bool = False) -> ConsumeResult:
    """Turn whatever a handler returned into a result its consume service understands.

    A :class:`ConsumeResult` (or a string naming one, Java spellings included) keeps its
    meaning; ``None`` or any other value means the handler returned normally: SUCCESS. An
    exception object means failure. For a concurrent handler the result is one of SUCCESS /
    RECONSUME_LATER (COMMIT counts as SUCCESS, the other orderly failures as RECONSUME_LATER).
    For an orderly handler RECONSUME_LATER becomes SUSPEND_CURRENT_QUEUE_A_MOMENT.
    """
    result: ConsumeResult | None
    if value is None:
        return ConsumeResult.SUCCESS
    if isinstance(value, ConsumeResult):
        result = value
    elif isinstance(value, str):
        result = _BY_NAME.get(value.upper(), ConsumeResult.SUCCESS)
    elif isinstance(value, BaseException):
        result = ConsumeResult.RECONSUME_LATER
    else:
        result = ConsumeResult.SUCCESS
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
    """Given to a handler parameter annotated ``ConsumeContext``; the handler may change the
    fields.

    * ``message``: the message of this call (per-message handlers; ``None`` for a batch call);
      with ``model=`` it is how the handler reaches the message behind the decoded object.
    * ``messages``: the messages of this call (one for a per-message handler); with
      ``model=``, those of the decoded objects the batch handler gets, in the same order
      (a body that could not be decoded is left out, and is in ``dead_letters``).
    * ``dead_letters``: messages of this call bound for the dead-letter queue, with their
      reason (bodies a batch handler's decoder could not read are put here).

    Concurrent (Java ``ConsumeConcurrentlyContext``):

    * ``ack_index``: with SUCCESS, ``k`` acknowledges the first ``k + 1`` messages of
      ``messages`` and the rest are treated as failed (sent back for retry). ``None`` (the default, Java's
      ``Integer.MAX_VALUE``) acknowledges the whole batch. Ignored for RECONSUME_LATER.
    * ``delay_level_when_next_consume``: delay level for messages sent back; ``0`` lets the
      broker pick (3 + reconsume times), ``-1`` sends them straight to the dead-letter queue.

    Orderly (Java ``ConsumeOrderlyContext``):

    * ``auto_commit``: commit the offset after SUCCESS (default). With ``False`` a SUCCESS
      leaves the messages taken but uncommitted (they count in the queue's cache, and come
      again if the queue moves to another consumer), a COMMIT commits them and everything
      taken before, a ROLLBACK puts them all back to be consumed again after the suspend
      time. It is read per call.
    * ``suspend_current_queue_time``: seconds (or a ``timedelta``) to pause after
      SUSPEND_CURRENT_QUEUE_A_MOMENT; ``None`` uses the consumer's option. Either is kept
      within 10 ms and 30 s, as Java keeps it.
      ``suspend_current_queue_time_millis`` is the Java field (milliseconds, ``-1`` = unset),
      read when ``suspend_current_queue_time`` is ``None``.
    """

    message_queue: MessageQueue
    ack_index: int | None = None
    delay_level_when_next_consume: int = 0
    auto_commit: bool = True
    suspend_current_queue_time_millis: int = -1
    suspend_current_queue_time: float | timedelta | None = None
    message: MessageExt | None = None
    messages: list[MessageExt] = field(default_factory=list)
    dead_letters: list[tuple[MessageExt, str]] = field(default_factory=list)

    def acked_count(self, batch_size: int, result: ConsumeResult) -> int:
        """How many leading messages of a batch of ``batch_size`` count as consumed.

        Java ``processConsumeResult``: SUCCESS acknowledges ``ack_index + 1`` messages, capped
        to the batch; any other result acknowledges none.
        """
        if not result.is_success:
            return 0
        index: object = self.ack_index  # typed int, but a handler may set anything
        if index is not None and not isinstance(index, int):
            index = _as_ack_index(index)
        assert index is None or isinstance(index, int)
        if index is None or index >= batch_size:
            return batch_size
        return max(index, -1) + 1


def _as_ack_index(value: object) -> int:
    """An ``ack_index`` the handler set to something other than an int: a whole number (a
    float such as ``len(msgs) / 2``) counts as its floor; anything else acknowledges none of
    the batch (its messages are retried), with a warning."""
    try:
        return math.floor(value)  # type: ignore[call-overload, no-any-return]
    except (TypeError, ValueError, OverflowError):
        log.warning("consume.ack_index_invalid", ack_index=repr(value)[:80])
        return -1


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
    result = normalize_result(raw, orderly=True)
    if result is ConsumeResult.SUCCESS:
        return DirectConsumeResult.CR_SUCCESS
    if result is ConsumeResult.COMMIT:
        return DirectConsumeResult.CR_COMMIT
    if result is ConsumeResult.ROLLBACK:
        return DirectConsumeResult.CR_ROLLBACK
    return DirectConsumeResult.CR_LATER

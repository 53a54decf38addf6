"""Middlewares: code around every consume call of the listener subscriptions.

A middleware is ``async def mw(call: ConsumeCall, call_next) -> None``. It runs code before
``await call_next(call)`` and after it; ``call_next`` returns ``None`` when the call succeeded
(its messages are acknowledged) and raises when it failed: the handler's own exception,
:class:`~rmq_async.consumer.results.RetryLater` for a handler that returned a failing
``ConsumeResult``, :class:`~rmq_async.consumer.results.DeadLetter` as itself. So:

* timing, tracing, metrics: measure around ``call_next``;
* on error: ``try: await call_next(call) except ...``; swallowing the exception turns the call
  into an acknowledgement, raising ``DeadLetter(reason)`` sends its messages to the dead-letter
  queue, raising anything else retries them;
* dedup or filtering: call ``call_next`` with a copy of the call holding fewer messages (the
  messages left out are acknowledged), or not at all (all are acknowledged).

Middlewares run in registration order, the first registered outermost. They wrap every call of a
handler (one message for a per-message handler, the batch for a batch handler), concurrent and
orderly; sink subscriptions have no handler calls and no middlewares. With none registered the
consume services call handlers directly.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass

import structlog

from rmq_async.consumer.listener import ListenerAdapter, is_async, is_generator
from rmq_async.consumer.results import (
    ConsumeContext,
    ConsumeResult,
    DeadLetter,
    RetryLater,
    normalize_result,
)
from rmq_async.consumer.tasks import ends_the_caller
from rmq_async.errors import InvalidTypeError
from rmq_async.protocol.types import MessageExt, MessageQueue

log = structlog.get_logger(__name__)

__all__ = ["CallNext", "ConsumeCall", "Middleware", "Outcome", "check_middleware", "run_call"]


@dataclass(slots=True)
class ConsumeCall:
    """One call of a handler, as middlewares see it."""

    group: str
    """The consumer group."""
    topic: str
    """The subscribed topic (for a redelivered message, the topic it was first sent to)."""
    queue: MessageQueue
    """The queue the messages were pulled from (``%RETRY%<group>`` for redeliveries)."""
    messages: list[MessageExt]
    """The messages of the call: one for a per-message handler."""
    context: ConsumeContext
    """The context the handler receives (and may change)."""
    orderly: bool
    """The subscription is consumed in order (failures suspend the queue instead of retrying
    through the retry topic)."""
    handler_name: str
    """The handler's qualified name."""


CallNext = Callable[[ConsumeCall], Awaitable[None]]
"""What a middleware awaits to run the rest of the chain (the next middleware, then the handler)."""
Middleware = Callable[[ConsumeCall, CallNext], Awaitable[None]]
"""An ``async def mw(call, call_next)`` run around every handler call; see the module."""


def check_middleware(middleware: object) -> None:
    """``InvalidTypeError`` unless ``middleware`` is an ``async def`` (a bound ``__call__``, a
    ``functools.partial`` of one, or a decorator's wrapper that kept ``__wrapped__`` count):
    a plain ``def`` never awaits ``call_next`` and a generator runs nothing, so either would
    fail every call of every subscription without reaching a handler."""
    if not callable(middleware):
        raise InvalidTypeError(f"a middleware must be callable, got {middleware!r}")
    inner = middleware
    with contextlib.suppress(ValueError):  # (a __wrapped__ cycle: taken as it is)
        inner = inspect.unwrap(middleware)
    if is_generator(middleware) or not (is_async(middleware) or is_async(inner)):
        raise InvalidTypeError(
            f"a middleware must be an async def (call, call_next) that awaits call_next, "
            f"got {middleware!r}")


@dataclass(slots=True)
class Outcome:
    """What one call came to, for the consume service that settles its messages."""

    result: ConsumeResult
    """SUCCESS (or COMMIT) when the call succeeded; the failing result otherwise."""
    dead_reason: str | None = None
    """Set when the call's messages go to the dead-letter queue (``DeadLetter``)."""
    acked: list[MessageExt] | None = None
    """Messages a middleware left out of the call (acknowledged whatever the result)."""
    error: BaseException | None = None
    """The exception the handler (or a middleware) raised, other than ``RetryLater`` and
    ``DeadLetter``."""
    reached: bool = True
    """The call reached the handler (its decoder at least) with messages: ``False`` when a
    middleware answered for it, without calling on or with none left."""


_ORDERLY_FAILURES = (ConsumeResult.SUSPEND_CURRENT_QUEUE_A_MOMENT, ConsumeResult.ROLLBACK)


def _terminal(adapter: ListenerAdapter, orderly: bool, reached: list[ConsumeCall],
              succeeded: list[ConsumeResult]) -> CallNext:
    async def call_handler(call: ConsumeCall) -> None:
        if not call.messages:
            return  # a middleware filtered everything out: the handler is not reached
        reached.append(call)
        # Each reach of the handler starts clean: a middleware calling on again (a retry)
        # must not inherit the failed attempt's ack index or dead letters.
        call.context.ack_index = None
        call.context.dead_letters.clear()
        raw = await adapter.invoke(call.messages, call.context)
        if raw is None:
            return
        result = normalize_result(raw, orderly=orderly)
        if not result.is_success:
            raise RetryLater(result)
        succeeded.append(result)  # COMMIT means more than SUCCESS to the orderly service

    return call_handler


def _link(mw: Middleware, nxt: CallNext) -> CallNext:
    async def step(call: ConsumeCall) -> None:
        await mw(call, nxt)

    return step


def once_each(dead_letters: Sequence[tuple[MessageExt, str]],
              call: Sequence[MessageExt]) -> list[tuple[MessageExt, str]]:
    """``ctx.dead_letters`` of a call of ``call``'s messages (one queue's): each message once,
    under the first reason given (a handler may list one twice: it would be dead-lettered,
    and counted, as often), and as the call's own message object (a middleware may have
    handed the handler copies: matched by queue offset, as its acknowledgements are)."""
    own = {m.queue_offset: m for m in call}
    seen: dict[int, tuple[MessageExt, str]] = {}
    for m, reason in dead_letters:
        if m.queue_offset not in seen:
            seen[m.queue_offset] = (own.get(m.queue_offset, m), reason)
    return list(seen.values())


async def run_call(adapter: ListenerAdapter, msgs: list[MessageExt], ctx: ConsumeContext, *,
                   group: str, topic: str, queue: MessageQueue, orderly: bool,
                   middlewares: Sequence[Middleware]) -> Outcome:
    """One handler call through the middlewares; exceptions become an :class:`Outcome`.

    When a middleware handed the handler fewer messages than the call had (dedup), a failure
    (or an ack index) applies only to the messages the handler saw; the others are in
    ``Outcome.acked``. The messages are matched by queue offset, so a middleware may hand on
    copies (decompressed bodies, say) without its failures turning into acknowledgements.
    """
    failed = ConsumeResult.SUSPEND_CURRENT_QUEUE_A_MOMENT if orderly \
        else ConsumeResult.RECONSUME_LATER
    call = ConsumeCall(group=group, topic=topic, queue=queue, messages=msgs, context=ctx,
                       orderly=orderly, handler_name=adapter.name)
    reached: list[ConsumeCall] = []
    succeeded: list[ConsumeResult] = []
    chain = _terminal(adapter, orderly, reached, succeeded)
    for mw in reversed(middlewares):
        chain = _link(mw, chain)
    outcome: Outcome
    try:
        await chain(call)
    except DeadLetter as exc:
        outcome = Outcome(failed, dead_reason=exc.reason or "DeadLetter")
    except RetryLater as exc:
        # Orderly keeps SUSPEND / ROLLBACK; concurrent knows one failure, RECONSUME_LATER.
        # RetryLater is a failure whatever it names (RetryLater(COMMIT) commits nothing).
        keep = exc.result in _ORDERLY_FAILURES if orderly \
            else exc.result is ConsumeResult.RECONSUME_LATER
        outcome = Outcome(exc.result if keep else failed)
    except BaseException as exc:
        if ends_the_caller(exc):
            raise
        # A CancelledError of the handler's own (it awaited a task that was cancelled) is a
        # failure like any other: raised on, it would end the worker and strand the queue.
        log.warning("consume.handler_raised", group=group, topic=topic, queue=str(queue),
                    handler=adapter.name, offsets=[m.queue_offset for m in msgs[:16]],
                    msg_ids=[m.msg_id for m in msgs[:8]], error=f"{type(exc).__name__}: {exc}")
        outcome = Outcome(failed, error=exc)
    else:
        outcome = Outcome(succeeded[-1] if succeeded else ConsumeResult.SUCCESS)
    outcome.reached = bool(reached)
    if reached and reached[-1].messages is not msgs:
        # One call's messages are of one queue: the offset names each of them.
        seen = {m.queue_offset for m in reached[-1].messages}
        outcome.acked = [m for m in msgs if m.queue_offset not in seen]
    return outcome



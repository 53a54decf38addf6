"""OpenTelemetry spans per consume call (optional extra ``otel``: opentelemetry-api).

::

    from rmq_async.observability.otel import TracingMiddleware

    consumer.add_middleware(TracingMiddleware())            # the global tracer provider
    consumer.add_middleware(TracingMiddleware(tracer_provider=provider))

Each consume call (one listener call: one message, or a batch) runs inside one span that
follows the OpenTelemetry semantic conventions for messaging (consumer "process" spans):

====================================== =========================================================
span / attribute                       value
====================================== =========================================================
name                                   ``process <topic>``
kind                                   ``CONSUMER``
``messaging.system``                   ``rocketmq``
``messaging.operation.type``           ``process``
``messaging.operation.name``           ``process``
``messaging.destination.name``         the subscribed topic
``messaging.destination.partition.id`` the queue id (string)
``messaging.consumer.group.name``      the consumer group
``messaging.batch.message_count``      number of messages (calls with more than one message)
``messaging.message.id``               the message id (calls with one message)
``messaging.message.body.size``        body size in bytes (calls with one message)
``messaging.rocketmq.message.tag``     the message's tag (calls with one message, when set)
``messaging.rocketmq.message.keys``    the message's keys (calls with one message, when set)
``messaging.rocketmq.consumption_model`` ``clustering`` / ``broadcasting`` when given
``server.address``                     the broker name of the queue
``code.function.name``                 the handler's name
====================================== =========================================================

A call that fails (the handler raised, asked for a retry, or sent the message to the
dead-letter queue) ends its span with status ``ERROR``, the exception recorded as a span event
and ``error.type`` set to the exception's class name; the exception goes on unchanged. A batch
call whose handler returned but left messages bound for the dead-letter queue (bodies its
``model=`` could not read, ``ctx.dead_letters``) ends with ``ERROR`` too, ``error.type``
``DeadLetter``; so does a concurrent batch call that succeeded with an ``ack_index`` short of
the batch (the rest is retried), ``error.type`` ``RetryLater``. A call cancelled before its
handler finished (``stop()`` past its timeout) ends with ``ERROR``, ``error.type``
``CancelledError``.

Trace context travels in the message's properties (W3C ``traceparent`` / ``tracestate`` as an
instrumented producer writes them; whatever propagator is configured reads them): a call of one
message runs as a child of its producer's span; a batch call links to each message's.
"""

from __future__ import annotations

import asyncio
from typing import Any

from rmq_async.errors import MissingExtraError

try:
    from opentelemetry import propagate, trace
    from opentelemetry.context import Context
    from opentelemetry.trace import Link, SpanKind, Status, StatusCode, TracerProvider
except ImportError as exc:  # pragma: no cover - depends on what is installed
    raise MissingExtraError(f"rmq_async.observability.otel needs the otel extra "
                      f"(pip install 'rmq_async[otel]'): {exc}") from exc

from rmq_async.consumer.middleware import CallNext, ConsumeCall
from rmq_async.consumer.results import ConsumeResult

__all__ = ["TracingMiddleware"]

_SCOPE = "rmq_async"
#: Links of one batch span at most (a span's links are kept in memory until it ends).
MAX_LINKS = 128


def _producer_context(properties: dict[str, str]) -> Context | None:
    """The trace context a producer put into a message's properties, if any."""
    ctx = propagate.extract(properties)
    return ctx if trace.get_current_span(ctx).get_span_context().is_valid else None


class TracingMiddleware:
    """A consume middleware that wraps every consume call in a CONSUMER span.

    ``consumption_model`` (``"clustering"`` / ``"broadcasting"``) is added as
    ``messaging.rocketmq.consumption_model`` when given.
    """

    def __init__(self, tracer_provider: TracerProvider | None = None, *,
                 consumption_model: str | None = None) -> None:
        self._tracer = trace.get_tracer(_SCOPE, tracer_provider=tracer_provider)
        self._model = consumption_model

    def attributes(self, call: ConsumeCall) -> dict[str, Any]:
        msgs = call.messages
        attrs: dict[str, Any] = {
            "messaging.system": "rocketmq",
            "messaging.operation.type": "process",
            "messaging.operation.name": "process",
            "messaging.destination.name": call.topic,
            "messaging.destination.partition.id": str(call.queue.queue_id),
            "messaging.consumer.group.name": call.group,
            "server.address": call.queue.broker_name,
            "code.function.name": call.handler_name,
        }
        if self._model is not None:
            attrs["messaging.rocketmq.consumption_model"] = self._model
        if len(msgs) == 1:
            m = msgs[0]
            attrs["messaging.message.id"] = m.msg_id
            attrs["messaging.message.body.size"] = len(m.body)
            if m.tags:
                attrs["messaging.rocketmq.message.tag"] = m.tags
            if m.keys:
                attrs["messaging.rocketmq.message.keys"] = list(m.keys)
        else:
            attrs["messaging.batch.message_count"] = len(msgs)
        return attrs

    async def __call__(self, call: ConsumeCall, call_next: CallNext) -> None:
        # A message without a producer's trace context starts a trace of its own: not a child
        # of whatever span was current when the consumer's tasks were started.
        parent: Context = Context()
        links: list[Link] = []
        if len(call.messages) == 1:
            parent = _producer_context(call.messages[0].properties) or parent
        else:
            for m in call.messages[:MAX_LINKS]:
                produced = _producer_context(m.properties)
                if produced is not None:
                    links.append(Link(trace.get_current_span(produced).get_span_context()))
        with self._tracer.start_as_current_span(
            f"process {call.topic}", context=parent, kind=SpanKind.CONSUMER,
            attributes=self.attributes(call), links=links,
            record_exception=False, set_status_on_exception=False,
        ) as span:
            try:
                await call_next(call)
            except asyncio.CancelledError:
                # Cut short (stop() past its timeout, the queue given up): not a success; the
                # messages are not acknowledged and come again.
                span.set_attribute("error.type", "CancelledError")
                span.set_status(Status(StatusCode.ERROR, "cancelled before the handler "
                                                         "finished"))
                raise
            except BaseException as exc:  # any other: the call failed (pytest's Failed too)
                span.record_exception(exc)
                span.set_attribute("error.type", type(exc).__qualname__)
                span.set_status(Status(StatusCode.ERROR, f"{type(exc).__name__}: {exc}"))
                raise
            # ack_index counts what the handler got (an inner middleware may have passed on
            # fewer, a decoder left unreadable bodies out), as the service applies it.
            size = len(call.context.messages)
            acked = call.context.acked_count(size, ConsumeResult.SUCCESS)
            if not call.orderly and acked < size:
                # A success with an ack_index short of the batch: the rest is retried.
                span.set_attribute("error.type", "RetryLater")
                span.set_status(Status(StatusCode.ERROR, f"{acked} of {size} message(s) "
                                       "acknowledged (ack_index); the rest retried"))
            dead = call.context.dead_letters
            if dead:
                span.set_attribute("error.type", "DeadLetter")
                span.set_status(Status(StatusCode.ERROR, f"{len(dead)} message(s) bound for "
                                                         f"the dead-letter queue: {dead[0][1]}"))

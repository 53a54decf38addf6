"""How a user handler is called, whatever its shape.

The shape of a handler is read once, at ``subscribe()``, from its signature:

* **Payload.** The first parameter receives the payload. By default a handler is per-message: it
  receives one :class:`~rmq_async.protocol.types.MessageExt` (or, with ``model=`` /
  ``decoder=``, one decoded object) per call. It is a batch handler, receiving a list, when
  ``batch=True`` is given or when the first parameter is annotated ``list[...]`` (or
  ``Sequence[...]``); an unannotated first parameter is per-message.
* **Context.** A parameter annotated :class:`~rmq_async.consumer.results.ConsumeContext` (or a
  subclass) receives the call's context, by keyword; nothing is ever injected by position or by
  counting parameters. Any other parameter must have a default (it is left alone): a required
  one raises :class:`~rmq_async.errors.InvalidTypeError` (a ``TypeError``) at ``subscribe()``.
* ``async def`` handlers are awaited on the event loop; plain ``def`` handlers run in a worker
  thread so they never block it.

Return values and exceptions are interpreted by the consume services (see
:mod:`rmq_async.consumer.results`).
"""

from __future__ import annotations

import collections.abc
import contextlib
import functools
import inspect
import types
import typing
from collections.abc import Awaitable, Callable
from typing import Any

import anyio

from rmq_async.consumer.results import ConsumeContext, DeadLetter
from rmq_async.consumer.tasks import in_user_thread
from rmq_async.errors import InvalidTypeError
from rmq_async.payloads import PayloadDecodeError, build_payload_decoder
from rmq_async.protocol.types import MessageExt

Listener = Callable[..., Any]

__all__ = ["HandlerShape", "Listener", "ListenerAdapter", "inspect_handler"]

_LIST_ORIGINS: tuple[Any, ...] = (list, collections.abc.Sequence, collections.abc.MutableSequence,
                                  typing.Sequence, typing.List)  # noqa: UP006
#: What ``X | None`` and ``Optional[X]`` are at run time.
_UNIONS: tuple[Any, ...] = (typing.Union, types.UnionType)
_LIST_NAMES = ("list[", "List[", "Sequence[", "typing.List[", "typing.Sequence[",
               "collections.abc.Sequence[")


class HandlerShape(typing.NamedTuple):
    """What :func:`inspect_handler` read from a handler's signature."""

    batch: bool
    context_param: str | None
    is_async: bool
    name: str


def _resolved_hints(fn: Callable[..., Any]) -> dict[str, Any]:
    target = fn if inspect.isfunction(fn) or inspect.ismethod(fn) else getattr(fn, "__call__", fn)  # noqa: B004
    try:
        return typing.get_type_hints(target)
    except Exception:
        # Annotations naming classes local to a function cannot be resolved; the raw
        # annotation (a string under ``from __future__ import annotations``) is used instead.
        return {}


def _is_context(annotation: Any) -> bool:
    """``ConsumeContext``, also optional (``ConsumeContext | None``, ``Optional[...]``)."""
    if isinstance(annotation, str):
        parts = [p.strip().strip("'\"") for p in annotation.strip().strip("'\"").split("|")]
        if len(parts) == 1 and parts[0].startswith(("Optional[", "typing.Optional[")):
            parts = [parts[0].split("[", 1)[1].rstrip("]").strip()]
        named = [p for p in parts if p != "None"]
        return len(named) == 1 and named[0].rsplit(".", 1)[-1] == "ConsumeContext"
    args = typing.get_args(annotation) if typing.get_origin(annotation) in _UNIONS else ()
    if args:
        named = [a for a in args if a is not type(None)]
        return len(named) == 1 and _is_context(named[0])
    return isinstance(annotation, type) and issubclass(annotation, ConsumeContext)


def _is_list(annotation: Any) -> bool:
    if isinstance(annotation, str):
        text = annotation.strip().strip("'\"")
        return text in ("list", "List", "Sequence") or text.startswith(_LIST_NAMES)
    if annotation in _LIST_ORIGINS:
        return True
    origin = typing.get_origin(annotation)
    return origin is not None and origin in _LIST_ORIGINS


def is_async(fn: Callable[..., Any]) -> bool:
    if inspect.iscoroutinefunction(fn):
        return True
    if isinstance(fn, functools.partial):
        return is_async(fn.func)
    call = getattr(fn, "__call__", None)  # noqa: B004
    return call is not None and inspect.iscoroutinefunction(call)


def is_generator(fn: Callable[..., Any]) -> bool:
    """A (sync or async) generator function: calling it runs none of its body."""
    if isinstance(fn, functools.partial):
        return is_generator(fn.func)
    with contextlib.suppress(ValueError):  # (a __wrapped__ cycle: taken as it is)
        fn = inspect.unwrap(fn)  # a decorator that kept __wrapped__ calls what it wraps
    for f in (fn, getattr(fn, "__call__", None)):  # noqa: B004
        if f is not None and (inspect.isgeneratorfunction(f)
                              or inspect.isasyncgenfunction(f)):
            return True
    return False


def inspect_handler(fn: Callable[..., Any], *, batch: bool | None = None) -> HandlerShape:
    """Read a handler's shape (see the module docs); ``TypeError`` for one that cannot be called.

    ``batch``: ``True`` / ``False`` force the kind; ``None`` reads it from the first
    parameter's annotation.
    """
    if not callable(fn):
        raise InvalidTypeError(f"a handler must be callable, got {fn!r}")
    name = str(getattr(fn, "__qualname__", None) or getattr(type(fn), "__qualname__", repr(fn)))
    if is_generator(fn):
        # Called, it would only make a generator object (taken for a success), its body
        # never run: every message acknowledged unprocessed.
        raise InvalidTypeError(
            f"handler {name} is a generator function (it contains `yield`); a handler runs "
            "to its end and returns its result: write it without `yield`")
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError) as exc:
        raise InvalidTypeError(f"cannot read the signature of handler {name}: {exc}") from exc
    hints = _resolved_hints(fn)
    params = list(sig.parameters.values())
    positional = [p for p in params
                  if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    has_var_positional = any(p.kind is p.VAR_POSITIONAL for p in params)
    if not positional and not has_var_positional:
        raise InvalidTypeError(
            f"handler {name} takes no positional parameter for the message(s); "
            "write e.g. `async def handle(msg: MessageExt) -> None`")

    def annotation(p: inspect.Parameter) -> Any:
        return hints.get(p.name, p.annotation)

    first = positional[0] if positional else None
    if first is not None and _is_context(annotation(first)):
        raise InvalidTypeError(
            f"handler {name}: the first parameter {first.name!r} receives the message(s), "
            "but it is annotated ConsumeContext; put the message parameter first")
    context_param: str | None = None
    for p in params:
        if p is first or p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
            continue
        if _is_context(annotation(p)):
            if context_param is not None:
                raise InvalidTypeError(f"handler {name} has two ConsumeContext parameters "
                                f"({context_param!r} and {p.name!r})")
            if p.kind is p.POSITIONAL_ONLY:
                raise InvalidTypeError(f"handler {name}: the ConsumeContext parameter {p.name!r} "
                                "is positional-only; it is passed by keyword")
            context_param = p.name
            continue
        if p.default is p.empty:
            raise InvalidTypeError(
                f"handler {name}: parameter {p.name!r} has no default and is not annotated "
                "ConsumeContext; a handler receives the message(s) as its first argument and "
                "the context only through a parameter annotated ConsumeContext")
    listed = first is not None and _is_list(annotation(first))
    if batch is None:
        is_batch = listed
    else:
        is_batch = bool(batch)
        if not is_batch and listed:
            raise InvalidTypeError(f"handler {name}: batch=False but the first parameter "
                            f"{first.name if first else ''!r} is annotated as a list")
    return HandlerShape(batch=is_batch, context_param=context_param, is_async=is_async(fn),
                        name=name)


#: What a plain handler's thread returns when every body of a batch went to the dead-letter
#: queue and the handler was not called.
_NOTHING_TO_CALL = object()


class ListenerAdapter:
    """Calls a user handler the same way whatever its shape.

    :meth:`invoke` runs one consume call: it decodes the payloads (when the subscription has a
    ``model=`` / ``decoder=``), calls the handler and returns what the handler returned; the
    handler's exceptions propagate. A per-message handler is called with ``msgs[0]`` (consume
    services call it once per message); a batch handler with the list.
    """

    __slots__ = ("batch", "context_param", "decode", "decode_off_loop", "fn", "is_async",
                 "limiter", "name", "plain", "wants_context")

    def __init__(self, fn: Listener, *, batch: bool | None = None,
                 model: type[Any] | None = None,
                 decoder: Callable[[bytes], Any] | None = None) -> None:
        shape = inspect_handler(fn, batch=batch)
        self.fn = fn
        self.batch = shape.batch
        self.context_param = shape.context_param
        self.wants_context = shape.context_param is not None
        self.is_async = shape.is_async
        self.name = shape.name
        self.decode: Callable[[MessageExt], Any] | None = (
            build_payload_decoder(model, decoder) if model is not None or decoder is not None
            else None)
        #: Called with the raw messages and nothing else: the fast path of the services.
        self.plain = self.is_async and not self.wants_context and self.decode is None
        #: A ``decoder=`` of the user's may block (a schema registry, say): it runs in a worker
        #: thread, as plain handlers do, never on the event loop. The built-in decoders of
        #: ``model=`` alone (JSON, msgpack, msgspec, pydantic) run where the handler is called.
        self.decode_off_loop = decoder is not None
        #: The worker threads of plain handlers and decoders: the consumer's own (as many as
        #: its ``consume_concurrency``, like Java's consume thread pool), so that handlers
        #: never wait for, nor hold up, other users of anyio's shared default of 40 threads
        #: (an offset file's write, a Spark write). ``None``: that default.
        self.limiter: anyio.CapacityLimiter | None = None

    def _payload(self, msgs: list[MessageExt], ctx: ConsumeContext) -> Any:
        decode = self.decode
        if not self.batch:
            msg = msgs[0]
            if decode is None:
                return msg
            try:
                return decode(msg)
            except PayloadDecodeError as exc:
                raise DeadLetter(str(exc)) from exc
        if decode is None:
            return msgs
        out: list[Any] = []
        handed: list[MessageExt] = []
        for m in msgs:
            try:
                out.append(decode(m))
            except PayloadDecodeError as exc:
                ctx.dead_letters.append((m, str(exc)))
            else:
                handed.append(m)
        if len(handed) < len(msgs):
            # ``ctx.messages`` is what the handler gets, one for each decoded object: zipped
            # with them, or counted by ``ack_index`` (which the service applies to this list),
            # it must not include the messages left out.
            ctx.messages = handed
        return out

    async def invoke(self, msgs: list[MessageExt], ctx: ConsumeContext) -> Any:
        """One call of the handler for ``msgs`` (one message for a per-message handler).

        An undecodable body raises :class:`DeadLetter` (per-message) or is recorded in
        ``ctx.dead_letters`` and left out of the list (batch; with none left the handler is
        not called).
        """
        ctx.messages = msgs
        ctx.message = None if self.batch else msgs[0]
        kwargs = {} if self.context_param is None else {self.context_param: ctx}
        if not self.is_async:
            # A plain handler: its payload is decoded in the same worker thread.
            raw = await anyio.to_thread.run_sync(in_user_thread, self._decode_and_call, msgs,
                                                 ctx, kwargs, limiter=self.limiter)
            if raw is _NOTHING_TO_CALL:
                return None
        else:
            if self.decode_off_loop:
                payload = await anyio.to_thread.run_sync(in_user_thread, self._payload, msgs,
                                                         ctx, limiter=self.limiter)
            else:
                payload = self._payload(msgs, ctx)
            if self.batch and self.decode is not None and not payload:
                return None
            result: Awaitable[Any] = self.fn(payload, **kwargs)
            return await result
        if inspect.isawaitable(raw):
            # A plain function that returns a coroutine (``lambda m: handle(m)``, a decorator
            # whose wrapper is a plain ``def``): its result is what the coroutine returns.
            raw = await raw
        return raw

    def _decode_and_call(self, msgs: list[MessageExt], ctx: ConsumeContext,
                         kwargs: dict[str, Any]) -> Any:
        """A plain handler's call, in a worker thread: decode, then call."""
        payload = self._payload(msgs, ctx)
        if self.batch and self.decode is not None and not payload:
            return _NOTHING_TO_CALL
        return self.fn(payload, **kwargs)

    async def __call__(self, msgs: list[MessageExt], ctx: ConsumeContext) -> Any:
        """Call the handler on ``msgs``: once for a batch handler, once per message otherwise
        (stopping at, and returning, the first result that is not a success)."""
        if self.batch or len(msgs) == 1:
            return await self.invoke(msgs, ctx)
        from rmq_async.consumer.results import normalize_result

        raw: Any = None
        for m in msgs:
            raw = await self.invoke([m], ctx)
            if not normalize_result(raw).is_success:
                return raw
        return raw

    def __repr__(self) -> str:
        kind = "batch" if self.batch else "per-message"
        return f"<handler {self.name} {kind}{' +context' if self.wants_context else ''}>"

"""How a user listener is called, whatever its shape."""

from __future__ import annotations

import inspect
from collections.abc import Awaitable, Callable
from typing import Any

import anyio

from rmq_async.consumer.results import ConsumeContext
from rmq_async.protocol.types import MessageExt

Listener = Callable[..., Any]


class ListenerAdapter:
    """Calls a user listener the same way whatever its shape.

    A listener is ``async def f(msgs)`` / ``async def f(msgs, context)`` or the same as a plain
    ``def``; plain functions run in a worker thread so they never block the event loop. A return
    value of ``None`` or a raised exception means RECONSUME_LATER.
    """

    def __init__(self, fn: Listener) -> None:
        self.fn = fn
        self.is_async = inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(
            getattr(fn, "__call__", None)  # noqa: B004
        )
        try:
            params = [
                p for p in inspect.signature(fn).parameters.values()
                if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
            ]
            self.wants_context = len(params) >= 2
        except (TypeError, ValueError):
            self.wants_context = False
        self.name = getattr(fn, "__qualname__", repr(fn))

    async def __call__(self, msgs: list[MessageExt], ctx: ConsumeContext) -> Any:
        args: tuple[Any, ...] = (msgs, ctx) if self.wants_context else (msgs,)
        if self.is_async:
            result: Awaitable[Any] = self.fn(*args)
            return await result
        return await anyio.to_thread.run_sync(lambda: self.fn(*args))

"""Sinks: consumers of message batches that acknowledge messages only once they are stored.

The Spark sink lives in :mod:`rmq_async.sinks.spark` and needs the ``spark`` extra
(``pip install 'rmq_async[spark]'``); this package itself imports neither PySpark nor pyarrow, so
the consumer can type against :class:`MessageSink` without them.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine
from typing import Any, Protocol

from rmq_async.errors import IllegalStateError
from rmq_async.protocol.stored import StoredChunk
from rmq_async.protocol.types import MessageExt, MessageQueue

__all__ = ["AckCallback", "MessageSink", "SinkClosedError", "TaskSpawner"]

#: Called exactly once per offered chunk, on the event loop: ``True`` once the chunk is stored,
#: ``False`` when storing it failed for good (the consumer then runs its failure path).
AckCallback = Callable[[bool], None]


class SinkClosedError(IllegalStateError):
    """A chunk was offered to a sink that is closing or closed."""


class TaskSpawner(Protocol):
    """Anything that owns tasks and starts one from a coroutine (the consumer's task owner)."""

    def spawn(self, coro: Coroutine[Any, Any, Any], *, name: str) -> Any: ...


class MessageSink(Protocol):
    """What a consumer needs from a sink. Every method is called on the event loop."""

    def offer(self, msgs: list[MessageExt] | StoredChunk, ack: AckCallback, *,
              redelivered: bool = False) -> None:
        """Take a chunk: a pull's messages, or its records undecoded (a
        :class:`~rmq_async.protocol.stored.StoredChunk`, whose ``messages()`` decodes them);
        ``ack`` is called once its fate is known. ``redelivered`` marks messages offered
        again after their write failed (and the broker did not take them back): they sit
        below offsets of their queue offered since, maybe already stored."""
        ...

    def queue_reassigned(self, mq: MessageQueue) -> None:
        """``mq`` was given up (a rebalance, an offset the broker moved) and taken again: the
        rows of it offered from now on are pulled anew from its committed offset, maybe after
        another consumer stored rows of it. Rows of both assignments must not share a batch
        whose offset range covers what the other consumer stored. Called before the first
        chunk of the new assignment is offered. (Optional: a sink without it is not told.)"""
        ...

    def want_more(self) -> bool:
        """False while the sink is behind; the consumer should then pause pulling."""
        ...

    async def wait_for_room(self) -> None:
        """Return once :meth:`want_more` is True."""
        ...

    def set_flow_limit(self, rows: int | None, bytes_: int | None = None) -> None:
        """The most messages (and body bytes) the consumer's flow control lets the sink hold."""
        ...

    def expedite(self) -> None:
        """A queue stopped pulling until something is acknowledged: close the open batch soon."""
        ...

    def caught_up(self) -> None:
        """Every queue of the sink's topic has been read to the end the broker reported."""
        ...

    @property
    def backlog_rows(self) -> int:
        """Messages offered and not yet acknowledged."""
        ...

    async def start(self, owner: TaskSpawner | asyncio.TaskGroup) -> None:
        """Start :meth:`run` as a task of ``owner``."""
        ...

    async def run(self) -> None:
        """The sink's writer loop; runs in the consumer's task group until :meth:`aclose`."""
        ...

    async def flush(self) -> None:
        """Store everything offered so far (or fail it) before returning."""
        ...

    async def aclose(self) -> None:
        """Flush, then end :meth:`run`. Idempotent."""
        ...

"""Rebalance listeners and lifespan hooks of a :class:`~rmq_async.consumer.push.PushConsumer`.

Rebalance listeners (as aiokafka's ``ConsumerRebalanceListener``, with methods named
``on_assigned`` / ``on_revoked``) hear which queues this client takes and gives up:

* ``on_revoked(queues)`` is awaited when a rebalance round (or ``stop()``) gives queues up,
  **before** their offsets are persisted and before their process queues are dropped: pulls of
  those queues may still be running and listener calls may still acknowledge messages while it
  runs, and what they acknowledge is persisted right after it returns.
* ``on_assigned(queues)`` is awaited after a round added queues (their process queues exist and
  their start offsets are known) and **before** their first pull.

Lifespan hooks: ``on_startup()`` is awaited in ``start()`` once the client is connected and
registered, before the first rebalance (so before any pull); an exception there fails
``start()``. ``on_shutdown()`` is awaited in ``stop()`` after the listeners drained and the
offsets were persisted, before the client unregisters and closes its connections; an
exception there is logged and ``stop()`` goes on.

Each hook may be ``async def`` or a plain function; plain functions run in a worker thread so
they never block the event loop. An exception raised by a rebalance listener is logged
(``consumer.rebalance_listener_failed``) and the rebalance goes on as if it had returned.

In ``stop()`` the ``on_revoked`` listeners, then the ``on_shutdown`` hooks, run within what is
left of ``stop()``'s timeout after the drain (each group gets at least a second, or the whole
timeout when it is shorter; each hook, even one whose turn comes late, a tenth of a second):
a hook still running then is cancelled and not waited for (a plain
function's thread cannot be cancelled: it finishes on its own), logged
(``consumer.hook_timed_out``), and ``stop()`` goes on.
"""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import Callable, Iterable
from typing import Any, Protocol, runtime_checkable

import anyio
import structlog

from rmq_async.consumer.tasks import being_cancelled, ends_the_caller, in_user_thread
from rmq_async.errors import InvalidTypeError
from rmq_async.protocol.types import MessageQueue

log = structlog.get_logger(__name__)

__all__ = ["LifespanHook", "QueuesHook", "RebalanceHooks", "RebalanceListener"]

#: A rebalance hook: receives the queues (a ``frozenset``) taken or given up.
QueuesHook = Callable[[frozenset[MessageQueue]], Any]
#: A lifespan hook: called without arguments.
LifespanHook = Callable[[], Any]


@runtime_checkable
class RebalanceListener(Protocol):
    """An object with both rebalance callbacks, passed as ``PushConsumer(rebalance_listener=)``.

    Either method may be ``async def`` or plain.
    """

    def on_assigned(self, queues: frozenset[MessageQueue]) -> Any: ...

    def on_revoked(self, queues: frozenset[MessageQueue]) -> Any: ...


def _name(fn: Callable[..., Any]) -> str:
    return getattr(fn, "__qualname__", None) or repr(fn)


def is_async_callable(fn: Callable[..., Any]) -> bool:
    """Is ``fn`` an ``async def`` function, or an object whose ``__call__`` is one?"""
    return inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(
        getattr(fn, "__call__", None))  # noqa: B004


async def call_user(fn: Callable[..., Any], *args: Any) -> None:
    """Call a user callback that may be ``async def`` (awaited) or plain (run in a worker
    thread, and an awaitable it returns awaited)."""
    if is_async_callable(fn):
        await fn(*args)
        return
    # A cancelled wait (a rebalance round cut short by stop(), a hook over stop()'s timeout)
    # does not wait for the thread: it cannot be interrupted, and finishes on its own.
    result = await anyio.to_thread.run_sync(in_user_thread, fn, *args, abandon_on_cancel=True)
    if inspect.isawaitable(result):  # a plain function that returned an awaitable
        await result


#: The least time a hook run by ``stop()`` gets, even after its group's deadline: enough to
#: start (a plain one in its thread) and, for a quick one, to finish.
MIN_HOOK_SECONDS = 0.1


class RebalanceHooks:
    """The rebalance and lifespan hooks registered on one consumer, and how they are called."""

    def __init__(self) -> None:
        self.assigned: list[QueuesHook] = []
        self.revoked: list[QueuesHook] = []
        self.startup: list[LifespanHook] = []
        self.shutdown: list[LifespanHook] = []
        # Hooks that ran out of stop()'s time, or whose stop() was cancelled: cancelled, not
        # waited for, kept until they end.
        self._overdue: set[asyncio.Task[None]] = set()

    def add_listener(self, listener: RebalanceListener) -> None:
        if not isinstance(listener, RebalanceListener):
            raise InvalidTypeError(
                "a rebalance listener needs on_assigned(queues) and on_revoked(queues)")
        self.assigned.append(listener.on_assigned)
        self.revoked.append(listener.on_revoked)

    async def fire_assigned(self, group: str, queues: Iterable[MessageQueue]) -> None:
        await self._fire("assigned", self.assigned, group, frozenset(queues))

    async def fire_revoked(self, group: str, queues: Iterable[MessageQueue], *,
                           deadline: float | None = None) -> None:
        """Await the ``on_revoked`` listeners; with ``deadline`` (event loop time), until
        then at most."""
        await self._fire("revoked", self.revoked, group, frozenset(queues), deadline)

    async def _fire(self, which: str, hooks: list[QueuesHook], group: str,
                    queues: frozenset[MessageQueue], deadline: float | None = None) -> None:
        if not queues or not hooks:
            return
        for hook in list(hooks):
            try:
                if not await self._within(deadline, group, which, hook, queues):
                    continue
            except asyncio.CancelledError as exc:
                if being_cancelled():
                    raise
                # The listener's own (it awaited a task it had cancelled, say): a failure of
                # the listener like any other, not the end of the rebalance or of stop().
                log.error("consumer.rebalance_listener_failed", group=group, hook=which,
                          listener=_name(hook), queues=sorted(str(q) for q in queues),
                          error="CancelledError raised by the listener", exc_info=exc)
            except BaseException as exc:  # a listener never breaks the rebalance
                if ends_the_caller(exc):
                    raise
                log.error("consumer.rebalance_listener_failed", group=group, hook=which,
                          listener=_name(hook), queues=sorted(str(q) for q in queues),
                          error=f"{type(exc).__name__}: {exc}", exc_info=exc)
            else:
                log.debug("consumer.rebalance_listener_done", group=group, hook=which,
                          listener=_name(hook), queues=len(queues))

    async def run_startup(self, group: str) -> None:
        """Await every startup hook in order; the first exception propagates."""
        for hook in list(self.startup):
            await call_user(hook)
            log.debug("consumer.startup_hook_done", group=group, hook=_name(hook))

    async def run_shutdown(self, group: str, *, deadline: float | None = None) -> None:
        """Await every shutdown hook in order (with ``deadline``, event loop time, until then
        at most); exceptions are logged, the others still run."""
        for hook in list(self.shutdown):
            try:
                await self._within(deadline, group, "shutdown", hook)
            except asyncio.CancelledError as exc:
                if being_cancelled():
                    raise
                log.error("consumer.shutdown_hook_failed", group=group, hook=_name(hook),
                          error="CancelledError raised by the hook", exc_info=exc)
            except BaseException as exc:
                if ends_the_caller(exc):
                    raise
                log.error("consumer.shutdown_hook_failed", group=group, hook=_name(hook),
                          error=f"{type(exc).__name__}: {exc}", exc_info=exc)

    async def _within(self, deadline: float | None, group: str, which: str,
                      hook: Callable[..., Any], *args: Any) -> bool:
        """Await one hook, until ``deadline`` if given (at least :data:`MIN_HOOK_SECONDS`);
        False when it ran out of time.

        A hook over time is cancelled and logged (``consumer.hook_timed_out``), and not waited
        for: one that handles or ignores its cancellation by awaiting more cannot hold
        ``stop()``. Its own exceptions propagate.
        """
        if deadline is None:
            await call_user(hook, *args)
            return True
        task = asyncio.get_running_loop().create_task(call_user(hook, *args),
                                                      name=f"hook:{_name(hook)}")
        try:
            done, _ = await asyncio.wait({task}, timeout=max(
                deadline - asyncio.get_running_loop().time(), MIN_HOOK_SECONDS))
        except asyncio.CancelledError:
            self._give_up(task)  # the caller is cancelled: so is the hook, still held
            raise
        if done:
            task.result()  # its exception, if any
            return True
        self._give_up(task)
        log.error("consumer.hook_timed_out", group=group, hook=which, listener=_name(hook))
        return False

    def _give_up(self, task: asyncio.Task[None]) -> None:
        """Cancel a hook not waited for any more, and hold it until it ends (a hook may await
        more while handling its cancellation) so that what it raises then is logged."""
        task.cancel()
        if not task.done():
            self._overdue.add(task)
            task.add_done_callback(self._overdue_done)

    def _overdue_done(self, task: asyncio.Task[None]) -> None:
        self._overdue.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.warning("consumer.hook_failed_after_timeout", hook=task.get_name(),
                        error=repr(task.exception()))

"""Task ownership: every background task of a consumer lives in a :class:`TaskOwner`."""

from __future__ import annotations

import asyncio
import contextvars
import threading
from collections.abc import Callable, Coroutine, Hashable, Iterable
from typing import Any, TypeVar

import structlog

from rmq_async.diagnostics import format_task
from rmq_async.errors import IllegalStateError

log = structlog.get_logger(__name__)

#: A cancelled task that has not ended after this long is cancelled again (and logged once).
RECANCEL_INTERVAL = 1.0

#: Tasks that still refuse to end after this long are given up on, loudly (``task.abandoned``),
#: so that closing never hangs.
ABANDON_AFTER = 60.0


_T = TypeVar("_T")

#: The worker threads running user code right now: a plain handler or a decoder, a plain hook,
#: a sink's write. ``rmq-async run`` names them, and does not wait for them, once it has
#: drained (``rmq_async.cli.console``).
USER_THREADS: set[threading.Thread] = set()


def in_user_thread(fn: Callable[..., _T], *args: Any) -> _T:
    """``fn(*args)`` in the calling worker thread, which is in :data:`USER_THREADS` meanwhile
    (pass this to ``anyio.to_thread.run_sync``)."""
    me = threading.current_thread()
    USER_THREADS.add(me)
    try:
        return fn(*args)
    finally:
        USER_THREADS.discard(me)


class UserCall:
    """User code that a task of a consumer is running now: a handler's chunk or orderly turn,
    the rebalance listeners of a round, the handlers of an error event.

    ``stop()`` called from within it must neither wait for ``task`` nor cancel it: ``task`` is
    waiting for that ``stop()``, directly, through a thread it runs the code in, or through a
    task the code started and awaits. Entered with :func:`enter_user_call`, which marks the
    running context (and so the threads and tasks the code starts); ``done`` once the code has
    returned, after which a task it left running is on its own (a ``stop()`` there waits for
    the consumer's calls as any other). ``queue``: the orderly queue of a turn.
    """

    __slots__ = ("done", "family", "queue", "task")

    def __init__(self, task: asyncio.Task[Any], family: object, queue: Hashable | None) -> None:
        self.task = task
        self.family = family
        self.queue = queue
        self.done = False

    def __enter__(self) -> UserCall:
        return self

    def __exit__(self, *exc: object) -> None:
        self.done = True


_USER_CALL: contextvars.ContextVar[UserCall | None] = \
    contextvars.ContextVar("rmq_async_user_call", default=None)


def enter_user_call(task: asyncio.Task[Any], family: object,
                    queue: Hashable | None = None) -> UserCall:
    """Mark the running context as running user code for ``task`` (of the owner ``family``,
    see :class:`TaskOwner`) until the returned call is marked ``done`` (or, used as a context
    manager, until its block ends)."""
    call = UserCall(task, family, queue)
    _USER_CALL.set(call)
    return call


def running_user_call(family: object | None = None) -> UserCall | None:
    """The :class:`UserCall` the running code is part of, while it runs (of ``family`` when
    given), or None."""
    call = _USER_CALL.get()
    if call is None or call.done or (family is not None and call.family is not family):
        return None
    return call


async def acquire_by(lock: asyncio.Lock, deadline: float) -> bool:
    """Acquire ``lock`` unless ``deadline`` (event loop time) passes first."""
    try:
        async with asyncio.timeout_at(deadline):
            await lock.acquire()
    except TimeoutError:
        return False
    return True


def being_cancelled() -> bool:
    """Is the running task being cancelled, rather than user code raising ``CancelledError``
    of its own (awaiting a task it cancelled, a library cancelling its futures)?

    Code that calls user code re-raises a ``CancelledError`` only when this is true; any other
    is a failure of that call like any exception.
    """
    task = asyncio.current_task()
    return task is not None and task.cancelling() > 0


def is_cancellation(exc: BaseException) -> bool:
    """Is ``exc``, caught around user code, the running task's own cancellation (to raise
    on), rather than a failure of that code (see :func:`being_cancelled`)?"""
    return isinstance(exc, asyncio.CancelledError) and being_cancelled()


def ends_the_caller(exc: BaseException) -> bool:
    """Caught around user code (``except BaseException``): must ``exc`` be raised on?

    Yes for the running task's own cancellation and for what ends a program or a coroutine
    (``SystemExit``, ``KeyboardInterrupt``, ``GeneratorExit``). Anything else the code raised
    (any ``Exception``, its own ``CancelledError``, another ``BaseException`` such as pytest's
    ``Failed``) is a failure of that call, as Java's client takes any ``Throwable`` of a
    listener: raised on, it would end a worker and strand its queue.
    """
    return is_cancellation(exc) or isinstance(exc, SystemExit | KeyboardInterrupt | GeneratorExit)


class TaskOwner:
    """Creates, keeps and ends a component's background tasks.

    ``spawn`` keeps a strong reference to each task until it ends; a task that dies with an
    unexpected exception is logged (``task.crashed``) instead of vanishing. ``aclose`` cancels
    every task still running and waits for all of them, so after it returns nothing this owner
    started is left running. Keyed tasks (``spawn(..., key=mq)``) can be cancelled one by one,
    which the pull service uses for one task per assigned queue. The owners of one consumer
    form a family (``family=``, the consumer's own owner): :func:`running_user_call` tells
    whether the running code is a user call of one of its tasks.

    Waiting for a cancelled task is bounded: a task that swallows its cancellation (Python
    3.11's ``asyncio.wait_for`` does so when its inner future completes in the same loop
    iteration) is cancelled again every :data:`RECANCEL_INTERVAL` seconds with a
    ``task.ignored_cancel`` warning naming where it waits, and one that still runs after
    :data:`ABANDON_AFTER` seconds is reported as ``task.abandoned`` instead of hanging the
    caller.
    """

    def __init__(self, name: str, *, family: TaskOwner | None = None) -> None:
        self.name = name
        self.family: object = family.family if family is not None else object()
        self._tasks: set[asyncio.Task[Any]] = set()
        self._keyed: dict[Hashable, asyncio.Task[Any]] = {}
        self._closed = False

    def spawn(self, coro: Coroutine[Any, Any, Any], *, name: str,
              key: Hashable | None = None) -> asyncio.Task[Any]:
        if self._closed:
            coro.close()
            raise IllegalStateError(f"{self.name}: cannot start task {name!r} after close")
        task = asyncio.get_running_loop().create_task(coro, name=f"{self.name}:{name}")
        self._tasks.add(task)
        if key is not None:
            self._keyed[key] = task
        task.add_done_callback(lambda t: self._on_done(t, key))
        return task

    def _on_done(self, task: asyncio.Task[Any], key: Hashable | None) -> None:
        self._tasks.discard(task)
        if key is not None and self._keyed.get(key) is task:
            del self._keyed[key]
        if not task.cancelled() and task.exception() is not None:
            exc = task.exception()
            log.error("task.crashed", owner=self.name, task=task.get_name(),
                      error=f"{type(exc).__name__}: {exc}", exc_info=exc)

    def get(self, key: Hashable) -> asyncio.Task[Any] | None:
        return self._keyed.get(key)

    async def cancel(self, key: Hashable) -> None:
        """Cancel the task started under ``key`` (if any) and wait until it has ended."""
        task = self._keyed.pop(key, None)
        if task is None or task.done():
            return
        if task is asyncio.current_task():
            task.cancel()
            return
        await self._cancel_and_wait([task], ABANDON_AFTER)

    def __len__(self) -> int:
        return len(self._tasks)

    @property
    def closed(self) -> bool:
        """:meth:`aclose` was called: a spared task still running ends at its next turn."""
        return self._closed

    @property
    def tasks(self) -> set[asyncio.Task[Any]]:
        return set(self._tasks)

    async def aclose(self, *, abandon_after: float = ABANDON_AFTER) -> None:
        """Cancel every task and wait for them, but for the calling one and the task whose
        user code the caller is part of (:func:`running_user_call`: ``stop()`` called by a
        handler), which cannot be waited for from where they wait; they end on their own."""
        self._closed = True
        call = running_user_call()
        spared = {asyncio.current_task(), call.task if call is not None else None}
        loop = asyncio.get_running_loop()
        deadline = loop.time() + abandon_after
        while True:
            tasks = [t for t in self._tasks if t not in spared and not t.done()]
            if not tasks:
                break
            if not await self._cancel_and_wait(tasks, deadline - loop.time()):
                break
        self._keyed.clear()

    async def _cancel_and_wait(self, tasks: Iterable[asyncio.Task[Any]], limit: float) -> bool:
        """Cancel ``tasks`` and wait until they end, cancelling again those that swallow it.

        Returns ``False`` when some were still running after ``limit`` seconds.
        """
        loop = asyncio.get_running_loop()
        deadline = loop.time() + limit
        pending = set(tasks)
        warned: set[asyncio.Task[Any]] = set()
        while pending:
            for t in pending:
                t.cancel()
            remaining = deadline - loop.time()
            if remaining <= 0:
                for t in pending:
                    log.error("task.abandoned", owner=self.name, task=t.get_name(),
                              seconds=limit, stack=format_task(t))
                return False
            _, pending = await asyncio.wait(pending, timeout=min(RECANCEL_INTERVAL, remaining))
            for t in pending - warned:
                warned.add(t)
                log.warning("task.ignored_cancel", owner=self.name, task=t.get_name(),
                            stack=format_task(t))
        return True

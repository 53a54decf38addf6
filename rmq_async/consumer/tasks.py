"""Task ownership: every background task of a consumer lives in a :class:`TaskOwner`."""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine, Hashable
from typing import Any

import structlog

log = structlog.get_logger(__name__)


class TaskOwner:
    """Creates, keeps and ends a component's background tasks.

    ``spawn`` keeps a strong reference to each task until it ends; a task that dies with an
    unexpected exception is logged (``task.crashed``) instead of vanishing. ``aclose`` cancels
    every task still running and waits for all of them, so after it returns nothing this owner
    started is left running. Keyed tasks (``spawn(..., key=mq)``) can be cancelled one by one,
    which the pull service uses for one task per assigned queue.
    """

    def __init__(self, name: str) -> None:
        self.name = name
        self._tasks: set[asyncio.Task[Any]] = set()
        self._keyed: dict[Hashable, asyncio.Task[Any]] = {}
        self._closed = False

    def spawn(self, coro: Coroutine[Any, Any, Any], *, name: str,
              key: Hashable | None = None) -> asyncio.Task[Any]:
        if self._closed:
            coro.close()
            raise RuntimeError(f"{self.name}: cannot start task {name!r} after close")
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
        task.cancel()
        if task is asyncio.current_task():
            return
        await asyncio.gather(task, return_exceptions=True)

    def __len__(self) -> int:
        return len(self._tasks)

    @property
    def tasks(self) -> set[asyncio.Task[Any]]:
        return set(self._tasks)

    async def aclose(self) -> None:
        self._closed = True
        current = asyncio.current_task()
        while True:
            tasks = [t for t in self._tasks if t is not current and not t.done()]
            if not tasks:
                break
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
        self._keyed.clear()

"""``App``: several consumers started, run and stopped as one (what ``rmq-async run`` runs).

::

    orders = PushConsumer("orders-group", namesrv=NAMESRV)
    audit = PushConsumer("audit-group", namesrv=NAMESRV)
    app = App(orders, audit)

    async with app:          # starts both; leaving the block stops both
        await stop_requested.wait()

``rmq-async run module:app`` does the same from the command line, stopping on SIGTERM or SIGINT
within its grace period.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable, Iterator
from datetime import timedelta
from types import TracebackType

import structlog

from rmq_async.consumer.push import PushConsumer, lifecycle_under_way, running_call_of
from rmq_async.consumer.tasks import acquire_by
from rmq_async.errors import IllegalStateError, InvalidTypeError

__all__ = ["App"]

log = structlog.get_logger(__name__)


class App:
    """A set of :class:`PushConsumer` s with one lifetime.

    ``start()`` starts them in the order given (if one fails, those already started are stopped
    again and the error propagates); ``stop()`` stops them all concurrently, each within the
    same ``timeout``. The two are serialized, as for a :class:`PushConsumer`: a ``stop()``
    called while ``start()`` is under way waits for it, then stops what it started.
    """

    def __init__(self, *consumers: PushConsumer) -> None:
        self._consumers: list[PushConsumer] = []
        self._started = False
        self._stopping = False
        self._start_lock = asyncio.Lock()
        for c in consumers:
            self.add(c)

    def add(self, consumer: PushConsumer) -> PushConsumer:
        """Add a consumer (before :meth:`start`); returns it, so it can wrap a construction."""
        if not isinstance(consumer, PushConsumer):
            raise InvalidTypeError(f"App holds PushConsumer objects, not {type(consumer).__name__}")
        if self._started or self._start_lock.locked():
            raise IllegalStateError("add consumers before the app starts")
        if any(c is consumer for c in self._consumers):
            raise IllegalStateError(f"{consumer!r} is already part of the app")
        self._consumers.append(consumer)
        return consumer

    @property
    def consumers(self) -> list[PushConsumer]:
        """The consumers, in start order."""
        return list(self._consumers)

    def __iter__(self) -> Iterator[PushConsumer]:
        return iter(self._consumers)

    def __len__(self) -> int:
        return len(self._consumers)

    @property
    def is_running(self) -> bool:
        """``True`` from a successful :meth:`start` until a :meth:`stop` has returned."""
        return self._started

    async def wait_stopped(self) -> None:
        """Return once no member is running: every one stopped, by :meth:`stop` or by its own
        code (``app.stop()`` or its ``consumer.stop()`` from a handler, say), none started
        again meanwhile."""
        while True:
            for c in self.consumers:
                await c.wait_stopped()
            if all(c.stopped for c in self.consumers):
                return

    async def start(self) -> None:
        """Start every consumer, in order."""
        async with self._start_lock:
            if self._started:
                raise IllegalStateError("app already started")
            if not self._consumers:
                raise IllegalStateError("the app has no consumers")
            started: list[PushConsumer] = []
            try:
                for c in self._consumers:
                    await c.start()
                    started.append(c)
            except BaseException:
                await _stop_all(started, 5.0)
                raise
            self._started = True
            log.info("app.started", consumers=[c.group for c in self._consumers])

    async def stop(self, timeout: float | timedelta = 30.0) -> None:
        """Stop every consumer concurrently; listener calls in flight get ``timeout`` seconds.

        A ``start()`` under way is waited for first, up to ``timeout`` (its consumers are then
        stopped; if it fails, nothing is left to stop); one that takes longer is given up (the
        member starting raises :class:`~rmq_async.errors.IllegalStateError`, and the app's
        ``start()`` with it). Acknowledged offsets are persisted by each consumer's
        own ``stop()``. The app counts as running until its members' stops have returned:
        a ``stop()`` that was cancelled (a drain cut short) can be called again, and stops
        the members still running.

        Called from a member's own code (a handler, a listener, a hook) it stops the app as
        :meth:`PushConsumer.stop` stops a consumer from there, without waiting for that code;
        while the app's stop is under way already it returns at once. From a member's
        ``on_startup`` hook it raises :class:`~rmq_async.errors.IllegalStateError`.
        """
        if isinstance(timeout, timedelta):
            timeout = timeout.total_seconds()
        within = lifecycle_under_way()
        member_hook = within is not None and any(c is within[0] for c in self._consumers)
        if member_hook and within is not None and within[1] == "start":
            raise IllegalStateError("App.stop() called from inside a member's start() "
                                    "(an on_startup hook raises to fail the start)")
        from_member = member_hook or any(running_call_of(c) is not None
                                         for c in self._consumers)
        if self._stopping and from_member:
            return  # the stop under way waits for the calling code
        lock = self._start_lock
        if not await acquire_by(lock, asyncio.get_running_loop().time() + timeout):
            # A start under way for all of timeout (a member's on_startup hook waiting for
            # something that does not answer): the member starting gives its start up, and
            # the app's start then stops those it started and fails.
            for c in self._consumers:
                c._give_up_start(timeout)
            await lock.acquire()
        try:
            if not self._started:
                return
            self._stopping = True
            try:
                await _stop_all(self._consumers, timeout)
            finally:
                self._stopping = False
            self._started = False
            log.info("app.stopped", consumers=[c.group for c in self._consumers])
        finally:
            lock.release()

    async def __aenter__(self) -> App:
        await self.start()
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> None:
        await self.stop()

    def __repr__(self) -> str:
        return f"<App consumers={[c.group for c in self._consumers]} running={self._started}>"


async def _stop_all(consumers: Iterable[PushConsumer], timeout: float) -> None:
    results = await asyncio.gather(*(c.stop(timeout) for c in consumers), return_exceptions=True)
    for c, r in zip(consumers, results, strict=True):
        if isinstance(r, BaseException):
            log.error("app.stop_failed", group=c.group, error=repr(r))

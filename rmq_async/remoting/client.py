"""A pool with one connection per address, reconnecting on next use after a drop."""

from __future__ import annotations

import asyncio
import functools
import ssl as _ssl
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import structlog

from rmq_async.protocol.codes import ResponseCode
from rmq_async.protocol.command import RemotingCommand
from rmq_async.remoting.connection import (
    DEFAULT_MAX_FRAME_SIZE,
    Connection,
    RequestHandler,
    RpcHook,
)
from rmq_async.remoting.errors import ConnectionClosed, RemotingError, RemotingTimeout

log = structlog.get_logger(__name__)

_T = TypeVar("_T")


async def until_deadline(work: Awaitable[_T], deadline: float, what: str, *,
                         addr: str | None = None) -> _T:
    """Await ``work`` until ``deadline`` (event loop time); then :class:`RemotingTimeout`
    saying ``what`` took the time. A ``TimeoutError`` of ``work``'s own propagates."""
    window = asyncio.timeout_at(deadline)
    try:
        async with window:
            return await work
    except TimeoutError:
        if not window.expired():
            raise
        raise RemotingTimeout(what, addr=addr) from None


#: A request that timed out closes its connection when it had more than this (seconds) or a
#: quarter of its timeout left when sent (Java ``MIN_CLOSE_TIMEOUT_MILLIS``).
MIN_CLOSE_TIMEOUT = 0.1


class RemotingClient:
    """Sends commands to name servers and brokers by address.

    There is at most one open connection per address. A connection that was closed (by the
    peer, a protocol error or a timeout storm) is replaced transparently by the next call;
    callers that need a connection at the same time share one connect attempt. One answered
    GO_AWAY (its peer is shutting down) is replaced too, but closed only once the requests
    still on it have their answers. ``close()`` ends connect attempts and closes every
    connection, failing all requests in flight with :class:`ConnectionClosed`.
    """

    def __init__(
        self,
        *,
        connect_timeout: float = 3.0,
        ssl: _ssl.SSLContext | None = None,
        rpc_hook: RpcHook | None = None,
        request_handler: RequestHandler | None = None,
        max_frame_size: int = DEFAULT_MAX_FRAME_SIZE,
        close_on_timeout: bool = True,
    ) -> None:
        self.connect_timeout = connect_timeout
        self.close_on_timeout = close_on_timeout
        self.ssl = ssl
        self.rpc_hook = rpc_hook
        self.request_handler = request_handler
        self.max_frame_size = max_frame_size
        self._connections: dict[str, Connection] = {}
        # The connect attempt under way per address, shared by every caller waiting for it.
        self._connecting: dict[str, asyncio.Task[Connection]] = {}
        # Connections answered GO_AWAY, closing once their last request is done (close()
        # closes those still open).
        self._retired: set[Connection] = set()
        self._closed = False

    async def connection(self, addr: str) -> Connection:
        """The open connection to ``addr``, connecting (again) when there is none.

        Concurrent callers share one connect attempt (Java's channel future): all get its
        connection, or all fail with its error, after at most one ``connect_timeout``. A
        caller that stops waiting (cancelled) does not end the attempt for the others.
        """
        if self._closed:
            raise ConnectionClosed("remoting client is closed", addr=addr)
        conn = self._pooled(addr)
        if conn is not None:
            return conn
        attempt = self._connecting.get(addr)
        if attempt is None:
            attempt = asyncio.get_running_loop().create_task(
                self._connect(addr), name=f"remoting-connect {addr}")
            self._connecting[addr] = attempt
            attempt.add_done_callback(functools.partial(self._connect_done, addr))
        try:
            return await asyncio.shield(attempt)
        except asyncio.CancelledError:
            me = asyncio.current_task()
            if self.closed and attempt.cancelled() and (me is None or not me.cancelling()):
                # close() ended the attempt (maybe before it ran a step), not our caller.
                raise ConnectionClosed("remoting client is closed", addr=addr) from None
            raise

    def _connection_made(self, addr: str, conn: Connection) -> None:
        """Called once per new connection, whoever still waits for it (a subclass hook)."""

    async def _connect(self, addr: str) -> Connection:
        try:
            conn = await Connection.open(
                addr,
                connect_timeout=self.connect_timeout,
                ssl=self.ssl,
                handler=self.request_handler,
                rpc_hook=self.rpc_hook,
                max_frame_size=self.max_frame_size,
            )
        except asyncio.CancelledError:
            if self._closed:  # close() ends the attempts under way
                raise ConnectionClosed("remoting client is closed", addr=addr) from None
            raise
        if self._closed:  # close() ran while the connection was being made
            await conn.close()
            raise ConnectionClosed("remoting client is closed", addr=addr)
        conn.on_started_timeout = self._after_started_timeout
        conn.on_started_go_away = self._after_started_go_away
        conn.on_closed = self._connection_closed
        self._connections[addr] = conn
        self._connection_made(addr, conn)
        return conn

    def _connect_done(self, addr: str, attempt: asyncio.Task[Connection]) -> None:
        if self._connecting.get(addr) is attempt:
            del self._connecting[addr]
        if not attempt.cancelled():
            attempt.exception()  # seen here: every caller may have stopped waiting for it

    async def _connection_by(self, addr: str, deadline: float,
                             timeout: float) -> tuple[Connection, float]:
        """:meth:`connection`, waiting for a connect at most until ``deadline`` (loop time),
        the end of the ``timeout`` of the request it is for; and the time left for it."""
        conn = self._pooled(addr)
        if conn is None:
            conn = await until_deadline(
                self.connection(addr), deadline,
                f"connecting to {addr} took the request's whole timeout ({timeout:.3f}s)",
                addr=addr)
        left = deadline - asyncio.get_running_loop().time()
        if left <= 0:
            raise RemotingTimeout(f"no time left for the request to {addr} after connecting "
                                  f"(timeout {timeout:.3f}s)", addr=addr)
        return conn, left

    def _pooled(self, addr: str) -> Connection | None:
        """The open connection to ``addr`` while the client is open, else ``None`` (then
        :meth:`connection` connects or raises)."""
        conn = self._connections.get(addr)
        if conn is None or conn.closed or self._closed:
            return None
        return conn

    async def invoke(self, addr: str, cmd: RemotingCommand, timeout: float, *,
                     resend_on_go_away: bool = True) -> RemotingCommand:
        """Send a request and return the peer's response (any response code but GO_AWAY).

        ``timeout`` covers connecting too (Java's ``invokeSync``): a request that waited for
        its connection gets what is left.

        A request that times out closes its connection (Java's ``clientCloseSocketIfTimeout``,
        on by default): a peer that went silent, or a half-open socket whose other end is gone,
        would otherwise keep every later request waiting for its full timeout. Other requests
        on it fail at once with :class:`ConnectionClosed`, and the next call reconnects.

        A GO_AWAY answer (a 5.x server shutting down) retires the connection (see
        :meth:`_retire`) and the request is sent once more on a new one, within what is left
        of ``timeout``; a second GO_AWAY raises :class:`RemotingError`, which callers that
        retry elsewhere (the producer) retry. With ``resend_on_go_away=False`` the GO_AWAY
        answer is returned instead (the connection retired all the same).
        """
        deadline = asyncio.get_running_loop().time() + timeout
        response = await self._invoke_by(addr, cmd, deadline, timeout)
        if response.code == ResponseCode.GO_AWAY and resend_on_go_away:
            response = await self._invoke_by(addr, cmd, deadline, timeout)
            if response.code == ResponseCode.GO_AWAY:
                raise RemotingError(f"{addr} answered GO_AWAY twice (on a new connection too)",
                                    addr=addr)
        return response

    async def _invoke_by(self, addr: str, cmd: RemotingCommand, deadline: float,
                         timeout: float) -> RemotingCommand:
        """One sending of :meth:`invoke`, connecting first if need be, all by ``deadline``."""
        conn, left = await self._connection_by(addr, deadline, timeout)
        try:
            response = await conn.request(cmd, left)
        except RemotingTimeout:
            # Java's rule: a request that had only a sliver of its timeout left when sent (the
            # connect or a GO_AWAY'd first sending took the rest) does not condemn the
            # connection, which the requests beside it may be using well.
            condemn = left > MIN_CLOSE_TIMEOUT or left > timeout / 4
            if self.close_on_timeout and condemn and not conn.closed:
                log.warning("remoting.closed_after_timeout", addr=addr, code=cmd.code,
                            timeout=timeout)
                conn.abort()  # the peer is not answering: it may not be reading either
                await conn.close()  # (closed, it leaves the pool: _connection_closed)
            raise
        if response.code == ResponseCode.GO_AWAY:
            log.info("remoting.go_away", addr=addr, code=cmd.code)
            self._retire(conn)
        return response

    async def start_invoke(self, addr: str, make_cmd: Callable[[], RemotingCommand],
                           timeout: float, *, frame: tuple[int, bytes] | None = None,
                           ) -> asyncio.Future[RemotingCommand]:
        """Send a request and return the future of its response without awaiting it.

        Pipelining form of :meth:`invoke` with the same close-on-timeout rule, and
        ``timeout`` covering a connect as there; a GO_AWAY answer retires the connection too,
        but the request is not sent again: the caller sees its code.
        ``frame`` (opaque, bytes) is the request already encoded; ``make_cmd`` builds it when
        the connection cannot take the encoded form.
        """
        conn = self._pooled(addr)
        if conn is None:
            deadline = asyncio.get_running_loop().time() + timeout
            conn, timeout = await self._connection_by(addr, deadline, timeout)
        fut = conn.start_frame(*frame, timeout) if frame is not None else None
        if fut is None:
            cmd = make_cmd()
            fut = conn.start_request(cmd, timeout)
            if fut is None:  # the transport is paused: wait for it in a request of our own
                # Not sent again on GO_AWAY, as the docstring says: the caller sees the code.
                return asyncio.ensure_future(self.invoke(addr, cmd, timeout,
                                                         resend_on_go_away=False))

        return fut

    def _after_started_timeout(self, conn: Connection, timeout: float) -> None:
        """A request kept in flight on ``conn`` timed out: as :meth:`invoke`, close it."""
        if not self.close_on_timeout:
            return
        if not conn.closed:
            log.warning("remoting.closed_after_timeout", addr=conn.addr, timeout=timeout)
        conn.abort()  # (closed, it leaves the pool: _connection_closed)

    def _after_started_go_away(self, conn: Connection) -> None:
        """A request kept in flight on ``conn`` was answered GO_AWAY: retire ``conn``."""
        log.info("remoting.go_away", addr=conn.addr)
        self._retire(conn)

    def _retire(self, conn: Connection) -> None:
        """``conn``'s peer answered GO_AWAY: new requests go to a new connection, and ``conn``
        closes once the requests still on it are answered or timed out (closing it now would
        fail those whose answers are still coming; Java keeps it as ``channelToClose``)."""
        self._forget(conn.addr, conn)
        if conn.closed:
            return
        self._retired.add(conn)  # until it closes (_connection_closed)
        conn.close_when_idle()

    def _connection_closed(self, conn: Connection) -> None:
        """``conn`` closed (its peer went, a timeout, a GO_AWAY retirement ended): the pool
        lets go of it, so a dead connection to an address no route names any more is freed."""
        self._forget(conn.addr, conn)
        self._retired.discard(conn)

    def _forget(self, addr: str, conn: Connection) -> None:
        """Stop handing out ``conn`` for ``addr`` (the next call connects anew)."""
        if self._connections.get(addr) is conn:
            del self._connections[addr]

    async def invoke_oneway(self, addr: str, cmd: RemotingCommand) -> None:
        conn = await self.connection(addr)
        await conn.send_oneway(cmd)

    async def close_connection(self, addr: str) -> None:
        conn = self._connections.pop(addr, None)
        if conn is not None:
            await conn.close()

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def addresses(self) -> list[str]:
        return [a for a, c in self._connections.items() if not c.closed]

    async def close(self, *, spare: asyncio.Task[Any] | None = None) -> None:
        """Close every connection. The calling task and ``spare`` (a request handler's task
        whose code this close is part of, awaiting it from a task of its own) are neither
        cancelled nor waited for, if they are a connection's request handlers."""
        self._closed = True
        attempts = list(self._connecting.values())
        for attempt in attempts:
            attempt.cancel()
        conns = [*self._connections.values(), *self._retired]
        self._connections.clear()
        self._retired.clear()
        # The calling task may be a request handler of one of these connections (a listener
        # that stopped its consumer): spared by each close(), which runs in a task of its own.
        keep = (asyncio.current_task(), spare)
        await asyncio.gather(*attempts, *(c.close(spare=keep) for c in conns),
                             return_exceptions=True)

    async def __aenter__(self) -> RemotingClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

"""A pool with one connection per address, reconnecting on next use after a drop."""

from __future__ import annotations

import asyncio
import ssl as _ssl
from collections.abc import Callable

import structlog

from rmq_async.protocol.codes import ResponseCode
from rmq_async.protocol.command import RemotingCommand
from rmq_async.remoting.connection import (
    DEFAULT_MAX_FRAME_SIZE,
    Connection,
    RequestHandler,
    RpcHook,
)
from rmq_async.remoting.errors import ConnectionClosed, RemotingTimeout

log = structlog.get_logger(__name__)


class RemotingClient:
    """Sends commands to name servers and brokers by address.

    There is at most one open connection per address. A connection that was closed (by the
    peer, a protocol error or a timeout storm) is replaced transparently by the next call.
    ``close()`` closes every connection, failing all requests in flight with
    :class:`ConnectionClosed`.
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
        self._connect_locks: dict[str, asyncio.Lock] = {}
        self._closed = False

    async def connection(self, addr: str) -> Connection:
        """The open connection to ``addr``, connecting (again) when there is none."""
        if self._closed:
            raise ConnectionClosed("remoting client is closed", addr=addr)
        conn = self._pooled(addr)
        if conn is not None:
            return conn
        lock = self._connect_locks.setdefault(addr, asyncio.Lock())
        async with lock:
            conn = self._pooled(addr)
            if conn is not None:
                return conn
            if self._closed:
                raise ConnectionClosed("remoting client is closed", addr=addr)
            conn = await Connection.open(
                addr,
                connect_timeout=self.connect_timeout,
                ssl=self.ssl,
                handler=self.request_handler,
                rpc_hook=self.rpc_hook,
                max_frame_size=self.max_frame_size,
            )
            if self.closed:  # close() ran while we were connecting
                await conn.close()
                raise ConnectionClosed("remoting client is closed", addr=addr)
            conn.on_started_timeout = self._after_started_timeout
            conn.on_started_go_away = self._after_started_go_away
            self._connections[addr] = conn
            return conn

    def _pooled(self, addr: str) -> Connection | None:
        """The open connection to ``addr`` while the client is open, else ``None`` (then
        :meth:`connection` connects or raises)."""
        conn = self._connections.get(addr)
        if conn is None or conn.closed or self._closed:
            return None
        return conn

    async def invoke(self, addr: str, cmd: RemotingCommand, timeout: float) -> RemotingCommand:
        """Send a request and return the peer's response (any response code).

        A request that times out closes its connection (Java's ``clientCloseSocketIfTimeout``,
        on by default): a peer that went silent, or a half-open socket whose other end is gone,
        would otherwise keep every later request waiting for its full timeout. Other requests
        on it fail at once with :class:`ConnectionClosed`, and the next call reconnects.
        """
        conn = await self.connection(addr)
        try:
            response = await conn.request(cmd, timeout)
        except RemotingTimeout:
            if self.close_on_timeout and not conn.closed:
                log.warning("remoting.closed_after_timeout", addr=addr, code=cmd.code,
                            timeout=timeout)
                self._forget(addr, conn)
                await conn.close()
            raise
        if response.code == ResponseCode.GO_AWAY:
            # A 5.x server that is shutting down: reconnect and send once more.
            log.info("remoting.go_away", addr=addr)
            await conn.close()
            conn = await self.connection(addr)
            response = await conn.request(cmd, timeout)
        return response

    async def start_invoke(self, addr: str, make_cmd: Callable[[], RemotingCommand],
                           timeout: float, *, frame: tuple[int, bytes] | None = None,
                           ) -> asyncio.Future[RemotingCommand]:
        """Send a request and return the future of its response without awaiting it.

        Pipelining form of :meth:`invoke` with the same close-on-timeout rule; a GO_AWAY
        answer closes the connection too, but is not sent again: the caller sees its code.
        ``frame`` (opaque, bytes) is the request already encoded; ``make_cmd`` builds it when
        the connection cannot take the encoded form.
        """
        conn = self._pooled(addr) or await self.connection(addr)
        fut = conn.start_frame(*frame, timeout) if frame is not None else None
        if fut is None:
            cmd = make_cmd()
            fut = conn.start_request(cmd, timeout)
            if fut is None:  # the transport is paused: wait for it in a request of our own
                return asyncio.ensure_future(self.invoke(addr, cmd, timeout))

        return fut

    def _after_started_timeout(self, conn: Connection, timeout: float) -> None:
        """A request kept in flight on ``conn`` timed out: as :meth:`invoke`, close it."""
        if not self.close_on_timeout:
            return
        if not conn.closed:
            log.warning("remoting.closed_after_timeout", addr=conn.addr, timeout=timeout)
        self._forget(conn.addr, conn)
        conn.abort()

    def _after_started_go_away(self, conn: Connection) -> None:
        """A request kept in flight on ``conn`` was answered GO_AWAY: the next call reconnects."""
        log.info("remoting.go_away", addr=conn.addr)
        self._forget(conn.addr, conn)
        conn.abort()

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

    async def close(self) -> None:
        self._closed = True
        conns = list(self._connections.values())
        self._connections.clear()
        await asyncio.gather(*(c.close() for c in conns), return_exceptions=True)

    async def __aenter__(self) -> RemotingClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

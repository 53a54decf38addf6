"""One asyncio connection to a name server or broker.

The connection is an :class:`asyncio.BufferedProtocol`: the transport reads into the receive
buffer of the sans-IO :class:`~rmq_async.protocol.command.FrameDecoder`, which decodes the frames
completed by each read in place (``buffer_updated``), and each decoded command is routed without
an extra hop:

* a response completes the future stored under its ``opaque`` in the pending table;
* a request from the peer (the broker asking the consumer something) is handed to the
  registered handler in a task owned by this connection, and its answer is written back.

Requests carry a timeout. One awaited with :meth:`Connection.request` has a timer of its own;
the requests kept in flight (:meth:`Connection.start_request`, :meth:`Connection.start_frame`:
every PULL_MESSAGE) only note their deadline, and one timer per connection, set for the
earliest deadline, fails those that passed it (as Java's client scans its response table). A
pull then allocates no timer handle and no callbacks, objects that would otherwise live for
its whole round trip and be promoted by the garbage collector, which the hot path feels. ``close()``
(or a peer that hangs up, or a peer that sends bytes the decoder rejects) fails every pending
request with :class:`ConnectionClosed` and cancels the connection's handler tasks.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import ssl as _ssl
from collections.abc import Awaitable, Callable, Collection
from typing import TYPE_CHECKING, Any, cast

import structlog

from rmq_async.errors import InvalidArgumentError
from rmq_async.protocol.codes import ResponseCode
from rmq_async.protocol.command import FrameDecoder, RemotingCommand, next_opaque
from rmq_async.protocol.errors import ProtocolError
from rmq_async.remoting.errors import (
    ConnectionClosed,
    ConnectionLostInFlight,
    RemotingConnectError,
    RemotingTimeout,
    TlsVerificationError,
)

if TYPE_CHECKING:
    pass

log = structlog.get_logger(__name__)

#: Answers a request the peer sent us. Returning ``None`` sends nothing back.
RequestHandler = Callable[[RemotingCommand, "Connection"], Awaitable[RemotingCommand | None]]

#: Called with every outgoing request just before it is encoded (ACL signing uses this).
RpcHook = Callable[[RemotingCommand], None]

DEFAULT_MAX_FRAME_SIZE = 16 * 1024 * 1024

#: Longest wait for a paused transport to drain before a write without its own deadline (a
#: oneway request, an answer to the peer) fails with :class:`RemotingTimeout`.
DEFAULT_WRITE_TIMEOUT = 3.0

# How early the deadline timer may fire and still count as on time (the clock's resolution).
_SWEEP_SLACK = 0.001

#: Seconds a graceful close leaves the frames still buffered to go out before the socket is
#: closed anyway (a peer that stopped reading never takes them).
CLOSE_FLUSH_GRACE = 2.0
#: How long close() waits for the request handlers it cancelled (a listener of
#: CONSUME_MESSAGE_DIRECTLY may clean up slowly, or swallow the cancellation).
HANDLER_CLOSE_WAIT = 1.0


class Connection(asyncio.BufferedProtocol):
    """A multiplexed request/response channel to one address."""

    def __init__(
        self,
        addr: str,
        *,
        handler: RequestHandler | None = None,
        rpc_hook: RpcHook | None = None,
        max_frame_size: int = DEFAULT_MAX_FRAME_SIZE,
    ) -> None:
        self.addr = addr
        self._handler = handler
        self._rpc_hook = rpc_hook
        self._decoder = FrameDecoder(max_frame_size)
        self._pending: dict[int, asyncio.Future[RemotingCommand]] = {}
        self._handler_tasks: set[asyncio.Task[None]] = set()
        self._transport: asyncio.Transport | None = None
        self._closed = False
        self._close_exc: BaseException | None = None
        self._closed_event = asyncio.Event()
        self._can_write = asyncio.Event()
        # Frames written during one loop iteration, sent together at its end (one syscall for
        # the pulls of several queues answered in the same read).
        self._out: list[bytes] | None = None
        # Bytes handed to the transport so far, bytes waiting in _out, and where in that
        # stream each pending request's frame ends: at a close, a request whose frame ended
        # within what the transport had passed to the socket went out (ConnectionLostInFlight).
        self._written = 0
        self._queued = 0
        self._frame_end: dict[int, int] = {}
        self._can_write.set()
        # Requests kept in flight (_start): opaque -> deadline (loop time) and -> timeout.
        self._deadlines: dict[int, float] = {}
        self._timeouts: dict[int, float] = {}
        self._sweep_handle: asyncio.TimerHandle | None = None
        self._sweep_at = math.inf
        #: Called (soon, not from inside the read) after a request kept in flight timed out,
        #: with the connection and that request's timeout.
        self.on_started_timeout: Callable[[Connection, float], None] | None = None
        #: Called (soon) when a request kept in flight was answered with GO_AWAY.
        self.on_started_go_away: Callable[[Connection], None] | None = None
        #: Called once the connection is closed (by anyone, for any reason), with itself.
        self.on_closed: Callable[[Connection], None] | None = None
        self._lost = False  # the transport reported connection_lost
        self._peer_closed = False  # ... without an error: the peer closed the connection
        self._flush_timer: asyncio.TimerHandle | None = None
        self._close_when_idle = False
        self.last_activity = asyncio.get_running_loop().time()

    # ------------------------------------------------------------------ opening / closing

    @classmethod
    async def open(
        cls,
        addr: str,
        *,
        connect_timeout: float = 3.0,
        ssl: _ssl.SSLContext | None = None,
        handler: RequestHandler | None = None,
        rpc_hook: RpcHook | None = None,
        max_frame_size: int = DEFAULT_MAX_FRAME_SIZE,
    ) -> Connection:
        host, port = split_addr(addr)
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(connect_timeout):
                _, proto = await loop.create_connection(
                    lambda: cls(
                        addr, handler=handler, rpc_hook=rpc_hook, max_frame_size=max_frame_size
                    ),
                    host,
                    port,
                    ssl=ssl,
                    server_hostname=host if ssl is not None else None,
                )
        except TimeoutError as exc:
            raise RemotingConnectError(f"connect to {addr} timed out", addr=addr) from exc
        except _ssl.SSLCertVerificationError as exc:
            reason = exc.verify_message or exc.reason or str(exc)
            raise TlsVerificationError(
                f"TLS certificate of {addr} refused: {reason} ({exc.reason})", addr=addr,
                reason=reason,
            ) from exc
        except OSError as exc:
            raise RemotingConnectError(f"connect to {addr} failed: {exc}", addr=addr) from exc
        log.debug("remoting.connected", addr=addr)
        return proto

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def pending_count(self) -> int:
        return len(self._pending)

    async def close(self, *, spare: Collection[asyncio.Task[Any] | None] = ()) -> None:
        """Close the connection, fail pending requests and end the handler tasks.

        A handler task that closes its own connection (its request's handler stopped the
        consumer), the calling task or one in ``spare`` (the task that asked the client to
        close, the handler task whose code that is part of) is neither cancelled nor waited
        for: it would wait for itself. The others are cancelled and waited for at most
        ``HANDLER_CLOSE_WAIT`` seconds (one that swallows its cancellation is left to end on
        its own, logged)."""
        keep = {asyncio.current_task(), *spare}
        self._shutdown(None, keep=keep)
        tasks = [t for t in self._handler_tasks if t not in keep and not t.done()]
        if not tasks:
            return
        _, pending = await asyncio.wait(tasks, timeout=HANDLER_CLOSE_WAIT)
        if pending:
            log.warning("remoting.handlers_left_running", addr=self.addr, count=len(pending),
                        seconds=HANDLER_CLOSE_WAIT)

    async def wait_closed(self) -> None:
        await self._closed_event.wait()

    def close_when_idle(self) -> None:
        """Close once no request waits for its answer any more (at once when none does).

        For a peer that answered GO_AWAY: it still answers the requests it took before, so
        those are left to get their answer or time out; the owner sends new ones elsewhere.
        """
        self._close_when_idle = True
        self._close_if_idle()

    def _close_if_idle(self) -> None:
        if self._close_when_idle and not self._pending:
            self._shutdown(None)

    def _shutdown(self, exc: BaseException | None, *, hard: bool = False,
                  keep: set[asyncio.Task[Any] | None] | None = None) -> None:
        if self._closed:
            return
        self._closed = True
        self._close_exc = exc
        self._can_write.set()
        transport = self._transport
        sent = self._written  # the stream position up to which frames went to the socket
        if transport is not None:
            if exc is not None or hard:
                sent -= transport.get_write_buffer_size()  # dropped with the transport
                transport.abort()
            else:
                out, self._out = self._out, None
                if out:  # frames written just before a graceful close still go out
                    transport.writelines(out)
                    sent = self._written = self._written + self._queued
                    self._queued = 0
                transport.close()
                if transport.get_write_buffer_size():
                    # close() waits for the buffer to drain: a peer that stopped reading would
                    # hold the socket (and what is buffered) for good. The frames get a moment.
                    self._flush_timer = asyncio.get_running_loop().call_later(
                        CLOSE_FLUSH_GRACE, self._abort_unflushed)
        self._decoder.release()
        reason = "connection closed" if exc is None else f"connection closed: {exc}"
        if self._sweep_handle is not None:
            self._sweep_handle.cancel()
            self._sweep_handle = None
        self._deadlines.clear()
        self._timeouts.clear()
        pending, self._pending = self._pending, {}
        ends, self._frame_end = self._frame_end, {}
        for opaque, fut in pending.items():
            if not fut.done():
                # A request that went out may have been acted on (a message stored): the
                # caller must not take the failure for "not done" (see ConnectionLostInFlight).
                # One still in _out or in the transport's buffer, or only partly passed to
                # the socket, never reached the peer whole.
                err = (ConnectionLostInFlight(f"{reason} ({self.addr}) after the request "
                                              "was sent", addr=self.addr)
                       if ends.get(opaque, math.inf) <= sent else
                       ConnectionClosed(f"{reason} ({self.addr})", addr=self.addr))
                err.__cause__ = exc
                fut.set_exception(err)
        for task in self._handler_tasks:
            if keep is None or task not in keep:
                task.cancel()
        self._closed_event.set()
        if self.on_closed is not None:
            self.on_closed(self)
        if exc is not None:
            # The peer closing a connection with nothing in flight is routine (a broker or a
            # name server closes one idle for 120 s; Java logs it at INFO too); a reset, an
            # error or a request lost with it is worth a warning.
            emit = log.info if self._peer_closed and not pending else log.warning
            emit("remoting.connection_lost", addr=self.addr, error=str(exc),
                 failed_requests=len(pending))
        else:
            log.debug("remoting.connection_closed", addr=self.addr, failed_requests=len(pending))

    # ------------------------------------------------------------------ asyncio.BufferedProtocol

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's TCP transport is not an asyncio.Transport subclass, only a lookalike.
        self._transport = cast(asyncio.Transport, transport)

    def connection_lost(self, exc: Exception | None) -> None:
        self._lost = True
        self._peer_closed = exc is None
        if self._flush_timer is not None:  # the buffer drained: nothing to abort
            self._flush_timer.cancel()
            self._flush_timer = None
        self._shutdown(exc if exc is not None else ConnectionResetError("peer closed"))

    def _abort_unflushed(self) -> None:
        """A graceful close's buffer did not drain in time: close the socket anyway."""
        self._flush_timer = None
        if self._transport is not None and not self._lost:
            self._transport.abort()

    def pause_writing(self) -> None:
        self._can_write.clear()

    def resume_writing(self) -> None:
        self._can_write.set()

    def get_buffer(self, sizehint: int) -> memoryview:
        return self._decoder.get_buffer(sizehint)

    def buffer_updated(self, nbytes: int) -> None:
        if self._closed:
            return
        self.last_activity = asyncio.get_running_loop().time()
        failure: ProtocolError | None = None
        try:
            commands = self._decoder.buffer_updated(nbytes)
        except ProtocolError as exc:
            log.error("remoting.protocol_error", addr=self.addr, error=str(exc))
            # The commands before the bad frame are delivered first (as Netty passes on each
            # whole frame before the bad one closes the channel), then the connection closes.
            commands, failure = list(exc.decoded), exc
        for cmd in commands:
            if cmd.is_response:
                fut = self._pending.pop(cmd.opaque, None)
                self._frame_end.pop(cmd.opaque, None)
                if self._deadlines.pop(cmd.opaque, None) is not None:
                    del self._timeouts[cmd.opaque]
                    if cmd.code == ResponseCode.GO_AWAY and self.on_started_go_away is not None:
                        asyncio.get_running_loop().call_soon(self.on_started_go_away, self)
                if fut is None:
                    log.debug("remoting.unmatched_response", addr=self.addr, opaque=cmd.opaque,
                              code=cmd.code)
                elif not fut.done():
                    fut.set_result(cmd)
            else:
                self._dispatch_request(cmd)
        if failure is not None:
            self._shutdown(failure)
            return
        if self._close_when_idle:
            self._close_if_idle()

    # ------------------------------------------------------------------ requests from the peer

    def _dispatch_request(self, cmd: RemotingCommand) -> None:
        task = asyncio.get_running_loop().create_task(
            self._serve(cmd), name=f"remoting-serve-{cmd.code}"
        )
        self._handler_tasks.add(task)
        task.add_done_callback(self._handler_tasks.discard)

    async def _serve(self, cmd: RemotingCommand) -> None:
        response: RemotingCommand | None
        if self._handler is None:
            response = unsupported_response(cmd)
        else:
            try:
                response = await self._handler(cmd, self)
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                log.exception("remoting.handler_failed", addr=self.addr, code=cmd.code)
                response = cmd.response_to(ResponseCode.SYSTEM_ERROR, remark=f"{type(exc).__name__}: {exc}")
        if response is None or cmd.is_oneway or self._closed:
            return
        try:
            parts = response.encode_parts()
        except Exception as exc:  # an answer that cannot be encoded: say so instead
            log.exception("remoting.answer_not_encodable", addr=self.addr, code=cmd.code)
            parts = cmd.response_to(ResponseCode.SYSTEM_ERROR,
                                    remark=f"the answer could not be encoded: "
                                           f"{type(exc).__name__}").encode_parts()
        try:
            await self._write(parts)
        except (ConnectionClosed, RemotingTimeout) as exc:
            log.warning("remoting.answer_not_sent", addr=self.addr, code=cmd.code, error=str(exc))

    # ------------------------------------------------------------------ sending

    async def _write(self, parts: list[bytes], timeout: float = DEFAULT_WRITE_TIMEOUT,
                     opaque: int | None = None) -> None:
        """Write a frame; while the transport is paused (the peer does not read), wait for it
        to drain at most ``timeout`` seconds, then give up with :class:`RemotingTimeout`."""
        if self._closed or self._transport is None:
            raise self._closed_error()
        if not self._can_write.is_set():
            try:
                async with asyncio.timeout(timeout):
                    await self._can_write.wait()
            except TimeoutError:
                raise RemotingTimeout(
                    f"{self.addr} did not read what was sent within {timeout:.3f}s", addr=self.addr
                ) from None
            if self._closed:
                raise self._closed_error()
        self._send_soon(parts, opaque)

    def _closed_error(self) -> ConnectionClosed:
        err = ConnectionClosed(f"connection to {self.addr} is closed", addr=self.addr)
        err.__cause__ = self._close_exc
        return err

    async def request(self, cmd: RemotingCommand, timeout: float) -> RemotingCommand:
        """Send ``cmd`` and wait for its response, at most ``timeout`` seconds."""
        if self._closed:
            raise self._closed_error()
        if self._rpc_hook is not None:
            self._rpc_hook(cmd)
        loop = asyncio.get_running_loop()
        cmd.opaque = next_opaque()
        fut: asyncio.Future[RemotingCommand] = loop.create_future()
        self._pending[cmd.opaque] = fut
        timer = loop.call_later(timeout, self._expire, cmd.opaque, timeout)
        try:
            # The write shares the request's deadline: a peer that stopped reading must not
            # hold the caller past it (the timer only fails the response future).
            await self._write(cmd.encode_parts(), timeout, cmd.opaque)
            return await fut
        finally:
            timer.cancel()
            self._pending.pop(cmd.opaque, None)
            self._frame_end.pop(cmd.opaque, None)
            if self._close_when_idle:
                self._close_if_idle()

    def start_request(self, cmd: RemotingCommand,
                      timeout: float) -> asyncio.Future[RemotingCommand] | None:
        """Send ``cmd`` now and return the future of its response, without awaiting it.

        The same request as :meth:`request` (same timeout, same failure on close), for callers
        that keep a request in flight while they do other work (the pull loop sends its next
        pull before it decodes the answer it just got). A cancelled request's entry goes when
        its answer comes or its deadline passes. Returns ``None`` while the transport is
        paused: the caller then uses :meth:`request`, which waits for it to drain.
        """
        if self._closed:
            raise self._closed_error()
        if self._transport is None or not self._can_write.is_set():
            return None
        if self._rpc_hook is not None:
            self._rpc_hook(cmd)
        opaque = cmd.opaque = next_opaque()
        return self._start(opaque, cmd.encode_parts(), timeout)

    def start_frame(self, opaque: int, frame: bytes,
                    timeout: float) -> asyncio.Future[RemotingCommand] | None:
        """:meth:`start_request` for a request already encoded with ``opaque`` (a
        :class:`~rmq_async.protocol.command.FrameTemplate`). ``None`` when it cannot be sent
        as is: the transport is paused, or requests must be signed (an RPC hook is set)."""
        if self._closed:
            raise self._closed_error()
        if self._transport is None or not self._can_write.is_set() or self._rpc_hook is not None:
            return None
        return self._start(opaque, [frame], timeout)

    def _start(self, opaque: int, parts: list[bytes],
               timeout: float) -> asyncio.Future[RemotingCommand]:
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[RemotingCommand] = loop.create_future()
        self._pending[opaque] = fut
        deadline = loop.time() + timeout
        self._deadlines[opaque] = deadline
        self._timeouts[opaque] = timeout
        if deadline < self._sweep_at:
            self._schedule_sweep(loop, deadline)
        self._send_soon(parts, opaque)
        return fut

    def _schedule_sweep(self, loop: asyncio.AbstractEventLoop, when: float) -> None:
        if self._sweep_handle is not None:
            self._sweep_handle.cancel()
        self._sweep_handle = loop.call_at(when, self._sweep)
        self._sweep_at = when

    def _sweep(self) -> None:
        """Fail the requests kept in flight whose deadline passed; wait for the next one."""
        self._sweep_handle = None
        self._sweep_at = math.inf
        if self._closed:
            return
        loop = asyncio.get_running_loop()
        # A timer may run up to the clock's resolution early: count that as on time.
        now = loop.time() + _SWEEP_SLACK
        deadlines = self._deadlines
        expired = [opaque for opaque, deadline in deadlines.items() if deadline <= now]
        timed_out = 0.0
        for opaque in expired:
            del deadlines[opaque]
            timeout = self._timeouts.pop(opaque)
            fut = self._pending.get(opaque)
            if fut is not None and not fut.done():
                timed_out = max(timed_out, timeout)
            self._expire(opaque, timeout)
        if deadlines:
            self._schedule_sweep(loop, min(deadlines.values()))
        if timed_out and self.on_started_timeout is not None:
            loop.call_soon(self.on_started_timeout, self, timed_out)
        if self._close_when_idle:
            self._close_if_idle()

    def _send_soon(self, parts: list[bytes], opaque: int | None = None) -> None:
        size = sum(map(len, parts))
        self._queued += size
        if opaque is not None:
            self._frame_end[opaque] = self._written + self._queued
        out = self._out
        if out is None:
            self._out = list(parts)
            asyncio.get_running_loop().call_soon(self._flush)
        else:
            out.extend(parts)

    def _flush(self) -> None:
        out, self._out = self._out, None
        if out and not self._closed and self._transport is not None:
            self._transport.writelines(out)
            self._written += self._queued
        self._queued = 0

    def abort(self) -> None:
        """Close at once: the socket too, with whatever it has not sent yet (pending requests
        fail with ConnectionClosed)."""
        self._shutdown(None, hard=True)

    def _expire(self, opaque: int, timeout: float) -> None:
        fut = self._pending.pop(opaque, None)
        self._frame_end.pop(opaque, None)
        if fut is not None and not fut.done():
            fut.set_exception(
                RemotingTimeout(f"no response from {self.addr} within {timeout:.3f}s", addr=self.addr)
            )

    async def send_oneway(self, cmd: RemotingCommand) -> None:
        """Send a request that gets no response."""
        if self._rpc_hook is not None:
            self._rpc_hook(cmd)
        cmd.opaque = next_opaque()
        cmd.flag |= 0x2
        await self._write(cmd.encode_parts())

    def __repr__(self) -> str:
        state = "closed" if self._closed else "open"
        return f"<Connection {self.addr} {state} pending={len(self._pending)}>"


def unsupported_response(cmd: RemotingCommand) -> RemotingCommand:
    """The answer Java gives to a request code nobody handles."""
    return cmd.response_to(
        ResponseCode.REQUEST_CODE_NOT_SUPPORTED, remark=f" request type {cmd.code} not supported"
    )


def split_addr(addr: str) -> tuple[str, int]:
    """Split ``host:port`` (IPv6 as ``[::1]:port``) into host and port."""
    host, sep, port = addr.rpartition(":")
    if not sep or not port.isascii() or not port.isdigit() or not 0 < int(port) < 65536:
        raise InvalidArgumentError(f"address must be host:port (port 1-65535), got {addr!r}")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    return host, int(port)


async def close_quietly(conn: Connection) -> None:
    with contextlib.suppress(Exception):
        await conn.close()

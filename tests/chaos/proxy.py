"""A fault-injecting TCP proxy on loopback, for the chaos tests.

``FaultProxy(target)`` listens on ``127.0.0.1:<free port>`` and forwards every accepted
connection to ``target`` (``host:port``). Two pipes per connection: ``"up"`` (client to server)
and ``"down"`` (server to client). Faults, changeable at any time:

* ``latency`` (seconds): every chunk is delivered that much later, in both directions;
* ``rate`` (bytes per second, per pipe): throttling; reads stop while the pipe is behind, so
  TCP backpressure reaches the sender;
* :meth:`stall`: the connections open now turn half-open: bytes are still read (the sender's
  writes succeed) but nothing is forwarded or answered, ever. New connections are healthy;
* :meth:`cut_mid_frame`: the next remoting frame (of at least ``min_size`` bytes) crossing a
  pipe is forwarded only in part, then both sides are closed;
* :meth:`reset`: every open connection is aborted with a TCP RST on both sides.

Name-server proxies rewrite broker addresses: with ``rewrite={"127.0.0.1:10911":
"127.0.0.1:40000"}`` the answers to GET_ROUTEINFO_BY_TOPIC and GET_BROKER_CLUSTER_INFO are
decoded with the project's :class:`FrameDecoder`, the real address in their JSON body is
replaced by the broker proxy's, and the frame is re-encoded. A client routed through the
name-server proxy therefore reaches the broker through the broker proxy without knowing it.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import struct
import time
from collections.abc import Mapping
from dataclasses import dataclass, field

from rmq_async.protocol.codes import RequestCode, ResponseCode
from rmq_async.protocol.command import FrameDecoder

__all__ = ["FaultProxy", "ProxyStats"]

UP = "up"
DOWN = "down"
_DIRECTIONS = (UP, DOWN)
_REWRITTEN_CODES = frozenset({int(RequestCode.GET_ROUTEINFO_BY_TOPIC),
                              int(RequestCode.GET_BROKER_CLUSTER_INFO)})
_CHUNK = 64 * 1024
_QUEUED_CHUNKS = 32
_LEN = struct.Struct(">i")


@dataclass
class ProxyStats:
    accepted: int = 0
    accept_times: list[float] = field(default_factory=list)  # time.monotonic() of each accept
    bytes: dict[str, int] = field(default_factory=lambda: dict.fromkeys(_DIRECTIONS, 0))
    dropped: dict[str, int] = field(default_factory=lambda: dict.fromkeys(_DIRECTIONS, 0))
    cuts: int = 0
    resets: int = 0
    rewrites: int = 0
    corrupted: list[int] = field(default_factory=list)


class _FrameCursor:
    """Follows remoting frame boundaries in one byte stream (length-prefixed frames)."""

    def __init__(self) -> None:
        self._len_buf = bytearray()
        self._left = 0  # bytes of the current frame (after its length field) not yet seen
        self._size = 0  # size of the current frame, length field included

    def cut_point(self, data: bytes, min_size: int | None) -> int | None:
        """Advance over ``data``. With ``min_size`` set, stop at the first index of ``data``
        that lies strictly within a frame of at least ``min_size`` bytes (its length field
        and some bytes before the index, at least one byte after) and return it."""
        pos = 0
        n = len(data)
        while pos < n:
            if self._left == 0:
                take = min(4 - len(self._len_buf), n - pos)
                self._len_buf += data[pos:pos + take]
                pos += take
                if len(self._len_buf) < 4:
                    return None
                (length,) = _LEN.unpack(self._len_buf)
                self._len_buf.clear()
                self._left = max(length, 0)
                self._size = self._left + 4
                continue
            avail = min(self._left, n - pos)
            if min_size is not None and self._size >= min_size:
                return pos + min(avail, self._left - 1) // 2
            self._left -= avail
            pos += avail
        return None


class _Pipe:
    """One direction of one proxied connection."""

    def __init__(self, conn: _Conn, direction: str, reader: asyncio.StreamReader,
                 writer: asyncio.StreamWriter) -> None:
        self.conn = conn
        self.proxy = conn.proxy
        self.direction = direction
        self.reader = reader
        self.writer = writer
        self.queue: asyncio.Queue[tuple[float, bytes] | None] = asyncio.Queue(_QUEUED_CHUNKS)
        self.cursor = _FrameCursor()
        self.decoder: FrameDecoder | None = None

    @property
    def stalled(self) -> bool:
        return self.direction in self.conn.stalled

    def _transform(self, data: bytes) -> bytes:
        """Name-server answers: rewrite broker addresses (frame by frame); requests: remember
        the code of every opaque so answers can be recognised."""
        proxy = self.proxy
        if not proxy.rewrite and not proxy.frames:
            return data
        if self.decoder is None:
            self.decoder = FrameDecoder()
        commands = self.decoder.feed(data)
        if self.direction == UP:
            for cmd in commands:
                if not cmd.is_response:
                    self.conn.request_codes[cmd.opaque] = cmd.code
            return data
        out = []
        for cmd in commands:
            code = self.conn.request_codes.pop(cmd.opaque, None) if cmd.is_response else None
            if (code == _PULL_MESSAGE and cmd.code == ResponseCode.SUCCESS
                    and proxy.corrupt_record is not None
                    and cmd.body):
                body = _corrupt_record(cmd.body, proxy.corrupt_record)
                if body is not None:
                    cmd.body, proxy.corrupt_record = body, None
                    proxy.stats.corrupted.append(_record_offset(body, proxy.corrupted_index))
            if code in _REWRITTEN_CODES and cmd.body:
                body = cmd.body
                for real, fake in proxy.rewrite.items():
                    body = body.replace(f'"{real}"'.encode(), f'"{fake}"'.encode())
                if body != cmd.body:
                    cmd.body = body
                    proxy.stats.rewrites += 1
            out.append(cmd.encode())
        return b"".join(out)

    async def pump(self) -> None:
        """Read from the source, queue for delivery (or drop while stalled)."""
        proxy = self.proxy
        try:
            while True:
                size = _CHUNK
                if proxy.rate:
                    size = max(256, min(_CHUNK, int(proxy.rate / 20)))
                data = await self.reader.read(size)
                if not data:
                    break
                if self.stalled:
                    proxy.stats.dropped[self.direction] += len(data)
                    continue
                data = self._transform(data)
                await self.queue.put((time.monotonic() + proxy.latency, data))
        except (ConnectionError, OSError):
            pass
        if self.stalled:
            # One side of a half-open connection hung up: let the other side see it too
            # (otherwise the broker would keep a dead client channel for two minutes).
            await self.conn.close()
            return
        await self.queue.put(None)

    async def deliver(self) -> None:
        """Write queued chunks when due, at most ``rate`` bytes per second; cut if armed."""
        proxy = self.proxy
        try:
            while True:
                item = await self.queue.get()
                if item is None:
                    break
                due, data = item
                if self.stalled:
                    proxy.stats.dropped[self.direction] += len(data)
                    continue
                delay = due - time.monotonic()
                if delay > 0:
                    await asyncio.sleep(delay)
                if self.stalled:
                    proxy.stats.dropped[self.direction] += len(data)
                    continue
                cut = self.cursor.cut_point(data, proxy._cut_armed.get(self.direction))
                if cut is not None:
                    proxy._cut_armed.pop(self.direction, None)
                    self.writer.write(data[:cut])
                    with contextlib.suppress(ConnectionError, OSError):
                        await self.writer.drain()
                    proxy.stats.cuts += 1
                    proxy.stats.bytes[self.direction] += cut
                    await self.conn.close()
                    proxy._cut_done.set()
                    return
                self.writer.write(data)
                proxy.stats.bytes[self.direction] += len(data)
                await self.writer.drain()
                if proxy.rate:
                    await asyncio.sleep(len(data) / proxy.rate)
        except (ConnectionError, OSError):
            pass
        finally:
            # The source ended (or the sink failed): end this half; the connection closes when
            # both halves are done.
            if not self.stalled:
                with contextlib.suppress(OSError, RuntimeError):
                    if self.writer.can_write_eof():
                        self.writer.write_eof()
            self.conn.half_done()


class _Conn:
    def __init__(self, proxy: FaultProxy, c_reader: asyncio.StreamReader,
                 c_writer: asyncio.StreamWriter, s_reader: asyncio.StreamReader,
                 s_writer: asyncio.StreamWriter) -> None:
        self.proxy = proxy
        self.client_writer = c_writer
        self.server_writer = s_writer
        self.stalled: set[str] = set()
        self.request_codes: dict[int, int] = {}
        self.pipes = [_Pipe(self, UP, c_reader, s_writer), _Pipe(self, DOWN, s_reader, c_writer)]
        self.tasks: list[asyncio.Task[None]] = []
        self._halves = 0
        self.closed = False

    def start(self) -> None:
        for pipe in self.pipes:
            self.tasks.append(asyncio.create_task(pipe.pump(), name=f"proxy-{pipe.direction}-pump"))
            self.tasks.append(asyncio.create_task(pipe.deliver(),
                                                  name=f"proxy-{pipe.direction}-deliver"))

    def half_done(self) -> None:
        self._halves += 1
        if self._halves >= 2 and not self.closed:
            asyncio.get_running_loop().create_task(self.close())

    async def close(self, *, rst: bool = False) -> None:
        if self.closed:
            return
        self.closed = True
        self.proxy._conns.discard(self)
        for w in (self.client_writer, self.server_writer):
            if rst:
                sock = w.get_extra_info("socket")
                if sock is not None:
                    with contextlib.suppress(OSError):
                        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER,
                                        struct.pack("ii", 1, 0))
                w.transport.abort()
            else:
                w.close()
        current = asyncio.current_task()
        for t in self.tasks:
            if t is not current:
                t.cancel()
        for w in (self.client_writer, self.server_writer):
            with contextlib.suppress(Exception):
                await w.wait_closed()


class FaultProxy:
    """See the module docstring."""

    def __init__(self, target: str, *, name: str = "proxy",
                 rewrite: Mapping[str, str] | None = None, frames: bool = False) -> None:
        host, _, port = target.rpartition(":")
        #: Decode the traffic frame by frame from the first byte (needed by corrupt_next_pull).
        self.frames = frames
        #: Index of the record to corrupt in the next PULL_MESSAGE answer that has it.
        self.corrupt_record: int | None = None
        self.corrupted_index = 0
        self.target_host = host or "127.0.0.1"
        self.target_port = int(port)
        self.name = name
        self.rewrite: dict[str, str] = dict(rewrite or {})
        self.latency = 0.0
        self.rate: float | None = None
        self.stats = ProxyStats()
        self._server: asyncio.Server | None = None
        self._conns: set[_Conn] = set()
        self._cut_armed: dict[str, int] = {}
        self._cut_done = asyncio.Event()
        self.port = 0

    @property
    def addr(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def open_connections(self) -> int:
        return len(self._conns)

    async def start(self, port: int = 0) -> FaultProxy:
        """Listen on ``port`` (a free one when 0; the port of a closed proxy to bring it back)."""
        self._server = await asyncio.start_server(self._accept, "127.0.0.1", port)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    async def __aenter__(self) -> FaultProxy:
        return await self.start()

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
        await asyncio.gather(*(c.close() for c in list(self._conns)), return_exceptions=True)
        if self._server is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._server.wait_closed(), 5)
            self._server = None

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.stats.accepted += 1
        self.stats.accept_times.append(time.monotonic())
        try:
            s_reader, s_writer = await asyncio.open_connection(self.target_host, self.target_port)
        except OSError:
            writer.transport.abort()
            return
        conn = _Conn(self, reader, writer, s_reader, s_writer)
        self._conns.add(conn)
        conn.start()

    # -- faults ---------------------------------------------------------------------------

    def clear(self) -> None:
        """Back to a transparent proxy for new traffic (stalled connections stay stalled)."""
        self.latency = 0.0
        self.rate = None
        self._cut_armed.clear()

    def stall(self, directions: tuple[str, ...] = _DIRECTIONS) -> int:
        """Turn every open connection half-open; returns how many."""
        for d in directions:
            if d not in _DIRECTIONS:
                raise ValueError(f"direction must be 'up' or 'down', not {d!r}")
        for conn in self._conns:
            conn.stalled.update(directions)
        return len(self._conns)

    async def cut_mid_frame(self, direction: str = DOWN, *, min_size: int = 0,
                            timeout: float = 30.0) -> None:
        """Cut the connection carrying the next frame of ``min_size`` bytes or more in
        ``direction`` in the middle of that frame; returns once it is cut."""
        self._cut_done.clear()
        self._cut_armed[direction] = min_size
        try:
            await asyncio.wait_for(self._cut_done.wait(), timeout)
        finally:
            self._cut_armed.pop(direction, None)

    def corrupt_next_pull(self, index: int) -> None:
        """Spoil the magic code of record ``index`` (0-based) of the next PULL_MESSAGE answer
        holding that many records; its queue offset is appended to ``stats.corrupted``.
        The proxy must have been made with ``frames=True``."""
        assert self.frames, "corrupting records needs a frame-aware proxy (frames=True)"
        self.corrupt_record = self.corrupted_index = index

    async def hang_up(self) -> int:
        """Close every open connection on both sides with a FIN, as a server closes one idle
        for ``serverChannelMaxIdleTimeSeconds``; returns how many."""
        conns = list(self._conns)
        for conn in conns:
            await conn.close()
        return len(conns)

    async def reset(self) -> int:
        """Abort every open connection with a RST on both sides; returns how many."""
        conns = list(self._conns)
        for conn in conns:
            await conn.close(rst=True)
        self.stats.resets += len(conns)
        return len(conns)


_PULL_MESSAGE = RequestCode.PULL_MESSAGE
_MAGIC_AT = 4
_QUEUE_OFFSET_AT = 20


def _record_starts(body: bytes) -> list[int]:
    starts = []
    pos = 0
    while pos + 4 <= len(body):
        size = int.from_bytes(body[pos:pos + 4], "big", signed=True)
        if size <= 0 or pos + size > len(body):
            break
        starts.append(pos)
        pos += size
    return starts


def _corrupt_record(body: bytes, index: int) -> bytes | None:
    """``body`` with record ``index``'s magic code zeroed, or ``None`` if it has no such record."""
    starts = _record_starts(body)
    if len(starts) <= index:
        return None
    at = starts[index] + _MAGIC_AT
    return body[:at] + b"\x00\x00\x00\x00" + body[at + 4:]


def _record_offset(body: bytes, index: int) -> int:
    at = _record_starts(body)[index] + _QUEUE_OFFSET_AT
    return int.from_bytes(body[at:at + 8], "big", signed=True)

"""Remoting layer against a scripted in-process peer (faults the real broker cannot produce)."""

from __future__ import annotations

import asyncio
import socket
import struct
import time
from collections.abc import Awaitable, Callable

import pytest
from structlog.testing import capture_logs

from rmq_async.protocol.codes import RequestCode, ResponseCode
from rmq_async.protocol.command import FrameDecoder, RemotingCommand
from rmq_async.protocol.errors import ProtocolError
from rmq_async.remoting import (
    Connection,
    ConnectionClosed,
    ConnectionLostInFlight,
    RemotingClient,
    RemotingConnectError,
    RemotingError,
    RemotingTimeout,
)
from tests.fake_broker import FakeBroker, insecure_tls, silent_listener
from tests.helpers import wait_until

Script = Callable[[RemotingCommand, asyncio.StreamWriter], Awaitable[None]]


class Peer:
    """A tiny server that decodes frames and lets each test script its answers."""

    def __init__(self, script: Script) -> None:
        self.script = script
        self.received: list[RemotingCommand] = []
        self.writers: list[asyncio.StreamWriter] = []
        self.server: asyncio.base_events.Server | None = None
        self.connections = 0

    async def __aenter__(self) -> Peer:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self.server is not None
        self.server.close()
        for w in self.writers:
            w.close()
        await self.server.wait_closed()

    @property
    def addr(self) -> str:
        assert self.server is not None
        host, port = self.server.sockets[0].getsockname()[:2]
        return f"{host}:{port}"

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        self.writers.append(writer)
        decoder = FrameDecoder()
        try:
            while data := await reader.read(65536):
                for cmd in decoder.feed(data):
                    self.received.append(cmd)
                    await self.script(cmd, writer)
        except (ConnectionError, ProtocolError):
            pass


async def echo(cmd: RemotingCommand, writer: asyncio.StreamWriter) -> None:
    if not cmd.is_oneway:
        writer.write(cmd.response_to(ResponseCode.SUCCESS, remark="ok", body=cmd.body).encode())
        await writer.drain()


async def silent(cmd: RemotingCommand, writer: asyncio.StreamWriter) -> None:
    return None


async def test_request_response_and_oneway() -> None:
    async with Peer(echo) as peer:
        conn = await Connection.open(peer.addr)
        try:
            resp = await conn.request(
                RemotingCommand.request(RequestCode.HEART_BEAT, ext_fields={"a": "b"}, body=b"x" * 70000),
                timeout=5,
            )
            assert resp.code == ResponseCode.SUCCESS
            assert resp.body == b"x" * 70000
            await conn.send_oneway(RemotingCommand.request(RequestCode.UPDATE_CONSUMER_OFFSET))
            for _ in range(100):
                if len(peer.received) == 2:
                    break
                await asyncio.sleep(0.01)
            assert peer.received[1].is_oneway
            assert conn.pending_count == 0
        finally:
            await conn.close()


async def test_many_concurrent_requests_are_matched_by_opaque() -> None:
    async def reverse_order(cmd: RemotingCommand, writer: asyncio.StreamWriter) -> None:
        await asyncio.sleep(0.001 * (int(cmd.ext_fields["i"]) % 7))  # type: ignore[index]
        writer.write(cmd.response_to(ResponseCode.SUCCESS, ext_fields=cmd.ext_fields).encode())

    async with Peer(reverse_order) as peer:
        conn = await Connection.open(peer.addr)
        try:
            resps = await asyncio.gather(*(
                conn.request(RemotingCommand.request(RequestCode.HEART_BEAT, ext_fields={"i": str(i)}),
                             timeout=5) for i in range(200)
            ))
            assert [r.ext_fields["i"] for r in resps] == [str(i) for i in range(200)]  # type: ignore[index]
        finally:
            await conn.close()


async def test_timeout_removes_pending_entry() -> None:
    async with Peer(silent) as peer:
        conn = await Connection.open(peer.addr)
        try:
            started = time.monotonic()
            with pytest.raises(RemotingTimeout):
                await conn.request(RemotingCommand.request(RequestCode.HEART_BEAT), timeout=0.2)
            assert time.monotonic() - started < 2.0
            assert conn.pending_count == 0
            assert not conn.closed
        finally:
            await conn.close()


async def test_close_fails_pending_requests() -> None:
    async with Peer(silent) as peer:
        conn = await Connection.open(peer.addr)
        task = asyncio.create_task(
            conn.request(RemotingCommand.request(RequestCode.HEART_BEAT), timeout=30)
        )
        await asyncio.sleep(0.05)
        await conn.close()
        with pytest.raises(ConnectionClosed):
            await task
        with pytest.raises(ConnectionClosed):
            await conn.request(RemotingCommand.request(RequestCode.HEART_BEAT), timeout=1)


async def test_a_close_tells_requests_that_went_out_from_those_that_did_not() -> None:
    """A request handed to the socket before the connection closed may have been acted on
    (ConnectionLostInFlight); one still queued for the loop turn's write was not."""
    async with Peer(silent) as peer:
        conn = await Connection.open(peer.addr)
        sent = conn.start_request(RemotingCommand.request(RequestCode.HEART_BEAT), timeout=30)
        assert sent is not None
        await asyncio.sleep(0.05)  # written
        queued = conn.start_request(RemotingCommand.request(RequestCode.HEART_BEAT), timeout=30)
        assert queued is not None
        conn.abort()  # in the same loop turn: the second frame never leaves
        await _went_out_and_did_not(sent, queued)


async def _went_out_and_did_not(went_out: Awaitable[object], did_not: Awaitable[object]) -> None:
    """The first request failed as sent (the peer may have acted on it), the second not."""
    with pytest.raises(ConnectionLostInFlight):
        await went_out
    with pytest.raises(ConnectionClosed) as info:
        await did_not
    assert not isinstance(info.value, ConnectionLostInFlight)


async def test_a_request_left_in_the_transports_buffer_by_an_abort_did_not_go_out() -> None:
    """A peer that stopped reading: a big frame passes to the socket only in part, the rest
    waits in the transport's buffer, which an abort drops. That request never reached the
    peer whole: not ConnectionLostInFlight (a producer would not send it elsewhere)."""
    async with silent_listener() as (addr, _):
        conn = await Connection.open(addr)
        small = conn.start_request(RemotingCommand.request(RequestCode.HEART_BEAT), timeout=30)
        assert small is not None
        await asyncio.sleep(0.05)
        big = conn.start_request(RemotingCommand.request(RequestCode.SEND_MESSAGE,
                                                         body=b"x" * (32 << 20)), timeout=30)
        assert big is not None
        await asyncio.sleep(0.2)  # written: what the socket took, and the rest buffered
        transport = conn._transport
        assert transport is not None and transport.get_write_buffer_size() > 0
        conn.abort()
        await _went_out_and_did_not(small, big)


async def test_garbage_from_peer_closes_with_typed_error_promptly() -> None:
    async def garbage(cmd: RemotingCommand, writer: asyncio.StreamWriter) -> None:
        # A frame length smaller than the mandatory header-info word.
        writer.write(b"\x00\x00\x00\x02\xff\xff")
        await writer.drain()

    async with Peer(garbage) as peer:
        conn = await Connection.open(peer.addr)
        started = time.monotonic()
        with pytest.raises(ConnectionClosed) as info:
            await conn.request(RemotingCommand.request(RequestCode.HEART_BEAT), timeout=30)
        assert time.monotonic() - started < 2.0
        assert isinstance(info.value.__cause__, ProtocolError)
        assert conn.closed


async def test_oversized_frame_is_rejected_without_buffering() -> None:
    async def huge(cmd: RemotingCommand, writer: asyncio.StreamWriter) -> None:
        writer.write((1 << 30).to_bytes(4, "big") + b"\x00" * 1024)
        await writer.drain()

    async with Peer(huge) as peer:
        conn = await Connection.open(peer.addr, max_frame_size=1 << 20)
        with pytest.raises(ConnectionClosed) as info:
            await conn.request(RemotingCommand.request(RequestCode.HEART_BEAT), timeout=30)
        assert isinstance(info.value.__cause__, ProtocolError)


async def test_peer_request_dispatch_and_unsupported_codes() -> None:
    handled: list[int] = []
    answers: list[RemotingCommand] = []
    got_answer = asyncio.Event()
    asked: list[RemotingCommand] = []

    async def handler(cmd: RemotingCommand, conn: Connection) -> RemotingCommand | None:
        handled.append(cmd.code)
        if cmd.code == RequestCode.GET_CONSUMER_RUNNING_INFO:
            return cmd.response_to(ResponseCode.SUCCESS, body=b"{}")
        return None

    async def script(cmd: RemotingCommand, writer: asyncio.StreamWriter) -> None:
        if cmd.is_response:
            answers.append(cmd)
            got_answer.set()  # the one-way notify has no answer: the running info's only
            return
        notify = RemotingCommand.request(RequestCode.NOTIFY_CONSUMER_IDS_CHANGED,
                                         ext_fields={"consumerGroup": "g"}, oneway=True)
        running = RemotingCommand.request(RequestCode.GET_CONSUMER_RUNNING_INFO,
                                          ext_fields={"consumerGroup": "g"})
        asked.append(running)
        writer.write(notify.encode() + running.encode())
        writer.write(cmd.response_to(ResponseCode.SUCCESS).encode())
        await writer.drain()

    async with Peer(script) as peer:
        conn = await Connection.open(peer.addr, handler=handler)
        try:
            await conn.request(RemotingCommand.request(RequestCode.HEART_BEAT), timeout=5)
            await asyncio.wait_for(asyncio.shield(_wait_len(handled, 2)), 5)
            await asyncio.wait_for(got_answer.wait(), 5)
            await asyncio.sleep(0.1)  # a second answer (to the one-way notify) would be here
        finally:
            await conn.close()
    assert sorted(handled) == sorted([RequestCode.NOTIFY_CONSUMER_IDS_CHANGED,
                                      RequestCode.GET_CONSUMER_RUNNING_INFO])
    (answer,) = answers
    assert answer.code == ResponseCode.SUCCESS and answer.body == b"{}"
    assert answer.opaque == asked[0].opaque

    # Without a handler, a request from the peer gets REQUEST_CODE_NOT_SUPPORTED.
    unsupported: list[RemotingCommand] = []
    done = asyncio.Event()

    async def script2(cmd: RemotingCommand, writer: asyncio.StreamWriter) -> None:
        if cmd.is_response:
            unsupported.append(cmd)
            done.set()
            return
        writer.write(RemotingCommand.request(12345).encode())
        writer.write(cmd.response_to(ResponseCode.SUCCESS).encode())
        await writer.drain()

    async with Peer(script2) as peer:
        conn = await Connection.open(peer.addr)
        try:
            await conn.request(RemotingCommand.request(RequestCode.HEART_BEAT), timeout=5)
            await asyncio.wait_for(done.wait(), 5)
        finally:
            await conn.close()
    assert unsupported[0].code == ResponseCode.REQUEST_CODE_NOT_SUPPORTED
    assert unsupported[0].remark == " request type 12345 not supported"
    assert RequestCode.NOTIFY_CONSUMER_IDS_CHANGED in handled


async def _wait_len(items: list[int], n: int) -> None:
    while len(items) < n:
        await asyncio.sleep(0.01)


async def test_client_reconnects_on_next_use_after_drop() -> None:
    async with Peer(echo) as peer:
        client = RemotingClient()
        try:
            r1 = await client.invoke(peer.addr, RemotingCommand.request(RequestCode.HEART_BEAT), 5)
            assert r1.code == ResponseCode.SUCCESS
            for w in peer.writers:
                w.close()
            conn = await client.connection(peer.addr)
            await asyncio.wait_for(conn.wait_closed(), 5)
            r2 = await client.invoke(peer.addr, RemotingCommand.request(RequestCode.HEART_BEAT), 5)
            assert r2.code == ResponseCode.SUCCESS
            assert peer.connections == 2
        finally:
            await client.close()


@pytest.mark.parametrize("how", ["idle-close", "close-with-a-request", "reset"])
async def test_a_lost_connection_warns_only_when_something_was_lost(how: str) -> None:
    # A server closing a connection with nothing in flight (a broker or a name server closes
    # one idle for 120 s) is routine, logged at info as Java logs a channel going inactive.
    seen = 0

    async def first_only(cmd: RemotingCommand, writer: asyncio.StreamWriter) -> None:
        nonlocal seen
        seen += 1
        if seen == 1 or how != "close-with-a-request":
            await echo(cmd, writer)

    async with Peer(first_only) as peer:
        conn = await Connection.open(peer.addr, connect_timeout=5)
        try:
            await conn.request(RemotingCommand.request(RequestCode.HEART_BEAT), 5)  # connected
            pending = None
            if how == "close-with-a-request":
                pending = asyncio.ensure_future(
                    conn.request(RemotingCommand.request(RequestCode.HEART_BEAT), 5))
                await wait_until(lambda: len(peer.received) == 2, 5)
            with capture_logs() as logs:
                (writer,) = peer.writers
                if how == "reset":
                    writer.get_extra_info("socket").setsockopt(
                        socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                    writer.transport.abort()
                else:
                    writer.close()
                await asyncio.wait_for(conn.wait_closed(), 5)
            if pending is not None:
                with pytest.raises(ConnectionClosed):
                    await pending
        finally:
            await conn.close()
    (event,) = [e for e in logs if e["event"] == "remoting.connection_lost"]
    assert event["log_level"] == ("info" if how == "idle-close" else "warning")
    assert event["failed_requests"] == (1 if how == "close-with-a-request" else 0)


async def test_connect_error_is_typed() -> None:
    server = await asyncio.start_server(lambda r, w: None, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    server.close()
    await server.wait_closed()
    with pytest.raises(RemotingConnectError):
        await Connection.open(f"127.0.0.1:{port}", connect_timeout=1)


async def test_request_to_a_peer_that_stopped_reading_times_out() -> None:
    # The transport is paused (its buffer is full because the peer reads nothing): the request
    # must still end at its deadline, not wait for the buffer to drain forever.
    async with Peer(silent) as peer:
        conn = await Connection.open(peer.addr)
        try:
            conn.pause_writing()
            started = time.monotonic()
            with pytest.raises(RemotingTimeout):
                await conn.request(RemotingCommand.request(RequestCode.HEART_BEAT), timeout=0.3)
            assert time.monotonic() - started < 2
            assert conn.pending_count == 0
            with pytest.raises(RemotingTimeout):  # a oneway send is bounded too
                await conn._write([b"x"], 0.2)
        finally:
            await conn.close()


async def test_a_timed_out_request_replaces_its_connection() -> None:
    # A peer that went silent (half-open): the first timeout closes the connection, the
    # requests still waiting on it fail at once, and the next call connects anew.
    answering = False

    async def sometimes(cmd: RemotingCommand, writer: asyncio.StreamWriter) -> None:
        if answering:
            await echo(cmd, writer)

    async with Peer(sometimes) as peer:
        client = RemotingClient()
        try:
            waiting = asyncio.ensure_future(client.invoke(
                peer.addr, RemotingCommand.request(RequestCode.PULL_MESSAGE), 30))
            with pytest.raises(RemotingTimeout):
                await client.invoke(peer.addr, RemotingCommand.request(RequestCode.HEART_BEAT), 0.2)
            with pytest.raises(ConnectionClosed):
                async with asyncio.timeout(2):
                    await waiting
            answering = True
            r = await client.invoke(peer.addr, RemotingCommand.request(RequestCode.HEART_BEAT), 5)
            assert r.code == ResponseCode.SUCCESS
            assert peer.connections == 2
        finally:
            await client.close()


async def test_requests_kept_in_flight_time_out_at_their_own_deadlines() -> None:
    # start_request notes a deadline instead of arming a timer per request; one timer per
    # connection fails each request when its deadline passes, whatever the order of sending.
    async with Peer(silent) as peer:
        conn = await Connection.open(peer.addr)
        try:
            started = time.monotonic()
            ended: dict[str, float] = {}

            async def wait(name: str, fut: asyncio.Future[RemotingCommand] | None) -> None:
                assert fut is not None
                with pytest.raises(RemotingTimeout):
                    await fut
                ended[name] = time.monotonic() - started

            slow = conn.start_request(RemotingCommand.request(RequestCode.HEART_BEAT), 0.9)
            fast = conn.start_request(RemotingCommand.request(RequestCode.HEART_BEAT), 0.2)
            middle = conn.start_request(RemotingCommand.request(RequestCode.HEART_BEAT), 0.5)
            assert conn.pending_count == 3
            await asyncio.gather(wait("slow", slow), wait("fast", fast), wait("middle", middle))
            # None before its deadline, each in the order of the deadlines (not of sending:
            # a single late check would wake them in the order they were sent), and none held
            # long after (bounds loose enough for a loaded CI machine).
            assert ended["fast"] >= 0.19 and ended["middle"] >= 0.49 and ended["slow"] >= 0.89
            assert ended["fast"] < ended["middle"] < ended["slow"] < 3.0
            assert conn.pending_count == 0 and not conn._deadlines and not conn._timeouts
            assert conn._sweep_handle is None  # nothing left to wait for
            assert not conn.closed  # a bare connection does not close itself on a timeout
        finally:
            await conn.close()


async def test_answered_and_cancelled_requests_leave_nothing_behind() -> None:
    answer = asyncio.Event()

    async def on_signal(cmd: RemotingCommand, writer: asyncio.StreamWriter) -> None:
        if cmd.code == RequestCode.HEART_BEAT:
            await answer.wait()
            await echo(cmd, writer)

    async with Peer(on_signal) as peer:
        conn = await Connection.open(peer.addr)
        try:
            cancelled = conn.start_request(
                RemotingCommand.request(RequestCode.PULL_MESSAGE), 0.3)
            (cancelled_opaque,) = conn._pending
            answered = conn.start_request(RemotingCommand.request(RequestCode.HEART_BEAT), 5)
            assert cancelled is not None and answered is not None
            cancelled.cancel()
            answer.set()
            assert (await answered).code == ResponseCode.SUCCESS
            # The answered one is gone at once; the cancelled one at the latest at its deadline.
            assert set(conn._deadlines) <= {cancelled_opaque}
            assert set(conn._pending) <= {cancelled_opaque}
            await asyncio.sleep(0.5)
            assert conn.pending_count == 0 and not conn._deadlines and not conn._timeouts
            assert not conn.closed  # a cancelled request is no timeout
        finally:
            await conn.close()


async def test_a_started_request_that_times_out_replaces_its_connection() -> None:
    # The pipelined form (every pull) follows the same rule as invoke: the connection that
    # let a request time out is closed, its other requests fail at once, the next call
    # connects anew.
    async with Peer(silent) as peer:
        client = RemotingClient()
        try:
            other = await client.start_invoke(
                peer.addr, lambda: RemotingCommand.request(RequestCode.PULL_MESSAGE), 30)
            started = time.monotonic()
            fut = await client.start_invoke(
                peer.addr, lambda: RemotingCommand.request(RequestCode.HEART_BEAT), 0.2)
            with pytest.raises(RemotingTimeout):
                await fut
            with pytest.raises(ConnectionClosed):
                async with asyncio.timeout(2):
                    await other
            assert time.monotonic() - started < 3.0
            await client.start_invoke(
                peer.addr, lambda: RemotingCommand.request(RequestCode.HEART_BEAT), 5)
            assert peer.connections == 2
        finally:
            await client.close()


async def test_a_started_request_answered_go_away_replaces_its_connection() -> None:
    async def go_away(cmd: RemotingCommand, writer: asyncio.StreamWriter) -> None:
        code = ResponseCode.GO_AWAY if cmd.code == RequestCode.PULL_MESSAGE else ResponseCode.SUCCESS
        writer.write(cmd.response_to(code).encode())
        await writer.drain()

    async with Peer(go_away) as peer:
        client = RemotingClient()
        try:
            fut = await client.start_invoke(
                peer.addr, lambda: RemotingCommand.request(RequestCode.PULL_MESSAGE), 5)
            assert (await fut).code == ResponseCode.GO_AWAY  # the caller sees the code
            async with asyncio.timeout(2):
                while (await client.connection(peer.addr)) is not None and peer.connections < 2:
                    await asyncio.sleep(0.01)
            assert peer.connections == 2
        finally:
            await client.close()


# ---------------------------------------------------------------- connects, GO_AWAY (fakes)


async def test_concurrent_callers_share_one_connect_attempt() -> None:
    # Six requests need a connection to an address whose connect hangs: one attempt is made,
    # and all six fail together when it gives up, after one connect_timeout (not one after
    # the other, the k-th after k timeouts: 1.8 s and more).
    async with silent_listener() as (addr, accepted):
        client = RemotingClient(connect_timeout=0.3, ssl=insecure_tls())
        try:
            started = time.monotonic()

            async def one() -> float:
                with pytest.raises(RemotingConnectError):
                    await client.invoke(addr, RemotingCommand.request(RequestCode.HEART_BEAT), 5)
                return time.monotonic() - started

            ended = await asyncio.gather(*(one() for _ in range(6)))
            assert len(accepted) == 1
            assert min(ended) >= 0.29 and max(ended) < 1.5
        finally:
            await client.close()


async def test_a_request_timeout_includes_its_connect() -> None:
    # The request has 0.3 s; connecting may take 5: it fails when its own time is up (Java's
    # invokeSync counts the connect), and close() ends the attempt still under way.
    async with silent_listener() as (addr, _):
        client = RemotingClient(connect_timeout=5, ssl=insecure_tls())
        try:
            started = time.monotonic()
            with pytest.raises(RemotingTimeout):
                await client.invoke(addr, RemotingCommand.request(RequestCode.HEART_BEAT), 0.3)
            assert time.monotonic() - started < 2.0
            with pytest.raises(RemotingTimeout):
                await client.start_invoke(
                    addr, lambda: RemotingCommand.request(RequestCode.PULL_MESSAGE), 0.2)
        finally:
            started = time.monotonic()
            await client.close()
        assert time.monotonic() - started < 2.5  # not the 5 s connect
        assert not [t for t in asyncio.all_tasks() if t.get_name().startswith("remoting-connect")]


def _ok(cmd: RemotingCommand) -> RemotingCommand:
    return cmd.response_to(ResponseCode.SUCCESS, ext_fields=cmd.ext_fields)


async def test_go_away_leaves_answers_in_flight_and_sends_again_on_a_new_connection() -> None:
    # A broker shutting down answers GO_AWAY to new requests but still answers those it took
    # before. The request answered GO_AWAY is sent again on a new connection; the one taken
    # before still gets its answer on the old connection, which closes after it.
    taken = asyncio.Event()
    answer_it = asyncio.Event()

    async def shutting_down(cmd: RemotingCommand, conn: int) -> RemotingCommand:
        if conn > 0:
            return _ok(cmd)
        if cmd.code == RequestCode.PULL_MESSAGE:  # taken before the shutdown began
            taken.set()
            await answer_it.wait()
            return _ok(cmd)
        return cmd.response_to(ResponseCode.GO_AWAY)

    async with FakeBroker(shutting_down) as broker:
        client = RemotingClient()
        try:
            taken_before = asyncio.ensure_future(client.invoke(
                broker.addr, RemotingCommand.request(RequestCode.PULL_MESSAGE), 5))
            await taken.wait()
            resp = await client.invoke(broker.addr,
                                       RemotingCommand.request(RequestCode.HEART_BEAT), 5)
            assert resp.code == ResponseCode.SUCCESS
            assert [(n, c.code) for n, c in broker.received][1:] == [
                (0, RequestCode.HEART_BEAT), (1, RequestCode.HEART_BEAT)]
            await asyncio.sleep(0.3)
            assert broker.closed == []  # the old connection waits for its last answer
            answer_it.set()
            assert (await taken_before).code == ResponseCode.SUCCESS
            async with asyncio.timeout(2):
                while broker.closed != [0]:
                    await asyncio.sleep(0.01)
            assert client.addresses == [broker.addr] and broker.connections == 2
        finally:
            await client.close()


async def test_a_second_go_away_is_an_error_and_the_resend_has_what_is_left() -> None:
    async def always_go_away(cmd: RemotingCommand, conn: int) -> RemotingCommand:
        return cmd.response_to(ResponseCode.GO_AWAY)

    async with FakeBroker(always_go_away) as broker:
        client = RemotingClient()
        try:
            with pytest.raises(RemotingError, match="GO_AWAY twice") as info:
                await client.invoke(broker.addr,
                                    RemotingCommand.request(RequestCode.HEART_BEAT), 5)
            assert not isinstance(info.value, RemotingTimeout | ConnectionClosed)
            assert broker.connections == 2
        finally:
            await client.close()

    # GO_AWAY after 2 s, then silence on the new connection: the request sent again has
    # the 2 s left of its 4, not 4 more.
    async def slow_go_away_then_silence(cmd: RemotingCommand, conn: int) -> RemotingCommand | None:
        if conn > 0:
            return None
        await asyncio.sleep(2.0)
        return cmd.response_to(ResponseCode.GO_AWAY)

    async with FakeBroker(slow_go_away_then_silence) as broker:
        client = RemotingClient()
        try:
            started = time.monotonic()
            with pytest.raises(RemotingTimeout):
                await client.invoke(broker.addr,
                                    RemotingCommand.request(RequestCode.HEART_BEAT), 4.0)
            assert 3.95 <= time.monotonic() - started < 5.5  # 6 s if given 4 s more
            assert [n for n, _ in broker.received] == [0, 1]
        finally:
            await client.close()


async def test_a_started_request_answered_go_away_leaves_the_others_in_flight() -> None:
    # The pipelined path (pulls): a GO_AWAY answer no longer fails the other pulls on the
    # connection; it closes once they are answered, and close() closes one still waiting.
    async def shutting_down(cmd: RemotingCommand, conn: int) -> RemotingCommand:
        if conn == 0 and (cmd.ext_fields or {}).get("slow"):
            await asyncio.sleep(float((cmd.ext_fields or {})["slow"]))
            return _ok(cmd)
        return cmd.response_to(ResponseCode.GO_AWAY if conn == 0 else ResponseCode.SUCCESS)

    def pull(**ext: str) -> Callable[[], RemotingCommand]:
        return lambda: RemotingCommand.request(RequestCode.PULL_MESSAGE, ext_fields=ext)

    async with FakeBroker(shutting_down) as broker:
        client = RemotingClient()
        try:
            slow = await client.start_invoke(broker.addr, pull(slow="0.3"), 5)
            very_slow = await client.start_invoke(broker.addr, pull(slow="30"), 40)
            gone = await client.start_invoke(broker.addr, pull(), 5)
            assert (await gone).code == ResponseCode.GO_AWAY  # the caller sees the code
            assert (await slow).code == ResponseCode.SUCCESS
            assert not very_slow.done()
            fresh = await client.start_invoke(broker.addr, pull(), 5)
            assert (await fresh).code == ResponseCode.SUCCESS
            assert broker.connections == 2 and broker.closed == []
        finally:
            await client.close()
        with pytest.raises(ConnectionClosed):
            await very_slow
        async with asyncio.timeout(2):
            while sorted(broker.closed) != [0, 1]:
                await asyncio.sleep(0.01)


def _slow_connects(monkeypatch: pytest.MonkeyPatch, seconds: float) -> None:
    """Every connect takes ``seconds`` longer (a lost SYN, a slow TLS handshake)."""
    from rmq_async.remoting import client as client_mod

    real = client_mod.Connection.open

    async def slow_open(*args: object, **kwargs: object) -> Connection:
        await asyncio.sleep(seconds)
        return await real(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(client_mod.Connection, "open", slow_open)


async def test_a_request_the_connect_left_a_sliver_does_not_close_the_connection(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Java's invokeSync rule: a request that timed out after a connect took most of its
    timeout (it had less than 0.1 s and a quarter of it left when sent) leaves the
    connection to the requests sharing it."""
    _slow_connects(monkeypatch, 0.45)

    async def answer(cmd: RemotingCommand, conn: int) -> RemotingCommand | None:
        if cmd.code == RequestCode.HEART_BEAT:
            return None  # never answered: it times out
        await asyncio.sleep(0.2)
        return _ok(cmd)

    async with FakeBroker(answer) as broker:
        client = RemotingClient()
        try:
            beat = client.invoke(broker.addr, RemotingCommand.request(RequestCode.HEART_BEAT),
                                 0.5)
            pulls = [client.invoke(broker.addr,
                                   RemotingCommand.request(RequestCode.PULL_MESSAGE), 5)
                     for _ in range(4)]
            results = await asyncio.gather(beat, *pulls, return_exceptions=True)
        finally:
            await client.close()
    assert isinstance(results[0], RemotingTimeout)
    assert [r.code for r in results[1:]] == [ResponseCode.SUCCESS] * 4  # type: ignore[union-attr]
    assert broker.connections == 1


async def test_a_connection_made_after_every_caller_gave_up_is_still_announced(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The client instance heartbeats on every new connection: one made after its only
    caller timed out is pooled and used by later requests, so it is announced too."""
    from rmq_async.client.instance import _AnnouncingRemoting

    _slow_connects(monkeypatch, 0.3)
    announced: list[str] = []

    async def answer(cmd: RemotingCommand, conn: int) -> RemotingCommand:
        return _ok(cmd)

    async with FakeBroker(answer) as broker:
        addr = broker.addr
        client = _AnnouncingRemoting(on_connect=announced.append)
        try:
            with pytest.raises(RemotingTimeout):
                await client.invoke(broker.addr,
                                    RemotingCommand.request(RequestCode.LOCK_BATCH_MQ), 0.1)
            async with asyncio.timeout(2):
                while not client.addresses:
                    await asyncio.sleep(0.01)
            resp = await client.invoke(broker.addr,
                                       RemotingCommand.request(RequestCode.PULL_MESSAGE), 1)
        finally:
            await client.close()
    assert resp.code == ResponseCode.SUCCESS
    assert announced == [addr]


async def test_close_during_a_new_connect_fails_the_caller_with_connection_closed() -> None:
    """close() ends a connect attempt that has not run a step yet: its caller, which nobody
    cancelled, gets ConnectionClosed, not a CancelledError of its own."""
    async def answer(cmd: RemotingCommand, conn: int) -> RemotingCommand:
        return _ok(cmd)

    async with FakeBroker(answer) as broker:
        client = RemotingClient()
        caller = asyncio.ensure_future(client.connection(broker.addr))
        await asyncio.sleep(0)  # the caller made the attempt and waits for it
        await client.close()
        with pytest.raises(ConnectionClosed):
            await caller
        assert not caller.cancelled()


async def _connected(client: RemotingClient,
                     addr: str) -> tuple[Connection, asyncio.Transport, socket.socket]:
    """The client's connection to ``addr``, its transport and its socket."""
    conn = await client.connection(addr)
    transport = conn._transport
    assert transport is not None
    return conn, transport, transport.get_extra_info("socket")


async def test_a_request_timed_out_on_a_peer_that_stopped_reading_frees_the_socket() -> None:
    """close() after a timeout waited for the write buffer to drain, which a peer that stopped
    reading never does: the socket and megabytes of unsent frames were held for good, one more
    per reconnect-and-time-out."""
    async with silent_listener() as (addr, _):  # it never reads: the frames stay buffered
        client = RemotingClient(connect_timeout=1)
        try:
            conn, _, sock = await _connected(client, addr)
            with pytest.raises(RemotingTimeout):
                await client.invoke(addr, RemotingCommand.request(RequestCode.HEART_BEAT,
                                                                  body=b"x" * 8_000_000), 0.5)
            assert conn.closed
            await wait_until(lambda: sock.fileno() == -1, 2, interval=0.02,
                             what="the socket to close")
            assert addr not in client.addresses
        finally:
            await client.close()


async def test_a_graceful_close_gives_a_peer_that_stopped_reading_a_moment_only(
        monkeypatch: pytest.MonkeyPatch) -> None:
    import rmq_async.remoting.connection as connection_module

    monkeypatch.setattr(connection_module, "CLOSE_FLUSH_GRACE", 0.2)
    async with silent_listener() as (addr, _):
        client = RemotingClient(connect_timeout=1)
        _, transport, sock = await _connected(client, addr)
        await client.invoke_oneway(addr, RemotingCommand.request(RequestCode.HEART_BEAT,
                                                                  body=b"x" * 8_000_000))
        await client.close()
        assert transport.get_write_buffer_size() > 0  # the peer takes nothing
        await wait_until(lambda: sock.fileno() == -1, 2, interval=0.02,
                         what="the socket to close")


async def test_a_connection_its_peer_closed_mid_frame_leaves_the_pool_and_its_buffer() -> None:
    """A dead connection stayed in the pool, its receive buffer grown to the frame cut short,
    until its address was asked for again (never, for a broker no route names any more)."""
    async def on_conn(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        dec = FrameDecoder()
        while data := await reader.read(65536):
            for cmd in dec.feed(data):
                frame = cmd.response_to(ResponseCode.SUCCESS, body=b"m" * 6_000_000).encode()
                writer.write(frame[:4_000_000])  # the broker dies in the middle of an answer
                await writer.drain()
                await asyncio.sleep(0.2)
                writer.transport.abort()
                return

    server = await asyncio.start_server(on_conn, "127.0.0.1", 0)
    host, port = server.sockets[0].getsockname()[:2]
    addr = f"{host}:{port}"
    client = RemotingClient()
    try:
        conn = await client.connection(addr)
        with pytest.raises(ConnectionClosed):
            await client.invoke(addr, RemotingCommand.request(RequestCode.PULL_MESSAGE), 5)
        assert conn.closed and addr not in client._connections
        assert conn._decoder.buffered == 0 and len(conn._decoder._buf) == 0
    finally:
        await client.close()
        server.close()


async def test_an_answer_that_cannot_be_encoded_is_answered_system_error() -> None:
    """A handler's answer whose header cannot be encoded ended the serving task with an
    exception nobody read, and the broker waited for an answer until its timeout."""
    answers: asyncio.Queue[RemotingCommand] = asyncio.Queue()
    connected = asyncio.Event()
    writers: list[asyncio.StreamWriter] = []

    async def on_conn(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writers.append(writer)
        connected.set()
        dec = FrameDecoder()
        while data := await reader.read(65536):
            for cmd in dec.feed(data):
                await answers.put(cmd)

    async def handler(cmd: RemotingCommand, conn: Connection) -> RemotingCommand:
        answer = cmd.response_to(ResponseCode.SUCCESS)
        answer.ext_fields = {"k": object()}  # type: ignore[dict-item]
        return answer

    server = await asyncio.start_server(on_conn, "127.0.0.1", 0)
    host, port = server.sockets[0].getsockname()[:2]
    client = RemotingClient(request_handler=handler)
    try:
        await client.connection(f"{host}:{port}")
        await connected.wait()
        request = RemotingCommand.request(RequestCode.CONSUME_MESSAGE_DIRECTLY)
        writers[0].write(request.encode())
        async with asyncio.timeout(5):
            answer = await answers.get()
        assert answer.opaque == request.opaque and answer.code == ResponseCode.SYSTEM_ERROR
        assert "could not be encoded" in (answer.remark or "")
    finally:
        await client.close()
        for w in writers:
            w.transport.abort()
        server.close()


async def test_answers_that_arrived_before_a_bad_frame_are_delivered() -> None:
    """Two whole answers and a bad frame in one read: the answers were discarded with the
    decoder's failure, and their requests failed as if the connection had dropped."""
    async def on_conn(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        dec = FrameDecoder()
        got: list[RemotingCommand] = []
        while data := await reader.read(65536):
            got.extend(dec.feed(data))
            if len(got) == 3:
                answers = b"".join(c.response_to(ResponseCode.SUCCESS).encode() for c in got[:2])
                writer.write(answers + (2).to_bytes(4, "big"))  # then a length under 4
                await writer.drain()

    server = await asyncio.start_server(on_conn, "127.0.0.1", 0)
    host, port = server.sockets[0].getsockname()[:2]
    addr = f"{host}:{port}"
    client = RemotingClient()
    try:
        calls = [asyncio.ensure_future(client.invoke(
            addr, RemotingCommand.request(RequestCode.HEART_BEAT), 5)) for _ in range(3)]
        results = await asyncio.gather(*calls, return_exceptions=True)
        answered = [r for r in results if isinstance(r, RemotingCommand)]
        failed = [r for r in results if isinstance(r, Exception)]
        assert len(answered) == 2 and all(r.code == ResponseCode.SUCCESS for r in answered)
        assert len(failed) == 1 and isinstance(failed[0], ConnectionClosed)
        assert addr not in client._connections
    finally:
        await client.close()
        server.close()


def test_a_frame_decoder_failure_carries_the_commands_before_it() -> None:
    good = b"".join(RemotingCommand(code=0, opaque=i, flag=1).encode() for i in (1, 2))
    with pytest.raises(ProtocolError, match="bad frame length 2") as failed:
        FrameDecoder().feed(good + (2).to_bytes(4, "big"))
    assert [c.opaque for c in failed.value.decoded] == [1, 2]


async def test_a_graceful_close_whose_buffer_drains_in_time_leaves_no_timer_behind(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The grace timer fired after the transport had closed by itself and failed in the event
    loop ('Exception in callback ... abort()')."""
    import rmq_async.remoting.connection as connection_module

    monkeypatch.setattr(connection_module, "CLOSE_FLUSH_GRACE", 0.5)
    loop = asyncio.get_running_loop()
    errors: list[dict[str, object]] = []
    loop.set_exception_handler(lambda _loop, ctx: errors.append(ctx))

    async def late_reader(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await asyncio.sleep(0.1)
        while await reader.read(1 << 20):
            pass
        writer.close()

    server = await asyncio.start_server(late_reader, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        conn = await Connection.open(f"127.0.0.1:{port}")
        await conn.send_oneway(RemotingCommand.request(RequestCode.HEART_BEAT,
                                                       body=b"x" * (16 << 20)))
        await conn.close()
        await asyncio.sleep(1.0)
        assert conn._flush_timer is None
        assert errors == []
    finally:
        loop.set_exception_handler(None)
        server.close()


async def test_a_request_handler_that_closes_the_client_is_neither_cancelled_nor_waited_for(
) -> None:
    """A CONSUME_MESSAGE_DIRECTLY listener that stops its consumer ends in the client's
    close(), inside the connection's own handler task: each connection's close() ran in a
    task of its own, did not know the handler's task, cancelled it and waited for it, while
    the handler waited for the close (a deadlock; cancelling it recursed)."""
    client = RemotingClient()
    after: list[str] = []

    async def handler(cmd: RemotingCommand, conn: Connection) -> None:
        await client.close()
        await asyncio.sleep(0)  # not cancelled: the rest of the stop goes on
        after.append("closed")

    conn = Connection("10.0.0.1:10911", handler=handler)
    client._connections[conn.addr] = conn
    conn._dispatch_request(RemotingCommand(code=RequestCode.CONSUME_MESSAGE_DIRECTLY))
    await wait_until(lambda: after == ["closed"], 3, what="the handler's close")
    assert conn.closed and not client.addresses


async def test_close_waits_a_bounded_time_for_a_handler_slow_to_end() -> None:
    """A handler (a CONSUME_MESSAGE_DIRECTLY listener) whose clean-up on cancellation is slow,
    or that swallows the cancellation, held close(), and so the consumer's stop(), for as long
    as it took."""
    from rmq_async.remoting.connection import HANDLER_CLOSE_WAIT

    release = asyncio.Event()

    async def handler(cmd: RemotingCommand, conn: Connection) -> None:
        try:
            await asyncio.sleep(1000)
        finally:
            await release.wait()

    conn = Connection("10.0.0.1:10911", handler=handler)
    conn._dispatch_request(RemotingCommand(code=RequestCode.CONSUME_MESSAGE_DIRECTLY))
    await asyncio.sleep(0.05)
    started = time.monotonic()
    with capture_logs() as logs:
        await conn.close()
    assert time.monotonic() - started < HANDLER_CLOSE_WAIT + 1.0
    assert [e["count"] for e in logs if e["event"] == "remoting.handlers_left_running"] == [1]
    release.set()
    await wait_until(lambda: not conn._handler_tasks, 3, what="the handler's end")


async def test_a_close_awaited_from_a_task_of_a_handler_spares_that_handler() -> None:
    """stop() called from a task a handler started and awaits: the close runs outside the
    handler's task, which it is told to spare (the consumer's user call); it cancelled the
    handler, the cancellation reached the awaited close, and the second connection stayed
    open."""
    client = RemotingClient()
    after: list[str] = []

    async def handler(cmd: RemotingCommand, conn: Connection) -> None:
        me = asyncio.current_task()
        await asyncio.create_task(client.close(spare=me))
        after.append("closed")

    one = Connection("10.0.0.1:10911", handler=handler)
    two = Connection("10.0.0.2:10911", handler=handler)
    client._connections[one.addr] = one
    client._connections[two.addr] = two
    one._dispatch_request(RemotingCommand(code=RequestCode.CONSUME_MESSAGE_DIRECTLY))
    await wait_until(lambda: after == ["closed"], 3, what="the handler's close")
    assert one.closed and two.closed

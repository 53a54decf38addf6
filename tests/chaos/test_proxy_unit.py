"""The fault proxy itself, against tiny loopback peers (no broker)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import AsyncIterator

import pytest

from rmq_async.protocol.codes import RequestCode, ResponseCode
from rmq_async.protocol.command import FrameDecoder, RemotingCommand
from rmq_async.remoting.client import RemotingClient
from rmq_async.remoting.errors import ConnectionClosed, RemotingTimeout
from tests.chaos.proxy import FaultProxy
from tests.helpers import wait_until


@contextlib.asynccontextmanager
async def echo_server() -> AsyncIterator[str]:
    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while data := await reader.read(65536):
                writer.write(data)
                await writer.drain()
        except ConnectionError:
            pass
        finally:
            writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    try:
        yield f"127.0.0.1:{server.sockets[0].getsockname()[1]}"
    finally:
        server.close()


@contextlib.asynccontextmanager
async def remoting_server(route_body: bytes = b"") -> AsyncIterator[str]:
    """Answers every request: routes with ``route_body``, anything else with an echo of the
    request body."""
    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        decoder = FrameDecoder()
        try:
            while data := await reader.read(65536):
                for cmd in decoder.feed(data):
                    if cmd.is_oneway:
                        continue
                    body = route_body if cmd.code == RequestCode.GET_ROUTEINFO_BY_TOPIC else cmd.body
                    writer.write(cmd.response_to(ResponseCode.SUCCESS, body=body).encode())
                await writer.drain()
        except ConnectionError:
            pass
        finally:
            writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    try:
        yield f"127.0.0.1:{server.sockets[0].getsockname()[1]}"
    finally:
        server.close()


async def _open(addr: str) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    host, port = addr.rsplit(":", 1)
    return await asyncio.open_connection(host, int(port))


async def _roundtrip(addr: str, payload: bytes) -> bytes:
    reader, writer = await _open(addr)
    try:
        writer.write(payload)
        await writer.drain()
        return await asyncio.wait_for(reader.readexactly(len(payload)), 10)
    finally:
        writer.close()


async def test_transparent_by_default() -> None:
    async with echo_server() as target, FaultProxy(target) as proxy:
        payload = bytes(range(256)) * 1000
        assert await _roundtrip(proxy.addr, payload) == payload
        assert proxy.stats.accepted == 1
        assert proxy.stats.bytes == {"up": len(payload), "down": len(payload)}


async def test_latency_applies_each_way() -> None:
    async with echo_server() as target, FaultProxy(target) as proxy:
        proxy.latency = 0.15
        started = time.monotonic()
        assert await _roundtrip(proxy.addr, b"ping") == b"ping"
        assert time.monotonic() - started >= 0.29


async def test_throttle_limits_the_rate() -> None:
    async with echo_server() as target, FaultProxy(target) as proxy:
        proxy.rate = 100_000
        payload = b"x" * 50_000
        started = time.monotonic()
        assert await _roundtrip(proxy.addr, payload) == payload
        # 50 kB at 100 kB/s is 0.5 s per direction (the two overlap, minus the first chunk).
        assert time.monotonic() - started >= 0.4


async def test_stall_is_half_open_and_new_connections_work() -> None:
    async with echo_server() as target, FaultProxy(target) as proxy:
        reader, writer = await _open(proxy.addr)
        writer.write(b"before")
        assert await reader.readexactly(6) == b"before"
        assert proxy.stall() == 1
        # Writes are accepted (the kernel and the proxy take them), nothing comes back.
        for _ in range(20):
            writer.write(b"y" * 10_000)
            await asyncio.wait_for(writer.drain(), 5)
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(reader.read(1), 0.5)
        assert proxy.stats.dropped["up"] > 0
        # A new connection is not affected.
        assert await _roundtrip(proxy.addr, b"fresh") == b"fresh"
        # Closing the client end of a stalled connection closes its server side too.
        writer.close()
        await wait_until(lambda: proxy.open_connections == 0, 5, what="both sides closed")


async def test_cut_mid_frame_forwards_part_of_one_frame_then_closes() -> None:
    async with remoting_server() as target, FaultProxy(target) as proxy:
        reader, writer = await _open(proxy.addr)
        small = RemotingCommand.request(RequestCode.PULL_MESSAGE, body=b"s" * 10)
        big = RemotingCommand.request(RequestCode.PULL_MESSAGE, body=b"b" * 5000)
        writer.write(small.encode())
        decoder = FrameDecoder()
        got = decoder.feed(await reader.readexactly(len(small.response_to(0, body=small.body)
                                                        .encode())))
        assert [c.opaque for c in got] == [small.opaque]
        cut = asyncio.create_task(proxy.cut_mid_frame("down", min_size=1000))
        await asyncio.sleep(0.05)
        writer.write(small.encode() + big.encode())
        await asyncio.wait_for(cut, 5)
        rest = await asyncio.wait_for(reader.read(), 5)  # up to EOF
        got = decoder.feed(rest)
        # The small answer passed whole, the big one only in part.
        assert [c.opaque for c in got] == [small.opaque]
        assert 0 < decoder.buffered < len(big.response_to(0, body=big.body).encode())
        assert proxy.stats.cuts == 1
        writer.close()


async def test_reset_sends_rst() -> None:
    async with echo_server() as target, FaultProxy(target) as proxy:
        reader, writer = await _open(proxy.addr)
        writer.write(b"a")
        assert await reader.readexactly(1) == b"a"
        assert await proxy.reset() == 1
        with pytest.raises(ConnectionResetError):
            await asyncio.wait_for(reader.read(10), 5)
        writer.close()


async def test_route_answers_are_rewritten() -> None:
    real, fake = "127.0.0.1:10911", "127.0.0.1:40001"
    route = {"brokerDatas": [{"brokerName": "b", "cluster": "c",
                              "brokerAddrs": {"0": real}}], "queueDatas": []}
    body = json.dumps(route).encode()
    async with remoting_server(body) as target, FaultProxy(target, rewrite={real: fake}) as proxy:
        async with RemotingClient() as client:
            for st in (0, 1):  # JSON and ROCKETMQ headers
                cmd = RemotingCommand.request(RequestCode.GET_ROUTEINFO_BY_TOPIC,
                                              {"topic": "T"}, serialize_type=st)
                answer = await client.invoke(proxy.addr, cmd, 5)
                assert json.loads(answer.body)["brokerDatas"][0]["brokerAddrs"] == {"0": fake}
                # Other answers are left alone, even when they mention the address.
                echo = RemotingCommand.request(RequestCode.PULL_MESSAGE, body=real.encode())
                assert (await client.invoke(proxy.addr, echo, 5)).body == real.encode()
        assert proxy.stats.rewrites == 2


async def test_remoting_client_replaces_a_stalled_connection() -> None:
    """What the consumer relies on: a request on a half-open connection times out, the
    connection is closed, and the next request opens a new one that works."""
    async with remoting_server() as target, FaultProxy(target) as proxy, RemotingClient() as client:
        ping = RemotingCommand.request(RequestCode.PULL_MESSAGE, body=b"1")
        assert (await client.invoke(proxy.addr, ping, 5)).body == b"1"
        proxy.stall()
        started = time.monotonic()
        with pytest.raises(RemotingTimeout):
            await client.invoke(proxy.addr, RemotingCommand.request(
                RequestCode.PULL_MESSAGE, body=b"2"), 0.5)
        assert time.monotonic() - started < 3.0
        again = RemotingCommand.request(RequestCode.PULL_MESSAGE, body=b"3")
        assert (await client.invoke(proxy.addr, again, 5)).body == b"3"
        assert proxy.stats.accepted == 2


async def test_remoting_client_survives_cut_and_reset() -> None:
    async with remoting_server() as target, FaultProxy(target) as proxy, RemotingClient() as client:
        big = RemotingCommand.request(RequestCode.PULL_MESSAGE, body=b"z" * 4000)
        cut = asyncio.create_task(proxy.cut_mid_frame("down", min_size=1000))
        await asyncio.sleep(0.05)
        with pytest.raises(ConnectionClosed):
            await client.invoke(proxy.addr, big, 5)
        await cut
        ok = RemotingCommand.request(RequestCode.PULL_MESSAGE, body=b"ok")
        assert (await client.invoke(proxy.addr, ok, 5)).body == b"ok"
        await proxy.reset()
        await wait_until(lambda: proxy.addr not in client.addresses, 5, what="the reset seen")
        ok2 = RemotingCommand.request(RequestCode.PULL_MESSAGE, body=b"ok2")
        assert (await client.invoke(proxy.addr, ok2, 5)).body == b"ok2"

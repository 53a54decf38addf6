"""A client instance sends a heartbeat on every new broker connection (Java's
onChannelActive), so a broker that forgot the client with its old connection knows it again
before the next pull, not up to ``heartbeat_interval`` later."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import pytest

from rmq_async.client.instance import ClientInstance, _BrokerAddrs
from rmq_async.protocol.bodies import HeartbeatData
from rmq_async.protocol.codes import LanguageCode, RequestCode, ResponseCode
from rmq_async.protocol.command import FrameDecoder, RemotingCommand
from rmq_async.remoting.errors import RemotingError


class FakeBroker:
    def __init__(self) -> None:
        self.codes: list[int] = []
        self.languages: list[int] = []  # of the heartbeats
        self.writers: list[asyncio.StreamWriter] = []

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.writers.append(writer)
        decoder = FrameDecoder()
        try:
            while data := await reader.read(65536):
                for cmd in decoder.feed(data):
                    self.codes.append(cmd.code)
                    if cmd.code == RequestCode.HEART_BEAT:
                        self.languages.append(cmd.language)
                    if not cmd.is_oneway:
                        writer.write(cmd.response_to(ResponseCode.SUCCESS).encode())
        except ConnectionError:
            pass
        finally:
            writer.close()

    def heartbeats(self) -> int:
        return self.codes.count(RequestCode.HEART_BEAT)


@contextlib.asynccontextmanager
async def fake_broker() -> AsyncIterator[tuple[FakeBroker, str]]:
    broker = FakeBroker()
    server = await asyncio.start_server(broker.handle, "127.0.0.1", 0)
    try:
        yield broker, f"127.0.0.1:{server.sockets[0].getsockname()[1]}"
    finally:
        server.close()


async def _wait(predicate: object, timeout: float = 5.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not predicate():  # type: ignore[operator]
        assert asyncio.get_running_loop().time() < deadline, "timed out"
        await asyncio.sleep(0.01)


async def test_heartbeat_on_every_new_broker_connection() -> None:
    async with fake_broker() as (broker, addr):
        instance = ClientInstance("127.0.0.1:1", "cid@test",
                                  heartbeat_source=lambda: HeartbeatData(client_id="cid@test"))
        instance.brokers["b"] = _BrokerAddrs("c", {0: addr})
        try:
            ping = RemotingCommand.request(RequestCode.GET_MAX_OFFSET, {"topic": "T"})
            await instance.remoting.invoke(addr, ping, 3)
            await _wait(lambda: broker.heartbeats() == 1)
            # More requests on the same connection: no more heartbeats.
            for _ in range(3):
                await instance.remoting.invoke(
                    addr, RemotingCommand.request(RequestCode.GET_MAX_OFFSET, {}), 3)
            await asyncio.sleep(0.05)
            assert broker.heartbeats() == 1
            # The broker drops the connection; the next request reconnects and re-registers.
            broker.writers[-1].transport.abort()
            await _wait(lambda: not instance.remoting.addresses)
            await instance.remoting.invoke(
                addr, RemotingCommand.request(RequestCode.GET_MAX_OFFSET, {}), 3)
            await _wait(lambda: broker.heartbeats() == 2)
        finally:
            await instance.close()


async def test_no_heartbeat_to_name_servers_or_without_a_source() -> None:
    async with fake_broker() as (server, addr):
        # An address that is no broker of any route (a name server): nothing sent.
        instance = ClientInstance(addr, "cid@test",
                                  heartbeat_source=lambda: HeartbeatData(client_id="cid@test"))
        try:
            await instance.remoting.invoke(
                addr, RemotingCommand.request(RequestCode.GET_MAX_OFFSET, {}), 3)
            await asyncio.sleep(0.05)
            assert server.heartbeats() == 0
        finally:
            await instance.close()
        # A producer-less, consumer-less instance (no heartbeat source): nothing sent.
        bare = ClientInstance(addr, "cid@bare")
        bare.brokers["b"] = _BrokerAddrs("c", {0: addr})
        try:
            await bare.remoting.invoke(
                addr, RemotingCommand.request(RequestCode.GET_MAX_OFFSET, {}), 3)
            await asyncio.sleep(0.05)
            assert server.heartbeats() == 0
        finally:
            await bare.close()


async def test_a_broker_shutting_down_gets_no_chain_of_connections() -> None:
    """A 5.x broker shutting down answers GO_AWAY to every new request. The heartbeat on a
    new connection is not sent again on another one: otherwise that connection's own
    heartbeat, answered GO_AWAY too, would make the next, and so on (hundreds a second)."""
    from tests.fake_broker import FakeBroker as ScriptedBroker

    async def going_away(cmd: RemotingCommand, conn: int) -> RemotingCommand:
        return cmd.response_to(ResponseCode.GO_AWAY)

    async with ScriptedBroker(going_away) as broker:
        addr = broker.addr
        instance = ClientInstance("127.0.0.1:1", "cid@test",
                                  heartbeat_source=lambda: HeartbeatData(client_id="cid@test"))
        instance.brokers["b"] = _BrokerAddrs("c", {0: addr})
        try:
            with pytest.raises(RemotingError, match="GO_AWAY twice"):
                await instance.remoting.invoke(
                    addr, RemotingCommand.request(RequestCode.GET_MAX_OFFSET, {}), 3)
            await asyncio.sleep(0.5)
            # The request's two connections, each with its one heartbeat, answered GO_AWAY.
            assert broker.connections <= 3, broker.connections
            assert broker.codes().count(RequestCode.HEART_BEAT) <= 3
        finally:
            await instance.close()


async def test_heartbeats_carry_the_configured_language() -> None:
    # Java sets ClientConfig.language on HEART_BEAT; the broker records it per client.
    async with fake_broker() as (broker, addr):
        for language in (LanguageCode.JAVA, LanguageCode.PYTHON):
            kwargs = {} if language is LanguageCode.PYTHON else {"language": language}
            instance = ClientInstance(
                "127.0.0.1:1", "cid@test",
                heartbeat_source=lambda: HeartbeatData(client_id="cid@test"), **kwargs)
            instance.brokers["b"] = _BrokerAddrs("c", {0: addr})
            broker.languages.clear()
            try:
                assert await instance.send_heartbeats() == {addr: True}  # and on connecting
                await _wait(lambda: len(broker.languages) == 2)
                assert broker.languages == [language, language]
            finally:
                await instance.close()


async def test_a_consumer_gives_its_client_the_api_timeout_and_language(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from rmq_async.consumer import push

    seen: list[dict[str, object]] = []

    class Refused(Exception):
        pass

    def recording(*args: object, **kwargs: object) -> ClientInstance:
        seen.append(kwargs)
        raise Refused

    monkeypatch.setattr(push, "ClientInstance", recording)
    consumer = push.PushConsumer("g_opts", "127.0.0.1:1", api_timeout=7.5, language="go")
    consumer.subscribe("T", listener=_noop)
    with pytest.raises(Refused):
        await consumer.start()
    assert seen and seen[0]["api_timeout"] == 7.5
    assert seen[0]["language"] is LanguageCode.GO


async def _noop(msg: object) -> None:
    return None

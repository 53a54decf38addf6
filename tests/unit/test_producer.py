"""Producer without a broker: queue selection over several broker groups, retries on another
broker, compression types, credentials and TLS options; and, against loopback fakes, the faults
a real broker cannot produce on demand (slow answers past the send timeout, GO_AWAY,
SYSTEM_BUSY, a broker that moved, a connect that hangs)."""

from __future__ import annotations

import asyncio
import itertools
import ssl
import time
from pathlib import Path
from typing import Any

import pytest
from structlog.testing import capture_logs

from rmq_async import (
    ConnectionLostInFlight,
    Message,
    Producer,
    RemotingConnectError,
    RemotingTimeout,
    TlsVerificationError,
)
from rmq_async.client.api import MQClientAPI, SendResult
from rmq_async.client.errors import MQBrokerError, NoPermissionError
from rmq_async.consumer.options import ConsumerOptions, Credentials, InvalidOptionError
from rmq_async.errors import IllegalStateError, InvalidArgumentError
from rmq_async.producer import select_queue
from rmq_async.protocol.codes import (
    MSG_COMPRESSED_FLAG,
    MessageSysFlag,
    RequestCode,
    ResponseCode,
)
from rmq_async.protocol.command import RemotingCommand
from rmq_async.protocol.message import decode_messages, decode_properties, encode_stored_message
from rmq_async.protocol.types import PROPERTY_UNIQ_KEY, PROPERTY_WAIT, MessageExt, MessageQueue
from tests.fake_broker import FakeBroker, route_answer, send_ok, silent_listener, uniq_key

# Java's order of a route with two groups of 4 writable queues: by broker name, then queue id.
QUEUES = [MessageQueue("T", b, i) for b in ("broker-a", "broker-b") for i in range(4)]


def test_round_robin_covers_every_queue_of_every_group() -> None:
    counter = itertools.count()
    picked = [select_queue(QUEUES, counter, None) for _ in range(16)]
    assert picked == QUEUES + QUEUES


def test_retry_moves_to_another_broker() -> None:
    # The first attempt went to broker-a queue 1; the retry skips broker-a's queues 2 and 3.
    counter = itertools.count(2)
    assert select_queue(QUEUES, counter, "broker-a") == MessageQueue("T", "broker-b", 0)
    # ... and from broker-b, the next one in turn on broker-a.
    counter = itertools.count(5)
    assert select_queue(QUEUES, counter, "broker-b") == MessageQueue("T", "broker-a", 0)


def test_retry_with_one_broker_takes_the_next_queue() -> None:
    only_a = QUEUES[:4]
    counter = itertools.count(0)
    assert select_queue(only_a, counter, "broker-a") == only_a[0]  # after len(queues) tries
    assert next(counter) == 5


class _FakeApi:
    def __init__(self, fail: dict[str, Exception]) -> None:
        self.fail = fail
        self.sent: list[tuple[str, MessageQueue, int, bytes]] = []
        self.calls: list[dict[str, Any]] = []

    async def send_message(self, addr: str, mq: MessageQueue, **kw: Any) -> SendResult:
        self.sent.append((addr, mq, kw["sys_flag"], kw["body"]))
        self.calls.append(kw)
        exc = self.fail.get(mq.broker_name)
        if exc is not None:
            raise exc
        return SendResult("ID", mq.queue_id, 7, mq.broker_name, 0)


def _fake_producer(fail: dict[str, Exception], **options: Any) -> tuple[Producer, _FakeApi]:
    producer = Producer("PG_unit", "127.0.0.1:1", **options)
    api = _FakeApi(fail)

    async def publish_queues(topic: str) -> list[MessageQueue]:
        return QUEUES

    async def find_broker_master(broker_name: str, topic: str | None = None) -> str:
        return {"broker-a": "10.0.0.1:10911", "broker-b": "10.0.0.2:10911"}[broker_name]

    producer.instance.publish_queues = publish_queues  # type: ignore[method-assign]
    producer.instance.find_broker_master = find_broker_master  # type: ignore[method-assign]
    producer.instance.api = api  # type: ignore[assignment]
    return producer, api


async def test_send_failure_retries_on_the_other_broker() -> None:
    producer, api = _fake_producer({"broker-a": RemotingConnectError("refused", addr="a")})
    producer._counters["T"] = itertools.count(0)
    results = [await producer.send(Message("T", b"x")) for _ in range(8)]
    assert {r.broker_name for r in results} == {"broker-b"}
    # The sends that picked broker-a (index 0, then index 8 after the skipped ones) were each
    # retried once, on broker-b's first queue in turn; the others went round broker-b.
    sent = [(mq.broker_name, mq.queue_id) for _, mq, _, _ in api.sent]
    assert sent == [("broker-a", 0), ("broker-b", 0), ("broker-b", 1), ("broker-b", 2),
                    ("broker-b", 3), ("broker-a", 0), ("broker-b", 0), ("broker-b", 1),
                    ("broker-b", 2), ("broker-b", 3)]


async def test_send_gives_up_after_retry_times_and_raises_the_last_error() -> None:
    denied = NoPermissionError(ResponseCode.NO_PERMISSION, "no permission", addr="x")
    producer, api = _fake_producer({"broker-a": denied, "broker-b": denied})
    with pytest.raises(NoPermissionError, match="producer group 'PG_unit', topic 'T', no credentials"):
        await producer.send(Message("T", b"x"))
    assert len(api.sent) == 3  # 1 + retry_times_when_send_failed
    assert len({mq.broker_name for _, mq, _, _ in api.sent[:2]}) == 2


async def test_final_broker_answers_and_tls_refusals_are_not_retried() -> None:
    final = MQBrokerError(ResponseCode.MESSAGE_ILLEGAL, "bad message")
    producer, api = _fake_producer({"broker-a": final, "broker-b": final})
    with pytest.raises(MQBrokerError):
        await producer.send(Message("T", b"x"))
    assert len(api.sent) == 1
    refused = TlsVerificationError("certificate refused", addr="a")
    producer, api = _fake_producer({"broker-a": refused, "broker-b": refused})
    with pytest.raises(TlsVerificationError):
        await producer.send(Message("T", b"x"))
    assert len(api.sent) == 1


@pytest.mark.parametrize(("ctype", "bits"), [
    ("ZLIB", MessageSysFlag.COMPRESSION_ZLIB_TYPE), ("lz4", MessageSysFlag.COMPRESSION_LZ4_TYPE),
    ("ZSTD", MessageSysFlag.COMPRESSION_ZSTD_TYPE)])
async def test_compress_type(ctype: str, bits: int) -> None:
    producer, api = _fake_producer({}, compress_type=ctype)
    body = b"compressible " * 10_000  # over 64 KiB: compressed in a worker thread
    await producer.send(Message("T", body))
    await producer.send(Message("T", b"small"))
    (_, _, flag, stored), (_, _, small_flag, _) = api.sent
    assert flag == MSG_COMPRESSED_FLAG | bits and len(stored) < len(body)
    assert small_flag == 0
    record = encode_stored_message(MessageExt(topic="T", body=stored, sys_flag=flag))
    assert decode_messages(record)[0].body == body


def test_options_are_checked() -> None:
    with pytest.raises(InvalidOptionError, match="compress_type"):
        Producer("PG", "127.0.0.1:1", compress_type="SNAPPY")
    with pytest.raises(InvalidOptionError, match="tls_verify"):
        Producer("PG", "127.0.0.1:1", tls_verify=False)
    with pytest.raises(InvalidOptionError, match="ssl_context"):
        Producer("PG", "127.0.0.1:1", ssl_context=ssl.create_default_context(), tls_verify=False)
    with pytest.raises(InvalidOptionError, match="tls_ca_file"):
        Producer("PG", "127.0.0.1:1", tls_ca_file="/nonexistent/ca.pem")
    with pytest.raises(InvalidOptionError, match="credentials"):
        Producer("PG", "127.0.0.1:1", credentials=("only-a-key",))
    with pytest.raises(InvalidOptionError, match="unknown producer option"):
        Producer("PG", "127.0.0.1:1", compres_type="LZ4")


def test_the_client_id_and_the_message_ids_carry_this_hosts_address() -> None:
    # Java: clientIP in the client id, UtilAll.getIP() in the message ids (the clock-derived
    # stand-in only when no address is found); both the consumer's choice of address here.
    from rmq_async.consumer.options import default_client_ip

    producer = Producer("PG", "127.0.0.1:1", instance_name="orders-1")
    assert producer.client_id == f"{default_client_ip()}@orders-1"
    chosen = Producer("PG", "127.0.0.1:1", instance_name="orders-1", client_ip="10.1.2.3")
    assert chosen.client_id == "10.1.2.3@orders-1"
    assert chosen._uniq.next_id().startswith("0A010203")
    named = Producer("PG", "127.0.0.1:1", client_ip="host-a")  # no address: the stand-in
    assert named.client_id.startswith("host-a@") and len(named._uniq.next_id()) == 32
    with pytest.raises(InvalidOptionError, match="client_ip"):
        Producer("PG", "127.0.0.1:1", client_ip=" ")


def test_credentials_sign_every_request() -> None:
    producer = Producer("PG", "127.0.0.1:1", credentials=("ak", "secret-1"))
    hook = producer.instance.remoting.rpc_hook
    assert hook is not None

    class Cmd:
        ext_fields: dict[str, str] | None = {"topic": "T"}
        body = b"payload"

    cmd = Cmd()
    hook(cmd)
    fields = dict(cmd.ext_fields or {})
    assert fields["AccessKey"] == "ak"
    assert fields["Signature"] == Credentials("ak", "secret-1").signature(
        {"topic": "T", "AccessKey": "ak"}, b"payload")
    assert Producer("PG", "127.0.0.1:1").instance.remoting.rpc_hook is None


def _ca_file(tmp_path: Path) -> Path:
    from tests.tls_certs import make_ca

    ca = make_ca("unit test CA")
    path = tmp_path / "ca.pem"
    path.write_bytes(ca.cert_pem)
    return path


@pytest.mark.parametrize("kind", ["producer", "consumer"])
def test_tls_verifies_by_default_and_warns_once_when_told_not_to(kind: str, tmp_path: Path) -> None:
    def context(**options: Any) -> ssl.SSLContext | None:
        if kind == "producer":
            ctx = Producer("PG", "127.0.0.1:1", **options).instance.remoting.ssl
            return ctx
        return ConsumerOptions("G", **options).client_ssl_context("client-1")

    with capture_logs() as logs:
        assert context() is None
        strict = context(tls=True)
        assert strict is not None
        assert strict.verify_mode == ssl.CERT_REQUIRED and strict.check_hostname
        ca = context(tls_ca_file=_ca_file(tmp_path))  # implies tls
        assert ca is not None and ca.verify_mode == ssl.CERT_REQUIRED and ca.check_hostname
        assert len(ca.get_ca_certs()) == 1
        assert not [e for e in logs if e["event"] == "tls.verification_disabled"]
        loose = context(tls=True, tls_verify=False)
        assert loose is not None and loose.verify_mode == ssl.CERT_NONE
    warnings = [e for e in logs if e["event"] == "tls.verification_disabled"]
    assert len(warnings) == 1 and warnings[0]["log_level"] == "warning"


# ---------------------------------------------------------------- retried answers, ids


@pytest.mark.parametrize("code", [ResponseCode.SYSTEM_BUSY, ResponseCode.GO_AWAY])
async def test_system_busy_and_go_away_are_retried_on_another_broker(code: int) -> None:
    # Java 5.3.3's retryResponseCodes: a broker in flow control or shutting down.
    producer, api = _fake_producer({"broker-a": MQBrokerError(code, "busy or going away")})
    producer._counters["T"] = itertools.count(0)
    result = await producer.send(Message("T", b"x"))
    assert result.broker_name == "broker-b"
    assert [mq.broker_name for _, mq, _, _ in api.sent] == ["broker-a", "broker-b"]


async def test_the_message_ids_go_with_the_request() -> None:
    # msg_id is the UNIQ_KEY the producer put in the message (a batch: each message's,
    # comma-joined), the same on every attempt; one the caller set is kept.
    producer, api = _fake_producer({"broker-a": RemotingConnectError("refused", addr="a")})
    producer._counters["T"] = itertools.count(0)
    await producer.send(Message("T", b"x"))
    first, retry = api.calls
    sent_key = decode_properties(first["properties"])[PROPERTY_UNIQ_KEY]
    assert first["msg_id"] == retry["msg_id"] == sent_key and len(sent_key) == 32
    api.calls.clear()
    await producer.send(Message("T", b"x", properties={PROPERTY_UNIQ_KEY: "MY-ID"}))
    assert api.calls[-1]["msg_id"] == "MY-ID"
    await producer.send_batch([Message("T", b"1"), Message("T", b"2", properties={
        PROPERTY_UNIQ_KEY: "MINE"})])
    ids = api.calls[-1]["msg_id"].split(",")
    assert len(ids) == 2 and len(ids[0]) == 32 and ids[1] == "MINE"
    body = api.calls[-1]["body"]  # each message of the batch carries its own id
    assert f"{PROPERTY_UNIQ_KEY}\x01{ids[0]}".encode() in body
    assert body.index(ids[0].encode()) < body.index(b"MINE")


async def test_send_result_has_the_message_id_and_the_brokers_offset_id() -> None:
    # Java's SendResult: msgId is the producer's id, offsetMsgId the broker's (a batch: one
    # per message, comma-joined).
    class Remoting:
        async def invoke(self, addr: str, req: RemotingCommand, timeout: float,
                         **kwargs: Any) -> RemotingCommand:
            return send_ok(req, offset_msg_id="0A00000100002A9F0000000000000010,"
                                              "0A00000100002A9F0000000000000050")

    api = MQClientAPI(Remoting())  # type: ignore[arg-type]
    mq = MessageQueue("T", "broker-a", 1)
    r = await api.send_message("a:1", mq, producer_group="PG", body=b"...", properties="",
                               batch=True, msg_id="K1,K2")
    assert r.msg_id == "K1,K2"
    assert r.offset_msg_id == "0A00000100002A9F0000000000000010,0A00000100002A9F0000000000000050"
    # Without the producer's id, msg_id stays the broker's, as before.
    r = await api.send_message("a:1", mq, producer_group="PG", body=b"...", properties="")
    assert r.msg_id == r.offset_msg_id != ""


# ---------------------------------------------------------------- one send_timeout (fakes)


def _route_to(producer: Producer, addrs: dict[str, str]) -> None:
    """Route topic T over ``addrs`` (broker name -> address), one queue each, broker-a first."""
    queues = [MessageQueue("T", name, 0) for name in addrs]

    async def publish_queues(topic: str) -> list[MessageQueue]:
        return queues

    async def find_broker_master(broker_name: str, topic: str | None = None) -> str:
        return addrs[broker_name]

    producer.instance.publish_queues = publish_queues  # type: ignore[method-assign]
    producer.instance.find_broker_master = find_broker_master  # type: ignore[method-assign]
    producer._counters["T"] = itertools.count(0)


def _slow(seconds: float, code: int = ResponseCode.SUCCESS) -> Any:
    async def answer(cmd: RemotingCommand, conn: int) -> RemotingCommand:
        await asyncio.sleep(seconds)
        return send_ok(cmd) if code == ResponseCode.SUCCESS else cmd.response_to(code, "no")
    return answer


async def test_a_send_that_timed_out_is_not_sent_again() -> None:
    # Both brokers store the message but answer after 1.5 s; send_timeout is 1 s for the
    # whole send: it fails after 1 s, and the message went out once (a retry would store
    # a second copy; Java gives all attempts one budget).
    async with FakeBroker(_slow(1.5)) as a, FakeBroker(_slow(1.5)) as b:
        producer = Producer("PG", "127.0.0.1:1", send_timeout=1.0)
        _route_to(producer, {"broker-a": a.addr, "broker-b": b.addr})
        try:
            started = time.monotonic()
            with pytest.raises(RemotingTimeout, match="send_timeout"):
                await producer.send(Message("T", b"x"))
            assert time.monotonic() - started < 2.5  # three full timeouts were 3 s
            await asyncio.sleep(0.1)
            assert len(a.received) + len(b.received) == 1
        finally:
            await producer.stop()


async def test_a_send_whose_connection_died_after_it_went_out_is_not_sent_again() -> None:
    # broker-a reads the request and resets the connection without an answer (it may have
    # stored the message); a retry on broker-b would store a second copy.
    brokers: dict[str, FakeBroker] = {}

    async def reset(cmd: RemotingCommand, conn: int) -> RemotingCommand | None:
        brokers["a"]._writers[conn].transport.abort()
        return None

    async with FakeBroker(reset) as a, FakeBroker(_slow(0)) as b:
        brokers["a"] = a
        producer = Producer("PG", "127.0.0.1:1", send_timeout=3.0)
        _route_to(producer, {"broker-a": a.addr, "broker-b": b.addr})
        try:
            with pytest.raises(ConnectionLostInFlight):
                await producer.send(Message("T", b"x"))
            await asyncio.sleep(0.1)
            assert len(a.received) == 1 and b.received == []
            # A connection that could not be made is no such doubt: retried on broker-b.
            _route_to(producer, {"broker-a": "127.0.0.1:1", "broker-b": b.addr})
            result = await producer.send(Message("T", b"y"))
            assert result.broker_name == "broker-b"
        finally:
            await producer.stop()


async def test_a_retry_has_what_the_failed_attempt_left() -> None:
    # broker-a answers SYSTEM_ERROR (retried) after 0.5 s; broker-b would answer after
    # 0.8 s, but only 0.5 s of send_timeout are left (the margins leave a loaded machine
    # time to make the retry at all).
    async with (FakeBroker(_slow(0.5, ResponseCode.SYSTEM_ERROR)) as a,
                FakeBroker(_slow(0.8)) as b):
        producer = Producer("PG", "127.0.0.1:1", send_timeout=1.0)
        _route_to(producer, {"broker-a": a.addr, "broker-b": b.addr})
        try:
            started = time.monotonic()
            with pytest.raises(RemotingTimeout):
                await producer.send(Message("T", b"x"))
            assert time.monotonic() - started < 1.7  # a fresh 1.0 s would have succeeded
            assert len(a.received) == len(b.received) == 1
        finally:
            await producer.stop()


async def test_the_route_lookup_is_inside_send_timeout() -> None:
    # The name server answers after 0.2 s, the broker after 0.2 s more: 0.4 s > send_timeout.
    async with FakeBroker(_slow(0.2)) as broker:
        async def namesrv(cmd: RemotingCommand, conn: int) -> RemotingCommand:
            await asyncio.sleep(0.2)
            return route_answer(cmd, {"broker-a": broker.addr})

        async with FakeBroker(namesrv) as ns:
            producer = Producer("PG", ns.addr, send_timeout=0.3)
            try:
                started = time.monotonic()
                with pytest.raises(RemotingTimeout):
                    await producer.send(Message("T", b"x"))
                assert time.monotonic() - started < 1.5
            finally:
                await producer.stop()


async def test_a_connect_that_hangs_is_inside_send_timeout() -> None:
    # Connecting to broker-a hangs (TLS handshake never answered; connect_timeout is 3 s):
    # the send fails when its 0.3 s are up, not after 3 s per attempt.
    async with silent_listener() as (addr, accepted):
        producer = Producer("PG", "127.0.0.1:1", send_timeout=0.3, tls=True, tls_verify=False)
        _route_to(producer, {"broker-a": addr})
        try:
            started = time.monotonic()
            with pytest.raises(RemotingTimeout):
                await producer.send(Message("T", b"x"))
            assert time.monotonic() - started < 2.5  # 3 s per attempt otherwise
            assert len(accepted) == 1
        finally:
            await producer.stop()


async def test_go_away_spares_the_send_in_flight_and_moves_the_next_one() -> None:
    # broker-a starts shutting down while it still works on send A: A's answer comes on the
    # old connection (A is stored once, not also re-sent to broker-b); send B, answered
    # GO_AWAY on the old connection and on a new one, is retried on broker-b.
    taken = asyncio.Event()
    stored: dict[str, list[str | None]] = {"broker-a": [], "broker-b": []}

    async def shutting_down(cmd: RemotingCommand, conn: int) -> RemotingCommand:
        if not taken.is_set():
            taken.set()
            stored["broker-a"].append(uniq_key(cmd))
            await asyncio.sleep(0.3)
            return send_ok(cmd)
        return cmd.response_to(ResponseCode.GO_AWAY, "please go away")

    async def healthy(cmd: RemotingCommand, conn: int) -> RemotingCommand:
        stored["broker-b"].append(uniq_key(cmd))
        return send_ok(cmd)

    async with FakeBroker(shutting_down) as a, FakeBroker(healthy) as b:
        producer = Producer("PG", "127.0.0.1:1")
        _route_to(producer, {"broker-a": a.addr, "broker-b": b.addr})
        try:
            send_a = asyncio.ensure_future(producer.send(Message("T", b"A")))
            await taken.wait()
            producer._counters["T"] = itertools.count(0)  # B to broker-a too
            result_b = await producer.send(Message("T", b"B"))
            result_a = await send_a
            assert (result_a.broker_name, result_b.broker_name) == ("broker-a", "broker-b")
            assert stored == {"broker-a": [result_a.msg_id], "broker-b": [result_b.msg_id]}
        finally:
            await producer.stop()


# ---------------------------------------------------------------- start, stop, routes


async def test_routes_are_refreshed_while_started() -> None:
    # broker-a restarts at another address; the name server knows it. The refresh started by
    # start() (every route_refresh_interval) finds it; stop() ends the refresh.
    async def ok(cmd: RemotingCommand, conn: int) -> RemotingCommand:
        return send_ok(cmd)

    where: dict[str, str] = {}

    async def namesrv(cmd: RemotingCommand, conn: int) -> RemotingCommand:
        assert cmd.code == RequestCode.GET_ROUTEINFO_BY_TOPIC
        return route_answer(cmd, where)

    async with FakeBroker(namesrv) as ns, FakeBroker(ok) as old, FakeBroker(ok) as new:
        producer = Producer("PG", ns.addr, send_timeout=1.0, route_refresh_interval=0.1)
        where["broker-a"] = old.addr
        await producer.start()
        try:
            assert (await producer.send(Message("T", b"x"))).broker_name == "broker-a"
            await old.aclose()
            where["broker-a"] = new.addr
            async with asyncio.timeout(3):
                while True:
                    try:
                        result = await producer.send(Message("T", b"x"))
                        break
                    except RemotingConnectError:  # the old address, until the refresh
                        await asyncio.sleep(0.05)
            assert result.broker_name == "broker-a"
            assert new.codes().count(RequestCode.SEND_MESSAGE_V2) == 1
            refresh = [t for t in asyncio.all_tasks() if t.get_name() == "producer[PG]:route-refresh"]
            assert len(refresh) == 1
        finally:
            await producer.stop()
        assert refresh[0].done()
        with pytest.raises(IllegalStateError):
            await producer.start()


async def test_stop_without_start_closes_the_connections() -> None:
    # send() works without start(); stop() must close what it opened all the same.
    async with silent_listener() as (addr, _):
        producer = Producer("PG", "127.0.0.1:1")
        conn = await producer.instance.remoting.connection(addr)
        await producer.stop()
        assert conn.closed and producer.instance.remoting.addresses == []


async def test_a_start_while_stop_runs_starts_nothing() -> None:
    """start() awaited while stop() waits for its tasks must not start a route refresh that
    outlives the closed client."""
    producer = Producer("PG", "127.0.0.1:1")
    await producer.start()
    stopping = asyncio.ensure_future(producer.stop())
    await asyncio.sleep(0)  # stop() now waits for the route refresh to end
    with pytest.raises(IllegalStateError):
        await producer.start()
    await stopping
    assert not [t for t in asyncio.all_tasks() if t.get_name().endswith("route-refresh")]


def test_route_refresh_interval_option() -> None:
    from datetime import timedelta

    assert Producer("PG", "127.0.0.1:1").options.route_refresh_interval == 30.0
    p = Producer("PG", "127.0.0.1:1", route_refresh_interval=timedelta(seconds=5))
    assert p.options.route_refresh_interval == 5.0
    with pytest.raises(InvalidOptionError, match="route_refresh_interval"):
        Producer("PG", "127.0.0.1:1", route_refresh_interval=0)


def _master_and_slave_route(cmd: RemotingCommand, master: str, slave: str) -> RemotingCommand:
    from rmq_async.protocol.bodies import BrokerData, QueueData, TopicRouteData

    route = TopicRouteData(queue_datas=[QueueData("broker-a", 2, 2, perm=6)],
                           broker_datas=[BrokerData("DefaultCluster", "broker-a",
                                                    {0: master, 1: slave})])
    return cmd.response_to(ResponseCode.SUCCESS, body=route.to_json_bytes())


async def test_a_started_producer_heartbeats_its_group_to_the_masters_and_unregisters() -> None:
    """As Java's producer: its group goes to each master broker on connecting and every
    ``heartbeat_interval`` (never to a slave: a producer has nothing to say to one), and
    ``stop()`` ends the heartbeats and sends UNREGISTER_CLIENT for the group."""
    import json

    async def broker(cmd: RemotingCommand, conn: int) -> RemotingCommand:
        if cmd.code == RequestCode.SEND_MESSAGE_V2:
            return send_ok(cmd)
        return cmd.response_to(ResponseCode.SUCCESS)

    addrs: dict[str, str] = {}

    async def namesrv(cmd: RemotingCommand, conn: int) -> RemotingCommand:
        return _master_and_slave_route(cmd, addrs["master"], addrs["slave"])

    async with FakeBroker(namesrv) as ns, FakeBroker(broker) as master, \
            FakeBroker(broker) as slave:
        addrs.update(master=master.addr, slave=slave.addr)
        producer = Producer("PG", ns.addr, heartbeat_interval=0.05)
        await producer.start()
        try:
            await producer.send(Message("T", b"x"))
            async with asyncio.timeout(3):
                while master.codes().count(RequestCode.HEART_BEAT) < 3:
                    await asyncio.sleep(0.01)
            beats = [c for _, c in master.received if c.code == RequestCode.HEART_BEAT]
            body = json.loads(beats[0].body or b"")
            assert body["clientID"] == producer.client_id
            assert body["producerDataSet"] == [{"groupName": "PG"}, {"groupName": "CLIENT_INNER_PRODUCER"}]
            assert body["consumerDataSet"] == []
            task = [t for t in asyncio.all_tasks() if t.get_name() == "producer[PG]:heartbeat"]
            assert len(task) == 1
        finally:
            await producer.stop()
        assert task[0].done()
        assert slave.received == []
        gone = [c for _, c in master.received if c.code == RequestCode.UNREGISTER_CLIENT]
        assert len(gone) == 1
        assert (gone[0].ext_fields or {}).get("producerGroup") == "PG"
        assert "consumerGroup" not in (gone[0].ext_fields or {})
        assert master.codes()[-1] == RequestCode.UNREGISTER_CLIENT


async def test_a_started_producer_that_knows_no_broker_yet_warns_of_nothing() -> None:
    producer = Producer("PG", "127.0.0.1:9876", heartbeat_interval=0.01)
    with capture_logs() as logs:
        await producer.start()
        try:
            await asyncio.sleep(0.05)  # a few heartbeat rounds, with no broker known
        finally:
            await producer.stop()
    assert [e for e in logs if e["log_level"] == "warning"] == []


async def test_a_producer_not_started_sends_no_heartbeat() -> None:
    async def broker(cmd: RemotingCommand, conn: int) -> RemotingCommand:
        return send_ok(cmd)

    where: dict[str, str] = {}

    async def namesrv(cmd: RemotingCommand, conn: int) -> RemotingCommand:
        return route_answer(cmd, where)

    async with FakeBroker(namesrv) as ns, FakeBroker(broker) as b:
        where["broker-a"] = b.addr
        producer = Producer("PG", ns.addr)
        try:
            await producer.send(Message("T", b"x"))
            await asyncio.sleep(0.05)
        finally:
            await producer.stop()
        assert b.codes() == [RequestCode.SEND_MESSAGE_V2]


def test_heartbeat_interval_option() -> None:
    assert Producer("PG", "127.0.0.1:9876").options.heartbeat_interval == 30.0
    with pytest.raises(InvalidOptionError):
        Producer("PG", "127.0.0.1:9876", heartbeat_interval=0)


async def test_what_java_refuses_before_sending_is_refused_before_sending() -> None:
    """Each of these went out (or failed late and untyped): a ``str`` body failed inside the
    connection's write and took the frames queued beside it down; a queue of another topic
    put the message on that topic; a selector's failure escaped as IndexError or
    AttributeError; a delayed or retry-topic message went into a batch; a body over
    ``max_message_size`` was compressed first and then let through; a send after ``stop()``
    tried three times against closed connections."""
    from rmq_async.client.errors import MQClientError
    from rmq_async.errors import InvalidArgumentError, InvalidTypeError

    producer, api = _fake_producer({}, max_message_size=1024, compress_over=64)
    with pytest.raises(InvalidTypeError, match="must be bytes"):
        await producer.send(Message("T", "text"))  # type: ignore[arg-type]
    with pytest.raises(InvalidTypeError, match="must be bytes"):
        await producer.send_batch([Message("T", b"ok"), Message("T", "text")])  # type: ignore[arg-type]
    with pytest.raises(InvalidArgumentError, match="is not the queue's 'payments'"):
        await producer.send(Message("orders", b"x"), queue=MessageQueue("payments", "broker-a", 0))
    with pytest.raises(InvalidArgumentError, match="is not the queue's"):
        await producer.send_batch([Message("orders", b"x")],
                                  queue=MessageQueue("payments", "broker-a", 0))

    def broken(queues: list[MessageQueue], msg: Message) -> MessageQueue:
        return queues[99]

    with pytest.raises(MQClientError, match="the queue selector raised IndexError"):
        await producer.send(Message("T", b"x"), selector=broken)
    with pytest.raises(MQClientError, match="returned None"):
        await producer.send(Message("T", b"x"), selector=lambda q, m: None)  # type: ignore[arg-type,return-value]
    with pytest.raises(InvalidArgumentError, match="delayed message"):
        await producer.send_batch([Message("T", b"x", properties={"DELAY": "3"})])
    with pytest.raises(InvalidArgumentError, match="retry topic"):
        await producer.send_batch([Message("%RETRY%G", b"x")])
    # An empty body, alone or in a batch (Java's Validators.checkMessage checks each
    # message of a batch as it checks one sent alone).
    with pytest.raises(InvalidArgumentError, match="body is empty"):
        await producer.send(Message("T", b""))
    with pytest.raises(InvalidArgumentError, match="body is empty"):
        await producer.send_batch([Message("T", b"x"), Message("T", b"")])
    # Checked before compression, as Java's Validators.checkMessage: 4 KiB of one byte would
    # compress to a few bytes.
    with pytest.raises(InvalidArgumentError, match="4096 bytes exceeds max_message_size"):
        await producer.send(Message("T", b"a" * 4096))
    assert api.sent == []
    await producer.send(Message("T", bytearray(b"bytes-like")))
    assert api.sent[-1][3] == b"bytes-like"
    await producer.stop()
    with pytest.raises(IllegalStateError, match="is stopped"):
        await producer.send(Message("T", b"x"))


async def test_a_message_sent_again_keeps_its_id() -> None:
    """Java's setUniqID stores the id in the message: a resend after a timeout (the broker may
    hold the first copy) carries the same msgId, which consumers can deduplicate on."""
    producer, api = _fake_producer({})
    msg = Message("T", b"x")
    await producer.send(msg)
    await producer.send(msg)
    assert msg.properties[PROPERTY_UNIQ_KEY] == api.calls[0]["msg_id"] == api.calls[1]["msg_id"]
    await producer.send(Message("T", b"x"))
    assert api.calls[2]["msg_id"] != api.calls[0]["msg_id"]  # a new message, a new id


async def test_a_topic_without_a_route_uses_the_create_topic_key_route_when_there_is_one() -> None:
    from rmq_async.client.errors import NoRouteError
    from rmq_async.protocol.bodies import BrokerData, QueueData, TopicRouteData

    producer, api = _fake_producer({}, default_topic_queue_nums=2)
    template = TopicRouteData(
        [QueueData("broker-a", 8, 8, 6), QueueData("broker-b", 1, 1, 6),
         QueueData("broker-c", 8, 8, 4)],  # broker-c: not writable
        [BrokerData("c", "broker-a", {0: "10.0.0.1:10911"}),
         BrokerData("c", "broker-b", {0: "10.0.0.2:10911"}),
         BrokerData("c", "broker-c", {0: "10.0.0.3:10911"})])
    asked: list[str] = []

    async def update_route(topic: str) -> TopicRouteData:
        asked.append(topic)
        if topic != "TBW102":
            raise NoRouteError(topic, "no route")
        return template

    async def own_route_missing(topic: str) -> list[MessageQueue]:
        asked.append(topic)
        raise NoRouteError(topic, "no route")

    producer.instance.publish_queues = own_route_missing  # type: ignore[method-assign]
    producer.instance.update_route = update_route  # type: ignore[method-assign]
    queues = await producer._publish_queues("NEW")
    assert [(q.topic, q.broker_name, q.queue_id) for q in queues] == [
        ("NEW", "broker-a", 0), ("NEW", "broker-a", 1), ("NEW", "broker-b", 0)]
    for _ in range(3):
        await producer.send(Message("NEW", b"x"))
    assert api.calls[-1]["default_topic"] == "TBW102"
    assert api.calls[-1]["default_topic_queue_nums"] == 2
    # The stand-in is kept (Java's publish table): the sends after the first asked nothing.
    # It lasts route_refresh_interval; then the topic's own route is asked for again.
    assert asked == ["NEW", "TBW102"]
    _, held = producer._stand_ins["NEW"]
    producer._stand_ins["NEW"] = (0.0, held)
    await producer.send(Message("NEW", b"x"))
    assert asked == ["NEW", "TBW102", "NEW", "TBW102"]
    # No broker creates topics: the topic's own error.
    other, _ = _fake_producer({}, create_topic_key="NO_SUCH_KEY")
    other.instance.publish_queues = own_route_missing  # type: ignore[method-assign]
    other.instance.update_route = update_route  # type: ignore[method-assign]
    with pytest.raises(NoRouteError, match="'NEW'"):
        await other.send(Message("NEW", b"x"))


def test_options_groups_and_messages_are_checked_before_any_send() -> None:
    """These failed at the first send that needed them, untyped (zlib.error, ValueError,
    TypeError), or not at all (a group of None sent messages)."""
    from rmq_async.errors import InvalidArgumentError, InvalidTypeError

    for options, said in [({"compress_level": 10}, "ZLIB takes a level from -1 to 9"),
                          ({"compress_type": "ZSTD", "compress_level": 99}, "ZSTD takes"),
                          ({"compress_over": "4k"}, "compress_over"),
                          ({"max_message_size": None}, "max_message_size"),
                          ({"default_topic_queue_nums": 0}, "default_topic_queue_nums")]:
        with pytest.raises(InvalidOptionError, match=said):
            Producer("PG", "127.0.0.1:1", **options)
    for group, said in [(None, "blank"), ("", "blank"), ("a b", "illegal characters"),
                        ("DEFAULT_PRODUCER", "reserved")]:
        with pytest.raises(InvalidOptionError, match=f"producer_group: .*{said}"):
            Producer(group, "127.0.0.1:1")  # type: ignore[arg-type]
    producer, _ = _fake_producer({})
    for msg, error, said in [
            (Message("", b"x"), InvalidArgumentError, "topic name is blank"),
            (Message("a b", b"x"), InvalidArgumentError, "illegal characters"),
            (Message("t" * 128, b"x"), InvalidArgumentError, "longer than 127"),
            (Message("T", b"x", properties={"n": 1}), InvalidTypeError,  # type: ignore[dict-item]
             "str to str"),
            (Message("T", b"x", keys=[1, 2]), InvalidTypeError, "keys"),  # type: ignore[list-item]
            (Message("T", b"x", tags=7), InvalidTypeError, "tags")]:  # type: ignore[arg-type]
        with pytest.raises(error, match=said):
            producer._check_sendable(msg, None)


async def test_messages_sharing_a_properties_dict_get_ids_of_their_own() -> None:
    """The id was written into the caller's properties dict: every later message built with
    the same dict (a common habit) went out with the first one's id, and a batch's messages
    all with one."""
    producer, api = _fake_producer({})
    common = {"source": "orders"}
    for body in (b"a", b"b"):
        await producer.send(Message("T", body, properties=common))
    await producer.send_batch([Message("T", b"c", properties=common),
                               Message("T", b"d", properties=common)])
    ids = [api.calls[0]["msg_id"], api.calls[1]["msg_id"], *api.calls[2]["msg_id"].split(",")]
    assert len(set(ids)) == 4 and common == {"source": "orders"}
    from rmq_async.errors import InvalidArgumentError

    refused = [Message("T", b"e", properties=common), Message("T", b"f", properties={"DELAY": "2"})]
    with pytest.raises(InvalidArgumentError):
        await producer.send_batch(refused)
    assert PROPERTY_UNIQ_KEY not in refused[0].properties  # a refused batch leaves them alone


def test_keys_and_levels_are_checked_as_documented() -> None:
    from rmq_async.errors import InvalidTypeError

    producer, _ = _fake_producer({})
    for keys in (["k1", None], 5):
        with pytest.raises(InvalidTypeError, match="keys"):
            producer._check_sendable(Message("T", b"x", keys=keys), None)  # type: ignore[arg-type]
    producer._check_sendable(Message("T", b"x", keys=("a", "b")), None)  # type: ignore[arg-type]
    Producer("PG", "127.0.0.1:1", compress_type="ZSTD", compress_level=-50)  # zstd's fast levels
    Producer("PG", "127.0.0.1:1", compress_over=float("inf"))  # never compress


async def test_a_batch_carries_its_messages_wait_in_the_request_header() -> None:
    # The broker reads WAIT for a batch from the request header and takes an absent one for
    # true: messages sent with WAIT=false in a batch still waited for the flush or replica.
    from rmq_async.errors import InvalidArgumentError

    producer, api = _fake_producer({})
    await producer.send_batch([Message("T", b"1", properties={PROPERTY_WAIT: "false"}),
                               Message("T", b"2", properties={PROPERTY_WAIT: "false"})])
    assert decode_properties(api.calls[-1]["properties"]) == {PROPERTY_WAIT: "false"}
    await producer.send_batch([Message("T", b"1"), Message("T", b"2")])
    assert decode_properties(api.calls[-1]["properties"]) == {PROPERTY_WAIT: "true"}
    with pytest.raises(InvalidArgumentError, match="agree on WAIT"):  # Java refuses them too
        await producer.send_batch([Message("T", b"1", properties={PROPERTY_WAIT: "false"}),
                                   Message("T", b"2")])


async def test_a_failed_route_lookup_on_a_retry_ends_with_the_brokers_error() -> None:
    # A retry's route lookup (two name-server requests for a topic without a route) that
    # failed ended the send with the lookup's error: the broker's answer was lost.
    from rmq_async.client.errors import MQBrokerError, NameServerUnavailable
    from rmq_async.protocol.codes import ResponseCode

    busy = MQBrokerError(ResponseCode.SYSTEM_BUSY, "too many requests", addr="a")
    producer, api = _fake_producer({"broker-a": busy, "broker-b": busy})
    lookups = 0

    async def publish_queues(topic: str) -> list[MessageQueue]:
        nonlocal lookups
        lookups += 1
        if lookups > 1:
            raise NameServerUnavailable("no name server answered")
        return QUEUES

    producer.instance.publish_queues = publish_queues  # type: ignore[method-assign]
    with pytest.raises(MQBrokerError) as info:
        await producer.send(Message("T", b"x"))
    assert info.value.code == ResponseCode.SYSTEM_BUSY
    assert len(api.sent) == 1


async def test_compressing_the_body_is_inside_send_timeout(monkeypatch: pytest.MonkeyPatch) -> None:
    # Java's send clock starts before the body is compressed: a compression that takes the
    # whole send_timeout leaves nothing for the request.
    import rmq_async.producer as producer_module

    def slow_compress(body: bytes, ctype: int, level: int) -> bytes:
        time.sleep(0.3)
        return body[:10]

    monkeypatch.setattr(producer_module, "compress_body", slow_compress)
    producer, api = _fake_producer({}, send_timeout=0.2, compress_over=64)
    with pytest.raises(RemotingTimeout, match="compressing the body"):
        await producer.send(Message("T", b"a" * 70_000))  # compressed in a worker thread
    assert api.sent == []
    await producer.send(Message("T", b"small"))  # not compressed: sent
    assert len(api.sent) == 1


async def test_a_retry_topic_send_carries_its_counts_in_the_header() -> None:
    """Java's sendKernelImpl copies RECONSUME_TIME / MAX_RECONSUME_TIMES of a %RETRY% message
    into the header (the properties, written first, keep them), where the broker reads them to
    choose between a retry and the DLQ; the header said 0 retries (never dead-lettered)."""
    from rmq_async.protocol.message import decode_properties

    producer, api = _fake_producer({})
    msg = Message("%RETRY%G", b"x", properties={"RECONSUME_TIME": "5",
                                                  "MAX_RECONSUME_TIMES": "16", "k": "v"})
    await producer.send(msg)
    call = api.calls[-1]
    assert (call["reconsume_times"], call["max_reconsume_times"]) == (5, 16)
    props = decode_properties(call["properties"])
    assert (props["k"], props["RECONSUME_TIME"], props["MAX_RECONSUME_TIMES"]) == ("v", "5", "16")
    await producer.send(Message("T", b"x", properties={"RECONSUME_TIME": "5"}))
    call = api.calls[-1]  # another topic: sent as given, as Java does
    assert (call["reconsume_times"], call["max_reconsume_times"]) == (None, None)
    assert decode_properties(call["properties"])["RECONSUME_TIME"] == "5"
    with pytest.raises(InvalidArgumentError, match="RECONSUME_TIME is not a number"):
        await producer.send(Message("%RETRY%G", b"x", properties={"RECONSUME_TIME": "x"}))


@pytest.mark.parametrize("topic", ["SCHEDULE_TOPIC_XXXX", "RMQ_SYS_TRANS_HALF_TOPIC",
                                   "OFFSET_MOVED_EVENT", "SELF_TEST_TOPIC"])
async def test_the_brokers_own_topics_are_refused_before_any_send(topic: str) -> None:
    # Java's Validators.isNotAllowedSendTopic; the broker's NO_PERMISSION was retried three
    # times and then blamed on the credentials.
    producer, api = _fake_producer({})
    with pytest.raises(InvalidArgumentError, match="is forbidden"):
        await producer.send(Message(topic, b"x"))
    assert api.sent == []


@pytest.mark.parametrize("flag", [2**31, -(2**31) - 1, 2**40, True, 1.0])
async def test_a_flag_outside_javas_int_is_refused_before_any_send(flag: Any) -> None:
    producer, api = _fake_producer({})
    for send in (lambda: producer.send(Message("T", b"x", flag=flag)),
                 lambda: producer.send_batch([Message("T", b"x", flag=flag)])):
        with pytest.raises(InvalidArgumentError, match="32-bit int"):
            await send()
    assert api.sent == []
    await producer.send(Message("T", b"x", flag=2**31 - 1))
    await producer.send(Message("T", b"x", flag=-(2**31)))
    assert [c["flag"] for c in api.calls] == [2**31 - 1, -(2**31)]


async def test_a_producer_used_without_start_fetches_a_stale_route_again() -> None:
    """Without start() there is no route refresh task: a route was held for good, so a master
    that moved (or new queues) was never seen. A send now fetches a route older than
    route_refresh_interval again, and keeps the old one when no name server answers."""
    from rmq_async.protocol.bodies import BrokerData, QueueData, TopicRouteData

    producer = Producer("PG_unit", "127.0.0.1:1")
    api = _FakeApi({})
    routes = [TopicRouteData([QueueData("broker-a", 2, 2, 6)],
                             [BrokerData("c", "broker-a", {0: "10.0.0.1:10911"})]),
              TopicRouteData([QueueData("broker-a", 2, 2, 6)],
                             [BrokerData("c", "broker-a", {0: "10.0.0.9:10911"})])]
    asked: list[str] = []

    async def get_route(namesrv: str, topic: str) -> TopicRouteData:
        asked.append(topic)
        answer = routes[min(len(asked), 2) - 1]
        if len(asked) == 3:
            raise MQBrokerError(ResponseCode.SYSTEM_ERROR, "name server trouble")
        return answer

    api.get_route = get_route  # type: ignore[attr-defined]
    producer.instance.api = api  # type: ignore[assignment]
    try:
        await producer.send(Message("T", b"x"))
        await producer.send(Message("T", b"x"))
        assert asked == ["T"] and {a for a, *_ in api.sent} == {"10.0.0.1:10911"}
        producer._routes_checked["T"] -= producer.options.route_refresh_interval  # stale
        await producer.send(Message("T", b"x"))
        assert asked == ["T", "T"] and api.sent[-1][0] == "10.0.0.9:10911"  # the new master
        producer._routes_checked["T"] -= producer.options.route_refresh_interval
        await producer.send(Message("T", b"x"))  # the name server fails: the route held serves
        assert asked == ["T", "T", "T"] and api.sent[-1][0] == "10.0.0.9:10911"
    finally:
        await producer.stop()

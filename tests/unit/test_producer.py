"""Producer without a broker: queue selection over several broker groups, retries on another
broker, compression types, credentials and TLS options."""

from __future__ import annotations

import itertools
import ssl
from pathlib import Path
from typing import Any

import pytest
from structlog.testing import capture_logs

from rmq_async import Message, Producer, RemotingConnectError, TlsVerificationError
from rmq_async.client.api import SendResult
from rmq_async.client.errors import MQBrokerError, NoPermissionError
from rmq_async.consumer.options import ConsumerOptions, Credentials, InvalidOptionError
from rmq_async.producer import select_queue
from rmq_async.protocol.codes import MSG_COMPRESSED_FLAG, MessageSysFlag, ResponseCode
from rmq_async.protocol.message import decode_messages, encode_stored_message
from rmq_async.protocol.types import MessageExt, MessageQueue

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

    async def send_message(self, addr: str, mq: MessageQueue, **kw: Any) -> SendResult:
        self.sent.append((addr, mq, kw["sys_flag"], kw["body"]))
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

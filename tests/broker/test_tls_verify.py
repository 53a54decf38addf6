"""TLS that verifies, and a producer with credentials and TLS, against a real broker.

One private broker for the module, with authentication on and its name server and broker
presenting a certificate for 127.0.0.1 issued by a CA the test makes (``tls.server.mode``
permissive, RocketMQ's test mode off). Clients trust that CA through ``tls_ca_file``; a client
trusting another CA must be refused quickly with :class:`TlsVerificationError`.
"""

from __future__ import annotations

import asyncio
import ssl
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from structlog.testing import capture_logs

from rmq_async import (
    ConsumeResult,
    Message,
    MessageExt,
    NoPermissionError,
    Producer,
    PushConsumer,
    TlsVerificationError,
)
from rmq_async.devbroker import AclAccount, LocalRocketMQ, TlsServerFiles
from rmq_async.devbroker.pytest_plugin import run_blocking
from tests.helpers import (
    SHORT_LIVED_BROKER_CONFIG,
    SHORT_LIVED_BROKER_FLAGS,
    TEST_SEND_TIMEOUT,
    unique,
    wait_until,
)
from tests.tls_certs import issue_server_cert, make_ca

pytestmark = pytest.mark.broker

ACCOUNT = AclAccount("bob", "bob-secret-42", admin=False)
CREDS = (ACCOUNT.access_key, ACCOUNT.secret_key)


class TlsBroker:
    def __init__(self, rmq: LocalRocketMQ, ca_file: Path, other_ca_file: Path) -> None:
        self.rmq = rmq
        self.ca_file = ca_file
        self.other_ca_file = other_ca_file


@pytest.fixture(scope="module")
def tls_broker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TlsBroker]:
    certs = tmp_path_factory.mktemp("tls-certs")
    ca = make_ca("rmq_async test CA")
    ca_file = certs / "ca.pem"
    ca_file.write_bytes(ca.cert_pem)
    other_ca_file = certs / "other-ca.pem"
    other_ca_file.write_bytes(make_ca("some other CA").cert_pem)
    cert_file, key_file = issue_server_cert(ca, certs, ips=("127.0.0.1",))
    rmq = LocalRocketMQ(acl=ACCOUNT, tls=TlsServerFiles(cert_file, key_file),
                        broker_config=SHORT_LIVED_BROKER_CONFIG, broker_jvm_flags=SHORT_LIVED_BROKER_FLAGS)
    started = time.monotonic()
    run_blocking(rmq.start_all())
    print(f"\nTLS + ACL broker started in {time.monotonic() - started:.1f} s")
    try:
        yield TlsBroker(rmq, ca_file, other_ca_file)
    finally:
        run_blocking(rmq.close())


async def _peer_certificates(client_remoting: object) -> dict[str, dict[str, object]]:
    from rmq_async.remoting.client import RemotingClient

    assert isinstance(client_remoting, RemotingClient)
    out = {}
    for addr in client_remoting.addresses:
        conn = await client_remoting.connection(addr)
        ssl_object = conn._transport.get_extra_info("ssl_object")  # type: ignore[union-attr]
        assert ssl_object is not None, f"{addr} is not a TLS connection"
        out[addr] = ssl_object.getpeercert()  # only filled in when the certificate was verified
    return out


async def test_consumer_and_producer_verify_the_broker_certificate(tls_broker: TlsBroker) -> None:
    rmq = tls_broker.rmq
    topic = unique("T_tlsv")
    await rmq.create_topic(topic, queues=2)
    n = 50
    async with Producer(unique("PG_tlsv"), rmq.namesrv_addr, credentials=CREDS,
                        tls_ca_file=tls_broker.ca_file, send_timeout=TEST_SEND_TIMEOUT) as producer:
        placed = {}
        for i in range(n):
            body = f"tls-{i}".encode() * (1 if i % 10 else 800)  # a few compressed ones
            r = await producer.send(Message(topic, body))
            placed[(r.queue_id, r.queue_offset)] = body
        producer_certs = await _peer_certificates(producer.instance.remoting)
    got: dict[tuple[int, int], bytes] = {}
    consumer = PushConsumer(unique("G_tlsv"), namesrv=rmq.namesrv_addr, credentials=CREDS,
                            tls_ca_file=tls_broker.ca_file,
                            consume_from_where="CONSUME_FROM_FIRST_OFFSET")

    @consumer.subscribe(topic)
    async def on(msgs: list[MessageExt]) -> ConsumeResult:
        got.update(((m.queue_id, m.queue_offset), m.body) for m in msgs)
        return ConsumeResult.SUCCESS

    async with consumer:
        await wait_until(lambda: len(got) == n, 30, what="every message over verified TLS")
        consumer_certs = await _peer_certificates(consumer.instance.remoting)
    assert got == placed
    for certs in (producer_certs, consumer_certs):
        assert {rmq.namesrv_addr, rmq.broker_addr} <= set(certs)
        for cert in certs.values():
            assert ("IP Address", "127.0.0.1") in cert["subjectAltName"]  # type: ignore[operator]
            assert cert["issuer"] == ((("commonName", "rmq_async test CA"),),)


async def test_certificate_from_another_ca_is_refused(tls_broker: TlsBroker) -> None:
    rmq = tls_broker.rmq
    topic = unique("T_tlsv_other")
    await rmq.create_topic(topic, queues=1)
    consumer = PushConsumer(unique("G_tlsv_other"), namesrv=rmq.namesrv_addr, credentials=CREDS,
                            tls_ca_file=tls_broker.other_ca_file)
    consumer.subscribe(topic, listener=lambda msgs: ConsumeResult.SUCCESS)
    before = set(asyncio.all_tasks())
    started = time.monotonic()
    with pytest.raises(TlsVerificationError) as info:
        await consumer.start()
    took = time.monotonic() - started
    print(f"\nconsumer refused in {took:.2f} s: {info.value}")
    assert took < 5
    assert info.value.addr == rmq.namesrv_addr
    assert "certificate" in str(info.value) and rmq.namesrv_addr in str(info.value)
    assert isinstance(info.value.__cause__, ssl.SSLCertVerificationError)
    await asyncio.sleep(0)
    assert [t for t in asyncio.all_tasks() - before if not t.done()] == []

    # The system's CAs do not know the test CA either.
    async with Producer(unique("PG_tlsv_other"), rmq.namesrv_addr, credentials=CREDS,
                        tls=True) as producer:
        started = time.monotonic()
        with pytest.raises(TlsVerificationError):
            await producer.send(Message(topic, b"never sent"))
        assert time.monotonic() - started < 5


async def test_verification_off_is_explicit_and_warned_once(tls_broker: TlsBroker) -> None:
    rmq = tls_broker.rmq
    topic = unique("T_tlsv_off")
    await rmq.create_topic(topic, queues=1)
    with capture_logs() as logs:
        async with Producer(unique("PG_tlsv_off"), rmq.namesrv_addr, credentials=CREDS, tls=True,
                            tls_verify=False) as producer:
            for i in range(3):
                await producer.send(Message(topic, f"m{i}".encode()))
            certs = await _peer_certificates(producer.instance.remoting)
    assert certs and all(c == {} for c in certs.values())  # TLS, but nothing was verified
    warnings = [e for e in logs if e["event"] == "tls.verification_disabled"]
    assert len(warnings) == 1 and warnings[0]["client"] == producer.client_id


@pytest.mark.parametrize("credentials", [
    (ACCOUNT.access_key, "wrong-secret-1"), ("mallory", ACCOUNT.secret_key), None,
], ids=["wrong-secret", "unknown-user", "no-credentials"])
async def test_producer_with_wrong_keys_gets_a_permission_error(
        tls_broker: TlsBroker, credentials: tuple[str, str] | None) -> None:
    rmq = tls_broker.rmq
    topic = unique("T_tlsv_denied")
    await rmq.create_topic(topic, queues=1)
    async with Producer(unique("PG_tlsv_denied"), rmq.namesrv_addr, credentials=credentials,
                        tls_ca_file=tls_broker.ca_file) as producer:
        started = time.monotonic()
        with pytest.raises(NoPermissionError) as info:
            await producer.send(Message(topic, b"denied"))
        took = time.monotonic() - started
    print(f"\nproducer {credentials and credentials[0]!r}: refused after {took:.2f} s: {info.value}")
    message = str(info.value)
    assert "NO_PERMISSION" in message and producer.group in message and topic in message
    assert (f"access key {credentials[0]!r}" if credentials else "no credentials") in message
    assert took < 10

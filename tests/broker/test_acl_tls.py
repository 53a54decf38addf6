"""ACL-signed requests against a broker with authentication on, and TLS remoting connections.

The ACL tests share one private broker started with an account (5.3 authentication and
authorization); the TLS tests use the session broker, whose remoting servers run the default
``tls.server.mode=permissive`` (a connection that opens with a TLS handshake is served over TLS,
with the broker's self-signed test certificate).
"""

from __future__ import annotations

import asyncio
import ssl
import time
from collections.abc import Iterator

import pytest

from rmq_async import (
    ConsumeResult,
    MessageExt,
    NoPermissionError,
    Producer,
    PushConsumer,
    TlsVerificationError,
)
from rmq_async.devbroker import AclAccount, LocalRocketMQ
from rmq_async.devbroker.pytest_plugin import run_blocking
from tests.helpers import simple_messages, unique, wait_until

pytestmark = pytest.mark.broker

ACCOUNT = AclAccount("alice", "alice-secret-1", admin=False)


@pytest.fixture(scope="module")
def acl_broker() -> Iterator[LocalRocketMQ]:
    rmq = LocalRocketMQ(acl=ACCOUNT)
    run_blocking(rmq.start_all())
    try:
        yield rmq
    finally:
        run_blocking(rmq.close())


async def _signed_produce(rmq: LocalRocketMQ, topic: str, n: int) -> None:
    msgs = simple_messages(topic, n)
    async with Producer(unique("PG_acl"), rmq.namesrv_addr,
                        credentials=(ACCOUNT.access_key, ACCOUNT.secret_key)) as producer:
        for chunk in range(0, n, 20):
            await producer.send_batch(msgs[chunk:chunk + 20])


async def test_acl_right_keys_consume(acl_broker: LocalRocketMQ) -> None:
    topic = unique("T_acl")
    await acl_broker.create_topic(topic, queues=2)
    await _signed_produce(acl_broker, topic, 100)
    seen: set[tuple[int, int]] = set()
    consumer = PushConsumer(unique("G_acl"), namesrv=acl_broker.namesrv_addr,
                            credentials=(ACCOUNT.access_key, ACCOUNT.secret_key),
                            consume_from_where="CONSUME_FROM_FIRST_OFFSET")

    @consumer.subscribe(topic)
    async def on(msgs: list[MessageExt]) -> ConsumeResult:
        seen.update((m.queue_id, m.queue_offset) for m in msgs)
        return ConsumeResult.SUCCESS

    async with consumer:
        await wait_until(lambda: len(seen) == 100, 30, what="100 messages under ACL")


@pytest.mark.parametrize("credentials, reason", [
    ((ACCOUNT.access_key, "wrong-secret-1"), "check signature failed"),
    (("mallory", ACCOUNT.secret_key), ""),
    (None, ""),
], ids=["wrong-secret", "unknown-user", "no-credentials"])
async def test_acl_wrong_keys_fail_start_with_permission_error(
        acl_broker: LocalRocketMQ, credentials: tuple[str, str] | None, reason: str) -> None:
    topic = unique("T_acl_denied")
    await acl_broker.create_topic(topic, queues=2)
    consumer = PushConsumer(unique("G_acl_denied"), namesrv=acl_broker.namesrv_addr,
                            credentials=credentials)
    consumer.subscribe(topic, listener=lambda msgs: ConsumeResult.SUCCESS)
    before = set(asyncio.all_tasks())
    started = time.monotonic()
    with pytest.raises(NoPermissionError) as info:
        await consumer.start()
    took = time.monotonic() - started
    message = str(info.value)
    print(f"\nACL {credentials and credentials[0]!r}: start() failed after {took:.2f} s: {message}")
    assert took < 10
    assert "NO_PERMISSION" in message and reason in message
    assert consumer.group in message
    # Nothing keeps running or retrying after the failed start.
    await asyncio.sleep(0)
    leftover = [t for t in asyncio.all_tasks() - before if not t.done()]
    assert leftover == []
    assert consumer.running_tasks() == 0


def _insecure_tls() -> ssl.SSLContext:
    ctx = ssl.create_default_context()
    ctx.check_hostname = False
    ctx.verify_mode = ssl.CERT_NONE  # the dev broker's certificate is self-signed
    return ctx


async def test_tls_connections(rocketmq: LocalRocketMQ, topic: str) -> None:
    from tests.helpers import produce

    placed = await produce(rocketmq.namesrv_addr, topic, simple_messages(topic, 200), batch=20)
    seen: set[tuple[int, int]] = set()
    consumer = PushConsumer(unique("G_tls"), namesrv=rocketmq.namesrv_addr,
                            ssl_context=_insecure_tls(),
                            consume_from_where="CONSUME_FROM_FIRST_OFFSET")

    @consumer.subscribe(topic)
    async def on(msgs: list[MessageExt]) -> ConsumeResult:
        seen.update((m.queue_id, m.queue_offset) for m in msgs)
        return ConsumeResult.SUCCESS

    async with consumer:
        await wait_until(lambda: len(seen) == 200, 30, what="200 messages over TLS")
        remoting = consumer.instance.remoting
        addrs = remoting.addresses
        assert rocketmq.namesrv_addr in addrs and rocketmq.broker_addr in addrs
        versions = {}
        for addr in addrs:
            conn = await remoting.connection(addr)
            ssl_object = conn._transport.get_extra_info("ssl_object")  # type: ignore[union-attr]
            assert ssl_object is not None, f"{addr} is not a TLS connection"
            versions[addr] = ssl_object.version()
            assert ssl_object.getpeercert(binary_form=True)
    assert seen == set(placed)
    print(f"\nTLS: {versions}")

    # A context that verifies certificates refuses the self-signed one: start() fails fast.
    strict = PushConsumer(unique("G_tls_strict"), namesrv=rocketmq.namesrv_addr,
                          ssl_context=ssl.create_default_context())
    strict.subscribe(topic, listener=lambda msgs: ConsumeResult.SUCCESS)
    started = time.monotonic()
    with pytest.raises(TlsVerificationError, match=r"self.signed certificate"):
        await strict.start()
    assert time.monotonic() - started < 10


async def test_topic_denied_after_start_is_reported_once(acl_broker: LocalRocketMQ) -> None:
    """A broker that stops serving one topic to this client (an ACL Deny added while the
    consumer runs) is surfaced once through on_error and the stats, not only in the log."""
    from rmq_async.consumer.events import ConsumerError, ConsumerErrorKind

    topic = unique("T_acl_deny")
    await acl_broker.create_topic(topic, queues=2)
    await _signed_produce(acl_broker, topic, 40)
    seen: set[tuple[int, int]] = set()
    errors: list[ConsumerError] = []
    consumer = PushConsumer(unique("G_acl_deny"), namesrv=acl_broker.namesrv_addr,
                            credentials=(ACCOUNT.access_key, ACCOUNT.secret_key),
                            consume_from_where="CONSUME_FROM_FIRST_OFFSET",
                            pull_time_delay_when_exception=0.2)

    @consumer.subscribe(topic)
    async def on(msgs: list[MessageExt]) -> ConsumeResult:
        seen.update((m.queue_id, m.queue_offset) for m in msgs)
        return ConsumeResult.SUCCESS

    consumer.on_error(errors.append)
    async with consumer:
        await wait_until(lambda: len(seen) == 40, 30, what="40 messages before the denial")
        await acl_broker.admin_request("acl", acl_broker.broker_addr, f"User:{ACCOUNT.access_key}",
                                       f"Topic:{topic}", "Sub", "Deny")
        await wait_until(lambda: len(errors) >= 2, 60, what="both queues reported refused")
        await asyncio.sleep(2.0)  # many refused pulls later: still one report per queue
        stats = consumer.stats_snapshot()[topic]
    assert sorted((e.kind, e.queue.queue_id if e.queue else -1) for e in errors) == [
        (ConsumerErrorKind.PERMISSION_DENIED, 0), (ConsumerErrorKind.PERMISSION_DENIED, 1)]
    assert all(e.topic == topic and "refuses" in e.detail for e in errors)
    assert stats["errors"] == {"permission_denied": 2}

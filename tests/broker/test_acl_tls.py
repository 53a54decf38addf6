"""ACL-signed requests against a broker with authentication on, and TLS remoting connections.

The ACL tests share one private broker started with an account (5.3 authentication and
authorization); the TLS tests use the session broker, whose remoting servers run the default
``tls.server.mode=permissive`` (a connection that opens with a TLS handshake is served over TLS,
with the broker's self-signed test certificate).
"""

from __future__ import annotations

import asyncio
import ssl
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

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
from rmq_async.devbroker.java import classpath, compile_java, run_java
from rmq_async.devbroker.pytest_plugin import run_blocking
from tests.helpers import (
    SHORT_LIVED_BROKER_CONFIG,
    SHORT_LIVED_BROKER_FLAGS,
    TEST_SEND_TIMEOUT,
    simple_messages,
    unique,
    wait_until,
)

pytestmark = pytest.mark.broker

ACCOUNT = AclAccount("alice", "alice-secret-1", admin=False)


@pytest.fixture(scope="module")
def acl_broker() -> Iterator[LocalRocketMQ]:
    rmq = LocalRocketMQ(acl=ACCOUNT, broker_config=SHORT_LIVED_BROKER_CONFIG,
                        broker_jvm_flags=SHORT_LIVED_BROKER_FLAGS)
    run_blocking(rmq.start_all())
    try:
        yield rmq
    finally:
        run_blocking(rmq.close())


async def _signed_produce(rmq: LocalRocketMQ, topic: str, n: int) -> None:
    msgs = simple_messages(topic, n)
    async with Producer(unique("PG_acl"), rmq.namesrv_addr,
                        credentials=(ACCOUNT.access_key, ACCOUNT.secret_key),
                        send_timeout=TEST_SEND_TIMEOUT) as producer:
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


def test_the_internal_admin_password_is_not_on_a_command_line(
        acl_broker: LocalRocketMQ) -> None:
    """Any local user can read a process's command line (/proc/PID/cmdline is 0444): the
    admin helper gets the internal admin's password through its environment."""
    from rmq_async.devbroker.procs import pid_cmdline

    helper = acl_broker._admin.proc
    assert helper is not None and acl_broker._admin_password
    assert acl_broker._admin_password not in pid_cmdline(helper.pid)


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
        # New messages end the pulls the broker holds (long polling, up to 15 s), so the next
        # pull of each queue, the refused one, comes now.
        await _signed_produce(acl_broker, topic, 40)
        await wait_until(lambda: len(errors) >= 2, 60, what="both queues reported refused")
        await asyncio.sleep(2.0)  # many refused pulls later: still one report per queue
        stats = consumer.stats_snapshot()[topic]
    assert sorted((e.kind, e.queue.queue_id if e.queue else -1) for e in errors) == [
        (ConsumerErrorKind.PERMISSION_DENIED, 0), (ConsumerErrorKind.PERMISSION_DENIED, 1)]
    assert all(e.topic == topic and "refuses" in e.detail for e in errors)
    assert stats["errors"] == {"permission_denied": 2}


_ACL_CLIENT = textwrap.dedent("""\
    import org.apache.rocketmq.acl.common.AclClientRPCHook;
    import org.apache.rocketmq.acl.common.SessionCredentials;
    import org.apache.rocketmq.client.producer.DefaultMQProducer;
    import org.apache.rocketmq.common.TopicConfig;
    import org.apache.rocketmq.common.message.Message;
    import org.apache.rocketmq.remoting.RPCHook;
    import org.apache.rocketmq.tools.admin.DefaultMQAdminExt;

    /**
     * args: namesrv broker topic probe...; a probe is mode(send|create)[:accessKey:secretKey].
     * Prints one line per probe, in order: "OK ..." or "DENIED <root cause>".
     */
    public class AclProbe {
        public static void main(String[] a) throws Exception {
            for (int i = 3; i < a.length; i++) {
                String[] probe = a[i].split(":", -1);
                System.out.println(run(a[0], a[1], a[2], probe));
                System.out.flush();
            }
        }

        static String run(String namesrv, String broker, String topic, String[] probe) {
            RPCHook hook = probe.length > 2
                ? new AclClientRPCHook(new SessionCredentials(probe[1], probe[2])) : null;
            try {
                if (probe[0].equals("send")) {
                    DefaultMQProducer p = new DefaultMQProducer("acl_probe_pg", hook);
                    p.setNamesrvAddr(namesrv);
                    p.setRetryTimesWhenSendFailed(0);
                    p.setInstanceName("probe" + System.nanoTime());
                    p.start();
                    try {
                        return "OK " + p.send(new Message(topic, "x".getBytes())).getSendStatus();
                    } finally {
                        p.shutdown();
                    }
                }
                DefaultMQAdminExt admin = new DefaultMQAdminExt(hook, 5000);
                admin.setNamesrvAddr(namesrv);
                admin.setInstanceName("probe" + System.nanoTime());
                admin.start();
                try {
                    admin.createAndUpdateTopicConfig(broker, new TopicConfig(topic, 2, 2));
                    return "OK created";
                } finally {
                    admin.shutdown();
                }
            } catch (Exception e) {
                Throwable root = e;
                while (root.getCause() != null) {
                    root = root.getCause();
                }
                return "DENIED " + String.valueOf(root.getMessage()).split("\\n")[0];
            }
        }
    }
    """)


async def test_acl_accounts_normal_and_super_from_the_java_client(
        acl_broker: LocalRocketMQ, tmp_path: Path) -> None:
    """The dev broker's accounts as the Java client sees them, signing with its own ACL hook: a
    Normal account (the one the broker starts with) may send but not administer; a Super account
    added to the running broker may do both; anyone else is refused."""
    src = tmp_path / "AclProbe.java"
    src.write_text(_ACL_CLIENT)
    rmq = acl_broker
    topic = unique("T_acl_java")
    await rmq.create_topic(topic, queues=4)  # the internal admin may
    await rmq.admin_request("user", rmq.broker_addr, "bob", "bob-secret-1", "Super")
    users = await rmq.mqadmin("listUser", "-b", rmq.broker_addr)
    kinds = {row[0]: row[2] for row in (line.split() for line in users.splitlines())
             if row and row[0] in ("alice", "bob")}
    assert kinds == {"alice": "Normal", "bob": "Super"}, users

    classes = await compile_java([src], rmq.lib_dir)
    cp = classpath(rmq.lib_dir, classes)
    # All probes in one JVM: a JVM start per probe cost most of this test's time.
    probes = ["send:alice:alice-secret-1", "send", "send:alice:wrong-secret",
              "send:mallory:alice-secret-1", "create:alice:alice-secret-1",
              "send:bob:bob-secret-1", "create:bob:bob-secret-1", "create:bob:alice-secret-1"]
    rc, out, err = await run_java(
        "AclProbe", [rmq.namesrv_addr, rmq.broker_addr, topic, *probes], cp, timeout=90,
    )
    assert rc == 0, err
    lines = [line for line in out.splitlines() if line.startswith(("OK", "DENIED"))]
    assert len(lines) == len(probes), out
    (alice_sent, anonymous, wrong_secret, wrong_user, alice_created,
     bob_sent, bob_created, bob_wrong_secret) = lines
    assert alice_sent == "OK SEND_OK"
    assert anonymous.startswith("DENIED")
    assert wrong_secret.startswith("DENIED")
    assert wrong_user.startswith("DENIED")
    assert alice_created.startswith("DENIED"), alice_created
    assert bob_sent == "OK SEND_OK"
    assert bob_created == "OK created"
    assert bob_wrong_secret.startswith("DENIED"), bob_wrong_secret

"""Compressed bodies on a real broker: every type the Java producer writes, and one that cannot
be inflated.

The Java ``DefaultMQProducer`` compresses bodies of 4 KiB and more with the type its user chose
(ZLIB, LZ4 or ZSTD); the broker stores them as they came. A PushConsumer must hand each one to
its listener exactly as the Java producer was given it.
"""

from __future__ import annotations

import hashlib
import time
from typing import Any

import pytest

from rmq_async import ConsumeResult, Message, MessageExt, Producer, PushConsumer
from rmq_async.consumer.events import ConsumerError, ConsumerErrorKind
from rmq_async.devbroker import LocalRocketMQ
from rmq_async.protocol.codes import MSG_COMPRESSED_FLAG, MessageSysFlag
from rmq_async.protocol.message import decode_messages, encode_properties
from rmq_async.protocol.types import PROPERTY_UNIQ_KEY, PROPERTY_WAIT
from tests.helpers import AdminClient, unique, wait_until

pytestmark = pytest.mark.broker

_TYPE_BITS = {"ZLIB": MessageSysFlag.COMPRESSION_ZLIB_TYPE, "LZ4": MessageSysFlag.COMPRESSION_LZ4_TYPE,
              "ZSTD": MessageSysFlag.COMPRESSION_ZSTD_TYPE}


async def _raw_sys_flags(admin: AdminClient, topic: str) -> dict[tuple[int, int], int]:
    """The stored sysFlag of every message, read without inflating anything."""
    out = {}
    for mq in await admin.queues(topic):
        addr = await admin.instance.find_broker_master(mq.broker_name, topic)
        end = await admin.instance.api.get_max_offset(addr, mq)
        offset = 0
        while offset < end:
            r = await admin.instance.api.pull_message(
                addr, group="rmq_async_test_reader", mq=mq, queue_offset=offset, max_msg_nums=32,
                suspend_timeout=0.0, timeout=10.0, subscription="*")
            for m in decode_messages(r.body, decompress=False):
                out[(m.queue_id, m.queue_offset)] = m.sys_flag
            offset = r.next_begin_offset
    return out


async def test_java_compressed_bodies_arrive_byte_identical(
        rocketmq: LocalRocketMQ, java_programs) -> None:  # type: ignore[no-untyped-def]
    topic = unique("T_bodies")
    await rocketmq.create_topic(topic, queues=2)
    started = time.monotonic()
    out = await java_programs.run("JavaCompressProducer", rocketmq.namesrv_addr, topic,
                                  "ZLIB,LZ4,ZSTD", timeout=120)
    java_took = time.monotonic() - started
    sent = {}
    for line in out.splitlines():
        if line.startswith("SENT "):
            _, ctype, qid, qoff, kind, size, digest = line.split()
            sent[(int(qid), int(qoff))] = (ctype, kind, int(size), digest)
    assert len(sent) == 3 * 7 * 2

    # The broker holds what Java wrote: bodies of 4 KiB and more compressed with each type.
    async with AdminClient(rocketmq.namesrv_addr) as admin:
        flags = await _raw_sys_flags(admin, topic)
    assert set(flags) == set(sent)
    for pos, (ctype, _kind, size, _digest) in sent.items():
        if size >= 4096:
            assert flags[pos] & MSG_COMPRESSED_FLAG, (pos, ctype, size)
            assert flags[pos] & MessageSysFlag.COMPRESSION_TYPE_COMPARATOR == _TYPE_BITS[ctype]
        else:
            assert not flags[pos] & MSG_COMPRESSED_FLAG

    got: dict[tuple[int, int], bytes] = {}
    errors: list[ConsumerError] = []
    consumer = PushConsumer(unique("G_bodies"), namesrv=rocketmq.namesrv_addr,
                            consume_from_where="CONSUME_FROM_FIRST_OFFSET")

    @consumer.subscribe(topic)
    async def on(msgs: list[MessageExt]) -> ConsumeResult:
        for m in msgs:
            got[(m.queue_id, m.queue_offset)] = m.body
        return ConsumeResult.SUCCESS

    consumer.on_error(errors.append)
    async with consumer:
        await wait_until(lambda: len(got) == len(sent), 30, what="every Java-compressed body")
    assert errors == []
    per_type: dict[str, int] = {}
    for pos, (ctype, kind, size, digest) in sent.items():
        body = got[pos]
        assert len(body) == size and hashlib.sha256(body).hexdigest() == digest, (ctype, kind, size)
        per_type[ctype] = per_type.get(ctype, 0) + 1
    print(f"\nJava-compressed bodies byte-identical: {per_type} (Java producer {java_took:.1f} s)")


async def test_body_that_cannot_be_inflated_is_reported_and_skipped(rocketmq: LocalRocketMQ) -> None:
    """Same policy as a corrupt record: reported once with its queue and offset, the messages
    behind it delivered, the offset committed past it."""
    topic = unique("T_badbody")
    await rocketmq.create_topic(topic, queues=1)
    group = unique("G_badbody")
    async with Producer(unique("PG_badbody"), rocketmq.namesrv_addr) as producer:
        for i in range(3):
            await producer.send(Message(topic, f"before-{i}".encode()))
        mq = (await producer.instance.publish_queues(topic))[0]
        addr = await producer.instance.find_broker_master(mq.broker_name, topic)
        props = encode_properties({PROPERTY_UNIQ_KEY: producer._uniq.next_id(), PROPERTY_WAIT: "true"})
        bad = await producer.instance.api.send_message(
            addr, mq, producer_group=producer.group, body=b"\x04\x22\x4d\x18 not an LZ4 frame",
            properties=props,
            sys_flag=MSG_COMPRESSED_FLAG | MessageSysFlag.COMPRESSION_LZ4_TYPE)
        for i in range(3):
            await producer.send(Message(topic, f"after-{i}".encode() * 1000, tags="after"))

    seen: list[str] = []
    errors: list[ConsumerError] = []
    consumer = PushConsumer(group, namesrv=rocketmq.namesrv_addr,
                            consume_from_where="CONSUME_FROM_FIRST_OFFSET",
                            persist_offset_interval=0.2)

    @consumer.subscribe(topic)
    async def on(msgs: list[MessageExt]) -> ConsumeResult:
        seen.extend(m.body[:8].decode() for m in msgs)
        return ConsumeResult.SUCCESS

    consumer.on_error(errors.append)
    async with consumer:
        await wait_until(lambda: len(seen) == 6 and bool(errors), 30,
                         what="the six good messages and the report")
        stats = consumer.stats_snapshot()[topic]
    assert seen == ["before-0", "before-1", "before-2", "after-0a", "after-1a", "after-2a"]
    [error] = errors
    assert (error.kind, error.topic, error.queue, error.offset) == (
        ConsumerErrorKind.CORRUPT_RECORD, topic, mq, bad.queue_offset)
    assert "LZ4" in error.detail
    assert stats["errors"] == {"corrupt_record": 1}
    async with AdminClient(rocketmq.namesrv_addr) as admin:
        assert await admin.committed_offsets(group, topic) == await admin.max_offsets(topic)


async def test_our_compressed_bodies_are_read_by_the_java_consumer(
        rocketmq: LocalRocketMQ, java_programs: Any) -> None:
    """The other direction: a Java DefaultMQPushConsumer reads what our producer compressed
    with each type, a body over one 4 MiB LZ4 block included (liblz4 links such blocks by
    default, which lz4-java refuses: the message and the rest of its pull were lost to Java
    consumers)."""
    from rmq_async.devbroker.java import start_java
    from tests.helpers import JAVA_CONSUMER_FLAGS

    topic = unique("T_pycompressed")
    await rocketmq.create_topic(topic, queues=1)
    large = (b"large compressible body " * 250_000)[:5_000_000]
    sends = [("LZ4", b"small " * 100), ("LZ4", large), ("ZSTD", large), ("ZLIB", large),
             ("ZLIB", b"after " * 50)]
    for ctype, body in sends:
        async with Producer(unique("PG"), rocketmq.namesrv_addr, compress_type=ctype,
                            compress_over=256, max_message_size=8 * 1024 * 1024) as producer:
            await producer.send(Message(topic, body))
    async with AdminClient(rocketmq.namesrv_addr) as admin:
        flags = await _raw_sys_flags(admin, topic)
    for offset, (ctype, _) in enumerate(sends):
        assert flags[(0, offset)] & MessageSysFlag.COMPRESSION_TYPE_COMPARATOR == \
            _TYPE_BITS[ctype], (offset, ctype)
    async with start_java("JavaPushConsumer",
                          [rocketmq.namesrv_addr, unique("G_javaread"), topic, "java-read",
                           "CONSUME_FROM_FIRST_OFFSET"],
                          java_programs.classpath, jvm_flags=JAVA_CONSUMER_FLAGS) as java:
        await java.wait_for("READY", 60)

        def read() -> set[int]:
            return {int(ln.split()[2]) for ln in java.lines if ln.startswith("MSG ")}

        await wait_until(lambda: read() == set(range(len(sends))), 60,
                         what="the Java consumer to read every body we compressed")

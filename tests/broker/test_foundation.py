"""Foundation against the real broker: round trip, long polling, connection loss."""

from __future__ import annotations

import asyncio
import random
import time

import pytest

from rmq_async import ConnectionClosed, Message, Producer
from rmq_async.client.instance import ClientInstance
from rmq_async.protocol.types import MessageQueue
from rmq_async.remoting.errors import RemotingError
from tests.helpers import AdminClient, send_batch_unchecked, unique

pytestmark = pytest.mark.broker

UNICODE_WORDS = ["订单", "ラベル", "ключ", "clé", "😀", "plain", "a b", "x=y", "Ünïcödé"]


def mixed_messages(topic: str, n: int, seed: int = 7) -> list[Message]:
    rnd = random.Random(seed)
    sizes = [0, 1, 100, 1024, 4095, 4096, 4097, 16 * 1024, 64 * 1024, 256 * 1024]
    msgs = []
    for i in range(n):
        # Mostly small, with every size class present (up to 256 KiB).
        size = sizes[i % len(sizes)] if i % 50 == 0 else rnd.choice(sizes[:5])
        body = rnd.randbytes(size) if i % 3 else (f"{i}-" * (size // 4 + 1)).encode()[:size]
        word = UNICODE_WORDS[i % len(UNICODE_WORDS)]
        msgs.append(Message(
            topic, body,
            tags=f"tag-{word}-{i % 5}",
            # Keys travel space-separated (as in Java), so a key cannot contain a space.
            keys=[f"k{i}", f"{word.replace(' ', '_')}{i}"],
            properties={"idx": str(i), "wörd": word, "empty-ish": " "},
        ))
    return msgs


async def test_round_trip_python_and_java_producers(rocketmq, java_programs) -> None:
    topic = unique("T_rt")
    await rocketmq.create_topic(topic, queues=8)
    sent = mixed_messages(topic, 10_000)
    results = {}
    async with Producer(unique("PG"), rocketmq.namesrv_addr) as producer:
        sem = asyncio.Semaphore(16)

        async def one(i: int, m: Message) -> None:
            async with sem:
                if m.body:
                    results[i] = await producer.send(m)
                else:
                    # An empty body is refused (as by Java), but other clients store them.
                    results[i] = await send_batch_unchecked(producer, [m])

        await asyncio.gather(*(one(i, m) for i, m in enumerate(sent)))
        with pytest.raises(ValueError, match="body is empty"):
            await producer.send(Message(topic, b""))
    # 1,000 messages from the Java producer, some over 4 KiB (compressed by Java).
    java_out = await java_programs.run(
        "JavaProducer", rocketmq.namesrv_addr, topic, "1000", timeout=120
    )
    java_sent = [line.split(" ", 4) for line in java_out.splitlines() if line.startswith("SENT ")]
    assert len(java_sent) == 1000

    async with AdminClient(rocketmq.namesrv_addr) as admin:
        got = await admin.read_all(topic)
    assert len(got) == 11_000
    by_pos = {(m.queue_id, m.queue_offset): m for m in got}
    assert len(by_pos) == 11_000
    for i, m in enumerate(sent):
        r = results[i]
        back = by_pos[(r.queue_id, r.queue_offset)]
        assert back.body == m.body
        assert back.tags == m.tags
        assert back.keys == m.keys  # type: ignore[comparison-overlap]
        for k, v in m.properties.items():
            assert back.properties[k] == v
        assert back.offset_msg_id == r.offset_msg_id
        assert back.msg_id == back.properties["UNIQ_KEY"] == r.msg_id
        assert back.topic == topic
    for _, qid, qoff, msg_id, size in java_sent:
        back = by_pos[(int(qid), int(qoff))]
        assert back.msg_id == msg_id
        i = int(back.properties["idx"])
        assert back.tags == f"java-{i % 3}"
        assert back.keys == [f"jk{i}"]
        assert len(back.body) == int(size)
        assert back.body == bytes((j * 31 + i) % 251 for j in range(int(size)))


async def test_the_broker_knows_a_started_producer_until_it_stops(rocketmq) -> None:
    """Java's admin client (``examineProducerConnectionInfo``, as ``mqadmin producerConnection``)
    finds a started producer's client id under its group once it has sent (the heartbeat on
    connecting), and none after ``stop()``."""
    topic = unique("T_pc")
    await rocketmq.create_topic(topic, queues=2)
    group = unique("PG")
    producer = Producer(group, rocketmq.namesrv_addr)
    await producer.start()
    try:
        await producer.send(Message(topic, b"x"))
        async with asyncio.timeout(10):
            while not (seen := await rocketmq.admin_request("producers", group, topic))[1:]:
                await asyncio.sleep(0.1)
        assert seen == ["OK", producer.client_id]
    finally:
        await producer.stop()
    assert await rocketmq.admin_request("producers", group, topic) == ["OK"]


async def test_long_poll_wakes_on_message_and_times_out(rocketmq) -> None:
    topic = unique("T_lp")
    await rocketmq.create_topic(topic, queues=1)
    async with AdminClient(rocketmq.namesrv_addr) as admin:
        mq = (await admin.queues(topic))[0]
        addr = await admin.instance.find_broker_master(mq.broker_name, topic)
        api = admin.instance.api
        # Nothing arrives: the broker holds the pull for the suspend time, then says "no new message".
        started = time.monotonic()
        r = await api.pull_message(addr, group=unique("G_lp"), mq=mq, queue_offset=0,
                                   suspend_timeout=2.0, timeout=10.0, subscription="*")
        waited = time.monotonic() - started
        assert r.status.name == "NO_NEW_MSG"
        assert 1.5 <= waited < 10.0, waited

        # A message sent meanwhile wakes a 15 s long poll at once (tens of ms at rest; without
        # the wake-up the broker finds it at its next 5 s check).
        group = unique("G_lp")
        pull = asyncio.create_task(api.pull_message(
            addr, group=group, mq=mq, queue_offset=0, suspend_timeout=15.0, timeout=30.0,
            subscription="*"))
        await asyncio.sleep(1.0)
        assert not pull.done()
        async with Producer(unique("PG"), rocketmq.namesrv_addr) as producer:
            await producer.send(Message(topic, b"wake up"))
            sent_at = time.monotonic()
            r = await pull
            latency = time.monotonic() - sent_at
        assert r.status.name == "FOUND"
        assert [m.body for m in r.decode()] == [b"wake up"]
        print(f"\nlong-poll wake-up latency after send returned: {latency * 1000:.1f} ms")
        assert latency < 2.0, latency  # without the wake-up: the broker's next 5 s check


async def test_broker_killed_mid_request_then_reconnect(rocketmq) -> None:
    rmq = rocketmq
    topic = unique("T_kill")
    await rmq.create_topic(topic, queues=1)
    instance = ClientInstance(rmq.namesrv_addr, "127.0.0.1@killtest")
    try:
        mq = MessageQueue(topic, rmq.broker_name, 0)
        await instance.update_route(topic)
        addr = await instance.find_broker_master(mq.broker_name, topic)
        pull = asyncio.create_task(instance.api.pull_message(
            addr, group="G_kill", mq=mq, queue_offset=0, suspend_timeout=15.0, timeout=20.0,
            subscription="*"))
        await asyncio.sleep(1.0)
        started = time.monotonic()
        try:
            rmq.kill_broker()
            with pytest.raises(ConnectionClosed):
                await pull
            assert time.monotonic() - started < 20.0
        finally:
            await rmq.start()
        deadline = time.monotonic() + 60
        while True:
            try:
                off = await instance.api.get_max_offset(addr, mq)
                break
            except RemotingError:
                if time.monotonic() > deadline:
                    raise
                await asyncio.sleep(0.5)
        assert off >= 0
    finally:
        await instance.close()


async def test_a_send_to_a_topic_without_a_route_lets_the_broker_create_it(rocketmq) -> None:
    """Java's tryToFindTopicPublishInfo: a topic without a route is sent to through the route
    of ``create_topic_key`` (TBW102), at most ``default_topic_queue_nums`` queues per broker,
    and a broker that allows it (``autoCreateTopicEnable``, on in the dev broker as in a stock
    one) creates the topic. The producer raised NoRouteError instead."""
    topic = unique("T_autocreated")
    async with Producer(unique("PG"), rocketmq.namesrv_addr, default_topic_queue_nums=3) as p:
        first = await p.send(Message(topic, b"first"))
        assert first.queue_id in range(3)
        async with AdminClient(rocketmq.namesrv_addr) as admin:
            deadline = time.monotonic() + 30
            while True:  # the broker registers the new topic with the name server
                try:
                    queues = await admin.queues(topic)
                    break
                except Exception:
                    assert time.monotonic() < deadline, "the created topic never got a route"
                    await asyncio.sleep(0.2)
            assert sorted(q.queue_id for q in queues) == [0, 1, 2]
            second = await p.send(Message(topic, b"second"))
            mq = MessageQueue(topic, first.broker_name, first.queue_id)
            addr = await admin.instance.find_broker_master(mq.broker_name, topic)
            r = await admin.instance.api.pull_message(
                addr, group=unique("G_read"), mq=mq, queue_offset=0, suspend_timeout=0,
                subscription="*")
            assert b"first" in [m.body for m in r.decode()]
            assert second.msg_id != first.msg_id

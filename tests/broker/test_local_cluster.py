"""One consumer across a real local cluster: two broker groups (master + slave each) and two name
servers, started once for this module.

The default sizes keep ``make test`` fast; ``RMQ_CLUSTER_FULL=1`` (``make test-cluster``) runs
the acceptance sizes (100,000 messages).
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import json
import os
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import TYPE_CHECKING

import pytest

from rmq_async import ConsumeResult, MessageExt, PushConsumer
from rmq_async.client.errors import MQBrokerError
from rmq_async.consumer.allocate import AllocateAveragely, sort_inputs
from rmq_async.devbroker import LocalCluster
from rmq_async.devbroker.java import start_java
from rmq_async.devbroker.procs import pid_cmdline
from rmq_async.producer import Producer, select_by_key
from rmq_async.protocol.command import RemotingCommand
from rmq_async.protocol.types import Message, MessageQueue
from tests.helpers import (
    JAVA_CONSUMER_FLAGS,
    SHORT_LIVED_BROKER_CONFIG,
    SHORT_LIVED_BROKER_FLAGS,
    AdminClient,
    first_broker_port_taken,
    simple_messages,
    unique,
    wait_until,
)

FULL = os.environ.get("RMQ_CLUSTER_FULL") == "1"

if TYPE_CHECKING:
    from tests.broker.conftest import JavaPrograms

pytestmark = [pytest.mark.broker, pytest.mark.timeout(1200 if FULL else 240)]
#: The module's cluster (the plugin's ``rocketmq_cluster`` fixture): brokers on C1 only.
ROCKETMQ_CLUSTER = {"broker_jvm_flags": SHORT_LIVED_BROKER_FLAGS}
#: Messages of the exactly-once scenario.
N_ONCE = 100_000 if FULL else 4_000
#: Messages of the fail-over scenario.
N_FAILOVER = 100_000 if FULL else 3_000

Key = tuple[str, int, int]  # broker name, queue id, queue offset


def _consumer(cluster: LocalCluster, group: str, **opts: object) -> PushConsumer:
    opts.setdefault("consume_from_where", "CONSUME_FROM_FIRST_OFFSET")
    opts.setdefault("persist_offset_interval", 0.5)
    opts.setdefault("route_refresh_interval", 1.0)
    opts.setdefault("pull_time_delay_when_exception", 0.3)
    opts.setdefault("rebalance_interval", 2.0)
    return PushConsumer(group, namesrv=cluster.namesrv_addr, **opts)  # type: ignore[arg-type]


async def _produce(namesrv: str, messages: Sequence[Message], *, batch: int = 64) -> list[Key]:
    """Send in batches over every group's queues; return where each message was stored."""
    placed: list[Key] = []
    async with Producer(unique("PG"), namesrv) as producer:
        sem = asyncio.Semaphore(4)

        async def send(chunk: Sequence[Message]) -> None:
            async with sem:
                r = await producer.send_batch(list(chunk))
            placed.extend((r.broker_name, r.queue_id, r.queue_offset + i)
                          for i in range(len(chunk)))

        await asyncio.gather(*(send(messages[i:i + batch])
                               for i in range(0, len(messages), batch)))
    return placed


async def _max_offsets_at(admin: AdminClient, addr: str, topic: str,
                          broker_name: str) -> dict[int, int]:
    out = {}
    for mq in await admin.queues(topic):
        if mq.broker_name == broker_name:
            out[mq.queue_id] = await admin.instance.api.get_max_offset(addr, mq)
    return out


async def _slave_serves(admin: AdminClient, addr: str, mq: MessageQueue) -> bool:
    """True once a slave answers pulls of ``mq``: it copies topic configurations from its master
    every 10 s, and refuses pulls of a topic it has not copied yet (TOPIC_NOT_EXIST)."""
    try:
        await admin.instance.api.pull_message(addr, group="rmq_async_test_reader", mq=mq,
                                              queue_offset=0, max_msg_nums=1,
                                              suspend_timeout=0.0, timeout=5.0,
                                              subscription="*")
    except MQBrokerError:
        return False
    return True


async def _wait_replicated(cluster: LocalCluster, topic: str, timeout: float = 60.0,
                           names: Sequence[str] | None = None) -> None:
    """Until every slave (of ``names``, default all groups) knows ``topic`` and holds as many
    messages per queue as its master (a topic created seconds ago; in production topics are
    older than the 10 s sync)."""
    async with AdminClient(cluster.namesrv_addr) as admin:
        deadline = time.monotonic() + timeout
        for name in names or cluster.broker_names:
            mq = next(q for q in await admin.queues(topic) if q.broker_name == name)
            for broker_id in range(1, cluster.slaves + 1):
                addr = cluster.broker_addr(name, broker_id)
                while True:
                    # The master's max offsets are read again each round: a broker builds its
                    # consume queues from the commit log in the background, so right after the
                    # sends a busy master may still report fewer than it stored.
                    master = await _max_offsets_at(admin, cluster.broker_addr(name, 0), topic,
                                                   name)
                    copied = await _max_offsets_at(admin, addr, topic, name)
                    serves = copied == master and await _slave_serves(admin, addr, mq)
                    if serves:
                        break
                    # What the slave had, for the failure message: not yet replicated (offsets
                    # behind the master's) or not yet serving the topic (config not synced).
                    assert time.monotonic() < deadline, (
                        f"{name}-{broker_id} did not catch up: max offsets {copied} against "
                        f"the master's {master}; "
                        + ("refuses pulls of the topic" if copied == master else "behind"))
                    await asyncio.sleep(0.2)


async def _commits_equal_max(cluster: LocalCluster, group: str, topic: str,
                             timeout: float = 30.0) -> dict[MessageQueue, tuple[int, int]]:
    """Wait until every queue's committed offset (on its master) equals its max offset."""
    async with AdminClient(cluster.namesrv_addr) as admin:
        deadline = time.monotonic() + timeout
        while True:
            committed = await admin.committed_offsets(group, topic)
            maxes = await admin.max_offsets(topic)
            if committed == maxes:
                return {mq: (committed[mq], maxes[mq]) for mq in maxes}
            if time.monotonic() > deadline:
                raise AssertionError(f"committed {committed} != max {maxes}")
            await asyncio.sleep(0.2)


async def test_cluster_layout_and_routes(rocketmq_cluster: LocalCluster) -> None:
    """Two groups of master + slave registered in both name servers; a topic gets 8 queues on
    each group's master."""
    c = rocketmq_cluster
    assert c.broker_names == ["broker-a", "broker-b"]
    assert len(c.namesrv_addrs) == 2
    for node in c.brokers.values():  # ROCKETMQ_CLUSTER's broker_jvm_flags reach every broker
        assert node.proc is not None
        assert " -XX:TieredStopAtLevel=1 " in pid_cmdline(node.proc.pid), node.key
    print(f"cluster start-up {c.startup_seconds}s, RSS MiB "
          f"{ {k: v >> 20 for k, v in c.rss_bytes().items()} }, "
          f"total {sum(c.rss_bytes().values()) >> 20} MiB")
    topic = unique("T_layout")
    await c.create_topic(topic, 8)
    for ns in c.namesrv_addrs:
        async with AdminClient(ns) as admin:
            route = await admin.instance.update_route(topic)
            addrs = {bd.broker_name: dict(bd.broker_addrs) for bd in route.broker_datas}
            assert addrs == {name: {0: c.broker_addr(name, 0), 1: c.broker_addr(name, 1)}
                             for name in c.broker_names}, (ns, addrs)
            assert sorted((q.broker_name, q.read_queue_nums) for q in route.queue_datas) == [
                ("broker-a", 8), ("broker-b", 8)]


async def test_one_consumer_two_groups_exactly_once(rocketmq_cluster: LocalCluster) -> None:
    """Two groups x 8 queues: every message consumed exactly once by one consumer, offsets
    committed on both masters up to the max offsets."""
    c = rocketmq_cluster
    topic = unique("T_once")
    await c.create_topic(topic, 8)
    started = time.monotonic()
    placed = await _produce(c.namesrv_addr, simple_messages(topic, N_ONCE, size=64))
    produced_s = time.monotonic() - started
    assert len(set(placed)) == N_ONCE
    assert {b for b, _, _ in placed} == {"broker-a", "broker-b"}
    group = unique("G_once")
    seen: collections.Counter[Key] = collections.Counter()
    consumer = _consumer(c, group)

    @consumer.subscribe(topic)
    async def on_msgs(msgs: list[MessageExt]) -> ConsumeResult:
        for m in msgs:
            seen[(m.broker_name, m.queue_id, m.queue_offset)] += 1
        return ConsumeResult.SUCCESS

    started = time.monotonic()
    async with consumer:
        await wait_until(lambda: len(seen) >= N_ONCE, 300, what=f"{N_ONCE} messages")
        consumed_s = time.monotonic() - started
        mine = [mq for mq in consumer.process_queues if mq.topic == topic]
        assert len(mine) == 16 and {mq.broker_name for mq in mine} == {"broker-a", "broker-b"}
        await _commits_equal_max(c, group, topic)
    assert set(seen) == set(placed)
    dups = sum(n - 1 for n in seen.values())
    assert dups == 0, f"{dups} duplicates"
    print(f"exactly once: {N_ONCE} messages over 16 queues, produced in {produced_s:.1f}s, "
          f"consumed in {consumed_s:.1f}s ({N_ONCE / consumed_s:,.0f} msg/s)")


async def test_master_killed_slave_serves_then_master_returns(
        rocketmq_cluster: LocalCluster) -> None:
    """Kill -9 broker-a's master mid-stream: broker-a's queues go on from its slave, broker-b is
    not disturbed; the restarted master gets the pulls back; committed = max at the end."""
    c = rocketmq_cluster
    topic = unique("T_failover")
    await c.create_topic(topic, 8)
    placed = await _produce(c.namesrv_addr, simple_messages(topic, N_FAILOVER, size=64))
    assert len(set(placed)) == N_FAILOVER
    await _wait_replicated(c, topic)
    per_broker = collections.Counter(b for b, _, _ in placed)
    group = unique("G_failover")
    seen: collections.Counter[Key] = collections.Counter()
    gate = asyncio.Event()
    gate.set()
    consumer = _consumer(c, group, pull_batch_size=8, pull_threshold_for_queue=16,
                         broker_suspend_max_time=2.0,
                         consume_message_batch_max_size=8)

    @consumer.subscribe(topic)
    async def on_msgs(msgs: list[MessageExt]) -> ConsumeResult:
        await gate.wait()
        for m in msgs:
            seen[(m.broker_name, m.queue_id, m.queue_offset)] += 1
        await asyncio.sleep(0.002)
        return ConsumeResult.SUCCESS

    def count(broker: str) -> int:
        return sum(1 for k in seen if k[0] == broker)

    async with consumer:
        pulls = consumer.pull_service.pulls_by_replica
        await wait_until(lambda: count("broker-a") >= per_broker["broker-a"] // 4, 120,
                         what="a quarter of broker-a's messages")
        gate.clear()
        await asyncio.sleep(0.2)
        c.kill_broker("broker-a", 0)
        killed_at = time.monotonic()
        a_before, b_before = count("broker-a"), count("broker-b")
        slave_pulls_before = pulls[("broker-a", 1)]
        gate.set()
        # broker-a goes on from its slave.
        await wait_until(lambda: pulls[("broker-a", 1)] > slave_pulls_before
                         and count("broker-a") > a_before, 60,
                         what="broker-a's queues consumed from its slave")
        switch_s = time.monotonic() - killed_at
        a_mid = count("broker-a")
        await wait_until(lambda: count("broker-a") >= min(per_broker["broker-a"],
                                                          a_mid + per_broker["broker-a"] // 4),
                         120, what="more of broker-a from the slave")
        # broker-b was served by its master all along.
        assert count("broker-b") > b_before or count("broker-b") == per_broker["broker-b"]
        assert pulls[("broker-b", 1)] == 0, pulls
        master_pulls_before = pulls[("broker-a", 0)]
        started = time.monotonic()
        await c.start_broker("broker-a", 0)
        restart_s = time.monotonic() - started
        await wait_until(lambda: pulls[("broker-a", 0)] > master_pulls_before, 60,
                         what="pulls back on broker-a's master")
        await wait_until(lambda: len(seen) >= N_FAILOVER, 300, what="every message")
        back = {mq: at for mq, at in consumer.pull_service.pulled_at.items()
                if mq.broker_name == "broker-a"}
        await wait_until(lambda: all(consumer.pull_service.pulled_at.get(mq, ("", 1))[1] == 0
                                     for mq in back), 30, what="every broker-a queue on master")
        offsets = await _commits_equal_max(c, group, topic, timeout=60)
    assert set(seen) == set(placed), "messages lost"
    dups = sum(n - 1 for n in seen.values())
    print(f"fail-over: {N_FAILOVER} messages, slave took over {switch_s:.1f}s after the kill, "
          f"master restarted in {restart_s:.1f}s, pulls per replica {dict(pulls)}, "
          f"duplicates {dups}, committed=max on {len(offsets)} queues")


#: Java RequestCode.UPDATE_BROKER_CONFIG: the body is ``key=value`` lines (a .properties text).
UPDATE_BROKER_CONFIG = 25


async def _set_store_ratio(c: LocalCluster, addr: str, ratio: int) -> None:
    """Change a running broker's ``accessMessageInMemoryMaxRatio`` (what mqadmin
    updateBrokerConfig sends, without starting a JVM)."""
    async with AdminClient(c.namesrv_addr) as admin:
        req = RemotingCommand.request(
            UPDATE_BROKER_CONFIG, body=f"accessMessageInMemoryMaxRatio={ratio}\n".encode())
        resp = await admin.instance.remoting.invoke(addr, req, 5.0)
    assert resp.code == 0, (resp.code, resp.remark)


#: Java RequestCode.GET_BROKER_RUNTIME_INFO: a KVTable of the broker's figures (JSON body).
GET_BROKER_RUNTIME_INFO = 28
REPLICAS = [("broker-a", 0), ("broker-a", 1), ("broker-b", 0), ("broker-b", 1)]


async def _served(c: LocalCluster) -> dict[tuple[str, int], int]:
    """Messages every replica has served to pulls so far (``msgGetTotalTodayNow``)."""
    out = {}
    async with AdminClient(c.namesrv_addr) as admin:
        for name, bid in REPLICAS:
            req = RemotingCommand.request(GET_BROKER_RUNTIME_INFO)
            resp = await admin.instance.remoting.invoke(c.broker_addr(name, bid), req, 5.0)
            assert resp.code == 0, (resp.code, resp.remark)
            out[(name, bid)] = int(json.loads(resp.body)["table"]["msgGetTotalTodayNow"])
    return out


def _delta(after: dict[tuple[str, int], int],
           before: dict[tuple[str, int], int]) -> dict[tuple[str, int], int]:
    return {k: after[k] - before[k] for k in after}


async def test_broker_suggesting_its_slave_gets_the_next_pulls_there(
        rocketmq_cluster: LocalCluster, java_programs: JavaPrograms) -> None:
    """broker-b's master with accessMessageInMemoryMaxRatio=0 finds every consumer that is
    behind "too slow" and answers with suggestWhichBrokerId=1: the queue's next pull goes to
    broker-b's slave (which sends it back to the master once it has caught up). broker-a,
    unchanged, is only pulled from its master. Every message once, offsets committed. A Java
    DefaultMQPushConsumer reading the same topic under the same suggestion pulls from the same
    replicas (measured on the brokers: the messages each replica served)."""
    c = rocketmq_cluster
    topic = unique("T_suggest")
    await c.create_topic(topic, 8)
    n = 2_000
    placed = await _produce(c.namesrv_addr, simple_messages(topic, n, size=64))
    # Only broker-b's slave is to serve here (broker-a's may still be reconnecting to its
    # master, killed and restarted by the fail-over test).
    await _wait_replicated(c, topic, names=["broker-b"])
    b_master = c.broker_addr("broker-b", 0)
    await _set_store_ratio(c, b_master, 0)
    try:
        group = unique("G_suggest")
        seen: collections.Counter[Key] = collections.Counter()
        consumer = _consumer(c, group, pull_batch_size=8, pull_threshold_for_queue=16)

        @consumer.subscribe(topic)
        async def on_msgs(msgs: list[MessageExt]) -> ConsumeResult:
            for m in msgs:
                seen[(m.broker_name, m.queue_id, m.queue_offset)] += 1
            return ConsumeResult.SUCCESS

        before = await _served(c)
        async with consumer:
            await wait_until(lambda: len(seen) >= n, 120, what=f"{n} messages")
            pulls = dict(consumer.pull_service.pulls_by_replica)
            await _commits_equal_max(c, group, topic)
        ours_served = _delta(await _served(c), before)

        # The Java client, same topic, a group of its own, the same suggestion in force.
        before = await _served(c)
        async with start_java("JavaPushConsumer",
                              [c.namesrv_addr, unique("G_suggest_java"), topic, "java-suggest",
                               "CONSUME_FROM_FIRST_OFFSET"], java_programs.classpath,
                              jvm_flags=JAVA_CONSUMER_FLAGS) as java:
            await java.wait_for("READY", 60)
            await wait_until(lambda: sum(line.startswith("MSG ") for line in java.lines) >= n,
                             120, what=f"{n} messages to the Java consumer")
        java_served = _delta(await _served(c), before)
    finally:
        await _set_store_ratio(c, b_master, 40)
    assert set(seen) == set(placed) and max(seen.values()) == 1
    assert pulls.get(("broker-b", 1), 0) > 0, pulls
    assert pulls.get(("broker-a", 1), 0) == 0, pulls
    print(f"suggested slave: pulls per replica {pulls}; messages served per replica: "
          f"rmq_async {ours_served}, Java {java_served}")
    # The same targets as the Java client: broker-b's slave serves both, broker-a's none.
    for served in (ours_served, java_served):
        assert served[("broker-b", 1)] > 0, served
        assert served[("broker-a", 1)] == 0, served
        assert served[("broker-a", 0)] >= n // 4, served  # broker-a's share, from its master


async def test_one_name_server_killed(rocketmq_cluster: LocalCluster) -> None:
    """With one of the two name servers killed, route refresh keeps working and a new consumer
    still starts and consumes (the name server is restarted afterwards)."""
    c = rocketmq_cluster
    topic = unique("T_namesrv")
    await c.create_topic(topic, 8)
    group = unique("G_namesrv")
    seen: collections.Counter[Key] = collections.Counter()

    async def on_msgs(msgs: list[MessageExt]) -> ConsumeResult:
        for m in msgs:
            seen[(m.broker_name, m.queue_id, m.queue_offset)] += 1
        return ConsumeResult.SUCCESS

    first = _consumer(c, group, instance_name="ns1")
    first.subscribe(topic, listener=on_msgs)
    try:
        await first.start()
        await wait_until(lambda: sum(mq.topic == topic for mq in first.process_queues) == 16,
                         30, what="16 queues")
        c.kill_namesrv(0)
        # Route refresh goes on through the other name server (every second here).
        # (the cached route is blanked; only a refresh can fill it again)
        first.instance.routes[topic] = dataclasses.replace(first.instance.routes[topic],
                                                           queue_datas=[])
        await wait_until(lambda: first.instance.routes[topic].queue_datas != [], 10,
                         what="route refreshed from the surviving name server")
        # Routes of topics new to the client are fetched too: a second consumer starts.
        topic2 = unique("T_namesrv2")
        await c.create_topic(topic2, 8)
        second = _consumer(c, unique("G_namesrv2"), instance_name="ns2")
        got2: list[MessageExt] = []

        async def on_msgs2(msgs: list[MessageExt]) -> ConsumeResult:
            got2.extend(msgs)
            return ConsumeResult.SUCCESS

        second.subscribe(topic2, listener=on_msgs2)
        async with second:
            placed = await _produce(c.namesrv_addr, simple_messages(topic, 200, size=32))
            placed2 = await _produce(c.namesrv_addr, simple_messages(topic2, 200, size=32))
            await wait_until(lambda: len(got2) >= 200 and len(seen) >= 200, 60,
                             what="both consumers' messages")
        assert {(m.broker_name, m.queue_id, m.queue_offset) for m in got2} == set(placed2)
        assert set(seen) == set(placed)
    finally:
        await first.stop()
        await c.start_namesrv(0)
        await c.register_all()


async def test_orderly_across_groups_with_a_master_killed(rocketmq_cluster: LocalCluster) -> None:
    """Orderly consumption over both groups; broker-a's master is killed mid-stream and
    restarted: no key sees its messages out of order (a re-delivery of one already seen is
    counted as a duplicate, not a violation), broker-b goes on, and the locks of broker-a's
    queues are taken again on the returned master."""
    c = rocketmq_cluster
    topic = unique("T_orderly")
    await c.create_topic(topic, 8)
    keys, per_key = 32, (100_000 if FULL else 2_000) // 32
    async with Producer(unique("PG"), c.namesrv_addr) as producer:

        async def send_key(k: int) -> None:
            for seq in range(per_key):
                await producer.send(Message(topic, f"k{k}:{seq}".encode(), keys=[f"k{k}"]),
                                    selector=select_by_key)

        await asyncio.gather(*(send_key(k) for k in range(keys)))
    await _wait_replicated(c, topic)
    group = unique("G_orderly")
    last: dict[str, int] = {}
    firsts = 0
    dups = 0
    violations: list[tuple[str, int, int]] = []
    by_broker: collections.Counter[str] = collections.Counter()
    gate = asyncio.Event()
    gate.set()
    consumer = _consumer(c, group, pull_batch_size=8, pull_threshold_for_queue=16,
                         broker_suspend_max_time=2.0, rebalance_lock_interval=1.0)

    @consumer.subscribe(topic, orderly=True)
    async def on_msgs(msgs: list[MessageExt]) -> ConsumeResult:
        nonlocal firsts, dups
        await gate.wait()
        for m in msgs:
            key, seq_text = m.body.decode().split(":")
            seq = int(seq_text)
            prev = last.get(key, -1)
            if seq == prev + 1:
                last[key] = seq
                firsts += 1
                by_broker[m.broker_name] += 1
            elif seq <= prev:
                dups += 1
            else:
                violations.append((key, prev, seq))
        await asyncio.sleep(0.002)
        return ConsumeResult.SUCCESS

    total = keys * per_key
    async with consumer:
        await wait_until(lambda: firsts >= total // 4, 120, what="a quarter of the messages")
        gate.clear()
        await asyncio.sleep(0.2)
        c.kill_broker("broker-a", 0)
        b_before = by_broker["broker-b"]
        gate.set()
        await wait_until(lambda: by_broker["broker-b"] > b_before or not any(
            mq.broker_name == "broker-b" and pq.msg_count
            for mq, pq in consumer.process_queues.items()), 60, what="broker-b going on")
        await asyncio.sleep(2.0)
        restarted = time.monotonic()
        await c.start_broker("broker-a", 0)
        a_queues = [mq for mq in consumer.process_queues
                    if mq.topic == topic and mq.broker_name == "broker-a"]
        assert a_queues, "broker-a's queues were given up while its master was down"
        # Held and locked again (a queue given up meanwhile does not count as locked).
        await wait_until(lambda: all(
            mq in consumer.process_queues
            and consumer.process_queues[mq].locked
            and consumer.process_queues[mq].last_lock_timestamp > restarted
            for mq in a_queues), 60, what="broker-a's queues locked again on its master")
        await wait_until(lambda: firsts >= total, 300, what="every message")
        await _commits_equal_max(c, group, topic, timeout=60)
    assert not violations, violations[:10]
    print(f"orderly fail-over: {total} messages over {keys} keys, duplicates {dups}, "
          f"order violations 0, broker-a queues re-locked after the restart")


async def test_three_consumers_split_16_queues_as_java(rocketmq_cluster: LocalCluster,
                                                       java_programs: JavaPrograms) -> None:
    """Two rmq_async consumers and one Java DefaultMQPushConsumer in one group split the 16
    queues of two groups exactly as Java's AllocateMessageQueueAveragely does, no queue twice;
    the messages are consumed once between them."""
    c = rocketmq_cluster
    topic = unique("T_three")
    await c.create_topic(topic, 8)
    group = unique("G_three")
    ours: dict[str, collections.Counter[Key]] = {}
    consumers = []
    for i in range(2):
        consumer = _consumer(c, group, instance_name=f"three{i}")
        bucket: collections.Counter[Key] = collections.Counter()
        ours[consumer.client_id] = bucket

        def make(b: collections.Counter[Key]) -> Callable[[list[MessageExt]],
                                                            Awaitable[ConsumeResult]]:
            async def on(msgs: list[MessageExt]) -> ConsumeResult:
                for m in msgs:
                    b[(m.broker_name, m.queue_id, m.queue_offset)] += 1
                return ConsumeResult.SUCCESS
            return on

        consumer.subscribe(topic, listener=make(bucket))
        consumers.append(consumer)
    async with start_java("JavaPushConsumer",
                          [c.namesrv_addr, group, topic, "java-three",
                           "CONSUME_FROM_FIRST_OFFSET"], java_programs.classpath,
                          jvm_flags=JAVA_CONSUMER_FLAGS) as java:
        await java.wait_for("READY", 60)
        java_cid = next(line.split()[1] for line in java.lines if line.startswith("READY"))
        for consumer in consumers:
            await consumer.start()
        try:
            def java_held() -> set[tuple[str, int]]:
                for line in reversed(java.lines):
                    if line.startswith("HELD"):
                        return {(b, int(q)) for b, q in (w.split(":") for w in line.split()[1:])}
                return set()

            def held() -> dict[str, set[tuple[str, int]]]:
                out = {cs.client_id: {(mq.broker_name, mq.queue_id) for mq in cs.process_queues
                                      if mq.topic == topic} for cs in consumers}
                out[java_cid] = java_held()
                return out

            async with AdminClient(c.namesrv_addr) as admin:
                mq_all = await admin.queues(topic)
            mqs, cids = sort_inputs(mq_all, [*ours, java_cid])
            expected = {cid: {(mq.broker_name, mq.queue_id)
                              for mq in AllocateAveragely().allocate(group, cid, mqs, cids)}
                        for cid in cids}
            await wait_until(lambda: held() == expected, 60,
                             what="the three consumers holding Java's assignment")
            got = held()
            assert sorted(len(v) for v in got.values()) == [5, 5, 6]
            assert set().union(*got.values()) == {(mq.broker_name, mq.queue_id) for mq in mq_all}
            placed = await _produce(c.namesrv_addr, simple_messages(topic, 1_600, size=32))

            def java_count() -> int:
                return sum(1 for line in java.lines if line.startswith("MSG "))

            await wait_until(lambda: java_count() + sum(len(b) for b in ours.values())
                             >= len(placed), 60, what="every message between the three")
        finally:
            for consumer in consumers:
                await consumer.stop()
    for cid, bucket in ours.items():
        assert max(bucket.values(), default=1) == 1
        assert {(b, q) for b, q, _ in bucket} <= expected[cid]
    java_by_queue = collections.Counter(
        int(line.split()[1]) for line in java.lines if line.startswith("MSG "))
    ours_all = set().union(*(set(b) for b in ours.values()))
    assert ours_all <= set(placed)
    assert sum(java_by_queue.values()) == len(placed) - len(ours_all)
    print(f"three consumers: queues held {sorted(len(v) for v in got.values())} as Java "
          "computes; "
          f"rmq_async {len(ours_all)} + Java {sum(java_by_queue.values())} = {len(placed)}")


async def test_send_back_with_the_master_down_goes_through_another_group(
        rocketmq_cluster: LocalCluster) -> None:
    """A message of broker-a failing while broker-a's master is down cannot be sent back there:
    as Java's consumer does, the client produces it into %RETRY%<group> on broker-b's master,
    and it comes back from there with reconsume_times 1. Nothing is lost."""
    c = rocketmq_cluster
    topic = unique("T_sendback")
    await c.create_topic(topic, 8)
    n = 400
    # Batches of 8: 50 batches go round every queue of both groups.
    placed = await _produce(c.namesrv_addr, simple_messages(topic, n, size=64), batch=8)
    on_a = sum(b == "broker-a" for b, _, _ in placed)
    assert on_a > 0
    # Enough consume workers that broker-a's messages, held at the gate, never starve broker-b's.
    consumer = _consumer(c, unique("G_sendback"), consume_concurrency=1000)
    gate = asyncio.Event()
    first: dict[bytes, Key] = {}
    again: dict[bytes, tuple[str, int]] = {}

    def failing(m: MessageExt) -> bool:
        return m.broker_name == "broker-a" and int(m.body[1:11]) % 10 == 0

    @consumer.subscribe(topic)
    async def on_msg(msg: MessageExt) -> None:
        body = msg.body[:11]
        if msg.reconsume_times > 0:
            again[body] = (msg.broker_name, msg.reconsume_times)
            return
        if msg.broker_name == "broker-a":
            await gate.wait()  # broker-a's messages wait in the cache until its master is gone
        first.setdefault(body, (msg.broker_name, msg.queue_id, msg.queue_offset))
        if failing(msg):
            raise RuntimeError("fails once")

    try:
        async with consumer:
            await wait_until(lambda: sum(b == "broker-b" for b, _, _ in first.values())
                             == sum(b == "broker-b" for b, _, _ in placed), 60,
                             what="broker-b's messages")

            def cached_on_a() -> int:
                return sum(pq.msg_count for mq, pq in consumer.process_queues.items()
                           if mq.topic == topic and mq.broker_name == "broker-a")

            # Every broker-a message pulled from its master (this test needs no slave).
            await wait_until(lambda: cached_on_a() == on_a, 60, what="broker-a's messages cached")
            c.kill_broker("broker-a", 0)
            gate.set()
            await wait_until(lambda: len(first) >= n, 120, what="every message once")
            failed = {body for body, (b, _, _) in first.items()
                      if b == "broker-a" and int(body[1:11]) % 10 == 0}
            assert failed
            # Delay level 3 (10 s) on broker-b, then the retry queue delivers them.
            await wait_until(lambda: failed <= set(again), 90, what="the failed ones back")
    finally:
        await c.start_broker("broker-a", 0)
    assert set(first.values()) == set(placed)
    assert {again[body] for body in failed} == {("broker-b", 1)}, again
    print(f"send-back with broker-a's master down: {len(failed)} messages came back through "
          f"broker-b's %RETRY% queue")


@pytest.mark.slow(seconds=30)
async def test_cluster_port_taken_before_the_jvm_binds_it_is_retried(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A broker port taken by someone else between the pick and the JVM's bind (two test
    workers starting brokers at once) costs the cluster a second start on other ports."""
    with first_broker_port_taken(monkeypatch) as race:
        async with LocalCluster(groups=1, slaves=0, namesrvs=1,
                                broker_config=SHORT_LIVED_BROKER_CONFIG,
                                broker_jvm_flags=SHORT_LIVED_BROKER_FLAGS) as c:
            node = c.broker("broker-a")
            race.assert_retried_for_taken_ports()
            assert node.port == race.picks[-1]
            await c.create_topic("T_cluster_port_retry", queues=1)
            async with AdminClient(c.namesrv_addr) as admin:
                await admin.instance.update_route("T_cluster_port_retry")
                assert await admin.instance.find_broker_master(
                    "broker-a", "T_cluster_port_retry") == node.addr

"""Rebalance churn: members join and leave every 2-5 s while messages flow.

Concurrent: three rmq_async members and the Java ``DefaultMQPushConsumer``; nothing lost,
duplicates only in queues that changed hands. Orderly: four rmq_async members; no queue is
consumed by two members at once (listener intervals per queue do not overlap), and per key
the order holds (a step back only at a handover)."""

from __future__ import annotations

import asyncio
import collections
import itertools
import random
import time
from typing import Any

import pytest

from rmq_async import ConsumeResult, Message, MessageExt, Producer, PushConsumer
from rmq_async.devbroker import LocalRocketMQ
from rmq_async.devbroker.java import JavaProcess, start_java
from rmq_async.protocol.types import MessageQueue
from tests.broker.test_orderly import Recorder, _body, _check_exclusive, by_key_hash
from tests.chaos.common import FULL, consumer, offsets_settled, produce_paced, report, scaled
from tests.chaos.conftest import JavaClasses
from tests.helpers import JAVA_CONSUMER_FLAGS, unique

# The churn scenarios take most of a minute even at their small sizes: they run with
# `make chaos`, which keeps `make test` within its time budget.
pytestmark = [pytest.mark.broker, pytest.mark.chaos,
              pytest.mark.skipif(not FULL, reason="rebalance churn runs with make chaos")]

CHURN_SECONDS = scaled(20, 60)


async def _churn(members: list[str], join: Any, leave: Any, running: set[str],
                 seconds: float, rng: random.Random) -> int:
    """Toggle a random member every 2-5 s for ``seconds``; returns the number of changes."""
    changes = 0
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        await asyncio.sleep(rng.uniform(2.0, 5.0))
        name = rng.choice(members)
        if name in running and len(running) > 1:
            await leave(name)
        elif name not in running:
            await join(name)
        changes += 1
    return changes


@pytest.mark.timeout(900 if FULL else 240)
async def test_churn_with_a_java_member(rocketmq: LocalRocketMQ, java_classes: JavaClasses) -> None:
    ns = rocketmq.namesrv_addr
    topic = unique("T_chaos_churn")
    await rocketmq.create_topic(topic, queues=8)
    group = unique("G_chaos_churn")
    n = scaled(20_000, 200_000)
    seen: collections.Counter[tuple[int, int]] = collections.Counter()
    owners: dict[int, set[str]] = collections.defaultdict(set)
    py: dict[str, PushConsumer] = {}
    java: JavaProcess | None = None
    java_lines: list[list[str]] = []
    running: set[str] = set()
    generation = itertools.count()

    def listener(member: str) -> Any:
        async def on(msgs: list[MessageExt]) -> ConsumeResult:
            for m in msgs:
                seen[(m.queue_id, m.queue_offset)] += 1
                owners[m.queue_id].add(member)
            return ConsumeResult.SUCCESS
        return on

    def java_seen() -> collections.Counter[tuple[int, int]]:
        out: collections.Counter[tuple[int, int]] = collections.Counter()
        for gen, lines in enumerate(java_lines):
            for line in lines:
                if line.startswith("MSG "):
                    _, q, off, _ = line.split(" ", 3)
                    out[(int(q), int(off))] += 1
                    owners[int(q)].add(f"java#{gen}")
        return out

    async def join(name: str) -> None:
        nonlocal java
        if name == "java":
            java = start_java("JavaPushConsumer", [ns, group, topic, f"java-{next(generation)}",
                                                   "CONSUME_FROM_FIRST_OFFSET"],
                              java_classes.classpath, jvm_flags=JAVA_CONSUMER_FLAGS)
            await java.__aenter__()
            java_lines.append(java.lines)
            await java.wait_for("READY", 60)
        else:
            member = f"{name}#{next(generation)}"
            c = consumer(ns, group, instance_name=member.replace("#", "-"))
            c.subscribe(topic, listener=listener(member))
            await c.start()
            py[name] = c
        running.add(name)

    async def leave(name: str) -> None:
        nonlocal java
        running.discard(name)
        if name == "java":
            assert java is not None
            await java.stop()
            java = None
        else:
            await py.pop(name).stop()

    members = ["py1", "py2", "py3", "java"]
    rng = random.Random(7)
    try:
        for name in members:
            await join(name)
        producing = asyncio.create_task(produce_paced(
            ns, topic, [b"c%08d" % i for i in range(n)], CHURN_SECONDS * 0.8))
        changes = await _churn(members, join, leave, running, CHURN_SECONDS, rng)
        placed = await producing
        for name in members:
            if name not in running:
                await join(name)
        settle_started = time.monotonic()
        deadline = settle_started + (600 if FULL else 120)
        while True:
            total = seen + java_seen()
            if all(p in total for p in placed):
                break
            assert time.monotonic() < deadline, \
                f"{sum(1 for p in placed if p not in total)} messages never consumed"
            await asyncio.sleep(0.5)
        settled = time.monotonic() - settle_started
    finally:
        for name in list(running):
            await leave(name)
    total = seen + java_seen()
    committed, maxes = await offsets_settled(ns, group, topic)
    dups = {p: v - 1 for p, v in total.items() if v > 1}
    changed = {q for q, o in owners.items() if len(o) > 1}
    report("churn-concurrent+java", sent=n, lost=sum(1 for p in placed if p not in total),
           duplicates=sum(dups.values()), recovery=settled,
           extra=f"membership_changes={changes} queues_changed_hands={len(changed)} "
                 f"java_msgs={sum(java_seen().values())}")
    assert all(p in total for p in placed)
    assert {q for q, _ in dups} <= changed
    assert committed == maxes
    assert any(o for o in owners.values() if any(m.startswith("java") for m in o))


async def _produce_ordered(namesrv: str, topic: str, keys: int, per_key: int,
                           seconds: float) -> None:
    async with Producer(unique("PG_chaos_ord"), namesrv) as producer:
        queues = await producer.instance.publish_queues(topic)
        per_queue: dict[MessageQueue, list[Message]] = collections.defaultdict(list)
        for seq in range(per_key):
            for key in range(keys):
                msg = Message(topic, _body(key, seq), keys=[f"order-{key}"], tags="o")
                per_queue[by_key_hash(queues, msg)].append(msg)

        async def send_queue(mq: MessageQueue, msgs: list[Message]) -> None:
            pause = seconds / max(1, len(msgs) // 100)
            for i in range(0, len(msgs), 100):
                await producer.send_batch(msgs[i:i + 100], queue=mq)
                await asyncio.sleep(pause)

        await asyncio.gather(*(send_queue(mq, msgs) for mq, msgs in per_queue.items()))


def _order_violations(rec: Recorder, keys: int, per_key: int) -> tuple[int, int, int]:
    """(violations, duplicates, missing): a violation is a gap, or a step back by the same
    member (a step back is allowed only where another member took over)."""
    violations = duplicates = missing = 0
    for key in range(keys):
        got = rec.deliveries[key]
        for (prev, prev_client), (seq, client) in itertools.pairwise(got):
            if seq == prev + 1:
                continue
            if seq > prev + 1 or client == prev_client:
                violations += 1
        seqs = {s for s, _ in got}
        missing += per_key - len(seqs)
        duplicates += len(got) - len(seqs)
    return violations, duplicates, missing


@pytest.mark.timeout(900 if FULL else 240)
async def test_orderly_churn_keeps_queues_exclusive_and_keys_ordered(
        rocketmq: LocalRocketMQ) -> None:
    ns = rocketmq.namesrv_addr
    topic = unique("T_chaos_ochurn")
    await rocketmq.create_topic(topic, queues=8, order=True)
    group = unique("G_chaos_ochurn")
    keys, per_key = 200, scaled(100, 1000)
    rec = Recorder()
    py: dict[str, PushConsumer] = {}
    running: set[str] = set()
    generation = itertools.count()

    async def join(name: str) -> None:
        member = f"{name}-{next(generation)}"
        c = consumer(ns, group, instance_name=member, consume_message_batch_max_size=4)
        c.subscribe(topic, listener=rec.listener(member), orderly=True)
        await c.start()
        py[name] = c
        running.add(name)

    async def leave(name: str) -> None:
        running.discard(name)
        await py.pop(name).stop()

    members = ["o1", "o2", "o3", "o4"]
    rng = random.Random(11)
    try:
        for name in members:
            await join(name)
        producing = asyncio.create_task(_produce_ordered(ns, topic, keys, per_key,
                                                         CHURN_SECONDS * 0.8))
        changes = await _churn(members, join, leave, running, CHURN_SECONDS, rng)
        await producing
        for name in members:
            if name not in running:
                await join(name)
        settle_started = time.monotonic()
        deadline = settle_started + (600 if FULL else 120)
        while any(len({s for s, _ in rec.deliveries[k]}) < per_key for k in range(keys)):
            assert time.monotonic() < deadline, "not every message was consumed"
            await asyncio.sleep(0.5)
        settled = time.monotonic() - settle_started
    finally:
        for name in list(running):
            await leave(name)
    violations, dups, missing = _order_violations(rec, keys, per_key)
    committed, maxes = await offsets_settled(ns, group, topic)
    changed = sorted(q for q, spans in rec.intervals.items() if len({c for *_, c in spans}) > 1)
    report("churn-orderly", sent=keys * per_key, lost=missing, duplicates=dups,
           recovery=settled,
           extra=f"membership_changes={changes} order_violations={violations} "
                 f"overlaps={len(rec.overlaps)} queues_changed_hands={len(changed)}")
    assert missing == 0
    assert violations == 0
    _check_exclusive(rec)
    assert changed, "no queue changed hands"
    assert committed == maxes

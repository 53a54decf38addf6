"""Handlers that read like Python, typed payloads and middlewares, against the real broker."""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import json
import time

import msgpack
import msgspec
import pydantic
import pytest

from rmq_async import (
    CallNext,
    ConsumeCall,
    ConsumeContext,
    DeadLetter,
    Message,
    MessageExt,
    Producer,
    PushConsumer,
)
from rmq_async.consumer.dead_letter import PROPERTY_DLQ_REASON
from rmq_async.payloads import CONTENT_TYPE_MSGPACK, PROPERTY_CONTENT_TYPE
from rmq_async.protocol.types import PROPERTY_ORIGIN_MESSAGE_ID, PROPERTY_RETRY_TOPIC, MessageQueue
from tests.helpers import AdminClient, produce, unique, wait_until

pytestmark = pytest.mark.broker


def _consumer(namesrv: str, group: str, **opts: object) -> PushConsumer:
    opts.setdefault("consume_from_where", "CONSUME_FROM_FIRST_OFFSET")
    opts.setdefault("rebalance_interval", 2.0)
    return PushConsumer(group, namesrv=namesrv, **opts)  # type: ignore[arg-type]


async def _dlq(namesrv: str, broker_name: str, group: str, via_topic: str,
               expect: int, timeout: float = 30.0) -> list[MessageExt]:
    """The messages of ``%DLQ%<group>``, read back raw once ``expect`` of them are there."""
    mq = MessageQueue(f"%DLQ%{group}", broker_name, 0)
    found: list[MessageExt] = []
    async with AdminClient(namesrv) as admin:
        addr = await admin.instance.find_broker_master(broker_name, via_topic)
        deadline = time.monotonic() + timeout
        while True:
            try:
                r = await admin.instance.api.pull_message(
                    addr, group=unique("G_dlqread"), mq=mq, queue_offset=0, max_msg_nums=64,
                    suspend_timeout=0, subscription="*")
                found = r.decode()
            except Exception:
                found = []  # the DLQ topic does not exist yet
            if len(found) >= expect or time.monotonic() > deadline:
                return found
            await asyncio.sleep(0.3)


# ---------------------------------------------------------------------------------- item 1


async def test_a_handler_without_return_acknowledges_once(rocketmq) -> None:
    topic = unique("T_noreturn")
    await rocketmq.create_topic(topic, queues=4)
    group = unique("G_noreturn")
    placed = await produce(rocketmq.namesrv_addr, topic,
                           [Message(topic, f"m{i}".encode()) for i in range(1000)])
    seen: collections.Counter[tuple[int, int]] = collections.Counter()
    consumer = _consumer(rocketmq.namesrv_addr, group, consume_message_batch_max_size=8)

    @consumer.subscribe(topic)
    async def on(msg: MessageExt):  # type: ignore[no-untyped-def]
        seen[(msg.queue_id, msg.queue_offset)] += 1

    async with consumer:
        await wait_until(lambda: len(seen) >= 1000, 60, what="1000 messages")
        await asyncio.sleep(0.5)  # any retry of an acknowledged message would show here
    assert set(seen) == set(placed) and all(n == 1 for n in seen.values())

    # The same group again: nothing old comes back. One new message per queue marks the end.
    again: list[tuple[int, int, bytes]] = []
    c2 = _consumer(rocketmq.namesrv_addr, group)

    @c2.subscribe(topic)
    async def on2(msg: MessageExt) -> None:
        again.append((msg.queue_id, msg.queue_offset, msg.body))

    async with c2:
        async with Producer(unique("PG"), rocketmq.namesrv_addr) as p:
            for q in range(4):
                await p.send(Message(topic, b"marker"),
                             queue=MessageQueue(topic, rocketmq.broker_name, q))
        await wait_until(lambda: len(again) >= 4, 60, what="the four markers")
        await asyncio.sleep(0.3)
    assert [b for _, _, b in again] == [b"marker"] * 4
    assert sorted(q for q, _, _ in again) == [0, 1, 2, 3]


async def test_a_raising_handler_gets_the_message_back_once_retried(rocketmq) -> None:
    topic = unique("T_raise")
    await rocketmq.create_topic(topic, queues=1)
    attempts: list[tuple[bytes, int]] = []
    consumer = _consumer(rocketmq.namesrv_addr, unique("G_raise"))

    @consumer.subscribe(topic)
    async def on(msg: MessageExt) -> None:
        attempts.append((msg.body, msg.reconsume_times))
        if msg.reconsume_times == 0:
            raise RuntimeError("first attempt fails")

    async with consumer:
        async with Producer(unique("PG"), rocketmq.namesrv_addr) as p:
            await p.send(Message(topic, b"flaky"))
        await wait_until(lambda: len(attempts) >= 2, 30, what="the redelivery")
        await asyncio.sleep(1.2)  # a further retry would arrive within a delay level (1 s)
    assert attempts == [(b"flaky", 0), (b"flaky", 1)]


async def test_per_message_handler_fails_only_its_message_in_a_batch(rocketmq) -> None:
    topic = unique("T_pm")
    await rocketmq.create_topic(topic, queues=1)
    await produce(rocketmq.namesrv_addr, topic,
                  [Message(topic, f"{i}".encode()) for i in range(20)], batch=20)
    seen: list[tuple[int, int]] = []
    consumer = _consumer(rocketmq.namesrv_addr, unique("G_pm"),
                         consume_message_batch_max_size=32)

    @consumer.subscribe(topic)
    async def on(msg: MessageExt, ctx: ConsumeContext) -> None:
        assert ctx.message is msg and ctx.messages == [msg]
        i = int(msg.body)
        seen.append((i, msg.reconsume_times))
        if i == 7 and msg.reconsume_times == 0:
            raise ValueError("seven fails once")

    async with consumer:
        await wait_until(lambda: len(seen) >= 21, 30, what="20 messages and one retry")
        await asyncio.sleep(1.2)
    counts = collections.Counter(i for i, _ in seen)
    assert counts[7] == 2 and all(counts[i] == 1 for i in range(20) if i != 7)
    assert (7, 1) in seen


async def test_two_handlers_by_tag_and_overlap_rejected(rocketmq) -> None:
    topic = unique("T_bytag")
    await rocketmq.create_topic(topic, queues=4)
    msgs = [Message(topic, f"{i}".encode(), tags=["a", "b", "c"][i % 3]) for i in range(300)]
    await produce(rocketmq.namesrv_addr, topic, msgs, batch=1, concurrency=16)
    got_a: list[str | None] = []
    got_b: list[str | None] = []
    consumer = _consumer(rocketmq.namesrv_addr, unique("G_bytag"),
                         consume_message_batch_max_size=4)

    @consumer.subscribe(topic, tags="a")
    async def on_a(msg: MessageExt) -> None:
        got_a.append(msg.tags)

    @consumer.subscribe(topic, tags="b", batch=True)
    async def on_b(batch: list[MessageExt]) -> None:
        got_b.extend(m.tags for m in batch)

    for tags in ("a", "b || d", "*"):
        with pytest.raises(ValueError, match="already subscribed"):
            consumer.subscribe(topic, tags=tags)(on_a)
    with pytest.raises(ValueError, match="already subscribed"):
        consumer.subscribe(topic, sql="TRUE")(on_a)
    assert consumer.subscription_data(topic).tags_set == ["a", "b"]  # type: ignore[union-attr]

    async with consumer:
        await wait_until(lambda: len(got_a) >= 100 and len(got_b) >= 100, 60,
                         what="both tags")
        await asyncio.sleep(0.5)
    assert got_a == ["a"] * 100 and got_b == ["b"] * 100


async def test_sql_subscription_gets_only_matching_messages(rocketmq) -> None:
    topic = unique("T_sql")
    await rocketmq.create_topic(topic, queues=2)
    msgs = [Message(topic, f"{i}".encode(), properties={"n": str(i), "color": ["red", "blue"][i % 2]})
            for i in range(200)]
    await produce(rocketmq.namesrv_addr, topic, msgs, batch=1, concurrency=16)
    wanted = {i for i in range(200) if i >= 150 and i % 2 == 0}
    got: list[int] = []
    consumer = _consumer(rocketmq.namesrv_addr, unique("G_sql"))

    @consumer.subscribe(topic, sql="n >= 150 AND color = 'red'")
    async def on(msg: MessageExt) -> None:
        got.append(int(msg.body))

    assert consumer.subscription_data(topic).expression_type == "SQL92"  # type: ignore[union-attr]
    async with consumer:
        await wait_until(lambda: len(got) >= len(wanted), 60, what="matching messages")
        await asyncio.sleep(0.5)
    assert sorted(got) == sorted(wanted)


# ---------------------------------------------------------------------------------- item 2


class PydOrder(pydantic.BaseModel):
    id: int
    item: str
    qty: int


@dataclasses.dataclass
class DcOrder:
    id: int
    item: str
    qty: int


class StructOrder(msgspec.Struct):
    id: int
    item: str
    qty: int


async def test_typed_payloads_and_poison_to_the_dlq(rocketmq) -> None:
    topic = unique("T_typed")
    await rocketmq.create_topic(topic, queues=4)
    msgs: list[Message] = []
    for i in range(1000):
        order = {"id": i, "item": f"item-{i % 7}", "qty": i % 5 + 1}
        if i % 100 == 0:  # some bodies in msgpack, as their content type says
            msgs.append(Message(topic, msgpack.packb(order), keys=f"ok{i}",
                                properties={PROPERTY_CONTENT_TYPE: CONTENT_TYPE_MSGPACK}))
        else:
            msgs.append(Message(topic, json.dumps(order).encode(), keys=f"ok{i}"))
    bad_bodies = [b"{not json", b"[]", b'{"id": 1}', b'{"id": 1, "item": "i", "qty": 1',
                  b"  ", b"null", b'{"id": 1, "item": "i"}', b"\xff\xfe", b'"text"', b"42"]
    msgs.extend(Message(topic, body, keys=f"bad{k}") for k, body in enumerate(bad_bodies))
    await produce(rocketmq.namesrv_addr, topic, msgs, batch=32)

    models: list[type] = [PydOrder, DcOrder, StructOrder]
    consumers = []
    got: dict[type, dict[int, object]] = {m: {} for m in models}
    attempts: dict[type, collections.Counter[str]] = {m: collections.Counter() for m in models}
    groups = {m: unique(f"G_typed_{m.__name__}") for m in models}
    for model in models:
        c = _consumer(rocketmq.namesrv_addr, groups[model], consume_message_batch_max_size=16)

        def attach(c: PushConsumer, model: type) -> None:
            @c.middleware
            async def count(call: ConsumeCall, call_next: CallNext) -> None:
                for m in call.messages:
                    attempts[model][m.keys[0]] += 1
                await call_next(call)

            @c.subscribe(topic, model=model)
            async def on(order: object, ctx: ConsumeContext) -> None:
                assert isinstance(order, model) and ctx.message is not None
                got[model][order.id] = order  # type: ignore[attr-defined]

        attach(c, model)
        consumers.append(c)
    for c in consumers:
        await c.start()
    try:
        for model in models:
            await wait_until(lambda m=model: len(got[m]) >= 1000, 60,  # type: ignore[misc]
                             what=f"1000 {model.__name__}s")
        dlqs = {m: await _dlq(rocketmq.namesrv_addr, rocketmq.broker_name, groups[m], topic,
                               expect=10) for m in models}
        await asyncio.sleep(1.2)  # a retry of a poison message would arrive within 1 s
    finally:
        for c in consumers:
            await c.stop()
    for model in models:
        assert set(got[model]) == set(range(1000))
        dead = dlqs[model]
        assert sorted(m.keys[0] for m in dead) == sorted(f"bad{k}" for k in range(10))
        for m in dead:
            reason = m.properties.get(PROPERTY_DLQ_REASON, "")
            assert reason.startswith(f"payload not decodable as {model.__name__}"), reason
            assert m.properties.get(PROPERTY_RETRY_TOPIC) == topic
            assert m.properties.get(PROPERTY_ORIGIN_MESSAGE_ID)
            assert attempts[model][m.keys[0]] == 1  # one attempt, no retry
        assert all(n == 1 for k, n in attempts[model].items() if k.startswith("bad"))


# ---------------------------------------------------------------------------------- item 3


async def test_middlewares_time_every_call_and_route_errors_to_the_dlq(rocketmq) -> None:
    topic = unique("T_mw")
    await rocketmq.create_topic(topic, queues=2)
    n = 200
    await produce(rocketmq.namesrv_addr, topic,
                  [Message(topic, f"{i}".encode(), keys=f"k{i}") for i in range(n)])
    group = unique("G_mw")
    consumer = _consumer(rocketmq.namesrv_addr, group, consume_message_batch_max_size=8)
    timings: list[tuple[str, int, float, str]] = []
    order: list[str] = []

    @consumer.middleware
    async def timing(call: ConsumeCall, call_next: CallNext) -> None:
        order.append("timing:before")
        began = time.perf_counter()
        outcome = "ok"
        try:
            await call_next(call)
        except BaseException as exc:
            outcome = type(exc).__name__
            raise
        finally:
            timings.append((call.handler_name, len(call.messages), time.perf_counter() - began,
                            outcome))
            assert call.group == group and call.topic == topic and not call.orderly
            assert call.queue.topic == topic

    async def errors_to_dlq(call: ConsumeCall, call_next: CallNext) -> None:
        order.append("errors:before")
        try:
            await call_next(call)
        except ValueError as exc:
            raise DeadLetter(f"ValueError: {exc}") from exc

    consumer.add_middleware(errors_to_dlq)
    handled: list[int] = []

    @consumer.subscribe(topic)
    async def on(msg: MessageExt) -> None:
        i = int(msg.body)
        if i % 40 == 0:
            raise ValueError(f"bad order {i}")
        await asyncio.sleep(0.001)
        handled.append(i)

    async with consumer:
        await wait_until(lambda: len(timings) >= n, 60, what="a timing per call")
        dead = await _dlq(rocketmq.namesrv_addr, rocketmq.broker_name, group, topic, expect=5)
        await asyncio.sleep(1.2)
    assert order[:2] == ["timing:before", "errors:before"]  # first registered is outermost
    assert len(timings) == n  # every call once: nothing retried
    assert all(name.endswith("on") and k == 1 and 0 < dt < 5 for name, k, dt, _ in timings)
    assert sum(dt >= 0.001 for _, _, dt, o in timings if o == "ok") == n - 5
    assert collections.Counter(o for *_, o in timings) == {"ok": n - 5, "DeadLetter": 5}
    assert sorted(handled) == [i for i in range(n) if i % 40]
    assert sorted(m.keys[0] for m in dead) == sorted(f"k{i}" for i in range(0, n, 40))
    assert all(m.properties[PROPERTY_DLQ_REASON] == f"ValueError: bad order {int(m.body)}"
               for m in dead)


async def test_middleware_around_orderly_batch_handler(rocketmq) -> None:
    topic = unique("T_mworder")
    await rocketmq.create_topic(topic, queues=1)
    await produce(rocketmq.namesrv_addr, topic,
                  [Message(topic, f"{i}".encode()) for i in range(30)], batch=30)
    calls: list[tuple[bool, list[int]]] = []
    bodies: list[int] = []
    group = unique("G_mworder")
    consumer = _consumer(rocketmq.namesrv_addr, group,
                         consume_message_batch_max_size=5,
                         suspend_current_queue_time=0.1)
    failed_once = False

    @consumer.middleware
    async def record(call: ConsumeCall, call_next: CallNext) -> None:
        calls.append((call.orderly, [int(m.body) for m in call.messages]))
        await call_next(call)

    @consumer.subscribe(topic, orderly=True)
    async def on(batch: list[MessageExt]) -> None:
        nonlocal failed_once
        if int(batch[0].body) == 10 and not failed_once:
            failed_once = True
            raise RuntimeError("suspend once")
        if int(batch[0].body) == 20:
            raise DeadLetter("orderly poison")
        bodies.extend(int(m.body) for m in batch)

    async with consumer:
        await wait_until(lambda: len(bodies) >= 25, 60, what="25 messages in order")
        dead = await _dlq(rocketmq.namesrv_addr, rocketmq.broker_name, group, topic, expect=5)
    assert bodies == [i for i in range(30) if not 20 <= i < 25]
    assert all(orderly for orderly, _ in calls)
    assert [c for _, c in calls].count([10, 11, 12, 13, 14]) == 2
    assert [c for _, c in calls].count([20, 21, 22, 23, 24]) == 1  # not retried
    assert sorted(int(m.body) for m in dead) == [20, 21, 22, 23, 24]
    assert {m.properties[PROPERTY_DLQ_REASON] for m in dead} == {"orderly poison"}

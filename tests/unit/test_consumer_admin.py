"""Broker-initiated requests answered by a (not started) consumer, without a broker."""

from __future__ import annotations

import asyncio
import json
import re
import types
from typing import Any

import pytest

from rmq_async import ConsumeResult, MessageExt, PushConsumer
from rmq_async.consumer import admin as admin_module
from rmq_async.consumer.admin import BrokerRequestHandler, build_running_info
from rmq_async.protocol.codes import RequestCode, ResponseCode
from rmq_async.protocol.command import RemotingCommand
from rmq_async.protocol.headers import (
    ConsumeMessageDirectlyResultRequestHeader,
    GetConsumerRunningInfoRequestHeader,
)
from rmq_async.protocol.message import encode_stored_message
from rmq_async.protocol.types import PROPERTY_RETRY_TOPIC, PROPERTY_UNIQ_KEY
from rmq_async.remoting.connection import Connection


class _Conn:
    addr = "127.0.0.1:10911"


def _consumer(**opts: Any) -> PushConsumer:
    c = PushConsumer("G_admin", namesrv="127.0.0.1:9876;127.0.0.2:9876", **opts)
    # What start() sets up before any broker can ask: the retry topic's subscription.
    c.subscriptions.reset_retry()
    return c


async def _ask(c: PushConsumer, cmd: RemotingCommand) -> RemotingCommand | None:
    handler = BrokerRequestHandler(c)
    conn: Connection = _Conn()  # type: ignore[assignment]
    return await handler(cmd, conn)


def test_running_info_properties_and_no_secret() -> None:
    c = _consumer(credentials=("my-access-key", "my-very-secret-key"), consume_concurrency=7)
    c.subscribe("T1", tags="a || b", listener=lambda msgs: ConsumeResult.SUCCESS)
    c.subscribe("T2", listener=lambda msgs: ConsumeResult.SUCCESS, orderly=True)
    info = build_running_info(c)
    props = info.properties
    assert props["PROP_CONSUME_TYPE"] == "CONSUME_PASSIVELY"
    assert props["PROP_CONSUMEORDERLY"] == "false"  # one topic is consumed concurrently
    assert props["PROP_THREADPOOL_CORE_SIZE"] == "7"
    assert props["PROP_NAMESERVER_ADDR"] == "127.0.0.1:9876;127.0.0.2:9876;"
    assert props["PROP_CLIENT_VERSION"] == "V5_3_3"
    assert props["consumerGroup"] == "G_admin" and props["pullBatchSize"] == "32"
    assert props["accessKey"] == "my-access-key"
    # Settings with a Java name under it, in Java's unit, as Java's object2Properties of the
    # DefaultMQPushConsumer writes them (they were written in seconds under camelCased names
    # of this library's options: consumeTimeout=900.0 where Java shows 15).
    assert (props["consumeTimeout"], props["pullInterval"]) == ("15", "0")
    assert (props["persistConsumerOffsetInterval"], props["heartbeatBrokerInterval"],
            props["pollNameServerInterval"], props["mqClientApiTimeout"],
            props["suspendCurrentQueueTimeMillis"]) == ("5000", "30000", "30000", "3000", "1000")
    assert props["consumeThreadMin"] == props["consumeThreadMax"] == "7"
    assert re.fullmatch(r"\d{14}", props["consumeTimestamp"])
    assert props["useTLS"] == "false" and props["pullThresholdSizeForQueue"] == "100"
    assert not {"consumeConcurrency", "apiTimeout", "heartbeatInterval", "tls"} & set(props)
    assert props["brokerSuspendMaxTime"] == "15.0"  # no Java setting: this library's seconds
    odd = build_running_info(_consumer(consume_timeout=90, consume_timestamp="20240102030405"))
    assert (odd.properties["consumeTimeout"], odd.properties["consumeTimestamp"]) == (
        "1.5", "20240102030405")
    body = info.to_json_bytes()
    assert b"my-very-secret-key" not in body
    subs = {s["topic"]: s["subString"] for s in json.loads(body)["subscriptionSet"]}
    assert subs == {"T1": "a || b", "T2": "*", "%RETRY%G_admin": "*"}
    assert set(info.status_table) == {"T1", "T2", "%RETRY%G_admin"}


def test_running_info_of_an_orderly_consumer() -> None:
    c = _consumer()
    c.subscribe("T2", listener=lambda msgs: ConsumeResult.SUCCESS, orderly=True)
    assert build_running_info(c).properties["PROP_CONSUMEORDERLY"] == "true"
    assert c.is_orderly(c.retry_topic)


async def test_running_info_request_for_another_group_is_refused() -> None:
    c = _consumer()
    c.subscribe("T1", listener=lambda msgs: ConsumeResult.SUCCESS)
    ext = GetConsumerRunningInfoRequestHeader(consumer_group="other", client_id="x").to_ext_fields()
    resp = await _ask(c, RemotingCommand.request(RequestCode.GET_CONSUMER_RUNNING_INFO, ext))
    assert resp is not None and resp.code == ResponseCode.SYSTEM_ERROR
    assert resp.remark == "The Consumer Group <other> not exist in this consumer"
    ext = GetConsumerRunningInfoRequestHeader(consumer_group="G_admin", client_id="x",
                                              jstack_enable=True).to_ext_fields()
    resp = await _ask(c, RemotingCommand.request(RequestCode.GET_CONSUMER_RUNNING_INFO, ext))
    assert resp is not None and resp.code == ResponseCode.SUCCESS
    assert "test_running_info_request_for_another_group" in json.loads(resp.body)["jstack"]


async def test_consumer_status_is_the_held_offsets_of_a_topic_or_of_all_as_java_answers(
) -> None:
    """GET_CONSUMER_STATUS_FROM_CLIENT: the topic's offsets; a blank topic, every topic's;
    another group, an empty table with SUCCESS (Java's ``MQClientInstance.getConsumerStatus``)."""
    from rmq_async.protocol.bodies import GetConsumerStatusBody
    from rmq_async.protocol.headers import GetConsumerStatusRequestHeader
    from rmq_async.protocol.types import MessageQueue

    c = _consumer()
    c.subscribe("T1", listener=lambda msgs: ConsumeResult.SUCCESS)
    held = {MessageQueue("T1", "b", 0): 5, MessageQueue("T1", "b", 1): 7,
            MessageQueue("T2", "b", 0): 9}
    # The store's table, as the handler reads it (a started consumer's store).
    c.offset_store = types.SimpleNamespace(snapshot=lambda: dict(held))  # type: ignore[assignment]

    async def status(group: str, topic: str) -> dict[MessageQueue, int]:
        ext = GetConsumerStatusRequestHeader(topic=topic, group=group).to_ext_fields()
        resp = await _ask(c, RemotingCommand.request(RequestCode.GET_CONSUMER_STATUS_FROM_CLIENT,
                                                     ext))
        assert resp is not None and resp.code == ResponseCode.SUCCESS, resp
        return GetConsumerStatusBody.from_json_bytes(resp.body).message_queue_table

    assert await status("G_admin", "T1") == {mq: o for mq, o in held.items() if mq.topic == "T1"}
    assert await status("G_admin", "") == held
    assert await status("other", "T1") == {}


async def test_unknown_and_malformed_requests_get_typed_answers() -> None:
    c = _consumer()
    resp = await _ask(c, RemotingCommand.request(9999))
    assert resp is not None and resp.code == ResponseCode.REQUEST_CODE_NOT_SUPPORTED
    resp = await _ask(c, RemotingCommand.request(RequestCode.GET_CONSUMER_RUNNING_INFO, {}))
    assert resp is not None and resp.code == ResponseCode.SYSTEM_ERROR
    assert "consumerGroup" in (resp.remark or "")


def _stored(topic: str, body: bytes, **props: str) -> bytes:
    msg = MessageExt(topic=topic, body=body, queue_id=2, queue_offset=17,
                     properties={PROPERTY_UNIQ_KEY: "ABC123", **props},
                     born_host="127.0.0.1:5000", store_host="127.0.0.1:10911")
    return encode_stored_message(msg)


async def test_consume_message_directly_runs_the_listener_once() -> None:
    c = _consumer()
    calls: list[tuple[str, bytes, str]] = []

    def on(msgs: list[MessageExt]) -> ConsumeResult:
        calls.append((msgs[0].topic, msgs[0].body, msgs[0].broker_name))
        if msgs[0].body == b"boom":
            raise ValueError("cannot")
        return ConsumeResult.RECONSUME_LATER if msgs[0].body == b"later" else ConsumeResult.SUCCESS

    c.subscribe("T1", listener=on)
    ext = ConsumeMessageDirectlyResultRequestHeader(
        consumer_group="G_admin", client_id="cid", msg_id="X", broker_name="broker-a",
        topic="T1").to_ext_fields()
    results = []
    for body, topic, props in [(b"ok", "T1", {}), (b"later", "T1", {}), (b"boom", "T1", {}),
                               (b"retried", c.retry_topic, {PROPERTY_RETRY_TOPIC: "T1"})]:
        cmd = RemotingCommand.request(RequestCode.CONSUME_MESSAGE_DIRECTLY, ext,
                                      body=_stored(topic, body, **props))
        resp = await _ask(c, cmd)
        assert resp is not None and resp.code == ResponseCode.SUCCESS
        results.append(json.loads(resp.body))
    assert [r["consumeResult"] for r in results] == [
        "CR_SUCCESS", "CR_LATER", "CR_THROW_EXCEPTION", "CR_SUCCESS"]
    assert "ValueError: cannot" in results[2]["remark"]
    assert all(r["order"] is False and r["autoCommit"] is True for r in results)
    # A redelivered message gets its original topic back before the listener sees it.
    assert calls == [("T1", b"ok", "broker-a"), ("T1", b"later", "broker-a"),
                     ("T1", b"boom", "broker-a"), ("T1", b"retried", "broker-a")]

    cmd = RemotingCommand.request(RequestCode.CONSUME_MESSAGE_DIRECTLY, ext,
                                  body=_stored("T9", b"x"))
    resp = await _ask(c, cmd)
    assert resp is not None and resp.code == ResponseCode.SYSTEM_ERROR
    cmd = RemotingCommand.request(RequestCode.CONSUME_MESSAGE_DIRECTLY, ext, body=b"\x00\x01")
    resp = await _ask(c, cmd)
    assert resp is not None and resp.code == ResponseCode.SYSTEM_ERROR
    assert len(calls) == 4


async def test_consume_message_directly_goes_through_the_middlewares_and_sees_poison() -> None:
    """As consumption would: a middleware that unwraps the body runs first, and a body the
    handler's model cannot read is reported (the message would go to the dead-letter queue),
    not called a success."""
    import dataclasses

    @dataclasses.dataclass
    class Order:
        id: int

    c = _consumer()
    seen: list[Any] = []

    @c.middleware
    async def unwrap(call: Any, call_next: Any) -> None:
        for m in call.messages:
            m.body = m.body.removeprefix(b"env:")
        await call_next(call)

    @c.subscribe("T1", model=Order, batch=True)
    async def on(orders: list[Order]) -> None:
        seen.extend(orders)

    ext = ConsumeMessageDirectlyResultRequestHeader(
        consumer_group="G_admin", client_id="cid", msg_id="X", broker_name="broker-a",
        topic="T1").to_ext_fields()
    answers = []
    for body in (b'env:{"id": 3}', b"env:not json"):
        cmd = RemotingCommand.request(RequestCode.CONSUME_MESSAGE_DIRECTLY, ext,
                                      body=_stored("T1", body))
        resp = await _ask(c, cmd)
        assert resp is not None and resp.code == ResponseCode.SUCCESS
        answers.append(json.loads(resp.body))
    assert seen == [Order(3)]
    assert answers[0]["consumeResult"] == "CR_SUCCESS"
    assert answers[1]["consumeResult"] == "CR_THROW_EXCEPTION"
    assert answers[1]["remark"].startswith("dead letter: payload not decodable as Order")


async def test_an_offset_reset_and_a_rebalance_round_do_not_interleave(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A round that ran while a reset had removed a queue but not yet persisted its new
    offset would take the queue again from the broker's old offset: the reset would be lost.
    The round waits for the reset (Java suspends the rebalance for one)."""
    import asyncio
    from types import SimpleNamespace

    from rmq_async.consumer.options import ConsumerOptions, MessageModel
    from rmq_async.consumer.process_queue import ProcessQueue
    from rmq_async.consumer.rebalance import Rebalancer
    from rmq_async.protocol.types import MessageQueue

    mq = MessageQueue("T", "broker-a", 0)
    broker = {mq: 100}  # the committed offset the broker holds
    memory: dict[MessageQueue, int] = {}
    gate = asyncio.Event()

    async def persist(q: MessageQueue) -> None:
        await gate.wait()  # the UPDATE_CONSUMER_OFFSET round trip, held open by the test
        if q in memory:
            broker[q] = memory[q]

    async def from_broker(q: MessageQueue) -> int:
        return broker[q]

    store = SimpleNamespace(freeze=memory.__setitem__, persist=persist,
                            remove=lambda q: memory.pop(q, None))
    started: list[tuple[MessageQueue, int]] = []

    async def stop_queue(q: MessageQueue) -> None:
        return None

    pull = SimpleNamespace(stop_queue=stop_queue,
                           start_queue=lambda req: started.append((req.mq, req.next_offset)))
    rt = SimpleNamespace(
        group="G", stopping=False, options=ConsumerOptions.from_kwargs("G"),
        process_queues={mq: ProcessQueue()}, offset_store=store,
        compute_pull_from_where=from_broker,
        subscriptions=SimpleNamespace(subscribed_topics=lambda: ["T"],
                                      is_orderly=lambda t: False))
    assert rt.options.message_model == MessageModel.CLUSTERING
    rebalancer = Rebalancer(rt, pull, orderly=None)  # type: ignore[arg-type]

    async def allocate(topic: str) -> set[MessageQueue]:
        return {mq}

    async def changed(topic: str) -> None:
        return None

    rebalancer._allocate = allocate  # type: ignore[method-assign]
    rebalancer._on_allocation_changed = changed  # type: ignore[method-assign]
    view = SimpleNamespace(group="G", stopping=False, process_queues=rt.process_queues,
                           offset_store=store, rebalancer=rebalancer, options=rt.options)
    handler = BrokerRequestHandler(view)  # type: ignore[arg-type]
    monkeypatch.setattr(admin_module, "RESET_SETTLE", 0.01)
    async with asyncio.timeout(5):
        reset = asyncio.create_task(handler.reset_offsets("T", {mq: 5}))
        while mq in rt.process_queues:
            await asyncio.sleep(0.001)  # the reset removed the queue and now persists
        round_ = asyncio.create_task(rebalancer.rebalance_once())
        await asyncio.sleep(0.02)
        assert started == []  # the round waits for the reset
        gate.set()
        await asyncio.gather(reset, round_)
    assert broker[mq] == 5
    assert started == [(mq, 5)]  # taken again from the reset offset


async def test_the_public_remove_queue_waits_for_a_rebalance_round() -> None:
    # A round running beside the removal saw the queue gone but still allocated, took it
    # again with the broker's older offset, and the removal then persisted that and dropped
    # the new hold's offset entry: messages consumed twice.
    import asyncio
    from types import SimpleNamespace

    from rmq_async.protocol.types import MessageQueue

    consumer = PushConsumer("G", "127.0.0.1:9876")
    removed: list[str] = []

    async def remove_queue(mq: MessageQueue, *, reason: str) -> None:
        removed.append(reason)

    consumer.rebalancer = SimpleNamespace(  # type: ignore[assignment]
        table_lock=asyncio.Lock(), remove_queue=remove_queue)
    async with asyncio.timeout(5):
        async with consumer.rebalancer.table_lock:  # a round under way
            removal = asyncio.create_task(
                consumer.remove_queue(MessageQueue("T", "b", 0), reason="by_hand"))
            await asyncio.sleep(0.02)
            assert removed == []
        await removal
    assert removed == ["by_hand"]


async def test_a_reset_is_written_again_after_the_pulls_sent_before_it(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # A pull sent just before the reset carries the old offset for the broker to commit; the
    # broker's pull threads can apply it after the reset's update, and the reset is undone
    # (a rewind then replays nothing). Java sleeps 10 s before writing reset offsets.
    import asyncio
    from types import SimpleNamespace

    from rmq_async.consumer.options import ConsumerOptions
    from rmq_async.consumer.process_queue import ProcessQueue
    from rmq_async.protocol.types import MessageQueue

    mq = MessageQueue("T", "broker-a", 0)
    broker = {mq: 100}
    memory: dict[MessageQueue, int] = {}
    writes: list[int] = []

    async def persist(q: MessageQueue) -> None:
        broker[q] = memory[q]
        writes.append(memory[q])
        if len(writes) == 1:  # the pull sent before the drop, applied after this update
            asyncio.get_running_loop().call_soon(broker.__setitem__, q, 100)

    store = SimpleNamespace(freeze=memory.__setitem__, persist=persist,
                            remove=lambda q: memory.pop(q, None))
    process_queues = {mq: ProcessQueue()}

    async def remove_queue(q: MessageQueue, *, reason: str) -> None:
        process_queues.pop(q)
        await store.persist(q)
        store.remove(q)

    rebalancer = SimpleNamespace(table_lock=asyncio.Lock(), remove_queue=remove_queue,
                                 releasing=lambda q: False, wake=lambda: None)
    view = SimpleNamespace(group="G", stopping=False, process_queues=process_queues,
                           offset_store=store, rebalancer=rebalancer,
                           options=ConsumerOptions.from_kwargs("G"))
    monkeypatch.setattr(admin_module, "RESET_SETTLE", 0.05)
    async with asyncio.timeout(5):
        await BrokerRequestHandler(view).reset_offsets("T", {mq: 5})  # type: ignore[arg-type]
    assert writes == [5, 5]
    assert broker[mq] == 5 and memory == {}


async def test_a_listener_called_directly_is_a_user_call_of_its_consumer() -> None:
    """As a handler's call: a stop() it makes, or makes from a task it awaits, does not wait
    for it nor cancel it with the connection its request came on (it was cancelled, and the
    stop with it, half done)."""
    from rmq_async.consumer.push import running_call_of
    from rmq_async.consumer.tasks import TaskOwner

    c = _consumer()
    c._owner = TaskOwner("consumer[G_admin]")  # as start() leaves it
    seen: list[object] = []

    async def on(msgs: list[MessageExt]) -> ConsumeResult:
        call = running_call_of(c)
        seen.append(call is not None and call.task is asyncio.current_task())
        inner = await asyncio.create_task(_call_of(c))  # a task the listener awaits
        seen.append(inner)
        return ConsumeResult.SUCCESS

    c.subscribe("T1", listener=on)
    ext = ConsumeMessageDirectlyResultRequestHeader(
        consumer_group="G_admin", client_id="cid", msg_id="X", broker_name="broker-a",
        topic="T1").to_ext_fields()
    cmd = RemotingCommand.request(RequestCode.CONSUME_MESSAGE_DIRECTLY, ext,
                                  body=_stored("T1", b"x"))
    resp = await asyncio.create_task(_ask(c, cmd))  # a task of its own, as a handler's
    assert resp is not None and resp.code == ResponseCode.SUCCESS
    assert seen == [True, True]


async def _call_of(c: PushConsumer) -> bool:
    from rmq_async.consumer.push import running_call_of

    return running_call_of(c) is not None

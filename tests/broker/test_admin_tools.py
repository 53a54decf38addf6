"""The real ``mqadmin`` against a running rmq_async consumer.

``consumerStatus`` / ``consumerProgress`` read the consumer's running info (GET_CONSUMER_RUNNING_INFO,
parsed by fastjson on the Java side), ``queryMsgById -g -d`` makes the broker forward a stored
message to the consumer (CONSUME_MESSAGE_DIRECTLY), and ``resetOffsetByTime`` moves a running
consumer back, both ways a 5.3 broker delivers it: applied on the broker and announced to the
next pull as PULL_OFFSET_MOVED (the default), or pushed to the consumer as
RESET_CONSUMER_CLIENT_OFFSET (``useServerSideResetOffset=false``).
"""

from __future__ import annotations

import asyncio
import collections
import re
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import pytest
from structlog.testing import capture_logs

from rmq_async import ConsumeResult, Message, MessageExt, PushConsumer
from rmq_async.devbroker import LocalRocketMQ
from rmq_async.protocol.bodies import GetConsumerStatusBody
from rmq_async.protocol.command import RemotingCommand
from rmq_async.protocol.headers import GetConsumerStatusRequestHeader
from rmq_async.protocol.types import MessageQueue
from tests.helpers import AdminClient, produce, simple_messages, unique, wait_until

pytestmark = pytest.mark.broker

# Admin request codes the tests send to the broker themselves.
UPDATE_BROKER_CONFIG = 25
INVOKE_BROKER_TO_GET_CONSUMER_STATUS = 223


_JAVA_ERROR = re.compile(r"[\w.$]+(?:Exception|Error)(?::|$)|^\s+at [\w.$<>]+\(", re.M)


def _no_java_error(out: str) -> None:
    """mqadmin exits 0 even when a command failed: look for a Java stack trace instead."""
    found = _JAVA_ERROR.search(out)
    assert found is None, out[max(0, found.start() - 500):found.start() + 2500]


@asynccontextmanager
async def broker_config(rocketmq: LocalRocketMQ, key: str, value: str,
                        restore: str) -> AsyncIterator[None]:
    """Change one broker setting at run time (UPDATE_BROKER_CONFIG), restoring it afterwards."""
    async with AdminClient(rocketmq.namesrv_addr) as admin:
        api = admin.instance.api

        async def put(v: str) -> None:
            req = RemotingCommand.request(UPDATE_BROKER_CONFIG, body=f"{key}={v}\n".encode())
            resp = await api.remoting.invoke(rocketmq.broker_addr, req, 10.0)
            assert resp.code == 0, resp.remark

        await put(value)
        try:
            yield
        finally:
            await put(restore)


async def test_consumer_status_progress_and_consume_directly(rocketmq: LocalRocketMQ) -> None:
    ns = rocketmq.namesrv_addr
    topic = unique("T_adm")
    ordered = unique("T_adm_ord")
    await rocketmq.create_topic(topic, queues=4)
    await rocketmq.create_topic(ordered, queues=2)
    placed = await produce(ns, topic, simple_messages(topic, 200, size=40), batch=10)
    await produce(ns, ordered, simple_messages(ordered, 20, size=40), batch=5)
    group = unique("G_adm")
    seen: collections.Counter[bytes] = collections.Counter()
    direct: list[bytes] = []
    consumer = PushConsumer(group, namesrv=ns, consume_from_where="CONSUME_FROM_FIRST_OFFSET",
                            persist_offset_interval=1.0)

    @consumer.subscribe(topic, tags="*")
    async def on(msgs: list[MessageExt]) -> ConsumeResult:
        for m in msgs:
            seen[m.body] += 1
            if seen[m.body] > 1:
                direct.append(m.body)
                if m.body.startswith(b"m0000000007"):
                    raise RuntimeError("cannot take message 7 twice")
        return ConsumeResult.SUCCESS

    consumer.subscribe(ordered, listener=lambda msgs: ConsumeResult.SUCCESS, orderly=True)
    async with consumer:
        await wait_until(lambda: len(seen) == 200, 30, what="200 messages")
        async with AdminClient(ns) as admin:
            maxes = await admin.max_offsets(topic)
            await wait_until(lambda: all(consumer.offset_store.read_memory(mq) == off
                                         for mq, off in maxes.items()), 10, what="acks")
            # GET_CONSUMER_STATUS_FROM_CLIENT, through the broker (as `getConsumerStatus` did).
            ext = GetConsumerStatusRequestHeader(topic=topic, group=group).to_ext_fields()
            req = RemotingCommand.request(INVOKE_BROKER_TO_GET_CONSUMER_STATUS, ext)
            resp = await admin.instance.remoting.invoke(rocketmq.broker_addr, req, 10.0)
            assert resp.code == 0, resp.remark
            status = GetConsumerStatusBody.from_json_bytes(resp.body)
            assert status.consumer_table == {consumer.client_id: maxes}

        # consumerStatus: fetches every client's running info, analyses them, and writes each
        # one, formatted as `consumerStatus -i <client>` prints it, to a file.
        summary = await rocketmq.mqadmin("consumerStatus", "-g", group)
        _no_java_error(summary)
        row = re.search(rf"^1\s+{re.escape(consumer.client_id)}\s+V5_3_3\s+(\S+)$", summary, re.M)
        assert row is not None, summary
        assert "Same subscription in the same group of consumer" in summary
        assert "Rebalance OK" in summary
        assert "can't lock for a while" not in summary
        assert "can't consume for a while" not in summary
        out = (rocketmq.workdir / row.group(1)).read_text()
        assert "PROP_CONSUME_TYPE                       : CONSUME_PASSIVELY" in out
        # Orderly and concurrent topics in one consumer: it reports itself as concurrent.
        assert "PROP_CONSUMEORDERLY                     : false" in out
        assert f"PROP_NAMESERVER_ADDR                    : {ns};" in out
        subs = re.findall(r"^\d{3} Topic: (\S+)\s+ClassFilter: false\s+SubExpression: (\S+)$",
                          out, re.M)
        assert sorted(subs) == sorted([(topic, "*"), (ordered, "*"), (f"%RETRY%{group}", "*")])
        offsets = re.findall(r"^(\S+)\s+broker-a\s+(\d+)\s+(-?\d+)\s*$", out, re.M)
        got = {(t, int(q)): int(o) for t, q, o in offsets}
        for mq, off in maxes.items():
            assert got[(topic, mq.queue_id)] == off
        details = re.findall(r"^(\S+)\s+broker-a\s+(\d+)\s+ProcessQueueInfo \[(.*)\]$", out, re.M)
        locked = {(t, int(q)): "locked=true" in info for t, q, info in details}
        assert locked[(ordered, 0)] and locked[(ordered, 1)] and not locked[(topic, 0)]
        rates = re.search(rf"^{topic}\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)\s+(\d+)$",
                          out, re.M)
        assert rates is not None, out
        assert float(rates.group(2)) > 0 and float(rates.group(4)) > 0  # pull TPS, consume OK TPS

        # consumerProgress -s true: the client of each queue comes from the running info.
        out = await rocketmq.mqadmin("consumerProgress", "-g", group, "-s", "true")
        _no_java_error(out)
        rows = re.findall(rf"^{topic}\s+broker-a\s+(\d+)\s+(\d+)\s+(\d+)\s+(\S+)", out, re.M)
        assert len(rows) == 4, out
        ip = consumer.client_id.split("@")[0]
        for qid, _broker_off, consumer_off, client_ip in rows:
            assert client_ip == ip
            assert int(consumer_off) == maxes[MessageQueue(topic, "broker-a", int(qid))]

        # queryMsgById -g -d: the broker forwards the stored messages; the listener runs once each.
        by_body = {}
        async with AdminClient(ns) as admin:
            for m in await admin.read_all(topic):
                by_body[m.body[:11]] = m.msg_id
        ids = [by_body[b"m0000000003"], by_body[b"m0000000007"]]
        out = await rocketmq.mqadmin("queryMsgById", "-t", topic, "-i", ",".join(ids),
                                     "-g", group, "-d", consumer.client_id)
        results = re.findall(r"ConsumeMessageDirectlyResult \[order=(\w+), autoCommit=(\w+), "
                             r"consumeResult=(\w+), remark=", out)
        assert results == [("false", "true", "CR_SUCCESS"), ("false", "true", "CR_THROW_EXCEPTION")]
        assert "cannot take message 7 twice" in out
        assert [b[:11] for b in direct] == [b"m0000000003", b"m0000000007"]
    assert len(placed) == 200


async def test_reset_offset_by_time_server_side_and_pushed(rocketmq: LocalRocketMQ) -> None:
    ns = rocketmq.namesrv_addr
    topic = unique("T_reset")
    await rocketmq.create_topic(topic, queues=4)
    group = unique("G_reset")
    seen: collections.Counter[bytes] = collections.Counter()
    consumer = PushConsumer(group, namesrv=ns, consume_from_where="CONSUME_FROM_FIRST_OFFSET",
                            persist_offset_interval=0.5, broker_suspend_max_time=2.0)

    @consumer.subscribe(topic)
    async def on(msgs: list[MessageExt]) -> ConsumeResult:
        for m in msgs:
            seen[m.body[:12]] += 1
        return ConsumeResult.SUCCESS

    async def batch(prefix: str) -> int:
        """Send 40 messages (10 per queue), wait until consumed and committed; return the
        time (ms) just before they were sent."""
        await asyncio.sleep(0.3)
        stamp = int(time.time() * 1000)
        await asyncio.sleep(0.3)
        # The first two bytes of a body say which batch the message is from.
        await produce(ns, topic, simple_messages(topic, 40, size=20, prefix=prefix), batch=5)
        return stamp

    async def committed_all() -> None:
        async with AdminClient(ns) as admin:
            maxes = await admin.max_offsets(topic)

            async def done() -> bool:
                return await admin.committed_offsets(group, topic) == maxes

            deadline = time.monotonic() + 15
            while not await done():
                assert time.monotonic() < deadline, "offsets not committed"
                await asyncio.sleep(0.2)

    async with consumer:
        await batch("a_")
        t_b = await batch("b_")
        await wait_until(lambda: sum(seen.values()) >= 80, 30, what="batches a and b")
        await committed_all()
        assert set(seen.values()) == {1}

        # 1. Server-side reset (the 5.3 default): the next pull answers PULL_OFFSET_MOVED.
        with capture_logs() as logs:
            out = await rocketmq.mqadmin("resetOffsetByTime", "-g", group, "-t", topic,
                                         "-s", str(t_b))
            _no_java_error(out)
            try:
                await wait_until(lambda: sum(seen.values()) >= 120, 30, what="b consumed again")
            except AssertionError as exc:
                # What the consumer did meanwhile, for the report (the logs are captured).
                events = [(e["event"], e.get("queue"), e.get("offset"), e.get("next_offset"))
                          for e in logs if e["event"].startswith(("pull.", "rebalance.",
                                                                  "offset"))]
                per_batch = collections.Counter({k[:2]: 0 for k in seen})
                for key, n in seen.items():
                    per_batch[key[:2]] += n
                raise AssertionError(f"{exc}; mqadmin: {out!r}; deliveries per batch "
                                     f"{dict(per_batch)}; events {events}") from None
        assert any(e["event"] == "pull.offset_illegal" for e in logs)
        assert not any(e["event"] == "admin.reset_offset" for e in logs)
        a_keys = [k for k in seen if k.startswith(b"a_")]
        assert {seen[k] for k in a_keys} == {1}, "messages before the reset time came again"
        await committed_all()

        # 2. Reset pushed to the consumer (RESET_CONSUMER_CLIENT_OFFSET).
        t_c = await batch("c_")
        await wait_until(lambda: sum(seen.values()) >= 160, 30, what="batch c")
        await committed_all()
        async with broker_config(rocketmq, "useServerSideResetOffset", "false", "true"):
            with capture_logs() as logs:
                out = await rocketmq.mqadmin("resetOffsetByTime", "-g", group, "-t", topic,
                                             "-s", str(t_c))
                _no_java_error(out)
                await wait_until(lambda: sum(seen.values()) >= 200, 30, what="c consumed again")
        assert any(e["event"] == "admin.reset_offset" for e in logs)
        assert sum(e["event"] == "admin.queue_reset" for e in logs) == 4
        await committed_all()
    # a once; b twice (first reset); c twice (second reset).
    by_batch = collections.defaultdict(set)
    for key, n in seen.items():
        by_batch[key[:2]].add(n)
    print(f"\nreset: deliveries per batch {dict(by_batch)}")
    assert dict(by_batch) == {b"a_": {1}, b"b_": {2}, b"c_": {2}}


async def test_heartbeats_name_the_inner_producer_group_as_java_clients_do(
        rocketmq: LocalRocketMQ, topic: str) -> None:
    """The broker lists a running consumer and producer under ``CLIENT_INNER_PRODUCER`` (the
    group of a client's own dead-letter and retry sends), and the producer under its group
    (GET_PRODUCER_CONNECTION_LIST, what ``mqadmin producerConnection`` shows)."""
    import json

    from rmq_async import Producer
    from rmq_async.protocol.codes import RequestCode, ResponseCode

    async def connected(admin: AdminClient, group: str) -> set[str]:
        req = RemotingCommand.request(RequestCode.GET_PRODUCER_CONNECTION_LIST,
                                      ext_fields={"producerGroup": group})
        resp = await admin.instance.remoting.invoke(rocketmq.broker_addr, req, 10.0)
        if resp.code != ResponseCode.SUCCESS:  # no producer of the group is connected
            return set()
        return {c["clientId"] for c in json.loads(resp.body)["connectionSet"]}

    async def idle(msgs: list[MessageExt]) -> ConsumeResult:
        return ConsumeResult.SUCCESS

    consumer = PushConsumer(unique("G_inner"), namesrv=rocketmq.namesrv_addr)
    consumer.subscribe(topic, listener=idle)
    group = unique("PG_inner")
    async with consumer, Producer(group, rocketmq.namesrv_addr) as producer, \
            AdminClient(rocketmq.namesrv_addr) as admin:
        await producer.send(Message(topic, b"x"))  # the producer's heartbeat reached the broker
        inner = await connected(admin, "CLIENT_INNER_PRODUCER")
        assert {consumer.client_id, producer.client_id} <= inner, inner
        assert producer.client_id in await connected(admin, group)

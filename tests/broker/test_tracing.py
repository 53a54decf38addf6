"""OpenTelemetry spans of real consume calls, collected by the SDK's in-memory exporter."""

from __future__ import annotations

import collections
import time

import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode

from rmq_async import DeadLetter, Message, MessageExt, PushConsumer
from rmq_async.devbroker import LocalRocketMQ
from rmq_async.observability.otel import TracingMiddleware
from tests.helpers import produce, unique, wait_until

pytestmark = pytest.mark.broker


async def test_one_span_per_consume_call_with_messaging_attributes(
        rocketmq: LocalRocketMQ) -> None:
    ns = rocketmq.namesrv_addr
    single, batched = unique("T_span"), unique("T_span_batch")
    await rocketmq.create_topic(single, queues=2)
    await rocketmq.create_topic(batched, queues=2)
    group = unique("G_span")
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    consumer = PushConsumer(group, namesrv=ns, consume_from_where="CONSUME_FROM_FIRST_OFFSET",
                            consume_message_batch_max_size=4)
    consumer.add_middleware(TracingMiddleware(tracer_provider=provider,
                                              consumption_model="clustering"))
    calls: list[str] = []
    batch_calls: list[int] = []
    failed: set[str] = set()

    @consumer.subscribe(single)
    async def handle(msg: MessageExt) -> None:
        calls.append(msg.msg_id)
        if msg.body == b"s3" and msg.msg_id not in failed:
            failed.add(msg.msg_id)
            raise RuntimeError("first attempt fails")
        if msg.body == b"s5":
            raise DeadLetter("not wanted")  # straight to the DLQ: no retry, counted as DLQ'd

    @consumer.subscribe(batched, batch=True)
    async def handle_batch(msgs: list[MessageExt]) -> None:
        batch_calls.append(len(msgs))

    t0 = time.monotonic()
    async with consumer:
        await produce(ns, single, [Message(single, f"s{i}".encode(), tags="t", keys=[f"k{i}"])
                                   for i in range(10)], batch=1)
        await produce(ns, batched, [Message(batched, f"b{i}".encode()) for i in range(20)],
                      batch=10)
        # Ten messages, one failed once and redelivered through the retry topic: 11 calls.
        await wait_until(lambda: len(calls) == 11 and sum(batch_calls) == 20, 30,
                         what="every consume call")
        await wait_until(lambda: len(exporter.get_finished_spans()) == 11 + len(batch_calls), 5,
                         what="every span ended")
    spans = exporter.get_finished_spans()
    per_message = [s for s in spans if s.name == f"process {single}"]
    per_batch = [s for s in spans if s.name == f"process {batched}"]
    assert len(per_message) == len(calls) == 11 and len(per_batch) == len(batch_calls)
    assert collections.Counter(dict(s.attributes or {})["messaging.message.id"]
                               for s in per_message) == collections.Counter(calls)
    for s in spans:
        a = dict(s.attributes or {})
        assert s.kind is SpanKind.CONSUMER
        assert a["messaging.system"] == "rocketmq"
        assert a["messaging.operation.type"] == "process"
        assert a["messaging.consumer.group.name"] == group
        assert a["messaging.rocketmq.consumption_model"] == "clustering"
        assert a["messaging.destination.partition.id"] in {"0", "1"}
    for s in per_message:
        a = dict(s.attributes or {})
        # A redelivery from %RETRY%<group> is traced under the topic it was sent to.
        assert a["messaging.destination.name"] == single
        assert a["messaging.rocketmq.message.tag"] == "t"
        assert len(a["messaging.rocketmq.message.keys"]) == 1
        assert "messaging.batch.message_count" not in a
    sizes = []
    for s in per_batch:
        a = dict(s.attributes or {})
        # The conventions leave the batch count off a call that holds a single message.
        n = a.get("messaging.batch.message_count")
        assert (n is None) == ("messaging.message.id" in a)
        sizes.append(1 if n is None else n)
    assert sorted(sizes) == sorted(batch_calls) and max(sizes) > 1
    errors = [s for s in spans if s.status.status_code is StatusCode.ERROR]
    assert sorted(dict(s.attributes or {})["error.type"] for s in errors) == [
        "DeadLetter", "RuntimeError"]
    assert all([e.name for e in s.events] == ["exception"] for s in errors)
    totals = consumer.stats.totals[single]
    assert (totals.failed, totals.sent_back, totals.dead_lettered) == (2, 1, 1)
    print(f"\ntracing: {len(per_message)} per-message spans (2 errors), {len(per_batch)} batch "
          f"spans of {sorted(batch_calls)} messages; {time.monotonic() - t0:.1f} s")

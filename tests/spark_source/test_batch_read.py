"""``spark.read.format("rocketmq")`` against the real broker: exact offset ranges, positions.

Sizes: RMQ_SPARK_SOURCE_FULL=1 reads the acceptance size (200,000 messages over 8 queues); the
default run reads 40,000.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from datetime import UTC, datetime
from typing import TYPE_CHECKING

import pyarrow as pa
import pytest
from structlog.testing import capture_logs

from rmq_async.devbroker import LocalRocketMQ
from rmq_async.protocol.message import stamp_delivered
from rmq_async.protocol.types import (
    PROPERTY_MAX_OFFSET,
    PROPERTY_MIN_OFFSET,
    MessageExt,
    MessageQueue,
)
from rmq_async.sinks._arrow import messages_to_arrow
from rmq_async.sinks.spark import SPARK_SCHEMA
from rmq_async.sources.ranges import DataLossError, SourceOptions, read_range_all
from rmq_async.sources.spark import spark_arrow_schema
from tests.helpers import AdminClient, produce, simple_messages, unique
from tests.spark_source.common import stored_offsets
from tests.spark_source.session import FULL

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

pytestmark = [pytest.mark.broker, pytest.mark.spark]

BATCH_MESSAGES = 200_000 if FULL else 40_000
KEY = ["topic", "broker_name", "queue_id", "queue_offset"]


def _sorted(table: pa.Table) -> pa.Table:
    return table.sort_by([(k, "ascending") for k in KEY])


def _expected(msgs: list[MessageExt], start: dict[MessageQueue, int],
              end: dict[MessageQueue, int], maxes: dict[MessageQueue, int]) -> pa.Table:
    """The rows of ``msgs`` in the ranges, as delivered: each with its queue's MIN_OFFSET (0,
    a fresh topic) and MAX_OFFSET (the topic is complete before the read) properties."""
    picked: list[MessageExt] = []
    for mq in sorted(start):
        in_range = [m for m in msgs
                    if MessageQueue(m.topic, m.broker_name, m.queue_id) == mq
                    and start[mq] <= m.queue_offset < end[mq]]
        stamp_delivered(in_range, mq.broker_name, {PROPERTY_MIN_OFFSET: "0",
                                                   PROPERTY_MAX_OFFSET: str(maxes[mq])})
        picked.extend(in_range)
    return _sorted(messages_to_arrow(picked).cast(spark_arrow_schema()))


@pytest.mark.timeout(300 if FULL else 150)
async def test_batch_read_between_offsets_gives_exactly_those_rows(
        rocketmq: LocalRocketMQ, topic: str, spark: SparkSession) -> None:
    t0 = time.monotonic()
    await produce(rocketmq.namesrv_addr, topic, simple_messages(topic, BATCH_MESSAGES, size=100),
                  batch=256, concurrency=4)
    maxes = await stored_offsets(rocketmq.namesrv_addr, topic, BATCH_MESSAGES)
    async with AdminClient(rocketmq.namesrv_addr) as admin:
        everything = await admin.read_all(topic)
    assert sum(maxes.values()) == BATCH_MESSAGES == len(everything)
    produced = time.monotonic() - t0

    rng = random.Random(7)
    queues = sorted(maxes)
    start: dict[MessageQueue, int] = {}
    end: dict[MessageQueue, int] = {}
    starting: dict[str, int] = {}
    ending: dict[str, int] = {}
    for i, mq in enumerate(queues):
        top = maxes[mq]
        key = f"{mq.broker_name}:{mq.queue_id}"
        if i == 0:  # earliest .. latest, spelled -2 / -1
            starting[key], ending[key] = -2, -1
            start[mq], end[mq] = 0, top
        elif i == 1:  # an empty range
            starting[key] = ending[key] = start[mq] = end[mq] = top // 2
        elif i == 2:  # left out of both: earliest .. latest
            start[mq], end[mq] = 0, top
        else:
            lo = rng.randrange(0, top // 2)
            hi = rng.randrange(top // 2, top)
            starting[key], ending[key] = lo, hi
            start[mq], end[mq] = lo, hi

    t1 = time.monotonic()
    df = (spark.read.format("rocketmq")
          .option("namesrv", rocketmq.namesrv_addr)
          .option("topics", topic)
          .option("startingOffsets", json.dumps({topic: starting}))
          .option("endingOffsets", json.dumps({topic: ending}))
          .load())
    assert df.schema == SPARK_SCHEMA
    got = _sorted(df.toArrow())
    read_s = time.monotonic() - t1
    want = _expected(everything, start, end, maxes)
    assert got.num_rows == sum(end[mq] - start[mq] for mq in queues)
    assert got.schema.equals(want.schema), (got.schema, want.schema)
    assert got.equals(want)
    print(f"\nbatch read: {BATCH_MESSAGES} produced in {produced:.1f}s; "
          f"{got.num_rows} rows read by Spark in {read_s:.1f}s "
          f"({got.num_rows / read_s:,.0f} rows/s incl. planning and toArrow)")


@pytest.mark.timeout(120)
async def test_starting_timestamp_matches_the_brokers_search(
        rocketmq: LocalRocketMQ, topic: str, spark: SparkSession) -> None:
    ns = rocketmq.namesrv_addr
    await produce(ns, topic, simple_messages(topic, 2_000, prefix="before"), batch=64)
    await stored_offsets(ns, topic, 2_000)
    await asyncio.sleep(0.05)
    async with AdminClient(ns) as admin:
        before = await admin.read_all(topic)
        cut = max(m.store_timestamp for m in before) + 1
    await asyncio.sleep(0.05)
    await produce(ns, topic, simple_messages(topic, 2_000, prefix="after"), batch=64)
    await stored_offsets(ns, topic, 4_000)
    async with AdminClient(ns) as admin:
        answers = {}
        for mq in await admin.queues(topic):
            addr = await admin.instance.find_broker_master(mq.broker_name, topic)
            answers[mq.queue_id] = await admin.instance.api.search_offset(addr, mq, cut)
        maxes = {mq.queue_id: off for mq, off in (await admin.max_offsets(topic)).items()}

    for option, value in [("startingTimestamp", str(cut)),
                          ("startingOffsets", datetime.fromtimestamp(cut / 1000, UTC).isoformat())]:
        df = (spark.read.format("rocketmq").option("namesrv", ns).option("topics", topic)
              .option(option, value).load())
        table = df.select("queue_id", "queue_offset", "body", "store_timestamp").toArrow()
        firsts: dict[int, int] = {}
        counts: dict[int, int] = {}
        for qid, off in zip(table.column("queue_id").to_pylist(),
                            table.column("queue_offset").to_pylist(), strict=True):
            firsts[qid] = min(off, firsts.get(qid, off))
            counts[qid] = counts.get(qid, 0) + 1
        for qid, answer in answers.items():
            assert counts.get(qid, 0) == maxes[qid] - answer
            if counts.get(qid):
                assert firsts[qid] == answer
        # The broker's answer for that time: exactly the messages stored after the cut.
        assert sorted(b[:5] for b in table.column("body").to_pylist()) == [b"after"] * 2_000


@pytest.mark.timeout(60)
async def test_offsets_gone_fail_or_skip_per_fail_on_data_loss(
        rocketmq: LocalRocketMQ, topic: str) -> None:
    """A range the queue no longer covers (here: past its max, as after the queue was recreated)."""
    ns = rocketmq.namesrv_addr
    await produce(ns, topic, simple_messages(topic, 80), batch=16)
    maxes = await stored_offsets(ns, topic, 80)
    mq = max(maxes, key=lambda q: maxes[q])
    top = maxes[mq]
    opts = SourceOptions.parse({"namesrv": ns, "topics": topic}, streaming=False)
    assert len(await read_range_all(opts, mq, 0, top)) == top
    with pytest.raises(DataLossError, match=r"are gone"):
        await read_range_all(opts, mq, top + 5, top + 10)
    lenient = SourceOptions.parse({"namesrv": ns, "topics": topic, "failOnDataLoss": "false"},
                                  streaming=False)
    with capture_logs() as logs:
        assert await read_range_all(lenient, mq, top + 5, top + 10) == []
    lost = [e for e in logs if e["event"] == "spark_source.data_loss"]
    assert len(lost) == 1 and lost[0]["first"] == top + 5 and lost[0]["last"] == top + 9


@pytest.mark.timeout(60)
async def test_tag_filter_and_tls_on_a_range(rocketmq: LocalRocketMQ, topic: str) -> None:
    """The broker filters on ``tags`` (re-checked on the client); ``tls`` reads over TLS (the dev
    broker serves TLS and plain connections alike)."""
    ns = rocketmq.namesrv_addr
    msgs = [*simple_messages(topic, 300, tags="a", prefix="a"),
            *simple_messages(topic, 300, tags="b", prefix="b"),
            *simple_messages(topic, 30, prefix="none")]
    random.Random(3).shuffle(msgs)
    await produce(ns, topic, msgs, batch=16)
    maxes = await stored_offsets(ns, topic, len(msgs))
    got: dict[str, list[bytes]] = {}
    for name, extra in [("tags", {"tags": "a || c"}),
                        ("tls", {"tls": "true", "tlsVerify": "false"})]:
        opts = SourceOptions.parse({"namesrv": ns, "topics": topic, **extra}, streaming=False)
        got[name] = [m.body[:1] for mq, top in maxes.items()
                     for m in await read_range_all(opts, mq, 0, top)]
    assert got["tags"] == [b"a"] * 300
    assert sorted(got["tls"]) == sorted(m.body[:1] for m in msgs)


@pytest.mark.timeout(60)
async def test_topic_pattern_reads_every_matching_topic(
        rocketmq: LocalRocketMQ, spark: SparkSession) -> None:
    ns = rocketmq.namesrv_addr
    prefix = unique("TP")
    names = [f"{prefix}_a", f"{prefix}_b", f"{prefix}x_c"]
    for name in names:
        await rocketmq.create_topic(name, queues=2)
        await produce(ns, name, simple_messages(name, 50, prefix=name[-1]), batch=16)
        await stored_offsets(ns, name, 50)
    df = (spark.read.format("rocketmq").option("namesrv", ns)
          .option("topicPattern", f"{prefix}_.*").load())
    counts = {r["topic"]: r["count"] for r in df.groupBy("topic").count().collect()}
    assert counts == {names[0]: 50, names[1]: 50}

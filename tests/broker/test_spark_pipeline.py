"""RocketMQ -> PushConsumer -> SparkSink -> Parquet against the real broker and local PySpark.

What is checked: exact round trips of every column, retries of a failing write, redelivery of a
batch whose retries ran out, committed offsets that never pass an unwritten batch (a consumer
process SIGKILLed after a failed write, and after a successful write before its offsets were
persisted, then restarted), and batch sizes that follow the consumer's flow control instead of
waiting for ``max_batch_latency``. Bounded memory under a slow write: ``test_spark_slow_write.py``.

The crash tests run the consumer as a subprocess (``tests/broker/spark_consumer_proc.py``) so
that it can be killed with SIGKILL; the others run it in the test's own event loop.
"""

from __future__ import annotations

import collections
import random
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

pytest.importorskip("pyspark", reason="needs the spark extra")

from rmq_async import Message, PushConsumer
from rmq_async.devbroker import LocalRocketMQ
from rmq_async.protocol import message
from rmq_async.sinks.spark import BatchInfo, SparkSink, parquet_writer
from tests.broker.spark_pipeline_support import (
    consumer_process,
    key_counts,
    produce_tracked,
    small_messages,
)
from tests.helpers import AdminClient, unique, wait_until
from tests.spark.session import local_spark

if TYPE_CHECKING:
    import pyarrow as pa
    from pyspark.sql import DataFrame, SparkSession

pytestmark = [pytest.mark.broker, pytest.mark.spark]

KEY = ["topic", "broker_name", "queue_id", "queue_offset"]
#: Properties the client or broker adds to what the producer set.
SYSTEM_PROPERTIES = {"UNIQ_KEY", "WAIT", "MIN_OFFSET", "MAX_OFFSET", "CLUSTER", "MSG_REGION", "TRACE_ON"}
_WORDS = ["created", "paid", "shipped", "größe", "注文", "заказ", "🚚", "a-b", "x" * 40]


@pytest.fixture(scope="module")
def spark() -> Iterator[SparkSession]:
    session = local_spark()
    yield session
    session.stop()


# ---------------------------------------------------------------------------- producing


def mixed_messages(topic: str, n: int, *, seed: int = 11) -> list[Message]:
    """Bodies of 0 B to 4 KiB, optional tags, 0-3 keys, unicode user properties; ``seq`` = index."""
    rng = random.Random(seed)
    msgs = []
    for i in range(n):
        size = rng.choice([0, 1, 17, 100, 300, 1024, 4096])
        props = {"seq": str(i)}
        if i % 3 == 0:
            props["origin"] = rng.choice(_WORDS)
        if i % 7 == 0:
            props[f"p-{rng.choice(_WORDS)}"] = rng.choice(_WORDS) * 3
        msgs.append(Message(
            topic,
            rng.randbytes(size),
            tags=rng.choice([*_WORDS, None]),
            keys=[f"{rng.choice(_WORDS)}-{i}" for _ in range(rng.randrange(4))],
            properties=props,
        ))
    return msgs




# ---------------------------------------------------------------------------- reading back


def read_table(spark: SparkSession, path: Path, columns: Sequence[str] | None = None) -> pa.Table:
    df = spark.read.parquet(str(path))
    if columns is not None:
        df = df.select(*columns)
    return df.toArrow()


def seq_of(props: Any) -> int:
    return int(dict(props)["seq"])


def consumer_for(namesrv: str, group: str, **opts: Any) -> PushConsumer:
    opts.setdefault("consume_from_where", "CONSUME_FROM_FIRST_OFFSET")
    opts.setdefault("persist_offset_interval", 1.0)
    return PushConsumer(group, namesrv=namesrv, **opts)


async def offsets(namesrv: str, group: str, topic: str) -> tuple[dict[int, int], dict[int, int]]:
    """Committed and max offsets per queue id."""
    async with AdminClient(namesrv) as admin:
        committed = await admin.committed_offsets(group, topic)
        maxes = await admin.max_offsets(topic)
    return ({mq.queue_id: o for mq, o in committed.items()},
            {mq.queue_id: o for mq, o in maxes.items()})


async def consume_until(consumer: PushConsumer, sink: SparkSink, rows: int, timeout: float) -> float:
    """Run ``consumer`` until ``sink`` has written ``rows`` rows; returns the seconds it took."""
    started = time.monotonic()
    async with consumer:
        await wait_until(lambda: sink.statistics().rows_written >= rows, timeout,
                         what=f"{rows} rows written")
    return time.monotonic() - started


# ---------------------------------------------------------------------------- consumer process


def batch_ranges(event: dict[str, Any]) -> dict[int, tuple[int, int]]:
    """queue_id -> (first, last) offset of a batch reported by the consumer process."""
    return {qid: (lo, hi) for _topic, _broker, qid, lo, hi in event["ranges"]}


# ---------------------------------------------------------------------------- the tests


@pytest.mark.slow(seconds=28)
async def test_100k_mixed_messages_land_in_parquet_exactly(
        rocketmq: LocalRocketMQ, spark: SparkSession, tmp_path: Path) -> None:
    topic = unique("T_spark100k")
    await rocketmq.create_topic(topic, queues=8)
    msgs = mixed_messages(topic, 100_000)
    placed = await produce_tracked(rocketmq.namesrv_addr, msgs)
    group = unique("G_spark100k")
    out = tmp_path / "rows.parquet"
    sink = SparkSink(spark, parquet_writer(str(out)), batch_rows=20_000, max_batch_latency=2.0)
    consumer = consumer_for(rocketmq.namesrv_addr, group, pull_threshold_for_queue=5000,
                            consume_concurrently_max_span=5000)
    consumer.subscribe(topic, sink=sink)
    kinds: collections.Counter[str] = collections.Counter()
    offer = sink.offer

    def counted(chunk: Any, ack: Any, **kw: Any) -> None:
        kinds[type(chunk).__name__] += 1
        offer(chunk, ack, **kw)

    sink.offer = counted  # type: ignore[method-assign]
    seconds = await consume_until(consumer, sink, len(msgs), 240)
    # With the compiled codec every pull (plain bodies) reaches the sink undecoded.
    assert set(kinds) == {"StoredChunk" if message.scan_records is not None else "list"}, kinds
    print(f"\n100k mixed messages: {len(msgs) / seconds:,.0f} rows/s end to end "
          f"({sink.statistics().batches_written} batches, Spark {sink.statistics().write_seconds:.1f} s)")

    table = read_table(spark, out)
    assert table.num_rows == len(msgs)
    cols = {name: table.column(name).to_pylist() for name in table.column_names}
    seen: set[int] = set()
    for i in range(table.num_rows):
        props = dict(cols["properties"][i])
        seq = int(props["seq"])
        assert seq not in seen, f"message {seq} twice"
        seen.add(seq)
        sent = msgs[seq]
        assert cols["topic"][i] == topic
        assert cols["broker_name"][i] == rocketmq.broker_name
        assert (cols["queue_id"][i], cols["queue_offset"][i]) == placed[seq]
        assert cols["body"][i] == sent.body, seq
        assert cols["tags"][i] == sent.tags
        assert cols["keys"][i] == (sent.keys or [])
        # The producer left the message's unique id in it (as Java's setUniqID): the row
        # carries that id; the other properties are the message's own and the system ones.
        assert props["UNIQ_KEY"] == sent.properties["UNIQ_KEY"], seq
        expected_props = {k: v for k, v in sent.all_properties().items() if k != "UNIQ_KEY"}
        assert {k: v for k, v in props.items() if k in expected_props} == expected_props
        assert set(props) - set(expected_props) == SYSTEM_PROPERTIES, seq
        assert cols["msg_id"][i] == props["UNIQ_KEY"]
        assert len(cols["offset_msg_id"][i]) == 32
        assert cols["reconsume_times"][i] == 0
        assert cols["born_timestamp"][i] <= cols["store_timestamp"][i]
        assert cols["born_host"][i].rsplit(":", 1)[1].isdigit()
        assert cols["store_host"][i].endswith(f":{rocketmq.broker_port}")
    assert seen == set(range(len(msgs)))
    assert len(set(cols["offset_msg_id"])) == len(msgs)

    committed, maxes = await offsets(rocketmq.namesrv_addr, group, topic)
    assert committed == maxes


async def test_default_flow_control_never_waits_for_the_batch_latency(
        rocketmq: LocalRocketMQ, spark: SparkSession, tmp_path: Path) -> None:
    # batch_rows (50,000 by default) is far above what the default thresholds let in
    # (8 queues x 1000): batches must close at half of that, not after max_batch_latency.
    topic = unique("T_spark_defaults")
    await rocketmq.create_topic(topic, queues=8)
    placed = await produce_tracked(rocketmq.namesrv_addr, small_messages(topic, 20_000))
    out = tmp_path / "rows.parquet"
    latency = 120.0
    sink = SparkSink(spark, parquet_writer(str(out)), max_batch_latency=latency)
    consumer = consumer_for(rocketmq.namesrv_addr, unique("G_spark_defaults"))
    consumer.subscribe(topic, sink=sink)
    # Four full batches well within one latency period; the tail is flushed by stop().
    seconds = await consume_until(consumer, sink, 16_000, latency * 0.75)
    assert seconds < latency
    assert sink.effective_batch_rows == 8 * 1001 // 2
    counts = key_counts(read_table(spark, out, ["topic", "queue_id", "queue_offset"]))
    assert len(counts) >= 16_000 and max(counts.values()) == 1
    assert set(counts) <= {(topic, q, o) for q, o in placed}


async def test_caught_up_sink_writes_its_last_batch_without_waiting_for_the_latency(
        rocketmq: LocalRocketMQ, spark: SparkSession, tmp_path: Path) -> None:
    # 3,000 messages never fill a batch of 100,000: with flush_when_caught_up the batch is
    # written once every queue is read to its end, long before the 120 s batch latency.
    topic = unique("T_spark_caught_up")
    await rocketmq.create_topic(topic, queues=4)
    placed = await produce_tracked(rocketmq.namesrv_addr, small_messages(topic, 3_000))
    out = tmp_path / "rows.parquet"
    latency = 120.0
    sink = SparkSink(spark, parquet_writer(str(out)), batch_rows=100_000,
                     max_batch_latency=latency, flush_when_caught_up=True)
    consumer = consumer_for(rocketmq.namesrv_addr, unique("G_spark_caught_up"))
    consumer.subscribe(topic, sink=sink)
    seconds = await consume_until(consumer, sink, 3_000, 60.0)
    assert seconds < 60.0
    counts = key_counts(read_table(spark, out, ["topic", "queue_id", "queue_offset"]))
    assert set(counts) == {(topic, q, o) for q, o in placed}
    assert max(counts.values()) == 1


async def test_one_busy_queue_closes_batches_when_it_stops_pulling(
        rocketmq: LocalRocketMQ, spark: SparkSession, tmp_path: Path) -> None:
    # Every message in queue 3: that queue stops pulling at 1000 cached messages, far below
    # the sink's batch size for 8 queues (4004); the open batch must be closed right then
    # instead of after max_batch_latency.
    topic = unique("T_spark_skew")
    await rocketmq.create_topic(topic, queues=8)
    async with AdminClient(rocketmq.namesrv_addr) as admin:
        mq = next(q for q in await admin.queues(topic) if q.queue_id == 3)
    placed = await produce_tracked(rocketmq.namesrv_addr, small_messages(topic, 6000), queue=mq)
    out = tmp_path / "rows.parquet"
    sizes: list[int] = []
    write = parquet_writer(str(out))

    def recording_write(df: DataFrame, info: BatchInfo) -> None:
        write(df, info)
        sizes.append(info.row_count)

    latency = 60.0
    sink = SparkSink(spark, recording_write, max_batch_latency=latency)
    group = unique("G_spark_skew")
    consumer = consumer_for(rocketmq.namesrv_addr, group)
    consumer.subscribe(topic, sink=sink)
    # Four batches well within one latency period; the tail is flushed by stop().
    seconds = await consume_until(consumer, sink, 4000, latency * 0.75)
    assert seconds < latency
    assert max(sizes) <= 1000 + 32
    counts = key_counts(read_table(spark, out, ["topic", "queue_id", "queue_offset"]))
    assert len(counts) == sum(sizes) and max(counts.values()) == 1
    # What was written is a prefix of the queue, and exactly that is committed.
    assert set(counts) == {(topic, 3, o) for o in range(len(counts))}
    assert {(topic, q, o) for q, o in placed} >= set(counts)
    committed, _ = await offsets(rocketmq.namesrv_addr, group, topic)
    assert committed[3] == len(counts)


async def test_a_sink_subscribed_after_start_writes_and_stop_writes_what_it_holds(
        rocketmq: LocalRocketMQ, spark: SparkSession, tmp_path: Path) -> None:
    # The consumer starts with a listener only; the sink subscribed afterwards must get its
    # writer started (one full batch lands while the consumer runs: at most 1,500 rows, and
    # more than 1,500 less a pull of 32, as a chunk that would pass the limit starts the next
    # batch), and stop() must write and commit the rows still open (the batch latency is far
    # away).
    listened = unique("T_spark_late_listener")
    topic = unique("T_spark_late_sink")
    await rocketmq.create_topic(listened, queues=2)
    await rocketmq.create_topic(topic, queues=4)
    placed = await produce_tracked(rocketmq.namesrv_addr, small_messages(topic, 2_000))
    out = tmp_path / "rows.parquet"
    sink = SparkSink(spark, parquet_writer(str(out)), batch_rows=1_500, max_batch_latency=600.0)
    group = unique("G_spark_late")
    consumer = consumer_for(rocketmq.namesrv_addr, group)
    consumer.subscribe(listened, listener=lambda msgs: None)
    async with consumer:
        consumer.subscribe(topic, sink=sink)
        await wait_until(lambda: 1_500 - 32 < sink.statistics().rows_written <= 1_500
                         and sink.statistics().rows_written + sink.backlog_rows == 2_000, 60.0,
                         what="a batch written by a sink subscribed after start(), the rest held")
    assert sink.statistics().rows_written == 2_000
    counts = key_counts(read_table(spark, out, ["topic", "queue_id", "queue_offset"]))
    assert set(counts) == {(topic, q, o) for q, o in placed}
    assert max(counts.values()) == 1
    committed, _ = await offsets(rocketmq.namesrv_addr, group, topic)
    assert committed == dict(collections.Counter(q for q, _ in placed))


def failing_on_call(write: Callable[[DataFrame, BatchInfo], None], call: int,
                    failed: list[BatchInfo]) -> Callable[[DataFrame, BatchInfo], None]:
    """``write``, except that its ``call``-th call raises (after recording the batch)."""
    calls = 0

    def wrapped(df: DataFrame, info: BatchInfo) -> None:
        nonlocal calls
        calls += 1
        if calls == call:
            failed.append(info)
            raise OSError(f"injected failure on call {calls}")
        write(df, info)

    return wrapped


async def test_write_failing_once_is_retried_without_gaps_or_duplicates(
        rocketmq: LocalRocketMQ, spark: SparkSession, tmp_path: Path) -> None:
    topic = unique("T_spark_retry")
    await rocketmq.create_topic(topic, queues=8)
    placed = await produce_tracked(rocketmq.namesrv_addr, small_messages(topic, 10_000))
    group = unique("G_spark_retry")
    out = tmp_path / "rows.parquet"
    failed: list[BatchInfo] = []
    sink = SparkSink(spark, failing_on_call(parquet_writer(str(out)), 2, failed),
                     batch_rows=2000, write_retries=2, retry_backoff=0.2)
    consumer = consumer_for(rocketmq.namesrv_addr, group)
    consumer.subscribe(topic, sink=sink)
    await consume_until(consumer, sink, len(placed), 120)

    assert [info.batch_id for info in failed] == [2]
    stats = sink.statistics()
    assert (stats.batches_given_up, stats.rows_written) == (0, len(placed))
    counts = key_counts(read_table(spark, out, ["topic", "queue_id", "queue_offset"]))
    assert max(counts.values()) == 1
    assert set(counts) == {(topic, q, o) for q, o in placed}
    committed, maxes = await offsets(rocketmq.namesrv_addr, group, topic)
    assert committed == maxes


async def test_batch_out_of_retries_is_redelivered_into_a_later_batch(
        rocketmq: LocalRocketMQ, spark: SparkSession, tmp_path: Path) -> None:
    topic = unique("T_spark_redeliver")
    await rocketmq.create_topic(topic, queues=8)
    msgs = small_messages(topic, 10_000)
    placed = await produce_tracked(rocketmq.namesrv_addr, msgs)
    group = unique("G_spark_redeliver")
    out = tmp_path / "rows.parquet"
    store = parquet_writer(str(out))
    failed: list[BatchInfo] = []
    failed_rows: list[tuple[int, str, str]] = []
    calls = 0

    def write(df: DataFrame, info: BatchInfo) -> None:
        from pyspark.sql import functions as sf

        nonlocal calls
        calls += 1
        if calls == 2:  # remember what the failing call held
            failed.append(info)
            failed_rows.extend((seq_of(r.properties), r.msg_id, r.offset_msg_id) for r in
                               df.select("properties", "msg_id", "offset_msg_id").collect())
            raise OSError("injected failure on the second call")
        store(df.withColumn("batch_id", sf.lit(info.batch_id)), info)

    sink = SparkSink(spark, write, batch_rows=2000, write_retries=0)
    consumer = consumer_for(rocketmq.namesrv_addr, group)
    consumer.subscribe(topic, sink=sink)
    # Everything is written once: the failed batch's rows come back through %RETRY%<group>.
    await consume_until(consumer, sink, len(msgs), 120)

    stats = sink.statistics()
    assert stats.batches_given_up == 1 and stats.rows_given_up == len(failed_rows) > 0
    assert [info.batch_id for info in failed] == [2]
    table = read_table(spark, out)
    assert table.num_rows == len(msgs)
    rows = table.select(["topic", "queue_id", "queue_offset", "msg_id", "properties",
                         "reconsume_times", "batch_id"]).to_pylist()
    by_seq = {seq_of(r["properties"]): r for r in rows}
    assert set(by_seq) == set(range(len(msgs)))  # every message once, none twice
    retry_topic = f"%RETRY%{group}"
    for seq, msg_id, offset_msg_id in failed_rows:
        r = by_seq[seq]
        props = dict(r["properties"])
        assert r["topic"] == retry_topic and props["RETRY_TOPIC"] == topic
        assert r["msg_id"] == msg_id and props["ORIGIN_MESSAGE_ID"] == offset_msg_id
        assert r["reconsume_times"] == 1
        assert r["batch_id"] > 2
    failed_seqs = {seq for seq, _, _ in failed_rows}
    for seq, r in by_seq.items():
        if seq not in failed_seqs:
            assert (r["topic"], r["queue_id"], r["queue_offset"]) == (topic, *placed[seq])
    committed, maxes = await offsets(rocketmq.namesrv_addr, group, topic)
    assert committed == maxes


@pytest.mark.slow(seconds=24)
async def test_offsets_never_pass_a_failed_batch_across_a_kill(
        rocketmq: LocalRocketMQ, spark: SparkSession, tmp_path: Path) -> None:
    topic = unique("T_spark_failkill")
    await rocketmq.create_topic(topic, queues=8)
    placed = await produce_tracked(rocketmq.namesrv_addr, small_messages(topic, 6000))
    group = unique("G_spark_failkill")
    out = tmp_path / "rows.parquet"
    cfg = {
        "namesrv": rocketmq.namesrv_addr, "topic": topic, "group": group, "out": str(out),
        "batch_rows": 1000, "fail_from_batch": 2, "write_retries": 20, "retry_backoff": 0.5,
        "consumer": {"persist_offset_interval": 0.5},
    }
    async with consumer_process(cfg, tmp_path) as proc:
        first = await proc.next_event(lambda e: e["event"] == "written", 120)
        failed = await proc.next_event(lambda e: e["event"] == "write_failed", 60)
        assert (first["batch_id"], failed["batch_id"]) == (1, 2)
        # The batch keeps failing (retries with backoff) while the offsets are persisted
        # every 0.5 s; kill the process in the middle of that.
        await proc.next_event(lambda e: e["event"] == "write_failed", 30)
        await proc.next_event(lambda e: e["event"] == "write_failed", 30)
        await proc.kill()
    committed, maxes = await offsets(rocketmq.namesrv_addr, group, topic)
    written = batch_ranges(first)
    not_written = batch_ranges(failed)
    for qid, (lo, _hi) in not_written.items():
        assert committed[qid] <= lo, (qid, committed[qid], lo)
    for qid, (_lo, hi) in written.items():
        assert committed[qid] >= hi + 1, (qid, committed[qid], hi)  # batch 1 was committed

    # Restart (in this process) with a write that works: the rest arrives, nothing twice.
    run1 = key_counts(read_table(spark, out, ["topic", "queue_id", "queue_offset"]))
    remaining = sum(maxes[q] - max(committed[q], 0) for q in maxes)
    sink = SparkSink(spark, parquet_writer(str(out)), batch_rows=2000)
    consumer = consumer_for(rocketmq.namesrv_addr, group)
    consumer.subscribe(topic, sink=sink)
    await consume_until(consumer, sink, remaining, 120)
    counts = key_counts(read_table(spark, out, ["topic", "queue_id", "queue_offset"]))
    assert set(counts) == {(topic, q, o) for q, o in placed}
    duplicated = {k for k, n in counts.items() if n > 1}
    assert duplicated == {k for k in run1 if k[2] >= committed[k[1]]} == set()


@pytest.mark.slow(seconds=24)
async def test_kill_between_write_and_offset_persist_duplicates_only_that_window(
        rocketmq: LocalRocketMQ, spark: SparkSession, tmp_path: Path) -> None:
    topic = unique("T_spark_kill9")
    await rocketmq.create_topic(topic, queues=8)
    placed = await produce_tracked(rocketmq.namesrv_addr, small_messages(topic, 8000))
    group = unique("G_spark_kill9")
    out = tmp_path / "rows.parquet"
    cfg = {
        "namesrv": rocketmq.namesrv_addr, "topic": topic, "group": group, "out": str(out),
        "batch_rows": 1000, "hold_after_batch": 3, "consumer": {"persist_offset_interval": 1.0},
    }
    async with consumer_process(cfg, tmp_path) as proc:
        # Batch 3 is in the Parquet folder, and the process holds before acknowledging it.
        third = await proc.next_event(lambda e: e["event"] == "written" and e["batch_id"] == 3, 120)
        await proc.kill()
    committed, maxes = await offsets(rocketmq.namesrv_addr, group, topic)
    for qid, (lo, _hi) in batch_ranges(third).items():
        assert committed[qid] <= lo, "offsets passed a batch that was never acknowledged"
    run1 = key_counts(read_table(spark, out, ["topic", "queue_id", "queue_offset"]))
    window = {k for k in run1 if k[2] >= committed[k[1]]}
    assert len(window) >= third["rows"]  # at least batch 3 is written and not committed

    remaining = sum(maxes[q] - max(committed[q], 0) for q in maxes)
    sink = SparkSink(spark, parquet_writer(str(out)), batch_rows=2000)
    consumer = consumer_for(rocketmq.namesrv_addr, group)
    consumer.subscribe(topic, sink=sink)
    await consume_until(consumer, sink, remaining, 120)

    table = read_table(spark, out, KEY)
    counts = key_counts(table)
    sent = {(topic, q, o) for q, o in placed}
    assert set(counts) == sent  # every message at least once
    assert {k for k, n in counts.items() if n > 1} == window  # duplicates: exactly that window
    assert max(counts.values()) == 2
    dedup = spark.read.parquet(str(out)).dropDuplicates(KEY)
    assert dedup.count() == len(sent)
    assert set(key_counts(dedup.select("topic", "queue_id", "queue_offset").toArrow())) == sent

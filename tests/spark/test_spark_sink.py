"""The Spark sink against real local PySpark: exact round trips to Parquet, retries, failures,
body decoding and a responsive event loop while Spark writes."""

from __future__ import annotations

import asyncio
import datetime as dt
import json
import random
import time
import weakref
from collections.abc import Callable
from decimal import Decimal
from pathlib import Path
from typing import TYPE_CHECKING, Any

import msgpack  # type: ignore[import-untyped, unused-ignore]
import pyarrow as pa
import pytest

from rmq_async.protocol.types import MessageExt
from rmq_async.sinks import spark as spark_module
from rmq_async.sinks.spark import (
    SPARK_SCHEMA,
    BatchInfo,
    SparkSink,
    messages_to_arrow,
    parquet_writer,
)
from tests.helpers import collector_off

if TYPE_CHECKING:
    from pyspark.sql import DataFrame, SparkSession

pytestmark = pytest.mark.spark

KEY = ["topic", "broker_name", "queue_id", "queue_offset"]

_WORDS = ["created", "paid", "shipped", "größe", "注文", "заказ", "🚚", "a b", ""]


def synthetic_messages(n: int, seed: int = 7) -> list[MessageExt]:
    """Mixed sizes, tags, keys and properties across two topics, two brokers, four queues."""
    rng = random.Random(seed)
    next_offset: dict[tuple[str, str, int], int] = {}
    msgs = []
    for i in range(n):
        topic = rng.choice(["orders", "payments"])
        broker = rng.choice(["broker-a", "broker-b"])
        queue_id = rng.randrange(4)
        offset = next_offset.get((topic, broker, queue_id), 0)
        next_offset[(topic, broker, queue_id)] = offset + 1
        size = rng.choice([0, 1, 17, 300, 1024, 1024, 1024, 4096])
        props = {"UNIQ_KEY": f"7F000001{i:024X}", "origin": rng.choice(_WORDS)}
        tag = rng.choice([*_WORDS[:-1], None])
        if tag is not None:
            props["TAGS"] = tag
        keys = [f"{rng.choice(_WORDS[:3])}-{i}" for _ in range(rng.randrange(4))]
        if keys:
            props["KEYS"] = " ".join(keys)
        if i % 5 == 0:
            props[f"prop-{rng.choice(_WORDS)}"] = rng.choice(_WORDS) * 3
        msgs.append(
            MessageExt(
                topic=topic,
                body=rng.randbytes(size),
                queue_id=queue_id,
                queue_offset=offset,
                properties=props,
                born_timestamp=1_700_000_000_000 + i * 7,
                born_host=f"192.168.{i % 7}.{i % 200}:{30000 + i % 5000}",
                store_timestamp=1_700_000_000_000 + i * 7 + rng.randrange(1000),
                store_host=f"10.0.0.{1 if broker == 'broker-a' else 2}:10911",
                reconsume_times=rng.choice([0, 0, 0, 1, 16]),
                offset_msg_id=f"0A00000{1 if broker == 'broker-a' else 2}00002A9F{i:016X}",
                broker_name=broker,
            )
        )
    return msgs


async def pump(sink: SparkSink, msgs: list[MessageExt], chunk: int = 32) -> list[list[bool]]:
    """Offer ``msgs`` in chunks like the consumer does, pausing while the sink is behind."""
    acks: list[list[bool]] = []
    for start in range(0, len(msgs), chunk):
        got: list[bool] = []
        acks.append(got)
        sink.offer(msgs[start : start + chunk], got.append)
        if not sink.want_more():
            await sink.wait_for_room()
    return acks


def read_rows(spark: SparkSession, path: Path) -> pa.Table:
    from pyspark.sql import functions as sf

    df = spark.read.parquet(str(path)).select(
        *[c for c in SPARK_SCHEMA.names if not c.endswith("_timestamp")],
        sf.unix_millis("born_timestamp").alias("born_ms"),
        sf.unix_millis("store_timestamp").alias("store_ms"),
    )
    table: pa.Table = df.toArrow()
    return table


def row_of(m: MessageExt) -> dict[str, Any]:
    return {
        "topic": m.topic,
        "broker_name": m.broker_name,
        "queue_id": m.queue_id,
        "queue_offset": m.queue_offset,
        "msg_id": m.msg_id,
        "offset_msg_id": m.offset_msg_id,
        "tags": m.tags,
        "keys": m.keys,
        "body": m.body,
        "properties": sorted(m.properties.items()),
        "born_host": m.born_host,
        "store_host": m.store_host,
        "reconsume_times": m.reconsume_times,
        "born_ms": m.born_timestamp,
        "store_ms": m.store_timestamp,
    }


def rows_by_key(table: pa.Table) -> dict[tuple[Any, ...], dict[str, Any]]:
    rows: dict[tuple[Any, ...], dict[str, Any]] = {}
    for row in table.to_pylist():
        row["properties"] = sorted(row["properties"])
        key = tuple(row[k] for k in KEY)
        assert key not in rows, f"duplicate row {key}"
        rows[key] = row
    return rows


def test_dataframe_from_arrow_keeps_the_schema(spark: SparkSession) -> None:
    msgs = synthetic_messages(50)
    df = spark.createDataFrame(messages_to_arrow(msgs))
    assert df.schema == SPARK_SCHEMA
    first = df.limit(1).collect()[0]
    assert first["keys"] == msgs[0].keys
    assert first["properties"] == msgs[0].properties
    assert bytes(first["body"]) == msgs[0].body


async def test_20k_messages_round_trip_through_parquet(spark: SparkSession, tmp_path: Path) -> None:
    msgs = synthetic_messages(20_000)
    out = tmp_path / "out"
    # A session time zone other than UTC must not shift the stored instants.
    previous_tz = spark.conf.get("spark.sql.session.timeZone")
    spark.conf.set("spark.sql.session.timeZone", "America/Los_Angeles")
    try:
        sink = SparkSink(spark, parquet_writer(str(out)), batch_rows=5000, max_batch_latency=1.0)
        started = time.perf_counter()
        async with asyncio.TaskGroup() as tg:
            await sink.start(tg)
            acks = await pump(sink, msgs)
            await sink.aclose()
        seconds = time.perf_counter() - started
        table = read_rows(spark, out)
    finally:
        spark.conf.set("spark.sql.session.timeZone", previous_tz or "UTC")
    print(f"sink to Parquet: {len(msgs) / seconds:,.0f} rows/s ({len(msgs)} rows, {seconds:.1f} s)")
    assert all(a == [True] for a in acks)
    stats = sink.statistics()
    assert stats.rows_written == len(msgs) and stats.batches_given_up == 0
    got = rows_by_key(table)
    expected = {tuple(r[k] for k in KEY): r for r in map(row_of, msgs)}
    assert got.keys() == expected.keys()
    mismatched = [key for key, row in expected.items() if got[key] != row]
    assert mismatched == [], f"{len(mismatched)} rows differ, e.g. {mismatched[:3]}"


async def test_write_failing_on_its_second_call_is_retried(spark: SparkSession, tmp_path: Path) -> None:
    out = tmp_path / "out"
    target = parquet_writer(str(out))
    calls: list[int] = []

    def write(df: DataFrame, info: BatchInfo) -> None:
        calls.append(info.batch_id)
        if len(calls) == 2:
            raise RuntimeError("storage hiccup")
        target(df, info)

    msgs = synthetic_messages(3000, seed=11)
    sink = SparkSink(spark, write, batch_rows=1000, write_retries=2, retry_backoff=0.01)
    async with asyncio.TaskGroup() as tg:
        await sink.start(tg)
        acks = await pump(sink, msgs, chunk=100)
        await sink.aclose()
    assert calls == [1, 2, 2, 3]
    assert all(a == [True] for a in acks)
    got = rows_by_key(read_rows(spark, out))  # raises on a duplicate key
    assert got.keys() == {tuple(r[k] for k in KEY) for r in map(row_of, msgs)}


async def test_written_batches_are_freed_in_spark_without_waiting_for_the_collector(
        spark: SparkSession, monkeypatch: pytest.MonkeyPatch) -> None:
    """A written batch's DataFrame proxy sits in a py4j reference cycle, and with it the copy
    of its rows in Spark's driver: the sink collects it itself (here after every batch), not
    when Python's collector gets round to it (switched off here: with little allocation it ran
    so seldom that a driver filled with written batches)."""
    monkeypatch.setattr(spark_module, "_SPARK_GARBAGE_BYTES", 1)
    proxies: list[weakref.ref[Any]] = []

    def write(df: DataFrame, info: BatchInfo) -> None:
        df.write.mode("append").format("noop").save()
        proxies.append(weakref.ref(df._jdf))

    msgs = synthetic_messages(1500, seed=17)
    sink = SparkSink(spark, write, batch_rows=500, retry_backoff=0.01)
    with collector_off():
        async with asyncio.TaskGroup() as tg:
            await sink.start(tg)
            acks = await pump(sink, msgs, chunk=100)
            await sink.aclose()
        assert acks == [[True]] * 15
        assert len(proxies) == 3
        assert [ref() for ref in proxies] == [None, None, None]


async def test_retries_exhausted_fail_exactly_that_batch(spark: SparkSession, tmp_path: Path) -> None:
    out = tmp_path / "out"
    target = parquet_writer(str(out))

    def write(df: DataFrame, info: BatchInfo) -> None:
        if info.batch_id == 2:
            raise RuntimeError("table locked")
        target(df, info)

    msgs = synthetic_messages(1500, seed=13)
    sink = SparkSink(spark, write, batch_rows=500, write_retries=1, retry_backoff=0.01)
    async with asyncio.TaskGroup() as tg:
        await sink.start(tg)
        acks = await pump(sink, msgs, chunk=100)  # five offers per batch
        await sink.aclose()
    assert acks == [[True]] * 5 + [[False]] * 5 + [[True]] * 5
    failed = {tuple(r[k] for k in KEY) for r in map(row_of, msgs[500:1000])}
    got = rows_by_key(read_rows(spark, out))
    assert got.keys() == {tuple(r[k] for k in KEY) for r in map(row_of, msgs)} - failed
    assert sink.statistics().rows_given_up == 500


async def test_slow_write_keeps_the_event_loop_responsive(spark: SparkSession, tmp_path: Path) -> None:
    out = tmp_path / "out"
    target = parquet_writer(str(out))

    def slow_write(df: DataFrame, info: BatchInfo) -> None:
        target(df, info)
        time.sleep(1.0)

    lags: list[float] = []
    stop = asyncio.Event()

    async def ticker(period: float = 0.01) -> None:
        loop = asyncio.get_running_loop()
        while not stop.is_set():
            before = loop.time()
            await asyncio.sleep(period)
            lags.append(loop.time() - before - period)

    msgs = synthetic_messages(9000, seed=17)
    sink = SparkSink(spark, slow_write, batch_rows=3000, max_batch_latency=0.5)
    async with asyncio.TaskGroup() as tg:
        tg.create_task(ticker())
        await sink.start(tg)
        acks = await pump(sink, msgs, chunk=60)  # fifty offers per batch
        await sink.aclose()
        stop.set()
    assert all(a == [True] for a in acks)
    assert sink.statistics().batches_written == 3
    worst, median = max(lags), sorted(lags)[len(lags) // 2]
    print(
        f"event loop lag during slow writes: max {worst * 1000:.1f} ms, "
        f"median {median * 1000:.1f} ms over {len(lags)} ticks"
    )
    # Each write sleeps 1 s in its thread: a blocked loop would show lags of a second or more.
    # The bounds leave room for CPU contention with the JVM (and anything else) on 2 cores.
    assert len(lags) > 200
    assert worst < 0.75
    assert median < 0.02


def _value_rows(frames: list[Any]) -> Callable[[DataFrame, BatchInfo], None]:
    """A write that keeps the schema and the decoded values (timestamps as epoch micros)."""

    def write(df: DataFrame, info: BatchInfo) -> None:
        from pyspark.sql import functions as sf
        from pyspark.sql.types import StructType

        value_type = df.schema["value"].dataType
        assert isinstance(value_type, StructType)
        value_fields = value_type.names
        columns = [
            sf.unix_micros(f"value.{name}").alias(name) if name == "at" else sf.col(f"value.{name}")
            for name in value_fields
        ]
        frames.append(df.schema)
        rows = df.orderBy("queue_offset").select("body", *columns, sf.col("value").isNull().alias("null"))
        frames.extend(rows.collect())

    return write


async def test_json_bodies_decode_into_value(spark: SparkSession) -> None:
    from pyspark.sql.types import StructType

    schema = StructType.fromDDL(
        "id BIGINT, name STRING, at TIMESTAMP, amount DECIMAL(10,2), tags ARRAY<STRING>"
    )
    assert isinstance(schema, StructType)
    bodies = [
        json.dumps({"id": 1, "name": "ä", "at": "2024-03-01T10:00:00.250Z", "amount": "12.50",
                    "tags": ["x", "y"], "ignored": True}).encode(),
        b'{"id": 2}',
        b"{broken",
        b'{"id": "not a number", "name": "n"}',
        b"[1, 2, 3]",
        b"",
        b"\xff\xfe\xfd",
    ]  # fmt: skip
    msgs = synthetic_messages(len(bodies), seed=19)
    for offset, (m, body) in enumerate(zip(msgs, bodies, strict=True)):
        m.queue_id, m.queue_offset, m.body = 0, offset, body
    frames: list[Any] = []
    sink = SparkSink(spark, _value_rows(frames), value_format="json", value_schema=schema)
    sink.offer(msgs, lambda ok: None)
    await sink.aclose()
    df_schema, *rows = frames
    assert df_schema.names == [*SPARK_SCHEMA.names, "value"]
    assert [f.name for f in df_schema["value"].dataType.fields] == schema.names
    at_us = int(dt.datetime(2024, 3, 1, 10, 0, 0, 250000, tzinfo=dt.UTC).timestamp() * 1e6)
    assert [bytes(r["body"]) for r in rows] == bodies  # bodies kept, decoded or not
    assert [tuple(r)[1:] for r in rows] == [
        (1, "ä", at_us, Decimal("12.50"), ["x", "y"], False),
        (2, None, None, None, None, False),
        *[(None, None, None, None, None, True)] * 5,
    ]


async def test_msgpack_bodies_decode_into_value(spark: SparkSession) -> None:
    from pyspark.sql.types import StructType

    schema = StructType.fromDDL("id BIGINT, name STRING, at TIMESTAMP, tags ARRAY<STRING>")
    assert isinstance(schema, StructType)
    at = dt.datetime(2024, 3, 1, 10, 0, 0, 250000, tzinfo=dt.UTC)
    bodies = [
        msgpack.packb({"id": 1, "name": "ä", "at": msgpack.Timestamp.from_datetime(at),
                       "tags": ["x"]}),
        msgpack.packb({"id": 2}),
        b"\xc1",
        msgpack.packb({"id": "nope"}),
    ]  # fmt: skip
    msgs = synthetic_messages(len(bodies), seed=23)
    for offset, (m, body) in enumerate(zip(msgs, bodies, strict=True)):
        m.queue_id, m.queue_offset, m.body = 0, offset, body
    frames: list[Any] = []
    sink = SparkSink(spark, _value_rows(frames), value_format="msgpack", value_schema=schema)
    sink.offer(msgs, lambda ok: None)
    await sink.aclose()
    df_schema, *rows = frames
    assert df_schema.names == [*SPARK_SCHEMA.names, "value"]
    assert df_schema["value"].dataType == schema
    assert [bytes(r["body"]) for r in rows] == bodies
    assert [tuple(r)[1:] for r in rows] == [
        (1, "ä", int(at.timestamp() * 1_000_000), ["x"], False),
        (2, None, None, None, False),
        (None, None, None, None, True),
        (None, None, None, None, True),
    ]

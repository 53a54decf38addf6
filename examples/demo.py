"""The main job, end to end: RocketMQ -> rmq_async PushConsumer -> Spark DataFrames -> Parquet.

``make demo`` runs it on a fresh machine:

1. starts a real local RocketMQ (NameServer + Broker from the Apache jars) on loopback ports,
2. produces 100,000 mixed messages (sizes, tags, keys, properties) with batch sends,
3. consumes them with a ``PushConsumer`` whose subscription feeds a ``SparkSink``: every batch
   becomes a DataFrame (built from Arrow) and is appended to a Parquet folder; offsets move only
   after a batch was written,
4. prints a summary (rows, rows/s, a few rows read back from the Parquet folder),
5. stops the consumer and shuts the broker down.

Options: ``--messages N``, ``--out DIR`` (default: a temporary folder, removed at the end unless
``--keep``), ``--batch-rows N``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import random
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING

import structlog

from rmq_async import Message, Producer, PushConsumer
from rmq_async.devbroker import LocalRocketMQ
from rmq_async.sinks.spark import SparkSink, parquet_writer

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

TOPIC = "demo_orders"
GROUP = "demo_spark_group"
QUEUES = 8
TAGS = ["created", "paid", "shipped", "cancelled"]
REGIONS = ["eu-west", "us-east", "ap-south"]


def say(text: str) -> None:
    print(text, flush=True)


def demo_messages(n: int, seed: int = 1) -> list[Message]:
    """Orders as JSON of mixed sizes, with tags, one or two keys and a few user properties."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        order = {
            "order_id": i,
            "customer": f"c{rng.randrange(10_000):05d}",
            "amount": round(rng.uniform(1, 500), 2),
            "note": "x" * rng.choice([0, 10, 100, 400, 1500]),
        }
        keys = [f"order-{i}"] + ([f"customer-{order['customer']}"] if i % 3 == 0 else [])
        out.append(Message(
            TOPIC,
            json.dumps(order).encode(),
            tags=rng.choice(TAGS),
            keys=keys,
            properties={"region": rng.choice(REGIONS), "schema": "order/v1"},
        ))
    return out


async def produce(namesrv: str, msgs: list[Message], *, batch: int = 128, in_flight: int = 4) -> None:
    async with Producer("demo_producer", namesrv) as producer:
        sem = asyncio.Semaphore(in_flight)

        async def send(chunk: list[Message]) -> None:
            async with sem:
                await producer.send_batch(chunk)

        async with asyncio.TaskGroup() as tg:
            for i in range(0, len(msgs), batch):
                tg.create_task(send(msgs[i:i + batch]))


def start_spark() -> SparkSession:
    from pyspark.sql import SparkSession

    os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")  # local mode: stay on loopback
    # Local mode for the demo. On a cluster only the session changes (master "yarn",
    # "spark://host:7077" or "k8s://...", executors, memory) and the output path must be
    # shared storage the executors can write (hdfs://, s3a://, abfss://...).
    spark = (
        SparkSession.builder.master("local[2]")
        .appName("rmq_async-demo")
        .config("spark.ui.showConsoleProgress", "false")
        .config("spark.sql.shuffle.partitions", "2")
        .getOrCreate()
    )
    spark.sparkContext.setLogLevel("ERROR")
    return spark


async def consume(namesrv: str, spark: SparkSession, out: Path, total: int, batch_rows: int,
                  timeout: float) -> tuple[float, SparkSink]:
    sink = SparkSink(spark, parquet_writer(str(out)), batch_rows=batch_rows, max_batch_latency=2.0)
    # The consumer keeps every message the sink holds in its process queues, so its flow control
    # bounds the batches: per queue it must be allowed 2 * batch_rows / queues messages (one
    # batch written while the next fills); with less, batches close at half of what it allows.
    per_queue = max(1000, 2 * batch_rows // QUEUES)
    consumer = PushConsumer(
        GROUP, namesrv=namesrv,
        consume_from_where="CONSUME_FROM_FIRST_OFFSET",
        pull_threshold_for_queue=per_queue,
        consume_concurrently_max_span=per_queue,
    )
    consumer.subscribe(TOPIC, sink=sink)
    started = time.monotonic()
    last_report = started
    async with consumer:
        while sink.statistics().rows_written < total:
            if time.monotonic() - started > timeout:
                raise SystemExit(f"only {sink.statistics().rows_written} of {total} rows "
                                 f"written after {timeout:.0f} s")
            await asyncio.sleep(0.2)
            now = time.monotonic()
            if now - last_report >= 5.0:
                last_report = now
                written = sink.statistics().rows_written
                say(f"   ... {written:,} rows written ({written / (now - started):,.0f} rows/s)")
        elapsed = time.monotonic() - started
    return elapsed, sink


async def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--messages", type=int, default=100_000)
    parser.add_argument("--batch-rows", type=int, default=25_000)
    parser.add_argument("--out", type=Path, help="Parquet folder (default: a temporary one)")
    parser.add_argument("--keep", action="store_true", help="keep the Parquet folder")
    parser.add_argument("--timeout", type=float, default=600.0)
    args = parser.parse_args()
    # Errors only: with a sink the pull flow control is busy by design, and its warnings
    # ("pull.flow_control.cached_count") would drown the summary.
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.ERROR))

    tmp = Path(tempfile.mkdtemp(prefix="rmq_async_demo_"))
    out: Path = args.out or tmp / "orders.parquet"
    try:
        say("1. starting a local RocketMQ (NameServer + Broker; the first run downloads the jars)")
        t0 = time.monotonic()
        async with LocalRocketMQ() as rmq:
            say(f"   up in {time.monotonic() - t0:.1f} s, name server {rmq.namesrv_addr}")
            await rmq.create_topic(TOPIC, queues=QUEUES)

            msgs = demo_messages(args.messages)
            say(f"2. producing {len(msgs):,} messages to {TOPIC} ({QUEUES} queues)")
            t0 = time.monotonic()
            await produce(rmq.namesrv_addr, msgs)
            seconds = time.monotonic() - t0
            say(f"   sent in {seconds:.1f} s ({len(msgs) / seconds:,.0f} msgs/s)")

            say("3. starting Spark (local[2])")
            spark = await asyncio.to_thread(start_spark)
            try:
                say(f"4. consuming through PushConsumer + SparkSink into {out}")
                elapsed, sink = await consume(rmq.namesrv_addr, spark, out, len(msgs),
                                              args.batch_rows, args.timeout)
                stats = sink.statistics()
                say("5. summary")
                say(f"   rows written   {stats.rows_written:,} in {stats.batches_written} batches "
                    f"({stats.bytes_written / 1e6:,.1f} MB of bodies)")
                say(f"   end to end     {elapsed:.1f} s, {stats.rows_written / elapsed:,.0f} rows/s "
                    f"(Spark writes {stats.write_seconds:.1f} s of it, the first batch with the "
                    f"JVM's warm-up)")
                df = spark.read.parquet(str(out))
                rows = df.count()
                distinct = df.dropDuplicates(["topic", "broker_name", "queue_id", "queue_offset"]).count()
                say(f"   Parquet rows   {rows:,} ({distinct:,} distinct keys)")
                df.select("topic", "queue_id", "queue_offset", "tags", "keys",
                          df.properties["region"].alias("region"), "store_timestamp") \
                    .orderBy("queue_id", "queue_offset").show(5, truncate=False)
                df.groupBy("tags").count().orderBy("tags").show()
                ok = rows >= len(msgs) and distinct == len(msgs)
            finally:
                await asyncio.to_thread(spark.stop)
            say("6. stopping the broker")
        say("done" if ok else "FAILED: the Parquet rows do not match what was sent")
        return 0 if ok else 1
    finally:
        if args.keep:
            say(f"Parquet folder kept: {out}")
        else:
            shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))

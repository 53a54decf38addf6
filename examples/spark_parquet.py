"""Consume a RocketMQ topic into a Parquet folder through Spark, printing rows/s.

    python -m rmq_async.devbroker up            # prints NAMESRV_ADDR=127.0.0.1:<port>
    python examples/spark_parquet.py --namesrv 127.0.0.1:<port> --topic orders --out /tmp/orders.parquet

It runs until Ctrl-C (or ``--seconds``), then stops cleanly: the batch being filled is written
and its offsets are committed before the consumer leaves the group.

Local mode by default. On a cluster only two things change: the SparkSession
(``--master yarn``, ``spark://host:7077`` or ``k8s://https://...``, with executors and memory
set the usual way, for example through ``spark-submit``) and the output path, which must be
storage every executor can write (``hdfs://``, ``s3a://``, ``abfss://``...). The consumer runs in
the driver; the sink hands each batch to Spark as one DataFrame built from Arrow.

Batches and flow control: the consumer holds every message the sink has not yet written, so a
batch of ``--batch-rows`` needs the consumer to let in twice that many (one batch written while
the next fills): ``pull_threshold_for_queue`` and ``consume_concurrently_max_span`` are set to
``2 * batch_rows / queues`` here. With smaller thresholds the sink closes batches at half of
what they allow, so nothing waits.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import signal
import time
from typing import TYPE_CHECKING

import structlog

from rmq_async import PushConsumer
from rmq_async.sinks.spark import SparkSink, parquet_writer

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

def build_spark(master: str) -> SparkSession:
    from pyspark.sql import SparkSession

    spark = (
        SparkSession.builder.master(master)
        .appName("rmq_async-spark-parquet")
        .config("spark.ui.showConsoleProgress", "false")
        .getOrCreate()
    )
    spark.sparkContext.setLogLevel("WARN")
    return spark


async def run(args: argparse.Namespace) -> None:
    spark = await asyncio.to_thread(build_spark, args.master)
    sink = SparkSink(
        spark,
        parquet_writer(args.out, partition_by=args.partition_by),
        batch_rows=args.batch_rows,
        max_batch_latency=args.max_latency,
    )
    per_queue = max(1000, 2 * args.batch_rows // args.queues)
    consumer = PushConsumer(
        args.group,
        namesrv=args.namesrv,
        consume_from_where=args.consume_from,
        pull_threshold_for_queue=min(per_queue, 65535),
        consume_concurrently_max_span=min(per_queue, 65535),
    )
    consumer.subscribe(args.topic, tags=args.tags, sink=sink)

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(NotImplementedError):
            loop.add_signal_handler(sig, stop.set)

    started = time.monotonic()
    async with consumer:
        last_rows, last_time = 0, started
        while not stop.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), args.report_every)
            now = time.monotonic()
            rows = sink.statistics().rows_written
            print(f"{rows:>12,} rows  {(rows - last_rows) / (now - last_time):>10,.0f} rows/s now  "
                  f"{rows / (now - started):>10,.0f} rows/s overall  backlog {sink.backlog_rows:,}",
                  flush=True)
            last_rows, last_time = rows, now
            if args.seconds is not None and now - started >= args.seconds:
                stop.set()
    stats = sink.statistics()
    elapsed = time.monotonic() - started
    print(f"stopped: {stats.rows_written:,} rows in {stats.batches_written} batches, "
          f"{elapsed:.1f} s, {stats.rows_written / elapsed:,.0f} rows/s; Parquet at {args.out}")
    await asyncio.to_thread(spark.stop)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--namesrv", required=True, help="name server address host:port")
    parser.add_argument("--topic", required=True)
    parser.add_argument("--tags", default="*", help='TAG expression, e.g. "created || paid"')
    parser.add_argument("--group", default="spark_parquet_group")
    parser.add_argument("--out", required=True, help="Parquet folder (any URI Spark can write)")
    parser.add_argument("--partition-by", nargs="*", default=[], help="Parquet partition columns")
    parser.add_argument("--master", default="local[2]", help="Spark master")
    parser.add_argument("--batch-rows", type=int, default=25_000)
    parser.add_argument("--max-latency", type=float, default=5.0, help="seconds a batch may fill")
    parser.add_argument("--queues", type=int, default=8, help="queues this client consumes")
    parser.add_argument("--consume-from", default="CONSUME_FROM_FIRST_OFFSET")
    parser.add_argument("--report-every", type=float, default=5.0)
    parser.add_argument("--seconds", type=float, help="stop after this many seconds")
    args = parser.parse_args()
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))
    asyncio.run(run(args))


if __name__ == "__main__":
    main()

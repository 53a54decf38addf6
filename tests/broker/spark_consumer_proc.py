"""A consumer process for the Spark pipeline tests: PushConsumer + SparkSink into Parquet.

The tests start it with ``python -m tests.broker.spark_consumer_proc '<json config>'`` so that
they can SIGKILL it at a chosen moment, or measure its memory alone. It reports on stdout, one
JSON object per line:

* ``{"event": "started", "baseline_rss_kib": ...}`` once the consumer runs;
* ``{"event": "written", "batch_id", "rows", "ranges"}`` from inside ``write``, after the batch
  is stored (``ranges``: ``[topic, broker_name, queue_id, first, last]`` per queue);
* ``{"event": "write_failed", "batch_id", "rows", "ranges"}`` from inside ``write`` before it
  raises;
* ``{"event": "done", ...}`` with statistics once ``expect_rows`` rows are written and the
  consumer has stopped.

Config keys: ``namesrv``, ``topic``, ``group``, ``out`` (Parquet folder), ``batch_rows``,
``max_batch_latency``, ``write_retries``, ``retry_backoff``, ``consumer`` (PushConsumer
options), ``fail_from_batch`` (every write of that batch id and later raises),
``hold_after_batch`` (after storing that batch, report it and block: the batch is written but
never acknowledged), ``write_sleep`` (seconds slept by every write), ``expect_rows``.
"""

from __future__ import annotations

import asyncio
import json
import logging
import resource
import sys
import threading
import time
from typing import TYPE_CHECKING, Any

import structlog

from rmq_async import PushConsumer
from rmq_async.sinks.spark import BatchInfo, SparkSink
from tests.spark.session import local_spark

if TYPE_CHECKING:
    from pyspark.sql import DataFrame

_out_lock = threading.Lock()


def emit(**event: Any) -> None:
    with _out_lock:
        sys.stdout.write(json.dumps(event) + "\n")
        sys.stdout.flush()


def current_rss_kib() -> int:
    with open("/proc/self/statm") as f:
        pages = int(f.read().split()[1])
    return pages * resource.getpagesize() // 1024


def peak_rss_kib() -> int:
    """This process's peak RSS (``VmHWM``). Not ``ru_maxrss``: that one keeps the peak of the
    parent's memory image this process was forked from, across the exec."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1])
    raise RuntimeError("no VmHWM in /proc/self/status")


def ranges_of(info: BatchInfo) -> list[list[Any]]:
    return [[mq.topic, mq.broker_name, mq.queue_id, lo, hi]
            for mq, (lo, hi) in info.offset_ranges.items()]


async def main(cfg: dict[str, Any]) -> None:
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING),
                        logger_factory=structlog.PrintLoggerFactory(sys.stderr))
    spark = local_spark("rmq_async-test-consumer")
    out = cfg["out"]
    fail_from = cfg.get("fail_from_batch")
    hold_after = cfg.get("hold_after_batch")
    write_sleep = float(cfg.get("write_sleep", 0.0))
    never = threading.Event()

    def write(df: DataFrame, info: BatchInfo) -> None:
        if fail_from is not None and info.batch_id >= fail_from:
            emit(event="write_failed", batch_id=info.batch_id, rows=info.row_count,
                 ranges=ranges_of(info))
            raise RuntimeError(f"injected failure of batch {info.batch_id}")
        if write_sleep:
            time.sleep(write_sleep)
        df.write.mode("append").parquet(out)
        emit(event="written", batch_id=info.batch_id, rows=info.row_count, ranges=ranges_of(info),
             rss_kib=current_rss_kib())
        if hold_after is not None and info.batch_id >= hold_after:
            never.wait()  # stored, never acknowledged: the test kills the process now

    sink = SparkSink(
        spark, write,
        batch_rows=cfg.get("batch_rows", 50_000),
        max_batch_latency=cfg.get("max_batch_latency", 1.0),
        write_retries=cfg.get("write_retries", 3),
        retry_backoff=cfg.get("retry_backoff", 0.2),
    )
    options = {"consume_from_where": "CONSUME_FROM_FIRST_OFFSET", **cfg.get("consumer", {})}
    consumer = PushConsumer(cfg["group"], namesrv=cfg["namesrv"], **options)
    consumer.subscribe(cfg["topic"], sink=sink)
    baseline = current_rss_kib()
    expect = cfg.get("expect_rows")
    max_cached = max_backlog = 0
    async with consumer:
        emit(event="started", baseline_rss_kib=baseline)
        while expect is None or sink.statistics().rows_written < expect:
            cached = sum(pq.msg_count for mq, pq in consumer.process_queues.items()
                         if mq.topic == cfg["topic"])
            max_cached = max(max_cached, cached)
            max_backlog = max(max_backlog, sink.backlog_rows)
            await asyncio.sleep(0.05)
    stats = sink.statistics()
    emit(event="done", rows_written=stats.rows_written, batches=stats.batches_written,
         write_seconds=round(stats.write_seconds, 2), baseline_rss_kib=baseline,
         peak_rss_kib=peak_rss_kib(), max_cached=max_cached, max_backlog=max_backlog,
         effective_batch_rows=sink.effective_batch_rows)
    spark.stop()


if __name__ == "__main__":
    asyncio.run(main(json.loads(sys.argv[1])))

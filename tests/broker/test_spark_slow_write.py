"""The Spark sink's memory stays bounded under a slow write: 500,000 messages through a
consumer process whose Parquet writes take 2 s each, against the real broker and local PySpark.

On its own file so that ``make test``'s workers, which take a file at a time, run it beside
the other Spark pipeline tests (``test_spark_pipeline.py``) rather than after them. Its rows
are read back with pyarrow: this file starts no Spark session of its own (the consumer process
runs the one that writes).
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

pytest.importorskip("pyspark", reason="needs the spark extra")

import pyarrow.parquet as pq

from rmq_async.devbroker import LocalRocketMQ
from tests.broker.spark_pipeline_support import (
    cached_bytes_per_message,
    consumer_process,
    key_counts,
    produce_tracked,
    small_messages,
)
from tests.helpers import unique

pytestmark = [pytest.mark.broker, pytest.mark.spark]


@pytest.mark.slow(seconds=120)
@pytest.mark.timeout(600)  # 500k messages through a deliberately slow writer
async def test_slow_write_keeps_memory_bounded_over_500k_messages(
        rocketmq: LocalRocketMQ, tmp_path: Path) -> None:
    topic = unique("T_spark_slow")
    await rocketmq.create_topic(topic, queues=8)
    total = 500_000
    placed = await produce_tracked(rocketmq.namesrv_addr, small_messages(topic, total),
                                   batch=512, in_flight=4)
    per_message = await cached_bytes_per_message(rocketmq.namesrv_addr, topic)
    out = tmp_path / "rows.parquet"
    per_queue = 6250  # 8 queues: at most ~50,000 messages held, batches of 25,000
    cfg = {
        "namesrv": rocketmq.namesrv_addr, "topic": topic, "group": unique("G_spark_slow"),
        "out": str(out), "batch_rows": 1_000_000, "max_batch_latency": 5.0, "write_sleep": 2.0,
        "expect_rows": total,
        "consumer": {"pull_threshold_for_queue": per_queue,
                     "consume_concurrently_max_span": per_queue},
    }
    started = time.monotonic()
    async with consumer_process(cfg, tmp_path) as proc:
        done = await proc.next_event(lambda e: e["event"] == "done", 300)
        assert await proc.proc.wait() == 0, proc.stderr_tail()
    seconds = time.monotonic() - started
    growth_mib = (done["peak_rss_kib"] - done["baseline_rss_kib"]) / 1024
    all_cached_mib = total * per_message / 2**20
    print(f"\n500k messages, 2 s per write: {seconds:.0f} s, {done['batches']} batches of "
          f"{done['effective_batch_rows']}, peak RSS {done['peak_rss_kib'] / 1024:.0f} MiB "
          f"(+{growth_mib:.0f} MiB over the started consumer; all 500k messages cached would be "
          f"{all_cached_mib:.0f} MiB at {per_message:.0f} B each), {done}")
    capacity = 8 * (per_queue + 32)
    assert done["effective_batch_rows"] == 8 * (per_queue + 1) // 2
    assert done["rows_written"] == total
    assert done["max_cached"] <= capacity and done["max_backlog"] <= capacity
    # What the process grew by is a fraction of what holding the 500,000 waiting messages
    # would take (it holds at most a tenth of them, plus up to two batches in Arrow form: the
    # one being written and the next one, converted while that write runs). Measured on the
    # project's machine: +84 MiB with one batch in Arrow form, +121 to +124 MiB with two, of 361.
    assert growth_mib < all_cached_mib / 2.5, done
    counts = key_counts(pq.read_table(out, columns=["topic", "queue_id", "queue_offset"]))
    assert len(counts) == total and max(counts.values()) == 1
    assert set(counts) == {(topic, q, o) for q, o in placed}

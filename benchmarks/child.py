"""One measured Python contender, run by ``benchmarks/run.py`` in a process of its own.

``python benchmarks/child.py '<json spec>'`` where the spec's ``kind`` is one of

* ``push``: an rmq_async :class:`~rmq_async.PushConsumer` with a no-op async listener (it only
  counts, marks each (queue, offset) to detect duplicates and, for latency runs, records the
  born-to-listener and store-to-listener times);
* ``raw``: a bare loop of PULL_MESSAGE calls, one in flight per queue, with or without decoding
  the stored messages: no rebalance, no process queue, no listener;
* ``spark``: the Spark sink into Parquet, plain Spark writing the same rows from in-memory
  Arrow tables, and the RocketMQ source (``format("rocketmq")``, a stream with trigger
  availableNow) reading the topic on Spark's executors into Parquet.

It speaks the line protocol of :mod:`benchlib` on standard output.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import json
import os
import shutil
import sys
import time
import uuid
from importlib.metadata import version
from pathlib import Path
from typing import Any

import structlog
from benchlib import (
    PROBE_TAG,
    PROGRESS_INTERVAL,
    UNCOUNTED_TAGS,
    Tally,
    cpu_times,
    emit,
    emit_result,
    host_cpu_ticks,
    process_cpu_seconds,
    round_orders,
    side_figures,
    side_readings,
    steal_percent,
    tree_cpu_seconds,
)

from rmq_async import ConsumeResult, MessageExt, PushConsumer
from rmq_async.client.api import PullStatus
from rmq_async.client.instance import ClientInstance
from rmq_async.protocol import message as message_codec
from rmq_async.protocol.types import PROPERTY_MAX_OFFSET, PROPERTY_MIN_OFFSET, MessageQueue


def quiet_logging() -> None:
    """Warnings and errors only: a benchmark run logs nothing per message."""
    import logging

    structlog.configure(
        wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING),
        logger_factory=structlog.PrintLoggerFactory(sys.stderr),
    )


class Watch:
    """Waits for a tally to complete, prints progress, gives up after a stall."""

    def __init__(self, tally: Tally, queues: int, stall_timeout: float) -> None:
        self.tally = tally
        self.queues = queues
        self.stall_timeout = stall_timeout
        self.done = asyncio.Event()
        self.ready_at = 0.0
        self.reason = ""

    def check_ready(self) -> None:
        if self.ready_at:
            return
        live = len(self.tally.probe_queues) >= self.queues if self.tally.latency else self.tally.consumed > 0
        if live:
            self.ready_at = time.perf_counter()
            emit("READY")

    async def wait(self) -> bool:
        last = -1
        last_change = time.perf_counter()
        while True:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.done.wait(), PROGRESS_INTERVAL)
            if self.done.is_set():
                emit(f"PROGRESS {self.tally.consumed}")
                return True
            now = time.perf_counter()
            self.check_ready()
            if self.tally.consumed != last:
                last = self.tally.consumed
                last_change = now
            elif now - last_change > self.stall_timeout:
                self.reason = (f"no progress for {self.stall_timeout} s at {last} of "
                               f"{self.tally.expected}")
                return False
            emit(f"PROGRESS {self.tally.consumed}")


# ---------------------------------------------------------------------- push consumer


async def run_push(spec: dict[str, Any]) -> dict[str, Any]:
    tally = Tally(int(spec["expected"]), latency=bool(spec.get("latency")))
    watch = Watch(tally, int(spec["queues"]), float(spec["stall_timeout"]))
    consumer = PushConsumer(
        spec["group"], spec["namesrv"], consume_from_where="CONSUME_FROM_FIRST_OFFSET",
        instance_name=f"bench-{os.getpid()}", **spec.get("options", {}),
    )
    latency = tally.latency

    async def on_messages(msgs: list[MessageExt]) -> ConsumeResult:
        now = time.perf_counter()
        wall_ms = int(time.time() * 1000) if latency else 0
        n = 0
        size = 0
        for m in msgs:
            if latency:
                tag = m.properties.get("TAGS")
                if tag in UNCOUNTED_TAGS:
                    if tag == PROBE_TAG:
                        tally.probe_queues.add(m.queue_id)
                    continue
            n += 1
            size += len(m.body)
            tally.mark(m.queue_id, m.queue_offset)
            if latency:
                tally.b2c.append(wall_ms - m.born_timestamp)
                tally.s2c.append(wall_ms - m.store_timestamp)
        tally.body_bytes += size
        if n and tally.add(n, now):
            watch.done.set()
        elif not n:
            tally.listener_calls += 1
        return ConsumeResult.SUCCESS

    consumer.subscribe(spec["topic"], listener=on_messages, batch=True)
    broker_pid = spec.get("broker_pid")
    side0 = side_readings(broker_pid)
    cpu0 = cpu_times()
    t0 = time.perf_counter()
    await consumer.start()
    try:
        ok = await watch.wait()
        cpu1 = cpu_times()
        side1 = side_readings(broker_pid)
        # Late duplicates (a redelivery) would show up right after the last message.
        await asyncio.sleep(0.3)
    finally:
        with contextlib.suppress(Exception):
            await consumer.stop(timeout=5.0)
    return tally.result(ok=ok, reason=watch.reason, started_at=t0, ready_at=watch.ready_at,
                        cpu_start=cpu0, cpu_end=cpu1, extra=side_figures(side0, side1))


# ---------------------------------------------------------------------- raw pull loop


async def run_raw(spec: dict[str, Any]) -> dict[str, Any]:
    tally = Tally(int(spec["expected"]))
    decode = bool(spec.get("decode"))
    batch = int(spec.get("pull_batch_size", 32))
    instance = ClientInstance(spec["namesrv"], f"127.0.0.1@bench-raw-{os.getpid()}")
    topic = spec["topic"]
    group = spec["group"]
    broker_pid = spec.get("broker_pid")
    side0 = side_readings(broker_pid)
    cpu0 = cpu_times()
    t0 = time.perf_counter()
    try:
        await instance.update_route(topic)
        queues: list[MessageQueue] = sorted(await instance.subscribe_queues(topic))
        addrs = {mq: await instance.find_broker_master(mq.broker_name, topic) for mq in queues}

        async def drain(mq: MessageQueue) -> None:
            offset = 0
            api = instance.api
            addr = addrs[mq]
            while True:
                r = await api.pull_message(addr, group=group, mq=mq, queue_offset=offset,
                                           max_msg_nums=batch, suspend_timeout=0.0,
                                           timeout=10.0, subscription="*")
                if r.status is PullStatus.FOUND:
                    if decode:
                        msgs = r.decode()
                        n = len(msgs)
                    else:
                        n = r.next_begin_offset - offset
                    tally.body_bytes += len(r.body)
                    tally.add(n, time.perf_counter())
                elif r.status is not PullStatus.NO_MATCHED_MSG:
                    return
                offset = r.next_begin_offset

        async def progress() -> None:
            while True:
                await asyncio.sleep(PROGRESS_INTERVAL)
                emit(f"PROGRESS {tally.consumed}")

        reporter = asyncio.create_task(progress())
        try:
            await asyncio.gather(*(drain(mq) for mq in queues))
        finally:
            reporter.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await reporter
        cpu1 = cpu_times()
        side1 = side_readings(broker_pid)
    finally:
        await instance.close()
    emit(f"PROGRESS {tally.consumed}")
    ok = tally.consumed == tally.expected
    reason = "" if ok else f"pulled {tally.consumed} of {tally.expected}"
    if not tally.end_at:
        tally.end_at = time.perf_counter()
    return tally.result(ok=ok, reason=reason, started_at=t0, ready_at=0.0, cpu_start=cpu0,
                        cpu_end=cpu1, extra={"decode": decode,
                                             "body_bytes_note": "wire bytes (stored records)",
                                             **side_figures(side0, side1)})


# ---------------------------------------------------------------------- spark sink


def _spark_session(app: str) -> Any:
    from pyspark.sql import SparkSession

    # The RocketMQ source runs in Spark's Python workers: they must import rmq_async.
    os.environ["PYSPARK_PYTHON"] = sys.executable
    session = (
        SparkSession.builder.master("local[2]")
        .appName(app)
        .config("spark.ui.enabled", "false")
        .config("spark.ui.showConsoleProgress", "false")
        .config("spark.sql.shuffle.partitions", "2")
        .config("spark.default.parallelism", "2")
        .config("spark.driver.memory", "2g")
        .config("spark.pyspark.python", sys.executable)
        .getOrCreate()
    )
    session.sparkContext.setLogLevel("ERROR")
    return session


#: The broker's per-pull caps for messages still in memory, raised for the "bulk" sink run
#: (defaults: 32 messages, 256 KiB), and the consumer's pull batch size that goes with them.
BULK_BROKER_CONFIG = {"maxTransferCountOnMessageInMemory": "256",
                      "maxTransferBytesOnMessageInMemory": str(1024 * 1024)}
BULK_PULL_BATCH_SIZE = 256


@contextlib.asynccontextmanager
async def _broker_config(spec: dict[str, Any], values: dict[str, str]) -> Any:
    """Set broker settings at run time for the duration of the block, then restore them."""
    instance = ClientInstance(spec["namesrv"], f"127.0.0.1@bench-config-{os.getpid()}")
    try:
        await instance.update_route(spec["topic"])
        mq = sorted(await instance.subscribe_queues(spec["topic"]))[0]
        addr = await instance.find_broker_master(mq.broker_name, spec["topic"])
        current = await instance.api.get_broker_config(addr)
        before = {k: current[k] for k in values if k in current}
        await instance.api.update_broker_config(addr, values)
        try:
            yield
        finally:
            await instance.api.update_broker_config(addr, before)
    finally:
        await instance.close()


async def _sink_run(spark: Any, spec: dict[str, Any], path: Path,
                    pull_batch_size: int = 32) -> dict[str, Any]:
    from rmq_async.sinks.spark import SparkSink, parquet_writer

    expected = int(spec["expected"])
    batch_rows = int(spec["batch_rows"])
    # A drain of a preloaded backlog: the last partial batch is written once every queue is
    # read to its end, as plain Spark writes its last table at once.
    sink = SparkSink(spark, parquet_writer(str(path)), batch_rows=batch_rows,
                     max_batch_latency=float(spec.get("max_batch_latency", 5.0)),
                     flush_when_caught_up=True)
    queues = int(spec["queues"])
    consumer = PushConsumer(
        f"{spec['group']}_sink_{uuid.uuid4().hex[:6]}", spec["namesrv"],
        consume_from_where="CONSUME_FROM_FIRST_OFFSET", instance_name=f"bench-sink-{os.getpid()}",
        # Room for one batch being written while the next fills (see SparkSink's docstring):
        # the cached-count and the offset-span limits per queue must both allow it, with a
        # quarter batch to spare, as queues do not fill batches evenly (with no spare, a queue
        # at its limit closes the last batch early and its remaining rows make a batch of
        # their own).
        pull_threshold_for_queue=max(1000, 9 * batch_rows // (4 * queues)),
        consume_concurrently_max_span=max(2000, 9 * batch_rows // (4 * queues)),
        pull_batch_size=pull_batch_size,
    )
    consumer.subscribe(spec["topic"], sink=sink)
    t0 = time.perf_counter()
    await consumer.start()
    ok = True
    reason = ""
    last, last_change = -1, time.perf_counter()
    shown = 0.0
    try:
        while True:
            stats = sink.statistics()
            if stats.rows_written >= expected:
                break
            now = time.perf_counter()
            if stats.rows_written != last:
                last, last_change = stats.rows_written, now
            elif now - last_change > float(spec["stall_timeout"]):
                ok, reason = False, f"sink stalled at {last} of {expected} rows"
                break
            if now - shown >= PROGRESS_INTERVAL:
                emit(f"PROGRESS {stats.rows_written}")
                shown = now
            await asyncio.sleep(0.02)  # the end is seen within 20 ms
        seconds = time.perf_counter() - t0
    finally:
        with contextlib.suppress(Exception):
            await consumer.stop(timeout=30.0)
    stats = sink.statistics()
    return {"ok": ok, "reason": reason, "rows": stats.rows_written, "seconds": round(seconds, 3),
            "batches": stats.batches_written, "write_seconds": round(stats.write_seconds, 3),
            "rows_per_s": round(stats.rows_written / seconds, 1) if seconds > 0 else 0.0}


async def _pull_batches(spec: dict[str, Any], batch_rows: int) -> list[list[MessageExt]]:
    """Every message of the topic (raw pulls, untimed), in batches cut as the sink cuts them:
    whole pulls, a batch closed before a pull that would take it past ``batch_rows`` (49,984
    rows of 32-message pulls for 50,000, not 50,000: the same number of Spark jobs as the
    sink's)."""
    instance = ClientInstance(spec["namesrv"], f"127.0.0.1@bench-arrow-{os.getpid()}")
    topic = spec["topic"]

    async def drain(mq: MessageQueue) -> list[list[MessageExt]]:
        addr = await instance.find_broker_master(mq.broker_name, topic)
        got: list[list[MessageExt]] = []
        offset = 0
        while True:
            r = await instance.api.pull_message(
                addr, group=spec["group"] + "_arrow", mq=mq, queue_offset=offset,
                max_msg_nums=32, suspend_timeout=0.0, timeout=10.0, subscription="*")
            if r.status is not PullStatus.FOUND:
                return got
            msgs = r.decode()
            # As a consumer delivers them (and the sink lands them): the queue's broker name
            # and the pull's MIN_OFFSET / MAX_OFFSET properties, so both write the same rows.
            message_codec.stamp_delivered(msgs, mq.broker_name, {
                PROPERTY_MIN_OFFSET: str(r.min_offset), PROPERTY_MAX_OFFSET: str(r.max_offset)})
            got.append(msgs)
            offset = r.next_begin_offset

    try:
        await instance.update_route(topic)
        queues = sorted(await instance.subscribe_queues(topic))
        per_queue = await asyncio.gather(*(drain(mq) for mq in queues))
    finally:
        await instance.close()
    return pack_pulls([pull for pulls in per_queue for pull in pulls], batch_rows)


def pack_pulls(pulls: list[list[MessageExt]], batch_rows: int) -> list[list[MessageExt]]:
    """Pulls into batches as the sink packs its chunks: a pull is never split, and one that
    would take a batch past ``batch_rows`` starts the next."""
    batches: list[list[MessageExt]] = []
    current: list[MessageExt] = []
    for pull in pulls:
        if current and len(current) + len(pull) > batch_rows:
            batches.append(current)
            current = []
        current.extend(pull)
    if current:
        batches.append(current)
    return batches


def _verify_parquet(path: Path, expected: int, property_names: set[str] | None = None,
                    body_size: int | None = None) -> tuple[bool, str]:
    """Every row once; with ``property_names``, the rows' property names are exactly those
    (the sink's rows against the baseline's: the same rows, not merely as many); with
    ``body_size``, every body whole: ``expected`` bodies of that size whose leading indexes
    (the preload's ``%012d|``) are 0 … expected - 1, each once.

    Read back with pyarrow, column by column (the bodies a record batch at a time), not with a
    Spark query: a `distinct().count()` over 1,000,000 keys once failed with
    AGGREGATE_OUT_OF_MEMORY in the third round of a full run (the driver's execution memory
    after the rounds before), which cost the run its whole Spark scenario.
    """
    import pyarrow as pa
    import pyarrow.compute as pc
    import pyarrow.dataset as pads
    import pyarrow.parquet as pq

    keys = pq.read_table(path, columns=["queue_id", "queue_offset"])
    rows = keys.num_rows
    # (queue id, offset) as one integer: queue ids are small, offsets below 2**40.
    packed = pc.bit_wise_or(pc.shift_left(keys.column("queue_id").cast(pa.int64()), 40),
                            keys.column("queue_offset").cast(pa.int64()))
    distinct = pc.count_distinct(packed).as_py()
    del keys, packed
    if rows != expected or distinct != expected:
        return False, f"parquet holds {rows} rows, {distinct} distinct of {expected}"
    if property_names is not None:
        found = _table_property_names(pq.read_table(path, columns=["properties"]))
        if found != property_names:
            return False, f"rows hold the properties {sorted(found)}, not {sorted(property_names)}"
    if body_size is not None:
        return _verify_bodies(pads.dataset(str(path), format="parquet"), expected, body_size)
    return True, ""


def _verify_bodies(dataset: Any, expected: int, body_size: int) -> tuple[bool, str]:
    import pyarrow as pa
    import pyarrow.compute as pc

    total = 0
    indexes: list[Any] = []
    for batch in dataset.to_batches(columns=["body"]):
        body = batch.column(0)
        total += pc.sum(pc.binary_length(body)).as_py() or 0
        head = pc.binary_slice(body, 0, 12).cast(pa.string())
        try:
            indexes.append(pc.cast(head, pa.int64()))
        except pa.ArrowInvalid:
            return False, "a body does not start with its 12-digit index"
    if total != expected * body_size:
        return False, f"bodies hold {total} bytes, not {expected} x {body_size}"
    found = pa.chunked_array(indexes, type=pa.int64())
    low, high = pc.min_max(found).values()
    distinct = pc.count_distinct(found).as_py()
    if (low.as_py(), high.as_py(), distinct) != (0, expected - 1, expected):
        return False, (f"body indexes {low} … {high}, {distinct} distinct: not 0 … "
                       f"{expected - 1} once each")
    return True, ""


def _table_property_names(table: Any) -> set[str]:
    import pyarrow.compute as pc

    return {str(k) for chunk in table.column("properties").chunks
            for k in pc.unique(chunk.keys).to_pylist()}


def _source_stream(spark: Any, spec: dict[str, Any], path: Path, checkpoint: Path) -> int:
    """The RocketMQ source (format rocketmq) streamed into Parquet until the topic is drained:
    micro-batches of ``batch_rows`` offsets, trigger availableNow; returns the rows read."""
    query = (spark.readStream.format("rocketmq")
             .option("namesrv", spec["namesrv"])
             .option("topics", spec["topic"])
             .option("startingOffsets", "earliest")
             .option("maxMessagesPerTrigger", str(spec["batch_rows"]))
             .load()
             .writeStream.format("parquet")
             .option("path", str(path))
             .option("checkpointLocation", str(checkpoint))
             .trigger(availableNow=True)
             .start())
    query.awaitTermination()
    return sum(int(p.numInputRows) for p in query.recentProgress)


def _write_parquet(spark: Any, table: Any, path: Path) -> None:
    spark.createDataFrame(table).write.mode("append").parquet(str(path))


#: A :class:`_CpuMeter` reading: this process's CPU seconds, Spark's per process, the broker's,
#: and the machine's (steal, all) clock ticks.
_Snapshot = tuple[float, dict[tuple[int, int], float], float | None, tuple[int, int] | None]


class _CpuMeter:
    """CPU seconds of the processes a Spark round runs on: this one (the consumer and the sink,
    or the plain path's table serialisation: the driver's Python side), Spark (every process
    below this one: the JVM and the Python workers it started) and the broker (when its pid is
    known); and the host's steal over the round (:func:`benchlib.host_cpu_ticks`).

    Spark's figure is summed process by process: what each process used between the two
    snapshots (all of it for one started meanwhile), with the CPU of the children it waited
    for. A process that exits during the round counts nothing for the round: Spark's idle
    Python workers (left by the source round) exit a minute later, in some later round, and
    their parent does not add their CPU to its own; summing the totals of the live processes
    instead took all the CPU such a worker had ever used out of that round's figure.
    """

    def __init__(self, broker_pid: int | None) -> None:
        self.broker_pid = broker_pid

    def snapshot(self) -> _Snapshot:
        user, system = cpu_times()
        spark = tree_cpu_seconds(os.getpid())
        broker = process_cpu_seconds(self.broker_pid) if self.broker_pid else None
        return user + system, spark, broker, host_cpu_ticks()

    @staticmethod
    def steal(start: _Snapshot, end: _Snapshot) -> float | None:
        return steal_percent(start[3], end[3])

    @staticmethod
    def per_million(start: _Snapshot, end: _Snapshot, rows: int) -> dict[str, float | None]:
        def rate(a: float | None, b: float | None) -> float | None:
            return round((b - a) / rows * 1e6, 2) if a is not None and b is not None and rows else None

        spark = sum(cpu - start[1].get(key, 0.0) for key, cpu in end[1].items())
        return {"python": rate(start[0], end[0]), "spark": rate(0.0, spark),
                "broker": rate(start[2], end[2])}


async def run_spark(spec: dict[str, Any]) -> dict[str, Any]:
    from rmq_async.sinks.spark import messages_to_arrow
    from rmq_async.sources.spark import register

    out_dir = Path(spec["work_dir"])
    await asyncio.to_thread(out_dir.mkdir, parents=True, exist_ok=True)
    expected = int(spec["expected"])
    batch_rows = int(spec["batch_rows"])
    body_size = int(spec["body_size"])
    t_start = time.perf_counter()
    spark = await asyncio.to_thread(_spark_session, "rmq_async-bench")
    session_seconds = time.perf_counter() - t_start
    await asyncio.to_thread(register, spark)
    runs: list[dict[str, Any]] = []
    meter = _CpuMeter(spec.get("broker_pid"))
    try:
        # The in-memory Arrow tables of the baseline: the same rows, built before timing.
        batches = await _pull_batches(spec, batch_rows)
        t = time.perf_counter()
        tables = [messages_to_arrow(b) for b in batches]
        arrow_seconds = time.perf_counter() - t
        pulled = sum(t.num_rows for t in tables)
        del batches
        names = set().union(*(_table_property_names(t) for t in tables))
        # Warm the JVMs before anything is timed: one untimed pass of the baseline over every
        # batch, then one untimed sink pass. Spark's JIT keeps compiling its Arrow and Parquet
        # paths for several passes (C2 time of 4 to 5 s in the first pass, under 2 s from the
        # third on), and the broker compiles its consumer pull path (long polling, offset
        # commits) only once a consumer pulls; with a batch or two of warm-up the first
        # contender of round 1 paid for the rest of it (a sink round 1 of 14.4 s, 11.4 to
        # 11.6 s after it, with 5.1 against 3.4 to 3.9 broker CPU seconds per million).
        if spec.get("warm_up", True):  # the quick run goes without
            emit("PHASE warm-up")
            for warm in tables:
                await asyncio.to_thread(_write_parquet, spark, warm, out_dir / "warmup")
            gc.collect()
            await _sink_run(spark, spec, out_dir / "warmup-sink")
            await asyncio.to_thread(shutil.rmtree, out_dir / "warmup", True)
            await asyncio.to_thread(shutil.rmtree, out_dir / "warmup-sink", True)

        async def sink_round(rnd: int, contender: str, path: Path,
                             pull_batch_size: int = 32) -> None:
            cpu0 = await asyncio.to_thread(meter.snapshot)
            sink_run = await _sink_run(spark, spec, path, pull_batch_size)
            cpu1 = await asyncio.to_thread(meter.snapshot)
            sink_run["cpu_s_per_million"] = meter.per_million(cpu0, cpu1, sink_run["rows"])
            sink_run["host_steal_pct"] = meter.steal(cpu0, cpu1)
            ok, reason = await asyncio.to_thread(_verify_parquet, path, expected, names,
                                                 body_size)
            if sink_run["ok"] and not ok:
                sink_run.update(ok=False, reason=reason)
            runs.append({"contender": contender, "round": rnd + 1, **sink_run})
            shutil.rmtree(path, ignore_errors=True)

        async def sink(rnd: int) -> None:
            emit(f"PHASE sink round {rnd + 1}")
            await sink_round(rnd, "spark-sink", out_dir / f"sink-{rnd}")

        async def bulk(rnd: int) -> None:
            # The same with the broker's per-pull caps raised: the broker and the consumer
            # then spend far less CPU per message (fewer, larger pulls).
            emit(f"PHASE bulk sink round {rnd + 1}")
            async with _broker_config(spec, BULK_BROKER_CONFIG):
                await sink_round(rnd, "spark-sink-bulk", out_dir / f"sink-bulk-{rnd}",
                                 BULK_PULL_BATCH_SIZE)

        async def plain(rnd: int) -> None:
            emit(f"PHASE plain spark round {rnd + 1}")
            path = out_dir / f"plain-{rnd}"
            cpu0 = await asyncio.to_thread(meter.snapshot)
            t = time.perf_counter()
            done_rows = 0
            for table in tables:
                await asyncio.to_thread(_write_parquet, spark, table, path)
                done_rows += table.num_rows
                emit(f"PROGRESS {done_rows}")
            seconds = time.perf_counter() - t
            cpu1 = await asyncio.to_thread(meter.snapshot)
            plain_cpu = meter.per_million(cpu0, cpu1, done_rows)
            ok, reason = await asyncio.to_thread(_verify_parquet, path, expected, names,
                                                 body_size)
            if pulled != expected:
                ok, reason = False, f"pulled {pulled} rows for the baseline, not {expected}"
            runs.append({"contender": "plain-spark-arrow", "round": rnd + 1, "ok": ok,
                         "reason": reason, "rows": done_rows, "seconds": round(seconds, 3),
                         "batches": len(tables), "cpu_s_per_million": plain_cpu,
                         "host_steal_pct": meter.steal(cpu0, cpu1),
                         "rows_per_s": round(done_rows / seconds, 1) if seconds > 0 else 0.0})
            shutil.rmtree(path, ignore_errors=True)

        async def source(rnd: int) -> None:
            emit(f"PHASE source round {rnd + 1}")
            path = out_dir / f"source-{rnd}"
            checkpoint = out_dir / f"source-checkpoint-{rnd}"
            cpu0 = await asyncio.to_thread(meter.snapshot)
            t = time.perf_counter()
            rows = await asyncio.to_thread(_source_stream, spark, spec, path, checkpoint)
            seconds = time.perf_counter() - t
            cpu1 = await asyncio.to_thread(meter.snapshot)
            source_cpu = meter.per_million(cpu0, cpu1, rows)
            emit(f"PROGRESS {rows}")
            ok, reason = await asyncio.to_thread(_verify_parquet, path, expected, None,
                                                 body_size)
            runs.append({"contender": "spark-source", "round": rnd + 1, "ok": ok,
                         "reason": reason, "rows": rows, "seconds": round(seconds, 3),
                         "cpu_s_per_million": source_cpu,
                         "host_steal_pct": meter.steal(cpu0, cpu1),
                         "rows_per_s": round(rows / seconds, 1) if seconds > 0 else 0.0})
            shutil.rmtree(path, ignore_errors=True)
            shutil.rmtree(checkpoint, ignore_errors=True)

        # Balanced orders (benchlib.round_orders: sink, bulk, plain; then another first, and
        # no path always right after the same one), so that no path always runs first, right
        # after the source or the set-up, or after the same other path.
        paths = {"sink": sink, "bulk": bulk, "plain": plain}
        path_names = ["sink", "bulk", "plain"] if spec.get("bulk", True) else ["sink", "plain"]
        for rnd, order in enumerate(round_orders(path_names, int(spec.get("rounds", 1)))):
            for path_name in order:
                # Untimed: whatever the path before left for Python's collector (PySpark's
                # DataFrames of the plain path, and the rows they hold in the driver) goes
                # now, not during the next path's timing.
                gc.collect()
                await paths[path_name](rnd)
            if rnd < int(spec.get("source_rounds", 1)):
                await source(rnd)
    finally:
        await asyncio.to_thread(spark.stop)
        shutil.rmtree(out_dir, ignore_errors=True)
    return {"ok": all(r["ok"] for r in runs), "runs": runs,
            "arrow_build_seconds": round(arrow_seconds, 3),
            "arrow_rows_per_s": round(pulled / arrow_seconds, 1) if arrow_seconds > 0 else 0.0,
            "spark_session_seconds": round(session_seconds, 3), "batch_rows": batch_rows}


# ---------------------------------------------------------------------- entry point


def main() -> None:
    spec = json.loads(sys.argv[1])
    quiet_logging()
    kind = spec["kind"]
    runners = {"push": run_push, "raw": run_raw, "spark": run_spark}
    if kind not in runners:
        raise SystemExit(f"unknown contender kind {kind!r}")
    profile_path = spec.get("profile")
    profiler = None
    if profile_path:
        import cProfile

        profiler = cProfile.Profile()
        profiler.enable()
    coro = runners[kind](spec)
    result: dict[str, Any] | None = None
    if spec.get("uvloop"):
        try:
            import uvloop
        except ImportError:
            pass
        else:
            result = uvloop.run(coro)
            result["event_loop"] = f"uvloop {version('uvloop')}"
    if result is None:
        result = asyncio.run(coro)
        result["event_loop"] = "asyncio"
    if profiler is not None:
        profiler.disable()
        profiler.dump_stats(profile_path)
        result["profile"] = profile_path
    emit_result(result)


if __name__ == "__main__":
    main()

"""Spark sink: consumed messages land in DataFrames; offsets move only after the write.

Needs the ``spark`` extra (PySpark 4 and pyarrow). The SparkSession is the caller's: nothing
here looks at ``spark.master``, so the same code runs in local mode or against a standalone,
YARN or Kubernetes cluster (only the write's target path must be reachable from the executors,
e.g. HDFS/S3 instead of a local folder).

How it works
------------
The consumer hands chunks of messages to :meth:`SparkSink.offer` together with an ``ack``
callback. Chunks are gathered into a batch until it holds ``batch_rows`` messages or
``batch_bytes`` of bodies, or until it is ``max_batch_latency`` seconds old, whichever comes first
(a chunk is never split: one that would take the batch past a size limit closes the batch and
opens the next, so a batch exceeds a limit only when a single chunk does); with
``flush_when_caught_up`` also as soon as the consumer has read every queue to its end. One writer
loop (:meth:`SparkSink.run`, owned by the consumer's task group) takes closed batches in order
and, in a worker thread, converts the batch to a pyarrow Table column by column (with the
compiled extension the consumer hands over each pull undecoded, and :func:`stored_to_arrow`
fills the Arrow buffers straight from the pull bodies, the copying without the GIL; decoded
messages go through :func:`messages_to_arrow`), creates the DataFrame with
``spark.createDataFrame(table)`` and calls the user's ``write(df, batch_info)``. While one batch
is being written the next one fills, and once it has closed it is converted to Arrow in another
worker thread, so that its write starts as soon as the one before has ended (the sink then holds
up to two batches in Arrow form besides the messages the flow control lets it hold). A failed write is
retried ``write_retries`` times with exponential backoff (``retry_backoff``, doubled per attempt,
slept on the event loop). Then every
chunk of the batch is acknowledged: ``ack(True)`` after the write returned, ``ack(False)`` when
all attempts failed (the consumer sends those messages back for redelivery); exactly one call per
offered chunk.

Rows follow Spark's Kafka source, adapted to RocketMQ (see :data:`SPARK_SCHEMA`). With
``value_format`` and a ``value_schema`` (a ``StructType``) the body is also decoded into a
``value`` struct column; a body that does not decode gives a null ``value`` and keeps its
``body``:

* ``"json"`` is decoded inside Spark with ``from_json`` (PERMISSIVE mode, and a row that Spark
  marks corrupt becomes null). It is faster than parsing in Python (measured on 50,000 rows of
  small objects: 1.3 s against 2.0 s end to end to Parquet) and follows Spark's JSON rules,
  including timestamps, dates and decimals given as strings.
* ``"msgpack"`` is decoded in Python in the worker thread (:func:`decode_values`) and arrives as
  an Arrow struct column; msgpack timestamps become Spark timestamps.

Exactly-once into Delta
-----------------------
Delivery is at-least-once: a crash between a successful write and the next offset persist
redelivers the messages of that window. Every row carries the key
``(topic, broker_name, queue_id, queue_offset)``, so a write can be made idempotent. With Delta
Lake, MERGE on the key inserts only rows not yet present::

    from delta.tables import DeltaTable

    def write(df, info):
        target = DeltaTable.forPath(spark, "s3://bucket/rocketmq/orders")
        (target.alias("t")
            .merge(df.alias("s"),
                   "t.topic = s.topic AND t.broker_name = s.broker_name"
                   " AND t.queue_id = s.queue_id AND t.queue_offset = s.queue_offset")
            .whenNotMatchedInsertAll()
            .execute())

A batch covers, per queue, a contiguous offset range (:attr:`BatchInfo.offset_ranges`), so an
overwrite of exactly that range is idempotent as well and avoids the join of a MERGE::

    def write(df, info):
        ranges = " OR ".join(
            f"(topic = '{mq.topic}' AND broker_name = '{mq.broker_name}'"
            f" AND queue_id = {mq.queue_id} AND queue_offset BETWEEN {lo} AND {hi})"
            for mq, (lo, hi) in info.offset_ranges.items())
        (df.write.format("delta").mode("overwrite")
            .option("replaceWhere", ranges).save("s3://bucket/rocketmq/orders"))

(Ranges are contiguous when the consumer delivers every offset of a queue to the sink; tag
filtering or messages handed back to the broker leave holes, which no batch writes. Messages
offered again after their batch failed, because the broker did not take them back, are
written in batches of their own, one chunk per queue, and a queue given up and taken again
starts a new batch (another consumer may have stored its rows between the two assignments),
so that no batch's range spans rows another batch wrote.)

Both keys cover a batch written again at the same coordinates. A batch given up (its write
failed ``write_retries`` times more) is handed back to the broker, and its messages come back
through the group's retry topic: as rows of ``%RETRY%<group>``, with that queue's offsets
(``properties['RETRY_TOPIC']`` names the topic they were first sent to). If such a write had
in fact landed before it raised, the rows come again under new keys. To be idempotent across
that too, merge on ``msg_id`` (the producer's unique key, which the redelivered copy keeps)
instead.
Plain Parquet appends (:func:`parquet_writer`) are at-least-once; deduplicate on the key when
reading (``dropDuplicates``).
"""

from __future__ import annotations

import asyncio
import gc
import inspect
import itertools
import math
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple, cast

import anyio.to_thread
import pyarrow as pa
import structlog
from pyspark.sql.types import (
    ArrayType,
    BinaryType,
    IntegerType,
    LongType,
    MapType,
    StringType,
    StructField,
    StructType,
    TimestampType,
)

from rmq_async.consumer.listener import is_async, is_generator
from rmq_async.consumer.tasks import ends_the_caller, in_user_thread
from rmq_async.errors import IllegalStateError, InvalidArgumentError
from rmq_async.protocol.stored import StoredChunk
from rmq_async.protocol.types import MessageExt, MessageQueue
from rmq_async.sinks import AckCallback, SinkClosedError, TaskSpawner
from rmq_async.sinks._arrow import (
    ARROW_SCHEMA,
    ValueFormat,
    all_nullable,
    chunk_offset_ranges,
    decode_values,
    messages_to_arrow,
    queue_offset_spans,
    stored_to_arrow,
)

if TYPE_CHECKING:
    from pyspark.sql import DataFrame, SparkSession

__all__ = [
    "ARROW_SCHEMA",
    "SPARK_SCHEMA",
    "BatchInfo",
    "SinkStatistics",
    "SparkSink",
    "WriteFunction",
    "decode_values",
    "messages_to_arrow",
    "parquet_writer",
]

log = structlog.get_logger(__name__)

_MiB = 1 << 20
# An Arrow binary column addresses at most 2 GiB; stay well below (a single chunk may exceed it).
_MAX_BATCH_BYTES = 1024 * _MiB
_CORRUPT_FIELD = "__rmq_corrupt_record"
# Largest Arrow slice (rows); also Spark's default Arrow batch size.
_MAX_CHUNK_ROWS = 10_000
# PySpark's JVM proxies (py4j) sit in reference cycles once a method of theirs has been called,
# so a written batch's DataFrame, and the copy of its rows that ``createDataFrame`` put in the
# driver JVM, live on until Python's cyclic collector runs. The sink's own hot path allocates so
# few Python objects that a full collection may not come for hundreds of batches: the driver's
# heap filled with written batches (a 2 GiB driver failed with OutOfMemoryError after some forty
# batches of 50 MB). So the sink collects, after a write and before an attempt, once the write
# attempts since its last collection have handed this much to Spark (a full collection took
# 18 ms in a process holding PySpark and 59,000 objects; its cost grows with the objects the
# process holds)...
_SPARK_GARBAGE_BYTES = 64 * _MiB
# ... each attempt counting its table's bytes plus this much (the JVM's plan, RDD and py4j
# objects of a batch), so that many small batches are collected too.
_SPARK_FRAME_OVERHEAD_BYTES = 256 * 1024

#: The DataFrame schema of every batch (the ``value`` column is appended when decoding bodies).
SPARK_SCHEMA = StructType(
    [
        StructField("topic", StringType(), False),
        StructField("broker_name", StringType(), False),
        StructField("queue_id", IntegerType(), False),
        StructField("queue_offset", LongType(), False),
        StructField("msg_id", StringType(), False),
        StructField("offset_msg_id", StringType(), False),
        StructField("tags", StringType(), True),
        StructField("keys", ArrayType(StringType(), False), False),
        StructField("body", BinaryType(), False),
        StructField("properties", MapType(StringType(), StringType(), False), False),
        StructField("born_timestamp", TimestampType(), False),
        StructField("store_timestamp", TimestampType(), False),
        StructField("born_host", StringType(), False),
        StructField("store_host", StringType(), False),
        StructField("reconsume_times", IntegerType(), False),
    ]
)


@dataclass(slots=True)
class BatchInfo:
    """What a batch holds; given to ``write`` next to the DataFrame."""

    batch_id: int
    """Increases by one per batch of this sink, starting at 1."""
    topics: tuple[str, ...]
    """Topics present, sorted."""
    queues: tuple[MessageQueue, ...]
    """Message queues present, in Java ``MessageQueue`` order."""
    offset_ranges: dict[MessageQueue, tuple[int, int]]
    """Lowest and highest queue offset per queue. No other batch writes a row of a queue
    inside its range: an overwrite of these ranges is idempotent."""
    row_count: int
    bytes: int
    """Sum of the body sizes."""
    opened_at: float
    """Wall-clock time (epoch seconds) the first chunk arrived."""
    closed_at: float
    """Wall-clock time the batch stopped taking chunks."""


WriteFunction = Callable[["DataFrame", BatchInfo], None]
CreateDataFrame = Callable[[pa.Table], "DataFrame"]


class SinkStatistics(NamedTuple):
    batches_written: int
    rows_written: int
    bytes_written: int
    batches_given_up: int
    rows_given_up: int
    write_seconds: float
    """Time spent in successful attempts (DataFrame creation, write, and the conversion to
    Arrow unless it was done ahead, while the batch before was being written)."""


class _Batch:
    __slots__ = (
        "acks",
        "batch_id",
        "bytes",
        "chunks",
        "closed_at",
        "done",
        "opened_at",
        "opened_mono",
        "redelivered",
        "rows",
        "tops",
        "urgent",
    )

    def __init__(self, batch_id: int) -> None:
        self.batch_id = batch_id
        self.chunks: list[list[MessageExt] | StoredChunk] = []
        self.acks: list[AckCallback] = []
        # The highest offset of each queue's chunks in pull order (not redelivered ones).
        self.tops: dict[tuple[str, str, int], int] = {}
        self.rows = 0
        self.bytes = 0
        self.opened_at = time.time()
        self.opened_mono = time.monotonic()
        self.closed_at = 0.0
        self.urgent = False
        #: Queues of a batch of redelivered chunks (None: a batch of chunks in pull order).
        self.redelivered: set[tuple[str, str, int]] | None = None
        self.done = asyncio.Event()


class _Job:
    """One batch on its way through the worker thread; survives across retries."""

    __slots__ = ("batch", "frame", "info", "table", "written")

    def __init__(self, batch: _Batch) -> None:
        self.batch = batch
        self.table: pa.Table | None = None
        self.info: BatchInfo | None = None
        self.frame: DataFrame | None = None  # made ahead; used by the first attempt only
        self.written = False


class SparkSink:
    """Batches consumed messages into Spark DataFrames and hands them to ``write``.

    ``write(df, batch_info)`` runs in a worker thread and stores the batch (for example
    :func:`parquet_writer`); returning normally means the batch is stored, raising means it is
    not. ``spark`` is the caller's SparkSession.

    The consumer drives the sink through :meth:`start` or :meth:`run` (the writer loop),
    :meth:`offer`, :meth:`want_more` / :attr:`backlog_rows`, :meth:`flush` and :meth:`aclose`,
    all on the event loop. Everything blocking (Arrow conversion, Spark) runs in a worker thread.

    Backpressure and batch size. The consumer keeps offered messages in its process queues
    until they are acknowledged, so its flow control bounds what the sink holds: per assigned
    queue at most ``min(pull_threshold_for_queue, consume_concurrently_max_span)`` messages and
    ``pull_threshold_size_for_queue`` MiB (plus one pull of ``pull_batch_size``). A batch that
    needs more than that could never fill. So the consumer reports this capacity through
    :meth:`set_flow_limit` and the sink closes batches at half of it when that is less than
    ``batch_rows`` / ``batch_bytes`` (:attr:`effective_batch_rows`): one batch is written while
    the next one fills. When a queue nevertheless stops pulling because of its thresholds (its
    messages are unevenly spread, or it is the retry queue) the consumer calls
    :meth:`expedite` and the open batch is closed as soon as the writer is free instead of at
    ``max_batch_latency``. When the writer falls behind (a closed batch waits while another is
    written) :meth:`want_more` turns False and the consumer pauses pulling, so memory stays
    below about two batches whatever the thresholds. To get batches of ``batch_rows``, raise
    the thresholds to ``2 * batch_rows / queues`` (for example ``batch_rows=50_000`` over 8
    queues: ``pull_threshold_for_queue=12_500, consume_concurrently_max_span=12_500``). The
    latency limit is applied when the writer is ready for the next batch: while a write is
    running, the open batch keeps filling up to the size limits instead of being cut into many
    small batches.

    Spark's driver keeps the rows ``createDataFrame`` copied into it for as long as the
    batch's DataFrame lives in Python, and PySpark's JVM proxies are freed by Python's cyclic
    collector only. So around its writes, once the batches written (or tried) since the last
    time add up to 64 MiB, the sink runs a full collection (``gc.collect()``, holding the GIL:
    18 ms in a process of 59,000 Python objects, more in one that holds more); a ``write`` that
    keeps a reference to its DataFrame keeps those rows in the driver.

    Args:
        spark: the SparkSession; may be None only when ``create_dataframe`` is given.
        write: stores one batch; called in a worker thread, one batch at a time, and the
            batch counts as written when it returns: a plain function, not ``async def``.
        batch_rows: the most messages of a batch (a single larger chunk makes a batch of its own).
        batch_bytes: the most body bytes of a batch (at most 1 GiB); likewise.
        max_batch_latency: close a batch this many seconds after its first chunk arrived.
        write_retries: attempts after the first failed one before the batch is given up.
        retry_backoff: seconds before the first retry; doubled for every further retry.
        value_format: ``"json"`` or ``"msgpack"`` to decode bodies into a ``value`` column.
        value_schema: the ``StructType`` of ``value``; required with ``value_format``. Every
            field of ``value`` is nullable, whatever the schema says (as Spark's ``from_json``
            reads them): a body without a field has it null.
        flush_when_caught_up: write the open batch as soon as the writer is free once the
            consumer has read every queue of the topic to its end, instead of waiting for
            ``max_batch_latency``. Suits draining a backlog (a catch-up, a batch job): the last
            partial batch lands at once. Off by default: under a steady trickle it would write
            many small batches back to back instead of one per ``max_batch_latency``.
        convert_ahead: convert a batch that closes while the one before is being written to
            Arrow at once, in another worker thread, and hand it to Spark
            (``createDataFrame``, which copies the Arrow data into the driver), so that its
            write starts as soon as that write ends (the default). The sink then holds up to
            two batches in Arrow form, and Spark's driver the next one; with ``False`` each
            batch is converted by its own write, for less memory and less throughput.
        create_dataframe: replaces ``spark.createDataFrame`` (a hook for tests of the batching).
    """

    def __init__(
        self,
        spark: SparkSession | None,
        write: WriteFunction,
        *,
        batch_rows: int = 50_000,
        batch_bytes: int = 64 * _MiB,
        max_batch_latency: float = 5.0,
        write_retries: int = 3,
        retry_backoff: float = 1.0,
        value_format: ValueFormat | None = None,
        value_schema: StructType | None = None,
        flush_when_caught_up: bool = False,
        convert_ahead: bool = True,
        create_dataframe: CreateDataFrame | None = None,
    ) -> None:
        if batch_rows < 1:
            raise InvalidArgumentError(f"batch_rows must be at least 1, got {batch_rows}")
        if not 1 <= batch_bytes <= _MAX_BATCH_BYTES:
            raise InvalidArgumentError(f"batch_bytes must be in 1..{_MAX_BATCH_BYTES}, got {batch_bytes}")
        if not (max_batch_latency > 0 and math.isfinite(max_batch_latency)):
            raise InvalidArgumentError(f"max_batch_latency must be positive, got {max_batch_latency}")
        if write_retries < 0:
            raise InvalidArgumentError(f"write_retries must not be negative, got {write_retries}")
        if not (retry_backoff >= 0 and math.isfinite(retry_backoff)):
            raise InvalidArgumentError(f"retry_backoff must be a non-negative number, got {retry_backoff}")
        if value_format not in (None, "json", "msgpack"):
            raise InvalidArgumentError(f"value_format must be 'json' or 'msgpack', got {value_format!r}")
        if value_format is not None and not isinstance(value_schema, StructType):
            raise InvalidArgumentError("value_format needs value_schema, a pyspark StructType")
        if value_format is None and value_schema is not None:
            raise InvalidArgumentError("value_schema given without value_format")
        if not callable(write):
            raise InvalidArgumentError(f"write must be a function (df, info), not {write!r}")
        if is_async(write) or is_generator(write):
            # It runs in a worker thread and its return is taken for "written": an async
            # function's coroutine would never run, and its rows' offsets would be committed.
            raise InvalidArgumentError(
                "write must be a plain function (it runs in a worker thread, where Spark's "
                "calls block), not a coroutine or generator function")
        if create_dataframe is None:
            if spark is None:
                raise InvalidArgumentError("spark is required unless create_dataframe is given")
            create_dataframe = spark.createDataFrame
        self._create_dataframe: CreateDataFrame = create_dataframe
        self._spark = spark
        self._chunk_rows: int | None = None
        # Bytes of the DataFrames written (or tried) since the last collection; see
        # _SPARK_GARBAGE_BYTES. Counted by the write attempts (one at a time, in a worker thread).
        self._handed_bytes = 0
        self._write = write
        self._batch_rows = batch_rows
        self._batch_bytes = batch_bytes
        self._max_batch_latency = float(max_batch_latency)
        self._write_retries = write_retries
        self._retry_backoff = float(retry_backoff)
        self._value_format: ValueFormat | None = value_format
        self._flush_when_caught_up = flush_when_caught_up
        self._convert_ahead = convert_ahead
        self._value_schema = value_schema
        self._value_arrow_type: pa.StructType | None = None
        if value_format == "msgpack":
            from pyspark.sql.pandas.types import to_arrow_type

            assert value_schema is not None
            self._value_arrow_type = cast(pa.StructType, all_nullable(
                to_arrow_type(value_schema, timezone="UTC")))

        self._flow_rows: int | None = None
        self._flow_bytes: int | None = None
        self._eff_rows = batch_rows
        self._eff_bytes = batch_bytes
        self._next_id = 1
        self._open: _Batch | None = None
        self._pending: deque[_Batch] = deque()
        # Closed batches already converted to Arrow while an earlier one was being written.
        self._converted: dict[int, _Job] = {}
        self._last_closed: _Batch | None = None
        self._wakeup = asyncio.Event()
        self._room = asyncio.Event()  # set while nothing closed waits: want_more()
        self._room.set()
        self._writer_lock = asyncio.Lock()
        self._running = False
        self._closed = False
        self._backlog_rows = 0
        self._backlog_bytes = 0
        self._batches_written = 0
        self._rows_written = 0
        self._bytes_written = 0
        self._batches_given_up = 0
        self._rows_given_up = 0
        self._write_seconds = 0.0

    # ------------------------------------------------------------------ consumer-facing

    def offer(self, msgs: list[MessageExt] | StoredChunk, ack: AckCallback, *,
              redelivered: bool = False) -> None:
        """Add a chunk to the open batch; ``ack`` is called once, after the batch's outcome.

        Never blocks and never refuses for lack of room: the consumer's flow control bounds
        what it offers (see the class docstring). A ``redelivered`` chunk (offered again after
        its batch failed) is not written with chunks in pull order, nor with another of its
        queue: among newer rows of its queue, the batch's offset range would span rows other
        batches wrote (see "Exactly-once into Delta" above); redelivered chunks of different
        queues share batches. A chunk of a queue that starts at or below an offset the open
        batch already holds for that queue (the queue was given up and taken again, or its
        offset reset, and is pulled again) closes the open batch first, so that no batch
        holds a row twice. Raises :class:`SinkClosedError` after :meth:`aclose`.
        """
        if self._closed:
            raise SinkClosedError("the Spark sink is closed")
        size = msgs.size if isinstance(msgs, StoredChunk) else sum(len(m.body) for m in msgs)
        rows = len(msgs)
        batch = self._open
        queue = _chunk_queue(msgs) if redelivered and rows else None
        # Each queue's lowest and highest offset in the chunk (one queue for a consumer's
        # chunk; a list offered by other code may mix them). Empty: none, it joins any batch.
        spans = queue_offset_spans([msgs]) if not redelivered else {}
        if batch is not None and batch.rows and (
            # Redelivered chunks share a batch only with redelivered chunks of other queues:
            # each lies within the range of the one batch that failed with it, which nothing
            # wrote; two of a queue could be of two failed batches around a written one.
            (batch.redelivered is not None) != redelivered
            or (batch.redelivered is not None and queue in batch.redelivered)
            # A queue given up and taken again (or its offset reset) is pulled again from
            # its committed offset: those rows go to a batch of their own, not beside the
            # same rows pulled before (one batch holding a row twice defeats a merge).
            or any(low <= batch.tops.get(q, -1) for q, (low, _) in spans.items())
            or batch.rows + rows > self._eff_rows or batch.bytes + size > self._eff_bytes
        ):
            # Closed before the chunk that would take it past a limit: a batch of at most
            # ``batch_rows`` rows is cut into the fewest Spark partitions (one per
            # ``maxRecordsPerBatch`` rows), where one chunk more made a partition more.
            self._close_open()
            batch = None
        if batch is None:
            batch = self._open = _Batch(self._next_id)
            self._next_id += 1
            if redelivered:
                batch.redelivered = set()
            self._wakeup.set()  # the writer starts the latency clock of this batch
        if queue is not None and batch.redelivered is not None:
            batch.redelivered.add(queue)
        for q, (_, high) in spans.items():
            if high > batch.tops.get(q, -1):
                batch.tops[q] = high
        batch.chunks.append(msgs)
        batch.acks.append(ack)
        batch.rows += rows
        batch.bytes += size
        self._backlog_rows += rows
        self._backlog_bytes += size
        if batch.rows >= self._eff_rows or batch.bytes >= self._eff_bytes:
            self._close_open()

    def set_flow_limit(self, rows: int | None, bytes_: int | None = None) -> None:
        """The most messages (and body bytes) the consumer lets this sink hold unacknowledged.

        Batches then close at half of it when that is below ``batch_rows`` / ``batch_bytes``,
        so that one batch can be written while the next one fills. ``None`` means unlimited.
        An open batch already past the new limits is closed.
        """
        if rows == self._flow_rows and bytes_ == self._flow_bytes:
            return
        if rows is not None and rows < 1:
            raise InvalidArgumentError(f"rows must be at least 1, got {rows}")
        if bytes_ is not None and bytes_ < 1:
            raise InvalidArgumentError(f"bytes_ must be at least 1, got {bytes_}")
        self._flow_rows = rows
        self._flow_bytes = bytes_
        eff_rows = self._batch_rows if rows is None else min(self._batch_rows, max(1, rows // 2))
        eff_bytes = (
            self._batch_bytes if bytes_ is None else min(self._batch_bytes, max(1, bytes_ // 2))
        )
        if eff_rows != self._eff_rows or eff_bytes != self._eff_bytes:
            log.info(
                "spark_sink.batch_limit_changed",
                batch_rows=eff_rows,
                batch_bytes=eff_bytes,
                configured_rows=self._batch_rows,
                configured_bytes=self._batch_bytes,
                flow_rows=rows,
                flow_bytes=bytes_,
            )
        self._eff_rows = eff_rows
        self._eff_bytes = eff_bytes
        batch = self._open
        if batch is not None and (batch.rows >= eff_rows or batch.bytes >= eff_bytes):
            self._close_open()

    @property
    def effective_batch_rows(self) -> int:
        """Rows at which a batch closes: ``batch_rows``, or half the flow limit if smaller."""
        return self._eff_rows

    @property
    def effective_batch_bytes(self) -> int:
        """Body bytes at which a batch closes: ``batch_bytes``, or half the flow limit."""
        return self._eff_bytes

    def queue_reassigned(self, mq: MessageQueue) -> None:
        """``mq`` was given up and taken again (the consumer calls it before offering the
        first chunk of the new assignment): the open batch, if it holds rows of ``mq``, is
        closed.

        Those rows are of the earlier assignment. Meanwhile another consumer may have taken
        the queue, stored rows beyond them and committed its offset; the new assignment starts
        there. In one batch with the new rows, the batch's offset range for ``mq`` would span
        the rows the other consumer stored, and an overwrite of that range would delete them.
        """
        batch = self._open
        key = (mq.topic, mq.broker_name, mq.queue_id)
        if batch is not None and batch.rows and (
                key in batch.tops or (batch.redelivered is not None and key in batch.redelivered)):
            self._close_open()

    def expedite(self) -> None:
        """Close the open batch as soon as the writer is free, without waiting for the latency.

        The consumer calls it when a queue stopped pulling until some of its messages are
        acknowledged: waiting for more rows would only wait for ``max_batch_latency``.
        """
        batch = self._open
        if batch is not None and not batch.urgent:
            batch.urgent = True
            self._wakeup.set()

    def caught_up(self) -> None:
        """The consumer has read every queue of the topic to the end the broker reported.

        With ``flush_when_caught_up`` the open batch is then closed as soon as the writer is
        free (as :meth:`expedite` does); otherwise nothing changes.
        """
        if self._flush_when_caught_up:
            self.expedite()

    def want_more(self) -> bool:
        """False while a closed batch waits behind the one being written."""
        return not self._pending

    async def wait_for_room(self) -> None:
        """Return once :meth:`want_more` is True."""
        await self._room.wait()

    @property
    def backlog_rows(self) -> int:
        """Messages offered and not yet acknowledged (open, waiting and writing batches)."""
        return self._backlog_rows

    @property
    def backlog_bytes(self) -> int:
        """Body bytes offered and not yet acknowledged."""
        return self._backlog_bytes

    @property
    def closed(self) -> bool:
        return self._closed

    def statistics(self) -> SinkStatistics:
        return SinkStatistics(
            self._batches_written,
            self._rows_written,
            self._bytes_written,
            self._batches_given_up,
            self._rows_given_up,
            self._write_seconds,
        )

    async def start(self, owner: TaskSpawner | asyncio.TaskGroup) -> None:
        """Start :meth:`run` as a task of ``owner`` (a task owner or an asyncio TaskGroup).

        A sink closed by :meth:`aclose` (its consumer stopped) is open again: a consumer that
        is stopped and started again writes through the same sink. Raises
        :class:`~rmq_async.errors.IllegalStateError` while a write that the last stop gave up
        still runs in its thread.
        """
        if self._closed:
            if self._writer_lock.locked():
                # The last run's writer still waits for a write in its thread: a stop() gave
                # it up (Spark calls cannot be interrupted). Waiting here would hang start().
                raise IllegalStateError(
                    "the sink's last writer is still in a Spark write that stop() gave up; "
                    "start again once that write has returned")
            async with self._writer_lock:  # a closing run() has returned
                self._closed = False
        if isinstance(owner, asyncio.TaskGroup):
            owner.create_task(self.run(), name="spark-sink-writer")
        else:
            owner.spawn(self.run(), name="spark-sink-writer")

    async def run(self) -> None:
        """The writer loop: writes closed batches one at a time until :meth:`aclose`.

        If the loop is cancelled while a write runs, the write finishes in its thread first
        (Spark calls cannot be interrupted) and its chunks are acknowledged with its outcome;
        every chunk not yet written is acknowledged with ``False``. The sink stays open, so the
        loop may be started again.
        """
        # Running from its first step, before it has the lock: a flush() writing batches
        # itself holds the lock meanwhile, and a flush() after it must leave the rest to this
        # loop rather than queue for the lock behind it (this loop keeps it until closed).
        self._running = True
        try:
            async with self._writer_lock:
                while True:
                    batch = await self._next_batch()
                    if batch is None:
                        return
                    await self._write_batch(batch)
        except BaseException:
            self._fail_outstanding()
            raise
        finally:
            self._running = False

    async def flush(self) -> None:
        """Close the open batch now and return once everything offered so far is acknowledged.

        If no writer loop is running, the batches are written by this call.
        """
        if self._open is not None:
            self._close_open()
        target = self._last_closed
        if target is None:
            return
        while not target.done.is_set():
            if self._running:
                # run() writes batches in order and acknowledges everything if it ends early.
                await target.done.wait()
                return
            async with self._writer_lock:
                while self._pending and not target.done.is_set():
                    await self._write_batch(self._take_pending())

    async def aclose(self) -> None:
        """Refuse further chunks, write what was offered, then end :meth:`run`. Idempotent."""
        self._closed = True
        await self.flush()
        self._wakeup.set()
        async with self._writer_lock:  # held by run() until it has returned
            pass

    def __repr__(self) -> str:
        state = "closed" if self._closed else "open"
        return (
            f"<SparkSink {state} backlog_rows={self._backlog_rows} "
            f"waiting_batches={len(self._pending)} written={self._batches_written}>"
        )

    # ------------------------------------------------------------------ batching

    def _close_open(self) -> None:
        batch = self._open
        if batch is None:
            return
        self._open = None
        batch.closed_at = time.time()
        self._pending.append(batch)
        self._room.clear()
        self._last_closed = batch
        self._wakeup.set()

    def _take_pending(self) -> _Batch:
        batch = self._pending.popleft()
        if not self._pending:
            self._room.set()
        return batch

    async def _next_batch(self) -> _Batch | None:
        """The next batch to write, waiting for one to close; None once closed and drained."""
        while True:
            if self._pending:
                return self._take_pending()
            batch = self._open
            timeout: float | None
            if batch is not None:
                timeout = batch.opened_mono + self._max_batch_latency - time.monotonic()
                if timeout <= 0 or self._closed or batch.urgent:
                    self._close_open()
                    continue
            elif self._closed:
                return None
            else:
                timeout = None
            self._wakeup.clear()
            try:
                async with asyncio.timeout(timeout):
                    await self._wakeup.wait()
            except TimeoutError:
                pass

    def _fail_outstanding(self) -> None:
        batches = list(self._pending)
        self._pending.clear()
        self._converted.clear()
        self._room.set()
        if self._open is not None:
            batches.append(self._open)
            self._open = None
        for batch in batches:
            if not batch.done.is_set():
                self._finish(batch, False)

    # ------------------------------------------------------------------ writing

    async def _write_batch(self, batch: _Batch) -> None:
        if batch.rows == 0:
            self._finish(batch, True)
            return
        job = self._converted.pop(batch.batch_id, None) or _Job(batch)
        attempt = 0
        try:
            while True:
                attempt += 1
                started = time.monotonic()
                try:
                    await self._attempt_and_convert_ahead(job)
                except BaseException as exc:
                    if ends_the_caller(exc):
                        raise
                    # Any other: a failed attempt (a BaseException of the user's write, such
                    # as pytest's Failed, ended the writer and left the topic's pulls waiting).
                    error = f"{type(exc).__name__}: {exc}"
                    log.warning(
                        "spark_sink.write_failed",
                        batch_id=batch.batch_id,
                        attempt=attempt,
                        error=error,
                    )
                    if attempt > self._write_retries:
                        log.error(
                            "spark_sink.batch_given_up",
                            batch_id=batch.batch_id,
                            rows=batch.rows,
                            attempts=attempt,
                            error=error,
                        )
                        self._batches_given_up += 1
                        self._rows_given_up += batch.rows
                        self._finish(batch, False)
                        return
                    await asyncio.sleep(self._retry_backoff * 2 ** (attempt - 1))
                    continue
                seconds = time.monotonic() - started
                log.info(
                    "spark_sink.batch_written",
                    batch_id=batch.batch_id,
                    rows=batch.rows,
                    bytes=batch.bytes,
                    seconds=round(seconds, 3),
                    attempts=attempt,
                )
                self._batches_written += 1
                self._rows_written += batch.rows
                self._bytes_written += batch.bytes
                self._write_seconds += seconds
                self._finish(batch, True)
                return
        except BaseException:
            # Cancelled while writing or backing off: the thread has finished
            # (_run_in_thread waits for it), so job.written is final.
            if not batch.done.is_set():
                self._finish(batch, job.written)
            raise

    async def _attempt_and_convert_ahead(self, job: _Job) -> None:
        """One write attempt of ``job``; meanwhile the next closed batch is converted to Arrow
        and handed to Spark.

        The conversion of batch N+1 (mostly without the GIL) and its ``createDataFrame`` then
        overlap the Spark write of batch N instead of delaying the write of N+1. A conversion
        already running when the write ends is awaited (its table and DataFrame are kept for
        the next write); one not started is not.
        """
        if not self._convert_ahead:
            await _run_in_thread(self._attempt, job)
            return
        converting = False

        async def convert_next() -> None:
            nonlocal converting
            while not self._pending:
                self._wakeup.clear()
                await self._wakeup.wait()
            batch = self._pending[0]
            if batch.batch_id in self._converted:
                return
            converting = True
            ahead = _Job(batch)
            await _run_in_thread(self._convert_and_create, ahead)
            if not batch.done.is_set():
                self._converted[batch.batch_id] = ahead

        converter = asyncio.ensure_future(convert_next())
        try:
            await _run_in_thread(self._attempt, job)
        finally:
            if not converting:
                converter.cancel()
            try:
                await converter
            except asyncio.CancelledError:
                current = asyncio.current_task()
                if not converter.cancelled() or (current is not None and current.cancelling()):
                    raise  # this task itself is being cancelled
            except Exception as exc:  # the write retries the conversion itself
                log.warning("spark_sink.convert_ahead_failed",
                            error=f"{type(exc).__name__}: {exc}")

    def _attempt(self, job: _Job) -> None:
        """One write attempt, in a worker thread."""
        if job.table is None or job.info is None:
            self._convert(job)
        assert job.table is not None and job.info is not None
        # The DataFrames of attempts that failed, kept by their exceptions until those were
        # handled: collected here, or writes failing for good would never free them.
        self._release_spark_garbage(job.batch.batch_id)
        frame, job.frame = job.frame, None  # a retry hands the table to Spark anew
        if frame is None:
            frame = self._frame(job.table)
        # The frame is garbage after this attempt, however it ends.
        self._handed_bytes += job.table.nbytes + _SPARK_FRAME_OVERHEAD_BYTES
        returned: object = self._write(frame, job.info)
        del frame  # dead before the collection below
        if inspect.isawaitable(returned):
            # (A wrapper the check in __init__ did not see through.) Its work would run
            # nowhere, or later: the batch is not taken for written.
            close = getattr(returned, "close", None)
            if close is not None:
                close()  # a coroutine never awaited, closed without a warning
            raise TypeError(f"write returned {type(returned).__name__}, an awaitable: it must "
                            "write the batch before it returns (a plain function)")
        del returned  # (a write may return its DataFrame)
        job.written = True
        self._release_spark_garbage(job.batch.batch_id)

    def _convert_and_create(self, job: _Job) -> None:
        """The conversion ahead of the write, in a worker thread: the Arrow table, then the
        DataFrame (creating it sends the Arrow data to Spark's driver, work that would
        otherwise delay the write once the write before it ends)."""
        self._convert(job)
        assert job.table is not None
        try:
            job.frame = self._frame(job.table)
        except Exception as exc:  # the write makes it itself (and reports what goes wrong)
            log.warning("spark_sink.create_ahead_failed", batch_id=job.batch.batch_id,
                        error=f"{type(exc).__name__}: {exc}")

    def _frame(self, table: pa.Table) -> DataFrame:
        frame = self._create_dataframe(table)
        if self._value_format == "json":
            frame = self._with_json_value(frame)
        return frame

    def _release_spark_garbage(self, batch_id: int) -> None:
        """Around a write, in its worker thread: run Python's full collection once the
        DataFrames written (or tried) since the last one add up to enough (see
        :data:`_SPARK_GARBAGE_BYTES`), so that they, and their rows in Spark's driver, are
        freed."""
        handed = self._handed_bytes
        if handed < _SPARK_GARBAGE_BYTES:
            return
        self._handed_bytes = 0
        started = time.monotonic()
        found = gc.collect()
        log.debug("spark_sink.garbage_collected", batch_id=batch_id, handed_bytes=handed,
                  objects=found, seconds=round(time.monotonic() - started, 4))

    def _convert(self, job: _Job) -> None:
        """Fill in the batch's Arrow table and :class:`BatchInfo`, in a worker thread."""
        chunks = job.batch.chunks  # read once: the loop may finish the batch meanwhile
        chunk_rows = self._arrow_chunk_rows()
        if all(type(c) is StoredChunk for c in chunks):
            # Undecoded pulls: straight from their bodies, no message objects.
            table = stored_to_arrow(cast("list[StoredChunk]", chunks), chunk_rows=chunk_rows)
            bodies: list[bytes] = []
            if self._value_arrow_type is not None:
                bodies = table.column("body").to_pylist()
        else:
            msgs = list(itertools.chain.from_iterable(
                c.messages() if isinstance(c, StoredChunk) else c for c in chunks))
            table = messages_to_arrow(msgs, chunk_rows=chunk_rows)
            bodies = [m.body for m in msgs] if self._value_arrow_type is not None else []
        if self._value_arrow_type is not None:
            assert self._value_format is not None
            value_type = self._value_arrow_type
            # Sliced as the table's other columns are (the fewest even slices): Spark cuts
            # its Arrow batches, one partition each, wherever any column's slice ends.
            values_parts: list[pa.Array] = []
            start = 0
            for piece in table.column("body").chunks:
                end = start + len(piece)
                values_parts.append(decode_values(bodies[start:end], self._value_format,
                                                  value_type))
                start = end
            values = pa.chunked_array(values_parts, value_type)
            table = table.append_column(pa.field("value", value_type, True), values)
        job.table = table
        job.info = _batch_info(job.batch, chunks, table.num_rows)

    def _arrow_chunk_rows(self) -> int:
        """Rows per Arrow slice: Spark's Arrow batch size (each slice becomes one partition),
        at most :data:`_MAX_CHUNK_ROWS` so that no single Arrow call holds the GIL for long."""
        if self._chunk_rows is None:
            rows = 0
            if self._spark is not None:
                try:
                    conf = self._spark.conf.get("spark.sql.execution.arrow.maxRecordsPerBatch")
                    rows = int(conf) if conf else 0
                except Exception:  # a session without that setting: keep the default
                    rows = 0
            self._chunk_rows = min(rows, _MAX_CHUNK_ROWS) if rows > 0 else _MAX_CHUNK_ROWS
        return self._chunk_rows

    def _with_json_value(self, frame: DataFrame) -> DataFrame:
        from pyspark.sql import functions as sf

        assert self._value_schema is not None
        with_corrupt = StructType(
            [*self._value_schema.fields, StructField(_CORRUPT_FIELD, StringType(), True)]
        )
        parsed = sf.from_json(
            sf.col("body").cast("string"),
            with_corrupt,
            {"mode": "PERMISSIVE", "columnNameOfCorruptRecord": _CORRUPT_FIELD},
        )
        value = sf.when(parsed[_CORRUPT_FIELD].isNull(), parsed.dropFields(_CORRUPT_FIELD))
        return frame.withColumn("value", value)

    def _finish(self, batch: _Batch, ok: bool) -> None:
        self._converted.pop(batch.batch_id, None)
        self._backlog_rows -= batch.rows
        self._backlog_bytes -= batch.bytes
        acks, batch.acks, batch.chunks = batch.acks, [], []
        batch.done.set()
        for ack in acks:
            try:
                ack(ok)
            except Exception as exc:
                log.error(
                    "spark_sink.ack_failed",
                    batch_id=batch.batch_id,
                    error=f"{type(exc).__name__}: {exc}",
                    exc_info=exc,
                )


async def _run_in_thread(func: Callable[[_Job], None], job: _Job) -> None:
    """Run ``func(job)`` in a worker thread and wait for it even if cancelled meanwhile.

    A Spark call cannot be interrupted, and native task cancellation is not held back by
    ``anyio.to_thread``, so the thread call runs in an inner task that is always awaited to
    its end; a cancellation received meanwhile is raised afterwards.
    """
    inner = asyncio.ensure_future(anyio.to_thread.run_sync(in_user_thread, func, job))
    cancelled: asyncio.CancelledError | None = None
    while not inner.done():
        try:
            await asyncio.wait([inner])
        except asyncio.CancelledError as exc:
            cancelled = exc
    if cancelled is not None:
        if not inner.cancelled():
            inner.exception()  # retrieved: the outcome is recorded in job.written
        raise cancelled
    inner.result()


def _chunk_queue(chunk: list[MessageExt] | StoredChunk) -> tuple[str, str, int]:
    """The queue a chunk (one pull's, or part of one) was read from."""
    if isinstance(chunk, StoredChunk):
        return (chunk.topic, chunk.broker_name, chunk.queue_id)
    first = chunk[0]
    return (first.topic, first.broker_name, first.queue_id)


def _batch_info(batch: _Batch, chunks: Sequence[Sequence[MessageExt] | StoredChunk],
                rows: int) -> BatchInfo:
    ranges = chunk_offset_ranges(chunks)
    queues = tuple(sorted(ranges))
    return BatchInfo(
        batch_id=batch.batch_id,
        topics=tuple(sorted({mq.topic for mq in queues})),
        queues=queues,
        offset_ranges={mq: ranges[mq] for mq in queues},
        row_count=rows,
        bytes=batch.bytes,
        opened_at=batch.opened_at,
        closed_at=batch.closed_at,
    )


def parquet_writer(path: str, mode: str = "append", *, partition_by: Sequence[str] = ()) -> WriteFunction:
    """A write function that stores each batch as Parquet files under ``path``.

    ``path`` is any URI Spark can write (a local folder in local mode; HDFS, S3 or another
    shared store on a cluster). Appends are at-least-once: see the module docstring.
    """
    columns = list(partition_by)

    def write(df: DataFrame, info: BatchInfo) -> None:
        writer = df.write.mode(mode)
        if columns:
            writer = writer.partitionBy(*columns)
        writer.parquet(path)

    return write

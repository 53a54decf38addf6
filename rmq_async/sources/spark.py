"""Spark reads RocketMQ itself: the data source ``format("rocketmq")``, batch and streaming.

Needs the ``spark`` extra (PySpark 4.2 or later, pyarrow). Register the source once per
SparkSession, then read as with any other format::

    from rmq_async.sources.spark import register

    register(spark)                       # spark.dataSource.register(RocketMQDataSource)

    # batch: a fixed offset range per queue
    df = (spark.read.format("rocketmq")
          .option("namesrv", "127.0.0.1:9876")
          .option("topics", "orders,payments")
          .option("startingOffsets", "earliest")
          .option("endingOffsets", "latest")
          .load())

    # streaming: offsets live in the query's checkpoint
    query = (spark.readStream.format("rocketmq")
             .option("namesrv", "127.0.0.1:9876")
             .option("topics", "orders")
             .option("startingOffsets", "earliest")
             .option("maxMessagesPerTrigger", "100000")
             .option("commitToGroup", "orders-to-lake")
             .load()
             .writeStream.format("parquet")
             .option("path", "/data/orders")
             .option("checkpointLocation", "/data/orders/_checkpoint")
             .start())

Rows have the Spark sink's schema (:data:`rmq_async.sinks.spark.SPARK_SCHEMA`), so code written
against one works on the other; a user-given schema must equal it. Their properties are those a
consumer delivers, the pull's ``MIN_OFFSET`` and ``MAX_OFFSET`` included, as in the sink's rows.

How it works
------------
Partitions are queues. On the driver, the planner asks the name server for the routes of the
topics and each queue's master for its min and max offsets (and, for a timestamp position,
SEARCH_OFFSET_BY_TIMESTAMP), and plans one Spark partition per queue with messages in range:
``(topic, broker, queue id, start, end)``. An executor task opens a short-lived client of its
own, pulls exactly ``[start, end)`` of its queue with plain PULL_MESSAGE calls (no consumer
group rebalance, nothing committed), decodes the stored records, converts them column by column
to Arrow (:func:`rmq_async.sinks._arrow.messages_to_arrow`) and yields record batches of
``chunkRows`` rows. The planning (driver side) and the reads (executors) run in Spark's Python
workers, which must import rmq_async: point ``spark.pyspark.python`` (or ``PYSPARK_PYTHON``) at
an interpreter that has it, on every machine of the cluster.

A stream's driver keeps its client, and with it the routes it fetched. When no name server
answers for a topic's route (or, with ``topicPattern``, for the topic list), or one that just
restarted does not know the topic yet, it plans from the route it holds and logs
``spark_source.route_refresh_failed`` (``spark_source.topic_list_failed``), as Java's client
does when a route refresh fails; without a route fetched before, the error fails the query.
A broker that does not answer for its queues' offsets fails it too (the executors could not
read those queues either).

In a stream, Spark's checkpoint owns the offsets: each micro-batch's end offsets are written to
the offset log before the batch runs, so a restarted query re-plans the same ranges for a batch
that did not commit and continues after the last committed one. With an exactly-once sink
(Spark's file sink, Delta) the output holds every message once. ``commitToGroup`` additionally
writes the end offsets of each committed micro-batch to that consumer group on the brokers
(UPDATE_CONSUMER_OFFSET), for ``mqadmin consumerProgress`` and lag dashboards; the group's
offsets are never read back. Spark tells a source about a committed micro-batch when it plans
the next one, so the offsets are written then, and also whenever the source is asked for new
data (its start is the last committed end): a stream that has caught up shows no lag. Before
the first write to a broker the source sends it one heartbeat for the group (as a pull
consumer, from a connection it closes right away), which makes the broker create the group's
retry topic that ``consumerProgress`` needs; a broker that does not answer gets it again at
the next write. Each queue's offset is written on its own: one whose broker left the route or
does not answer is logged (``spark_source.commit_to_group_failed`` with the queue and offset)
and written at a later commit, the others are written now, and the query goes on. Use a group
of its own: push consumers in the same group would count that client while it is connected.

Options (names are case-insensitive)
------------------------------------
``namesrv`` (required)
    Name server address(es), ``host:port``, several separated by ``;``.
``topics`` or ``topicPattern`` (one of them is required)
    One or more topics, comma separated; or a regular expression that whole topic names match
    (the name servers' topic list, read again at every micro-batch: matching topics created
    later are read from their first offset). A pattern never matches the broker's system
    topics (``SCHEDULE_TOPIC_XXXX``, ``RMQ_SYS_*``, ``rmq_sys_*``, ...) nor retry and
    dead-letter topics (``%RETRY%...``, ``%DLQ%...``); name one in ``topics`` to read it.
``tags`` / ``sql``
    A tag expression (``"created || paid"``) or an SQL92 expression (the broker needs
    ``enablePropertyFilter=true``) that the broker filters on; not both.
``startingOffsets``
    ``earliest``, ``latest`` (streams only, their default), a timestamp (epoch milliseconds or
    ISO-8601, e.g. ``2026-11-23T16:00:00Z``: per queue, the first message stored at or after
    that time; the broker's SEARCH_OFFSET_BY_TIMESTAMP answer, checked with a pull, and
    corrected on a 4.x broker, which answers the nearest message), or JSON per
    queue: ``{"orders": {"broker-a:0": 1200, "broker-a:1": -2}}`` with ``-2`` for earliest and
    ``-1`` for latest; queues left out start at earliest. Batch default: ``earliest``. In a
    stream it applies only to a new query (a restarted one continues from its checkpoint);
    queues that appear later are read from their first offset. A stream's ``latest`` (and a
    JSON ``-1``) is where the queues are when its first micro-batch is planned: the
    checkpoint keeps the start offset ``{"@latest": true}``. Whatever the start, batch 0's
    end carries the offsets it starts from (under ``"@start"``), so Spark's repeated
    questions about the start, and a restart before batch 0 was committed, all plan the same
    range (a JSON offset above a queue's max, lowered to the max, and a time after a queue's
    last message resolve otherwise once the queue has grown).
``startingTimestamp``
    The same as a timestamp in ``startingOffsets`` (the Kafka source's name).
``endingOffsets`` / ``endingTimestamp`` (batch only)
    Exclusive end, same forms as the start; default ``latest``; queues left out of JSON end at
    latest.
``maxMessagesPerTrigger`` (streams only)
    At most this many offsets per micro-batch, shared between queues in proportion to their
    backlog (with a ``tags``/``sql`` filter fewer rows may come out); as in the Kafka source,
    every queue with a backlog gets one offset at least, so a bound smaller than the number
    of such queues is passed (each of them moves by one at least). ``maxOffsetsPerTrigger``,
    the Kafka source's name, is taken for it too.
``failOnDataLoss`` (default ``true``)
    Offsets planned for but gone from the broker (expired files, an offset below the queue's
    min, entries whose messages left the commit log, a queue whose max went down below what
    the query read): fail the query with :class:`DataLossError`, or with ``false`` log
    ``spark_source.data_loss`` and skip them. An admin offset reset of the pull group is not
    a loss: the range planned is read as planned. Nor is an offset the queue still holds
    that the broker keeps refusing (four answers in a row): whatever this option says, that
    read fails with :class:`~rmq_async.client.errors.MQClientError`, and Spark tries the
    task again up to ``spark.task.maxFailures`` (1 in ``local`` mode: the query fails).
``commitToGroup``
    A consumer group to write the committed offsets to after each micro-batch (streams only;
    a batch read refuses it).
``group``
    The group name pulls are made under (default ``commitToGroup``, else
    ``rmq_async_spark_source``); the broker needs it to exist or to auto-create groups.
``accessKey`` / ``secretKey`` / ``securityToken``
    ACL credentials; every request is signed.
``tls`` / ``tlsVerify`` / ``tlsCaFile``
    TLS to name servers and brokers; ``tlsVerify=false`` accepts any certificate, ``tlsCaFile``
    trusts a CA bundle (and implies ``tls``).
``apiTimeout`` (seconds, default 10), ``pullBatchSize`` (messages per pull, default 32; the
broker caps it), ``pullDepth`` (pulls kept in flight per queue range when no tag or SQL filter
is set, default 4; a filtered read pulls one at a time), ``chunkRows`` (rows per Arrow batch,
default 10,000).

Log events (structlog): ``spark_source.planned`` (a batch read or micro-batch planned: queues,
offsets), ``spark_source.partition_read`` (an executor read one queue range: rows, seconds),
``spark_source.data_loss``, ``spark_source.route_refresh_failed`` and
``spark_source.topic_list_failed`` (planned from the routes held),
``spark_source.committed_to_group``, ``spark_source.commit_to_group_failed`` (per queue) and
``spark_source.announce_group_failed`` (per broker).
"""

from __future__ import annotations

import asyncio
import os
import socket
import time
from collections.abc import AsyncGenerator, Callable, Coroutine, Iterator, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

import pyarrow as pa
import structlog
from pyspark.sql.datasource import (
    DataSource,
    DataSourceReader,
    DataSourceStreamReader,
    InputPartition,
)
from pyspark.sql.streaming.datasource import (
    ReadAllAvailable,
    ReadLimit,
    ReadMaxRows,
    SupportsTriggerAvailableNow,
)
from pyspark.sql.types import ArrayType, DataType, MapType, StructType

from rmq_async.client.instance import ClientInstance
from rmq_async.consumer.offset_store import write_topic_by_topic
from rmq_async.protocol.types import MessageExt, MessageQueue
from rmq_async.sinks._arrow import ARROW_SCHEMA, messages_to_arrow
from rmq_async.sinks.spark import SPARK_SCHEMA
from rmq_async.sources.ranges import (
    EARLIEST,
    LATEST,
    DataLossError,
    SourceError,
    SourceOptions,
    announce_group,
    limit_offsets,
    list_queues,
    offsets_from_json,
    offsets_to_json,
    open_client,
    queue_bounds,
    queue_key,
    read_range,
    report_data_loss,
    resolve_offsets,
    source_topics,
)

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

__all__ = [
    "FORMAT",
    "DataLossError",
    "QueueRange",
    "RocketMQBatchReader",
    "RocketMQDataSource",
    "RocketMQStreamReader",
    "SourceError",
    "register",
    "spark_arrow_schema",
]

log = structlog.get_logger(__name__)

#: The format name: ``spark.read.format(FORMAT)``.
FORMAT = "rocketmq"

T = TypeVar("T")


def register(spark: SparkSession) -> None:
    """Make ``format("rocketmq")`` available in ``spark`` (once per session is enough)."""
    spark.dataSource.register(RocketMQDataSource)


def spark_arrow_schema() -> pa.Schema:
    """The sink's Arrow schema as Spark expects batches of :data:`SPARK_SCHEMA`.

    Spark's timestamps are microseconds; everything else is :data:`ARROW_SCHEMA` as is.
    """
    fields = []
    for f in ARROW_SCHEMA:
        if pa.types.is_timestamp(f.type):
            f = f.with_type(pa.timestamp("us", tz=f.type.tz))
        fields.append(f)
    return pa.schema(fields)


class QueueRange(InputPartition):
    """One Spark partition: the offsets ``[start, end)`` of one queue."""

    def __init__(self, topic: str, broker_name: str, queue_id: int, start: int, end: int,
                 fresh: bool = False) -> None:
        # No super().__init__: InputPartition's only field (value) is not used.
        self.topic = topic
        self.broker_name = broker_name
        self.queue_id = queue_id
        self.start = start
        self.end = end
        self.fresh = fresh

    @property
    def queue(self) -> MessageQueue:
        return MessageQueue(self.topic, self.broker_name, self.queue_id)


def _ranges(start: dict[MessageQueue, int], end: dict[MessageQueue, int], *,
            fresh: set[MessageQueue] | None = None) -> list[QueueRange]:
    out = []
    for mq in sorted(end):
        lo = start.get(mq, 0)
        if end[mq] > lo:
            out.append(QueueRange(mq.topic, mq.broker_name, mq.queue_id, lo, end[mq],
                                  bool(fresh and mq in fresh)))
    return out


def _read_partition(opts: SourceOptions, part: InputPartition) -> Iterator[pa.RecordBatch]:
    """Executor side: pull one queue range, yield it as Arrow record batches."""
    if not isinstance(part, QueueRange):
        return  # Spark plans one empty partition when a batch read has none
    schema = spark_arrow_schema()
    mq = part.queue
    t0 = time.monotonic()
    rows = 0
    with asyncio.Runner() as runner:
        client = runner.run(_new_client(opts, "read"))
        chunks = read_range(client, opts, mq, part.start, part.end, fresh_queue=part.fresh)
        try:
            while (msgs := runner.run(_next_chunk(chunks))) is not None:
                table = messages_to_arrow(msgs).cast(schema)
                rows += table.num_rows
                yield from table.to_batches(max_chunksize=opts.chunk_rows)
        finally:
            try:
                runner.run(chunks.aclose())
            finally:
                runner.run(client.close())
    log.info("spark_source.partition_read", topic=mq.topic, queue=queue_key(mq),
             start=part.start, end=part.end, rows=rows, seconds=round(time.monotonic() - t0, 3),
             host=socket.gethostname(), pid=os.getpid())


async def _next_chunk(chunks: AsyncGenerator[list[MessageExt], None]) -> list[MessageExt] | None:
    return await anext(chunks, None)


async def _bounds(client: ClientInstance, opts: SourceOptions) -> dict[MessageQueue, tuple[int, int]]:
    """Min and max offset of every queue the source reads right now."""
    return await queue_bounds(client, await list_queues(client, await source_topics(client, opts)))


async def _read_what_arrived() -> None:
    """Give a loop that was not running the turns to handle what its sockets received
    meanwhile: a peer's close is read in one turn and ends the connection in the next."""
    for _ in range(3):
        await asyncio.sleep(0)


async def _new_client(opts: SourceOptions, role: str) -> ClientInstance:
    return open_client(opts, role)


async def _with_client(opts: SourceOptions, role: str,
                       work: Callable[[ClientInstance], Coroutine[Any, Any, T]]) -> T:
    client = open_client(opts, role)
    try:
        return await work(client)
    finally:
        await client.close()


def _check_schema(schema: StructType) -> None:
    # Nullability included (the reads return batches of exactly this schema, which Spark
    # checks against the one given: a schema equal in its simple string but nullable where
    # the source's fields are not passed here and then failed every read task).
    if schema != SPARK_SCHEMA and _shape(schema) != _shape(SPARK_SCHEMA):
        raise SourceError(
            f"format rocketmq has a fixed schema ({SPARK_SCHEMA.simpleString()}, nullability "
            f"as rmq_async.sinks.spark.SPARK_SCHEMA has it): give none, or that one; got "
            f"{schema.simpleString()}"
            + (" (its nullability differs)"
               if schema.simpleString() == SPARK_SCHEMA.simpleString() else ""))


def _shape(t: DataType) -> object:
    """``t`` down to names, types and nullability (no metadata)."""
    if isinstance(t, StructType):
        return tuple((f.name, _shape(f.dataType), f.nullable) for f in t.fields)
    if isinstance(t, ArrayType):
        return ("array", _shape(t.elementType), t.containsNull)
    if isinstance(t, MapType):
        return ("map", _shape(t.keyType), _shape(t.valueType), t.valueContainsNull)
    return t.simpleString()


class RocketMQDataSource(DataSource):
    """``format("rocketmq")``: see the module documentation for the options."""

    @classmethod
    def name(cls) -> str:
        return FORMAT

    def schema(self) -> StructType:
        return SPARK_SCHEMA

    def reader(self, schema: StructType) -> RocketMQBatchReader:
        _check_schema(schema)
        return RocketMQBatchReader(SourceOptions.parse(self.options, streaming=False))

    def streamReader(self, schema: StructType) -> RocketMQStreamReader:
        _check_schema(schema)
        return RocketMQStreamReader(SourceOptions.parse(self.options, streaming=True))


class RocketMQBatchReader(DataSourceReader):
    """A batch read: the offsets between ``startingOffsets`` and ``endingOffsets``, per queue."""

    def __init__(self, opts: SourceOptions) -> None:
        self.opts = opts

    async def _plan(self, client: ClientInstance) -> list[QueueRange]:
        opts = self.opts
        assert opts.ending is not None
        bounds = await _bounds(client, opts)
        start = await resolve_offsets(client, opts.starting, bounds, default=EARLIEST,
                                      group=opts.group, timeout=opts.api_timeout)
        end = await resolve_offsets(client, opts.ending, bounds, default=-1,
                                    group=opts.group, timeout=opts.api_timeout)
        past = sorted(mq for mq in end if start.get(mq, 0) > end[mq])
        if past:
            # Nothing to read is not what such options mean (the Kafka source fails too).
            raise SourceError("the start is past the end for "
                              + ", ".join(f"{mq.topic} {queue_key(mq)} ({start[mq]} > {end[mq]})"
                                          for mq in past))
        parts = _ranges(start, end)
        log.info("spark_source.planned", kind="batch", topics=sorted({mq.topic for mq in bounds}),
                 queues=len(bounds), partitions=len(parts),
                 offsets=sum(p.end - p.start for p in parts))
        return parts

    def partitions(self) -> Sequence[InputPartition]:
        return asyncio.run(_with_client(self.opts, "plan", self._plan))

    def read(self, partition: InputPartition) -> Iterator[pa.RecordBatch]:
        return _read_partition(self.opts, partition)


#: The start offset of a stream that starts at "latest" (a marker, resolved by batch 0's plan).
LATEST_MARK = "@latest"
#: In batch 0's end offsets: the queues' offsets its plan started from.
LATEST_START_KEY = "@start"


def _offsets(data: dict[str, Any]) -> dict[MessageQueue, int]:
    """The queue offsets of a stream offset, without the markers (keys from ``@``, which no
    topic name has)."""
    return offsets_from_json({k: v for k, v in data.items() if not k.startswith("@")})


class RocketMQStreamReader(DataSourceStreamReader, SupportsTriggerAvailableNow):
    """A stream: offsets ``{topic: {"broker:queue": offset}}`` in Spark's checkpoint.

    The driver-side methods run in one long-lived Python process per query; it keeps one
    client on a private event loop (dropped when the reader is pickled for the executors).
    """

    def __init__(self, opts: SourceOptions) -> None:
        self.opts = opts
        self._runner: asyncio.Runner | None = None
        self._client: ClientInstance | None = None
        self._target: dict[MessageQueue, int] | None = None
        self._initial: dict[MessageQueue, int] | None = None  # initialOffset's, once resolved
        self._lows: dict[MessageQueue, int] = {}  # each queue's min offset, as last read
        self._went_down: dict[MessageQueue, int] = {}  # queues reported: the offset read
        self._group_offsets: dict[MessageQueue, int] = {}  # as written to commitToGroup
        self._group_announced: set[str] = set()  # brokers that took the group's heartbeat

    def __getstate__(self) -> dict[str, Any]:
        return {"opts": self.opts, "_runner": None, "_client": None, "_target": None,
                "_lows": {}, "_went_down": {}, "_group_offsets": {},
                "_group_announced": set()}

    def _run(self, work: Callable[[ClientInstance], Coroutine[Any, Any, T]]) -> T:
        if self._runner is None:
            self._runner = asyncio.Runner()
        if self._client is None:
            self._client = self._runner.run(_new_client(self.opts, "driver"))
        else:
            # Nothing ran the loop since the last call, so a connection its peer closed
            # meanwhile (a broker or a name server closes one idle for 120 s) is still pooled.
            # A few turns read those closes first: the work connects again instead of sending
            # on a dead connection and failing (Java's event loop sees a close at once).
            self._runner.run(_read_what_arrived())
        client = self._client
        return self._runner.run(work(client))

    async def _live_bounds(self, client: ClientInstance) -> dict[MessageQueue, tuple[int, int]]:
        bounds = await _bounds(client, self.opts)
        self._lows = {mq: low for mq, (low, _) in bounds.items()}
        return bounds

    async def _latest(self, client: ClientInstance) -> dict[MessageQueue, int]:
        return {mq: high for mq, (_, high) in (await self._live_bounds(client)).items()}

    def initialOffset(self) -> dict[str, Any]:
        # Spark asks for a new query's start more than once (to plan batch 0's end, then to
        # run it, and again after a restart before batch 0 was committed), and the answers
        # must agree. "latest" would move between the calls, so it is answered by a marker;
        # the first latestOffset resolves it and carries the queues' offsets in batch 0's end
        # (under LATEST_START_KEY), where partitions() reads batch 0's start from. Any other
        # start is resolved once per reader: a queue out of the route at the second call (a
        # broker restarting) would otherwise be missing from the start and read from its min.
        if self._initial is not None:
            return offsets_to_json(self._initial)
        starting = self.opts.starting
        if starting.kind == "latest" or (starting.kind == "offsets"
                                         and LATEST in starting.offsets.values()):
            log.info("spark_source.initial_offsets", offsets="latest")
            return {LATEST_MARK: True}

        async def work(client: ClientInstance) -> dict[MessageQueue, int]:
            bounds = await _bounds(client, self.opts)
            return await resolve_offsets(client, self.opts.starting, bounds, default=EARLIEST,
                                         group=self.opts.group, timeout=self.opts.api_timeout)

        offsets = self._run(work)
        log.info("spark_source.initial_offsets", offsets=offsets_to_json(offsets))
        self._initial = offsets
        return offsets_to_json(offsets)

    def getDefaultReadLimit(self) -> ReadLimit:
        n = self.opts.max_messages_per_trigger
        return ReadMaxRows(n) if n else ReadAllAvailable()

    def prepareForTriggerAvailableNow(self) -> None:
        self._target = self._run(self._latest)

    def latestOffset(self, start: dict[str, Any], limit: ReadLimit) -> dict[str, Any]:
        resolved = start.get(LATEST_MARK) is True
        if resolved:
            # Batch 0 of a query that starts at "latest" (or a JSON -1) starts where the
            # queues are now.
            async def work(client: ClientInstance) -> tuple[dict[MessageQueue, int],
                                                            dict[MessageQueue, int]]:
                bounds = await self._live_bounds(client)
                first = await resolve_offsets(client, self.opts.starting, bounds,
                                              default=EARLIEST)
                return {mq: high for mq, (_, high) in bounds.items()}, first

            live, begin = self._run(work)
        else:
            live = self._run(self._latest)
            begin = _offsets(start)
        # Spark tells a source about a committed batch (commit) only when it plans the next
        # one with new data; ``start`` here is always the end of the last committed batch, so
        # the group also catches up when the stream has (and on the last round of availableNow).
        self._commit_to_group(begin)
        latest = dict(live)
        # A queue never goes backwards, and one that left the route keeps its offset.
        for mq, off in begin.items():
            high = live.get(mq, off)
            if high < off and self._went_down.get(mq) != off:
                # Its max went below what was read (the topic deleted and created again, a
                # store wiped): what it holds now below ``off`` would never be read. Raised,
                # or (failOnDataLoss=false) logged once; the queue goes on from ``off``.
                self._went_down[mq] = off
                report_data_loss(self.opts, mq, high, off,
                                 f"the queue's max offset went down from {off} to {high}")
            latest[mq] = max(off, high)
        if self._target is not None:
            # availableNow: no further than what the queues held when it was asked for (the
            # check above is against their live offsets: a start read after that moment may
            # lie above the target without anything having gone down).
            # A queue the target does not know (it came after) stays where it starts.
            latest = {mq: max(begin.get(mq, -1),
                              min(high, self._target.get(mq, begin.get(mq, high))))
                      for mq, high in latest.items()
                      if mq in self._target or mq in begin}
        if isinstance(limit, ReadMaxRows):
            # A queue new to the query is read from its first offset (see partitions): its
            # share of the limit starts there, not at 0, where nothing is left to read.
            fill = {mq: begin.get(mq, self._lows.get(mq, 0)) for mq in latest}
            latest = limit_offsets(fill, latest, limit.max_rows)
        if not resolved and latest == begin:
            # Nothing new: the very offset Spark gave, so that it finds no new data. Batch 0's
            # end of a "latest" start carries LATEST_START_KEY, and the same offsets without
            # it would differ as text and run an empty micro-batch.
            return start
        end: dict[str, Any] = dict(offsets_to_json(latest))
        if resolved or begin == self._initial:
            # Batch 0: its end carries where it starts, which partitions() reads, so that a
            # restart before it was committed plans it the same even when the start resolves
            # otherwise by then (an offset above a queue's max, lowered to the max; a time
            # after a queue's last message: both move with the queue).
            end[LATEST_START_KEY] = offsets_to_json(begin)
        return end

    def reportLatestOffset(self) -> dict[str, Any] | None:
        return None

    def partitions(self, start: dict[str, Any], end: dict[str, Any]) -> Sequence[InputPartition]:
        finish = _offsets(end)
        carried = end.get(LATEST_START_KEY)
        if carried is not None:
            # Batch 0 (only its end carries a start): from where its end was planned.
            begin = offsets_from_json(carried)
        elif start.get(LATEST_MARK) is True:
            begin = dict(finish)  # a "latest" batch 0 planned before its end carried one
        else:
            begin = _offsets(start)
        fresh = set(finish) - set(begin)
        parts = _ranges(begin, finish, fresh=fresh)
        log.info("spark_source.planned", kind="micro_batch", partitions=len(parts),
                 offsets=sum(p.end - p.start for p in parts), end=end)
        return parts

    def read(self, partition: InputPartition) -> Iterator[pa.RecordBatch]:
        return _read_partition(self.opts, partition)

    def commit(self, end: dict[str, Any]) -> None:
        self._commit_to_group(_offsets(end))

    def _commit_to_group(self, offsets: dict[MessageQueue, int]) -> None:
        """Write ``offsets`` to ``commitToGroup``, each queue on its own.

        The group is only a view (the offsets that count are in Spark's checkpoint), so
        nothing here fails the query: a queue whose broker left the route or does not answer
        is logged and tried again at the next commit, while the others are written; only the
        queues written are remembered as such. A broker gets the group's heartbeat before
        its first write, again at the next commit until it has answered one.
        """
        group = self.opts.commit_to_group
        if group is None:
            return
        todo = {mq: off for mq, off in offsets.items() if self._group_offsets.get(mq) != off}
        if not todo:
            return
        failed: dict[MessageQueue, str] = {}

        async def work(client: ClientInstance) -> None:
            addrs: dict[MessageQueue, str] = {}

            async def find(mq: MessageQueue) -> None:
                try:
                    addrs[mq] = await client.find_broker_master(mq.broker_name, mq.topic)
                except Exception as exc:  # left the route: its offset waits for the next commit
                    failed[mq] = f"{type(exc).__name__}: {exc}"

            async def write(mq: MessageQueue, addr: str) -> None:
                try:
                    await client.api.update_consumer_offset(addr, group, mq, todo[mq],
                                                            oneway=False)
                except Exception as exc:
                    failed[mq] = f"{type(exc).__name__}: {exc}"
                else:
                    self._group_offsets[mq] = todo[mq]

            await asyncio.gather(*(find(mq) for mq in todo))
            unannounced = set(addrs.values()) - self._group_announced
            if unannounced:
                self._group_announced |= await announce_group(
                    self.opts, group, unannounced, {mq.topic for mq in offsets})
            await write_topic_by_topic(addrs, addrs.__getitem__,
                                       lambda mq: write(mq, addrs[mq]))

        try:
            self._run(work)
        except Exception as exc:  # not one queue's failure: the whole round went wrong
            log.warning("spark_source.commit_to_group_failed", group=group,
                        error=f"{type(exc).__name__}: {exc}")
        for mq, error in sorted(failed.items()):
            log.warning("spark_source.commit_to_group_failed", group=group, topic=mq.topic,
                        queue=queue_key(mq), offset=todo[mq], error=error)
        written = {mq: off for mq, off in todo.items() if self._group_offsets.get(mq) == off}
        if written:
            log.info("spark_source.committed_to_group", group=group, queues=len(written),
                     offsets=sum(written.values()), failed=len(todo) - len(written))

    def stop(self) -> None:
        runner, client = self._runner, self._client
        self._runner = self._client = None
        if runner is None:
            return
        try:
            if client is not None:
                runner.run(client.close())
        finally:
            runner.close()

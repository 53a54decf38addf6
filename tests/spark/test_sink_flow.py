"""Batch sizes that follow the consumer's flow control, and the consumer's side of a sink:
acknowledgements, hand-back of failed chunks, pull backpressure. No broker, no Spark job."""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
import warnings
import weakref
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

import pytest

from rmq_async import PushConsumer
from rmq_async.consumer import sink_service as sink_service_module
from rmq_async.consumer.offset_store import _MemoryTable
from rmq_async.consumer.process_queue import ProcessQueue
from rmq_async.consumer.runtime import ConsumerRuntime
from rmq_async.consumer.service import ServiceRouter
from rmq_async.consumer.sink_service import SinkConsumeService
from rmq_async.consumer.tasks import TaskOwner
from rmq_async.errors import InvalidArgumentError
from rmq_async.protocol.message import encode_stored_message
from rmq_async.protocol.stored import StoredChunk
from rmq_async.protocol.types import PROPERTY_RETRY_TOPIC, MessageExt, MessageQueue
from rmq_async.sinks import SinkClosedError
from rmq_async.sinks import spark as spark_module
from rmq_async.sinks.spark import BatchInfo, SparkSink
from tests.helpers import collector_off, wait_until

pytestmark = pytest.mark.spark

MiB = 1 << 20


def msgs(start: int, n: int, *, queue_id: int = 0, topic: str = "orders",
         body: bytes = b"0123456789") -> list[MessageExt]:
    return [MessageExt(topic=topic, body=body, queue_id=queue_id, queue_offset=i,
                       properties={"UNIQ_KEY": f"K{i:08d}"}, broker_name="broker-a")
            for i in range(start, start + n)]


class Writes:
    """A write function recording row counts; ``gate`` holds every write until set."""

    def __init__(self) -> None:
        self.rows: list[int] = []
        self.gate = threading.Event()
        self.gate.set()
        self.entered = threading.Semaphore(0)

    def __call__(self, df: Any, info: BatchInfo) -> None:
        self.entered.release()
        assert self.gate.wait(10)
        self.rows.append(info.row_count)

    async def wait_entered(self) -> None:
        assert await asyncio.to_thread(self.entered.acquire, True, 10), "no write started"


def sink_for(write: Writes, **kw: Any) -> SparkSink:
    opts: dict[str, Any] = {"batch_rows": 1000, "max_batch_latency": 30.0, "retry_backoff": 0.0}
    opts.update(kw)
    return SparkSink(None, write, create_dataframe=lambda table: table, **opts)


def ignore(ok: bool) -> None:
    pass


@contextlib.asynccontextmanager
async def running(sink: SparkSink) -> AsyncIterator[None]:
    """``sink`` with its writer loop running in an owner of its own; closed, and the owner
    with it, on the way out."""
    owner = TaskOwner("sink")
    await sink.start(owner)
    try:
        yield
    finally:
        await sink.aclose()
        await owner.aclose()


async def offer_300_in_chunks_of_50(sink: SparkSink) -> list[bool]:
    """Run ``sink`` and offer it messages 0..299 as the consumer would (waiting for room);
    returns the acknowledgements once it is closed."""
    acks: list[bool] = []
    async with asyncio.TaskGroup() as tg:
        await sink.start(tg)
        for start in range(0, 300, 50):
            sink.offer(msgs(start, 50), acks.append)
            if not sink.want_more():
                await sink.wait_for_room()
        await sink.aclose()
    return acks


# ---------------------------------------------------------------------------- the sink


async def test_a_write_that_does_not_write_before_it_returns_is_refused() -> None:
    """The write runs in a worker thread and its return means "written": an ``async def``
    write's coroutine never ran, and the batch was acknowledged (its offsets committed)
    without a row written. Refused up front; an awaitable returned by a wrapper the check
    cannot see through fails the attempt (the batch is not acknowledged)."""
    import functools

    async def async_write(df: Any, info: BatchInfo) -> None:
        raise AssertionError("never run")

    def generator_write(df: Any, info: BatchInfo) -> Any:
        yield

    class AsyncCall:
        async def __call__(self, df: Any, info: BatchInfo) -> None:
            raise AssertionError("never run")

    for bad in (async_write, functools.partial(async_write), AsyncCall(), generator_write,
                "not a function"):
        with pytest.raises(InvalidArgumentError, match="write must be"):
            SparkSink(None, bad, create_dataframe=lambda table: table)  # type: ignore[arg-type]

    def hidden(df: Any, info: BatchInfo) -> Any:  # a plain function returning a coroutine
        return async_write(df, info)

    sink = SparkSink(None, hidden, create_dataframe=lambda table: table, batch_rows=10,
                     max_batch_latency=30.0, write_retries=1, retry_backoff=0.0)
    acks: list[bool] = []
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # (the coroutine is closed, not left unawaited)
        async with running(sink):
            sink.offer(msgs(0, 10), acks.append)
            async with asyncio.timeout(10):
                while not acks:
                    await asyncio.sleep(0.01)
    assert acks == [False]


async def test_a_start_while_a_given_up_write_still_runs_is_refused_not_hung() -> None:
    """stop() gives a hung Spark write up (its thread cannot be interrupted); the writer loop
    holds its lock until the write returns, and a start() after it waited for that lock, for
    good (holding the consumer's start lock, so a second stop() hung too)."""
    from rmq_async.errors import IllegalStateError

    write = Writes()
    write.gate.clear()
    sink = sink_for(write, batch_rows=10)
    owner = TaskOwner("sink")
    await sink.start(owner)
    sink.offer(msgs(0, 10), ignore)
    await write.wait_entered()
    await owner.aclose(abandon_after=0.2)  # stop(): the writer given up in its write
    with contextlib.suppress(TimeoutError):
        async with asyncio.timeout(0.2):
            await sink.aclose()
    again = TaskOwner("sink-again")
    async with asyncio.timeout(2):
        with pytest.raises(IllegalStateError, match="still in a Spark write"):
            await sink.start(again)
    write.gate.set()  # the write returns; its loop ends
    await wait_until(lambda: not sink._writer_lock.locked(), 10, what="the old writer ended")
    async with asyncio.timeout(2):
        await sink.start(again)  # now it opens again
    await sink.aclose()
    await again.aclose()


async def test_flow_limit_caps_batches_at_half_of_it() -> None:
    write = Writes()
    sink = sink_for(write, batch_rows=1000)
    sink.set_flow_limit(400)
    assert sink.effective_batch_rows == 200
    sink.offer(msgs(0, 150), ignore)
    assert sink.want_more()
    sink.offer(msgs(150, 60), ignore)  # 210 > 200: the 150 are closed, the 60 open the next
    assert not sink.want_more()
    sink.offer(msgs(210, 140), ignore)  # 200: closed at the limit
    sink.set_flow_limit(None)
    assert sink.effective_batch_rows == 1000
    sink.offer(msgs(350, 300), ignore)
    await sink.aclose()
    assert write.rows == [150, 200, 300]


async def test_flow_limit_in_bytes_and_a_lower_limit_closes_the_open_batch() -> None:
    write = Writes()
    sink = sink_for(write, batch_rows=1000, batch_bytes=64 * MiB)
    sink.set_flow_limit(10_000, 5000)
    assert (sink.effective_batch_rows, sink.effective_batch_bytes) == (1000, 2500)
    sink.offer(msgs(0, 100, body=bytes(20)), ignore)  # 2000 bytes: open
    assert sink.want_more()
    sink.set_flow_limit(150)  # half is 75 rows: the open batch of 100 closes now
    assert not sink.want_more()
    await sink.aclose()
    assert write.rows == [100]


def test_flow_limit_rejects_nonsense() -> None:
    sink = sink_for(Writes())
    with pytest.raises(ValueError):
        sink.set_flow_limit(0)
    with pytest.raises(ValueError):
        sink.set_flow_limit(10, -1)
    sink.set_flow_limit(1)
    assert sink.effective_batch_rows == 1


async def test_expedite_closes_the_open_batch_without_waiting_for_latency() -> None:
    write = Writes()
    sink = sink_for(write, max_batch_latency=30.0)
    async with asyncio.TaskGroup() as tg:
        await sink.start(tg)
        sink.expedite()  # nothing open: nothing happens
        sink.offer(msgs(0, 10), ignore)
        started = time.monotonic()
        sink.expedite()
        await write.wait_entered()
        assert time.monotonic() - started < 5.0
        await sink.aclose()
    assert write.rows == [10]


async def test_expedite_while_writing_closes_the_batch_once_the_writer_is_free() -> None:
    write = Writes()
    write.gate.clear()
    sink = sink_for(write, batch_rows=100, max_batch_latency=30.0)
    async with asyncio.TaskGroup() as tg:
        await sink.start(tg)
        sink.offer(msgs(0, 100), ignore)  # full: written (held by the gate)
        await write.wait_entered()
        sink.offer(msgs(100, 10), ignore)
        sink.expedite()
        sink.offer(msgs(110, 5), ignore)  # the open batch still takes chunks meanwhile
        assert sink.want_more()
        write.gate.set()
        await write.wait_entered()  # the second batch starts at once, not after 30 s
        await sink.aclose()
    assert write.rows == [100, 15]


async def test_the_next_batch_is_converted_while_one_is_written_and_only_once(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Batch 2 closes while batch 1 is being written: it is converted to Arrow before that
    write returns; its own write (failing once, then retried) reuses that table."""
    from rmq_async.sinks import spark as spark_module

    real = spark_module.messages_to_arrow
    converted: list[int] = []  # the first offset of every batch converted
    second_converted = threading.Event()

    def recording(batch: list[MessageExt], **kw: Any) -> Any:
        table = real(batch, **kw)
        converted.append(batch[0].queue_offset)
        if batch[0].queue_offset == 100:
            second_converted.set()
        return table

    monkeypatch.setattr(spark_module, "messages_to_arrow", recording)
    attempts: list[int] = []
    written: list[tuple[int, int]] = []

    def write(table: Any, info: BatchInfo) -> None:
        attempts.append(info.batch_id)
        if info.batch_id == 1:
            assert second_converted.wait(10), "batch 2 was not converted during write 1"
        if attempts == [1, 2]:
            raise RuntimeError("storage hiccup")
        written.append((info.batch_id, table.num_rows))

    sink = SparkSink(None, write, create_dataframe=lambda table: table, batch_rows=100,
                     max_batch_latency=30.0, retry_backoff=0.0)
    acks = await offer_300_in_chunks_of_50(sink)
    assert attempts == [1, 2, 2, 3]
    assert written == [(1, 100), (2, 100), (3, 100)]
    # Each batch converted once (batch 1 by its write, 2 and 3 ahead; 1 and 2 may overlap).
    assert sorted(converted) == [0, 100, 200]
    assert acks == [True] * 6


async def test_the_next_dataframe_is_created_during_a_write_and_a_retry_makes_its_own() -> None:
    """Converting ahead also hands the next batch to Spark (``createDataFrame``) while the
    write before it runs; the first attempt of its write uses that DataFrame, a retry does not."""
    created: list[int] = []  # the first offset of every table handed to createDataFrame
    second_created = threading.Event()

    def create(table: Any) -> tuple[int, Any]:
        first = table.column("queue_offset")[0].as_py()
        created.append(first)
        if first == 100:
            second_created.set()
        return first, table  # stands in for the DataFrame

    attempts: list[int] = []

    def write(frame: tuple[int, Any], info: BatchInfo) -> None:
        attempts.append(info.batch_id)
        assert frame[0] == (info.batch_id - 1) * 100 and frame[1].num_rows == 100
        if info.batch_id == 1:
            assert second_created.wait(10), "batch 2 was not handed to Spark during write 1"
        if attempts == [1, 2]:
            raise RuntimeError("storage hiccup")

    sink = SparkSink(None, write, create_dataframe=create, batch_rows=100,
                     max_batch_latency=30.0, retry_backoff=0.0)
    acks = await offer_300_in_chunks_of_50(sink)
    assert attempts == [1, 2, 2, 3]
    # Batch 1 by its own write, 2 ahead and again for its retry, 3 once (ahead or by its write).
    assert sorted(created) == [0, 100, 100, 200]
    assert acks == [True] * 6


async def test_the_sink_collects_once_enough_has_been_handed_to_spark(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A full collection after a write only once the DataFrames made since the last one add
    up to the threshold (here every DataFrame counts a little over half of it), not after
    every batch: a collection holds the GIL for milliseconds."""
    half = 1 << 30
    monkeypatch.setattr(spark_module, "_SPARK_FRAME_OVERHEAD_BYTES", half)
    monkeypatch.setattr(spark_module, "_SPARK_GARBAGE_BYTES", 2 * half)
    written: list[int] = []
    collected_after: list[list[int]] = []

    class CountingGc:
        @staticmethod
        def collect() -> int:
            collected_after.append(list(written))
            return 0

    monkeypatch.setattr(spark_module, "gc", CountingGc)

    def write(df: Any, info: BatchInfo) -> None:
        written.append(info.batch_id)

    sink = SparkSink(None, write, create_dataframe=lambda table: table, batch_rows=50,
                     max_batch_latency=30.0, convert_ahead=False)
    acks = await offer_300_in_chunks_of_50(sink)
    assert acks == [True] * 6
    assert collected_after == [[1, 2], [1, 2, 3, 4], [1, 2, 3, 4, 5, 6]]


async def test_the_dataframes_of_failed_attempts_are_collected_while_writes_keep_failing(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A failed attempt's DataFrame outlives it in its exception's traceback, and in py4j's
    reference cycles after that: with the store down for good (every attempt of every batch
    failing) they are collected all the same, not only after a write that succeeds."""
    monkeypatch.setattr(spark_module, "_SPARK_GARBAGE_BYTES", 1)

    class Frame:  # stands in for PySpark's DataFrame, in a reference cycle as its proxies are
        def __init__(self) -> None:
            self.me = self

    frames: list[weakref.ref[Frame]] = []

    def create(table: Any) -> Frame:
        frame = Frame()
        frames.append(weakref.ref(frame))
        return frame

    def write(df: Any, info: BatchInfo) -> None:
        raise OSError("the store is down")

    sink = SparkSink(None, write, create_dataframe=create, batch_rows=50, max_batch_latency=30.0,
                     write_retries=2, retry_backoff=0.0, convert_ahead=False)
    acks: list[bool] = []
    with collector_off():
        async with running(sink):
            sink.offer(msgs(0, 50), acks.append)
            sink.offer(msgs(50, 50), acks.append)
        assert acks == [False, False]
        assert len(frames) == 6  # three attempts per batch
        # Every attempt's but the last one's (collected before the next attempt).
        assert [ref() is None for ref in frames] == [True] * 5 + [False]


async def test_without_convert_ahead_each_batch_is_converted_by_its_own_write(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """``convert_ahead=False``: batch 2 closes while batch 1 is being written and stays
    messages until its own write converts it (one batch in Arrow form at a time)."""
    from rmq_async.sinks import spark as spark_module

    real = spark_module.messages_to_arrow
    converted: list[int] = []

    def recording(batch: list[MessageExt], **kw: Any) -> Any:
        converted.append(batch[0].queue_offset)
        return real(batch, **kw)

    monkeypatch.setattr(spark_module, "messages_to_arrow", recording)
    seen_during_write: list[list[int]] = []
    second_closed = threading.Event()

    def write(table: Any, info: BatchInfo) -> None:
        if info.batch_id == 1:
            assert second_closed.wait(10), "batch 2 did not close during write 1"
            time.sleep(0.3)  # room for a conversion ahead, which must not happen
        seen_during_write.append(list(converted))

    sink = SparkSink(None, write, create_dataframe=lambda table: table, batch_rows=100,
                     max_batch_latency=30.0, convert_ahead=False)
    acks: list[bool] = []
    async with asyncio.TaskGroup() as tg:
        await sink.start(tg)
        for start in range(0, 300, 50):
            sink.offer(msgs(start, 50), acks.append)
            if start == 150:
                second_closed.set()
            if not sink.want_more():
                await sink.wait_for_room()
        await sink.aclose()
    assert seen_during_write == [[0], [0, 100], [0, 100, 200]]
    assert acks == [True] * 6


async def test_caught_up_closes_the_open_batch_only_when_asked_to() -> None:
    for flush in (True, False):
        write = Writes()
        sink = sink_for(write, max_batch_latency=30.0, flush_when_caught_up=flush)
        async with asyncio.TaskGroup() as tg:
            await sink.start(tg)
            sink.offer(msgs(0, 10), ignore)
            sink.caught_up()
            if flush:
                await write.wait_entered()  # at once, not after 30 s
            else:
                await asyncio.sleep(0.5)
                assert write.rows == []  # still waiting for the batch latency
            await sink.aclose()
        assert write.rows == [10]


# ---------------------------------------------------------------------------- the consumer


class FakeSink:
    """Records what the consumer tells it; acknowledges on demand."""

    def __init__(self) -> None:
        self.offers: list[tuple[list[MessageExt], Callable[[bool], None]]] = []
        self.redelivered: list[bool] = []
        self.limits: list[tuple[int | None, int | None]] = []
        self.expedited = 0
        self.caught = 0
        self.more = True

    def offer(self, batch: list[MessageExt], ack: Callable[[bool], None], *,
              redelivered: bool = False) -> None:
        self.offers.append((batch, ack))
        self.redelivered.append(redelivered)

    def set_flow_limit(self, rows: int | None, bytes_: int | None = None) -> None:
        self.limits.append((rows, bytes_))

    def expedite(self) -> None:
        self.expedited += 1

    def caught_up(self) -> None:
        self.caught += 1

    def want_more(self) -> bool:
        return self.more


class SinkSide:
    """The sink service of a (not started) consumer, wired as ``start()`` wires it."""

    def __init__(self) -> None:
        self.consumer = PushConsumer("G_sink_unit", namesrv="127.0.0.1:9876",
                                     pull_threshold_for_queue=100, consume_concurrently_max_span=80)
        c = self.consumer
        self.rt = ConsumerRuntime(
            group=c.group, client_id=c.client_id, options=c.options, subscriptions=c.subscriptions,
            process_queues=c.process_queues, paused=set(), stats=c.stats, errors=c.errors,
            instance=None, offset_store=_MemoryTable(), tasks=TaskOwner("test"),  # type: ignore[arg-type]
        )
        self.service = SinkConsumeService(self.rt)
        unused: Any = None
        self.router = ServiceRouter(c.subscriptions, concurrent=unused, orderly=unused,
                                    sink=self.service)

    @property
    def offset_store(self) -> Any:
        return self.rt.offset_store

    def pull_delay(self, topic: str) -> float:
        return self.service.pull_delay(topic)


@pytest.fixture
def side() -> Iterator[SinkSide]:
    yield SinkSide()


def attach(side: SinkSide, queues: int = 4,
           sink: FakeSink | None = None) -> tuple[FakeSink, dict[int, MessageQueue]]:
    sink = sink if sink is not None else FakeSink()
    side.consumer.subscribe("orders", sink=sink)  # type: ignore[arg-type]
    mqs = {}
    for q in range(queues):
        mq = MessageQueue("orders", "broker-a", q)
        side.consumer.process_queues[mq] = ProcessQueue()
        mqs[q] = mq
    rebalanced(side, "orders")
    return sink, mqs


def rebalanced(side: SinkSide, *topics: str) -> None:
    """What the rebalancer does after it changed the queues of ``topics``: count them again."""
    for topic in topics:
        side.rt.thresholds.recompute(
            topic, sum(1 for mq in side.consumer.process_queues if mq.topic == topic))


def pull(side: SinkSide, mq: MessageQueue, batch: list[MessageExt]) -> None:
    pq = side.consumer.process_queues[mq]
    first = pq.put_messages(batch)
    side.router.submit(batch, pq, mq, first)


async def test_consumer_tells_the_sink_its_flow_limit_and_commits_on_ack(side: SinkSide) -> None:
    sink, mqs = attach(side, queues=4)
    pull(side, mqs[0], msgs(0, 32))
    # 4 queues x (min(100 cached, 80 span) + 1) messages, 4 x 100 MiB
    assert sink.limits == [(4 * 81, 4 * 100 * MiB)]
    pull(side, mqs[0], msgs(32, 32))
    assert sink.limits == [(4 * 81, 4 * 100 * MiB)] * 2
    _, ack = sink.offers[0]
    assert side.offset_store.read_memory(mqs[0]) < 0
    ack(True)  # committed synchronously: nothing to await, nothing lost on stop
    assert side.offset_store.read_memory(mqs[0]) == 32
    sink.offers[1][1](True)
    assert side.offset_store.read_memory(mqs[0]) == 64
    assert side.consumer.process_queues[mqs[0]].msg_count == 0


async def test_flow_limit_follows_the_queues_the_consumer_holds(side: SinkSide) -> None:
    sink, mqs = attach(side, queues=4)
    pull(side, mqs[0], msgs(0, 32))
    assert sink.limits[-1] == (4 * 81, 4 * 100 * MiB)
    side.consumer.process_queues.pop(mqs[3]).dropped = True  # rebalance took queue 3 away
    rebalanced(side, "orders")
    pull(side, mqs[0], msgs(32, 32))
    assert sink.limits[-1] == (3 * 81, 3 * 100 * MiB)
    gained = MessageQueue("orders", "broker-b", 0)  # and gave this client two new ones
    side.consumer.process_queues[gained] = ProcessQueue()
    side.consumer.process_queues[MessageQueue("orders", "broker-b", 1)] = ProcessQueue()
    rebalanced(side, "orders")
    pull(side, gained, msgs(0, 8))
    assert sink.limits[-1] == (5 * 81, 5 * 100 * MiB)
    side.consumer.process_queues[MessageQueue("other", "broker-a", 0)] = ProcessQueue()
    rebalanced(side, "other")
    pull(side, gained, msgs(8, 8))  # a queue of another topic changes nothing for this one
    assert sink.limits[-1] == (5 * 81, 5 * 100 * MiB)


async def test_flow_limit_follows_a_queue_moving_between_topics(side: SinkSide) -> None:
    # One rebalance takes a queue of "orders" away and another gives this client a queue of
    # "audit": the table holds as many queues as before, and the sink of "orders" must still
    # hear that it has one queue less.
    sink, mqs = attach(side, queues=4)
    pull(side, mqs[0], msgs(0, 32))
    assert sink.limits[-1] == (4 * 81, 4 * 100 * MiB)
    side.consumer.process_queues.pop(mqs[3]).dropped = True
    rebalanced(side, "orders")
    side.consumer.process_queues[MessageQueue("audit", "broker-a", 0)] = ProcessQueue()
    rebalanced(side, "audit")
    pull(side, mqs[0], msgs(32, 32))
    assert sink.limits[-1] == (3 * 81, 3 * 100 * MiB)


async def test_a_sink_of_two_topics_hears_the_room_of_both(side: SinkSide) -> None:
    """One sink may take several topics: what it may hold is the sum over them, whichever
    topic's chunk comes (before, each chunk set the limit from its own topic's queues, and a
    chunk of the smaller topic cut the open batch)."""
    sink, mqs = attach(side, queues=4)
    side.consumer.subscribe("audit", sink=sink)  # type: ignore[arg-type]
    audit = MessageQueue("audit", "broker-a", 0)
    side.consumer.process_queues[audit] = ProcessQueue()
    rebalanced(side, "audit")
    pull(side, mqs[0], msgs(0, 32))
    assert sink.limits[-1] == (5 * 81, 5 * 100 * MiB)
    pull(side, audit, msgs(0, 8, topic="audit"))
    assert sink.limits[-1] == (5 * 81, 5 * 100 * MiB)


async def test_a_retry_pull_for_two_topics_of_one_sink_is_one_chunk_counted_per_topic(
        side: SinkSide, monkeypatch: pytest.MonkeyPatch) -> None:
    """The retried messages of two topics of one sink interleave in the retry queue: one chunk
    (so one batch, whose range of the retry queue no other batch's interleaves), its messages
    counted consumed, or failed, under the topic each came from."""
    sink, _ = attach(side, queues=1)
    side.consumer.subscribe("audit", sink=sink)  # type: ignore[arg-type]
    monkeypatch.setattr(sink_service_module, "SEND_BACK_FAILED_RETRY_DELAY", 0.01)

    async def send_back(msg: MessageExt, delay_level: int) -> bool:
        return True

    monkeypatch.setattr(side.rt, "send_message_back", send_back)
    retry = MessageQueue(side.consumer.retry_topic, "broker-a", 0)
    side.consumer.process_queues[retry] = ProcessQueue()
    batch = msgs(10, 6, topic=retry.topic)
    for m, origin in zip(batch, ["orders", "audit"] * 3, strict=True):
        m.properties = {**m.properties, PROPERTY_RETRY_TOPIC: origin}
    pull(side, retry, batch)
    assert [[m.queue_offset for m in chunk] for chunk, _ in sink.offers] == [list(range(10, 16))]
    sink.offers[0][1](True)
    totals = side.consumer.stats.totals
    assert (totals["orders"].consumed, totals["audit"].consumed) == (3, 3)
    assert side.offset_store.read_memory(retry) == 16

    audit_only = msgs(16, 3, topic=retry.topic)
    for m in audit_only:
        m.properties = {**m.properties, PROPERTY_RETRY_TOPIC: "audit"}
    pull(side, retry, audit_only)
    sink.offers[-1][1](False)
    await wait_until(lambda: side.offset_store.read_memory(retry) == 19, 5, what="sent back")
    assert (totals["orders"].failed, totals["audit"].failed) == (0, 3)
    await side.rt.tasks.aclose()


async def test_queue_over_its_threshold_expedites_the_sink(side: SinkSide) -> None:
    sink, mqs = attach(side, queues=2)
    pull(side, mqs[1], msgs(0, 64, queue_id=1))
    assert sink.expedited == 0
    pull(side, mqs[1], msgs(64, 32, queue_id=1))  # span 95 > 80: this queue stops pulling
    assert sink.expedited == 1


def at(batch: list[MessageExt], max_offset: int) -> list[MessageExt]:
    """``batch`` as pulled from a queue whose max offset is ``max_offset``."""
    for m in batch:
        m.put_property("MAX_OFFSET", str(max_offset))
    return batch


async def test_sink_hears_when_every_queue_is_read_to_its_end(side: SinkSide) -> None:
    sink, mqs = attach(side, queues=3)  # queue 2 never delivers: it has nothing
    pull(side, mqs[0], at(msgs(0, 32), 40))
    pull(side, mqs[1], at(msgs(0, 8, queue_id=1), 8))
    assert sink.caught == 0  # queue 0 holds 8 more on the broker
    pull(side, mqs[0], at(msgs(32, 8), 40))
    assert sink.caught == 1
    pull(side, mqs[1], at(msgs(8, 4, queue_id=1), 20))  # new messages arrived in queue 1
    pull(side, mqs[0], at(msgs(40, 1), 41))
    assert sink.caught == 1
    side.consumer.process_queues[mqs[1]].dropped = True  # rebalance took queue 1 away
    pull(side, mqs[0], at(msgs(41, 1), 42))
    assert sink.caught == 2


async def test_pulls_pause_while_the_sink_is_behind(side: SinkSide) -> None:
    sink, _ = attach(side)
    assert side.router.service_for("orders") is side.service  # the pull loop asks it
    assert side.pull_delay("orders") == 0.0
    sink.more = False
    assert side.pull_delay("orders") == side.consumer.options.pull_time_delay_when_flow_control
    assert side.pull_delay(side.consumer.retry_topic) == 0.0
    assert side.pull_delay("other") == 0.0


async def test_failed_chunk_is_sent_back_and_what_the_broker_refused_is_offered_again(
        side: SinkSide, monkeypatch: pytest.MonkeyPatch) -> None:
    sink, mqs = attach(side, queues=1)
    monkeypatch.setattr(sink_service_module, "SEND_BACK_FAILED_RETRY_DELAY", 0.01)
    sent: list[int] = []

    async def send_back(msg: MessageExt, delay_level: int) -> bool:
        if msg.queue_offset in (3, 5):
            return False  # the broker did not take these back
        sent.append(msg.queue_offset)
        return True

    monkeypatch.setattr(side.rt, "send_message_back", send_back)
    pull(side, mqs[0], msgs(0, 8))
    _, ack = sink.offers[0]
    ack(False)
    await asyncio.wait_for(_offered(sink, 2), 5)
    assert sorted(sent) == [0, 1, 2, 4, 6, 7]
    again, ack_again = sink.offers[1]
    assert [m.queue_offset for m in again] == [3, 5]
    assert sink.redelivered == [False, True]
    # The offset stops at the first message still held: 3.
    assert side.offset_store.read_memory(mqs[0]) == 3
    ack_again(True)
    assert side.offset_store.read_memory(mqs[0]) == 8
    await side.rt.tasks.aclose()


async def test_the_send_backs_of_failed_chunks_share_one_bound(
        side: SinkSide, monkeypatch: pytest.MonkeyPatch) -> None:
    """A failed batch fails all of its chunks at once: their send-backs together keep at most
    SEND_BACK_PARALLEL requests at the broker, whose send queue sheds what waits too long."""
    sink, mqs = attach(side, queues=3)
    in_flight = peak = 0
    sent: list[tuple[int, int]] = []

    async def send_back(msg: MessageExt, delay_level: int) -> bool:
        nonlocal in_flight, peak
        in_flight += 1
        peak = max(peak, in_flight)
        await asyncio.sleep(0.005)
        in_flight -= 1
        sent.append((msg.queue_id, msg.queue_offset))
        return True

    monkeypatch.setattr(side.rt, "send_message_back", send_back)
    for q in range(3):
        pull(side, mqs[q], msgs(0, 40, queue_id=q))
    for _, ack in list(sink.offers):
        ack(False)
    await wait_until(lambda: all(side.offset_store.read_memory(mqs[q]) == 40 for q in range(3)),
                     10, what="every message sent back and committed")
    assert peak == sink_service_module.SEND_BACK_PARALLEL
    assert sorted(sent) == [(q, o) for q in range(3) for o in range(40)]
    await side.rt.tasks.aclose()


async def test_a_redelivered_chunk_is_written_in_a_batch_of_its_own() -> None:
    """Rows offered again after a failed write sit below newer rows of their queue: in one
    batch with them, the batch's offset range would span rows other batches wrote."""
    write = Writes()
    sink = sink_for(write, batch_rows=100, max_batch_latency=0.05)
    async with running(sink):
        sink.offer(msgs(16, 4), ignore)
        sink.offer(msgs(3, 1), ignore, redelivered=True)
        sink.offer(msgs(20, 4), ignore)
        await sink.flush()
    assert write.rows == [4, 1, 4]


async def test_redelivered_chunks_of_other_queues_share_a_batch() -> None:
    """A failed batch offered again chunk by chunk (broadcasting, or a broker that took
    nothing back) is not one write per pull: chunks of different queues share a batch, two of
    one queue do not (they could be of two failed batches around a written one)."""
    write = Writes()
    sink = sink_for(write, batch_rows=1000, max_batch_latency=0.05)
    async with running(sink):
        for q in range(8):
            sink.offer(msgs(0, 50, queue_id=q), ignore, redelivered=True)
        sink.offer(msgs(100, 50, queue_id=0), ignore, redelivered=True)  # queue 0 again
        await sink.flush()
    assert write.rows == [400, 50]


async def test_an_overwrite_of_each_batchs_offset_ranges_keeps_every_row(
        side: SinkSide, monkeypatch: pytest.MonkeyPatch) -> None:
    """The module docs' idempotent write (Delta ``replaceWhere`` over ``info.offset_ranges``),
    on a dict: a failed batch whose message the broker did not take back is offered again
    while newer rows of its queue wait in the open batch, and no written row is lost."""
    monkeypatch.setattr(sink_service_module, "SEND_BACK_FAILED_RETRY_DELAY", 0.05)
    table: dict[int, bytes] = {}
    calls = 0

    def write(df: Any, info: BatchInfo) -> None:
        nonlocal calls
        calls += 1
        if calls == 1:
            raise RuntimeError("storage hiccup")
        for _mq, (lo, hi) in info.offset_ranges.items():
            for off in [o for o in table if lo <= o <= hi]:
                del table[off]
        for off, body in zip(df.column("queue_offset").to_pylist(),
                             df.column("body").to_pylist(), strict=True):
            table[off] = body

    async def send_back(msg: MessageExt, delay_level: int) -> bool:
        return msg.queue_offset != 3  # the broker does not take offset 3 back

    monkeypatch.setattr(side.rt, "send_message_back", send_back)
    sink = SparkSink(None, write, create_dataframe=lambda t: t, batch_rows=8,
                     max_batch_latency=0.2, write_retries=0)
    side.consumer.subscribe("orders", sink=sink)
    mq = MessageQueue("orders", "broker-a", 0)
    side.consumer.process_queues[mq] = ProcessQueue()
    rebalanced(side, "orders")
    await side.service.start_sinks()
    try:
        pull_stored(side, mq, stored(mq, 0, 8))   # batch 1 fails; all but 3 handed back
        await asyncio.sleep(0.02)
        pull_stored(side, mq, stored(mq, 8, 8))   # batch 2 is written
        await asyncio.sleep(0.01)
        pull_stored(side, mq, stored(mq, 16, 4))  # opens batch 3; 3 comes again meanwhile
        async with asyncio.timeout(5):
            while side.offset_store.read_memory(mq) != 20:
                await asyncio.sleep(0.01)
    finally:
        await sink.aclose()
        await side.rt.tasks.aclose()
    assert sorted(table) == [3, *range(8, 20)]


async def test_a_sink_whose_offer_takes_two_arguments_gets_its_chunk_again(
        side: SinkSide, monkeypatch: pytest.MonkeyPatch) -> None:
    """A sink (or a wrapper of its offer) from before the ``redelivered`` flag: the chunk the
    broker did not take back is offered again in the two-argument form, not lost to a
    TypeError that would leave it cached and its queue's offset stuck below it."""

    class TwoArgSink(FakeSink):
        def offer(self, batch: list[MessageExt],  # type: ignore[override]
                  ack: Callable[[bool], None]) -> None:
            self.offers.append((batch, ack))

    sink, mqs = attach(side, queues=1, sink=TwoArgSink())
    mq = mqs[0]
    monkeypatch.setattr(sink_service_module, "SEND_BACK_FAILED_RETRY_DELAY", 0.01)

    async def refuse(msg: MessageExt, delay_level: int) -> bool:
        return False

    monkeypatch.setattr(side.rt, "send_message_back", refuse)
    pull(side, mq, msgs(0, 8))
    sink.offers[0][1](False)
    await asyncio.wait_for(_offered(sink, 2), 5)
    sink.offers[1][1](True)
    assert side.offset_store.read_memory(mq) == 8
    await side.rt.tasks.aclose()


class _RaisesOnce(FakeSink):
    """A sink whose first offer raises ``error``; it takes the offers after that."""

    def __init__(self, error: Exception) -> None:
        super().__init__()
        self.error: Exception | None = error

    def offer(self, batch: list[MessageExt], ack: Callable[[bool], None], *,
              redelivered: bool = False) -> None:
        if self.error is not None:
            error, self.error = self.error, None
            raise error
        super().offer(batch, ack, redelivered=redelivered)


@pytest.mark.parametrize(("error", "event"), [
    # A bug in a sink's offer: logged, the chunk offered again after a pause; the pull loop
    # that offered it is not ended by it.
    (KeyError("a bug in the sink"), "sink.offer_failed"),
    # A sink closed while its consumer runs (its own aclose() called, or shared with a
    # consumer that stopped; then started again) refused the chunk, which then stayed
    # cached for good in silence: its queue's offset held, its pulls blocked at the span
    # limit.
    (SinkClosedError("the Spark sink is closed"), "sink.closed_while_consuming"),
])
async def test_a_chunk_the_sink_refused_is_offered_again_and_the_pull_goes_on(
        error: Exception, event: str, side: SinkSide, monkeypatch: pytest.MonkeyPatch) -> None:
    sink, mqs = attach(side, queues=1, sink=_RaisesOnce(error))
    mq = mqs[0]
    monkeypatch.setattr(sink_service_module, "SEND_BACK_FAILED_RETRY_DELAY", 0.01)
    from structlog.testing import capture_logs

    with capture_logs() as logs:
        pull(side, mq, msgs(0, 8))  # returns: the error does not reach the pull loop
        await asyncio.wait_for(_offered(sink, 1), 5)
    assert [e["event"] for e in logs if e["log_level"] == "error"] == [event]
    # Offered again out of pull order (later chunks may be written meanwhile): as a
    # redelivered chunk, never in a batch of chunks in pull order, whose offset range would
    # then span rows of batches written between.
    assert sink.redelivered == [True]
    sink.offers[0][1](True)
    assert side.offset_store.read_memory(mq) == 8
    await side.rt.tasks.aclose()


async def _offered(sink: FakeSink, n: int) -> None:
    while len(sink.offers) < n:
        await asyncio.sleep(0.005)


# ---------------------------------------------------------------------------- stored chunks


def stored(mq: MessageQueue, start: int, n: int, *, max_offset: int = -1,
           body: bytes = b"0123456789") -> StoredChunk:
    """A pull of ``mq`` kept undecoded, as the pull loop keeps a sink subscription's pulls."""
    data = b"".join(
        encode_stored_message(MessageExt(
            topic=mq.topic, body=body, queue_id=mq.queue_id, queue_offset=i,
            properties={"UNIQ_KEY": f"K{i:08d}"}, born_host="127.0.0.1:1",
            store_host="127.0.0.1:10911"))
        for i in range(start, start + n))
    return StoredChunk(data, mq.topic, mq.broker_name, mq.queue_id, start, start + n - 1, n,
                       len(body) * n, {"MAX_OFFSET": str(max_offset)}, max_offset)


def pull_stored(side: SinkSide, mq: MessageQueue, chunk: StoredChunk) -> None:
    pq = side.consumer.process_queues[mq]
    side.router.submit_stored(chunk, pq, mq, pq.put_chunk(chunk))


async def test_stored_chunks_are_offered_whole_and_committed_on_ack(side: SinkSide) -> None:
    sink, mqs = attach(side, queues=2)
    first, second = stored(mqs[0], 0, 32, max_offset=64), stored(mqs[0], 32, 32, max_offset=64)
    pull_stored(side, mqs[0], first)
    assert sink.caught == 0  # 32 more on the broker
    pull_stored(side, mqs[0], second)
    assert sink.caught == 1  # queue 1 never delivered: it had nothing
    assert [chunk for chunk, _ in sink.offers] == [first, second]
    pq = side.consumer.process_queues[mqs[0]]
    assert (pq.msg_count, pq.msg_size) == (64, 640)
    sink.offers[1][1](True)
    assert side.offset_store.read_memory(mqs[0]) == 0  # the first chunk still holds the offset
    sink.offers[0][1](True)
    assert side.offset_store.read_memory(mqs[0]) == 64
    assert pq.msg_count == 0


async def test_a_failed_stored_chunk_is_sent_back_message_by_message(
        side: SinkSide, monkeypatch: pytest.MonkeyPatch) -> None:
    sink, mqs = attach(side, queues=1)
    monkeypatch.setattr(sink_service_module, "SEND_BACK_FAILED_RETRY_DELAY", 0.01)
    sent: list[tuple[int, str]] = []

    async def send_back(msg: MessageExt, delay_level: int) -> bool:
        if msg.queue_offset == 4:
            return False
        sent.append((msg.queue_offset, msg.broker_name))
        return True

    monkeypatch.setattr(side.rt, "send_message_back", send_back)
    pull_stored(side, mqs[0], stored(mqs[0], 0, 8))
    pull_stored(side, mqs[0], stored(mqs[0], 8, 8))
    sink.offers[0][1](False)
    await asyncio.wait_for(_offered(sink, 3), 5)
    assert sorted(sent) == [(i, "broker-a") for i in (0, 1, 2, 3, 5, 6, 7)]
    again, ack_again = sink.offers[2]
    assert isinstance(again, list) and [m.queue_offset for m in again] == [4]
    assert side.offset_store.read_memory(mqs[0]) == 4
    ack_again(True)
    assert side.offset_store.read_memory(mqs[0]) == 8  # the second chunk is still cached
    sink.offers[1][1](True)
    assert side.offset_store.read_memory(mqs[0]) == 16
    await side.rt.tasks.aclose()


async def test_a_batch_of_stored_chunks_and_messages_converts_in_pull_order() -> None:
    writes = Writes()
    tables: list[Any] = []
    sink = SparkSink(None, writes, batch_rows=20, max_batch_latency=30.0,
                     create_dataframe=lambda table: tables.append(table) or table)
    mq = MessageQueue("orders", "broker-a", 0)
    owner = TaskOwner("test")
    await sink.start(owner)
    sink.offer(stored(mq, 0, 8), ignore)
    sink.offer(msgs(8, 4), ignore)  # a pull that had to be decoded (say, compressed bodies)
    sink.offer(stored(mq, 12, 8), ignore)
    await sink.flush()
    await sink.aclose()
    await owner.aclose()
    assert writes.rows == [20]
    assert tables[0].column("queue_offset").to_pylist() == list(range(20))
    assert tables[0].column("msg_id").to_pylist() == [f"K{i:08d}" for i in range(20)]


@pytest.mark.parametrize("path", ["messages", "stored"])
def test_a_decoded_value_column_keeps_the_tables_even_slices(path: str) -> None:
    """Spark makes one partition per Arrow slice, cut wherever any column's slice ends: the
    ``value`` column decoded from msgpack bodies is sliced as the other columns are."""
    import msgpack
    from pyspark.sql.types import LongType, StructField, StructType

    from rmq_async.sinks.spark import _Batch, _Job

    mq = MessageQueue("orders", "broker-a", 0)
    sink = SparkSink(None, lambda df, info: None, create_dataframe=lambda t: t,
                     value_format="msgpack",
                     value_schema=StructType([StructField("id", LongType())]))
    body = msgpack.packb({"id": 7})
    batch = _Batch(1)
    if path == "messages":
        batch.chunks = [msgs(0, 25_000, body=body)]
    else:
        batch.chunks = [stored(mq, i, 32, body=body) for i in range(0, 25_024, 32)]
    batch.rows = sum(len(c) for c in batch.chunks)
    job = _Job(batch)
    sink._convert(job)
    assert job.table is not None
    sizes = [b.num_rows for b in job.table.to_batches(max_chunksize=10_000)]
    assert len(sizes) == 3 and max(sizes) - min(sizes) <= 32, sizes  # whole pulls of 32
    assert job.table.column("value").to_pylist()[:2] == [{"id": 7}, {"id": 7}]


def test_a_msgpack_body_without_a_non_nullable_field_has_it_null_not_invalid() -> None:
    """pyarrow builds a null into a child the schema marks non-nullable (and Spark trusts the
    flag: it read such a value as 0). Every field of ``value`` is nullable now, as Spark's
    ``from_json`` makes them on the JSON path."""
    import msgpack
    from pyspark.sql.types import ArrayType, LongType, StringType, StructField, StructType

    from rmq_async.sinks.spark import _Batch, _Job

    schema = StructType([
        StructField("id", LongType(), nullable=False),
        StructField("inner", StructType([StructField("n", LongType(), nullable=False)]),
                    nullable=False),
        StructField("tags", ArrayType(StringType(), containsNull=False), nullable=False),
    ])
    sink = SparkSink(None, lambda df, info: None, create_dataframe=lambda t: t,
                     value_format="msgpack", value_schema=schema)
    batch = _Batch(1)
    batch.chunks = [msgs(0, 1, body=msgpack.packb({"tags": ["a"], "inner": {}}))
                    + msgs(1, 1, body=msgpack.packb({"id": 3, "inner": {"n": 4},
                                                     "tags": ["b"]}))]
    batch.rows = 2
    job = _Job(batch)
    sink._convert(job)
    assert job.table is not None
    value = job.table.column("value").combine_chunks()
    value.validate(full=True)
    assert value.to_pylist() == [{"id": None, "inner": {"n": None}, "tags": ["a"]},
                                 {"id": 3, "inner": {"n": 4}, "tags": ["b"]}]
    value_type = job.table.schema.field("value").type
    assert all(f.nullable for f in value_type)
    assert all(f.nullable for f in value_type.field("inner").type)
    assert value_type.field("tags").type.value_field.nullable


async def test_a_queue_taken_again_starts_a_new_batch() -> None:
    """Rows 100-199 of a queue wait in the open batch when the queue is given up; another
    consumer stores 200-299 and commits; the queue comes back at 300. One batch of 100-199 and
    300-331 would cover 200-299, and an overwrite of its range would delete them."""
    infos: list[BatchInfo] = []
    sink = SparkSink(None, lambda df, info: infos.append(info), create_dataframe=lambda t: t,
                     batch_rows=1000, max_batch_latency=60.0, retry_backoff=0.0)
    mq = MessageQueue("orders", "broker-a", 0)
    other = MessageQueue("orders", "broker-a", 1)
    async with running(sink):
        sink.offer(msgs(100, 32), ignore)
        sink.offer(msgs(132, 68), ignore)
        sink.queue_reassigned(other)  # holds no row of that queue: the batch stays open
        sink.offer(msgs(300, 32), ignore)
        await sink.flush()
        assert [i.offset_ranges for i in infos] == [{mq: (100, 331)}]  # one assignment
        infos.clear()
        sink.offer(msgs(400, 32), ignore)
        sink.queue_reassigned(mq)
        sink.offer(msgs(600, 32), ignore)
        await sink.flush()
    assert [i.offset_ranges for i in infos] == [{mq: (400, 431)}, {mq: (600, 631)}]


async def test_the_consumer_tells_the_sink_of_a_queue_taken_again(side: SinkSide) -> None:
    """The sink service tells a new assignment (a new ProcessQueue of the queue) from the
    one before and tells the sink before offering its first chunk."""
    told: list[tuple[MessageQueue, int]] = []

    class Told(FakeSink):
        def queue_reassigned(self, mq: MessageQueue) -> None:
            told.append((mq, len(self.offers)))

    _, mqs = attach(side, queues=2, sink=Told())
    pull(side, mqs[0], msgs(100, 32))
    pull(side, mqs[1], msgs(0, 32, queue_id=1))
    pull(side, mqs[0], msgs(132, 32))
    assert told == []
    side.consumer.process_queues.pop(mqs[0]).dropped = True  # given up, its chunks unwritten
    side.consumer.process_queues[mqs[0]] = ProcessQueue()  # and taken again
    pull(side, mqs[0], msgs(300, 32))
    pull(side, mqs[0], msgs(332, 32))
    assert told == [(mqs[0], 3)]  # once, before the new assignment's first chunk


async def test_a_sink_without_the_reassignment_hook_takes_the_chunks_all_the_same() -> None:
    other = SinkSide()
    plain, mqs = attach(other, queues=1)
    assert not hasattr(plain, "queue_reassigned")
    pull(other, mqs[0], msgs(0, 32))
    other.consumer.process_queues.pop(mqs[0]).dropped = True
    other.consumer.process_queues[mqs[0]] = ProcessQueue()
    pull(other, mqs[0], msgs(100, 32))
    assert [batch[0].queue_offset for batch, _ in plain.offers] == [0, 100]


async def test_flushes_right_after_start_do_not_wait_for_the_writer_loop_for_good() -> None:
    """A flush before the writer loop's first step writes the batch itself; the loop then
    takes the writer lock and keeps it. A second flush queued for that lock waited forever."""
    write = Writes()
    sink = sink_for(write, batch_rows=1000, max_batch_latency=60.0)
    async with running(sink):
        async with asyncio.timeout(10):
            sink.offer(msgs(0, 32), ignore)
            await sink.flush()  # before the loop has run: written here
            sink.offer(msgs(32, 32), ignore)
            await sink.flush()  # the loop is starting: written by it
            sink.offer(msgs(64, 32), ignore)
            await sink.flush()
    assert write.rows == [32, 32, 32]


async def test_a_conversion_ahead_ends_before_the_writer_it_belongs_to() -> None:
    """Cancelled while batch 2 is converted ahead of its write, and cancelled again while it
    waits for that conversion, the writer still waits for it (its thread cannot be
    interrupted): no conversion task or thread outlives the writer's owner."""
    write = Writes()
    write.gate.clear()
    converting = threading.Event()
    converted = threading.Event()

    def create(table: Any) -> Any:
        if table.column("queue_offset")[0].as_py() == 100:
            converting.set()
            time.sleep(2.5)  # past the owner's second cancellation (1 s after the first)
            converted.set()
        return table

    sink = SparkSink(None, write, create_dataframe=create, batch_rows=100,
                     max_batch_latency=30.0, retry_backoff=0.0)
    owner = TaskOwner("sink")
    await sink.start(owner)
    sink.offer(msgs(0, 100), ignore)  # batch 1: its write waits for the gate
    await write.wait_entered()
    sink.offer(msgs(100, 100), ignore)  # batch 2: converted ahead, slowly
    assert await asyncio.to_thread(converting.wait, 10)
    closing = asyncio.ensure_future(owner.aclose())
    await asyncio.sleep(0.2)
    write.gate.set()  # write 1 ends; the writer, cancelled, now waits for the conversion
    await closing
    assert converted.is_set(), "the owner was done while the conversion still ran"
    assert not [t for t in asyncio.all_tasks()
                if "convert_next" in getattr(t.get_coro(), "__qualname__", "")]
    await sink.aclose()

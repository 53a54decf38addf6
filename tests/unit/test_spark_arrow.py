"""Spark sink without Spark: Arrow conversion exactness and the batching / ack rules.

The batching tests inject ``create_dataframe`` (the Arrow table itself stands in for the
DataFrame); everything against real PySpark lives in ``tests/spark/``.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import json
import threading
import time
from collections.abc import Callable, Iterator, MutableMapping
from typing import Any

import msgpack  # type: ignore[import-untyped, unused-ignore]
import pyarrow as pa
import pytest
import structlog
from hypothesis import given, settings
from hypothesis import strategies as st

from rmq_async.protocol.types import MessageExt, MessageQueue
from rmq_async.sinks import MessageSink, SinkClosedError
from rmq_async.sinks._arrow import (
    ARROW_SCHEMA,
    chunk_offset_ranges,
    decode_values,
    messages_to_arrow,
    offset_ranges,
)
from rmq_async.sinks.spark import BatchInfo, SparkSink
from tests.helpers import NotAnException

LogList = list[MutableMapping[str, Any]]

UTC = dt.UTC


def make_msg(
    i: int,
    *,
    topic: str = "orders",
    broker: str = "broker-a",
    queue_id: int | None = None,
    body: bytes | None = None,
    tags: str | None = "created",
    keys: str | None = None,
    extra: dict[str, str] | None = None,
    uniq: bool = True,
) -> MessageExt:
    props: dict[str, str] = {}
    if uniq:
        props["UNIQ_KEY"] = f"AC1100{i:026X}"
    if tags is not None:
        props["TAGS"] = tags
    if keys is not None:
        props["KEYS"] = keys
    props.update(extra or {})
    return MessageExt(
        topic=topic,
        body=body if body is not None else f"body-{i}".encode(),
        queue_id=i % 4 if queue_id is None else queue_id,
        queue_offset=1000 + i,
        properties=props,
        born_timestamp=1_700_000_000_123 + i,
        born_host=f"10.0.0.{i % 250}:{40000 + i % 1000}",
        store_timestamp=1_700_000_000_456 + i,
        store_host="10.0.1.7:10911",
        reconsume_times=i % 3,
        offset_msg_id=f"0A0001070000{i:020X}",
        broker_name=broker,
    )


def expected_row(m: MessageExt) -> dict[str, Any]:
    """The row a message must become, derived from MessageExt's own accessors."""
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
        "properties": list(m.properties.items()),
        "born_timestamp": dt.datetime.fromtimestamp(m.born_timestamp // 1000, UTC)
        + dt.timedelta(milliseconds=m.born_timestamp % 1000),
        "store_timestamp": dt.datetime.fromtimestamp(m.store_timestamp // 1000, UTC)
        + dt.timedelta(milliseconds=m.store_timestamp % 1000),
        "born_host": m.born_host,
        "store_host": m.store_host,
        "reconsume_times": m.reconsume_times,
    }


# ---------------------------------------------------------------------- Arrow conversion


def test_schema_columns_and_types() -> None:
    assert ARROW_SCHEMA.names == [
        "topic", "broker_name", "queue_id", "queue_offset", "msg_id", "offset_msg_id", "tags",
        "keys", "body", "properties", "born_timestamp", "store_timestamp", "born_host",
        "store_host", "reconsume_times",
    ]  # fmt: skip
    assert ARROW_SCHEMA.field("queue_id").type == pa.int32()
    assert ARROW_SCHEMA.field("queue_offset").type == pa.int64()
    assert ARROW_SCHEMA.field("born_timestamp").type == pa.timestamp("ms", tz="UTC")
    assert pa.types.is_list(ARROW_SCHEMA.field("keys").type)
    assert pa.types.is_map(ARROW_SCHEMA.field("properties").type)
    assert ARROW_SCHEMA.field("body").type == pa.binary()
    assert [f.name for f in ARROW_SCHEMA if f.nullable] == ["tags"]


def test_conversion_is_exact_for_awkward_messages() -> None:
    msgs = [
        make_msg(0, tags="créé", keys="ключ 鍵", extra={"städte": "Zürich ✓", "emoji": "🚀🎉"}),
        make_msg(1, body=b"", tags=None, keys=None),
        make_msg(2, body=bytes(range(256)) * 9, keys="only"),
        make_msg(3, uniq=False, tags="", extra={"": "empty name", "v": ""}),
        make_msg(4, topic="%RETRY%grp", broker="broker-b", queue_id=0, keys="a b c d e"),
        make_msg(5, body=b"\x00" * 1024, extra={"nul": "a\x00b", "newline": "l1\nl2"}),
    ]
    table = messages_to_arrow(msgs)
    assert table.schema == ARROW_SCHEMA
    assert table.to_pylist() == [expected_row(m) for m in msgs]
    # no UNIQ_KEY: msg_id falls back to the offset message id
    assert table.column("msg_id")[3].as_py() == msgs[3].offset_msg_id
    assert table.column("tags")[1].as_py() is None
    assert table.column("keys")[1].as_py() == []
    assert table.column("body")[1].as_py() == b""


def test_timestamps_are_utc_milliseconds() -> None:
    msg = make_msg(7)
    msg.born_timestamp = 1_717_171_717_171
    msg.store_timestamp = 0
    table = messages_to_arrow([msg])
    assert table.column("born_timestamp").cast(pa.int64()).to_pylist() == [1_717_171_717_171]
    assert table.column("born_timestamp")[0].as_py() == dt.datetime(
        2024, 5, 31, 16, 8, 37, 171000, tzinfo=UTC
    )
    assert table.column("store_timestamp")[0].as_py() == dt.datetime(1970, 1, 1, tzinfo=UTC)


def test_keys_with_empty_tokens_drop_them() -> None:
    # double, leading and trailing separators, and an empty KEYS property
    msgs = [make_msg(0, keys="a  b "), make_msg(1, keys=" x"), make_msg(2, keys=""),
            make_msg(3, keys=None), make_msg(4, keys="p q")]  # fmt: skip
    keys = messages_to_arrow(msgs).column("keys").to_pylist()
    assert keys == [["a", "b"], ["x"], [], [], ["p", "q"]]
    assert keys == [m.keys for m in msgs]


def test_properties_keep_order_and_all_entries() -> None:
    msg = make_msg(0, keys="k1 k2", extra={"z": "1", "a": "2", "m": "3"})
    row = messages_to_arrow([msg]).column("properties")[0].as_py()
    assert row == list(msg.properties.items())
    assert [k for k, _ in row] == ["UNIQ_KEY", "TAGS", "KEYS", "z", "a", "m"]


def test_empty_batch() -> None:
    table = messages_to_arrow([])
    assert table.num_rows == 0
    assert table.schema == ARROW_SCHEMA


_text = st.text(st.characters(codec="utf-8"), max_size=12)


@st.composite
def messages(draw: st.DrawFn) -> MessageExt:
    props = draw(st.dictionaries(_text, _text, max_size=5))
    if draw(st.booleans()):
        props["TAGS"] = draw(_text)
    if draw(st.booleans()):
        props["KEYS"] = draw(st.text(st.sampled_from("ab é "), max_size=10))
    return MessageExt(
        topic=draw(st.text(min_size=1, max_size=8)),
        body=draw(st.binary(max_size=64)),
        queue_id=draw(st.integers(0, 2**31 - 1)),
        queue_offset=draw(st.integers(0, 2**63 - 1)),
        properties=props,
        born_timestamp=draw(st.integers(0, 4_102_444_800_000)),
        store_timestamp=draw(st.integers(0, 4_102_444_800_000)),
        born_host=draw(_text),
        store_host=draw(_text),
        reconsume_times=draw(st.integers(0, 16)),
        offset_msg_id=draw(_text),
        broker_name=draw(_text),
    )


@settings(max_examples=60, deadline=None)
@given(st.lists(messages(), max_size=20), st.integers(1, 8))
def test_conversion_matches_messages(msgs: list[MessageExt], chunk_rows: int) -> None:
    table = messages_to_arrow(msgs, chunk_rows=chunk_rows)
    assert table.schema == ARROW_SCHEMA
    assert table.to_pylist() == [expected_row(m) for m in msgs]


def test_conversion_in_slices() -> None:
    msgs = [make_msg(i, keys="a  b" if i == 5 else f"k{i}") for i in range(25)]
    table = messages_to_arrow(msgs, chunk_rows=10)
    # The fewest slices of at most 10 rows, of even sizes (one Spark partition each).
    assert [len(c) for c in table.column("body").chunks] == [8, 8, 9]
    assert table.equals(messages_to_arrow(msgs))
    with pytest.raises(ValueError, match="chunk_rows"):
        messages_to_arrow(msgs, chunk_rows=0)


def test_conversion_speed_is_reported() -> None:
    # Not a benchmark gate: makes sure a realistic batch converts and prints the rate.
    msgs = [make_msg(i, body=bytes(1024), keys=f"k{i} o{i}") for i in range(20_000)]
    started = time.perf_counter()
    table = messages_to_arrow(msgs)
    seconds = time.perf_counter() - started
    assert table.num_rows == len(msgs)
    print(f"messages_to_arrow: {len(msgs) / seconds:,.0f} rows/s (1 KiB bodies)")


def test_offset_ranges() -> None:
    msgs = [make_msg(i, queue_id=i % 2) for i in (5, 1, 9, 2, 8, 4)]
    msgs.append(make_msg(3, broker="broker-b", queue_id=1))
    assert offset_ranges(msgs) == {
        MessageQueue("orders", "broker-a", 1): (1001, 1009),
        MessageQueue("orders", "broker-a", 0): (1002, 1008),
        MessageQueue("orders", "broker-b", 1): (1003, 1003),
    }


def test_chunk_offset_ranges_equal_the_ranges_of_all_messages() -> None:
    one_queue = [make_msg(i, queue_id=3) for i in (7, 5, 6)]  # a chunk need not be sorted
    later = [make_msg(i, queue_id=3) for i in (20, 21)]
    mixed = [make_msg(4, queue_id=3), make_msg(2, queue_id=0), make_msg(9, broker="broker-b")]
    other_topic = [make_msg(1, queue_id=3)]
    other_topic[0].topic = "refunds"
    chunks = [one_queue, [], later, mixed, other_topic]
    expected = {
        MessageQueue("orders", "broker-a", 3): (1004, 1021),
        MessageQueue("orders", "broker-a", 0): (1002, 1002),
        MessageQueue("orders", "broker-b", 1): (1009, 1009),  # queue_id 9 % 4
        MessageQueue("refunds", "broker-a", 3): (1001, 1001),
    }
    assert chunk_offset_ranges(chunks) == expected
    assert offset_ranges([m for c in chunks for m in c]) == expected


# ---------------------------------------------------------------------- body decoding

_VALUE_TYPE = pa.struct(
    [
        pa.field("id", pa.int64()),
        pa.field("name", pa.string()),
        pa.field("tags", pa.list_(pa.string())),
        pa.field("at", pa.timestamp("us", tz="UTC")),
    ]
)


def test_decode_msgpack_rows_and_failures() -> None:
    at = dt.datetime(2024, 2, 29, 12, 0, 1, 500000, tzinfo=UTC)
    bodies = [
        msgpack.packb({"id": 1, "name": "ünï", "tags": ["x"],
                       "at": msgpack.Timestamp.from_datetime(at)}),
        msgpack.packb({"id": 2, "extra": 1}),  # unknown field ignored, missing ones null
        b"\xc1",  # never-used msgpack byte: malformed
        msgpack.packb([1, 2]),  # not a map
        msgpack.packb({"id": "not a number"}),  # does not fit the type
        b"",
        msgpack.packb({"id": 3, "name": None}),
    ]  # fmt: skip
    values = decode_values(bodies, "msgpack", _VALUE_TYPE)
    assert values.type == _VALUE_TYPE
    assert values.to_pylist() == [
        {"id": 1, "name": "ünï", "tags": ["x"], "at": at},
        {"id": 2, "name": None, "tags": None, "at": None},
        None,
        None,
        None,
        None,
        {"id": 3, "name": None, "tags": None, "at": None},
    ]


def test_decode_json_rows_and_failures() -> None:
    bodies = [
        json.dumps({"id": 10, "name": "a", "tags": ["p", "q"]}).encode(),
        b"{not json",
        b"\xff\xfe\x00",
        b"42",
        json.dumps({"id": 2**70}).encode(),  # overflows int64
        json.dumps({"id": 11}).encode(),
    ]
    values = decode_values(bodies, "json", _VALUE_TYPE).to_pylist()
    assert values == [
        {"id": 10, "name": "a", "tags": ["p", "q"], "at": None},
        None,
        None,
        None,
        None,
        {"id": 11, "name": None, "tags": None, "at": None},
    ]


def test_decode_isolates_many_bad_rows() -> None:
    bodies = [json.dumps({"id": i if i % 7 else "bad"}).encode() for i in range(1000)]
    values = decode_values(bodies, "json", _VALUE_TYPE).to_pylist()
    assert [v["id"] if v else None for v in values] == [i if i % 7 else None for i in range(1000)]


def test_decode_rejects_unknown_format() -> None:
    with pytest.raises(ValueError, match="value_format"):
        decode_values([b"{}"], "xml", _VALUE_TYPE)  # type: ignore[arg-type]


# ---------------------------------------------------------------------- batching and acks


class Recorder:
    """A write function that records every call, optionally failing or blocking on a gate."""

    def __init__(self, fail: Callable[[int, BatchInfo], bool] | None = None) -> None:
        self.calls: list[tuple[pa.Table, BatchInfo]] = []
        self.written: list[tuple[pa.Table, BatchInfo]] = []
        self.fail = fail
        self.gate: threading.Event | None = None
        self.entered = threading.Semaphore(0)
        self.lock = threading.Lock()

    def __call__(self, df: Any, info: BatchInfo) -> None:
        with self.lock:
            self.calls.append((df, info))
            call_no = len(self.calls)
        self.entered.release()
        if self.gate is not None:
            assert self.gate.wait(10), "test gate never opened"
        if self.fail is not None and self.fail(call_no, info):
            raise RuntimeError(f"write {call_no} failed")
        with self.lock:
            self.written.append((df, info))

    async def wait_entered(self) -> None:
        """Wait (off the loop) until a write call has started."""
        ok = await asyncio.to_thread(self.entered.acquire, True, 10)
        assert ok, "write was never called"


class Acks:
    def __init__(self) -> None:
        self.results: dict[int, list[bool]] = {}

    def cb(self, n: int) -> Callable[[bool], None]:
        self.results[n] = []
        return self.results[n].append

    def outcome(self, n: int) -> bool | None:
        got = self.results[n]
        assert len(got) <= 1, f"offer {n} acknowledged {len(got)} times"
        return got[0] if got else None


def make_sink(write: Recorder, **kw: Any) -> SparkSink:
    opts: dict[str, Any] = {"batch_rows": 100, "max_batch_latency": 30.0, "retry_backoff": 0.0}
    opts.update(kw)
    return SparkSink(None, write, create_dataframe=lambda table: table, **opts)


def chunk(start: int, n: int, **kw: Any) -> list[MessageExt]:
    return [make_msg(i, **kw) for i in range(start, start + n)]


@pytest.fixture
def logs() -> Iterator[LogList]:
    with structlog.testing.capture_logs() as captured:
        yield captured


async def test_batch_closes_before_a_chunk_that_would_pass_the_row_limit() -> None:
    write = Recorder()
    sink = make_sink(write, batch_rows=100)
    acks = Acks()
    sink.offer(chunk(0, 60), acks.cb(0))
    sink.offer(chunk(60, 60), acks.cb(1))  # 120 > 100: the first 60 close, these open the next
    assert not sink.want_more()  # a closed batch is waiting for the (not yet running) writer
    sink.offer(chunk(120, 40), acks.cb(2))  # 100: closes at the limit, chunks whole
    sink.offer(chunk(160, 150), acks.cb(3))  # larger than the limit alone: a batch of its own
    sink.offer(chunk(310, 10), acks.cb(4))
    assert sink.backlog_rows == 320
    await sink.aclose()
    assert [info.row_count for _, info in write.written] == [60, 100, 150, 10]
    assert write.written[0][0].column("queue_offset").to_pylist() == [1000 + i for i in range(60)]
    assert write.written[1][0].column("queue_offset").to_pylist() == [
        1060 + i for i in range(100)
    ]
    assert [acks.outcome(n) for n in range(5)] == [True] * 5
    assert sink.backlog_rows == 0
    assert sink.want_more()


async def test_rows_pulled_again_after_a_queue_is_taken_back_go_to_a_batch_of_their_own(
) -> None:
    # A queue given up and taken again while its chunks sat in the open batch is pulled again
    # from its committed offset: those rows joined the same batch, which then held each of
    # them twice (a MERGE on the message's coordinates inserts both).
    write = Recorder()
    sink = make_sink(write, batch_rows=100)
    acks = Acks()
    sink.offer(chunk(0, 10, queue_id=1), acks.cb(0))  # offsets 1000..1009
    sink.offer(chunk(0, 5, queue_id=2), acks.cb(1))
    sink.offer(chunk(10, 10, queue_id=1), acks.cb(2))  # 1010..1019: in pull order, same batch
    sink.offer(chunk(0, 10, queue_id=1), acks.cb(3))  # taken back: from 1000 again
    sink.offer(chunk(5, 5, queue_id=2), acks.cb(4))
    await sink.aclose()
    assert [info.row_count for _, info in write.written] == [25, 15]
    for table, _ in write.written:
        rows = list(zip(table.column("queue_id").to_pylist(),
                        table.column("queue_offset").to_pylist(), strict=True))
        assert len(rows) == len(set(rows))
    assert [acks.outcome(n) for n in range(5)] == [True] * 5


async def test_a_list_of_several_queues_is_checked_queue_by_queue() -> None:
    # Code other than the consumer may offer one list mixing queues: each queue's offsets
    # rising is pull order, whatever the lowest offset of the whole list.
    write = Recorder()
    sink = make_sink(write, batch_rows=100)
    acks = Acks()
    sink.offer(chunk(0, 10, queue_id=1), acks.cb(0))  # queue 1: 1000..1009
    mixed = [make_msg(i, queue_id=1) for i in range(10, 15)] + chunk(0, 5, queue_id=2)
    sink.offer(mixed, acks.cb(1))  # queue 1 goes on at 1010; queue 2 starts at 1000
    sink.offer(chunk(5, 5, queue_id=1), acks.cb(2))  # queue 1 from 1005 again: a new batch
    await sink.aclose()
    assert [info.row_count for _, info in write.written] == [20, 5]


async def test_batch_closes_at_byte_limit() -> None:
    write = Recorder()
    sink = make_sink(write, batch_rows=10_000, batch_bytes=4096)
    acks = Acks()
    for n in range(5):
        sink.offer(chunk(n * 2, 2, body=bytes(1000)), acks.cb(n))
    await sink.aclose()
    # 4,000 bytes, then a chunk that would make 6,000: closed before it, so at most 4,096.
    assert [(info.row_count, info.bytes) for _, info in write.written] == [
        (4, 4000), (4, 4000), (2, 2000)
    ]


async def test_batch_closes_at_latency_without_flush() -> None:
    write = Recorder()
    sink = make_sink(write, batch_rows=1_000_000, max_batch_latency=0.2)
    acks = Acks()
    async with asyncio.TaskGroup() as tg:
        await sink.start(tg)
        started = time.monotonic()
        sink.offer(chunk(0, 3), acks.cb(0))
        await write.wait_entered()
        waited = time.monotonic() - started
        await sink.aclose()
    assert 0.2 <= waited < 2.0
    assert [info.row_count for _, info in write.written] == [3]
    assert acks.outcome(0) is True


async def test_batch_larger_than_flow_control_does_not_deadlock() -> None:
    # The consumer never offers more than 50 rows (its flow control) while batch_rows is
    # 1000: every batch is closed by the latency limit and acknowledged.
    write = Recorder()
    sink = make_sink(write, batch_rows=1000, max_batch_latency=0.05)
    acks = Acks()
    async with asyncio.TaskGroup() as tg:
        await sink.start(tg)
        for n in range(4):
            done = asyncio.Event()
            got: list[bool] = []

            def ack(ok: bool, got: list[bool] = got, done: asyncio.Event = done) -> None:
                got.append(ok)
                done.set()

            sink.offer(chunk(n * 50, 50), ack)
            async with asyncio.timeout(5):
                await done.wait()
            assert got == [True]
            acks.results[n] = got
        await sink.aclose()
    assert [info.row_count for _, info in write.written] == [50, 50, 50, 50]


async def test_open_batch_keeps_filling_while_writer_busy() -> None:
    write = Recorder()
    write.gate = threading.Event()
    sink = make_sink(write, batch_rows=100, max_batch_latency=0.05)
    acks = Acks()
    async with asyncio.TaskGroup() as tg:
        await sink.start(tg)
        sink.offer(chunk(0, 100), acks.cb(0))  # closes at once; writer takes it and blocks
        await write.wait_entered()
        for n in range(1, 6):  # 50 rows while the writer is busy, well past the latency limit
            sink.offer(chunk(n * 10, 10), acks.cb(n))
            await asyncio.sleep(0.02)
        assert sink.want_more()  # nothing closed is waiting: the open batch is still filling
        sink.offer(chunk(500, 50), acks.cb(6))  # reaches 100 rows: closes
        assert not sink.want_more()
        sink.offer(chunk(600, 5), acks.cb(7))  # still accepted while behind
        assert sink.backlog_rows == 100 + 100 + 5
        write.gate.set()
        await sink.aclose()
    assert [info.row_count for _, info in write.written] == [100, 100, 5]
    assert all(acks.outcome(n) is True for n in range(8))


async def test_wait_for_room_returns_when_the_writer_catches_up() -> None:
    write = Recorder()
    write.gate = threading.Event()
    sink = make_sink(write, batch_rows=5)
    async with asyncio.TaskGroup() as tg:
        await sink.start(tg)
        await sink.wait_for_room()  # nothing waiting: immediate
        sink.offer(chunk(0, 5), lambda ok: None)
        await write.wait_entered()
        sink.offer(chunk(5, 5), lambda ok: None)  # closed and waiting
        assert not sink.want_more()
        room = tg.create_task(sink.wait_for_room())
        await asyncio.sleep(0.05)
        assert not room.done()
        write.gate.set()  # batch 1 ends, the writer takes batch 2: nothing waits any more
        async with asyncio.timeout(5):
            await room
        assert sink.want_more()
        await sink.aclose()


async def test_batch_info_describes_the_batch() -> None:
    write = Recorder()
    sink = make_sink(write, batch_rows=1000)
    before = time.time()
    sink.offer(chunk(0, 6, queue_id=3), lambda ok: None)
    sink.offer(chunk(10, 4, topic="b-topic", broker="broker-b", queue_id=1), lambda ok: None)
    sink.offer(chunk(20, 5, queue_id=0), lambda ok: None)
    await sink.flush()
    sink.offer(chunk(30, 1), lambda ok: None)
    await sink.aclose()
    info = write.written[0][1]
    assert info.batch_id == 1 and write.written[1][1].batch_id == 2
    assert info.topics == ("b-topic", "orders")
    assert info.queues == (
        MessageQueue("b-topic", "broker-b", 1),
        MessageQueue("orders", "broker-a", 0),
        MessageQueue("orders", "broker-a", 3),
    )
    assert info.offset_ranges == {
        MessageQueue("b-topic", "broker-b", 1): (1010, 1013),
        MessageQueue("orders", "broker-a", 0): (1020, 1024),
        MessageQueue("orders", "broker-a", 3): (1000, 1005),
    }
    assert info.row_count == 15
    assert info.bytes == sum(len(b) for b in write.written[0][0].column("body").to_pylist())
    assert before <= info.opened_at <= info.closed_at <= time.time()


async def test_write_retried_until_it_succeeds(logs: LogList) -> None:
    write = Recorder(fail=lambda call_no, info: call_no in (1, 2))
    sink = make_sink(write, write_retries=3, retry_backoff=0.05)
    acks = Acks()
    sink.offer(chunk(0, 5), acks.cb(0))
    sink.offer(chunk(5, 5), acks.cb(1))
    started = time.monotonic()
    await sink.flush()
    assert time.monotonic() - started >= 0.05 + 0.1  # backoff doubles: 0.05 then 0.1
    assert len(write.calls) == 3 and len(write.written) == 1
    assert [acks.outcome(0), acks.outcome(1)] == [True, True]
    events = [e["event"] for e in logs if e["event"].startswith("spark_sink.")]
    assert events == ["spark_sink.write_failed", "spark_sink.write_failed",
                      "spark_sink.batch_written"]  # fmt: skip
    assert [e["attempt"] for e in logs if e["event"] == "spark_sink.write_failed"] == [1, 2]
    await sink.aclose()


async def test_a_write_raising_a_base_exception_is_a_failed_attempt(logs: LogList) -> None:
    # It ended the writer (``task.crashed``): the batch was failed and every later offer of
    # the topic waited for room until stop().
    class Raising(Recorder):
        attempts = 0

        def __call__(self, df: Any, info: BatchInfo) -> None:
            self.attempts += 1
            if self.attempts == 1:
                raise NotAnException("pytest.fail() in the write")
            super().__call__(df, info)

    write = Raising()
    sink = make_sink(write, batch_rows=5, write_retries=2, max_batch_latency=0.05)
    acks = Acks()
    async with asyncio.TaskGroup() as tg:
        await sink.start(tg)
        sink.offer(chunk(0, 5), acks.cb(0))
        sink.offer(chunk(5, 5), acks.cb(1))
        async with asyncio.timeout(5):
            while acks.outcome(1) is None:
                await asyncio.sleep(0.01)
        await sink.aclose()
    assert [acks.outcome(0), acks.outcome(1)] == [True, True]
    assert write.attempts == 3  # batch 1 twice, batch 2 once
    assert [info.batch_id for _, info in write.written] == [1, 2]
    failed = [e for e in logs if e["event"] == "spark_sink.write_failed"]
    assert [e["error"] for e in failed] == ["NotAnException: pytest.fail() in the write"]


async def test_retries_exhausted_fail_exactly_that_batch(logs: LogList) -> None:
    write = Recorder(fail=lambda call_no, info: info.batch_id == 2)
    sink = make_sink(write, batch_rows=10, write_retries=2)
    acks = Acks()
    async with asyncio.TaskGroup() as tg:
        await sink.start(tg)
        for n in range(6):  # batches: offers 0-1, 2-3, 4-5
            sink.offer(chunk(n * 5, 5), acks.cb(n))
        await sink.aclose()
    assert [acks.outcome(n) for n in range(6)] == [True, True, False, False, True, True]
    assert [info.batch_id for _, info in write.written] == [1, 3]
    assert sum(1 for _, info in write.calls if info.batch_id == 2) == 3
    given_up = [e for e in logs if e["event"] == "spark_sink.batch_given_up"]
    assert [(e["batch_id"], e["rows"]) for e in given_up] == [(2, 10)]
    stats = sink.statistics()
    assert (stats.batches_written, stats.rows_written) == (2, 20)
    assert (stats.batches_given_up, stats.rows_given_up) == (1, 10)


async def test_flush_without_writer_loop_writes_inline() -> None:
    write = Recorder()
    sink = make_sink(write)
    acks = Acks()
    sink.offer(chunk(0, 3), acks.cb(0))
    await sink.flush()
    assert acks.outcome(0) is True
    await sink.flush()  # nothing new: returns at once
    assert len(write.calls) == 1


async def test_flush_waits_for_running_writer() -> None:
    write = Recorder()
    write.gate = threading.Event()
    sink = make_sink(write, batch_rows=5)
    acks = Acks()
    async with asyncio.TaskGroup() as tg:
        await sink.start(tg)
        sink.offer(chunk(0, 5), acks.cb(0))
        await write.wait_entered()
        sink.offer(chunk(5, 2), acks.cb(1))
        flush = tg.create_task(sink.flush())
        await asyncio.sleep(0.05)
        assert not flush.done() and acks.outcome(1) is None
        write.gate.set()
        await flush
        assert acks.outcome(0) is True and acks.outcome(1) is True
        await sink.aclose()


async def test_aclose_ends_run_and_refuses_offers() -> None:
    write = Recorder()
    sink = make_sink(write)
    async with asyncio.TaskGroup() as tg:
        runner = tg.create_task(sink.run())
        sink.offer(chunk(0, 2), lambda ok: None)
        await sink.aclose()
        assert runner.done()
    assert sink.closed
    with pytest.raises(SinkClosedError):
        sink.offer(chunk(2, 1), lambda ok: None)
    await sink.aclose()  # idempotent
    await sink.run()  # returns at once on a closed sink
    assert [info.row_count for _, info in write.written] == [2]


async def test_a_closed_sink_started_again_writes_again() -> None:
    """Its consumer stopped (aclose) and started again (start): the sink takes and writes
    chunks again, instead of refusing every offer while the chunks sit cached."""
    write = Recorder()
    sink = make_sink(write, max_batch_latency=0.05)
    acks = Acks()
    async with asyncio.TaskGroup() as tg:
        await sink.start(tg)
        sink.offer(chunk(0, 2), acks.cb(0))
        await sink.aclose()
        assert sink.closed
        await sink.start(tg)
        assert not sink.closed
        sink.offer(chunk(2, 3), acks.cb(1))
        async with asyncio.timeout(5):
            while acks.outcome(1) is None:
                await asyncio.sleep(0.01)
        await sink.aclose()
    assert [info.row_count for _, info in write.written] == [2, 3]
    assert [acks.outcome(n) for n in range(2)] == [True, True]


async def test_cancelled_writer_acks_every_offer_once() -> None:
    write = Recorder()
    write.gate = threading.Event()
    sink = make_sink(write, batch_rows=5)
    acks = Acks()
    runner = asyncio.get_running_loop().create_task(sink.run())
    sink.offer(chunk(0, 5), acks.cb(0))  # batch 1: being written when the cancel comes
    await write.wait_entered()
    sink.offer(chunk(5, 5), acks.cb(1))  # batch 2: closed, waiting
    sink.offer(chunk(10, 2), acks.cb(2))  # batch 3: open
    runner.cancel()
    await asyncio.sleep(0.05)
    assert not runner.done()  # the write in the thread is not abandoned
    write.gate.set()
    with pytest.raises(asyncio.CancelledError):
        await runner
    assert [acks.outcome(n) for n in range(3)] == [True, False, False]
    assert sink.backlog_rows == 0 and sink.want_more()


async def test_failing_ack_does_not_stop_the_writer(logs: LogList) -> None:
    write = Recorder()
    sink = make_sink(write, batch_rows=2)

    def bad_ack(ok: bool) -> None:
        raise ValueError("consumer bug")

    acks = Acks()
    sink.offer(chunk(0, 2), bad_ack)
    sink.offer(chunk(2, 2), acks.cb(1))
    await sink.aclose()
    assert acks.outcome(1) is True
    assert [e["event"] for e in logs if e["event"] == "spark_sink.ack_failed"] == ["spark_sink.ack_failed"]


def test_spark_sink_is_a_message_sink() -> None:
    sink: MessageSink = make_sink(Recorder())  # checked statically by mypy
    assert callable(sink.offer) and callable(sink.wait_for_room)


async def test_empty_offer_is_acknowledged_without_a_write() -> None:
    write = Recorder()
    sink = make_sink(write)
    acks = Acks()
    sink.offer([], acks.cb(0))
    await sink.aclose()
    assert acks.outcome(0) is True
    assert write.calls == []


@pytest.mark.parametrize(
    ("kw", "match"),
    [
        ({"batch_rows": 0}, "batch_rows"),
        ({"batch_bytes": 0}, "batch_bytes"),
        ({"batch_bytes": 4 << 30}, "batch_bytes"),
        ({"max_batch_latency": 0}, "max_batch_latency"),
        ({"max_batch_latency": float("inf")}, "max_batch_latency"),
        ({"write_retries": -1}, "write_retries"),
        ({"retry_backoff": -1.0}, "retry_backoff"),
        ({"value_format": "xml"}, "value_format"),
        ({"value_format": "json"}, "value_schema"),
    ],
)
def test_invalid_options(kw: dict[str, Any], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        make_sink(Recorder(), **kw)


def test_spark_or_create_dataframe_required() -> None:
    with pytest.raises(ValueError, match="spark"):
        SparkSink(None, Recorder())

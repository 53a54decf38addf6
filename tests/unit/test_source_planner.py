"""The stream reader's planning (``latestOffset``) against scripted queue bounds, no broker."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable, Coroutine
from typing import Any

import pytest

pytest.importorskip("pyspark")

from pyspark.sql.streaming.datasource import ReadAllAvailable, ReadMaxRows

from rmq_async.protocol.types import MessageQueue
from rmq_async.sources import ranges as ranges_module
from rmq_async.sources import spark as spark_source
from rmq_async.sources.ranges import (
    DataLossError,
    SourceError,
    SourceOptions,
    offsets_from_json,
    offsets_to_json,
)

A = MessageQueue("t", "broker-a", 0)
B = MessageQueue("t", "broker-b", 0)


def reader(monkeypatch: pytest.MonkeyPatch, bounds: dict[MessageQueue, tuple[int, int]],
           **extra: str) -> spark_source.RocketMQStreamReader:
    opts = SourceOptions.parse({"namesrv": "127.0.0.1:9876", "topics": "t", **extra},
                               streaming=True)

    async def scripted(client: Any, opts: SourceOptions) -> dict[MessageQueue, tuple[int, int]]:
        return dict(bounds)

    monkeypatch.setattr(spark_source, "_bounds", scripted)
    r = spark_source.RocketMQStreamReader(opts)

    def run(work: Callable[[Any], Coroutine[Any, Any, Any]]) -> Any:
        return asyncio.run(work(None))

    r._run = run  # type: ignore[method-assign]
    return r


def test_a_queue_new_to_the_query_gets_its_share_from_its_min_offset(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """broker-b was out of the route when the query began; it is back with offsets 5000..5999
    (older files expired). Under maxMessagesPerTrigger its share starts at 5000: a range from
    0 would read nothing now and be a (false) data loss in the next batch."""
    r = reader(monkeypatch, {A: (0, 1000), B: (5000, 6000)}, maxMessagesPerTrigger="100")
    end = offsets_from_json(r.latestOffset(offsets_to_json({A: 500}), ReadMaxRows(100)))
    assert end[A] - 500 + end[B] - 5000 == 100
    assert 5000 < end[B] <= 6000


def test_a_queue_whose_max_went_down_is_data_loss(monkeypatch: pytest.MonkeyPatch) -> None:
    """The checkpoint read A up to 1000; the topic was created again and A now holds 0..299.
    Planning on from 1000 would skip what A holds now without a word."""
    with pytest.raises(DataLossError, match=r"max offset went down from 1000 to 300"):
        reader(monkeypatch, {A: (0, 300)}).latestOffset(offsets_to_json({A: 1000}),
                                                        ReadAllAvailable())
    lenient = reader(monkeypatch, {A: (0, 300)}, failOnDataLoss="false")
    for _ in range(2):  # reported once, then planned on from where the query was
        end = lenient.latestOffset(offsets_to_json({A: 1000}), ReadAllAvailable())
        assert offsets_from_json(end) == {A: 1000}
    assert lenient._went_down == {A: 1000}


class _Growing:
    """Queue A holds 100 messages at first and 10 more each time the source looks."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.high = 100

        async def bounds(client: Any, opts: SourceOptions) -> dict[MessageQueue, tuple[int, int]]:
            now = self.high
            self.high += 10
            return {A: (0, now)}

        monkeypatch.setattr(spark_source, "_bounds", bounds)


def _stream(**extra: str) -> spark_source.RocketMQStreamReader:
    opts = SourceOptions.parse({"namesrv": "127.0.0.1:9876", "topics": "t", **extra},
                               streaming=True)
    r = spark_source.RocketMQStreamReader(opts)
    r._run = lambda work: asyncio.run(work(None))  # type: ignore[method-assign]
    return r


def _planned(parts: Any) -> list[int]:
    return sorted(o for p in parts for o in range(p.start, p.end))


def test_a_stream_from_latest_reads_batch_zero_from_where_its_end_was_planned(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Spark asks a new query's ``initialOffset()`` once to plan batch 0's end and again to run
    it: "latest" resolved twice moved between the calls, and what was stored in between was
    never read (batch 1 starts at batch 0's end)."""
    _Growing(monkeypatch)
    r = _stream()  # startingOffsets: latest, the stream's default
    limit = ReadAllAvailable()
    start0 = r.initialOffset()
    end0 = r.latestOffset(start0, limit)
    plan0 = r.partitions(r.initialOffset(), end0)  # runBatch asks again
    end1 = r.latestOffset(end0, limit)
    plan1 = r.partitions(end0, end1)
    assert r.initialOffset() == start0  # the same answer every time
    first = offsets_from_json(end0[spark_source.LATEST_START_KEY])[A]
    last = offsets_from_json({k: v for k, v in end1.items() if not k.startswith("@")})[A]
    assert first == 100 and _planned(plan0) + _planned(plan1) == list(range(first, last))


def test_no_new_data_after_a_latest_start_is_the_same_offset_as_text(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Spark finds new data when the end it is given differs from the start as JSON text:
    batch 0's end carries ``"@start"``, and batch 1's end with the same queue offsets but
    without it ran an empty micro-batch."""
    async def bounds(client: Any, opts: SourceOptions) -> dict[MessageQueue, tuple[int, int]]:
        return {A: (0, 100), B: (0, 50)}

    monkeypatch.setattr(spark_source, "_bounds", bounds)
    r = _stream()
    end0 = r.latestOffset(r.initialOffset(), ReadAllAvailable())
    assert spark_source.LATEST_START_KEY in end0
    end1 = r.latestOffset(json.loads(json.dumps(end0)), ReadAllAvailable())
    assert json.dumps(end1) == json.dumps(end0)
    # And a stream from plain offsets: nothing new is the start again, something new is not.
    end2 = r.latestOffset(offsets_to_json({A: 100, B: 50}), ReadAllAvailable())
    assert json.dumps(end2) == json.dumps(offsets_to_json({A: 100, B: 50}))
    assert offsets_from_json(r.latestOffset(offsets_to_json({A: 90, B: 50}),
                                            ReadAllAvailable())) == {A: 100, B: 50}


def test_a_restart_before_batch_zero_was_committed_plans_it_again_the_same(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The offset log holds batch 0's end, the commit log nothing: the restarted query asks
    the new reader's ``initialOffset()`` for batch 0's start, and gets the same plan (before,
    "latest" resolved again gave a start past batch 0's end, and batch 1 began there)."""
    _Growing(monkeypatch)
    r = _stream()
    end0 = r.latestOffset(r.initialOffset(), ReadAllAvailable())
    plan0 = r.partitions(r.initialOffset(), end0)
    r.stop()
    again = _stream()  # the queue has grown meanwhile: batch 0 still ends where it did
    assert again.partitions(again.initialOffset(), end0) == plan0
    end1 = again.latestOffset(end0, ReadAllAvailable())
    assert _planned(again.partitions(end0, end1)) == list(range(100, 110))


@pytest.mark.parametrize("starting", [
    '{"t": {"broker-a:0": 500}}',  # above the max: lowered to it, which moves
    "2026-01-01T00:00:00Z",  # after every message: the max, which moves
], ids=["offset-above-max", "time-after-last-message"])
def test_a_restart_before_batch_zero_was_committed_plans_any_start_the_same(
        monkeypatch: pytest.MonkeyPatch, starting: str) -> None:
    """A start that resolves to a queue's max resolves higher once the queue has grown: the
    restarted query's batch 0 began there, and what lay between the two starts was never
    read (batch 1 starts at batch 0's end)."""
    live = {"high": 300}

    async def bounds(client: Any, opts: SourceOptions) -> dict[MessageQueue, tuple[int, int]]:
        return {A: (0, live["high"])}

    async def first_stored_since(*a: Any, **kw: Any) -> int:
        return live["high"]  # every message is older than the time

    monkeypatch.setattr(spark_source, "_bounds", bounds)
    monkeypatch.setattr(ranges_module, "first_stored_since", first_stored_since)
    r = _stream(startingOffsets=starting)
    start0 = r.initialOffset()
    live["high"] = 400  # 100 messages arrive
    end0 = r.latestOffset(start0, ReadAllAvailable())
    plan0 = r.partitions(r.initialOffset(), end0)
    assert _planned(plan0) == list(range(300, 400))
    r.stop()
    live["high"] = 450  # the driver was restarted
    again = _stream(startingOffsets=starting)
    assert _planned(again.partitions(again.initialOffset(), end0)) == list(range(300, 400))
    end1 = again.latestOffset(end0, ReadAllAvailable())
    assert _planned(again.partitions(end0, end1)) == list(range(400, 450))
    assert again.latestOffset(end1, ReadAllAvailable()) == end1  # nothing new


def test_available_now_from_latest_on_a_live_topic_is_no_data_loss(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """``prepareForTriggerAvailableNow`` runs before ``initialOffset``: a message stored in
    between puts the start above the target, which is not a queue going down."""
    high = {"now": 100}

    async def bounds(client: Any, opts: SourceOptions) -> dict[MessageQueue, tuple[int, int]]:
        return {A: (0, high["now"])}

    monkeypatch.setattr(spark_source, "_bounds", bounds)
    r = _stream(startingOffsets='{"t": {"broker-a:0": 101}}')
    r.prepareForTriggerAvailableNow()  # target: 100
    high["now"] = 101
    end = r.latestOffset(r.initialOffset(), ReadAllAvailable())
    assert offsets_from_json(end) == {A: 101}  # nothing to read, and no DataLossError
    high["now"] = 130  # messages after the target are not this run's
    latest = _stream()
    latest.prepareForTriggerAvailableNow()  # target: 130
    high["now"] = 140
    end = latest.latestOffset(latest.initialOffset(), ReadAllAvailable())
    assert offsets_from_json(end[spark_source.LATEST_START_KEY]) == {A: 140}
    assert spark_source._offsets(end) == {A: 140}


def _batch_plan(monkeypatch: pytest.MonkeyPatch, **opts: str) -> Any:
    async def bounds(client: Any, o: SourceOptions) -> dict[MessageQueue, tuple[int, int]]:
        return {A: (0, 1000)}

    monkeypatch.setattr(spark_source, "_bounds", bounds)
    r = spark_source.RocketMQBatchReader(SourceOptions.parse(
        {"namesrv": "127.0.0.1:9876", "topics": "t", **opts}, streaming=False))
    return asyncio.run(r._plan(None))  # type: ignore[arg-type]


@pytest.mark.parametrize("start,end,error", [
    ("500", "100", "the start is past the end for t broker-a:0 \\(500 > 100\\)"),
    ("-1", "1000", "-1 \\(latest\\) reads nothing in a batch query"),
    ("0", "-2", "-2 \\(earliest\\) reads nothing in a batch query"),
])
def test_a_batch_read_whose_start_is_past_its_end_is_refused(
        monkeypatch: pytest.MonkeyPatch, start: str, end: str, error: str) -> None:
    """As the Kafka source, and as the string forms ``latest`` / ``earliest`` are: not an
    empty result that says nothing."""
    with pytest.raises(SourceError, match=error):
        _batch_plan(monkeypatch, startingOffsets=json.dumps({"t": {"broker-a:0": int(start)}}),
                    endingOffsets=json.dumps({"t": {"broker-a:0": int(end)}}))
    parts = _batch_plan(monkeypatch, startingOffsets='{"t": {"broker-a:0": 100}}',
                        endingOffsets='{"t": {"broker-a:0": 100}}')
    assert parts == []  # an empty range given as such is fine


@pytest.mark.parametrize("value", ["inf", "1e999", "nan", "0", "-3", "3601"])
def test_api_timeout_must_be_a_finite_positive_bound(value: str) -> None:
    """A read ends even when a broker stops answering: no infinite or NaN timeout."""
    with pytest.raises(SourceError, match="apiTimeout"):
        SourceOptions.parse({"namesrv": "127.0.0.1:9876", "topics": "t", "apiTimeout": value},
                            streaming=True)
    assert SourceOptions.parse({"namesrv": "127.0.0.1:9876", "topics": "t",
                                "apiTimeout": "2.5"}, streaming=True).api_timeout == 2.5


async def test_a_topic_pattern_never_matches_system_retry_or_dead_letter_topics() -> None:
    from rmq_async.protocol.codes import RequestCode, ResponseCode
    from rmq_async.sources.ranges import open_client, source_topics
    from tests.fake_broker import FakeBroker

    listed = ["orders", "orders-eu", "%RETRY%orders-etl", "%DLQ%orders-etl",
              "RMQ_SYS_TRANS_HALF_TOPIC", "SCHEDULE_TOPIC_XXXX", "rmq_sys_wheel_timer", "TBW102"]

    async def answer(cmd: Any, number: int) -> Any:
        if cmd.code == RequestCode.GET_ALL_TOPIC_LIST_FROM_NAMESERVER:
            return cmd.response_to(ResponseCode.SUCCESS,
                                   body=json.dumps({"topicList": listed}).encode())
        return cmd.response_to(ResponseCode.SYSTEM_ERROR)

    async with FakeBroker(answer) as namesrv:
        for pattern in (".*orders.*", ".*"):
            opts = SourceOptions.parse({"namesrv": namesrv.addr, "topicPattern": pattern},
                                       streaming=True)
            client = open_client(opts, "plan")
            try:
                assert await source_topics(client, opts) == ["orders", "orders-eu"], pattern
            finally:
                await client.close()


def test_a_json_latest_start_is_planned_from_one_answer_too(monkeypatch: pytest.MonkeyPatch) -> None:
    """``{"t": {"broker-a:0": -1}}`` moves between Spark's calls as ``latest`` does."""
    _Growing(monkeypatch)
    r = _stream(startingOffsets='{"t": {"broker-a:0": -1}}')
    limit = ReadAllAvailable()
    start0 = r.initialOffset()
    end0 = r.latestOffset(start0, limit)
    plan0 = r.partitions(r.initialOffset(), end0)
    end1 = r.latestOffset(end0, limit)
    plan1 = r.partitions(end0, end1)
    first = offsets_from_json(end0[spark_source.LATEST_START_KEY])[A]
    last = spark_source._offsets(end1)[A]
    assert r.initialOffset() == start0
    assert _planned(plan0) + _planned(plan1) == list(range(first, last))


def test_available_now_keeps_a_queue_the_target_does_not_know_where_it_starts(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A queue that appears after ``prepareForTriggerAvailableNow`` is not read on and on while
    producers write to it: the run ends."""
    b = MessageQueue("t", "broker-b", 0)
    state: dict[str, int | None] = {"b": None}

    async def bounds(client: Any, opts: SourceOptions) -> dict[MessageQueue, tuple[int, int]]:
        out = {A: (0, 100)}
        if state["b"] is not None:
            out[b] = (0, state["b"])
        return out

    monkeypatch.setattr(spark_source, "_bounds", bounds)
    r = _stream()
    r.prepareForTriggerAvailableNow()  # the target knows A only
    state["b"] = 50
    limit = ReadAllAvailable()
    start = r.latestOffset(r.initialOffset(), limit)
    ends = []
    for _ in range(3):
        state["b"] = (state["b"] or 0) + 1000  # producers keep writing to B
        start = r.latestOffset(start, limit)
        ends.append(spark_source._offsets(start).get(b))
    assert ends == [50, 50, 50]


def test_a_start_is_resolved_once_even_when_a_queue_leaves_the_route_between_the_calls(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Spark asks ``initialOffset()`` again to run batch 0. broker-b left the route in between
    (restarting): resolved again, the start lacked it, and batch 0 read it from its min,
    below the start asked for."""
    live = {A: (0, 1000), B: (0, 600)}

    async def bounds(client: Any, opts: SourceOptions) -> dict[MessageQueue, tuple[int, int]]:
        return dict(live)

    monkeypatch.setattr(spark_source, "_bounds", bounds)
    r = _stream(startingOffsets=json.dumps({"t": {"broker-a:0": 400, "broker-b:0": 500}}))
    start0 = r.initialOffset()
    end0 = r.latestOffset(start0, ReadAllAvailable())
    del live[B]
    assert r.initialOffset() == start0
    plan = r.partitions(r.initialOffset(), end0)
    assert sorted((p.broker_name, p.start, p.end) for p in plan) == [
        ("broker-a", 400, 1000), ("broker-b", 500, 600)]


def test_a_given_schema_must_match_the_sources_nullability_too() -> None:
    """A schema equal to the source's in its simple string (a DDL string gives every field
    nullable) passed the check, and then every read task failed on the batches' schema."""
    from pyspark.sql.types import StructField, StructType

    from rmq_async.sinks.spark import SPARK_SCHEMA
    from rmq_async.sources.ranges import SourceError

    source = spark_source.RocketMQDataSource({"namesrv": "127.0.0.1:9876", "topics": "t"})
    source.reader(SPARK_SCHEMA)  # the source's own: taken
    source.reader(StructType.fromJson(json.loads(SPARK_SCHEMA.json())))  # a round trip too
    loose = StructType([StructField(f.name, f.dataType, True) for f in SPARK_SCHEMA.fields])
    assert loose.simpleString() == SPARK_SCHEMA.simpleString() and loose != SPARK_SCHEMA
    with pytest.raises(SourceError, match="nullability differs"):
        source.reader(loose)
    with pytest.raises(SourceError, match="fixed schema"):
        source.reader(StructType([StructField("body", SPARK_SCHEMA["body"].dataType)]))

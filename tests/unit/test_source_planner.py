"""The stream reader's planning (``latestOffset``) against scripted queue bounds, no broker."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine
from typing import Any

import pytest

pytest.importorskip("pyspark")

from pyspark.sql.streaming.datasource import ReadAllAvailable, ReadMaxRows

from rmq_async.protocol.types import MessageQueue
from rmq_async.sources import spark as spark_source
from rmq_async.sources.ranges import (
    DataLossError,
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

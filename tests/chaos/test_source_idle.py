"""The Spark source's stream driver after its peers closed its connections between two of
Spark's calls.

The driver keeps one client on an event loop that runs only while Spark calls the reader, so
nothing reads a socket in between. A broker and a name server close a connection idle for
``serverChannelMaxIdleTimeSeconds`` (120 s), longer than many trigger intervals: the next
call must see the close and connect again, as Java's client (whose event loop notices a
closed channel at once) does, not send on the dead connection and fail the call.
"""

from __future__ import annotations

import asyncio

import pytest

pytest.importorskip("pyspark")

from pyspark.sql.streaming.datasource import ReadAllAvailable
from structlog.testing import capture_logs

from rmq_async import Message
from rmq_async.devbroker import LocalRocketMQ
from rmq_async.protocol.types import MessageQueue
from rmq_async.sources import spark as spark_source
from rmq_async.sources.ranges import SourceOptions
from tests.chaos.conftest import Proxies
from tests.helpers import produce, unique

pytestmark = [pytest.mark.broker, pytest.mark.chaos]


def highs(placed: list[tuple[int, int]], broker: str, topic: str) -> dict[MessageQueue, int]:
    out: dict[MessageQueue, int] = {}
    for queue_id, offset in placed:
        mq = MessageQueue(topic, broker, queue_id)
        out[mq] = max(out.get(mq, 0), offset + 1)
    return out


async def test_connections_closed_while_the_driver_was_away_are_not_used(
        rocketmq: LocalRocketMQ, proxies: Proxies) -> None:
    topic = unique("T_source_idle")
    await rocketmq.create_topic(topic, queues=2)
    placed = await produce(rocketmq.namesrv_addr, topic,
                           [Message(topic, b"a%d" % i) for i in range(10)], batch=1)
    opts = SourceOptions.parse({"namesrv": proxies.namesrv_addr, "topics": topic,
                                "startingOffsets": "earliest"}, streaming=True)
    reader = spark_source.RocketMQStreamReader(opts)
    try:
        start = await asyncio.to_thread(reader.initialOffset)
        first = await asyncio.to_thread(reader.latestOffset, start, ReadAllAvailable())
        assert spark_source._offsets(first) == highs(placed, rocketmq.broker_name, topic)
        # Both peers close the driver's connections while Spark is away (the broker's and
        # the name server's idle close, through the proxies in front of them).
        assert await proxies.namesrv.hang_up() >= 1
        assert await proxies.broker.hang_up() >= 1
        accepted = proxies.namesrv.stats.accepted, proxies.broker.stats.accepted
        placed += await produce(rocketmq.namesrv_addr, topic,
                                [Message(topic, b"b%d" % i) for i in range(6)], batch=1)
        with capture_logs() as logs:
            second = await asyncio.to_thread(reader.latestOffset, first, ReadAllAvailable())
        assert spark_source._offsets(second) == highs(placed, rocketmq.broker_name, topic)
        noisy = [e for e in logs if e["log_level"] in ("warning", "error")]
        assert noisy == []
        # It connected again to both.
        assert proxies.namesrv.stats.accepted > accepted[0]
        assert proxies.broker.stats.accepted > accepted[1]
    finally:
        await asyncio.to_thread(reader.stop)

"""The stream reader plans from the routes its client holds when the name servers fail.

A real :class:`ClientInstance` (its name-server call and broker API scripted, no socket), so
``update_route`` keeps the route it had when a refresh fails, as it does in production.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

pytest.importorskip("pyspark")

from pyspark.sql.streaming.datasource import ReadAllAvailable
from structlog.testing import capture_logs

from rmq_async.client.errors import MQClientError, NoRouteError
from rmq_async.client.instance import ClientInstance
from rmq_async.protocol.bodies import BrokerData, QueueData, TopicRouteData
from rmq_async.protocol.codes import PERM_READ, PERM_WRITE
from rmq_async.protocol.types import MessageQueue
from rmq_async.remoting.errors import RemotingConnectError, RemotingTimeout
from rmq_async.sources import ranges
from rmq_async.sources import spark as spark_source
from rmq_async.sources.ranges import SourceError, SourceOptions, offsets_from_json

ADDR_A = "10.0.0.1:10911"


def route(queues: int = 2) -> TopicRouteData:
    return TopicRouteData(
        queue_datas=[QueueData("broker-a", queues, queues, PERM_READ | PERM_WRITE)],
        broker_datas=[BrokerData("c", "broker-a", {0: ADDR_A})])


class ScriptedNamesrv:
    """``fetch_route``: the route, or ``failure`` while it is set."""

    def __init__(self) -> None:
        self.failure: Exception | None = None
        self.routes: dict[str, TopicRouteData] = {}
        self.calls = 0

    async def fetch_route(self, topic: str) -> TopicRouteData:
        self.calls += 1
        if self.failure is not None:
            raise self.failure
        if topic not in self.routes:
            raise NoRouteError(topic, "TOPIC_NOT_EXIST")
        return self.routes[topic]


class ScriptedBrokers:
    """Min and max offsets per queue; ``down`` brokers do not answer."""

    def __init__(self) -> None:
        self.high: dict[MessageQueue, int] = {}
        self.down: set[str] = set()

    def _check(self, addr: str) -> None:
        if addr in self.down:
            raise RemotingTimeout(f"no answer from {addr}", addr=addr)

    async def get_min_offset(self, addr: str, mq: MessageQueue) -> int:
        self._check(addr)
        return 0

    async def get_max_offset(self, addr: str, mq: MessageQueue) -> int:
        self._check(addr)
        return self.high.get(mq, 0)


@pytest.fixture
def setup() -> Iterator[tuple[ScriptedNamesrv, ScriptedBrokers, ClientInstance]]:
    namesrv, brokers = ScriptedNamesrv(), ScriptedBrokers()
    client = ClientInstance("127.0.0.1:9876", "127.0.0.1@test")
    client.fetch_route = namesrv.fetch_route  # type: ignore[method-assign]
    client.api = brokers  # type: ignore[assignment]
    yield namesrv, brokers, client


def stream(client: ClientInstance, **extra: str) -> spark_source.RocketMQStreamReader:
    opts = SourceOptions.parse({"namesrv": "127.0.0.1:9876", **extra}, streaming=True)
    r = spark_source.RocketMQStreamReader(opts)
    r._client = client  # the driver's long-lived client (see _run)
    return r


def q(i: int, topic: str = "t") -> MessageQueue:
    return MessageQueue(topic, "broker-a", i)


@pytest.mark.parametrize("failure", [
    MQClientError("no name server answered for topic 't': 127.0.0.1:9876: connection refused"),
    RemotingConnectError("connection refused", addr="127.0.0.1:9876"),
    NoRouteError("t", "No topic route info in name server"),  # restarted, not re-registered
], ids=["refused", "connect-error", "restarted"])
def test_a_failed_route_refresh_plans_from_the_known_route(
        setup: tuple[ScriptedNamesrv, ScriptedBrokers, ClientInstance],
        failure: Exception) -> None:
    namesrv, brokers, client = setup
    namesrv.routes["t"] = route()
    brokers.high = {q(0): 10, q(1): 20}
    r = stream(client, topics="t", startingOffsets="earliest")
    try:
        start = r.initialOffset()
        assert offsets_from_json(start) == {q(0): 0, q(1): 0}
        namesrv.failure = failure
        brokers.high = {q(0): 15, q(1): 25}
        with capture_logs() as logs:
            end = r.latestOffset(start, ReadAllAvailable())
        assert spark_source._offsets(end) == {q(0): 15, q(1): 25}
        warned = [e for e in logs if e["event"] == "spark_source.route_refresh_failed"]
        assert len(warned) == 1 and warned[0]["log_level"] == "warning"
        assert warned[0]["topic"] == "t" and type(failure).__name__ in warned[0]["error"]
        # The name server is back: its route is used again (here with a third queue).
        namesrv.failure = None
        namesrv.routes["t"] = route(3)
        brokers.high[q(2)] = 5
        assert offsets_from_json(r.latestOffset(end, ReadAllAvailable())) == \
            {q(0): 15, q(1): 25, q(2): 5}
    finally:
        r.stop()


def test_without_a_known_route_the_error_still_surfaces(
        setup: tuple[ScriptedNamesrv, ScriptedBrokers, ClientInstance]) -> None:
    namesrv, _, client = setup
    namesrv.routes["t"] = route()
    r = stream(client, topics="t,u", startingOffsets="earliest")
    try:
        with pytest.raises(SourceError, match="'u' has no route on the name server"):
            r.initialOffset()
        # t's route is known now, u's never was: t is planned from it, u's error surfaces.
        namesrv.failure = MQClientError("no name server answered")
        with capture_logs() as logs, pytest.raises(MQClientError, match="no name server"):
            r.initialOffset()
        assert [e["topic"] for e in logs
                if e["event"] == "spark_source.route_refresh_failed"] == ["t"]
    finally:
        r.stop()


def test_a_topic_pattern_plans_from_the_known_topics_when_the_topic_list_fails(
        setup: tuple[ScriptedNamesrv, ScriptedBrokers, ClientInstance],
        monkeypatch: pytest.MonkeyPatch) -> None:
    namesrv, brokers, client = setup
    namesrv.routes = {"orders-1": route(1), "other": route(1)}
    brokers.high = {q(0, "orders-1"): 7}
    listing: dict[str, Any] = {"topics": ["orders-1", "other"], "failure": None}

    async def matching(client: ClientInstance, pattern: str) -> list[str]:
        if listing["failure"] is not None:
            raise listing["failure"]
        return [t for t in listing["topics"] if t.startswith("orders-")]

    monkeypatch.setattr(ranges, "matching_topics", matching)
    r = stream(client, topicPattern="orders-.*", startingOffsets="earliest")
    try:
        start = r.initialOffset()
        assert offsets_from_json(start) == {q(0, "orders-1"): 0}
        client.routes.setdefault("other", route(1))  # a route the pattern does not match
        listing["failure"] = MQClientError("no name server answered the topic list")
        namesrv.failure = MQClientError("no name server answered")
        with capture_logs() as logs:
            end = r.latestOffset(start, ReadAllAvailable())
        assert spark_source._offsets(end) == {q(0, "orders-1"): 7}
        events = [e["event"] for e in logs]
        assert "spark_source.topic_list_failed" in events
        assert "spark_source.route_refresh_failed" in events
        listed = next(e for e in logs if e["event"] == "spark_source.topic_list_failed")
        assert listed["topics"] == ["orders-1"]
    finally:
        r.stop()


def test_a_broker_that_does_not_answer_the_max_offset_still_fails_the_plan(
        setup: tuple[ScriptedNamesrv, ScriptedBrokers, ClientInstance]) -> None:
    """Kept on purpose: the executors could not read its queues either (see the module doc)."""
    namesrv, brokers, client = setup
    namesrv.routes["t"] = route()
    r = stream(client, topics="t", startingOffsets="earliest")
    try:
        start = r.initialOffset()
        namesrv.failure = MQClientError("no name server answered")
        brokers.down.add(ADDR_A)
        with pytest.raises(RemotingTimeout):
            r.latestOffset(start, ReadAllAvailable())
        brokers.down.clear()
        assert offsets_from_json(r.latestOffset(start, ReadAllAvailable())) == \
            {q(0): 0, q(1): 0}
    finally:
        r.stop()

"""``commitToGroup`` writes each queue's offset on its own: a broker that left the route or
is down holds back only its queues, never the others, and never the query (scripted brokers)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine
from typing import Any

import pytest

pytest.importorskip("pyspark")

from pyspark.sql.streaming.datasource import ReadAllAvailable
from structlog.testing import capture_logs

from rmq_async.client.errors import MQClientError
from rmq_async.protocol.types import MessageQueue
from rmq_async.remoting.errors import RemotingConnectError
from rmq_async.sources import ranges
from rmq_async.sources import spark as spark_source
from rmq_async.sources.ranges import SourceOptions, offsets_to_json

GROUP = "lag-view"
A = MessageQueue("t", "broker-a", 0)
A1 = MessageQueue("t", "broker-a", 1)
B = MessageQueue("t", "broker-b", 0)
C = MessageQueue("t", "broker-c", 0)
ADDRS = {"broker-a": "10.0.0.1:10911", "broker-b": "10.0.0.2:10911", "broker-c": "10.0.0.3:10911"}


class Cluster:
    """Brokers by name: ``gone`` ones are not in the route, ``down`` ones do not answer."""

    def __init__(self) -> None:
        self.gone: set[str] = set()
        self.down: set[str] = set()
        self.no_heartbeat: set[str] = set()  # answer writes, not heartbeats
        self.writes: list[tuple[str, str, MessageQueue, int]] = []
        self.heartbeats: list[str] = []

    def check(self, addr: str) -> None:
        if addr in {ADDRS[b] for b in self.down}:
            raise RemotingConnectError(f"connect to {addr} refused", addr=addr)

    # the driver's client -----------------------------------------------------------
    async def find_broker_master(self, broker_name: str, topic: str | None = None) -> str:
        if broker_name in self.gone:
            raise MQClientError(f"no master address known for broker {broker_name!r}")
        return ADDRS[broker_name]

    @property
    def api(self) -> Cluster:
        return self

    async def update_consumer_offset(self, addr: str, group: str, mq: MessageQueue, offset: int,
                                     *, oneway: bool = True) -> None:
        assert not oneway
        self.check(addr)
        self.writes.append((addr, group, mq, offset))

    # announce_group's own client ---------------------------------------------------
    client_id = "127.0.0.1@spark-source-group"

    async def heartbeat(self, addr: str, data: Any, *, resend_on_go_away: bool = True) -> int:
        self.check(addr)
        if addr in {ADDRS[b] for b in self.no_heartbeat}:
            raise RemotingConnectError(f"heartbeat to {addr} failed", addr=addr)
        assert data.consumer_data_set[0].group_name == GROUP
        self.heartbeats.append(addr)
        return 0

    async def close(self) -> None:
        pass


def reader(monkeypatch: pytest.MonkeyPatch, cluster: Cluster) -> spark_source.RocketMQStreamReader:
    opts = SourceOptions.parse({"namesrv": "127.0.0.1:9876", "topics": "t",
                                "commitToGroup": GROUP}, streaming=True)
    monkeypatch.setattr(ranges, "open_client", lambda opts, role: cluster)
    r = spark_source.RocketMQStreamReader(opts)

    def run(work: Callable[[Any], Coroutine[Any, Any, Any]]) -> Any:
        return asyncio.run(work(cluster))

    r._run = run  # type: ignore[method-assign]
    return r


def commit(r: spark_source.RocketMQStreamReader, offsets: dict[MessageQueue, int]) -> list[Any]:
    with capture_logs() as logs:
        r.commit(offsets_to_json(offsets))  # never raises
    return logs


def failures(logs: list[Any]) -> dict[str, int]:
    return {e["queue"]: e["offset"] for e in logs
            if e["event"] == "spark_source.commit_to_group_failed"}


def test_one_broker_gone_or_down_holds_back_only_its_queues(
        monkeypatch: pytest.MonkeyPatch) -> None:
    cluster = Cluster()
    cluster.gone.add("broker-c")  # left the route
    cluster.down.add("broker-b")  # in the route, not answering
    r = reader(monkeypatch, cluster)

    logs = commit(r, {A: 10, A1: 11, B: 20, C: 30})
    assert sorted(cluster.writes) == [(ADDRS["broker-a"], GROUP, A, 10),
                                      (ADDRS["broker-a"], GROUP, A1, 11)]
    assert cluster.heartbeats == [ADDRS["broker-a"]]
    assert r._group_offsets == {A: 10, A1: 11}
    assert failures(logs) == {"broker-b:0": 20, "broker-c:0": 30}
    failed = [e for e in logs if e["event"] == "spark_source.commit_to_group_failed"]
    assert all(e["log_level"] == "warning" and e["group"] == GROUP and e["error"]
               for e in failed)
    assert any(e["event"] == "spark_source.announce_group_failed"
               and e["broker"] == ADDRS["broker-b"] for e in logs)
    done = next(e for e in logs if e["event"] == "spark_source.committed_to_group")
    assert (done["queues"], done["failed"]) == (2, 2)

    # broker-b is back: its queue (and its heartbeat) are sent now; broker-a's are not again.
    cluster.down.clear()
    cluster.writes.clear()
    logs = commit(r, {A: 10, A1: 11, B: 20, C: 30})
    assert cluster.writes == [(ADDRS["broker-b"], GROUP, B, 20)]
    assert cluster.heartbeats == [ADDRS["broker-a"], ADDRS["broker-b"]]
    assert failures(logs) == {"broker-c:0": 30}
    assert r._group_offsets == {A: 10, A1: 11, B: 20}

    # broker-c came back into the route; A moved on.
    cluster.gone.clear()
    cluster.writes.clear()
    logs = commit(r, {A: 15, A1: 11, B: 20, C: 30})
    assert sorted(cluster.writes) == [(ADDRS["broker-a"], GROUP, A, 15),
                                      (ADDRS["broker-c"], GROUP, C, 30)]
    assert cluster.heartbeats[-1] == ADDRS["broker-c"] and len(cluster.heartbeats) == 3
    assert failures(logs) == {}
    assert r._group_offsets == {A: 15, A1: 11, B: 20, C: 30}

    # Nothing new: nothing sent.
    cluster.writes.clear()
    assert commit(r, {A: 15, A1: 11, B: 20, C: 30}) == []
    assert cluster.writes == [] and len(cluster.heartbeats) == 3


def test_a_broker_that_missed_the_heartbeat_gets_it_at_the_next_write(
        monkeypatch: pytest.MonkeyPatch) -> None:
    cluster = Cluster()
    cluster.no_heartbeat.add("broker-b")
    r = reader(monkeypatch, cluster)
    commit(r, {A: 1, B: 2})
    assert r._group_offsets == {A: 1, B: 2}  # the writes do not wait for the heartbeat
    assert r._group_announced == {ADDRS["broker-a"]}
    cluster.no_heartbeat.clear()
    commit(r, {A: 1, B: 3})
    assert r._group_announced == {ADDRS["broker-a"], ADDRS["broker-b"]}
    assert cluster.heartbeats == [ADDRS["broker-a"], ADDRS["broker-b"]]


def test_latest_offset_goes_on_when_the_group_cannot_be_written(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The query's own planning never depends on the view."""
    cluster = Cluster()
    cluster.down.add("broker-a")
    r = reader(monkeypatch, cluster)

    async def bounds(client: Any, opts: SourceOptions) -> dict[MessageQueue, tuple[int, int]]:
        return {A: (0, 50), B: (0, 60)}

    monkeypatch.setattr(spark_source, "_bounds", bounds)
    with capture_logs() as logs:
        end = r.latestOffset(offsets_to_json({A: 5, B: 6}), ReadAllAvailable())
    assert end == offsets_to_json({A: 50, B: 60})
    assert r._group_offsets == {B: 6}
    assert failures(logs) == {"broker-a:0": 5}


def test_one_topics_queues_on_one_broker_are_written_one_after_the_other(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A 5.3.3 broker loses one of two first writes of a group's topic that meet (its offset
    map is made without a lock): a topic's queues on one broker go one after the other, other
    brokers side by side."""
    cluster = Cluster()
    in_flight: dict[str, int] = {}
    most: dict[str, int] = {}
    written = cluster.update_consumer_offset

    async def slow_write(addr: str, group: str, mq: MessageQueue, offset: int,
                         *, oneway: bool = True) -> None:
        in_flight[addr] = in_flight.get(addr, 0) + 1
        most[addr] = max(most.get(addr, 0), in_flight[addr])
        await asyncio.sleep(0.01)
        in_flight[addr] -= 1
        await written(addr, group, mq, offset, oneway=oneway)

    cluster.update_consumer_offset = slow_write  # type: ignore[method-assign]
    r = reader(monkeypatch, cluster)
    commit(r, {A: 5, A1: 6, B: 7})
    assert sorted((mq, off) for _, _, mq, off in cluster.writes) == [(A, 5), (A1, 6), (B, 7)]
    assert most == {ADDRS["broker-a"]: 1, ADDRS["broker-b"]: 1}

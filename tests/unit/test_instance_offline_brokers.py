"""The client instance forgets a broker address once no topic route it holds lists it any more
(Java MQClientInstance.cleanOfflineBroker): no heartbeats to it, no lookups answered with it."""

from __future__ import annotations

import asyncio

import pytest
from structlog.testing import capture_logs

from rmq_async.client.errors import MQClientError
from rmq_async.client.instance import ClientInstance
from rmq_async.consumer.push import PushConsumer
from rmq_async.protocol.bodies import BrokerData, ConsumerData, HeartbeatData, QueueData, TopicRouteData
from tests.helpers import no_broker

A0, A1 = "10.0.0.1:10911", "10.0.0.2:10911"  # broker-a: master, slave
B0, B1 = "10.0.1.1:10911", "10.0.1.2:10911"  # broker-b: master, slave
C0 = "10.0.2.1:10911"  # broker-c: master


def _route(**brokers: dict[int, str]) -> TopicRouteData:
    """A route with four queues on each broker; ``broker_a={0: ...}`` names ``broker-a``."""
    names = {key.replace("_", "-"): addrs for key, addrs in brokers.items()}
    return TopicRouteData(
        queue_datas=[QueueData(name, 4, 4, 6) for name in names],
        broker_datas=[BrokerData("DefaultCluster", name, dict(addrs))
                      for name, addrs in names.items()],
    )


class _FakeApi:
    """The name server's current answers (a route, or an error to raise) and the brokers'
    heartbeat answers; every heartbeat address is recorded."""

    def __init__(self) -> None:
        self.routes: dict[str, TopicRouteData | Exception] = {}
        self.heartbeats: list[str] = []
        self.hold_heartbeats: asyncio.Event | None = None
        self.heartbeats_waiting = asyncio.Event()

    async def get_route(self, namesrv: str, topic: str) -> TopicRouteData:
        answer = self.routes[topic]
        if isinstance(answer, Exception):
            raise answer
        return answer

    async def heartbeat(self, addr: str, data: HeartbeatData, *,
                        resend_on_go_away: bool = True) -> int:
        self.heartbeats.append(addr)
        if self.hold_heartbeats is not None:
            self.heartbeats_waiting.set()
            await self.hold_heartbeats.wait()
        return 453


def _instance() -> tuple[ClientInstance, _FakeApi]:
    inst = ClientInstance("127.0.0.1:9876", "127.0.0.1@test",
                          heartbeat_source=lambda: HeartbeatData(
                              client_id="127.0.0.1@test",
                              consumer_data_set=[ConsumerData(group_name="G")]))
    api = _FakeApi()
    inst.api = api  # type: ignore[assignment]
    return inst, api


async def test_broker_gone_from_the_newer_route_is_forgotten() -> None:
    inst, api = _instance()
    try:
        api.routes["T"] = _route(broker_a={0: A0, 1: A1}, broker_b={0: B0, 1: B1})
        await inst.update_route("T")
        await inst.send_heartbeats()
        assert sorted(api.heartbeats) == sorted([A0, A1, B0, B1])
        assert set(inst.broker_versions) == {A0, A1, B0, B1}

        api.routes["T"] = _route(broker_a={0: A0, 1: A1})
        with capture_logs() as logs:
            await inst.update_route("T")
        assert inst.all_broker_addrs() == sorted([A0, A1])
        assert set(inst.brokers) == {"broker-a"}
        assert set(inst.broker_versions) == {A0, A1}
        removed = [(e["broker"], e["addr"]) for e in logs
                   if e["event"] == "broker.offline_removed"]
        assert sorted(removed) == [("broker-b", B0), ("broker-b", B1)]
        assert [e["broker"] for e in logs
                if e["event"] == "broker.offline_name_removed"] == ["broker-b"]
        assert all(e["log_level"] == "info" for e in logs if e["event"].startswith("broker."))

        # Lookups no longer answer with broker-b, not even after the fallback route update.
        with pytest.raises(MQClientError):
            await inst.find_broker_master("broker-b")
        with pytest.raises(MQClientError):
            await inst.find_broker_master("broker-b", "T")
        with pytest.raises(MQClientError):
            await inst.find_broker_in_subscribe("broker-b", 1, topic="T")
        assert await inst.find_broker_master("broker-a") == A0

        api.heartbeats.clear()
        await inst.send_heartbeats()
        assert sorted(api.heartbeats) == sorted([A0, A1])
    finally:
        await inst.close()


async def test_dropped_slave_is_forgotten_while_the_master_stays() -> None:
    inst, api = _instance()
    try:
        # U's route was fetched before broker-a's slave registered, T's after: the entry
        # holds T's view (master and slave).
        api.routes["U"] = _route(broker_a={0: A0})
        api.routes["T"] = _route(broker_a={0: A0, 1: A1}, broker_b={0: B0})
        await inst.update_route("U")
        await inst.update_route("T")
        assert await inst.find_broker_in_subscribe("broker-a", 1) == (A1, 1)

        # T leaves broker-a; the only route naming broker-a now (U's) has no slave.
        api.routes["T"] = _route(broker_b={0: B0})
        await inst.update_route("T")
        assert inst.brokers["broker-a"].addrs == {0: A0}
        assert inst.all_broker_addrs() == sorted([A0, B0])
        assert await inst.find_broker_master("broker-a") == A0
        # The slave asked for is not there: the master answers instead, and only it.
        assert await inst.find_broker_in_subscribe("broker-a", 1) == (A0, 0)
        with pytest.raises(MQClientError):
            await inst.find_broker_in_subscribe("broker-a", 1, only_this_broker=True)
    finally:
        await inst.close()


async def test_address_still_listed_by_another_topic_is_kept() -> None:
    inst, api = _instance()
    try:
        api.routes["T"] = _route(broker_a={0: A0}, broker_b={0: B0, 1: B1})
        api.routes["U"] = _route(broker_b={0: B0, 1: B1})
        await inst.update_route("T")
        await inst.update_route("U")

        api.routes["T"] = _route(broker_a={0: A0})
        await inst.update_route("T")
        assert inst.all_broker_addrs() == sorted([A0, B0, B1])
        assert await inst.find_broker_master("broker-b") == B0

        # Once U's route no longer names it either, it goes.
        api.routes["U"] = _route(broker_a={0: A0})
        await inst.update_route("U")
        assert inst.all_broker_addrs() == [A0]
    finally:
        await inst.close()


async def test_periodic_refresh_forgets_and_a_failed_fetch_keeps_its_route() -> None:
    inst, api = _instance()
    try:
        api.routes["T"] = _route(broker_a={0: A0}, broker_b={0: B0})
        api.routes["U"] = _route(broker_b={0: B0}, broker_c={0: C0})
        await inst.update_route("T")
        await inst.update_route("U")

        # Neither newer route names broker-b: a refresh round forgets it.
        api.routes["T"] = _route(broker_a={0: A0})
        api.routes["U"] = _route(broker_c={0: C0})
        await inst.refresh_routes()
        assert inst.all_broker_addrs() == sorted([A0, C0])

        # broker-b is back in both routes; then T drops it again while U's route cannot be
        # fetched: U's held route still lists broker-b, so it is kept.
        api.routes["T"] = _route(broker_a={0: A0}, broker_b={0: B0})
        api.routes["U"] = _route(broker_b={0: B0}, broker_c={0: C0})
        await inst.refresh_routes()
        assert inst.all_broker_addrs() == sorted([A0, B0, C0])
        api.routes["T"] = _route(broker_a={0: A0})
        api.routes["U"] = MQClientError("no name server answered")
        await inst.refresh_routes()
        assert inst.all_broker_addrs() == sorted([A0, B0, C0])
        assert await inst.find_broker_master("broker-b") == B0
    finally:
        await inst.close()


async def test_a_route_the_owner_no_longer_uses_is_forgotten_not_refreshed() -> None:
    """With ``route_topics`` (a consumer's subscriptions), the refresh drops the route of a
    topic no longer used (unsubscribed, or looked up for one send), stops asking the name
    servers for it, and forgets the brokers only that route listed; without it (a producer)
    every route is kept, as Java's publish table."""
    inst, api = _instance()
    used = {"T", "U"}
    inst.route_topics = lambda: used
    fetched: list[str] = []
    get_route = api.get_route

    async def counting(namesrv: str, topic: str) -> TopicRouteData:
        fetched.append(topic)
        return await get_route(namesrv, topic)

    api.get_route = counting  # type: ignore[method-assign]
    try:
        api.routes["T"] = _route(broker_a={0: A0})
        api.routes["U"] = _route(broker_c={0: C0})
        await inst.update_route("T")
        await inst.update_route("U")
        await inst.refresh_routes()
        assert sorted(fetched) == ["T", "T", "U", "U"]

        used.discard("U")
        fetched.clear()
        with capture_logs() as logs:
            await inst.refresh_routes()
            await inst.refresh_routes()
        assert fetched == ["T", "T"]
        assert set(inst.routes) == {"T"}
        assert inst.all_broker_addrs() == [A0]
        assert [e["topics"] for e in logs if e["event"] == "route.unused_forgotten"] == [["U"]]
        api.heartbeats.clear()
        await inst.send_heartbeats()
        assert api.heartbeats == [A0]

        # Looked up again (subscribed again, or another send): held and refreshed again.
        used.add("U")
        await inst.route("U")
        fetched.clear()
        await inst.refresh_routes()
        assert sorted(fetched) == ["T", "U"]

        inst.route_topics = None
        used.clear()
        await inst.refresh_routes()
        assert set(inst.routes) == {"T", "U"}
    finally:
        await inst.close()


async def test_a_consumer_keeps_the_routes_of_its_subscriptions_and_retry_topic(
        monkeypatch: pytest.MonkeyPatch) -> None:
    no_broker(monkeypatch)
    c = PushConsumer("G", "127.0.0.1:9876")
    c.subscribe("T", listener=lambda m: None)
    c.subscribe("U", listener=lambda m: None)
    await c.start()
    try:
        assert c.instance.route_topics is not None
        assert set(c.instance.route_topics()) == {"T", "U", "%RETRY%G"}
        c.unsubscribe("U")
        assert set(c.instance.route_topics()) == {"T", "%RETRY%G"}
    finally:
        await c.stop()


async def test_lookup_fallback_still_finds_a_broker_new_to_the_route() -> None:
    inst, api = _instance()
    try:
        api.routes["T"] = _route(broker_a={0: A0})
        await inst.update_route("T")
        api.routes["T"] = _route(broker_c={0: C0})
        assert await inst.find_broker_master("broker-c", "T") == C0
        assert inst.all_broker_addrs() == [C0]
    finally:
        await inst.close()


async def test_broker_name_given_to_another_address_is_dropped() -> None:
    inst, api = _instance()
    try:
        api.routes["T"] = _route(broker_a={0: A0})
        await inst.update_route("T")
        # The same process now registers as broker-c: broker-a does not answer with it.
        api.routes["T"] = _route(broker_c={0: A0})
        await inst.update_route("T")
        assert set(inst.brokers) == {"broker-c"}
        with pytest.raises(MQClientError):
            await inst.find_broker_master("broker-a")
    finally:
        await inst.close()


async def test_no_heartbeat_on_connect_to_a_forgotten_broker() -> None:
    inst, api = _instance()
    try:
        api.routes["T"] = _route(broker_a={0: A0}, broker_b={0: B0})
        await inst.update_route("T")
        api.routes["T"] = _route(broker_a={0: A0})
        await inst.update_route("T")
        inst._connected(B0)  # a connection to it, from a request made with an older address
        assert not inst._connect_heartbeats
        inst._connected(A0)
        await asyncio.gather(*inst._connect_heartbeats)
        assert api.heartbeats == [A0]
    finally:
        await inst.close()


async def test_heartbeat_answer_from_a_broker_forgotten_meanwhile_is_not_kept() -> None:
    inst, api = _instance()
    try:
        api.routes["T"] = _route(broker_a={0: A0}, broker_b={0: B0})
        await inst.update_route("T")
        api.hold_heartbeats = asyncio.Event()
        round_ = asyncio.ensure_future(inst.send_heartbeats())
        await api.heartbeats_waiting.wait()
        api.routes["T"] = _route(broker_a={0: A0})
        await inst.update_route("T")
        api.hold_heartbeats.set()
        status = await round_
        assert status == {A0: True, B0: True}
        assert set(inst.broker_versions) == {A0}
    finally:
        await inst.close()

"""A rebalance that changes a topic's queues tells the broker the subscription's new version
before the pulls carry it, also while a periodic heartbeat is under way.

The broker refuses a pull whose ``subVersion`` is newer than the one its last heartbeat
registered (SUBSCRIPTION_NOT_LATEST). The Java client (5.3.3) skips the heartbeat that carries
the new version when its scheduled heartbeat holds the lock at that moment ("lock heartBeat,
but failed"), and the broker then refuses every pull of the topic until a later rebalance that
changes something sends one: a 20 s stall at the default rebalance interval, seen in the
benchmark's Java runs. Here the round waits for the heartbeat in flight and then sends its own.
"""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

from rmq_async.client.instance import ClientInstance, _BrokerAddrs
from rmq_async.consumer.options import MessageModel
from rmq_async.consumer.process_queue import ProcessQueue
from rmq_async.consumer.rebalance import Rebalancer
from rmq_async.consumer.subscriptions import Subscription, Subscriptions
from rmq_async.protocol.filter import build_subscription
from rmq_async.protocol.types import MessageQueue

TOPIC = "orders"
Q0 = MessageQueue(TOPIC, "broker-a", 0)
Q1 = MessageQueue(TOPIC, "broker-a", 1)


class _Api:
    """Records the topic's subscription version of every heartbeat; the first one (the
    periodic round) waits for ``release``."""

    def __init__(self) -> None:
        self.versions: list[int] = []
        self.first_in_flight = asyncio.Event()
        self.release = asyncio.Event()

    async def heartbeat(self, addr: str, data: Any) -> int:
        self.versions.append(next(d.sub_version for d in data if d.topic == TOPIC))
        if len(self.versions) == 1:
            self.first_in_flight.set()
            await self.release.wait()
        return 0


class _Pull:
    def __init__(self) -> None:
        self.started: list[MessageQueue] = []

    async def stop_queue(self, mq: MessageQueue) -> None:
        return None

    def start_queue(self, req: Any) -> None:
        self.started.append(req.mq)


class _Store:
    async def persist(self, mq: MessageQueue) -> None:
        return None

    def remove(self, mq: MessageQueue) -> None:
        return None


async def test_a_changed_allocation_announces_its_version_after_a_heartbeat_in_flight() -> None:
    subs = Subscriptions("G", MessageModel.CLUSTERING)
    subs.add(Subscription(topic=TOPIC, expression="*", data=build_subscription(TOPIC, "*")))
    subs.reset_retry()
    data = subs.subscription_data(TOPIC)
    assert data is not None
    old = data.sub_version

    instance = ClientInstance("127.0.0.1:9876", "client-1",
                              heartbeat_source=subs.heartbeat_data_set)  # type: ignore[arg-type]
    instance.brokers["broker-a"] = _BrokerAddrs("DefaultCluster", {0: "127.0.0.1:10911"})
    api = _Api()
    instance.api = api  # type: ignore[assignment]

    async def start_offset(mq: MessageQueue) -> int:
        return 0

    pull = _Pull()
    rt: Any = SimpleNamespace(
        group="G", stopping=False, process_queues={Q0: ProcessQueue()}, offset_store=_Store(),
        options=SimpleNamespace(message_model=MessageModel.CLUSTERING, pull_max_idle_time=120.0),
        subscriptions=subs, instance=instance,
        thresholds=SimpleNamespace(recompute=lambda topic, n: None),
        compute_pull_from_where=start_offset)
    rebalancer = Rebalancer(rt, pull, orderly=None)  # type: ignore[arg-type]

    periodic = asyncio.ensure_future(instance.send_heartbeats())
    await api.first_in_flight.wait()  # the periodic heartbeat holds the lock
    round_ = asyncio.ensure_future(rebalancer.apply_allocation(TOPIC, {Q0, Q1}))
    for _ in range(20):
        await asyncio.sleep(0)
    # The round waits for the lock; meanwhile pulls keep the version the broker knows.
    assert not round_.done()
    assert data.sub_version == old
    api.release.set()
    await asyncio.gather(periodic, round_)

    new = data.sub_version
    assert new > old
    # The periodic heartbeat carried the old version, then the round's own the new one; the
    # pulls switched to it only after that.
    assert api.versions == [old, new]
    assert pull.started == [Q1]

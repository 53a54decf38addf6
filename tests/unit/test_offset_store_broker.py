"""BrokerOffsetStore: what its periodic round sends while the pull loop corrects offsets."""

from __future__ import annotations

import asyncio
from typing import Any, cast

from rmq_async.client.instance import ClientInstance
from rmq_async.consumer.offset_store import BrokerOffsetStore
from rmq_async.protocol.types import MessageQueue

Q0 = MessageQueue("T", "broker-a", 0)
Q1 = MessageQueue("T", "broker-a", 1)
Q2 = MessageQueue("T", "broker-a", 2)


class _Api:
    """Records UPDATE_CONSUMER_OFFSET calls; the first one waits for ``release``."""

    def __init__(self) -> None:
        self.sent: list[tuple[MessageQueue, int]] = []
        self.first_waiting = asyncio.Event()
        self.release = asyncio.Event()

    async def update_consumer_offset(self, addr: str, group: str, mq: MessageQueue, offset: int,
                                     *, oneway: bool = True) -> None:
        self.sent.append((mq, offset))
        if len(self.sent) == 1:
            self.first_waiting.set()
            await self.release.wait()


class _Instance:
    def __init__(self) -> None:
        self.api = _Api()

    async def find_broker_in_subscribe(self, broker_name: str, broker_id: int,
                                       **kw: Any) -> tuple[str, int]:
        return "127.0.0.1:10911", 0


async def test_a_newer_offset_is_sent_only_once_the_older_one_is_answered() -> None:
    """A queue never has two writes in flight: the broker runs a connection's requests side
    by side and could apply the older after the newer. Here the round's 20 for Q1 is on its
    way when the pull loop learns that the broker moved Q1 back (an admin's reset) and
    persists the corrected 10: the 10 waits for the 20's answer, so the broker keeps 10; Q2,
    given up meanwhile, is not written."""
    instance = _Instance()
    api = instance.api
    store = BrokerOffsetStore(cast("ClientInstance", instance), "G")
    for mq in (Q1, Q0, Q2):
        store.update(mq, 20, increase_only=False)
    round_ = asyncio.ensure_future(store.persist_all({Q0, Q1, Q2}, oneway=False))
    await api.first_waiting.wait()  # Q1's 20 is on its way to the broker
    store.freeze(Q1, 10)
    persisted = asyncio.ensure_future(store.persist(Q1))
    store.remove(Q2)
    for _ in range(10):
        await asyncio.sleep(0)
    assert api.sent == [(Q1, 20)]  # the 10 waits for the 20's answer
    api.release.set()
    await asyncio.gather(round_, persisted)
    assert sorted(api.sent) == [(Q0, 20), (Q1, 10), (Q1, 20)]
    assert api.sent.index((Q1, 20)) < api.sent.index((Q1, 10))
    assert store.read_memory(Q1) == 10


class _CountingApi:
    """Records how many UPDATE_CONSUMER_OFFSET requests of each topic are in flight."""

    def __init__(self) -> None:
        self.in_flight: dict[str, int] = {}
        self.most: dict[str, int] = {}
        self.most_overall = 0

    async def update_consumer_offset(self, addr: str, group: str, mq: MessageQueue, offset: int,
                                     *, oneway: bool = True) -> None:
        self.in_flight[mq.topic] = self.in_flight.get(mq.topic, 0) + 1
        self.most[mq.topic] = max(self.most.get(mq.topic, 0), self.in_flight[mq.topic])
        self.most_overall = max(self.most_overall, sum(self.in_flight.values()))
        await asyncio.sleep(0.01)
        self.in_flight[mq.topic] -= 1


async def test_one_topics_queues_are_written_one_after_the_other_other_topics_side_by_side() -> None:
    """A 5.3.3 broker creates a group's offset map of a topic on its first write without a
    lock: of two first writes of one topic that meet, one is lost (seen in a broker test whose
    final offsets went out all at once). Queues of one topic on one broker go one after the
    other; other topics (and brokers) side by side."""
    instance = _Instance()
    api = _CountingApi()
    instance.api = api  # type: ignore[assignment]
    store = BrokerOffsetStore(cast("ClientInstance", instance), "G")
    queues = [MessageQueue(t, "broker-a", q) for t in ("T", "U") for q in range(4)]
    for mq in queues:
        store.update(mq, 7, increase_only=False)
    await store.persist_all(set(queues), oneway=False)
    assert api.most == {"T": 1, "U": 1} and api.most_overall == 2


class _SlowRouteInstance(_Instance):
    """The first broker address lookup waits for ``route`` (a route refresh in progress)."""

    def __init__(self) -> None:
        super().__init__()
        self.lookups = 0
        self.first_lookup_waiting = asyncio.Event()
        self.route = asyncio.Event()

    async def find_broker_in_subscribe(self, broker_name: str, broker_id: int,
                                       **kw: Any) -> tuple[str, int]:
        self.lookups += 1
        if self.lookups == 1:
            self.first_lookup_waiting.set()
            await self.route.wait()
        return "127.0.0.1:10911", 0


async def test_a_queue_given_up_while_its_broker_is_looked_up_is_not_sent_again() -> None:
    instance = _SlowRouteInstance()
    instance.api.release.set()  # the sends themselves answer at once here
    store = BrokerOffsetStore(cast("ClientInstance", instance), "G")
    store.update(Q0, 20, increase_only=False)
    round_ = asyncio.ensure_future(store.persist_all({Q0}, oneway=False))
    await instance.first_lookup_waiting.wait()  # the round waits for Q0's broker address
    # Meanwhile the queue is consumed up to 30 and a rebalance gives it up, which persists
    # its offset and then forgets the queue.
    store.update(Q0, 30, increase_only=True)
    await store.persist(Q0)
    store.remove(Q0)
    instance.route.set()
    await round_
    # Before, the round went on to send the 20 it had been handed once the address came, after
    # the 30 the removal wrote (the broker went back to 20, and the next owner of the queue
    # consumed 10 messages twice), and kept a record of a queue the store no longer has.
    assert instance.api.sent == [(Q0, 30)]
    assert store.read_memory(Q0) < 0
    assert Q0 not in store._persisted


async def test_a_queue_given_up_during_its_write_leaves_no_lock_behind() -> None:
    """remove() keeps the lock of a write in flight (the write still needs it); the write
    drops it once done, or every queue ever held kept one."""
    instance = _Instance()
    api = instance.api
    store = BrokerOffsetStore(cast("ClientInstance", instance), "G")
    store.update(Q0, 20, increase_only=False)
    write = asyncio.ensure_future(store.persist(Q0))
    await api.first_waiting.wait()
    store.remove(Q0)
    assert Q0 in store._writing  # still held by the write
    api.release.set()
    await write
    assert api.sent == [(Q0, 20)]
    assert Q0 not in store._writing
    # A write of a queue given up before it took the lock leaves none either.
    await store._send(Q1, 5, oneway=False)
    assert api.sent == [(Q0, 20)] and Q1 not in store._writing

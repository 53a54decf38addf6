"""The pull loop's offset corrections and the rebalance's self-healing, as Java 5.3.3 does them:
an idle broadcasting queue keeps its place (``correctTagsOffset`` in both models), an
OFFSET_ILLEGAL fix cut short by a pause or a failed offsets file does not strand its queue,
and a queue whose start offset could not be read is retried at the short interval."""

from __future__ import annotations

import asyncio
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from structlog.testing import capture_logs

from rmq_async.client.api import PullStatus
from rmq_async.consumer.offset_store import LocalFileOffsetStore
from rmq_async.consumer.options import ConsumerOptions
from rmq_async.consumer.process_queue import ProcessQueue
from rmq_async.consumer.pull import PullService
from rmq_async.consumer.rebalance import Rebalancer
from rmq_async.consumer.runtime import ConsumerRuntime, PullThresholds
from rmq_async.consumer.service import PullRequest
from rmq_async.consumer.tasks import TaskOwner
from rmq_async.protocol.types import MessageQueue
from tests.unit.test_pull_loop import MQ, Pending, router, runtime


def _answer(status: PullStatus, next_offset: int) -> Pending:
    return Pending(SimpleNamespace(
        status=status, next_begin_offset=next_offset, min_offset=next_offset,
        max_offset=next_offset + 100, suggest_which_broker_id=0, offset_delta=None, body=b""))


def _ready_to_take_queues(rt: Any, start: int = 500) -> None:
    """What ``apply_allocation`` needs of the runtime to take a queue."""
    data = SimpleNamespace(tags_set=None, sub_version=0, expression_type="TAG")

    async def compute_pull_from_where(mq: MessageQueue) -> int:
        return start

    async def send_heartbeats() -> None:
        return None

    rt.client_id = "me"
    rt.compute_pull_from_where = compute_pull_from_where
    rt.subscriptions.subscription_data = lambda t: data
    rt.subscriptions.version_override = {}
    rt.instance = SimpleNamespace(send_heartbeats=send_heartbeats)


async def test_an_idle_broadcast_queue_keeps_its_place_in_the_offsets_file(
        tmp_path: Path) -> None:
    """A broadcasting queue taken at its max offset that gets nothing during a run: the offset
    pulled to is stored and written, so the next start resumes there, not at the new max
    (which would skip what was sent while the consumer was down)."""
    opts = ConsumerOptions.from_kwargs("G", message_model="BROADCASTING")
    store = LocalFileOffsetStore(tmp_path, "cid", "G")
    await store.load()
    pq = ProcessQueue()
    rt = runtime(opts, pq)
    rt.offset_store = store

    class Pull(PullService):
        async def _send(self, req: PullRequest, offset: int) -> Any:
            await asyncio.sleep(0.01)  # a long poll that ends with nothing new
            return _answer(PullStatus.NO_NEW_MSG, 100)

    pull = Pull(rt, router([]), on_queue_forgotten=lambda: None)
    pull.start_queue(PullRequest(MQ, pq, 100))
    await asyncio.sleep(0.1)
    await pull.aclose()
    await store.persist_all({MQ}, oneway=False)  # as stop() does

    again = LocalFileOffsetStore(tmp_path, "cid", "G")
    await again.load()

    async def max_offset(mq: MessageQueue) -> int:
        return 150  # fifty messages sent while the consumer was down

    rt2: Any = SimpleNamespace(offset_store=again, options=opts, _max_offset=max_offset)
    assert await ConsumerRuntime.compute_pull_from_where(rt2, MQ) == 100


class _IllegalOffsetPull(PullService):
    """A pull service whose every pull is answered OFFSET_ILLEGAL, next offset 500."""

    async def _send(self, req: PullRequest, offset: int) -> Any:
        return _answer(PullStatus.OFFSET_ILLEGAL, 500)


class _SlowStore:
    def __init__(self) -> None:
        self.table: dict[MessageQueue, int] = {}
        self.persisting = asyncio.Event()

    def freeze(self, mq: MessageQueue, offset: int) -> None:
        self.table[mq] = offset

    def update(self, mq: MessageQueue, offset: int, *, increase_only: bool) -> None:
        self.table[mq] = offset

    async def persist(self, mq: MessageQueue) -> None:
        self.persisting.set()
        await asyncio.sleep(0.05)  # the UPDATE_CONSUMER_OFFSET round trip

    def remove(self, mq: MessageQueue) -> None:
        self.table.pop(mq, None)


async def test_a_pause_during_an_offset_illegal_fix_does_not_strand_the_queue() -> None:
    """pause()/resume() interrupt a queue's pull task; one that is persisting the corrected
    offset of an OFFSET_ILLEGAL finishes forgetting the queue, and the rebalance takes it
    again with a pull task."""
    opts = ConsumerOptions.from_kwargs("G")
    pq = ProcessQueue()
    rt = runtime(opts, pq)
    _ready_to_take_queues(rt)
    rt.offset_store = store = _SlowStore()
    woken: list[int] = []

    pull = _IllegalOffsetPull(rt, router([]), on_queue_forgotten=lambda: woken.append(1))
    pull.start_queue(PullRequest(MQ, pq, 0))
    try:
        async with asyncio.timeout(5):
            await store.persisting.wait()
        pull.interrupt(MQ)  # pause() at this moment
        async with asyncio.timeout(5):
            while MQ in rt.process_queues:
                await asyncio.sleep(0.01)
        assert woken == [1] and store.table.get(MQ) is None
        await Rebalancer(rt, pull, orderly=None).apply_allocation("T", {MQ})  # type: ignore[arg-type]
        assert rt.process_queues[MQ] is not pq and pull.is_pulling(MQ)
    finally:
        await pull.aclose()


async def test_an_offsets_file_error_during_an_offset_illegal_fix_does_not_strand_the_queue(
        tmp_path: Path) -> None:
    """Broadcasting, the offsets file cannot be written (here: its folder would have to be made
    under a file): logged, as Java's store logs its IOException, and the queue is forgotten
    and taken again."""
    blocker = tmp_path / "not-a-folder"
    blocker.write_text("x")
    opts = ConsumerOptions.from_kwargs("G", message_model="BROADCASTING")
    pq = ProcessQueue()
    rt = runtime(opts, pq)
    _ready_to_take_queues(rt)
    rt.offset_store = LocalFileOffsetStore(blocker, "cid", "G")

    pull = _IllegalOffsetPull(rt, router([]), on_queue_forgotten=lambda: None)
    with capture_logs() as logs:
        pull.start_queue(PullRequest(MQ, pq, 0))
        try:
            async with asyncio.timeout(5):
                while MQ in rt.process_queues:
                    await asyncio.sleep(0.01)
            await Rebalancer(rt, pull, orderly=None).apply_allocation("T", {MQ})  # type: ignore[arg-type]
            assert rt.process_queues[MQ] is not pq and pull.is_pulling(MQ)
        finally:
            await pull.aclose()
    assert any(e["event"] == "offset.file_write_failed" for e in logs), logs
    assert not any(e["event"] == "task.crashed" for e in logs), logs


async def test_a_failed_persist_of_an_offset_illegal_fix_still_forgets_the_queue() -> None:
    """Whatever the store's persist raises, the queue is forgotten and the rebalance woken
    (the pull task does not crash with the queue still in the table)."""
    opts = ConsumerOptions.from_kwargs("G")
    pq = ProcessQueue()
    rt = runtime(opts, pq)

    class FailingStore(_SlowStore):
        async def persist(self, mq: MessageQueue) -> None:
            raise RuntimeError("the broker's answer made no sense")

    rt.offset_store = FailingStore()
    woken: list[int] = []

    pull = _IllegalOffsetPull(rt, router([]), on_queue_forgotten=lambda: woken.append(1))
    with capture_logs() as logs:
        pull.start_queue(PullRequest(MQ, pq, 0))
        try:
            async with asyncio.timeout(5):
                while MQ in rt.process_queues:
                    await asyncio.sleep(0.01)
        finally:
            await pull.aclose()
    assert woken == [1]
    assert MQ not in pull.pull_from  # (the answer's suggestion goes with the queue)
    assert [e["event"] for e in logs if e["log_level"] == "warning"] == [
        "pull.offset_illegal", "pull.offset_fix_persist_failed"]


def _quiet_pulls(rt: Any) -> PullService:
    """A pull service for ``rt``, ready to take queues (start offset 7), whose pulls never
    get an answer."""
    _ready_to_take_queues(rt, start=7)
    rt.offset_store = _SlowStore()
    pull = PullService(rt, router([]), on_queue_forgotten=lambda: None)

    async def never(req: PullRequest, offset: int) -> Any:
        return Pending()

    pull._send = never  # type: ignore[method-assign]
    return pull


async def test_a_dropped_queue_left_without_a_pull_task_is_taken_again() -> None:
    """However a dropped queue came to stay in the table with no pull task, the next rebalance
    round takes it out and back in (Java gets there through pull expiry)."""
    opts = ConsumerOptions.from_kwargs("G")
    pq = ProcessQueue()
    pq.dropped = True
    rt = runtime(opts, pq)
    pull = _quiet_pulls(rt)
    try:
        await Rebalancer(rt, pull, orderly=None).apply_allocation("T", {MQ})  # type: ignore[arg-type]
        taken = rt.process_queues[MQ]
        assert taken is not pq and not taken.dropped and pull.is_pulling(MQ)
        assert pull.requests[MQ].next_offset == 7
    finally:
        await pull.aclose()


async def test_a_queue_still_being_given_up_is_not_taken_again_until_it_is() -> None:
    """An orderly queue given up while a batch of it ran on is released (persisted, unlocked)
    once that batch ends; taken again meanwhile, the release would unlock it under this
    client's new lock, or persist an older offset over the new one."""
    opts = ConsumerOptions.from_kwargs("G")
    rt = runtime(opts, ProcessQueue())
    rt.process_queues.clear()
    pull = _quiet_pulls(rt)
    releasing = {MQ}
    orderly = SimpleNamespace(releasing=lambda mq: mq in releasing)
    rebalancer = Rebalancer(rt, pull, orderly=orderly)  # type: ignore[arg-type]
    try:
        with capture_logs() as logs:
            await rebalancer.apply_allocation("T", {MQ})
        assert MQ not in rt.process_queues
        assert [e["event"] for e in logs if e["event"].startswith("rebalance.queue_still")] == [
            "rebalance.queue_still_releasing"]
        releasing.clear()
        await rebalancer.apply_allocation("T", {MQ})
        assert MQ in rt.process_queues and pull.is_pulling(MQ)
    finally:
        await pull.aclose()


async def test_a_queue_whose_start_offset_is_unknown_leaves_the_round_unbalanced() -> None:
    """The round is balanced only when the working queues are the allocated ones (Java
    ``rebalanceByTopic``): a queue not taken because its start offset could not be read is
    tried again after the short interval, not after ``rebalance_interval``."""
    mqs = [MessageQueue("T", "broker-a", i) for i in range(2)]
    opts = ConsumerOptions.from_kwargs("G")

    async def subscribe_queues(topic: str) -> list[MessageQueue]:
        return mqs

    async def find_any_broker(topic: str) -> str:
        return "addr"

    async def get_consumer_ids(addr: str, group: str) -> list[str]:
        return ["me"]

    async def compute_pull_from_where(mq: MessageQueue) -> int:
        return -1 if mq.queue_id == 1 else 0  # the offset query of queue 1 timed out

    async def send_heartbeats() -> None:
        return None

    data = SimpleNamespace(sub_version=0)
    rt: Any = SimpleNamespace(
        tasks=TaskOwner("consumer[G]"),
        group="G", client_id="me", options=opts, stopping=False, process_queues={},
        thresholds=PullThresholds(opts),
        subscriptions=SimpleNamespace(subscribed_topics=lambda: ["T"], is_orderly=lambda t: False,
                                      subscription_data=lambda t: data, version_override={}),
        instance=SimpleNamespace(subscribe_queues=subscribe_queues, find_any_broker=find_any_broker,
                                 api=SimpleNamespace(get_consumer_ids=get_consumer_ids),
                                 send_heartbeats=send_heartbeats),
        offset_store=SimpleNamespace(remove=lambda mq: None),
        compute_pull_from_where=compute_pull_from_where)
    started: list[MessageQueue] = []
    pull: Any = SimpleNamespace(start_queue=lambda req: started.append(req.mq),
                                is_pulling=lambda mq: mq in started)
    rebalancer = Rebalancer(rt, pull, orderly=None)
    await rebalancer.rebalance_once()
    assert started == [mqs[0]]
    assert rebalancer._last_round_balanced is False
    compute_pull_from_where_ok = 0

    async def now_known(mq: MessageQueue) -> int:
        return compute_pull_from_where_ok

    rt.compute_pull_from_where = now_known
    await rebalancer.rebalance_once()
    assert started == mqs and rebalancer._last_round_balanced is True


async def test_a_failed_start_offset_does_not_strand_the_queues_taken_before_it() -> None:
    """A malformed answer (a GET_MAX_OFFSET without its offset: ProtocolError) for the second
    queue of a round ended the round: the first queue, already in the table, never got a pull
    task, and later rounds left it alone until pull_max_idle_time (120 s)."""
    from rmq_async.protocol.errors import ProtocolError

    mq0, mq1 = MessageQueue("T", "broker-a", 0), MessageQueue("T", "broker-a", 1)
    opts = ConsumerOptions.from_kwargs("G")
    rt = runtime(opts, ProcessQueue())
    rt.process_queues = {}
    _ready_to_take_queues(rt)
    broken = {"on": True}

    async def compute(mq: MessageQueue) -> int:
        if mq == mq1 and broken["on"]:
            raise ProtocolError("GetMaxOffsetResponseHeader: required field 'offset' is missing")
        return 100

    rt.compute_pull_from_where = compute
    pull = PullService(rt, router([]), on_queue_forgotten=lambda: None)

    async def never(req: PullRequest, offset: int) -> Any:
        return Pending()

    pull._send = never  # type: ignore[method-assign]
    rebalancer = Rebalancer(rt, pull, orderly=None)  # type: ignore[arg-type]
    try:
        with capture_logs() as logs:
            await rebalancer.apply_allocation("T", {mq0, mq1})
        assert pull.is_pulling(mq0) and mq1 not in rt.process_queues
        assert rebalancer._retry  # the next round comes soon
        assert any(e["event"] == "rebalance.queue_add_failed" for e in logs)
        broken["on"] = False
        await rebalancer.apply_allocation("T", {mq0, mq1})
        assert pull.is_pulling(mq0) and pull.is_pulling(mq1)
        # A queue held with no pull task (its task crashed, say) is taken out and back in.
        await pull._owner.cancel(mq0)
        assert not pull.is_pulling(mq0) and mq0 in rt.process_queues
        await rebalancer.apply_allocation("T", {mq0, mq1})
        assert pull.is_pulling(mq0) and pull.requests[mq0].next_offset == 100
    finally:
        await pull.aclose()


async def test_a_subscribed_topic_without_a_route_does_not_spin_the_rebalancer() -> None:
    """Java counts a topic without a route as balanced, and never counts the retry topic's
    failures against the balance: such a topic made every round 'unbalanced', so rounds (and
    name-server lookups) came every second instead of every rebalance_interval."""
    from rmq_async.client.errors import NoRouteError

    opts = ConsumerOptions.from_kwargs("G")
    lookups: list[str] = []
    failing = {"%RETRY%G": NoRouteError("%RETRY%G"), "T": NoRouteError("T")}

    async def subscribe_queues(topic: str) -> list[MessageQueue]:
        lookups.append(topic)
        raise failing[topic]

    rt: Any = SimpleNamespace(
        tasks=TaskOwner("consumer[G]"),
        group="G", client_id="me", stopping=False, options=opts, process_queues={},
        subscriptions=SimpleNamespace(subscribed_topics=lambda: ["%RETRY%G", "T"]),
        instance=SimpleNamespace(subscribe_queues=subscribe_queues))
    rebalancer = Rebalancer(rt, pull=None, orderly=None)  # type: ignore[arg-type]
    await rebalancer.rebalance_once()
    assert lookups == ["%RETRY%G", "T"] and rebalancer._last_round_balanced is True
    from rmq_async.remoting.errors import RemotingConnectError

    failing["%RETRY%G"] = RemotingConnectError("broker down", addr="x")
    await rebalancer.rebalance_once()
    assert rebalancer._last_round_balanced is True  # the retry topic's failure: not counted
    failing["T"] = RemotingConnectError("broker down", addr="x")
    await rebalancer.rebalance_once()
    assert rebalancer._last_round_balanced is False  # a real topic's broker failure: retried soon


async def test_an_offset_illegal_on_a_locked_orderly_queue_gives_its_lock_back() -> None:
    """The pull loop forgot an orderly queue on OFFSET_ILLEGAL by itself, past the rebalancer's
    removal, so its broker lock was never given back: a client the next round gave the queue
    to could not lock it until the lock lapsed (60 s). Java removes it as a rebalance does."""
    from rmq_async.consumer.orderly import OrderlyConsumeService

    opts = ConsumerOptions.from_kwargs("G")
    pq = ProcessQueue()
    pq.locked = True
    rt = runtime(opts, pq)
    _ready_to_take_queues(rt)
    rt.offset_store = store = _SlowStore()
    unlocked: list[MessageQueue] = []

    async def master(*a: Any) -> str:
        return "127.0.0.1:10911"

    async def unlock_batch_mq(addr: str, group: str, cid: str, mqs: list[MessageQueue],
                              **kw: Any) -> None:
        unlocked.extend(mqs)

    rt.instance.find_broker_master = master
    rt.instance.api = SimpleNamespace(unlock_batch_mq=unlock_batch_mq)
    rt.subscriptions.is_orderly = lambda topic: True
    orderly = OrderlyConsumeService(rt)
    woken: list[int] = []
    pull = _IllegalOffsetPull(rt, router([]), on_queue_forgotten=lambda: woken.append(1))
    req = PullRequest(MQ, pq, 0)
    req.previously_locked = True
    pull.start_queue(req)
    try:
        async with asyncio.timeout(5):
            while not woken:
                await asyncio.sleep(0.01)
        assert pq.dropped and pq.offset_fixed and store.table[MQ] == 500  # for the rebalancer
        await Rebalancer(rt, pull, orderly).apply_allocation("T", set())  # another client's now
        assert unlocked == [MQ] and MQ not in rt.process_queues
    finally:
        await pull.aclose()


def _two_topics(
    opts: ConsumerOptions, queues: dict[str, list[MessageQueue]],
    consumer_ids: Any = None,
) -> tuple[Rebalancer, Any, dict[str, set[MessageQueue]]]:
    """A rebalancer over topics A and B of one broker; ``applied`` records each topic's
    allocation (and "dropped" once drop_unsubscribed ran). ``consumer_ids(topic)`` answers
    the member list (default: this client alone)."""

    async def subscribe_queues(topic: str) -> list[MessageQueue]:
        return queues[topic]

    async def find_any_broker(topic: str) -> str:
        return f"127.0.0.1:10911#{topic}"

    async def get_consumer_ids(addr: str, group: str) -> list[str]:
        if consumer_ids is not None:
            return await consumer_ids(addr.rpartition("#")[2])
        return ["me"]

    rt: Any = SimpleNamespace(
        tasks=TaskOwner("consumer[G]"),
        group="G", client_id="me", stopping=False, options=opts, process_queues={},
        subscriptions=SimpleNamespace(subscribed_topics=lambda: ["A", "B"]),
        instance=SimpleNamespace(subscribe_queues=subscribe_queues,
                                 find_any_broker=find_any_broker,
                                 api=SimpleNamespace(get_consumer_ids=get_consumer_ids)))
    rebalancer = Rebalancer(rt, pull=None, orderly=None)  # type: ignore[arg-type]
    applied: dict[str, set[MessageQueue]] = {}

    async def apply_allocation(topic: str, allocated: set[MessageQueue]) -> None:
        applied[topic] = allocated
        for mq in list(rt.process_queues):
            if mq.topic == topic and mq not in allocated:
                del rt.process_queues[mq]
        for mq in allocated:
            rt.process_queues.setdefault(mq, ProcessQueue())

    async def drop_unsubscribed(topics: set[str]) -> None:
        applied["dropped"] = set()

    rebalancer.apply_allocation = apply_allocation  # type: ignore[method-assign]
    rebalancer.drop_unsubscribed = drop_unsubscribed  # type: ignore[method-assign]
    return rebalancer, rt, applied


async def test_a_failing_allocation_strategy_leaves_its_topic_and_balances_the_others() -> None:
    """A user's strategy raising for one topic (a machine-room resolver without an entry)
    ended the whole round: the topics after it were never taken. Java's rebalanceByTopic
    catches it, logs it and counts that topic unbalanced."""
    from rmq_async.consumer.allocate import AllocateAveragely

    class PickyStrategy(AllocateAveragely):
        def allocate(self, group: str, current_cid: str, mq_all: list[MessageQueue],
                     cid_all: list[str]) -> list[MessageQueue]:
            if mq_all and mq_all[0].topic == "A":
                raise KeyError("no machine room for broker-a")
            return super().allocate(group, current_cid, mq_all, cid_all)

    opts = ConsumerOptions.from_kwargs("G", allocate_strategy=PickyStrategy())
    queues = {t: [MessageQueue(t, "broker-a", i) for i in range(2)] for t in ("A", "B")}
    rebalancer, _, applied = _two_topics(opts, queues)
    with capture_logs() as logs:
        await rebalancer.rebalance_once()
    assert applied == {"B": set(queues["B"]), "dropped": set()}
    assert rebalancer._last_round_balanced is False  # topic A: tried again soon
    failed = [e for e in logs if e["event"] == "rebalance.allocate_failed"]
    assert [(e["topic"], e["error"]) for e in failed] == [
        ("A", "KeyError: 'no machine room for broker-a'")]


async def test_a_garbled_member_list_leaves_its_topic_and_balances_the_others() -> None:
    """A broker's member-list answer that does not decode (a ProtocolError) ended the whole
    round like the strategy above. Java's findConsumerIdList catches it and returns null:
    that topic is unbalanced, the others are taken."""
    from rmq_async.protocol.errors import ProtocolError

    queues = {t: [MessageQueue(t, "broker-a", i) for i in range(2)] for t in ("A", "B")}

    async def consumer_ids(topic: str) -> list[str]:
        if topic == "A":
            raise ProtocolError("consumer list body is not a JSON object")
        return ["me"]

    rebalancer, _, applied = _two_topics(ConsumerOptions.from_kwargs("G"), queues,
                                         consumer_ids)
    with capture_logs() as logs:
        await rebalancer.rebalance_once()
    assert applied == {"B": set(queues["B"]), "dropped": set()}
    assert rebalancer._last_round_balanced is False
    assert [e["topic"] for e in logs if e["event"] == "rebalance.topic_failed"] == ["A"]


async def test_broadcasting_gives_up_the_queues_of_a_topic_with_none_readable() -> None:
    """A topic whose queues all lost the read permission (or were cut to none) has an empty
    queue set. Java's broadcasting rebalance applies it: the queues are given up and the
    round is balanced. They were kept, pulled (each pull refused) and retried every second.
    Clustering keeps them, as Java's strategies refuse an empty queue list."""
    for model, kept in (("BROADCASTING", False), ("CLUSTERING", True)):
        queues = {t: _all(t) for t in ("A", "B")}
        rebalancer, rt, _ = _two_topics(
            ConsumerOptions.from_kwargs("G", message_model=model), queues)
        await rebalancer.rebalance_once()
        assert set(rt.process_queues) == set(_all("A")) | set(_all("B"))
        queues["A"] = []  # the route now has no readable queue of A
        with capture_logs():
            await rebalancer.rebalance_once()
        expected = set(_all("B")) | (set(_all("A")) if kept else set())
        assert set(rt.process_queues) == expected, model
        assert rebalancer._last_round_balanced is not kept, model


def _all(topic: str) -> list[MessageQueue]:
    return [MessageQueue(topic, "broker-a", i) for i in range(2)]

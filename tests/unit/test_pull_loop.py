"""The pull loop of one queue, without a broker: a held-back queue is not an idle one, and an
interrupted pipelined pull does not strand the chunk it followed."""

from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace
from typing import Any

import pytest

from rmq_async.client.api import PullStatus
from rmq_async.consumer.options import ConsumerOptions
from rmq_async.consumer.process_queue import ProcessQueue
from rmq_async.consumer.pull import PullService
from rmq_async.consumer.rebalance import Rebalancer
from rmq_async.consumer.runtime import PullThresholds
from rmq_async.consumer.service import PullRequest
from rmq_async.consumer.tasks import TaskOwner
from rmq_async.protocol.types import MessageExt, MessageQueue

MQ = MessageQueue("T", "broker-a", 0)


class Pending:
    """A PULL_MESSAGE in flight: answered with ``result``, or never (``None``)."""

    def __init__(self, result: Any = None) -> None:
        self._result = result
        self.sent_at = time.monotonic()

    async def result(self) -> Any:
        if self._result is None:
            await asyncio.Event().wait()
        return self._result

    def cancel(self) -> None:
        pass


def found(first: int, n: int) -> Any:
    msgs = [MessageExt("T", b"x", 0, i) for i in range(first, first + n)]
    return SimpleNamespace(status=PullStatus.FOUND, next_begin_offset=first + n, min_offset=0,
                           max_offset=10_000, suggest_which_broker_id=0, offset_delta=None,
                           body=b"", decode=lambda: msgs)


def runtime(opts: ConsumerOptions, pq: ProcessQueue, **extra: Any) -> Any:
    async def nothing(*_: Any) -> None:
        return None

    return SimpleNamespace(
        tasks=TaskOwner("consumer[G]"),
        group="G", stopping=False, options=opts, paused=set(), thresholds=PullThresholds(opts),
        process_queues={MQ: pq}, retry_topic="%RETRY%G",
        stats=SimpleNamespace(record_pull=lambda *a: None),
        subscriptions=SimpleNamespace(subscription_data=lambda t: SimpleNamespace(tags_set=None),
                                      topics={}, is_orderly=lambda t: False),
        offset_store=SimpleNamespace(persist=nothing, remove=lambda mq: None), **extra)


def router(submitted: list[int]) -> Any:
    service = SimpleNamespace(in_order=False, pull_delay=lambda t: 0.0)
    return SimpleNamespace(
        service_for=lambda t: service,
        submit=lambda msgs, pq, mq, first: submitted.extend(m.queue_offset for m in msgs))


@pytest.mark.parametrize("held_by", ["pause", "cached_count"])
async def test_a_held_back_queue_is_not_pull_expired_and_the_rebalance_keeps_it(
        held_by: str) -> None:
    """Java refreshes lastPullTimestamp at the top of pullMessage, before the pause and flow
    control checks: a queue held back longer than pull_max_idle_time is not dropped."""
    opts = ConsumerOptions.from_kwargs("G", pull_time_delay_when_suspend=0.01,
                                       pull_time_delay_when_flow_control=0.01,
                                       pull_threshold_for_queue=1, pull_max_idle_time=0.15)
    pq = ProcessQueue()
    rt = runtime(opts, pq)
    if held_by == "pause":
        rt.paused.add("T")
    else:
        pq.put_messages([MessageExt("T", b"x", 0, i) for i in range(2)])  # over the limit of 1
    pull = PullService(rt, router([]), on_queue_forgotten=lambda: None)
    pull.start_queue(PullRequest(MQ, pq, 0))
    try:
        await asyncio.sleep(0.4)  # held back for more than pull_max_idle_time
        assert not pq.is_pull_expired(time.monotonic(), opts.pull_max_idle_time)
        rebalancer = Rebalancer(rt, pull, orderly=None)  # type: ignore[arg-type]
        await rebalancer.apply_allocation("T", {MQ})
        assert not pq.dropped and rt.process_queues[MQ] is pq
    finally:
        await pull.aclose()


async def test_an_interrupt_during_the_pipelined_pull_still_hands_on_the_cached_chunk() -> None:
    """pause()/resume() cancel a queue's loop; when that happens while the next pull is being
    sent (a reconnect, a route refresh), the chunk cached just before is handed on all the
    same, instead of staying cached unconsumed with next_offset already past it."""
    submitted: list[int] = []

    class Pull(PullService):
        sends = 0

        async def _send(self, req: PullRequest, offset: int) -> Any:
            self.sends += 1
            if self.sends == 1:
                return Pending(found(offset, 32))
            if self.sends == 2:  # the pipelined pull: slow to go out
                await asyncio.sleep(0.05)
            return Pending()

    opts = ConsumerOptions.from_kwargs("G")
    pq = ProcessQueue()
    pull = Pull(runtime(opts, pq), router(submitted), on_queue_forgotten=lambda: None)
    req = PullRequest(MQ, pq, 0)
    pull.start_queue(req)
    try:
        async with asyncio.timeout(5):
            while pq.msg_count == 0:
                await asyncio.sleep(0.001)
        pull.interrupt(MQ)  # consumer.pause("T") while the pipelined pull is under way
        await asyncio.sleep(0.1)
        assert req.next_offset == 32
        assert submitted == list(range(32))
    finally:
        await pull.aclose()


async def test_pulled_messages_count_what_the_tag_filter_kept() -> None:
    """Java's pull TPS counts the messages its client-side tag filter kept (a broker filters by
    tag hash, so the client drops the collisions); they were counted before the filter."""
    from rmq_async.protocol.filter import build_subscription

    submitted: list[int] = []
    recorded: list[tuple[str, int]] = []

    class Pull(PullService):
        sends = 0

        async def _send(self, req: PullRequest, offset: int) -> Any:
            self.sends += 1
            if self.sends > 1:
                return Pending()
            msgs = [MessageExt("T", b"x", 0, i, properties={"TAGS": "a" if i % 4 else "b"})
                    for i in range(8)]
            return Pending(SimpleNamespace(
                status=PullStatus.FOUND, next_begin_offset=8, min_offset=0, max_offset=8,
                suggest_which_broker_id=0, offset_delta=None, body=b"", decode=lambda: msgs))

    opts = ConsumerOptions.from_kwargs("G")
    pq = ProcessQueue()
    rt = runtime(opts, pq)
    sub = build_subscription("T", "a")
    rt.subscriptions.subscription_data = lambda t: sub
    rt.stats = SimpleNamespace(record_pull=lambda topic, n, rtt: recorded.append((topic, n)))
    pull = Pull(rt, router(submitted), on_queue_forgotten=lambda: None)
    pull.start_queue(PullRequest(MQ, pq, 0))
    try:
        async with asyncio.timeout(5):
            while not submitted:
                await asyncio.sleep(0.001)
    finally:
        await pull.aclose()
    assert submitted == [1, 2, 3, 5, 6, 7]
    assert recorded == [("T", 6)]


async def test_a_queue_taken_in_the_other_mode_hands_nothing_on_and_pulls_no_more() -> None:
    """A queue taken orderly whose topic is consumed concurrently now (subscribed again): its
    chunks would reach the concurrent workers on a ProcessQueue that an orderly turn may work
    on too. Until the rebalance retakes it, it hands nothing on and pulls no more."""
    submitted: list[int] = []

    class Pull(PullService):
        sends = 0

        async def _send(self, req: PullRequest, offset: int) -> Any:
            self.sends += 1
            return Pending(found(offset, 32))

    opts = ConsumerOptions.from_kwargs("G", pull_time_delay_when_suspend=0.01)
    pq = ProcessQueue()
    pq.ordered = True  # taken while the topic was orderly; the router says concurrent now
    pull = Pull(runtime(opts, pq), router(submitted), on_queue_forgotten=lambda: None)
    pull.start_queue(PullRequest(MQ, pq, 0))
    try:
        await asyncio.sleep(0.1)
        assert submitted == [] and pull.sends == 0
        pq.ordered = False  # (as the queue retaken in the new mode)
        async with asyncio.timeout(5):
            while not submitted:
                await asyncio.sleep(0.005)
        assert submitted[:32] == list(range(32))
    finally:
        await pull.aclose()


async def test_a_found_answer_the_tag_filter_emptied_is_followed_at_once_despite_pull_interval(
) -> None:
    """Java pulls again at once when its client-side tag filter left nothing of a FOUND answer
    (a tag hash collision), and waits pull_interval only after a chunk it dispatched."""
    from rmq_async.protocol.filter import build_subscription

    sent_at: list[float] = []

    class Pull(PullService):
        async def _send(self, req: PullRequest, offset: int) -> Any:
            sent_at.append(time.monotonic())
            if len(sent_at) > 3:
                return Pending()
            tag = "b" if len(sent_at) < 3 else "a"  # two answers the filter empties, then one
            msgs = [MessageExt("T", b"x", 0, offset + i, properties={"TAGS": tag})
                    for i in range(4)]
            return Pending(SimpleNamespace(
                status=PullStatus.FOUND, next_begin_offset=offset + 4, min_offset=0,
                max_offset=100, suggest_which_broker_id=0, offset_delta=None, body=b"",
                decode=lambda: msgs))

    opts = ConsumerOptions.from_kwargs("G", pull_interval=2.0)
    pq = ProcessQueue()
    rt = runtime(opts, pq)
    sub = build_subscription("T", "a")
    rt.subscriptions.subscription_data = lambda t: sub
    submitted: list[int] = []
    pull = Pull(rt, router(submitted), on_queue_forgotten=lambda: None)
    pull.start_queue(PullRequest(MQ, pq, 0))
    try:
        async with asyncio.timeout(1.5):  # under one pull_interval
            while not submitted:
                await asyncio.sleep(0.005)
        await asyncio.sleep(0.2)
        assert submitted == [8, 9, 10, 11]
        assert len(sent_at) == 3  # the pull after the dispatched chunk waits pull_interval
    finally:
        await pull.aclose()


async def test_a_queue_given_up_forgets_the_replica_it_was_told_to_pull_from() -> None:
    """The broker's suggestion of a replica (a slave while the master is busy) is kept per
    queue for its next pulls; a queue given up takes it along, and its refusal (it was kept for
    every queue ever held, and a queue taken again started at a replica suggested long
    before)."""
    class Pull(PullService):
        async def _send(self, req: PullRequest, offset: int) -> Any:
            if offset > 0:
                return Pending()
            answer = found(0, 4)
            answer.suggest_which_broker_id = 1
            return Pending(answer)

    opts = ConsumerOptions.from_kwargs("G")
    pq = ProcessQueue()
    submitted: list[int] = []
    pull = Pull(runtime(opts, pq), router(submitted), on_queue_forgotten=lambda: None)
    pull.start_queue(PullRequest(MQ, pq, 0))
    try:
        async with asyncio.timeout(2):
            while not submitted:
                await asyncio.sleep(0.005)
        assert pull.pull_from == {MQ: 1}
        # (What the real send records: where it pulled from, a fallback, a refusal.)
        pull.pulled_at[MQ] = ("10.0.0.2:10911", 1)
        pull.fallen_back.add(MQ)
        pull.refused.add(MQ)
        await pull.stop_queue(MQ)
        assert pull.pull_from == {} and pull.pulled_at == {}
        assert not pull.fallen_back and not pull.refused
    finally:
        await pull.aclose()

"""``stop()`` called from the consumer's own code, against the real broker.

A handler, a rebalance listener or an error handler that awaits ``consumer.stop()`` is part
of what ``stop()`` waits for. It must not wait for itself: the stop goes through without a
shortfall (``stop_shortfalls`` names ``listeners`` when the wait for running calls timed out),
returns to the caller, and no task of the consumer is left once the caller has returned. The
calling message is not acknowledged (Java's ``shutdown()`` from a listener drops its queue
under it): the group's next consumer gets it again. A stop in a task the handler started and
left is outside code once the handler has returned: it waits for the calls as any stop.
"""

from __future__ import annotations

import asyncio
import collections

import anyio.from_thread
import pytest

from rmq_async import App, ConsumeResult, MessageExt, PushConsumer
from rmq_async.consumer.events import ConsumerError, ConsumerErrorKind
from rmq_async.errors import IllegalStateError
from rmq_async.protocol.types import MessageQueue
from tests.helpers import AdminClient, produce, simple_messages, unique, wait_until

pytestmark = pytest.mark.broker

STOP_AT = 5  # the offset whose handler call stops the consumer
#: The stops' timeout: a stop waiting for its own caller would wait this long (or half of it,
#: for the error events), well past what each test waits for it.
LONG = 200.0


def _consumer(namesrv: str, group: str, **opts: object) -> PushConsumer:
    opts.setdefault("consume_from_where", "CONSUME_FROM_FIRST_OFFSET")
    return PushConsumer(group, namesrv=namesrv, **opts)  # type: ignore[arg-type]


def _tasks_of(group: str) -> list[str]:
    return [t.get_name() for t in asyncio.all_tasks()
            if f"[{group}]" in t.get_name() and not t.done()]


async def _topic_with(rocketmq, prefix: str, n: int = 20) -> str:
    topic = unique(prefix)
    await rocketmq.create_topic(topic, queues=1)
    await produce(rocketmq.namesrv_addr, topic, simple_messages(topic, n, size=32))
    return topic


async def _redelivered(namesrv: str, group: str, topic: str, n: int) -> set[int]:
    """The offsets the group's next consumer gets, the calling message among them, up to the
    last (one pull brings a whole test topic, handled in offset order)."""
    seen: set[int] = set()
    again = _consumer(namesrv, group)

    @again.subscribe(topic)
    async def on(msg: MessageExt) -> None:
        seen.add(msg.queue_offset)

    async with again:
        await wait_until(lambda: STOP_AT in seen and n - 1 in seen, 60,
                         what="the rest of the topic")
    return seen


@pytest.mark.parametrize("orderly", [False, True], ids=["concurrent", "orderly"])
async def test_an_async_handler_stops_its_consumer(rocketmq, orderly: bool) -> None:
    topic = await _topic_with(rocketmq, "T_stop_in")
    group = unique("G_stop_in")
    consumer = _consumer(rocketmq.namesrv_addr, group)
    calls: collections.Counter[int] = collections.Counter()
    stopped = asyncio.Event()
    after_stop: list[tuple[bool, tuple[str, ...]]] = []

    @consumer.subscribe(topic, orderly=orderly)
    async def on(msg: MessageExt) -> ConsumeResult:
        calls[msg.queue_offset] += 1
        if msg.queue_offset == STOP_AT:
            await consumer.stop(timeout=LONG)
            # Back in the handler: the consumer has stopped, nothing was left undone.
            after_stop.append((consumer.is_running, consumer.stop_shortfalls))
            # A second call there (the consumer stopped) does nothing.
            await consumer.stop()
            stopped.set()
        return ConsumeResult.SUCCESS

    await consumer.start()
    await asyncio.wait_for(stopped.wait(), 60)
    assert after_stop == [(False, ())]
    # The handler returned, and its worker ended with it: nothing of the consumer runs.
    await wait_until(lambda: not _tasks_of(group), 10, what="the consumer's tasks ended")
    assert max(calls) == STOP_AT and all(c == 1 for c in calls.values())
    # Not acknowledged: the next consumer of the group gets the calling message again.
    assert STOP_AT in await _redelivered(rocketmq.namesrv_addr, group, topic, 20)


async def test_a_stop_a_handler_starts_and_leaves_waits_for_its_chunk(rocketmq) -> None:
    """``asyncio.create_task(consumer.stop())``, not awaited: once the handler has returned the
    stop is outside code, so it waits for the calls running (the worker is not spared) and
    the calling message is acknowledged."""
    topic = await _topic_with(rocketmq, "T_stop_task")
    group = unique("G_stop_task")
    consumer = _consumer(rocketmq.namesrv_addr, group)
    stopping: list[asyncio.Task[None]] = []

    @consumer.subscribe(topic)
    async def on(msg: MessageExt) -> None:
        if msg.queue_offset == STOP_AT and not stopping:
            stopping.append(asyncio.get_running_loop().create_task(consumer.stop(timeout=LONG)))

    await consumer.start()
    await wait_until(lambda: bool(stopping), 60, what="the handler's stop task")
    await asyncio.wait_for(stopping[0], 30)
    assert consumer.stop_shortfalls == () and not consumer.is_running
    assert not _tasks_of(group)
    # Acknowledged: the group's committed offset is past it.
    async with AdminClient(rocketmq.namesrv_addr) as admin:
        committed = await admin.committed_offsets(group, topic)
    assert min(committed.values()) > STOP_AT, committed


async def test_a_plain_handler_stops_its_consumer_from_its_thread(rocketmq) -> None:
    topic = await _topic_with(rocketmq, "T_stop_thr")
    group = unique("G_stop_thr")
    consumer = _consumer(rocketmq.namesrv_addr, group)
    after_stop: list[tuple[bool, tuple[str, ...]]] = []

    @consumer.subscribe(topic)
    def on(msg: MessageExt) -> None:  # runs in a worker thread
        if msg.queue_offset == STOP_AT:
            anyio.from_thread.run(consumer.stop, LONG)
            after_stop.append((consumer.is_running, consumer.stop_shortfalls))

    await consumer.start()
    await wait_until(lambda: bool(after_stop), 60, what="the handler's stop")
    assert after_stop == [(False, ())]
    await wait_until(lambda: not _tasks_of(group), 10, what="the consumer's tasks ended")
    assert STOP_AT in await _redelivered(rocketmq.namesrv_addr, group, topic, 20)


async def test_a_rebalance_listener_stops_its_consumer(rocketmq) -> None:
    topic = await _topic_with(rocketmq, "T_stop_reb", n=1)
    group = unique("G_stop_reb")
    consumer = _consumer(rocketmq.namesrv_addr, group)
    consumer.subscribe(topic, listener=lambda msgs: None, batch=True)
    after_stop: list[tuple[bool, tuple[str, ...]]] = []

    @consumer.on_assigned
    async def assigned(queues: frozenset[MessageQueue]) -> None:
        await consumer.stop(timeout=LONG)
        after_stop.append((consumer.is_running, consumer.stop_shortfalls))

    await consumer.start()
    await wait_until(lambda: bool(after_stop), 30, what="the listener's stop")
    assert after_stop == [(False, ())]
    # The round that ran the listener ends with it, rather than waiting for the next one.
    await wait_until(lambda: not _tasks_of(group), 10, what="the consumer's tasks ended")


@pytest.mark.parametrize("plain", [False, True], ids=["async", "plain"])
async def test_an_error_handler_stops_its_consumer(rocketmq, plain: bool) -> None:
    topic = await _topic_with(rocketmq, "T_stop_err", n=1)
    group = unique("G_stop_err")
    consumer = _consumer(rocketmq.namesrv_addr, group)
    consumer.subscribe(topic, listener=lambda msgs: None, batch=True)
    after_stop: list[tuple[bool, tuple[str, ...]]] = []

    if plain:
        @consumer.on_error
        def on_error(event: ConsumerError) -> None:  # runs in a worker thread
            anyio.from_thread.run(consumer.stop, LONG)
            after_stop.append((consumer.is_running, consumer.stop_shortfalls))
    else:
        @consumer.on_error
        async def on_error_async(event: ConsumerError) -> None:
            await consumer.stop(timeout=LONG)
            after_stop.append((consumer.is_running, consumer.stop_shortfalls))

    await consumer.start()
    consumer.report_error(ConsumerError(ConsumerErrorKind.PERMISSION_DENIED, topic, None, None,
                                        "reported by the test"))
    await wait_until(lambda: bool(after_stop), 30, what="the error handler's stop")
    assert after_stop == [(False, ())]
    await wait_until(lambda: not _tasks_of(group), 10, what="the consumer's tasks ended")


@pytest.mark.parametrize("whole", [False, True], ids=["consumer", "app"])
async def test_a_stop_from_inside_while_stopping_or_starting(rocketmq, whole: bool) -> None:
    """During a stop, a handler's stop returns at once (the stop under way waits for it); an
    ``on_startup`` hook's raises: either would otherwise wait for itself."""
    topic = await _topic_with(rocketmq, "T_stop_both")
    group = unique("G_stop_both")
    consumer = _consumer(rocketmq.namesrv_addr, group)
    app = App(consumer)
    start, stop = (app.start, app.stop) if whole else (consumer.start, consumer.stop)
    entered, go = asyncio.Event(), asyncio.Event()
    outer: list[asyncio.Task[None]] = []
    inner: list[bool] = []

    @consumer.subscribe(topic)
    async def on(msg: MessageExt) -> None:
        if msg.queue_offset == STOP_AT:
            entered.set()
            await go.wait()
            await stop()
            inner.append(outer[0].done())  # the outer stop still waits for this call

    await start()
    await asyncio.wait_for(entered.wait(), 60)
    outer.append(asyncio.create_task(stop(timeout=LONG)))
    await wait_until(lambda: consumer.stopping, 10, what="the outer stop under way")
    go.set()
    await asyncio.wait_for(outer[0], 30)
    assert inner == [False]
    assert consumer.stop_shortfalls == () and not consumer.is_running
    assert not _tasks_of(group)

    @consumer.on_startup
    async def startup() -> None:
        await stop()

    with pytest.raises(IllegalStateError, match="on_startup"):
        await start()
    assert not consumer.is_running and not app.is_running and not _tasks_of(group)


async def test_a_shutdown_hook_calling_stop(rocketmq) -> None:
    topic = await _topic_with(rocketmq, "T_stop_hooks", n=1)
    group = unique("G_stop_hooks")
    consumer = _consumer(rocketmq.namesrv_addr, group)
    consumer.subscribe(topic, listener=lambda msgs: None, batch=True)
    in_hook: list[str] = []
    left_running: list[asyncio.Task[None]] = []

    async def stop_later() -> None:
        await asyncio.sleep(0.5)
        await consumer.stop(timeout=LONG)

    # From an on_shutdown hook of the stop itself: returns at once, the stop goes on.
    @consumer.on_shutdown
    async def shutdown() -> None:
        if left_running:
            return  # the second run's stop
        await consumer.stop()
        in_hook.append("stop returned")
        # Nor can the consumer be started again from within its own stop.
        try:
            await consumer.start()
        except IllegalStateError as exc:
            in_hook.append(str(exc))
        # A task the hook starts is not part of the stop once the stop has ended.
        left_running.append(asyncio.get_running_loop().create_task(stop_later()))

    await consumer.start()
    await consumer.stop(timeout=LONG)
    assert in_hook == ["stop returned", "start() called from inside this consumer's stop()"]
    assert consumer.stop_shortfalls == () and not consumer.is_running
    # Started again, the hook's task stops the consumer as any outside code would.
    await consumer.start()
    await asyncio.wait_for(left_running[0], 30)
    assert not consumer.is_running and consumer.stop_shortfalls == ()
    assert not _tasks_of(group)


async def test_a_handler_stops_its_app(rocketmq) -> None:
    topic = await _topic_with(rocketmq, "T_stop_app")
    groups = unique("G_stop_app"), unique("G_stop_app_other")
    first, other = (_consumer(rocketmq.namesrv_addr, g) for g in groups)
    other.subscribe(topic, listener=lambda msgs: None, batch=True)
    app = App(first, other)
    after_stop: list[tuple[bool, tuple[str, ...], tuple[str, ...]]] = []

    @first.subscribe(topic)
    async def on(msg: MessageExt) -> None:
        if msg.queue_offset == STOP_AT:
            await app.stop(timeout=LONG)
            after_stop.append((app.is_running, first.stop_shortfalls, other.stop_shortfalls))
            await app.stop()  # stopped already: nothing to do

    await app.start()
    await wait_until(lambda: bool(after_stop), 30, what="the handler's stop of the app")
    assert after_stop == [(False, (), ())]
    assert not first.is_running and not other.is_running
    await wait_until(lambda: not any(_tasks_of(g) for g in groups), 10,
                     what="the members' tasks ended")



async def test_an_app_stop_from_a_consumer_outside_the_app_waits_for_it(rocketmq) -> None:
    """Only the app's own members' code is spared: another consumer's handler calling
    ``app.stop()`` while the app stops waits for that stop like any outside code."""
    topic = await _topic_with(rocketmq, "T_stop_outside")
    member = _consumer(rocketmq.namesrv_addr, unique("G_stop_member"))
    outsider = _consumer(rocketmq.namesrv_addr, unique("G_stop_outsider"))
    app = App(member)
    entered, go = asyncio.Event(), asyncio.Event()
    outer: list[asyncio.Task[None]] = []
    returned: list[tuple[bool, bool]] = []

    @member.subscribe(topic)
    async def held(msg: MessageExt) -> None:
        if msg.queue_offset == STOP_AT:
            entered.set()
            await go.wait()

    @outsider.subscribe(topic)
    async def outside(msg: MessageExt) -> None:
        if msg.queue_offset == STOP_AT:
            await entered.wait()
            await wait_until(lambda: bool(outer) and member.stopping, 30,
                             what="the app's stop under way")
            stop = asyncio.get_running_loop().create_task(app.stop())
            await asyncio.sleep(0.5)
            early = stop.done()  # it waits: the member's held call keeps the app stopping
            go.set()
            await stop
            returned.append((early, outer[0].done()))

    await app.start()
    await asyncio.wait_for(entered.wait(), 60)
    outer.append(asyncio.create_task(app.stop(timeout=LONG)))
    async with outsider:
        await wait_until(lambda: bool(returned), 30, what="the outsider's app.stop()")
    assert returned == [(False, True)] and member.stop_shortfalls == ()

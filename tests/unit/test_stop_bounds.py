"""``stop(timeout)`` stays near its timeout when a broker stops answering: the periodic offset
round under way, the final offsets and the orderly unlocks are each bounded by what is left
of it (at least a second each), and the queues' offsets go out side by side."""

from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace
from typing import Any, cast

import pytest

from rmq_async.client.instance import ClientInstance
from rmq_async.consumer.offset_store import BrokerOffsetStore
from rmq_async.consumer.process_queue import ProcessQueue
from rmq_async.consumer.push import PushConsumer
from rmq_async.consumer.runtime import ConsumerRuntime
from rmq_async.consumer.tasks import TaskOwner
from rmq_async.errors import IllegalStateError
from rmq_async.protocol.types import MessageQueue
from tests.helpers import no_broker


class _HungApi:
    """A broker that takes every request and answers none."""

    def __init__(self) -> None:
        self.updates = 0
        self.unlocks = 0

    async def update_consumer_offset(self, *a: Any, **kw: Any) -> None:
        self.updates += 1
        await asyncio.Event().wait()

    async def unlock_batch_mq(self, *a: Any, **kw: Any) -> None:
        self.unlocks += 1
        await asyncio.Event().wait()


class _Instance:
    def __init__(self) -> None:
        self.api = _HungApi()
        self.brokers: dict[str, Any] = {}

    async def find_broker_in_subscribe(self, *a: Any, **kw: Any) -> tuple[str, int]:
        return "10.0.0.1:10911", 0

    async def find_broker_master(self, *a: Any, **kw: Any) -> str:
        return "10.0.0.1:10911"

    async def unregister(self, *a: Any) -> None:
        return None

    async def close(self, **kw: Any) -> None:
        return None


class _Idle:
    in_order = False

    async def wait_idle(self, caller: object = None) -> None:
        return None

    async def finish_releases(self, timeout: float, caller_queue: object = None) -> None:
        return None

    async def aclose(self, **kw: Any) -> None:
        return None


@pytest.mark.parametrize("orderly", [False, True])
async def test_stop_is_bounded_when_the_broker_answers_no_offset_update(orderly: bool) -> None:
    c = PushConsumer("G", "127.0.0.1:9876", persist_offset_interval=0.05)
    c.subscribe("T", listener=lambda m: None, orderly=orderly)
    inst = _Instance()
    c.instance = cast(ClientInstance, inst)
    c.offset_store = BrokerOffsetStore(cast(ClientInstance, inst), "G")
    for i in range(16):
        mq = MessageQueue("T", f"broker-{'ab'[i % 2]}", i)
        c.process_queues[mq] = ProcessQueue()
        c.offset_store.update(mq, 100, increase_only=False)
    c._owner = TaskOwner("consumer[G]")
    c._rt = cast(ConsumerRuntime, SimpleNamespace(stopping=False))
    c.pull_service = cast(Any, _Idle())
    c.consume_service = c.sink_service = cast(Any, _Idle())
    if orderly:
        from rmq_async.consumer.orderly import OrderlyConsumeService
        c.orderly_service = OrderlyConsumeService.__new__(OrderlyConsumeService)
        c.orderly_service._rt = cast(Any, SimpleNamespace(instance=inst, group="G",
                                                          client_id="cid"))
        c.orderly_service.wait_idle = _Idle().wait_idle  # type: ignore[method-assign]
        c.orderly_service._releasing = {}
        c.orderly_service.aclose = _Idle().aclose  # type: ignore[method-assign]
    else:
        c.orderly_service = cast(Any, _Idle())
    c._started = True
    c._owner.spawn(c._persist_loop(), name="persist-offsets")
    async with asyncio.timeout(5):
        while inst.api.updates < 2:  # a periodic round is under way on both brokers
            await asyncio.sleep(0.01)
    began = time.monotonic()
    async with asyncio.timeout(10):
        await c.stop(timeout=1.0)
    took = time.monotonic() - began
    # Waiting for the round: the timeout; the final offsets: a second; the unlocks: a second.
    assert took < 1.0 + 1.0 + 1.0 + 1.5, took
    assert inst.api.updates == 4  # the final round's first write on each broker too
    if orderly:
        assert inst.api.unlocks == 2  # one request per broker, side by side
    # What was left undone is there for the caller (`rmq-async run` exits 1 on it).
    assert c.stop_shortfalls == (("offsets", "unlocks") if orderly else ("offsets",))


class _WritingSinks:
    """A sink service whose write never ends: flushing and closing wait for it."""

    in_order = False

    def __init__(self) -> None:
        self.write_done = asyncio.Event()

    async def wait_idle(self, caller: object = None) -> None:
        await self.write_done.wait()

    async def aclose(self) -> None:
        await self.write_done.wait()


def _running_consumer(*, pull: Any, sinks: Any) -> PushConsumer:
    """A consumer as start() leaves it, with these pull and sink services, idle consume
    services and a broker that answers nothing."""
    c = PushConsumer("G", "127.0.0.1:9876")
    c.subscribe("T", listener=lambda m: None)
    inst = _Instance()
    c.instance = cast(ClientInstance, inst)
    c.offset_store = BrokerOffsetStore(cast(ClientInstance, inst), "G")
    c._owner = TaskOwner("consumer[G]")
    c._rt = cast(ConsumerRuntime, SimpleNamespace(stopping=False))
    c.pull_service = cast(Any, pull)
    c.consume_service = c.orderly_service = cast(Any, _Idle())
    c.sink_service = cast(Any, sinks)
    c._started = True
    return c


async def test_stop_is_bounded_by_its_timeout_when_a_sink_write_hangs() -> None:
    # A Spark write that hangs (a lost executor, a stalled object store): the sink's writer
    # waits for its thread through every cancellation. stop() held it for 60 s, then waited
    # for the sink's close for as long as the write lasted.
    sinks = _WritingSinks()
    c = _running_consumer(pull=_Idle(), sinks=sinks)
    assert c._owner is not None

    async def writer() -> None:  # as the sink's writer awaits its write thread
        while not sinks.write_done.is_set():
            try:
                await sinks.write_done.wait()
            except asyncio.CancelledError:
                pass

    c._owner.spawn(writer(), name="sink-writer")
    began = time.monotonic()
    try:
        async with asyncio.timeout(20):
            await c.stop(timeout=1.0)
        took = time.monotonic() - began
    finally:
        sinks.write_done.set()
    # The listeners' and sinks' time: the timeout; the tasks, the sink's close: a second each.
    assert took < 1.0 + 1.0 + 1.0 + 1.5, took
    assert not c._started
    assert c.stop_shortfalls == ("listeners", "sinks")


async def test_one_hung_sink_does_not_keep_the_others_from_closing() -> None:
    # stop() bounds the sinks' close by what is left of its timeout. Closed one after the
    # other, a sink whose last write hung used all of it, and the sinks after it never wrote
    # their last batch (their rows came again after a restart).
    from rmq_async.consumer.sink_service import SinkConsumeService

    class Sink:
        def __init__(self, how: str) -> None:
            self.how = how
            self.closed = False

        async def aclose(self) -> None:
            if self.how == "hangs":
                await asyncio.Event().wait()
            if self.how == "raises":
                raise RuntimeError("the last write failed")
            self.closed = True

    hung, failing, other = Sink("hangs"), Sink("raises"), Sink("closes")
    rt = SimpleNamespace(options=SimpleNamespace(),
                         subscriptions=SimpleNamespace(sinks=lambda: [hung, failing, other]))
    service = SinkConsumeService(cast(ConsumerRuntime, rt))
    began = time.monotonic()
    with pytest.raises(TimeoutError):
        async with asyncio.timeout(0.5):
            await service.aclose()
    assert other.closed
    assert time.monotonic() - began < 2.0


async def test_a_stop_that_raises_part_way_is_a_shortfall() -> None:
    # `rmq-async run` reads stop_shortfalls after the drain: a consumer whose stop() raised
    # (App.stop logs it and goes on) must not read as a clean stop.
    class _Failing(_Idle):
        async def aclose(self, **kw: Any) -> None:
            raise RuntimeError("a bug in a service's close")

    c = _running_consumer(pull=_Failing(), sinks=_Idle())
    owner = c._owner
    assert owner is not None
    with pytest.raises(RuntimeError, match="a bug in a service's close"):
        await c.stop(timeout=1.0)
    assert c.stop_shortfalls == ("failed",)
    await owner.aclose()


def _event(offset: int) -> Any:
    from rmq_async.consumer.events import ConsumerError, ConsumerErrorKind

    return ConsumerError(ConsumerErrorKind.CORRUPT_RECORD, "T", MessageQueue("T", "b", 0),
                         offset, "bad magic")


async def test_error_events_reported_before_stop_reach_their_handlers() -> None:
    # stop() cancelled the delivery task with the consumer's other tasks: the events still
    # waiting behind a slow handler (a webhook, say) never reached it.
    c = _running_consumer(pull=_Idle(), sinks=_Idle())
    c.errors.owner = c._owner  # as start() sets it
    seen: list[int | None] = []

    @c.on_error
    async def slow(event: Any) -> None:
        await asyncio.sleep(0.1)
        seen.append(event.offset)

    for offset in range(5):
        c.report_error(_event(offset))
    async with asyncio.timeout(10):
        await c.stop(timeout=5.0)
    assert seen == [0, 1, 2, 3, 4]
    assert c.stop_shortfalls == ()


async def test_a_hung_error_handler_holds_stop_up_for_half_of_what_is_left_at_most() -> None:
    from structlog.testing import capture_logs

    c = _running_consumer(pull=_Idle(), sinks=_Idle())
    c.errors.owner = c._owner
    hung = _Hung()
    c.on_error(hung)
    c.report_error(_event(1))
    c.report_error(_event(2))
    began = time.monotonic()
    with capture_logs() as logs:
        async with asyncio.timeout(10):
            await c.stop(timeout=2.0)
    took = time.monotonic() - began
    assert 0.9 < took < 1.9, took  # half the 2 s timeout, not all of it
    assert hung.calls == 1 and hung.cancelled
    dropped = [e for e in logs if e["event"] == "consumer.error_events_undelivered"]
    assert dropped and dropped[0]["pending"] == 2


class _Hung:
    def __init__(self) -> None:
        self.calls = 0
        self.cancelled = False

    async def __call__(self, event: Any) -> None:
        self.calls += 1
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            self.cancelled = True
            raise


async def test_a_stop_cancelled_part_way_can_be_called_again_and_finishes() -> None:
    # The CLI's drain cut short, or a caller's own timeout around stop(): the second stop()
    # goes through every stage (App.stop relies on it) and ends with the consumer stopped.
    class _Busy(_Idle):
        def __init__(self) -> None:
            self.release = asyncio.Event()

        async def wait_idle(self, caller: object = None) -> None:  # a listener call still running
            await self.release.wait()

    busy = _Busy()
    c = _running_consumer(pull=_Idle(), sinks=_Idle())
    c.consume_service = cast(Any, busy)
    first = asyncio.create_task(c.stop(timeout=30.0))
    await asyncio.sleep(0.1)
    first.cancel()
    with pytest.raises(asyncio.CancelledError):
        await first
    assert c.stop_shortfalls == ("failed",)  # not stopped yet
    busy.release.set()
    async with asyncio.timeout(10):
        await c.stop(timeout=2.0)
    assert c.stop_shortfalls == () and not c._started and c._owner is None


async def test_stop_lets_a_rebalance_round_under_way_finish_its_release() -> None:
    # A round releasing a queue (taken out of the table, its offset being persisted) was
    # cancelled with the consumer's tasks: the queue missed the final persist and unlock.
    c = _running_consumer(pull=_Idle(), sinks=_Idle())
    assert c._owner is not None
    c.rebalancer = cast(Any, SimpleNamespace(table_lock=asyncio.Lock()))
    released: list[str] = []
    started = asyncio.Event()

    async def round_releasing_a_queue() -> None:
        async with c.rebalancer.table_lock:
            started.set()
            await asyncio.sleep(0.3)  # persisting the queue's offset, then unlocking it
            released.append("persisted and unlocked")

    c._owner.spawn(round_releasing_a_queue(), name="rebalance")
    await started.wait()
    async with asyncio.timeout(10):
        await c.stop(timeout=5.0)
    assert released == ["persisted and unlocked"]
    assert not c.rebalancer.table_lock.locked()


async def test_a_stop_cancelled_while_waiting_for_the_persist_lock_lets_the_rebalance_lock_go() -> None:
    # It held the rebalance lock it had taken: the rebalance and an admin reset stayed
    # blocked, and a second stop() waited its whole timeout for the lock.
    c = _running_consumer(pull=_Idle(), sinks=_Idle())
    c.rebalancer = cast(Any, SimpleNamespace(table_lock=asyncio.Lock()))
    await c._persist_lock.acquire()  # a periodic persist round under way, a slow broker
    first = asyncio.create_task(c.stop(timeout=30.0))
    await asyncio.sleep(0.2)
    first.cancel()
    with pytest.raises(asyncio.CancelledError):
        await first
    c._persist_lock.release()
    assert not c.rebalancer.table_lock.locked()
    began = time.monotonic()
    async with asyncio.timeout(20):
        await c.stop(timeout=3.0)
    assert time.monotonic() - began < 2.0


async def test_a_handler_that_swallows_its_cancellation_holds_stop_up_a_stage_at_most() -> None:
    """After the listeners' wait ran out, the consume service's tasks were cancelled and
    waited for up to a minute (the task owner's default) when a handler swallowed it."""
    release = asyncio.Event()

    async def stubborn() -> None:
        while not release.is_set():
            try:
                await asyncio.sleep(10)
            except asyncio.CancelledError:
                continue  # a retry loop's `except BaseException: continue`

    class _Workers(_Idle):
        def __init__(self) -> None:
            self.owner = TaskOwner("consume[G]")
            self.owner.spawn(stubborn(), name="worker-0")

        async def aclose(self, *, abandon_after: float = 60.0) -> None:
            await self.owner.aclose(abandon_after=abandon_after)

    c = _running_consumer(pull=_Idle(), sinks=_Idle())
    workers = _Workers()
    c.consume_service = cast(Any, workers)
    left = list(workers.owner._tasks)
    try:
        began = time.monotonic()
        async with asyncio.timeout(20):
            await c.stop(timeout=0.5)
        assert time.monotonic() - began < 3.0
        assert not all(t.done() for t in left)  # abandoned, still running
    finally:
        # Whatever happened above: the stubborn task ends (the test's loop would otherwise
        # wait for it for good when it closes).
        release.set()
        for task in left:
            task.cancel()  # (swallowed once more, and the loop sees the release)
        await asyncio.wait(left, timeout=5)
    assert all(t.done() for t in left)


async def test_an_unanswered_unregistration_holds_stop_up_a_stage_at_most() -> None:
    class _Mute(_Instance):
        async def unregister(self, *a: Any) -> None:
            await asyncio.Event().wait()  # (the connect and the request share api_timeout)

    c = _running_consumer(pull=_Idle(), sinks=_Idle())
    c.instance = cast(ClientInstance, _Mute())
    began = time.monotonic()
    async with asyncio.timeout(20):
        await c.stop(timeout=0.5)
    assert time.monotonic() - began < 2.0
    assert c.stop_shortfalls == ()  # the broker forgets the client with its connection


async def test_a_start_hung_in_its_startup_hook_is_given_up_by_stop(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """stop() waited for the start lock without a bound: a start whose on_startup hook waited
    for something that never answered (a cache warm-up on a dead database) held a stop(1.0)
    for good. It now waits for the start up to its timeout, then gives the start up: start()
    undoes what it began and raises IllegalStateError."""
    no_broker(monkeypatch)
    c = PushConsumer("G", "127.0.0.1:9876")
    c.subscribe("T", listener=lambda m: None)
    undone: list[str] = []

    @c.on_startup
    async def warm_cache() -> None:
        try:
            await asyncio.Event().wait()
        finally:
            undone.append("hook cancelled")

    start = asyncio.create_task(c.start())
    await asyncio.sleep(0.2)
    assert c.starting
    began = time.monotonic()
    async with asyncio.timeout(10):
        await c.stop(timeout=1.0)
    assert time.monotonic() - began < 3.0
    with pytest.raises(IllegalStateError, match="the start was given up"):
        await start
    assert undone == ["hook cancelled"] and not c.starting and c.stopped
    assert not c.instance.remoting.addresses and c.instance.remoting.closed


async def test_a_start_that_ends_within_the_timeout_is_waited_for_then_stopped(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """(As before, and as App.stop() does: a start under way finishes, then is stopped.)"""
    no_broker(monkeypatch)
    c = PushConsumer("G", "127.0.0.1:9876")
    c.subscribe("T", listener=lambda m: None)

    @c.on_startup
    async def warm_cache() -> None:
        await asyncio.sleep(0.3)

    start = asyncio.create_task(c.start())
    await asyncio.sleep(0.1)
    async with asyncio.timeout(10):
        await c.stop(timeout=2.0)
    await start  # it finished, and was then stopped
    assert c.stopped and not c.starting


async def test_an_app_whose_member_start_hangs_is_stopped_within_its_timeout(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from rmq_async import App
    no_broker(monkeypatch)
    first, second = PushConsumer("G1", "127.0.0.1:9876"), PushConsumer("G2", "127.0.0.1:9876")
    for c in (first, second):
        c.subscribe("T", listener=lambda m: None)

    @second.on_startup
    async def warm_cache() -> None:
        await asyncio.Event().wait()

    app = App(first, second)
    start = asyncio.create_task(app.start())
    await asyncio.sleep(0.3)
    assert first.is_running and second.starting
    began = time.monotonic()
    async with asyncio.timeout(15):
        await app.stop(timeout=1.0)
    assert time.monotonic() - began < 8.0  # the app's start stops the first member in 5 s
    with pytest.raises(IllegalStateError, match="the start was given up"):
        await start
    assert first.stopped and second.stopped and not app.is_running


async def test_a_stop_does_not_cut_short_the_undo_of_a_start_failing_already(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The give-up's cancellation must not land in a failing start's own clean-up: it cut
    the connections' close short and hid the start's error behind IllegalStateError."""
    no_broker(monkeypatch)
    closing = ClientInstance.close

    async def slow_close(self: ClientInstance) -> None:
        await asyncio.sleep(0.8)
        await closing(self)

    monkeypatch.setattr(ClientInstance, "close", slow_close)
    c = PushConsumer("G", "127.0.0.1:9876")
    c.subscribe("T", listener=lambda m: None)

    @c.on_startup
    async def warm_cache() -> None:
        await asyncio.sleep(0.2)
        raise RuntimeError("the cache is not there")

    start = asyncio.create_task(c.start())
    await asyncio.sleep(0.05)
    async with asyncio.timeout(10):
        await c.stop(timeout=0.4)  # its wait ends while the failed start undoes itself
    with pytest.raises(RuntimeError, match="the cache is not there"):
        await start
    assert c.instance.remoting.closed and c.stopped


async def test_a_start_whose_hook_swallows_the_give_up_is_undone_when_it_ends(
        monkeypatch: pytest.MonkeyPatch) -> None:
    no_broker(monkeypatch)
    c = PushConsumer("G", "127.0.0.1:9876")
    c.subscribe("T", listener=lambda m: None)

    @c.on_startup
    async def warm_cache() -> None:
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            await asyncio.sleep(0.3)  # swallowed; the hook then returns

    async def starter() -> int:
        with pytest.raises(IllegalStateError, match="the start was given up"):
            await c.start()
        task = asyncio.current_task()
        assert task is not None
        return task.cancelling()

    start = asyncio.create_task(starter())
    await asyncio.sleep(0.1)
    async with asyncio.timeout(10):
        await c.stop(timeout=0.5)
    assert await start == 0  # the give-up's cancellation is not left on the caller's task
    assert c.stopped and not c.is_running and c.instance.remoting.closed

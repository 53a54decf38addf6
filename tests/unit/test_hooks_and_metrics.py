"""Hooks, metrics and tracing without a broker: the parts called directly."""

from __future__ import annotations

import asyncio
import re
import threading
from dataclasses import dataclass, field
from typing import Any

import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families
from structlog.testing import capture_logs

import rmq_async.consumer.hooks as hooks_module
import rmq_async.observability.prometheus as prom
from rmq_async.consumer.hooks import RebalanceHooks
from rmq_async.consumer.lag import QueueLag
from rmq_async.consumer.middleware import ConsumeCall
from rmq_async.consumer.process_queue import ProcessQueue
from rmq_async.consumer.results import ConsumeContext
from rmq_async.consumer.stats import ConsumerStats, CumulativeHistogram
from rmq_async.consumer.tasks import TaskOwner
from rmq_async.errors import InvalidArgumentError, InvalidTypeError
from rmq_async.observability.otel import TracingMiddleware
from rmq_async.protocol.types import MessageExt, MessageQueue
from tests.helpers import NotAnException, wait_until

Q0 = MessageQueue("orders", "broker-a", 0)
Q1 = MessageQueue("orders", "broker-a", 1)


# ---------------------------------------------------------------------- rebalance / lifespan hooks


async def test_rebalance_hooks_sync_async_and_listener_objects() -> None:
    hooks = RebalanceHooks()
    seen: list[tuple[str, frozenset[MessageQueue], str]] = []
    main_thread = threading.get_ident()

    async def a(queues: frozenset[MessageQueue]) -> None:
        seen.append(("async", queues, "loop" if threading.get_ident() == main_thread else "thread"))

    def s(queues: frozenset[MessageQueue]) -> None:
        seen.append(("sync", queues, "loop" if threading.get_ident() == main_thread else "thread"))

    class Listener:
        async def on_assigned(self, queues: frozenset[MessageQueue]) -> None:
            seen.append(("obj-assigned", queues,
                         "loop" if threading.get_ident() == main_thread else "thread"))

        def on_revoked(self, queues: frozenset[MessageQueue]) -> None:
            seen.append(("obj-revoked", queues,
                         "loop" if threading.get_ident() == main_thread else "thread"))

    hooks.revoked += [a, s]
    hooks.add_listener(Listener())
    await hooks.fire_revoked("g", [Q0, Q1])
    await hooks.fire_assigned("g", [Q1])
    await hooks.fire_assigned("g", [])  # nothing assigned: no call
    both = frozenset({Q0, Q1})
    assert seen == [("async", both, "loop"), ("sync", both, "thread"),
                    ("obj-revoked", both, "thread"), ("obj-assigned", frozenset({Q1}), "loop")]
    with pytest.raises(InvalidTypeError):
        hooks.add_listener(object())  # type: ignore[arg-type]


async def test_failing_rebalance_listener_is_logged_and_the_next_still_runs() -> None:
    hooks = RebalanceHooks()
    ran: list[str] = []

    def bad(queues: frozenset[MessageQueue]) -> None:
        raise RuntimeError("listener bug")

    async def good(queues: frozenset[MessageQueue]) -> None:
        ran.append("good")

    hooks.revoked += [bad, good]
    with capture_logs() as logs:
        await hooks.fire_revoked("g1", [Q0])
    assert ran == ["good"]
    failed = [e for e in logs if e["event"] == "consumer.rebalance_listener_failed"]
    assert len(failed) == 1
    assert failed[0]["group"] == "g1" and failed[0]["hook"] == "revoked"
    assert failed[0]["queues"] == [str(Q0)] and "listener bug" in failed[0]["error"]


@pytest.mark.parametrize("with_deadline", [False, True])  # a rebalance round; stop()
async def test_a_listener_raising_cancelled_error_is_a_failed_listener(
        with_deadline: bool) -> None:
    """A listener that awaits a task it cancelled raises CancelledError of its own: it left
    the hook runner, which ended the rebalance loop for good or cut stop() short before the
    offsets were persisted. The running task is not being cancelled, so it is the listener's
    failure; a real cancellation of the runner still propagates."""
    hooks = RebalanceHooks()
    ran: list[str] = []

    async def careless(queues: frozenset[MessageQueue]) -> None:
        worker = asyncio.get_running_loop().create_task(asyncio.sleep(10))
        await asyncio.sleep(0)
        worker.cancel()
        ran.append("careless")
        await worker

    async def after(queues: frozenset[MessageQueue]) -> None:
        ran.append("after")

    hooks.revoked += [careless, after]
    hooks.shutdown.append(lambda: careless(frozenset()))
    deadline = asyncio.get_running_loop().time() + 5 if with_deadline else None
    with capture_logs() as logs:
        await hooks.fire_revoked("g", [Q0], deadline=deadline)
        await hooks.run_shutdown("g", deadline=deadline)
    assert ran == ["careless", "after", "careless"]
    assert [e["event"] for e in logs if e["log_level"] == "error"] == [
        "consumer.rebalance_listener_failed", "consumer.shutdown_hook_failed"]

    async def slow(queues: frozenset[MessageQueue]) -> None:
        await asyncio.sleep(10)

    hooks.revoked[:] = [slow]
    runner = asyncio.get_running_loop().create_task(
        hooks.fire_revoked("g", [Q0], deadline=deadline))
    await asyncio.sleep(0.05)
    runner.cancel()
    with pytest.raises(asyncio.CancelledError):
        await runner


async def test_a_listener_raising_a_base_exception_is_a_failed_listener() -> None:
    # It left the hook runner: the rebalance round failed, or stop() ended before the
    # offsets were persisted.
    hooks = RebalanceHooks()
    ran: list[str] = []

    async def failing(queues: frozenset[MessageQueue]) -> None:
        ran.append("failing")
        raise NotAnException("pytest.fail() in the listener")

    async def after(queues: frozenset[MessageQueue]) -> None:
        ran.append("after")

    hooks.revoked += [failing, after]
    hooks.shutdown.append(lambda: failing(frozenset()))
    with capture_logs() as logs:
        await hooks.fire_revoked("g", [Q0])
        await hooks.run_shutdown("g")
    assert ran == ["failing", "after", "failing"]
    assert [e["event"] for e in logs if e["log_level"] == "error"] == [
        "consumer.rebalance_listener_failed", "consumer.shutdown_hook_failed"]


async def test_startup_failure_propagates_shutdown_failure_is_logged() -> None:
    hooks = RebalanceHooks()
    order: list[str] = []

    def boom() -> None:
        raise ValueError("no database")

    async def after() -> None:
        order.append("after")

    hooks.startup.append(boom)
    with pytest.raises(ValueError, match="no database"):
        await hooks.run_startup("g")
    hooks.shutdown += [boom, after]
    with capture_logs() as logs:
        await hooks.run_shutdown("g")
    assert order == ["after"]
    assert [e["event"] for e in logs if e["log_level"] == "error"] == ["consumer.shutdown_hook_failed"]


async def test_hooks_that_never_return_are_bounded_by_the_stop_deadline(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """stop() gives the on_revoked listeners, then the on_shutdown hooks, until a deadline:
    a hook still running then is cancelled and not waited for, even one that ignores its
    cancellation; a plain one's thread is left to finish on its own."""
    # A hook whose turn comes after the deadline still gets this long: a worker thread
    # started on a loaded machine needs more than the default tenth of a second.
    monkeypatch.setattr(hooks_module, "MIN_HOOK_SECONDS", 0.5)
    hooks = RebalanceHooks()
    release = threading.Event()
    order: list[str] = []

    async def forever(*args: Any) -> None:
        await asyncio.Event().wait()

    async def stubborn(*args: Any) -> None:  # ignores the first cancellation, then cleans up
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            await asyncio.sleep(2)
            order.append("stubborn cleaned up")

    def blocked(*args: Any) -> None:  # a plain function: a worker thread, not cancellable
        release.wait(30)
        order.append("blocked returned")

    async def after(*args: Any) -> None:
        order.append("after")

    def quick(*args: Any) -> None:  # plain, its turn after the deadline: it still runs
        order.append("quick")

    hooks.revoked += [forever, blocked, quick, after]
    hooks.shutdown += [stubborn, after]
    mq = MessageQueue("T", "b", 0)
    loop = asyncio.get_running_loop()
    try:
        with capture_logs() as logs:
            began = loop.time()
            async with asyncio.timeout(5):
                await hooks.fire_revoked("g", {mq}, deadline=loop.time() + 0.3)
                await hooks.run_shutdown("g", deadline=loop.time() + 0.3)
            took = loop.time() - began
    finally:
        release.set()
    # A group shares its 0.3 s; a hook whose turn comes after it still gets MIN_HOOK_SECONDS,
    # in which a quick one completes, plain or not: 0.3 + 0.5 (blocked) + 0.3 (stubborn).
    assert order == ["quick", "after", "after"]
    assert 1.0 <= took < 2.5
    timed_out = [(e["hook"], e["listener"].rsplit(".", 1)[-1]) for e in logs
                 if e["event"] == "consumer.hook_timed_out"]
    assert timed_out == [("revoked", "forever"), ("revoked", "blocked"),
                         ("shutdown", "stubborn")]
    # It ends on its own, after stop() went on.
    await wait_until(lambda: "stubborn cleaned up" in order, 10, what="stubborn's clean-up")


async def test_a_hook_of_a_cancelled_stop_is_held_until_it_ends() -> None:
    """``stop()`` itself cancelled (``wait_for(consumer.stop(), ...)``) while a hook runs: the
    hook is cancelled too, and one that awaits more in its clean-up stays owned until it ends
    (what it raises then is logged), not left to the loop's weak reference."""
    hooks = RebalanceHooks()
    cleaned = asyncio.Event()

    async def slow_cleanup(*args: Any) -> None:
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            await asyncio.sleep(0.3)
            cleaned.set()
            raise RuntimeError("clean-up failed") from None

    hooks.revoked.append(slow_cleanup)
    loop = asyncio.get_running_loop()
    with capture_logs() as logs:
        firing = asyncio.ensure_future(
            hooks.fire_revoked("g", {MessageQueue("T", "b", 0)}, deadline=loop.time() + 30))
        await asyncio.sleep(0.1)
        firing.cancel()
        with pytest.raises(asyncio.CancelledError):
            await firing
        held = [t for t in hooks._overdue if not t.done()]
        assert [t.get_name() for t in held] == ["hook:" + hooks_module._name(slow_cleanup)]
        await asyncio.wait_for(cleaned.wait(), 5)
        await asyncio.sleep(0)
        await wait_until(lambda: not hooks._overdue, 5, what="the hook's task let go")
    assert [e["error"] for e in logs if e["event"] == "consumer.hook_failed_after_timeout"] \
        == ["RuntimeError('clean-up failed')"]


# ---------------------------------------------------------------------- statistics totals


def test_totals_count_send_backs_and_time_calls() -> None:
    stats = ConsumerStats()
    stats.record_consume("t", 3, 1, 0.030, calls=2)  # two calls of 15 ms
    stats.record_consume("t", 5, 0, 0.0)  # a sink chunk: not timed
    stats.record_send_back("t", dead_letter=False)
    stats.record_send_back("t", dead_letter=True)
    stats.record_pull("t", 32, 0.004)
    t = stats.totals["t"]
    assert (t.consumed, t.failed, t.sent_back, t.dead_lettered, t.pulled) == (8, 1, 1, 1, 32)
    assert t.consume_seconds.count == 2 and t.consume_seconds.sum == pytest.approx(0.030)
    cum = dict(t.consume_seconds.cumulative())
    assert cum[0.01] == 0 and cum[0.025] == 2 and cum[float("inf")] == 2
    assert dict(t.pull_seconds.cumulative())[0.005] == 1


def test_histogram_buckets_are_cumulative_and_inf_is_the_count() -> None:
    h = CumulativeHistogram((1.0, 2.0))
    for v in (0.5, 1.0, 1.5, 3.0):
        h.observe(v)
    assert h.cumulative() == [(1.0, 2), (2.0, 3), (float("inf"), 4)]
    assert h.sum == pytest.approx(6.0)


# ---------------------------------------------------------------------- Prometheus


@dataclass
class _FakeConsumer:
    group: str
    stats: ConsumerStats = field(default_factory=ConsumerStats)
    process_queues: dict[MessageQueue, ProcessQueue] = field(default_factory=dict)
    lags: dict[MessageQueue, QueueLag] = field(default_factory=dict)
    healthy: bool = True
    is_running: bool = False
    start_timestamp: int = 0  # set when a start() begins
    starting: bool = False  # start() under way

    def lag(self) -> dict[MessageQueue, QueueLag]:
        return self.lags

    def is_healthy(self) -> bool:
        return self.healthy


def _documented_metrics() -> set[str]:
    assert prom.__doc__ is not None
    return set(re.findall(r"^``(rocketmq_consumer_\w+)`` \(", prom.__doc__, re.M))


def _exposed(registry: CollectorRegistry) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    text = generate_latest(registry).decode()
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def test_collector_exposes_the_documented_metrics_from_the_consumer() -> None:
    registry = CollectorRegistry()
    c = _FakeConsumer("G")
    c.stats.record_consume("orders", 7, 2, 0.02, calls=3)
    c.stats.record_send_back("orders", dead_letter=False)
    c.stats.record_send_back("orders", dead_letter=True)
    c.stats.record_pull("orders", 9, 0.003)
    pq = ProcessQueue()
    pq.put_messages([MessageExt(topic="orders", body=b"x", queue_offset=i) for i in range(3)])
    c.process_queues = {Q0: pq, Q1: ProcessQueue()}
    c.lags = {Q0: QueueLag(100, 60, 40, 3, 0.0), Q1: QueueLag(5, None, None, 0, 0.0)}
    prom.instrument(c, registry)  # type: ignore[arg-type]
    got = _exposed(registry)
    topic = (("group", "G"), ("topic", "orders"))
    q0 = (("broker", "broker-a"), ("group", "G"), ("queue_id", "0"), ("topic", "orders"))
    q1 = (("broker", "broker-a"), ("group", "G"), ("queue_id", "1"), ("topic", "orders"))
    assert got[("rocketmq_consumer_messages_consumed_total", topic)] == 7
    assert got[("rocketmq_consumer_messages_failed_total", topic)] == 2
    assert got[("rocketmq_consumer_messages_retried_total", topic)] == 1
    assert got[("rocketmq_consumer_messages_dlq_total", topic)] == 1
    assert got[("rocketmq_consumer_messages_pulled_total", topic)] == 9
    assert got[("rocketmq_consumer_consume_duration_seconds_count", topic)] == 3
    assert got[("rocketmq_consumer_pull_duration_seconds_count", topic)] == 1
    assert got[("rocketmq_consumer_lag_messages", q0)] == 40
    assert ("rocketmq_consumer_lag_messages", q1) not in got  # no committed offset yet
    assert got[("rocketmq_consumer_max_offset", q1)] == 5
    assert got[("rocketmq_consumer_committed_offset", q0)] == 60
    assert got[("rocketmq_consumer_cached_messages", q0)] == 3
    assert got[("rocketmq_consumer_assigned_queues", (("group", "G"),))] == 2
    assert got[("rocketmq_consumer_healthy", (("group", "G"),))] == 1
    # Every documented metric is exposed, and nothing undocumented.
    families = {name for name, _ in got}
    exposed = {re.sub(r"_(bucket|count|sum)$", "", n) if "duration" in n else n for n in families}
    assert exposed == _documented_metrics()


def test_a_scrape_restricted_to_some_names_finds_them() -> None:
    """``/metrics?name[]=...`` (prometheus_client's restricted registry) finds a collector by
    the names it describes; this one described none, and such a scrape came back empty."""
    registry = CollectorRegistry()
    c = _FakeConsumer("G")
    c.stats.record_consume("orders", 3, 0, 0.01)
    prom.instrument(c, registry)  # type: ignore[arg-type]
    text = generate_latest(registry.restricted_registry(
        ["rocketmq_consumer_messages_consumed_total"])).decode()
    assert 'rocketmq_consumer_messages_consumed_total{group="G",topic="orders"} 3.0' in text
    assert "rocketmq_consumer_messages_failed_total{" not in text


def test_one_collector_per_registry_and_one_member_per_group() -> None:
    registry = CollectorRegistry()
    a, b = _FakeConsumer("A"), _FakeConsumer("B")
    assert prom.instrument(a, registry) is prom.instrument(b, registry)  # type: ignore[arg-type]
    with pytest.raises(InvalidArgumentError, match="already exported"):
        prom.instrument(_FakeConsumer("A"), registry)  # type: ignore[arg-type]
    prom.instrument(_FakeConsumer("A"), CollectorRegistry())  # type: ignore[arg-type]
    # A stopped member gives its place to its successor (a new object after stop()).
    a.stopping = True  # type: ignore[attr-defined]
    successor = _FakeConsumer("A")
    prom.instrument(successor, registry)  # type: ignore[arg-type]
    assert prom._collectors[registry]._live() == [b, successor]
    # One whose start() is under way keeps its place (a second member instrumented into
    # the same registry meanwhile took it).
    successor.start_timestamp = 1_700_000_000_000
    successor.starting = True
    with pytest.raises(InvalidArgumentError, match="already exported"):
        prom.instrument(_FakeConsumer("A"), registry)  # type: ignore[arg-type]
    # One whose start() failed (it began a start and does not run) gives it up: a retry with
    # a new object was refused.
    successor.starting = False
    retried = _FakeConsumer("A")
    prom.instrument(retried, registry)  # type: ignore[arg-type]
    assert prom._collectors[registry]._live() == [b, retried]
    # One running, or never started, keeps its place.
    retried.is_running = True
    retried.start_timestamp = 1_700_000_000_001
    with pytest.raises(InvalidArgumentError, match="already exported"):
        prom.instrument(_FakeConsumer("A"), registry)  # type: ignore[arg-type]


@pytest.mark.parametrize("module, extra, missing", [
    ("rmq_async.observability.prometheus", "prometheus", "prometheus_client"),
    ("rmq_async.observability.otel", "otel", "opentelemetry"),
])
def test_a_missing_extra_is_named_with_its_install_command(
        monkeypatch: pytest.MonkeyPatch, module: str, extra: str, missing: str) -> None:
    """Without the extra, importing the module was a bare ModuleNotFoundError."""
    import importlib
    import sys

    monkeypatch.setitem(sys.modules, missing, None)  # as if not installed
    monkeypatch.delitem(sys.modules, module)
    with pytest.raises(ImportError, match=re.escape(f"pip install 'rmq_async[{extra}]'")):
        importlib.import_module(module)


# ---------------------------------------------------------------------- OpenTelemetry


def _call(group: str, topic: str, queue: MessageQueue, messages: list[MessageExt]) -> ConsumeCall:
    return ConsumeCall(group=group, topic=topic, queue=queue, messages=messages,
                       context=ConsumeContext(queue, messages=messages), orderly=False,
                       handler_name="handle")


def _tracing() -> tuple[TracingMiddleware, InMemorySpanExporter]:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    return TracingMiddleware(tracer_provider=provider, consumption_model="clustering"), exporter


async def test_span_per_call_with_messaging_attributes() -> None:
    mw, exporter = _tracing()
    msg = MessageExt(topic="orders", body=b"hello", queue_id=1, queue_offset=5,
                     properties={"TAGS": "created", "KEYS": "k1 k2", "UNIQ_KEY": "ABC"})
    inner: list[bool] = []

    async def call_next(call: Any) -> None:
        from opentelemetry import trace
        inner.append(trace.get_current_span().is_recording())

    await mw(_call("G", "orders", Q1, [msg]), call_next)
    batch = [MessageExt(topic="orders", body=b"x", queue_offset=i) for i in range(3)]
    await mw(_call("G", "orders", Q1, batch), call_next)
    assert inner == [True, True]  # the handler runs inside the span
    one, many = exporter.get_finished_spans()
    assert one.name == "process orders" and one.kind is SpanKind.CONSUMER
    assert one.status.status_code is StatusCode.UNSET
    a = dict(one.attributes or {})
    assert a["messaging.system"] == "rocketmq"
    assert a["messaging.operation.type"] == "process"
    assert a["messaging.destination.name"] == "orders"
    assert a["messaging.destination.partition.id"] == "1"
    assert a["messaging.consumer.group.name"] == "G"
    assert a["messaging.message.id"] == msg.msg_id
    assert a["messaging.message.body.size"] == 5
    assert a["messaging.rocketmq.message.tag"] == "created"
    assert a["messaging.rocketmq.message.keys"] == ("k1", "k2")
    assert a["messaging.rocketmq.consumption_model"] == "clustering"
    assert "messaging.batch.message_count" not in a
    b = dict(many.attributes or {})
    assert b["messaging.batch.message_count"] == 3 and "messaging.message.id" not in b


async def test_failed_call_marks_the_span_and_reraises() -> None:
    mw, exporter = _tracing()

    async def call_next(call: Any) -> None:
        raise ValueError("bad order")

    with pytest.raises(ValueError, match="bad order"):
        await mw(_call("G", "orders", Q0, [MessageExt(topic="orders", body=b"")]), call_next)
    (span,) = exporter.get_finished_spans()
    assert span.status.status_code is StatusCode.ERROR
    assert dict(span.attributes or {})["error.type"] == "ValueError"
    assert [e.name for e in span.events] == ["exception"]


async def test_a_cancelled_call_is_an_error_span() -> None:
    """A call cut short (stop() past its timeout) did not succeed: its messages come again."""
    import asyncio

    mw, exporter = _tracing()
    entered = asyncio.Event()

    async def call_next(call: Any) -> None:
        entered.set()
        await asyncio.sleep(60)

    task = asyncio.ensure_future(
        mw(_call("G", "orders", Q0, [MessageExt(topic="orders", body=b"")]), call_next))
    await entered.wait()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    (span,) = exporter.get_finished_spans()
    assert span.status.status_code is StatusCode.ERROR
    assert dict(span.attributes or {})["error.type"] == "CancelledError"


async def test_a_call_that_left_dead_letters_is_an_error_span() -> None:
    mw, exporter = _tracing()
    msgs = [MessageExt(topic="orders", body=b"{", queue_offset=i) for i in range(2)]

    async def call_next(call: Any) -> None:  # the handler's decoder put one aside
        call.context.dead_letters.append((call.messages[0], "payload not decodable"))

    await mw(_call("G", "orders", Q0, msgs), call_next)
    (span,) = exporter.get_finished_spans()
    assert span.status.status_code is StatusCode.ERROR
    assert dict(span.attributes or {})["error.type"] == "DeadLetter"


async def test_a_message_without_trace_context_starts_a_trace_of_its_own() -> None:
    """The consumer's tasks are started in whatever context ``start()`` ran in: a span current
    then (an app's startup span) became the parent of every later consume span without a
    producer's context, one message or a batch."""
    from opentelemetry import context as otel_context
    from opentelemetry import trace

    mw, exporter = _tracing()
    app = TracerProvider().get_tracer("app")
    with app.start_as_current_span("app startup") as startup:
        started_in = otel_context.get_current()  # what the worker tasks copy at start()

    async def call_next(call: Any) -> None:
        pass

    async def worker() -> None:
        await mw(_call("G", "orders", Q0, [MessageExt(topic="orders", body=b"x")]), call_next)
        batch = [MessageExt(topic="orders", body=b"x", queue_offset=i) for i in range(2)]
        await mw(_call("G", "orders", Q0, batch), call_next)

    token = otel_context.attach(started_in)
    try:
        await asyncio.get_running_loop().create_task(worker())
    finally:
        otel_context.detach(token)
    spans = exporter.get_finished_spans()
    assert len(spans) == 2 and trace.get_current_span().is_recording() is False
    assert all(s.parent is None for s in spans)
    assert all(s.context.trace_id != startup.get_span_context().trace_id for s in spans)


async def test_a_batch_acknowledged_in_part_is_an_error_span() -> None:
    """SUCCESS with an ack_index short of the batch retries the rest: a retry asked for, which
    the docs say ends the span with ERROR; it ended UNSET."""
    mw, exporter = _tracing()
    msgs = [MessageExt(topic="orders", body=b"x", queue_offset=i) for i in range(4)]

    async def part(call: Any) -> None:
        call.context.ack_index = 1

    async def whole(call: Any) -> None:
        call.context.ack_index = 3

    await mw(_call("G", "orders", Q0, msgs), part)
    await mw(_call("G", "orders", Q0, msgs), whole)
    partial, full = exporter.get_finished_spans()
    assert partial.status.status_code is StatusCode.ERROR
    assert dict(partial.attributes or {})["error.type"] == "RetryLater"
    assert "2 of 4" in (partial.status.description or "")
    assert full.status.status_code is StatusCode.UNSET


async def test_a_batch_acknowledged_whole_after_an_inner_middleware_is_not_an_error_span() -> None:
    """An inner middleware (a de-duplication) passed on two of four messages and the handler
    acknowledged both: the service acknowledges all four (ack_index counts what the handler
    got), but the span compared the handler's ack_index with the four and said RetryLater."""
    import dataclasses

    from rmq_async.consumer.consume import _apply_outcome
    from rmq_async.consumer.listener import ListenerAdapter
    from rmq_async.consumer.middleware import CallNext, run_call

    mw, exporter = _tracing()
    msgs = [MessageExt(topic="orders", body=b"x", queue_offset=i) for i in range(4)]

    async def dedup(call: ConsumeCall, call_next: CallNext) -> None:
        await call_next(dataclasses.replace(call, messages=call.messages[:2]))

    async def handler(batch: list[MessageExt], ctx: ConsumeContext) -> None:
        ctx.ack_index = len(batch) - 1

    ctx = ConsumeContext(Q0)
    outcome = await run_call(ListenerAdapter(handler), msgs, ctx, group="G", topic="orders",
                             queue=Q0, orderly=False, middlewares=[mw, dedup])
    failed: list[tuple[MessageExt, int]] = []
    dead: list[tuple[MessageExt, str]] = []
    _apply_outcome(outcome, msgs, ctx, failed, dead)
    assert failed == [] and dead == []
    (span,) = exporter.get_finished_spans()
    assert span.status.status_code is StatusCode.UNSET


async def test_a_call_failed_by_a_base_exception_is_an_error_span() -> None:
    """pytest's Failed (a ``BaseException``) fails the call, which is retried; the span
    ended UNSET, as a success."""
    from rmq_async.consumer.listener import ListenerAdapter
    from rmq_async.consumer.middleware import run_call
    from rmq_async.consumer.results import ConsumeResult

    mw, exporter = _tracing()

    async def handler(msg: MessageExt) -> None:
        raise NotAnException("pytest.fail() in the handler")

    outcome = await run_call(ListenerAdapter(handler), [MessageExt(topic="orders", body=b"x")],
                             ConsumeContext(Q0), group="G", topic="orders", queue=Q0,
                             orderly=False, middlewares=[mw])
    assert outcome.result is ConsumeResult.RECONSUME_LATER
    (span,) = exporter.get_finished_spans()
    assert span.status.status_code is StatusCode.ERROR
    assert dict(span.attributes or {})["error.type"] == "NotAnException"


async def test_the_producers_trace_context_is_the_parent_or_a_link() -> None:
    """A message carrying W3C trace context (as an instrumented producer writes it into the
    properties) is processed in a child span of the producer's; a batch links to each."""
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

    mw, exporter = _tracing()
    producer = TracerProvider().get_tracer("producer")
    carriers: list[dict[str, str]] = []
    span_ids: list[int] = []
    for i in range(2):
        with producer.start_as_current_span(f"send {i}") as sent:
            carrier: dict[str, str] = {}
            TraceContextTextMapPropagator().inject(carrier)
            carriers.append(carrier)
            span_ids.append(sent.get_span_context().span_id)

    async def call_next(call: Any) -> None:
        pass

    one = MessageExt(topic="orders", body=b"x", properties=dict(carriers[0]))
    await mw(_call("G", "orders", Q0, [one]), call_next)
    batch = [MessageExt(topic="orders", body=b"x", queue_offset=i, properties=dict(c))
             for i, c in enumerate(carriers)]
    batch.append(MessageExt(topic="orders", body=b"x", queue_offset=2))  # no context
    await mw(_call("G", "orders", Q0, batch), call_next)
    await mw(_call("G", "orders", Q0, [MessageExt(topic="orders", body=b"x")]), call_next)
    child, linked, root = exporter.get_finished_spans()
    assert child.parent is not None and child.parent.span_id == span_ids[0]
    assert child.context.trace_id == _trace_id(carriers[0])
    assert linked.parent is None
    assert [link.context.span_id for link in linked.links] == span_ids
    assert root.parent is None and not root.links


def _trace_id(carrier: dict[str, str]) -> int:
    return int(carrier["traceparent"].split("-")[1], 16)


# ---------------------------------------------------------------------- the rebalancer's order


class _Store:
    def __init__(self, events: list[tuple[str, Any]]) -> None:
        self.events = events

    async def persist(self, mq: MessageQueue) -> None:
        self.events.append(("persist", mq))

    def remove(self, mq: MessageQueue) -> None:
        self.events.append(("forget", mq))


class _Pull:
    def __init__(self, events: list[tuple[str, Any]]) -> None:
        self.events = events

    async def stop_queue(self, mq: MessageQueue) -> None:
        self.events.append(("stop_pull", mq))

    def start_queue(self, req: Any) -> None:
        self.events.append(("start_pull", req.mq))

    def is_pulling(self, mq: MessageQueue) -> bool:
        return True  # the queues this fake holds have their pull tasks


async def test_rebalancer_revokes_before_persisting_and_assigns_before_pulling() -> None:
    from types import SimpleNamespace

    from rmq_async.consumer.options import MessageModel
    from rmq_async.consumer.rebalance import Rebalancer

    events: list[tuple[str, Any]] = []
    q2 = MessageQueue("orders", "broker-a", 2)
    held = {Q0: ProcessQueue(), Q1: ProcessQueue()}

    async def start_offset(mq: MessageQueue) -> int:
        return 0

    rt: Any = SimpleNamespace(
        tasks=TaskOwner("consumer[G]"),
        group="G", stopping=False, process_queues=held, offset_store=_Store(events),
        options=SimpleNamespace(message_model=MessageModel.CLUSTERING, pull_max_idle_time=120.0),
        subscriptions=SimpleNamespace(is_orderly=lambda topic: False,
                                      subscription_data=lambda topic: None),
        thresholds=SimpleNamespace(recompute=lambda topic, n: None),
        compute_pull_from_where=start_offset)
    hooks = RebalanceHooks()

    def broken(queues: frozenset[MessageQueue]) -> None:
        raise RuntimeError("listener bug")

    async def revoked(queues: frozenset[MessageQueue]) -> None:
        assert all(mq in held and not held[mq].dropped for mq in queues)
        events.append(("revoked", queues))

    async def assigned(queues: frozenset[MessageQueue]) -> None:
        assert all(mq in held for mq in queues)
        events.append(("assigned", queues))

    hooks.revoked += [broken, revoked]
    hooks.assigned.append(assigned)
    rebalancer = Rebalancer(rt, _Pull(events), orderly=None, hooks=hooks)  # type: ignore[arg-type]
    with capture_logs() as logs:
        await rebalancer.apply_allocation("orders", {Q1, q2})
    assert [e["event"] for e in logs if e["log_level"] == "error"] == [
        "consumer.rebalance_listener_failed"]
    kinds = [(k, v) for k, v in events if k != "forget"]
    assert kinds == [("revoked", frozenset({Q0})), ("stop_pull", Q0), ("persist", Q0),
                     ("assigned", frozenset({q2})), ("start_pull", q2)]
    assert set(held) == {Q1, q2}
    # Unsubscribing gives the rest up the same way.
    events.clear()
    await rebalancer.drop_unsubscribed(set())
    assert events[0] == ("revoked", frozenset({Q1, q2}))
    assert {v for k, v in events if k == "persist"} == {Q1, q2} and not held



class _HeartbeatApi:
    """Records the ``orders`` subscription version of every heartbeat; the first one (the
    periodic round) waits for ``release``."""

    def __init__(self) -> None:
        self.versions: list[int] = []
        self.first_in_flight = asyncio.Event()
        self.release = asyncio.Event()

    async def heartbeat(self, addr: str, data: Any, *, resend_on_go_away: bool = True) -> int:
        subs = data.consumer_data_set[0].subscription_data_set
        self.versions.append(next(d.sub_version for d in subs if d.topic == "orders"))
        if len(self.versions) == 1:
            self.first_in_flight.set()
            await self.release.wait()
        return 0


async def test_a_changed_allocation_announces_its_version_after_a_heartbeat_in_flight() -> None:
    """A rebalance that changes a topic's queues tells the broker the subscription's new version
    before the pulls carry it, also while a periodic heartbeat is under way.

    The broker refuses a pull whose ``subVersion`` is newer than the one its last heartbeat
    registered (SUBSCRIPTION_NOT_LATEST). The Java client (5.3.3) skips the heartbeat that
    carries the new version when its scheduled heartbeat holds the lock at that moment ("lock
    heartBeat, but failed"), and the broker then refuses every pull of the topic until a later
    rebalance that changes something sends one: a 20 s stall at the default rebalance interval,
    seen in the benchmark's Java runs. Here the round waits for the heartbeat in flight and then
    sends its own.
    """
    from types import SimpleNamespace

    from rmq_async.client.instance import ClientInstance, _BrokerAddrs
    from rmq_async.consumer.options import MessageModel
    from rmq_async.consumer.rebalance import Rebalancer
    from rmq_async.consumer.subscriptions import Subscription, Subscriptions
    from rmq_async.protocol.bodies import ConsumerData, HeartbeatData
    from rmq_async.protocol.filter import build_subscription

    subs = Subscriptions("G", MessageModel.CLUSTERING)
    subs.add(Subscription(topic="orders", expression="*", data=build_subscription("orders", "*")))
    subs.reset_retry()
    data = subs.subscription_data("orders")
    assert data is not None
    old = data.sub_version

    def heartbeat_data() -> HeartbeatData:
        return HeartbeatData(client_id="client-1", consumer_data_set=[
            ConsumerData("G", subscription_data_set=subs.heartbeat_data_set())])

    instance = ClientInstance("127.0.0.1:9876", "client-1", heartbeat_source=heartbeat_data)
    instance.brokers["broker-a"] = _BrokerAddrs("DefaultCluster", {0: "127.0.0.1:10911"})
    api = _HeartbeatApi()
    instance.api = api  # type: ignore[assignment]

    async def start_offset(mq: MessageQueue) -> int:
        return 0

    events: list[tuple[str, Any]] = []
    rt: Any = SimpleNamespace(
        tasks=TaskOwner("consumer[G]"),
        group="G", stopping=False, process_queues={Q0: ProcessQueue()},
        offset_store=_Store(events),
        options=SimpleNamespace(message_model=MessageModel.CLUSTERING, pull_max_idle_time=120.0),
        subscriptions=subs, instance=instance,
        thresholds=SimpleNamespace(recompute=lambda topic, n: None),
        compute_pull_from_where=start_offset)
    rebalancer = Rebalancer(rt, _Pull(events), orderly=None)  # type: ignore[arg-type]

    periodic = asyncio.ensure_future(instance.send_heartbeats())
    await api.first_in_flight.wait()  # the periodic heartbeat holds the lock
    round_ = asyncio.ensure_future(rebalancer.apply_allocation("orders", {Q0, Q1}))
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
    assert [mq for kind, mq in events if kind == "start_pull"] == [Q1]

def test_is_healthy_needs_the_last_round_answered_and_a_recent_heartbeat() -> None:
    import time
    from types import SimpleNamespace

    from rmq_async import PushConsumer

    c = PushConsumer("G", namesrv="127.0.0.1:9876", heartbeat_interval=1.0, api_timeout=1.0)
    assert not c.is_healthy()  # never started
    c._started = True
    c.instance = SimpleNamespace(brokers_reachable=True,  # type: ignore[assignment]
                                 last_heartbeat_ok=time.monotonic())
    assert c.is_healthy()
    c.instance.brokers_reachable = False  # no broker answered the last round
    assert not c.is_healthy()
    c.instance.brokers_reachable = True
    c.instance.last_heartbeat_ok = time.monotonic() - 3.5  # 2 intervals + timeout ago: stuck
    assert not c.is_healthy()


async def _start_held_at_its_route_lookup(
        monkeypatch: pytest.MonkeyPatch, consumer: Any) -> tuple[Any, Any]:
    """Start ``consumer`` with its route lookup held; the start task and the event that
    lets the lookup fail (a NameServerUnavailable)."""
    from rmq_async.client.errors import NameServerUnavailable
    from rmq_async.client.instance import ClientInstance

    asked = asyncio.Event()
    answer = asyncio.Event()

    async def update_route(self: ClientInstance, topic: str) -> None:
        asked.set()
        await answer.wait()
        raise NameServerUnavailable("no name server answered")

    monkeypatch.setattr(ClientInstance, "update_route", update_route)
    start = asyncio.create_task(consumer.start())
    async with asyncio.timeout(5):
        await asked.wait()
    return start, answer


async def test_a_consumer_is_starting_while_its_start_runs(monkeypatch: pytest.MonkeyPatch) -> None:
    from rmq_async import PushConsumer
    from rmq_async.client.errors import NameServerUnavailable

    consumer = PushConsumer("G", "127.0.0.1:9876")
    consumer.subscribe("T", listener=lambda m: None)
    assert not consumer.starting
    start, answer = await _start_held_at_its_route_lookup(monkeypatch, consumer)
    assert consumer.starting and not prom._ended(consumer)
    answer.set()
    with pytest.raises(NameServerUnavailable):
        await start
    assert not consumer.starting and prom._ended(consumer)


async def test_a_consumer_started_again_after_a_stop_is_starting_not_stopping(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # The runtime of the stop before said "stopping" until the new start replaced it, so
    # a second start (its offsets loading in a worker thread, say) read as ended.
    from types import SimpleNamespace

    from rmq_async import PushConsumer
    from rmq_async.client.errors import NameServerUnavailable

    consumer = PushConsumer("G", "127.0.0.1:9876")
    consumer.subscribe("T", listener=lambda m: None)
    consumer._rt = SimpleNamespace(stopping=True)  # type: ignore[assignment]  # as stop() left it
    assert consumer.stopping
    start, answer = await _start_held_at_its_route_lookup(monkeypatch, consumer)
    assert consumer.starting and not consumer.stopping and not prom._ended(consumer)
    answer.set()
    with pytest.raises(NameServerUnavailable):
        await start

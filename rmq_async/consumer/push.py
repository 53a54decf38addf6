"""``PushConsumer``: the public consumer API and the owner of the three loops.

``start()`` wires the parts together and ``stop()`` takes them apart; everything in between runs
below this module: the rebalancer (:mod:`~rmq_async.consumer.rebalance`) assigns queues, the
pull loop (:mod:`~rmq_async.consumer.pull`) fills their ProcessQueues and hands each pulled chunk
through the :class:`~rmq_async.consumer.service.ServiceRouter` to the concurrent, orderly or sink
service, which acknowledges it into the offset store. They share a
:class:`~rmq_async.consumer.runtime.ConsumerRuntime`, not the consumer.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import contextvars
import os
import time
from collections.abc import Callable, Iterable
from datetime import timedelta
from typing import TYPE_CHECKING, Any, ParamSpec, TypeVar, overload

import anyio
import structlog

from rmq_async.client.errors import MQBrokerError, MQClientError, NoRouteError
from rmq_async.client.instance import ClientInstance
from rmq_async.consumer.admin import BrokerRequestHandler, raise_if_refused
from rmq_async.consumer.consume import ConcurrentConsumeService
from rmq_async.consumer.events import ConsumerError, ErrorHandler, ErrorReporter
from rmq_async.consumer.hooks import LifespanHook, QueuesHook, RebalanceHooks, RebalanceListener
from rmq_async.consumer.lag import LagMonitor, QueueLag
from rmq_async.consumer.listener import ListenerAdapter
from rmq_async.consumer.middleware import Middleware, check_middleware
from rmq_async.consumer.offset_store import BrokerOffsetStore, LocalFileOffsetStore, OffsetStore
from rmq_async.consumer.options import (
    ConsumerOptions,
    MessageModel,
    build_client_id,
    check_topic_name,
)
from rmq_async.consumer.orderly import OrderlyConsumeService
from rmq_async.consumer.process_queue import ProcessQueue
from rmq_async.consumer.pull import PullService
from rmq_async.consumer.rebalance import Rebalancer
from rmq_async.consumer.runtime import ConsumerRuntime
from rmq_async.consumer.service import ServiceRouter, wait_all_idle
from rmq_async.consumer.sink_service import SinkConsumeService
from rmq_async.consumer.stats import ConsumerStats
from rmq_async.consumer.subscriptions import (
    RETRY_GROUP_TOPIC_PREFIX,
    Subscription,
    Subscriptions,
)
from rmq_async.consumer.tasks import TaskOwner, UserCall, acquire_by, running_user_call
from rmq_async.errors import IllegalStateError, InvalidArgumentError, InvalidTypeError
from rmq_async.protocol.bodies import INNER_PRODUCER_GROUP, ConsumerData, HeartbeatData, ProducerData
from rmq_async.protocol.codes import LanguageCode
from rmq_async.protocol.command import RemotingCommand
from rmq_async.protocol.filter import EXPRESSION_SQL92, SubscriptionData, build_subscription
from rmq_async.protocol.types import MessageExt, MessageQueue
from rmq_async.remoting.connection import Connection
from rmq_async.remoting.errors import RemotingError

if TYPE_CHECKING:
    from rmq_async.sinks.spark import SparkSink

log = structlog.get_logger(__name__)

T = TypeVar("T")

#: How long a call from another thread (:meth:`PushConsumer.pause` in a plain handler, say)
#: waits for the consumer's event loop to run it.
THREAD_CALL_TIMEOUT = 30.0

#: The consumer whose ``start()`` hooks or ``stop()`` the running code is part of, and which
#: of the two: calling ``start()`` or ``stop()`` of that consumer there could only wait for
#: itself.
_LIFECYCLE: contextvars.ContextVar[tuple[PushConsumer, str] | None] = \
    contextvars.ContextVar("rmq_async_lifecycle", default=None)


def lifecycle_under_way() -> tuple[PushConsumer, str] | None:
    """The consumer whose ``start()`` hooks (``"start"``) or ``stop()`` (``"stop"``) the
    running code is part of, while that start or stop runs; None elsewhere (a task a hook
    started, say, once the hook's start or stop has ended)."""
    within = _LIFECYCLE.get()
    if within is None:
        return None
    consumer, which = within
    running = consumer.starting if which == "start" else consumer._stop_running
    return within if running else None


def running_call_of(consumer: PushConsumer) -> UserCall | None:
    """The user call of ``consumer`` (a handler's, a listener's) that the running code is
    part of, while it runs; None elsewhere."""
    family = consumer.task_family()
    return running_user_call(family) if family is not None else None


P = ParamSpec("P")
R = TypeVar("R")


class PushConsumer:
    """A RocketMQ push consumer (Java ``DefaultMQPushConsumer``), asyncio-native.

    ::

        consumer = PushConsumer("orders-group", namesrv="127.0.0.1:9876")

        @consumer.subscribe("orders", tags="created || paid", model=Order)
        async def on_order(order: Order) -> None:
            ...                                   # returning acknowledges, raising retries

        async with consumer:
            await stop_event.wait()

    Options carry the Java client's names in snake_case and its defaults; see
    :class:`~rmq_async.consumer.options.ConsumerOptions`. A bad option or subscription
    expression raises :class:`~rmq_async.consumer.options.InvalidOptionError` or
    :class:`~rmq_async.errors.InvalidArgumentError` (both subclasses of ``ValueError``) here, at
    construction or at ``subscribe``.
    """

    def __init__(self, group: str, namesrv: str | list[str], *,
                 rebalance_listener: RebalanceListener | None = None, **options: Any) -> None:
        self.options: ConsumerOptions = ConsumerOptions.from_kwargs(group, **options)
        self.hooks = RebalanceHooks()
        if rebalance_listener is not None:
            self.hooks.add_listener(rebalance_listener)
        self.group = group
        from rmq_async.client.instance import parse_namesrv

        self.namesrv = parse_namesrv(namesrv)
        self.client_id = build_client_id(
            self.options.client_ip, self.options.instance_name, self.options.unit_name,
            self.options.message_model,
        )
        self.subscriptions = Subscriptions(group, self.options.message_model)
        self.retry_topic = self.subscriptions.retry_topic
        self._subs: dict[str, Subscription] = self.subscriptions.topics
        self._paused: set[str] = set()
        self.process_queues: dict[MessageQueue, ProcessQueue] = {}
        self.stats = ConsumerStats()
        self.stop_shortfalls: tuple[str, ...] = ()
        """What the last :meth:`stop` left undone within its timeout: ``"listeners"`` (listener
        calls or sink writes still running), ``"sinks"`` (a sink not closed), ``"offsets"``
        (the final offsets not all persisted) and ``"unlocks"`` (orderly locks not given
        back), or ``"failed"`` (the stop raised part-way), or ``"start"`` (a start under way
        was given up and had not ended a second timeout later). Empty after a clean stop."""
        self._started = False
        self._stopped = asyncio.Event()  # set while not started
        self._stopped.set()
        self._starting = False
        self._start_task: asyncio.Task[Any] | None = None  # the task of a start() under way
        self._start_given_up = False  # a stop() cancelled that start
        self._loop: asyncio.AbstractEventLoop | None = None  # the loop start() ran on
        self._stop_running = False  # a stop() is under way (its body, under the lock)
        self._start_lock = asyncio.Lock()
        self._owner: TaskOwner | None = None
        self._rt: ConsumerRuntime | None = None
        self._lag: LagMonitor | None = None
        # Set by start(): the worker threads of the concurrent and the orderly handlers.
        self._thread_limiters: tuple[anyio.CapacityLimiter, anyio.CapacityLimiter] | None = None
        # Set by start():
        self.instance: ClientInstance = None  # type: ignore[assignment]
        self.offset_store: OffsetStore = None  # type: ignore[assignment]
        self.pull_service: PullService = None  # type: ignore[assignment]
        self.consume_service: ConcurrentConsumeService = None  # type: ignore[assignment]
        self.orderly_service: OrderlyConsumeService = None  # type: ignore[assignment]
        self.sink_service: SinkConsumeService = None  # type: ignore[assignment]
        self.router: ServiceRouter = None  # type: ignore[assignment]
        self.rebalancer: Rebalancer = None  # type: ignore[assignment]
        self._request_handler = BrokerRequestHandler(self)
        self._persist_lock = asyncio.Lock()
        self.start_timestamp = 0
        self.errors = ErrorReporter()

    # ------------------------------------------------------------------ subscriptions

    @overload
    def subscribe(
        self, topic: str, tags: str = "*", *, sql: str | None = None, listener: None = None,
        orderly: bool = False, sink: None = None, batch: bool | None = None,
        model: type[Any] | None = None, decoder: Callable[[bytes], Any] | None = None,
    ) -> Callable[[Callable[P, R]], Callable[P, R]]: ...

    @overload
    def subscribe(
        self, topic: str, tags: str = "*", *, sql: str | None = None,
        listener: Callable[P, R], orderly: bool = False, sink: None = None,
        batch: bool | None = None, model: type[Any] | None = None,
        decoder: Callable[[bytes], Any] | None = None,
    ) -> Callable[P, R]: ...

    @overload
    def subscribe(
        self, topic: str, tags: str = "*", *, sql: None = None, listener: None = None,
        orderly: bool = False, sink: SparkSink, batch: None = None, model: None = None,
        decoder: None = None,
    ) -> None: ...

    def subscribe(
        self,
        topic: str,
        tags: str = "*",
        *,
        sql: str | None = None,
        listener: Callable[P, R] | None = None,
        orderly: bool = False,
        sink: SparkSink | None = None,
        batch: bool | None = None,
        model: type[Any] | None = None,
        decoder: Callable[[bytes], Any] | None = None,
    ) -> Callable[[Callable[P, R]], Callable[P, R]] | Callable[P, R] | None:
        """Subscribe ``topic`` with a TAG expression (``"*"`` or ``"a || b"``) or, with
        ``sql=``, an SQL92 filter on the message properties (the broker must enable
        ``enablePropertyFilter``, as the dev broker does).

        Used as a decorator it registers the decorated function as the topic's handler and
        returns it unchanged::

            @consumer.subscribe("orders", tags="created")
            async def handle(msg: MessageExt) -> None: ...

        It also accepts ``listener=fn`` or ``sink=SparkSink(...)`` directly.

        * Returning normally acknowledges; raising retries (concurrent: through the retry
          topic; orderly: the queue is suspended and the call repeated); raising
          :class:`~rmq_async.consumer.results.DeadLetter` sends to ``%DLQ%<group>`` at once.
          A returned :class:`ConsumeResult` keeps its Java meaning.
        * Handlers are per-message by default; ``batch=True`` or a ``list[...]`` annotation on
          the first parameter makes a batch handler. A per-message handler over a pulled batch
          is called once per message, and a failing message is retried alone while the others
          of the batch are acknowledged: a batch is a transport unit, and retrying messages
          that succeeded would repeat their side effects.
        * A parameter annotated ``ConsumeContext`` receives the context; any other parameter
          without a default is an :class:`~rmq_async.errors.InvalidTypeError` (a ``TypeError``)
          here.
        * ``model=`` / ``decoder=`` decode each body into the handler's payload
          (:mod:`rmq_async.payloads`); an undecodable body goes to the DLQ at once.
        * Several handlers may share a topic with disjoint tags (each message goes to the
          handler of its tag); an overlapping or repeated subscription raises
          :class:`~rmq_async.errors.InvalidArgumentError` (a ``ValueError``).

        Subscribing after ``start()`` takes effect at once: a rebalance round is triggered.
        """
        check_topic_name(topic)  # what no broker would create: an error now, not no route later
        if sql is not None:
            if tags != "*":
                raise InvalidArgumentError("give either tags= or sql=, not both")
            data = build_subscription(topic, sql, expression_type=EXPRESSION_SQL92)
            expression = sql
        else:
            data = build_subscription(topic, tags)
            expression = tags
        if topic.startswith(RETRY_GROUP_TOPIC_PREFIX):
            raise InvalidArgumentError(f"{topic!r} is a retry topic; it is subscribed automatically")
        if listener is not None and sink is not None:
            raise InvalidArgumentError("give either a listener or a sink, not both")
        if sink is not None:
            if orderly:
                raise InvalidArgumentError(
                    "a sink consumes concurrently; orderly=True is not supported with it")
            if batch is not None or model is not None or decoder is not None:
                raise InvalidArgumentError("batch=, model= and decoder= apply to handlers, not sinks")

        def register(fn: Callable[..., Any] | None) -> None:
            adapter = (ListenerAdapter(fn, batch=batch, model=model, decoder=decoder)
                       if fn is not None else None)
            self._on_loop(lambda: add(fn, adapter))

        def add(fn: Callable[..., Any] | None, adapter: ListenerAdapter | None) -> None:
            self.subscriptions.add(Subscription(
                topic=topic,
                expression=expression,
                data=data,
                listener=adapter,
                orderly=orderly,
                sink=sink,
                user_fn=fn,
            ))
            if self._started:
                self._give_threads()
                self._subscription_changed()

        if sink is not None:
            register(None)
            return None
        if listener is not None:
            register(listener)
            return listener

        def decorator(fn: Callable[P, R]) -> Callable[P, R]:
            register(fn)
            return fn

        return decorator

    def add_middleware(self, middleware: Middleware) -> Middleware:
        """Run ``middleware`` around every handler call (see :mod:`rmq_async.consumer.middleware`).

        Middlewares run in registration order, the first registered outermost. Also usable
        as a decorator (:meth:`middleware`).
        """
        check_middleware(middleware)
        self.subscriptions.middlewares.append(middleware)
        return middleware

    def middleware(self, middleware: Middleware) -> Middleware:
        """Decorator form of :meth:`add_middleware`::

            @consumer.middleware
            async def timing(call: ConsumeCall, call_next: CallNext) -> None:
                began = time.monotonic()
                try:
                    await call_next(call)
                finally:
                    observe(call.topic, time.monotonic() - began)
        """
        return self.add_middleware(middleware)

    def unsubscribe(self, topic: str) -> None:
        """Remove ``topic``'s subscription; after ``start()`` its queues are released at once.

        Messages of ``topic`` that come after that, through the group's retry topic (sent back
        before) or pulled just before the release, find no handler: they are sent back as
        failed, and reach the group's dead-letter queue (``%DLQ%<group>``) after
        ``max_reconsume_times``. (Java's one listener per consumer would still get them.)
        Subscribe the topic again to take them, or read them from the dead-letter queue."""
        def remove() -> None:
            if self._subs.pop(topic, None) is not None and self._started:
                self._subscription_changed()

        self._on_loop(remove)

    def _subscription_changed(self) -> None:
        if self.instance is not None:
            self._owner_spawn(self._after_subscription_change(), "subscription-change")

    async def _after_subscription_change(self) -> None:
        await self.sink_service.start_sinks()  # before the rebalance hands it any queue
        for topic in self.subscribed_topics():
            with contextlib.suppress(MQClientError, RemotingError):
                await self.instance.route(topic)
        await self.instance.send_heartbeats()
        self.rebalancer.wake()

    def subscribed_topics(self) -> list[str]:
        """The subscribed topics, the group's retry topic included (clustering)."""
        return self.subscriptions.subscribed_topics()

    def subscription_data(self, topic: str) -> SubscriptionData | None:
        """The filter sent to the broker for ``topic`` (``None`` if not subscribed)."""
        return self.subscriptions.subscription_data(topic)

    def listener_for(self, topic: str, msg: MessageExt | None = None) -> ListenerAdapter | None:
        """The handler for ``topic`` (for ``msg``'s tag when several share the topic; ``None``
        for a sink or no subscription)."""
        return self.subscriptions.listener_for(topic, msg)

    def is_orderly(self, topic: str) -> bool:
        """Whether ``topic`` is consumed orderly (``subscribe(..., orderly=True)``)."""
        return self.subscriptions.is_orderly(topic)

    # ------------------------------------------------------------------ pause / resume

    def pause(self, topics: Iterable[str] | str | None = None) -> None:
        """Stop pulling the given topics (all when ``None``) until :meth:`resume`.

        Long polls in flight for those topics are abandoned at once, so nothing pulled after
        this call reaches the listener; batches already handed to the consume side finish.

        Redeliveries of a topic's failed messages come through the group's retry topic
        (:attr:`retry_topic`), which all topics of the group share: ``pause()`` with no
        argument pauses it too (as Java's ``suspend()`` does), ``pause("orders")`` does not,
        and ``pause(["orders", consumer.retry_topic])`` holds back the retries of every topic.

        Safe to call from any thread (a plain ``def`` handler runs in a worker thread): the
        call is made on the consumer's event loop and waited for.
        """
        def pause() -> None:
            chosen = self._topic_set(topics)
            self._paused.update(chosen)
            self._interrupt_pulls(chosen)
            log.info("consumer.paused", group=self.group, topics=sorted(self._paused))

        self._on_loop(pause)

    def resume(self, topics: Iterable[str] | str | None = None) -> None:
        """Pull the given topics (all when ``None``) again, right away. Safe to call from any
        thread, as :meth:`pause` is."""

        def resume() -> None:
            chosen = set(self._paused) if topics is None else self._topic_set(topics)
            self._paused.difference_update(chosen)
            self._interrupt_pulls(chosen)
            log.info("consumer.resumed", group=self.group, paused=sorted(self._paused))

        self._on_loop(resume)

    def _on_loop(self, fn: Callable[[], T]) -> T:
        """``fn()`` on the consumer's event loop: here when called on it (or when it does not
        run), else handed to it from this thread and waited for.

        A plain (``def``) handler runs in a worker thread, and may call :meth:`pause` there
        as Java listeners call ``suspend()``: the consumer's state and tasks belong to its
        loop, which is not thread-safe.
        """
        loop = self._loop
        if loop is None or loop.is_closed() or not loop.is_running():
            return fn()
        with contextlib.suppress(RuntimeError):
            if asyncio.get_running_loop() is loop:
                return fn()
        done: concurrent.futures.Future[T] = concurrent.futures.Future()

        def run() -> None:
            if done.set_running_or_notify_cancel():
                try:
                    done.set_result(fn())
                except BaseException as exc:
                    done.set_exception(exc)

        try:
            loop.call_soon_threadsafe(run)
        except RuntimeError:  # the loop closed meanwhile: nothing runs on it any more
            return fn()
        try:
            return done.result(timeout=THREAD_CALL_TIMEOUT)
        except TimeoutError:
            if not done.cancel():  # it runs (or ran) meanwhile after all: its outcome
                return done.result()
            # Not run later either, once the caller was told that it failed.
            raise TimeoutError(f"the consumer's event loop did not take the call within "
                               f"{THREAD_CALL_TIMEOUT:g} s (is it blocked?)") from None

    def _interrupt_pulls(self, topics: set[str]) -> None:
        if self.pull_service is None or self.stopping:
            return
        for mq in list(self.process_queues):
            if mq.topic in topics:
                self.pull_service.interrupt(mq)

    def _topic_set(self, topics: Iterable[str] | str | None) -> set[str]:
        if topics is None:
            return set(self.subscribed_topics())
        if isinstance(topics, str):
            return {topics}
        return set(topics)

    def is_paused(self, topic: str) -> bool:
        """Whether pulling ``topic`` is paused by :meth:`pause`."""
        return topic in self._paused

    # ------------------------------------------------------------------ lifecycle

    async def __aenter__(self) -> PushConsumer:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    @property
    def starting(self) -> bool:
        """``start()`` is under way (begun, not yet finished or failed)."""
        return self._starting

    @property
    def stopping(self) -> bool:
        """``stop()`` has begun (and the consumer was not started again since)."""
        return self._rt is not None and self._rt.stopping

    async def start(self) -> None:
        """Connect, register with the brokers and start consuming.

        A :meth:`stop` called meanwhile waits for the start up to its ``timeout``, then gives
        it up: the start undoes what it began and raises
        :class:`~rmq_async.errors.IllegalStateError`.

        Raises :class:`~rmq_async.errors.IllegalStateError` when already started and
        :class:`~rmq_async.errors.InvalidArgumentError` without a subscription; the broker's
        refusal (for example a missing permission) raises its
        :class:`~rmq_async.client.errors.MQBrokerError`.
        """
        within = lifecycle_under_way()
        if within is not None and within[0] is self:
            raise IllegalStateError(f"start() called from inside this consumer's {within[1]}()")
        async with self._start_lock:
            if self._started:
                raise IllegalStateError("consumer already started")
            if not self._subs:
                raise InvalidArgumentError("subscribe at least one topic before start()")
            self._starting = True
            self._start_task = me = asyncio.current_task()
            baseline = me.cancelling() if me is not None else 0
            self._start_given_up = False
            self._stopped.clear()
            try:
                await self._start()
            except asyncio.CancelledError:
                # (Compared with the cancellations requested before, as asyncio.timeout()
                # does: one of the caller's own is passed on.)
                if self._start_given_up and me is not None and me.uncancel() <= baseline:
                    raise IllegalStateError(_GIVEN_UP) from None
                raise
            else:
                if self._start_given_up:
                    # The give-up's cancellation was swallowed (by an on_startup hook) and the
                    # start went through: it is undone here, and fails all the same.
                    if me is not None:
                        me.uncancel()
                    self._stop_running = True
                    try:
                        await self._stop(STAGE_MIN_SECONDS, None)
                    finally:
                        self._stop_running = False
                    raise IllegalStateError(_GIVEN_UP)
            finally:
                self._starting = False
                self._start_task = None
                if not self._started:  # the start failed: stopped as before
                    self._stopped.set()

    async def _start(self) -> None:
        """The body of :meth:`start`, under its lock."""
        self._loop = asyncio.get_running_loop()
        self._rt = None  # the runtime of a stop() before is not this start's
        self.start_timestamp = int(time.time() * 1000)
        self.subscriptions.reset_retry()
        # (Reading a CA bundle is file I/O: off the event loop.)
        ssl_context = (await anyio.to_thread.run_sync(self.options.client_ssl_context,
                                                      self.client_id)
                       if self.options.tls_enabled else None)
        self.instance = ClientInstance(
            self.namesrv,
            self.client_id,
            heartbeat_source=self.heartbeat_data,
            route_topics=self.subscribed_topics,
            request_handler=self._handle_broker_request,
            rpc_hook=self.options.rpc_hook(),
            ssl=ssl_context,
            api_timeout=self.options.api_timeout,
            language=LanguageCode[self.options.language],
        )
        if self.options.message_model == MessageModel.BROADCASTING:
            self.offset_store = LocalFileOffsetStore(
                self.options.offset_store_dir, self.client_id, self.group
            )
        else:
            self.offset_store = BrokerOffsetStore(self.instance, self.group)
        await self.offset_store.load()
        self._owner = TaskOwner(f"consumer[{self.group}]")
        rt = self._rt = ConsumerRuntime(
            group=self.group, client_id=self.client_id, options=self.options,
            subscriptions=self.subscriptions, process_queues=self.process_queues,
            paused=self._paused, stats=self.stats, errors=self.errors,
            instance=self.instance, offset_store=self.offset_store, tasks=self._owner,
        )
        # The three consumption services are peers behind one interface; the pull loop
        # hands each pulled chunk to the one of its topic, through the router.
        self.consume_service = ConcurrentConsumeService(rt)
        self.orderly_service = OrderlyConsumeService(rt)
        self.sink_service = SinkConsumeService(rt)
        self.router = ServiceRouter(self.subscriptions, concurrent=self.consume_service,
                                    orderly=self.orderly_service, sink=self.sink_service)
        rebalance_now = asyncio.Event()
        self.pull_service = PullService(rt, self.router, on_queue_forgotten=rebalance_now.set)
        self.rebalancer = Rebalancer(rt, self.pull_service, self.orderly_service,
                                     wakeup=rebalance_now, hooks=self.hooks)
        self._lag = LagMonitor(rt)
        try:
            for topic in self.subscribed_topics():
                try:
                    await self.instance.update_route(topic)
                except NoRouteError as exc:
                    # A new group's retry topic is created by the broker on the first
                    # heartbeat. Any other topic may not be created yet, or the name server
                    # asked may have restarted before the brokers registered again: as
                    # Java's start does, this is a warning, and the rebalancer takes the
                    # topic once its route appears.
                    if topic != self.retry_topic:
                        log.warning("consumer.topic_has_no_route", group=self.group,
                                    topic=topic, error=str(exc))
            await raise_if_refused(self, await self.instance.send_heartbeats())
            await self.sink_service.start_sinks()
            # Before the first rebalance and pull.
            lifecycle = _LIFECYCLE.set((self, "start"))
            try:
                await self.hooks.run_startup(self.group)
            finally:
                _LIFECYCLE.reset(lifecycle)
        except BaseException:
            # Failing already: a stop() meanwhile waits for this clean-up rather than cut it
            # short (and hide why the start failed).
            self._start_task = None
            await self._owner.aclose()
            await self.instance.close()
            raise
        self.errors.owner = self._owner
        self._thread_limiters = (anyio.CapacityLimiter(self.options.consume_concurrency),
                                 anyio.CapacityLimiter(self.options.consume_concurrency))
        self._give_threads()
        for service in self._services():
            service.start()
        o = self.options
        self._owner.spawn(self.rebalancer.run(), name="rebalance")
        self._owner.spawn(self._persist_loop(), name="persist-offsets")
        self._owner.spawn(self._lag.run(), name="lag")
        self._owner.spawn(self.instance.heartbeat_loop(o.heartbeat_interval), name="heartbeat")
        self._owner.spawn(self.instance.route_refresh_loop(o.route_refresh_interval),
                          name="route-refresh")
        self._started = True
        log.info("consumer.started", group=self.group, client_id=self.client_id,
                 topics=list(self._subs), model=str(o.message_model))

    def _give_threads(self) -> None:
        """Each handler's worker threads: those of its consume service (concurrent, orderly),
        as many as ``consume_concurrency`` each, as Java gives each its own thread pool."""
        if self._thread_limiters is None:
            return
        concurrent, orderly = self._thread_limiters
        for sub in self.subscriptions.topics.values():
            # (Handlers sharing a topic by tag are the subscription's parts.)
            for adapter in (sub.listener, *sub.by_tag.values()):
                if adapter is not None:
                    adapter.limiter = orderly if sub.orderly else concurrent

    def _services(self) -> tuple[SinkConsumeService, ConcurrentConsumeService,
                                 OrderlyConsumeService]:
        return (self.sink_service, self.consume_service, self.orderly_service)

    def _owner_spawn(self, coro: Any, name: str) -> None:
        if self._owner is None:
            coro.close()
            return
        self._owner.spawn(coro, name=name)

    async def stop(self, timeout: float | timedelta = 30.0) -> None:
        """Stop consuming and release everything.

        Pulling stops at once; listener calls already running may finish (up to ``timeout``
        seconds, a float or a ``timedelta``) and their acknowledgements are committed, and a
        rebalance round under way ends (within the same time, at least a second). Error
        events reported until then reach the ``on_error`` handlers, in at most half of what
        is left of ``timeout`` (at least half a second). The ``on_revoked`` listeners, then
        the ``on_shutdown`` hooks, run in what is left of ``timeout`` (each group at least a
        second, or ``timeout`` when shorter); a hook over time is cancelled and not waited
        for. Offsets are persisted and orderly queues unlocked, each in what is left of
        ``timeout`` as well (at least a second: a broker that stopped answering does not
        hold ``stop()`` up longer), the client is unregistered from the brokers (as long as
        that lasts too; a broker also forgets a client whose connection closed) and the
        connections are closed. Afterwards no task of this consumer is left running, but for
        code that ignored its cancellation (a hook, a handler, a listener called by an admin
        tool's consume-directly request), each given what was left of its stage and then
        logged and left to end on its own, and a sink write still running in its thread
        past the timeout (a Spark call cannot be interrupted; that batch is not acknowledged,
        and its messages come again).

        A :meth:`start` under way is waited for first, up to ``timeout``; one that takes
        longer (an ``on_startup`` hook waiting for something that does not answer) is given
        up, and that ``start()`` raises :class:`~rmq_async.errors.IllegalStateError`.

        Called from the consumer's own code while it runs (a handler, a rebalance listener,
        an ``on_error`` handler, a thread one of them runs in or a task it started and
        awaits), ``stop()`` does not wait for that very call: it stops the consumer and
        returns to it. The call then ends as it would, but as with Java's ``shutdown()``
        called from a listener its messages are not acknowledged (its queue is given up
        under it), nor are the others of its pulled chunk: they come again, to the group's
        next consumer of the queue. There, while a stop is under way already (and from the
        ``on_revoked`` and ``on_shutdown`` hooks of a stop), it returns at once: that stop
        goes on. From an ``on_startup`` hook it raises
        :class:`~rmq_async.errors.IllegalStateError` (the hook raises to fail the start).
        """
        if isinstance(timeout, timedelta):
            timeout = timeout.total_seconds()
        within = lifecycle_under_way()
        if within is not None and within[0] is self:
            if within[1] == "stop":
                return  # a hook of this very stop
            raise IllegalStateError("stop() called from inside this consumer's start() "
                                    "(an on_startup hook raises to fail the start)")
        call = running_call_of(self)
        if call is not None and self._stop_running:
            return  # the stop under way waits for this very call
        lifecycle = _LIFECYCLE.set((self, "stop"))
        try:
            lock = self._start_lock
            loop = asyncio.get_running_loop()
            if not await acquire_by(lock, loop.time() + timeout):
                # A start under way for all of timeout (an on_startup hook waiting for a
                # service that does not answer, say) is given up: it undoes what it began.
                if not self._give_up_start(timeout):
                    await lock.acquire()  # another stop() (bounded), a failing start's undo
                elif not await acquire_by(lock, loop.time() + max(timeout, STAGE_MIN_SECONDS)):
                    # A hook that swallowed its cancellation and waits on: the start undoes
                    # itself whenever it ends (start() below).
                    log.error("consumer.start_not_given_up", group=self.group)
                    self.stop_shortfalls = ("start",)
                    return
            try:
                if self._started:
                    self._stop_running = True
                    try:
                        await self._stop(timeout, call)
                    finally:
                        self._stop_running = False
            finally:
                lock.release()
        finally:
            _LIFECYCLE.reset(lifecycle)

    def task_family(self) -> object | None:
        """The family of this run's tasks (see :func:`~rmq_async.consumer.tasks.enter_user_call`),
        or None when not started."""
        return self._owner.family if self._owner is not None else None

    def _give_up_start(self, waited: float) -> bool:
        """Cancel a :meth:`start` under way (``stop()`` waited ``waited`` seconds for it):
        it undoes what it began and raises :class:`~rmq_async.errors.IllegalStateError`.
        False when no start is under way."""
        start = self._start_task
        if start is None or start.done() or self._start_given_up:
            return False
        log.warning("consumer.start_given_up", group=self.group, waited=waited)
        self._start_given_up = True
        start.cancel()
        return True

    async def _stop(self, timeout: float, call: UserCall | None) -> None:
        """The body of :meth:`stop`, under its lock; ``call`` is the consumer's own user call
        (a handler's) that called it, or None."""
        assert self._owner is not None and self._rt is not None
        caller = call.task if call is not None else None
        stop_by = asyncio.get_running_loop().time() + timeout
        self._rt.stopping = True
        shortfalls: list[str] = []
        self.stop_shortfalls = ("failed",)  # until this stop has gone through
        owner = self._owner
        loop = asyncio.get_running_loop()

        def stage_left() -> float:
            # (At least a tenth of a second: tasks just cancelled get to end, not abandoned
            # before their first step, with a timeout near 0.)
            return max(_stage_deadline(stop_by, timeout) - loop.time(), 0.1)

        # 1. no new rebalances, heartbeats or pulls
        await self.pull_service.aclose(abandon_after=stage_left())
        # 2. sinks flush what they hold; running listeners finish (side by side)
        if not await wait_all_idle(self._services(), timeout, caller):
            log.warning("consumer.stop_timeout", group=self.group, timeout=timeout)
            shortfalls.append("listeners")
        # (A handler still running is cancelled; one that swallows that is left to end on
        # its own once the stage's time is up, not waited for a minute.)
        await self.consume_service.aclose(abandon_after=stage_left())
        # Orderly queues given up while a batch ran on: persisted and unlocked once it ended.
        await self.orderly_service.finish_releases(
            stage_left(), call.queue if call is not None else None)
        await self.orderly_service.aclose(abandon_after=stage_left())
        # The error events reported so far reach their handlers before the delivery
        # task ends with the others below, in at most half of what is left of the
        # timeout (a hung handler must not take the offsets' and sinks' time), but at
        # least half a second (or of the timeout when shorter).
        await self.errors.drain(max((stop_by - asyncio.get_running_loop().time()) / 2,
                                    min(STAGE_MIN_SECONDS, timeout) / 2), caller)
        # A periodic persist round still sending ends first (an older offset of it that
        # the broker applied after the final one would move the queue back), as long as
        # the timeout lasts; one still going then is cancelled with the other tasks.
        # A rebalance round under way ends first too: a queue it is releasing is out of
        # the table already, so cut off (its task is cancelled below) it would miss the
        # final persist and unlock (redelivered from its last persisted offset, its broker
        # lock left to lapse). A round that adds queues ends at once while stopping. (A
        # round whose rebalance listener called this stop holds the lock, waiting for it.)
        rebalancing = locked = False
        try:  # (both released whatever happens: a stop() cancelled here may be called again)
            rebalancing = (self.rebalancer is not None
                           and (caller is None or self.rebalancer.round_task is not caller)
                           and await acquire_by(self.rebalancer.table_lock,
                                                 _stage_deadline(stop_by, timeout)))
            locked = await acquire_by(self._persist_lock,
                                       _stage_deadline(stop_by, timeout))
            # The sinks' tasks and the sink send-backs among them. A sink's writer waits
            # for a write running in its thread (a Spark call cannot be interrupted): it
            # is given up, its batch unacknowledged, when the stage's time is up.
            stage_end = _stage_deadline(stop_by, timeout)
            await owner.aclose(
                abandon_after=stage_end - asyncio.get_running_loop().time())
        finally:
            if locked:
                self._persist_lock.release()
            if rebalancing:
                self.rebalancer.table_lock.release()
        self.errors.owner = None
        try:
            async with asyncio.timeout_at(_stage_deadline(stop_by, timeout)):
                await self.sink_service.aclose()
        except TimeoutError:
            log.warning("consumer.sink_close_timeout", group=self.group)
            shortfalls.append("sinks")
        # 3. the rebalance listeners hear that every queue is given up, then what was
        # acknowledged is persisted and the queues are forgotten
        await self.hooks.fire_revoked(self.group, set(self.process_queues),
                                      deadline=_stage_deadline(stop_by, timeout))
        try:
            async with asyncio.timeout_at(_stage_deadline(stop_by, timeout)):
                await self.offset_store.persist_all(set(self.process_queues), oneway=False)
        except TimeoutError:
            log.warning("consumer.persist_on_stop_timeout", group=self.group)
            shortfalls.append("offsets")
        except Exception as exc:
            log.warning("consumer.persist_on_stop_failed", error=str(exc))
            shortfalls.append("offsets")
        try:
            async with asyncio.timeout_at(_stage_deadline(stop_by, timeout)):
                await self._unlock_all_on_stop()
        except TimeoutError:
            log.warning("consumer.unlock_on_stop_timeout", group=self.group)
            shortfalls.append("unlocks")
        for pq in self.process_queues.values():
            pq.dropped = True
        self.process_queues.clear()
        await self.hooks.run_shutdown(self.group, deadline=_stage_deadline(stop_by, timeout))
        # 4. leave the group and close the connections (a broker that does not answer the
        # unregistration forgets the client when its connection closes)
        try:
            async with asyncio.timeout_at(_stage_deadline(stop_by, timeout)):
                await self.instance.unregister(None, self.group)
        except TimeoutError:
            log.warning("consumer.unregister_timeout", group=self.group)
        await self.instance.close(spare=caller)
        self._owner = None
        self._lag = None
        self._started = False
        self._stopped.set()
        self.stop_shortfalls = tuple(shortfalls)
        log.info("consumer.stopped", group=self.group, client_id=self.client_id,
                 **({"left_undone": list(shortfalls)} if shortfalls else {}))

    async def _unlock_all_on_stop(self) -> None:
        """Orderly consumers give their broker locks back."""
        if self.options.message_model != MessageModel.CLUSTERING:
            return
        orderly = [mq for mq in self.process_queues if self.is_orderly(mq.topic)]
        if orderly:
            await self.orderly_service.unlock_all(orderly)

    async def _persist_loop(self) -> None:
        # Each round waits for the broker's answers (Java sends them oneway). A oneway update
        # can be applied by the broker after a later one, since its request threads run in
        # parallel, and so move a committed offset backwards; ``stop()`` takes the lock so no
        # round is half sent when the final offsets go out.
        interval = self.options.persist_offset_interval
        while True:
            await asyncio.sleep(interval)
            async with self._persist_lock:
                try:
                    await self.offset_store.persist_all(set(self.process_queues), oneway=False)
                except Exception as exc:
                    log.warning("offset.persist_round_failed", error=str(exc))

    # ------------------------------------------------------------------ heartbeat

    def heartbeat_data(self) -> HeartbeatData:
        """The HEART_BEAT body this consumer sends: its group, model and subscriptions."""
        subs = self.subscriptions.heartbeat_data_set()
        return HeartbeatData(
            client_id=self.client_id,
            consumer_data_set=[
                ConsumerData(
                    group_name=self.group,
                    consume_type="CONSUME_PASSIVELY",
                    message_model=str(self.options.message_model),
                    consume_from_where=str(self.options.consume_from_where),
                    subscription_data_set=subs,
                    unit_mode=False,
                )
            ],
            # The client's own sends (dead-letter and retry copies) go as this group.
            producer_data_set=[ProducerData(INNER_PRODUCER_GROUP)],
        )

    # ------------------------------------------------------------------ queues

    async def remove_queue(self, mq: MessageQueue, *, reason: str) -> None:
        """Give ``mq`` up (see :meth:`Rebalancer.remove_queue`); no rebalance round runs
        meanwhile (it would take the queue again, with an older offset, while its offset is
        being persisted). The next round may take it again."""
        async with self.rebalancer.table_lock:
            await self.rebalancer.remove_queue(mq, reason=reason)

    async def send_message_back(self, msg: MessageExt, delay_level: int) -> bool:
        """CONSUMER_SEND_MSG_BACK for a failed message; ``False`` if it could not be handed back."""
        if self._rt is None:
            raise IllegalStateError("the consumer was never started")
        return await self._rt.send_message_back(msg, delay_level)

    # ------------------------------------------------------------------ broker requests

    async def _handle_broker_request(self, cmd: RemotingCommand,
                                     conn: Connection) -> RemotingCommand | None:
        return await self._request_handler(cmd, conn)

    # ------------------------------------------------------------------ introspection

    def stats_snapshot(self) -> dict[str, dict[str, Any]]:
        """Per-topic statistics of the subscribed topics (the retry topic included).

        For each topic: ``pullRT`` / ``consumeRT`` (average milliseconds per pull / listener
        call over the last minute), ``pullTPS`` / ``consumeOKTPS`` / ``consumeFailedTPS``
        (messages per second over the last minute) and ``consumeFailedMsgs`` (failed messages
        in the last hour) — the figures ``mqadmin consumerStatus`` shows (a retried message's
        consume figures count under its own topic, where Java's count under
        ``%RETRY%<group>``) — and ``errors``:
        the :class:`~rmq_async.consumer.events.ConsumerError` events reported for the topic
        since the consumer was created, by kind.
        """
        return {topic: {**self.stats.snapshot(topic), "errors": self.errors.topic_counts(topic)}
                for topic in self.subscribed_topics()}

    def on_error(self, handler: ErrorHandler) -> ErrorHandler:
        """Register ``handler`` (a function or ``async def``, usable as a decorator) for the
        problems the consumer works around without stopping: a corrupt record skipped, a
        queue the broker refuses. It receives a :class:`ConsumerError`, in the order the
        events happened; a plain function runs in a worker thread, never on the event loop."""
        self.errors.handlers.append(handler)
        return handler

    def report_error(self, event: ConsumerError) -> None:
        """Count ``event`` and pass it to the :meth:`on_error` handlers."""
        self.errors.report(event)

    # ------------------------------------------------------------------ hooks

    def on_assigned(self, fn: QH) -> QH:
        """Register ``fn(queues)`` (``async def`` or plain; usable as a decorator), awaited after
        a rebalance took new queues and before their first pull. See
        :mod:`rmq_async.consumer.hooks`."""
        self.hooks.assigned.append(_callable(fn))
        return fn

    def on_revoked(self, fn: QH) -> QH:
        """Register ``fn(queues)``, awaited when queues are given up (a rebalance, ``stop()``),
        before their offsets are persisted and their process queues dropped."""
        self.hooks.revoked.append(_callable(fn))
        return fn

    def on_startup(self, fn: LH) -> LH:
        """Register ``fn()``, awaited by ``start()`` before the first pull; an exception fails
        ``start()``."""
        self.hooks.startup.append(_callable(fn))
        return fn

    def on_shutdown(self, fn: LH) -> LH:
        """Register ``fn()``, awaited by ``stop()`` after the drain and the final offset
        persist, before the connections close; an exception is logged."""
        self.hooks.shutdown.append(_callable(fn))
        return fn

    # ------------------------------------------------------------------ state

    @property
    def is_running(self) -> bool:
        """``True`` from the end of a successful :meth:`start` until :meth:`stop` begins."""
        return self._started and not self.stopping

    @property
    def stopped(self) -> bool:
        """``True`` while the consumer is not started: before :meth:`start`, after a failed
        one, and once a :meth:`stop` has gone through."""
        return not (self._started or self._starting)

    async def wait_stopped(self) -> None:
        """Return once the consumer is stopped: at once when it is not started, else when a
        :meth:`stop` has gone through, whoever called it (a handler, an app, another task),
        and no :meth:`start` has begun again since."""
        while not self.stopped:
            await self._stopped.wait()

    def assignment(self) -> frozenset[MessageQueue]:
        """The queues this member holds now (its share of the last rebalance), retry queues
        included; empty when the consumer is not running."""
        return frozenset(self.process_queues)

    # ------------------------------------------------------------------ lag and health

    def lag(self) -> dict[MessageQueue, QueueLag]:
        """Lag of every queue assigned now: broker max offset - committed offset.

        The figures are refreshed every ``persist_offset_interval`` seconds by a task of the
        consumer (see :mod:`rmq_async.consumer.lag`); a queue assigned since the last refresh
        is missing until the next one. Empty when the consumer is not running.
        """
        lag = self._lag  # read once: stop() may clear it meanwhile (a scrape's thread)
        return lag.snapshot() if lag is not None else {}

    async def refresh_lag(self) -> dict[MessageQueue, QueueLag]:
        """Read every assigned queue's max offset now and return :meth:`lag`."""
        lag = self._lag
        if lag is None:
            return {}
        return await lag.refresh()

    def is_healthy(self) -> bool:
        """``True`` while the consumer runs and at least one broker answered its last
        heartbeat round.

        A consumer that lost every broker turns unhealthy with the next heartbeat round, so
        within ``heartbeat_interval`` seconds (plus the request timeout when the brokers went
        silent rather than away); it is healthy again as soon as one broker answers a
        heartbeat (a new connection sends one at once). It is false too when no heartbeat
        succeeded for two intervals plus the request timeout (the heartbeat loop itself is
        stuck, e.g. the event loop is starved).
        """
        if not self._started or self.stopping or self.instance is None:
            return False
        last = self.instance.last_heartbeat_ok
        o = self.options
        if last is None or time.monotonic() - last > 2 * o.heartbeat_interval + o.api_timeout:
            return False
        return bool(self.instance.brokers_reachable)

    def running_tasks(self) -> int:
        """How many background tasks the consumer owns right now (0 once stopped)."""
        n = 0
        for owner in (self._owner,):
            if owner is not None:
                n += len(owner)
        return n

    def __repr__(self) -> str:
        state = "started" if self._started else "stopped"
        return (f"<PushConsumer group={self.group!r} client_id={self.client_id!r} {state} "
                f"queues={len(self.process_queues)}>")


QH = TypeVar("QH", bound=QueuesHook)
LH = TypeVar("LH", bound=LifespanHook)


def _callable(fn: Callable[..., Any]) -> Callable[..., Any]:
    if not callable(fn):
        raise InvalidTypeError(f"a hook must be callable, got {fn!r}")
    return fn


def _pid() -> int:
    return os.getpid()


__all__ = ["RETRY_GROUP_TOPIC_PREFIX", "PushConsumer", "Subscription", "MQBrokerError"]


#: The least time stop() gives the on_revoked hooks, and then the on_shutdown hooks, however
#: long the drain took (capped by stop()'s timeout).
STAGE_MIN_SECONDS = 1.0
_GIVEN_UP = ("the start was given up: stop() was called and the start did not finish within "
             "its timeout")


def _stage_deadline(stop_by: float, timeout: float) -> float:
    """When a stage of ``stop()`` that talks to brokers or runs hooks must be done (event loop
    time): what is left of its timeout, at least :data:`STAGE_MIN_SECONDS` (or the timeout
    when that is shorter)."""
    now = asyncio.get_running_loop().time()
    return max(stop_by, now + min(STAGE_MIN_SECONDS, timeout))

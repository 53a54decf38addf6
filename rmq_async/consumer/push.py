"""``PushConsumer``: the public consumer API and the owner of the three loops."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import os
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar

import structlog

from rmq_async.client.errors import MQBrokerError, MQClientError, NoRouteError
from rmq_async.client.instance import ClientInstance
from rmq_async.consumer.admin import BrokerRequestHandler, raise_if_refused
from rmq_async.consumer.consume import ConcurrentConsumeService, ListenerAdapter
from rmq_async.consumer.events import ConsumerError, ErrorHandler, ErrorReporter
from rmq_async.consumer.offset_store import (
    OFFSET_NOT_FOUND,
    BrokerOffsetStore,
    LocalFileOffsetStore,
    OffsetStore,
)
from rmq_async.consumer.options import (
    ConsumeFromWhere,
    ConsumerOptions,
    MessageModel,
    build_client_id,
)
from rmq_async.consumer.orderly import OrderlyConsumeService
from rmq_async.consumer.process_queue import ProcessQueue
from rmq_async.consumer.pull import PullRequest, PullService
from rmq_async.consumer.rebalance import Rebalancer
from rmq_async.consumer.stats import ConsumerStats
from rmq_async.consumer.tasks import TaskOwner
from rmq_async.protocol.bodies import ConsumerData, HeartbeatData
from rmq_async.protocol.command import RemotingCommand
from rmq_async.protocol.filter import SubscriptionData, build_subscription
from rmq_async.protocol.types import PROPERTY_RETRY_TOPIC, MessageExt, MessageQueue
from rmq_async.remoting.connection import Connection
from rmq_async.remoting.errors import RemotingError

if TYPE_CHECKING:
    from rmq_async.sinks.spark import SparkSink

log = structlog.get_logger(__name__)

F = TypeVar("F", bound=Callable[..., Any])

RETRY_GROUP_TOPIC_PREFIX = "%RETRY%"


@dataclass(slots=True)
class Subscription:
    topic: str
    expression: str
    data: SubscriptionData
    listener: ListenerAdapter | None = None
    orderly: bool = False
    sink: SparkSink | None = None
    user_fn: Any = None
    extra: dict[str, Any] = field(default_factory=dict)


class PushConsumer:
    """A RocketMQ push consumer (Java ``DefaultMQPushConsumer``), asyncio-native.

    ::

        consumer = PushConsumer("orders-group", namesrv="127.0.0.1:9876")

        @consumer.subscribe("orders", tags="created || paid")
        async def on_orders(msgs: list[MessageExt]) -> ConsumeResult:
            ...
            return ConsumeResult.SUCCESS

        async with consumer:
            await stop_event.wait()

    Options carry the Java client's names in snake_case and its defaults; see
    :class:`~rmq_async.consumer.options.ConsumerOptions`. A bad option or subscription
    expression raises ``ValueError`` here, at construction or at ``subscribe``.
    """

    def __init__(self, group: str, namesrv: str | list[str], **options: Any) -> None:
        self.options: ConsumerOptions = ConsumerOptions.from_kwargs(group, **options)
        self.group = group
        from rmq_async.client.instance import parse_namesrv

        self.namesrv = parse_namesrv(namesrv)
        self.client_id = build_client_id(
            self.options.client_ip, self.options.instance_name, self.options.unit_name,
            self.options.message_model,
        )
        self.retry_topic = RETRY_GROUP_TOPIC_PREFIX + group
        self._subs: dict[str, Subscription] = {}
        self._paused: set[str] = set()
        self.process_queues: dict[MessageQueue, ProcessQueue] = {}
        self.stats = ConsumerStats()
        self.stopping = False
        self._started = False
        self._start_lock = asyncio.Lock()
        self._owner: TaskOwner | None = None
        self.instance: ClientInstance = None  # type: ignore[assignment]  # set by start()
        self.offset_store: OffsetStore = None  # type: ignore[assignment]
        self.pull_service: PullService = None  # type: ignore[assignment]
        self.consume_service: ConcurrentConsumeService = None  # type: ignore[assignment]
        self.orderly_service: OrderlyConsumeService = None  # type: ignore[assignment]
        self.rebalancer = Rebalancer(self)
        self._request_handler = BrokerRequestHandler(self)
        self._sub_version_override: dict[str, int] = {}
        self._persist_lock = asyncio.Lock()
        self.start_timestamp = 0
        self.errors = ErrorReporter()

    # ------------------------------------------------------------------ subscriptions

    def subscribe(
        self,
        topic: str,
        tags: str = "*",
        *,
        listener: Callable[..., Any] | None = None,
        orderly: bool = False,
        sink: SparkSink | None = None,
    ) -> Any:
        """Subscribe ``topic`` with a TAG expression (``"*"`` or ``"a || b"``).

        Used as a decorator it registers the decorated function as the topic's listener::

            @consumer.subscribe("orders", tags="created")
            async def handle(msgs): ...

        It also accepts ``listener=fn`` or ``sink=SparkSink(...)`` directly. Subscribing after
        ``start()`` takes effect at once: a rebalance round is triggered.
        """
        data = build_subscription(topic, tags)
        if topic.startswith(RETRY_GROUP_TOPIC_PREFIX):
            raise ValueError(f"{topic!r} is a retry topic; it is subscribed automatically")
        if listener is not None and sink is not None:
            raise ValueError("give either a listener or a sink, not both")
        if orderly and sink is not None:
            raise ValueError("a sink consumes concurrently; orderly=True is not supported with it")

        def register(fn: Callable[..., Any] | None) -> None:
            self._subs[topic] = Subscription(
                topic=topic,
                expression=tags,
                data=data,
                listener=ListenerAdapter(fn) if fn is not None else None,
                orderly=orderly,
                sink=sink,
                user_fn=fn,
            )
            if self._started:
                self._subscription_changed()

        if listener is not None or sink is not None:
            register(listener)
            return listener

        def decorator(fn: F) -> F:
            register(fn)
            return fn

        return decorator

    def unsubscribe(self, topic: str) -> None:
        if self._subs.pop(topic, None) is not None and self._started:
            self._subscription_changed()

    def _subscription_changed(self) -> None:
        if self.instance is not None:
            self._owner_spawn(self._after_subscription_change(), "subscription-change")

    async def _after_subscription_change(self) -> None:
        for topic in self.subscribed_topics():
            with contextlib.suppress(MQClientError, RemotingError):
                await self.instance.route(topic)
        await self.instance.send_heartbeats()
        self.rebalancer.wake()

    def subscribed_topics(self) -> list[str]:
        topics = list(self._subs)
        if self._subs and self.options.message_model == MessageModel.CLUSTERING:
            topics.append(self.retry_topic)
        return topics

    def subscription_data(self, topic: str) -> SubscriptionData | None:
        if topic == self.retry_topic:
            return self._retry_sub
        sub = self._subs.get(topic)
        return sub.data if sub else None

    def listener_for(self, topic: str) -> ListenerAdapter | None:
        sub = self._subs.get(topic)
        return sub.listener if sub else None

    def is_orderly(self, topic: str) -> bool:
        if topic == self.retry_topic:
            # As in Java, where orderliness belongs to the consumer: a consumer whose
            # subscriptions are all orderly also locks and consumes its retry queue in order.
            return bool(self._subs) and all(s.orderly for s in self._subs.values())
        sub = self._subs.get(topic)
        return bool(sub and sub.orderly)

    # ------------------------------------------------------------------ pause / resume

    def pause(self, topics: Iterable[str] | str | None = None) -> None:
        """Stop pulling the given topics (all when ``None``) until :meth:`resume`.

        Long polls in flight for those topics are abandoned at once, so nothing pulled after
        this call reaches the listener; batches already handed to the consume side finish.
        """
        chosen = self._topic_set(topics)
        self._paused.update(chosen)
        self._interrupt_pulls(chosen)
        log.info("consumer.paused", group=self.group, topics=sorted(self._paused))

    def resume(self, topics: Iterable[str] | str | None = None) -> None:
        """Pull the given topics (all when ``None``) again, right away."""
        chosen = set(self._paused) if topics is None else self._topic_set(topics)
        self._paused.difference_update(chosen)
        self._interrupt_pulls(chosen)
        log.info("consumer.resumed", group=self.group, paused=sorted(self._paused))

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
        return topic in self._paused

    # ------------------------------------------------------------------ lifecycle

    async def __aenter__(self) -> PushConsumer:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    async def start(self) -> None:
        async with self._start_lock:
            if self._started:
                raise RuntimeError("consumer already started")
            if not self._subs:
                raise ValueError("subscribe at least one topic before start()")
            self.stopping = False
            self.start_timestamp = int(time.time() * 1000)
            self._retry_sub = build_subscription(self.retry_topic, "*")
            self.instance = ClientInstance(
                self.namesrv,
                self.client_id,
                heartbeat_source=self.heartbeat_data,
                request_handler=self._handle_broker_request,
                rpc_hook=self.options.rpc_hook(),
                ssl=self.options.ssl_context,
            )
            if self.options.message_model == MessageModel.BROADCASTING:
                self.offset_store = LocalFileOffsetStore(
                    self.options.offset_store_dir, self.client_id, self.group
                )
            else:
                self.offset_store = BrokerOffsetStore(self.instance, self.group)
            await self.offset_store.load()
            self.pull_service = PullService(self)
            self.consume_service = ConcurrentConsumeService(self)
            self.orderly_service = OrderlyConsumeService(self)
            self._owner = TaskOwner(f"consumer[{self.group}]")
            try:
                for topic in self.subscribed_topics():
                    try:
                        await self.instance.update_route(topic)
                    except NoRouteError:
                        # A new group's retry topic is created by the broker on the first
                        # heartbeat; the rebalancer picks its route up later.
                        if topic != self.retry_topic:
                            raise
                await raise_if_refused(self, await self.instance.send_heartbeats())
                for sub in self._subs.values():
                    if sub.sink is not None:
                        await sub.sink.start(self._owner)
            except BaseException:
                await self._owner.aclose()
                await self.instance.close()
                raise
            self.errors.owner = self._owner
            self.consume_service.start()
            self.orderly_service.start()
            o = self.options
            self._owner.spawn(self.rebalancer.run(), name="rebalance")
            self._owner.spawn(self._persist_loop(), name="persist-offsets")
            self._owner.spawn(self.instance.heartbeat_loop(o.heartbeat_interval), name="heartbeat")
            self._owner.spawn(self.instance.route_refresh_loop(o.route_refresh_interval),
                              name="route-refresh")
            self._started = True
            log.info("consumer.started", group=self.group, client_id=self.client_id,
                     topics=list(self._subs), model=str(o.message_model))

    def _owner_spawn(self, coro: Any, name: str) -> None:
        if self._owner is None:
            coro.close()
            return
        self._owner.spawn(coro, name=name)

    async def stop(self, timeout: float = 30.0) -> None:
        """Stop consuming and release everything.

        Pulling stops at once; listener calls already running may finish (up to ``timeout``
        seconds) and their acknowledgements are committed; offsets are persisted, the client is
        unregistered from the brokers and the connections are closed. Afterwards no task of
        this consumer is left running.
        """
        async with self._start_lock:
            if not self._started:
                return
            self.stopping = True
            assert self._owner is not None
            owner = self._owner
            # 1. no new rebalances, heartbeats or pulls
            await self.pull_service.aclose()
            # 2. sinks flush what they hold; running listeners finish
            try:
                async with asyncio.timeout(timeout):
                    for sub in self._subs.values():
                        if sub.sink is not None:
                            await sub.sink.flush()
                    await self.consume_service.wait_idle()
                    await self.orderly_service.wait_idle()
            except TimeoutError:
                log.warning("consumer.stop_timeout", group=self.group, timeout=timeout)
            await self.consume_service.aclose()
            await self.orderly_service.aclose()
            async with self._persist_lock:  # no persist round left half sent
                await owner.aclose()
            self.errors.owner = None
            for sub in self._subs.values():
                if sub.sink is not None:
                    with contextlib.suppress(Exception):
                        await sub.sink.aclose()
            # 3. persist what was acknowledged, then forget the queues
            try:
                await self.offset_store.persist_all(set(self.process_queues), oneway=False)
            except Exception as exc:
                log.warning("consumer.persist_on_stop_failed", error=str(exc))
            await self._unlock_all_on_stop()
            for pq in self.process_queues.values():
                pq.dropped = True
            self.process_queues.clear()
            # 4. leave the group and close the connections
            await self.instance.unregister(None, self.group)
            await self.instance.close()
            self._owner = None
            self._started = False
            log.info("consumer.stopped", group=self.group, client_id=self.client_id)

    async def _unlock_all_on_stop(self) -> None:
        """Orderly consumers give their broker locks back."""
        if self.options.message_model != MessageModel.CLUSTERING:
            return
        for mq in list(self.process_queues):
            if self.is_orderly(mq.topic):
                await self.orderly_service.unlock(mq)

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
        subs = [s.data for s in self._subs.values()]
        if self.options.message_model == MessageModel.CLUSTERING and self._subs:
            subs.append(self._retry_sub)
        if self._sub_version_override:
            subs = [
                dataclasses.replace(d, sub_version=self._sub_version_override[d.topic])
                if d.topic in self._sub_version_override else d
                for d in subs
            ]
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
            producer_data_set=[],
        )

    # ------------------------------------------------------------------ rebalance hooks

    async def apply_allocation(self, topic: str, allocated: set[MessageQueue]) -> None:
        changed = False
        now = time.monotonic()
        for mq, pq in list(self.process_queues.items()):
            if mq.topic != topic:
                continue
            if mq not in allocated:
                await self.remove_queue(mq, reason="reassigned")
                changed = True
            elif pq.is_pull_expired(now, self.options.pull_max_idle_time) and not pq.dropped:
                log.warning("rebalance.queue_pull_expired", queue=str(mq))
                await self.remove_queue(mq, reason="pull_expired")
                changed = True
        new_queues = [mq for mq in allocated if mq not in self.process_queues]
        added: list[PullRequest] = []
        for mq in sorted(new_queues):
            if self.stopping:
                return
            if not await self.queue_assigned(mq):
                continue
            self.offset_store.remove(mq)
            offset = await self.compute_pull_from_where(mq)
            if offset < 0:
                log.warning("rebalance.start_offset_unknown", queue=str(mq))
                continue
            pq = ProcessQueue()
            if self._needs_lock(mq):
                pq.locked = True
                pq.last_lock_timestamp = time.monotonic()
            self.process_queues[mq] = pq
            added.append(PullRequest(mq, pq, offset))
            log.info("rebalance.queue_added", group=self.group, queue=str(mq), offset=offset)
            changed = True
        if changed:
            await self._on_allocation_changed(topic)
        for req in added:
            if not req.pq.dropped and not self.stopping:
                self.pull_service.start_queue(req)

    async def _on_allocation_changed(self, topic: str) -> None:
        """New subscription version, new per-queue thresholds, and a heartbeat right away.

        The broker refuses a pull whose ``subVersion`` is newer than the one its last
        heartbeat registered (SUBSCRIPTION_NOT_LATEST), so the heartbeat carrying the new
        version goes out first and the pulls switch to it only once it was sent.
        """
        self._recompute_topic_thresholds(topic)
        data = self.subscription_data(topic)
        if data is None:
            return
        new_version = max(int(time.time() * 1000), data.sub_version + 1)
        self._sub_version_override[topic] = new_version
        try:
            await self.instance.send_heartbeats()
        finally:
            self._sub_version_override.pop(topic, None)
        data.sub_version = new_version

    def _recompute_topic_thresholds(self, topic: str) -> None:
        o = self.options
        n = sum(1 for mq in self.process_queues if mq.topic == topic)
        if n == 0:
            return
        if o.pull_threshold_for_topic > 0:
            self.pull_service.queue_count_threshold[topic] = max(1, o.pull_threshold_for_topic // n)
        if o.pull_threshold_size_for_topic > 0:
            self.pull_service.queue_size_threshold_mib[topic] = max(
                1, o.pull_threshold_size_for_topic // n
            )

    def _needs_lock(self, mq: MessageQueue) -> bool:
        return self.options.message_model == MessageModel.CLUSTERING and self.is_orderly(mq.topic)

    async def queue_assigned(self, mq: MessageQueue) -> bool:
        """Called before a new queue is pulled: orderly clustering consumers lock it first."""
        if self._needs_lock(mq) and not await self.orderly_service.lock(mq):
            log.info("rebalance.queue_lock_refused", queue=str(mq))
            self.rebalancer.retry_soon()
            return False
        return True

    async def remove_queue(self, mq: MessageQueue, *, reason: str) -> None:
        pq = self.process_queues.pop(mq, None)
        if pq is None:
            return
        pq.dropped = True
        await self.pull_service.stop_queue(mq)
        if self._needs_lock(mq) or pq.locked:
            # Unlock only after the batch being consumed on this queue has finished (also when
            # the topic was unsubscribed and no longer counts as orderly).
            await self.orderly_service.release(mq, pq)
        else:
            await self.offset_store.persist(mq)
        self.offset_store.remove(mq)
        log.info("rebalance.queue_removed", group=self.group, queue=str(mq), reason=reason)

    async def drop_unsubscribed(self, topics: set[str]) -> None:
        for mq in list(self.process_queues):
            if mq.topic not in topics:
                await self.remove_queue(mq, reason="unsubscribed")

    async def compute_pull_from_where(self, mq: MessageQueue) -> int:
        """Start offset of a newly assigned queue (Java ``computePullFromWhere``)."""
        last = await self.offset_store.read_store(mq)
        if last >= 0:
            return last
        if last != OFFSET_NOT_FOUND:
            return -1
        cfw = self.options.consume_from_where
        api = self.instance.api
        try:
            if cfw == ConsumeFromWhere.FIRST_OFFSET:
                return 0
            if mq.topic.startswith(RETRY_GROUP_TOPIC_PREFIX):
                return 0 if cfw != ConsumeFromWhere.TIMESTAMP else await self._max_offset(mq)
            if cfw == ConsumeFromWhere.TIMESTAMP:
                addr = await self.instance.find_broker_master(mq.broker_name, mq.topic)
                ts = self.options.consume_timestamp_ms()
                return await api.search_offset(addr, mq, ts)
            return await self._max_offset(mq)
        except (MQClientError, RemotingError) as exc:
            log.warning("rebalance.compute_offset_failed", queue=str(mq), error=str(exc))
            return -1

    async def _max_offset(self, mq: MessageQueue) -> int:
        addr = await self.instance.find_broker_master(mq.broker_name, mq.topic)
        return await self.instance.api.get_max_offset(addr, mq)

    async def fix_offset_and_recreate(self, mq: MessageQueue, offset: int) -> None:
        """OFFSET_ILLEGAL: persist the corrected offset, forget the queue, rebalance now."""
        if hasattr(self.offset_store, "freeze"):
            self.offset_store.freeze(mq, offset)
        else:
            self.offset_store.update(mq, offset, increase_only=False)
        await self.offset_store.persist(mq)
        pq = self.process_queues.get(mq)
        if pq is not None and pq.dropped:
            del self.process_queues[mq]
        self.pull_service.requests.pop(mq, None)
        self.offset_store.remove(mq)
        log.info("pull.offset_fixed", queue=str(mq), offset=offset)
        self.rebalancer.wake()

    # ------------------------------------------------------------------ consumption hooks

    def dispatch(self, msgs: list[MessageExt], pq: ProcessQueue, mq: MessageQueue,
                 first: bool) -> None:
        """Hand freshly pulled (and cached) messages to the consume side.

        ``first``: the ProcessQueue had no consume turn pending (orderly scheduling).
        """
        if self.is_orderly(mq.topic):
            # The orderly service takes the messages from the ProcessQueue in offset order.
            self.orderly_service.submit(pq, mq, first)
            return
        if mq.topic != self.retry_topic:
            self._dispatch_to(mq.topic, msgs, pq, mq)
            return
        # One pull of %RETRY%<group> can carry messages of several subscribed topics: each
        # goes to the listener or sink of the topic it was first sent to.
        by_origin: dict[str, list[MessageExt]] = {}
        for m in msgs:
            by_origin.setdefault(m.properties.get(PROPERTY_RETRY_TOPIC, mq.topic), []).append(m)
        for origin, part in by_origin.items():
            self._dispatch_to(origin, part, pq, mq)

    def _dispatch_to(self, origin: str, msgs: list[MessageExt], pq: ProcessQueue,
                     mq: MessageQueue) -> None:
        sub = self._subs.get(origin)
        if sub is not None and sub.sink is not None:
            self._offer_to_sink(sub.sink, msgs, pq, mq)
            return
        self.consume_service.submit(msgs, pq, mq)

    def _origin_topic(self, topic: str, msgs: list[MessageExt]) -> str:
        """The subscribed topic a chunk belongs to (``dispatch`` keeps chunks single-origin)."""
        if topic == self.retry_topic and msgs:
            return msgs[0].properties.get(PROPERTY_RETRY_TOPIC, topic)
        return topic

    def _offer_to_sink(self, sink: SparkSink, msgs: list[MessageExt], pq: ProcessQueue,
                       mq: MessageQueue) -> None:
        # Rows keep the coordinates of the queue they were read from (a redelivered message
        # keeps %RETRY%<group> as its topic and carries RETRY_TOPIC), so that
        # (topic, broker_name, queue_id, queue_offset) stays a unique, idempotent row key.
        #
        # The messages stay cached in ``pq`` until the sink acknowledges them, so the pull flow
        # control bounds what the sink holds; the sink learns that bound (its batches close at
        # half of it) and is told to close its open batch early when this queue stops pulling.
        from rmq_async.sinks import SinkClosedError

        if mq.topic != self.retry_topic:
            self._tell_sink_flow_limit(sink, mq.topic)

        def ack(ok: bool) -> None:
            if ok:
                self._commit_sink_chunk(msgs, pq, mq)
                return
            try:
                self._owner_spawn(self._sink_acked(sink, msgs, pq, mq, ok), "sink-failed")
            except RuntimeError:  # the consumer is stopping: nothing commits, all is redelivered
                log.warning("sink.failed_chunk_left_uncommitted", queue=str(mq), count=len(msgs),
                            first_offset=msgs[0].queue_offset if msgs else -1)

        try:
            sink.offer(msgs, ack)
        except SinkClosedError:
            # Only while stopping: the messages stay cached, their offsets never move.
            log.warning("sink.offer_after_close", queue=str(mq), count=len(msgs))
            return
        if self._sink_queue_blocked(pq, mq):
            sink.expedite()

    def _tell_sink_flow_limit(self, sink: SparkSink, topic: str) -> None:
        """Report to ``sink`` what the flow control lets it hold for ``topic`` on this client."""
        o = self.options
        queues = sum(1 for q, p in self.process_queues.items() if q.topic == topic and not p.dropped)
        if queues == 0:
            return
        ps = self.pull_service
        count = ps.queue_count_threshold.get(topic, o.pull_threshold_for_queue)
        size_mib = ps.queue_size_threshold_mib.get(topic, o.pull_threshold_size_for_queue)
        # A queue pulls while it caches at most `count` messages spanning at most `max_span`
        # offsets, so each queue can always hold this many messages of the sink's batches.
        per_queue = min(count, o.consume_concurrently_max_span) + 1
        sink.set_flow_limit(queues * per_queue, queues * size_mib * 1024 * 1024)

    def _sink_queue_blocked(self, pq: ProcessQueue, mq: MessageQueue) -> bool:
        """The pull flow control holds this queue until some of its messages are acknowledged."""
        o = self.options
        ps = self.pull_service
        count = ps.queue_count_threshold.get(mq.topic, o.pull_threshold_for_queue)
        size_mib = ps.queue_size_threshold_mib.get(mq.topic, o.pull_threshold_size_for_queue)
        return (pq.msg_count > count or pq.msg_size > size_mib * 1024 * 1024
                or pq.max_span > o.consume_concurrently_max_span)

    def _commit_sink_chunk(self, msgs: list[MessageExt], pq: ProcessQueue, mq: MessageQueue,
                           *, stored: bool = True) -> None:
        """``msgs`` are stored (or handed back): forget them, move the in-memory offset."""
        if stored:
            self.stats.record_consume(self._origin_topic(mq.topic, msgs), len(msgs), 0, 0.0)
        if pq.dropped:
            # Rebalance took the queue away meanwhile: this result commits nothing.
            return
        offset = pq.remove_messages(msgs)
        if offset >= 0 and not pq.dropped:
            self.offset_store.update(mq, offset, increase_only=True)

    async def _sink_acked(self, sink: SparkSink, msgs: list[MessageExt], pq: ProcessQueue,
                          mq: MessageQueue, ok: bool) -> None:
        """The sink's verdict on a chunk. A failed chunk is handed back to the broker.

        Clustering: each failed message is sent back (CONSUMER_SEND_MSG_BACK) and redelivered
        through ``%RETRY%<group>``; once handed back it no longer holds the offset. A message the
        broker did not take back (and, broadcasting, every failed message) stays cached, so the
        offset cannot pass it, and is offered to the sink again after a pause: a sink's data is
        never dropped.
        """
        from rmq_async.consumer.consume import SEND_BACK_FAILED_RETRY_DELAY

        if ok:
            self._commit_sink_chunk(msgs, pq, mq)
            return
        self.stats.record_consume(self._origin_topic(mq.topic, msgs), 0, len(msgs), 0.0)
        if pq.dropped or not msgs:
            return
        not_sent = msgs
        if self.options.message_model == MessageModel.CLUSTERING:
            sent_flags: list[bool] = []
            for start in range(0, len(msgs), 32):
                part = msgs[start:start + 32]
                sent_flags += await asyncio.gather(*(self.send_message_back(m, 0) for m in part))
            not_sent = [m for m, sent in zip(msgs, sent_flags, strict=True) if not sent]
            if len(not_sent) < len(msgs):
                keep = {id(m) for m in not_sent}
                self._commit_sink_chunk([m for m in msgs if id(m) not in keep], pq, mq,
                                        stored=False)
            log.info("sink.chunk_sent_back", queue=str(mq), count=len(msgs) - len(not_sent),
                     not_sent=len(not_sent))
        if not not_sent:
            return
        log.warning("sink.chunk_retried_locally", queue=str(mq), count=len(not_sent),
                    delay=SEND_BACK_FAILED_RETRY_DELAY)
        await asyncio.sleep(SEND_BACK_FAILED_RETRY_DELAY)
        if not pq.dropped and not self.stopping:
            self._offer_to_sink(sink, not_sent, pq, mq)

    def sink_backpressure_delay(self, topic: str) -> float:
        """Pause pulling ``topic`` while its sink has a closed batch waiting for the writer.

        The retry queue is bounded by its own thresholds and is shared by all subscriptions
        of the group, so a slow sink does not hold it.
        """
        sub = self._subs.get(topic)
        if sub is None or sub.sink is None or sub.sink.want_more():
            return 0.0
        return self.options.pull_time_delay_when_flow_control

    async def orderly_pull_gate(self, req: PullRequest) -> float:
        return await self.orderly_service.pull_gate(req)

    async def send_message_back(self, msg: MessageExt, delay_level: int) -> bool:
        """CONSUMER_SEND_MSG_BACK for a failed message; ``False`` if it could not be handed back."""
        try:
            addr = await self.instance.find_broker_master(msg.broker_name, msg.topic)
            await self.instance.api.consumer_send_msg_back(
                addr, msg, self.group, delay_level,
                self.options.effective_max_reconsume_times(orderly=False),
            )
            return True
        except (MQClientError, RemotingError) as exc:
            log.warning("consume.send_back_failed", msg_id=msg.msg_id, offset=msg.queue_offset,
                        error=str(exc))
            return False

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
        in the last hour) — the figures ``mqadmin consumerStatus`` shows — and ``errors``:
        the :class:`~rmq_async.consumer.events.ConsumerError` events reported for the topic
        since the consumer was created, by kind.
        """
        return {topic: {**self.stats.snapshot(topic), "errors": self.errors.topic_counts(topic)}
                for topic in self.subscribed_topics()}

    def on_error(self, handler: ErrorHandler) -> ErrorHandler:
        """Register ``handler`` (a function or ``async def``, usable as a decorator) for the
        problems the consumer works around without stopping: a corrupt record skipped, a
        queue the broker refuses. It receives a :class:`ConsumerError`."""
        self.errors.handlers.append(handler)
        return handler

    def report_error(self, event: ConsumerError) -> None:
        self.errors.report(event)

    def running_tasks(self) -> int:
        n = 0
        for owner in (self._owner,):
            if owner is not None:
                n += len(owner)
        return n

    def __repr__(self) -> str:
        state = "started" if self._started else "stopped"
        return (f"<PushConsumer group={self.group!r} client_id={self.client_id!r} {state} "
                f"queues={len(self.process_queues)}>")


def _pid() -> int:
    return os.getpid()


__all__ = ["PushConsumer", "Subscription", "MQBrokerError"]

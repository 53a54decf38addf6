"""Prometheus metrics of push consumers (optional extra ``prometheus``: prometheus-client).

::

    from rmq_async.observability.prometheus import instrument, start_metrics_server

    instrument(consumer)                  # into prometheus_client's default registry
    server = start_metrics_server(9108)   # GET http://host:9108/metrics
    ...
    server.close()

Nothing is counted twice: the figures are read at scrape time from what the consumer already
keeps (its :class:`~rmq_async.consumer.stats.ConsumerStats`, its process queues and
:meth:`~rmq_async.consumer.push.PushConsumer.lag`), so listener, orderly and sink
subscriptions are all covered and an idle scrape costs nothing on the consume path.
``instrument(consumer, registry=...)`` puts them into a registry of your own instead (serve it
with ``start_metrics_server(port, registry=...)`` or any prometheus_client exposition);
prometheus_client's own ``start_http_server`` works as well.

Metrics (name, type, labels, meaning; per-queue labels are ``group``, ``topic``, ``broker``,
``queue_id``):

``rocketmq_consumer_messages_consumed_total`` (counter; group, topic)
    Messages acknowledged (listener success, sink write stored).
``rocketmq_consumer_messages_failed_total`` (counter; group, topic)
    Messages a listener or sink failed, once per failed attempt.
``rocketmq_consumer_messages_retried_total`` (counter; group, topic)
    Failed messages handed back to the broker for a later retry (``%RETRY%<group>``).
``rocketmq_consumer_messages_dlq_total`` (counter; group, topic)
    Failed messages handed back to go to the dead-letter queue (``%DLQ%<group>``).
``rocketmq_consumer_messages_pulled_total`` (counter; group, topic)
    Messages found by pulls (what the client's tag filter kept, as Java counts its pull TPS).
``rocketmq_consumer_consume_duration_seconds`` (histogram; group, topic)
    Time of the listener calls: the calls on one pulled chunk are timed together (one clock
    read per chunk, not per call) and observed at their mean, so ``_sum`` and ``_count`` are
    exact and the buckets hold per-chunk means (sink writes are batched and not timed).
``rocketmq_consumer_pull_duration_seconds`` (histogram; group, topic)
    Round trip of a pull that found messages.
``rocketmq_consumer_lag_messages`` (gauge; per queue)
    Broker max offset minus committed offset, per assigned queue (:meth:`PushConsumer.lag`).
``rocketmq_consumer_max_offset`` (gauge; per queue)
    The queue's max offset when the lag was last read.
``rocketmq_consumer_committed_offset`` (gauge; per queue)
    The group's committed offset when the lag was last read.
``rocketmq_consumer_cached_messages`` (gauge; per queue)
    Messages pulled and not yet acknowledged, at scrape time.
``rocketmq_consumer_assigned_queues`` (gauge; group)
    Queues this consumer holds.
``rocketmq_consumer_healthy`` (gauge; group)
    1 while :meth:`PushConsumer.is_healthy`, else 0.

Topics are the subscribed topics. What happens to a message (consumed, failed, retried,
dead-lettered, consume time) counts under its own topic, a retried one too (messages of the
group's retry topic that could not be reset to one count under ``%RETRY%<group>``); what a
pull finds counts under the pulled queue's topic, so a retry topic's pulls (whose messages may
belong to several topics) count under ``%RETRY%<group>``. Java's consumer statistics count
both under the queue's topic. A result that arrives after a rebalance took its queue away
counts its time only: its messages come again. The lag
gauges follow :meth:`PushConsumer.lag`, refreshed every ``persist_offset_interval``; a queue
whose group has no committed offset yet has no lag sample.

Several consumers may share a registry as long as their groups differ (two members of one
group in one process would export the same series): give each its own registry then. A
stopped consumer gives its place to a new one of its group; :meth:`ConsumerCollector.remove`
takes one out at any time.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

from rmq_async.errors import MissingExtraError

try:
    from prometheus_client import REGISTRY, start_http_server
    from prometheus_client.core import (
        CounterMetricFamily,
        GaugeMetricFamily,
        HistogramMetricFamily,
        Metric,
    )
    from prometheus_client.registry import Collector, CollectorRegistry
except ImportError as exc:  # pragma: no cover - depends on what is installed
    raise MissingExtraError(f"rmq_async.observability.prometheus needs the prometheus extra "
                      f"(pip install 'rmq_async[prometheus]'): {exc}") from exc

from rmq_async.errors import InvalidArgumentError

if TYPE_CHECKING:
    from wsgiref.simple_server import WSGIServer

    from rmq_async.consumer.push import PushConsumer
    from rmq_async.consumer.stats import CumulativeHistogram

__all__ = ["ConsumerCollector", "MetricsServer", "instrument", "start_metrics_server"]

_PREFIX = "rocketmq_consumer_"
_QUEUE_LABELS = ["group", "topic", "broker", "queue_id"]
_TOPIC_LABELS = ["group", "topic"]

_collectors: weakref.WeakKeyDictionary[CollectorRegistry, ConsumerCollector] = (
    weakref.WeakKeyDictionary())
_collectors_lock = threading.Lock()


def _ended(consumer: PushConsumer) -> bool:
    """Stopping or stopped, or its start failed: it began a start, does not run, and is not
    starting still."""
    if getattr(consumer, "starting", False):
        return False
    return bool(getattr(consumer, "stopping", False)) or (
        not getattr(consumer, "is_running", True)
        and bool(getattr(consumer, "start_timestamp", 0)))


class ConsumerCollector(Collector):
    """Yields the metrics of the consumers added to it, read when the registry is scraped.

    One collector serves a registry; :func:`instrument` creates it on first use. Consumers are
    held weakly: one that is gone stops being exported.
    """

    def __init__(self) -> None:
        self._consumers: list[weakref.ref[PushConsumer]] = []
        self._lock = threading.Lock()

    def add(self, consumer: PushConsumer) -> None:
        with self._lock:
            # A stopped member of the group makes room for its successor (a supervisor that
            # starts a new consumer object after stopping the old one, say), and so does one
            # whose start() failed (it began a start and does not run); one whose start is
            # under way keeps its place.
            live = [c for c in self._live() if c is not consumer
                    and not (c.group == consumer.group and _ended(c))]
            if any(c.group == consumer.group for c in live):
                raise InvalidArgumentError(f"a consumer of group {consumer.group!r} is already exported to "
                                 "this registry; give each member its own registry")
            self._consumers = [weakref.ref(c) for c in [*live, consumer]]

    def remove(self, consumer: PushConsumer) -> None:
        with self._lock:
            self._consumers = [weakref.ref(c) for c in self._live() if c is not consumer]

    def _live(self) -> list[PushConsumer]:
        return [c for c in (r() for r in self._consumers) if c is not None]

    def describe(self) -> Iterable[Metric]:
        # The families, without samples: a scrape restricted to some names (``/metrics?
        # name[]=...``, prometheus_client's restricted registry) finds this collector by them,
        # and a collector of the user's that takes one of the names is refused at once.
        return _Families().all()

    def collect(self) -> Iterator[Metric]:
        with self._lock:
            consumers = self._live()
        fams = _Families()
        for consumer in consumers:
            fams.add(consumer)
        yield from fams.all()


class _Families:
    def __init__(self) -> None:
        def counter(name: str, doc: str) -> CounterMetricFamily:
            return CounterMetricFamily(_PREFIX + name, doc, labels=_TOPIC_LABELS)

        def gauge(name: str, doc: str, labels: list[str]) -> GaugeMetricFamily:
            return GaugeMetricFamily(_PREFIX + name, doc, labels=labels)

        def hist(name: str, doc: str) -> HistogramMetricFamily:
            return HistogramMetricFamily(_PREFIX + name, doc, labels=_TOPIC_LABELS)

        self.consumed = counter("messages_consumed", "Messages acknowledged.")
        self.failed = counter("messages_failed", "Messages a listener or sink failed.")
        self.retried = counter("messages_retried", "Failed messages handed back for a retry.")
        self.dlq = counter("messages_dlq", "Failed messages handed back to the dead-letter queue.")
        self.pulled = counter("messages_pulled", "Messages found by pulls.")
        self.consume_seconds = hist("consume_duration_seconds",
                                    "Time of the listener calls (per-chunk means).")
        self.pull_seconds = hist("pull_duration_seconds",
                                 "Round trip of a pull that found messages.")
        self.lag = gauge("lag_messages", "Broker max offset minus committed offset.",
                         _QUEUE_LABELS)
        self.max_offset = gauge("max_offset", "The queue's max offset at the last lag reading.",
                                _QUEUE_LABELS)
        self.committed = gauge("committed_offset",
                               "The group's committed offset at the last lag reading.",
                               _QUEUE_LABELS)
        self.cached = gauge("cached_messages", "Messages pulled and not yet acknowledged.",
                            _QUEUE_LABELS)
        self.assigned = gauge("assigned_queues", "Queues this consumer holds.", ["group"])
        self.healthy = gauge("healthy", "1 when the consumer is healthy, else 0.", ["group"])

    def add(self, consumer: PushConsumer) -> None:
        group = consumer.group
        for topic, t in sorted(dict(consumer.stats.totals).items()):
            labels = [group, topic]
            self.consumed.add_metric(labels, t.consumed)
            self.failed.add_metric(labels, t.failed)
            self.retried.add_metric(labels, t.sent_back)
            self.dlq.add_metric(labels, t.dead_lettered)
            self.pulled.add_metric(labels, t.pulled)
            _histogram(self.consume_seconds, labels, t.consume_seconds)
            _histogram(self.pull_seconds, labels, t.pull_seconds)
        for mq, lag in sorted(consumer.lag().items()):
            labels = [group, mq.topic, mq.broker_name, str(mq.queue_id)]
            self.max_offset.add_metric(labels, lag.max_offset)
            if lag.committed_offset is not None and lag.lag is not None:
                self.committed.add_metric(labels, lag.committed_offset)
                self.lag.add_metric(labels, lag.lag)
        queues = dict(consumer.process_queues)
        for mq, pq in sorted(queues.items()):
            self.cached.add_metric([group, mq.topic, mq.broker_name, str(mq.queue_id)],
                                   pq.msg_count)
        self.assigned.add_metric([group], len(queues))
        self.healthy.add_metric([group], 1.0 if consumer.is_healthy() else 0.0)

    def all(self) -> list[Metric]:
        return [self.consumed, self.failed, self.retried, self.dlq, self.pulled,
                self.consume_seconds, self.pull_seconds, self.lag, self.max_offset,
                self.committed, self.cached, self.assigned, self.healthy]


def _histogram(fam: HistogramMetricFamily, labels: list[str], h: CumulativeHistogram) -> None:
    buckets = [("+Inf" if bound == float("inf") else repr(bound), float(n))
               for bound, n in h.cumulative()]
    fam.add_metric(labels, buckets, h.sum)


def instrument(consumer: PushConsumer,
               registry: CollectorRegistry | None = None) -> ConsumerCollector:
    """Export ``consumer``'s metrics through ``registry`` (prometheus_client's default
    registry when ``None``). Call it once per consumer, before or after ``start()``."""
    reg = REGISTRY if registry is None else registry
    with _collectors_lock:
        collector = _collectors.get(reg)
        if collector is None:
            collector = _collectors[reg] = ConsumerCollector()
            reg.register(collector)
    collector.add(consumer)
    return collector


@dataclass
class MetricsServer:
    """The HTTP endpoint :func:`start_metrics_server` started (a daemon thread)."""

    server: WSGIServer
    thread: threading.Thread

    @property
    def port(self) -> int:
        return int(self.server.server_port)

    def close(self) -> None:
        """Stop serving and wait for the thread (blocking: call it from a worker thread, e.g.
        ``await anyio.to_thread.run_sync(server.close)``, inside an event loop)."""
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(5.0)


def start_metrics_server(port: int, addr: str = "0.0.0.0",
                         registry: CollectorRegistry | None = None) -> MetricsServer:
    """Serve ``registry`` (default: prometheus_client's) at ``http://addr:port/metrics`` from
    a daemon thread; ``port=0`` picks a free port (see :attr:`MetricsServer.port`)."""
    server, thread = start_http_server(port, addr=addr,
                                       registry=REGISTRY if registry is None else registry)
    return MetricsServer(server, thread)

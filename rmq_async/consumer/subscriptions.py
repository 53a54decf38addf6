"""The subscription table: what each subscribed topic is consumed by.

A topic is consumed by a handler (concurrently or in order) or by a sink. Several handlers may
share a topic when their TAG filters are disjoint: the broker is sent one subscription, the
union of their tags, and each message goes to the handler whose tags contain its tag. A second
subscription of a topic that overlaps the first (the same tag, ``*`` with anything, an SQL92
filter with anything, a sink, or a different ``orderly``) raises
:class:`~rmq_async.errors.InvalidArgumentError` (a ``ValueError``). The group's retry
topic ``%RETRY%<group>`` is subscribed on its own in clustering mode; a message redelivered
through it carries the topic it was first sent to (``RETRY_TOPIC``), which decides the listener
or sink it goes to.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from rmq_async.consumer.listener import ListenerAdapter
from rmq_async.consumer.options import MessageModel
from rmq_async.errors import InvalidArgumentError
from rmq_async.protocol.filter import EXPRESSION_TAG, SubscriptionData, build_subscription
from rmq_async.protocol.types import PROPERTY_RETRY_TOPIC, MessageExt

if TYPE_CHECKING:
    from rmq_async.consumer.middleware import Middleware
    from rmq_async.sinks.spark import SparkSink

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
    #: Several handlers on the topic: the handler of each tag (``listener`` is then ``None``).
    by_tag: dict[str, ListenerAdapter] = field(default_factory=dict)
    #: Each handler's own tag expression, in subscription order.
    parts: list[tuple[str, ListenerAdapter | None]] = field(default_factory=list)

    def adapter_for(self, msg: MessageExt) -> ListenerAdapter | None:
        """The handler of ``msg`` (by its tag when several handlers share the topic)."""
        if not self.by_tag:
            return self.listener
        tag = msg.tags
        return self.by_tag.get(tag) if tag is not None else None

    def describe(self) -> str:
        if self.sink is not None:
            return "a sink"
        if self.data.expression_type != EXPRESSION_TAG:
            return f"sql={self.expression!r}"
        return f"tags={self.expression!r}"


def reset_retry_topic(msgs: list[MessageExt], retry_topic: str) -> None:
    """Give retried messages their original topic back (Java ``resetRetryAndNamespace``)."""
    for m in msgs:
        if m.topic == retry_topic:
            original = m.properties.get(PROPERTY_RETRY_TOPIC)
            if original:
                m.topic = original


class Subscriptions:
    """The subscribed topics of one consumer group, and the group's retry topic."""

    def __init__(self, group: str, message_model: MessageModel) -> None:
        self.retry_topic = RETRY_GROUP_TOPIC_PREFIX + group
        self.message_model = message_model
        self.topics: dict[str, Subscription] = {}
        #: The retry topic's subscription, built afresh by each ``start()``.
        self.retry_data: SubscriptionData | None = None
        #: Subscription versions the next heartbeat announces before the pulls use them.
        self.version_override: dict[str, int] = {}
        #: Around every handler call, the first outermost (``PushConsumer.add_middleware``).
        self.middlewares: list[Middleware] = []

    def add(self, sub: Subscription) -> Subscription:
        """Register ``sub``; a topic already subscribed is shared when both are handlers with
        disjoint tag lists (the registered subscription then covers the union), otherwise
        :class:`~rmq_async.errors.InvalidArgumentError`."""
        topic = sub.topic
        old = self.topics.get(topic)
        sub.parts = [(sub.expression, sub.listener)]
        if old is None:
            self.topics[topic] = sub
            return sub
        problem = None
        if old.sink is not None or sub.sink is not None:
            problem = "a topic consumed by a sink has no other subscription"
        elif old.data.expression_type != EXPRESSION_TAG or sub.data.expression_type != EXPRESSION_TAG:
            problem = "an SQL92 subscription cannot share its topic"
        elif not old.data.tags_set or not sub.data.tags_set:
            problem = "'*' takes every tag, so it cannot share the topic"
        elif old.orderly != sub.orderly:
            problem = "handlers of one topic are either all orderly or none"
        else:
            overlap = [t for t in sub.data.tags_set if t in old.data.tags_set]
            if overlap:
                problem = f"tag(s) {', '.join(repr(t) for t in overlap)} already have a handler"
        if problem is not None:
            raise InvalidArgumentError(
                f"topic {topic!r} is already subscribed ({old.describe()}); cannot add "
                f"{sub.describe()}: {problem}. Unsubscribe it first, or give each handler "
                "its own disjoint tags")
        assert sub.listener is not None
        by_tag = dict(old.by_tag) if old.by_tag else {}
        if not by_tag:
            assert old.listener is not None
            by_tag = dict.fromkeys(old.data.tags_set, old.listener)
        by_tag.update(dict.fromkeys(sub.data.tags_set, sub.listener))
        union = " || ".join(by_tag)
        merged = Subscription(
            topic=topic, expression=union, data=build_subscription(topic, union),
            listener=None, orderly=old.orderly, user_fn=old.user_fn, by_tag=by_tag,
            parts=[*old.parts, (sub.expression, sub.listener)],
        )
        self.topics[topic] = merged
        return merged

    def reset_retry(self) -> None:
        self.retry_data = build_subscription(self.retry_topic, "*")

    def get(self, topic: str) -> Subscription | None:
        return self.topics.get(topic)

    def heartbeat_data_set(self) -> list[SubscriptionData]:
        """The subscriptions a heartbeat registers (the retry topic's included, clustering)."""
        subs = [s.data for s in self.topics.values()]
        if (self.message_model == MessageModel.CLUSTERING and self.topics
                and self.retry_data is not None):  # built by start()
            subs.append(self.retry_data)
        if self.version_override:
            subs = [
                dataclasses.replace(d, sub_version=self.version_override[d.topic])
                if d.topic in self.version_override else d
                for d in subs
            ]
        return subs

    def subscribed_topics(self) -> list[str]:
        topics = list(self.topics)
        if self.topics and self.message_model == MessageModel.CLUSTERING:
            topics.append(self.retry_topic)
        return topics

    def subscription_data(self, topic: str) -> SubscriptionData | None:
        if topic == self.retry_topic:
            return self.retry_data
        sub = self.topics.get(topic)
        return sub.data if sub else None

    def listener_for(self, topic: str, msg: MessageExt | None = None) -> ListenerAdapter | None:
        """The handler of ``topic`` (of ``msg``'s tag when several handlers share it)."""
        sub = self.topics.get(topic)
        if sub is None:
            return None
        if msg is not None:
            return sub.adapter_for(msg)
        return sub.listener

    def sink_for(self, topic: str) -> SparkSink | None:
        sub = self.topics.get(topic)
        return sub.sink if sub else None

    def sinks(self) -> list[SparkSink]:
        return [s.sink for s in self.topics.values() if s.sink is not None]

    def is_orderly(self, topic: str) -> bool:
        if topic == self.retry_topic:
            # As in Java, where orderliness belongs to the consumer: a consumer whose
            # subscriptions are all orderly also locks and consumes its retry queue in order.
            return bool(self.topics) and all(s.orderly for s in self.topics.values())
        sub = self.topics.get(topic)
        return bool(sub and sub.orderly)

    def origin_topic(self, topic: str, msgs: list[MessageExt]) -> str:
        """The subscribed topic a chunk belongs to: its first message's (the router keeps a
        chunk single-origin, or bound for one sink: see ``ServiceRouter``)."""
        if topic == self.retry_topic and msgs:
            return msgs[0].properties.get(PROPERTY_RETRY_TOPIC, topic)
        return topic

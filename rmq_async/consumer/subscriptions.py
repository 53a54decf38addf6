"""The subscription table: what each subscribed topic is consumed by.

A topic is consumed by a listener (concurrently or in order) or by a sink. The group's retry
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
from rmq_async.protocol.filter import SubscriptionData, build_subscription
from rmq_async.protocol.types import PROPERTY_RETRY_TOPIC, MessageExt

if TYPE_CHECKING:
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

    def listener_for(self, topic: str) -> ListenerAdapter | None:
        sub = self.topics.get(topic)
        return sub.listener if sub else None

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
        """The subscribed topic a chunk belongs to (the router keeps chunks single-origin)."""
        if topic == self.retry_topic and msgs:
            return msgs[0].properties.get(PROPERTY_RETRY_TOPIC, topic)
        return topic

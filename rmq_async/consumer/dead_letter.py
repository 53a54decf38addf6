"""Sending a message to the group's dead-letter queue at once, with the reason.

A poison message (a body that cannot be decoded, a handler or middleware raising
:class:`~rmq_async.consumer.results.DeadLetter`) goes to ``%DLQ%<group>`` after one attempt, and
whoever reads the DLQ should see why. CONSUMER_SEND_MSG_BACK cannot carry properties (the
broker rebuilds the message from its commit-log copy; with a negative delay level it moves it
straight to the DLQ, without any reason). So the message is produced again, by this client:

* a SEND_MESSAGE of the original body and properties to ``%RETRY%<group>`` (created by the
  group's heartbeat), with ``reconsumeTimes`` one above ``maxReconsumeTimes``: the broker's send
  processor moves a retry-topic message over its limit into ``%DLQ%<group>`` (creating that
  topic as it does for send-backs), so the copy lands there as the broker's own DLQ copies do;
* the copy carries ``RETRY_TOPIC`` (the topic it was first sent to), ``ORIGIN_MESSAGE_ID``
  (the original message id) and ``RMQ_DLQ_REASON`` (the reason, at most 1,000 characters), and
  keeps ``UNIQ_KEY``, ``TAGS``, ``KEYS`` and the user properties;
* if that send fails, CONSUMER_SEND_MSG_BACK with delay level ``-1`` still moves the message
  to the DLQ (the reason is then only in the log, event ``consume.dead_lettered``), and when
  the message's master cannot be reached at all the copy goes through another group's master
  (``ConsumerRuntime.send_message_back``, as Java's consumer falls back to its inner producer);
  if everything fails the message stays cached and is consumed again later.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import structlog

from rmq_async.client.errors import MQClientError
from rmq_async.consumer.runtime import dead_letter_counts, retry_copy_properties
from rmq_async.errors import InvalidArgumentError
from rmq_async.payloads import MAX_REASON_CHARS
from rmq_async.protocol.bodies import INNER_PRODUCER_GROUP
from rmq_async.protocol.message import encode_properties
from rmq_async.protocol.types import (
    MessageExt,
    MessageQueue,
)
from rmq_async.remoting.errors import RemotingError

if TYPE_CHECKING:
    from rmq_async.consumer.runtime import ConsumerRuntime

log = structlog.get_logger(__name__)

__all__ = ["DLQ_GROUP_TOPIC_PREFIX", "PROPERTY_DLQ_REASON", "dlq_topic", "send_to_dlq"]

#: The user property a dead-lettered copy carries its reason in.
PROPERTY_DLQ_REASON = "RMQ_DLQ_REASON"
DLQ_GROUP_TOPIC_PREFIX = "%DLQ%"



_SEPARATORS = str.maketrans({"\x01": " ", "\x02": " "})


def dlq_topic(group: str) -> str:
    return DLQ_GROUP_TOPIC_PREFIX + group


def dead_letter_properties(msg: MessageExt, reason: str) -> dict[str, str]:
    """The properties of the DLQ copy of ``msg`` (its topic already reset to the original)."""
    props = retry_copy_properties(msg)
    # Any text a handler gave (ctx.dead_letters takes anything): the property format's own
    # separators would make the copy unsendable, and its send fail for good.
    reason = (reason if isinstance(reason, str) else str(reason)).translate(_SEPARATORS)
    if len(reason) > MAX_REASON_CHARS:
        reason = reason[:MAX_REASON_CHARS - 3] + "..."
    props[PROPERTY_DLQ_REASON] = reason
    return props


async def send_to_dlq(rt: ConsumerRuntime, msg: MessageExt, reason: str) -> bool:
    """Put ``msg`` into ``%DLQ%<group>`` with ``reason``; ``False`` if it could not be."""
    reconsume, limit = dead_letter_counts(rt.options.effective_max_reconsume_times(orderly=False))
    try:
        addr = await rt.instance.find_broker_master(msg.broker_name, msg.topic)
        await rt.instance.api.send_message(
            addr, MessageQueue(rt.retry_topic, msg.broker_name, 0),
            producer_group=INNER_PRODUCER_GROUP, body=msg.body,
            properties=encode_properties(dead_letter_properties(msg, reason)), flag=msg.flag,
            born_timestamp=msg.born_timestamp or None,
            reconsume_times=reconsume, max_reconsume_times=limit,
        )
    except (MQClientError, RemotingError, InvalidArgumentError) as exc:
        log.warning("consume.dead_letter_send_failed", group=rt.group, topic=msg.topic,
                    queue_id=msg.queue_id, offset=msg.queue_offset, msg_id=msg.msg_id,
                    error=str(exc))
        if not await rt.send_message_back(msg, -1):
            return False
        log.warning("consume.dead_lettered", group=rt.group, topic=msg.topic,
                    queue_id=msg.queue_id, offset=msg.queue_offset, msg_id=msg.msg_id,
                    reason=reason, via="send_back")
        return True
    log.warning("consume.dead_lettered", group=rt.group, topic=msg.topic, queue_id=msg.queue_id,
                offset=msg.queue_offset, msg_id=msg.msg_id, reason=reason, via="send")
    rt.stats.record_send_back(msg.topic, dead_letter=True)  # (the send-back path counts itself)
    return True

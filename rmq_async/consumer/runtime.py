"""What the parts of one started consumer share, and nothing more.

``PushConsumer.start()`` builds one :class:`ConsumerRuntime` and hands it to the pull loop and
to the consumption services: the options, the subscription table, the process queues, the
offset store, the broker client, the statistics, the error reporter and the consumer's task
owner. No part below ``push.py`` sees the consumer itself.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING

import structlog

from rmq_async.client.errors import RETRY_SEND_CODES, MQBrokerError, MQClientError
from rmq_async.consumer.offset_store import OFFSET_NOT_FOUND
from rmq_async.consumer.options import ConsumeFromWhere
from rmq_async.consumer.subscriptions import RETRY_GROUP_TOPIC_PREFIX
from rmq_async.protocol.bodies import INNER_PRODUCER_GROUP
from rmq_async.protocol.codes import INT32_MAX
from rmq_async.protocol.errors import ProtocolError
from rmq_async.protocol.message import encode_properties
from rmq_async.protocol.types import (
    PROPERTY_CONSUME_START_TIME,
    PROPERTY_DELAY,
    PROPERTY_MAX_OFFSET,
    PROPERTY_MAX_RECONSUME_TIMES,
    PROPERTY_MIN_OFFSET,
    PROPERTY_ORIGIN_MESSAGE_ID,
    PROPERTY_RECONSUME_TIME,
    PROPERTY_RETRY_TOPIC,
    PROPERTY_TRANSACTION_PREPARED,
)
from rmq_async.remoting.errors import RemotingError, RemotingTimeout

if TYPE_CHECKING:
    from rmq_async.client.instance import ClientInstance
    from rmq_async.consumer.events import ErrorReporter
    from rmq_async.consumer.offset_store import OffsetStore
    from rmq_async.consumer.options import ConsumerOptions
    from rmq_async.consumer.process_queue import ProcessQueue
    from rmq_async.consumer.stats import ConsumerStats
    from rmq_async.consumer.subscriptions import Subscriptions
    from rmq_async.consumer.tasks import TaskOwner
    from rmq_async.protocol.types import MessageExt, MessageQueue

log = structlog.get_logger(__name__)

#: The send-back fallback's copy is sent as Java's inner producer sends: this many attempts
#: (``retryTimesWhenSendFailed`` 2, plus the first) within this many seconds (its send timeout).
RETRY_RESEND_ATTEMPTS = 3
RETRY_RESEND_TIMEOUT = 3.0

#: Properties the pull loop or the delay added to a delivered message, and the transaction
#: mark (a copy is a plain message, as Java's consumer clears it on its retry copies): not
#: carried to a copy.
_NOT_COPIED = (PROPERTY_CONSUME_START_TIME, PROPERTY_MIN_OFFSET, PROPERTY_MAX_OFFSET, PROPERTY_DELAY,
               PROPERTY_TRANSACTION_PREPARED)


def dead_letter_counts(max_times: int) -> tuple[int, int]:
    """The (reconsume times, max reconsume times) of a %RETRY% send that the broker moves into
    ``%DLQ%<group>`` at once (its count over the limit), both within Java's int: a limit of
    2**31-1 (orderly's unlimited) is sent as 2**31-2."""
    limit = min(max_times, INT32_MAX - 1)
    return limit + 1, limit


def retry_copy_properties(msg: MessageExt) -> dict[str, str]:
    """The properties of a copy of ``msg`` the client sends into ``%RETRY%<group>`` (a retry
    after a failed send-back, or a dead letter): its own, less what delivery added, with
    ``RETRY_TOPIC`` (the topic it was first sent to) and ``ORIGIN_MESSAGE_ID``; never
    ``TRAN_MSG``, which would make the broker store the copy as a transaction's half message."""
    props = {k: v for k, v in msg.properties.items() if k not in _NOT_COPIED}
    props.setdefault(PROPERTY_RETRY_TOPIC, msg.topic)
    props.setdefault(PROPERTY_ORIGIN_MESSAGE_ID, msg.msg_id)
    return props

MiB = 1024 * 1024


class PullThresholds:
    """Per-queue flow-control limits of each topic.

    ``pull_threshold_for_queue`` / ``pull_threshold_size_for_queue`` apply unless the topic-wide
    limits (``pull_threshold_for_topic`` / ``pull_threshold_size_for_topic``) are set; those are
    shared by the topic's queues on this client and recomputed when its allocation changes.
    ``queues`` holds each topic's queue count of that recomputation (the sink service sizes a
    sink's flow limit from it).
    """

    def __init__(self, options: ConsumerOptions) -> None:
        self._opts = options
        self.count: dict[str, int] = {}
        self.size_mib: dict[str, int] = {}
        self.queues: dict[str, int] = {}

    def count_for(self, topic: str) -> int:
        return self.count.get(topic, self._opts.pull_threshold_for_queue)

    def size_mib_for(self, topic: str) -> int:
        return self.size_mib.get(topic, self._opts.pull_threshold_size_for_queue)

    def recompute(self, topic: str, queues: int) -> None:
        o = self._opts
        self.queues[topic] = queues
        if queues == 0:
            return
        if o.pull_threshold_for_topic > 0:
            self.count[topic] = max(1, o.pull_threshold_for_topic // queues)
        if o.pull_threshold_size_for_topic > 0:
            self.size_mib[topic] = max(1, o.pull_threshold_size_for_topic // queues)

    def queue_blocked(self, topic: str, pq: ProcessQueue) -> bool:
        """The flow control holds a concurrently consumed queue until some of it is acknowledged."""
        return (pq.msg_count > self.count_for(topic)
                or pq.msg_size > self.size_mib_for(topic) * MiB
                or pq.max_span > self._opts.consume_concurrently_max_span)


class ConsumerRuntime:
    """The narrow things the pull loop and the consumption services of a started consumer use."""

    def __init__(
        self,
        *,
        group: str,
        client_id: str,
        options: ConsumerOptions,
        subscriptions: Subscriptions,
        process_queues: dict[MessageQueue, ProcessQueue],
        paused: set[str],
        stats: ConsumerStats,
        errors: ErrorReporter,
        instance: ClientInstance,
        offset_store: OffsetStore,
        tasks: TaskOwner,
    ) -> None:
        self.group = group
        self.client_id = client_id
        self.options = options
        self.subscriptions = subscriptions
        self.retry_topic = subscriptions.retry_topic
        #: The queues this client holds, each with its cache of pulled messages.
        self.process_queues = process_queues
        #: Topics whose pulls are paused (``PushConsumer.pause``).
        self.paused = paused
        self.stats = stats
        self.errors = errors
        self.instance = instance
        self.offset_store = offset_store
        #: The consumer's task owner: tasks started here end on ``stop()``.
        self.tasks = tasks
        self.thresholds = PullThresholds(options)
        #: Set once ``stop()`` began: no new pulls, no new listener turns.
        self.stopping = False

    async def send_message_back(self, msg: MessageExt, delay_level: int) -> bool:
        """CONSUMER_SEND_MSG_BACK for a failed message; ``False`` if it could not be handed back."""
        max_times = self.options.effective_max_reconsume_times(orderly=False)
        try:
            addr = await self.instance.find_broker_master(msg.broker_name, msg.topic)
            await self.instance.api.consumer_send_msg_back(
                addr, msg, self.group, delay_level, max_times,
            )
        except (MQClientError, RemotingError) as exc:
            log.warning("consume.send_back_failed", msg_id=msg.msg_id, offset=msg.queue_offset,
                        error=str(exc))
            if not await self._resend_to_retry_topic(msg, delay_level, max_times):
                return False
        # The broker's own rule: a negative level or retries used up goes to %DLQ%<group>.
        self.stats.record_send_back(msg.topic, dead_letter=delay_level < 0
                                    or msg.reconsume_times >= max_times)
        return True

    async def _resend_to_retry_topic(self, msg: MessageExt, delay_level: int,
                                     max_times: int) -> bool:
        """Java's fallback when CONSUMER_SEND_MSG_BACK fails (the message's master is down,
        refused, or shed the request as busy): produce a copy into ``%RETRY%<group>`` on
        whichever group's master takes it, other groups first. The copy carries
        ``RETRY_TOPIC``, ``ORIGIN_MESSAGE_ID``, the next reconsume count and delay level
        ``3 + reconsume_times``, as the broker's own retry copies do; for a dead letter
        (``delay_level < 0``) its reconsume count is over the limit, so the broker moves it into
        ``%DLQ%<group>``."""
        if delay_level < 0:
            reconsume, max_times = dead_letter_counts(max_times)
        else:
            reconsume = msg.reconsume_times + 1
        props = retry_copy_properties(msg)
        # In the properties as well as in the header, as Java's sendMessageBackAsNormalMessage
        # sets them (its producer writes the properties before it takes the two out).
        props[PROPERTY_RECONSUME_TIME] = str(reconsume)
        props[PROPERTY_MAX_RECONSUME_TIMES] = str(max_times)
        props[PROPERTY_DELAY] = str(3 + msg.reconsume_times)
        try:
            queues = await self.instance.publish_queues(self.retry_topic)
        except (MQClientError, RemotingError) as exc:
            log.warning("consume.retry_resend_failed", msg_id=msg.msg_id, topic=msg.topic,
                        queue_id=msg.queue_id, offset=msg.queue_offset, error=str(exc))
            return False
        by_broker: dict[str, MessageQueue] = {}
        for mq in queues:
            by_broker.setdefault(mq.broker_name, mq)
        order = sorted(by_broker, key=lambda name: name == msg.broker_name)
        # As Java's inner producer sends it: up to RETRY_RESEND_ATTEMPTS attempts (the next
        # broker group each time, round the list again if it is shorter) within one send
        # timeout, again only after an answer its producer retries (a busy broker among them).
        loop = asyncio.get_running_loop()
        deadline = loop.time() + RETRY_RESEND_TIMEOUT
        last_error = "no writable queue of " + self.retry_topic
        for attempt in range(RETRY_RESEND_ATTEMPTS if order else 0):
            left = deadline - loop.time()
            if left <= 0:
                break
            name = order[attempt % len(order)]
            mq = by_broker[name]
            try:
                addr = await self.instance.find_broker_master(name, self.retry_topic)
                await self.instance.api.send_message(
                    addr, mq, producer_group=INNER_PRODUCER_GROUP, body=msg.body,
                    properties=encode_properties(props), flag=msg.flag,
                    reconsume_times=reconsume, max_reconsume_times=max_times,
                    timeout=left,
                )
            except (MQClientError, RemotingError) as exc:
                last_error = str(exc)
                if isinstance(exc, RemotingTimeout):
                    break  # the broker may have stored it: not sent twice
                if isinstance(exc, MQBrokerError) and exc.code not in RETRY_SEND_CODES:
                    break
                continue
            log.info("consume.retry_resent", msg_id=msg.msg_id, topic=msg.topic,
                     queue_id=msg.queue_id, offset=msg.queue_offset, via=name,
                     reconsume_times=reconsume, attempts=attempt + 1)
            return True
        log.warning("consume.retry_resend_failed", msg_id=msg.msg_id, topic=msg.topic,
                    queue_id=msg.queue_id, offset=msg.queue_offset, error=last_error)
        return False

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
        except (MQClientError, RemotingError, ProtocolError) as exc:
            # (ProtocolError: an answer without its offset.) Java's computePullFromWhere turns
            # any failure into -1: the queue is not taken this round.
            log.warning("rebalance.compute_offset_failed", queue=str(mq), error=str(exc))
            return -1

    async def _max_offset(self, mq: MessageQueue) -> int:
        addr = await self.instance.find_broker_master(mq.broker_name, mq.topic)
        return await self.instance.api.get_max_offset(addr, mq)

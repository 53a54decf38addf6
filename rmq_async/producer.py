"""A small asyncio producer: send, batch send, round-robin queue selection.

It exists for examples, tests and the benchmark; it is kept small and correct rather than
complete (no transactions, no request-reply)::

    async with Producer("my-producer", namesrv="127.0.0.1:9876") as p:
        result = await p.send(Message("orders", b"...", tags="created", keys=["o-1"]))
"""

from __future__ import annotations

import itertools
import time
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import structlog

from rmq_async.client.api import SendResult
from rmq_async.client.errors import MQBrokerError, MQClientError
from rmq_async.client.instance import ClientInstance
from rmq_async.consumer.options import InvalidOptionError
from rmq_async.errors import InvalidArgumentError
from rmq_async.protocol.codes import MessageSysFlag
from rmq_async.protocol.filter import java_string_hash
from rmq_async.protocol.message import UniqKeyGenerator, encode_batch, encode_properties
from rmq_async.protocol.types import (
    PROPERTY_UNIQ_KEY,
    PROPERTY_WAIT,
    Message,
    MessageQueue,
)
from rmq_async.remoting.errors import RemotingError

log = structlog.get_logger(__name__)

QueueSelector = Callable[[list[MessageQueue], Message], MessageQueue]


def select_by_key(queues: list[MessageQueue], msg: Message) -> MessageQueue:
    """Queue selector keeping every message with the same (first) key on one queue.

    Pass it as ``send(msg, selector=select_by_key)`` for ordered messages: the queue is the
    Java ``String.hashCode`` of the key, in absolute value, modulo the number of queues.
    """
    key = msg.keys if isinstance(msg.keys, str) else (msg.keys or [""])[0]
    return queues[abs(java_string_hash(key)) % len(queues)]


@dataclass(slots=True)
class ProducerOptions:
    send_timeout: float = 3.0
    retry_times_when_send_failed: int = 2
    compress_over: int = 4096
    compress_level: int = 5
    max_message_size: int = 4 * 1024 * 1024
    default_topic_queue_nums: int = 4
    create_topic_key: str = "TBW102"


class Producer:
    """Sends messages to a topic's queues in turn (Java ``DefaultMQProducer``, trimmed)."""

    def __init__(self, group: str, namesrv: str | list[str], *,
                 instance_name: str | None = None, **options: Any) -> None:
        unknown = set(options) - set(ProducerOptions.__dataclass_fields__)
        if unknown:
            names = ", ".join(sorted(unknown))
            raise InvalidOptionError(names, "unknown producer option(s)")
        self.options = ProducerOptions(**options)
        self.group = group
        import os

        self.client_id = f"127.0.0.1@{instance_name or f'producer-{os.getpid()}-{time.monotonic_ns()}'}"
        self.instance = ClientInstance(namesrv, self.client_id, api_timeout=self.options.send_timeout)
        self._uniq = UniqKeyGenerator()
        self._counters: dict[str, itertools.count[int]] = {}
        self._started = False

    async def start(self) -> None:
        self._started = True

    async def stop(self) -> None:
        if not self._started:
            return
        self._started = False
        await self.instance.close()

    async def __aenter__(self) -> Producer:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    async def _pick_queue(self, topic: str, msg: Message | None,
                          selector: QueueSelector | None) -> MessageQueue:
        queues = await self.instance.publish_queues(topic)
        if not queues:
            raise MQClientError(f"topic {topic!r} has no writable queue")
        if selector is not None and msg is not None:
            return selector(queues, msg)
        counter = self._counters.setdefault(topic, itertools.count())
        return queues[next(counter) % len(queues)]

    async def send(self, msg: Message, *, queue: MessageQueue | None = None,
                   selector: QueueSelector | None = None) -> SendResult:
        """Send one message; the queue is chosen round-robin unless given or selected."""
        if not msg.body:
            # The broker cannot store a single message without a body (Java refuses it too:
            # "the message body length is zero"); inside a batch an empty body is fine.
            raise InvalidArgumentError("the message body is empty; send it with send_batch() or add a body")
        props = msg.all_properties()
        props.setdefault(PROPERTY_UNIQ_KEY, self._uniq.next_id())
        props.setdefault(PROPERTY_WAIT, "true")
        body = msg.body
        sys_flag = 0
        if len(body) >= self.options.compress_over:
            body = zlib.compress(body, self.options.compress_level)
            sys_flag |= MessageSysFlag.COMPRESSED_FLAG | MessageSysFlag.COMPRESSION_ZLIB_TYPE
        if len(body) > self.options.max_message_size:
            raise InvalidArgumentError(f"message body of {len(body)} bytes exceeds max_message_size")
        return await self._send_with_retry(
            msg.topic, queue, msg, selector, body, encode_properties(props), sys_flag, msg.flag,
            batch=False,
        )

    async def send_batch(self, msgs: Sequence[Message], *,
                         queue: MessageQueue | None = None) -> SendResult:
        """Send several messages of one topic in one request (SEND_BATCH_MESSAGE)."""
        if not msgs:
            raise InvalidArgumentError("empty batch")
        topic = msgs[0].topic
        prepared: list[Message] = []
        for m in msgs:
            if m.topic != topic:
                raise InvalidArgumentError("all messages of a batch must have the same topic")
            props = m.all_properties()
            props.setdefault(PROPERTY_UNIQ_KEY, self._uniq.next_id())
            props.setdefault(PROPERTY_WAIT, "true")
            prepared.append(Message(topic, m.body, properties=props, flag=m.flag))
        body = encode_batch(prepared)
        if len(body) > self.options.max_message_size:
            raise InvalidArgumentError(f"batch of {len(body)} bytes exceeds max_message_size")
        return await self._send_with_retry(
            topic, queue, None, None, body, "", 0, 0, batch=True,
        )

    async def _send_with_retry(self, topic: str, queue: MessageQueue | None, msg: Message | None,
                               selector: QueueSelector | None, body: bytes, properties: str,
                               sys_flag: int, flag: int, *, batch: bool) -> SendResult:
        attempts = 1 + (self.options.retry_times_when_send_failed if queue is None else 0)
        last_exc: Exception | None = None
        for attempt in range(attempts):
            mq = queue or await self._pick_queue(topic, msg, selector)
            try:
                addr = await self.instance.find_broker_master(mq.broker_name, topic)
                return await self.instance.api.send_message(
                    addr, mq, producer_group=self.group, body=body, properties=properties,
                    sys_flag=sys_flag, flag=flag, batch=batch,
                    default_topic=self.options.create_topic_key,
                    default_topic_queue_nums=self.options.default_topic_queue_nums,
                    timeout=self.options.send_timeout,
                )
            except (MQBrokerError, MQClientError, RemotingError) as exc:
                last_exc = exc
                log.warning("producer.send_failed", topic=topic, queue=str(mq), attempt=attempt,
                            error=str(exc))
                if selector is not None:
                    break
        assert last_exc is not None
        raise last_exc

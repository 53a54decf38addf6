"""A small asyncio producer: send, batch send, round-robin queue selection.

It exists for examples, tests and the benchmark; it is kept small and correct rather than
complete (no transactions, no request-reply)::

    async with Producer("my-producer", namesrv="127.0.0.1:9876") as p:
        result = await p.send(Message("orders", b"...", tags="created", keys=["o-1"]))
"""

from __future__ import annotations

import asyncio
import dataclasses
import ipaddress
import itertools
import math
import os
import random
import ssl
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import anyio
import structlog

from rmq_async.client.api import SendResult
from rmq_async.client.errors import (
    RETRY_SEND_CODES,
    MQBrokerError,
    MQClientError,
    NoPermissionError,
    NoRouteError,
)
from rmq_async.client.instance import ClientInstance
from rmq_async.consumer.options import (
    Credentials,
    InvalidOptionError,
    check_group_name,
    check_tls_options,
    check_topic_name,
    default_client_ip,
)
from rmq_async.consumer.subscriptions import RETRY_GROUP_TOPIC_PREFIX
from rmq_async.consumer.tasks import TaskOwner
from rmq_async.errors import IllegalStateError, InvalidArgumentError, InvalidTypeError
from rmq_async.protocol.bodies import (
    INNER_PRODUCER_GROUP,
    HeartbeatData,
    ProducerData,
    producer_queues,
)
from rmq_async.protocol.codes import (
    COMPRESSION_LZ4,
    COMPRESSION_ZLIB,
    COMPRESSION_ZSTD,
    INT32_MAX,
    INT32_MIN,
    MessageSysFlag,
)
from rmq_async.protocol.errors import ProtocolError
from rmq_async.protocol.filter import java_string_hash
from rmq_async.protocol.message import (
    UniqKeyGenerator,
    compress_body,
    encode_batch,
    encode_properties,
)
from rmq_async.protocol.types import (
    PROPERTY_DELAY,
    PROPERTY_MAX_RECONSUME_TIMES,
    PROPERTY_RECONSUME_TIME,
    PROPERTY_UNIQ_KEY,
    PROPERTY_WAIT,
    Message,
    MessageQueue,
)
from rmq_async.remoting.client import until_deadline
from rmq_async.remoting.errors import (
    ConnectionLostInFlight,
    RemotingError,
    RemotingTimeout,
    TlsVerificationError,
)
from rmq_async.remoting.tls import client_ssl_context

log = structlog.get_logger(__name__)

# Bodies at least this large are compressed in a worker thread.
_COMPRESS_INLINE = 64 * 1024

QueueSelector = Callable[[list[MessageQueue], Message], MessageQueue]


def select_by_key(queues: list[MessageQueue], msg: Message) -> MessageQueue:
    """Queue selector keeping every message with the same (first) key on one queue.

    Pass it as ``send(msg, selector=select_by_key)`` for ordered messages: the queue is the
    Java ``String.hashCode`` of the key, in absolute value, modulo the number of queues.
    """
    key = msg.keys if isinstance(msg.keys, str) else (msg.keys or [""])[0]
    return queues[abs(java_string_hash(key)) % len(queues)]


_COMPRESSION_TYPES = {"ZLIB": COMPRESSION_ZLIB, "LZ4": COMPRESSION_LZ4, "ZSTD": COMPRESSION_ZSTD}
#: The levels each compression takes (zlib's -1..9; zstd's negative fast levels and 1..22;
#: LZ4 ignores the level, as lz4-java does).
_COMPRESS_LEVELS = {"ZLIB": (-1, 9), "ZSTD": (-(2**17), 22), "LZ4": (INT32_MIN, INT32_MAX)}
#: Java ``MixAll.DEFAULT_PRODUCER_GROUP``: no producer may take it.
DEFAULT_PRODUCER_GROUP = "DEFAULT_PRODUCER"


@dataclass(slots=True)
class ProducerOptions:
    """Producer settings (Java ``DefaultMQProducer`` names in snake_case); durations are
    seconds, a float or a ``timedelta``."""

    send_timeout: float = 3.0
    """The time one ``send()`` may take, every attempt included (Java ``sendMsgTimeout``):
    route lookup, connecting and each request get what the ones before left. A request
    that timed out used it all and is not sent again."""
    retry_times_when_send_failed: int = 2
    """Extra attempts of a send whose queue was neither given nor picked by a ``selector``,
    each on another broker when the topic has one (Java ``retryTimesWhenSendFailed``), while
    ``send_timeout`` lasts."""
    route_refresh_interval: float = 30.0
    """How often the routes of the topics sent to are fetched again while the producer is
    started, as the consumer's option of this name (Java ``pollNameServerInterval``)."""
    heartbeat_interval: float = 30.0
    """How often a started producer tells the master brokers it knows its group (Java
    ``heartbeatBrokerInterval``); a broker also gets one on each new connection."""
    compress_over: int = 4096
    compress_level: int = 5
    compress_type: str = "ZLIB"
    """``ZLIB``, ``LZ4`` or ``ZSTD``: how bodies of ``compress_over`` bytes or more are
    compressed (Java ``compressType``)."""
    max_message_size: int = 4 * 1024 * 1024
    default_topic_queue_nums: int = 4
    """Queues per broker of a topic the broker creates on its first message (Java
    ``defaultTopicQueueNums``)."""
    create_topic_key: str = "TBW102"
    """The topic whose route stands in for a topic that has none yet (Java
    ``createTopicKey``): a send to a new topic goes to the brokers that serve this one, which
    create the topic if they allow it (``autoCreateTopicEnable``)."""
    client_ip: str = dataclasses.field(default_factory=default_client_ip)
    """This host's address as the broker is told it: the front of the producer's client id
    and the address inside its message ids (Java ``clientIP``; picked as the consumer's).
    A value that is not an IP address keeps the client id but gives the message ids the
    clock-derived stand-in Java uses when it finds no address."""
    credentials: Credentials | None = None
    """ACL account, as the consumer's: ``(access_key, secret_key[, security_token])`` too."""
    tls: bool = False
    tls_verify: bool = True
    tls_ca_file: str | os.PathLike[str] | None = None
    ssl_context: ssl.SSLContext | None = None
    """TLS, as the consumer's options: verified against the system's CAs or ``tls_ca_file``
    unless ``tls_verify=False``; a ready ``ssl_context`` is used as given."""

    def __post_init__(self) -> None:
        if not isinstance(self.client_ip, str) or not self.client_ip.strip():
            raise InvalidOptionError("client_ip", f"expected a non-empty string, got "
                                                  f"{self.client_ip!r}")
        self.send_timeout = _positive_seconds("send_timeout", self.send_timeout)
        self.route_refresh_interval = _positive_seconds("route_refresh_interval",
                                                        self.route_refresh_interval)
        self.heartbeat_interval = _positive_seconds("heartbeat_interval", self.heartbeat_interval)
        self.credentials = Credentials.coerce(self.credentials)
        check_tls_options(self.tls, self.tls_verify, self.tls_ca_file, self.ssl_context)
        ctype = self.compress_type.strip().upper() if isinstance(self.compress_type, str) else None
        if ctype not in _COMPRESSION_TYPES:
            raise InvalidOptionError(
                "compress_type", f"{self.compress_type!r} is not one of ZLIB, LZ4, ZSTD")
        self.compress_type = ctype
        if (not isinstance(self.retry_times_when_send_failed, int)
                or self.retry_times_when_send_failed < 0):
            raise InvalidOptionError("retry_times_when_send_failed",
                                     f"expected an int >= 0, got {self.retry_times_when_send_failed!r}")
        # Checked here, not at the first send that needs them (an untyped error there).
        for name, least in (("compress_over", 0), ("max_message_size", 1),
                            ("default_topic_queue_nums", 1)):
            value = getattr(self, name)
            if name == "compress_over" and value == math.inf:
                continue  # never compress
            if isinstance(value, bool) or not isinstance(value, int) or value < least:
                raise InvalidOptionError(name, f"expected an int >= {least}, got {value!r}")
        low, high = _COMPRESS_LEVELS[ctype]
        level = self.compress_level
        if isinstance(level, bool) or not isinstance(level, int) or not low <= level <= high:
            raise InvalidOptionError("compress_level", f"{ctype} takes a level from {low} to "
                                                       f"{high}, got {level!r}")

    @property
    def tls_enabled(self) -> bool:
        return self.tls or self.tls_ca_file is not None or self.ssl_context is not None


def _waits_for_store(msg: Message) -> bool:
    """Java's ``isWaitStoreMsgOK``: the WAIT property, true when absent."""
    value = msg.properties.get(PROPERTY_WAIT)
    return value is None or value.lower() == "true"


def _ip_or_none(text: str) -> str | None:
    try:
        ipaddress.ip_address(text)
    except ValueError:
        return None
    return text


def _positive_seconds(name: str, value: object) -> float:
    if isinstance(value, timedelta):
        value = value.total_seconds()
    if isinstance(value, bool) or not isinstance(value, int | float) or not value > 0:
        raise InvalidOptionError(name, f"expected seconds > 0, got {value!r}")
    return float(value)


def select_queue(queues: Sequence[MessageQueue], counter: Iterator[int],
                 last_broker: str | None) -> MessageQueue:
    """The next queue of a send, as Java's producer picks it without latency fault tolerance.

    Round-robin over every writable queue of every broker group (``counter`` is the topic's
    send index); on a retry (``last_broker`` is the broker that just failed) the first queue
    in turn on another broker, or the next queue at all when there is no other broker.
    """
    n = len(queues)
    if last_broker is not None:
        for _ in range(n):
            mq = queues[next(counter) % n]
            if mq.broker_name != last_broker:
                return mq
    return queues[next(counter) % n]


class Producer:
    """Sends messages to a topic's queues in turn (Java ``DefaultMQProducer``, trimmed)."""

    def __init__(self, group: str, namesrv: str | list[str], *,
                 instance_name: str | None = None, **options: Any) -> None:
        unknown = set(options) - set(ProducerOptions.__dataclass_fields__)
        if unknown:
            raise InvalidOptionError(", ".join(sorted(unknown)), "unknown producer option")
        self.options = opts = ProducerOptions(**options)
        self.group = check_group_name(group, option="producer_group",
                                      reserved=DEFAULT_PRODUCER_GROUP)
        self.client_id = (f"{opts.client_ip}@"
                          f"{instance_name or f'producer-{os.getpid()}-{time.monotonic_ns()}'}")
        self.instance = ClientInstance(
            namesrv, self.client_id, api_timeout=opts.send_timeout,
            rpc_hook=None if opts.credentials is None else opts.credentials.rpc_hook(),
            ssl=client_ssl_context(
                tls=opts.tls_enabled, tls_verify=opts.tls_verify, tls_ca_file=opts.tls_ca_file,
                ssl_context=opts.ssl_context, client=self.client_id),
        )
        self._compression = _COMPRESSION_TYPES[opts.compress_type]
        self._uniq = UniqKeyGenerator(_ip_or_none(opts.client_ip))
        self._counters: dict[str, Iterator[int]] = {}
        # Topics without a route of their own: until when the create_topic_key route's
        # queues stand in for theirs, and those queues.
        self._stand_ins: dict[str, tuple[float, list[MessageQueue]]] = {}
        # When each topic's route was last fetched or checked (a producer not started).
        self._routes_checked: dict[str, float] = {}
        self._tasks: TaskOwner | None = None
        self._lookup_late = (f"route lookup took the rest of send_timeout "
                             f"({self.options.send_timeout:.3f}s)")
        self._stopped = False

    def heartbeat_data(self) -> HeartbeatData:
        """The HEART_BEAT body this producer sends: its group and, as Java's, the client's
        inner producer group."""
        groups = [self.group] + ([INNER_PRODUCER_GROUP] if self.group != INNER_PRODUCER_GROUP
                                 else [])
        return HeartbeatData(client_id=self.client_id,
                             producer_data_set=[ProducerData(group_name=g) for g in groups])

    async def start(self) -> None:
        """Get ready to send: routes are fetched on the first send to each topic, and again
        every ``route_refresh_interval`` until :meth:`stop`; the master brokers hear of the
        producer group on each new connection and every ``heartbeat_interval``."""
        if self._tasks is not None:
            return
        if self._stopped or self.instance.remoting.closed:
            raise IllegalStateError("the producer was stopped; create a new one to send again")
        self._tasks = TaskOwner(f"producer[{self.group}]")
        self.instance.heartbeat_source = self.heartbeat_data  # a producer not started sends none
        self._tasks.spawn(self.instance.route_refresh_loop(self.options.route_refresh_interval),
                          name="route-refresh")
        self._tasks.spawn(self.instance.heartbeat_loop(self.options.heartbeat_interval),
                          name="heartbeat")

    async def stop(self) -> None:
        """End the route refresh and the heartbeats, tell the brokers the producer is gone
        (UNREGISTER_CLIENT, when it was started) and close the connections to the name servers
        and brokers (also those of sends made without :meth:`start`)."""
        self._stopped = True  # a start() while this stop() awaits must not start again
        tasks, self._tasks = self._tasks, None
        if tasks is not None:
            await tasks.aclose()
            await self.instance.unregister(self.group, None)
        await self.instance.close()

    async def __aenter__(self) -> Producer:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    async def _pick_queue(self, topic: str, msg: Message | None,
                          selector: QueueSelector | None, last_broker: str | None) -> MessageQueue:
        queues = await self._publish_queues(topic)
        if not queues:
            raise MQClientError(f"topic {topic!r} has no writable queue")
        if selector is not None and msg is not None:
            try:
                chosen = selector(queues, msg)
            except Exception as exc:  # Java: "select message queue threw exception."
                raise MQClientError(f"the queue selector raised {type(exc).__name__}: "
                                    f"{exc}") from exc
            if not isinstance(chosen, MessageQueue):
                raise MQClientError(f"the queue selector returned {chosen!r}, not one of the "
                                    f"topic's MessageQueue")
            return chosen
        counter = self._counters.get(topic)
        if counter is None:
            # Java starts each topic's send index at a random point.
            counter = self._counters[topic] = itertools.count(random.randrange(1 << 16))
        return select_queue(queues, counter, last_broker)

    async def _publish_queues(self, topic: str) -> list[MessageQueue]:
        """The topic's writable queues; for a topic without a route, those the route of
        ``create_topic_key`` stands in for (Java ``tryToFindTopicPublishInfo``): at most
        ``default_topic_queue_nums`` per broker, on which the broker creates the topic.

        A stand-in is kept for ``route_refresh_interval`` (Java keeps it in its publish table
        until the periodic refresh finds the topic's own route): the sends meanwhile ask the
        name servers nothing."""
        loop = asyncio.get_running_loop()
        held = self._stand_ins.get(topic)
        if held is not None:
            if held[0] > loop.time():
                return held[1]
            del self._stand_ins[topic]
        if self._tasks is None:
            await self._refresh_unstarted(topic, loop.time())
        try:
            return await self.instance.publish_queues(topic)
        except NoRouteError as missing:
            try:
                template = await self.instance.update_route(self.options.create_topic_key)
            except NoRouteError:
                raise missing from None  # no broker creates topics: the topic's own error
        n = self.options.default_topic_queue_nums
        stand_in = dataclasses.replace(template, order_topic_conf=None, queue_datas=[
            dataclasses.replace(qd, read_queue_nums=min(n, qd.read_queue_nums),
                                write_queue_nums=min(n, qd.read_queue_nums))
            for qd in template.queue_datas])
        queues = producer_queues(stand_in, topic)
        if queues:
            self._stand_ins[topic] = (loop.time() + self.options.route_refresh_interval, queues)
        return queues

    async def _refresh_unstarted(self, topic: str, now: float) -> None:
        """A producer used without :meth:`start` has no route refresh task: a held route older
        than ``route_refresh_interval`` is fetched again by the send that needs it (a master
        that moved, a queue count changed), and kept when the name servers fail to answer."""
        checked = self._routes_checked.get(topic)
        if checked is None or topic not in self.instance.routes:
            self._routes_checked[topic] = now
            return
        if now - checked < self.options.route_refresh_interval:
            return
        self._routes_checked[topic] = now
        try:
            await self.instance.update_route(topic)
        except (MQClientError, RemotingError, ProtocolError) as exc:
            log.warning("producer.route_refresh_failed", topic=topic, error=str(exc))

    async def send(self, msg: Message, *, queue: MessageQueue | None = None,
                   selector: QueueSelector | None = None) -> SendResult:
        """Send one message; the queue is chosen round-robin unless given or selected.

        The message gets its unique id (``UNIQ_KEY``, the ``msg_id`` of the result) in its
        ``properties`` on its first send, as Java's ``setUniqID``: sent again (after a timeout,
        say), it keeps it, so that consumers can recognise the copy."""
        self._check_sendable(msg, queue)
        body = bytes(msg.body)
        uniq_id = self._unique_id(msg)
        props = msg.all_properties()
        props.setdefault(PROPERTY_WAIT, "true")
        counts = _retry_counts(msg.topic, props)
        sys_flag = 0
        # As in Java, compressing the body is part of the send, so of its send_timeout.
        deadline = asyncio.get_running_loop().time() + self.options.send_timeout
        if len(body) >= self.options.compress_over:
            body = await self._compress(body)
            sys_flag |= MessageSysFlag.COMPRESSED_FLAG | (self._compression << 8)
        return await self._send_with_retry(
            msg.topic, queue, msg, selector, body, encode_properties(props), sys_flag, msg.flag,
            batch=False, msg_id=uniq_id, deadline=deadline, retry_counts=counts,
        )

    def _unique_id(self, msg: Message) -> str:
        """``msg``'s unique id, given it on its first send (Java ``setUniqID``). The message
        gets a new properties dict holding it: the caller's dict, which other messages may
        share, is not written to."""
        uniq_id = msg.properties.get(PROPERTY_UNIQ_KEY)
        if uniq_id is None:
            uniq_id = self._uniq.next_id()
            msg.properties = {**msg.properties, PROPERTY_UNIQ_KEY: uniq_id}
        return uniq_id

    def _check_sendable(self, msg: Message, queue: MessageQueue | None) -> None:
        """What Java's ``send`` refuses before anything is sent, and what would otherwise fail
        later, untyped, or take other sends down with it (a ``str`` body failed in the
        connection's write, with every frame queued beside it)."""
        if self._stopped:
            raise IllegalStateError(f"producer {self.group!r} is stopped")
        check_topic_name(msg.topic)
        if msg.topic in NOT_ALLOWED_SEND_TOPICS:
            # Java's Validators.isNotAllowedSendTopic: the broker refuses them (NO_PERMISSION,
            # which a send would retry and then blame on the credentials).
            raise InvalidArgumentError(f"sending a message to topic {msg.topic!r} is forbidden")
        if not isinstance(msg.flag, int) or isinstance(msg.flag, bool) \
                or not INT32_MIN <= msg.flag <= INT32_MAX:
            raise InvalidArgumentError(f"a message flag is a 32-bit int (Java's int), "
                                       f"not {msg.flag!r}")
        if not isinstance(msg.body, bytes | bytearray | memoryview):
            raise InvalidTypeError(f"a message body must be bytes, not {type(msg.body).__name__}"
                                   " (encode text first)")
        if not msg.body:
            # Java's Validators.checkMessage: "the message body length is zero", for a message
            # sent alone and for each message of a batch.
            raise InvalidArgumentError("the message body is empty")
        size = memoryview(msg.body).nbytes  # a memoryview's len() counts items, not bytes
        if size > self.options.max_message_size:  # as Java: checked before compressing
            raise InvalidArgumentError(f"message body of {size} bytes exceeds max_message_size")
        if msg.tags is not None and not isinstance(msg.tags, str):
            raise InvalidTypeError(f"tags must be a str, not {type(msg.tags).__name__}")
        keys = msg.keys
        if not (keys is None or isinstance(keys, str) or (
                isinstance(keys, list | tuple) and all(isinstance(k, str) for k in keys))):
            raise InvalidTypeError("keys must be a str or a list of str")
        for name, value in msg.properties.items():
            if not isinstance(name, str) or not isinstance(value, str):
                raise InvalidTypeError(f"message properties must map str to str, not "
                                       f"{name!r}: {type(value).__name__}")
        if queue is not None:
            if not isinstance(queue, MessageQueue):
                raise InvalidTypeError(f"queue must be a MessageQueue, not "
                                       f"{type(queue).__name__}")
            if queue.topic != msg.topic:
                raise InvalidArgumentError(f"the message's topic {msg.topic!r} is not the "
                                           f"queue's {queue.topic!r}")

    async def _compress(self, body: bytes) -> bytes:
        level = self.options.compress_level
        if len(body) < _COMPRESS_INLINE:
            return compress_body(body, self._compression, level)
        # Large bodies are compressed off the event loop.
        return await anyio.to_thread.run_sync(compress_body, body, self._compression, level)

    async def send_batch(self, msgs: Sequence[Message], *,
                         queue: MessageQueue | None = None) -> SendResult:
        """Send several messages of one topic in one request (SEND_BATCH_MESSAGE)."""
        if not msgs:
            raise InvalidArgumentError("empty batch")
        topic = msgs[0].topic
        prepared: list[Message] = []
        uniq_ids: list[str] = []
        for m in msgs:
            self._check_sendable(m, queue)
            if m.topic != topic:
                raise InvalidArgumentError("all messages of a batch must have the same topic")
            # Java's MessageBatch refuses these too: the broker would not delay or retry a
            # message inside a batch.
            if m.topic.startswith(RETRY_GROUP_TOPIC_PREFIX):
                raise InvalidArgumentError("a retry topic's messages cannot be sent in a batch")
            if m.properties.get(PROPERTY_DELAY, "0") not in ("", "0"):
                raise InvalidArgumentError("a delayed message cannot be sent in a batch")
        # The broker reads WAIT for the whole batch from the request header (absent: true),
        # so the messages must agree on it, as Java's MessageBatch requires.
        waits = {_waits_for_store(m) for m in msgs}
        if len(waits) > 1:
            raise InvalidArgumentError("the messages of a batch must agree on WAIT "
                                       "(waiting for the store or not)")
        for m in msgs:  # every message checked first: a refused batch leaves them untouched
            uniq_ids.append(self._unique_id(m))
            props = m.all_properties()
            props.setdefault(PROPERTY_WAIT, "true")
            prepared.append(Message(topic, bytes(m.body), properties=props, flag=m.flag))
        body = encode_batch(prepared)
        if len(body) > self.options.max_message_size:
            raise InvalidArgumentError(f"batch of {len(body)} bytes exceeds max_message_size")
        header_props = encode_properties({PROPERTY_WAIT: "true" if waits.pop() else "false"})
        return await self._send_with_retry(
            topic, queue, None, None, body, header_props, 0, 0, batch=True,
            msg_id=",".join(uniq_ids),
        )

    async def _send_with_retry(self, topic: str, queue: MessageQueue | None, msg: Message | None,
                               selector: QueueSelector | None, body: bytes, properties: str,
                               sys_flag: int, flag: int, *, batch: bool,
                               msg_id: str, deadline: float | None = None,
                               retry_counts: tuple[int | None, int | None] = (None, None),
                               ) -> SendResult:
        """Send, retrying as Java's ``sendDefaultImpl`` does, all within one ``send_timeout``.

        Each attempt (route lookup, connecting, the request) gets what the ones before it
        left. An attempt that timed out used the rest: the message is not sent again (the
        broker may have stored it), and neither is it once nothing is left. Nor after the
        connection closed while the request was out (:class:`ConnectionLostInFlight`), for the
        same reason; Java sends it again in both cases, risking a duplicate.
        """
        attempts = 1 + (self.options.retry_times_when_send_failed if queue is None else 0)
        loop = asyncio.get_running_loop()
        if deadline is None:
            deadline = loop.time() + self.options.send_timeout
        last_exc: Exception | None = None
        last_broker: str | None = None
        timed_out = False
        for attempt in range(attempts):
            if loop.time() >= deadline:
                timed_out = True
                break
            try:
                # (Inside the try: a retry's route lookup that fails ends the send with what
                # the attempts before it met, not with the lookup's error alone.)
                mq = queue if queue is not None else await until_deadline(
                    self._pick_queue(topic, msg, selector, last_broker), deadline,
                    self._lookup_late)
            except (MQClientError, RemotingError) as exc:
                if last_exc is None or isinstance(exc, RemotingTimeout):
                    raise
                log.warning("producer.route_lookup_failed", topic=topic, attempt=attempt,
                            error=str(exc))
                break
            last_broker = mq.broker_name
            try:
                addr = await until_deadline(
                    self.instance.find_broker_master(mq.broker_name, topic), deadline,
                    self._lookup_late)
                return await self.instance.api.send_message(
                    addr, mq, producer_group=self.group, body=body, properties=properties,
                    sys_flag=sys_flag, flag=flag, batch=batch,
                    default_topic=self.options.create_topic_key,
                    default_topic_queue_nums=self.options.default_topic_queue_nums,
                    timeout=deadline - loop.time(), msg_id=msg_id,
                    reconsume_times=retry_counts[0], max_reconsume_times=retry_counts[1],
                )
            except TlsVerificationError:
                raise  # another attempt meets the same certificate
            except (MQBrokerError, MQClientError, RemotingError) as exc:
                last_exc = exc
                log.warning("producer.send_failed", topic=topic, queue=str(mq), attempt=attempt,
                            error=str(exc))
                if isinstance(exc, RemotingTimeout):
                    timed_out = True  # this attempt had what was left of send_timeout
                    break
                if isinstance(exc, ConnectionLostInFlight):
                    break  # sent, then the connection died: the broker may have stored it
                if selector is not None:
                    break
                if isinstance(exc, MQBrokerError) and exc.code not in RETRY_SEND_CODES:
                    break
        if timed_out:
            raise RemotingTimeout(
                f"send to topic {topic!r} not done within send_timeout "
                f"({self.options.send_timeout:.3f}s; "
                + (f"last failure: {last_exc})" if last_exc is not None else
                   "used up before the first attempt: compressing the body)"),
                addr=getattr(last_exc, "addr", None),
            ) from last_exc
        assert last_exc is not None
        if isinstance(last_exc, NoPermissionError):
            creds = self.options.credentials
            who = f"access key {creds.access_key!r}" if creds is not None else "no credentials"
            raise NoPermissionError(
                last_exc.code,
                f"{last_exc.remark} (producer group {self.group!r}, topic {topic!r}, {who}; check "
                "the credentials option and the account's rights on the broker)",
                addr=last_exc.addr, request=last_exc.request,
            ) from last_exc
        raise last_exc


#: Java ``TopicValidator``'s topics no client may send to (the broker's own).
NOT_ALLOWED_SEND_TOPICS = frozenset({
    "SCHEDULE_TOPIC_XXXX", "RMQ_SYS_TRANS_HALF_TOPIC", "RMQ_SYS_TRANS_OP_HALF_TOPIC",
    "TRANS_CHECK_MAX_TIME_TOPIC", "SELF_TEST_TOPIC", "OFFSET_MOVED_EVENT",
})


def _retry_counts(topic: str, props: dict[str, str]) -> tuple[int | None, int | None]:
    """For a ``%RETRY%`` topic, the message's ``RECONSUME_TIME`` and ``MAX_RECONSUME_TIMES``
    for the request header, as Java's ``sendKernelImpl`` copies them there (after writing the
    properties, which keep them): the broker decides between a retry and the dead-letter
    queue from the header alone."""
    if not topic.startswith(RETRY_GROUP_TOPIC_PREFIX):
        return None, None
    counts: list[int | None] = []
    for name in (PROPERTY_RECONSUME_TIME, PROPERTY_MAX_RECONSUME_TIMES):
        text = props.get(name)
        if text is None:
            counts.append(None)
            continue
        try:
            value = int(text)
        except ValueError:
            raise InvalidArgumentError(f"property {name} is not a number: {text!r}") from None
        if not INT32_MIN <= value <= INT32_MAX:
            raise InvalidArgumentError(f"property {name} is not a 32-bit int: {text!r}")
        counts.append(value)
    return counts[0], counts[1]

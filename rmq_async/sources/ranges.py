"""Offset ranges of RocketMQ queues: options, positions, planning, and reading one range.

Everything an engine-driven source needs that is not the engine itself: no Spark, no Arrow.

* :class:`SourceOptions` parses the string options of a source (Spark's option map) once.
* A *position* (:class:`Position`) says where a read starts or ends: ``earliest``, ``latest``,
  a store timestamp, or an offset per queue. :func:`resolve_offsets` turns it into one offset
  per queue with the broker's own answers (GET_MIN_OFFSET, GET_MAX_OFFSET,
  SEARCH_OFFSET_BY_TIMESTAMP).
* Offsets travel as JSON-able dicts ``{topic: {"<broker>:<queue id>": offset}}``
  (:func:`offsets_to_json` / :func:`offsets_from_json`): Spark keeps them in its checkpoint.
* :func:`read_range` pulls exactly the offsets ``[start, end)`` of one queue with plain
  PULL_MESSAGE calls (no consumer group membership, no rebalance, no committed offset) and
  yields the decoded messages in chunks.

Offsets are queue offsets (consume-queue indexes), so ``end - start`` is the number of messages
in a range; with a ``tags`` or ``sql`` filter the broker skips the entries that do not match,
and a range yields fewer rows than offsets.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import ssl as _ssl
import time
from collections import deque
from collections.abc import AsyncGenerator, Iterable, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any, Literal

import structlog

from rmq_async.client.api import PendingPull, PullStatus
from rmq_async.client.errors import (
    MQBrokerError,
    MQClientError,
    NameServerUnavailable,
    NoRouteError,
    broker_error,
)
from rmq_async.client.instance import ClientInstance
from rmq_async.consumer.options import Credentials, default_client_ip
from rmq_async.errors import InvalidArgumentError
from rmq_async.protocol.bodies import ConsumerData, HeartbeatData
from rmq_async.protocol.codes import RequestCode, ResponseCode
from rmq_async.protocol.command import RemotingCommand
from rmq_async.protocol.filter import SubscriptionData, build_subscription, tag_matches
from rmq_async.protocol.message import stamp_delivered
from rmq_async.protocol.types import (
    PROPERTY_MAX_OFFSET,
    PROPERTY_MIN_OFFSET,
    MessageExt,
    MessageQueue,
)
from rmq_async.remoting.errors import RemotingError

__all__ = [
    "EARLIEST",
    "LATEST",
    "DataLossError",
    "announce_group",
    "first_stored_since",
    "Position",
    "SourceError",
    "SourceOptions",
    "limit_offsets",
    "list_queues",
    "matching_topics",
    "offsets_from_json",
    "offsets_to_json",
    "open_client",
    "parse_position",
    "queue_bounds",
    "queue_key",
    "read_range",
    "resolve_offsets",
    "source_topics",
]

log = structlog.get_logger(__name__)

#: In a JSON position, the queue's first offset (as in Spark's Kafka source).
EARLIEST = -2
#: The longest ``apiTimeout`` taken: a read must end even when a broker stops answering.
MAX_API_TIMEOUT = 3600.0
#: In a JSON position, the queue's max offset: where the next message will be written.
LATEST = -1

DEFAULT_GROUP = "rmq_async_spark_source"
DEFAULT_PULL_BATCH = 32
DEFAULT_CHUNK_ROWS = 10_000
DEFAULT_PULL_DEPTH = 4

OffsetsJson = dict[str, dict[str, int]]


class SourceError(InvalidArgumentError):
    """A source option or position that cannot be used (raised while planning)."""


class DataLossError(MQClientError):
    """Offsets a read was planned for are gone from the broker (``failOnDataLoss`` is true)."""


# ---------------------------------------------------------------------- offsets as JSON


def queue_key(mq: MessageQueue) -> str:
    """``"<broker name>:<queue id>"``, the key of a queue inside its topic's offset map."""
    return f"{mq.broker_name}:{mq.queue_id}"


def _parse_queue_key(topic: str, key: str) -> MessageQueue:
    broker, sep, qid = key.rpartition(":")
    if not sep or not broker or not qid.lstrip("-").isdigit():
        raise SourceError(f"queue key {key!r} of topic {topic!r} is not '<broker name>:<queue id>'")
    return MessageQueue(topic, broker, int(qid))


def offsets_to_json(offsets: Mapping[MessageQueue, int]) -> OffsetsJson:
    """``{topic: {"broker:queue": offset}}``, topics and queues in a stable order."""
    out: OffsetsJson = {}
    for mq in sorted(offsets):
        out.setdefault(mq.topic, {})[queue_key(mq)] = int(offsets[mq])
    return out


def offsets_from_json(data: Any) -> dict[MessageQueue, int]:
    """Inverse of :func:`offsets_to_json` (also reads JSON text)."""
    if isinstance(data, str):
        try:
            data = json.loads(data)
        except json.JSONDecodeError as exc:
            raise SourceError(f"offsets are not valid JSON: {exc}")
    if not isinstance(data, dict):
        raise SourceError(f"offsets must be a JSON object of topics, got {type(data).__name__}")
    out: dict[MessageQueue, int] = {}
    for topic, queues in data.items():
        if not isinstance(queues, dict):
            raise SourceError(f"offsets of topic {topic!r} must be an object of queues")
        for key, offset in queues.items():
            if isinstance(offset, bool) or not isinstance(offset, int):
                raise SourceError(f"offset of {topic!r} {key!r} must be an integer, got {offset!r}")
            out[_parse_queue_key(topic, key)] = offset
    return out


# ---------------------------------------------------------------------- positions


@dataclass(frozen=True, slots=True)
class Position:
    """Where a read starts or ends.

    ``kind`` is ``earliest``, ``latest``, ``timestamp`` (``timestamp_ms``: the first message
    stored at or after that time, per queue) or ``offsets`` (``offsets``: per queue, where
    :data:`EARLIEST` and :data:`LATEST` stand for the queue's bounds; a queue left out takes
    ``default``).
    """

    kind: Literal["earliest", "latest", "timestamp", "offsets"]
    timestamp_ms: int | None = None
    offsets: dict[MessageQueue, int] = field(default_factory=dict)


_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)


def _parse_timestamp(text: str, option: str) -> int:
    text = text.strip()
    if text.lstrip("-").isdigit():
        value = int(text)
    else:
        try:
            moment = datetime.fromisoformat(text.replace("Z", "+00:00"))
        except ValueError:
            raise SourceError(
                f"{option}: {text!r} is neither 'earliest', 'latest', JSON offsets per queue, "
                "a timestamp in epoch milliseconds nor an ISO-8601 time")
        if moment.tzinfo is None:
            moment = moment.replace(tzinfo=UTC)
        value = (moment - _EPOCH) // timedelta(milliseconds=1)  # exact, unlike a float
    if value < 0:
        raise SourceError(f"{option}: a timestamp must not be negative, got {value}")
    return value


def parse_position(text: str, option: str) -> Position:
    """Parse ``earliest``, ``latest``, JSON offsets, epoch milliseconds or an ISO-8601 time."""
    stripped = text.strip()
    lowered = stripped.lower()
    if lowered == "earliest":
        return Position("earliest")
    if lowered == "latest":
        return Position("latest")
    if stripped.startswith("{"):
        offsets = offsets_from_json(stripped)
        for mq, off in offsets.items():
            if off < EARLIEST:
                raise SourceError(f"{option}: offset {off} of {mq} is below -2 (earliest)")
        return Position("offsets", offsets=offsets)
    return Position("timestamp", timestamp_ms=_parse_timestamp(stripped, option))


# ---------------------------------------------------------------------- options


def _bool(options: Mapping[str, str], name: str, default: bool) -> bool:
    raw = options.get(name.lower())
    if raw is None:
        return default
    value = raw.strip().lower()
    if value in ("true", "1", "yes"):
        return True
    if value in ("false", "0", "no"):
        return False
    raise SourceError(f"{name}: expected true or false, got {raw!r}")


def _positive_int(options: Mapping[str, str], name: str) -> int | None:
    raw = options.get(name.lower())
    if raw is None:
        return None
    try:
        value = int(raw)
    except ValueError:
        raise SourceError(f"{name}: expected a positive integer, got {raw!r}")
    if value < 1:
        raise SourceError(f"{name}: expected a positive integer, got {value}")
    return value


def _max_per_trigger(options: Mapping[str, str]) -> int | None:
    """``maxMessagesPerTrigger``, or Kafka's name for the same bound, ``maxOffsetsPerTrigger``
    (a queue's offsets count its messages); both given must agree."""
    ours = _positive_int(options, "maxMessagesPerTrigger")
    kafkas = _positive_int(options, "maxOffsetsPerTrigger")
    if ours is not None and kafkas is not None and ours != kafkas:
        raise SourceError(f"maxMessagesPerTrigger ({ours}) and maxOffsetsPerTrigger ({kafkas}) "
                          "name one bound: give one of them")
    return ours if ours is not None else kafkas


_KNOWN = {
    "namesrv", "topics", "tags", "sql", "startingoffsets", "endingoffsets", "startingtimestamp",
    "endingtimestamp", "maxmessagespertrigger", "maxoffsetspertrigger", "failondataloss",
    "committogroup", "group",
    "accesskey", "secretkey", "securitytoken", "tls", "tlsverify", "tlscafile", "apitimeout",
    "pullbatchsize", "pulldepth", "chunkrows", "path", "topicpattern",
}


@dataclass(frozen=True, slots=True)
class SourceOptions:
    """The options of a RocketMQ source, parsed and checked (names as in Spark's option map).

    See :mod:`rmq_async.sources.spark` for what each one means.
    """

    namesrv: str
    topics: tuple[str, ...]
    starting: Position
    ending: Position | None = None
    topic_pattern: str | None = None
    tags: str | None = None
    sql: str | None = None
    max_messages_per_trigger: int | None = None
    fail_on_data_loss: bool = True
    commit_to_group: str | None = None
    group: str = DEFAULT_GROUP
    access_key: str | None = None
    secret_key: str | None = field(default=None, repr=False)
    security_token: str | None = field(default=None, repr=False)
    tls: bool = False
    tls_verify: bool = True
    tls_ca_file: str | None = None
    api_timeout: float = 10.0
    pull_batch_size: int = DEFAULT_PULL_BATCH
    pull_depth: int = DEFAULT_PULL_DEPTH
    chunk_rows: int = DEFAULT_CHUNK_ROWS

    @classmethod
    def parse(cls, options: Mapping[str, str], *, streaming: bool) -> SourceOptions:
        """Check ``options`` (keys in any case) for a batch (``streaming=False``) or a stream."""
        opts = {str(k).lower(): str(v) for k, v in options.items() if v is not None}
        unknown = sorted(set(opts) - _KNOWN)
        if unknown:
            raise SourceError(f"unknown option(s) {', '.join(unknown)} for format rocketmq")
        namesrv = opts.get("namesrv", "").strip()
        if not namesrv:
            raise SourceError("option namesrv is required (name server host:port[;host:port])")
        topics = tuple(t.strip() for t in opts.get("topics", "").split(",") if t.strip())
        pattern = opts.get("topicpattern")
        if bool(topics) == bool(pattern):
            raise SourceError("give exactly one of the options topics (one or more topic names, "
                              "comma separated) and topicPattern (a regular expression)")
        if pattern:
            try:
                re.compile(pattern)
            except re.error as exc:
                raise SourceError(f"topicPattern: {exc}")
        if "tags" in opts and "sql" in opts:
            raise SourceError("options tags and sql exclude each other")
        starting = cls._position(opts, "startingOffsets", "startingTimestamp",
                                 "latest" if streaming else "earliest")
        ending: Position | None = None
        if streaming:
            if "endingoffsets" in opts or "endingtimestamp" in opts:
                raise SourceError("endingOffsets / endingTimestamp are for batch reads only")
        else:
            ending = cls._position(opts, "endingOffsets", "endingTimestamp", "latest")
            if starting.kind == "latest":
                raise SourceError("startingOffsets=latest reads nothing in a batch query")
            if ending.kind == "earliest":
                raise SourceError("endingOffsets=earliest reads nothing in a batch query")
            for name in ("maxMessagesPerTrigger", "maxOffsetsPerTrigger", "commitToGroup"):
                if name.lower() in opts:
                    raise SourceError(f"{name} is for streaming reads only")
            if starting.kind == "offsets" and LATEST in starting.offsets.values():
                raise SourceError("startingOffsets: -1 (latest) reads nothing in a batch query")
            if ending.kind == "offsets" and EARLIEST in ending.offsets.values():
                raise SourceError("endingOffsets: -2 (earliest) reads nothing in a batch query")
        access_key = opts.get("accesskey")
        secret_key = opts.get("secretkey")
        if bool(access_key) != bool(secret_key):
            raise SourceError("options accessKey and secretKey go together")
        if opts.get("securitytoken") and not access_key:
            raise SourceError("option securityToken goes with accessKey and secretKey")
        tls = _bool(opts, "tls", False) or "tlscafile" in opts
        tls_verify = _bool(opts, "tlsVerify", True)
        if not tls_verify and not tls:
            # As the consumer's tls_verify: it would leave the connections plain TCP.
            raise SourceError("tlsVerify=false only applies with TLS on (tls=true)")
        try:
            api_timeout = float(opts.get("apitimeout", "10"))
        except ValueError:
            raise SourceError(f"apiTimeout: expected seconds, got {opts['apitimeout']!r}")
        if not 0 < api_timeout <= MAX_API_TIMEOUT:  # also refuses nan (and inf)
            raise SourceError(f"apiTimeout: expected seconds above 0 and at most "
                              f"{MAX_API_TIMEOUT:g}, got {opts['apitimeout']!r}")
        tags = opts.get("tags")
        if tags is not None:
            # (" * " is every tag, as "*" is: the filter the pulls ask for and the one the
            # reads expect must be the same; the broker took a padded "*" for a tag.)
            tags = tags.strip()
        sql = opts.get("sql")
        try:
            for topic in topics or ("*",):
                build_subscription(topic, sql if sql is not None else tags,
                                   expression_type="SQL92" if sql is not None else None)
        except ValueError as exc:
            raise SourceError(f"{'sql' if sql is not None else 'tags'}: {exc}")
        return cls(
            namesrv=namesrv,
            topics=topics,
            topic_pattern=pattern or None,
            starting=starting,
            ending=ending,
            tags=tags,
            sql=sql,
            max_messages_per_trigger=_max_per_trigger(opts),
            fail_on_data_loss=_bool(opts, "failOnDataLoss", True),
            commit_to_group=opts.get("committogroup") or None,
            group=opts.get("group") or opts.get("committogroup") or DEFAULT_GROUP,
            access_key=access_key or None,
            secret_key=secret_key or None,
            security_token=opts.get("securitytoken") or None,
            tls=tls,
            tls_verify=tls_verify,
            tls_ca_file=opts.get("tlscafile"),
            api_timeout=api_timeout,
            pull_batch_size=_positive_int(opts, "pullBatchSize") or DEFAULT_PULL_BATCH,
            pull_depth=_positive_int(opts, "pullDepth") or DEFAULT_PULL_DEPTH,
            chunk_rows=_positive_int(opts, "chunkRows") or DEFAULT_CHUNK_ROWS,
        )

    @staticmethod
    def _position(opts: Mapping[str, str], offsets_name: str, timestamp_name: str,
                  default: str) -> Position:
        by_offsets = opts.get(offsets_name.lower())
        by_time = opts.get(timestamp_name.lower())
        if by_offsets is not None and by_time is not None:
            raise SourceError(f"options {offsets_name} and {timestamp_name} exclude each other")
        if by_time is not None:
            return Position("timestamp", timestamp_ms=_parse_timestamp(by_time, timestamp_name))
        return parse_position(by_offsets if by_offsets is not None else default, offsets_name)

    def subscription(self, topic: str) -> SubscriptionData:
        """What each pull of ``topic`` asks the broker to filter on."""
        if self.sql is not None:
            return build_subscription(topic, self.sql, sub_version=0, expression_type="SQL92")
        return build_subscription(topic, self.tags, sub_version=0)

    @property
    def filtered(self) -> bool:
        return self.sql is not None or (self.tags is not None and self.tags.strip() not in ("", "*"))


# ---------------------------------------------------------------------- client


def _ssl_context(opts: SourceOptions) -> _ssl.SSLContext | None:
    if not opts.tls:
        return None
    ctx = _ssl.create_default_context(cafile=opts.tls_ca_file)
    if not opts.tls_verify:
        ctx.check_hostname = False
        ctx.verify_mode = _ssl.CERT_NONE
    return ctx


def open_client(opts: SourceOptions, role: str) -> ClientInstance:
    """A short-lived client for one planning step or one partition read (call inside a loop)."""
    hook = (Credentials(opts.access_key, opts.secret_key, opts.security_token).rpc_hook()
            if opts.access_key and opts.secret_key else None)
    client_id = f"{default_client_ip()}@spark-source-{role}-{os.getpid()}"
    return ClientInstance(opts.namesrv, client_id, rpc_hook=hook, ssl=_ssl_context(opts),
                          api_timeout=opts.api_timeout)


# ---------------------------------------------------------------------- planning


async def matching_topics(client: ClientInstance, pattern: str) -> list[str]:
    """The topics the name servers know whose whole name matches ``pattern``, sorted."""
    regex = re.compile(pattern)
    errors: list[str] = []
    for addr in client.namesrv_addrs:
        request = RemotingCommand.request(RequestCode.GET_ALL_TOPIC_LIST_FROM_NAMESERVER)
        try:
            resp = await client.remoting.invoke(addr, request, client.api.timeout)
        except (RemotingError, MQClientError) as exc:
            errors.append(f"{addr}: {exc}")
            continue
        if resp.code != ResponseCode.SUCCESS:
            raise broker_error(resp.code, resp.remark, addr=addr,
                               request="GET_ALL_TOPIC_LIST_FROM_NAMESERVER")
        try:
            doc = json.loads(resp.body or b"{}")
            if not isinstance(doc, dict):
                raise ValueError("not a JSON object")
            names = doc.get("topicList") or []
            if not isinstance(names, list):
                raise ValueError("topicList is not a list")
        except ValueError as exc:  # a garbled answer is this name server's failure
            errors.append(f"{addr}: a topic list that does not parse ({exc})")
            continue
        return sorted(t for t in names
                      if isinstance(t, str) and regex.fullmatch(t) and not _internal_topic(t))
    raise NameServerUnavailable("no name server answered the topic list: " + "; ".join(errors))


#: Topics of the broker itself (Java ``TopicValidator``'s system topics), never matched by a
#: ``topicPattern``: they hold delayed, half-committed or trace messages, not the application's.
SYSTEM_TOPICS = frozenset({
    "TBW102", "SCHEDULE_TOPIC_XXXX", "BenchmarkTest", "RMQ_SYS_TRANS_HALF_TOPIC",
    "RMQ_SYS_TRACE_TOPIC", "RMQ_SYS_TRANS_OP_HALF_TOPIC", "TRANS_CHECK_MAX_TIME_TOPIC",
    "SELF_TEST_TOPIC", "OFFSET_MOVED_EVENT", "CHECKPOINT_TOPIC",
})


def _internal_topic(name: str) -> bool:
    """A system topic, or a group's retry / dead-letter topic (``%RETRY%``, ``%DLQ%``, any
    ``%``-prefixed one: copies of messages, or none of the application's)."""
    return name in SYSTEM_TOPICS or name.startswith(("rmq_sys_", "%"))


async def source_topics(client: ClientInstance, opts: SourceOptions) -> list[str]:
    """``topics``, or the topics matching ``topicPattern`` right now.

    When no name server answers the topic list, the matching topics ``client`` already has
    routes for stand in (see :func:`list_queues`, which then plans from those routes); with
    none, the error surfaces.
    """
    if opts.topic_pattern is None:
        return list(opts.topics)
    try:
        return await matching_topics(client, opts.topic_pattern)
    except (MQClientError, RemotingError) as exc:
        regex = re.compile(opts.topic_pattern)
        known = sorted(t for t in client.routes if regex.fullmatch(t))
        if not known:
            raise
        log.warning("spark_source.topic_list_failed", pattern=opts.topic_pattern, topics=known,
                    error=f"{type(exc).__name__}: {exc}")
        return known


async def list_queues(client: ClientInstance, topics: Iterable[str]) -> list[MessageQueue]:
    """Every readable queue of ``topics`` from the name server, sorted.

    A topic whose route cannot be fetched now but that ``client`` fetched before is planned
    from the route it holds, with a warning, as Java's client does when a periodic route
    refresh fails: a name server that just restarted answers TOPIC_NOT_EXIST until the
    brokers register again, one that is down refuses, and neither should end a stream (whose
    driver keeps one client). Without a known route (a new topic, a batch read's fresh client)
    the error surfaces: TOPIC_NOT_EXIST as :class:`SourceError`.
    """
    out: list[MessageQueue] = []
    for topic in topics:
        try:
            await client.update_route(topic)
        except (MQClientError, RemotingError) as exc:
            if topic not in client.routes:  # update_route keeps the old route on failure
                if isinstance(exc, NoRouteError):
                    raise SourceError(f"topic {topic!r} has no route on the name server: {exc}")
                raise
            log.warning("spark_source.route_refresh_failed", topic=topic,
                        error=f"{type(exc).__name__}: {exc}")
        out.extend(await client.subscribe_queues(topic))
    return sorted(out)


async def queue_bounds(client: ClientInstance,
                       mqs: Iterable[MessageQueue]) -> dict[MessageQueue, tuple[int, int]]:
    """``(min offset, max offset)`` of each queue, max exclusive, asked of each queue's master."""
    async def one(mq: MessageQueue) -> tuple[int, int]:
        addr = await client.find_broker_master(mq.broker_name, mq.topic)
        low, high = await asyncio.gather(client.api.get_min_offset(addr, mq),
                                         client.api.get_max_offset(addr, mq))
        return low, high

    queues = list(mqs)
    bounds = await asyncio.gather(*(one(mq) for mq in queues))
    return dict(zip(queues, bounds, strict=True))


async def first_stored_since(client: ClientInstance, mq: MessageQueue, timestamp_ms: int,
                             low: int, high: int, *, group: str = DEFAULT_GROUP,
                             timeout: float = 10.0) -> int:
    """The offset of the first message of ``mq`` stored at or after ``timestamp_ms``.

    ``high`` (the queue's max offset) when every message in ``[low, high)`` was stored before
    it. The broker's SEARCH_OFFSET_BY_TIMESTAMP answer is the starting point. A 5.x broker
    answers exactly that; a 4.x broker answers the stored message *nearest* to the time,
    which can be the one before it, any one of several stored in the same millisecond (a
    batch shares its store time), or the last message when the time is after all of them.
    So the answer is checked against the store times of the messages around it (one pull of
    two messages when it is right) and moved to the first one at or after the time by a
    galloping search of single-message pulls. Store times only grow along a queue.
    """
    if low >= high:
        return high  # nothing stored
    addr = await client.find_broker_master(mq.broker_name, mq.topic)
    api = client.api
    sub = build_subscription(mq.topic, "*", sub_version=0)

    async def stamps(at: int, n: int) -> dict[int, int]:
        result = await api.pull_message(addr, group=group, mq=mq, queue_offset=at,
                                        max_msg_nums=n, suspend_timeout=0.0, timeout=timeout,
                                        subscription=sub)
        if result.status is not PullStatus.FOUND:
            return {}
        return {m.queue_offset: m.store_timestamp for m in result.decode()}

    async def since(at: int) -> bool | None:
        """Is the message at ``at`` (below ``high``) stored at or after the time (None: the
        broker has none)?"""
        got = await stamps(at, 1)
        if not got:
            return None
        return got[min(got)] >= timestamp_ms

    async def first_since(before: int, since_at: int) -> int:
        """The first offset in ``(before, since_at]`` stored at or after the time, given
        ``before`` is not and ``since_at`` is (or is ``high``; ``since`` is asked only about
        offsets between the two)."""
        while since_at - before > 1:
            mid = (before + since_at) // 2
            if await since(mid):
                since_at = mid
            else:
                before = mid
        return since_at

    found = min(max(await api.search_offset(addr, mq, timestamp_ms), low), high)
    around = await stamps(found - 1, 2) if found > low else await stamps(found, 1)
    if found < high and found not in around:
        # A pull is capped by bytes too (a 4.x broker reading from disk: 64 KiB): with large
        # messages the answer brings only the message before ``found``.
        around.update(await stamps(found, 1))
    if found < high and found in around and around[found] < timestamp_ms:
        # Stored before the time: the first one at or after it lies above.
        step, before = 1, found
        while True:
            probe = min(before + step, high)
            if probe == high or await since(probe):
                return await first_since(before, probe)
            before, step = probe, step * 2
    if found > low and around.get(found - 1, -1) >= timestamp_ms:
        # The message before it was stored at or after the time too: the first lies below.
        step, since_at = 1, found - 1
        while since_at > low:
            probe = max(since_at - step, low)
            if await since(probe) is False:
                return await first_since(probe, since_at)
            since_at, step = probe, step * 2
        return low
    return found


async def resolve_offsets(client: ClientInstance, position: Position,
                          bounds: Mapping[MessageQueue, tuple[int, int]], *,
                          default: int, group: str = DEFAULT_GROUP,
                          timeout: float = 10.0) -> dict[MessageQueue, int]:
    """One offset per queue of ``bounds`` for ``position``.

    ``default`` (:data:`EARLIEST` or :data:`LATEST`) is used for queues a JSON position leaves
    out. An offset beyond the queue's max is lowered to the max; an offset below its min is
    kept (the read reports the loss). A timestamp resolves to the first message stored at or
    after it (:func:`first_stored_since`, with pulls as ``group``).
    """
    out: dict[MessageQueue, int] = {}
    if position.kind == "timestamp":
        assert position.timestamp_ms is not None
        stamp = position.timestamp_ms
        found = await asyncio.gather(*(
            first_stored_since(client, mq, stamp, low, high, group=group, timeout=timeout)
            for mq, (low, high) in bounds.items()))
        out = dict(zip(bounds, found, strict=True))
    else:
        for mq, (low, high) in bounds.items():
            if position.kind == "earliest":
                wanted = EARLIEST
            elif position.kind == "latest":
                wanted = LATEST
            else:
                wanted = position.offsets.get(mq, default)
            out[mq] = low if wanted == EARLIEST else high if wanted == LATEST else min(wanted, high)
    if position.kind == "offsets":
        unknown = sorted(set(position.offsets) - set(bounds))
        if unknown:
            raise SourceError("offsets given for queues the route does not have: "
                              + ", ".join(f"{mq.topic} {queue_key(mq)}" for mq in unknown))
    return out


def limit_offsets(start: Mapping[MessageQueue, int], latest: Mapping[MessageQueue, int],
                  max_messages: int) -> dict[MessageQueue, int]:
    """End offsets about ``max_messages`` past ``start`` in total (exactly, while that is at
    least the number of queues with a backlog; see below).

    Each queue gets a share proportional to its backlog (the rounding remainder goes to the
    queues with the largest fractions, then the lowest queue), and the sum is exactly
    ``max_messages`` when the backlog is larger. No queue starves: each queue with a backlog
    gets at least one offset (as the Kafka source rounds a share below one up), taken from the
    largest grants while ``max_messages`` is at least the number of such queues, and beyond
    ``max_messages`` when it is smaller (the largest queue would otherwise take the whole
    limit every trigger, for as long as it grows).
    """
    backlog = {mq: max(0, latest[mq] - start.get(mq, latest[mq])) for mq in latest}
    total = sum(backlog.values())
    if total <= max_messages:
        return dict(latest)
    grant: dict[MessageQueue, int] = {}
    fractions: list[tuple[int, MessageQueue]] = []  # remainders, all over ``total``
    for mq, todo in backlog.items():
        # In integers: a float share could round past a whole number with large backlogs.
        grant[mq], rest = divmod(max_messages * todo, total)
        fractions.append((rest, mq))
    left = max_messages - sum(grant.values())
    for _, mq in sorted(fractions, key=lambda f: (-f[0], f[1].java_sort_key())):
        if left <= 0:
            break
        if grant[mq] < backlog[mq]:
            grant[mq] += 1
            left -= 1
    starving = sorted((mq for mq, todo in backlog.items() if todo and not grant[mq]),
                      key=lambda q: q.java_sort_key())
    if starving and sum(1 for todo in backlog.values() if todo) <= max_messages:
        for mq in starving:
            richest = max(grant, key=lambda q: (grant[q], q.java_sort_key()))
            grant[richest] -= 1
            grant[mq] = 1
    else:
        for mq in starving:
            grant[mq] = 1
    return {mq: (start[mq] + grant[mq] if mq in start else latest[mq]) for mq in latest}


async def announce_group(opts: SourceOptions, group: str, addrs: Iterable[str],
                         topics: Iterable[str]) -> set[str]:
    """Make ``group`` known to the brokers as a pull-style group, as a lite pull consumer would.

    One heartbeat per broker from a client of its own, which then disconnects (so the brokers
    drop it from the group's members again). The broker creates the group's retry topic on the
    heartbeat; ``mqadmin consumerProgress`` needs it to report the group's offsets. Returns
    the addresses that answered; a broker that did not is logged
    (``spark_source.announce_group_failed``) and left to the caller to try again, so one
    broker down does not keep the group from the others.
    """
    client = open_client(opts, "group")
    data = HeartbeatData(client_id=client.client_id, consumer_data_set=[ConsumerData(
        group_name=group, consume_type="CONSUME_ACTIVELY", message_model="CLUSTERING",
        consume_from_where="CONSUME_FROM_LAST_OFFSET",
        subscription_data_set=[opts.subscription(t) for t in sorted(topics)])])
    targets = sorted(set(addrs))
    try:
        results = await asyncio.gather(*(client.api.heartbeat(addr, data) for addr in targets),
                                       return_exceptions=True)
    finally:
        await client.close()
    answered: set[str] = set()
    for addr, res in zip(targets, results, strict=True):
        if isinstance(res, Exception):
            log.warning("spark_source.announce_group_failed", group=group, broker=addr,
                        error=f"{type(res).__name__}: {res}")
        elif isinstance(res, BaseException):
            raise res  # a cancellation is not a broker's answer
        else:
            answered.add(addr)
    return answered


# ---------------------------------------------------------------------- reading a range


#: OFFSET_ILLEGAL answers in a row that a range reader takes for an offset reset handed out
#: by the broker (the queue has the offset), or NO_MATCHED_MSG answers that do not move on
#: for an offset the queue has, before it treats the offset as gone.
MOVED_RETRIES = 3
#: The pauses before pulling again after the broker answered a pull SYSTEM_BUSY or
#: FLOW_CONTROL (its pull flow control), about 5 s in all; then the read fails.
BUSY_PAUSES = (0.1, 0.2, 0.4, 0.8, 1.0, 1.0, 1.0, 1.0)


def report_data_loss(opts: SourceOptions, mq: MessageQueue, start: int, end: int,
                     detail: str) -> None:
    """Report offsets ``[start, end)`` of ``mq`` that the broker no longer has."""
    if opts.fail_on_data_loss:
        raise DataLossError(
            f"offsets {start}..{end - 1} of {mq.topic} {queue_key(mq)} are gone ({detail}); "
            "set failOnDataLoss=false to skip them")
    log.warning("spark_source.data_loss", topic=mq.topic, broker=mq.broker_name,
                queue_id=mq.queue_id, first=start, last=end - 1, detail=detail)


async def read_range(client: ClientInstance, opts: SourceOptions, mq: MessageQueue, start: int,
                     end: int, *, chunk_rows: int | None = None,
                     fresh_queue: bool = False) -> AsyncGenerator[list[MessageExt], None]:
    """The messages of ``mq`` at offsets ``[start, end)``, in chunks of about ``chunk_rows``.

    Each message has ``broker_name`` set, and the ``MIN_OFFSET`` / ``MAX_OFFSET`` properties of
    the pull that brought it, as a consumer delivers it. Offsets the broker no longer has
    (below its min offset, or a hole) raise :class:`DataLossError`, or with
    ``failOnDataLoss=false`` are logged (``spark_source.data_loss``) and skipped; so is a queue
    whose max fell below ``end``.
    ``fresh_queue``: the queue appeared after the query started and is read from its first
    offset, so offsets below its min are not a loss.

    Without a filter, offsets map one to one to messages, so ``pullDepth`` pulls of consecutive
    slices are kept in flight; a slice the broker answers only in part (its per-pull byte cap)
    is completed by a pull for the rest, ahead of the others. With a filter the broker decides
    where each pull ends, and pulls go one at a time. A pull the broker answers SYSTEM_BUSY
    or FLOW_CONTROL (its pull flow control) is made again after a pause, a few times
    (:data:`BUSY_PAUSES`) before the read fails.
    """
    rows_per_chunk = chunk_rows or opts.chunk_rows
    sub = opts.subscription(mq.topic)
    filtered = opts.filtered
    depth = 1 if filtered else opts.pull_depth
    addr = await client.find_broker_master(mq.broker_name, mq.topic)
    api = client.api
    inflight: deque[tuple[int, int, PendingPull]] = deque()

    async def send(at: int, want: int) -> tuple[int, int, PendingPull]:
        pending = await api.start_pull(
            addr, group=opts.group, mq=mq, queue_offset=at, max_msg_nums=want,
            suspend_timeout=0.0, timeout=opts.api_timeout, subscription=sub)
        return at, want, pending

    def drop_inflight() -> None:
        while inflight:
            inflight.popleft()[2].cancel()

    offset = start
    planned = start  # every offset below this one has a pull in flight (or is done)
    chunk: list[MessageExt] = []
    moved = 0  # OFFSET_ILLEGAL answers in a row for an offset the queue has (see below)
    busy = 0  # SYSTEM_BUSY / FLOW_CONTROL answers in a row
    try:
        while offset < end:
            if len(chunk) >= rows_per_chunk and not inflight:
                # Handed on with no pull in flight: the caller may hold the chunk for long
                # without running the event loop (Spark converting and shipping it), and an
                # answer left unread meanwhile would count as timed out.
                yield chunk
                chunk = []
            while len(inflight) < depth and planned < end and len(chunk) < rows_per_chunk:
                want = min(opts.pull_batch_size, end - planned)
                inflight.append(await send(planned, want))
                planned += want
            at, want, pending = inflight.popleft()
            try:
                result = await pending.result()
            except MQBrokerError as exc:
                if exc.code not in (ResponseCode.SYSTEM_BUSY, ResponseCode.FLOW_CONTROL) \
                        or busy >= len(BUSY_PAUSES):
                    raise
                # The broker sheds load: pull this offset again after a pause, as a
                # consumer does, rather than fail the Spark task (which reads it all again).
                log.info("spark_source.broker_busy", topic=mq.topic, queue=queue_key(mq),
                         offset=offset, code=exc.code, remark=exc.remark)
                drop_inflight()
                planned = offset
                await asyncio.sleep(BUSY_PAUSES[busy])
                busy += 1
                continue
            busy = 0
            status = result.status
            nxt = result.next_begin_offset
            if status is PullStatus.FOUND:
                msgs = result.decode()
                expect = offset
                kept: list[MessageExt] = []
                for m in msgs:
                    off = m.queue_offset
                    if off >= end:
                        break
                    if off < expect:
                        continue
                    if off > expect and not filtered:
                        report_data_loss(opts, mq, expect, off, "hole in the queue")
                    expect = off + 1
                    if filtered and not tag_matches(sub, m.tags):
                        continue
                    kept.append(m)
                if kept:
                    # As a consumer delivers them (Java's processPullResult), so that a row
                    # read here is the row a sink lands: the queue's broker name and the
                    # pull's MIN_OFFSET / MAX_OFFSET properties.
                    stamp_delivered(kept, mq.broker_name, {
                        PROPERTY_MIN_OFFSET: str(result.min_offset),
                        PROPERTY_MAX_OFFSET: str(result.max_offset)})
                    chunk.extend(kept)
                top = msgs[-1].queue_offset + 1 if msgs else offset
                if not filtered and top < nxt and top < end:
                    # Without a filter the broker skips entries only when their messages are
                    # gone from the commit log (MESSAGE_WAS_REMOVING).
                    report_data_loss(opts, mq, top, min(nxt, end), "removed from the commit log")
                moved = 0
                offset = max(nxt, top, offset + (1 if not msgs else 0))
                if offset < at + want:
                    # Answered in part: fetch the rest of this slice before the next ones.
                    inflight.appendleft(await send(offset, at + want - offset))
                elif offset > at + want:
                    drop_inflight()
                    planned = offset
                continue
            # Anything but FOUND: settle this offset alone, then plan again from where it ends.
            drop_inflight()
            stuck = status is PullStatus.NO_MATCHED_MSG and nxt <= offset
            if ((status is PullStatus.OFFSET_ILLEGAL or stuck) and moved < MOVED_RETRIES
                    and result.min_offset <= offset < result.max_offset):
                # The queue has this offset, so this read's range stands: pull it again.
                # OFFSET_ILLEGAL: the broker handing out an admin offset reset of the pull
                # group (PULL_OFFSET_MOVED, useServerSideResetOffset), which it does once.
                # NO_MATCHED_MSG that does not move on (PULL_RETRY_IMMEDIATELY): it could not
                # read the offset this time (a store read error; a static topic's switch to
                # its next item); retried, as the name says, after a moment.
                moved += 1
                planned = offset
                if stuck:
                    await asyncio.sleep(0.05 * moved)
                continue
            moved = 0
            if status is PullStatus.NO_MATCHED_MSG and nxt > offset:
                if not filtered:
                    report_data_loss(opts, mq, offset, min(nxt, end), "removed from the commit log")
                offset = nxt
            elif status is PullStatus.OFFSET_ILLEGAL and nxt > offset:
                if not fresh_queue or offset != start:
                    report_data_loss(opts, mq, offset, min(nxt, end),
                          f"below the queue's min offset {result.min_offset}")
                offset = nxt
            elif status is PullStatus.NO_NEW_MSG and nxt > offset:
                report_data_loss(opts, mq, offset, min(nxt, end), "no message at this offset")
                offset = nxt
            elif result.min_offset <= offset < result.max_offset:
                # The broker holds this offset and kept refusing it (the retries above): not
                # data loss, and not to be skipped (failOnDataLoss=false would drop what the
                # queue still has): the read fails, for Spark to try the task again.
                raise MQClientError(
                    f"{mq}: the broker answered {status.value} for offset {offset} "
                    f"{MOVED_RETRIES + 1} times, though the queue holds "
                    f"{result.min_offset}..{result.max_offset - 1}; the read is given up "
                    "rather than skip messages the broker has")
            else:
                # The queue ends before the planned range does (max offset went down).
                report_data_loss(opts, mq, offset, end,
                      f"{status.value}: the queue's max offset is {result.max_offset}")
                break
            planned = offset
    finally:
        drop_inflight()
    if chunk:
        yield chunk


async def read_range_all(opts: SourceOptions, mq: MessageQueue, start: int, end: int) -> list[MessageExt]:
    """Every message of one range with a client of its own (for tests and small reads)."""
    client = open_client(opts, "range")
    t0 = time.monotonic()
    try:
        out: list[MessageExt] = []
        async for chunk in read_range(client, opts, mq, start, end):
            out.extend(chunk)
    finally:
        await client.close()
    log.debug("spark_source.range_read", topic=mq.topic, queue=queue_key(mq), rows=len(out),
              seconds=round(time.monotonic() - t0, 3))
    return out

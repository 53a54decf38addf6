"""Typed request and response headers (the ``extFields`` of a command).

Every header is a keyword-only dataclass whose fields carry their Java name and wire type in
the field metadata (see :func:`hfield`); one shared implementation turns them into
``extFields`` and back:

* :meth:`CommandHeader.to_ext_fields` writes each non-``None`` field under its Java name as Java's
  ``toString`` would: decimal integers, ``"true"``/``"false"``, strings as they are.
* :meth:`CommandHeader.from_ext_fields` parses them back. A missing required field, an integer
  that is not a decimal number or does not fit its Java type raises :class:`ProtocolError`.
  Booleans follow ``Boolean.parseBoolean`` (only a case-insensitive ``"true"`` is true). Unknown
  keys are ignored.

Request headers that extend Java's ``RpcRequestHeader`` carry the optional ``bname`` (the broker
name of the target queue), which a 5.x proxy needs. ``SendMessageRequestHeaderV2`` carries it
under the short name ``n``.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import MISSING, dataclass, field, fields
from enum import Enum
from typing import Any, ClassVar, Self

from .codes import INT32_MAX, INT32_MIN
from .command import ExtFields
from .errors import ProtocolError

__all__ = [
    "CommandHeader",
    "ConsumeMessageDirectlyResultRequestHeader",
    "ConsumerSendMsgBackRequestHeader",
    "CreateTopicRequestHeader",
    "FieldKind",
    "GetConsumerListByGroupRequestHeader",
    "GetConsumerRunningInfoRequestHeader",
    "GetConsumerStatusRequestHeader",
    "GetEarliestMsgStoretimeRequestHeader",
    "GetEarliestMsgStoretimeResponseHeader",
    "GetMaxOffsetRequestHeader",
    "GetMaxOffsetResponseHeader",
    "GetMinOffsetRequestHeader",
    "GetMinOffsetResponseHeader",
    "GetRouteInfoRequestHeader",
    "HeaderField",
    "HeartbeatRequestHeader",
    "LockBatchMqRequestHeader",
    "NotifyConsumerIdsChangedRequestHeader",
    "PullMessageRequestHeader",
    "PullMessageResponseHeader",
    "QueryConsumerOffsetRequestHeader",
    "QueryConsumerOffsetResponseHeader",
    "RequestHeader",
    "ResetOffsetRequestHeader",
    "SearchOffsetRequestHeader",
    "SearchOffsetResponseHeader",
    "SendMessageRequestHeaderV2",
    "SendMessageResponseHeader",
    "UnlockBatchMqRequestHeader",
    "UnregisterClientRequestHeader",
    "UpdateConsumerOffsetRequestHeader",
    "hfield",
]


class FieldKind(Enum):
    """Java type of a header field."""

    STR = "String"
    INT32 = "Integer"
    INT64 = "Long"
    BOOL = "Boolean"


_INT_RANGE = {
    FieldKind.INT32: (INT32_MIN, INT32_MAX),
    FieldKind.INT64: (-(2**63), 2**63 - 1),
}
_JAVA_INT = re.compile(r"[+-]?[0-9]+\Z")


@dataclass(frozen=True, slots=True)
class HeaderField:
    """One row of a header's field table."""

    py_name: str
    java_name: str
    kind: FieldKind
    required: bool
    default: Any


def hfield(java: str, kind: FieldKind, *, required: bool = False, default: Any = MISSING) -> Any:
    """Declare a header field: its Java name, Java type and whether Java marks it required.

    A required field without ``default`` must be given to the constructor; an optional field
    defaults to ``None`` (not sent) unless ``default`` says otherwise (Java primitives, which
    are always sent).
    """
    metadata = {"java": java, "kind": kind, "required": required}
    if default is MISSING and not required:
        default = None
    if default is MISSING:
        return field(metadata=metadata)
    return field(default=default, metadata=metadata)


_TABLES: dict[type, tuple[HeaderField, ...]] = {}
_PUT_ORDERS: dict[type, tuple[HeaderField, ...]] = {}
_LAYOUTS: dict[type, tuple[tuple[str, ...], tuple[str, ...] | None]] = {}
# For from_ext_fields: (java name, python name, _PLAIN_DIGITS of the kind or 0, row) per field.
_READ_PLANS: dict[type, tuple[tuple[str, str, int, HeaderField], ...]] = {}


def _format(kind: FieldKind, value: Any) -> str:
    if kind is FieldKind.BOOL:
        return "true" if value else "false"
    if kind is FieldKind.STR:
        return str(value)
    return str(int(value))


# Fewer decimal digits than this always fit the type (int32: 9 digits, int64: 18).
_PLAIN_DIGITS = {FieldKind.INT32: 10, FieldKind.INT64: 19}


def _parse(row: HeaderField, raw: str) -> Any:
    kind = row.kind
    if kind is FieldKind.STR:
        return raw
    if kind is FieldKind.BOOL:
        return raw.lower() == "true"
    if raw.isascii() and raw.isdigit() and len(raw) < _PLAIN_DIGITS[kind]:
        return int(raw)  # the common case: plain decimal digits that cannot overflow the type
    if not _JAVA_INT.match(raw):
        raise ProtocolError(f"header field {row.java_name!r}: {raw[:40]!r} is not an integer")
    # Leading zeros are allowed (as by Long.parseLong); what remains must fit int() and the type.
    digits = raw.lstrip("+-").lstrip("0")
    if len(digits) > 19:
        raise ProtocolError(f"header field {row.java_name!r}: {raw[:40]!r}... out of {kind.value} range")
    value = -int(digits or "0") if raw[0] == "-" else int(digits or "0")
    lo, hi = _INT_RANGE[kind]
    if not lo <= value <= hi:
        raise ProtocolError(f"header field {row.java_name!r}: {value} out of {kind.value} range")
    return value


@dataclass(slots=True, kw_only=True)
class CommandHeader:
    """Base of all headers: conversion to and from ``extFields``.

    ``JAVA_PUT_ORDER`` lists the Java field names in the order Java 5.3.3 puts them into the
    ``extFields`` HashMap (the iteration order of the ``HashSet<Field>`` it collects by
    reflection). HashMap iteration follows the key hashes, so this order only decides between
    keys that land in the same bucket; :meth:`to_ext_fields` inserts in this order so that the
    encoded header is byte-identical to Java's.
    """

    JAVA_PUT_ORDER: ClassVar[str] = ""
    #: For Java ``FastCodesHeader`` classes: the field order of their ``encode(ByteBuf)``,
    #: which the Netty encoder uses for the ROCKETMQ binary header instead of HashMap order.
    JAVA_FAST_CODES: ClassVar[str] = ""

    @classmethod
    def field_table(cls) -> tuple[HeaderField, ...]:
        """``(py_name, java_name, kind, required, default)`` for every field, in order."""
        table = _TABLES.get(cls)
        if table is None:
            rows = []
            for f in fields(cls):
                md = f.metadata
                default = None if f.default is MISSING else f.default
                rows.append(HeaderField(f.name, md["java"], md["kind"], md["required"], default))
            table = tuple(rows)
            _TABLES[cls] = table
        return table

    @classmethod
    def _put_order(cls) -> tuple[HeaderField, ...]:
        rows = _PUT_ORDERS.get(cls)
        if rows is None:
            java_order = [n for n in cls.JAVA_PUT_ORDER.split(",") if n]
            rank = {name: i for i, name in enumerate(java_order)}
            table = cls.field_table()
            rows = tuple(
                sorted(table, key=lambda r: (rank.get(r.java_name, len(rank)), table.index(r)))
            )
            _PUT_ORDERS[cls] = rows
        return rows

    @classmethod
    def _ext_layout(cls) -> tuple[tuple[str, ...], tuple[str, ...] | None]:
        layout = _LAYOUTS.get(cls)
        if layout is None:
            own = tuple(n for n in cls.JAVA_PUT_ORDER.split(",") if n)
            fast = tuple(n for n in cls.JAVA_FAST_CODES.split(",") if n) or None
            layout = (own, fast)
            _LAYOUTS[cls] = layout
        return layout

    def to_ext_fields(self) -> ExtFields:
        """The header as ``extFields``: Java names, Java ``toString`` values, ``None`` skipped.

        The result is an :class:`~rmq_async.protocol.command.ExtFields`: fields named in
        ``JAVA_PUT_ORDER`` are the Java header's own; any other (a Java ``addExtField`` beside
        the header, such as the send response's ``MSG_REGION``) or any key the caller adds
        later counts as added, which is how Java orders them on the wire.
        """
        own, fast = self._ext_layout()
        out = ExtFields(header_keys=own, fast_codes=fast)
        for row in self._put_order():
            value = getattr(self, row.py_name)
            if value is not None:
                out[row.java_name] = _format(row.kind, value)
        return out

    @classmethod
    def from_ext_fields(cls, ext_fields: Mapping[str, str] | None) -> Self:
        """Parse received ``extFields``; :class:`ProtocolError` if a required one is missing."""
        get = (ext_fields if ext_fields is not None else {}).get
        kwargs: dict[str, Any] = {}
        plan = _READ_PLANS.get(cls)
        if plan is None:
            plan = _READ_PLANS[cls] = tuple(
                (row.java_name, row.py_name, _PLAIN_DIGITS.get(row.kind, 0), row)
                for row in cls.field_table()
            )
        for java_name, py_name, plain_digits, row in plan:
            raw = get(java_name)
            if raw is None:
                if row.required:
                    raise ProtocolError(f"{cls.__name__}: required field {java_name!r} is missing")
                kwargs[py_name] = row.default
            elif row.kind is FieldKind.STR:
                kwargs[py_name] = raw
            elif len(raw) < plain_digits and raw.isdigit() and raw.isascii():
                kwargs[py_name] = int(raw)  # the common case, as in _parse
            else:
                kwargs[py_name] = _parse(row, raw)
        return cls(**kwargs)


S, I32, I64, B = FieldKind.STR, FieldKind.INT32, FieldKind.INT64, FieldKind.BOOL


@dataclass(slots=True, kw_only=True)
class RequestHeader(CommandHeader):
    """A request header extending Java's ``RpcRequestHeader``: optional ``bname``."""

    bname: str | None = hfield("bname", S)


# --- name server -----------------------------------------------------------------------------


@dataclass(slots=True, kw_only=True)
class GetRouteInfoRequestHeader(RequestHeader):
    """GET_ROUTEINFO_BY_TOPIC (105)."""

    JAVA_PUT_ORDER: ClassVar[str] = "topic,ns,bname,oway,acceptStandardJsonOnly,lo,nsd"

    topic: str = hfield("topic", S, required=True)
    accept_standard_json_only: bool | None = hfield("acceptStandardJsonOnly", B)


# --- membership ------------------------------------------------------------------------------


@dataclass(slots=True, kw_only=True)
class HeartbeatRequestHeader(RequestHeader):
    """HEART_BEAT (34): no fields of its own (5.x sends ``"extFields":{}``)."""

    JAVA_PUT_ORDER: ClassVar[str] = "ns,bname,oway,nsd"


@dataclass(slots=True, kw_only=True)
class UnregisterClientRequestHeader(RequestHeader):
    """UNREGISTER_CLIENT (35)."""

    JAVA_PUT_ORDER: ClassVar[str] = "ns,bname,oway,producerGroup,clientID,consumerGroup,nsd"

    client_id: str = hfield("clientID", S, required=True)
    producer_group: str | None = hfield("producerGroup", S)
    consumer_group: str | None = hfield("consumerGroup", S)


@dataclass(slots=True, kw_only=True)
class GetConsumerListByGroupRequestHeader(RequestHeader):
    """GET_CONSUMER_LIST_BY_GROUP (38)."""

    JAVA_PUT_ORDER: ClassVar[str] = "consumerGroup,ns,bname,oway,nsd"

    consumer_group: str = hfield("consumerGroup", S, required=True)


# --- offsets ---------------------------------------------------------------------------------


@dataclass(slots=True, kw_only=True)
class QueryConsumerOffsetRequestHeader(RequestHeader):
    """QUERY_CONSUMER_OFFSET (14)."""

    JAVA_PUT_ORDER: ClassVar[str] = (
        "topic,setZeroIfNotFound,ns,bname,oway,consumerGroup,queueId,lo,nsd"
    )

    consumer_group: str = hfield("consumerGroup", S, required=True)
    topic: str = hfield("topic", S, required=True)
    queue_id: int = hfield("queueId", I32, required=True)
    set_zero_if_not_found: bool | None = hfield("setZeroIfNotFound", B)


@dataclass(slots=True, kw_only=True)
class QueryConsumerOffsetResponseHeader(CommandHeader):
    JAVA_PUT_ORDER: ClassVar[str] = "offset"

    offset: int = hfield("offset", I64, required=True)


@dataclass(slots=True, kw_only=True)
class UpdateConsumerOffsetRequestHeader(RequestHeader):
    """UPDATE_CONSUMER_OFFSET (15)."""

    JAVA_PUT_ORDER: ClassVar[str] = "queueId,ns,bname,oway,commitOffset,topic,consumerGroup,lo,nsd"

    consumer_group: str = hfield("consumerGroup", S, required=True)
    topic: str = hfield("topic", S, required=True)
    queue_id: int = hfield("queueId", I32, required=True)
    commit_offset: int = hfield("commitOffset", I64, required=True)


@dataclass(slots=True, kw_only=True)
class GetMaxOffsetRequestHeader(RequestHeader):
    """GET_MAX_OFFSET (30). ``committed`` is a Java primitive (5.x), always sent."""

    JAVA_PUT_ORDER: ClassVar[str] = "committed,queueId,ns,bname,oway,topic,lo,nsd"

    topic: str = hfield("topic", S, required=True)
    queue_id: int = hfield("queueId", I32, required=True)
    committed: bool = hfield("committed", B, default=True)


@dataclass(slots=True, kw_only=True)
class GetMaxOffsetResponseHeader(CommandHeader):
    JAVA_PUT_ORDER: ClassVar[str] = "offset"

    offset: int = hfield("offset", I64, required=True)


@dataclass(slots=True, kw_only=True)
class GetMinOffsetRequestHeader(RequestHeader):
    """GET_MIN_OFFSET (31)."""

    JAVA_PUT_ORDER: ClassVar[str] = "topic,ns,bname,oway,queueId,lo,nsd"

    topic: str = hfield("topic", S, required=True)
    queue_id: int = hfield("queueId", I32, required=True)


@dataclass(slots=True, kw_only=True)
class GetMinOffsetResponseHeader(CommandHeader):
    JAVA_PUT_ORDER: ClassVar[str] = "offset"

    offset: int = hfield("offset", I64, required=True)


@dataclass(slots=True, kw_only=True)
class SearchOffsetRequestHeader(RequestHeader):
    """SEARCH_OFFSET_BY_TIMESTAMP (29). ``boundary_type``: ``"LOWER"`` or ``"UPPER"`` (5.x)."""

    JAVA_PUT_ORDER: ClassVar[str] = "timestamp,boundaryType,ns,bname,oway,topic,lo,queueId,nsd"

    topic: str = hfield("topic", S, required=True)
    queue_id: int = hfield("queueId", I32, required=True)
    timestamp: int = hfield("timestamp", I64, required=True)
    boundary_type: str | None = hfield("boundaryType", S)


@dataclass(slots=True, kw_only=True)
class SearchOffsetResponseHeader(CommandHeader):
    JAVA_PUT_ORDER: ClassVar[str] = "offset"

    offset: int = hfield("offset", I64, required=True)


@dataclass(slots=True, kw_only=True)
class GetEarliestMsgStoretimeRequestHeader(RequestHeader):
    """GET_EARLIEST_MSG_STORETIME (32)."""

    JAVA_PUT_ORDER: ClassVar[str] = "queueId,ns,bname,oway,topic,lo,nsd"

    topic: str = hfield("topic", S, required=True)
    queue_id: int = hfield("queueId", I32, required=True)


@dataclass(slots=True, kw_only=True)
class GetEarliestMsgStoretimeResponseHeader(CommandHeader):
    JAVA_PUT_ORDER: ClassVar[str] = "timestamp"

    timestamp: int = hfield("timestamp", I64, required=True)


# --- pull --------------------------------------------------------------------------------------


@dataclass(slots=True, kw_only=True)
class PullMessageRequestHeader(RequestHeader):
    """PULL_MESSAGE (11) / LITE_PULL_MESSAGE (361)."""

    JAVA_PUT_ORDER: ClassVar[str] = (
        "maxMsgBytes,queueId,ns,commitOffset,maxMsgNums,sysFlag,subscription,"
        "requestSource,proxyFrowardClientId,lo,bname,oway,suspendTimeoutMillis,"
        "queueOffset,expressionType,topic,consumerGroup,subVersion,nsd"
    )
    JAVA_FAST_CODES: ClassVar[str] = (
        "consumerGroup,topic,queueId,queueOffset,maxMsgNums,sysFlag,commitOffset,"
        "suspendTimeoutMillis,subscription,subVersion,expressionType,maxMsgBytes,requestSource,"
        "proxyFrowardClientId,lo,ns,nsd,bname,oway"
    )

    consumer_group: str = hfield("consumerGroup", S, required=True)
    topic: str = hfield("topic", S, required=True)
    queue_id: int = hfield("queueId", I32, required=True)
    queue_offset: int = hfield("queueOffset", I64, required=True)
    max_msg_nums: int = hfield("maxMsgNums", I32, required=True)
    sys_flag: int = hfield("sysFlag", I32, required=True)
    commit_offset: int = hfield("commitOffset", I64, required=True)
    suspend_timeout_millis: int = hfield("suspendTimeoutMillis", I64, required=True)
    subscription: str | None = hfield("subscription", S)
    sub_version: int = hfield("subVersion", I64, required=True)
    expression_type: str | None = hfield("expressionType", S)
    max_msg_bytes: int | None = hfield("maxMsgBytes", I32)
    request_source: int | None = hfield("requestSource", I32)
    proxy_forward_client_id: str | None = hfield("proxyFrowardClientId", S)


@dataclass(slots=True, kw_only=True)
class PullMessageResponseHeader(CommandHeader):
    """Response of PULL_MESSAGE. ``offset_delta`` and the flags are 5.x only."""

    JAVA_PUT_ORDER: ClassVar[str] = (
        "maxOffset,offsetDelta,topicSysFlag,minOffset,groupSysFlag,suggestWhichBrokerId,"
        "nextBeginOffset,forbiddenType"
    )
    JAVA_FAST_CODES: ClassVar[str] = (
        "suggestWhichBrokerId,nextBeginOffset,minOffset,maxOffset,offsetDelta,topicSysFlag,"
        "groupSysFlag,forbiddenType"
    )

    suggest_which_broker_id: int = hfield("suggestWhichBrokerId", I64, required=True)
    next_begin_offset: int = hfield("nextBeginOffset", I64, required=True)
    min_offset: int = hfield("minOffset", I64, required=True)
    max_offset: int = hfield("maxOffset", I64, required=True)
    offset_delta: int | None = hfield("offsetDelta", I64)
    topic_sys_flag: int | None = hfield("topicSysFlag", I32)
    group_sys_flag: int | None = hfield("groupSysFlag", I32)
    forbidden_type: int | None = hfield("forbiddenType", I32)


# --- failures and order --------------------------------------------------------------------


@dataclass(slots=True, kw_only=True)
class ConsumerSendMsgBackRequestHeader(RequestHeader):
    """CONSUMER_SEND_MSG_BACK (36). ``offset`` is the commit-log offset of the message."""

    JAVA_PUT_ORDER: ClassVar[str] = (
        "maxReconsumeTimes,ns,bname,originTopic,oway,delayLevel,offset,originMsgId,group,"
        "unitMode,nsd"
    )

    offset: int = hfield("offset", I64, required=True)
    group: str = hfield("group", S, required=True)
    delay_level: int = hfield("delayLevel", I32, required=True)
    origin_msg_id: str | None = hfield("originMsgId", S)
    origin_topic: str | None = hfield("originTopic", S)
    unit_mode: bool = hfield("unitMode", B, default=False)
    max_reconsume_times: int | None = hfield("maxReconsumeTimes", I32)


@dataclass(slots=True, kw_only=True)
class LockBatchMqRequestHeader(RequestHeader):
    """LOCK_BATCH_MQ (41): no fields of its own; the queues travel in the body."""

    JAVA_PUT_ORDER: ClassVar[str] = "ns,bname,oway,nsd"


@dataclass(slots=True, kw_only=True)
class UnlockBatchMqRequestHeader(RequestHeader):
    """UNLOCK_BATCH_MQ (42): no fields of its own; the queues travel in the body."""

    JAVA_PUT_ORDER: ClassVar[str] = "ns,bname,oway,nsd"


# --- send and admin ----------------------------------------------------------------------------


@dataclass(slots=True, kw_only=True)
class SendMessageRequestHeaderV2(CommandHeader):
    """SEND_MESSAGE_V2 (310) / SEND_BATCH_MESSAGE (320): one-letter Java names ``a`` ... ``n``."""

    JAVA_PUT_ORDER: ClassVar[str] = "n,l,m,j,ns,k,h,i,f,g,d,e,b,c,lo,a,bname,oway,nsd"
    JAVA_FAST_CODES: ClassVar[str] = "a,b,c,d,e,f,g,h,i,j,k,l,m,n"

    producer_group: str = hfield("a", S, required=True)
    topic: str = hfield("b", S, required=True)
    default_topic: str = hfield("c", S, required=True, default="TBW102")
    default_topic_queue_nums: int = hfield("d", I32, required=True, default=4)
    queue_id: int = hfield("e", I32, required=True)
    sys_flag: int = hfield("f", I32, required=True, default=0)
    born_timestamp: int = hfield("g", I64, required=True)
    flag: int = hfield("h", I32, required=True, default=0)
    properties: str | None = hfield("i", S)
    reconsume_times: int | None = hfield("j", I32)
    unit_mode: bool | None = hfield("k", B)
    max_reconsume_times: int | None = hfield("l", I32)
    batch: bool | None = hfield("m", B)
    bname: str | None = hfield("n", S)


@dataclass(slots=True, kw_only=True)
class SendMessageResponseHeader(CommandHeader):
    """Response of SEND_MESSAGE(_V2) / SEND_BATCH_MESSAGE. ``msg_id`` is the offsetMsgId."""

    JAVA_PUT_ORDER: ClassVar[str] = (
        "msgId,recallHandle,queueOffset,batchUniqId,transactionId,queueId"
    )
    JAVA_FAST_CODES: ClassVar[str] = (
        "msgId,queueId,queueOffset,transactionId,batchUniqId,recallHandle"
    )

    msg_id: str = hfield("msgId", S, required=True)
    queue_id: int = hfield("queueId", I32, required=True)
    queue_offset: int = hfield("queueOffset", I64, required=True)
    transaction_id: str | None = hfield("transactionId", S)
    batch_uniq_id: str | None = hfield("batchUniqId", S)
    recall_handle: str | None = hfield("recallHandle", S)
    msg_region: str | None = hfield("MSG_REGION", S)
    trace_on: str | None = hfield("TRACE_ON", S)


@dataclass(slots=True, kw_only=True)
class CreateTopicRequestHeader(RequestHeader):
    """UPDATE_AND_CREATE_TOPIC (17)."""

    JAVA_PUT_ORDER: ClassVar[str] = (
        "ns,topicFilterType,writeQueueNums,attributes,force,topic,order,lo,readQueueNums,"
        "bname,oway,perm,topicSysFlag,defaultTopic,nsd"
    )

    topic: str = hfield("topic", S, required=True)
    default_topic: str = hfield("defaultTopic", S, required=True, default="TBW102")
    read_queue_nums: int = hfield("readQueueNums", I32, required=True)
    write_queue_nums: int = hfield("writeQueueNums", I32, required=True)
    perm: int = hfield("perm", I32, required=True, default=6)
    topic_filter_type: str = hfield("topicFilterType", S, required=True, default="SINGLE_TAG")
    topic_sys_flag: int | None = hfield("topicSysFlag", I32)
    order: bool = hfield("order", B, required=True, default=False)
    attributes: str | None = hfield("attributes", S)
    force: bool | None = hfield("force", B)


# --- broker -> client --------------------------------------------------------------------------


@dataclass(slots=True, kw_only=True)
class NotifyConsumerIdsChangedRequestHeader(RequestHeader):
    """NOTIFY_CONSUMER_IDS_CHANGED (40), oneway."""

    JAVA_PUT_ORDER: ClassVar[str] = "consumerGroup,ns,bname,oway,nsd"

    consumer_group: str = hfield("consumerGroup", S, required=True)


@dataclass(slots=True, kw_only=True)
class ResetOffsetRequestHeader(RequestHeader):
    """RESET_CONSUMER_CLIENT_OFFSET (220), oneway. ``queue_id``/``offset`` are 5.x only."""

    JAVA_PUT_ORDER: ClassVar[str] = (
        "isForce,topic,ns,bname,group,timestamp,oway,queueId,offset,lo,nsd"
    )

    topic: str = hfield("topic", S, required=True)
    group: str = hfield("group", S, required=True)
    timestamp: int = hfield("timestamp", I64, required=True)
    is_force: bool = hfield("isForce", B, required=True)
    queue_id: int = hfield("queueId", I32, default=-1)
    offset: int | None = hfield("offset", I64)


@dataclass(slots=True, kw_only=True)
class GetConsumerStatusRequestHeader(RequestHeader):
    """GET_CONSUMER_STATUS_FROM_CLIENT (221)."""

    JAVA_PUT_ORDER: ClassVar[str] = "ns,bname,oway,clientAddr,group,topic,lo,nsd"

    topic: str = hfield("topic", S, required=True)
    group: str = hfield("group", S, required=True)
    client_addr: str | None = hfield("clientAddr", S)


@dataclass(slots=True, kw_only=True)
class GetConsumerRunningInfoRequestHeader(RequestHeader):
    """GET_CONSUMER_RUNNING_INFO (307)."""

    JAVA_PUT_ORDER: ClassVar[str] = "jstackEnable,ns,bname,consumerGroup,oway,clientId,nsd"

    consumer_group: str = hfield("consumerGroup", S, required=True)
    client_id: str = hfield("clientId", S, required=True)
    jstack_enable: bool = hfield("jstackEnable", B, default=False)


@dataclass(slots=True, kw_only=True)
class ConsumeMessageDirectlyResultRequestHeader(RequestHeader):
    """CONSUME_MESSAGE_DIRECTLY (309); the body is one stored message record."""

    JAVA_PUT_ORDER: ClassVar[str] = (
        "msgId,topic,consumerGroup,ns,bname,topicSysFlag,oway,brokerName,clientId,"
        "groupSysFlag,lo,nsd"
    )

    consumer_group: str = hfield("consumerGroup", S, required=True)
    client_id: str | None = hfield("clientId", S)
    msg_id: str | None = hfield("msgId", S)
    broker_name: str | None = hfield("brokerName", S)
    topic: str | None = hfield("topic", S)
    topic_sys_flag: int | None = hfield("topicSysFlag", I32)
    group_sys_flag: int | None = hfield("groupSysFlag", I32)


del S, I32, I64, B

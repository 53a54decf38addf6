"""JSON bodies of requests and responses: route data, heartbeat, locks, offsets, admin replies.

Encoders produce what fastjson produces for the Java bean (sorted fields, nulls omitted; see
:mod:`~rmq_async.protocol.jsonutil`); Java ``HashSet`` fields (tags, codes, lock queue sets)
are written in the Java set's iteration order. Decoders accept both the standard JSON and
fastjson's default non-standard form (bare integer keys, object keys) and raise
:class:`ProtocolError` for anything not shaped as expected.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Self

from .codes import MASTER_ID, PERM_READ, PERM_WRITE
from .errors import ProtocolError
from .filter import SubscriptionData
from .jsonutil import (
    InsertionOrderedMap,
    fastjson_dumps,
    java_hash_order,
    java_string_hash,
    tolerant_loads,
)
from .types import MessageQueue

__all__ = [
    "BrokerData",
    "ClusterInfo",
    "ConsumeMessageDirectlyResult",
    "ConsumeStats",
    "ConsumeStatus",
    "ConsumerConnection",
    "ConsumerData",
    "ConsumerRunningInfo",
    "GetConsumerListByGroupResponseBody",
    "GetConsumerStatusBody",
    "INNER_PRODUCER_GROUP",
    "HeartbeatData",
    "LockBatchRequestBody",
    "LockBatchResponseBody",
    "OffsetWrapper",
    "ProcessQueueInfo",
    "ProducerData",
    "QueueData",
    "ResetOffsetBody",
    "TopicRouteData",
    "UnlockBatchRequestBody",
    "consumer_queues",
    "decode_consumer_list",
    "decode_lock_batch_response",
    "encode_lock_batch_request",
    "master_address",
    "mq_hash_code",
    "producer_queues",
]


# ---------------------------------------------------------------------------------------------
# Parsing helpers


def _load(data: bytes | bytearray | memoryview | str, what: str) -> dict[Any, Any]:
    obj = tolerant_loads(data)
    if not isinstance(obj, dict):
        raise ProtocolError(f"{what}: body is not a JSON object")
    return obj


def _field(obj: Mapping[Any, Any], key: str, what: str) -> Any:
    if key not in obj:
        raise ProtocolError(f"{what}: missing {key!r}")
    return obj[key]


def _as_str(value: Any, what: str) -> str:
    if not isinstance(value, str):
        raise ProtocolError(f"{what}: expected a string")
    return value


def _as_int(value: Any, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        if isinstance(value, str):
            try:
                return int(value)
            except ValueError:
                pass
        raise ProtocolError(f"{what}: expected an integer")
    return value


def _as_bool(value: Any, what: str) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.lower() in ("true", "false"):
        return value.lower() == "true"
    raise ProtocolError(f"{what}: expected a boolean")


def _as_list(value: Any, what: str) -> list[Any]:
    if not isinstance(value, list):
        raise ProtocolError(f"{what}: expected an array")
    return value


def _as_dict(value: Any, what: str) -> dict[Any, Any]:
    if not isinstance(value, dict):
        raise ProtocolError(f"{what}: expected an object")
    return value


def _opt(obj: Mapping[Any, Any], key: str, default: Any) -> Any:
    value = obj.get(key)
    return default if value is None else value


def _as_mq(value: Any, what: str) -> MessageQueue:
    if isinstance(value, MessageQueue):
        return value
    if isinstance(value, str):
        # A key written as a string holding the object (WriteNonStringKeyAsString).
        value = tolerant_loads(value)
    if isinstance(value, tuple):
        # An object key, frozen as (name, value) pairs; an array key is not a queue.
        try:
            value = dict(value)
        except (TypeError, ValueError):
            raise ProtocolError(f"{what}: expected a message queue") from None
    obj = _as_dict(value, what)
    return MessageQueue(
        _as_str(_field(obj, "topic", what), what),
        _as_str(_field(obj, "brokerName", what), what),
        _as_int(_field(obj, "queueId", what), what),
    )


def mq_hash_code(mq: MessageQueue) -> int:
    """Java ``MessageQueue.hashCode()`` (signed 32-bit)."""
    h = 31 + java_string_hash(mq.broker_name)
    h = (31 * h + mq.queue_id) & 0xFFFFFFFF
    h = (31 * h + java_string_hash(mq.topic)) & 0xFFFFFFFF
    return h - 0x100000000 if h >= 0x80000000 else h


def _mq_hash_map(table: Mapping[MessageQueue, Any]) -> InsertionOrderedMap:
    """A ``HashMap<MessageQueue, ?>`` in Java's iteration order."""
    keys = list(table)
    ordered = java_hash_order(keys, [mq_hash_code(mq) for mq in keys])
    return InsertionOrderedMap((mq, table[mq]) for mq in ordered)


def _mq_set_json(mqs: Iterable[MessageQueue]) -> list[dict[str, Any]]:
    unique = list(dict.fromkeys(mqs))
    ordered = java_hash_order(unique, [mq_hash_code(mq) for mq in unique])
    return [mq.to_json() for mq in ordered]


# ---------------------------------------------------------------------------------------------
# Route data (GET_ROUTEINFO_BY_TOPIC) and cluster info


@dataclass(slots=True)
class QueueData:
    broker_name: str
    read_queue_nums: int
    write_queue_nums: int
    perm: int
    topic_sys_flag: int = 0

    @classmethod
    def from_json(cls, obj: Any) -> Self:
        what = "QueueData"
        d = _as_dict(obj, what)
        return cls(
            broker_name=_as_str(_field(d, "brokerName", what), what),
            read_queue_nums=_as_int(_field(d, "readQueueNums", what), what),
            write_queue_nums=_as_int(_field(d, "writeQueueNums", what), what),
            perm=_as_int(_field(d, "perm", what), what),
            topic_sys_flag=_as_int(_opt(d, "topicSysFlag", 0), what),
        )

    def to_json(self) -> dict[str, Any]:
        return {
            "brokerName": self.broker_name,
            "perm": self.perm,
            "readQueueNums": self.read_queue_nums,
            "topicSysFlag": self.topic_sys_flag,
            "writeQueueNums": self.write_queue_nums,
        }


@dataclass(slots=True)
class BrokerData:
    cluster: str
    broker_name: str
    broker_addrs: dict[int, str] = field(default_factory=dict)
    enable_acting_master: bool = False
    zone_name: str | None = None

    @classmethod
    def from_json(cls, obj: Any) -> Self:
        what = "BrokerData"
        d = _as_dict(obj, what)
        addrs: dict[int, str] = {}
        for key, value in _as_dict(_opt(d, "brokerAddrs", {}), what).items():
            addrs[_as_int(key, "BrokerData.brokerAddrs key")] = _as_str(value, what)
        zone = d.get("zoneName")
        return cls(
            cluster=_as_str(_opt(d, "cluster", ""), what),
            broker_name=_as_str(_field(d, "brokerName", what), what),
            broker_addrs=addrs,
            enable_acting_master=_as_bool(_opt(d, "enableActingMaster", False), what),
            zone_name=None if zone is None else _as_str(zone, what),
        )

    def to_json(self, *, standard: bool = True) -> dict[str, Any]:
        addrs: dict[Any, str] = dict(self.broker_addrs)
        if standard:
            addrs = {str(k): v for k, v in addrs.items()}
        return {
            "brokerAddrs": addrs,
            "brokerName": self.broker_name,
            "cluster": self.cluster,
            "enableActingMaster": self.enable_acting_master,
            "zoneName": self.zone_name,
        }

    @property
    def master_addr(self) -> str | None:
        return self.broker_addrs.get(MASTER_ID)

    def select_broker_addr(self) -> str | None:
        """The master if present, else the address with the lowest broker id."""
        master = self.broker_addrs.get(MASTER_ID)
        if master is not None:
            return master
        if not self.broker_addrs:
            return None
        return self.broker_addrs[min(self.broker_addrs)]


@dataclass(slots=True)
class TopicRouteData:
    queue_datas: list[QueueData] = field(default_factory=list)
    broker_datas: list[BrokerData] = field(default_factory=list)
    order_topic_conf: str | None = None
    filter_server_table: dict[str, list[str]] = field(default_factory=dict)

    @classmethod
    def from_json(cls, obj: Any) -> Self:
        what = "TopicRouteData"
        d = _as_dict(obj, what)
        conf = d.get("orderTopicConf")
        filters: dict[str, list[str]] = {}
        for key, value in _as_dict(_opt(d, "filterServerTable", {}), what).items():
            filters[str(key)] = [_as_str(v, what) for v in _as_list(value, what)]
        return cls(
            queue_datas=[QueueData.from_json(q) for q in _as_list(_opt(d, "queueDatas", []), what)],
            broker_datas=[
                BrokerData.from_json(b) for b in _as_list(_opt(d, "brokerDatas", []), what)
            ],
            order_topic_conf=None if conf is None else _as_str(conf, what),
            filter_server_table=filters,
        )

    @classmethod
    def from_json_bytes(cls, data: bytes | bytearray | memoryview | str) -> Self:
        return cls.from_json(_load(data, "TopicRouteData"))

    def to_json(self, *, standard: bool = True) -> dict[str, Any]:
        return {
            "brokerDatas": [b.to_json(standard=standard) for b in self.broker_datas],
            "filterServerTable": self.filter_server_table,
            "orderTopicConf": self.order_topic_conf,
            "queueDatas": [q.to_json() for q in self.queue_datas],
        }

    def to_json_bytes(self, *, standard: bool = True) -> bytes:
        """As a name server writes it: ``standard`` quotes the broker-id keys."""
        return fastjson_dumps(self.to_json(standard=standard))

    def broker_data(self, broker_name: str) -> BrokerData | None:
        for bd in self.broker_datas:
            if bd.broker_name == broker_name:
                return bd
        return None


def consumer_queues(route: TopicRouteData, topic: str) -> list[MessageQueue]:
    """Queues a consumer may read: ids ``0 .. readQueueNums-1`` of every readable QueueData."""
    out: list[MessageQueue] = []
    for qd in route.queue_datas:
        if qd.perm & PERM_READ:
            out.extend(MessageQueue(topic, qd.broker_name, i) for i in range(qd.read_queue_nums))
    return out


def producer_queues(route: TopicRouteData, topic: str) -> list[MessageQueue]:
    """Queues a producer may write, in Java's order.

    With ``orderTopicConf`` (``broker:count;...``) those queues; otherwise, by broker name,
    ids ``0 .. writeQueueNums-1`` of every writable QueueData whose broker has a master.
    """
    out: list[MessageQueue] = []
    if route.order_topic_conf:
        for item in route.order_topic_conf.split(";"):
            name, sep, count = item.partition(":")
            if not sep:
                continue
            try:
                n = int(count)
            except ValueError:
                raise ProtocolError(f"bad orderTopicConf entry {item!r}") from None
            out.extend(MessageQueue(topic, name, i) for i in range(n))
        return out
    for qd in sorted(route.queue_datas,
                     key=lambda q: q.broker_name.encode("utf-16-be", "surrogatepass")):
        if not qd.perm & PERM_WRITE:
            continue
        bd = route.broker_data(qd.broker_name)
        if bd is None or MASTER_ID not in bd.broker_addrs:
            continue
        out.extend(MessageQueue(topic, qd.broker_name, i) for i in range(qd.write_queue_nums))
    return out


def master_address(route: TopicRouteData, broker_name: str) -> str | None:
    """The master (broker id 0) address of ``broker_name``, or ``None``."""
    bd = route.broker_data(broker_name)
    return None if bd is None else bd.broker_addrs.get(MASTER_ID)


@dataclass(slots=True)
class ClusterInfo:
    """GET_BROKER_CLUSTER_INFO body."""

    broker_addr_table: dict[str, BrokerData] = field(default_factory=dict)
    cluster_addr_table: dict[str, list[str]] = field(default_factory=dict)

    @classmethod
    def from_json(cls, obj: Any) -> Self:
        what = "ClusterInfo"
        d = _as_dict(obj, what)
        brokers = {
            _as_str(k, what): BrokerData.from_json(v)
            for k, v in _as_dict(_opt(d, "brokerAddrTable", {}), what).items()
        }
        clusters = {
            _as_str(k, what): [_as_str(n, what) for n in _as_list(v, what)]
            for k, v in _as_dict(_opt(d, "clusterAddrTable", {}), what).items()
        }
        return cls(broker_addr_table=brokers, cluster_addr_table=clusters)

    @classmethod
    def from_json_bytes(cls, data: bytes | bytearray | memoryview | str) -> Self:
        return cls.from_json(_load(data, "ClusterInfo"))

    def to_json(self, *, standard: bool = False) -> dict[str, Any]:
        return {
            "brokerAddrTable": {
                k: v.to_json(standard=standard) for k, v in self.broker_addr_table.items()
            },
            "clusterAddrTable": {k: set(v) for k, v in self.cluster_addr_table.items()},
        }

    def to_json_bytes(self, *, standard: bool = False) -> bytes:
        return fastjson_dumps(self.to_json(standard=standard))


# ---------------------------------------------------------------------------------------------
# Heartbeat


#: Producer group of a client's own sends (the Java client's inner producer: the dead-letter
#: and retry copies a consumer sends). Every client's heartbeat names it, as Java's does.
INNER_PRODUCER_GROUP = "CLIENT_INNER_PRODUCER"


@dataclass(slots=True)
class ProducerData:
    group_name: str

    def to_json(self) -> dict[str, Any]:
        return {"groupName": self.group_name}


@dataclass(slots=True)
class ConsumerData:
    group_name: str
    consume_type: str = "CONSUME_PASSIVELY"
    message_model: str = "CLUSTERING"
    consume_from_where: str = "CONSUME_FROM_LAST_OFFSET"
    subscription_data_set: list[SubscriptionData] = field(default_factory=list)
    unit_mode: bool = False

    def to_json(self) -> dict[str, Any]:
        return {
            "consumeFromWhere": self.consume_from_where,
            "consumeType": self.consume_type,
            "groupName": self.group_name,
            "messageModel": self.message_model,
            # A HashSet in Java: written in its hash order, not in the order we hold them.
            "subscriptionDataSet": [
                s.to_json() for s in java_hash_order(
                    self.subscription_data_set,
                    [s.java_hash_code() for s in self.subscription_data_set],
                )
            ],
            "unitMode": self.unit_mode,
        }


@dataclass(slots=True)
class HeartbeatData:
    """HEART_BEAT body. ``heartbeat_fingerprint`` 0 selects the classic (full) heartbeat."""

    client_id: str
    consumer_data_set: list[ConsumerData] = field(default_factory=list)
    producer_data_set: list[ProducerData] = field(default_factory=list)
    heartbeat_fingerprint: int = 0
    without_sub: bool = False

    def to_json(self) -> dict[str, Any]:
        return {
            "clientID": self.client_id,
            "consumerDataSet": [c.to_json() for c in self.consumer_data_set],
            "heartbeatFingerprint": self.heartbeat_fingerprint,
            "producerDataSet": [p.to_json() for p in self.producer_data_set],
            "withoutSub": self.without_sub,
        }

    def to_json_bytes(self) -> bytes:
        return fastjson_dumps(self.to_json())

    encode = to_json_bytes


# ---------------------------------------------------------------------------------------------
# Orderly locks and consumer list


@dataclass(slots=True)
class LockBatchRequestBody:
    consumer_group: str
    client_id: str
    mq_set: list[MessageQueue] = field(default_factory=list)
    only_this_broker: bool = False

    def to_json(self) -> dict[str, Any]:
        return {
            "clientId": self.client_id,
            "consumerGroup": self.consumer_group,
            "mqSet": _mq_set_json(self.mq_set),
            "onlyThisBroker": self.only_this_broker,
        }

    def to_json_bytes(self) -> bytes:
        return fastjson_dumps(self.to_json())

    @classmethod
    def from_json_bytes(cls, data: bytes | bytearray | memoryview | str) -> Self:
        what = "LockBatchRequestBody"
        d = _load(data, what)
        return cls(
            consumer_group=_as_str(_field(d, "consumerGroup", what), what),
            client_id=_as_str(_field(d, "clientId", what), what),
            mq_set=[_as_mq(m, what) for m in _as_list(_opt(d, "mqSet", []), what)],
            only_this_broker=_as_bool(_opt(d, "onlyThisBroker", False), what),
        )


@dataclass(slots=True)
class UnlockBatchRequestBody(LockBatchRequestBody):
    """Same shape as :class:`LockBatchRequestBody`."""


@dataclass(slots=True)
class LockBatchResponseBody:
    lock_ok_mq_set: set[MessageQueue] = field(default_factory=set)

    @classmethod
    def from_json_bytes(cls, data: bytes | bytearray | memoryview | str) -> Self:
        what = "LockBatchResponseBody"
        d = _load(data, what)
        return cls({_as_mq(m, what) for m in _as_list(_opt(d, "lockOKMQSet", []), what)})

    def to_json_bytes(self) -> bytes:
        return fastjson_dumps({"lockOKMQSet": _mq_set_json(self.lock_ok_mq_set)})


@dataclass(slots=True)
class GetConsumerListByGroupResponseBody:
    consumer_id_list: list[str] = field(default_factory=list)

    @classmethod
    def from_json_bytes(cls, data: bytes | bytearray | memoryview | str) -> Self:
        what = "GetConsumerListByGroupResponseBody"
        d = _load(data, what)
        return cls([_as_str(c, what) for c in _as_list(_opt(d, "consumerIdList", []), what)])

    def to_json_bytes(self) -> bytes:
        return fastjson_dumps({"consumerIdList": self.consumer_id_list})


def encode_lock_batch_request(
    consumer_group: str,
    client_id: str,
    mqs: Iterable[MessageQueue],
    only_this_broker: bool = False,
) -> bytes:
    """LOCK_BATCH_MQ / UNLOCK_BATCH_MQ body."""
    body = LockBatchRequestBody(consumer_group, client_id, list(mqs), only_this_broker)
    return body.to_json_bytes()


def decode_lock_batch_response(data: bytes | bytearray | memoryview | str) -> set[MessageQueue]:
    """The queues a LOCK_BATCH_MQ response says are locked by us."""
    return LockBatchResponseBody.from_json_bytes(data).lock_ok_mq_set


def decode_consumer_list(data: bytes | bytearray | memoryview | str) -> list[str]:
    """Client ids of a GET_CONSUMER_LIST_BY_GROUP response."""
    return GetConsumerListByGroupResponseBody.from_json_bytes(data).consumer_id_list


# ---------------------------------------------------------------------------------------------
# Broker -> client bodies


def _offset_table(value: Any, what: str) -> dict[MessageQueue, int]:
    table: dict[MessageQueue, int] = {}
    if isinstance(value, list):
        # ResetOffsetBodyForC: [{"brokerName","offset","queueId","topic"}, ...]
        for item in value:
            d = _as_dict(item, what)
            table[_as_mq(d, what)] = _as_int(_field(d, "offset", what), what)
        return table
    for key, offset in _as_dict(value, what).items():
        table[_as_mq(key, what)] = _as_int(offset, what)
    return table


@dataclass(frozen=True, slots=True)
class OffsetWrapper:
    """One queue of a :class:`ConsumeStats` answer: the broker's max offset, the group's
    committed offset and when the last consumed message was stored (epoch ms, 0 = never)."""

    broker_offset: int
    consumer_offset: int
    last_timestamp: int = 0

    @property
    def diff(self) -> int:
        """Messages not yet consumed (``broker_offset - consumer_offset``), as mqadmin shows it."""
        return self.broker_offset - self.consumer_offset


@dataclass(slots=True)
class ConsumeStats:
    """GET_CONSUME_STATS answer: per queue offsets of a group on one broker, and its TPS."""

    offset_table: dict[MessageQueue, OffsetWrapper] = field(default_factory=dict)
    consume_tps: float = 0.0

    @classmethod
    def from_json_bytes(cls, data: bytes | bytearray | memoryview | str) -> Self:
        what = "ConsumeStats"
        d = _load(data, what)
        table: dict[MessageQueue, OffsetWrapper] = {}
        for key, value in _as_dict(_opt(d, "offsetTable", {}), what).items():
            w = _as_dict(value, what)
            table[_as_mq(key, what)] = OffsetWrapper(
                broker_offset=_as_int(_opt(w, "brokerOffset", 0), what),
                consumer_offset=_as_int(_opt(w, "consumerOffset", 0), what),
                last_timestamp=_as_int(_opt(w, "lastTimestamp", 0), what),
            )
        tps = _opt(d, "consumeTps", 0.0)
        if isinstance(tps, bool) or not isinstance(tps, int | float):
            raise ProtocolError(f"{what}: consumeTps is not a number: {tps!r}")
        return cls(table, float(tps))


@dataclass(frozen=True, slots=True)
class ConsumerConnection:
    """GET_CONSUMER_CONNECTION_LIST answer: the clients of a group connected to one broker,
    and how the group consumes (``messageModel`` ``CLUSTERING`` / ``BROADCASTING``)."""

    client_ids: list[str] = field(default_factory=list)
    message_model: str = ""
    consume_type: str = ""

    @classmethod
    def from_json_bytes(cls, data: bytes | bytearray | memoryview | str) -> Self:
        what = "ConsumerConnection"
        d = _load(data, what)
        ids = [_as_str(_field(_as_dict(c, what), "clientId", what), what)
               for c in _as_list(_opt(d, "connectionSet", []), what)]
        return cls(ids, _as_str(_opt(d, "messageModel", ""), what),
                   _as_str(_opt(d, "consumeType", ""), what))


@dataclass(slots=True)
class ResetOffsetBody:
    """RESET_CONSUMER_CLIENT_OFFSET body: new offset per queue.

    Accepts fastjson's object-keyed map and the list form the broker sends for C++ admins.
    """

    offset_table: dict[MessageQueue, int] = field(default_factory=dict)

    @classmethod
    def from_json_bytes(cls, data: bytes | bytearray | memoryview | str) -> Self:
        what = "ResetOffsetBody"
        d = _load(data, what)
        return cls(_offset_table(_opt(d, "offsetTable", {}), what))

    def to_json_bytes(self) -> bytes:
        return fastjson_dumps({"offsetTable": _mq_hash_map(self.offset_table)})


@dataclass(slots=True)
class GetConsumerStatusBody:
    """GET_CONSUMER_STATUS_FROM_CLIENT reply: consume offsets per queue."""

    message_queue_table: dict[MessageQueue, int] = field(default_factory=dict)
    consumer_table: dict[str, dict[MessageQueue, int]] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {
            "consumerTable": {k: _mq_hash_map(v) for k, v in self.consumer_table.items()},
            "messageQueueTable": _mq_hash_map(self.message_queue_table),
        }

    def to_json_bytes(self) -> bytes:
        return fastjson_dumps(self.to_json())

    @classmethod
    def from_json_bytes(cls, data: bytes | bytearray | memoryview | str) -> Self:
        what = "GetConsumerStatusBody"
        d = _load(data, what)
        consumers = {
            _as_str(k, what): _offset_table(v, what)
            for k, v in _as_dict(_opt(d, "consumerTable", {}), what).items()
        }
        return cls(_offset_table(_opt(d, "messageQueueTable", {}), what), consumers)


@dataclass(slots=True)
class ProcessQueueInfo:
    """Per-queue consumer state in :class:`ConsumerRunningInfo` (``droped`` is Java's spelling)."""

    commit_offset: int = 0
    cached_msg_min_offset: int = 0
    cached_msg_max_offset: int = 0
    cached_msg_count: int = 0
    cached_msg_size_in_mib: int = 0
    transaction_msg_min_offset: int = 0
    transaction_msg_max_offset: int = 0
    transaction_msg_count: int = 0
    locked: bool = False
    try_unlock_times: int = 0
    last_lock_timestamp: int = 0
    droped: bool = False
    last_pull_timestamp: int = 0
    last_consume_timestamp: int = 0

    def to_json(self) -> dict[str, Any]:
        return {
            "cachedMsgCount": self.cached_msg_count,
            "cachedMsgMaxOffset": self.cached_msg_max_offset,
            "cachedMsgMinOffset": self.cached_msg_min_offset,
            "cachedMsgSizeInMiB": self.cached_msg_size_in_mib,
            "commitOffset": self.commit_offset,
            "droped": self.droped,
            "lastConsumeTimestamp": self.last_consume_timestamp,
            "lastLockTimestamp": self.last_lock_timestamp,
            "lastPullTimestamp": self.last_pull_timestamp,
            "locked": self.locked,
            "transactionMsgCount": self.transaction_msg_count,
            "transactionMsgMaxOffset": self.transaction_msg_max_offset,
            "transactionMsgMinOffset": self.transaction_msg_min_offset,
            "tryUnlockTimes": self.try_unlock_times,
        }

    def json_value(self) -> dict[str, Any]:
        return self.to_json()


@dataclass(slots=True)
class ConsumeStatus:
    """Per-topic rates in :class:`ConsumerRunningInfo`."""

    pull_rt: float = 0.0
    pull_tps: float = 0.0
    consume_rt: float = 0.0
    consume_ok_tps: float = 0.0
    consume_failed_tps: float = 0.0
    consume_failed_msgs: int = 0

    def to_json(self) -> dict[str, Any]:
        return {
            "consumeFailedMsgs": self.consume_failed_msgs,
            "consumeFailedTPS": float(self.consume_failed_tps),
            "consumeOKTPS": float(self.consume_ok_tps),
            "consumeRT": float(self.consume_rt),
            "pullRT": float(self.pull_rt),
            "pullTPS": float(self.pull_tps),
        }

    def json_value(self) -> dict[str, Any]:
        return self.to_json()


@dataclass(slots=True)
class ConsumerRunningInfo:
    """GET_CONSUMER_RUNNING_INFO reply. ``mq_table`` keys are written as JSON objects."""

    properties: dict[str, str] = field(default_factory=dict)
    subscription_set: list[SubscriptionData] = field(default_factory=list)
    mq_table: dict[MessageQueue, ProcessQueueInfo] = field(default_factory=dict)
    status_table: dict[str, ConsumeStatus] = field(default_factory=dict)
    user_consumer_info: dict[str, str] = field(default_factory=dict)
    jstack: str | None = None

    def to_json(self) -> dict[str, Any]:
        # subscriptionSet is a TreeSet ordered by "topic@subString".
        subs = sorted(
            self.subscription_set,
            key=lambda s: f"{s.topic}@{s.sub_string}".encode("utf-16-be", "surrogatepass"),
        )
        return {
            "jstack": self.jstack,
            "mqPopTable": {},
            "mqTable": self.mq_table,
            "properties": self.properties,
            "statusTable": self.status_table,
            "subscriptionSet": [s.to_json() for s in subs],
            "userConsumerInfo": self.user_consumer_info,
        }

    def to_json_bytes(self) -> bytes:
        return fastjson_dumps(self.to_json())


@dataclass(slots=True)
class ConsumeMessageDirectlyResult:
    """CONSUME_MESSAGE_DIRECTLY reply. ``consume_result``: ``CR_SUCCESS``, ``CR_LATER``,
    ``CR_ROLLBACK``, ``CR_COMMIT``, ``CR_THROW_EXCEPTION`` or ``CR_RETURN_NULL``."""

    consume_result: str
    order: bool = False
    auto_commit: bool = True
    remark: str | None = None
    spent_time_mills: int = 0

    def to_json(self) -> dict[str, Any]:
        return {
            "autoCommit": self.auto_commit,
            "consumeResult": self.consume_result,
            "order": self.order,
            "remark": self.remark,
            "spentTimeMills": self.spent_time_mills,
        }

    def to_json_bytes(self) -> bytes:
        return fastjson_dumps(self.to_json())

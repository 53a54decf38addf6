"""Small value types shared by every layer: message queues and consumed messages."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

# Property keys the client reads or writes (Java MessageConst names in comments).
PROPERTY_TAGS = "TAGS"  # PROPERTY_TAGS
PROPERTY_KEYS = "KEYS"  # PROPERTY_KEYS, keys joined by a single space
PROPERTY_UNIQ_KEY = "UNIQ_KEY"  # PROPERTY_UNIQ_CLIENT_MESSAGE_ID_KEYIDX
PROPERTY_WAIT = "WAIT"  # PROPERTY_WAIT_STORE_MSG_OK
PROPERTY_DELAY = "DELAY"  # PROPERTY_DELAY_TIME_LEVEL
PROPERTY_RETRY_TOPIC = "RETRY_TOPIC"
PROPERTY_ORIGIN_MESSAGE_ID = "ORIGIN_MESSAGE_ID"
PROPERTY_RECONSUME_TIME = "RECONSUME_TIME"
PROPERTY_MAX_RECONSUME_TIMES = "MAX_RECONSUME_TIMES"
PROPERTY_CONSUME_START_TIME = "CONSUME_START_TIME"
PROPERTY_MIN_OFFSET = "MIN_OFFSET"
PROPERTY_MAX_OFFSET = "MAX_OFFSET"
PROPERTY_TRANSACTION_PREPARED = "TRAN_MSG"
PROPERTY_SHARDING_KEY = "__SHARDINGKEY"
PROPERTY_PRODUCER_GROUP = "PGROUP"
PROPERTY_DLQ_ORIGIN_TOPIC = "DLQ_ORIGIN_TOPIC"

KEY_SEPARATOR = " "


def _java_order_key(text: str) -> bytes:
    # Java String.compareTo compares UTF-16 code units; big-endian UTF-16 bytes sort the same way.
    return text.encode("utf-16-be", "surrogatepass")


@dataclass(frozen=True, slots=True)
class MessageQueue:
    """One queue of a topic on one broker (Java ``MessageQueue``)."""

    topic: str
    broker_name: str
    queue_id: int

    def java_sort_key(self) -> tuple[bytes, bytes, int]:
        """Key that sorts queues exactly as Java's ``MessageQueue.compareTo``."""
        return (_java_order_key(self.topic), _java_order_key(self.broker_name), self.queue_id)

    def __lt__(self, other: MessageQueue) -> bool:
        return self.java_sort_key() < other.java_sort_key()

    def __str__(self) -> str:
        # Java MessageQueue.toString(); used by the consistent-hash strategy.
        return (
            f"MessageQueue [topic={self.topic}, brokerName={self.broker_name}, "
            f"queueId={self.queue_id}]"
        )

    def to_json(self) -> dict[str, Any]:
        """The fastjson object form: keys in alphabetical order."""
        return {"brokerName": self.broker_name, "queueId": self.queue_id, "topic": self.topic}

    @classmethod
    def from_json(cls, obj: dict[str, Any]) -> MessageQueue:
        return cls(str(obj["topic"]), str(obj["brokerName"]), int(obj["queueId"]))


def java_string_sort_key(text: str) -> bytes:
    """Sort key equal to Java ``String.compareTo`` order (used for client ids)."""
    return _java_order_key(text)


@dataclass(slots=True, eq=False)
class MessageExt:
    """A stored message as read back from the broker (Java ``MessageExt``).

    Every field of the stored-record layout is kept. ``msg_id`` is the client id (UNIQ_KEY)
    when the producer set one, else ``offset_msg_id`` (Java ``MessageClientExt#getMsgId``).
    """

    topic: str
    body: bytes
    queue_id: int = 0
    queue_offset: int = 0
    flag: int = 0
    sys_flag: int = 0
    properties: dict[str, str] = field(default_factory=dict)
    store_size: int = 0
    body_crc: int = 0
    commit_log_offset: int = 0
    born_timestamp: int = 0
    born_host: str = ""
    store_timestamp: int = 0
    store_host: str = ""
    reconsume_times: int = 0
    prepared_transaction_offset: int = 0
    offset_msg_id: str = ""
    broker_name: str = ""

    @property
    def msg_id(self) -> str:
        return self.properties.get(PROPERTY_UNIQ_KEY) or self.offset_msg_id

    @property
    def tags(self) -> str | None:
        return self.properties.get(PROPERTY_TAGS)

    @property
    def keys(self) -> list[str]:
        raw = self.properties.get(PROPERTY_KEYS)
        if not raw:
            return []
        return [k for k in raw.split(KEY_SEPARATOR) if k]

    def get_property(self, name: str, default: str | None = None) -> str | None:
        return self.properties.get(name, default)

    @property
    def message_queue(self) -> MessageQueue:
        return MessageQueue(self.topic, self.broker_name, self.queue_id)

    def __repr__(self) -> str:
        return (
            f"MessageExt(topic={self.topic!r}, queue_id={self.queue_id}, "
            f"queue_offset={self.queue_offset}, msg_id={self.msg_id!r}, tags={self.tags!r}, "
            f"body_len={len(self.body)}, reconsume_times={self.reconsume_times})"
        )


@dataclass(slots=True)
class Message:
    """A message to send (Java ``Message``)."""

    topic: str
    body: bytes
    tags: str | None = None
    keys: str | list[str] | None = None
    properties: dict[str, str] = field(default_factory=dict)
    flag: int = 0

    def all_properties(self) -> dict[str, str]:
        """User properties plus TAGS / KEYS, as they travel on the wire."""
        props = dict(self.properties)
        if self.tags:
            props[PROPERTY_TAGS] = self.tags
        if self.keys:
            keys = [self.keys] if isinstance(self.keys, str) else list(self.keys)
            props[PROPERTY_KEYS] = KEY_SEPARATOR.join(keys)
        return props

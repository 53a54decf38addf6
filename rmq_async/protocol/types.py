"""Small value types shared by every layer: message queues and consumed messages."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields
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
        """The queue from its fastjson object form (``brokerName``, ``queueId``, ``topic``)."""
        return cls(str(obj["topic"]), str(obj["brokerName"]), int(obj["queueId"]))


def java_string_sort_key(text: str) -> bytes:
    """Sort key equal to Java ``String.compareTo`` order (used for client ids)."""
    return _java_order_key(text)


def _parse_raw_properties(raw: bytes) -> dict[str, str]:
    """Stored properties bytes to a dict, with Java's rules (see ``message.decode_properties``).

    :mod:`rmq_async.protocol.message` replaces this with the compiled parser when it is active.
    """
    out: dict[str, str] = {}
    for segment in raw.decode("utf-8", "replace").split("\x02"):
        name, _, value = segment.partition("\x01")
        if name and value:
            out[name] = value
    return out


_properties_parser: Callable[[bytes], dict[str, str]] = _parse_raw_properties
# Finds one property in raw stored properties without parsing them all (None: parse instead).
_property_finder: Callable[[bytes, str], str | None] | None = None


def set_properties_parser(
    parser: Callable[[bytes], dict[str, str]],
    finder: Callable[[bytes, str], str | None] | None = None,
) -> None:
    """Install the functions that read raw stored properties (used by the codec).

    ``finder(raw, name)`` must equal ``parser(raw).get(name)``.
    """
    global _properties_parser, _property_finder
    _properties_parser = parser
    _property_finder = finder


class _FieldNames:
    # Declaring these two names as slots here keeps the dataclass below from creating slots of
    # its own for them, so the properties of _LazyFields are what the names resolve to. The two
    # slots themselves stay unused.
    __slots__ = ("offset_msg_id", "properties")


class _LazyFields(_FieldNames):
    """Storage of the fields that a decoded message computes only when they are first read.

    A decoder leaves ``_props`` ``None`` and keeps the raw properties bytes of the record in
    ``_props_raw``; properties set before the first read wait in ``_props_pending`` and are
    applied after parsing (so the result equals parsing first and setting afterwards). A
    pending dict may be shared by several messages (the pull's values on every message of a
    chunk), so it is never changed in place: a change replaces it with an updated copy. The
    offset message id is formatted from the store host's hex prefix and the commit-log offset
    the record carried (``_oid_host`` is ``None`` once a value was assigned).
    """

    __slots__ = ("_oid", "_oid_host", "_oid_offset", "_props", "_props_pending", "_props_raw")

    _props: dict[str, str] | None
    _props_raw: bytes | None
    _props_pending: dict[str, str] | None
    _oid: str | None
    _oid_host: str | None
    _oid_offset: int

    @property
    def properties(self) -> dict[str, str]:
        """User and system properties (``TAGS``, ``KEYS``, ``UNIQ_KEY``, ...), parsed on first access."""
        props = self._props
        if props is not None:
            return props
        if self._props_raw is None:  # None was assigned: keep it, as a plain field would
            return props  # type: ignore[return-value]
        return self._parse_properties()

    @properties.setter
    def properties(self, value: dict[str, str]) -> None:
        self._props = value
        self._props_raw = None
        self._props_pending = None

    def _parse_properties(self) -> dict[str, str]:
        raw = self._props_raw
        props = _properties_parser(raw) if raw else {}
        pending = self._props_pending
        if pending:
            props.update(pending)
        self._props = props
        self._props_raw = None
        self._props_pending = None
        return props

    @property
    def offset_msg_id(self) -> str:
        """The broker-side id: store host and port, then the commit-log offset (hex)."""
        oid = self._oid
        if oid is None and self._oid_host is not None:
            oid = self._oid = f"{self._oid_host}{self._oid_offset & 0xFFFFFFFFFFFFFFFF:016X}"
        return oid  # type: ignore[return-value]  # None only if None was assigned

    @offset_msg_id.setter
    def offset_msg_id(self, value: str) -> None:
        self._oid = value
        self._oid_host = None

    def get_property(self, name: str, default: str | None = None) -> str | None:
        """``properties.get(name, default)``; reading one property does not parse them all."""
        props = self._props
        if props is None:
            pending = self._props_pending
            if pending is not None and name in pending:
                return pending[name]
            raw = self._props_raw
            if raw is not None and _property_finder is not None and type(name) is str:
                # (Any other key, a str enum's member say, is looked up in the parsed dict.)
                value = _property_finder(raw, name)
                return default if value is None else value
            props = self._parse_properties()
        return props.get(name, default)

    def put_property(self, name: str, value: str) -> None:
        """``properties[name] = value``, without parsing properties nobody has read yet."""
        props = self._props
        if props is not None:
            props[name] = value
            return
        pending = self._props_pending
        if pending is None:
            self._props_pending = {name: value}
        else:  # possibly shared with other messages: replaced, not changed
            own = dict(pending)
            own[name] = value
            self._props_pending = own

    def put_properties(self, values: Mapping[str, str]) -> None:
        """``properties.update(values)``, without parsing properties nobody has read yet."""
        props = self._props
        if props is not None:
            props.update(values)
            return
        pending = self._props_pending
        if pending is None:
            self._props_pending = dict(values)
        else:  # possibly shared with other messages: replaced, not changed
            own = dict(pending)
            own.update(values)
            self._props_pending = own

    def _set_pending(self, pending: dict[str, str]) -> None:
        """Replace the pending properties (a dict that nobody changes in place)."""
        self._props_pending = pending


@dataclass(slots=True, eq=False)
class MessageExt(_LazyFields):
    """A stored message as read back from the broker (Java ``MessageExt``).

    Every field of the stored-record layout is kept. ``msg_id`` is the client id (UNIQ_KEY)
    when the producer set one, else ``offset_msg_id`` (Java ``MessageClientExt#getMsgId``).

    Decoded messages parse ``properties`` and format ``offset_msg_id`` on first access (a
    listener that reads only the body never pays for them); both behave as plain fields.
    ``put_property`` / ``put_properties`` / ``get_property`` do not force the parse.
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
        """The producer's unique id (``UNIQ_KEY``), else :attr:`offset_msg_id`."""
        return self.get_property(PROPERTY_UNIQ_KEY) or self.offset_msg_id

    @property
    def tags(self) -> str | None:
        """The message's tag (``TAGS`` property), ``None`` without one."""
        return self.get_property(PROPERTY_TAGS)

    @property
    def keys(self) -> list[str]:
        """The message's keys (``KEYS`` property, space-separated)."""
        raw = self.get_property(PROPERTY_KEYS)
        if not raw:
            return []
        return [k for k in raw.split(KEY_SEPARATOR) if k]

    @property
    def message_queue(self) -> MessageQueue:
        """The queue the message was read from."""
        return MessageQueue(self.topic, self.broker_name, self.queue_id)

    def __repr__(self) -> str:
        return (
            f"MessageExt(topic={self.topic!r}, queue_id={self.queue_id}, "
            f"queue_offset={self.queue_offset}, msg_id={self.msg_id!r}, tags={self.tags!r}, "
            f"body_len={len(self.body)}, reconsume_times={self.reconsume_times})"
        )

    def __getstate__(self) -> dict[str, Any]:
        # The fields, with lazy ones computed: a pickle does not depend on the decoder.
        return {f.name: getattr(self, f.name) for f in fields(self)}

    def __setstate__(self, state: dict[str, Any]) -> None:
        for name, value in state.items():
            setattr(self, name, value)


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

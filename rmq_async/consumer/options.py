"""Push consumer options: the Java client's settings, in snake_case, with its defaults.

A Java user finds what they know: ``pull_batch_size`` is ``pullBatchSize``, and so on. Units
follow one rule: **durations are seconds** (a float or a ``datetime.timedelta``), a start time is a
``datetime`` (``consume_timestamp``), and sizes ending in ``_size_for_*`` are MiB.

The Java setting names are accepted too (:data:`JAVA_OPTION_NAMES`), with their Java units:
``consumeTimeout=15`` is 15 minutes, ``pullInterval=500`` is 500 milliseconds, and each is
converted to the option it means. Java settings with no counterpart get a hint instead.

Everything is checked when the options are built (Java ``checkConfig`` ranges), and a bad value
raises :class:`InvalidOptionError` (a ``ValueError`` and a
:class:`~rmq_async.errors.RocketMQError`) naming the option.
"""

from __future__ import annotations

import base64
import contextlib
import dataclasses
import difflib
import functools
import hashlib
import hmac
import ipaddress
import os
import re
import socket
import ssl
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from enum import StrEnum
from pathlib import Path
from typing import Any, TypeVar

from rmq_async.consumer.allocate import AllocateAveragely, AllocateStrategy
from rmq_async.errors import InvalidArgumentError
from rmq_async.protocol.codes import INT32_MAX, LanguageCode
from rmq_async.remoting.tls import client_ssl_context

__all__ = [
    "DEFAULT_CONSUMER_GROUP",
    "DEFAULT_INSTANCE_NAME",
    "ConsumeFromWhere",
    "ConsumerOptions",
    "Credentials",
    "InvalidOptionError",
    "JAVA_OPTION_NAMES",
    "MessageModel",
    "build_client_id",
    "check_group_name",
    "check_tls_options",
    "default_client_ip",
    "pick_client_ip",
    "resolve_instance_name",
]

DEFAULT_CONSUMER_GROUP = "DEFAULT_CONSUMER"
"""Reserved by the broker; a push consumer may not use it (Java ``MixAll``)."""
DEFAULT_INSTANCE_NAME = "DEFAULT"

GROUP_MAX_LENGTH = 120
"""Longest accepted group name. The retry topic ``%RETRY%<group>`` must stay within the
broker's 127-character topic limit, so longer groups could not retry (the newest Java client
uses the same 120)."""

_NAME_RE = re.compile(r"^[%|a-zA-Z0-9_-]+$")
_TIMESTAMP_FORMAT = "%Y%m%d%H%M%S"


class InvalidOptionError(InvalidArgumentError):
    """An option value (or name) the consumer cannot work with; ``option`` names it."""

    def __init__(self, option: str, message: str) -> None:
        super().__init__(f"{option}: {message}")
        self.option = option


class MessageModel(StrEnum):
    """How a group shares a topic (Java ``MessageModel``; the value is sent in heartbeats)."""

    CLUSTERING = "CLUSTERING"
    """Each queue is consumed by one member of the group."""
    BROADCASTING = "BROADCASTING"
    """Every member consumes every queue; offsets are kept locally."""


class ConsumeFromWhere(StrEnum):
    """Where a group with no committed offset starts (Java ``ConsumeFromWhere``).

    The value is the Java enum name, as sent in heartbeats. The three deprecated members behave
    like LAST_OFFSET.
    """

    LAST_OFFSET = "CONSUME_FROM_LAST_OFFSET"
    FIRST_OFFSET = "CONSUME_FROM_FIRST_OFFSET"
    TIMESTAMP = "CONSUME_FROM_TIMESTAMP"
    LAST_OFFSET_AND_FROM_MIN_WHEN_BOOT_FIRST = (
        "CONSUME_FROM_LAST_OFFSET_AND_FROM_MIN_WHEN_BOOT_FIRST"
    )
    MIN_OFFSET = "CONSUME_FROM_MIN_OFFSET"
    MAX_OFFSET = "CONSUME_FROM_MAX_OFFSET"

    @property
    def effective(self) -> ConsumeFromWhere:
        """The member the client actually acts on (deprecated ones map to LAST_OFFSET)."""
        if self in (ConsumeFromWhere.FIRST_OFFSET, ConsumeFromWhere.TIMESTAMP):
            return self
        return ConsumeFromWhere.LAST_OFFSET


_E = TypeVar("_E", bound=StrEnum)


def _enum_member(enum: type[_E], option: str, value: object) -> _E:
    if isinstance(value, enum):
        return value
    if isinstance(value, str):
        text = value.strip().upper()
        for member in enum:
            if text in (member.value, member.name, f"CONSUME_FROM_{member.name}"):
                return member
    choices = ", ".join(m.name for m in enum)
    raise InvalidOptionError(option, f"{value!r} is not one of {choices}")


# ---------------------------------------------------------------------- ACL credentials


@dataclass(frozen=True, slots=True)
class Credentials:
    """ACL account for a broker with access control (Java ``SessionCredentials``)."""

    access_key: str
    secret_key: str = field(repr=False)
    security_token: str | None = field(default=None, repr=False)

    def signature(self, fields: Mapping[str, str], body: bytes | None) -> str:
        """The ``Signature`` of a request whose ext fields (signing keys included) are given.

        Field values sorted by key (Java ``String.compareTo``) and concatenated, followed by the
        body; HMAC-SHA1 with the secret key; standard Base64.
        """
        parts = [
            v for k, v in sorted(fields.items(), key=lambda kv: kv[0].encode("utf-16-be"))
            if k != "Signature"
        ]
        content = "".join(parts).encode("utf-8") + (body or b"")
        digest = hmac.new(self.secret_key.encode("utf-8"), content, hashlib.sha1).digest()
        return base64.b64encode(digest).decode("ascii")

    def sign_fields(self, fields: dict[str, str], body: bytes | None) -> None:
        """Add ``AccessKey`` (and ``SecurityToken``) then ``Signature`` to ``fields`` in place."""
        fields["AccessKey"] = self.access_key
        if self.security_token:
            fields["SecurityToken"] = self.security_token
        fields.pop("Signature", None)
        fields["Signature"] = self.signature(fields, body)

    def rpc_hook(self) -> Callable[[Any], None]:
        """A hook that signs each outgoing command with these credentials.

        It adds ``AccessKey`` [``SecurityToken``] and ``Signature`` to the command's
        ``ext_fields`` (creating the dict if it is ``None``), signing over its ``body``.
        """

        def sign(cmd: Any) -> None:
            fields = cmd.ext_fields
            if fields is None:
                fields = {}
                cmd.ext_fields = fields
            self.sign_fields(fields, cmd.body)

        return sign

    @classmethod
    def coerce(cls, value: object) -> Credentials | None:
        if value is None or isinstance(value, Credentials):
            return value
        if (
            isinstance(value, tuple | list)
            and len(value) in (2, 3)
            and all(isinstance(v, str) for v in value)
            and value[0]
            and value[1]
        ):
            token = value[2] if len(value) == 3 else None
            return cls(value[0], value[1], token or None)
        raise InvalidOptionError(
            "credentials",
            "expected (access_key, secret_key) or (access_key, secret_key, security_token) "
            "with non-empty strings",
        )


# ---------------------------------------------------------------------- TLS


def check_tls_options(tls: object, tls_verify: object, tls_ca_file: object,
                      ssl_context: object) -> None:
    """Validate the TLS options consumers and producers share (see :class:`ConsumerOptions`)."""
    for name, value in (("tls", tls), ("tls_verify", tls_verify)):
        if not isinstance(value, bool):
            raise InvalidOptionError(name, f"expected a bool, got {value!r}")
    if tls_ca_file is not None:
        if not isinstance(tls_ca_file, str | os.PathLike):
            raise InvalidOptionError("tls_ca_file", f"expected a path, got {tls_ca_file!r}")
        if not os.path.isfile(tls_ca_file):
            raise InvalidOptionError("tls_ca_file", f"{os.fspath(tls_ca_file)!r} is not a file")
    if ssl_context is not None:
        if not isinstance(ssl_context, ssl.SSLContext):
            raise InvalidOptionError(
                "ssl_context", f"expected an ssl.SSLContext, got {ssl_context!r}")
        if tls_ca_file is not None or tls_verify is not True:
            raise InvalidOptionError(
                "ssl_context", "a ready context carries its own trust settings: set them on it "
                "instead of passing tls_verify or tls_ca_file")
    elif tls_verify is not True and not tls and tls_ca_file is None:
        raise InvalidOptionError("tls_verify", "only applies with TLS on (tls=True)")


# ---------------------------------------------------------------------- client id


def _is_internal_ipv4(addr: ipaddress.IPv4Address) -> bool:
    # Java UtilAll.isInternalIP: 10/8, 127/8, 172.16/12, 192.168/16.
    a, b = addr.packed[0], addr.packed[1]
    return a in (10, 127) or (a == 172 and 16 <= b <= 31) or (a == 192 and b == 168)


def pick_client_ip(candidates: Iterable[str]) -> str:
    """Java ``NetworkUtil.getLocalAddress`` choice among local IPv4 addresses.

    Loopback addresses are skipped; the first public address wins, else the last private one;
    ``127.0.0.1`` when there is none.
    """
    usable: list[ipaddress.IPv4Address] = []
    for text in candidates:
        try:
            addr = ipaddress.IPv4Address(text)
        except ValueError:
            continue
        if addr.is_loopback or addr.is_unspecified:
            continue
        usable.append(addr)
    for addr in usable:
        if not _is_internal_ipv4(addr):
            return str(addr)
    if usable:
        return str(usable[-1])
    return "127.0.0.1"


def _interface_ipv4_addresses() -> list[str]:
    """IPv4 addresses of the interfaces that are up (Linux: not loopback, bridge or ppp)."""
    found: list[str] = []
    try:
        import fcntl
        import struct
    except ImportError:  # not a POSIX platform
        return found
    siocgifflags, siocgifaddr = 0x8913, 0x8915
    iff_up, iff_loopback, iff_pointopoint = 0x1, 0x8, 0x10
    try:
        names = [name for _, name in socket.if_nameindex()]
    except OSError:
        return found
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for name in names:
            if os.path.exists(f"/sys/class/net/{name}/bridge"):
                continue
            req = struct.pack("256s", name.encode()[:15])
            try:
                flags = struct.unpack("H", fcntl.ioctl(s.fileno(), siocgifflags, req)[16:18])[0]
                if not flags & iff_up or flags & (iff_loopback | iff_pointopoint):
                    continue
                raw = fcntl.ioctl(s.fileno(), siocgifaddr, req)
            except OSError:
                continue
            found.append(socket.inet_ntoa(raw[20:24]))
    return found


def _routed_ipv4_address() -> str | None:
    # The source address the kernel would use to reach a public address; nothing is sent.
    with contextlib.suppress(OSError), socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect(("192.0.2.1", 9))
        return str(s.getsockname()[0])
    return None


@functools.cache
def default_client_ip() -> str:
    """This host's address as the Java client picks it (computed once per process)."""
    candidates = _interface_ipv4_addresses()
    if not candidates:
        routed = _routed_ipv4_address()
        if routed:
            candidates = [routed]
    return pick_client_ip(candidates)


_last_nano = 0


def _unique_nanos() -> int:
    # Java System.nanoTime(); strictly increasing here so two consumers of one process never
    # share an instance name.
    global _last_nano
    now = time.monotonic_ns()
    if now <= _last_nano:
        now = _last_nano + 1
    _last_nano = now
    return now


def resolve_instance_name(
    instance_name: str,
    model: MessageModel,
    *,
    pid: int | None = None,
    nanos: int | None = None,
) -> str:
    """Java ``changeInstanceNameToPID``: a clustering consumer named ``DEFAULT`` becomes
    ``<pid>#<nanoTime>``, so several processes (or consumers) on one host get distinct ids."""
    if model is MessageModel.CLUSTERING and instance_name == DEFAULT_INSTANCE_NAME:
        if pid is None:
            pid = os.getpid()
        if nanos is None:
            nanos = _unique_nanos()
        return f"{pid}#{nanos}"
    return instance_name


def build_client_id(
    ip: str, instance_name: str, unit_name: str | None, model: MessageModel
) -> str:
    """The client id the broker knows this consumer by (Java ``buildMQClientId``):
    ``ip@instance[@unit]``, after the instance-name rewrite of :func:`resolve_instance_name`."""
    cid = f"{ip}@{resolve_instance_name(instance_name, model)}"
    if unit_name and unit_name.strip():
        cid += f"@{unit_name}"
    return cid


# ---------------------------------------------------------------------- validation helpers


def check_group_name(group: object, *, option: str = "consumer_group",
                     reserved: str = DEFAULT_CONSUMER_GROUP) -> str:
    """Java ``Validators.checkGroup`` plus the reserved-name rule of the push consumer (or,
    with ``reserved="DEFAULT_PRODUCER"``, of the producer)."""
    if not isinstance(group, str) or not group.strip():
        raise InvalidOptionError(option, "the group name is blank")
    if len(group) > GROUP_MAX_LENGTH:
        raise InvalidOptionError(
            option,
            f"{group!r} is longer than {GROUP_MAX_LENGTH} characters ({len(group)})",
        )
    if not _NAME_RE.fullmatch(group):
        raise InvalidOptionError(
            option,
            f"{group!r} contains illegal characters, allowing only ^[%|a-zA-Z0-9_-]+$",
        )
    if group == reserved:
        raise InvalidOptionError(
            option,
            f"{reserved} is reserved by the broker, please specify another one",
        )
    return group


#: Java ``TopicValidator.TOPIC_MAX_LENGTH``.
TOPIC_MAX_LENGTH = 127


def check_topic_name(topic: object) -> str:
    """Java ``TopicValidator.validateTopic``: a non-blank name of at most 127 characters of
    ``[%|a-zA-Z0-9_-]``."""
    if not isinstance(topic, str) or not topic.strip():
        raise InvalidArgumentError("the topic name is blank")
    if len(topic) > TOPIC_MAX_LENGTH:
        raise InvalidArgumentError(f"topic {topic[:40]!r}... is longer than {TOPIC_MAX_LENGTH} "
                                   f"characters ({len(topic)})")
    if not _NAME_RE.fullmatch(topic):
        raise InvalidArgumentError(f"topic {topic!r} contains illegal characters, allowing only "
                                   "^[%|a-zA-Z0-9_-]+$")
    return topic


def _default_consume_timestamp() -> datetime:
    return (datetime.now() - timedelta(minutes=30)).replace(microsecond=0)


def _default_offset_store_dir() -> Path:
    return Path.home() / ".rocketmq_offsets"


_DEFAULT_CONCURRENCY = 20  # Java's consumeThreadMin


def _is_number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _int_in(name: str, value: object, lo: int, hi: int, *, off: int | None = None) -> None:
    if not isinstance(value, int) or isinstance(value, bool):
        raise InvalidOptionError(name, f"expected an int, got {value!r}")
    if off is not None and value == off:
        return
    if not lo <= value <= hi:
        extra = f" (or {off} to disable)" if off is not None else ""
        raise InvalidOptionError(name, f"{value} is out of range [{lo}, {hi}]{extra}")


def _as_seconds(value: object) -> object:
    """A ``timedelta`` as float seconds; anything else unchanged (checked by :func:`_seconds`)."""
    if isinstance(value, timedelta):
        return value.total_seconds()
    return value


def _seconds(
    name: str,
    value: object,
    *,
    allow_zero: bool = False,
    hi: float | None = None,
    unit: str = "seconds",
) -> None:
    if not _is_number(value):
        raise InvalidOptionError(name, f"expected a number of {unit}, got {value!r}")
    v = float(value)  # type: ignore[arg-type]
    if v != v or v < 0 or (v == 0 and not allow_zero):
        bound = ">= 0" if allow_zero else "> 0"
        raise InvalidOptionError(name, f"{value!r} must be {bound} {unit}")
    if hi is not None and v > hi:
        raise InvalidOptionError(name, f"{value!r} is above the maximum of {hi} {unit}")


def _camel_to_snake(name: str) -> str:
    return re.sub(r"(?<=[a-z0-9])([A-Z])", r"_\1", name).lower()


# ---------------------------------------------------------------------- the options


@dataclass(frozen=True, slots=True)
class ConsumerOptions:
    """Every setting of a push consumer. Build it with :meth:`from_kwargs`."""

    consumer_group: str

    # -- model and start position
    message_model: MessageModel = MessageModel.CLUSTERING
    consume_from_where: ConsumeFromWhere = ConsumeFromWhere.LAST_OFFSET
    consume_timestamp: datetime = field(default_factory=_default_consume_timestamp)
    """Where CONSUME_FROM_TIMESTAMP starts. A naive ``datetime`` is local time (as Java reads its
    string); Java's ``"yyyyMMddHHmmss"`` string is accepted and converted. Default: 30 min ago.
    The start is the broker's SEARCH_OFFSET_BY_TIMESTAMP answer, as in Java: on 5.x the first
    message stored at or after the time, on 4.x the message stored nearest to it."""
    allocate_strategy: AllocateStrategy = field(default_factory=AllocateAveragely)

    # -- pulling
    pull_batch_size: int = 32
    pull_interval: float = 0.0
    """Seconds to wait after a pull that found messages before the next one."""
    pull_threshold_for_queue: int = 1000
    pull_threshold_size_for_queue: int = 100
    """MiB of message bodies cached per queue before pulling pauses."""
    pull_threshold_for_topic: int = -1
    """Messages cached per topic (split evenly over its queues); -1 = off."""
    pull_threshold_size_for_topic: int = -1
    """MiB cached per topic (split evenly over its queues); -1 = off."""
    post_subscription_when_pull: bool = False

    # -- consuming
    consume_concurrently_max_span: int = 2000
    consume_message_batch_max_size: int = 1
    consume_concurrency: int = _DEFAULT_CONCURRENCY
    """Concurrent listener calls (Java ``consumeThreadMin``; ``consumeThreadMax`` is only
    checked, see :data:`JAVA_OPTION_NAMES`)."""
    max_reconsume_times: int = -1
    """-1: 16 for concurrent listeners, unlimited for orderly ones."""
    consume_timeout: float = 900.0
    """Seconds: a cached message whose consumption started longer ago is sent back for retry
    (Java ``consumeTimeout``, 15 minutes): a call that made no progress for that long, as a
    cleaner that looks every ``consume_timeout`` sees it (see the delivery guide)."""
    suspend_current_queue_time: float = 1.0
    """Orderly: seconds to pause before a failed batch is retried (Java
    ``suspendCurrentQueueTimeMillis``, 1000 ms); kept within 10 ms and 30 s, as Java keeps it."""

    # -- identity
    instance_name: str = DEFAULT_INSTANCE_NAME
    unit_name: str | None = None
    client_ip: str = field(default_factory=default_client_ip)
    language: str = "PYTHON"
    """The ``LanguageCode`` name a heartbeat carries (Java ``language``, which Java sends on
    heartbeats only): brokers record it per client and admin tools show it in the group's
    connections. Any case; kept upper-case."""

    # -- periodic work (seconds)
    persist_offset_interval: float = 5.0
    heartbeat_interval: float = 30.0
    route_refresh_interval: float = 30.0
    rebalance_interval: float = 20.0
    api_timeout: float = 3.0
    """Timeout of route, heartbeat, consumer-list, offset and lock requests."""

    # -- pull delays and long polling (seconds)
    pull_time_delay_when_exception: float = 1.0
    pull_time_delay_when_flow_control: float = 0.05
    pull_time_delay_when_broker_flow_control: float = 0.02
    pull_time_delay_when_suspend: float = 1.0
    broker_suspend_max_time: float = 15.0
    """How long the broker holds a pull open when there is nothing new (long polling)."""
    consumer_timeout_when_suspend: float = 30.0
    """Client-side timeout of a long-poll pull."""
    pull_max_idle_time: float = 120.0

    # -- orderly locking (seconds)
    rebalance_lock_interval: float = 20.0
    rebalance_lock_max_live_time: float = 30.0
    max_time_consume_continuously: float = 60.0

    # -- storage and transport
    offset_store_dir: Path = field(default_factory=_default_offset_store_dir)
    """Broadcasting: local offsets live in ``<dir>/<client id>/<group>/offsets.json``."""
    credentials: Credentials | None = None
    """ACL account; ``(access_key, secret_key[, security_token])`` is accepted too."""
    tls: bool = False
    """TLS to name servers and brokers (Java ``useTLS``); certificates are verified."""
    tls_verify: bool = True
    """``False`` accepts any certificate (logged as a warning when the consumer starts)."""
    tls_ca_file: str | os.PathLike[str] | None = None
    """PEM file of the CAs to trust instead of the system's; implies ``tls``."""
    ssl_context: ssl.SSLContext | None = None
    """A ready TLS context, used as given (implies ``tls``; not with ``tls_verify`` or
    ``tls_ca_file``)."""

    def __post_init__(self) -> None:
        set_ = functools.partial(object.__setattr__, self)
        check_group_name(self.consumer_group)
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if isinstance(value, timedelta):
                set_(f.name, _as_seconds(value))
        set_("message_model", _enum_member(MessageModel, "message_model", self.message_model))
        set_(
            "consume_from_where",
            _enum_member(ConsumeFromWhere, "consume_from_where", self.consume_from_where),
        )
        self._check_timestamp()
        strategy = self.allocate_strategy
        if not isinstance(getattr(strategy, "name", None), str) or not callable(
            getattr(strategy, "allocate", None)
        ):
            raise InvalidOptionError(
                "allocate_strategy",
                f"{strategy!r} has no 'name' string and 'allocate(group, cid, mq_all, cid_all)'",
            )

        _int_in("pull_batch_size", self.pull_batch_size, 1, 1024)
        _int_in("pull_threshold_for_queue", self.pull_threshold_for_queue, 1, 65535)
        _int_in("pull_threshold_size_for_queue", self.pull_threshold_size_for_queue, 1, 1024)
        _int_in("pull_threshold_for_topic", self.pull_threshold_for_topic, 1, 6553500, off=-1)
        _int_in(
            "pull_threshold_size_for_topic", self.pull_threshold_size_for_topic, 1, 102400, off=-1
        )
        _seconds("pull_interval", self.pull_interval, allow_zero=True, hi=65.535)
        _int_in("consume_concurrently_max_span", self.consume_concurrently_max_span, 1, 65535)
        _int_in("consume_message_batch_max_size", self.consume_message_batch_max_size, 1, 1024)
        _int_in("consume_concurrency", self.consume_concurrency, 1, 1000)
        _int_in("max_reconsume_times", self.max_reconsume_times, -1, INT32_MAX)
        _seconds("consume_timeout", self.consume_timeout)
        _seconds("suspend_current_queue_time", self.suspend_current_queue_time, allow_zero=True,
                 hi=INT32_MAX / 1000.0)
        for name in (
            "persist_offset_interval",
            "heartbeat_interval",
            "route_refresh_interval",
            "rebalance_interval",
            "api_timeout",
            "broker_suspend_max_time",
            "consumer_timeout_when_suspend",
            "pull_max_idle_time",
            "rebalance_lock_interval",
            "rebalance_lock_max_live_time",
            "max_time_consume_continuously",
            # A queue over its limits, or paused, is pulled again after this: 0 would pull at
            # once, turning flow control and pause() off (Java's are fixed, 50 ms and 1 s).
            "pull_time_delay_when_flow_control",
            "pull_time_delay_when_suspend",
        ):
            _seconds(name, getattr(self, name))
        for name in (
            "pull_time_delay_when_exception",
            "pull_time_delay_when_broker_flow_control",
        ):
            _seconds(name, getattr(self, name), allow_zero=True)
        if self.consumer_timeout_when_suspend <= self.broker_suspend_max_time:
            raise InvalidOptionError(
                "consumer_timeout_when_suspend",
                f"{self.consumer_timeout_when_suspend} s must be longer than "
                f"broker_suspend_max_time ({self.broker_suspend_max_time} s), or every idle "
                "long poll would time out on the client",
            )

        for name in ("instance_name", "client_ip", "language"):
            value = getattr(self, name)
            if not isinstance(value, str) or not value.strip():
                raise InvalidOptionError(name, f"expected a non-empty string, got {value!r}")
        language = self.language.strip().upper()
        if language not in LanguageCode.__members__:
            raise InvalidOptionError(
                "language", f"{self.language!r} is not a LanguageCode name "
                f"({', '.join(LanguageCode.__members__)})")
        object.__setattr__(self, "language", language)
        if self.unit_name is not None and not isinstance(self.unit_name, str):
            raise InvalidOptionError("unit_name", f"expected a string, got {self.unit_name!r}")
        if not isinstance(self.post_subscription_when_pull, bool):
            raise InvalidOptionError(
                "post_subscription_when_pull",
                f"expected a bool, got {self.post_subscription_when_pull!r}",
            )
        if not isinstance(self.offset_store_dir, str | os.PathLike):
            raise InvalidOptionError(
                "offset_store_dir", f"expected a path, got {self.offset_store_dir!r}"
            )
        set_("offset_store_dir", Path(self.offset_store_dir).expanduser())
        set_("credentials", Credentials.coerce(self.credentials))
        check_tls_options(self.tls, self.tls_verify, self.tls_ca_file, self.ssl_context)
        if self.tls_ca_file is not None:
            set_("tls_ca_file", os.fspath(self.tls_ca_file))

    def _check_timestamp(self) -> None:
        ts: object = self.consume_timestamp
        if isinstance(ts, datetime):
            return
        parsed: datetime | None = None
        if isinstance(ts, str) and len(ts) == 14 and ts.isdigit():
            try:
                parsed = datetime.strptime(ts, _TIMESTAMP_FORMAT)
            except ValueError:
                parsed = None
        if parsed is None:
            raise InvalidOptionError(
                "consume_timestamp",
                f"{ts!r} is neither a datetime nor a valid yyyyMMddHHmmss timestamp",
            )
        object.__setattr__(self, "consume_timestamp", parsed)

    # ------------------------------------------------------------------ derived values

    def consume_timestamp_ms(self) -> int:
        """``consume_timestamp`` as epoch milliseconds (a naive one read as local time, like
        Java)."""
        return int(self.consume_timestamp.timestamp() * 1000)

    def effective_max_reconsume_times(self, orderly: bool) -> int:
        """``max_reconsume_times`` with -1 resolved: 16 (concurrent), 2**31-1 (orderly)."""
        if self.max_reconsume_times == -1:
            return INT32_MAX if orderly else 16
        return self.max_reconsume_times

    @property
    def tls_enabled(self) -> bool:
        return self.tls or self.tls_ca_file is not None or self.ssl_context is not None

    def client_ssl_context(self, client: str) -> ssl.SSLContext | None:
        """The TLS context of the client's connections (``None``: plain TCP); warns once when it
        does not verify certificates, so call it once per client start."""
        return client_ssl_context(
            tls=self.tls_enabled, tls_verify=self.tls_verify, tls_ca_file=self.tls_ca_file,
            ssl_context=self.ssl_context, client=client,
        )

    def rpc_hook(self) -> Callable[[Any], None] | None:
        """A hook that ACL-signs each outgoing command (:meth:`Credentials.rpc_hook`), or
        ``None`` without credentials."""
        return None if self.credentials is None else self.credentials.rpc_hook()

    def replace(self, **changes: Any) -> ConsumerOptions:
        """A copy with some options changed (validated like the original); Java names are
        accepted as in :meth:`from_kwargs`."""
        return dataclasses.replace(
            self, **_python_options(changes, concurrency=self.consume_concurrency))

    # ------------------------------------------------------------------ construction

    @classmethod
    def from_kwargs(cls, group: str, **kwargs: Any) -> ConsumerOptions:
        """Options for consumer group ``group``.

        Keywords are the option names, or the Java setting names of :data:`JAVA_OPTION_NAMES`
        with their Java units; an unknown keyword is an error with a hint.
        """
        return cls(group, **_python_options(kwargs))


def _option_names() -> list[str]:
    return [f.name for f in dataclasses.fields(ConsumerOptions) if f.name != "consumer_group"]


def _millis(value: Any) -> Any:
    return value / 1000.0 if _is_number(value) else value


def _minutes(value: Any) -> Any:
    return value * 60.0 if _is_number(value) else value


def _same(value: Any) -> Any:
    return value


JAVA_OPTION_NAMES: dict[str, tuple[str, str]] = {
    "messageModel": ("message_model", ""),
    "consumeFromWhere": ("consume_from_where", ""),
    "consumeTimestamp": ("consume_timestamp", "yyyyMMddHHmmss string or datetime"),
    "pullBatchSize": ("pull_batch_size", ""),
    "pullInterval": ("pull_interval", "ms"),
    "pullThresholdForQueue": ("pull_threshold_for_queue", ""),
    "pullThresholdSizeForQueue": ("pull_threshold_size_for_queue", "MiB"),
    "pullThresholdForTopic": ("pull_threshold_for_topic", ""),
    "pullThresholdSizeForTopic": ("pull_threshold_size_for_topic", "MiB"),
    "postSubscriptionWhenPull": ("post_subscription_when_pull", ""),
    "consumeConcurrentlyMaxSpan": ("consume_concurrently_max_span", ""),
    "consumeMessageBatchMaxSize": ("consume_message_batch_max_size", ""),
    "consumeThreadMin": ("consume_concurrency", "threads"),
    "consumeThreadMax": ("consume_concurrency", "ceiling"),
    "maxReconsumeTimes": ("max_reconsume_times", ""),
    "consumeTimeout": ("consume_timeout", "minutes"),
    "suspendCurrentQueueTimeMillis": ("suspend_current_queue_time", "ms"),
    "instanceName": ("instance_name", ""),
    "unitName": ("unit_name", ""),
    "clientIP": ("client_ip", ""),
    "language": ("language", ""),
    "persistConsumerOffsetInterval": ("persist_offset_interval", "ms"),
    "heartbeatBrokerInterval": ("heartbeat_interval", "ms"),
    "pollNameServerInterval": ("route_refresh_interval", "ms"),
    "mqClientApiTimeout": ("api_timeout", "ms"),
    "pullTimeDelayMillsWhenException": ("pull_time_delay_when_exception", "ms"),
    "useTLS": ("tls", ""),
}
"""Java ``DefaultMQPushConsumer`` / ``ClientConfig`` setting -> (option, Java unit).

Each is accepted as a keyword with its Java unit and converted: ``ms`` values are divided by
1000, ``minutes`` multiplied by 60. ``consumeThreadMin`` sets ``consume_concurrency``: the
Java pool runs that many threads (its queue is unbounded, so it never grows to the maximum).
``consumeThreadMax`` is only checked as Java checks it (1 to 1000, and not below the
concurrency, given or the default 20) and changes nothing."""

_JAVA_CONVERTERS: dict[str, Callable[[Any], Any]] = {"ms": _millis, "minutes": _minutes}

# Older snake_case names that meant the same thing in another unit.
_LEGACY_NAMES: dict[str, tuple[str, Callable[[Any], Any]]] = {
    "suspend_current_queue_time_millis": ("suspend_current_queue_time", _millis),
}

# Java setting names with no option of the same meaning: a hint only.
_JAVA_HINTS = {
    "allocateMessageQueueStrategy": "allocate_strategy",
    "consumerGroup": "consumer_group (the first argument)",
    "namesrvAddr": "namesrv (a constructor argument)",
    "rpcHook": "credentials",
}


def _python_options(kwargs: Mapping[str, Any],
                    concurrency: int = _DEFAULT_CONCURRENCY) -> dict[str, Any]:
    """``kwargs`` with Java (and legacy) names converted to options; unknown names rejected.

    ``concurrency`` is the ``consume_concurrency`` in force when ``kwargs`` leave it as it is
    (``consumeThreadMax`` may not be below it)."""
    names = set(_option_names())
    out: dict[str, Any] = {}
    sources: dict[str, str] = {}
    ceiling: Any = None
    for key, value in kwargs.items():
        if key in names:
            target, converted = key, value
        elif key in JAVA_OPTION_NAMES:
            target, unit = JAVA_OPTION_NAMES[key]
            if unit == "ceiling":
                ceiling = value
                continue
            converted = _JAVA_CONVERTERS.get(unit, _same)(value)
        elif key in _LEGACY_NAMES:
            target, convert = _LEGACY_NAMES[key]
            converted = convert(value)
        else:
            raise _unknown_option(key)
        if target in out:
            raise InvalidOptionError(
                key, f"sets {target!r}, which {sources[target]!r} already sets"
            )
        out[target] = converted
        sources[target] = key
    if ceiling is not None:
        # Java's checkConfig: each within [1, 1000], and the core size not above the maximum.
        _int_in("consumeThreadMax", ceiling, 1, 1000)
        threads = out.get("consume_concurrency", concurrency)
        if _is_number(threads) and threads > ceiling:
            raise InvalidOptionError(
                "consumeThreadMax",
                f"{ceiling} is below the {threads} concurrent calls "
                f"({sources.get('consume_concurrency', 'the default')}); Java refuses a "
                "consumeThreadMin larger than consumeThreadMax",
            )
    return out


def _unknown_option(key: str) -> InvalidOptionError:
    names = _option_names()
    snake = _camel_to_snake(key)
    if key in _JAVA_HINTS:
        guesses = [_JAVA_HINTS[key]]
    elif snake in names:
        guesses = [snake]
    else:
        guesses = difflib.get_close_matches(key, names, n=3)
    hint = f"; did you mean {' or '.join(repr(g) for g in guesses)}?" if guesses else ""
    return InvalidOptionError(key, f"unknown consumer option{hint}")

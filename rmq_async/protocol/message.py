"""Stored messages: the record layout of a PULL_MESSAGE body, properties, message ids.

A pull body is a plain concatenation of records written by the broker's commit log::

    int32 totalSize | int32 magic | int32 bodyCRC | int32 queueId | int32 flag
    int64 queueOffset | int64 commitLogOffset | int32 sysFlag | int64 bornTimestamp
    bornHost (4+4 or 16+4) | int64 storeTimestamp | storeHost (4+4 or 16+4)
    int32 reconsumeTimes | int64 preparedTransactionOffset
    int32 bodyLength, body | int8 (v1) or int16 (v2) topicLength, topic | int16 propsLength, props

The decoder reads with precompiled ``struct`` formats straight from the buffer (one ``unpack``
for the fixed part of the common IPv4 record), checks every length against the record and the
buffer before slicing, and raises :class:`ProtocolError` for anything malformed.
"""

from __future__ import annotations

import hashlib
import ipaddress
import itertools
import os
import secrets
import struct
import time
import zlib
from collections.abc import Callable, Iterable, Mapping
from datetime import datetime
from pathlib import Path
from typing import Any

import lz4.frame as lz4_frame
import structlog
import zstandard

from rmq_async.errors import InvalidArgumentError

from .codes import (
    COMPRESSION_LZ4,
    COMPRESSION_TYPE_MASK,
    COMPRESSION_ZLIB,
    COMPRESSION_ZSTD,
    MSG_BORNHOST_V6_FLAG,
    MSG_COMPRESSED_FLAG,
    MSG_INNER_BATCH_FLAG,
    MSG_NEED_UNWRAP_FLAG,
    MSG_STOREHOST_V6_FLAG,
)
from .command import set_json_header_parser
from .errors import BodyDecompressionError, ProtocolError
from .types import Message, MessageExt, _LazyFields, set_properties_parser

__all__ = [
    "BodyDecompressionError",
    "DEFAULT_MAX_BODY_SIZE",
    "IMPLEMENTATION",
    "MAGIC_V1",
    "MAGIC_V2",
    "NAME_VALUE_SEPARATOR",
    "PROPERTY_SEPARATOR",
    "ProtocolError",
    "UniqKeyGenerator",
    "body_crc",
    "compress_body",
    "decode_message",
    "decode_messages",
    "decode_properties",
    "encode_batch",
    "encode_properties",
    "encode_stored_message",
    "offset_msg_id",
    "parse_host",
]

MAGIC_V1 = -626843481  # 0xDAA320A7
MAGIC_V2 = -626843477  # 0xDAA320AB
NAME_VALUE_SEPARATOR = "\x01"
PROPERTY_SEPARATOR = "\x02"

DEFAULT_MAX_BODY_SIZE = 128 * 1024 * 1024
"""Largest body a compressed message may inflate to before it is refused."""

# Fixed part of a record whose born and store hosts are both IPv4 (the common case).
_FIXED_V4 = struct.Struct(">iiiiiqqiqIiqIiiqi")
# Pieces for the general case.
_HEAD = struct.Struct(">iiiiiqqiq")  # up to and including bornTimestamp
_HOST4 = struct.Struct(">Ii")
_HOST6 = struct.Struct(">16si")
_I64 = struct.Struct(">q")
_TAIL = struct.Struct(">iqi")  # reconsumeTimes, preparedTransactionOffset, bodyLength
_I16 = struct.Struct(">h")
_I32 = struct.Struct(">i")
_BATCH_HEAD = struct.Struct(">iiiii")  # totalSize, magic, bodyCRC, flag, bodyLength
_MSGID_TAIL = struct.Struct(">iq")

_HEAD_SIZE = _HEAD.size  # 48
_MIN_RECORD = _HEAD_SIZE + 8 + 8 + 8 + _TAIL.size + 1 + 2  # IPv4 hosts, v1, empty body
_MIN_BATCH_RECORD = _BATCH_HEAD.size + 2

# host key -> ("ip:port", upper-case hex of address + port for offsetMsgId)
_HostInfo = tuple[str, str]
_HOST_CACHE: dict[Any, _HostInfo] = {}
_HOST_CACHE_MAX = 4096


def _host4(ip: int, port: int) -> _HostInfo:
    key = (ip << 32) | (port & 0xFFFFFFFF)
    info = _HOST_CACHE.get(key)
    if info is None:
        text = f"{ip >> 24}.{(ip >> 16) & 0xFF}.{(ip >> 8) & 0xFF}.{ip & 0xFF}:{port}"
        info = (text, f"{ip:08X}{port & 0xFFFFFFFF:08X}")
        if len(_HOST_CACHE) >= _HOST_CACHE_MAX:
            _HOST_CACHE.clear()
        _HOST_CACHE[key] = info
    return info


def _host6(addr: bytes, port: int) -> _HostInfo:
    key = (addr, port)
    info = _HOST_CACHE.get(key)
    if info is None:
        text = f"[{ipaddress.IPv6Address(addr).compressed}]:{port}"
        info = (text, f"{addr.hex().upper()}{port & 0xFFFFFFFF:08X}")
        if len(_HOST_CACHE) >= _HOST_CACHE_MAX:
            _HOST_CACHE.clear()
        _HOST_CACHE[key] = info
    return info


# ---------------------------------------------------------------------------------------------
# Properties


def decode_properties(text: str) -> dict[str, str]:
    """Parse a properties string (``name \\x01 value \\x02`` ...) with Java's rules.

    A pair survives only with a non-empty name and a non-empty value; the value may contain
    ``\\x01``; later duplicates win.
    """
    return _decode_properties_impl(text)


def _py_decode_properties(text: str) -> dict[str, str]:
    out: dict[str, str] = {}
    for segment in text.split(PROPERTY_SEPARATOR):
        name, _, value = segment.partition(NAME_VALUE_SEPARATOR)
        if name and value:
            out[name] = value
    return out


def encode_properties(properties: Mapping[str, str | None]) -> str:
    """Build a properties string as Java does: ``name\\x01value\\x02`` per pair, ``None`` skipped.

    Names containing a separator and values containing ``\\x02`` cannot be read back, so they
    raise :class:`ValueError` (Java would silently corrupt the message).
    """
    parts: list[str] = []
    for name, value in properties.items():
        if value is None:
            continue
        if not name or NAME_VALUE_SEPARATOR in name or PROPERTY_SEPARATOR in name:
            raise InvalidArgumentError(f"invalid property name {name!r}")
        if PROPERTY_SEPARATOR in value:
            raise InvalidArgumentError(f"property {name!r} has a value containing \\x02")
        parts.append(f"{name}{NAME_VALUE_SEPARATOR}{value}{PROPERTY_SEPARATOR}")
    return "".join(parts)


# ---------------------------------------------------------------------------------------------
# Ids and checksums


def offset_msg_id(host_bytes: bytes, port: int, commit_log_offset: int) -> str:
    """The broker-side message id: store address + port + commit-log offset, upper-case hex."""
    if len(host_bytes) not in (4, 16):
        raise InvalidArgumentError("host address must be 4 or 16 bytes")
    return (host_bytes + _MSGID_TAIL.pack(port, commit_log_offset)).hex().upper()


def body_crc(body: bytes) -> int:
    """BODYCRC as the broker stores it: CRC-32 of the stored body, masked to 31 bits."""
    return zlib.crc32(body) & 0x7FFFFFFF


class UniqKeyGenerator:
    """Client message ids (``UNIQ_KEY``) laid out as Java's ``MessageClientIDSetter`` does.

    ``address (4 or 16 bytes) | pid (int16) | instance hash (int32) | ms since the start of the
    current local month (int32) | counter (int16)`` in upper-case hex: 32 characters for an
    IPv4 address. Pass the client's own ``ip``; without it a stand-in address derived from the
    clock is used, as Java does when it cannot find one. ``seed`` replaces Java's class-loader
    hash (random by default).
    """

    __slots__ = ("_counter", "_next_start_ms", "_prefix", "_start_ms")

    def __init__(
        self, ip: bytes | str | None = None, *, pid: int | None = None, seed: int | None = None
    ) -> None:
        if ip is None:
            address = struct.pack(">q", time.time_ns() // 1_000_000)[4:]
        elif isinstance(ip, str):
            address = ipaddress.ip_address(ip).packed
        else:
            address = bytes(ip)
        if len(address) not in (4, 16):
            raise InvalidArgumentError("ip must be an IPv4 or IPv6 address")
        pid_value = (os.getpid() if pid is None else pid) & 0xFFFF
        seed_value = (secrets.randbits(32) if seed is None else seed) & 0xFFFFFFFF
        self._prefix = (address + struct.pack(">HI", pid_value, seed_value)).hex().upper()
        self._counter = itertools.count()
        self._start_ms = 0
        self._next_start_ms = 0

    def _roll_month(self, now_ms: int) -> None:
        # Naive local times: .timestamp() applies the zone's rules of *that* date (as Java's
        # Calendar does), where an aware one would keep today's UTC offset and put the first
        # of a month with a daylight saving change in it an hour off.
        local = datetime.fromtimestamp(now_ms / 1000)
        start = local.replace(day=1, hour=0, minute=0, second=0, microsecond=0)
        if start.month == 12:
            nxt = start.replace(year=start.year + 1, month=1)
        else:
            nxt = start.replace(month=start.month + 1)
        self._start_ms = int(start.timestamp() * 1000)
        self._next_start_ms = int(nxt.timestamp() * 1000)

    def next_id(self, now_ms: int | None = None) -> str:
        """A new id (``now_ms`` overrides the clock, for tests)."""
        now = time.time_ns() // 1_000_000 if now_ms is None else now_ms
        if now >= self._next_start_ms or now < self._start_ms - 86_400_000:
            self._roll_month(now)
        diff = (now - self._start_ms) & 0xFFFFFFFF
        if diff >= 0x80000000 and diff - 0x100000000 > -1_000_000:
            diff = 0  # slightly negative: clock stepped back
        count = next(self._counter) & 0xFFFF
        return f"{self._prefix}{diff:08X}{count:04X}"

    __call__ = next_id


# ---------------------------------------------------------------------------------------------
# Decoding


# Compressed bodies are read as the Java client's decompressors read them
# (org.apache.rocketmq.common.compression): ZLIB through java.util.zip.InflaterInputStream (one
# zlib stream, bytes after its end ignored, a stream cut short refused), LZ4 through lz4-java's
# LZ4FrameInputStream and ZSTD through zstd-jni's ZstdInputStream, both of which read frame after
# frame to the end of the body and refuse a frame cut short or bytes that are not a frame. The
# compression level the writer chose does not matter to the reader. Type 0 is ZLIB (writers older
# than the type bits); types 4 to 7 are unknown to Java and refused.

_COMPRESSION_NAMES = {0: "ZLIB", COMPRESSION_ZLIB: "ZLIB", COMPRESSION_LZ4: "LZ4",
                      COMPRESSION_ZSTD: "ZSTD"}

# ZSTD input is fed in slices this small so that one slice cannot inflate far past the limit
# (a ZSTD block of 128 KiB can be written in a few bytes).
_ZSTD_SLICE = 1024


def _too_large(name: str, limit: int) -> BodyDecompressionError:
    return BodyDecompressionError(name, f"decompressed body exceeds {limit} bytes")


def _inflate_zlib(body: bytes, limit: int) -> bytes:
    inflater = zlib.decompressobj()
    try:
        out = inflater.decompress(body, limit + 1)
    except zlib.error as exc:
        raise BodyDecompressionError("ZLIB", str(exc)) from None
    if len(out) > limit:
        raise _too_large("ZLIB", limit)
    if not inflater.eof:
        raise BodyDecompressionError("ZLIB", "truncated zlib stream")
    return out


def _inflate_lz4(body: bytes, limit: int) -> bytes:
    parts: list[bytes] = []
    room = limit
    rest = body
    while rest:
        decompressor = lz4_frame.LZ4FrameDecompressor()
        try:
            chunk: bytes = decompressor.decompress(rest, max_length=room + 1)
        except RuntimeError as exc:
            raise BodyDecompressionError("LZ4", str(exc)) from None
        if len(chunk) > room:
            raise _too_large("LZ4", limit)
        if not decompressor.eof:
            raise BodyDecompressionError("LZ4", "truncated LZ4 frame")
        parts.append(chunk)
        room -= len(chunk)
        rest = decompressor.unused_data
    return b"".join(parts)


def _inflate_zstd(body: bytes, limit: int) -> bytes:
    parts: list[bytes] = []
    size = 0
    view = memoryview(body)
    pos = 0
    n = len(body)
    while pos < n:
        decompressor = zstandard.ZstdDecompressor().decompressobj()
        rest = b""
        while pos < n:
            piece = view[pos:pos + _ZSTD_SLICE]
            pos += len(piece)
            try:
                chunk = decompressor.decompress(piece)
            except zstandard.ZstdError as exc:
                raise BodyDecompressionError("ZSTD", str(exc)) from None
            size += len(chunk)
            if size > limit:
                raise _too_large("ZSTD", limit)
            parts.append(chunk)
            if decompressor.eof:
                rest = decompressor.unused_data
                break
        if not decompressor.eof:
            raise BodyDecompressionError("ZSTD", "truncated ZSTD frame")
        if rest:
            # The next frame starts inside the last slice: continue from its first byte.
            pos -= len(rest)
    return b"".join(parts)


def compress_body(body: bytes, compression: int, level: int = 5) -> bytes:
    """``body`` compressed as the Java producer compresses it with this type (a ``COMPRESSION_*``
    value of :mod:`~rmq_async.protocol.codes`).

    ZLIB is one zlib stream at ``level``, ZSTD one frame at ``level``, LZ4 one frame with
    independent 4 MiB blocks and no content size, as lz4-java's ``LZ4FrameOutputStream``
    writes it (which ignores the level). Its reader refuses linked blocks ("Dependent block
    stream is unsupported"), which liblz4 writes by default once a body spans two blocks.
    """
    if compression == COMPRESSION_ZLIB:
        return zlib.compress(body, level)
    if compression == COMPRESSION_LZ4:
        data: bytes = lz4_frame.compress(body, block_size=lz4_frame.BLOCKSIZE_MAX4MB,
                                         block_linked=False, store_size=False)
        return data
    if compression == COMPRESSION_ZSTD:
        return zstandard.ZstdCompressor(level=level).compress(body)
    raise InvalidArgumentError(f"unknown compression type {compression}")


def _decompress(body: bytes, sys_flag: int, limit: int) -> bytes:
    ctype = (sys_flag & COMPRESSION_TYPE_MASK) >> 8
    if ctype == 0 or ctype == COMPRESSION_ZLIB:
        return _inflate_zlib(body, limit)
    if ctype == COMPRESSION_LZ4:
        return _inflate_lz4(body, limit)
    if ctype == COMPRESSION_ZSTD:
        return _inflate_zstd(body, limit)
    raise BodyDecompressionError(str(ctype), f"unknown compression type {ctype}")


_new_message = MessageExt.__new__


def _unwrap_batch(outer: MessageExt, out: list[MessageExt]) -> None:
    """Split an inner-batch record into its messages (as Java's ``decodeMessage`` does)."""
    data = outer.body
    n = len(data)
    pos = 0
    index = 0
    while pos < n:
        if n - pos < _MIN_BATCH_RECORD:
            raise ProtocolError("truncated inner batch record")
        total, _magic, _crc, flag, body_len = _BATCH_HEAD.unpack_from(data, pos)
        end = pos + total
        if total < _MIN_BATCH_RECORD or end > n:
            raise ProtocolError(f"bad inner batch record size {total}")
        p = pos + _BATCH_HEAD.size
        if body_len < 0 or body_len > end - p - 2:
            raise ProtocolError(f"bad inner batch body length {body_len}")
        body = data[p : p + body_len]
        p += body_len
        (props_len,) = _I16.unpack_from(data, p)
        p += 2
        if props_len < 0 or p + props_len != end:
            raise ProtocolError(f"bad inner batch properties length {props_len}")
        msg = _new_message(MessageExt)
        lazy: _LazyFields = msg  # mypy does not count inherited slots of slots dataclasses
        msg.topic = outer.topic
        msg.body = body
        msg.queue_id = outer.queue_id
        msg.queue_offset = outer.queue_offset + index
        msg.flag = flag
        msg.sys_flag = outer.sys_flag
        lazy._props = None
        lazy._props_raw = data[p:end]
        lazy._props_pending = None
        msg.store_size = 0
        msg.body_crc = 0
        msg.commit_log_offset = outer.commit_log_offset
        msg.born_timestamp = outer.born_timestamp
        msg.born_host = outer.born_host
        msg.store_timestamp = outer.store_timestamp
        msg.store_host = outer.store_host
        msg.reconsume_times = 0
        msg.prepared_transaction_offset = 0
        lazy._oid = outer._oid
        lazy._oid_host = outer._oid_host
        lazy._oid_offset = outer._oid_offset
        msg.broker_name = outer.broker_name
        out.append(msg)
        pos = end
        index += 1


def _decode_records(
    data: bytes,
    out: list[MessageExt],
    decompress: bool,
    unwrap_batch: bool,
    max_body_size: int,
    limit: int,
) -> None:
    n = len(data)
    pos = 0
    fixed_v4 = _FIXED_V4.unpack_from
    fixed_v4_size = _FIXED_V4.size
    new = _new_message
    cls = MessageExt
    append = out.append
    while pos < n and len(out) < limit:
        remaining = n - pos
        if remaining < _MIN_RECORD:
            raise ProtocolError(f"truncated message record: {remaining} bytes left")
        (
            total,
            magic,
            crc,
            queue_id,
            flag,
            queue_offset,
            commit_offset,
            sys_flag,
            born_ts,
            born_ip,
            born_port,
            store_ts,
            store_ip,
            store_port,
            reconsume,
            prepared,
            body_len,
        ) = fixed_v4(data, pos)
        end = pos + total
        if total < _MIN_RECORD or total > remaining:
            raise ProtocolError(f"bad message record size {total} ({remaining} bytes left)")
        if magic != MAGIC_V1 and magic != MAGIC_V2:
            raise ProtocolError(f"bad message magic code {magic & 0xFFFFFFFF:#010x}")
        if sys_flag & (MSG_BORNHOST_V6_FLAG | MSG_STOREHOST_V6_FLAG):
            # At least one IPv6 host: the fixed part has a different layout.
            p = pos + _HEAD_SIZE
            if sys_flag & MSG_BORNHOST_V6_FLAG:
                if end - p < 20:
                    raise ProtocolError("truncated born host")
                addr, port = _HOST6.unpack_from(data, p)
                born = _host6(addr, port)
                p += 20
            else:
                born = _host4(*_HOST4.unpack_from(data, p))
                p += 8
            if end - p < 8:
                raise ProtocolError("truncated store timestamp")
            (store_ts,) = _I64.unpack_from(data, p)
            p += 8
            if sys_flag & MSG_STOREHOST_V6_FLAG:
                if end - p < 20:
                    raise ProtocolError("truncated store host")
                addr, port = _HOST6.unpack_from(data, p)
                store = _host6(addr, port)
                p += 20
            else:
                if end - p < 8:
                    raise ProtocolError("truncated store host")
                store = _host4(*_HOST4.unpack_from(data, p))
                p += 8
            if end - p < _TAIL.size:
                raise ProtocolError("truncated message record")
            reconsume, prepared, body_len = _TAIL.unpack_from(data, p)
            p += _TAIL.size
        else:
            born = _host4(born_ip, born_port)
            store = _host4(store_ip, store_port)
            p = pos + fixed_v4_size
        topic_len_size = 1 if magic == MAGIC_V1 else 2
        if body_len < 0 or body_len > end - p - topic_len_size - 2:
            raise ProtocolError(f"bad message body length {body_len}")
        body = data[p : p + body_len]
        p += body_len
        if topic_len_size == 1:
            topic_len = data[p]
            if topic_len > 127:
                raise ProtocolError("negative topic length")
            p += 1
        else:
            (topic_len,) = _I16.unpack_from(data, p)
            if topic_len < 0:
                raise ProtocolError("negative topic length")
            p += 2
        if topic_len > end - p - 2:
            raise ProtocolError(f"bad topic length {topic_len}")
        try:
            topic = data[p : p + topic_len].decode("utf-8")
        except UnicodeDecodeError:
            raise ProtocolError("topic is not valid UTF-8") from None
        p += topic_len
        (props_len,) = _I16.unpack_from(data, p)
        p += 2
        if props_len < 0 or p + props_len != end:
            raise ProtocolError(
                f"bad properties length {props_len} (record has {end - p} bytes left)"
            )
        if decompress and sys_flag & MSG_COMPRESSED_FLAG and body:
            # Java inflates (and clears the flag of) a non-empty body only: an empty one is
            # stored as is, its flag kept.
            body = _decompress(body, sys_flag, max_body_size)
            sys_flag &= ~MSG_COMPRESSED_FLAG
        # Properties and the offset message id are kept raw: MessageExt parses / formats them
        # when they are first read.
        msg = new(cls)
        lazy: _LazyFields = msg  # mypy does not count inherited slots of slots dataclasses
        msg.topic = topic
        msg.body = body
        msg.queue_id = queue_id
        msg.queue_offset = queue_offset
        msg.flag = flag
        msg.sys_flag = sys_flag
        lazy._props = None
        lazy._props_raw = data[p:end]
        lazy._props_pending = None
        msg.store_size = total
        msg.body_crc = crc
        msg.commit_log_offset = commit_offset
        msg.born_timestamp = born_ts
        msg.born_host = born[0]
        msg.store_timestamp = store_ts
        msg.store_host = store[0]
        msg.reconsume_times = reconsume
        msg.prepared_transaction_offset = prepared
        lazy._oid = None
        lazy._oid_host = store[1]
        lazy._oid_offset = commit_offset
        msg.broker_name = ""
        if (
            unwrap_batch
            and (sys_flag & (MSG_INNER_BATCH_FLAG | MSG_NEED_UNWRAP_FLAG))
            == (MSG_INNER_BATCH_FLAG | MSG_NEED_UNWRAP_FLAG)
        ):
            _unwrap_batch(msg, out)
        else:
            append(msg)
        pos = end


def _as_bytes(data: bytes | bytearray | memoryview) -> bytes:
    return data if type(data) is bytes else bytes(data)


def decode_messages(
    data: bytes | bytearray | memoryview,
    *,
    decompress: bool = True,
    unwrap_batch: bool = True,
    max_body_size: int = DEFAULT_MAX_BODY_SIZE,
) -> list[MessageExt]:
    """Decode every record of a pull body (or any concatenation of stored records).

    Compressed bodies (ZLIB, LZ4 or ZSTD, as the Java producer writes them) are inflated and
    their COMPRESSED flag cleared; one that cannot be inflated raises
    :class:`BodyDecompressionError`; inner batches are split into their messages.
    ``broker_name`` is left empty: the caller knows which queue it pulled. Properties and the
    offset message id are parsed / formatted when first read.
    """
    return _decode_messages(_records, data, decompress, unwrap_batch, max_body_size)


def decode_message(
    data: bytes | bytearray | memoryview,
    *,
    decompress: bool = True,
    max_body_size: int = DEFAULT_MAX_BODY_SIZE,
) -> MessageExt:
    """Decode exactly one stored record (e.g. the body of CONSUME_MESSAGE_DIRECTLY).

    An inner batch is returned as its outer record, not split.
    """
    return _decode_message(_records, data, decompress, max_body_size)


_RecordLoop = Callable[[bytes, list[MessageExt], bool, bool, int, int], None]


def _decode_messages(
    records: _RecordLoop,
    data: bytes | bytearray | memoryview,
    decompress: bool,
    unwrap_batch: bool,
    max_body_size: int,
) -> list[MessageExt]:
    out: list[MessageExt] = []
    try:
        records(_as_bytes(data), out, decompress, unwrap_batch, max_body_size, 1 << 62)
    except (struct.error, IndexError) as exc:  # defensive: every length is checked first
        raise ProtocolError(f"malformed message record: {exc}") from None
    return out


def _decode_message(
    records: _RecordLoop,
    data: bytes | bytearray | memoryview,
    decompress: bool,
    max_body_size: int,
) -> MessageExt:
    raw = _as_bytes(data)
    out: list[MessageExt] = []
    if len(raw) >= 4:
        (total,) = _I32.unpack_from(raw, 0)
        if total != len(raw):
            raise ProtocolError(f"record size {total} does not match {len(raw)} bytes given")
    try:
        records(raw, out, decompress, False, max_body_size, 1)
    except (struct.error, IndexError) as exc:
        raise ProtocolError(f"malformed message record: {exc}") from None
    if not out:
        raise ProtocolError("no message record")
    return out[0]


# ---------------------------------------------------------------------------------------------
# Encoding (the broker's layout; used by tests and fake brokers) and batches


def parse_host(host: str) -> tuple[bytes, int]:
    """``"ip:port"`` or ``"[ipv6]:port"`` to (address bytes, port); ``""`` is 0.0.0.0:0."""
    if not host:
        return b"\x00\x00\x00\x00", 0
    addr_text, sep, port_text = host.rpartition(":")
    if not sep:
        raise InvalidArgumentError(f"host {host!r} has no port")
    if addr_text.startswith("[") and addr_text.endswith("]"):
        addr_text = addr_text[1:-1]
    return ipaddress.ip_address(addr_text).packed, int(port_text)


def encode_stored_message(
    msg: MessageExt,
    *,
    magic: int | None = None,
    compress: bool = False,
    compress_level: int = 5,
    compression: int = COMPRESSION_ZLIB,
    crc: int | None = None,
) -> bytes:
    """Write ``msg`` as the broker stores it (one record of a pull body).

    Host strings decide the IPv4/IPv6 flags; ``magic`` defaults to v1, or v2 when the topic is
    longer than 127 bytes; ``compress`` compresses the body with ``compression`` (ZLIB unless
    told) and sets the COMPRESSED flag with that type. TOTALSIZE is computed, and BODYCRC too
    unless ``crc`` is given.
    """
    body = msg.body
    sys_flag = msg.sys_flag & ~(MSG_BORNHOST_V6_FLAG | MSG_STOREHOST_V6_FLAG)
    if compress:
        body = compress_body(body, compression, compress_level)
        sys_flag = (sys_flag & ~COMPRESSION_TYPE_MASK) | MSG_COMPRESSED_FLAG | (compression << 8)
    born_addr, born_port = parse_host(msg.born_host)
    store_addr, store_port = parse_host(msg.store_host)
    if len(born_addr) == 16:
        sys_flag |= MSG_BORNHOST_V6_FLAG
    if len(store_addr) == 16:
        sys_flag |= MSG_STOREHOST_V6_FLAG
    topic = msg.topic.encode("utf-8")
    if magic is None:
        magic = MAGIC_V2 if len(topic) > 127 else MAGIC_V1
    if magic == MAGIC_V2:
        if len(topic) > 32767:
            raise InvalidArgumentError("topic too long")
        topic_part = _I16.pack(len(topic)) + topic
    else:
        if len(topic) > 127:
            raise InvalidArgumentError("topic longer than 127 bytes needs magic v2")
        topic_part = bytes((len(topic),)) + topic
    props = encode_properties(msg.properties).encode("utf-8")
    if len(props) > 32767:
        raise InvalidArgumentError("properties longer than 32767 bytes")
    middle = b"".join(
        (
            struct.pack(">iqqiq", msg.flag, msg.queue_offset, msg.commit_log_offset, sys_flag,
                        msg.born_timestamp),
            born_addr,
            _I32.pack(born_port),
            _I64.pack(msg.store_timestamp),
            store_addr,
            _I32.pack(store_port),
            _TAIL.pack(msg.reconsume_times, msg.prepared_transaction_offset, len(body)),
            body,
            topic_part,
            _I16.pack(len(props)),
            props,
        )
    )
    total = 16 + len(middle)
    stored_crc = body_crc(body) if crc is None else crc
    return struct.pack(">iiii", total, magic, stored_crc, msg.queue_id) + middle


def _encode_batch_item(body: bytes, flag: int, properties: Mapping[str, str | None]) -> bytes:
    props = encode_properties(properties).encode("utf-8")
    if len(props) > 32767:
        raise InvalidArgumentError("properties longer than 32767 bytes")
    total = _BATCH_HEAD.size + len(body) + 2 + len(props)
    return b"".join(
        (_BATCH_HEAD.pack(total, 0, 0, flag, len(body)), body, _I16.pack(len(props)), props)
    )


def encode_batch(messages: Iterable[Message]) -> bytes:
    """The SEND_BATCH_MESSAGE body: per message size, magic 0, CRC 0, flag, body, properties.

    Properties are each message's :meth:`~Message.all_properties` (user properties plus TAGS and
    KEYS).
    """
    return b"".join(_encode_batch_item(m.body, m.flag, m.all_properties()) for m in messages)


def _stamp_delivered(msgs: list[MessageExt], broker_name: str, values: dict[str, str]) -> None:
    """Set ``broker_name`` and add ``values`` to the properties of every pulled message (as
    :meth:`MessageExt.put_properties`: unparsed properties stay unparsed) with
    :func:`_put_each`: the messages that had no pending properties share one copy of
    ``values``."""
    for m in msgs:
        m.broker_name = broker_name
    _put_each(msgs, values)


def _put_each(msgs: list[MessageExt], values: dict[str, str]) -> None:
    """:meth:`MessageExt.put_properties` of ``values`` on every message, with one pending dict
    for all messages that had none (a pulled chunk) and one for each run of messages that
    shared one, instead of a copy per message."""
    fresh: dict[str, str] | None = None
    last_old: dict[str, str] | None = None
    last_new: dict[str, str] = values
    for m in msgs:
        props = m._props
        if props is not None:
            props.update(values)
            continue
        pending = m._props_pending
        if pending is None:
            if fresh is None:
                fresh = dict(values)
            m._set_pending(fresh)
            continue
        if pending is not last_old:
            last_old, last_new = pending, {**pending, **values}
        m._set_pending(last_new)


def _cache_run(msgs: list[MessageExt], cache: dict[int, Any], taken: dict[int, Any],
               last: int) -> tuple[int, list[int], int]:
    """File the leading run of ``msgs`` whose offsets go up from ``last`` in ``cache`` (the
    :class:`~rmq_async.consumer.process_queue.ProcessQueue` dict by offset), skipping offsets
    already in ``cache`` or ``taken``.

    Returns where the run stopped (``len(msgs)``, or the index of the first message whose offset
    is not cached and not above the highest one filed so far: the caller files the rest one by
    one), the offsets filed in order, and their body bytes."""
    added: list[int] = []
    append = added.append
    size = 0
    for i, m in enumerate(msgs):
        offset = m.queue_offset
        if offset in cache or (taken and offset in taken):
            continue
        if offset <= last:
            return i, added, size
        cache[offset] = m
        append(offset)
        size += len(m.body)
        last = offset
    return len(msgs), added, size


def _uncache(msgs: list[MessageExt], cache: dict[int, Any], keep: type) -> tuple[int, int]:
    """Take the messages cached under the offsets of ``msgs`` out of ``cache``, but no entry that
    is an instance of ``keep`` (a sink's stored chunk); returns how many and their body bytes."""
    removed = 0
    size = 0
    for m in msgs:
        offset = m.queue_offset
        cached = cache.get(offset)
        if cached is not None and not isinstance(cached, keep):
            del cache[offset]
            removed += 1
            size += len(cached.body)
    return removed, size


# ---------------------------------------------------------------------------------------------
# Implementation: the compiled twin (rmq_async/protocol/_cmessage.pyx) when it can be imported
# and RMQ_ASYNC_NO_EXTENSIONS is not set, else the pure-Python functions above.

NO_EXTENSIONS_ENV = "RMQ_ASYNC_NO_EXTENSIONS"

IMPLEMENTATION: str
"""``"compiled"`` or ``"python"``: which decoder this process uses (fixed at import)."""

_records: _RecordLoop = _decode_records
_decode_properties_impl: Callable[[str], dict[str, str]] = _py_decode_properties

stamp_delivered: Callable[[list[MessageExt], str, dict[str, str]], None] = _stamp_delivered
"""Set the queue's broker name and the pull's properties (MIN_OFFSET, MAX_OFFSET) on every
message of a pulled chunk (compiled when the extension is in use)."""

put_each: Callable[[list[MessageExt], dict[str, str]], None] = _put_each
"""Add ``values`` to the properties of every message of a chunk (the consume start time), one
pending dict per chunk (compiled when the extension is in use)."""

cache_run: Callable[[list[MessageExt], dict[int, Any], dict[int, Any], int],
                    tuple[int, list[int], int]] = _cache_run
"""A ProcessQueue's filing of a pulled chunk in offset order (compiled when the extension is in
use; see :func:`_cache_run`)."""

uncache: Callable[[list[MessageExt], dict[int, Any], type], tuple[int, int]] = _uncache
"""A ProcessQueue's removal of consumed messages (compiled when the extension is in use; see
:func:`_uncache`)."""

message_columns: Callable[[list[MessageExt]], dict[str, Any] | None] | None = None
"""The compiled converter of messages to the buffers of the sink's Arrow columns, or None
without the extension (see ``rmq_async.sinks._arrow``)."""

scan_records: Callable[[bytes, bytes], tuple[int, int, int, int, int] | None] | None = None
"""The compiled check of a pull body that a sink can keep undecoded, or None without the
extension (see :mod:`rmq_async.protocol.stored`)."""

record_columns: Callable[[list[tuple[bytes, str, dict[str, str] | None]], int,
                          Callable[[int], Any] | None], dict[str, Any] | None] | None = None
"""The compiled converter of stored chunks to the buffers of the sink's Arrow columns, or None
without the extension."""


_COMPILED_NAMES = (
    "install", "decode_records", "decode_properties", "parse_raw_properties",
    "find_raw_property", "json_header", "message_columns", "stamp_delivered", "put_each",
    "cache_run", "uncache", "scan_records", "record_columns",
)


def _source_digest(path: Path) -> str | None:
    """The digest ``setup.py`` builds into the extension (``SOURCE_DIGEST``) for its source;
    ``None`` when that source is not installed or cannot be read (nothing to compare)."""
    try:
        return hashlib.sha256(path.read_bytes()).hexdigest()[:16]
    except OSError:
        return None


def _use_compiled() -> bool:
    global _records, _decode_properties_impl, message_columns, put_each, stamp_delivered
    global scan_records, record_columns, cache_run, uncache
    if os.environ.get(NO_EXTENSIONS_ENV, "") not in ("", "0"):
        return False
    try:
        import rmq_async.protocol._cmessage as _cmessage

        # An extension built from an older source (not rebuilt after an update) lacks a
        # function: it is not used at all, rather than half.
        missing = [name for name in _COMPILED_NAMES if not hasattr(_cmessage, name)]
        if missing:
            raise ImportError(f"the built extension is out of date (no {', '.join(missing)})")
        # One whose functions kept their names but not their arguments: its source differs
        # from the .pyx installed beside it (a checkout updated without rebuilding).
        built_from = getattr(_cmessage, "SOURCE_DIGEST", None)
        source = _source_digest(Path(__file__).with_name("_cmessage.pyx"))
        if built_from and source and built_from != source:
            raise ImportError("the built extension is out of date (built from another "
                              "_cmessage.pyx; rebuild it with make setup or pip install)")
    except ImportError as exc:
        structlog.get_logger(__name__).warning(
            "rmq_async.extensions_unavailable",
            detail="the compiled message decoder is not available; using the pure-Python one",
            reason=str(exc),
        )
        return False
    _cmessage.install(_decompress, _host6)
    _records = _cmessage.decode_records
    _decode_properties_impl = _cmessage.decode_properties
    set_properties_parser(_cmessage.parse_raw_properties, _cmessage.find_raw_property)
    set_json_header_parser(_cmessage.json_header)
    message_columns = _cmessage.message_columns
    stamp_delivered = _cmessage.stamp_delivered
    put_each = _cmessage.put_each
    cache_run = _cmessage.cache_run
    uncache = _cmessage.uncache
    scan_records = _cmessage.scan_records
    record_columns = _cmessage.record_columns
    return True


IMPLEMENTATION = "compiled" if _use_compiled() else "python"

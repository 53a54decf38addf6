"""``RemotingCommand`` frames: encoding, decoding and an incremental frame decoder.

Frame layout (big-endian)::

    int32 length          = 4 + H + B (excludes itself)
    int32 header-info     = serialize type << 24 | H
    H bytes header        JSON (type 0) or ROCKETMQ binary (type 1)
    B bytes body

:meth:`RemotingCommand.encode` writes what Java's ``NettyEncoder`` puts on the wire
(``fastEncodeHeader`` + body), byte for byte.

JSON headers are written as fastjson writes them: bean fields in sorted order (``code``,
``extFields``, ``flag``, ``language``, ``opaque``, ``remark``, ``serializeTypeCurrentRPC``,
``version``), null fields omitted, ``language`` and ``serializeTypeCurrentRPC`` as enum names.
``extFields`` is a Java ``HashMap`` written without ``MapSortField``, so its entries appear in
HashMap iteration order, which :func:`~rmq_async.protocol.jsonutil.java_hashmap_order`
reproduces. That order depends on the map's capacity and, within a bucket, on insertion order,
which :class:`ExtFields` records:

* a plain ``dict`` stands for a map Java filled in the dict's order after creating it with
  ``new HashMap<>()`` (capacity 16), as ``setExtFields`` users do;
* an :class:`ExtFields` (what typed headers' ``to_ext_fields`` return, and what
  :meth:`RemotingCommand.add_ext_field` creates) knows which keys are the header's own fields.
  Alone, they are put into a ``new HashMap<>()`` by ``makeCustomHeaderToNet``; any other key
  stands for Java's ``addExtField``, which creates the map with capacity 256 before the header's
  fields are put into it at encode time. (Java's ACL hook adds its ``Signature`` after the
  header fields; that changes the order only if it shares a bucket with one of them.)

The ROCKETMQ binary header writes the entries in the same HashMap order, as
``RocketMQSerializable`` does for ordinary headers. Headers implementing Java's
``FastCodesHeader`` (pull and send V2 requests and their responses) are different on the wire:
``fastEncodeHeader`` writes their fields in declaration order (``ExtFields.fast_codes``),
then the added keys in HashMap order. :meth:`RemotingCommand.encode_header_binary` gives either
form; the HashMap form is also real wire bytes (Java's ``encodeHeader()``, which the broker uses
for zero-copy pull responses).
"""

from __future__ import annotations

import itertools
import json
import struct
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from rmq_async.errors import InvalidArgumentError

from .codes import (
    CURRENT_VERSION,
    INT32_MAX,
    INT32_MIN,
    RPC_ONEWAY,
    RPC_TYPE_RESPONSE,
    LanguageCode,
    SerializeType,
)
from .errors import ProtocolError
from .jsonutil import fastjson_string, java_hashmap_order

__all__ = [
    "DEFAULT_MAX_FRAME_SIZE",
    "ExtFields",
    "FrameDecoder",
    "RemotingCommand",
    "next_opaque",
]

DEFAULT_MAX_FRAME_SIZE = 16 * 1024 * 1024
"""Largest accepted frame, counting the 4-byte length field (Java's default)."""


_U32 = struct.Struct(">I")
_I32 = struct.Struct(">i")
_PREFIX = struct.Struct(">iI")  # length, header-info
_BIN_FIXED = struct.Struct(">hBhiii")  # code, language, version, opaque, flag, remark length
_I16 = struct.Struct(">h")

_opaque_counter = itertools.count(1)


def next_opaque() -> int:
    """Next request id: a process-wide counter, kept within positive int32."""
    return next(_opaque_counter) & 0x7FFFFFFF


_LANGUAGE_BY_NAME = {member.name: member for member in LanguageCode}
_SERIALIZE_NAMES = {SerializeType.JSON: "JSON", SerializeType.ROCKETMQ: "ROCKETMQ"}


def _language_name(language: int) -> str:
    try:
        return LanguageCode(language).name
    except ValueError:
        # A language the Java enum does not know has no name to write.
        return LanguageCode.OTHER.name


def _language_value(language: int) -> int:
    try:
        return LanguageCode(language)
    except ValueError:
        return language


#: Capacity of the map Java's ``addExtField`` creates (``new HashMap<>(256)``).
_ADDED_MAP_CAPACITY = 256
#: Capacity of the map ``makeCustomHeaderToNet`` creates (``new HashMap<>()``).
_HEADER_MAP_CAPACITY = 16


class ExtFields(dict[str, str]):
    """``extFields`` built from a typed header, remembering how Java would have built them.

    ``header_keys`` are the Java field names of the header in the order Java's
    ``makeCustomHeaderToNet`` puts them; any other key counts as added with ``addExtField``.
    ``fast_codes`` is the field order of the header's ``FastCodesHeader.encode`` (``None`` for
    ordinary headers). Both only decide byte order; the mapping itself is a plain ``dict``.
    """

    __slots__ = ("fast_codes", "header_keys")

    header_keys: tuple[str, ...]
    fast_codes: tuple[str, ...] | None

    def __init__(
        self,
        items: Mapping[str, str] | Iterable[tuple[str, str]] = (),
        *,
        header_keys: Iterable[str] = (),
        fast_codes: Iterable[str] | None = None,
    ) -> None:
        super().__init__(items)
        self.header_keys = tuple(header_keys)
        self.fast_codes = tuple(fast_codes) if fast_codes is not None else None

    def copy(self) -> ExtFields:
        return ExtFields(self, header_keys=self.header_keys, fast_codes=self.fast_codes)

    def __repr__(self) -> str:
        return f"ExtFields({dict.__repr__(self)})"


_SECRET_FIELDS = frozenset({"SecurityToken", "Signature"})


def _shown_ext(fields: Mapping[str, str] | None) -> str:
    """``repr`` of ext fields with the ACL session token and the signature masked (a repr
    ends up in logs and tracebacks; the access key alone names who signed)."""
    if fields is None or not _SECRET_FIELDS & fields.keys():
        return repr(fields)
    return repr({k: ("***" if k in _SECRET_FIELDS else v) for k, v in fields.items()})


def _copy_ext(fields: Mapping[str, str]) -> dict[str, str]:
    return fields.copy() if isinstance(fields, ExtFields) else dict(fields)


@dataclass(slots=True, repr=False)
class RemotingCommand:
    """One request or response of the remoting protocol.

    ``language`` is kept as a plain int when the peer sent a code this enum does not know.
    ``ext_fields`` maps Java header field names to their string values.
    """

    code: int
    language: int = LanguageCode.PYTHON
    version: int = CURRENT_VERSION
    opaque: int = 0
    flag: int = 0
    remark: str | None = None
    ext_fields: dict[str, str] | None = None
    body: bytes = b""
    serialize_type: SerializeType = SerializeType.JSON

    # -- construction -------------------------------------------------------------------

    @classmethod
    def request(
        cls,
        code: int,
        ext_fields: Mapping[str, str] | None = None,
        body: bytes = b"",
        *,
        oneway: bool = False,
        serialize_type: SerializeType = SerializeType.JSON,
    ) -> RemotingCommand:
        """A new request with the next opaque."""
        return cls(
            code=int(code),
            opaque=next_opaque(),
            flag=RPC_ONEWAY if oneway else 0,
            ext_fields=_copy_ext(ext_fields) if ext_fields is not None else None,
            body=body,
            serialize_type=serialize_type,
        )

    def response_to(
        self,
        code: int,
        remark: str | None = None,
        ext_fields: Mapping[str, str] | None = None,
        body: bytes = b"",
    ) -> RemotingCommand:
        """The response to this request: same opaque, response flag, same serialization."""
        return RemotingCommand(
            code=int(code),
            opaque=self.opaque,
            flag=RPC_TYPE_RESPONSE,
            remark=remark,
            ext_fields=_copy_ext(ext_fields) if ext_fields is not None else None,
            body=body,
            serialize_type=self.serialize_type,
        )

    # -- flags ----------------------------------------------------------------------------

    @property
    def is_response(self) -> bool:
        return (self.flag & RPC_TYPE_RESPONSE) != 0

    @property
    def is_oneway(self) -> bool:
        return (self.flag & RPC_ONEWAY) != 0

    def add_ext_field(self, name: str, value: str) -> None:
        """Set one extFields entry, as Java's ``addExtField`` (which may create the map)."""
        if self.ext_fields is None:
            self.ext_fields = ExtFields()
        self.ext_fields[name] = value

    def ext(self, name: str) -> str | None:
        """One extFields value, or ``None``."""
        fields = self.ext_fields
        return fields.get(name) if fields is not None else None

    def __repr__(self) -> str:
        kind = "response" if self.is_response else ("oneway" if self.is_oneway else "request")
        return (
            f"RemotingCommand({kind} code={self.code} opaque={self.opaque} flag={self.flag} "
            f"remark={self.remark!r} ext_fields={_shown_ext(self.ext_fields)} "
            f"body_len={len(self.body)} "
            f"serialize_type={self.serialize_type.name})"
        )

    # -- encoding ---------------------------------------------------------------------------

    def _hashmap_entries(self) -> list[tuple[str, str]]:
        """The entries in the iteration order of Java's ``extFields`` HashMap."""
        fields = self.ext_fields
        if not fields:
            return []
        present = [k for k, v in fields.items() if v is not None]
        if isinstance(fields, ExtFields):
            own = set(fields.header_keys)
            added = [k for k in present if k not in own]
            header = [k for k in fields.header_keys if fields.get(k) is not None]
            if added:
                keys = java_hashmap_order(added + header, _ADDED_MAP_CAPACITY)
            else:
                keys = java_hashmap_order(header, _HEADER_MAP_CAPACITY)
        else:
            keys = java_hashmap_order(present, _HEADER_MAP_CAPACITY)
        return [(k, fields[k]) for k in keys]

    def _fast_codes_entries(self) -> list[tuple[str, str]] | None:
        """Entries as ``fastEncodeHeader`` writes a FastCodesHeader, or ``None`` if not one."""
        fields = self.ext_fields
        if not isinstance(fields, ExtFields) or fields.fast_codes is None:
            return None
        own = set(fields.header_keys)
        first = [k for k in fields.fast_codes if k in own and fields.get(k) is not None]
        listed = set(first)
        # Header fields missing from the declaration list would be dropped by Java; keep them.
        first += [k for k, v in fields.items() if k in own and k not in listed and v is not None]
        added = [k for k, v in fields.items() if k not in own and v is not None]
        keys = first + java_hashmap_order(added, _ADDED_MAP_CAPACITY)
        return [(k, fields[k]) for k in keys]

    def encode_header_json(self) -> bytes:
        parts = ['{"code":', str(self.code)]
        if self.ext_fields is not None:
            parts.append(',"extFields":{')
            parts.append(
                ",".join(
                    f"{fastjson_string(k)}:{fastjson_string(v)}" for k, v in self._hashmap_entries()
                )
            )
            parts.append("}")
        parts.append(f',"flag":{self.flag},"language":"{_language_name(self.language)}"')
        parts.append(f',"opaque":{self.opaque}')
        if self.remark is not None:
            parts.append(',"remark":')
            parts.append(fastjson_string(self.remark))
        parts.append(f',"serializeTypeCurrentRPC":"JSON","version":{self.version}}}')
        return "".join(parts).encode("utf-8", "replace")

    def encode_header_binary(self, *, fast_codes: bool = False) -> bytes:
        """The ROCKETMQ binary header.

        By default as Java's ``encodeHeader()`` writes it (every extFields entry in HashMap
        order); with ``fast_codes`` as ``fastEncodeHeader`` (the Netty encoder) writes it, which
        differs for FastCodesHeader headers (see the module doc). :meth:`encode` uses the latter.
        """
        if not -32768 <= self.code <= 32767:
            raise InvalidArgumentError(f"code {self.code} does not fit the ROCKETMQ header; use JSON")
        if not -32768 <= self.version <= 32767:
            raise InvalidArgumentError(f"version {self.version} does not fit the ROCKETMQ header")
        if not 0 <= self.language <= 255:
            raise InvalidArgumentError(f"language {self.language} does not fit one byte")
        remark = self.remark.encode("utf-8", "replace") if self.remark else b""
        out = [
            _BIN_FIXED.pack(
                self.code, self.language, self.version, self.opaque, self.flag, len(remark)
            ),
            remark,
        ]
        entries = self._fast_codes_entries() if fast_codes else None
        if entries is None:
            entries = self._hashmap_entries()
        ext: list[bytes] = []
        for key, value in entries:
            kb = key.encode("utf-8", "replace")
            vb = value.encode("utf-8", "replace")
            if len(kb) > 32767:
                raise InvalidArgumentError("extFields key longer than 32767 bytes")
            ext.append(_I16.pack(len(kb)))
            ext.append(kb)
            ext.append(_I32.pack(len(vb)))
            ext.append(vb)
        ext_bytes = b"".join(ext)
        out.append(_I32.pack(len(ext_bytes)))
        out.append(ext_bytes)
        return b"".join(out)

    def encode_parts(self) -> list[bytes]:
        """The frame as ``[length + header-info + header, body]`` (body omitted when empty)."""
        if self.serialize_type == SerializeType.JSON:
            header = self.encode_header_json()
        elif self.serialize_type == SerializeType.ROCKETMQ:
            header = self.encode_header_binary(fast_codes=True)
        else:  # pragma: no cover - enum is closed
            raise InvalidArgumentError(f"unknown serialize type {self.serialize_type}")
        hlen = len(header)
        if hlen > 0xFFFFFF:
            raise InvalidArgumentError("header longer than 16 MiB")
        body = self.body
        prefix = _PREFIX.pack(4 + hlen + len(body), (int(self.serialize_type) << 24) | hlen)
        if body:
            return [prefix + header, body]
        return [prefix + header]

    def encode(self) -> bytes:
        """The whole frame, including the 4-byte length."""
        return b"".join(self.encode_parts())

    # -- decoding ---------------------------------------------------------------------------

    @classmethod
    def decode(cls, frame: bytes | bytearray | memoryview) -> RemotingCommand:
        """Decode one frame given **without** its 4-byte length field."""
        n = len(frame)
        if n < 4:
            raise ProtocolError(f"frame too short: {n} bytes")
        (info,) = _U32.unpack_from(frame, 0)
        stype = info >> 24
        hlen = info & 0xFFFFFF
        if hlen > n - 4:
            raise ProtocolError(f"header length {hlen} exceeds frame length {n}")
        header = frame[4 : 4 + hlen]
        if stype == SerializeType.JSON:
            cmd = _decode_json_header(header)
        elif stype == SerializeType.ROCKETMQ:
            cmd = _decode_binary_header(header)
        else:
            raise ProtocolError(f"unknown serialize type {stype}")
        if 4 + hlen < n:
            cmd.body = bytes(frame[4 + hlen :])
        return cmd


def _json_int(obj: Mapping[str, Any], key: str, default: int) -> int:
    value = obj.get(key, default)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int):
        if isinstance(value, str):
            try:
                value = int(value)
            except ValueError:
                raise ProtocolError(f"header field {key!r} is not an integer") from None
        else:
            raise ProtocolError(f"header field {key!r} is not an integer")
    if not INT32_MIN <= value <= INT32_MAX:
        raise ProtocolError(f"header field {key!r} out of int32 range")
    return value


def _ext_value(value: Any) -> str | None:
    if value is None or isinstance(value, str):
        return value
    if value is True:
        return "true"
    if value is False:
        return "false"
    if isinstance(value, int | float):
        return str(value)
    raise ProtocolError("extFields value is not a scalar")


_is_str = str.__instancecheck__


_JsonHeaderFields = tuple[int, str | None, int, int, int, str | None, dict[str, str] | None]
_json_header_fast: Callable[[bytes], _JsonHeaderFields | None] | None = None


def set_json_header_parser(parser: Callable[[bytes], _JsonHeaderFields | None] | None) -> None:
    """Install the compiled reader of plain JSON headers (:mod:`rmq_async.protocol.message`
    does, with the rest of the compiled codec), or remove it with ``None``."""
    global _json_header_fast
    _json_header_fast = parser


def _json_language(raw: object) -> int:
    """The ``language`` of a JSON header: absent is Java (as Java reads it), a name unknown to
    the Java enum is OTHER, a number is taken as the binary header takes it."""
    if raw is None:
        return LanguageCode.JAVA
    if isinstance(raw, str):
        return _LANGUAGE_BY_NAME.get(raw, LanguageCode.OTHER)
    if isinstance(raw, int) and not isinstance(raw, bool):
        return _language_value(raw)
    raise ProtocolError("header field 'language' is neither a name nor a number")


def _decode_json_header(header: bytes | bytearray | memoryview) -> RemotingCommand:
    raw = bytes(header)
    if _json_header_fast is not None:
        fields = _json_header_fast(raw)
        if fields is not None:
            code, language_name, version, opaque, flag, remark, ext_fields = fields
            return RemotingCommand(
                code=code,
                language=_json_language(language_name),
                version=version,
                opaque=opaque,
                flag=flag,
                remark=remark,
                ext_fields=ext_fields,
                serialize_type=SerializeType.JSON,
            )
    return _decode_json_header_py(raw)


def _decode_json_header_py(header: bytes) -> RemotingCommand:
    """The JSON header by :func:`json.loads`: any JSON, and the wording of every error."""
    try:
        obj = json.loads(header.decode("utf-8"))
    except (ValueError, RecursionError) as exc:
        raise ProtocolError(f"bad JSON header: {exc}") from None
    if not isinstance(obj, dict):
        raise ProtocolError("JSON header is not an object")
    language = _json_language(obj.get("language"))
    remark = obj.get("remark")
    if remark is not None and not isinstance(remark, str):
        raise ProtocolError("header field 'remark' is not a string")
    raw_ext = obj.get("extFields")
    ext_fields: dict[str, str] | None
    if raw_ext is None:
        ext_fields = None
    elif isinstance(raw_ext, dict):
        if all(map(_is_str, raw_ext.values())):
            ext_fields = raw_ext  # the common case (Java sends a map of strings): kept as is
        else:
            ext_fields = {}
            for key, value in raw_ext.items():
                text = _ext_value(value)
                if text is not None:
                    ext_fields[key] = text
    else:
        raise ProtocolError("header field 'extFields' is not an object")
    return RemotingCommand(
        code=_json_int(obj, "code", 0),
        language=language,
        version=_json_int(obj, "version", 0),
        opaque=_json_int(obj, "opaque", 0),
        flag=_json_int(obj, "flag", 0),
        remark=remark,
        ext_fields=ext_fields,
        serialize_type=SerializeType.JSON,
    )


def _utf8(raw: bytes | bytearray | memoryview, what: str) -> str:
    try:
        return bytes(raw).decode("utf-8")
    except UnicodeDecodeError:
        raise ProtocolError(f"{what} is not valid UTF-8") from None


def _decode_binary_header(header: bytes | bytearray | memoryview) -> RemotingCommand:
    hlen = len(header)
    if hlen < 21:
        raise ProtocolError(f"ROCKETMQ header too short: {hlen} bytes")
    code, language, version, opaque, flag, remark_len = _BIN_FIXED.unpack_from(header, 0)
    pos = 17
    if remark_len < 0 or remark_len > hlen - pos - 4:
        raise ProtocolError(f"bad remark length {remark_len}")
    remark = _utf8(header[pos : pos + remark_len], "remark") if remark_len else None
    pos += remark_len
    (ext_len,) = _I32.unpack_from(header, pos)
    pos += 4
    if ext_len < 0 or ext_len != hlen - pos:
        raise ProtocolError(f"bad extFields length {ext_len} (header has {hlen - pos} left)")
    ext_fields: dict[str, str] | None = None
    if ext_len > 0:
        ext_fields = {}
        while pos < hlen:
            if pos + 2 > hlen:
                raise ProtocolError("truncated extFields key length")
            (klen,) = _I16.unpack_from(header, pos)
            pos += 2
            if klen < 0 or pos + klen + 4 > hlen:
                raise ProtocolError(f"bad extFields key length {klen}")
            key = _utf8(header[pos : pos + klen], "extFields key") if klen else None
            pos += klen
            (vlen,) = _I32.unpack_from(header, pos)
            pos += 4
            if vlen < 0 or pos + vlen > hlen:
                raise ProtocolError(f"bad extFields value length {vlen}")
            value = _utf8(header[pos : pos + vlen], "extFields value") if vlen else None
            pos += vlen
            # Java reads a zero-length string as null; null keys and values carry nothing.
            if key is not None and value is not None:
                ext_fields[key] = value
    return RemotingCommand(
        code=code,
        language=_language_value(language),
        version=version,
        opaque=opaque,
        flag=flag,
        remark=remark,
        ext_fields=ext_fields,
        serialize_type=SerializeType.ROCKETMQ,
    )


class FrameDecoder:
    """Incremental decoder: received bytes in, complete commands out.

    Bytes arrive in one reusable receive buffer: a connection (an
    :class:`asyncio.BufferedProtocol`) lets the transport read straight into the space
    :meth:`get_buffer` offers and then calls :meth:`buffer_updated`, which decodes every frame
    completed in place and keeps only the unfinished one. Reads then allocate nothing (a
    transport that makes a new ``bytes`` per read asks the allocator for a quarter megabyte
    each time), and decoded commands copy out what they keep (a body becomes ``bytes`` of its
    own), so the buffer is reused at once. A frame larger than the buffer grows it to the
    frame's size, announced by its length field, so the frame is read in place as well; the
    buffer shrinks back once it is empty. :meth:`feed` offers the same for bytes in hand.

    A declared length above ``max_frame_size`` (which counts the 4-byte length field, as Java
    does) is refused as soon as the length is read, before the frame is buffered. After a
    :class:`ProtocolError` the decoder stays failed.
    """

    __slots__ = ("_buf", "_end", "_error", "_need", "_start", "max_frame_size")

    #: Capacity of a receive buffer, and the least free space offered to one read.
    BUFFER_SIZE = 256 * 1024
    MIN_READ = 64 * 1024

    def __init__(self, max_frame_size: int = DEFAULT_MAX_FRAME_SIZE) -> None:
        if max_frame_size < 8:
            raise InvalidArgumentError("max_frame_size must be at least 8")
        self.max_frame_size = max_frame_size
        self._buf = bytearray(self.BUFFER_SIZE)
        self._start = 0  # the unfinished frame (if any) is _buf[_start:_end]
        self._end = 0
        self._need = 0  # its whole size once its length field is in, else 0
        self._error: ProtocolError | None = None

    @property
    def buffered(self) -> int:
        """Bytes held for an incomplete frame."""
        return self._end - self._start

    @property
    def failed(self) -> bool:
        return self._error is not None

    def _fail(self, message: str) -> ProtocolError:
        self._error = ProtocolError(message)
        self._start = self._end = self._need = 0
        return self._error

    def release(self) -> None:
        """Drop the receive buffer and any unfinished frame (the connection is closed: a frame
        cut short held up to ``max_frame_size`` bytes for as long as the object lived). A later
        read gets a new buffer."""
        self._buf = bytearray()
        self._start = self._end = self._need = 0

    def get_buffer(self, sizehint: int = -1) -> memoryview:
        """Space for the next read: the tail of the receive buffer, at least
        :attr:`MIN_READ` bytes, or the room the unfinished frame still needs if that is more.
        Nothing in the buffer is ever resized, so a view the transport still holds is harmless."""
        buf, start, end = self._buf, self._start, self._end
        pending = end - start
        room = max(self.MIN_READ, self._need - pending)
        if not pending and len(buf) > 4 * self.BUFFER_SIZE and room <= self.BUFFER_SIZE:
            self._buf = buf = bytearray(self.BUFFER_SIZE)  # the large frame that grew it is gone
        if len(buf) - end < room:
            size = max(self.BUFFER_SIZE, pending + room)
            if size > len(buf):
                grown = bytearray(size)
                grown[:pending] = buf[start:end]
                self._buf = buf = grown
            else:
                buf[:pending] = buf[start:end]
            self._start, self._end = 0, pending
            end = pending
        return memoryview(buf)[end:]

    def buffer_updated(self, nbytes: int) -> list[RemotingCommand]:
        """``nbytes`` were written at the start of the last :meth:`get_buffer` space; return every
        command they completed (possibly none)."""
        if self._error is not None:
            raise ProtocolError(f"decoder failed earlier: {self._error}")
        self._end = end = self._end + nbytes
        pos = self._start
        out: list[RemotingCommand] = []
        need = 0
        with memoryview(self._buf) as view:
            try:
                while end - pos >= 4:
                    size = self._frame_size(view, pos)
                    if pos + size > end:
                        need = size
                        break
                    out.append(self._decode(view[pos + 4 : pos + size]))
                    pos += size
            except ProtocolError as exc:
                exc.decoded = out  # the frames before the bad one arrived whole
                raise
        self._need = need
        if pos < end:
            self._start = pos
        else:
            self._start = self._end = 0
        return out

    def feed(self, data: bytes | bytearray | memoryview) -> list[RemotingCommand]:
        """Add received bytes; return every command completed by them (possibly none)."""
        if self._error is not None:
            raise ProtocolError(f"decoder failed earlier: {self._error}")
        out: list[RemotingCommand] = []
        with memoryview(data if isinstance(data, bytes | bytearray) else bytes(data)) as src:
            pos, total = 0, len(src)
            while pos < total:
                space = self.get_buffer()
                n = min(len(space), total - pos)
                space[:n] = src[pos : pos + n]
                try:
                    out.extend(self.buffer_updated(n))
                except ProtocolError as exc:
                    exc.decoded = [*out, *exc.decoded]
                    raise
                pos += n
        return out

    def _frame_size(self, data: bytes | bytearray | memoryview, pos: int) -> int:
        """The size (length field included) of the frame whose length field is at ``pos``;
        fails the decoder if that length is impossible or over ``max_frame_size``."""
        length: int = _I32.unpack_from(data, pos)[0]
        if length < 4:
            raise self._fail(f"bad frame length {length}")
        if length + 4 > self.max_frame_size:
            raise self._fail(f"frame length {length + 4} exceeds maximum {self.max_frame_size}")
        return length + 4

    def _decode(self, frame: memoryview) -> RemotingCommand:
        """One frame given without its length field; a ProtocolError fails the decoder."""
        try:
            return RemotingCommand.decode(frame)
        except ProtocolError as exc:
            raise self._fail(str(exc)) from None


class FrameTemplate:
    """The encoded frame of a request with holes for a few values that change per send.

    Built once from a JSON-serialized request whose ext fields hold the sentinel strings given
    for the holes; :meth:`render` then writes the same bytes :meth:`RemotingCommand.encode`
    would for the given values, without building a command or ordering its fields (the pull
    loop sends the same PULL_MESSAGE with a new offset thousands of times a second). The
    opaque is always a hole. :meth:`build` returns ``None`` when a sentinel is not found
    exactly once in the encoded header, so callers fall back to the plain encoder.
    """

    __slots__ = ("_info", "_names", "_pieces")

    _OPAQUE_SENTINEL = 1987654321

    def __init__(self, pieces: list[bytes], names: list[str], info: int) -> None:
        self._pieces = pieces
        self._names = names
        self._info = info

    @classmethod
    def build(cls, cmd: RemotingCommand, holes: Mapping[str, str]) -> FrameTemplate | None:
        if cmd.serialize_type != SerializeType.JSON or cmd.body or cmd.remark is not None:
            return None
        cmd.opaque = cls._OPAQUE_SENTINEL
        header = cmd.encode_header_json()
        marks = {str(cls._OPAQUE_SENTINEL).encode(): "opaque"}
        marks.update({v.encode(): k for k, v in holes.items()})
        found: list[tuple[int, bytes]] = []
        for mark in marks:
            at = header.find(mark)
            if at < 0 or header.find(mark, at + 1) >= 0:
                return None
            found.append((at, mark))
        found.sort()
        pieces: list[bytes] = []
        names: list[str] = []
        pos = 0
        for at, mark in found:
            pieces.append(header[pos:at])
            names.append(marks[mark])
            pos = at + len(mark)
        pieces.append(header[pos:])
        return cls(pieces, names, int(SerializeType.JSON) << 24)

    def render(self, opaque: int, values: Mapping[str, object]) -> bytes:
        """The whole frame with ``opaque`` and ``values`` (``str()`` of each) in their holes."""
        pieces = self._pieces
        out = [pieces[0]]
        for i, name in enumerate(self._names):
            out.append(str(opaque if name == "opaque" else values[name]).encode())
            out.append(pieces[i + 1])
        header = b"".join(out)
        hlen = len(header)
        return _PREFIX.pack(4 + hlen, self._info | hlen) + header

"""JSON as the Java side writes and reads it (fastjson 1.2.83 with RocketMQ's default features).

Writing (:func:`fastjson_dumps`, :func:`fastjson_string`) follows fastjson's default serializer:

* compact, no spaces; bean fields in sorted order (callers give beans as dicts, whose keys we sort);
* ``None`` values of dict entries are omitted (fastjson skips null fields and null map values);
* enums are written by name; booleans ``true``/``false``; doubles as Java prints them;
* strings: non-ASCII is written raw (the caller encodes UTF-8); escaped are ``"`` and ``\\``
  (backslash escape), ``\\b \\f \\n \\r \\t`` (short escapes), the other control characters
  U+0000-U+001F, U+007F-U+009F and U+2028/U+2029 (``\\uXXXX`` with upper-case hex). ``/`` is
  not escaped. This is the reading of ``SerializeWriter.writeStringWithDoubleQuote`` and
  ``IOUtils.specicalFlags_doubleQuotes`` in fastjson 1.2.83.
* map keys that are not strings: integers are written bare (``{0:"a"}``) and objects as JSON
  objects (``{{"brokerName":"b","queueId":0,"topic":"t"}:100}``), as fastjson's ``MapSerializer``
  does without ``WriteNonStringKeyAsString``.

Reading (:func:`tolerant_loads`) accepts standard JSON and those two non-standard key forms.
Representation of keys that are not strings (a documented choice of this module):

* a bare number key stays a Python ``int`` (or ``float``);
* an object key that has exactly the fields ``brokerName``, ``queueId``, ``topic`` becomes a
  :class:`~rmq_async.protocol.types.MessageQueue`; any other object key becomes a tuple of
  ``(name, value)`` pairs in document order, with nested arrays as tuples (hashable);
* ``true``/``false``/``null`` keys become ``True``/``False``/``None``.

Standard JSON input takes the fast path (``json.loads``); the hand-written parser only runs when
that fails.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Iterable, Mapping, Sequence
from decimal import Decimal
from enum import Enum
from typing import Any, TypeVar

from rmq_async.errors import InvalidArgumentError, InvalidTypeError

from .errors import ProtocolError
from .types import MessageQueue

__all__ = [
    "InsertionOrderedMap",
    "fastjson_dumps",
    "fastjson_string",
    "java_double_str",
    "java_hash_order",
    "java_hashmap_order",
    "java_int_set_order",
    "java_string_hash",
    "tolerant_loads",
]

T = TypeVar("T")

# ---------------------------------------------------------------------------------------------
# Java helpers


def java_string_hash(text: str) -> int:
    """Java ``String.hashCode``: over UTF-16 code units, signed 32-bit result."""
    h = 0
    if text.isascii():
        for ch in text.encode("ascii"):
            h = (31 * h + ch) & 0xFFFFFFFF
    else:
        raw = text.encode("utf-16-be", "surrogatepass")
        for i in range(0, len(raw), 2):
            h = (31 * h + ((raw[i] << 8) | raw[i + 1])) & 0xFFFFFFFF
    return h - 0x100000000 if h >= 0x80000000 else h


def _java_sort_key(text: str) -> bytes:
    return text.encode("utf-16-be", "surrogatepass")


_ORDER_CACHE: dict[tuple[int, tuple[str, ...]], tuple[int, ...]] = {}
_ORDER_CACHE_MAX = 1024


def _table_capacity(size: int, initial_capacity: int) -> int:
    cap = 1
    while cap < initial_capacity:
        cap <<= 1
    # HashMap doubles its table when the size exceeds 3/4 of the capacity.
    while size > (cap * 3) // 4:
        cap <<= 1
    return cap


def _hash_order(hashes: list[int], initial_capacity: int) -> tuple[int, ...]:
    mask = _table_capacity(len(hashes), initial_capacity) - 1
    slots = []
    for i, h in enumerate(hashes):
        h &= 0xFFFFFFFF
        slots.append(((h ^ (h >> 16)) & mask, i))
    slots.sort()
    return tuple(i for _, i in slots)


def java_hashmap_order(keys: Iterable[str], initial_capacity: int = 16) -> list[str]:
    """The iteration order of a ``java.util.HashMap<String, ?>`` (or ``HashSet``) of ``keys``.

    ``keys`` are given in insertion order. The table starts at ``initial_capacity`` (16 for
    ``new HashMap<>()``) and doubles whenever the size exceeds 3/4 of it; iteration walks the
    buckets by index (``(h ^ (h >>> 16)) & (capacity - 1)`` of ``String.hashCode``) and each
    bucket in insertion order. Tree bins (8+ keys in one bucket) are not modelled.
    """
    ks = tuple(keys)
    cache_key = (initial_capacity, ks)
    perm = _ORDER_CACHE.get(cache_key)
    if perm is None:
        perm = _hash_order([java_string_hash(k) for k in ks], initial_capacity)
        if len(_ORDER_CACHE) >= _ORDER_CACHE_MAX:
            _ORDER_CACHE.clear()
        _ORDER_CACHE[cache_key] = perm
    return [ks[i] for i in perm]


def java_hash_order(
    items: Sequence[T], hashes: Sequence[int], initial_capacity: int = 16
) -> list[T]:
    """Iteration order of a Java ``HashSet``/``HashMap`` of ``items``.

    ``hashes`` are their Java ``hashCode`` values; both are given in insertion order.
    """
    if len(items) != len(hashes):
        raise InvalidArgumentError("items and hashes differ in length")
    return [items[i] for i in _hash_order(list(hashes), initial_capacity)]


def java_int_set_order(values: Iterable[int], initial_capacity: int = 16) -> list[int]:
    """The iteration order of a ``java.util.HashSet<Integer>`` (``Integer.hashCode`` = value)."""
    vs = list(values)
    return [vs[i] for i in _hash_order(vs, initial_capacity)]


def java_double_str(value: float) -> str:
    """A double as fastjson writes it (shortest digits, Java ``Double.toString`` layout).

    NaN and infinities are written as ``null`` by fastjson.
    """
    if math.isnan(value) or math.isinf(value):
        return "null"
    if value == 0.0:
        return "-0.0" if math.copysign(1.0, value) < 0 else "0.0"
    sign, digit_tuple, exponent = Decimal(repr(value)).as_tuple()
    assert isinstance(exponent, int)
    digits = "".join(map(str, digit_tuple)).rstrip("0") or "0"
    # value = 0.<digits> * 10**point
    point = len(digit_tuple) + exponent
    prefix = "-" if sign else ""
    magnitude = abs(value)
    if 1e-3 <= magnitude < 1e7:
        if point <= 0:
            return f"{prefix}0.{'0' * -point}{digits}"
        if point >= len(digits):
            return f"{prefix}{digits}{'0' * (point - len(digits))}.0"
        return f"{prefix}{digits[:point]}.{digits[point:]}"
    rest = digits[1:] or "0"
    return f"{prefix}{digits[0]}.{rest}E{point - 1}"


# ---------------------------------------------------------------------------------------------
# Writing

# Characters fastjson escapes inside a double-quoted string (default features).
_NEEDS_ESCAPE = re.compile('[\x00-\x1f"\\\\\x7f-\x9f\u2028\u2029]')
_SHORT_ESCAPES = {
    '"': '\\"',
    "\\": "\\\\",
    "\b": "\\b",
    "\f": "\\f",
    "\n": "\\n",
    "\r": "\\r",
    "\t": "\\t",
}


def _escape_char(match: re.Match[str]) -> str:
    ch = match.group()
    short = _SHORT_ESCAPES.get(ch)
    if short is not None:
        return short
    return f"\\u{ord(ch):04X}"


def fastjson_string(text: str) -> str:
    """``text`` as a quoted JSON string literal, escaped as fastjson does."""
    if _NEEDS_ESCAPE.search(text) is None:
        return f'"{text}"'
    return '"' + _NEEDS_ESCAPE.sub(_escape_char, text) + '"'


class InsertionOrderedMap(dict[Any, Any]):
    """A map that :func:`fastjson_dumps` writes in insertion order instead of sorting it.

    Used for Java ``HashMap`` fields whose iteration order the caller has reproduced.
    """


def _key_rank(key: object) -> tuple[int, Any]:
    if isinstance(key, str):
        return (0, _java_sort_key(key))
    if isinstance(key, bool):
        return (1, key)
    if isinstance(key, int | float):
        return (2, key)
    if isinstance(key, MessageQueue):
        return (3, key.java_sort_key())
    return (4, repr(key))


def _write(value: Any, out: list[str]) -> None:
    if value is None:
        out.append("null")
    elif isinstance(value, str):
        out.append(fastjson_string(value))
    elif isinstance(value, Enum):
        out.append(fastjson_string(value.name))
    elif value is True:
        out.append("true")
    elif value is False:
        out.append("false")
    elif isinstance(value, int):
        out.append(str(value))
    elif isinstance(value, float):
        out.append(java_double_str(value))
    elif isinstance(value, Mapping):
        _write_map(value, out)
    elif isinstance(value, MessageQueue):
        _write_map(value.to_json(), out)
    elif isinstance(value, list | tuple):
        _write_array(value, out)
    elif isinstance(value, set | frozenset):
        items = list(value)
        if all(isinstance(v, str) for v in items):
            items.sort(key=_java_sort_key)
        elif all(isinstance(v, int) and not isinstance(v, bool) for v in items):
            items.sort()
        _write_array(items, out)
    elif hasattr(value, "json_value"):
        _write(value.json_value(), out)
    else:
        raise InvalidTypeError(f"cannot write {type(value).__name__} as JSON")


def _write_array(items: Iterable[Any], out: list[str]) -> None:
    out.append("[")
    first = True
    for item in items:
        if not first:
            out.append(",")
        first = False
        _write(item, out)
    out.append("]")


def _write_map(mapping: Mapping[Any, Any], out: list[str]) -> None:
    out.append("{")
    first = True
    keys = mapping if isinstance(mapping, InsertionOrderedMap) else sorted(mapping, key=_key_rank)
    for key in keys:
        value = mapping[key]
        if value is None:
            continue
        if not first:
            out.append(",")
        first = False
        if isinstance(key, str):
            out.append(fastjson_string(key))
        elif key is None:
            out.append("null")
        else:
            _write(key, out)
        out.append(":")
        _write(value, out)
    out.append("}")


def fastjson_dumps(obj: Any) -> bytes:
    """Serialize ``obj`` as fastjson would, as UTF-8 bytes.

    Dicts stand for Java beans and maps: keys are sorted (Java ``String`` order; non-string keys
    after strings; an :class:`InsertionOrderedMap` keeps its order) and entries whose value is
    ``None`` are omitted. Objects with a
    ``json_value()`` method are written as what that method returns.
    """
    out: list[str] = []
    _write(obj, out)
    # Unpaired surrogates become '?' as in Java's String.getBytes(UTF_8).
    return "".join(out).encode("utf-8", "replace")


# ---------------------------------------------------------------------------------------------
# Reading

_MAX_DEPTH = 200
_WS = " \t\n\r"
_DECODER = json.JSONDecoder()


def _freeze(value: Any) -> Any:
    if isinstance(value, dict):
        if value.keys() == {"brokerName", "queueId", "topic"}:
            topic, broker, qid = value["topic"], value["brokerName"], value["queueId"]
            if (
                isinstance(topic, str)
                and isinstance(broker, str)
                and isinstance(qid, int)
                and not isinstance(qid, bool)
            ):
                return MessageQueue(topic, broker, qid)
        return tuple((k, _freeze(v)) for k, v in value.items())
    if isinstance(value, list):
        return tuple(_freeze(v) for v in value)
    return value


class _Parser:
    __slots__ = ("pos", "text")

    def __init__(self, text: str) -> None:
        self.text = text
        self.pos = 0

    def fail(self, what: str) -> ProtocolError:
        return ProtocolError(f"bad JSON at offset {self.pos}: {what}")

    def skip_ws(self) -> None:
        text, pos, n = self.text, self.pos, len(self.text)
        while pos < n and text[pos] in _WS:
            pos += 1
        self.pos = pos

    def parse_document(self) -> Any:
        value = self.value(0)
        self.skip_ws()
        if self.pos != len(self.text):
            raise self.fail("trailing data")
        return value

    def value(self, depth: int) -> Any:
        if depth > _MAX_DEPTH:
            raise self.fail("nesting too deep")
        self.skip_ws()
        if self.pos >= len(self.text):
            raise self.fail("unexpected end")
        ch = self.text[self.pos]
        if ch == "{":
            return self.obj(depth + 1)
        if ch == "[":
            return self.array(depth + 1)
        try:
            value, end = _DECODER.raw_decode(self.text, self.pos)
        except ValueError:
            raise self.fail("bad value") from None
        self.pos = end
        return value

    def obj(self, depth: int) -> dict[Any, Any]:
        self.pos += 1  # '{'
        result: dict[Any, Any] = {}
        self.skip_ws()
        if self.pos < len(self.text) and self.text[self.pos] == "}":
            self.pos += 1
            return result
        while True:
            key = self.value(depth)
            if isinstance(key, dict | list):
                key = _freeze(key)
            self.skip_ws()
            if self.pos >= len(self.text) or self.text[self.pos] != ":":
                raise self.fail("expected ':'")
            self.pos += 1
            result[key] = self.value(depth)
            self.skip_ws()
            if self.pos >= len(self.text):
                raise self.fail("unexpected end in object")
            ch = self.text[self.pos]
            self.pos += 1
            if ch == "}":
                return result
            if ch != ",":
                raise self.fail("expected ',' or '}'")

    def array(self, depth: int) -> list[Any]:
        self.pos += 1  # '['
        result: list[Any] = []
        self.skip_ws()
        if self.pos < len(self.text) and self.text[self.pos] == "]":
            self.pos += 1
            return result
        while True:
            result.append(self.value(depth))
            self.skip_ws()
            if self.pos >= len(self.text):
                raise self.fail("unexpected end in array")
            ch = self.text[self.pos]
            self.pos += 1
            if ch == "]":
                return result
            if ch != ",":
                raise self.fail("expected ',' or ']'")


def tolerant_loads(data: bytes | bytearray | memoryview | str) -> Any:
    """Parse JSON as written by fastjson, including non-string map keys (see module doc).

    Raises :class:`ProtocolError` on anything that is not such JSON (including bad UTF-8).
    """
    if isinstance(data, str):
        text = data
    else:
        try:
            text = bytes(data).decode("utf-8")
        except UnicodeDecodeError as exc:
            raise ProtocolError(f"JSON body is not UTF-8: {exc}") from None
    try:
        return json.loads(text)
    except (ValueError, RecursionError):
        pass
    try:
        return _Parser(text).parse_document()
    except RecursionError:
        raise ProtocolError("bad JSON: nesting too deep") from None

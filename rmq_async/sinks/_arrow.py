"""Columnar conversion of consumed messages into Arrow (the Spark sink's fast path).

Two implementations build the same table (``tests/unit/test_arrow_twins.py`` holds them
equal):

* **Compiled** (``message_columns`` in the codec extension): one pass over the messages' slots
  with the GIL, collecting pointers to their bytes and strings; then, without the GIL, the raw
  properties records are split into pairs (pending properties such as the pull's
  ``MIN_OFFSET``/``MAX_OFFSET`` applied over them), every column is measured, and the Arrow
  buffers (offsets, data, validity) are filled; :func:`_from_buffers` wraps them without a copy.
  Properties are never parsed into Python dicts. A record whose dict would not be a plain list
  of its pairs (a repeated name, bytes that are not UTF-8) takes its pairs from
  ``msg.properties``; a batch with a value of an unexpected type goes to the second path.
* **From Python values** (:func:`_convert_values`, also the path without the extension): one
  Python list per column pulled out of the batch with C-level iteration
  (``map(attrgetter(...))``), the property-based columns (``msg_id``, ``tags``, ``keys``)
  derived from the property dicts, each list handed to Arrow once. ``keys`` is split by Arrow
  (only a batch with empty tokens falls back to splitting in Python) and ``properties`` is
  assembled into a ``MapArray`` from flattened names, values and offsets.

Measured on a 2-core machine, 1 KiB bodies with six properties: compiled about 550,000 to
1,000,000 rows/s, from values about 70,000 rows/s.

Optional body decoding (:func:`decode_values`) parses each body (msgpack or JSON) in Python and
builds one Arrow struct array from the target type. A body that fails to parse, is not a map, or
does not fit the type gives a null value; the batch is never rejected because of one row.
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Callable, Iterable, Sequence
from operator import attrgetter
from typing import Any, Literal

import msgpack  # type: ignore[import-untyped, unused-ignore]
import pyarrow as pa
import pyarrow.compute as pc

from rmq_async.errors import InvalidArgumentError
from rmq_async.protocol import message as _message
from rmq_async.protocol.message import message_columns as _message_columns
from rmq_async.protocol.stored import StoredChunk
from rmq_async.protocol.types import (
    KEY_SEPARATOR,
    PROPERTY_KEYS,
    PROPERTY_TAGS,
    PROPERTY_UNIQ_KEY,
    MessageExt,
    MessageQueue,
)

__all__ = [
    "ARROW_SCHEMA",
    "ValueFormat",
    "chunk_offset_ranges",
    "decode_values",
    "messages_to_arrow",
    "offset_ranges",
    "stored_to_arrow",
]

ValueFormat = Literal["json", "msgpack"]

_TIMESTAMP = pa.timestamp("ms", tz="UTC")
_KEYS_TYPE = pa.list_(pa.field("element", pa.string(), nullable=False))
_PROPERTIES_TYPE = pa.map_(pa.string(), pa.field("value", pa.string(), nullable=False))
_PROPERTY_ENTRY = pa.struct([_PROPERTIES_TYPE.key_field, _PROPERTIES_TYPE.item_field])

#: The row layout of every batch. Only ``tags`` may be null (a message sent without tags);
#: a message without keys has an empty ``keys`` array. Timestamps are UTC, millisecond precision
#: as stored by the broker.
ARROW_SCHEMA: pa.Schema = pa.schema(
    [
        pa.field("topic", pa.string(), nullable=False),
        pa.field("broker_name", pa.string(), nullable=False),
        pa.field("queue_id", pa.int32(), nullable=False),
        pa.field("queue_offset", pa.int64(), nullable=False),
        pa.field("msg_id", pa.string(), nullable=False),
        pa.field("offset_msg_id", pa.string(), nullable=False),
        pa.field("tags", pa.string(), nullable=True),
        pa.field("keys", _KEYS_TYPE, nullable=False),
        pa.field("body", pa.binary(), nullable=False),
        pa.field("properties", _PROPERTIES_TYPE, nullable=False),
        pa.field("born_timestamp", _TIMESTAMP, nullable=False),
        pa.field("store_timestamp", _TIMESTAMP, nullable=False),
        pa.field("born_host", pa.string(), nullable=False),
        pa.field("store_host", pa.string(), nullable=False),
        pa.field("reconsume_times", pa.int32(), nullable=False),
    ]
)

# Errors pyarrow raises when a Python value does not fit the target type.
_CONVERSION_ERRORS = (pa.ArrowInvalid, pa.ArrowTypeError, TypeError, ValueError, OverflowError)


def _column(msgs: Sequence[MessageExt], name: str) -> list[Any]:
    return list(map(attrgetter(name), msgs))


def _keys_array(raw: list[str | None]) -> pa.Array:
    strings = pa.array(raw, pa.string())
    split = pc.split_pattern(strings, KEY_SEPARATOR)
    tokens = pc.list_flatten(split)
    if len(tokens) and pc.any(pc.equal(tokens, "")).as_py():
        # Rare: empty tokens must be dropped (same rule as MessageExt.keys).
        lists = [[k for k in s.split(KEY_SEPARATOR) if k] if s else [] for s in raw]
        return pa.array(lists, _KEYS_TYPE)
    if split.null_count:
        split = pc.fill_null(split, pa.scalar([], split.type))
    return split.cast(_KEYS_TYPE)


def _properties_array(props: list[dict[str, str]]) -> pa.Array:
    offsets = list(itertools.accumulate(map(len, props), initial=0))
    names = list(itertools.chain.from_iterable(props))
    values = list(itertools.chain.from_iterable(map(dict.values, props)))
    return pa.MapArray.from_arrays(
        pa.array(offsets, pa.int32()),
        pa.array(names, pa.string()),
        pa.array(values, pa.string()),
        type=_PROPERTIES_TYPE,
    )


def messages_to_arrow(msgs: Sequence[MessageExt], *, chunk_rows: int = 10_000) -> pa.Table:
    """Convert messages to a table with :data:`ARROW_SCHEMA`, column by column, in one pass each.

    Row ``i`` describes ``msgs[i]``: ``msg_id`` is :attr:`MessageExt.msg_id` (the producer's
    unique key, else the offset message id), ``tags`` the ``TAGS`` property or null, ``keys``
    the ``KEYS`` property split on spaces with empty tokens dropped, ``properties`` every
    property including the system ones (``TAGS``, ``KEYS``, ``UNIQ_KEY``...).

    The table is built in the fewest slices of at most ``chunk_rows`` rows, of even sizes (its
    columns are chunked accordingly; Spark makes a partition of each slice, see
    :func:`even_slices`). Each Arrow call holds the GIL for its whole duration, so slicing
    bounds how long another thread (the event loop) can be kept waiting; small slices are also
    faster than one large conversion.
    """
    if chunk_rows < 1:
        raise InvalidArgumentError(f"chunk_rows must be at least 1, got {chunk_rows}")
    if len(msgs) <= chunk_rows:
        return _convert(msgs)
    bounds = even_slices(len(msgs), chunk_rows)
    return pa.concat_tables([_convert(msgs[start:end]) for start, end in bounds])


def even_slices(rows: int, chunk_rows: int) -> list[tuple[int, int]]:
    """``(start, end)`` of the fewest slices of at most ``chunk_rows`` rows covering ``rows``,
    their sizes differing by one at most.

    ``spark.createDataFrame(table)`` makes one partition, so one task and one file, of each
    slice it cuts at ``spark.sql.execution.arrow.maxRecordsPerBatch`` rows: 25,000 rows cut at
    10,000 are two full tasks and a half-empty one; slices of 8,334 keep the tasks even.
    """
    count = max(1, -(-rows // chunk_rows))
    return [(rows * i // count, rows * (i + 1) // count) for i in range(count)]


def stored_to_arrow(chunks: Sequence[StoredChunk], *, chunk_rows: int = 10_000) -> pa.Table:
    """The table :func:`messages_to_arrow` gives for the messages of ``chunks``, read straight
    from their bodies (compiled ``record_columns``) without a message object per row.

    Chunks are converted in groups, a slice of the table each (a chunk is never split): the
    fewest groups of at most ``chunk_rows`` rows, of about even sizes, as
    :func:`messages_to_arrow` slices (a chunk larger than ``chunk_rows`` makes a group of its
    own). A group the compiled converter declines, and every group without the compiled codec,
    is decoded into messages and converted as those.
    """
    if chunk_rows < 1:
        raise InvalidArgumentError(f"chunk_rows must be at least 1, got {chunk_rows}")
    tables = [_convert_stored(group, rows) for group, rows in _chunk_groups(chunks, chunk_rows)]
    return tables[0] if len(tables) == 1 else pa.concat_tables(tables)


def _chunk_groups(chunks: Sequence[StoredChunk],
                  chunk_rows: int) -> list[tuple[list[StoredChunk], int]]:
    """Whole chunks in groups of at most ``chunk_rows`` rows and about even sizes.

    A group ends at the first chunk boundary at or past its share of the rows, or before a
    chunk that would take it over ``chunk_rows``. The number of groups is planned with a
    group's room less one largest chunk, so that the groups' ends, which fall on chunk
    boundaries, leave no small remainder for a group of its own (a batch of 50,000 rows in
    pulls of 32 is six groups of about 8,333 rows, not five of 9,984 and one of 80).
    """
    total = sum(c.count for c in chunks)
    largest = max((c.count for c in chunks), default=1)
    room = max(1, chunk_rows - largest + 1)
    count = max(1, -(-total // room))
    groups: list[tuple[list[StoredChunk], int]] = []
    group: list[StoredChunk] = []
    rows = done = 0
    for chunk in chunks:
        if group and (rows + chunk.count > chunk_rows
                      or (done + rows) * count >= total * (len(groups) + 1)):
            groups.append((group, rows))
            done += rows
            group, rows = [], 0
        group.append(chunk)
        rows += chunk.count
    if group or not groups:
        groups.append((group, rows))
    return groups


def _convert_stored(group: list[StoredChunk], rows: int) -> pa.Table:
    convert = _message.record_columns
    if convert is not None:
        buffers = convert([(c.data, c.broker_name, c.pending) for c in group], rows,
                          pa.allocate_buffer)
        if buffers is not None:
            return _from_buffers(buffers)
    return _convert([m for chunk in group for m in chunk.messages()])


def _convert(msgs: Sequence[MessageExt]) -> pa.Table:
    if _message_columns is not None:
        buffers = _message_columns(msgs if type(msgs) is list else list(msgs))
        if buffers is not None:
            return _from_buffers(buffers)
    return _convert_values(msgs)


def _variable(kind: pa.DataType, count: int, offsets: bytearray, data: bytearray,
              valid: bytearray | None = None, null_count: int = 0) -> pa.Array:
    """A string or binary array of offsets and data (and a validity bitmap when it has nulls)."""
    return pa.Array.from_buffers(
        kind,
        count,
        [None if valid is None else pa.py_buffer(valid), pa.py_buffer(offsets),
         pa.py_buffer(data)],
        null_count=null_count,
    )


def _string(count: int, offsets: bytearray, data: bytearray) -> pa.Array:
    return _variable(pa.string(), count, offsets, data)


def _fixed(kind: pa.DataType, count: int, data: bytearray) -> pa.Array:
    return pa.Array.from_buffers(kind, count, [None, pa.py_buffer(data)])


def _from_buffers(b: dict[str, Any]) -> pa.Table:
    """The table of the compiled converter's buffers (see ``message_columns``); no copies."""
    n = b["rows"]
    valid, tag_offsets, tag_data = b["tags"]
    tags = _variable(pa.string(), n, tag_offsets, tag_data, valid, b["tags_null"])
    list_offsets, token_offsets, token_data = b["keys"]
    keys = pa.Array.from_buffers(
        _KEYS_TYPE,
        n,
        [None, pa.py_buffer(list_offsets)],
        children=[_string(b["key_tokens"], token_offsets, token_data)],
    )
    map_offsets, name_offsets, names, value_offsets, values = b["properties"]
    entries = b["entries"]
    pairs = pa.Array.from_buffers(
        _PROPERTY_ENTRY,
        entries,
        [None],
        children=[_string(entries, name_offsets, names), _string(entries, value_offsets, values)],
    )
    properties = pa.Array.from_buffers(
        _PROPERTIES_TYPE, n, [None, pa.py_buffer(map_offsets)], children=[pairs]
    )
    columns = [
        _string(n, *b["topic"]),
        _string(n, *b["broker_name"]),
        _fixed(pa.int32(), n, *b["queue_id"]),
        _fixed(pa.int64(), n, *b["queue_offset"]),
        _string(n, *b["msg_id"]),
        _string(n, *b["offset_msg_id"]),
        tags,
        keys,
        _variable(pa.binary(), n, *b["body"]),
        properties,
        _fixed(_TIMESTAMP, n, *b["born_timestamp"]),
        _fixed(_TIMESTAMP, n, *b["store_timestamp"]),
        _string(n, *b["born_host"]),
        _string(n, *b["store_host"]),
        _fixed(pa.int32(), n, *b["reconsume_times"]),
    ]
    return pa.Table.from_arrays(columns, schema=ARROW_SCHEMA)


def _convert_values(msgs: Sequence[MessageExt]) -> pa.Table:
    """The table built from the messages' Python values (the path without the extension)."""
    props: list[dict[str, str]] = _column(msgs, "properties")
    offset_ids: list[str] = _column(msgs, "offset_msg_id")
    msg_ids = [p.get(PROPERTY_UNIQ_KEY) or o for p, o in zip(props, offset_ids, strict=True)]
    columns = [
        pa.array(_column(msgs, "topic"), pa.string()),
        pa.array(_column(msgs, "broker_name"), pa.string()),
        pa.array(_column(msgs, "queue_id"), pa.int32()),
        pa.array(_column(msgs, "queue_offset"), pa.int64()),
        pa.array(msg_ids, pa.string()),
        pa.array(offset_ids, pa.string()),
        pa.array([p.get(PROPERTY_TAGS) for p in props], pa.string()),
        _keys_array([p.get(PROPERTY_KEYS) for p in props]),
        pa.array(_column(msgs, "body"), pa.binary()),
        _properties_array(props),
        pa.array(_column(msgs, "born_timestamp"), _TIMESTAMP),
        pa.array(_column(msgs, "store_timestamp"), _TIMESTAMP),
        pa.array(_column(msgs, "born_host"), pa.string()),
        pa.array(_column(msgs, "store_host"), pa.string()),
        pa.array(_column(msgs, "reconsume_times"), pa.int32()),
    ]
    return pa.Table.from_arrays(columns, schema=ARROW_SCHEMA)


def offset_ranges(msgs: Sequence[MessageExt]) -> dict[MessageQueue, tuple[int, int]]:
    """Lowest and highest queue offset per message queue present in ``msgs``."""
    return chunk_offset_ranges([msgs])


_TOPIC = attrgetter("topic")
_BROKER = attrgetter("broker_name")
_QUEUE_ID = attrgetter("queue_id")
_OFFSET = attrgetter("queue_offset")


def chunk_offset_ranges(
    chunks: Iterable[Sequence[MessageExt] | StoredChunk],
) -> dict[MessageQueue, tuple[int, int]]:
    """:func:`offset_ranges` of the messages of all ``chunks``.

    A stored chunk knows its range; a chunk of messages of one queue (what a consumer offers:
    one pull's messages) is measured with a few C-level passes, without a Python step per
    message; a mixed one message by message.
    """
    return {MessageQueue(*key): span for key, span in queue_offset_spans(chunks).items()}


def queue_offset_spans(
    chunks: Iterable[Sequence[MessageExt] | StoredChunk],
) -> dict[tuple[str, str, int], tuple[int, int]]:
    """:func:`chunk_offset_ranges` keyed by ``(topic, broker_name, queue_id)``: no
    :class:`MessageQueue` is built or hashed (the sink measures every chunk it is offered)."""
    ranges: dict[tuple[str, str, int], tuple[int, int]] = {}
    for chunk in chunks:
        if type(chunk) is StoredChunk:
            _widen(ranges, (chunk.topic, chunk.broker_name, chunk.queue_id),
                   chunk.first_offset, chunk.last_offset)
            continue
        if not chunk:
            continue
        assert not isinstance(chunk, StoredChunk)
        first = chunk[0]
        if (len(chunk) == 1 or (len(set(map(_QUEUE_ID, chunk))) == 1
                                and len(set(map(_TOPIC, chunk))) == 1
                                and len(set(map(_BROKER, chunk))) == 1)):
            _widen(ranges, (first.topic, first.broker_name, first.queue_id),
                   min(map(_OFFSET, chunk)), max(map(_OFFSET, chunk)))
            continue
        for msg in chunk:
            offset = msg.queue_offset
            _widen(ranges, (msg.topic, msg.broker_name, msg.queue_id), offset, offset)
    return ranges


def _widen(ranges: dict[tuple[str, str, int], tuple[int, int]], key: tuple[str, str, int],
           lo: int, hi: int) -> None:
    seen = ranges.get(key)
    if seen is None:
        ranges[key] = (lo, hi)
    elif lo < seen[0] or hi > seen[1]:
        ranges[key] = (min(lo, seen[0]), max(hi, seen[1]))


def _loads_msgpack(body: bytes) -> Any:
    # timestamp=3: msgpack Timestamp values become timezone-aware datetimes (UTC).
    return msgpack.unpackb(body, raw=False, timestamp=3, strict_map_key=False)


_LOADERS: dict[str, Callable[[bytes], Any]] = {"json": json.loads, "msgpack": _loads_msgpack}


def _fit(values: list[Any], value_type: pa.StructType) -> pa.Array:
    """Struct array of ``values``; values that do not fit ``value_type`` become null.

    The whole list is tried first; on failure the list is halved until the offending values are
    isolated, so a few bad rows cost O(bad * log n) conversions instead of one per row.
    """
    try:
        return pa.array(values, value_type)
    except _CONVERSION_ERRORS:
        pass
    if len(values) == 1:
        return pa.array([None], value_type)
    middle = len(values) // 2
    return pa.concat_arrays([_fit(values[:middle], value_type), _fit(values[middle:], value_type)])


def all_nullable(value_type: pa.DataType) -> pa.DataType:
    """``value_type`` with every field, item and map value nullable, at every depth.

    A body that leaves out a field the schema marks non-nullable would otherwise give a row
    whose non-nullable child holds a null (pyarrow builds it so, and Spark trusts the flag);
    it is null as a missing field is with Spark's ``from_json``, which reads every field of
    its schema as nullable too (the JSON path)."""
    if pa.types.is_struct(value_type):
        return pa.struct([pa.field(f.name, all_nullable(f.type), nullable=True,
                                   metadata=f.metadata) for f in value_type])
    if pa.types.is_map(value_type):
        return pa.map_(value_type.key_type, pa.field(value_type.item_field.name,
                                                     all_nullable(value_type.item_type)))
    if pa.types.is_large_list(value_type):
        return pa.large_list(all_nullable(value_type.value_type))
    if pa.types.is_list(value_type):
        return pa.list_(all_nullable(value_type.value_type))
    return value_type


def decode_values(bodies: Sequence[bytes], value_format: ValueFormat, value_type: pa.StructType) -> pa.Array:
    """Decode each body (JSON or msgpack) into a struct array of ``value_type``.

    A body decodes to a row when it parses, its top level is a map, and its fields convert to
    the field types (missing fields become null, fields not in the type are ignored). Any other
    body gives a null row. Only the types the format itself carries convert: JSON strings do not
    become timestamps or decimals here (the Spark sink decodes JSON with Spark's ``from_json``,
    which does).
    """
    try:
        loads = _LOADERS[value_format]
    except KeyError:
        raise InvalidArgumentError(f"unknown value_format {value_format!r}; use 'json' or 'msgpack'")
    values: list[Any] = []
    append = values.append
    for body in bodies:
        try:
            value = loads(body)
        except Exception:  # any malformed body is a null value, never a failed batch
            value = None
        append(value if isinstance(value, dict) else None)
    return _fit(values, value_type)

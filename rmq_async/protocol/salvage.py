"""Decoding a pull body that holds a corrupt record: keep what comes before it.

:func:`~rmq_async.protocol.message.decode_messages` is all or nothing. When it fails, the
consumer still wants the good records in front of the bad one (the Java client keeps them too)
and needs to know which offset is bad, so that one record cannot stall its queue. This module
walks the body record by record with the same decoder and stops at the first record that does
not decode.
"""

from __future__ import annotations

from dataclasses import dataclass

from .errors import ProtocolError
from .message import decode_messages
from .types import MessageExt

__all__ = ["CorruptRecord", "decode_messages_salvaging"]

#: Bytes before a record's queueOffset: totalSize, magicCode, bodyCRC, queueId, flag.
_QUEUE_OFFSET_AT = 20


@dataclass(frozen=True, slots=True)
class CorruptRecord:
    """The first record of a body that could not be decoded."""

    position: int
    """Byte position of the record in the body."""
    queue_offset: int | None
    """Its queue offset as written in its header, when the header is long enough to hold one
    (a corrupt record may carry a wrong one: callers check it against what they pulled)."""
    error: ProtocolError


def decode_messages_salvaging(data: bytes) -> tuple[list[MessageExt], CorruptRecord | None]:
    """Every message of ``data``, or the messages before its first corrupt record and that record.

    A body that decodes as a whole costs one :func:`decode_messages` call; only a failing one
    is walked record by record.
    """
    try:
        return decode_messages(data), None
    except ProtocolError:
        pass
    out: list[MessageExt] = []
    n = len(data)
    pos = 0
    while pos < n:
        queue_offset = None
        if n - pos >= _QUEUE_OFFSET_AT + 8:
            queue_offset = int.from_bytes(data[pos + _QUEUE_OFFSET_AT:pos + _QUEUE_OFFSET_AT + 8],
                                          "big", signed=True)
        if n - pos < 4:
            return out, CorruptRecord(pos, None, ProtocolError(
                f"truncated message record: {n - pos} bytes left"))
        total = int.from_bytes(data[pos:pos + 4], "big", signed=True)
        if total <= 0 or total > n - pos:
            return out, CorruptRecord(pos, queue_offset, ProtocolError(
                f"bad message record size {total} ({n - pos} bytes left)"))
        try:
            out.extend(decode_messages(data[pos:pos + total]))
        except ProtocolError as exc:
            return out, CorruptRecord(pos, queue_offset, exc)
        pos += total
    return out, None

"""Stored chunks: the records of one pull, kept as the broker sent them.

A sink writes columns, not messages, so for a sink subscription the pull loop does not decode
a FOUND body into a :class:`~rmq_async.protocol.types.MessageExt` per record. It checks the body
once (:func:`StoredChunk.scan`: with the compiled codec, one pass without Python objects) and
keeps it whole; the sink later converts the bodies of a batch straight into Arrow buffers
(``record_columns``), each row the same as the decoded, stamped message would give. A chunk
is decoded into messages only when something needs them: a failed write, whose messages are sent
back one by one, or a batch converted without the compiled codec.

Only plain bodies are kept this way: every record of the pull's topic and queue, offsets
rising, uncompressed, not an inner batch, IPv4 hosts. Anything else (and every body when the
compiled codec is not in use) is decoded as usual, which inflates, unwraps or reports a corrupt
record the usual way.
"""

from __future__ import annotations

from rmq_async.protocol import message as _message
from rmq_async.protocol.types import MessageExt

__all__ = ["StoredChunk"]


class StoredChunk:
    """The undecoded records of one pull of one queue (``count`` of them, offsets
    ``first_offset`` to ``last_offset``, ``size`` body bytes) and what the pull adds to each
    message: the queue's broker name and ``pending`` properties (``MIN_OFFSET``,
    ``MAX_OFFSET``)."""

    __slots__ = ("broker_name", "count", "data", "first_offset", "last_offset", "max_offset",
                 "pending", "queue_id", "size", "topic")

    def __init__(self, data: bytes, topic: str, broker_name: str, queue_id: int,
                 first_offset: int, last_offset: int, count: int, size: int,
                 pending: dict[str, str] | None = None, max_offset: int = -1) -> None:
        self.data = data
        self.topic = topic
        self.broker_name = broker_name
        self.queue_id = queue_id
        self.first_offset = first_offset
        self.last_offset = last_offset
        self.count = count
        self.size = size
        #: Shared with nobody who changes it: replaced, never changed in place.
        self.pending = pending
        #: The queue's max offset the broker reported with this pull (-1: unknown).
        self.max_offset = max_offset

    @classmethod
    def scan(cls, data: bytes, topic: str, broker_name: str,
             pending: dict[str, str] | None = None, max_offset: int = -1) -> StoredChunk | None:
        """The chunk of a FOUND body, or None when it must be decoded as usual (see the module
        docstring; always None without the compiled codec)."""
        scan = _message.scan_records
        if scan is None or type(data) is not bytes:
            return None
        found = scan(data, topic.encode("utf-8"))
        if found is None:
            return None
        count, first, last, size, queue_id = found
        return cls(data, topic, broker_name, queue_id, first, last, count, size, pending,
                   max_offset)

    def messages(self) -> list[MessageExt]:
        """The chunk decoded and stamped as the pull loop would have delivered it."""
        msgs = _message.decode_messages(self.data)
        if msgs:
            _message.stamp_delivered(msgs, self.broker_name, self.pending or {})
        return msgs

    def __len__(self) -> int:
        return self.count

    def __repr__(self) -> str:
        return (f"<StoredChunk {self.topic}@{self.broker_name}:{self.queue_id} "
                f"offsets {self.first_offset}..{self.last_offset} count={self.count}>")

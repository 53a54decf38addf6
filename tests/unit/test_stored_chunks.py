"""Stored chunks: a sink subscription's pulls kept undecoded, cached as one entry each, and
converted straight from their bodies into the same Arrow rows the decoded messages give.

The compiled scan and converter are checked against the decoder and the values path
(hypothesis, valid and odd records); the ProcessQueue's chunk entries against the offsets and
counts the same messages would give one by one.
"""

from __future__ import annotations

import random
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rmq_async.consumer.process_queue import ProcessQueue
from rmq_async.protocol import message
from rmq_async.protocol.message import (
    COMPRESSION_LZ4,
    decode_messages,
    encode_batch,
    encode_stored_message,
)
from rmq_async.protocol.stored import StoredChunk
from rmq_async.protocol.types import Message, MessageExt
from rmq_async.sinks import _arrow

needs_compiled = pytest.mark.skipif(message.scan_records is None,
                                    reason="compiled codec not built or disabled")

TWINS = settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])

PULLED = {"MIN_OFFSET": "0", "MAX_OFFSET": "900"}


def record(offset: int, *, topic: str = "orders", queue_id: int = 2, body: bytes = b"x" * 40,
           props: dict[str, str] | None = None, born_host: str = "127.0.0.1:50001",
           store_host: str = "10.0.0.7:10911", **kw: Any) -> bytes:
    msg = MessageExt(topic=topic, body=body, queue_id=queue_id, queue_offset=offset,
                     properties={"UNIQ_KEY": f"U{offset:06d}", "TAGS": "t"} if props is None
                     else props,
                     commit_log_offset=1000 + offset * 200, born_timestamp=1_700_000_000_000,
                     born_host=born_host, store_timestamp=1_700_000_000_500,
                     store_host=store_host, reconsume_times=offset % 3)
    return encode_stored_message(msg, **kw)


def body_of(offsets: range, **kw: Any) -> bytes:
    return b"".join(record(o, **kw) for o in offsets)


def chunk_of(first: int, count: int, *, size: int = 40, max_offset: int = -1) -> StoredChunk:
    """A chunk built without the scan (works on both paths)."""
    data = body_of(range(first, first + count), body=b"y" * size)
    return StoredChunk(data, "orders", "broker-a", 2, first, first + count - 1, count,
                       count * size, dict(PULLED), max_offset)


# ---------------------------------------------------------------------------- scan


@needs_compiled
def test_scan_measures_a_plain_body() -> None:
    data = body_of(range(100, 132), body=b"z" * 300)
    chunk = StoredChunk.scan(data, "orders", "broker-a", PULLED, 900)
    assert chunk is not None
    assert (chunk.first_offset, chunk.last_offset, chunk.count, chunk.size, chunk.queue_id) == \
        (100, 131, 32, 32 * 300, 2)
    assert chunk.pending is PULLED and chunk.max_offset == 900
    msgs = chunk.messages()
    assert [m.queue_offset for m in msgs] == list(range(100, 132))
    assert all(m.broker_name == "broker-a" and m.get_property("MAX_OFFSET") == "900" for m in msgs)


@needs_compiled
@pytest.mark.parametrize("why", ["compressed", "batch", "ipv6", "other topic", "other queue",
                                 "offsets not rising", "truncated", "bad magic", "empty"])
def test_scan_declines_what_must_be_decoded(why: str) -> None:
    good = body_of(range(0, 3))
    data = {
        "compressed": good + record(3, body=b"a" * 5000, compress=True,
                                    compression=COMPRESSION_LZ4),
        "batch": good + _inner_batch(3),
        "ipv6": good + record(3, store_host="[2001:db8::1]:10911"),
        "other topic": good + record(3, topic="other"),
        "other queue": good + record(3, queue_id=5),
        "offsets not rising": good + record(2),
        "truncated": good[:-1],
        "bad magic": good[:4] + b"\x00\x00\x00\x00" + good[8:],
        "empty": b"",
    }[why]
    assert message.scan_records is not None
    assert message.scan_records(data, b"orders") is None
    assert StoredChunk.scan(data, "orders", "broker-a") is None


def _inner_batch(offset: int) -> bytes:
    batch = encode_batch([Message("orders", b"one"), Message("orders", b"two")])
    outer = MessageExt(topic="orders", body=batch, queue_id=2, queue_offset=offset,
                       sys_flag=0xC0, born_host="1.2.3.4:5", store_host="1.2.3.4:6")
    return encode_stored_message(outer)


@needs_compiled
@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=64), st.integers(0, 400), st.data())
def test_scan_never_accepts_what_the_decoder_does_not_give_alike(
        noise: bytes, at: int, data: st.DataObject) -> None:
    # Whatever the bytes, an accepted body decodes into exactly the messages it counted.
    good = body_of(range(10, 14))
    at = min(at, len(good))
    mutated = good[:at] + noise + good[at + data.draw(st.integers(0, 8)):]
    assert message.scan_records is not None
    found = message.scan_records(mutated, b"orders")
    if found is None:
        return
    count, first, last, size, queue_id = found
    msgs = decode_messages(mutated)
    assert len(msgs) == count
    assert (msgs[0].queue_offset, msgs[-1].queue_offset) == (first, last)
    assert sum(len(m.body) for m in msgs) == size
    assert all(m.topic == "orders" and m.queue_id == queue_id for m in msgs)


def test_without_the_compiled_codec_nothing_is_kept_undecoded(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(message, "scan_records", None)
    assert StoredChunk.scan(body_of(range(0, 4)), "orders", "broker-a") is None


# ---------------------------------------------------------------------------- Arrow twins

texts = st.text(alphabet=st.characters(blacklist_categories=["Cs"]), max_size=10)
names = st.one_of(st.sampled_from(["TAGS", "KEYS", "UNIQ_KEY", "MIN_OFFSET", "MAX_OFFSET"]),
                  st.text(alphabet=st.characters(blacklist_characters="\x00\x01\x02",
                                                 blacklist_categories=["Cs"]),
                          min_size=1, max_size=6))
values = st.one_of(st.sampled_from(["a b", " k  ", "x", "中 文"]),
                   st.text(alphabet=st.characters(blacklist_characters="\x02",
                                                  blacklist_categories=["Cs"]),
                           min_size=1, max_size=10))
# Raw properties as a broker may hold them: repeated names, stray separators, bad UTF-8.
odd_raw = st.sampled_from([b"", b"TAGS\x01a\x02TAGS\x01b", b"K\x01\xe4\xb8", b"\x01v\x02a\x01b",
                           b"KEYS\x01  \x02UNIQ_KEY\x01", b"\xed\xa0\x80\x01v"])


@st.composite
def chunks(draw: st.DrawFn) -> StoredChunk:
    first = draw(st.integers(0, 2**40))
    count = draw(st.integers(1, 6))
    host = draw(st.sampled_from(["127.0.0.1:1", "10.1.2.3:10911", "255.255.255.255:65535"]))
    parts = []
    for offset in range(first, first + count):
        common = {"topic": "topic-中", "queue_id": 7, "body": draw(st.binary(max_size=50)),
                  "store_host": host, "born_host": draw(st.sampled_from([host, "1.1.1.1:2"]))}
        if draw(st.integers(0, 5)) == 0:
            parts.append(_with_raw_properties(offset, draw(odd_raw), **common))
        else:
            parts.append(record(offset, props=draw(st.dictionaries(names, values, max_size=5)),
                                **common))
    pending = draw(st.sampled_from([None, {}, dict(PULLED), {"TAGS": "over", "x": "y"}]))
    broker = draw(st.sampled_from(["broker-a", "b中"]))
    chunk = StoredChunk.scan(b"".join(parts), "topic-中", broker, pending, first + count)
    assert chunk is not None
    return chunk


def _with_raw_properties(offset: int, raw: bytes, **kw: Any) -> bytes:
    """One record whose stored properties are exactly ``raw``."""
    data = record(offset, props={}, **kw)
    assert data.endswith(b"\x00\x00")  # no properties: their length is last
    out = data[:-2] + len(raw).to_bytes(2, "big") + raw
    return len(out).to_bytes(4, "big") + out[4:]


@needs_compiled
@TWINS
@given(st.lists(chunks(), min_size=1, max_size=5), st.integers(1, 12))
def test_rows_from_bodies_equal_the_rows_of_the_decoded_messages(
        group: list[StoredChunk], chunk_rows: int) -> None:
    table = _arrow.stored_to_arrow(group, chunk_rows=chunk_rows)
    table.validate(full=True)
    msgs = [m for c in group for m in c.messages()]
    expected = _arrow._convert_values(msgs)
    assert table.schema == expected.schema == _arrow.ARROW_SCHEMA
    assert table.equals(expected), (table.to_pylist(), expected.to_pylist())
    assert _arrow.chunk_offset_ranges(group) == _arrow.offset_ranges(msgs)


@given(st.lists(st.integers(1, 40), max_size=60), st.integers(1, 100))
def test_chunk_groups_are_even_slices_within_the_spark_batch_size(
        sizes: list[int], chunk_rows: int) -> None:
    offsets = [sum(sizes[:i]) for i in range(len(sizes))]
    group = [chunk_of(first, n, size=8) for first, n in zip(offsets, sizes, strict=True)]
    groups = _arrow._chunk_groups(group, chunk_rows)
    # Every chunk once, in order, and each group's row count is its chunks'.
    assert [c for g, _ in groups for c in g] == group
    assert all(rows == sum(c.count for c in g) for g, rows in groups)
    # No group over chunk_rows unless it is one chunk larger than that, so Spark cuts no slice.
    assert all(rows <= chunk_rows or len(g) == 1 for g, rows in groups)
    # As few groups as chunk_rows less one largest chunk allows, so no small remainder.
    total = sum(sizes)
    room = max(1, chunk_rows - max(sizes, default=1) + 1)
    assert len(groups) <= max(1, -(-total // room), sum(n > chunk_rows for n in sizes))


def test_a_spark_batch_of_pulls_of_32_is_six_even_slices() -> None:
    # 50,080 rows in pulls of 32 at Spark's 10,000 rows per Arrow batch: six partitions of
    # about 8,350, where whole 10,000-row groups left Spark to cut 16-row partitions off each.
    group = [chunk_of(32 * i, 32, size=8) for i in range(1565)]
    table = _arrow.stored_to_arrow(group, chunk_rows=10_000)
    sizes = [len(c) for c in table.column("queue_offset").chunks]
    assert sizes == [len(b) for b in table.to_batches(max_chunksize=10_000)]
    assert len(sizes) == 6 and max(sizes) - min(sizes) <= 32 and sum(sizes) == 50_080


def test_rows_without_the_compiled_converter_are_the_decoded_messages(
        monkeypatch: pytest.MonkeyPatch) -> None:
    group = [chunk_of(0, 5), chunk_of(5, 3)]
    monkeypatch.setattr(message, "record_columns", None)
    table = _arrow.stored_to_arrow(group, chunk_rows=4)
    assert table.equals(_arrow._convert_values([m for c in group for m in c.messages()]))
    assert table.column("queue_offset").to_pylist() == list(range(8))


# ---------------------------------------------------------------------------- ProcessQueue


def test_chunk_entries_count_and_commit_like_their_messages() -> None:
    pq = ProcessQueue()
    a, b, c = chunk_of(0, 32, max_offset=200), chunk_of(32, 32), chunk_of(64, 10, max_offset=200)
    assert pq.put_chunk(a) is True  # a consume turn is asked for, as with messages
    assert pq.put_chunk(b) is False
    pq.put_chunk(c)
    assert (pq.msg_count, pq.msg_size) == (74, 74 * 40)
    assert (pq.min_offset, pq.max_offset, pq.max_span) == (0, 73, 73)
    assert pq.msg_acc_count == 200 - 73
    assert pq.put_chunk(chunk_of(32, 32)) is False and pq.msg_count == 74  # already cached
    assert pq.remove_chunk(b) == 0  # a is still cached: the offset cannot pass it
    assert pq.remove_chunk(a) == 64
    assert pq.remove_chunk(a) == 64  # twice: nothing changes
    info = pq.to_info(64)
    assert (info["cachedMsgCount"], info["cachedMsgMinOffset"], info["cachedMsgMaxOffset"]) == \
        (10, 64, 73)
    assert pq.remove_chunk(c) == 74
    assert (pq.msg_count, pq.msg_size, pq.max_span) == (0, 0, 0)
    assert pq.remove_chunk(c) == -1  # empty: nothing to commit, as remove_messages


def test_a_failed_chunk_is_unpacked_into_its_messages() -> None:
    pq = ProcessQueue()
    a, b = chunk_of(0, 8), chunk_of(8, 8)
    pq.put_chunk(a)
    pq.put_chunk(b)
    msgs = a.messages()
    assert pq.unpack_chunk(a, msgs) is True
    assert (pq.msg_count, pq.msg_size, pq.min_offset, pq.max_offset) == (16, 16 * 40, 0, 15)
    assert pq.unpack_chunk(a, msgs) is False  # no longer cached as a chunk
    assert pq.remove_messages(msgs[:3]) == 3
    assert pq.remove_messages(msgs[3:]) == 8  # the chunk 8..15 still holds the offset
    assert pq.remove_chunk(b) == 16


def test_chunks_and_messages_share_one_queue() -> None:
    pq = ProcessQueue()
    loose = chunk_of(0, 4).messages()
    pq.put_messages(loose)
    chunk = chunk_of(4, 4)
    pq.put_chunk(chunk)
    assert (pq.msg_count, pq.max_span) == (8, 7)
    # Removing messages never removes the chunk filed under an offset they share.
    assert pq.remove_messages(chunk.messages()) == 0
    assert pq.remove_messages(loose) == 4
    assert pq.remove_chunk(chunk) == 8
    expired = ProcessQueue()
    expired.put_chunk(chunk_of(0, 2))
    assert expired.clean_expired_messages(10**15, 1) == []  # a chunk has no start time


@needs_compiled
def test_a_typical_pull_converts_without_decoding(monkeypatch: pytest.MonkeyPatch) -> None:
    rng = random.Random(3)
    group = []
    for first in range(0, 320, 32):
        data = body_of(range(first, first + 32), body=rng.randbytes(1024))
        chunk = StoredChunk.scan(data, "orders", "broker-a", PULLED, 320)
        assert chunk is not None
        group.append(chunk)

    def refuse(self: StoredChunk) -> list[MessageExt]:
        raise AssertionError("a plain chunk was decoded")

    monkeypatch.setattr(StoredChunk, "messages", refuse)
    table = _arrow.stored_to_arrow(group, chunk_rows=100)
    monkeypatch.undo()
    assert table.num_rows == 320
    assert table.equals(_arrow._convert_values([m for c in group for m in c.messages()]))


def _batch_record(offset: int, **kw: Any) -> bytes:
    # As the broker stores each message of a batch: WAIT twice (the message's own, then the
    # batch's), the second with another value here to show which one the row keeps.
    raw = record(offset, props={"UNIQ_KEY": f"U{offset:06d}", "WAIT": "true", "TAGS": "t",
                                "WAXX": "fals"}, **kw)
    return raw.replace(b"WAXX\x01", b"WAIT\x01")


@needs_compiled
def test_a_pull_of_batch_sent_messages_is_read_without_python() -> None:
    convert = message.record_columns
    assert convert is not None
    data = b"".join(_batch_record(o, body=b"q" * 100) for o in range(64, 96))
    chunk = StoredChunk.scan(data, "orders", "broker-a", PULLED, 900)
    assert chunk is not None
    buffers = convert([(chunk.data, chunk.broker_name, chunk.pending)], 32, None)
    assert buffers is not None
    # A repeated name is resolved in the compiled pass, not by a dict per row.
    assert buffers["python_rows"] == 0
    table = _arrow.stored_to_arrow([chunk])
    msgs = chunk.messages()
    assert table.equals(_arrow._convert_values(msgs))
    # The dict's rule: the first place, the last value.
    assert list(msgs[0].properties.items())[:3] == \
        [("UNIQ_KEY", "U000064"), ("WAIT", "fals"), ("TAGS", "t")]
    assert table.column("properties")[0].as_py()[:3] == \
        [("UNIQ_KEY", "U000064"), ("WAIT", "fals"), ("TAGS", "t")]
    # What still goes through Python is counted: properties that are not valid UTF-8.
    bad = record(96, props={"UNIQ_KEY": "U000096", "TAGS": "t", "X": "\u00e9"}).replace(
        "\u00e9".encode(), b"\xc3\x28")
    mixed = StoredChunk.scan(data + bad, "orders", "broker-a", PULLED, 900)
    assert mixed is not None
    buffers = convert([(mixed.data, mixed.broker_name, mixed.pending)], 33, None)
    assert buffers is not None and buffers["python_rows"] == 1
    assert _arrow.stored_to_arrow([mixed]).equals(_arrow._convert_values(mixed.messages()))

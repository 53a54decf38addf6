"""Stored-message decoding and encoding, properties, ids, batches."""

from __future__ import annotations

import importlib.metadata
import random
import re
import struct
import zlib
from datetime import datetime

import pytest

from rmq_async.protocol.codes import (
    COMPRESSION_LZ4,
    COMPRESSION_ZLIB,
    COMPRESSION_ZSTD,
    MSG_BORNHOST_V6_FLAG,
    MSG_COMPRESSED_FLAG,
    MSG_INNER_BATCH_FLAG,
    MSG_NEED_UNWRAP_FLAG,
    MSG_STOREHOST_V6_FLAG,
)
from rmq_async.protocol.errors import BodyDecompressionError, ProtocolError
from rmq_async.protocol.message import (
    MAGIC_V1,
    MAGIC_V2,
    UniqKeyGenerator,
    body_crc,
    compress_body,
    decode_message,
    decode_messages,
    decode_properties,
    encode_batch,
    encode_properties,
    encode_stored_message,
    offset_msg_id,
    parse_host,
)
from rmq_async.protocol.types import Message, MessageExt

# Records written by RocketMQ 5.3.3 MessageDecoder.encode for one MessageExt: topic TopicTest,
# body "hello world", queueId 3, flag 7, queueOffset 1234, commitLogOffset 987654321,
# born 1700000000123 from 10.0.0.5:40001 (or [2001:db8::1]), stored 1700000000456 on
# 192.168.1.20:10911 (or [::1]), reconsumeTimes 2, bodyCRC field 12345, properties
# k1=v1, TAGS=TagA, KEYS="key1 key2", UNIQ_KEY=0A000005109C18B4AAC2754A8D0F0000.
_PROPS_HEX = (
    "00496b31017631024b455953016b657931206b65793202554e49515f4b455901304130303030303531303943"
    "31384234414143323735344138443046303030300254414753015461674102"
)
JAVA_V4 = bytes.fromhex(
    "000000b8daa320a700003039000000030000000700000000000004d2000000003ade68b100000000000001"
    "8bcfe5687b0a00000500009c410000018bcfe569c8c0a8011400002a9f0000000200000000000000000000"
    "000b68656c6c6f20776f726c6409546f70696354657374" + _PROPS_HEX
)
JAVA_V6 = bytes.fromhex(
    "000000d0daa320a700003039000000030000000700000000000004d2000000003ade68b100000030000001"
    "8bcfe5687b20010db800000000000000000000000100009c410000018bcfe569c8000000000000000000000000"
    "0000000100002a9f0000000200000000000000000000000b68656c6c6f20776f726c6409546f7069635465"
    "7374" + _PROPS_HEX
)
JAVA_V6_BORN_ONLY = bytes.fromhex(
    "000000c4daa320a700003039000000030000000700000000000004d2000000003ade68b100000010000001"
    "8bcfe5687b20010db800000000000000000000000100009c410000018bcfe569c8c0a8011400002a9f0000"
    "000200000000000000000000000b68656c6c6f20776f726c6409546f70696354657374" + _PROPS_HEX
)
JAVA_ZLIB = bytes.fromhex(
    "000000c0daa320a700003039000000030000000700000000000004d2000000003ade68b100000301000001"
    "8bcfe5687b0a00000500009c410000018bcfe569c8c0a8011400002a9f0000000200000000000000000000"
    "0013785ecb48cdc9c95728cf2fca4901001a0b045d09546f70696354657374" + _PROPS_HEX
)
# MessageDecoder.encodeMessages of three messages (body b0..b2, TAGS=TagB, i=0..2, WAIT=true).
JAVA_BATCH = bytes.fromhex(
    "000000300000000000000000000000000000000262300018690130025741495401747275650254414753015461"
    "674202000000300000000000000000000000000000000262310018690131025741495401747275650254414753"
    "015461674202000000300000000000000000000000000000000262320018690132025741495401747275650254"
    "414753015461674202"
)
JAVA_PROPERTIES = {
    "k1": "v1", "TAGS": "TagA", "KEYS": "key1 key2", "UNIQ_KEY": "0A000005109C18B4AAC2754A8D0F0000",
}


def _check_java_fields(m: MessageExt) -> None:
    assert m.topic == "TopicTest"
    assert m.body == b"hello world"
    assert (m.queue_id, m.flag, m.queue_offset, m.commit_log_offset) == (3, 7, 1234, 987654321)
    assert (m.born_timestamp, m.store_timestamp) == (1700000000123, 1700000000456)
    assert (m.reconsume_times, m.prepared_transaction_offset, m.body_crc) == (2, 0, 12345)
    assert m.properties == JAVA_PROPERTIES
    assert m.msg_id == "0A000005109C18B4AAC2754A8D0F0000"
    assert m.tags == "TagA" and m.keys == ["key1", "key2"]


def test_decode_java_ipv4_record() -> None:
    [m] = decode_messages(JAVA_V4)
    _check_java_fields(m)
    assert m.sys_flag == 0 and m.store_size == len(JAVA_V4)
    assert m.born_host == "10.0.0.5:40001" and m.store_host == "192.168.1.20:10911"
    assert m.offset_msg_id == "C0A8011400002A9F000000003ADE68B1"


def test_decode_java_ipv6_records() -> None:
    [m] = decode_messages(JAVA_V6)
    _check_java_fields(m)
    assert m.sys_flag == MSG_BORNHOST_V6_FLAG | MSG_STOREHOST_V6_FLAG
    assert m.born_host == "[2001:db8::1]:40001" and m.store_host == "[::1]:10911"
    assert m.offset_msg_id == "0000000000000000000000000000000100002A9F000000003ADE68B1"
    [b] = decode_messages(JAVA_V6_BORN_ONLY)
    assert b.born_host == "[2001:db8::1]:40001" and b.store_host == "192.168.1.20:10911"
    assert b.offset_msg_id == "C0A8011400002A9F000000003ADE68B1"


def test_decode_java_zlib_record() -> None:
    [m] = decode_messages(JAVA_ZLIB)
    _check_java_fields(m)
    assert m.sys_flag == 0x300  # compressed flag cleared, type bits kept
    [raw] = decode_messages(JAVA_ZLIB, decompress=False)
    assert raw.sys_flag & MSG_COMPRESSED_FLAG and zlib.decompress(raw.body) == b"hello world"


def test_decode_concatenation_and_input_types() -> None:
    body = JAVA_V4 + JAVA_V6 + JAVA_ZLIB + JAVA_V6_BORN_ONLY
    for data in (body, bytearray(body), memoryview(body)):
        msgs = decode_messages(data)
        assert [m.body for m in msgs] == [b"hello world"] * 4
    assert decode_messages(b"") == []


def test_decode_message_single_record() -> None:
    assert decode_message(JAVA_V6).store_host == "[::1]:10911"
    with pytest.raises(ProtocolError):
        decode_message(JAVA_V4 + JAVA_V4)
    with pytest.raises(ProtocolError):
        decode_message(b"")


def _msg(**kw: object) -> MessageExt:
    base: dict[str, object] = dict(
        topic="TopicTest", body=b"payload", queue_id=1, queue_offset=10, flag=0, sys_flag=0,
        properties={"TAGS": "a"}, commit_log_offset=4096, born_timestamp=1, born_host="1.2.3.4:5",
        store_timestamp=2, store_host="5.6.7.8:10911", reconsume_times=0,
    )
    base.update(kw)
    return MessageExt(**base)  # type: ignore[arg-type]


def test_encode_decode_round_trip_fields() -> None:
    m = _msg(flag=-3, reconsume_times=4, prepared_transaction_offset=77, queue_offset=2**40,
             properties={"a": "1", "b": "x\x01y"})
    rec = encode_stored_message(m)
    [back] = decode_messages(rec)
    for name in ("topic", "body", "queue_id", "queue_offset", "flag", "sys_flag", "properties",
                 "commit_log_offset", "born_timestamp", "born_host", "store_timestamp",
                 "store_host", "reconsume_times", "prepared_transaction_offset"):
        assert getattr(back, name) == getattr(m, name), name
    assert back.body_crc == body_crc(b"payload") and back.store_size == len(rec)


def test_magic_v2_for_long_topics() -> None:
    topic = "T" * 200
    rec = encode_stored_message(_msg(topic=topic))
    assert struct.unpack_from(">i", rec, 4)[0] == MAGIC_V2
    assert decode_messages(rec)[0].topic == topic
    short_v2 = encode_stored_message(_msg(), magic=MAGIC_V2)
    assert decode_messages(short_v2)[0].topic == "TopicTest"
    with pytest.raises(ValueError):
        encode_stored_message(_msg(topic=topic), magic=MAGIC_V1)


def test_ipv6_encode_sets_flags() -> None:
    rec = encode_stored_message(_msg(born_host="[::1]:1", store_host="[fe80::2]:3"))
    [m] = decode_messages(rec)
    assert m.sys_flag & MSG_BORNHOST_V6_FLAG and m.sys_flag & MSG_STOREHOST_V6_FLAG
    assert (m.born_host, m.store_host) == ("[::1]:1", "[fe80::2]:3")


def test_compressed_round_trip_and_type_zero_is_zlib() -> None:
    body = b"abc" * 5000
    rec = encode_stored_message(_msg(body=body), compress=True)
    assert decode_messages(rec)[0].body == body
    # sysFlag compression type 0 (older writers) also means zlib
    rec0 = encode_stored_message(
        _msg(body=zlib.compress(body), sys_flag=MSG_COMPRESSED_FLAG)
    )
    assert decode_messages(rec0)[0].body == body


def test_decompression_limits_and_errors() -> None:
    bomb = encode_stored_message(_msg(body=b"\0" * 1_000_000), compress=True)
    with pytest.raises(ProtocolError, match="exceeds"):
        decode_messages(bomb, max_body_size=1000)
    bad = encode_stored_message(_msg(body=b"not zlib", sys_flag=MSG_COMPRESSED_FLAG | 0x300))
    with pytest.raises(ProtocolError):
        decode_messages(bad)
    truncated = encode_stored_message(
        _msg(body=zlib.compress(b"x" * 1000)[:-6], sys_flag=MSG_COMPRESSED_FLAG | 0x300)
    )
    with pytest.raises(ProtocolError):
        decode_messages(truncated)
    unknown = encode_stored_message(_msg(sys_flag=MSG_COMPRESSED_FLAG | 0x500))
    with pytest.raises(ProtocolError, match="compression type"):
        decode_messages(unknown)


# Bodies compressed by RocketMQ 5.3.3's own compressors (CompressorFactory.getCompressor(type)
# .compress(body, 5), as DefaultMQProducer does with its default level): lz4-java's
# LZ4FrameOutputStream, zstd-jni's ZstdOutputStream (written, flushed, closed) and a Deflater.
_JAVA_TEXT = "".join(f"rocketmq body {i % 7} " for i in range(300)).encode()
_JAVA_BODIES = {
    COMPRESSION_LZ4: bytes.fromhex(
    "04224d1860707348000000fa01726f636b65746d7120626f647920302010001b3110001b3210001b3310001b3410001b"
    "3510001b3610000f7000ffffffffffffffffffffffffffffffffffff3c50647920352000000000"
    ),
    COMPRESSION_ZSTD: bytes.fromhex(
    "28b52ffd00589c0500c6132612b02763d7605123d70d0c53242545ea250e0625001e001e00b9cb297739e52ea7dce594"
    "bb9c729753ee72ca5d4eb9cb696424040560180a880121501c0253ee72ca5d4eb9cb297739e52ea7dce594bb9c729753"
    "ee72ca5d4eb9cb29e594bb9c729753ee72ca5d4eb9cb297739e52ea7dce594bb9c729753ee32c3e594bb9c729753ee72"
    "ca5d4eb9cb297739e52ea7dce594bb9c729753ee812ba811e0efbf01e1cf0111fc097f492699611a0c505501010000"
    ),
    COMPRESSION_ZLIB: bytes.fromhex(
    "785eedcdb10d80201445d155fe0820c2402895210462c3f6d4bc82096e79aa33daf395bf76cbed9de66c6cf6e24b1cc4"
    "b7388a93988f8f8f8f8f8f8f8f8f8f8f8f8f8f8f8f8feffc2d4888a00c"
    ),
}
_TYPES = [COMPRESSION_LZ4, COMPRESSION_ZSTD, COMPRESSION_ZLIB]
_IDS = ["lz4", "zstd", "zlib"]


def _compressed(body: bytes, ctype: int) -> bytes:
    return encode_stored_message(_msg(body=body, sys_flag=MSG_COMPRESSED_FLAG | (ctype << 8)))


@pytest.mark.parametrize("ctype", _TYPES, ids=_IDS)
def test_java_compressed_bodies(ctype: int) -> None:
    [m] = decode_messages(_compressed(_JAVA_BODIES[ctype], ctype))
    assert len(_JAVA_TEXT) == 4800
    assert m.body == _JAVA_TEXT
    assert not m.sys_flag & MSG_COMPRESSED_FLAG
    assert m.sys_flag & 0x700 == ctype << 8  # the type bits stay, as in Java


@pytest.mark.parametrize("ctype", _TYPES, ids=_IDS)
@pytest.mark.parametrize("level", [1, 5, 9])
def test_compressed_round_trip_every_type(ctype: int, level: int) -> None:
    rnd = random.Random(ctype * 100 + level)
    for body in (rnd.randbytes(4096), rnd.randbytes(200 * 1024), _JAVA_TEXT * 40, b""):
        if not body and ctype == COMPRESSION_ZLIB:
            continue
        rec = encode_stored_message(_msg(body=body), compress=True, compression=ctype,
                                    compress_level=level)
        [m] = decode_messages(rec)
        assert m.body == body


@pytest.mark.parametrize("ctype", [COMPRESSION_LZ4, COMPRESSION_ZSTD], ids=["lz4", "zstd"])
def test_concatenated_frames_are_read_to_the_end(ctype: int) -> None:
    # lz4-java's LZ4FrameInputStream and zstd-jni's ZstdInputStream go on with the next frame.
    frames = compress_body(b"first frame " * 500, ctype) + compress_body(b"second " * 700, ctype)
    [m] = decode_messages(_compressed(frames, ctype))
    assert m.body == b"first frame " * 500 + b"second " * 700


@pytest.mark.parametrize("ctype", _TYPES, ids=_IDS)
def test_bodies_that_cannot_be_inflated(ctype: int) -> None:
    good = _JAVA_BODIES[ctype]
    cases = {
        "garbage": b"this is not a compressed body at all",
        "truncated": good[: len(good) // 2],
        "cut-at-end": good[:-3],
    }
    if ctype != COMPRESSION_ZLIB:  # Java's zlib stream ignores what follows its end
        cases["trailing-garbage"] = good + b"\x00garbage"
    for name, body in cases.items():
        with pytest.raises(BodyDecompressionError) as info:
            decode_messages(_compressed(body, ctype))
        assert isinstance(info.value, ProtocolError), name
        assert info.value.compression == _IDS[_TYPES.index(ctype)].upper(), name
    if ctype == COMPRESSION_ZLIB:
        [m] = decode_messages(_compressed(good + b"\x00garbage", ctype))
        assert m.body == _JAVA_TEXT


@pytest.mark.parametrize("ctype", _TYPES, ids=_IDS)
def test_decompression_bomb_is_refused(ctype: int) -> None:
    bomb = _compressed(compress_body(b"\0" * 4_000_000, ctype), ctype)
    with pytest.raises(BodyDecompressionError, match="exceeds 100000 bytes"):
        decode_messages(bomb, max_body_size=100_000)
    assert len(decode_messages(bomb, max_body_size=4_000_000)[0].body) == 4_000_000


def test_codecs_are_regular_dependencies() -> None:
    """A plain install brings both codecs: neither sits behind an extra."""
    requires = importlib.metadata.requires("rmq_async") or []
    plain = {re.split(r"[<>=;\s\[]", r, maxsplit=1)[0] for r in requires if "extra ==" not in r}
    assert {"lz4", "zstandard"} <= plain, requires


def test_unknown_compression_types_are_refused() -> None:
    for ctype in (4, 5, 6, 7):
        with pytest.raises(BodyDecompressionError, match="unknown compression type"):
            decode_messages(_compressed(b"whatever", ctype))
    # Not marked compressed: the type bits alone mean nothing.
    [m] = decode_messages(encode_stored_message(_msg(body=b"plain", sys_flag=0x500)))
    assert m.body == b"plain"


def test_inner_batch_unwrapped() -> None:
    outer = _msg(body=JAVA_BATCH, sys_flag=MSG_INNER_BATCH_FLAG | MSG_NEED_UNWRAP_FLAG,
                 queue_offset=10, reconsume_times=3)
    rec = encode_stored_message(outer)
    msgs = decode_messages(rec)
    assert [m.body for m in msgs] == [b"b0", b"b1", b"b2"]
    assert [m.queue_offset for m in msgs] == [10, 11, 12]
    assert [m.properties for m in msgs] == [
        {"i": str(i), "WAIT": "true", "TAGS": "TagB"} for i in range(3)
    ]
    outer_decoded = decode_messages(rec, unwrap_batch=False)[0]
    for m in msgs:
        assert (m.topic, m.queue_id, m.commit_log_offset, m.store_host, m.born_host) == (
            "TopicTest", 1, 4096, "5.6.7.8:10911", "1.2.3.4:5"
        )
        assert m.offset_msg_id == outer_decoded.offset_msg_id
        assert m.sys_flag == outer.sys_flag
    # only one of the two flags: not unwrapped
    assert len(decode_messages(encode_stored_message(
        _msg(body=JAVA_BATCH, sys_flag=MSG_INNER_BATCH_FLAG)))) == 1


def test_inner_batch_compressed_then_unwrapped() -> None:
    outer = _msg(body=JAVA_BATCH, sys_flag=MSG_INNER_BATCH_FLAG | MSG_NEED_UNWRAP_FLAG)
    assert len(decode_messages(encode_stored_message(outer, compress=True))) == 3


@pytest.mark.parametrize("cut", [1, 5, 23, 40])
def test_bad_inner_batch(cut: int) -> None:
    outer = _msg(body=JAVA_BATCH[:-cut], sys_flag=MSG_INNER_BATCH_FLAG | MSG_NEED_UNWRAP_FLAG)
    with pytest.raises(ProtocolError):
        decode_messages(encode_stored_message(outer))


def test_encode_batch_layout() -> None:
    msgs = [Message("TopicTest", b"b%d" % i, tags="TagB", properties={"i": str(i)}, flag=i)
            for i in range(3)]
    data = encode_batch(msgs)
    pos = 0
    for i in range(3):
        total, magic, crc, flag, blen = struct.unpack_from(">iiiii", data, pos)
        assert (magic, crc, flag, blen) == (0, 0, i, 2)
        body = data[pos + 20 : pos + 22]
        (plen,) = struct.unpack_from(">h", data, pos + 22)
        props = decode_properties(data[pos + 24 : pos + 24 + plen].decode())
        assert body == b"b%d" % i and props == {"i": str(i), "TAGS": "TagB"}
        assert total == 24 + plen
        pos += total
    assert pos == len(data)


# --------------------------------------------------------------------------------- malformed


def _with(rec: bytes, offset: int, fmt: str, value: int) -> bytes:
    buf = bytearray(rec)
    struct.pack_into(fmt, buf, offset, value)
    return bytes(buf)


@pytest.mark.parametrize(
    "mutate",
    [
        lambda r: r[:-1],  # truncated
        lambda r: r + b"\x00" * 10,  # trailing garbage too short for a record
        lambda r: _with(r, 0, ">i", len(r) + 1),  # total size beyond buffer
        lambda r: _with(r, 0, ">i", 10),  # total size too small
        lambda r: _with(r, 0, ">i", len(r) - 1),  # total size disagrees with content
        lambda r: _with(r, 4, ">i", 0x1234),  # bad magic
        lambda r: _with(r, 84, ">i", -1),  # negative body length
        lambda r: _with(r, 84, ">i", 10_000),  # body length beyond record
        lambda r: _with(r, 88 + 7, ">b", -1),  # negative topic length
        lambda r: _with(r, 88 + 7, ">b", 100),  # topic length beyond record
        lambda r: _with(r, 88 + 7 + 1, ">B", 0xFF),  # topic not UTF-8
        lambda r: _with(r, 88 + 7 + 1 + 9, ">h", -2),  # negative properties length
    ],
)
def test_malformed_records_raise_protocol_error(mutate: object) -> None:
    rec = encode_stored_message(_msg(body=b"1234567", properties={"TAGS": "a"}))
    assert len(decode_messages(rec)) == 1
    with pytest.raises(ProtocolError):
        decode_messages(mutate(rec))  # type: ignore[operator]


# -------------------------------------------------------------------------------- properties


def test_properties_rules() -> None:
    assert decode_properties("") == {}
    assert decode_properties("a\x011\x02b\x012\x02") == {"a": "1", "b": "2"}
    assert decode_properties("a\x011") == {"a": "1"}  # last separator optional
    assert decode_properties("a\x01\x02b\x012\x02") == {"b": "2"}  # empty value dropped
    assert decode_properties("\x01x\x02") == {}  # empty name dropped
    assert decode_properties("noval\x02") == {}
    assert decode_properties("a\x01x\x01y\x02") == {"a": "x\x01y"}  # value may hold \x01
    assert decode_properties("a\x011\x02a\x012\x02") == {"a": "2"}  # later wins
    assert encode_properties({"a": "1", "b": None, "c": ""}) == "a\x011\x02c\x01\x02"
    for bad in ({"": "x"}, {"a\x01": "x"}, {"a\x02": "x"}, {"a": "x\x02"}):
        with pytest.raises(ValueError):
            encode_properties(bad)


def test_properties_round_trip_drops_only_empty_values() -> None:
    props = {"TAGS": "t", "KEYS": "k1 k2", "EMPTY": "", "中文": "值"}
    assert decode_properties(encode_properties(props)) == {k: v for k, v in props.items() if v}


# ------------------------------------------------------------------------------------- ids


def test_offset_msg_id() -> None:
    assert offset_msg_id(bytes([192, 168, 1, 20]), 10911, 987654321) == (
        "C0A8011400002A9F000000003ADE68B1"
    )
    assert len(offset_msg_id(bytes(16), 1, 2)) == 56
    with pytest.raises(ValueError):
        offset_msg_id(b"\x00", 1, 2)


def test_body_crc_example() -> None:
    assert body_crc(b"hello") == 907060870


def test_parse_host() -> None:
    assert parse_host("10.0.0.1:10911") == (bytes([10, 0, 0, 1]), 10911)
    assert parse_host("[::1]:80") == (bytes(15) + b"\x01", 80)
    assert parse_host("") == (bytes(4), 0)


def test_uniq_key_layout() -> None:
    gen = UniqKeyGenerator("10.0.0.5", pid=0x1234, seed=0xCAFEBABE)
    start = int(datetime.now().replace(
        day=1, hour=0, minute=0, second=0, microsecond=0).timestamp() * 1000)
    first = gen.next_id(now_ms=start + 1000)
    second = gen.next_id(now_ms=start + 1000)
    assert first[:20] == "0A0000051234CAFEBABE"
    assert first[20:28] == f"{1000:08X}"
    assert (first[28:], second[28:]) == ("0000", "0001")
    assert len(first) == 32 and first != second
    ids = {gen() for _ in range(5000)}
    assert len(ids) == 5000
    assert len(UniqKeyGenerator("::1").next_id()) == 56
    assert len(UniqKeyGenerator().next_id()) == 32


@pytest.mark.parametrize("zone", ["America/New_York", "Europe/Berlin", "Australia/Sydney"])
def test_uniq_key_time_is_counted_from_the_local_start_of_the_month_across_a_dst_change(
        monkeypatch: pytest.MonkeyPatch, zone: str) -> None:
    """The id's time is milliseconds since the first of the month, 00:00 local time, by the
    zone's rules of that day (Java's Calendar): in a month whose clocks changed since, not an
    hour off (a 4.9.x client's query by UNIQ_KEY starts its search at that time)."""
    import time
    from zoneinfo import ZoneInfo

    monkeypatch.setenv("TZ", zone)
    time.tzset()
    try:
        tz = ZoneInfo(zone)
        # The 20th of the month after each change (March, April, October, November).
        for year, month in ((2025, 3), (2025, 4), (2025, 10), (2025, 11)):
            now = int(datetime(year, month, 20, 12, tzinfo=tz).timestamp() * 1000)
            first = int(datetime(year, month, 1, tzinfo=tz).timestamp() * 1000)
            key = UniqKeyGenerator("10.0.0.5", pid=1, seed=1).next_id(now_ms=now)
            assert int(key[20:28], 16) == now - first, (zone, year, month)
    finally:
        monkeypatch.undo()
        time.tzset()


def test_an_empty_body_flagged_compressed_is_delivered_empty() -> None:
    """Java inflates a body only when it has bytes: an empty one flagged compressed (any
    type) is an empty body, not a decompression error, and keeps its flag (Java clears it
    only where it inflated)."""
    from rmq_async.protocol.codes import MSG_COMPRESSED_FLAG

    for ctype in (0, 1 << 8, 2 << 8, 3 << 8):  # none (read as ZLIB), LZ4, ZSTD, ZLIB
        msg = MessageExt(topic="t", body=b"", born_host="1.1.1.1:1", store_host="2.2.2.2:2",
                         sys_flag=MSG_COMPRESSED_FLAG | ctype)
        (got,) = decode_messages(encode_stored_message(msg))
        assert got.body == b"" and got.sys_flag == MSG_COMPRESSED_FLAG | ctype, ctype


@pytest.mark.parametrize("size", [100_000, 4 * 1024 * 1024 + 1, 6_000_000])
def test_lz4_frames_are_what_lz4_java_reads(size: int) -> None:
    """lz4-java's LZ4FrameInputStream (the Java consumer's decoder) refuses frames whose blocks
    are linked, which liblz4 writes by default for a body over one 4 MiB block: a Java
    consumer lost such a message and the rest of its pull. Independent blocks, no content
    size: the frame descriptor lz4-java's LZ4FrameOutputStream writes."""
    import lz4.frame as lz4_frame

    body = (b"payload %d " * 8) * (size // 80 + 1)
    frame = compress_body(body[:size], COMPRESSION_LZ4)
    assert frame[:4] == b"\x04\x22\x4d\x18"  # the LZ4 frame magic
    flg, bd = frame[4], frame[5]
    assert flg & 0x20, "block independence is not set"
    assert not flg & 0x08, "the content size is stored"
    # Version 01; a valid block size (liblz4 picks the smallest that holds a short body,
    # which lz4-java reads as any other: it sizes its buffer from the code).
    assert (flg >> 6) == 1 and (bd >> 4) & 0x7 in (4, 5, 6, 7)
    assert lz4_frame.decompress(frame) == body[:size]

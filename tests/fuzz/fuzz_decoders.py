"""Structure-aware fuzzing of the protocol decoders: frames, headers, JSON bodies, stored records.

Every input starts as a valid one, built with the project's own encoders, and is then usually
mutated (bit flips, byte inserts and deletes, truncation, length fields set to edge or huge
values, splices of two inputs, JSON tokens swapped, random bytes). Each input goes through the
decoders of its target:

``frame``   :class:`FrameDecoder` fed in random chunks and all at once (both must agree), and
            :meth:`RemotingCommand.decode` of the first frame;
``header``  ``from_ext_fields`` of every typed header in :mod:`~rmq_async.protocol.headers`, given
            dicts or ext fields read back from encoded (and mutated) commands;
``body``    every JSON body decoder of :mod:`~rmq_async.protocol.bodies` and ``tolerant_loads``;
``record``  the stored-record decoder, compiled and pure-Python twins side by side (same messages
            or the same ``ProtocolError``), single-record decoding, and the salvaging decoder;
            with the compiled codec also the Spark sink's path: a body the scan keeps undecoded
            (:meth:`StoredChunk.scan`) must decode into exactly what it counted, and its rows
            read straight from the bytes (``record_columns``) must equal the decoded messages'
            rows. Some bodies are made in the shape the scan keeps (one topic and queue, rising
            offsets, plain records), valid or mutated, so that path is reached.

Anything other than :class:`ProtocolError` escaping a decoder is a finding, as is a broken
invariant (twins disagreeing, a valid input not decoding back to what was encoded, a decoder
that keeps state after failing) and an input that takes longer than ``--hang-seconds``. Findings
are printed with the input and the traceback; the exit status is non-zero if there was any.

Deterministic: input ``i`` of a target is generated from its own RNG seeded by
``(seed, target, i)``, so ``--index i`` replays exactly that input.

    python -m tests.fuzz.fuzz_decoders --inputs 1000000 --seed 0 [--target frame|header|body|record|all]
"""

from __future__ import annotations

import argparse
import dataclasses
import faulthandler
import ipaddress
import os
import random
import string
import sys
import threading
import time
import traceback
import zlib
from collections.abc import Callable, Sequence
from typing import Any, TextIO, cast

from rmq_async.protocol import headers as h
from rmq_async.protocol import message, types
from rmq_async.protocol.bodies import (
    BrokerData,
    ClusterInfo,
    ConsumeMessageDirectlyResult,
    ConsumerData,
    ConsumerRunningInfo,
    ConsumeStatus,
    GetConsumerListByGroupResponseBody,
    GetConsumerStatusBody,
    HeartbeatData,
    LockBatchRequestBody,
    LockBatchResponseBody,
    ProcessQueueInfo,
    ProducerData,
    QueueData,
    ResetOffsetBody,
    TopicRouteData,
    UnlockBatchRequestBody,
    decode_consumer_list,
    decode_lock_batch_response,
)
from rmq_async.protocol.codes import (
    COMPRESSION_TYPE_MASK,
    MSG_COMPRESSED_FLAG,
    MSG_INNER_BATCH_FLAG,
    MSG_NEED_UNWRAP_FLAG,
    LanguageCode,
    RequestCode,
    ResponseCode,
    SerializeType,
)
from rmq_async.protocol.command import DEFAULT_MAX_FRAME_SIZE, FrameDecoder, RemotingCommand
from rmq_async.protocol.errors import ProtocolError
from rmq_async.protocol.filter import SubscriptionData
from rmq_async.protocol.jsonutil import fastjson_dumps, tolerant_loads
from rmq_async.protocol.message import MAGIC_V1, MAGIC_V2, encode_batch, encode_stored_message
from rmq_async.protocol.salvage import decode_messages_salvaging
from rmq_async.protocol.stored import StoredChunk
from rmq_async.protocol.types import Message, MessageExt, MessageQueue

try:
    from rmq_async.protocol import _cmessage
except ImportError:  # the extension is built by `make setup`; without it only the pure twin runs
    _cmessage = None  # type: ignore[assignment]

try:
    from rmq_async.sinks import _arrow
except ImportError:  # no pyarrow (the spark extra): the sink's rows are not compared
    _arrow = None  # type: ignore[assignment]

TARGETS = ("frame", "header", "body", "record")
DEFAULT_SEED = 0
DEFAULT_HANG_SECONDS = 1.0


class Finding(Exception):
    """A broken invariant (not an exception raised by a decoder)."""


@dataclasses.dataclass(slots=True)
class Case:
    """One generated input and what its checker needs to know about it."""

    data: Any
    """The input (bytes, or an extFields dict for headers); printed with a finding."""
    extra: dict[str, Any]


# ------------------------------------------------------------------------------ primitives

_ASCII = string.ascii_letters + string.digits + "_-.%@#"
_SPECIAL = '"\\/{}[]:, \t\n\r\b\f\x00\x03\x1f\x7f\x80\x9f\u2028\u2029'
_UNICODE = "éüßñ中文✓€ÿ\ufeff\ufffd𝄞😀"


def rtext(rng: random.Random, max_len: int = 16, min_len: int = 0, *, exclude: str = "") -> str:
    """Random text, mostly ASCII, sometimes with characters that need escaping or are not ASCII.

    Never contains surrogates (the encoders would turn them into ``?``).
    """
    n = rng.randint(min_len, max_len) if rng.random() < 0.5 else rng.randint(min_len,
                                                                             max(min_len, 6))
    mode = rng.random()
    pool = _ASCII if mode < 0.6 else _ASCII + _UNICODE if mode < 0.8 else _ASCII + _SPECIAL + _UNICODE
    text = "".join(rng.choices(pool, k=n))
    if exclude:
        text = "".join(c for c in text if c not in exclude)
    if len(text) < min_len:
        text += "x" * (min_len - len(text))
    return text


def rbytes(rng: random.Random, max_len: int) -> bytes:
    n = rng.randint(0, max_len) if rng.random() < 0.7 else rng.randint(0, 8)
    return rng.randbytes(n)


def rint(rng: random.Random, bits: int) -> int:
    """A signed integer of ``bits`` bits, edge values often."""
    lo, hi = -(1 << (bits - 1)), (1 << (bits - 1)) - 1
    r = rng.random()
    if r < 0.3:
        return rng.choice((0, 1, -1, lo, hi, lo + 1, hi - 1, 127, 128, 255, 256, 32767, lo >> 1))
    if r < 0.7:
        return rng.randint(0, 10_000)
    return rng.randint(lo, hi)


# ------------------------------------------------------------------------------ mutation

_INTERESTING = (0, 1, -1, 2, 3, 4, 7, 8, 16, 20, 21, 91, 127, 128, 255, 256, 0x7FFF, 0x8000, 0xFFFF,
                0x10000, 0xFFFFFF, 0x1000000, 16 * 1024 * 1024 - 4, 16 * 1024 * 1024 + 1,
                0x7FFFFFFF, -0x80000000, 0x7FFFFFF0)
_INTERESTING_BYTES = (0x00, 0x01, 0x02, 0x7F, 0x80, 0xFF, 0x7B, 0x5B, 0x22, 0x3A)

#: (offset, width) of a length or flag field in an input, for targeted tampering.
Hot = list[tuple[int, int]]


def _write_int(buf: bytearray, pos: int, width: int, value: int) -> None:
    if pos < 0 or pos + width > len(buf):
        return
    buf[pos : pos + width] = (value & ((1 << (8 * width)) - 1)).to_bytes(width, "big")


def _read_int(buf: bytearray, pos: int, width: int) -> int:
    return int.from_bytes(buf[pos : pos + width], "big", signed=True)


def mutate(rng: random.Random, data: bytes, hot: Hot, other: bytes) -> bytes:
    """Apply 1-8 random mutations to ``data``; ``other`` is a second input for splices."""
    buf = bytearray(data)
    for _ in range(rng.choice((1, 1, 1, 1, 2, 2, 3, 4, 8))):
        n = len(buf)
        op = rng.random()
        if op < 0.15 and n:  # bit flip
            buf[rng.randrange(n)] ^= 1 << rng.randrange(8)
        elif op < 0.25 and n:  # interesting byte
            buf[rng.randrange(n)] = rng.choice(_INTERESTING_BYTES)
        elif op < 0.45:  # length / flag field tampering
            if hot and rng.random() < 0.8:
                pos, width = rng.choice(hot)
            else:
                width = rng.choice((1, 2, 4, 8))
                pos = rng.randrange(max(1, n - width + 1))
            if pos + width > len(buf):
                continue
            old = _read_int(buf, pos, width)
            r = rng.random()
            if r < 0.4:
                value = rng.choice(_INTERESTING)
            elif r < 0.7:
                value = old + rng.choice((-4, -2, -1, 1, 2, 4, 8, 100, -100))
            elif r < 0.85:
                value = rng.randint(0, max(old, 0) + 64)  # shorter: another check fires first
            else:
                value = rng.getrandbits(8 * width)
            _write_int(buf, pos, width, value)
        elif op < 0.55:  # truncate
            if n:
                del buf[rng.randrange(n) :]
        elif op < 0.63:  # insert
            pos = rng.randrange(n + 1)
            buf[pos:pos] = rng.randbytes(rng.randint(1, 16)) if rng.random() < 0.7 else bytes(
                (rng.choice(_INTERESTING_BYTES),)) * rng.randint(1, 64)
        elif op < 0.71 and n:  # delete
            pos = rng.randrange(n)
            del buf[pos : pos + rng.randint(1, 16)]
        elif op < 0.77 and n:  # duplicate a slice
            a = rng.randrange(n)
            b = min(n, a + rng.randint(1, 64))
            pos = rng.randrange(n + 1)
            buf[pos:pos] = buf[a:b]
        elif op < 0.87 and other:  # splice two inputs
            cut = rng.randrange(n + 1)
            buf[cut:] = other[rng.randrange(len(other)) :]
        elif op < 0.93:  # append
            buf += other if rng.random() < 0.5 else rng.randbytes(rng.randint(1, 32))
        elif n:  # overwrite a run with random bytes
            pos = rng.randrange(n)
            run = rng.randint(1, 32)
            buf[pos : pos + run] = rng.randbytes(min(run, n - pos))
    return bytes(buf)


# ------------------------------------------------------------------------------ headers

HEADER_CLASSES: tuple[type[h.CommandHeader], ...] = tuple(
    obj for name in h.__all__
    if isinstance(obj := getattr(h, name), type) and issubclass(obj, h.CommandHeader)
)

_NASTY_VALUES = ("", " ", "+", "-", "+0", "-0", "007", "1_000", " 1", "1 ", "0x1F",
                 "\uff11\uff12\uff13", "\u0663", "1e3", "1.0", "NaN", "true", "TRUE", "tRuE",
                 "false", "yes", "\x00",
                 "9" * 19, "9" * 20, "-9223372036854775808", "-9223372036854775809",
                 "9223372036854775807", "9223372036854775808", "2147483647", "2147483648",
                 "-2147483648", "-2147483649", "9" * 4301, "-" + "1" * 5000, "+" + "0" * 6000)


def gen_header(rng: random.Random, cls: type[h.CommandHeader]) -> h.CommandHeader:
    kwargs: dict[str, Any] = {}
    for row in cls.field_table():
        if not row.required and rng.random() < 0.3:
            kwargs[row.py_name] = None
            continue
        if row.kind is h.FieldKind.STR:
            kwargs[row.py_name] = rtext(rng, 24)
        elif row.kind is h.FieldKind.INT32:
            kwargs[row.py_name] = rint(rng, 32)
        elif row.kind is h.FieldKind.INT64:
            kwargs[row.py_name] = rint(rng, 64)
        else:
            kwargs[row.py_name] = rng.random() < 0.5
    return cls(**kwargs)


def _header_defaults(header: h.CommandHeader) -> h.CommandHeader:
    """``header`` as read back: fields not sent take their declared defaults."""
    changes = {row.py_name: row.default for row in header.field_table()
               if getattr(header, row.py_name) is None}
    return dataclasses.replace(header, **changes)


def mutate_ext(rng: random.Random, ext: dict[str, str], cls: type[h.CommandHeader]) -> dict[str, str]:
    out = dict(ext)
    names = [row.java_name for row in cls.field_table()]
    for _ in range(rng.randint(1, 3)):
        op = rng.random()
        keys = list(out)
        if op < 0.2 and keys:
            del out[rng.choice(keys)]
        elif op < 0.3:
            out[rtext(rng, 12, 1)] = rtext(rng, 12)
        elif op < 0.85 and (keys or names):
            key = rng.choice(keys) if keys and (rng.random() < 0.8 or not names) else rng.choice(names)
            r = rng.random()
            if r < 0.6:
                out[key] = rng.choice(_NASTY_VALUES)
            elif r < 0.8 and key in out:
                raw = out[key].encode()
                out[key] = mutate(rng, raw, [], b"").decode("utf-8", "replace")
            else:
                out[key] = rtext(rng, 30)
        elif keys and names:  # a value under another field's name
            src = rng.choice(keys)
            out[rng.choice(names)] = out[src]
    return out


# ------------------------------------------------------------------------------ commands


def gen_ext(rng: random.Random) -> dict[str, str] | None:
    r = rng.random()
    if r < 0.15:
        return None
    if r < 0.25:
        return {}
    if r < 0.6:
        ext = gen_header(rng, rng.choice(HEADER_CLASSES)).to_ext_fields()
        if rng.random() < 0.3:
            ext[rtext(rng, 10, 1)] = rtext(rng, 10, 1)  # as Java's addExtField
        return ext
    return {rtext(rng, 12, 1): rtext(rng, 20, 1) for _ in range(rng.randint(1, 6))}


_REQUEST_CODES = tuple(RequestCode)
_RESPONSE_CODES = tuple(ResponseCode)
_LANGUAGES = tuple(LanguageCode)


def gen_command(rng: random.Random) -> RemotingCommand:
    stype = SerializeType.JSON if rng.random() < 0.5 else SerializeType.ROCKETMQ
    r = rng.random()
    if r < 0.1:
        body = b""
    elif r < 0.4:
        body = rbytes(rng, 200)
    elif r < 0.7:
        body = gen_body(rng)[1]
    else:
        body = gen_records(rng)[0]
    code = rng.choice((int(rng.choice(_REQUEST_CODES)), int(rng.choice(_RESPONSE_CODES)),
                       rint(rng, 16)))
    if not -32768 <= code <= 32767:
        stype = SerializeType.JSON  # the binary header has 16 bits for it
    return RemotingCommand(
        code=code,
        language=rng.choice(_LANGUAGES),
        version=rint(rng, 16),
        opaque=rint(rng, 32),
        flag=rint(rng, 32),
        remark=None if rng.random() < 0.5 else rtext(rng, 40),
        ext_fields=gen_ext(rng),
        body=body,
        serialize_type=stype,
    )


def read_back(cmd: RemotingCommand) -> RemotingCommand:
    """What decoding ``cmd.encode()`` must give."""
    ext = cmd.ext_fields
    remark = cmd.remark
    if cmd.serialize_type == SerializeType.ROCKETMQ:
        # Java reads zero-length strings as null; an empty map is not written at all.
        remark = remark or None
        ext = {k: v for k, v in ext.items() if k and v} if ext else None
    else:
        ext = dict(ext) if ext is not None else None
    return dataclasses.replace(cmd, remark=remark, ext_fields=ext)


def frame_hot(stream: bytes) -> Hot:
    """Length fields of a valid stream of frames: frame length, header info, and in ROCKETMQ
    headers the remark and extFields lengths and every key and value length."""
    hot: Hot = []
    pos = 0
    n = len(stream)
    while pos + 8 <= n:
        length = int.from_bytes(stream[pos : pos + 4], "big")
        info = int.from_bytes(stream[pos + 4 : pos + 8], "big")
        hot += [(pos, 4), (pos + 4, 4), (pos + 4, 1)]
        header = pos + 8
        if info >> 24 == SerializeType.ROCKETMQ:
            hlen = info & 0xFFFFFF
            hend = header + hlen
            rlen = int.from_bytes(stream[header + 13 : header + 17], "big")
            hot += [(header, 2), (header + 13, 4)]
            p = header + 17 + rlen
            hot.append((p, 4))
            p += 4
            while p + 6 <= hend:
                klen = int.from_bytes(stream[p : p + 2], "big")
                hot.append((p, 2))
                p += 2 + klen
                vlen = int.from_bytes(stream[p : p + 4], "big")
                hot.append((p, 4))
                p += 4 + vlen
        pos += 4 + length
    return hot


def _chunks(rng: random.Random, data: bytes) -> list[bytes]:
    n = len(data)
    r = rng.random()
    if r < 0.2:
        return [data]
    if r < 0.3 and n <= 2048:
        return [data[i : i + 1] for i in range(n)]
    cuts = sorted(rng.randrange(n + 1) for _ in range(rng.randint(1, 8)))
    out = []
    prev = 0
    for cut in [*cuts, n]:
        out.append(data[prev:cut])
        prev = cut
    return out


def json_header_mutant(rng: random.Random, cmd: RemotingCommand) -> bytes:
    """``cmd`` encoded with a JSON header that is mutated as JSON, lengths kept consistent, so
    that the header's fields get values of the wrong type rather than a syntax error."""
    frame = cmd.encode()
    hlen = int.from_bytes(frame[4:8], "big") & 0xFFFFFF
    header = mutate_json(rng, frame[8 : 8 + hlen], b"")
    body = frame[8 + hlen :]
    return b"".join(((4 + len(header) + len(body)).to_bytes(4, "big"),
                     len(header).to_bytes(4, "big"), header, body))


def gen_frame_case(rng: random.Random) -> Case:
    r = rng.random()
    if r < 0.04:  # random bytes
        return Case(rng.randbytes(rng.randint(0, 300)), {"expected": None, "max": 4096,
                                                         "chunks": None})
    cmds = [gen_command(rng) for _ in range(rng.choice((1, 1, 1, 2, 3, 4)))]
    if rng.random() < 0.2:
        for c in cmds:
            c.serialize_type = SerializeType.JSON
        stream = b"".join(json_header_mutant(rng, c) if rng.random() < 0.7 else c.encode()
                          for c in cmds)
        return Case(stream, {"expected": None, "max": DEFAULT_MAX_FRAME_SIZE,
                             "chunks": _chunks(rng, stream)})
    stream = b"".join(c.encode() for c in cmds)
    max_size = rng.choice((DEFAULT_MAX_FRAME_SIZE, DEFAULT_MAX_FRAME_SIZE, 1 << 16, 4096))
    expected: list[RemotingCommand] | None = None
    if rng.random() < 0.12:
        if all(len(c.encode()) <= max_size for c in cmds):
            expected = [read_back(c) for c in cmds]
    else:
        other = gen_command(rng).encode() if rng.random() < 0.3 else stream
        stream = mutate(rng, stream, frame_hot(stream), other)
    return Case(stream, {"expected": expected, "max": max_size, "chunks": _chunks(rng, stream)})


def _feed(dec: FrameDecoder, chunks: Sequence[bytes]) -> tuple[list[RemotingCommand], str | None]:
    got: list[RemotingCommand] = []
    try:
        for chunk in chunks:
            got.extend(dec.feed(chunk))
    except ProtocolError as exc:
        if not dec.failed or dec.buffered:
            raise Finding("FrameDecoder kept state after a ProtocolError") from None
        try:
            dec.feed(b"\x00\x00\x00\x08\x00\x00\x00\x00\x00\x00\x00\x00")
        except ProtocolError:
            pass
        else:
            raise Finding("FrameDecoder accepted input after failing") from None
        return got, str(exc)
    if dec.buffered > dec.max_frame_size:
        raise Finding(f"FrameDecoder buffers {dec.buffered} bytes > max {dec.max_frame_size}")
    return got, None


def check_frame(case: Case) -> str:
    data: bytes = case.data
    max_size: int = case.extra["max"]
    chunks = case.extra["chunks"] or [data]
    whole, whole_err = _feed(FrameDecoder(max_size), [data])
    dec = FrameDecoder(max_size)
    parts, parts_err = _feed(dec, chunks)
    if whole_err != parts_err:
        raise Finding(f"whole feed gave {whole_err!r}, chunked feed {parts_err!r}")
    if whole_err is None and parts != whole:
        raise Finding("whole and chunked feeds decoded different commands")
    for cmd in parts:
        if not isinstance(cmd, RemotingCommand):
            raise Finding(f"decoder returned {type(cmd).__name__}")
        repr(cmd)
    single_err = False
    if len(data) >= 4:
        try:
            RemotingCommand.decode(data[4:])
        except ProtocolError:
            single_err = True
    expected = case.extra["expected"]
    if expected is not None:
        if parts_err is not None or (single_err and len(expected) == 1):
            raise Finding(f"a valid stream failed: {parts_err}")
        if parts != expected or dec.buffered:
            raise Finding(f"valid stream decoded as {parts!r}, expected {expected!r}")
    return "error" if parts_err is not None or single_err else "ok"


# ------------------------------------------------------------------------------ header target


def gen_header_case(rng: random.Random) -> Case:
    cls = rng.choice(HEADER_CLASSES)
    header = gen_header(rng, cls)
    ext: dict[str, str] = header.to_ext_fields()
    valid = rng.random() < 0.15
    if not valid:
        ext = mutate_ext(rng, ext, cls)
    extra: dict[str, Any] = {"cls": cls, "other": rng.choice(HEADER_CLASSES),
                             "expected": _header_defaults(header) if valid else None}
    if rng.random() < 0.3:
        # Through the wire: encode a command carrying these fields, maybe damage the bytes.
        stype = SerializeType.JSON if rng.random() < 0.5 else SerializeType.ROCKETMQ
        cmd = RemotingCommand(code=int(RequestCode.PULL_MESSAGE), ext_fields=ext,
                              serialize_type=stype)
        r = rng.random()
        if r < 0.35 and stype == SerializeType.JSON:
            frame = json_header_mutant(rng, cmd)
        elif r < 0.7:
            frame = cmd.encode()
            frame = mutate(rng, frame, frame_hot(frame), b"")
        else:
            frame = cmd.encode()
        extra["expected"] = None
        return Case(frame, extra)
    return Case(ext, extra)


def _has_surrogates(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return True
    return False


def _parse_header(cls: type[h.CommandHeader], ext: dict[str, str] | None) -> h.CommandHeader | None:
    try:
        header = cls.from_ext_fields(ext)
    except ProtocolError:
        return None
    back = cls.from_ext_fields(header.to_ext_fields())
    if back != header:
        raise Finding(f"{cls.__name__} does not read back its own ext fields: {back!r} != {header!r}")
    values = header.to_ext_fields().values()
    if any(_has_surrogates(v) for v in values):
        return header  # written as '?' (as Java's getBytes does): not expected to read back
    for stype in (SerializeType.JSON, SerializeType.ROCKETMQ):
        frame = RemotingCommand(code=0, ext_fields=header.to_ext_fields(),
                                serialize_type=stype).encode()
        wire = RemotingCommand.decode(frame[4:])
        if stype == SerializeType.ROCKETMQ and any(v == "" for v in values):
            continue  # empty strings travel as null in the binary header
        if cls.from_ext_fields(wire.ext_fields) != header:
            raise Finding(f"{cls.__name__} changed through a {stype.name} frame")
    return header


def check_header(case: Case) -> str:
    data = case.data
    ext: dict[str, str] | None
    if isinstance(data, bytes):
        try:
            ext = RemotingCommand.decode(data[4:]).ext_fields
        except ProtocolError:
            return "error"
    else:
        ext = data
    header = _parse_header(case.extra["cls"], ext)
    other = _parse_header(case.extra["other"], ext)
    expected = case.extra["expected"]
    if expected is not None and header != expected:
        raise Finding(f"valid ext fields read as {header!r}, expected {expected!r}")
    return "ok" if header is not None and other is not None else "error"


# ------------------------------------------------------------------------------ bodies


def gen_mq(rng: random.Random) -> MessageQueue:
    return MessageQueue(rtext(rng, 16), rtext(rng, 12), rint(rng, 32))


def gen_mqs(rng: random.Random, max_n: int = 4) -> list[MessageQueue]:
    return list(dict.fromkeys(gen_mq(rng) for _ in range(rng.randint(0, max_n))))


def gen_broker_data(rng: random.Random) -> BrokerData:
    addrs = {rng.choice((0, 1, 2, rint(rng, 64))): f"10.0.0.{rng.randint(0, 255)}:{rng.randint(0, 65535)}"
             for _ in range(rng.randint(0, 3))}
    return BrokerData(rtext(rng, 10), rtext(rng, 10), addrs, rng.random() < 0.5,
                      None if rng.random() < 0.5 else rtext(rng, 8))


def gen_sub(rng: random.Random) -> SubscriptionData:
    tags = list(dict.fromkeys(rtext(rng, 8, 1) for _ in range(rng.randint(0, 3))))
    return SubscriptionData(rtext(rng, 12), " || ".join(tags) or "*", tags,
                            list(dict.fromkeys(rint(rng, 32) for _ in tags)),
                            rng.choice(("TAG", "SQL92")), rint(rng, 64), rng.random() < 0.2)


def gen_body(rng: random.Random) -> tuple[str, bytes, Any]:
    """(kind, encoded body, the object it must decode to or ``None`` if not compared)."""
    kind = rng.choice(BODY_KINDS)
    obj: Any
    if kind == "TopicRouteData":
        obj = TopicRouteData(
            [QueueData(rtext(rng, 10), rint(rng, 32), rint(rng, 32), rint(rng, 32), rint(rng, 32))
             for _ in range(rng.randint(0, 3))],
            [gen_broker_data(rng) for _ in range(rng.randint(0, 3))],
            rng.choice((None, "a:4;b:8", rtext(rng, 12))),
            {rtext(rng, 8): [rtext(rng, 8) for _ in range(rng.randint(0, 2))]
             for _ in range(rng.randint(0, 2))},
        )
        return kind, obj.to_json_bytes(standard=rng.random() < 0.5), obj
    if kind == "ClusterInfo":
        cluster = ClusterInfo({rtext(rng, 8): gen_broker_data(rng) for _ in range(rng.randint(0, 3))},
                              {rtext(rng, 8): [rtext(rng, 8) for _ in range(rng.randint(0, 3))]
                               for _ in range(rng.randint(0, 2))})
        return kind, cluster.to_json_bytes(standard=rng.random() < 0.5), None
    if kind in ("LockBatchRequestBody", "UnlockBatchRequestBody"):
        body_cls = LockBatchRequestBody if kind == "LockBatchRequestBody" else UnlockBatchRequestBody
        obj = body_cls(rtext(rng, 12), rtext(rng, 20), gen_mqs(rng), rng.random() < 0.5)
        return kind, obj.to_json_bytes(), obj
    if kind == "LockBatchResponseBody":
        mqs = gen_mqs(rng)
        # A list keeps the output independent of str hash randomisation (a set would not).
        obj = LockBatchResponseBody(cast(set[MessageQueue], mqs))
        return kind, obj.to_json_bytes(), set(mqs)
    if kind == "GetConsumerListByGroupResponseBody":
        ids = [rtext(rng, 24) for _ in range(rng.randint(0, 4))]
        return kind, GetConsumerListByGroupResponseBody(ids).to_json_bytes(), ids
    if kind == "ResetOffsetBody":
        table = {mq: rint(rng, 64) for mq in gen_mqs(rng)}
        if rng.random() < 0.3:  # the list form sent for C++ admins
            rows = [{**mq.to_json(), "offset": off} for mq, off in table.items()]
            return kind, fastjson_dumps({"offsetTable": rows}), table
        return kind, ResetOffsetBody(table).to_json_bytes(), table
    if kind == "GetConsumerStatusBody":
        status = GetConsumerStatusBody(
            {mq: rint(rng, 64) for mq in gen_mqs(rng)},
            {rtext(rng, 8): {mq: rint(rng, 64) for mq in gen_mqs(rng, 2)}
             for _ in range(rng.randint(0, 2))})
        return kind, status.to_json_bytes(), status
    if kind == "HeartbeatData":
        hb = HeartbeatData(
            rtext(rng, 20),
            [ConsumerData(rtext(rng, 10), subscription_data_set=[gen_sub(rng) for _ in range(2)],
                          unit_mode=rng.random() < 0.5) for _ in range(rng.randint(0, 2))],
            [ProducerData(rtext(rng, 10)) for _ in range(rng.randint(0, 2))],
            rint(rng, 32), rng.random() < 0.5)
        return kind, hb.to_json_bytes(), None
    if kind == "ConsumerRunningInfo":
        info = ConsumerRunningInfo(
            {rtext(rng, 8): rtext(rng, 12) for _ in range(rng.randint(0, 3))},
            [gen_sub(rng) for _ in range(rng.randint(0, 2))],
            {mq: ProcessQueueInfo(commit_offset=rint(rng, 64), locked=rng.random() < 0.5)
             for mq in gen_mqs(rng, 3)},
            {rtext(rng, 8): ConsumeStatus(rng.random() * 1000, rng.choice((0.0, 1e-5, 1e9)),
                                          consume_failed_msgs=rint(rng, 64))
             for _ in range(rng.randint(0, 2))},
            {rtext(rng, 6): rtext(rng, 6)},
            None if rng.random() < 0.7 else rtext(rng, 60))
        return kind, info.to_json_bytes(), None
    result = ConsumeMessageDirectlyResult(
        rng.choice(("CR_SUCCESS", "CR_LATER", "CR_THROW_EXCEPTION")), rng.random() < 0.5,
        rng.random() < 0.5, None if rng.random() < 0.5 else rtext(rng, 30), rint(rng, 64))
    return "ConsumeMessageDirectlyResult", result.to_json_bytes(), None


def _lock_request_key(body: LockBatchRequestBody) -> tuple[Any, ...]:
    return (body.consumer_group, body.client_id, set(body.mq_set), body.only_this_broker)


BODY_DECODERS: dict[str, Callable[[Any], Any]] = {
    "TopicRouteData": TopicRouteData.from_json_bytes,
    "ClusterInfo": ClusterInfo.from_json_bytes,
    "LockBatchRequestBody": LockBatchRequestBody.from_json_bytes,
    "UnlockBatchRequestBody": UnlockBatchRequestBody.from_json_bytes,
    "LockBatchResponseBody": decode_lock_batch_response,
    "GetConsumerListByGroupResponseBody": decode_consumer_list,
    "ResetOffsetBody": lambda data: ResetOffsetBody.from_json_bytes(data).offset_table,
    "GetConsumerStatusBody": GetConsumerStatusBody.from_json_bytes,
    "json": tolerant_loads,
}
BODY_KINDS = (*[k for k in BODY_DECODERS if k != "json"], "HeartbeatData", "ConsumerRunningInfo",
              "ConsumeMessageDirectlyResult")
_COMPARE: dict[str, Callable[[Any], Any]] = {
    "LockBatchRequestBody": _lock_request_key,
    "UnlockBatchRequestBody": _lock_request_key,
}

_JSON_SNIPPETS = (
    b"{", b"}", b"[", b"]", b",", b":", b'"', b"null", b"true", b"false", b"-", b"0", b"-1",
    b"1e999", b"-1e999", b"1.5", b"NaN", b"Infinity", b"9" * 30, b"9" * 5000, b"-" + b"1" * 4400,
    b"[1,2,3]", b"[[1,2,3]]", b"[[1,2]]", b'[["a",1]]', b'{"a":1}', b"{}", b"[]", b'"x"',
    b'"\\ud800"', b'"\\u0000"', b'"\\', b'"0"', b'"-7"', b'"9999999999999999999999"',
    b'{"brokerName":"b","queueId":0,"topic":"t"}', b'{"brokerName":"b","queueId":"7","topic":"t"}',
    b'{"brokerName":1,"queueId":0,"topic":"t"}', b'{"topic":"t","brokerName":"b","queueId":1.5}',
    b'{{"brokerName":"b","queueId":0,"topic":"t"}:1}', b'"{\\"brokerName\\":\\"b\\"}"',
    b"[" * 300, b"{" * 300, b"[" * 5000, b'{"a":' * 300, b'{[1]:' * 150, b"\xff", b"\xc3",
    b"\xed\xa0\x80", b"\x00", b" ",
)
_VALUE_STARTS = frozenset(b":[,")
_VALUE_ENDS = frozenset(b",]}")


def mutate_json(rng: random.Random, data: bytes, other: bytes) -> bytes:
    buf = bytearray(data)
    for _ in range(rng.choice((1, 1, 2, 3))):
        n = len(buf)
        snippet = rng.choice(_JSON_SNIPPETS)
        op = rng.random()
        if op < 0.3:
            pos = rng.randrange(n + 1)
            buf[pos:pos] = snippet
        elif op < 0.75:  # replace a value (or a key) with a snippet
            starts = [0, *(i + 1 for i, c in enumerate(buf) if c in _VALUE_STARTS or c == 0x7B)]
            if not starts:
                continue
            a = rng.choice(starts)
            b = a
            depth = 0
            while b < n:
                c = buf[b]
                if c in (0x5B, 0x7B):
                    depth += 1
                elif c in (0x5D, 0x7D):
                    if depth == 0:
                        break
                    depth -= 1
                elif (c == 0x2C or c == 0x3A) and depth == 0:
                    break
                b += 1
            buf[a:b] = snippet
        elif op < 0.85 and n:  # delete between two structural characters
            marks = [i for i, c in enumerate(buf) if c in _VALUE_ENDS or c in _VALUE_STARTS]
            if len(marks) >= 2:
                a, b = sorted(rng.sample(marks, 2))
                del buf[a:b]
        else:
            buf = bytearray(mutate(rng, bytes(buf), [], other))
    return bytes(buf)


def gen_body_case(rng: random.Random) -> Case:
    if rng.random() < 0.03:
        data = rng.randbytes(rng.randint(0, 200))
        return Case(data, {"kind": "json", "expected": None, "other": "json", "as_str": False})
    kind, data, expected = gen_body(rng)
    if rng.random() < 0.85:
        other = gen_body(rng)[1]
        data = mutate_json(rng, data, other) if rng.random() < 0.6 else mutate(rng, data, [], other)
        expected = None
    decoder = kind if kind in BODY_DECODERS else "json"
    return Case(data, {"kind": decoder, "expected": expected, "valid": expected is not None,
                       "other": rng.choice(list(BODY_DECODERS)), "as_str": rng.random() < 0.1})


def check_body(case: Case) -> str:
    data: bytes = case.data
    source: bytes | str = data.decode("utf-8", "replace") if case.extra["as_str"] else data
    kind = case.extra["kind"]
    outcome = "ok"
    result: Any = None
    for name in dict.fromkeys((kind, "json", case.extra["other"])):
        try:
            value = BODY_DECODERS[name](source)
        except ProtocolError:
            outcome = "error"
            if name == kind and case.extra.get("valid"):
                raise Finding(f"a valid {kind} body failed to decode") from None
            continue
        if name == kind:
            result = value
        if isinstance(value, TopicRouteData):
            for qd in value.queue_datas:
                qd.to_json()
            for bd in value.broker_datas:
                bd.select_broker_addr()
    expected = case.extra["expected"]
    if expected is not None:
        key = _COMPARE.get(kind, lambda v: v)
        if key(result) != key(expected):
            raise Finding(f"valid {kind} body read as {result!r}, expected {expected!r}")
    return outcome


# ------------------------------------------------------------------------------ records

_V6 = ("::1", "::", "2001:db8::1", "fe80::abcd:0:0:1", "::ffff:10.0.0.1", "1:2:3:4:5:6:7:8")


def ipv4_host(rng: random.Random, port: int) -> str:
    return f"{ipaddress.IPv4Address(rng.getrandbits(32))}:{port}"


def gen_host(rng: random.Random) -> tuple[str, bool]:
    port = rng.randint(0, 65535) if rng.random() < 0.9 else rint(rng, 32)
    if rng.random() < 0.75:
        return ipv4_host(rng, port), False
    pick = rng.random() < 0.5
    addr = rng.choice(_V6) if pick else ipaddress.IPv6Address(rng.getrandbits(128)).compressed
    return f"[{addr}]:{port}", True


def gen_props(rng: random.Random, max_n: int = 5) -> dict[str, str]:
    props = {rtext(rng, 8, 1, exclude="\x01\x02"): rtext(rng, 12, 1, exclude="\x02")
             for _ in range(rng.randint(0, max_n))}
    r = rng.random()
    if r < 0.3:
        props["UNIQ_KEY"] = "".join(rng.choice("0123456789ABCDEF") for _ in range(32))
    if rng.random() < 0.3:
        props["TAGS"] = rtext(rng, 8, 1, exclude="\x02")
    if rng.random() < 0.3:
        props["KEYS"] = rng.choice(("a b", " a  b ", "k", rtext(rng, 10, 1, exclude="\x02")))
    return props


def _large_body(rng: random.Random) -> bytes:
    n = rng.choice((1024, 4096, 70_000))
    return (bytes(range(256)) * (n // 256 + 1))[:n]


def gen_record(rng: random.Random, start: int) -> tuple[bytes, int, bool, Hot]:
    """One stored record: (bytes, messages it holds when unwrapped, compressed?, hot offsets)."""
    kind = rng.choice(("plain", "plain", "plain", "v2", "zlib", "batch", "zlib-batch"))
    born, born6 = gen_host(rng)
    store, store6 = gen_host(rng)
    r = rng.random()
    topic = rtext(rng, 40, 1) if r < 0.95 else "T" * rng.randint(120, 300)
    body = rbytes(rng, 300) if rng.random() < 0.97 else _large_body(rng)
    sys_flag = rint(rng, 32) & ~(MSG_COMPRESSED_FLAG | COMPRESSION_TYPE_MASK | MSG_INNER_BATCH_FLAG
                                 | MSG_NEED_UNWRAP_FLAG)
    if rng.random() < 0.7:
        sys_flag &= 0xF
    count = 1
    if kind.endswith("batch"):
        items = [Message("t", rbytes(rng, 60), tags=rng.choice((None, "TagA")), flag=rint(rng, 32),
                         properties=gen_props(rng, 3)) for _ in range(rng.randint(0, 4))]
        body = encode_batch(items)
        sys_flag |= MSG_INNER_BATCH_FLAG | MSG_NEED_UNWRAP_FLAG
        count = len(items)
    msg = MessageExt(topic=topic, body=body, queue_id=rint(rng, 32), queue_offset=rint(rng, 64),
                     flag=rint(rng, 32), sys_flag=sys_flag, properties=gen_props(rng),
                     commit_log_offset=rint(rng, 64), born_timestamp=rint(rng, 64), born_host=born,
                     store_timestamp=rint(rng, 64), store_host=store,
                     reconsume_times=rint(rng, 32), prepared_transaction_offset=rint(rng, 64))
    topic_len = len(topic.encode())
    magic = MAGIC_V2 if kind == "v2" or topic_len > 127 else MAGIC_V1
    compress = kind.startswith("zlib")
    data = encode_stored_message(msg, magic=magic, compress=compress,
                                 compress_level=rng.randint(0, 9))
    # Where the length and flag fields of this record are.
    tail = start + 48 + (20 if born6 else 8) + 8 + (20 if store6 else 8)
    stored_body = int.from_bytes(data[tail - start + 12 : tail - start + 16], "big")
    topic_at = tail + 16 + stored_body
    tsize = 1 if magic == MAGIC_V1 else 2
    hot: Hot = [(start, 4), (start + 4, 4), (start + 36, 4), (start + 36, 1), (start + 38, 1),
                (tail + 12, 4), (topic_at, tsize), (topic_at + tsize + topic_len, 2)]
    if kind == "batch":
        p = tail + 16
        end = p + stored_body
        while p + 22 <= end:
            size = int.from_bytes(data[p - start : p - start + 4], "big")
            blen = int.from_bytes(data[p - start + 16 : p - start + 20], "big")
            hot += [(p, 4), (p + 16, 4), (p + 20 + blen, 2)]
            p += max(size, 1)
    return data, count, compress, hot


def gen_records(rng: random.Random) -> tuple[bytes, int, bool, Hot]:
    parts: list[bytes] = []
    hot: Hot = []
    count = 0
    compressed = False
    pos = 0
    for _ in range(rng.choice((1, 1, 2, 3, 4))):
        data, n, comp, rec_hot = gen_record(rng, pos)
        parts.append(data)
        hot += rec_hot
        count += n
        compressed = compressed or comp
        pos += len(data)
    return b"".join(parts), count, compressed, hot


def gen_sink_body(rng: random.Random) -> tuple[bytes, str, Hot]:
    """A pull body in the shape the sink keeps undecoded: plain records of one topic and queue
    at rising offsets, IPv4 hosts (a few odd ones mixed in); its topic; and where each record's
    length, queue, offset, flag and property-length fields are."""
    topic = rtext(rng, 30, 1)
    queue_id = rint(rng, 32)
    offset = rint(rng, 48)
    parts: list[bytes] = []
    hot: Hot = []
    pos = 0
    for _ in range(rng.randint(1, 6)):
        if rng.random() < 0.8:  # mostly the IPv4 hosts the sink keeps
            born = ipv4_host(rng, rng.randint(0, 65535))
            store = ipv4_host(rng, rng.randint(0, 65535))
        else:
            born, store = gen_host(rng)[0], gen_host(rng)[0]
        msg = MessageExt(topic=topic if rng.random() < 0.97 else topic + "x",
                         body=rbytes(rng, 200), queue_id=queue_id,
                         queue_offset=offset, flag=rint(rng, 32),
                         # Mostly not compressed (bit 0), which the scan declines.
                         sys_flag=rint(rng, 32) & 0xE if rng.random() < 0.9 else rint(rng, 32),
                         properties=gen_props(rng), commit_log_offset=rint(rng, 63),
                         born_timestamp=rint(rng, 63), born_host=born,
                         store_timestamp=rint(rng, 63), store_host=store,
                         reconsume_times=rint(rng, 31))
        data = encode_stored_message(msg)
        # Total size, queue id, queue offset, sys flag, properties length.
        hot += [(pos, 4), (pos + 12, 4), (pos + 20, 8), (pos + 36, 4), (pos + len(data) - 2, 2)]
        parts.append(data)
        pos += len(data)
        offset += 1 if rng.random() < 0.95 else rng.choice((0, -1, 2))
    return b"".join(parts), topic, hot


def gen_record_case(rng: random.Random) -> Case:
    opts: dict[str, Any] = {"decompress": rng.random() < 0.9, "unwrap": rng.random() < 0.9,
                            "limit": message.DEFAULT_MAX_BODY_SIZE, "expected": None,
                            "sink_topic": None}
    if rng.random() < 0.1:
        opts["limit"] = rng.choice((0, 10, 1000, 1 << 16))
    r = rng.random()
    if r < 0.15:  # a body the Spark sink would keep undecoded, as it came or mutated
        data, opts["sink_topic"], hot = gen_sink_body(rng)
        if rng.random() < 0.6:
            data = mutate(rng, data, hot, data)
        return Case(data, opts)
    r = rng.random()
    if r < 0.03:
        return Case(rng.randbytes(rng.randint(0, 400)), opts)
    if r < 0.05:  # a compressed body inflating beyond the limit, or to exactly it
        size = rng.choice((1 << 16, 1 << 20))
        opts["limit"] = rng.choice((size - 1, size, 10))
        msg = MessageExt("t", bytes(size), born_host="1.1.1.1:1", store_host="2.2.2.2:2")
        return Case(encode_stored_message(msg, compress=True), opts)
    if r < 0.08:  # a bad compressed body, or another compression type
        flag = MSG_COMPRESSED_FLAG | (rng.randint(0, 7) << 8)
        good = zlib.compress(rbytes(rng, 200))
        body = rng.choice((b"", b"garbage", good[:-rng.randint(1, 4)], good + b"tail", good,
                           mutate(rng, good, [], b"")))
        msg = MessageExt("t", body, sys_flag=flag, born_host="1.1.1.1:1", store_host="[::1]:2")
        return Case(encode_stored_message(msg), opts)
    data, count, compressed, hot = gen_records(rng)
    if rng.random() < 0.12:
        if opts["decompress"] and opts["unwrap"] and (
                not compressed or opts["limit"] == message.DEFAULT_MAX_BODY_SIZE):
            opts["expected"] = count
    else:
        if rng.random() < 0.1:
            data = shrink_record(rng, data)
        other = gen_record(rng, 0)[0] if rng.random() < 0.4 else data
        data = mutate(rng, data, hot, other)
    return Case(data, opts)


def shrink_record(rng: random.Random, data: bytes) -> bytes:
    """Declare one record barely longer than the smallest possible, so that the checks of its
    variable-length middle (IPv6 hosts, tail) fire instead of the overall size check."""
    starts = []
    pos = 0
    while pos + 4 <= len(data):
        starts.append(pos)
        pos += max(int.from_bytes(data[pos : pos + 4], "big"), 4)
    buf = bytearray(data)
    _write_int(buf, rng.choice(starts), 4, rng.randint(message._MIN_RECORD, message._MIN_RECORD + 40))
    return bytes(buf)


def _twin_parsers() -> tuple[Callable[[bytes], dict[str, str]], Callable[[bytes], dict[str, str]] | None]:
    compiled = _cmessage.parse_raw_properties if _cmessage is not None else None
    return types._parse_raw_properties, compiled


def _state(m: MessageExt, parse: Callable[[bytes], dict[str, str]],
           find: Callable[[bytes, str], str | None] | None) -> dict[str, Any]:
    raw = m._props_raw
    if m._props is not None or raw is None:
        raise Finding("a decoded message has its properties parsed already")
    props = parse(raw)
    if find is not None:
        for name in ("TAGS", "KEYS", "UNIQ_KEY", "", "\ufffd", *list(props)[:2]):
            if find(raw, name) != props.get(name):
                raise Finding(f"find_raw_property({raw!r}, {name!r}) disagrees with the parser")
    out: dict[str, Any] = {"_props_raw": raw, "_properties_items": list(props.items())}
    for f in dataclasses.fields(m):
        out[f.name] = getattr(m, f.name)
    out["properties_items"] = list(out["properties"].items())
    out["msg_id"] = m.msg_id
    out["tags"] = m.tags
    out["keys"] = m.keys
    repr(m)
    return out


_Loop = Callable[[bytes, list[MessageExt], bool, bool, int, int], None]


def _outcome(loop: _Loop, parse: Callable[[bytes], dict[str, str]],
             find: Callable[[bytes, str], str | None] | None, data: bytes, opts: dict[str, Any],
             single: bool) -> tuple[str, Any]:
    try:
        if single:
            msgs = [message._decode_message(loop, data, opts["decompress"], opts["limit"])]
        else:
            msgs = message._decode_messages(loop, data, opts["decompress"], opts["unwrap"],
                                            opts["limit"])
    except ProtocolError as exc:
        return ("error", str(exc))
    return ("ok", [_state(m, parse, find) for m in msgs])


def check_record(case: Case) -> str:
    data: bytes = case.data
    opts = case.extra
    py_parse, c_parse = _twin_parsers()
    py = _outcome(message._decode_records, py_parse, None, data, opts, False)
    py1 = _outcome(message._decode_records, py_parse, None, data, opts, True)
    if _cmessage is not None:
        c = _outcome(_cmessage.decode_records, cast(Callable[[bytes], dict[str, str]], c_parse),
                     _cmessage.find_raw_property, data, opts, False)
        if c != py:
            raise Finding(f"compiled and pure decoders disagree: compiled {_brief(c)}, "
                          f"pure {_brief(py)}")
        c1 = _outcome(_cmessage.decode_records, cast(Callable[[bytes], dict[str, str]], c_parse),
                      _cmessage.find_raw_property, data, opts, True)
        if c1 != py1:
            raise Finding(f"compiled and pure single-record decoders disagree: compiled "
                          f"{_brief(c1)}, pure {_brief(py1)}")
    if _cmessage is not None and opts["sink_topic"] is not None:
        _check_sink_scan(data, opts["sink_topic"])
    expected = opts["expected"]
    if expected is not None and (py[0] != "ok" or len(py[1]) != expected):
        raise Finding(f"valid records decoded as {_brief(py)}, expected {expected} messages")
    if opts["decompress"] and opts["unwrap"] and opts["limit"] == message.DEFAULT_MAX_BODY_SIZE:
        good, corrupt = decode_messages_salvaging(data)
        if (corrupt is None) != (py[0] == "ok"):
            raise Finding(f"salvage reports {corrupt!r} but the whole body gave {_brief(py)}")
        if corrupt is None and len(good) != len(py[1]):
            raise Finding("salvage decoded a different number of messages")
        if corrupt is not None and not 0 <= corrupt.position < len(data):
            raise Finding(f"salvage reports a position outside the body: {corrupt!r}")
    return "ok" if py[0] == "ok" and py1[0] == "ok" else "error"


_PULL_PROPERTIES = {"MIN_OFFSET": "0", "MAX_OFFSET": "99"}
#: Bodies the sink's scan kept and :func:`_check_sink_scan` checked, over the process's life
#: (:func:`run` reports the difference per run, so that a reader sees the path was reached).
_SINK_KEPT = [0]


def _check_sink_scan(data: bytes, topic: str) -> None:
    """A body the sink's scan keeps must decode into exactly the messages it counted, and the
    rows converted from its bytes must be the rows of those messages."""
    chunk = StoredChunk.scan(data, topic, "broker-f", dict(_PULL_PROPERTIES), 99)
    if chunk is None:
        return
    _SINK_KEPT[0] += 1
    try:
        msgs = message.decode_messages(data)
    except ProtocolError as exc:
        raise Finding(f"the sink's scan kept a body the decoder rejects: {exc}") from exc
    seen = (len(msgs), msgs[0].queue_offset if msgs else None,
            msgs[-1].queue_offset if msgs else None, sum(len(m.body) for m in msgs))
    counted = (chunk.count, chunk.first_offset, chunk.last_offset, chunk.size)
    if seen != counted:
        raise Finding(f"the sink's scan counted (count, first, last, bytes) {counted}, "
                      f"the decoder gives {seen}")
    if any(m.topic != topic or m.queue_id != chunk.queue_id for m in msgs):
        raise Finding("the sink's scan kept records of another topic or queue")
    if _arrow is not None:
        table = _arrow.stored_to_arrow([chunk])
        table.validate(full=True)
        expected = _arrow._convert_values(chunk.messages())
        if not table.equals(expected):
            raise Finding(f"rows read from the bytes differ from the decoded messages' rows: "
                          f"{table.to_pylist()!r} != {expected.to_pylist()!r}")


def _brief(outcome: tuple[str, Any]) -> str:
    kind, value = outcome
    if kind == "error":
        return f"ProtocolError({value!r})"
    return f"{len(value)} message(s)"


# ------------------------------------------------------------------------------ driver

GENERATORS: dict[str, tuple[Callable[[random.Random], Case], Callable[[Case], str]]] = {
    "frame": (gen_frame_case, check_frame),
    "header": (gen_header_case, check_header),
    "body": (gen_body_case, check_body),
    "record": (gen_record_case, check_record),
}


@dataclasses.dataclass(slots=True)
class TargetStats:
    name: str
    inputs: int = 0
    protocol_errors: int = 0
    ok: int = 0
    findings: int = 0
    hangs: int = 0
    seconds: float = 0.0
    slowest: float = 0.0
    sink_kept: int = 0
    """Record bodies the Spark sink's scan kept undecoded, checked against the decoder."""

    def line(self) -> str:
        rate = self.inputs / self.seconds if self.seconds else 0.0
        kept = f" sink_kept={self.sink_kept}" if self.name == "record" else ""
        return (f"{self.name:<7} inputs={self.inputs} protocol_errors={self.protocol_errors} "
                f"ok={self.ok} findings={self.findings} hangs={self.hangs}{kept} "
                f"time={self.seconds:.1f}s rate={rate:,.0f}/s slowest={self.slowest * 1000:.1f}ms")


@dataclasses.dataclass(slots=True)
class Report:
    seed: int
    targets: list[TargetStats]
    messages: list[str] = dataclasses.field(default_factory=list)
    timed_out: bool = False

    @property
    def findings(self) -> int:
        return sum(t.findings for t in self.targets)

    @property
    def inputs(self) -> int:
        return sum(t.inputs for t in self.targets)

    def total_line(self) -> str:
        seconds = sum(t.seconds for t in self.targets)
        rate = self.inputs / seconds if seconds else 0.0
        return (f"total   inputs={self.inputs} "
                f"protocol_errors={sum(t.protocol_errors for t in self.targets)} "
                f"ok={sum(t.ok for t in self.targets)} findings={self.findings} "
                f"hangs={sum(t.hangs for t in self.targets)} time={seconds:.1f}s "
                f"rate={rate:,.0f}/s seed={self.seed} implementations="
                f"{'compiled+python' if _cmessage is not None else 'python'}"
                + (" TIME LIMIT REACHED" if self.timed_out else ""))


def case_rng(seed: int, target: str, index: int) -> random.Random:
    return random.Random(f"{seed}/{target}/{index}")


def _show(data: Any, limit: int = 512) -> str:
    if isinstance(data, bytes | bytearray):
        text = bytes(data[:limit]).hex()
        return f"{len(data)} bytes: {text}{'...' if len(data) > limit else ''}"
    text = repr(data)
    return text if len(text) <= 4 * limit else text[: 4 * limit] + "..."


class _Progress:
    """What the main thread is doing, for the stall watchdog."""

    __slots__ = ("index", "started", "target")

    def __init__(self) -> None:
        self.target = ""
        self.index = -1
        self.started = 0.0


def run(inputs: int, seed: int = DEFAULT_SEED, targets: Sequence[str] = TARGETS, *,
        hang_seconds: float = DEFAULT_HANG_SECONDS, time_limit: float | None = None,
        out: TextIO | None = None, max_printed: int = 10, progress: _Progress | None = None,
        only_index: int | None = None) -> Report:
    """Run ``inputs`` generated inputs split evenly over ``targets``; return the figures.

    Findings are written to ``out`` (at most ``max_printed`` per target in full).
    """
    stream = out if out is not None else sys.stdout
    if _cmessage is not None:
        # The compiled loop borrows decompression and IPv6 formatting from the pure module.
        _cmessage.install(message._decompress, message._host6)
    report = Report(seed, [TargetStats(t) for t in targets])
    deadline = None if time_limit is None else time.monotonic() + time_limit
    share, extra = divmod(inputs, len(targets))
    for n, stats in enumerate(report.targets):
        gen, check = GENERATORS[stats.name]
        count = share + (1 if n < extra else 0)
        indices: range | list[int] = range(count) if only_index is None else [only_index]
        started = time.perf_counter()
        kept_before = _SINK_KEPT[0]
        for i in indices:
            if deadline is not None and (i & 255) == 0 and time.monotonic() > deadline:
                report.timed_out = True
                break
            if progress is not None:
                progress.target, progress.index, progress.started = stats.name, i, time.monotonic()
            rng = case_rng(seed, stats.name, i)
            case: Case | None = None
            t0 = time.perf_counter()
            try:
                case = gen(rng)
                t0 = time.perf_counter()
                outcome = check(case)
            except Exception as exc:
                elapsed = time.perf_counter() - t0
                stats.findings += 1
                kind = "invariant" if isinstance(exc, Finding) else type(exc).__name__
                message_text = (
                    f"FINDING {stats.name} #{i} (seed {seed}; replay with --target {stats.name} "
                    f"--seed {seed} --index {i}): {kind}: {exc}\n"
                    f"  input: {_show(case.data) if case is not None else '(generation failed)'}\n"
                    + "".join(traceback.format_exception(exc)))
                report.messages.append(message_text)
                if stats.findings <= max_printed:
                    print(message_text, file=stream, flush=True)
            else:
                elapsed = time.perf_counter() - t0
                if outcome == "ok":
                    stats.ok += 1
                else:
                    stats.protocol_errors += 1
            stats.inputs += 1
            if elapsed > stats.slowest:
                stats.slowest = elapsed
            if elapsed > hang_seconds and case is not None:
                stats.hangs += 1
                stats.findings += 1
                text = (f"HANG {stats.name} #{i} (seed {seed}): {elapsed:.2f}s > {hang_seconds}s\n"
                        f"  input: {_show(case.data)}\n")
                report.messages.append(text)
                print(text, file=stream, flush=True)
        stats.seconds = time.perf_counter() - started
        stats.sink_kept = _SINK_KEPT[0] - kept_before
        print(stats.line(), file=stream, flush=True)
        if report.timed_out:
            break
    if progress is not None:
        progress.target = ""
    print(report.total_line(), file=stream, flush=True)
    return report


def _watchdog(progress: _Progress, stall_seconds: float) -> None:
    """Stop the process with the main thread's stack if one input runs for ``stall_seconds``."""
    while True:
        time.sleep(min(1.0, stall_seconds / 4))
        target = progress.target
        if target and time.monotonic() - progress.started > stall_seconds:
            print(f"HANG {target} #{progress.index}: no result after {stall_seconds:.0f}s; "
                  f"replay with --target {target} --index {progress.index}", file=sys.stderr,
                  flush=True)
            faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
            os._exit(3)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--inputs", type=int, default=1_000_000,
                        help="inputs in total, split evenly over the targets")
    parser.add_argument("--seed", type=int, default=DEFAULT_SEED)
    parser.add_argument("--target", choices=(*TARGETS, "all"), default="all")
    parser.add_argument("--index", type=int, default=None,
                        help="replay only this input of each selected target")
    parser.add_argument("--hang-seconds", type=float, default=DEFAULT_HANG_SECONDS,
                        help="an input taking longer than this is reported as a hang")
    parser.add_argument("--stall-seconds", type=float, default=30.0,
                        help="abort (exit 3) with the stack if one input runs this long")
    parser.add_argument("--time-limit", type=float, default=1800.0,
                        help="wall-clock limit of the whole run, in seconds")
    parser.add_argument("--max-printed", type=int, default=10,
                        help="findings printed in full per target")
    args = parser.parse_args(argv)
    targets = TARGETS if args.target == "all" else (args.target,)
    progress = _Progress()
    threading.Thread(target=_watchdog, args=(progress, args.stall_seconds), daemon=True,
                     name="fuzz-watchdog").start()
    # Last resort if the interpreter itself is stuck (the watchdog needs the GIL).
    faulthandler.dump_traceback_later(args.time_limit + 60, exit=True)
    print(f"fuzzing {', '.join(targets)}: {args.inputs} inputs, seed {args.seed}, "
          f"decoder implementations: {'compiled+python' if _cmessage is not None else 'python'}",
          flush=True)
    try:
        report = run(args.inputs, args.seed, targets, hang_seconds=args.hang_seconds,
                     time_limit=args.time_limit, max_printed=args.max_printed, progress=progress,
                     only_index=args.index)
    finally:
        faulthandler.cancel_dump_traceback_later()
    if report.timed_out:
        print(f"time limit of {args.time_limit:.0f}s reached", file=sys.stderr)
        return 2
    return 1 if report.findings else 0


if __name__ == "__main__":
    sys.exit(main())

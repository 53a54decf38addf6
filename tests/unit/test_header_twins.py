"""The compiled reader of JSON command headers and the pure decoder agree on every input.

``_cmessage.json_header`` reads only the plain shape brokers write and declines (``None``)
everything else; where it answers, its answer must be the pure decoder's, and a header decoded
through :func:`command._decode_json_header` (compiled first, pure when declined) must equal the
pure decoding or fail with the same ProtocolError.
"""

from __future__ import annotations

import json
import random
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rmq_async.protocol import command, message
from rmq_async.protocol.command import (
    FrameDecoder,
    RemotingCommand,
    _decode_json_header,
    _decode_json_header_py,
)
from rmq_async.protocol.errors import ProtocolError

try:
    from rmq_async.protocol import _cmessage
except ImportError:  # pragma: no cover - the extension is built by `make setup`
    _cmessage = None  # type: ignore[assignment]

needs_compiled = pytest.mark.skipif(_cmessage is None, reason="compiled codec not built")

TWINS = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])

# A pull response header as a 5.3.3 broker writes it (fastjson: sorted keys, no spaces).
BROKER_PULL = (
    b'{"code":0,"extFields":{"groupSysFlag":"0","maxOffset":"125000","minOffset":"0",'
    b'"nextBeginOffset":"3232","suggestWhichBrokerId":"0","topicSysFlag":"0"},"flag":1,'
    b'"language":"JAVA","opaque":12345,"serializeTypeCurrentRPC":"JSON","version":475}'
)
BROKER_ERROR = (
    b'{"code":17,"flag":1,"language":"JAVA","opaque":7,"remark":"topic[x] not exist, apply '
    b'first please! \xe4\xb8\xad","serializeTypeCurrentRPC":"JSON","version":475}'
)


def _fields(cmd: RemotingCommand) -> tuple[Any, ...]:
    ext = cmd.ext_fields
    return (cmd.code, cmd.language, type(cmd.language), cmd.version, cmd.opaque, cmd.flag,
            cmd.remark, None if ext is None else list(ext.items()), cmd.serialize_type)


def _outcome(decode: Any, raw: bytes) -> tuple[str, Any]:
    try:
        return "ok", _fields(decode(raw))
    except ProtocolError as exc:
        return "error", str(exc)


def _check(raw: bytes) -> bool:
    """Both decoders agree on ``raw``; True when the compiled reader answered itself."""
    assert _cmessage is not None
    pure = _outcome(_decode_json_header_py, raw)
    fast = _cmessage.json_header(raw)
    if fast is not None:
        assert pure[0] == "ok", (raw, pure)
        code, language, version, opaque, flag, remark, ext = fast
        cmd = RemotingCommand(code=code, version=version, opaque=opaque, flag=flag,
                              remark=remark, ext_fields=ext,
                              language=command._json_language(language))
        assert _fields(cmd) == pure[1], raw
    saved = command._json_header_fast
    command.set_json_header_parser(_cmessage.json_header)
    try:
        assert _outcome(_decode_json_header, raw) == pure, raw
    finally:
        command.set_json_header_parser(saved)
    return fast is not None


@needs_compiled
def test_broker_headers_are_read_by_the_compiled_reader() -> None:
    assert _check(BROKER_PULL)
    assert _check(BROKER_ERROR)
    assert _check(b"{}")
    assert _check(b' { "code" : -5 , "extFields" : { } , "remark" : null }\n')


@needs_compiled
@pytest.mark.parametrize("raw", [
    b'{"code":"12"}',  # a number as a string: the pure decoder converts it
    b'{"code":1.0}', b'{"code":1e3}', b'{"code":01}', b'{"code":2147483648}',
    b'{"code":true}', b'{"language":3}', b'{"remark":5}', b'{"extFields":{"a":1}}',
    b'{"extFields":{"a":null}}', b'{"extFields":[]}', b'{"other":[1,2]}', b'{"other":{}}',
    b'{"remark":"a\\nb"}', b'{"remark":"a\x01b"}', b'{"remark":"\xff"}', b'{"co\\u0064e":1}',
    b'{"code":1}x', b'{"code":1,}', b'[1]', b'', b'{', b'{"code":NaN}', b'\xef\xbb\xbf{}',
    b'{"code":-}', b'{"code":1 2}', b'{"extFields":{"a":"b",}}',
])
def test_unusual_headers_are_left_to_the_pure_decoder(raw: bytes) -> None:
    assert not _check(raw)


@needs_compiled
def test_duplicate_keys_keep_the_last_value_like_json() -> None:
    assert _check(b'{"code":1,"code":2,"extFields":{"a":"1","b":"2","a":"3"},"extFields":null}')
    assert _check(b'{"extFields":{"a":"1","b":"2","a":"3"},"language":"GO","language":null}')


_scalar = st.one_of(st.none(), st.booleans(), st.integers(-(2**40), 2**40), st.text(max_size=8),
                    st.floats(allow_nan=False, allow_infinity=False))
_names = st.sampled_from(["code", "extFields", "flag", "language", "opaque", "remark",
                          "serializeTypeCurrentRPC", "version", "other", ""])
_ext = st.one_of(st.none(), st.dictionaries(st.text(max_size=6), st.text(max_size=10), max_size=6),
                 st.dictionaries(st.text(max_size=6), _scalar, max_size=4), st.lists(_scalar))
_value = st.one_of(_scalar, st.sampled_from(["JAVA", "PYTHON", "GO", "RUST", "JSON"]),
                   st.integers(-(2**31), 2**31 - 1), _ext)


@needs_compiled
@TWINS
@given(st.lists(st.tuples(_names, _value), max_size=9), st.booleans(), st.booleans(),
       st.sampled_from([(",", ":"), (", ", ": "), (" ,\n", "\t:\r")]))
def test_generated_headers_decode_alike(pairs: list[tuple[str, Any]], ascii_only: bool,
                                        sort: bool, separators: tuple[str, str]) -> None:
    # Pairs rather than a dict, so that repeated keys reach the decoders as written.
    sep_item, sep_key = separators
    text = "{" + sep_item.join(
        json.dumps(k, ensure_ascii=ascii_only) + sep_key
        + json.dumps(v, ensure_ascii=ascii_only, sort_keys=sort, separators=separators)
        for k, v in pairs) + "}"
    _check(text.encode("utf-8", "surrogatepass"))


@needs_compiled
@TWINS
@given(st.data(), st.sampled_from([BROKER_PULL, BROKER_ERROR]))
def test_mutated_broker_headers_decode_alike(data: st.DataObject, base: bytes) -> None:
    raw = bytearray(base)
    for _ in range(data.draw(st.integers(1, 4))):
        at = data.draw(st.integers(0, len(raw)))
        action = data.draw(st.sampled_from(["set", "insert", "delete"]))
        byte = data.draw(st.sampled_from([0x22, 0x2C, 0x3A, 0x7B, 0x7D, 0x30, 0x39, 0x2D, 0x20,
                                          0x5C, 0x2E, 0x65, 0x00, 0xFF, 0x80, 0x61]))
        if action == "insert" or at == len(raw):
            raw.insert(at, byte)
        elif action == "set":
            raw[at] = byte
        else:
            del raw[at]
    _check(bytes(raw))


@needs_compiled
def test_every_truncation_and_single_byte_change_decodes_alike() -> None:
    rng = random.Random(11)
    for base in (BROKER_PULL, BROKER_ERROR):
        for end in range(len(base) + 1):
            _check(base[:end])
        for at in range(len(base)):
            raw = bytearray(base)
            raw[at] = rng.randrange(256)
            _check(bytes(raw))


@needs_compiled
def test_frames_decode_alike_through_the_frame_decoder() -> None:
    assert _cmessage is not None
    body = b"stored records"
    header = BROKER_PULL
    data = ((len(header) + len(body) + 4).to_bytes(4, "big") + len(header).to_bytes(4, "big")
            + header + body)
    results = []
    for parser in (None, _cmessage.json_header):
        saved = command._json_header_fast
        command.set_json_header_parser(parser)
        try:
            (cmd,) = FrameDecoder().feed(data)
        finally:
            command.set_json_header_parser(saved)
        results.append((_fields(cmd), cmd.body))
    assert results[0] == results[1]
    assert results[0][1] == body


def test_the_process_uses_the_compiled_reader_with_the_compiled_codec() -> None:
    if message.IMPLEMENTATION == "compiled":
        assert _cmessage is not None
        assert command._json_header_fast is _cmessage.json_header
    else:
        assert command._json_header_fast is None

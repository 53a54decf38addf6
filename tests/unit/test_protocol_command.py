"""RemotingCommand encoding/decoding and the incremental FrameDecoder."""

from __future__ import annotations

import json
import random
import struct

import pytest

from rmq_async.protocol import headers as h
from rmq_async.protocol.codes import (
    CURRENT_VERSION,
    RPC_ONEWAY,
    RPC_TYPE_RESPONSE,
    LanguageCode,
    RequestCode,
    ResponseCode,
    SerializeType,
)
from rmq_async.protocol.command import FrameDecoder, RemotingCommand, next_opaque
from rmq_async.protocol.errors import ProtocolError

# Reference §1.11 worked example: GET_ROUTEINFO_BY_TOPIC for TopicTest, opaque 1, PYTHON, 479.
GOLDEN_JSON_HEADER = (
    b'{"code":105,"extFields":{"topic":"TopicTest"},"flag":0,"language":"PYTHON",'
    b'"opaque":1,"serializeTypeCurrentRPC":"JSON","version":479}'
)
GOLDEN_ROCKETMQ_FRAME = bytes.fromhex(
    "0000002d 01000029 0069 03 01df 00000001 00000000 00000000 00000014"
    " 0005 746f706963 00000009 546f70696354657374"
)

# Produced by RocketMQ 5.3.3 + fastjson 1.2.83 (RemotingCommand with a PullMessageRequestHeader,
# makeCustomHeaderToNet + RemotingSerializable.encode): extFields in Java HashMap order.
JAVA_PULL_JSON_HEADER = (
    '{"code":11,"extFields":{"queueId":"3","maxMsgNums":"32","sysFlag":"3",'
    '"suspendTimeoutMillis":"15000","commitOffset":"99","bname":"broker-a","topic":"TopicTest",'
    '"queueOffset":"100","expressionType":"TAG","subscription":"TagA || TagB",'
    '"subVersion":"1700000000000","consumerGroup":"g1"},"flag":0,"language":"PYTHON","opaque":7,'
    '"serializeTypeCurrentRPC":"JSON","version":479}'
)
# Same command with remark "hi", ROCKETMQ serialization (RocketMQSerializable.rocketMQProtocolEncode).
JAVA_PULL_BINARY_HEADER = bytes.fromhex(
    "000b0301df0000000700000000000000026869000001030007717565756549640000000133000a6d61784d7367"
    "4e756d730000000233320007737973466c61670000000133001473757370656e6454696d656f75744d696c6c69"
    "73000000053135303030000c636f6d6d69744f66667365740000000239390005626e616d650000000862726f6b"
    "65722d610005746f70696300000009546f70696354657374000b71756575654f66667365740000000331303000"
    "0e65787072657373696f6e5479706500000003544147000c737562736372697074696f6e0000000c5461674120"
    "7c7c2054616742000a73756256657273696f6e0000000d31373030303030303030303030000d636f6e73756d65"
    "7247726f7570000000026731"
)
# A SYSTEM_ERROR response from Java whose remark needs every kind of fastjson escaping.
JAVA_ESCAPED_REMARK = (
    'esc " \\ / \b\f\n\r\t \u0001\u000b\u001f\u007f\u0085\u009f\u00a0 \u2028\u2029 中文 😀'
)
JAVA_ESCAPED_HEADER = bytes.fromhex(
    "7b22636f6465223a312c22666c6167223a312c226c616e6775616765223a224a415641222c226f706171756522"
    "3a392c2272656d61726b223a22657363205c22205c5c202f205c625c665c6e5c725c74205c75303030315c7530"
    "3030425c75303031465c75303037465c75303038355c7530303946c2a0205c75323032385c753230323920e4b8"
    "ade6968720f09f9880222c2273657269616c697a655479706543757272656e74525043223a224a534f4e222c22"
    "76657273696f6e223a3437397d"
)


def _pull_header() -> h.PullMessageRequestHeader:
    return h.PullMessageRequestHeader(
        consumer_group="g1",
        topic="TopicTest",
        queue_id=3,
        queue_offset=100,
        max_msg_nums=32,
        sys_flag=3,
        commit_offset=99,
        suspend_timeout_millis=15000,
        sub_version=1700000000000,
        expression_type="TAG",
        subscription="TagA || TagB",
        bname="broker-a",
    )


def test_golden_json_frame() -> None:
    cmd = RemotingCommand(code=RequestCode.GET_ROUTEINFO_BY_TOPIC, opaque=1,
                          ext_fields={"topic": "TopicTest"})
    frame = cmd.encode()
    assert frame[:8] == bytes.fromhex("00000089 00000085")
    assert frame[8:] == GOLDEN_JSON_HEADER
    assert len(frame) == 141


def test_golden_rocketmq_frame() -> None:
    cmd = RemotingCommand(code=105, opaque=1, ext_fields={"topic": "TopicTest"},
                          serialize_type=SerializeType.ROCKETMQ)
    assert cmd.encode() == GOLDEN_ROCKETMQ_FRAME


def test_java_pull_header_bytes_both_serializations() -> None:
    ext = _pull_header().to_ext_fields()
    cmd = RemotingCommand(code=11, opaque=7, ext_fields=ext)
    assert cmd.encode_header_json().decode("utf-8") == JAVA_PULL_JSON_HEADER
    binary = RemotingCommand(code=11, opaque=7, remark="hi", ext_fields=ext,
                             serialize_type=SerializeType.ROCKETMQ)
    assert binary.encode_header_binary() == JAVA_PULL_BINARY_HEADER


def test_java_string_escaping_in_remark() -> None:
    cmd = RemotingCommand(code=1, flag=RPC_TYPE_RESPONSE, opaque=9, language=LanguageCode.JAVA,
                          remark=JAVA_ESCAPED_REMARK)
    assert cmd.encode_header_json() == JAVA_ESCAPED_HEADER
    # and it reads back to the same text
    prefix = struct.pack(">iI", 4 + len(JAVA_ESCAPED_HEADER), len(JAVA_ESCAPED_HEADER))
    decoded = RemotingCommand.decode((prefix + JAVA_ESCAPED_HEADER)[4:])
    assert decoded.remark == JAVA_ESCAPED_REMARK
    assert decoded.language == LanguageCode.JAVA


def test_null_fields_omitted_and_empty_ext_fields_kept() -> None:
    text = RemotingCommand(code=34, opaque=3, ext_fields={}).encode_header_json().decode()
    assert '"extFields":{}' in text
    text = RemotingCommand(code=34, opaque=3).encode_header_json().decode()
    assert "extFields" not in text and "remark" not in text
    ext: dict[str, str] = {"a": "1"}
    ext["b"] = None  # type: ignore[assignment]
    assert json.loads(RemotingCommand(code=34, ext_fields=ext).encode_header_json())[
        "extFields"
    ] == {"a": "1"}


@pytest.mark.parametrize("stype", [SerializeType.JSON, SerializeType.ROCKETMQ])
@pytest.mark.parametrize(
    "cmd",
    [
        RemotingCommand(code=11, opaque=123456, ext_fields={"queueId": "0", "topic": "t"}),
        RemotingCommand(code=0, flag=1, opaque=2**31 - 1, remark="some error 中文",
                        body=b"\x00\x01" * 1000),
        RemotingCommand(code=-1006, language=LanguageCode.GO, version=401, opaque=-5, flag=3,
                        ext_fields={"k": "v\n\"x\"", "ключ": "значение"}, body=b"body"),
        RemotingCommand(code=17),
    ],
)
def test_round_trip(cmd: RemotingCommand, stype: SerializeType) -> None:
    cmd.serialize_type = stype
    frame = cmd.encode()
    assert frame == b"".join(cmd.encode_parts())
    (length,) = struct.unpack(">i", frame[:4])
    assert length == len(frame) - 4
    back = RemotingCommand.decode(frame[4:])
    assert back == cmd


def test_encode_parts_does_not_copy_body() -> None:
    body = b"x" * 100_000
    parts = RemotingCommand(code=310, body=body).encode_parts()
    assert len(parts) == 2 and parts[1] is body
    assert RemotingCommand(code=310).encode_parts()[-1] != b""


def test_request_and_response_helpers() -> None:
    req = RemotingCommand.request(RequestCode.PULL_MESSAGE, {"topic": "t"}, b"abc")
    assert req.opaque > 0 and req.flag == 0 and not req.is_response and not req.is_oneway
    assert req.language == LanguageCode.PYTHON and req.version == CURRENT_VERSION
    oneway = RemotingCommand.request(15, oneway=True)
    assert oneway.flag == RPC_ONEWAY and oneway.is_oneway
    assert oneway.opaque != req.opaque
    resp = req.response_to(ResponseCode.SUCCESS, remark="ok", ext_fields={"offset": "5"})
    assert resp.opaque == req.opaque and resp.flag == RPC_TYPE_RESPONSE and resp.is_response
    assert resp.ext("offset") == "5" and resp.ext("missing") is None
    binreq = RemotingCommand.request(40, serialize_type=SerializeType.ROCKETMQ)
    assert binreq.response_to(0).serialize_type == SerializeType.ROCKETMQ


def test_next_opaque_is_positive_int32() -> None:
    values = [next_opaque() for _ in range(1000)]
    assert all(0 <= v <= 2**31 - 1 for v in values)
    assert len(set(values)) == 1000


def test_binary_header_limits() -> None:
    with pytest.raises(ValueError):
        RemotingCommand(code=200050, serialize_type=SerializeType.ROCKETMQ).encode()
    # POP codes fit the JSON header
    assert RemotingCommand.decode(RemotingCommand(code=200050).encode()[4:]).code == 200050


def _frame(header: bytes, stype: int = 0, body: bytes = b"") -> bytes:
    prefix = struct.pack(">iI", 4 + len(header) + len(body), (stype << 24) | len(header))
    return prefix + header + body


def test_decode_json_from_java_style_header() -> None:
    hdr = (b'{"code":0,"flag":1,"language":"JAVA","opaque":0,'
           b'"serializeTypeCurrentRPC":"JSON","version":401,"extFields":{"offset":"12"},'
           b'"unknownKey":[1,2]}')
    cmd = RemotingCommand.decode(_frame(hdr, body=b"xyz")[4:])
    assert cmd.code == 0 and cmd.is_response and cmd.version == 401
    assert cmd.language == LanguageCode.JAVA and cmd.ext_fields == {"offset": "12"}
    assert cmd.body == b"xyz"


def test_decode_language_variants() -> None:
    def lang(value: str) -> int:
        header = f'{{"code":1,"language":{value}}}'.encode()
        return RemotingCommand.decode(_frame(header)[4:]).language
    assert lang('"PYTHON"') == LanguageCode.PYTHON
    assert lang('"COBOL"') == LanguageCode.OTHER
    assert lang("9") == LanguageCode.GO
    assert lang("99") == 99
    # unknown language byte in a ROCKETMQ header is kept as its number
    raw = bytearray(RemotingCommand(code=1, serialize_type=SerializeType.ROCKETMQ).encode())
    raw[8 + 2] = 200
    assert RemotingCommand.decode(bytes(raw[4:])).language == 200


def test_decode_json_coerces_non_string_ext_values() -> None:
    hdr = b'{"code":1,"extFields":{"a":1,"b":true,"c":null,"d":"x"}}'
    assert RemotingCommand.decode(_frame(hdr)[4:]).ext_fields == {"a": "1", "b": "true", "d": "x"}


@pytest.mark.parametrize(
    "frame",
    [
        b"\x00\x00",  # too short
        _frame(b'{"code":1}')[4:-1] + b"",  # header length > frame
        _frame(b'{"code":1}', stype=2)[4:],  # unknown serialize type
        _frame(b'{"code":1')[4:],  # bad JSON
        _frame(b"[1,2]")[4:],  # not an object
        _frame(b'{"code":"x"}')[4:],
        _frame(b'{"code":99999999999}')[4:],
        _frame(b'{"code":1,"remark":5}')[4:],
        _frame(b'{"code":1,"extFields":[1]}')[4:],
        _frame(b'{"code":1,"extFields":{"a":[1]}}')[4:],
        _frame(b'{"code":1,"language":true}')[4:],
        _frame(b'{"code":1,"remark":"\xff"}')[4:],  # bad UTF-8
        _frame(b"\x00" * 10, stype=1)[4:],  # binary header too short
        _frame(bytes.fromhex("006903 01df 00000001 00000000 00000064 00000000"), stype=1)[4:],
        # ^ remark length beyond the header
        _frame(GOLDEN_ROCKETMQ_FRAME[8:-1], stype=1)[4:],  # truncated extFields value
        _frame(GOLDEN_ROCKETMQ_FRAME[8:] + b"\x00", stype=1)[4:],  # trailing byte in header
    ],
)
def test_decode_rejects_malformed(frame: bytes) -> None:
    with pytest.raises(ProtocolError):
        RemotingCommand.decode(frame)


# ----------------------------------------------------------------------------- FrameDecoder


def test_frame_decoder_splits_and_joins() -> None:
    cmds = [
        RemotingCommand(code=i, opaque=i, ext_fields={"i": str(i)}, body=bytes([i]) * i,
                        serialize_type=SerializeType(i % 2))
        for i in range(1, 20)
    ]
    stream = b"".join(c.encode() for c in cmds)
    for chunk in (1, 3, 7, 64, len(stream)):
        dec = FrameDecoder()
        out: list[RemotingCommand] = []
        for start in range(0, len(stream), chunk):
            out.extend(dec.feed(stream[start : start + chunk]))
        assert out == cmds
        assert dec.buffered == 0


def test_frame_decoder_large_body_in_64k_chunks() -> None:
    body = bytes(range(256)) * (4 * 4096)  # 4 MiB
    frame = RemotingCommand(code=0, flag=1, opaque=77, body=body).encode()
    dec = FrameDecoder()
    got: list[RemotingCommand] = []
    view = memoryview(frame)
    for start in range(0, len(frame), 65536):
        got.extend(dec.feed(view[start : start + 65536]))
        assert dec.buffered <= len(frame)
    assert len(got) == 1 and got[0].body == body and got[0].opaque == 77


def test_frame_decoder_accepts_bytearray_and_memoryview() -> None:
    frame = RemotingCommand(code=5, opaque=1).encode()
    assert FrameDecoder().feed(bytearray(frame))[0].code == 5
    assert FrameDecoder().feed(memoryview(frame))[0].code == 5


def test_frame_decoder_rejects_huge_length_without_buffering() -> None:
    dec = FrameDecoder(max_frame_size=1024)
    with pytest.raises(ProtocolError, match="exceeds maximum"):
        dec.feed(struct.pack(">i", 2**31 - 1) + b"\x00" * 100)
    assert dec.buffered == 0 and dec.failed
    with pytest.raises(ProtocolError):
        dec.feed(b"\x00" * 65536)
    assert dec.buffered == 0


def test_frame_decoder_max_counts_length_field() -> None:
    frame = RemotingCommand(code=1, body=b"x" * 100).encode()
    assert FrameDecoder(max_frame_size=len(frame)).feed(frame)[0].body == b"x" * 100
    with pytest.raises(ProtocolError):
        FrameDecoder(max_frame_size=len(frame) - 1).feed(frame)


@pytest.mark.parametrize("length", [-1, 0, 3])
def test_frame_decoder_rejects_short_length(length: int) -> None:
    with pytest.raises(ProtocolError):
        FrameDecoder().feed(struct.pack(">i", length) + b"\x00" * 8)


def test_frame_decoder_stays_failed() -> None:
    dec = FrameDecoder()
    good = RemotingCommand(code=1).encode()
    with pytest.raises(ProtocolError):
        dec.feed(_frame(b"{bad json}"))
    with pytest.raises(ProtocolError):
        dec.feed(good)


def test_frame_decoder_partial_length_prefix() -> None:
    frame = RemotingCommand(code=9, opaque=4).encode()
    dec = FrameDecoder()
    assert dec.feed(frame[:2]) == []
    assert dec.feed(frame[2:5]) == []
    assert [c.code for c in dec.feed(frame[5:] + frame[:3])] == [9]
    assert dec.buffered == 3
    assert [c.code for c in dec.feed(frame[3:])] == [9]


def test_frame_decoder_keeps_only_the_unfinished_frame() -> None:
    frames = [RemotingCommand(code=i, opaque=i, body=bytes([i]) * 1000).encode() for i in range(4)]
    dec = FrameDecoder()
    assert dec.feed(frames[0][:700]) == []
    assert dec.buffered == 700
    # The rest of the first, two whole frames and the start of the last, in one read.
    got = dec.feed(frames[0][700:] + frames[1] + frames[2] + frames[3][:10])
    assert [c.code for c in got] == [0, 1, 2]
    assert [c.body for c in got] == [bytes([i]) * 1000 for i in range(3)]
    assert dec.buffered == 10
    assert [c.code for c in dec.feed(frames[3][10:])] == [3]
    assert dec.buffered == 0


def _read_like_a_transport(dec: FrameDecoder, stream: bytes, rng: random.Random
                           ) -> list[RemotingCommand]:
    """What a buffered transport does: read into get_buffer()'s space, then buffer_updated()."""
    got: list[RemotingCommand] = []
    pos = 0
    while pos < len(stream):
        space = dec.get_buffer(-1)
        assert len(space) >= FrameDecoder.MIN_READ
        n = min(len(space), rng.randint(1, 100_000), len(stream) - pos)
        space[:n] = stream[pos : pos + n]
        space[n:] = b"\xee" * (len(space) - n)  # what lies past the read must not matter
        got.extend(dec.buffer_updated(n))
        pos += n
    return got


def test_frame_decoder_reads_in_place_and_commands_own_their_bytes() -> None:
    rng = random.Random(11)
    cmds = [
        RemotingCommand(code=i, opaque=i, flag=i % 2, ext_fields={"k": str(i)},
                        body=bytes([i]) * rng.choice([0, 1, 900, 40_000, 300_000]))
        for i in range(60)
    ]
    dec = FrameDecoder()
    got = _read_like_a_transport(dec, b"".join(c.encode() for c in cmds), rng)
    assert got == cmds and dec.buffered == 0
    # The receive buffer is reused at once: scribbling over all of it changes no command.
    space = dec.get_buffer(-1)
    space[:] = b"\xff" * len(space)
    assert got == cmds


def test_frame_decoder_grows_for_a_large_frame_and_shrinks_after() -> None:
    big = RemotingCommand(code=1, opaque=1, body=bytes(range(256)) * 8192)  # 2 MiB
    small = RemotingCommand(code=2, opaque=2, body=b"s" * 100)
    dec = FrameDecoder()
    frame = big.encode()
    space = dec.get_buffer(-1)
    space[:10] = frame[:10]
    assert dec.buffer_updated(10) == []
    # The length field is in: the next read is offered the whole rest of the frame.
    space = dec.get_buffer(-1)
    assert len(space) >= len(frame) - 10
    space[: len(frame) - 10] = frame[10:]
    assert dec.buffer_updated(len(frame) - 10) == [big]
    assert len(dec.get_buffer(-1)) <= FrameDecoder.BUFFER_SIZE
    assert _read_like_a_transport(dec, small.encode() * 3, random.Random(1)) == [small] * 3


def test_frame_decoder_moves_an_unfinished_frame_to_the_front_when_space_runs_out() -> None:
    frames = [RemotingCommand(code=i, opaque=i, body=bytes([i]) * 30_000).encode()
              for i in range(20)]
    stream = b"".join(frames)
    dec = FrameDecoder()
    got: list[RemotingCommand] = []
    pos = 0
    while pos < len(stream):  # reads that always end inside a frame
        space = dec.get_buffer(-1)
        n = min(len(space), 45_000, len(stream) - pos)
        space[:n] = stream[pos : pos + n]
        got.extend(dec.buffer_updated(n))
        pos += n
    assert [c.code for c in got] == list(range(20))
    assert [c.body for c in got] == [bytes([i]) * 30_000 for i in range(20)]


def test_frame_decoder_checks_a_length_completed_by_the_next_read() -> None:
    dec = FrameDecoder(max_frame_size=1024)
    assert dec.feed(struct.pack(">i", 4096)[:2]) == []
    with pytest.raises(ProtocolError, match="exceeds maximum"):
        dec.feed(struct.pack(">i", 4096)[2:] + b"\x00" * 10)
    assert dec.failed and dec.buffered == 0

"""Property-based tests: decoders fed arbitrary or mutated input either succeed or raise
ProtocolError, never anything else; valid streams survive any chunking."""

from __future__ import annotations

import struct

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rmq_async.protocol import headers as h
from rmq_async.protocol.bodies import ResetOffsetBody, TopicRouteData
from rmq_async.protocol.codes import MSG_INNER_BATCH_FLAG, MSG_NEED_UNWRAP_FLAG, SerializeType
from rmq_async.protocol.command import FrameDecoder, RemotingCommand
from rmq_async.protocol.errors import ProtocolError
from rmq_async.protocol.jsonutil import fastjson_dumps, tolerant_loads
from rmq_async.protocol.message import (
    decode_messages,
    decode_properties,
    encode_properties,
    encode_stored_message,
)
from rmq_async.protocol.types import Message, MessageExt, MessageQueue

FUZZ = settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
# Generators of whole records and command streams are expensive; fewer examples keep the
# unit suite fast.
FUZZ_HEAVY = settings(FUZZ, max_examples=100)

texts = st.text(max_size=40)
ext_fields = st.dictionaries(st.text(min_size=1, max_size=12), st.text(min_size=1, max_size=20),
                             max_size=6)


@st.composite
def commands(draw: st.DrawFn) -> RemotingCommand:
    stype = draw(st.sampled_from([SerializeType.JSON, SerializeType.ROCKETMQ]))
    return RemotingCommand(
        code=draw(st.integers(-32768, 32767)),
        language=draw(st.integers(0, 13)),
        version=draw(st.integers(-32768, 32767)),
        opaque=draw(st.integers(-(2**31), 2**31 - 1)),
        flag=draw(st.integers(-(2**31), 2**31 - 1)),
        remark=draw(st.one_of(st.none(), st.text(min_size=1, max_size=30))),
        ext_fields=draw(st.one_of(st.none(), ext_fields)),
        body=draw(st.binary(max_size=200)),
        serialize_type=stype,
    )


def _normalised(cmd: RemotingCommand) -> RemotingCommand:
    # The ROCKETMQ header cannot carry an empty extFields map (Java reads it back as null).
    if cmd.serialize_type == SerializeType.ROCKETMQ and cmd.ext_fields == {}:
        cmd.ext_fields = None
    return cmd


def _feed_all(dec: FrameDecoder, data: bytes, cuts: list[int]) -> list[RemotingCommand]:
    out: list[RemotingCommand] = []
    prev = 0
    for cut in [*sorted(c % (len(data) + 1) for c in cuts), len(data)]:
        out.extend(dec.feed(data[prev:cut]))
        prev = cut
    return out


@FUZZ_HEAVY
@given(st.lists(commands(), min_size=1, max_size=5), st.lists(st.integers(0, 10**6), max_size=8))
def test_valid_stream_survives_any_chunking(cmds: list[RemotingCommand], cuts: list[int]) -> None:
    stream = b"".join(c.encode() for c in cmds)
    dec = FrameDecoder()
    assert _feed_all(dec, stream, cuts) == [_normalised(c) for c in cmds]
    assert dec.buffered == 0


@FUZZ
@given(st.binary(max_size=600), st.lists(st.integers(0, 10**6), max_size=6))
def test_arbitrary_bytes_never_crash_frame_decoder(data: bytes, cuts: list[int]) -> None:
    dec = FrameDecoder(max_frame_size=4096)
    try:
        _feed_all(dec, data, cuts)
    except ProtocolError:
        assert dec.failed and dec.buffered == 0
    assert dec.buffered <= 4096


@st.composite
def mutated(draw: st.DrawFn, data: bytes) -> bytes:
    buf = bytearray(data)
    for _ in range(draw(st.integers(1, 4))):
        op = draw(st.sampled_from(["flip", "truncate", "insert", "delete", "set"]))
        if not buf:
            break
        pos = draw(st.integers(0, len(buf) - 1))
        if op == "flip":
            buf[pos] ^= 1 << draw(st.integers(0, 7))
        elif op == "truncate":
            del buf[pos:]
        elif op == "insert":
            buf[pos:pos] = draw(st.binary(min_size=1, max_size=8))
        elif op == "delete":
            del buf[pos : pos + draw(st.integers(1, 8))]
        else:
            buf[pos] = draw(st.integers(0, 255))
    return bytes(buf)


@FUZZ_HEAVY
@given(st.data(), st.lists(commands(), min_size=1, max_size=3),
       st.lists(st.integers(0, 10**6), max_size=6))
def test_mutated_frames_give_commands_or_protocol_error(
    data: st.DataObject, cmds: list[RemotingCommand], cuts: list[int]
) -> None:
    stream = data.draw(mutated(b"".join(c.encode() for c in cmds)))
    dec = FrameDecoder(max_frame_size=1 << 16)
    try:
        for cmd in _feed_all(dec, stream, cuts):
            assert isinstance(cmd, RemotingCommand)
    except ProtocolError:
        pass
    assert dec.buffered <= 1 << 16


@FUZZ
@given(st.integers(min_value=1 << 16, max_value=2**31 - 1), st.binary(max_size=100))
def test_declared_length_over_max_rejected_before_buffering(length: int, tail: bytes) -> None:
    dec = FrameDecoder(max_frame_size=1 << 16)
    try:
        dec.feed(struct.pack(">i", length) + tail)
    except ProtocolError:
        assert dec.buffered == 0
    else:
        raise AssertionError("oversized frame accepted")


@FUZZ
@given(st.binary(max_size=300))
def test_arbitrary_frame_bodies_decode_or_protocol_error(frame: bytes) -> None:
    try:
        RemotingCommand.decode(frame)
    except ProtocolError:
        pass


# --------------------------------------------------------------------------------- messages


hosts = st.one_of(
    st.tuples(st.integers(0, 255), st.integers(0, 255), st.integers(0, 65535)).map(
        lambda t: f"10.{t[0]}.{t[1]}.1:{t[2]}"
    ),
    st.integers(0, 65535).map(lambda p: f"[2001:db8::1:{p:x}]:{p}"),
)
prop_names = st.text(alphabet=st.characters(blacklist_characters="\x00\x01\x02",
                                            blacklist_categories=["Cs"]), min_size=1, max_size=8)
prop_values = st.text(alphabet=st.characters(blacklist_characters="\x02",
                                             blacklist_categories=["Cs"]), min_size=1, max_size=12)


@st.composite
def stored(draw: st.DrawFn) -> MessageExt:
    return MessageExt(
        topic=draw(st.text(alphabet=st.characters(blacklist_categories=["Cs"]), min_size=1,
                           max_size=60)),
        body=draw(st.binary(max_size=300)),
        queue_id=draw(st.integers(-(2**31), 2**31 - 1)),
        queue_offset=draw(st.integers(0, 2**63 - 1)),
        flag=draw(st.integers(-(2**31), 2**31 - 1)),
        sys_flag=draw(st.sampled_from([0, 0x2, 0x4, 0x8])),
        properties=draw(st.dictionaries(prop_names, prop_values, max_size=5)),
        commit_log_offset=draw(st.integers(0, 2**63 - 1)),
        born_timestamp=draw(st.integers(0, 2**62)),
        born_host=draw(hosts),
        store_timestamp=draw(st.integers(0, 2**62)),
        store_host=draw(hosts),
        reconsume_times=draw(st.integers(0, 1000)),
        prepared_transaction_offset=draw(st.integers(0, 2**40)),
    )


@FUZZ_HEAVY
@given(st.lists(stored(), min_size=1, max_size=4), st.booleans())
def test_stored_messages_round_trip(msgs: list[MessageExt], compress: bool) -> None:
    data = b"".join(encode_stored_message(m, compress=compress) for m in msgs)
    back = decode_messages(data)
    assert len(back) == len(msgs)
    for m, b in zip(msgs, back, strict=True):
        assert (b.topic, b.body, b.properties, b.born_host, b.store_host, b.queue_offset,
                b.commit_log_offset, b.flag, b.queue_id) == (
            m.topic, m.body, m.properties, m.born_host, m.store_host, m.queue_offset,
            m.commit_log_offset, m.flag, m.queue_id)


@FUZZ_HEAVY
@given(st.data(), st.lists(stored(), min_size=1, max_size=3), st.booleans())
def test_mutated_message_records(data: st.DataObject, msgs: list[MessageExt], compress: bool) -> None:
    raw = data.draw(mutated(b"".join(encode_stored_message(m, compress=compress) for m in msgs)))
    try:
        for m in decode_messages(raw, max_body_size=1 << 20):
            assert isinstance(m, MessageExt)
    except ProtocolError:
        pass


@FUZZ
@given(st.data(), st.lists(st.binary(max_size=40), min_size=1, max_size=4))
def test_mutated_inner_batches(data: st.DataObject, bodies: list[bytes]) -> None:
    from rmq_async.protocol.message import encode_batch

    batch = encode_batch([Message("t", b, properties={"k": "v"}) for b in bodies])
    body = data.draw(st.one_of(st.just(batch), mutated(batch)))
    outer = MessageExt("t", body, sys_flag=MSG_INNER_BATCH_FLAG | MSG_NEED_UNWRAP_FLAG,
                       born_host="1.1.1.1:1", store_host="2.2.2.2:2")
    try:
        out = decode_messages(encode_stored_message(outer))
    except ProtocolError:
        assert body != batch
    else:
        if body == batch:
            assert [m.body for m in out] == bodies


@FUZZ
@given(st.binary(max_size=400))
def test_arbitrary_bytes_never_crash_message_decoder(data: bytes) -> None:
    try:
        decode_messages(data)
    except ProtocolError:
        pass


@FUZZ
@given(st.binary(min_size=8, max_size=200))
def test_arbitrary_record_tails_after_valid_magic(tail: bytes) -> None:
    head = struct.pack(">ii", 8 + len(tail), -626843481)
    try:
        decode_messages(head + tail)
    except ProtocolError:
        pass


@FUZZ
@given(st.dictionaries(prop_names, st.text(alphabet=st.characters(
    blacklist_characters="\x02", blacklist_categories=["Cs"]), max_size=12), max_size=8))
def test_properties_round_trip(props: dict[str, str]) -> None:
    assert decode_properties(encode_properties(props)) == {k: v for k, v in props.items() if v}


@FUZZ
@given(st.text(max_size=80))
def test_properties_decode_total(text: str) -> None:
    for key, value in decode_properties(text).items():
        assert key and value and "\x02" not in key + value and "\x01" not in key


# ------------------------------------------------------------------------------ JSON, headers


json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**63), 2**63) | st.text(max_size=10),
    lambda children: st.lists(children, max_size=4)
    | st.dictionaries(st.text(max_size=6), children, max_size=4),
    max_leaves=20,
)


@FUZZ
@given(json_values)
def test_fastjson_dumps_is_valid_json_for_string_keys(value: object) -> None:
    def strip_none(v: object) -> object:
        if isinstance(v, dict):
            return {k: strip_none(x) for k, x in v.items() if x is not None}
        if isinstance(v, list):
            return [strip_none(x) for x in v]
        return v

    assert tolerant_loads(fastjson_dumps(value)) == strip_none(value)


@FUZZ
@given(st.dictionaries(
    st.one_of(st.integers(-5, 5), st.builds(MessageQueue, texts, texts, st.integers(0, 9))),
    st.integers(), max_size=5))
def test_non_string_keys_round_trip(table: dict[object, int]) -> None:
    assert tolerant_loads(fastjson_dumps({"t": table})) == {"t": table}


@FUZZ
@given(st.text(max_size=120))
def test_tolerant_loads_total(text: str) -> None:
    try:
        tolerant_loads(text)
    except ProtocolError:
        pass


@FUZZ
@given(st.data())
def test_mutated_bodies_decode_or_protocol_error(data: st.DataObject) -> None:
    route = (b'{"brokerDatas":[{"brokerAddrs":{0:"10.0.0.1:10911"},"brokerName":"a",'
             b'"cluster":"c"}],"queueDatas":[{"brokerName":"a","perm":6,"readQueueNums":4,'
             b'"topicSysFlag":0,"writeQueueNums":4}]}')
    reset = b'{"offsetTable":{{"brokerName":"b","queueId":0,"topic":"t"}:1}}'
    for parse, original in ((TopicRouteData.from_json_bytes, route),
                            (ResetOffsetBody.from_json_bytes, reset)):
        try:
            parse(data.draw(mutated(original)))
        except ProtocolError:
            pass


@FUZZ
@given(st.sampled_from([
    h.PullMessageResponseHeader, h.ResetOffsetRequestHeader, h.SendMessageResponseHeader,
    h.ConsumeMessageDirectlyResultRequestHeader, h.GetConsumerRunningInfoRequestHeader,
]), st.dictionaries(st.sampled_from([
    "suggestWhichBrokerId", "nextBeginOffset", "minOffset", "maxOffset", "offsetDelta", "topic",
    "group", "timestamp", "isForce", "queueId", "offset", "msgId", "queueOffset",
    "consumerGroup", "clientId", "jstackEnable", "topicSysFlag"]), st.text(max_size=25)))
def test_header_parsing_total(cls: type[h.CommandHeader], ext: dict[str, str]) -> None:
    try:
        header = cls.from_ext_fields(ext)
    except ProtocolError:
        return
    assert cls.from_ext_fields(header.to_ext_fields()) == header

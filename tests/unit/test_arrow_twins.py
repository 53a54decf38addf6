"""The compiled columnar converter and the conversion from Python values build the same tables.

``messages_to_arrow`` hands a batch to the compiled converter (``message_columns``: one pass
over the messages' slots, the rest without the GIL, straight into Arrow buffers) and falls back
to building the columns from Python values when the converter declines. Both must give equal
tables (values and schema) for every batch, including messages whose raw properties are odd
(repeated names, bytes that are not UTF-8, empty names or values), messages whose properties
were read, set or replaced before, and assigned offset message ids; where the values path
raises, the compiled path must raise the same type of error.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import pyarrow as pa
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rmq_async.protocol import message
from rmq_async.protocol.message import decode_messages, encode_stored_message
from rmq_async.protocol.types import MessageExt
from rmq_async.sinks import _arrow

needs_compiled = pytest.mark.skipif(message.message_columns is None,
                                    reason="compiled codec not built or disabled")

TWINS = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])

hosts = st.sampled_from(["127.0.0.1:10911", "10.1.2.3:5555", "[2001:db8::1]:10911", ""])
texts = st.text(alphabet=st.characters(blacklist_categories=["Cs"]), max_size=12)
names = st.text(alphabet=st.characters(blacklist_characters="\x00\x01\x02",
                                       blacklist_categories=["Cs"]), min_size=1, max_size=8)
values = st.text(alphabet=st.characters(blacklist_characters="\x02",
                                        blacklist_categories=["Cs"]), min_size=1, max_size=12)
system = st.sampled_from(["TAGS", "KEYS", "UNIQ_KEY"])
key_texts = st.sampled_from(["a b", " a  b ", "k", " ", "x  ", "中 文", "a\tb"])
# Raw properties bytes as a broker could hold them: pairs in the stored format, with repeated
# names, empty parts, stray separators and bytes that are not UTF-8 mixed in.
raw_parts = st.one_of(
    st.tuples(st.one_of(system, names), st.one_of(values, key_texts)).map(
        lambda kv: f"{kv[0]}\x01{kv[1]}".encode()),
    st.sampled_from([b"", b"\x01", b"TAGS\x01", b"\x01v", b"a\x01b\x01c", b"TAGS\x01\xff\xfe",
                     b"K\x01\xe4\xb8", b"\xed\xa0\x80\x01v", b"KEYS\x01  ", b"UNIQ_KEY\x01"]),
)
raw_props = st.lists(raw_parts, max_size=8).flatmap(
    lambda parts: st.booleans().map(lambda trail: b"\x02".join(parts) + (b"\x02" if trail else b"")))


@st.composite
def messages(draw: st.DrawFn) -> MessageExt:
    props = draw(st.dictionaries(st.one_of(system, names), st.one_of(values, key_texts),
                                 max_size=5))
    stored = MessageExt(
        topic=draw(st.text(alphabet=st.characters(blacklist_categories=["Cs"]), min_size=1,
                           max_size=20)),
        body=draw(st.binary(max_size=64)),
        queue_id=draw(st.integers(-(2**31), 2**31 - 1)),
        queue_offset=draw(st.integers(-(2**63), 2**63 - 1)),
        properties=props,
        commit_log_offset=draw(st.integers(-(2**63), 2**63 - 1)),
        born_timestamp=draw(st.integers(-(2**40), 2**40)),
        born_host=draw(hosts.filter(bool)),
        store_timestamp=draw(st.integers(-(2**40), 2**40)),
        store_host=draw(hosts.filter(bool)),
        reconsume_times=draw(st.integers(-(2**31), 2**31 - 1)),
    )
    (msg,) = decode_messages(encode_stored_message(stored))
    msg.broker_name = draw(st.sampled_from(["broker-a", "b", "中"]))
    # What a consumer or a user may have done to the message before it reached the sink.
    change = draw(st.sampled_from(["none", "raw", "read", "put", "raw+put", "replace", "oid",
                                     "retopic", "stamp", "stamp+put"]))
    if change == "raw":
        msg._props_raw = draw(raw_props)
    elif change == "read":
        msg.properties  # noqa: B018 - parses and caches the properties
    elif change == "put":
        for _ in range(draw(st.integers(1, 3))):
            msg.put_property(draw(st.one_of(system, names)),
                             draw(st.one_of(values, st.just(""))))
    elif change == "raw+put":
        msg._props_raw = draw(raw_props)
        msg.put_properties({"MIN_OFFSET": "0", draw(st.one_of(system, names)): draw(values)})
    elif change in ("stamp", "stamp+put"):
        message.stamp_delivered([msg], msg.broker_name,
                                {"MIN_OFFSET": "0", draw(st.one_of(system, names)): draw(values)})
        if change == "stamp+put":
            msg.put_property(draw(st.one_of(system, names)), draw(values))
    elif change == "replace":
        msg.properties = draw(st.dictionaries(st.one_of(system, names),
                                              st.one_of(values, st.just("")), max_size=3))
    elif change == "oid":
        msg.offset_msg_id = draw(texts)
    elif change == "retopic":
        msg.topic = draw(texts)
    return msg


def _outcome(convert: Any, msgs: list[MessageExt]) -> tuple[str, Any]:
    try:
        table = convert(msgs)
    except Exception as exc:  # the type is compared, both paths must fail alike
        return ("error", type(exc))
    table.validate(full=True)
    return ("ok", table)


def _same(msgs: list[MessageExt]) -> None:
    compiled = _outcome(_arrow._convert, msgs)
    values = _outcome(_arrow._convert_values, msgs)
    assert compiled[0] == values[0], (compiled, values)
    if compiled[0] == "ok":
        assert compiled[1].schema == values[1].schema == _arrow.ARROW_SCHEMA
        assert compiled[1].equals(values[1]), (compiled[1].to_pylist(), values[1].to_pylist())
    else:
        assert compiled[1] is values[1]


@needs_compiled
@TWINS
@given(st.lists(messages(), max_size=12))
def test_compiled_columns_equal_the_values_path(msgs: list[MessageExt]) -> None:
    _same(msgs)


@needs_compiled
def test_columns_of_a_typical_batch_without_fallback(monkeypatch: pytest.MonkeyPatch) -> None:
    # A batch as the consumer hands it over takes the compiled path (no fallback).
    stored = [
        MessageExt(topic="orders", body=bytes([i % 251]) * 300, queue_id=i % 4, queue_offset=i,
                   properties={"UNIQ_KEY": f"{i:032X}", "TAGS": "created", "KEYS": f"k{i} o",
                               "WAIT": "true"},
                   commit_log_offset=i * 400, born_host="127.0.0.1:1", store_host="10.0.0.1:2")
        for i in range(500)
    ]
    msgs = [m for s in stored for m in decode_messages(encode_stored_message(s))]
    # As the pull loop does: the values wait, one dict shared by the chunk.
    message.stamp_delivered(msgs, "broker-a", {"MIN_OFFSET": "0", "MAX_OFFSET": "500"})
    assert msgs[0]._props_pending is msgs[-1]._props_pending
    monkeypatch.setattr(_arrow, "_convert_values", _refuse)
    table = _arrow.messages_to_arrow(msgs, chunk_rows=128)
    monkeypatch.undo()
    # Read straight from the raw bytes and the pending values: nothing was parsed in Python.
    assert all(m._props is None for m in msgs)
    assert table.equals(_arrow._convert_values(msgs))
    assert table.column("msg_id")[7].as_py() == f"{7:032X}"
    assert table.column("keys")[7].as_py() == ["k7", "o"]
    assert table.column("offset_msg_id")[7].as_py() == msgs[7].offset_msg_id
    assert dict(table.column("properties")[7].as_py())["MAX_OFFSET"] == "500"


@needs_compiled
def test_repeated_property_names_are_resolved_without_python() -> None:
    # The broker stores WAIT twice in each message of a batch: the compiled pass keeps the
    # dict's rule (first place, last value) itself instead of parsing a dict per message.
    convert = message.message_columns
    assert convert is not None
    msgs = [m for i in range(20) for m in decode_messages(encode_stored_message(
        MessageExt(topic="orders", body=b"b", queue_offset=i, properties={"TAGS": "t"},
                   born_host="127.0.0.1:1", store_host="10.0.0.1:2")))]
    for m in msgs:
        m._props_raw = b"UNIQ_KEY\x01U1\x02WAIT\x01true\x02TAGS\x01t\x02WAIT\x01no\x02"
    message.stamp_delivered(msgs, "broker-a", {"MIN_OFFSET": "0", "WAIT": "later"})
    buffers = convert(msgs)
    assert buffers is not None and buffers["python_rows"] == 0
    table = _arrow.messages_to_arrow(msgs)
    assert table.equals(_arrow._convert_values(msgs))
    assert table.column("properties")[0].as_py() == \
        [("UNIQ_KEY", "U1"), ("WAIT", "later"), ("TAGS", "t"), ("MIN_OFFSET", "0")]


def _refuse(msgs: Any) -> pa.Table:
    raise AssertionError("the compiled converter declined a plain batch")


@needs_compiled
def test_converter_declines_what_it_does_not_take() -> None:
    assert message.message_columns is not None
    (msg,) = decode_messages(encode_stored_message(
        MessageExt(topic="t", body=b"x", born_host="1.2.3.4:5", store_host="1.2.3.4:6")))
    weird: list[Any] = [msg, object()]
    assert message.message_columns(weird) is None
    msg.queue_id = 2**40  # does not fit the int32 column
    assert message.message_columns([msg]) is None
    msg.queue_id = 1
    msg.body = bytearray(b"x")  # type: ignore[assignment]
    assert message.message_columns([msg]) is None


@needs_compiled
def test_conversion_lets_other_threads_run() -> None:
    # The copying passes run without the GIL: a Python thread keeps counting meanwhile, at a
    # good part of the rate it counts when left alone (with the GIL held it would stand still).
    (one,) = decode_messages(encode_stored_message(
        MessageExt(topic="t", body=b"\x00" * 65536, properties={"TAGS": "a"},
                   born_host="1.2.3.4:5", store_host="1.2.3.4:6")))
    msgs = [one] * 3000  # 190 MiB of bodies to copy
    convert = message.message_columns
    assert convert is not None
    convert(msgs)  # first touch of the memory
    ticks = 0
    stop = threading.Event()

    def count() -> None:
        nonlocal ticks
        while not stop.is_set():
            ticks += 1

    thread = threading.Thread(target=count)
    thread.start()
    try:
        start, t0 = ticks, time.perf_counter()
        time.sleep(0.05)
        alone = (ticks - start) / (time.perf_counter() - t0)
        start, t0 = ticks, time.perf_counter()
        convert(msgs)
        seconds = time.perf_counter() - t0
        during = ticks - start
    finally:
        stop.set()
        thread.join()
    assert during > 0.1 * alone * seconds, (during, alone, seconds)

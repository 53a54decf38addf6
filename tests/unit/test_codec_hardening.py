"""The compiled codec under inputs that no well-behaved caller or broker gives.

Each case once crashed the process, read outside a buffer, or answered otherwise than the pure
twin: a record with thousands of property pairs (converted in time quadratic in the pairs,
holding the GIL), a JSON header integer longer than Python's limit (decoded where json.loads
refuses it), a list changed while it was being stamped, and ``record_columns`` given bodies or
a row count it had not been promised. The crash cases run in a child process, so a crash is a
failed test, not a lost worker.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from rmq_async.protocol import message
from rmq_async.protocol.command import _decode_json_header_py
from rmq_async.protocol.errors import ProtocolError
from rmq_async.protocol.message import decode_messages, encode_stored_message
from rmq_async.protocol.types import MessageExt
from rmq_async.sinks import _arrow

try:
    from rmq_async.protocol import _cmessage
except ImportError:  # pragma: no cover - the extension is built by `make setup`
    _cmessage = None  # type: ignore[assignment]

needs_compiled = pytest.mark.skipif(message.record_columns is None or _cmessage is None,
                                    reason="compiled codec not built or disabled")


def stored(offset: int, props: dict[str, str], body: bytes = b"payload") -> bytes:
    return encode_stored_message(MessageExt(
        topic="orders", body=body, queue_id=1, queue_offset=offset, properties=props,
        born_host="127.0.0.1:5000", store_host="10.0.0.1:10911"))


def many_pairs(offset: int, n: int) -> dict[str, str]:
    return {"UNIQ_KEY": f"U{offset}", "TAGS": "t", **{f"p{i}": str(i) for i in range(n)}}


@needs_compiled
def test_a_record_with_thousands_of_properties_converts_like_the_values_path() -> None:
    # The most pairs a record's 32 KiB properties field holds are about 5,000; the compiled
    # conversion appended each pair after looking for its name among the earlier ones.
    data = b"".join(stored(o, many_pairs(o, 3_000)) for o in range(4))
    msgs = decode_messages(data)
    for m in msgs:
        m.broker_name = "broker-a"
    table = _arrow._convert(msgs)
    assert table.equals(_arrow._convert_values(msgs))
    assert len(table.column("properties")[0].as_py()) == 3_002
    assert message.record_columns is not None
    assert message.record_columns([(data, "broker-a", None)], 4) is not None


@needs_compiled
def test_a_json_integer_past_pythons_digit_limit_is_refused_by_both_readers() -> None:
    raw = b'{"code":0,"flag":1,"opaque":7,"x":' + b"1" * 5_000 + b',"version":1}'
    with pytest.raises(ProtocolError):
        _decode_json_header_py(raw)
    assert _cmessage.json_header(raw) is None  # left to json.loads, which words the error
    short = b'{"code":0,"x":' + b"1" * 640 + b"}"  # the lowest limit a process may set
    assert _cmessage.json_header(short) is not None


@needs_compiled
def test_record_columns_refuses_bodies_and_counts_it_was_not_promised() -> None:
    assert message.record_columns is not None
    good = stored(0, {"A": "b"})
    assert message.record_columns([(good, "b", None)], 1) is not None
    bad = bytearray(good)
    bad[84:88] = (0x10000000).to_bytes(4, "big")  # a 256 MiB body in a short record
    assert message.record_columns([(bytes(bad), "b", None)], 1) is None
    cut = good[:-3]  # the properties end past the record
    assert message.record_columns([(cut, "b", None)], 1) is None
    for rows in (-1, 2**61, 2**62):  # 2**61 rows of 216 bytes wrapped to a tiny allocation
        assert message.record_columns([(good, "b", None)], rows) is None


def _child(code: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True,
                          text=True, timeout=120, check=False)


@needs_compiled
def test_stamping_a_list_its_items_empty_does_not_crash() -> None:
    # A MessageExt subclass runs its own put_properties, which may change the list; the
    # compiled loop kept the length it read first and read past the list's end.
    proc = _child("""
        from rmq_async.protocol import message
        from rmq_async.protocol.types import MessageExt

        class Odd(MessageExt):
            pass

        msgs = []

        class Clearing(MessageExt):
            def put_properties(self, values):
                msgs.clear()

        msgs.extend([Clearing(topic="t", body=b"x")] + [Odd(topic="t", body=b"y")] * 100_000)
        message.stamp_delivered(msgs, "broker-a", {"MIN_OFFSET": "0"})
        msgs.extend([Clearing(topic="t", body=b"x")] + [Odd(topic="t", body=b"y")] * 100_000)
        message.put_each(msgs, {"MIN_OFFSET": "0"})
        print("ok", len(msgs))
    """)
    assert proc.returncode == 0, (proc.returncode, proc.stderr[-2000:])
    assert proc.stdout.split() == ["ok", "0"]


@needs_compiled
def test_an_allocator_buffer_too_short_for_the_bodies_is_refused() -> None:
    # A bytearray from ``alloc`` was written without its size checked (a heap overrun).
    assert message.record_columns is not None
    data = b"".join(stored(i, {"A": "b"}, b"x" * 100) for i in range(4))
    for short in (bytearray(399), memoryview(bytearray(399))):
        with pytest.raises(ValueError, match="399 bytes for 400"):
            message.record_columns([(data, "b", None)], 4, lambda size, s=short: s)
    out = message.record_columns([(data, "b", None)], 4, bytearray)
    assert out is not None and bytes(out["body"][1]) == b"x" * 400


@needs_compiled
def test_an_allocator_buffer_cannot_be_resized_while_the_bodies_are_written() -> None:
    # The fill writes the bodies without the GIL; the buffer's view was released before it,
    # so another thread could shrink (free) a bytearray the allocator kept: a write into
    # freed memory. The view is now held until the fill ends (a resize meanwhile raises
    # BufferError in that thread).
    proc = _child("""
        import threading
        from rmq_async.protocol import message
        from rmq_async.protocol.message import encode_stored_message
        from rmq_async.protocol.types import MessageExt

        held = []
        def alloc(size):
            held.append(bytearray(size))
            return held[-1]
        data = b"".join(encode_stored_message(MessageExt(
            topic="t", body=b"A" * 200_000, queue_offset=i, born_host="1.2.3.4:5",
            store_host="5.6.7.8:9")) for i in range(100))
        stop = False
        refused = 0
        def shrink():
            global refused
            while not stop:
                if held:
                    try:
                        del held[-1][:]
                    except BufferError:
                        refused += 1
        t = threading.Thread(target=shrink)
        t.start()
        try:
            for _ in range(20):
                assert message.record_columns([(data, "b", None)], 100, alloc) is not None
        finally:
            stop = True
            t.join()
        print("ok", refused)
    """)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.startswith("ok")


class _Name(str):
    pass


def test_a_str_subclass_or_str_enum_reads_a_property_on_both_paths() -> None:
    # The compiled finder and parser took only exact str: a StrEnum member as a property name
    # raised TypeError where the pure path answered. (Run on both paths.)
    import enum

    class Prop(enum.StrEnum):
        TRACE = "TRACE_ID"

    class OldProp(str, enum.Enum):  # noqa: UP042 - the older spelling, on purpose
        TRACE = "TRACE_ID"

    raw = stored(0, {"TRACE_ID": "abc", "K": "v"})
    for name in (Prop.TRACE, OldProp.TRACE, _Name("TRACE_ID"), "TRACE_ID"):
        msg = decode_messages(raw)[0]
        assert msg.get_property(name) == "abc", name
        assert msg.get_property(_Name("missing"), "d") == "d"
    assert message.decode_properties(_Name("a\x01b\x02c\x01d")) == {"a": "b", "c": "d"}
    assert type(next(iter(message.decode_properties(_Name("a\x01b"))))) is str


def test_stamping_keeps_a_properties_mapping_of_the_users_own_type() -> None:
    # put_each wrote into the properties with PyDict_Update: an OrderedDict's order links were
    # bypassed (a corrupted OrderedDict), a UserDict raised SystemError. (Both paths.)
    import collections

    for kind in (collections.OrderedDict, collections.UserDict):
        msgs = decode_messages(stored(0, {"A": "1"}) + stored(1, {"B": "2"}))
        for m in msgs:
            m.properties = kind(m.properties)  # type: ignore[assignment]
        message.stamp_delivered(msgs, _Name("broker-a"), {"CONSUME_START_TIME": "9"})
        message.put_each(msgs, {"X": "y"})
        for m, first in zip(msgs, ("A", "B"), strict=True):
            assert type(m.properties) is kind
            assert list(m.properties.items()) == [
                (first, m.properties[first]), ("CONSUME_START_TIME", "9"), ("X", "y")]
        assert msgs[0].broker_name == "broker-a"


@needs_compiled
def test_the_compiled_json_reader_leaves_long_integers_to_json_loads_at_any_digit_limit(
) -> None:
    # The compiled reader took integers up to Python's default limit (4300 digits); a process
    # that lowered the limit had json.loads refuse what the compiled reader accepted.
    saved = sys.get_int_max_str_digits()
    sys.set_int_max_str_digits(640)
    try:
        for digits in (640, 641, 1000):
            raw = b'{"code":1,"x":' + b"7" * digits + b"}"
            fast = _cmessage.json_header(raw)
            try:
                _decode_json_header_py(raw)
            except ProtocolError:
                assert fast is None, digits
            else:
                assert digits <= 640
    finally:
        sys.set_int_max_str_digits(saved)
    assert _cmessage.json_header(b'{"code":1,"x":' + b"7" * 641 + b"}") is None

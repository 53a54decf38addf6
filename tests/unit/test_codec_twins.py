"""The compiled stored-record decoder and its pure-Python twin agree on every input.

Both record loops get the same bytes, valid or corrupt; they must produce messages equal in every
field (lazy ones included, and the raw state they are computed from) or raise ProtocolError
with the same message. The property parsers are compared the same way. Which implementation a
process uses is checked too (``RMQ_ASYNC_NO_EXTENSIONS``, missing extension).
"""

from __future__ import annotations

import dataclasses
import os
import pickle
import subprocess
import sys
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rmq_async.protocol import message, types
from rmq_async.protocol.codes import (
    COMPRESSION_ZLIB,
    MSG_COMPRESSED_FLAG,
    MSG_INNER_BATCH_FLAG,
    MSG_NEED_UNWRAP_FLAG,
)
from rmq_async.protocol.errors import ProtocolError
from rmq_async.protocol.message import MAGIC_V1, MAGIC_V2, encode_batch, encode_stored_message
from rmq_async.protocol.types import Message, MessageExt

try:
    from rmq_async.protocol import _cmessage
except ImportError:  # pragma: no cover - the extension is built by `make setup`
    _cmessage = None  # type: ignore[assignment]

needs_compiled = pytest.mark.skipif(_cmessage is None, reason="compiled codec not built")

TWINS = settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
TWINS_HEAVY = settings(TWINS, max_examples=100)

Loop = Callable[[bytes, list[MessageExt], bool, bool, int, int], None]


def _loops() -> tuple[Loop, Loop]:
    assert _cmessage is not None
    # The compiled loop borrows decompression and IPv6 formatting from the pure module; install
    # them even when this process runs the pure implementation.
    _cmessage.install(message._decompress, message._host6)
    return message._decode_records, _cmessage.decode_records


def _state(m: MessageExt, parse: Callable[[bytes], dict[str, str]]) -> dict[str, Any]:
    """Every field of ``m``; properties parsed with ``parse`` from the raw bytes kept."""
    raw = m._props_raw
    assert m._props is None and raw is not None
    props = parse(raw)
    out: dict[str, Any] = {"_props_raw": raw, "_properties_items": list(props.items())}
    for f in dataclasses.fields(m):
        out[f.name] = getattr(m, f.name)
    out["properties_items"] = list(out["properties"].items())
    out["msg_id"] = m.msg_id
    out["tags"] = m.tags
    out["keys"] = m.keys
    return out


def _outcome(fn: Callable[[], list[MessageExt]],
             parse: Callable[[bytes], dict[str, str]]) -> tuple[str, Any]:
    try:
        msgs = fn()
    except ProtocolError as exc:
        return ("error", str(exc))
    return ("ok", [_state(m, parse) for m in msgs])


def check_twins(data: bytes | bytearray | memoryview, *, decompress: bool = True,
                unwrap_batch: bool = True,
                max_body_size: int = message.DEFAULT_MAX_BODY_SIZE) -> tuple[str, Any]:
    """Decode ``data`` with both loops (all messages, and as one record); require equal results."""
    py_loop, c_loop = _loops()
    assert _cmessage is not None
    py = _outcome(lambda: message._decode_messages(py_loop, data, decompress, unwrap_batch,
                                                   max_body_size), types._parse_raw_properties)
    c = _outcome(lambda: message._decode_messages(c_loop, data, decompress, unwrap_batch,
                                                  max_body_size), _cmessage.parse_raw_properties)
    assert c == py
    py1 = _outcome(lambda: [message._decode_message(py_loop, data, decompress, max_body_size)],
                   types._parse_raw_properties)
    c1 = _outcome(lambda: [message._decode_message(c_loop, data, decompress, max_body_size)],
                  _cmessage.parse_raw_properties)
    assert c1 == py1
    return py


# ------------------------------------------------------------------------------ generators

ipv4_hosts = st.tuples(st.integers(0, 255), st.integers(0, 255), st.integers(0, 255),
                       st.integers(0, 255), st.integers(0, 65535)).map(
    lambda t: f"{t[0]}.{t[1]}.{t[2]}.{t[3]}:{t[4]}")
ipv6_hosts = st.sampled_from(["2001:db8::1", "::1", "fe80::abcd:0:0:1", "::", "1:2:3:4:5:6:7:8",
                              "::ffff:10.0.0.1", "2001:db8:0:0:1::"]).flatmap(
    lambda a: st.integers(0, 65535).map(lambda p: f"[{a}]:{p}"))
hosts = st.one_of(ipv4_hosts, ipv6_hosts)
unicode_text = st.text(alphabet=st.characters(blacklist_categories=["Cs"]), min_size=1,
                       max_size=40)
prop_names = st.text(alphabet=st.characters(blacklist_characters="\x00\x01\x02",
                                            blacklist_categories=["Cs"]), min_size=1, max_size=10)
prop_values = st.text(alphabet=st.characters(blacklist_characters="\x02",
                                             blacklist_categories=["Cs"]), min_size=1, max_size=16)
bodies = st.one_of(st.binary(max_size=200),
                   st.sampled_from([0, 1, 1024, 70_000]).map(lambda n: bytes(range(256)) * (n // 256)
                                                             + bytes(n % 256)))


@st.composite
def stored(draw: st.DrawFn) -> MessageExt:
    props = draw(st.dictionaries(prop_names, prop_values, max_size=6))
    if draw(st.booleans()):
        props["UNIQ_KEY"] = draw(st.text(alphabet="0123456789ABCDEF", min_size=1, max_size=32))
    if draw(st.booleans()):
        props["KEYS"] = draw(st.sampled_from(["a b", " a  b ", "k", ""])) or "x"
    return MessageExt(
        topic=draw(unicode_text),
        body=draw(bodies),
        queue_id=draw(st.integers(-(2**31), 2**31 - 1)),
        queue_offset=draw(st.integers(-(2**63), 2**63 - 1)),
        flag=draw(st.integers(-(2**31), 2**31 - 1)),
        sys_flag=draw(st.sampled_from([0, 0x2, 0x4, 0x8, 0x40, 0x80])),
        properties=props,
        commit_log_offset=draw(st.integers(-(2**63), 2**63 - 1)),
        born_timestamp=draw(st.integers(-(2**63), 2**63 - 1)),
        born_host=draw(hosts),
        store_timestamp=draw(st.integers(-(2**63), 2**63 - 1)),
        store_host=draw(hosts),
        reconsume_times=draw(st.integers(-(2**31), 2**31 - 1)),
        prepared_transaction_offset=draw(st.integers(-(2**63), 2**63 - 1)),
    )


@st.composite
def records(draw: st.DrawFn) -> bytes:
    """One stored record: plain, v2 magic, zlib-compressed, or an inner batch."""
    kind = draw(st.sampled_from(["plain", "v2", "zlib", "batch", "zlib-batch"]))
    msg = draw(stored())
    if kind in ("batch", "zlib-batch"):
        items = draw(st.lists(st.tuples(st.binary(max_size=60), st.integers(-(2**31), 2**31 - 1),
                                        st.dictionaries(prop_names, prop_values, max_size=3)),
                              min_size=0, max_size=4))
        msg.body = encode_batch([Message("t", b, flag=f, properties=p) for b, f, p in items])
        msg.sys_flag |= MSG_INNER_BATCH_FLAG | MSG_NEED_UNWRAP_FLAG
    topic_len = len(msg.topic.encode())
    magic = MAGIC_V2 if kind == "v2" or topic_len > 127 else MAGIC_V1
    return encode_stored_message(msg, magic=magic, compress=kind.startswith("zlib"))


@st.composite
def mutated(draw: st.DrawFn, data: bytes) -> bytes:
    out = bytearray(data)
    for _ in range(draw(st.integers(1, 4))):
        if not out:
            break
        op = draw(st.sampled_from(["flip", "set", "cut", "insert", "delete"]))
        i = draw(st.integers(0, len(out) - 1))
        if op == "flip":
            out[i] ^= 1 << draw(st.integers(0, 7))
        elif op == "set":
            out[i] = draw(st.sampled_from([0x00, 0x7F, 0x80, 0xFF, 0x01, 0x02]))
        elif op == "cut":
            del out[i:]
        elif op == "insert":
            out[i:i] = draw(st.binary(min_size=1, max_size=8))
        else:
            del out[i : i + draw(st.integers(1, 8))]
    return bytes(out)


# ------------------------------------------------------------------------------ valid input


@needs_compiled
@TWINS_HEAVY
@given(st.lists(records(), min_size=1, max_size=4))
def test_valid_records_decode_alike(recs: list[bytes]) -> None:
    kind, _ = check_twins(b"".join(recs))
    assert kind == "ok"


@needs_compiled
@TWINS
@given(records(), st.booleans(), st.booleans(), st.sampled_from([0, 10, 1 << 20]))
def test_options_decode_alike(rec: bytes, decompress: bool, unwrap: bool, limit: int) -> None:
    check_twins(rec, decompress=decompress, unwrap_batch=unwrap, max_body_size=limit)


@needs_compiled
def test_java_style_records_decode_alike() -> None:
    msg = MessageExt(topic="TopicTest", body=b"hello world", queue_id=3, flag=7,
                     queue_offset=1234, commit_log_offset=987654321,
                     born_timestamp=1700000000123, born_host="10.0.0.5:40001",
                     store_timestamp=1700000000456, store_host="192.168.1.20:10911",
                     reconsume_times=2,
                     properties={"k1": "v1", "TAGS": "TagA", "KEYS": "key1 key2",
                                 "UNIQ_KEY": "0A000005109C18B4AAC2754A8D0F0000", "é": "ü ✓"})
    kind, [state] = check_twins(encode_stored_message(msg))
    assert kind == "ok"
    assert state["offset_msg_id"] == "C0A8011400002A9F000000003ADE68B1"
    assert state["properties"] == msg.properties


# ------------------------------------------------------------------------------ corrupt input


def _sample_records() -> list[bytes]:
    base = MessageExt(topic="T", body=b"body" * 5, born_host="1.2.3.4:5",
                      store_host="[2001:db8::1]:10911", properties={"TAGS": "a", "ü": "ß"})
    batch = dataclasses.replace(
        base, body=encode_batch([Message("t", b"x", properties={"k": "v"}),
                                 Message("t", b"yy", tags="T")]),
        sys_flag=MSG_INNER_BATCH_FLAG | MSG_NEED_UNWRAP_FLAG, store_host="9.9.9.9:1")
    return [
        encode_stored_message(base),
        encode_stored_message(base, magic=MAGIC_V2),
        encode_stored_message(dataclasses.replace(base, born_host="[::1]:1",
                                                  store_host="5.6.7.8:9"), compress=True),
        encode_stored_message(batch),
    ]


@needs_compiled
def test_every_truncation_fails_alike() -> None:
    for rec in _sample_records():
        for cut in range(len(rec) + 1):
            check_twins(rec[:cut])
            check_twins(rec + rec[:cut])


@needs_compiled
def test_every_single_byte_corruption_fails_alike() -> None:
    for rec in _sample_records():
        for i in range(len(rec)):
            for value in (0x00, 0x80, 0xFF, rec[i] ^ 0x01):
                check_twins(rec[:i] + bytes((value,)) + rec[i + 1 :])


@needs_compiled
@TWINS_HEAVY
@given(st.data(), st.lists(records(), min_size=1, max_size=3))
def test_mutated_records_fail_alike(data: st.DataObject, recs: list[bytes]) -> None:
    check_twins(data.draw(mutated(b"".join(recs))), max_body_size=1 << 20)


@needs_compiled
@TWINS
@given(st.data(), st.lists(st.binary(max_size=40), min_size=1, max_size=4), st.booleans())
def test_mutated_inner_batches_fail_alike(data: st.DataObject, parts: list[bytes],
                                          compress: bool) -> None:
    batch = encode_batch([Message("t", b, properties={"k": "v"}) for b in parts])
    body = data.draw(st.one_of(st.just(batch), mutated(batch)))
    outer = MessageExt("t", body, sys_flag=MSG_INNER_BATCH_FLAG | MSG_NEED_UNWRAP_FLAG,
                       born_host="1.1.1.1:1", store_host="[::2]:2")
    check_twins(encode_stored_message(outer, compress=compress))


@needs_compiled
@TWINS
@given(st.binary(max_size=400))
def test_random_bytes_fail_alike(data: bytes) -> None:
    check_twins(data)


@needs_compiled
@TWINS
@given(st.binary(min_size=0, max_size=200), st.sampled_from([MAGIC_V1, MAGIC_V2, 0, -1]),
       st.integers(-(2**31), 2**31 - 1))
def test_random_record_tails_fail_alike(tail: bytes, magic: int, sys_flag: int) -> None:
    head = (8 + 28 + 4 + len(tail)).to_bytes(4, "big") + magic.to_bytes(4, "big", signed=True)
    middle = bytes(28) + sys_flag.to_bytes(4, "big", signed=True)
    check_twins(head + middle + tail)


@needs_compiled
def test_bad_compressed_bodies_fail_alike() -> None:
    msg = MessageExt(topic="t", body=b"x" * 100, born_host="1.1.1.1:1", store_host="2.2.2.2:2")
    flag = MSG_COMPRESSED_FLAG | (COMPRESSION_ZLIB << 8)
    for body in (b"", b"garbage", zlib.compress(b"x" * 100)[:-3], zlib.compress(b"y" * 5000)):
        for ctype_flag in (flag, MSG_COMPRESSED_FLAG, MSG_COMPRESSED_FLAG | (7 << 8)):
            rec = encode_stored_message(dataclasses.replace(msg, body=body, sys_flag=ctype_flag))
            check_twins(rec, max_body_size=1000)


# ------------------------------------------------------------------------------ properties

prop_text = st.text(alphabet=st.sampled_from(["\x01", "\x02", "a", "b", "é", "✓", "𝄞", " "]),
                    max_size=40)


@needs_compiled
@TWINS
@given(prop_text)
def test_decode_properties_alike(text: str) -> None:
    assert _cmessage is not None
    py = message._py_decode_properties(text)
    c = _cmessage.decode_properties(text)
    assert list(c.items()) == list(py.items())


@needs_compiled
@TWINS
@given(st.lists(st.sampled_from([b"\x01", b"\x02", b"a", b"\xc3\xa9", b"\xc3", b"\xe2\x82",
                                 b"\xff", b"\xf0\x9d\x84\x9e", b"\xed\xa0\x80"]), max_size=30))
def test_parse_raw_properties_alike(parts: list[bytes]) -> None:
    assert _cmessage is not None
    raw = b"".join(parts)
    py = types._parse_raw_properties(raw)
    c = _cmessage.parse_raw_properties(raw)
    assert list(c.items()) == list(py.items())
    assert py == message._py_decode_properties(raw.decode("utf-8", "replace"))


@needs_compiled
@TWINS
@given(st.lists(st.sampled_from([b"\x01", b"\x02", b"a", b"TAGS", b"\xc3\xa9", b"\xc3", b"\xff",
                                 b"\xf0\x9d\x84\x9e", b"\xef\xbf\xbd"]), max_size=30),
       st.sampled_from(["a", "aa", "TAGS", "é", "\ufffd", "𝄞", "a\ufffd", "", "\x01"]))
def test_find_raw_property_matches_parse(parts: list[bytes], name: str) -> None:
    assert _cmessage is not None
    raw = b"".join(parts)
    assert _cmessage.find_raw_property(raw, name) == types._parse_raw_properties(raw).get(name)


# ------------------------------------------------------------------------------ lazy fields


@needs_compiled
def test_compiled_accessors_read_single_properties_without_parsing() -> None:
    assert _cmessage is not None
    msg = MessageExt(topic="T", body=b"b", born_host="1.2.3.4:5", store_host="10.0.0.1:1",
                     properties={"TAGS": "x", "KEYS": "a b", "UNIQ_KEY": "U"})
    [m] = message._decode_messages(_loops()[1], encode_stored_message(msg), True, True, 1 << 20)
    saved = (types._properties_parser, types._property_finder)
    types.set_properties_parser(_cmessage.parse_raw_properties, _cmessage.find_raw_property)
    try:
        assert (m.tags, m.keys, m.msg_id, m.get_property("nope", "d")) == ("x", ["a", "b"], "U", "d")
        assert m._props is None
        assert m.properties == msg.properties
    finally:
        types.set_properties_parser(*saved)


def test_lazy_fields_behave_as_plain_fields() -> None:
    msg = MessageExt(topic="T", body=b"b", commit_log_offset=42, born_host="1.2.3.4:5",
                     store_host="10.0.0.1:10911", properties={"TAGS": "x", "KEYS": "a  b"})
    [m] = message.decode_messages(encode_stored_message(msg))
    assert m._props is None and m._oid is None  # nothing parsed or formatted yet
    _ = m.body
    assert m._props is None
    m.put_property("MAX_OFFSET", "9")
    m.put_properties({"MIN_OFFSET": "1", "TAGS": "y"})
    assert m.get_property("MAX_OFFSET") == "9"
    assert m._props is None  # still not parsed
    assert m.properties == {"TAGS": "y", "KEYS": "a  b", "MAX_OFFSET": "9", "MIN_OFFSET": "1"}
    assert list(m.properties) == ["TAGS", "KEYS", "MAX_OFFSET", "MIN_OFFSET"]
    assert m.keys == ["a", "b"] and m.tags == "y"
    assert m.offset_msg_id == "0A00000100002A9F000000000000002A" == m.msg_id
    m.properties["X"] = "1"
    assert m.get_property("X") == "1"
    m.properties = {"UNIQ_KEY": "U"}
    assert m.msg_id == "U"
    m.offset_msg_id = "O"
    assert m.offset_msg_id == "O"
    copy = dataclasses.replace(m, topic="T2")
    assert (copy.topic, copy.properties, copy.offset_msg_id) == ("T2", {"UNIQ_KEY": "U"}, "O")
    assert dataclasses.asdict(m)["properties"] == {"UNIQ_KEY": "U"}


def test_assigning_none_reads_back_none() -> None:
    # Not what the types say, but what a plain field did.
    [m] = message.decode_messages(encode_stored_message(
        MessageExt(topic="T", body=b"", born_host="1.1.1.1:1", store_host="2.2.2.2:2")))
    m.properties = None  # type: ignore[assignment]
    m.offset_msg_id = None  # type: ignore[assignment]
    assert m.properties is None and m.offset_msg_id is None


@needs_compiled
def test_bytes_like_inputs_decode_alike() -> None:
    class Bytes(bytes):
        pass

    rec = _sample_records()[0]
    for data in (Bytes(rec), bytearray(rec), memoryview(rec)):
        assert check_twins(data)[0] == "ok"
        assert message.decode_messages(data)[0].body == b"body" * 5


def test_decoded_message_pickles_and_compares_by_identity() -> None:
    msg = MessageExt(topic="T", body=b"b", born_host="1.2.3.4:5", store_host="[::1]:7",
                     properties={"a": "1"})
    [m] = message.decode_messages(encode_stored_message(msg))
    back = pickle.loads(pickle.dumps(m))
    for f in dataclasses.fields(MessageExt):
        assert getattr(back, f.name) == getattr(m, f.name)
    assert back != m and m == m  # eq=False: identity, as before
    assert "msg_id=" in repr(m)


# ------------------------------------------------------------------------------ implementation


def _implementation(env: dict[str, str], prelude: str = "") -> subprocess.CompletedProcess[str]:
    code = prelude + (
        "import structlog\n"
        "from rmq_async.protocol import message\n"
        "print('IMPLEMENTATION=' + message.IMPLEMENTATION)\n"
    )
    full_env = {k: v for k, v in os.environ.items() if k != message.NO_EXTENSIONS_ENV}
    full_env.update(env)
    return subprocess.run([sys.executable, "-c", code], env=full_env, capture_output=True,
                          text=True, check=True, timeout=60)


def test_implementation_in_this_process() -> None:
    forced = os.environ.get(message.NO_EXTENSIONS_ENV, "") not in ("", "0")
    if not forced and os.environ.get("RMQ_ASYNC_EXPECT_COMPILED") == "1":
        # make test-unit on a machine that can build C extensions: a failed build (a broken
        # .pyx, say) is only a warning of setup.py's, and the twin tests would all skip.
        assert _cmessage is not None, "the compiled codec could be built here but is missing"
    if forced or _cmessage is None:
        assert message.IMPLEMENTATION == "python"
        assert message._records is message._decode_records
    else:
        assert message.IMPLEMENTATION == "compiled"
        assert message._records is _cmessage.decode_records


def test_implementation_follows_the_environment() -> None:
    forced = _implementation({message.NO_EXTENSIONS_ENV: "1"})
    assert "IMPLEMENTATION=python" in forced.stdout
    assert "extensions_unavailable" not in forced.stdout + forced.stderr  # asked for, not missing
    default = _implementation({})
    expected = "python" if _cmessage is None else "compiled"
    assert f"IMPLEMENTATION={expected}" in default.stdout


def test_missing_extension_falls_back_with_one_log_line() -> None:
    block = (
        "import sys\n"
        "class Block:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name == 'rmq_async.protocol._cmessage':\n"
        "            raise ImportError('no compiled codec here')\n"
        "sys.meta_path.insert(0, Block())\n"
    )
    result = _implementation({}, prelude=block)
    assert "IMPLEMENTATION=python" in result.stdout
    output = result.stdout + result.stderr
    lines = [line for line in output.splitlines() if "rmq_async.extensions_unavailable" in line]
    assert len(lines) == 1, output
    assert "error" not in lines[0].lower().replace("importerror", "")


@needs_compiled
def test_an_out_of_date_extension_is_not_used_at_all() -> None:
    # An extension built from an older source lacks a function the pure module now expects:
    # the process uses the pure twins throughout, with the one log line, and does not fail.
    stale = _tampered_extension("del module.uncache")
    result = _implementation({}, prelude=stale)
    assert result.returncode == 0, result.stderr
    assert "IMPLEMENTATION=python" in result.stdout
    output = result.stdout + result.stderr
    lines = [line for line in output.splitlines() if "rmq_async.extensions_unavailable" in line]
    assert len(lines) == 1 and "out of date (no uncache)" in lines[0], output


def _tampered_extension(change: str) -> str:
    """A prelude that applies ``change`` (a statement on ``module``) to the compiled codec
    module right after it is loaded, as a differently built extension would differ."""
    return (
        "import sys\n"
        "from importlib.machinery import PathFinder\n"
        "class Tampered:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name != 'rmq_async.protocol._cmessage':\n"
        "            return None\n"
        "        spec = PathFinder.find_spec(name, path)\n"
        "        run = spec.loader.exec_module\n"
        "        def exec_module(module):\n"
        "            run(module)\n"
        f"            {change}\n"
        "        spec.loader.exec_module = exec_module\n"
        "        return spec\n"
        "sys.meta_path.insert(0, Tampered())\n"
    )


@needs_compiled
def test_an_extension_built_from_another_source_is_not_used() -> None:
    # Every name present, but built from another _cmessage.pyx than the one beside it (a
    # function whose arguments changed would fail at its first call): the pure path, with
    # the one log line.
    result = _implementation(
        {}, prelude=_tampered_extension("module.SOURCE_DIGEST = '0123456789abcdef'"))
    assert result.returncode == 0, result.stderr
    assert "IMPLEMENTATION=python" in result.stdout
    output = result.stdout + result.stderr
    lines = [line for line in output.splitlines() if "rmq_async.extensions_unavailable" in line]
    assert len(lines) == 1 and "built from another _cmessage.pyx" in lines[0], output
    # Built without a digest (by hand, without setup.py): nothing to compare, it is used.
    result = _implementation({}, prelude=_tampered_extension("module.SOURCE_DIGEST = ''"))
    assert "IMPLEMENTATION=compiled" in result.stdout, result.stdout + result.stderr


@needs_compiled
def test_the_built_extension_carries_the_digest_of_its_source() -> None:
    # The check above is only as good as the build: setup.py must stamp the extension.
    from rmq_async.protocol import _cmessage

    source = Path(message.__file__).with_name("_cmessage.pyx")
    assert message._source_digest(source) == _cmessage.SOURCE_DIGEST
    assert message._source_digest(source.with_name("absent.pyx")) is None  # nothing to compare


@needs_compiled
def test_compiled_messages_are_not_tracked_by_the_cycle_collector() -> None:
    import gc

    _, c_loop = _loops()
    data = encode_stored_message(MessageExt(topic="t", body=b"x", properties={"A": "b"},
                                            born_host="1.2.3.4:5", store_host="1.2.3.4:6"))
    inner = encode_batch([Message("t", b"a"), Message("t", b"b")])
    batch = encode_stored_message(MessageExt(topic="t", body=inner, sys_flag=MSG_INNER_BATCH_FLAG
                                             | MSG_NEED_UNWRAP_FLAG, born_host="1.2.3.4:5",
                                             store_host="1.2.3.4:6"))
    out: list[MessageExt] = []
    c_loop(data + batch, out, True, True, message.DEFAULT_MAX_BODY_SIZE, 10)
    assert len(out) == 3
    assert not any(gc.is_tracked(m) for m in out)
    # Still ordinary objects: properties parse, fields can be set, the memory is released.
    out[0].put_property("B", "c")
    assert out[0].properties == {"A": "b", "B": "c"}
    out[0].topic = "u"
    assert out[0].message_queue.topic == "u"


@needs_compiled
def test_stamp_delivered_twins_agree_and_leave_properties_unparsed() -> None:
    """The pull's broker name and MIN/MAX_OFFSET, set by either twin on decoded messages whose
    properties are unparsed, parsed, or already have pending ones (and on a subclass)."""
    assert _cmessage is not None
    stored = b"".join(encode_stored_message(MessageExt(
        "T", f"b{i}".encode(), 1, i, properties={"TAGS": "t", "KEYS": f"k{i}", "a": str(i)}))
        for i in range(4))

    class Custom(MessageExt):
        __slots__ = ()

    def batch() -> list[MessageExt]:
        msgs = message.decode_messages(stored)
        _ = msgs[1].properties                      # parsed
        msgs[2].put_property("CONSUME_START_TIME", "5")  # pending before the pull's
        msgs.append(Custom("T", b"c", 1, 9, properties={"x": "y"}))
        return msgs

    values = {"MIN_OFFSET": "0", "MAX_OFFSET": "10"}
    results = []
    for stamp in (message._stamp_delivered, _cmessage.stamp_delivered):
        msgs = batch()
        stamp(msgs, "broker-b", values)
        assert msgs[0]._props is None and msgs[3]._props is None  # nothing parsed
        # The messages that waited for nothing share one dict of the pull's values ...
        assert msgs[0]._props_pending is msgs[3]._props_pending
        assert msgs[0]._props_pending is not values
        # ... which a change to one of them copies first (others do not see the change).
        msgs[0].put_property("MAX_OFFSET", "11")
        msgs[3].put_properties({"u": "v"})
        assert msgs[3].get_property("MAX_OFFSET") == "10"
        assert msgs[0].get_property("u") is None and msgs[0].get_property("MAX_OFFSET") == "11"
        msgs[0].put_property("MAX_OFFSET", "10")
        del msgs[3].properties["u"]
        results.append([(m.broker_name, m.properties) for m in msgs])
    assert results[0] == results[1]
    assert all(b == "broker-b" and p["MAX_OFFSET"] == "10" for b, p in results[0])
    assert results[0][0][1] == {"TAGS": "t", "KEYS": "k0", "a": "0", "MIN_OFFSET": "0",
                                "MAX_OFFSET": "10"}
    assert results[0][2][1]["CONSUME_START_TIME"] == "5"
    assert values == {"MIN_OFFSET": "0", "MAX_OFFSET": "10"}  # each message got its own copy


@needs_compiled
def test_put_each_twins_agree_and_share_one_dict_per_run() -> None:
    """The consume start time on a chunk: each twin gives every message the same properties as
    ``put_properties`` would, with one pending dict for the messages that shared one."""
    assert _cmessage is not None
    stored = b"".join(encode_stored_message(MessageExt(
        "T", f"b{i}".encode(), 1, i, properties={"TAGS": "t", "a": str(i)})) for i in range(6))

    class Custom(MessageExt):
        __slots__ = ()

    def chunk() -> list[MessageExt]:
        msgs = message.decode_messages(stored)
        message.stamp_delivered(msgs, "b", {"MIN_OFFSET": "0", "MAX_OFFSET": "9"})
        _ = msgs[2].properties                    # parsed
        msgs[4].put_property("x", "own")          # a pending dict of its own
        msgs.append(Custom("T", b"c", 1, 9, properties={"y": "z"}))
        return msgs

    values = {"CONSUME_START_TIME": "1700000000000"}
    expected = []
    for m in chunk():
        m.put_properties(values)
        expected.append(m.properties)
    for put in (message._put_each, _cmessage.put_each):
        msgs = chunk()
        put(msgs, values)
        pending = [m._props_pending for m in msgs]
        # 0, 1 and 3 are one run (2 is parsed, so has no pending); 4 ends it, 5 starts another.
        assert pending[0] is pending[1] and pending[1] is pending[3]
        assert pending[4] is not pending[0] and pending[5] is not pending[0]
        assert pending[5] == pending[0] and pending[2] is None
        assert msgs[0]._props is None                     # nothing parsed
        # The shared dict is never changed in place: a later change to one message stays there.
        msgs[0].put_property("CONSUME_START_TIME", "1")
        assert msgs[1].get_property("CONSUME_START_TIME") == "1700000000000"
        msgs[0].put_property("CONSUME_START_TIME", "1700000000000")
        assert [m.properties for m in msgs] == expected
    assert values == {"CONSUME_START_TIME": "1700000000000"}

"""Inputs found by the decoder fuzzer (tests/fuzz/fuzz_decoders.py) that once raised something
other than ProtocolError."""

from __future__ import annotations

import pytest

from rmq_async.protocol import headers as h
from rmq_async.protocol.bodies import GetConsumerStatusBody, LockBatchResponseBody, ResetOffsetBody
from rmq_async.protocol.errors import ProtocolError
from rmq_async.protocol.types import MessageQueue


@pytest.mark.parametrize("raw", ["9" * 4301, "-" + "1" * 5000, "+" + "0" * 5999 + "1" * 20])
def test_header_integer_with_more_digits_than_int_converts(raw: str) -> None:
    # int() refuses strings over sys.get_int_max_str_digits() digits with a ValueError.
    with pytest.raises(ProtocolError, match="out of Long range"):
        h.QueryConsumerOffsetResponseHeader.from_ext_fields({"offset": raw})


@pytest.mark.parametrize(("raw", "value"), [
    ("+" + "0" * 6000 + "5", 5),
    ("-" + "0" * 5000 + "9223372036854775808", -(2**63)),
    ("0" * 4400, 0),
    ("-0", 0),
])
def test_header_integer_leading_zeros_as_long_parse_long(raw: str, value: int) -> None:
    assert h.QueryConsumerOffsetResponseHeader.from_ext_fields({"offset": raw}).offset == value


@pytest.mark.parametrize(("raw", "value"), [
    ("999999999", 999_999_999), ("2147483647", 2**31 - 1), ("0042", 42), ("+7", 7)])
def test_header_int32_plain_digits_and_the_edge(raw: str, value: int) -> None:
    # Plain digits take a shortcut; the shortcut and the full parse agree at its edge.
    header = h.GetMinOffsetRequestHeader.from_ext_fields({"topic": "t", "queueId": raw})
    assert header.queue_id == value


@pytest.mark.parametrize("raw", ["2147483648", "0000000002147483648", "\u00b2", "\u0663", "12a",
                                 ""])
def test_header_int32_refuses_overflow_and_digits_other_than_ascii(raw: str) -> None:
    # Out of range, a superscript two, an Arabic-Indic three (str.isdigit says yes to both).
    with pytest.raises(ProtocolError):
        h.GetMinOffsetRequestHeader.from_ext_fields({"topic": "t", "queueId": raw})


def test_header_integer_range_still_checked() -> None:
    with pytest.raises(ProtocolError, match="out of Long range"):
        h.QueryConsumerOffsetResponseHeader.from_ext_fields({"offset": "9223372036854775808"})
    with pytest.raises(ProtocolError, match="out of Integer range"):
        h.GetMinOffsetRequestHeader.from_ext_fields({"topic": "t", "queueId": "-2147483649"})


@pytest.mark.parametrize("data", [
    b'{"offsetTable":{[[1,2,3]]:8872}}',  # array key of 3-element arrays: not (name, value) pairs
    b'{"offsetTable":{[1,2,3]:1}}',  # array key of numbers
    b'{"offsetTable":{[["a",1],["b"]]:1}}',
])
def test_array_keys_where_a_queue_is_expected(data: bytes) -> None:
    with pytest.raises(ProtocolError, match="expected a message queue"):
        ResetOffsetBody.from_json_bytes(data)


def test_array_keys_in_nested_offset_tables() -> None:
    data = b'{"consumerTable":{"g":{[[1,2,3]]:1}},"messageQueueTable":{}}'
    with pytest.raises(ProtocolError):
        GetConsumerStatusBody.from_json_bytes(data)
    with pytest.raises(ProtocolError):
        LockBatchResponseBody.from_json_bytes(b'{"lockOKMQSet":["[[1,2,3]]"]}')


def test_object_keys_still_read_as_queues() -> None:
    data = b'{"offsetTable":{{"brokerName":"b","queueId":"7","topic":"t"}:3}}'
    assert ResetOffsetBody.from_json_bytes(data).offset_table == {MessageQueue("t", "b", 7): 3}

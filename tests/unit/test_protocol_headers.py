"""Typed headers: field tables, extFields conversion, parsing errors."""

from __future__ import annotations

import dataclasses
import inspect

import pytest

from rmq_async.protocol import headers as h
from rmq_async.protocol.errors import ProtocolError

ALL_HEADERS = [
    cls
    for _, cls in inspect.getmembers(h, inspect.isclass)
    if issubclass(cls, h.CommandHeader) and cls not in (h.CommandHeader, h.RequestHeader)
]


def test_every_header_has_a_table_and_java_order() -> None:
    assert len(ALL_HEADERS) >= 28
    for cls in ALL_HEADERS:
        table = cls.field_table()
        assert [r.py_name for r in table] == [f.name for f in dataclasses.fields(cls)]
        java_names = [r.java_name for r in table]
        assert len(set(java_names)) == len(java_names), cls
        put_order = cls.JAVA_PUT_ORDER.split(",")
        extra = {"MSG_REGION", "TRACE_ON"}  # response extFields not in Java's header class
        assert set(java_names) - extra <= set(put_order), cls


def test_pull_request_to_ext_fields() -> None:
    header = h.PullMessageRequestHeader(
        consumer_group="g", topic="t", queue_id=1, queue_offset=2**40, max_msg_nums=32,
        sys_flag=2, commit_offset=-1, suspend_timeout_millis=15000, sub_version=5,
        bname="broker-a",
    )
    assert header.to_ext_fields() == {
        "consumerGroup": "g", "topic": "t", "queueId": "1", "queueOffset": "1099511627776",
        "maxMsgNums": "32", "sysFlag": "2", "commitOffset": "-1",
        "suspendTimeoutMillis": "15000", "subVersion": "5", "bname": "broker-a",
    }


def test_booleans_and_primitive_defaults() -> None:
    ext = h.ConsumerSendMsgBackRequestHeader(offset=10, group="g", delay_level=0).to_ext_fields()
    assert ext == {"offset": "10", "group": "g", "delayLevel": "0", "unitMode": "false"}
    ext = h.GetMaxOffsetRequestHeader(topic="t", queue_id=0).to_ext_fields()
    assert ext["committed"] == "true"


def test_send_v2_uses_short_names() -> None:
    header = h.SendMessageRequestHeaderV2(
        producer_group="pg", topic="t", queue_id=2, born_timestamp=1700000000000,
        properties="a\x01b\x02", batch=True, bname="broker-a",
    )
    assert header.to_ext_fields() == {
        "a": "pg", "b": "t", "c": "TBW102", "d": "4", "e": "2", "f": "0",
        "g": "1700000000000", "h": "0", "i": "a\x01b\x02", "m": "true", "n": "broker-a",
    }


@pytest.mark.parametrize("cls", ALL_HEADERS, ids=lambda c: c.__name__)
def test_round_trip_every_header(cls: type[h.CommandHeader]) -> None:
    kwargs: dict[str, object] = {}
    for row in cls.field_table():
        kwargs[row.py_name] = {
            h.FieldKind.STR: f"v-{row.java_name}",
            h.FieldKind.INT32: -7,
            h.FieldKind.INT64: 2**62,
            h.FieldKind.BOOL: True,
        }[row.kind]
    header = cls(**kwargs)
    ext = header.to_ext_fields()
    assert all(isinstance(v, str) for v in ext.values())
    assert cls.from_ext_fields(ext) == header


def test_from_ext_fields_parses_and_ignores_unknown() -> None:
    resp = h.PullMessageResponseHeader.from_ext_fields(
        {"suggestWhichBrokerId": "0", "nextBeginOffset": "+12", "minOffset": "0",
         "maxOffset": "99", "unknown": "x", "offsetDelta": "-3"}
    )
    assert (resp.next_begin_offset, resp.max_offset, resp.offset_delta) == (12, 99, -3)
    assert resp.topic_sys_flag is None


def test_from_ext_fields_defaults_for_4x_broker() -> None:
    reset = h.ResetOffsetRequestHeader.from_ext_fields(
        {"topic": "t", "group": "g", "timestamp": "1", "isForce": "TRUE"}
    )
    assert reset.queue_id == -1 and reset.offset is None and reset.is_force is True
    info = h.GetConsumerRunningInfoRequestHeader.from_ext_fields(
        {"consumerGroup": "g", "clientId": "c"}
    )
    assert info.jstack_enable is False


def test_boolean_parsing_follows_java() -> None:
    def parse(raw: str) -> bool | None:
        return h.GetRouteInfoRequestHeader.from_ext_fields(
            {"topic": "t", "acceptStandardJsonOnly": raw}
        ).accept_standard_json_only
    assert parse("true") is True and parse("True") is True
    assert parse("yes") is False and parse("1") is False


@pytest.mark.parametrize(
    "ext",
    [
        {},  # everything missing
        {"offset": ""},
        {"offset": "12x"},
        {"offset": " 12"},
        {"offset": "1_000"},
        {"offset": "9223372036854775808"},  # > Long.MAX_VALUE
        {"offset": "١٢"},  # non-ASCII digits
    ],
)
def test_from_ext_fields_errors(ext: dict[str, str]) -> None:
    with pytest.raises(ProtocolError):
        h.QueryConsumerOffsetResponseHeader.from_ext_fields(ext)


def test_int32_range_checked() -> None:
    good = {"msgId": "m", "queueId": "2147483647", "queueOffset": "1"}
    assert h.SendMessageResponseHeader.from_ext_fields(good).queue_id == 2**31 - 1
    with pytest.raises(ProtocolError):
        h.SendMessageResponseHeader.from_ext_fields({**good, "queueId": "2147483648"})


def test_none_ext_fields_means_empty() -> None:
    assert h.HeartbeatRequestHeader.from_ext_fields(None) == h.HeartbeatRequestHeader()
    assert h.HeartbeatRequestHeader().to_ext_fields() == {}
    with pytest.raises(ProtocolError):
        h.NotifyConsumerIdsChangedRequestHeader.from_ext_fields(None)

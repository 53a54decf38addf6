"""fastjson-compatible writing and tolerant reading."""

from __future__ import annotations

import json
from enum import Enum

import pytest

from rmq_async.protocol.errors import ProtocolError
from rmq_async.protocol.jsonutil import (
    InsertionOrderedMap,
    fastjson_dumps,
    fastjson_string,
    java_double_str,
    java_hashmap_order,
    java_int_set_order,
    java_string_hash,
    tolerant_loads,
)
from rmq_async.protocol.types import MessageQueue


class Color(Enum):
    RED = 1


def test_dumps_sorted_compact_nulls_omitted() -> None:
    obj = {"b": 1, "a": [1, None, "x"], "c": None, "B": True, "d": {"z": None, "y": False}}
    assert fastjson_dumps(obj) == b'{"B":true,"a":[1,null,"x"],"b":1,"d":{"y":false}}'


def test_dumps_enum_by_name_and_sets() -> None:
    assert fastjson_dumps({"e": Color.RED}) == b'{"e":"RED"}'
    assert fastjson_dumps({"s": {"b", "a"}, "i": frozenset({3, 1})}) == b'{"i":[1,3],"s":["a","b"]}'


def test_dumps_non_string_keys_as_fastjson() -> None:
    assert fastjson_dumps({1: "b", 0: "a"}) == b'{0:"a",1:"b"}'
    mq = MessageQueue("t", "b", 0)
    assert fastjson_dumps({mq: 100}) == b'{{"brokerName":"b","queueId":0,"topic":"t"}:100}'


def test_dumps_insertion_ordered_map() -> None:
    assert fastjson_dumps(InsertionOrderedMap([("b", 1), ("a", 2)])) == b'{"b":1,"a":2}'


def test_dumps_rejects_unknown_types() -> None:
    with pytest.raises(TypeError):
        fastjson_dumps({"x": object()})


def test_dumps_lone_surrogate_becomes_question_mark() -> None:
    assert fastjson_dumps("a\ud800b") == b'"a?b"'


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("plain", '"plain"'),
        ('q"b\\s/', '"q\\"b\\\\s/"'),
        ("\b\f\n\r\t", '"\\b\\f\\n\\r\\t"'),
        ("\x00\x07\x0b\x1f", '"\\u0000\\u0007\\u000B\\u001F"'),
        ("\x7f\x85\x9f\xa0", '"\\u007F\\u0085\\u009F\xa0"'),
        ("\u2028\u2029", '"\\u2028\\u2029"'),
        ("中文😀", '"中文😀"'),
    ],
)
def test_fastjson_string_escapes(text: str, expected: str) -> None:
    assert fastjson_string(text) == expected
    assert json.loads(expected) == text


def test_java_double_str_matches_fastjson() -> None:
    # Produced by fastjson 1.2.83 JSON.toJSONString(double) for the same values.
    values = [0.0, 1.5, 100.0, 1e7, 1e-3, 1e-4, 123456.789, 0.1, 1.0 / 3, 12345678.9, -2.5e-10]
    expected = ("0.0 1.5 100.0 1.0E7 0.001 1.0E-4 123456.789 0.1 0.3333333333333333 "
                "1.23456789E7 -2.5E-10")
    assert " ".join(java_double_str(v) for v in values) == expected
    assert java_double_str(float("nan")) == "null"
    assert java_double_str(-0.0) == "-0.0"


def test_java_string_hash_examples() -> None:
    assert java_string_hash("TagA") == 2598919
    assert java_string_hash("order-created") == -392709271
    assert java_string_hash("中文") == 646394
    assert java_string_hash("😀") == 1772899


def test_java_hashmap_order_matches_java() -> None:
    # Java 17: new HashMap<>(), put in this order, then keySet() iteration order.
    keys = ["consumerGroup", "topic", "queueId", "commitOffset", "bname", "zz",
            "a", "b", "c", "d", "e", "f", "g", "h", "i", "j", "k"]
    assert ",".join(java_hashmap_order(keys)) == (
        "zz,queueId,a,b,c,d,commitOffset,e,f,g,h,i,j,k,bname,topic,consumerGroup"
    )
    assert java_hashmap_order([]) == []


def test_java_int_set_order_matches_java() -> None:
    # HashSet<Integer> of the tag codes of "TagA || TagB || order-created || 中文 || a || zzz"
    codes = [2598919, 2598920, -392709271, 646394, 97, 121146]
    assert java_int_set_order(codes) == [2598919, 97, 646394, 121146, -392709271, 2598920]


# ---------------------------------------------------------------------------- tolerant reading


def test_loads_standard_json() -> None:
    assert tolerant_loads(b'{"a":[1,2.5,"x",null,true]}') == {"a": [1, 2.5, "x", None, True]}


def test_loads_bare_integer_keys() -> None:
    data = b'{"brokerAddrs":{0:"10.0.0.1:10911",1:"10.0.0.2:10911"},"n":{-3:1}}'
    assert tolerant_loads(data) == {
        "brokerAddrs": {0: "10.0.0.1:10911", 1: "10.0.0.2:10911"},
        "n": {-3: 1},
    }


def test_loads_object_keys_become_message_queues() -> None:
    data = ('{"offsetTable":{{"brokerName":"broker-a","queueId":1,"topic":"TopicTest"}:200,'
            ' {"brokerName":"broker-a","queueId":0,"topic":"TopicTest"} : 100}}')
    assert tolerant_loads(data) == {
        "offsetTable": {
            MessageQueue("TopicTest", "broker-a", 1): 200,
            MessageQueue("TopicTest", "broker-a", 0): 100,
        }
    }


def test_loads_other_object_and_array_keys_are_frozen() -> None:
    value = tolerant_loads('{{"x":[1,{"y":2}]}:1,[1,2]:2,true:3,null:4}')
    assert value == {(("x", (1, (("y", 2),))),): 1, (1, 2): 2, True: 3, None: 4}


def test_loads_round_trips_fastjson_dumps() -> None:
    obj = {"m": {MessageQueue("t", "b", 3): 7}, "k": {5: "v"}, "s": "é\n"}
    assert tolerant_loads(fastjson_dumps(obj)) == obj


@pytest.mark.parametrize(
    "data",
    [
        b"",
        b"{",
        b"{0:}",
        b"{0 1}",
        b"{0:1,}",
        b"[1,2",
        b"[1 2]",
        b'{"a":1} x',
        b"{x:1}",
        b"\xff\xfe",
        b"{" * 5000 + b"0:1" + b"}" * 5000,
        b"[" * 100000,
    ],
)
def test_loads_rejects_garbage(data: bytes) -> None:
    with pytest.raises(ProtocolError):
        tolerant_loads(data)

"""Subscription expressions, tag hash codes and the client re-filter."""

from __future__ import annotations

import pytest

from rmq_async.protocol.filter import (
    SubscriptionData,
    build_subscription,
    java_string_hash,
    tag_matches,
)
from rmq_async.protocol.jsonutil import fastjson_dumps


@pytest.mark.parametrize(
    ("text", "code"),
    [
        ("TagA", 2598919),
        ("TagB", 2598920),
        ("a", 97),
        ("", 0),
        ("order-created", -392709271),
        ("中文", 646394),
        ("😀", 1772899),
    ],
)
def test_java_string_hash_reference_examples(text: str, code: int) -> None:
    assert java_string_hash(text) == code


@pytest.mark.parametrize("expression", [None, "", "*"])
def test_subscribe_all(expression: str | None) -> None:
    sub = build_subscription("t", expression, sub_version=1)
    assert (sub.sub_string, sub.tags_set, sub.code_set) == ("*", [], [])
    assert sub.is_all and sub.sub_version == 1


def test_tag_list_trimmed_and_hashed() -> None:
    sub = build_subscription("t", " TagA ||TagB||  || TagA ||\t*", sub_version=5)
    assert sub.sub_string == " TagA ||TagB||  || TagA ||\t*"
    assert sub.tags_set == ["TagA", "TagB", "*"]
    assert sub.code_set == [2598919, 2598920, 42]
    assert sub.expression_type == "TAG" and not sub.is_all


def test_java_trim_keeps_non_ascii_spaces() -> None:
    assert build_subscription("t", "\u00a0a\u00a0").tags_set == ["\u00a0a\u00a0"]


@pytest.mark.parametrize("expression", ["||", "  ", " || \t", "||||"])
def test_expression_without_tags_is_rejected(expression: str) -> None:
    with pytest.raises(ValueError, match="names no tag"):
        build_subscription("t", expression)


def test_sql92_and_unknown_types() -> None:
    sub = build_subscription("t", "a > 5", expression_type="SQL92")
    assert (sub.expression_type, sub.sub_string, sub.tags_set) == ("SQL92", "a > 5", [])
    with pytest.raises(ValueError):
        build_subscription("t", " ", expression_type="SQL92")
    with pytest.raises(ValueError):
        build_subscription("t", "a", expression_type="XPATH")


def test_sub_version_defaults_to_now() -> None:
    sub = build_subscription("t", "*")
    assert sub.sub_version > 1_600_000_000_000


def test_to_json_matches_java_heartbeat_subscription() -> None:
    # As written by RocketMQ 5.3.3 for FilterAPI.buildSubscriptionData(topic, same expression).
    sub = build_subscription(
        "TopicTest", "TagA || TagB || order-created || 中文 || a || zzz", sub_version=1700000000000
    )
    assert fastjson_dumps(sub.to_json()).decode() == (
        '{"classFilterMode":false,"codeSet":[2598919,97,646394,121146,-392709271,2598920],'
        '"expressionType":"TAG","subString":"TagA || TagB || order-created || 中文 || a || zzz",'
        '"subVersion":1700000000000,"tagsSet":["TagA","a","中文","zzz","order-created","TagB"],'
        '"topic":"TopicTest"}'
    )


def test_tag_matches() -> None:
    sub = build_subscription("t", "TagA || TagB")
    assert tag_matches(sub, "TagA") and tag_matches(sub, "TagB")
    assert not tag_matches(sub, "TagC")
    assert not tag_matches(sub, None)
    assert not tag_matches(sub, "taga")
    everything = build_subscription("t", "*")
    assert tag_matches(everything, None) and tag_matches(everything, "x")
    sql = build_subscription("t", "a = 1", expression_type="SQL92")
    assert tag_matches(sql, None)
    class_filter = SubscriptionData("t", "TagA", ["TagA"], [2598919], class_filter_mode=True)
    assert tag_matches(class_filter, "other")

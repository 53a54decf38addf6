"""Options, positions, offset JSON and the per-trigger limit of the RocketMQ source (no broker)."""

from __future__ import annotations

import pytest

from rmq_async.protocol.types import MessageQueue
from rmq_async.sources.ranges import (
    EARLIEST,
    LATEST,
    Position,
    SourceError,
    SourceOptions,
    limit_offsets,
    offsets_from_json,
    offsets_to_json,
    parse_position,
)

BASE = {"namesrv": "127.0.0.1:9876", "topics": "a, b"}


def mq(i: int, topic: str = "a") -> MessageQueue:
    return MessageQueue(topic, "broker-a", i)


def test_offsets_json_round_trip() -> None:
    offsets = {mq(1): 5, mq(0): 3, mq(0, "b"): 0}
    data = offsets_to_json(offsets)
    assert data == {"a": {"broker-a:0": 3, "broker-a:1": 5}, "b": {"broker-a:0": 0}}
    assert offsets_from_json(data) == offsets
    assert offsets_from_json('{"x": {"b:c:7": 1}}') == {MessageQueue("x", "b:c", 7): 1}


@pytest.mark.parametrize("bad", ['{"a": 1}', '{"a": {"0": 1}}', '{"a": {"b:0": "1"}}', "[1]",
                                 '{"a": {"b:0": true}}', "{nope"])
def test_offsets_json_rejects(bad: str) -> None:
    with pytest.raises(SourceError):
        offsets_from_json(bad)


def test_positions() -> None:
    assert parse_position("EARLIEST", "x") == Position("earliest")
    assert parse_position(" latest ", "x") == Position("latest")
    assert parse_position("1700000000000", "x") == Position("timestamp", timestamp_ms=1700000000000)
    assert parse_position("2023-11-14T22:13:20Z", "x").timestamp_ms == 1700000000000
    assert parse_position("2023-11-14T22:13:20", "x").timestamp_ms == 1700000000000  # UTC
    # Exact milliseconds (seconds as a float times 1000 came out 1 ms low for this one).
    assert parse_position("2039-06-27T19:46:00.832Z", "x").timestamp_ms == 2192816760832
    assert parse_position("2023-11-14T23:13:20.001+01:00", "x").timestamp_ms == 1700000000001
    pos = parse_position('{"a": {"broker-a:0": -2, "broker-a:1": 10}}', "x")
    assert pos.kind == "offsets" and pos.offsets == {mq(0): EARLIEST, mq(1): 10}
    for bad in ("soon", "-5", '{"a": {"broker-a:0": -3}}'):
        with pytest.raises(SourceError):
            parse_position(bad, "x")


def test_options_defaults_and_checks() -> None:
    batch = SourceOptions.parse(BASE, streaming=False)
    assert batch.topics == ("a", "b")
    assert batch.starting.kind == "earliest" and batch.ending == Position("latest")
    assert batch.fail_on_data_loss and batch.group == "rmq_async_spark_source"
    stream = SourceOptions.parse({**BASE, "MaxMessagesPerTrigger": "10", "commitToGroup": "g",
                                  "failOnDataLoss": "false"}, streaming=True)
    assert stream.starting.kind == "latest" and stream.ending is None
    assert stream.max_messages_per_trigger == 10 and stream.group == "g"
    assert not stream.fail_on_data_loss
    for kafka in ({"maxOffsetsPerTrigger": "7"},  # Kafka's name for the same bound
                  {"maxOffsetsPerTrigger": "7", "maxMessagesPerTrigger": "7"}):
        assert SourceOptions.parse({**BASE, **kafka}, streaming=True) \
            .max_messages_per_trigger == 7
    assert SourceOptions.parse({**BASE, "startingTimestamp": "5"}, streaming=True).starting == \
        Position("timestamp", timestamp_ms=5)
    assert SourceOptions.parse({**BASE, "tls": "true", "tlsVerify": "false"}, streaming=True).tls
    by_pattern = SourceOptions.parse({"namesrv": "x:1", "topicPattern": "orders-.*"}, streaming=True)
    assert by_pattern.topics == () and by_pattern.topic_pattern == "orders-.*"
    for bad, streaming in [
        ({"topics": "a"}, False),
        ({"namesrv": "x:1"}, False),
        ({**BASE, "startingOffsets": "latest"}, False),
        ({**BASE, "endingOffsets": "earliest"}, False),
        ({**BASE, "endingOffsets": "latest"}, True),
        ({**BASE, "maxMessagesPerTrigger": "10"}, False),
        ({**BASE, "commitToGroup": "g"}, False),  # accepted, and then nothing was written
        ({**BASE, "tlsVerify": "false"}, True),  # the connections stayed plain TCP
        ({**BASE, "securityToken": "t"}, True),  # dropped: nothing was signed
        ({**BASE, "maxMessagesPerTrigger": "0"}, True),
        ({**BASE, "maxOffsetsPerTrigger": "10"}, False),
        ({**BASE, "maxOffsetsPerTrigger": "0"}, True),
        ({**BASE, "maxOffsetsPerTrigger": "10", "maxMessagesPerTrigger": "20"}, True),
        ({**BASE, "tags": "x", "sql": "a > 1"}, True),
        ({**BASE, "tags": "||"}, True),
        ({**BASE, "startingOffsets": "earliest", "startingTimestamp": "1"}, True),
        ({**BASE, "accessKey": "k"}, True),
        ({**BASE, "failOnDataLoss": "maybe"}, True),
        ({**BASE, "startingOfsets": "earliest"}, True),
        ({**BASE, "topicPattern": "a.*"}, True),
        ({"namesrv": "x:1", "topicPattern": "a[("}, True),
    ]:
        with pytest.raises(SourceError):
            SourceOptions.parse(bad, streaming=streaming)


def test_limit_offsets_shares_by_backlog() -> None:
    start = {mq(0): 0, mq(1): 100, mq(2): 50}
    latest = {mq(0): 1000, mq(1): 100, mq(2): 150, mq(3): 10}
    # Everything fits.
    assert limit_offsets(start | {mq(3): 0}, latest, 10_000) == latest
    end = limit_offsets(start | {mq(3): 0}, latest, 111)
    assert sum(end[q] - (start | {mq(3): 0})[q] for q in latest) == 111
    assert end[mq(1)] == 100
    assert end[mq(0)] == 100 and end[mq(2)] == 60 and end[mq(3)] == 1
    # One message at a time: each queue with a backlog still moves forward (by one, as the
    # Kafka source rounds a share below one up, past the limit), never past the latest offset.
    fill = dict(start) | {mq(3): 0}
    for _ in range(50):
        nxt = limit_offsets(fill, latest, 1)
        assert all(nxt[q] == min(fill[q] + 1, latest[q]) for q in latest)
        fill = nxt
    assert LATEST == -1


def test_limit_offsets_lets_a_small_queue_move_beside_a_huge_backlog() -> None:
    """A share below one offset rounds to one (the Kafka source's rule), so a queue with a
    small backlog is not held back for as long as a big one has more than ~200x its backlog."""
    a, b = mq(0), mq(1)
    start, latest = {a: 0, b: 0}, {a: 1_000_000, b: 150}
    for _ in range(3):
        end = limit_offsets(start, latest, 100)
        assert end[b] - start[b] == 1 and end[a] - start[a] == 99
        start = end
    # Fewer offsets than queues with a backlog: one each, past the limit (the sum was kept,
    # and a queue growing by more than the limit per trigger took all of it, every trigger).
    many = {mq(i): 0 for i in range(5)}
    end = limit_offsets(many, {q: 10 for q in many}, 3)
    assert end == {q: 1 for q in many}
    big, small = mq(0), mq(1)
    start2, high = {big: 0, small: 0}, {big: 100, small: 1}
    for _ in range(5):
        end = limit_offsets(start2, high, 1)
        start2, high = end, {big: high[big] + 2, small: high[small]}
    assert start2[small] == 1  # read, though the big queue grew by more than the limit


def test_a_padded_star_is_every_tag_for_the_pulls_and_the_reads_alike() -> None:
    """" * " counted as no filter for the reads but went to the broker as a literal tag "*":
    every entry was skipped, and the reads took that for data loss."""
    for tags in (" * ", "*", "  "):
        opts = SourceOptions.parse({"namesrv": "127.0.0.1:9876", "topics": "t", "tags": tags},
                                   streaming=False)
        sub = opts.subscription("t")
        assert not opts.filtered and sub.sub_string == "*" and not sub.tags_set, tags
    opts = SourceOptions.parse({"namesrv": "127.0.0.1:9876", "topics": "t", "tags": " a || b "},
                               streaming=False)
    assert opts.filtered and set(opts.subscription("t").tags_set) == {"a", "b"}

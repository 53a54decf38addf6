"""ConsumerStats: sliding-window TPS / RT per topic with a controlled clock."""

from __future__ import annotations

import pytest

from rmq_async.consumer.stats import ConsumerStats, WindowCounter

KEYS = {"pullRT", "pullTPS", "consumeRT", "consumeOKTPS", "consumeFailedTPS", "consumeFailedMsgs"}


class Clock:
    def __init__(self, t: float = 10_000.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


def test_unknown_topic_snapshot_is_all_zero() -> None:
    snap = ConsumerStats(Clock()).snapshot("nope")
    assert set(snap) == KEYS
    assert all(v == 0 for v in snap.values())


def test_pull_rt_and_tps_over_a_full_minute() -> None:
    clock = Clock()
    stats = ConsumerStats(clock)
    # 120 pulls over 60 s, 2 per second, 32 messages each, 10 ms and 30 ms alternating.
    for i in range(120):
        clock.t = 10_000.0 + i * 0.5
        stats.record_pull("T", 32, 0.010 if i % 2 else 0.030)
    clock.t = 10_000.0 + 60.0
    snap = stats.snapshot("T")
    assert snap["pullRT"] == pytest.approx(20.0)
    # The window covers the last 60 one-second buckets: seconds 1..60 relative to start,
    # the 60th just begun. They hold 118 pulls (the two pulls of second 0 fell out) over
    # the 59 seconds covered so far.
    assert snap["pullTPS"] == pytest.approx(118 * 32 / 59.0)


@pytest.mark.parametrize("into_second", [0.0, 0.001, 0.25, 0.5, 0.999])
def test_a_steady_rate_reads_the_same_anywhere_in_a_second(into_second: float) -> None:
    """Ten messages a second for two minutes read as ten a second, whenever it is read: the
    window is 59 whole seconds and part of the current one, not always 60 seconds."""
    counter = WindowCounter(10_000.0)
    now = 10_120.0 + into_second
    k = 0
    while (t := 10_000.0 + k / 10) <= now:
        counter.add(t, 1.0)
        k += 1
    assert counter.minute_rate(now) == pytest.approx(10.0, rel=0.005)


def test_young_counter_divides_by_its_age() -> None:
    clock = Clock()
    stats = ConsumerStats(clock)
    stats.record_consume("T", ok=100, failed=0, rt=0.002)
    clock.t += 10.0
    stats.record_consume("T", ok=100, failed=0, rt=0.004)
    snap = stats.snapshot("T")
    assert snap["consumeOKTPS"] == pytest.approx(200 / 10.0)
    assert snap["consumeRT"] == pytest.approx(3.0)


def test_rate_never_divides_by_less_than_a_second() -> None:
    clock = Clock()
    stats = ConsumerStats(clock)
    stats.record_consume("T", ok=50, failed=0, rt=0.0)
    assert stats.snapshot("T")["consumeOKTPS"] == pytest.approx(50.0)


def test_failed_counts_tps_and_hourly_total() -> None:
    clock = Clock()
    stats = ConsumerStats(clock)
    stats.record_consume("T", ok=3, failed=2, rt=0.001)
    clock.t += 30 * 60.0  # 30 minutes later: out of the minute, inside the hour
    stats.record_consume("T", ok=0, failed=1, rt=0.001)
    snap = stats.snapshot("T")
    assert snap["consumeFailedMsgs"] == 3
    assert snap["consumeFailedTPS"] == pytest.approx(1 / 59.0)  # at a second's start: 59 s covered
    assert snap["consumeOKTPS"] == 0.0
    assert isinstance(snap["consumeFailedMsgs"], int)
    clock.t += 31 * 60.0  # first record now older than an hour
    assert stats.snapshot("T")["consumeFailedMsgs"] == 1


def test_consume_rt_falls_back_to_the_hour_when_the_minute_is_empty() -> None:
    clock = Clock()
    stats = ConsumerStats(clock)
    stats.record_consume("T", ok=1, failed=0, rt=0.250)
    stats.record_consume("T", ok=1, failed=0, rt=0.050)
    clock.t += 5 * 60.0
    snap = stats.snapshot("T")
    assert snap["consumeRT"] == pytest.approx(150.0)
    assert snap["consumeOKTPS"] == 0.0
    assert snap["pullRT"] == 0.0  # no pull recorded: average of nothing is 0


def test_buckets_are_reused_after_a_full_turn() -> None:
    clock = Clock(0.0)
    counter = WindowCounter(0.0)
    counter.add(0.2, 5.0)
    clock.t = 60.2  # same slot (60 % 60 == 0), a new epoch: the old value must not leak
    counter.add(clock.t, 1.0)
    assert counter.minute(clock.t) == (1.0, 1)
    assert counter.hour(clock.t) == (6.0, 2)


def test_topics_are_separate_and_listed() -> None:
    clock = Clock()
    stats = ConsumerStats(clock)
    stats.record_pull("A", 10, 0.001)
    stats.record_pull("B", 20, 0.003)
    assert sorted(stats.topics()) == ["A", "B"]
    table = stats.snapshot_all()
    assert set(table) == {"A", "B"}
    assert table["A"]["pullRT"] == pytest.approx(1.0)
    assert table["B"]["pullRT"] == pytest.approx(3.0)
    assert table["A"]["pullTPS"] == pytest.approx(10.0)


def test_histogram_buckets_take_values_up_to_their_bound() -> None:
    from rmq_async.consumer.stats import PULL_BUCKETS, CumulativeHistogram

    h = CumulativeHistogram(PULL_BUCKETS)
    values = [0.0, 0.001, 0.0011, 0.0025, 0.7, 30.0, 30.5, 1e9]
    for v in values:
        h.observe(v)
    h.observe(0.003, times=4)
    # Each value counted in the first bucket whose bound is >= it, as a linear scan would.
    expected = [0] * len(PULL_BUCKETS)
    for v, times in [*((v, 1) for v in values), (0.003, 4)]:
        first = next((i for i, b in enumerate(PULL_BUCKETS) if v <= b), None)
        if first is not None:
            expected[first] += times
    assert h.counts == expected
    assert h.count == len(values) + 4  # values above the last bound only in +Inf
    assert h.counts[0] == 2 and h.counts[1] == 2 and h.counts[2] == 4

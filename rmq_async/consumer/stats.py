"""Per-topic pull and consume statistics over sliding windows (Java ``ConsumerStatsManager``).

Recording is O(1): each counter is a ring of per-second buckets (last minute) and of per-minute
buckets (last hour); a bucket whose slot comes round again is reset before it is reused.
Reading a snapshot sums at most 60 buckets per counter. Like everything the consumer owns, an
instance is used from one event loop thread only.

Snapshot keys and meaning follow Java's ``ConsumeStatus`` (what ``mqadmin consumerStatus``
prints): ``pullRT`` / ``consumeRT`` are average milliseconds per pull / per consume call,
``*TPS`` are messages per second over the last minute, ``consumeFailedMsgs`` is the number of
failed messages over the last hour.
"""

from __future__ import annotations

import time
from bisect import bisect_left
from collections.abc import Callable
from typing import Any

__all__ = ["CONSUME_BUCKETS", "PULL_BUCKETS", "ConsumerStats", "CumulativeHistogram",
           "TopicTotals", "WindowCounter"]

#: Upper bounds (seconds) of the consume latency histogram's buckets.
CONSUME_BUCKETS: tuple[float, ...] = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5,
                                      1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
#: Upper bounds (seconds) of the pull round-trip histogram's buckets (a long poll that finds
#: messages can answer up to ``broker_suspend_max_time`` after it was sent).
PULL_BUCKETS: tuple[float, ...] = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5,
                                   1.0, 2.5, 5.0, 10.0, 20.0, 30.0)

_MINUTE = 60.0


class _Ring:
    """``slots`` buckets of ``width`` seconds, each holding (sum of values, number of events)."""

    __slots__ = ("_counts", "_epochs", "_sums", "slots", "width")

    def __init__(self, slots: int, width: float) -> None:
        self.slots = slots
        self.width = width
        self._epochs = [-1] * slots
        self._sums = [0.0] * slots
        self._counts = [0] * slots

    def add(self, now: float, value: float, count: int) -> None:
        epoch = int(now // self.width)
        i = epoch % self.slots
        if self._epochs[i] != epoch:
            self._epochs[i] = epoch
            self._sums[i] = value
            self._counts[i] = count
        else:
            self._sums[i] += value
            self._counts[i] += count

    def total(self, now: float) -> tuple[float, int]:
        """Sums over the buckets of the last ``slots`` epochs, the current one included."""
        current = int(now // self.width)
        oldest = current - self.slots + 1
        value = 0.0
        count = 0
        for epoch, s, c in zip(self._epochs, self._sums, self._counts, strict=True):
            if oldest <= epoch <= current:
                value += s
                count += c
        return value, count


class WindowCounter:
    """A value recorded with an event count, readable over the last minute and hour."""

    __slots__ = ("_created", "_hour", "_minute")

    def __init__(self, now: float) -> None:
        self._created = now
        self._minute = _Ring(60, 1.0)
        self._hour = _Ring(60, 60.0)

    def add(self, now: float, value: float, count: int = 1) -> None:
        self._minute.add(now, value, count)
        self._hour.add(now, value, count)

    def minute(self, now: float) -> tuple[float, int]:
        return self._minute.total(now)

    def hour(self, now: float) -> tuple[float, int]:
        return self._hour.total(now)

    def minute_rate(self, now: float) -> float:
        """Value per second over the last minute (over the time since creation if younger).

        The minute's buckets are the 59 whole seconds before the current one and the part of
        the current second gone so far: the rate divides by that, not by a full 60 s (which
        read up to a sixtieth low just after a second began)."""
        value, _ = self._minute.total(now)
        covered = _MINUTE - 1.0 + now % 1.0
        span = max(1.0, min(covered, now - self._created))
        return value / span


class _TopicStats:
    __slots__ = ("consume_failed", "consume_ok", "consume_rt", "pull_rt", "pull_tps")

    def __init__(self, now: float) -> None:
        self.pull_tps = WindowCounter(now)  # value: messages found, count: pulls
        self.pull_rt = WindowCounter(now)  # value: milliseconds, count: pulls
        self.consume_ok = WindowCounter(now)  # value: messages acknowledged
        self.consume_failed = WindowCounter(now)  # value: messages failed
        self.consume_rt = WindowCounter(now)  # value: milliseconds, count: listener calls


class CumulativeHistogram:
    """Observations counted into fixed buckets since creation (Prometheus histogram data)."""

    __slots__ = ("bounds", "count", "counts", "sum")

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self.bounds = bounds
        self.counts = [0] * len(bounds)  # per bucket, not cumulative; +Inf is ``count``
        self.count = 0
        self.sum = 0.0

    def observe(self, value: float, times: int = 1) -> None:
        i = bisect_left(self.bounds, value)  # the first bucket whose bound is >= value
        if i < len(self.counts):
            self.counts[i] += times
        self.count += times
        self.sum += value * times

    def cumulative(self) -> list[tuple[float, int]]:
        """``(upper bound, observations <= bound)`` per bucket, ``+Inf`` last."""
        out: list[tuple[float, int]] = []
        running = 0
        for bound, n in zip(self.bounds, self.counts, strict=True):
            running += n
            out.append((bound, running))
        # Read from another thread (a metrics endpoint) between a bucket's and the count's
        # update, the count may lag by one observation: never report less than the buckets.
        out.append((float("inf"), max(self.count, running)))
        return out


class TopicTotals:
    """Counters of one topic since the consumer was created (they only grow).

    ``consumed``: messages acknowledged; ``failed``: messages a listener (or sink) failed;
    ``sent_back``: failed messages handed back to the broker for a later retry
    (``%RETRY%<group>``); ``dead_lettered``: failed messages handed back to go to
    ``%DLQ%<group>``; ``consume_seconds`` / ``pull_seconds``: latency of listener calls and of
    pulls that found messages; ``pulled``: messages found by pulls.
    """

    __slots__ = ("consume_seconds", "consumed", "dead_lettered", "failed", "pull_seconds",
                 "pulled", "sent_back")

    def __init__(self) -> None:
        self.consumed = 0
        self.failed = 0
        self.sent_back = 0
        self.dead_lettered = 0
        self.pulled = 0
        self.consume_seconds = CumulativeHistogram(CONSUME_BUCKETS)
        self.pull_seconds = CumulativeHistogram(PULL_BUCKETS)


def _avg(pair: tuple[float, int]) -> float:
    value, count = pair
    return value / count if count else 0.0


class ConsumerStats:
    """Pull and consume statistics of one consumer, per topic."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._topics: dict[str, _TopicStats] = {}
        #: Cumulative counters per topic (what metrics exporters read).
        self.totals: dict[str, TopicTotals] = {}

    def _totals(self, topic: str) -> TopicTotals:
        t = self.totals.get(topic)
        if t is None:
            t = self.totals[topic] = TopicTotals()
        return t

    def _topic(self, topic: str, now: float) -> _TopicStats:
        ts = self._topics.get(topic)
        if ts is None:
            ts = self._topics[topic] = _TopicStats(now)
        return ts

    def record_pull(self, topic: str, msgs: int, rt: float) -> None:
        """A pull that found ``msgs`` messages and took ``rt`` seconds."""
        now = self._clock()
        ts = self._topic(topic, now)
        ts.pull_rt.add(now, rt * 1000.0)
        ts.pull_tps.add(now, float(msgs))
        totals = self._totals(topic)
        totals.pulled += msgs
        totals.pull_seconds.observe(rt)

    def record_consume(self, topic: str, ok: int, failed: int, rt: float, *,
                       calls: int = 1) -> None:
        """``calls`` listener calls that acknowledged ``ok`` and failed ``failed`` messages in
        ``rt`` seconds together (the consume RT is kept per call; none when no listener was
        called, for messages settled without one)."""
        now = self._clock()
        ts = self._topic(topic, now)
        if calls > 0:
            ts.consume_rt.add(now, rt * 1000.0, calls)
        if ok:
            ts.consume_ok.add(now, float(ok))
        if failed:
            ts.consume_failed.add(now, float(failed))
        totals = self._totals(topic)
        totals.consumed += ok
        totals.failed += failed
        if rt > 0.0 and calls > 0:  # sink chunks are written in batches, recorded without a time
            totals.consume_seconds.observe(rt / calls, calls)

    def record_send_back(self, topic: str, *, dead_letter: bool) -> None:
        """A failed message of ``topic`` was handed back to the broker: for a later retry, or
        (``dead_letter``) to the dead-letter queue."""
        totals = self._totals(topic)
        if dead_letter:
            totals.dead_lettered += 1
        else:
            totals.sent_back += 1

    def topics(self) -> list[str]:
        return list(self._topics)

    def snapshot(self, topic: str) -> dict[str, Any]:
        """Java ``ConsumeStatus`` of ``topic`` (all zero for a topic never seen)."""
        now = self._clock()
        ts = self._topics.get(topic)
        if ts is None:
            return {
                "pullRT": 0.0,
                "pullTPS": 0.0,
                "consumeRT": 0.0,
                "consumeOKTPS": 0.0,
                "consumeFailedTPS": 0.0,
                "consumeFailedMsgs": 0,
            }
        consume_rt = ts.consume_rt.minute(now)
        if consume_rt[1] == 0:
            # Java falls back to the hour when nothing was consumed in the last minute.
            consume_rt = ts.consume_rt.hour(now)
        return {
            "pullRT": _avg(ts.pull_rt.minute(now)),
            "pullTPS": ts.pull_tps.minute_rate(now),
            "consumeRT": _avg(consume_rt),
            "consumeOKTPS": ts.consume_ok.minute_rate(now),
            "consumeFailedTPS": ts.consume_failed.minute_rate(now),
            "consumeFailedMsgs": int(ts.consume_failed.hour(now)[0]),
        }

    def snapshot_all(self) -> dict[str, dict[str, Any]]:
        """``statusTable`` of running info: topic -> :meth:`snapshot`."""
        return {topic: self.snapshot(topic) for topic in self._topics}

"""A timestamp position resolves to the first message stored at or after it, on 4.x and 5.x.

The broker's SEARCH_OFFSET_BY_TIMESTAMP differs by version (5.x: the first message stored at
or after the time; 4.x: the message nearest to it), so ``first_stored_since`` checks the
answer with pulls and corrects it. Here the broker is simulated by a queue of store times
with both answers, the 4.x one following ConsumeQueue.getOffsetInQueueByTime of 4.9.7 (a
binary search that stops at any message of the exact time, else takes the nearer of the two
neighbours); tests/compat runs the same check against a real 4.9.7 broker.
"""

from __future__ import annotations

import asyncio
import bisect
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from rmq_async.client.api import PullStatus
from rmq_async.protocol.types import MessageQueue
from rmq_async.sources.ranges import first_stored_since

MQ = MessageQueue("t", "broker-a", 0)


def nearest_4x(times: list[int], low: int, timestamp: int) -> int:
    """What a 4.9.7 broker answers for a queue whose offsets ``low..`` have ``times``."""
    lo, hi = 0, len(times) - 1
    left = right = -1
    left_value = right_value = -1
    while hi >= lo:
        mid = (lo + hi) // 2
        if times[mid] == timestamp:
            return low + mid
        if times[mid] > timestamp:
            hi, right, right_value = mid - 1, mid, times[mid]
        else:
            lo, left, left_value = mid + 1, mid, times[mid]
    if left_value == -1:
        return low + right
    if right_value == -1:
        return low + left
    return low + (right if abs(timestamp - left_value) > abs(timestamp - right_value) else left)


def first_5x(times: list[int], low: int, timestamp: int) -> int:
    return low + bisect.bisect_left(times, timestamp)


@dataclass
class SimulatedBroker:
    times: list[int]
    low: int
    answer: Any
    pulls: int = 0
    per_pull: int | None = None  # a broker's byte cap: large messages come one per pull

    async def search_offset(self, addr: str, mq: MessageQueue, timestamp_ms: int) -> int:
        return int(self.answer(self.times, self.low, timestamp_ms))

    async def pull_message(self, addr: str, *, queue_offset: int, max_msg_nums: int,
                           **_: Any) -> Any:
        self.pulls += 1
        at = queue_offset - self.low
        if not 0 <= at < len(self.times):
            return SimpleNamespace(status=PullStatus.NO_NEW_MSG, decode=list)
        n = max_msg_nums if self.per_pull is None else min(max_msg_nums, self.per_pull)
        msgs = [SimpleNamespace(queue_offset=self.low + i, store_timestamp=self.times[i])
                for i in range(at, min(at + n, len(self.times)))]
        return SimpleNamespace(status=PullStatus.FOUND, decode=lambda: msgs)


def resolve(broker: SimulatedBroker, timestamp: int) -> int:
    async def find_broker_master(name: str, topic: str) -> str:
        return "127.0.0.1:10911"

    client: Any = SimpleNamespace(api=broker, find_broker_master=find_broker_master)
    return asyncio.run(first_stored_since(client, MQ, timestamp, broker.low,
                                          broker.low + len(broker.times)))


def test_the_cases_a_4x_broker_answers_otherwise() -> None:
    # 100 messages at 1000 ms, a batch of 40 sharing 1050, 60 more from 2000.
    times = [1000] * 100 + [1050] * 40 + list(range(2000, 2060))
    low = 500
    for stamp, first in [(1050, 100),   # a 4.x answer is some message of the batch
                         (1001, 100),   # the nearer neighbour is the one before
                         (1049, 100),
                         (999, 0),      # before everything
                         (1000, 0),
                         (2030, 170),
                         (5000, 200)]:  # after everything: the max offset
        assert first_5x(times, low, stamp) == low + first
        for answer in (nearest_4x, first_5x):
            assert resolve(SimulatedBroker(times, low, answer), stamp) == low + first, \
                (answer.__name__, stamp)
    # The 4.x answers really are other offsets in these cases (the check is not idle).
    assert nearest_4x(times, low, 1001) == low + 99
    assert nearest_4x(times, low, 5000) == low + 199
    assert nearest_4x(times, low, 1050) != low + 100


def test_a_right_answer_costs_one_pull() -> None:
    times = list(range(0, 10_000, 3))
    broker = SimulatedBroker(times, 0, first_5x)
    assert resolve(broker, 4_000) == bisect.bisect_left(times, 4_000)
    assert broker.pulls == 1


def test_an_empty_queue_resolves_to_its_max_without_a_pull() -> None:
    broker = SimulatedBroker([], 7, first_5x)
    assert resolve(broker, 123) == 7 and broker.pulls == 0


def test_a_4x_answer_is_checked_when_a_pull_brings_one_message() -> None:
    # Messages over 32 KiB read from disk come one per pull (a 4.x broker's 64 KiB cap): the
    # check asked for the answer and the message before it in one pull, got only the one
    # before, and took a 4.x answer stored before the time as it was.
    times = [50, 100, 200, 300]
    assert nearest_4x(times, 10, 140) == 11  # t=100, before the time
    assert resolve(SimulatedBroker(times, 10, nearest_4x, per_pull=1), 140) == 12
    assert nearest_4x(times, 10, 5000) == 13  # after every message: the last one
    assert resolve(SimulatedBroker(times, 10, nearest_4x, per_pull=1), 5000) == 14


@settings(max_examples=300, deadline=None)
@given(steps=st.lists(st.integers(0, 3), min_size=1, max_size=300),
       low=st.integers(0, 1_000), stamp=st.integers(-2, 400), exact=st.booleans(),
       one_per_pull=st.booleans())
def test_any_queue_and_time(steps: list[int], low: int, stamp: int, exact: bool,
                            one_per_pull: bool) -> None:
    times: list[int] = []
    now = 0
    for step in steps:
        now += step  # steps of 0: several messages stored in the same millisecond
        times.append(now)
    broker = SimulatedBroker(times, low, first_5x if exact else nearest_4x,
                             per_pull=1 if one_per_pull else None)
    assert resolve(broker, stamp) == first_5x(times, low, stamp)
    # A galloping search: a few dozen pulls at most, however long the run of equal times.
    assert broker.pulls <= 4 * max(1, len(times)).bit_length() + 2

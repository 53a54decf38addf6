"""ProcessQueue: offset bookkeeping (concurrent and orderly), counters, expiry, running info."""

from __future__ import annotations

import random
import time

from hypothesis import given, settings
from hypothesis import strategies as st

from rmq_async.consumer.process_queue import ProcessQueue
from rmq_async.protocol.types import (
    PROPERTY_CONSUME_START_TIME,
    PROPERTY_MAX_OFFSET,
    MessageExt,
)


def msg(offset: int, size: int = 10, props: dict[str, str] | None = None) -> MessageExt:
    return MessageExt(
        topic="T", body=b"x" * size, queue_offset=offset, properties=dict(props or {})
    )


def msgs(*offsets: int, size: int = 10) -> list[MessageExt]:
    return [msg(o, size) for o in offsets]


# ---------------------------------------------------------------------- put


def test_put_counts_messages_and_bytes_and_ignores_duplicates() -> None:
    pq = ProcessQueue()
    assert pq.put_messages(msgs(5, 6, 7, size=100)) is True
    assert (pq.msg_count, pq.msg_size) == (3, 300)
    pq.put_messages([msg(6, 999), msg(8, 1)])
    assert (pq.msg_count, pq.msg_size) == (4, 301)
    assert pq.max_span == 3
    assert (pq.min_offset, pq.max_offset) == (5, 8)


def test_put_asks_for_dispatch_once_until_an_orderly_take_finds_nothing() -> None:
    pq = ProcessQueue()
    assert pq.put_messages([]) is False  # nothing cached, nothing to dispatch
    assert pq.put_messages(msgs(1)) is True
    assert pq.put_messages(msgs(2)) is False  # a consume task is already marked
    assert len(pq.take_messages(10)) == 2
    assert pq.put_messages(msgs(3)) is False  # the task has not seen an empty cache yet
    assert len(pq.take_messages(10)) == 1
    assert pq.take_messages(10) == []  # drained: mark cleared
    assert pq.put_messages(msgs(4)) is True


def test_put_records_messages_left_on_broker() -> None:
    pq = ProcessQueue()
    pq.put_messages([msg(10), msg(11, props={PROPERTY_MAX_OFFSET: "50"})])
    assert pq.msg_acc_count == 39


def test_empty_queue_span_and_offsets() -> None:
    pq = ProcessQueue()
    assert pq.max_span == 0
    assert pq.min_offset is None and pq.max_offset is None
    assert not pq.has_temp_message()


# ---------------------------------------------------------------------- concurrent remove


def test_remove_returns_lowest_still_cached_offset() -> None:
    pq = ProcessQueue()
    batch = msgs(10, 11, 12, 13)
    pq.put_messages(batch)
    assert pq.remove_messages([batch[2]]) == 10  # 12 done, 10 still cached
    assert pq.remove_messages([batch[0]]) == 11
    assert pq.remove_messages([batch[1]]) == 13
    assert pq.remove_messages([batch[3]]) == 14  # empty: highest ever cached + 1
    assert (pq.msg_count, pq.msg_size) == (0, 0)


def test_remove_on_empty_cache_commits_nothing() -> None:
    pq = ProcessQueue()
    assert pq.remove_messages(msgs(1)) == -1
    pq.put_messages(msgs(1))
    pq.clear()
    assert pq.remove_messages(msgs(1)) == -1


def test_remove_of_unknown_message_still_reports_the_commit_point() -> None:
    pq = ProcessQueue()
    pq.put_messages(msgs(3, 4))
    assert pq.remove_messages(msgs(99)) == 3
    assert pq.msg_count == 2


def test_remove_subtracts_cached_body_sizes() -> None:
    pq = ProcessQueue()
    pq.put_messages([msg(1, 100), msg(2, 50)])
    pq.remove_messages([msg(1, 0)])  # size counted from the cached copy
    assert pq.msg_size == 50


def test_remove_updates_last_consume_timestamp() -> None:
    pq = ProcessQueue(now=0.0)
    pq.put_messages(msgs(1))
    pq.remove_messages(msgs(1))
    assert pq.last_consume_timestamp > 0.0


@settings(max_examples=200, deadline=None)
@given(st.integers(0, 10**12), st.integers(1, 200), st.randoms(use_true_random=False))
def test_out_of_order_removal_matches_a_naive_model(
    base: int, n: int, rnd: random.Random
) -> None:
    pq = ProcessQueue()
    batch = msgs(*range(base, base + n))
    # Pulled in several increasing chunks.
    i = 0
    while i < n:
        step = rnd.randint(1, 32)
        pq.put_messages(batch[i : i + step])
        i += step
    order = batch[:]
    rnd.shuffle(order)
    remaining = {m.queue_offset for m in batch}
    while order:
        k = rnd.randint(1, 4)
        done, order = order[:k], order[k:]
        for m in done:
            remaining.discard(m.queue_offset)
        expected = min(remaining) if remaining else base + n
        assert pq.remove_messages(done) == expected
        assert pq.msg_count == len(remaining)
        assert pq.max_span == (max(remaining) - min(remaining) if remaining else 0)


def test_interleaved_put_and_remove_keeps_internal_index_small() -> None:
    pq = ProcessQueue()
    for start in range(0, 10_000, 10):
        batch = msgs(*range(start, start + 10))
        pq.put_messages(batch)
        # Finish everything but the oldest message of each batch, then that one too.
        assert pq.remove_messages(batch[1:]) == start
        assert pq.remove_messages(batch[:1]) == start + 10
    assert pq.msg_count == 0
    assert len(pq._offsets) == 0


def test_offset_below_cached_range_is_accepted() -> None:
    pq = ProcessQueue()
    pq.put_messages(msgs(10, 11))
    pq.put_messages(msgs(5))  # not expected from a broker, but must stay ordered
    pq.put_messages(msgs(7))  # lands in the middle
    assert pq.min_offset == 5
    assert [m.queue_offset for m in pq.take_messages(10)] == [5, 7, 10, 11]


# ---------------------------------------------------------------------- expiry


def test_pull_and_lock_expiry_use_monotonic_seconds() -> None:
    pq = ProcessQueue(now=1000.0)
    assert not pq.is_pull_expired(1120.0)
    assert pq.is_pull_expired(1120.5)
    assert pq.is_pull_expired(1010.0, max_idle=5.0)
    assert not pq.is_lock_expired(1030.0)
    assert pq.is_lock_expired(1030.1)
    pq.last_lock_timestamp = 1030.0
    assert not pq.is_lock_expired(1030.1)


def test_clean_expired_messages_returns_leading_expired_only() -> None:
    pq = ProcessQueue()
    now_ms = 1_000_000
    timeout = 60_000
    old = str(now_ms - timeout - 1)
    pq.put_messages(
        [
            msg(1, props={PROPERTY_CONSUME_START_TIME: old}),
            msg(2, props={PROPERTY_CONSUME_START_TIME: old}),
            msg(3, props={PROPERTY_CONSUME_START_TIME: str(now_ms - timeout)}),  # not yet (>)
            msg(4, props={PROPERTY_CONSUME_START_TIME: old}),
        ]
    )
    got = pq.clean_expired_messages(now_ms, timeout)
    assert [m.queue_offset for m in got] == [1, 2]
    assert pq.msg_count == 4  # nothing removed by the call itself


def test_clean_expired_messages_stops_at_unstarted_and_respects_limit() -> None:
    pq = ProcessQueue()
    pq.put_messages([msg(1), msg(2, props={PROPERTY_CONSUME_START_TIME: "0"})])
    assert pq.clean_expired_messages(10**9, 1000) == []  # head not started yet
    pq2 = ProcessQueue()
    pq2.put_messages([msg(i, props={PROPERTY_CONSUME_START_TIME: "0"}) for i in range(40)])
    assert [m.queue_offset for m in pq2.clean_expired_messages(10**9, 1000)] == list(range(16))
    assert len(pq2.clean_expired_messages(10**9, 1000, limit=3)) == 3
    pq2.remove_messages(msgs(0, 1))
    assert pq2.clean_expired_messages(10**9, 1000, limit=1)[0].queue_offset == 2


def test_clean_expired_messages_treats_garbage_start_time_as_not_expired() -> None:
    pq = ProcessQueue()
    pq.put_messages([msg(1, props={PROPERTY_CONSUME_START_TIME: "soon"})])
    assert pq.clean_expired_messages(10**9, 1) == []


# ---------------------------------------------------------------------- orderly


def test_take_and_commit_in_offset_order() -> None:
    pq = ProcessQueue()
    pq.put_messages(msgs(100, 101, 102, 103, 104, size=10))
    first = pq.take_messages(2)
    assert [m.queue_offset for m in first] == [100, 101]
    assert pq.cached_count == 3 and pq.consuming_count == 2
    assert pq.msg_count == 5  # taken messages still count until committed
    assert pq.commit() == 102
    assert (pq.msg_count, pq.msg_size, pq.consuming_count) == (3, 30, 0)
    assert pq.commit() == -1  # nothing taken
    assert [m.queue_offset for m in pq.take_messages(10)] == [102, 103, 104]
    assert pq.commit() == 105
    assert (pq.msg_count, pq.msg_size) == (0, 0)


def test_commit_through_an_offset_leaves_the_later_taken_ones_taken() -> None:
    pq = ProcessQueue()
    pq.put_messages(msgs(100, 101, 102, 103, size=10))
    pq.take_messages(3)
    assert pq.commit(through=99) == -1  # nothing taken at or below it
    assert pq.commit(through=101) == 102
    assert (pq.msg_count, pq.msg_size, pq.consuming_count) == (2, 20, 1)
    assert pq.commit(through=200) == 103  # everything taken, as commit() does
    assert (pq.msg_count, pq.msg_size, pq.consuming_count) == (1, 10, 0)


def test_make_message_to_consume_again_puts_them_first() -> None:
    pq = ProcessQueue()
    pq.put_messages(msgs(1, 2, 3, 4))
    taken = pq.take_messages(3)
    pq.make_message_to_consume_again(taken[1:])  # 2 and 3 back; 1 stays taken
    assert pq.consuming_count == 1
    assert pq.msg_count == 4
    assert pq.commit() == 2
    assert [m.queue_offset for m in pq.take_messages(10)] == [2, 3, 4]


def test_rollback_returns_every_taken_message() -> None:
    pq = ProcessQueue()
    pq.put_messages(msgs(1, 2, 3))
    pq.take_messages(2)
    pq.rollback()
    assert pq.consuming_count == 0 and pq.msg_count == 3
    assert [m.queue_offset for m in pq.take_messages(10)] == [1, 2, 3]


def test_duplicate_of_a_taken_message_is_not_cached_again() -> None:
    pq = ProcessQueue()
    pq.put_messages(msgs(1, 2))
    pq.take_messages(1)
    pq.put_messages(msgs(1))
    assert pq.msg_count == 2 and pq.cached_count == 1


def test_try_unlock_times() -> None:
    pq = ProcessQueue()
    pq.inc_try_unlock_times()
    pq.inc_try_unlock_times()
    assert pq.try_unlock_times == 2


# ---------------------------------------------------------------------- running info


def test_to_info_has_java_process_queue_info_keys_and_values() -> None:
    pq = ProcessQueue()
    pq.put_messages(msgs(7, 8, 9, size=1024 * 1024))
    before = int(time.time() * 1000)
    pq.take_messages(1)
    pq.locked = True
    pq.dropped = True
    info = pq.to_info(commit_offset=7)
    after = int(time.time() * 1000)
    assert set(info) == {
        "commitOffset", "cachedMsgMinOffset", "cachedMsgMaxOffset", "cachedMsgCount",
        "cachedMsgSizeInMiB", "transactionMsgMinOffset", "transactionMsgMaxOffset",
        "transactionMsgCount", "locked", "tryUnlockTimes", "lastLockTimestamp", "droped",
        "lastPullTimestamp", "lastConsumeTimestamp",
    }
    assert info["commitOffset"] == 7
    assert (info["cachedMsgMinOffset"], info["cachedMsgMaxOffset"]) == (8, 9)
    assert info["cachedMsgCount"] == 2
    assert info["cachedMsgSizeInMiB"] == 3
    assert (info["transactionMsgMinOffset"], info["transactionMsgMaxOffset"]) == (7, 7)
    assert info["transactionMsgCount"] == 1
    assert info["locked"] is True and info["droped"] is True
    # take_messages just touched the consume timestamp: wall clock "now", within rounding.
    assert before - 5 <= info["lastConsumeTimestamp"] <= after + 5


def test_to_info_converts_monotonic_stamps_to_wall_clock() -> None:
    pq = ProcessQueue()
    pq.last_pull_timestamp = time.monotonic() - 60.0
    info = pq.to_info(-1)
    age_ms = time.time() * 1000 - info["lastPullTimestamp"]
    assert 59_000 <= age_ms <= 61_000
    empty = ProcessQueue().to_info(0)
    assert empty["cachedMsgCount"] == 0 and empty["cachedMsgMinOffset"] == 0

"""``ProcessQueue``: the client-side cache of pulled, not yet acknowledged messages of one queue.

Mirrors Java's ``ProcessQueue``. The pull loop puts messages in, the consume side takes them out,
and what is left decides the queue's committable offset: a concurrent consumer may finish
messages in any order, yet the offset it commits never passes a message that is still cached.

Threading: a ``ProcessQueue`` belongs to one event loop and is only touched from that loop's
thread (pull task, consume workers, rebalancer). Its methods never await, so each call is atomic
with respect to the other tasks and no lock is needed. Listener code running in worker threads
must not call it.

Time: ``last_pull_timestamp``, ``last_consume_timestamp`` and ``last_lock_timestamp`` are
``time.monotonic()`` seconds (immune to wall-clock jumps); :meth:`to_info` converts them to
wall-clock milliseconds for running info.

Data structure: messages live in a dict keyed by queue offset. A deque keeps those offsets in
ascending order; entries removed from the dict are dropped from the deque lazily, once they reach
either end. Pulled messages arrive in increasing offset order, so the common path (append at the
right, remove anywhere, read the smallest and largest live offset) is amortised O(1) per message;
an offset that lands in the middle (not expected from the broker) triggers an O(n log n) rebuild.

Sink subscriptions cache whole pulls as :class:`~rmq_async.protocol.stored.StoredChunk` entries
(:meth:`put_chunk`): one entry per pull, filed under its first offset, counting all of its
messages and their body bytes, and removed in one step when its batch is written
(:meth:`remove_chunk`). The committable offset and the span see a chunk's whole offset range.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Iterable
from typing import Any

from rmq_async.protocol import message as message_codec
from rmq_async.protocol.stored import StoredChunk
from rmq_async.protocol.types import (
    PROPERTY_CONSUME_START_TIME,
    PROPERTY_MAX_OFFSET,
    MessageExt,
)

__all__ = [
    "PULL_MAX_IDLE_TIME",
    "REBALANCE_LOCK_INTERVAL",
    "REBALANCE_LOCK_MAX_LIVE_TIME",
    "ProcessQueue",
]

PULL_MAX_IDLE_TIME = 120.0
"""Seconds without a pull after which the rebalancer recreates a queue (Java pullMaxIdleTime)."""
REBALANCE_LOCK_MAX_LIVE_TIME = 30.0
"""Seconds after which an unrenewed orderly lock counts as lost (Java lockMaxLiveTime)."""
REBALANCE_LOCK_INTERVAL = 20.0
"""Seconds between orderly lock renewals (Java lockInterval)."""

_MiB = 1024 * 1024


def _body_size(msg: MessageExt) -> int:
    return len(msg.body)


class ProcessQueue:
    """Cached messages of one message queue, ordered by queue offset."""

    __slots__ = (
        "__weakref__",  # the sink service tells one assignment of a queue from the next
        "_consuming",
        "_msgs",
        "_offsets",
        "abandoned",
        "consuming",
        "dropped",
        "expired_sent_back",
        "last_consume_timestamp",
        "last_lock_timestamp",
        "last_pull_timestamp",
        "locked",
        "msg_acc_count",
        "msg_count",
        "msg_size",
        "offset_fixed",
        "ordered",
        "queue_offset_max",
        "try_unlock_times",
    )

    def __init__(self, *, now: float | None = None) -> None:
        if now is None:
            now = time.monotonic()
        # Messages, and (sink subscriptions) stored chunks under their first offset.
        self._msgs: dict[int, MessageExt | StoredChunk] = {}
        self._offsets: deque[int] = deque()
        # Orderly mode: messages handed to the listener and not yet committed.
        self._consuming: dict[int, MessageExt] = {}
        self.msg_count = 0
        """Messages held: cached plus (orderly) taken but not committed."""
        self.msg_size = 0
        """Body bytes of the messages counted in ``msg_count``."""
        self.queue_offset_max = 0
        """Highest offset ever put (Java ``queueOffsetMax``)."""
        self.msg_acc_count = 0
        """Messages still on the broker after the last pulled one (Java ``msgAccCnt``)."""
        self.dropped = False
        self.abandoned = False
        """Orderly: given up without waiting for its batch any longer (the broker's lock
        lapsed first): what that batch commits is no longer this client's to keep."""
        self.offset_fixed = False
        """Dropped by its pull loop on OFFSET_ILLEGAL (an orderly queue locked at the broker),
        its offset fixed: for the rebalance to release and take again."""
        self.expired_sent_back = 0
        """Messages the consume-timeout cleaner sent back and removed (concurrent mode): a
        worker whose chunk they belong to must not hand them to the listener any more."""
        self.last_pull_timestamp = now
        self.last_consume_timestamp = now
        self.locked = False
        self.last_lock_timestamp = now
        self.try_unlock_times = 0
        self.consuming = False
        """Orderly: a consume task is (or is about to be) working on this queue."""
        self.ordered: bool | None = None
        """Whether its topic was consumed orderly when the rebalance took the queue (None: not
        taken by a rebalance). A topic subscribed again in the other mode, or a retry queue
        whose consumer's subscriptions became all orderly or no longer are, is taken anew."""

    # ------------------------------------------------------------------ internals

    def _trim(self) -> None:
        offsets = self._offsets
        msgs = self._msgs
        while offsets and offsets[0] not in msgs:
            offsets.popleft()
        while offsets and offsets[-1] not in msgs:
            offsets.pop()

    def _insert(self, offset: int, msg: MessageExt | StoredChunk) -> None:
        """Cache ``msg`` under a fresh offset (the caller checked it is not cached)."""
        offsets = self._offsets
        self._msgs[offset] = msg
        if not offsets or offset > offsets[-1]:
            offsets.append(offset)
        elif offset < offsets[0]:
            offsets.appendleft(offset)
        else:
            self._offsets = deque(sorted(self._msgs))

    # ------------------------------------------------------------------ pull side

    def put_messages(self, msgs: Iterable[MessageExt]) -> bool:
        """Cache freshly pulled messages; an offset already cached is ignored.

        Returns ``True`` when the caller should hand the queue to a consume task: the cache holds
        messages and no consume task is marked as working on it (Java ``dispatchToConsume``; it
        matters for orderly consumption, where one task drains a queue and
        :meth:`take_messages` clears the mark once the cache is empty).
        """
        if type(msgs) is not list:
            msgs = list(msgs)
        msgs_map = self._msgs
        consuming = self._consuming
        offsets = self._offsets
        top = self.queue_offset_max
        # The common case, a chunk above everything cached, in one step; the rest (a message
        # consumed again lands below) one by one.
        i, run, size = message_codec.cache_run(msgs, msgs_map, consuming,
                                               offsets[-1] if offsets else -1)
        added = len(run)
        if added:
            offsets.extend(run)
            if run[-1] > top:
                top = run[-1]
        for msg in msgs[i:] if i < len(msgs) else ():
            offset = msg.queue_offset
            if offset in msgs_map or offset in consuming:
                continue
            offsets = self._offsets
            if offsets and offset <= offsets[-1]:
                self._insert(offset, msg)  # out of order (a message consumed again)
            else:
                msgs_map[offset] = msg
                offsets.append(offset)
            added += 1
            size += len(msg.body)
            if offset > top:
                top = offset
        self.queue_offset_max = top
        self.msg_count += added
        self.msg_size += size
        if msgs:
            last = msgs[-1]
            max_offset = last.get_property(PROPERTY_MAX_OFFSET)
            if max_offset is not None:
                try:
                    behind = int(max_offset) - last.queue_offset
                except ValueError:
                    behind = 0
                if behind > 0:
                    self.msg_acc_count = behind
        dispatch = False
        if msgs_map and not self.consuming:
            self.consuming = True
            dispatch = True
        return dispatch

    @property
    def max_span(self) -> int:
        """Largest minus smallest cached offset (0 when empty); flow control in concurrent mode."""
        offsets = self._offsets
        if not offsets:
            return 0
        return self._top() - offsets[0]

    def _top(self) -> int:
        """The highest cached offset, the last offset of a stored chunk included (not empty)."""
        last = self._offsets[-1]
        entry = self._msgs.get(last)
        return entry.last_offset if type(entry) is StoredChunk else last

    @property
    def cached_count(self) -> int:
        """Messages waiting in the cache (orderly: not counting those being consumed)."""
        return self.msg_count - len(self._consuming)

    @property
    def min_offset(self) -> int | None:
        """Smallest cached offset, or ``None``."""
        return self._offsets[0] if self._offsets else None

    @property
    def max_offset(self) -> int | None:
        """Largest cached offset, or ``None``."""
        return self._top() if self._offsets else None

    def has_temp_message(self) -> bool:
        return bool(self._msgs)

    def contains(self, msg: MessageExt) -> bool:
        return msg.queue_offset in self._msgs

    def is_pull_expired(self, now: float, max_idle: float = PULL_MAX_IDLE_TIME) -> bool:
        """No pull for more than ``max_idle`` seconds (``now`` from ``time.monotonic()``)."""
        return now - self.last_pull_timestamp > max_idle

    def put_chunk(self, chunk: StoredChunk) -> bool:
        """Cache a sink's stored chunk as one entry (see the module docstring); a chunk whose
        first offset is already cached is ignored. Returns what :meth:`put_messages` returns."""
        first = chunk.first_offset
        msgs_map = self._msgs
        if first not in msgs_map and first not in self._consuming:
            offsets = self._offsets
            if offsets and first <= offsets[-1]:
                self._insert(first, chunk)
            else:
                msgs_map[first] = chunk
                offsets.append(first)
            self.msg_count += chunk.count
            self.msg_size += chunk.size
            if chunk.last_offset > self.queue_offset_max:
                self.queue_offset_max = chunk.last_offset
        if chunk.max_offset > chunk.last_offset:
            self.msg_acc_count = chunk.max_offset - chunk.last_offset
        if msgs_map and not self.consuming:
            self.consuming = True
            return True
        return False

    def remove_chunk(self, chunk: StoredChunk) -> int:
        """Forget a stored chunk whose batch is written; returns what :meth:`remove_messages`
        returns (the offset that may now be committed, or ``-1``)."""
        self.last_consume_timestamp = time.monotonic()
        msgs_map = self._msgs
        if not msgs_map:
            return -1
        if msgs_map.get(chunk.first_offset) is chunk:
            del msgs_map[chunk.first_offset]
            self.msg_count -= chunk.count
            self.msg_size = 0 if self.msg_count == 0 else self.msg_size - chunk.size
            self._trim()
        if self._offsets:
            return self._offsets[0]
        return self.queue_offset_max + 1

    def unpack_chunk(self, chunk: StoredChunk, msgs: list[MessageExt]) -> bool:
        """Cache ``msgs`` (the chunk decoded) in place of ``chunk``, so that they can be
        acknowledged one by one; False when the chunk is not cached (nothing changes)."""
        msgs_map = self._msgs
        if msgs_map.get(chunk.first_offset) is not chunk:
            return False
        del msgs_map[chunk.first_offset]
        self.msg_count -= chunk.count
        self.msg_size -= chunk.size
        for msg in msgs:
            if msg.queue_offset not in msgs_map:
                msgs_map[msg.queue_offset] = msg
                self.msg_count += 1
                self.msg_size += len(msg.body)
        self._offsets = deque(sorted(msgs_map))  # rare (a failed write): a rebuild is fine
        return True

    # ------------------------------------------------------------------ concurrent consume

    def remove_messages(self, msgs: Iterable[MessageExt]) -> int:
        """Forget consumed messages and return the offset that may now be committed.

        That is the smallest offset still cached, or, when nothing is left, the highest offset
        ever cached plus one. ``-1`` means "nothing to commit": the cache was already empty when
        called (for example after :meth:`clear`), as in Java. Messages not cached are skipped.
        """
        self.last_consume_timestamp = time.monotonic()
        msgs_map = self._msgs
        if not msgs_map:
            return -1
        removed, size = message_codec.uncache(msgs if type(msgs) is list else list(msgs),
                                              msgs_map, StoredChunk)
        if removed:
            self.msg_count -= removed
            self.msg_size = 0 if self.msg_count == 0 else self.msg_size - size
            self._trim()
        if self._offsets:
            return self._offsets[0]
        return self.queue_offset_max + 1

    def clean_expired_messages(
        self, now_ms: int, consume_timeout_ms: int, limit: int = 16
    ) -> list[MessageExt]:
        """Leading cached messages whose consumption started more than the timeout ago.

        Java ``cleanExpiredMsg`` (concurrent mode): looks at the cached messages in offset order
        and stops at the first one that has no ``CONSUME_START_TIME`` or is not expired; at most
        ``limit`` are returned. Nothing is removed here: the caller sends each back to the broker
        and then calls :meth:`remove_messages` for it.
        """
        result: list[MessageExt] = []
        msgs_map = self._msgs
        for offset in self._offsets:
            if len(result) >= limit:
                break
            msg = msgs_map.get(offset)
            if msg is None:
                continue
            if type(msg) is StoredChunk:
                break  # a sink's chunk has no consume start time
            assert isinstance(msg, MessageExt)
            started = msg.get_property(PROPERTY_CONSUME_START_TIME)
            if not started:
                break
            try:
                started_ms = int(started)
            except ValueError:
                break
            if now_ms - started_ms <= consume_timeout_ms:
                break
            result.append(msg)
        return result

    # ------------------------------------------------------------------ orderly consume

    def take_messages(self, batch_size: int) -> list[MessageExt]:
        """Orderly: move up to ``batch_size`` messages, lowest offsets first, to "consuming".

        An empty result also clears the :attr:`consuming` mark, so that the next
        :meth:`put_messages` asks for a new consume task.
        """
        self.last_consume_timestamp = time.monotonic()
        result: list[MessageExt] = []
        msgs_map = self._msgs
        offsets = self._offsets
        consuming = self._consuming
        while offsets and len(result) < batch_size:
            offset = offsets.popleft()
            msg = msgs_map.pop(offset, None)
            if msg is None:
                continue
            assert isinstance(msg, MessageExt)  # orderly queues hold no stored chunks
            consuming[offset] = msg
            result.append(msg)
        self._trim()
        if not result:
            self.consuming = False
        return result

    def commit(self, through: int | None = None) -> int:
        """Orderly: the taken messages are done; with ``through``, only those at offsets up to
        it (the others stay taken). Returns the highest offset done + 1, or ``-1``."""
        consuming = self._consuming
        if through is not None and consuming and max(consuming) > through:
            done = [offset for offset in consuming if offset <= through]
            if not done:
                return -1
            self._remove_taken(done)
            return max(done) + 1
        if not consuming:
            return -1
        last = max(consuming)
        self.msg_count -= len(consuming)
        if self.msg_count == 0:
            self.msg_size = 0
        else:
            self.msg_size -= sum(_body_size(m) for m in consuming.values())
        consuming.clear()
        return last + 1

    def rollback(self) -> None:
        """Orderly: put every taken message back into the cache."""
        taken = self._consuming
        self._consuming = {}
        # Highest first: each one then lands at the left end of the offset deque.
        for offset in sorted(taken, reverse=True):
            if offset not in self._msgs:
                self._insert(offset, taken[offset])

    def make_message_to_consume_again(self, msgs: Iterable[MessageExt]) -> None:
        """Orderly: put these taken messages back so they are taken again next."""
        # Highest first: each one then lands at the left end of the offset deque.
        for msg in sorted(msgs, key=lambda m: m.queue_offset, reverse=True):
            offset = msg.queue_offset
            was_taken = self._consuming.pop(offset, None) is not None
            if offset in self._msgs:
                continue
            self._insert(offset, msg)
            if not was_taken:
                self.msg_count += 1
                self.msg_size += _body_size(msg)

    def forget_taken(self, msgs: Iterable[MessageExt]) -> None:
        """Orderly: these taken messages are done without a commit (sent to the dead-letter
        queue while earlier ones wait for theirs): a rollback does not bring them back."""
        self._remove_taken(msg.queue_offset for msg in msgs)

    def _remove_taken(self, offsets: Iterable[int]) -> None:
        """Take these offsets out of "consuming" and out of the cache's counts."""
        consuming = self._consuming
        for offset in offsets:
            msg = consuming.pop(offset, None)
            if msg is not None:
                self.msg_count -= 1
                self.msg_size -= _body_size(msg)

    @property
    def consuming_count(self) -> int:
        """Orderly: messages taken and not yet committed."""
        return len(self._consuming)

    def is_lock_expired(self, now: float, max_live: float = REBALANCE_LOCK_MAX_LIVE_TIME) -> bool:
        """The broker lock was not renewed for more than ``max_live`` seconds (monotonic)."""
        return now - self.last_lock_timestamp > max_live

    def inc_try_unlock_times(self) -> None:
        self.try_unlock_times += 1

    # ------------------------------------------------------------------ reset

    def clear(self) -> None:
        """Forget every message (offset reset). Offsets removed afterwards commit nothing."""
        self._msgs.clear()
        self._offsets.clear()
        self._consuming.clear()
        self.msg_count = 0
        self.msg_size = 0
        self.queue_offset_max = 0

    # ------------------------------------------------------------------ running info

    def to_info(self, commit_offset: int) -> dict[str, Any]:
        """Java ``ProcessQueueInfo`` for GET_CONSUMER_RUNNING_INFO (timestamps in wall ms)."""
        wall_ms = time.time() * 1000.0
        mono = time.monotonic()

        def wall(ts: float) -> int:
            return int(wall_ms - (mono - ts) * 1000.0)

        offsets = self._offsets
        consuming = self._consuming
        return {
            "commitOffset": commit_offset,
            "cachedMsgMinOffset": offsets[0] if offsets else 0,
            "cachedMsgMaxOffset": self._top() if offsets else 0,
            "cachedMsgCount": self.msg_count - len(consuming),
            "cachedMsgSizeInMiB": self.msg_size // _MiB,
            "transactionMsgMinOffset": min(consuming) if consuming else 0,
            "transactionMsgMaxOffset": max(consuming) if consuming else 0,
            "transactionMsgCount": len(consuming),
            "locked": self.locked,
            "tryUnlockTimes": self.try_unlock_times,
            "lastLockTimestamp": wall(self.last_lock_timestamp),
            "droped": self.dropped,
            "lastPullTimestamp": wall(self.last_pull_timestamp),
            "lastConsumeTimestamp": wall(self.last_consume_timestamp),
        }

    def __repr__(self) -> str:
        return (
            f"<ProcessQueue count={self.msg_count} size={self.msg_size} span={self.max_span} "
            f"min={self.min_offset} max={self.max_offset} dropped={self.dropped} "
            f"locked={self.locked}>"
        )

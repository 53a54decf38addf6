"""Consumer lag per assigned queue: the broker's max offset minus the committed offset.

A :class:`LagMonitor` belongs to a started consumer. Its task (owned by the consumer, ended by
``stop()``) refreshes the figures every ``persist_offset_interval`` seconds, the cadence at
which committed offsets reach the broker, so the lag read here is the one ``mqadmin
consumerProgress`` shows (its ``Diff``) give or take what was acknowledged since the last
round. Each round asks every assigned queue's master broker for its max offset
(GET_MAX_OFFSET); the committed offset is the consumer's own (the offset store's in-memory
value, which is what the persist round sends). A broker that does not answer keeps that
queue's previous figures and the failure is logged (``lag.refresh_failed``). Figures belong to
the queue's current hold: a queue given up and taken again between two rounds shows nothing
until the next round reads it anew.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import structlog

from rmq_async.client.errors import MQClientError
from rmq_async.protocol.errors import ProtocolError
from rmq_async.protocol.types import MessageQueue
from rmq_async.remoting.errors import RemotingError

if TYPE_CHECKING:
    from rmq_async.consumer.process_queue import ProcessQueue
    from rmq_async.consumer.runtime import ConsumerRuntime

log = structlog.get_logger(__name__)

__all__ = ["LagMonitor", "QueueLag"]


@dataclass(frozen=True, slots=True)
class QueueLag:
    """The lag of one assigned queue, as of ``updated_at`` (``time.time()`` seconds).

    ``committed_offset`` is ``None`` while the group has no offset for the queue yet (nothing
    acknowledged and nothing stored on the broker); ``lag`` is ``None`` then too.
    ``cached_messages`` is how many pulled messages the consumer holds for the queue (pulled,
    not yet acknowledged) when the figures were read.
    """

    max_offset: int
    committed_offset: int | None
    lag: int | None
    cached_messages: int
    updated_at: float


class LagMonitor:
    """Refreshes and keeps the :class:`QueueLag` of every queue the consumer holds."""

    def __init__(self, rt: ConsumerRuntime) -> None:
        self._rt = rt
        # Each queue's figures with the ProcessQueue they were read for: a queue given up and
        # taken again gets a new one, and the old figures are not shown for it.
        self._lags: dict[MessageQueue, tuple[ProcessQueue, QueueLag]] = {}
        self._lock = asyncio.Lock()
        self.rounds = 0

    def snapshot(self) -> dict[MessageQueue, QueueLag]:
        """The last figures of the queues assigned now (queues given up are left out, and so
        are queues taken again since their figures were read)."""
        # Copies first (atomic in CPython): a metrics endpoint reads this from its own thread.
        held = dict(self._rt.process_queues)
        return {mq: lag for mq, (pq, lag) in dict(self._lags).items() if held.get(mq) is pq}

    async def run(self) -> None:
        """Refresh every ``persist_offset_interval`` seconds until cancelled."""
        interval = self._rt.options.persist_offset_interval
        while True:
            try:
                await self.refresh()
            except Exception as exc:  # a round must never end the loop
                log.error("lag.round_failed", group=self._rt.group,
                          error=f"{type(exc).__name__}: {exc}", exc_info=exc)
            await asyncio.sleep(interval)

    async def refresh(self, queues: Iterable[MessageQueue] | None = None) -> dict[MessageQueue, QueueLag]:
        """Read the max offsets of ``queues`` (default: every assigned queue) now."""
        rt = self._rt
        async with self._lock:
            chosen = sorted(set(rt.process_queues) if queues is None else set(queues))
            # (return_exceptions: a failure nobody expected fails its queue only; it must not
            # leave the other requests running with nothing waiting for them.)
            answers = await asyncio.gather(*(self._max_offset(mq) for mq in chosen),
                                           return_exceptions=True)
            results: list[int | None] = []
            for mq, answer in zip(chosen, answers, strict=True):
                if isinstance(answer, BaseException):
                    if isinstance(answer, asyncio.CancelledError):
                        raise answer
                    log.error("lag.refresh_failed", group=rt.group, queue=str(mq),
                              error=f"{type(answer).__name__}: {answer}", exc_info=answer)
                    answer = None
                results.append(answer)
            now = time.time()
            for mq, max_offset in zip(chosen, results, strict=True):
                pq = rt.process_queues.get(mq)
                if max_offset is None or pq is None:
                    continue
                committed: int | None = rt.offset_store.read_memory(mq)
                if committed is not None and committed < 0:
                    committed = None
                lag = None if committed is None else max(0, max_offset - committed)
                self._lags[mq] = (pq, QueueLag(max_offset, committed, lag, pq.msg_count, now))
            for mq in [m for m, (pq, _) in self._lags.items() if rt.process_queues.get(m) is not pq]:
                del self._lags[mq]
            self.rounds += 1
            return self.snapshot()

    async def _max_offset(self, mq: MessageQueue) -> int | None:
        rt = self._rt
        try:
            addr = await rt.instance.find_broker_master(mq.broker_name, mq.topic)
            return await rt.instance.api.get_max_offset(addr, mq)
        except (MQClientError, RemotingError, ProtocolError) as exc:
            # (ProtocolError: an answer that does not decode, an expected failure too; the
            # gather in refresh() takes any other, logged as an error.)
            log.warning("lag.refresh_failed", group=rt.group, queue=str(mq), error=str(exc))
            return None

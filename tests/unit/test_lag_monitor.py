"""LagMonitor: figures per held queue, refreshed from the brokers' max offsets."""

from __future__ import annotations

from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any, cast

from rmq_async.client.errors import MQBrokerError
from rmq_async.consumer.lag import LagMonitor
from rmq_async.consumer.process_queue import ProcessQueue
from rmq_async.protocol.types import MessageQueue

Q0 = MessageQueue("t", "broker-a", 0)
Q1 = MessageQueue("t", "broker-a", 1)


@dataclass
class _Api:
    max_offsets: dict[MessageQueue, int]
    failing: set[MessageQueue] = field(default_factory=set)

    async def get_max_offset(self, addr: str, mq: MessageQueue) -> int:
        if mq in self.failing:
            raise MQBrokerError(1, "no answer", addr=addr)
        return self.max_offsets[mq]


class _Instance:
    def __init__(self, api: _Api) -> None:
        self.api = api

    async def find_broker_master(self, broker_name: str, topic: str) -> str:
        return "127.0.0.1:10911"


class _OffsetStore:
    def __init__(self, offsets: dict[MessageQueue, int]) -> None:
        self.offsets = offsets

    def read_memory(self, mq: MessageQueue) -> int | None:
        return self.offsets.get(mq)


def _runtime(api: _Api, offsets: dict[MessageQueue, int]) -> Any:
    return SimpleNamespace(
        group="g", process_queues={}, offset_store=_OffsetStore(offsets),
        instance=_Instance(api), options=SimpleNamespace(persist_offset_interval=5.0))


async def test_lag_is_max_offset_minus_committed_per_held_queue() -> None:
    api = _Api({Q0: 100, Q1: 7})
    rt = _runtime(api, {Q0: 60})
    rt.process_queues.update({Q0: ProcessQueue(), Q1: ProcessQueue()})
    lags = await LagMonitor(cast(Any, rt)).refresh()
    assert (lags[Q0].max_offset, lags[Q0].committed_offset, lags[Q0].lag) == (100, 60, 40)
    assert (lags[Q1].committed_offset, lags[Q1].lag) == (None, None)


async def test_a_queue_taken_again_does_not_show_the_figures_of_its_earlier_hold() -> None:
    api = _Api({Q0: 100, Q1: 50})
    rt = _runtime(api, {Q0: 60, Q1: 10})
    rt.process_queues.update({Q0: ProcessQueue(), Q1: ProcessQueue()})
    monitor = LagMonitor(cast(Any, rt))
    await monitor.refresh()
    # Rebalance gives Q0 up and takes it again (a new ProcessQueue) between two rounds; its
    # offset moved meanwhile (another member consumed from it).
    rt.process_queues[Q0] = ProcessQueue()
    rt.offset_store.offsets[Q0] = 95
    shown = monitor.snapshot()
    assert Q0 not in shown, "figures read for the earlier hold shown for the new one"
    assert shown[Q1].lag == 40
    # A round whose read of Q0 fails keeps nothing stale for it either.
    api.failing.add(Q0)
    assert Q0 not in await monitor.refresh()
    api.failing.clear()
    assert (await monitor.refresh())[Q0].lag == 5


async def test_a_queue_given_up_is_left_out() -> None:
    api = _Api({Q0: 100})
    rt = _runtime(api, {Q0: 60})
    rt.process_queues[Q0] = ProcessQueue()
    monitor = LagMonitor(cast(Any, rt))
    await monitor.refresh()
    del rt.process_queues[Q0]
    assert monitor.snapshot() == {}
    assert await monitor.refresh() == {}


async def test_an_answer_that_does_not_decode_fails_only_its_queue() -> None:
    """A garbled GET_MAX_OFFSET answer (ProtocolError) escaped the per-queue catch: the whole
    refresh raised and the other queues' requests were left running unowned."""
    import asyncio

    from rmq_async.protocol.errors import ProtocolError

    class _Garbled(_Api):
        async def get_max_offset(self, addr: str, mq: MessageQueue) -> int:
            if mq == Q0:
                raise ProtocolError("header field 'offset' is not a number")
            await asyncio.sleep(0.05)
            return self.max_offsets[mq]

    rt = _runtime(_Garbled({Q1: 7}), {Q1: 5})
    rt.process_queues.update({Q0: ProcessQueue(), Q1: ProcessQueue()})
    lags = await LagMonitor(cast(Any, rt)).refresh()
    assert Q0 not in lags and lags[Q1].lag == 2

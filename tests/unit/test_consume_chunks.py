"""The concurrent service settles each pulled chunk once, whatever the listener batch size."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import pytest

from rmq_async.consumer.consume import ConcurrentConsumeService, ListenerAdapter
from rmq_async.consumer.options import ConsumerOptions, MessageModel
from rmq_async.consumer.process_queue import ProcessQueue
from rmq_async.consumer.results import ConsumeContext, ConsumeResult
from rmq_async.consumer.stats import ConsumerStats
from rmq_async.consumer.subscriptions import Subscription, Subscriptions
from rmq_async.consumer.tasks import TaskOwner
from rmq_async.protocol.filter import build_subscription
from rmq_async.protocol.types import PROPERTY_CONSUME_START_TIME, MessageExt, MessageQueue
from tests.helpers import NotAnException

MQ = MessageQueue("T", "broker-a", 0)


class CountingProcessQueue(ProcessQueue):
    removals = 0

    def remove_messages(self, msgs: Any) -> int:
        self.removals += 1
        return super().remove_messages(msgs)


class Harness:
    def __init__(self, listener: Callable[..., Any], **opts: Any) -> None:
        self.options = ConsumerOptions.from_kwargs("G", consume_concurrency=2, **opts)
        self.stats = ConsumerStats()
        self.updates: list[int] = []
        self.sent_back: list[tuple[int, int]] = []
        self.send_back_ok = True
        self.adapter = ListenerAdapter(listener)
        self.subscriptions = Subscriptions("G", MessageModel.CLUSTERING)
        self.subscriptions.add(Subscription("T", "*", build_subscription("T", "*"),
                                            listener=self.adapter))
        self.pq = CountingProcessQueue()
        # The narrow things the service uses of a started consumer (a ConsumerRuntime).
        rt = SimpleNamespace(
            tasks=TaskOwner("consumer[G]"),
            group="G", options=self.options, stats=self.stats, retry_topic="%RETRY%G",
            offset_store=SimpleNamespace(update=lambda mq, off, increase_only: self.updates.append(off)),
            subscriptions=self.subscriptions,
            send_message_back=self._send_back,
            process_queues={MQ: self.pq},
        )
        self.service = ConcurrentConsumeService(rt)  # type: ignore[arg-type]
        self.recorded = 0
        real_record = self.stats.record_consume

        def counting_record(*a: Any, **kw: Any) -> None:
            self.recorded += 1
            real_record(*a, **kw)

        self.stats.record_consume = counting_record  # type: ignore[method-assign]

    async def _send_back(self, msg: MessageExt, level: int) -> bool:
        if self.send_back_ok:
            self.sent_back.append((msg.queue_offset, level))
        return self.send_back_ok

    @property
    def removals(self) -> int:
        return self.pq.removals

    def start_chunk(self, n: int, first: int = 0) -> list[MessageExt]:
        """Cache ``n`` messages from offset ``first``, start the service and hand it the chunk
        (the caller closes the service)."""
        msgs = [MessageExt("T", f"m{i}".encode(), 0, i) for i in range(first, first + n)]
        self.pq.put_messages(msgs)
        self.service.start()
        self.service.submit(msgs, self.pq, MQ)
        return msgs

    async def run_chunk(self, n: int, first: int = 0, *,
                        until: Callable[[], bool] | None = None) -> list[MessageExt]:
        """Consume one chunk until ``until()`` (default: something was removed), then
        drain and close the service."""
        done = until or (lambda: self.removals != 0)
        try:
            msgs = self.start_chunk(n, first)
            async with asyncio.timeout(5):
                while self.service.queued or not done():
                    await asyncio.sleep(0.005)
                await self.service.wait_idle()
        finally:
            await self.service.aclose()
        return msgs


async def test_one_removal_offset_update_and_stats_update_per_chunk() -> None:
    calls: list[list[int]] = []

    async def listener(msgs: list[MessageExt]) -> ConsumeResult:
        calls.append([m.queue_offset for m in msgs])
        assert msgs[0].get_property(PROPERTY_CONSUME_START_TIME)
        return ConsumeResult.SUCCESS

    h = Harness(listener)  # consume_message_batch_max_size=1, the default
    await h.run_chunk(32)
    assert calls == [[i] for i in range(32)]  # one call per message, in offset order
    assert (h.removals, h.updates, h.recorded) == (1, [32], 1)
    snap = h.stats.snapshot("T")
    assert snap["consumeOKTPS"] > 0 and snap["consumeFailedTPS"] == 0


@pytest.mark.parametrize("fail", [False, True])
async def test_a_result_for_a_dropped_queue_counts_its_time_only(fail: bool) -> None:
    """A rebalance gave the queue away during the calls: nothing is committed or sent back and
    the messages come again, so they are neither consumed nor failed yet (Java records the
    consume RT and skips processConsumeResult, which counts OK and failed)."""
    h: Harness

    async def listener(msg: MessageExt) -> None:
        h.pq.dropped = True
        if fail:
            raise RuntimeError("fails")

    h = Harness(listener)
    await h.run_chunk(5, until=lambda: h.recorded != 0)
    totals = h.stats.totals["T"]
    assert (h.updates, h.sent_back, totals.consumed, totals.failed) == ([], [], 0, 0)
    assert totals.consume_seconds.count == 1  # the one call made
    snap = h.stats.snapshot("T")
    assert snap["consumeOKTPS"] == snap["consumeFailedTPS"] == 0


async def test_failures_and_ack_index_per_call_then_one_settlement() -> None:
    async def listener(msgs: list[MessageExt], ctx: ConsumeContext) -> ConsumeResult:
        first = msgs[0].queue_offset
        if first == 4:
            ctx.ack_index = 1       # 4, 5 acknowledged; 6, 7 failed
            return ConsumeResult.SUCCESS
        if first == 8:
            ctx.delay_level_when_next_consume = 5
            raise RuntimeError("batch 8..11 fails")
        return ConsumeResult.SUCCESS

    h = Harness(listener, consume_message_batch_max_size=4)
    await h.run_chunk(16)
    # The delay level a call set applies to its failed messages, even when it raised.
    assert h.sent_back == [(6, 0), (7, 0), (8, 5), (9, 5), (10, 5), (11, 5)]
    # Sent back counts as done: the whole chunk is removed at once and the offset moves past it.
    assert (h.removals, h.updates, h.recorded) == (1, [16], 1)


async def test_a_failed_send_back_keeps_the_offset_below_the_message() -> None:
    async def listener(msgs: list[MessageExt]) -> ConsumeResult:
        if msgs[0].queue_offset == 3:
            raise RuntimeError("fails")
        return ConsumeResult.SUCCESS

    h = Harness(listener)
    h.send_back_ok = False
    await h.run_chunk(8)
    assert h.updates == [3]  # lowest unacknowledged offset
    assert h.pq.msg_count == 1


async def test_a_bug_in_settling_does_not_lose_the_worker(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[int] = []

    async def listener(msgs: list[MessageExt]) -> ConsumeResult:
        seen.append(msgs[0].queue_offset)
        return ConsumeResult.SUCCESS

    h = Harness(listener)
    boom = True
    real = h.service._settle

    async def settle(*a: Any, **kw: Any) -> None:
        nonlocal boom
        if boom:
            boom = False
            raise KeyError("bug")
        await real(*a, **kw)

    monkeypatch.setattr(h.service, "_settle", settle)
    monkeypatch.setattr("rmq_async.consumer.consume.SEND_BACK_FAILED_RETRY_DELAY", 0.01)
    await h.run_chunk(2)
    assert seen == [0, 1, 0, 1]  # the chunk was consumed again
    assert h.updates == [2]


async def test_a_stuck_call_sends_back_only_what_no_listener_answered() -> None:
    never = asyncio.Event()
    seen: list[int] = []

    async def listener(msgs: list[MessageExt]) -> ConsumeResult:
        seen.append(msgs[0].queue_offset)
        if msgs[0].queue_offset == 2:
            await never.wait()  # this call never returns
        return ConsumeResult.SUCCESS

    h = Harness(listener, consume_timeout=0.012)
    try:
        h.start_chunk(5)
        async with asyncio.timeout(5):
            while seen != [0, 1, 2]:
                await asyncio.sleep(0.005)
        await asyncio.sleep(0.05)
        await h.service.clean_expired()
    finally:
        await h.service.aclose()
    # 0 and 1 were answered: settled, not sent back; 2 (stuck) and 3, 4 (never handed to the
    # listener) go back to the broker, and the offset moves past all of them.
    assert [o for o, _ in h.sent_back] == [2, 3, 4]
    assert h.pq.msg_count == 0
    assert h.updates[-1] == 5


@pytest.mark.parametrize("batch_size", [1, 2])
@pytest.mark.parametrize("per_message", [True, False])
async def test_what_the_cleaner_sent_back_is_not_consumed_when_the_slow_call_returns(
        per_message: bool, batch_size: int) -> None:
    """The cleaner sends back the slow message and those behind it in its chunk; when the slow
    call does return, the worker hands none of them to the listener (they come again through
    the retry topic) and does not send any of them back a second time."""
    release = asyncio.Event()
    seen: list[int] = []

    async def slow(offsets: list[int]) -> bool:
        seen.extend(offsets)
        if 2 in offsets:
            await release.wait()  # slow, not stuck: it returns after the cleaner ran
            return False  # and fails, which must not send 2 back again
        return True

    if per_message:
        async def listener(msg: MessageExt) -> ConsumeResult:
            ok = await slow([msg.queue_offset])
            return ConsumeResult.SUCCESS if ok else ConsumeResult.RECONSUME_LATER
        h = Harness(listener, consume_timeout=0.012)
    else:
        async def batch_listener(msgs: list[MessageExt]) -> ConsumeResult:
            ok = await slow([m.queue_offset for m in msgs])
            return ConsumeResult.SUCCESS if ok else ConsumeResult.RECONSUME_LATER
        h = Harness(batch_listener, consume_timeout=0.012,
                    consume_message_batch_max_size=batch_size)
    try:
        h.start_chunk(7)
        async with asyncio.timeout(5):
            while 2 not in seen:
                await asyncio.sleep(0.005)
        await asyncio.sleep(0.05)
        await h.service.clean_expired()
        sent_by_cleaner = [o for o, _ in h.sent_back]
        release.set()
        async with asyncio.timeout(5):
            await h.service.wait_idle()
    finally:
        await h.service.aclose()
    in_flight = [0, 1, 2] if per_message or batch_size == 1 else [0, 1, 2, 3]
    answered = 2  # 0 and 1 (and, in calls of two, 2 and 3 are one call still running)
    assert seen == in_flight
    assert sent_by_cleaner == list(range(answered, 7))
    assert [o for o, _ in h.sent_back] == sent_by_cleaner  # nothing sent back twice
    assert h.pq.msg_count == 0 and h.updates[-1] == 7
    # The statistics count what the listener answered: 0 and 1 acknowledged, the slow call's
    # messages failed (though not sent back again); 3 to 6 are not counted (no call saw them).
    totals = h.stats.totals["T"]
    assert (totals.consumed, totals.failed) == (2, len(in_flight) - 2)


async def test_a_plain_batch_handler_called_directly_acknowledges_by_its_result(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """``async def h(msgs: list[MessageExt])`` (no context, no middleware) is called without a
    ConsumeContext: what it returns or raises alone decides, per call, as on the full path."""
    from rmq_async.consumer import consume as consume_module
    from rmq_async.consumer.results import DeadLetter, RetryLater

    dead: list[tuple[int, str]] = []

    async def to_dlq(rt: Any, msg: MessageExt, reason: str) -> bool:
        dead.append((msg.queue_offset, reason))
        return True

    monkeypatch.setattr(consume_module, "send_to_dlq", to_dlq)
    outcomes: dict[int, Any] = {
        0: None, 2: ConsumeResult.SUCCESS, 4: "CONSUME_SUCCESS", 6: ConsumeResult.RECONSUME_LATER,
        8: "RECONSUME_LATER", 10: {"anything": "else"}, 12: DeadLetter("poison"),
        14: RetryLater(), 16: ValueError("boom"), 18: ConsumeResult.COMMIT,
    }

    async def listener(msgs: list[MessageExt]) -> Any:
        outcome = outcomes[msgs[0].queue_offset]
        if isinstance(outcome, BaseException):
            raise outcome
        return outcome

    h = Harness(listener, consume_message_batch_max_size=2)
    assert h.adapter.plain and h.adapter.batch
    await h.run_chunk(20)
    assert h.sent_back == [(o, 0) for o in (6, 7, 8, 9, 14, 15, 16, 17)]
    assert dead == [(12, "poison"), (13, "poison")]
    assert (h.removals, h.updates, h.recorded) == (1, [20], 1)


async def test_a_middleware_handing_on_copies_keeps_the_handlers_failure() -> None:
    """The messages a middleware passes on are matched by offset, not identity: copies (bodies
    decompressed, say) that the handler fails on are sent back, not acknowledged."""
    import copy
    import dataclasses

    async def handler(msgs: list[MessageExt]) -> ConsumeResult:
        raise RuntimeError("downstream down")

    h = Harness(handler, consume_message_batch_max_size=3)

    async def decompress(call: Any, call_next: Any) -> None:
        copies = []
        for m in call.messages:
            c = copy.copy(m)
            c.body = m.body.upper()
            copies.append(c)
        await call_next(dataclasses.replace(call, messages=copies))

    h.subscriptions.middlewares.append(decompress)
    await h.run_chunk(3)
    assert h.sent_back == [(0, 0), (1, 0), (2, 0)]


async def test_an_ack_index_counts_within_what_a_filtering_middleware_passed_on() -> None:
    """A dedup middleware passes m1, m2 of m0..m2; the handler acknowledges its first (m1) with
    ack_index 0 and returns SUCCESS: m0 (left out) and m1 are acknowledged, only m2 is retried."""
    import dataclasses

    async def handler(msgs: list[MessageExt], ctx: ConsumeContext) -> ConsumeResult:
        assert [m.queue_offset for m in msgs] == [1, 2]
        ctx.ack_index = 0
        return ConsumeResult.SUCCESS

    h = Harness(handler, consume_message_batch_max_size=3)

    async def dedup(call: Any, call_next: Any) -> None:
        await call_next(dataclasses.replace(call, messages=call.messages[1:]))

    h.subscriptions.middlewares.append(dedup)
    await h.run_chunk(3)
    assert h.sent_back == [(2, 0)]


async def test_a_plain_function_returning_a_coroutine_is_awaited() -> None:
    """``listener=lambda m: handle(m)`` or a decorator whose wrapper is a plain ``def``: the
    coroutine it returns is run and its outcome counts (it was acknowledged unrun)."""
    import functools

    ran: list[int] = []

    async def real(msg: MessageExt) -> ConsumeResult:
        ran.append(msg.queue_offset)
        if msg.queue_offset == 1:
            raise RuntimeError("fails")
        return ConsumeResult.SUCCESS

    def logged(fn: Any) -> Any:
        @functools.wraps(fn)
        def wrapper(*a: Any, **kw: Any) -> Any:
            return fn(*a, **kw)
        return wrapper

    h = Harness(logged(real))
    await h.run_chunk(3)
    assert ran == [0, 1, 2]
    assert h.sent_back == [(1, 0)]


@pytest.mark.parametrize("batch_size", [1, 2])
@pytest.mark.parametrize("per_message", [True, False])
async def test_the_consume_timeout_is_per_call_not_per_chunk(
        per_message: bool, batch_size: int) -> None:
    """Java sends back only messages whose call has run longer than ``consume_timeout``. A
    chunk of calls that each take well under the timeout, but together much longer, loses
    nothing to the cleaner (before, the whole chunk carried its first call's stamp: the
    cleaner sent back messages that were in a fresh call or not yet called, and they were
    consumed twice). Each look of the cleaner that finds the chunk has answered more stamps
    its unanswered messages again."""
    seen: list[int] = []
    stamps: list[int] = []

    async def slow(msgs: list[MessageExt]) -> None:
        for m in msgs:
            seen.append(m.queue_offset)
            stamps.append(int(m.get_property(PROPERTY_CONSUME_START_TIME) or 0))
        await asyncio.sleep(0.03)

    if per_message:
        async def listener(msg: MessageExt) -> ConsumeResult:
            await slow([msg])
            return ConsumeResult.SUCCESS
        h = Harness(listener, consume_timeout=0.2)
    else:
        async def batch_listener(msgs: list[MessageExt]) -> ConsumeResult:
            await slow(msgs)
            return ConsumeResult.SUCCESS
        h = Harness(batch_listener, consume_timeout=0.2, consume_message_batch_max_size=batch_size)
    n = 12 * batch_size  # twelve calls: about twice the timeout for the chunk
    try:
        h.start_chunk(n)
        async with asyncio.timeout(10):
            while not h.updates or h.updates[-1] < n:
                await h.service.clean_expired()
                await asyncio.sleep(0.01)
            await h.service.wait_idle()
    finally:
        await h.service.aclose()
    assert h.sent_back == []
    assert seen == list(range(n))
    assert h.updates[-1] == n and h.pq.msg_count == 0
    assert h.stats.totals["T"].consumed == n
    assert stamps[-1] > stamps[0]  # stamped again as the chunk went on


async def test_answered_messages_of_a_slow_chunk_are_settled_not_sent_back() -> None:
    """Messages a call answered stay cached until their chunk is settled. Once their stamps
    are past the timeout, the cleaner settles them (acknowledged) and leaves the call in
    progress alone, as it is inside its time."""
    gate = asyncio.Event()
    seen: list[int] = []

    async def listener(msg: MessageExt) -> ConsumeResult:
        seen.append(msg.queue_offset)
        if msg.queue_offset < 2:
            await asyncio.sleep(0.06)  # 0 and 1 take longer than the timeout together
        else:
            await gate.wait()
        return ConsumeResult.SUCCESS

    h = Harness(listener, consume_timeout=0.1)
    try:
        h.start_chunk(4)
        async with asyncio.timeout(5):
            while seen != [0, 1, 2]:
                await asyncio.sleep(0.002)
        await h.service.clean_expired()
        assert h.sent_back == []
        assert h.updates[-1] == 2  # 0 and 1 settled: the offset is the call in progress
        gate.set()
        async with asyncio.timeout(5):
            while h.updates[-1] < 4:
                await asyncio.sleep(0.005)
    finally:
        await h.service.aclose()
    assert seen == [0, 1, 2, 3] and h.sent_back == []
    assert h.updates[-1] == 4 and h.pq.msg_count == 0


async def test_the_cleaner_waits_for_a_settlement_sending_back() -> None:
    """A chunk past the consume timeout settles while the cleaner looks: its failed message
    was being sent back by the settlement (awaiting the broker) when the cleaner found every
    message of the chunk still cached and expired, and sent them all back at level 3: the
    consumed ones as duplicates, the failed one twice."""
    gate = asyncio.Event()

    async def listener(msg: MessageExt) -> ConsumeResult:
        return ConsumeResult.RECONSUME_LATER if msg.queue_offset == 1 else ConsumeResult.SUCCESS

    # The service's own cleaner looks every minute (never, in this test); the look below
    # finds every message past a timeout of a millisecond.
    h = Harness(listener, consume_timeout=60.0)
    settling = asyncio.Event()

    async def slow_send_back(msg: MessageExt, level: int) -> bool:
        if msg.queue_offset == 1 and not settling.is_set():
            settling.set()
            await gate.wait()
        h.sent_back.append((msg.queue_offset, level))
        return True

    h.service._rt.send_message_back = slow_send_back  # type: ignore[attr-defined]
    try:
        h.start_chunk(4)
        async with asyncio.timeout(5):
            await settling.wait()
            await asyncio.sleep(0.01)
            h.service._opts = h.options.replace(consume_timeout=0.001)
            cleaner = asyncio.create_task(h.service.clean_expired())
            await asyncio.sleep(0.05)
            gate.set()
            await cleaner
            while not h.updates:
                await asyncio.sleep(0.005)
    finally:
        await h.service.aclose()
    assert h.sent_back == [(1, 0)]
    assert h.updates == [4] and h.pq.msg_count == 0


async def test_two_settlements_send_back_side_by_side() -> None:
    """The cleaner's turn-taking with the settlements (above) must not make the settlements
    take turns among themselves: with one lock for all, a broker slow to answer send-backs
    held every failing worker behind one send at a time."""
    async def listener(msg: MessageExt) -> ConsumeResult:
        return ConsumeResult.RECONSUME_LATER

    h = Harness(listener, consume_timeout=60.0)  # two workers
    sent: list[int] = []
    both = asyncio.Event()
    in_flight = 0

    async def slow_send_back(msg: MessageExt, level: int) -> bool:
        nonlocal in_flight
        in_flight += 1
        if in_flight == 2:
            both.set()
        async with asyncio.timeout(5):
            await both.wait()  # returns only once the other settlement's send is out too
        sent.append(msg.queue_offset)
        return True

    h.service._rt.send_message_back = slow_send_back  # type: ignore[attr-defined]
    try:
        h.start_chunk(1, 0)
        more = [MessageExt("T", b"m1", 0, 1)]
        h.pq.put_messages(more)
        h.service.submit(more, h.pq, MQ)
        async with asyncio.timeout(10):
            while len(sent) < 2:
                await asyncio.sleep(0.005)
    finally:
        await h.service.aclose()
    assert sorted(sent) == [0, 1]


@pytest.mark.parametrize("kind", ["dead", "level"])
async def test_what_a_call_of_a_long_chunk_failed_goes_where_its_answer_sends_it(
        kind: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A message answered as poison or with a delay level, in a chunk still running when the
    cleaner looks, keeps an older stamp than the chunk's unanswered ones: it goes to the
    dead-letter queue or back with its level, not back at level 3 with the expired ones."""
    import time

    from rmq_async.consumer import consume as consume_module
    from rmq_async.consumer.results import DeadLetter

    timeout = 0.3
    dlq: list[int] = []

    async def to_dlq(rt: Any, m: MessageExt, reason: str) -> bool:
        dlq.append(m.queue_offset)
        return True

    monkeypatch.setattr(consume_module, "send_to_dlq", to_dlq)
    t0 = time.monotonic()
    failed: list[int] = []

    async def listener(msg: MessageExt, ctx: ConsumeContext) -> ConsumeResult:
        await asyncio.sleep(0.03)  # each call well inside the timeout
        if not failed and time.monotonic() - t0 > timeout + 0.12:
            failed.append(msg.queue_offset)  # answered after the cleaner's first look
            if kind == "dead":
                raise DeadLetter("poison")
            ctx.delay_level_when_next_consume = 7
            return ConsumeResult.RECONSUME_LATER
        return ConsumeResult.SUCCESS

    h = Harness(listener, consume_timeout=timeout)
    n = 22  # about 0.7 s of calls: the cleaner looks at about 0.3 s and 0.6 s
    try:
        h.start_chunk(n)
        async with asyncio.timeout(10):
            while not h.updates or h.updates[-1] < n:
                await asyncio.sleep(0.01)
            await h.service.wait_idle()
    finally:
        await h.service.aclose()
    assert len(failed) == 1
    if kind == "dead":
        assert dlq == failed and h.sent_back == []
    else:
        assert h.sent_back == [(failed[0], 7)] and dlq == []


async def test_a_message_resubmitted_after_the_cleaner_sent_it_back_is_not_consumed_again(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A failed message whose send-back failed waits five seconds to be consumed again here;
    the cleaner may send it back meanwhile (its stamp is old), and then it comes through the
    retry topic only."""
    from rmq_async.consumer import consume as consume_module

    monkeypatch.setattr(consume_module, "SEND_BACK_FAILED_RETRY_DELAY", 1.0)
    calls: list[int] = []

    async def listener(msg: MessageExt) -> ConsumeResult:
        calls.append(msg.queue_offset)
        return ConsumeResult.RECONSUME_LATER if msg.queue_offset == 0 else ConsumeResult.SUCCESS

    h = Harness(listener, consume_timeout=0.3)
    h.send_back_ok = False  # the chunk's own send-back of 0 fails: consumed again after 1 s
    try:
        h.start_chunk(2)
        await asyncio.sleep(0.1)
        h.send_back_ok = True  # the broker takes it when the cleaner sends it back
        await asyncio.sleep(1.3)
    finally:
        await h.service.aclose()
    assert h.sent_back == [(0, 3)] and calls == [0, 1]


@pytest.mark.parametrize("reason", [ValueError("bad body"), "bad\x02reason\x01here"])
async def test_a_dead_letter_reason_of_any_text_sends_the_copy_once(
        reason: object, monkeypatch: pytest.MonkeyPatch) -> None:
    """``raise DeadLetter(exc)`` (not a str) or a reason holding the property separators made
    the DLQ send raise outside the caught errors: the whole chunk was consumed again every
    5 s, forever, its offset never committed."""
    import rmq_async.consumer.consume as consume_module
    from rmq_async import DeadLetter
    from rmq_async.consumer.dead_letter import PROPERTY_DLQ_REASON
    from rmq_async.protocol.message import decode_properties

    monkeypatch.setattr(consume_module, "SEND_BACK_FAILED_RETRY_DELAY", 0.05)
    calls: list[int] = []

    async def handler(msg: MessageExt) -> None:
        calls.append(msg.queue_offset)
        if msg.queue_offset == 1:
            raise DeadLetter(reason)  # type: ignore[arg-type]

    h = Harness(handler)
    copies: list[dict[str, str]] = []

    async def send_message(addr: str, mq: MessageQueue, **kw: Any) -> None:
        copies.append(decode_properties(kw["properties"]))

    async def master(*args: Any) -> str:
        return "127.0.0.1:10911"

    h.service._rt.instance = SimpleNamespace(find_broker_master=master,
                                             api=SimpleNamespace(send_message=send_message))
    try:
        h.start_chunk(3)
        await asyncio.sleep(0.4)  # eight retry delays of the old loop
    finally:
        await h.service.aclose()
    assert calls == [0, 1, 2] and h.updates == [3] and len(copies) == 1
    assert copies[0][PROPERTY_DLQ_REASON] == str(reason).replace("\x02", " ").replace("\x01", " ")


async def test_an_ack_index_that_is_not_an_int_is_read_not_fatal(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """``ctx.ack_index = len(msgs) / 2`` (a float) crashed the settlement: the chunk was
    consumed again every 5 s, forever. A float counts as its floor; anything else
    acknowledges none of the batch (retried), with a warning."""
    import rmq_async.consumer.consume as consume_module

    monkeypatch.setattr(consume_module, "SEND_BACK_FAILED_RETRY_DELAY", 0.05)
    calls: list[int] = []

    async def handler(msgs: list[MessageExt], ctx: ConsumeContext) -> None:
        calls.append(len(msgs))
        ctx.ack_index = len(msgs) / 2  # type: ignore[assignment]

    h = Harness(handler, consume_message_batch_max_size=3)
    try:
        h.start_chunk(3)
        await asyncio.sleep(0.4)
    finally:
        await h.service.aclose()
    assert calls == [3] and h.updates == [3]
    assert h.sent_back == [(2, 0)]  # 1.5 -> 1: the first two acknowledged, the third retried
    ctx = ConsumeContext(MQ)
    ctx.ack_index = "one"  # type: ignore[assignment]
    assert ctx.acked_count(3, ConsumeResult.SUCCESS) == 0


async def _cancelled_by_someone_else() -> None:
    """What a handler sees when it awaits a task that other code cancelled."""
    task = asyncio.ensure_future(asyncio.sleep(10))
    await asyncio.sleep(0)
    task.cancel()
    await task


async def _raise_base_exception() -> None:
    raise NotAnException("pytest.fail() in the listener")


@pytest.mark.parametrize("raises", ["own-cancelled-error", "base-exception"])
@pytest.mark.parametrize("shape", ["one", "batch", "context"])
async def test_a_handler_raising_cancelled_error_of_its_own_fails_its_call_only(
        shape: str, raises: str) -> None:
    """A ``CancelledError`` that is not the consumer's cancellation (the handler awaited a task
    that was cancelled), or a ``BaseException`` that is not an ``Exception``, is a failure of
    that call: it ended the worker, and the chunk stayed cached for good, holding the queue's
    offset (and, at the span limit, its pulls)."""
    calls: list[int] = []
    fail = {"own-cancelled-error": _cancelled_by_someone_else,
            "base-exception": _raise_base_exception}[raises]

    async def body(first: int) -> None:
        calls.append(first)
        if first == 1 and calls.count(1) == 1:
            await fail()

    async def one(msg: MessageExt) -> None:
        await body(msg.queue_offset)

    async def batch(msgs: list[MessageExt]) -> None:
        await body(msgs[0].queue_offset)

    async def context(msgs: list[MessageExt], ctx: ConsumeContext) -> ConsumeResult:
        await body(msgs[0].queue_offset)
        return ConsumeResult.SUCCESS

    listener = {"one": one, "batch": batch, "context": context}[shape]
    h = Harness(listener)
    try:
        h.start_chunk(4)
        async with asyncio.timeout(5):
            while h.updates != [4]:
                await asyncio.sleep(0.005)
        assert calls == [0, 1, 2, 3]
        assert h.sent_back == [(1, 0)]  # the failed call's message goes back for a retry
        assert h.pq.msg_count == 0
        # Both workers are still there: two more chunks are consumed side by side.
        for first in (4, 5):
            more = [MessageExt("T", b"m", 0, first)]
            h.pq.put_messages(more)
            h.service.submit(more, h.pq, MQ)
        async with asyncio.timeout(5):
            while h.updates[-1] != 6:
                await asyncio.sleep(0.005)
        assert sum(":worker-" in t.get_name() and not t.done()
                   for t in h.service._owner.tasks) == 2
    finally:
        await h.service.aclose()
    assert sorted(calls) == [0, 1, 2, 3, 4, 5]


async def test_a_message_listed_twice_in_dead_letters_goes_once_and_counts_once(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A handler that put one message in ``ctx.dead_letters`` three times: three copies went
    to the dead-letter queue and the consumed count went down by two (a Prometheus counter
    going backwards)."""
    from rmq_async.consumer import consume as consume_module

    dead: list[tuple[int, str]] = []

    async def to_dlq(rt: Any, msg: MessageExt, reason: str) -> bool:
        dead.append((msg.queue_offset, reason))
        return True

    monkeypatch.setattr(consume_module, "send_to_dlq", to_dlq)

    async def listener(msgs: list[MessageExt], ctx: ConsumeContext) -> ConsumeResult:
        poison = msgs[1]
        ctx.dead_letters.extend([(poison, "bad"), (poison, "still bad"), (poison, "bad")])
        return ConsumeResult.SUCCESS

    h = Harness(listener, consume_message_batch_max_size=5)
    await h.run_chunk(5)
    assert dead == [(1, "bad")] and h.sent_back == []
    totals = h.stats.totals["T"]
    assert (totals.consumed, totals.failed) == (4, 1)


async def test_a_dead_letter_listed_as_a_middlewares_copy_is_the_calls_own_message(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A middleware hands the handler copies; the handler dead-letters one copy and
    acknowledges only the first message (``ack_index``). The copy went to the dead-letter
    queue and its original, not recognised, back for a retry as well."""
    import dataclasses

    from rmq_async.consumer import consume as consume_module
    from rmq_async.consumer.middleware import ConsumeCall

    dead: list[int] = []

    async def to_dlq(rt: Any, msg: MessageExt, reason: str) -> bool:
        dead.append(msg.queue_offset)
        return True

    monkeypatch.setattr(consume_module, "send_to_dlq", to_dlq)

    async def copying(call: ConsumeCall, call_next: Any) -> None:
        await call_next(dataclasses.replace(
            call, messages=[dataclasses.replace(m) for m in call.messages]))

    async def listener(msgs: list[MessageExt], ctx: ConsumeContext) -> ConsumeResult:
        ctx.dead_letters.append((msgs[1], "poison"))
        ctx.ack_index = 0
        return ConsumeResult.SUCCESS

    h = Harness(listener, consume_message_batch_max_size=4)
    h.subscriptions.middlewares.append(copying)
    await h.run_chunk(4)
    assert dead == [1]
    assert sorted(off for off, _ in h.sent_back) == [2, 3]  # not 1: it is dead-lettered
    totals = h.stats.totals["T"]
    assert (totals.consumed, totals.failed) == (1, 3)


@pytest.mark.parametrize("copies", [False, True])
async def test_an_ack_index_counts_over_the_handlers_list_with_its_dead_letters_in_it(
        monkeypatch: pytest.MonkeyPatch, copies: bool) -> None:
    """The handler dead-letters m0 and acknowledges up to m1 (``ack_index = 1``) of m0..m3:
    m2 and m3 are retried. ``ack_index`` was applied to the list without the dead letter, so
    m2 was acknowledged: committed, neither handled nor sent back (Java counts ackIndex over
    the listener's list). A body its decoder left out is not in the handler's list (the
    middleware test above); copies handed on by a middleware are matched by offset."""
    import dataclasses

    from rmq_async.consumer import consume as consume_module
    from rmq_async.consumer.middleware import ConsumeCall

    dead: list[int] = []

    async def to_dlq(rt: Any, msg: MessageExt, reason: str) -> bool:
        dead.append(msg.queue_offset)
        return True

    monkeypatch.setattr(consume_module, "send_to_dlq", to_dlq)

    async def listener(msgs: list[MessageExt], ctx: ConsumeContext) -> ConsumeResult:
        ctx.dead_letters.append((msgs[0], "poison"))
        ctx.ack_index = 1
        return ConsumeResult.SUCCESS

    h = Harness(listener, consume_message_batch_max_size=4)
    if copies:
        async def copying(call: ConsumeCall, call_next: Any) -> None:
            await call_next(dataclasses.replace(
                call, messages=[dataclasses.replace(m) for m in call.messages]))

        h.subscriptions.middlewares.append(copying)
    await h.run_chunk(4)
    assert dead == [0]
    assert sorted(off for off, _ in h.sent_back) == [2, 3]


async def test_an_ack_index_follows_the_order_the_handler_got_its_messages_in() -> None:
    """A middleware hands the handler m3..m0 (newest first); ``ack_index = 0`` acknowledges
    the handler's first, m3: m0..m2 are retried (the batch's order was counted)."""
    import dataclasses

    from rmq_async.consumer.middleware import ConsumeCall

    async def listener(msgs: list[MessageExt], ctx: ConsumeContext) -> ConsumeResult:
        assert [m.queue_offset for m in msgs] == [3, 2, 1, 0]
        ctx.ack_index = 0
        return ConsumeResult.SUCCESS

    async def newest_first(call: ConsumeCall, call_next: Any) -> None:
        await call_next(dataclasses.replace(call, messages=call.messages[::-1]))

    h = Harness(listener, consume_message_batch_max_size=4)
    h.subscriptions.middlewares.append(newest_first)
    await h.run_chunk(4)
    assert sorted(off for off, _ in h.sent_back) == [0, 1, 2]

"""``read_range`` against a scripted queue: pipelined pulls, partial answers, gaps, filters."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

import pytest

from rmq_async.client.api import PullStatus
from rmq_async.client.errors import MQBrokerError, MQClientError, broker_error
from rmq_async.protocol.codes import ResponseCode
from rmq_async.protocol.types import MessageExt, MessageQueue
from rmq_async.sources import ranges as ranges_module
from rmq_async.sources.ranges import DataLossError, SourceOptions, read_range

MQ = MessageQueue("t", "broker-a", 3)


@dataclass
class Answer:
    status: PullStatus
    next_begin_offset: int
    msgs: list[MessageExt]
    min_offset: int = 0
    max_offset: int = 0

    def decode(self) -> list[MessageExt]:
        return [MessageExt(m.topic, m.body, queue_id=m.queue_id, queue_offset=m.queue_offset,
                           properties=dict(m.properties)) for m in self.msgs]


@dataclass
class FakeQueue:
    """Offsets ``low..high-1`` minus ``holes``; each pull returns at most ``cap`` messages."""

    low: int
    high: int
    cap: int = 32
    holes: set[int] = field(default_factory=set)
    tags: dict[int, str] = field(default_factory=dict)
    pulls: list[tuple[int, int]] = field(default_factory=list)
    max_inflight: int = 0
    busy: int = 0  # answers of SYSTEM_BUSY (the broker's pull flow control) to come
    _inflight: int = 0

    def message(self, off: int) -> MessageExt:
        props = {"TAGS": self.tags[off]} if off in self.tags else {}
        return MessageExt("t", f"m{off}".encode(), queue_id=MQ.queue_id, queue_offset=off,
                          properties=props)

    def answer(self, at: int, want: int, expression: str) -> Answer:
        if at < self.low:
            return Answer(PullStatus.OFFSET_ILLEGAL, self.low, [], self.low, self.high)
        if at > self.high:
            return Answer(PullStatus.OFFSET_ILLEGAL, self.high, [], self.low, self.high)
        if at == self.high:
            return Answer(PullStatus.NO_NEW_MSG, at, [], self.low, self.high)
        msgs: list[MessageExt] = []
        off = at
        wanted = {t.strip() for t in expression.split("||")} if expression != "*" else None
        while off < self.high and len(msgs) < min(want, self.cap):
            if off not in self.holes and (wanted is None or self.tags.get(off) in wanted):
                msgs.append(self.message(off))
            off += 1
        if not msgs:
            return Answer(PullStatus.NO_MATCHED_MSG, off, [], self.low, self.high)
        return Answer(PullStatus.FOUND, msgs[-1].queue_offset + 1, msgs, self.low, self.high)


class FakePending:
    def __init__(self, queue: FakeQueue, answer: Answer) -> None:
        self.queue = queue
        self.answer = answer
        self.cancelled = False

    def cancel(self) -> None:
        if not self.cancelled:
            self.cancelled = True
            self.queue._inflight -= 1

    async def result(self) -> Answer:
        await asyncio.sleep(0)
        assert not self.cancelled
        self.queue._inflight -= 1
        if self.queue.busy:
            self.queue.busy -= 1
            raise broker_error(ResponseCode.SYSTEM_BUSY, "[REJECTREQUEST]system busy",
                               addr="x", request="PULL_MESSAGE")
        return self.answer


class FakeApi:
    def __init__(self, queue: FakeQueue) -> None:
        self.queue = queue

    async def start_pull(self, addr: str, *, mq: MessageQueue, queue_offset: int,
                         max_msg_nums: int, subscription: Any, **_: Any) -> FakePending:
        q = self.queue
        q.pulls.append((queue_offset, max_msg_nums))
        q._inflight += 1
        q.max_inflight = max(q.max_inflight, q._inflight)
        return FakePending(q, q.answer(queue_offset, max_msg_nums, subscription.sub_string))


class FakeClient:
    def __init__(self, queue: FakeQueue) -> None:
        self.api = FakeApi(queue)

    async def find_broker_master(self, broker_name: str, topic: str | None = None) -> str:
        return "127.0.0.1:10911"


def options(**extra: str) -> SourceOptions:
    return SourceOptions.parse({"namesrv": "127.0.0.1:9876", "topics": "t", **extra},
                               streaming=False)


async def read(queue: FakeQueue, opts: SourceOptions, start: int, end: int,
               chunk_rows: int = 100, fresh: bool = False) -> list[list[int]]:
    out = []
    async for chunk in read_range(FakeClient(queue), opts, MQ, start, end,  # type: ignore[arg-type]
                                  chunk_rows=chunk_rows, fresh_queue=fresh):
        assert all(m.broker_name == "broker-a" for m in chunk)
        out.append([m.queue_offset for m in chunk])
    return out


async def test_pipelined_pulls_read_exactly_the_range_in_chunks() -> None:
    q = FakeQueue(0, 1000)
    chunks = await read(q, options(), 17, 905, chunk_rows=200)
    assert [o for c in chunks for o in c] == list(range(17, 905))
    assert all(len(c) >= 200 for c in chunks[:-1])
    assert q.max_inflight == 4  # pullDepth
    assert sum(n for _, n in q.pulls) == 905 - 17  # no offset asked twice


async def test_partial_answers_are_completed_before_later_slices() -> None:
    q = FakeQueue(0, 500, cap=10)  # the broker answers at most 10 per pull
    chunks = await read(q, options(pullBatchSize="32"), 0, 500)
    assert [o for c in chunks for o in c] == list(range(500))


async def test_filtered_reads_go_one_pull_at_a_time() -> None:
    q = FakeQueue(0, 300, tags={i: ("a" if i % 3 == 0 else "b") for i in range(300)})
    chunks = await read(q, options(tags="a"), 5, 290)
    assert [o for c in chunks for o in c] == [i for i in range(5, 290) if i % 3 == 0]
    assert q.max_inflight == 1


async def test_gone_offsets_fail_or_are_skipped() -> None:
    q = FakeQueue(100, 400, holes={250, 251})
    with pytest.raises(DataLossError, match=r"offsets 50\.\.99 .* are gone"):
        await read(q, options(), 50, 300)
    with pytest.raises(DataLossError, match=r"offsets 250\.\.251 .*hole in the queue"):
        await read(q, options(), 200, 300)
    lenient = options(failOnDataLoss="false")
    got = [o for c in await read(q, lenient, 50, 300) for o in c]
    assert got == [i for i in range(100, 300) if i not in (250, 251)]
    # A queue that appeared after the query started: its min offset is where it begins.
    assert [o for c in await read(q, options(), 0, 120, fresh=True) for o in c] == list(range(100, 120))
    # The queue's max fell below the planned end.
    with pytest.raises(DataLossError, match=r"offsets 400\.\.449"):
        await read(q, options(), 390, 450)
    assert [o for c in await read(q, lenient, 390, 450) for o in c] == list(range(390, 400))


@dataclass
class ResetQueue(FakeQueue):
    """A queue whose pull group an admin reset (``mqadmin resetOffsetByTime``): the broker
    answers the next pull at ``reset_at`` once with OFFSET_ILLEGAL (PULL_OFFSET_MOVED,
    useServerSideResetOffset) pointing at the reset offset, the queue's bounds unchanged."""

    reset_at: int = 0
    reset_to: int | None = None

    def answer(self, at: int, want: int, expression: str) -> Answer:
        if at == self.reset_at and self.reset_to is not None:
            to, self.reset_to = self.reset_to, None
            return Answer(PullStatus.OFFSET_ILLEGAL, to, [], self.low, self.high)
        return super().answer(at, want, expression)


@pytest.mark.parametrize("reset_to", [80, 10])
@pytest.mark.parametrize("fail", ["true", "false"])
async def test_an_offset_reset_of_the_pull_group_does_not_cut_the_range(
        reset_to: int, fail: str) -> None:
    """The planned range stands: the offset the broker moved is pulled again (it has it),
    neither skipped to the reset offset nor reported as gone."""
    q = ResetQueue(0, 100, reset_at=32, reset_to=reset_to)
    chunks = await read(q, options(failOnDataLoss=fail, pullDepth="1"), 0, 100)
    assert [o for c in chunks for o in c] == list(range(100))


async def test_an_offset_the_broker_keeps_refusing_is_not_pulled_for_ever() -> None:
    class Refusing(FakeQueue):
        def answer(self, at: int, want: int, expression: str) -> Answer:
            if at >= 64:
                return Answer(PullStatus.OFFSET_ILLEGAL, at, [], self.low, self.high)
            return super().answer(at, want, expression)

    # The queue holds the offset (0..99): not data loss (failOnDataLoss=false skipped the rest
    # of the range), the read fails for Spark to try again.
    for fail in ("true", "false"):
        q = Refusing(0, 100)
        with pytest.raises(MQClientError, match=r"OFFSET_ILLEGAL for offset 64 4 times") as info:
            await read(q, options(failOnDataLoss=fail, pullDepth="1"), 0, 100)
        assert not isinstance(info.value, DataLossError)
        assert sum(1 for at, _ in q.pulls if at == 64) == 4  # three more tries, then given up


@pytest.mark.parametrize("fail", ["true", "false"])
async def test_a_retry_immediately_answer_that_does_not_move_on_is_retried(fail: str) -> None:
    """PULL_RETRY_IMMEDIATELY (NO_MATCHED_MSG) with the same next offset, for an offset the
    queue has (a store read error on the broker): the offset is pulled again, not taken for
    a queue whose max fell below the range; one the broker keeps answering so is given up."""

    class Hiccup(FakeQueue):
        stumbles = 2

        def answer(self, at: int, want: int, expression: str) -> Answer:
            if at == 64 and self.stumbles:
                self.stumbles -= 1
                return Answer(PullStatus.NO_MATCHED_MSG, at, [], self.low, self.high)
            return super().answer(at, want, expression)

    q = Hiccup(0, 100)
    chunks = await read(q, options(failOnDataLoss=fail, pullDepth="1"), 0, 100)
    assert [o for c in chunks for o in c] == list(range(100))
    assert sum(1 for at, _ in q.pulls if at == 64) == 3

    stuck = Hiccup(0, 100)
    stuck.stumbles = 1_000
    # Not data loss, whatever failOnDataLoss says (it skipped 64..99, which the queue holds).
    with pytest.raises(MQClientError, match=r"for offset 64 4 times") as info:
        await read(stuck, options(failOnDataLoss=fail, pullDepth="1"), 0, 100)
    assert not isinstance(info.value, DataLossError)
    assert sum(1 for at, _ in stuck.pulls if at == 64) == 4


async def test_entries_removed_from_the_commit_log_are_data_loss_without_a_filter() -> None:
    """A commit-log file deleted before its consume-queue entries: the broker answers
    NO_MATCHED_MSG (MESSAGE_WAS_REMOVING) past them, or FOUND with fewer messages than the
    entries it stepped over. Without a filter both are gone messages, not filtered ones."""

    class Removing(FakeQueue):
        def answer(self, at: int, want: int, expression: str) -> Answer:
            if at < 40:
                return Answer(PullStatus.NO_MATCHED_MSG, min(at + want, 40), [], self.low,
                              self.high)
            if at < 70 <= at + want:
                msgs = [self.message(o) for o in range(at, 60)]
                return Answer(PullStatus.FOUND, 70, msgs, self.low, self.high)
            return super().answer(at, want, expression)

    with pytest.raises(DataLossError, match=r"offsets 0\.\.31 .*removed from the commit log"):
        await read(Removing(0, 100), options(), 0, 100)
    got = [o for c in await read(Removing(0, 100), options(failOnDataLoss="false"), 0, 100)
           for o in c]
    assert got == [*range(40, 60), *range(70, 100)]
    # With a filter, an answer past entries it did not match is just that.
    tagged = FakeQueue(0, 100, tags={i: "a" for i in range(50, 100)})
    got = [o for c in await read(tagged, options(tags="a"), 0, 100) for o in c]
    assert got == list(range(50, 100))


class _ThreadedQueueBroker:
    """Name server and broker-a for topic t (offsets 0..63, 64 KiB bodies) on an event loop of
    a thread of its own, so the reader under test can stop its own loop between chunks as
    Spark does."""

    def __init__(self) -> None:
        import threading

        self.loop = asyncio.new_event_loop()
        self.ready = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()
        assert self.ready.wait(10)

    def _run(self) -> None:
        from tests.fake_broker import FakeBroker

        asyncio.set_event_loop(self.loop)
        self.broker = FakeBroker(self._answer)
        self.loop.run_until_complete(self.broker.__aenter__())
        self.addr = self.broker.addr
        self.ready.set()
        self.loop.run_forever()

    def stop(self) -> None:
        asyncio.run_coroutine_threadsafe(self.broker.aclose(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)

    async def _answer(self, cmd: Any, number: int) -> Any:
        from rmq_async.protocol.codes import RequestCode, ResponseCode
        from rmq_async.protocol.message import encode_stored_message
        from tests.fake_broker import route_answer

        ext = cmd.ext_fields or {}
        if cmd.code == RequestCode.GET_ROUTEINFO_BY_TOPIC:
            return route_answer(cmd, {"broker-a": self.addr}, queues=1)
        if cmd.code == RequestCode.PULL_MESSAGE:
            at, want = int(ext["queueOffset"]), int(ext["maxMsgNums"])
            await asyncio.sleep(0.02)
            offs = range(at, min(64, at + want))
            body = b"".join(encode_stored_message(MessageExt(
                "t", b"x" * 65536, queue_id=0, queue_offset=o, born_host="127.0.0.1:1",
                store_host="127.0.0.1:2")) for o in offs)
            return cmd.response_to(ResponseCode.SUCCESS, body=body, ext_fields={
                "minOffset": "0", "maxOffset": "64", "suggestWhichBrokerId": "0",
                "nextBeginOffset": str(offs[-1] + 1)})
        return cmd.response_to(ResponseCode.SUCCESS)


def test_an_executor_that_holds_a_chunk_longer_than_the_timeout_reads_on() -> None:
    """Spark holds each chunk (converting and shipping it) without running the reader's event
    loop. Pulls left in flight across that pause saw their deadline pass before their answers
    were read: a RemotingTimeout, though the broker had answered at once. A chunk is handed
    on with no pull in flight now."""
    import time

    pytest.importorskip("pyspark")
    from rmq_async.sources import spark as spark_source

    broker = _ThreadedQueueBroker()
    try:
        opts = SourceOptions.parse({"namesrv": broker.addr, "topics": "t", "apiTimeout": "0.3",
                                    "pullBatchSize": "8", "chunkRows": "8"}, streaming=False)
        rows = 0
        part = spark_source.QueueRange("t", "broker-a", 0, 0, 64)
        for batch in spark_source._read_partition(opts, part):
            rows += batch.num_rows
            time.sleep(0.5)  # Spark writing the batch on; the reader's loop does not run
        assert rows == 64
    finally:
        broker.stop()


def test_rows_carry_the_pulls_min_and_max_offset_as_a_consumers_messages_do() -> None:
    # Java's processPullResult stamps every delivered message with the pull's MIN_OFFSET and
    # MAX_OFFSET, and so does the push consumer feeding a sink: a source row is the same row.
    queue = FakeQueue(low=5, high=90, cap=8, tags={7: "a"})
    got: list[MessageExt] = []

    async def collect() -> None:
        async for chunk in read_range(FakeClient(queue), options(), MQ, 5, 40,  # type: ignore[arg-type]
                                      chunk_rows=10):
            got.extend(chunk)

    asyncio.run(collect())
    assert [m.queue_offset for m in got] == list(range(5, 40))
    for m in got:
        assert m.broker_name == "broker-a"
        assert m.properties["MIN_OFFSET"] == "5" and m.properties["MAX_OFFSET"] == "90"
    assert got[2].properties["TAGS"] == "a"  # the message's own properties are kept


async def test_a_busy_broker_is_asked_again_after_a_pause(monkeypatch: pytest.MonkeyPatch) -> None:
    # SYSTEM_BUSY (the Apache broker's pull flow control) failed the whole read at once, and
    # Spark read the range again from its start; a consumer waits and pulls again.
    monkeypatch.setattr(ranges_module, "BUSY_PAUSES", (0.01,) * 3)
    q = FakeQueue(0, 100, busy=3)
    chunks = await read(q, options(), 0, 100)
    assert [o for c in chunks for o in c] == list(range(100))
    q = FakeQueue(0, 100, busy=4)  # still busy after the last pause: the read fails
    with pytest.raises(MQBrokerError, match="system busy"):
        await read(q, options(), 0, 100)

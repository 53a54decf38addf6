"""A corrupt record never stalls its queue: what precedes it is delivered, it is reported, skipped."""

from __future__ import annotations

from collections.abc import Callable
from types import SimpleNamespace

import pytest

from rmq_async.client.api import PullResult, PullStatus
from rmq_async.consumer.events import ConsumerError, ConsumerErrorKind
from rmq_async.consumer.options import ConsumerOptions
from rmq_async.consumer.process_queue import ProcessQueue
from rmq_async.consumer.pull import PullRequest, PullService
from rmq_async.consumer.runtime import PullThresholds
from rmq_async.consumer.tasks import TaskOwner
from rmq_async.protocol.message import encode_stored_message
from rmq_async.protocol.salvage import decode_messages_salvaging
from rmq_async.protocol.types import MessageExt, MessageQueue
from tests.helpers import NotAnException

MQ = MessageQueue("T", "broker-a", 3)


def _records(first: int, n: int) -> list[bytes]:
    return [encode_stored_message(MessageExt(
        "T", f"body-{first + i}".encode(), queue_id=3, queue_offset=first + i,
        properties={"KEYS": f"k{first + i}"}, born_host="127.0.0.1:1", store_host="127.0.0.1:2"))
        for i in range(n)]


def _service() -> tuple[PullService, list[ConsumerError]]:
    reported: list[ConsumerError] = []
    opts = ConsumerOptions.from_kwargs("G")
    rt = SimpleNamespace(tasks=TaskOwner("consumer[G]"), group="G", options=opts,
                         errors=SimpleNamespace(report=reported.append),
                         thresholds=PullThresholds(opts))
    return PullService(rt, router=None, on_queue_forgotten=lambda: None), reported  # type: ignore[arg-type]


def _corrupt_magic(record: bytes) -> bytes:
    return record[:4] + b"\x00\x00\x00\x00" + record[8:]


def _corrupt_body(record: bytes) -> bytes:
    # Mark the record compressed with a body that is not zlib: it cannot be inflated.
    flag_at = 4 + 4 + 4 + 4 + 4 + 8 + 8
    sys_flag = int.from_bytes(record[flag_at:flag_at + 4], "big") | 0x1
    return record[:flag_at] + sys_flag.to_bytes(4, "big") + record[flag_at + 4:]


@pytest.mark.parametrize("spoil", [_corrupt_magic, _corrupt_body], ids=["magic", "inflate"])
def test_third_record_corrupt_delivers_two_reports_third_and_moves_past_it(
        spoil: Callable[[bytes], bytes]) -> None:
    recs = _records(100, 5)
    recs[2] = spoil(recs[2])
    body = b"".join(recs)
    service, reported = _service()
    req = PullRequest(MQ, ProcessQueue(), 100)
    result = PullResult(PullStatus.FOUND, 105, 0, 105, 0, body)
    msgs, next_offset = service._decode(req, result)
    assert [m.queue_offset for m in msgs] == [100, 101]
    assert [m.body for m in msgs] == [b"body-100", b"body-101"]
    assert next_offset == 103  # the records behind the bad one are pulled again
    assert len(reported) == 1
    event = reported[0]
    assert (event.kind, event.queue, event.offset) == (ConsumerErrorKind.CORRUPT_RECORD, MQ, 102)
    # The next pull answer starts after it and is whole.
    again = PullResult(PullStatus.FOUND, 105, 0, 105, 0, b"".join(recs[3:]))
    msgs, next_offset = service._decode(PullRequest(MQ, ProcessQueue(), 103), again)
    assert [m.queue_offset for m in msgs] == [103, 104] and next_offset == 105
    assert len(reported) == 1


def test_unreadable_size_falls_back_to_the_offset_after_the_last_good_record() -> None:
    recs = _records(7, 3)
    body = recs[0] + b"\xff\xff" + b"".join(recs[1:])  # garbage where record 8 begins
    service, reported = _service()
    msgs, next_offset = service._decode(PullRequest(MQ, ProcessQueue(), 7),
                                        PullResult(PullStatus.FOUND, 10, 0, 10, 0, body))
    assert [m.queue_offset for m in msgs] == [7]
    assert reported[0].offset == 8 and next_offset == 9


def test_salvage_of_a_whole_body_is_the_plain_decode() -> None:
    body = b"".join(_records(0, 4))
    msgs, bad = decode_messages_salvaging(body)
    assert bad is None and [m.queue_offset for m in msgs] == [0, 1, 2, 3]
    _, bad = decode_messages_salvaging(body[:-3])
    assert bad is not None and bad.position == sum(len(r) for r in _records(0, 3))


def test_permission_refused_is_reported_once_per_episode() -> None:
    from rmq_async.client.errors import MQBrokerError
    from rmq_async.protocol.codes import ResponseCode

    service, reported = _service()
    req = PullRequest(MQ, ProcessQueue(), 5)
    refused = MQBrokerError(ResponseCode.NO_PERMISSION, "the topic is not readable")
    for _ in range(3):
        assert service._error_delay(req, refused) > 0
    assert [(e.kind, e.offset) for e in reported] == [(ConsumerErrorKind.PERMISSION_DENIED, 5)]
    assert reported[0].detail.startswith("the broker refuses to serve this queue")
    assert service.refused == {MQ}


def test_a_refused_route_lookup_is_reported_as_the_name_servers_refusal() -> None:
    # A pull may look its topic's route up first: when every name server refuses this
    # client's credentials, the event does not blame the broker.
    from rmq_async.client.errors import NoPermissionError
    from rmq_async.protocol.codes import ResponseCode

    service, reported = _service()
    refused = NoPermissionError(ResponseCode.NO_PERMISSION, "no permission",
                                addr="127.0.0.1:9876", request="GET_ROUTEINFO_BY_TOPIC")
    service._error_delay(PullRequest(MQ, ProcessQueue(), 5), refused)
    assert [e.kind for e in reported] == [ConsumerErrorKind.PERMISSION_DENIED]
    assert reported[0].detail.startswith("the name servers refuse this client the route")


@pytest.mark.parametrize("error", [ValueError, NotAnException])
async def test_error_handlers_sync_and_async_and_counts(error: type[BaseException]) -> None:
    import asyncio

    from rmq_async.consumer.events import ErrorReporter
    from rmq_async.consumer.tasks import TaskOwner

    reporter = ErrorReporter()
    owner = TaskOwner("consumer[G]")
    reporter.owner = owner
    seen: list[str] = []
    done = asyncio.Event()

    def broken(event: ConsumerError) -> None:
        raise error("a handler bug does not stop the others")

    async def broken_async(event: ConsumerError) -> None:
        raise error("nor does an async handler's")

    async def notify(event: ConsumerError) -> None:
        seen.append(f"async {event.kind}")
        done.set()

    reporter.handlers += [broken, broken_async, lambda e: seen.append(f"sync {e.offset}"),
                          notify]
    reporter.report(ConsumerError(ConsumerErrorKind.CORRUPT_RECORD, "T", MQ, 9, "bad magic"))
    async with asyncio.timeout(5):
        await done.wait()
    await owner.aclose()
    assert seen == ["sync 9", "async corrupt_record"]
    assert reporter.topic_counts("T") == {"corrupt_record": 1}


async def test_a_plain_error_handler_runs_off_the_event_loop_in_report_order() -> None:
    """A plain handler that blocks (a webhook, a file) must not stall the consumer's loop: it
    runs in a worker thread, and the events still reach every handler in report order."""
    import asyncio
    import threading

    from rmq_async.consumer.events import ErrorReporter
    from rmq_async.consumer.tasks import TaskOwner

    reporter = ErrorReporter()
    owner = TaskOwner("consumer[G]")
    reporter.owner = owner
    loop_thread = threading.get_ident()
    release = threading.Event()
    seen: list[tuple[str, int | None, bool]] = []

    def blocking(event: ConsumerError) -> None:
        release.wait(10)  # inline on the loop this would hold every pull until it timed out
        seen.append(("plain", event.offset, threading.get_ident() == loop_thread))

    async def after(event: ConsumerError) -> None:
        seen.append(("async", event.offset, threading.get_ident() == loop_thread))

    reporter.handlers += [blocking, after]
    for offset in (1, 2, 3):
        reporter.report(ConsumerError(ConsumerErrorKind.CORRUPT_RECORD, "T", MQ, offset, "bad"))
    ticks = 0
    for _ in range(5):  # the loop keeps running while the plain handler blocks
        await asyncio.sleep(0.01)
        ticks += 1
    assert ticks == 5 and seen == []
    release.set()
    async with asyncio.timeout(5):
        while len(seen) < 6:
            await asyncio.sleep(0.01)
    await owner.aclose()
    assert seen == [("plain", 1, False), ("async", 1, True), ("plain", 2, False),
                    ("async", 2, True), ("plain", 3, False), ("async", 3, True)]
    assert reporter.topic_counts("T") == {"corrupt_record": 3}


async def test_error_events_reported_while_stopping_are_counted_not_delivered() -> None:
    from rmq_async.consumer.events import ErrorReporter
    from rmq_async.consumer.tasks import TaskOwner

    reporter = ErrorReporter()
    owner = TaskOwner("consumer[G]")
    await owner.aclose()
    reporter.owner = owner  # closed: no task may start
    seen: list[ConsumerError] = []
    reporter.handlers.append(seen.append)
    reporter.report(ConsumerError(ConsumerErrorKind.CORRUPT_RECORD, "T", MQ, 4, "bad"))
    assert seen == [] and reporter.topic_counts("T") == {"corrupt_record": 1}
    reporter.owner = None  # no consumer runs: a plain handler gets it at once
    reporter.report(ConsumerError(ConsumerErrorKind.CORRUPT_RECORD, "T", MQ, 5, "bad"))
    assert [e.offset for e in seen] == [5]


async def test_error_delivery_resumes_on_a_consumer_started_again() -> None:
    """A delivery task cancelled by stop() before it ran must not leave the reporter thinking
    one still runs: the events of the next run reach the handlers."""
    import asyncio

    from rmq_async.consumer.events import ErrorReporter
    from rmq_async.consumer.tasks import TaskOwner

    reporter = ErrorReporter()
    seen: list[int | None] = []

    async def handler(event: ConsumerError) -> None:
        seen.append(event.offset)

    reporter.handlers.append(handler)
    first = TaskOwner("consumer[G]")
    reporter.owner = first
    reporter.report(ConsumerError(ConsumerErrorKind.CORRUPT_RECORD, "T", MQ, 1, "bad"))
    await first.aclose()  # stop() right after the report: the delivery never ran
    reporter.owner = None
    second = TaskOwner("consumer[G]")
    reporter.owner = second  # start() again
    reporter.report(ConsumerError(ConsumerErrorKind.CORRUPT_RECORD, "T", MQ, 2, "bad"))
    async with asyncio.timeout(5):
        while 2 not in seen:
            await asyncio.sleep(0.01)
    await second.aclose()
    assert seen[-1] == 2


async def test_an_error_reported_from_a_worker_thread_is_delivered() -> None:
    """``report_error`` from a plain handler (a worker thread) tried to start the delivery
    task there: RuntimeError (no running event loop) and the event stranded."""
    import asyncio

    import anyio

    from rmq_async.consumer.events import ErrorReporter
    from rmq_async.consumer.tasks import TaskOwner

    reporter = ErrorReporter()
    owner = TaskOwner("consumer[G]")
    reporter.owner = owner
    seen: list[int | None] = []
    reporter.handlers.append(lambda e: seen.append(e.offset))
    event = ConsumerError(ConsumerErrorKind.CORRUPT_RECORD, "T", MQ, 7, "bad")
    await anyio.to_thread.run_sync(reporter.report, event)
    async with asyncio.timeout(5):
        while seen != [7]:
            await asyncio.sleep(0.01)
    await owner.aclose()
    assert reporter.topic_counts("T") == {"corrupt_record": 1}


async def test_drain_waits_for_a_delivery_started_by_an_event_reported_meanwhile() -> None:
    import asyncio

    from rmq_async.consumer.events import ErrorReporter
    from rmq_async.consumer.tasks import TaskOwner

    reporter = ErrorReporter()
    owner = TaskOwner("consumer[G]")
    reporter.owner = owner
    seen: list[int | None] = []

    async def handler(event: ConsumerError) -> None:
        await asyncio.sleep(0.05)
        seen.append(event.offset)

    reporter.handlers.append(handler)
    reporter.report(ConsumerError(ConsumerErrorKind.CORRUPT_RECORD, "T", MQ, 1, "bad"))
    first = reporter._delivery
    assert first is not None
    # Reported just as the first delivery ends (as from a plain handler's thread): it starts
    # a second delivery, which drain() must wait for too.
    first.add_done_callback(lambda _: reporter.report(
        ConsumerError(ConsumerErrorKind.CORRUPT_RECORD, "T", MQ, 2, "bad")))
    assert await reporter.drain(5.0)
    assert seen == [1, 2]
    await owner.aclose()

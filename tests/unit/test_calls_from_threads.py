"""pause() / resume() / subscribe() / unsubscribe() called from another thread (a plain
handler's worker thread) run on the consumer's event loop. No broker: the loop is the test's."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from rmq_async import PushConsumer
from rmq_async.consumer import push as push_module


def _consumer_on_this_loop() -> PushConsumer:
    consumer = PushConsumer("G_threads", namesrv="127.0.0.1:9876")
    consumer._loop = asyncio.get_running_loop()  # as start() records it
    return consumer


async def test_a_call_from_a_thread_runs_on_the_loop_and_is_waited_for() -> None:
    consumer = _consumer_on_this_loop()
    ran_on: list[int] = []
    real = consumer._topic_set

    def recording(topics: object) -> set[str]:
        ran_on.append(threading.get_ident())
        return real(topics)  # type: ignore[arg-type]

    consumer._topic_set = recording  # type: ignore[method-assign]
    await asyncio.to_thread(consumer.pause, "orders")
    assert consumer.is_paused("orders")  # done when pause() returned in the thread
    assert ran_on == [threading.get_ident()]  # on the loop's thread
    await asyncio.to_thread(consumer.resume, "orders")
    assert not consumer.is_paused("orders")


async def test_a_call_the_loop_does_not_take_in_time_fails_and_is_not_made_later(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(push_module, "THREAD_CALL_TIMEOUT", 0.2)
    consumer = _consumer_on_this_loop()
    outcome: list[BaseException | None] = []

    def in_thread() -> None:
        try:
            consumer.pause("orders")
        except BaseException as exc:
            outcome.append(exc)
        else:
            outcome.append(None)

    thread = threading.Thread(target=in_thread)
    thread.start()
    time.sleep(0.6)  # noqa: ASYNC251 -- blocks the loop on purpose: the call waits, then gives up
    thread.join(5)
    assert len(outcome) == 1 and isinstance(outcome[0], TimeoutError)
    await asyncio.sleep(0.05)  # the loop runs its callbacks now
    assert not consumer.is_paused("orders")  # the failed call was not made after all

"""The user call a piece of code is part of, which ``stop()`` called there must not wait for.

A consumer's task marks the user code it runs (a handler's chunk, rebalance listeners, error
handlers) as a :class:`UserCall` in its context; what that code starts (a worker thread, a
coroutine a thread hands back to the loop, a task of its own) inherits the mark while the call
runs. ``aclose`` spares the call's task, and :class:`BusyWorkers` does not wait for its work.
"""

from __future__ import annotations

import asyncio
from typing import Any

import anyio.from_thread
import anyio.to_thread

from rmq_async.consumer.service import BusyWorkers
from rmq_async.consumer.tasks import TaskOwner, running_user_call


def _task_of(call: Any) -> Any:
    return call.task if call is not None else None


async def test_a_user_call_is_seen_where_its_code_runs_until_it_returns() -> None:
    root = TaskOwner("consumer[G]")
    child = TaskOwner("consume[G]", family=root)
    stranger = TaskOwner("consumer[H]")
    busy = BusyWorkers(child.family)
    seen: dict[str, Any] = {}
    left_running: list[asyncio.Task[Any]] = []
    release = asyncio.Event()

    async def inner() -> Any:
        return _task_of(running_user_call(root.family))

    def in_thread() -> Any:
        return _task_of(running_user_call(root.family)), anyio.from_thread.run(inner)

    async def outlives_the_call() -> Any:
        await release.wait()
        return running_user_call()

    async def worker() -> None:
        me = asyncio.current_task()
        assert me is not None
        seen["before"] = running_user_call()
        call = busy.take(me)
        try:
            seen["call"] = _task_of(running_user_call(root.family))
            seen["other family"] = running_user_call(stranger.family)
            seen["thread"], seen["back on the loop"] = await anyio.to_thread.run_sync(in_thread)
            seen["its own task"] = await asyncio.get_running_loop().create_task(inner())
            left_running.append(asyncio.get_running_loop().create_task(outlives_the_call()))
        finally:
            busy.done(call)
        seen["after"] = running_user_call()

    task = child.spawn(worker(), name="worker-0")
    await task
    assert seen == {"before": None, "call": task, "other family": None, "thread": task,
                    "back on the loop": task, "its own task": task, "after": None}
    # A task the call started and left running is on its own once the call has returned.
    release.set()
    assert await left_running[0] is None
    assert running_user_call() is None  # the mark stays in the worker's own context
    await root.aclose()
    await child.aclose()


async def test_aclose_spares_the_task_whose_call_closes_it() -> None:
    owner = TaskOwner("consume[G]")
    busy = BusyWorkers(owner.family)
    closed_from_thread = asyncio.Event()
    finished: list[str] = []

    async def handler_like() -> None:
        me = asyncio.current_task()
        assert me is not None
        call = busy.take(me)
        try:
            # A plain handler's thread closes the owner (as stop() would) through the loop.
            await anyio.to_thread.run_sync(anyio.from_thread.run, owner.aclose)
            closed_from_thread.set()
            await asyncio.sleep(0)
            finished.append("spared")
        finally:
            busy.done(call)

    async def idle() -> None:
        await asyncio.sleep(3600)

    bystander = owner.spawn(idle(), name="worker-1")
    caller = owner.spawn(handler_like(), name="worker-0")
    await asyncio.wait_for(closed_from_thread.wait(), 10)
    assert bystander.cancelled()  # the others are cancelled and waited for
    await asyncio.wait_for(caller, 10)  # the spared one ends on its own
    assert finished == ["spared"] and owner.closed


async def test_busy_workers_wait_for_all_but_the_caller() -> None:
    busy = BusyWorkers(object())
    loop = asyncio.get_running_loop()
    calls: dict[str, Any] = {}
    go = {name: asyncio.Event() for name in "ab"}

    async def work(name: str) -> None:
        me = asyncio.current_task()
        assert me is not None
        calls[name] = busy.take(me)
        await go[name].wait()
        busy.done(calls[name])

    await asyncio.wait_for(busy.wait_idle(), 1)  # nothing in hand
    a = loop.create_task(work("a"))
    b = loop.create_task(work("b"))
    await asyncio.sleep(0)
    waiter = loop.create_task(busy.wait_idle(caller=a))
    await asyncio.sleep(0.05)
    assert not waiter.done()  # b's work is waited for
    go["b"].set()
    await asyncio.wait_for(waiter, 1)  # a's is not: a is the caller
    waiter = loop.create_task(busy.wait_idle())
    await asyncio.sleep(0.05)
    assert not waiter.done()  # without a caller, a's work is waited for too
    go["a"].set()
    await asyncio.wait_for(waiter, 1)
    await asyncio.gather(a, b)
    assert calls["a"].done and calls["b"].done

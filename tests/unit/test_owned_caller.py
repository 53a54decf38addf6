"""The owned task a piece of code runs for, which ``stop()`` called there must not wait for.

``TaskOwner.spawn`` marks each task in its own context; what the task's code starts (a worker
thread, a task of its own, a coroutine a thread hands back to the loop) inherits the mark.
``aclose`` spares that task, and :class:`BusyWorkers` does not wait for its work.
"""

from __future__ import annotations

import asyncio
from typing import Any

import anyio.from_thread
import anyio.to_thread

from rmq_async.consumer.service import BusyWorkers
from rmq_async.consumer.tasks import TaskOwner, owned_caller


async def test_a_spawned_task_and_what_its_code_starts_know_the_task() -> None:
    root = TaskOwner("consumer[G]")
    child = TaskOwner("consume[G]", family=root)
    stranger = TaskOwner("consumer[H]")
    seen: dict[str, Any] = {}

    async def inner() -> Any:
        return owned_caller(root.family)

    def in_thread() -> Any:
        return owned_caller(root.family), anyio.from_thread.run(inner)

    async def work() -> None:
        seen["task"] = owned_caller(root.family)
        seen["other family"] = owned_caller(stranger.family)
        seen["thread"], seen["back on the loop"] = await anyio.to_thread.run_sync(in_thread)
        seen["its own task"] = await asyncio.get_running_loop().create_task(inner())

    assert owned_caller() is None  # not in an owned task
    task = child.spawn(work(), name="worker-0")
    await task
    assert seen == {"task": task, "other family": None, "thread": task,
                    "back on the loop": task, "its own task": task}
    assert owned_caller() is None  # the mark stays in the task's own context
    await root.aclose()
    await child.aclose()


async def test_aclose_spares_the_task_its_caller_runs_for() -> None:
    owner = TaskOwner("consume[G]")
    closed_from_thread = asyncio.Event()
    finished: list[str] = []

    async def handler_like() -> None:
        # A plain handler's thread closes the owner (as stop() would) through the loop.
        await anyio.to_thread.run_sync(anyio.from_thread.run, owner.aclose)
        closed_from_thread.set()
        await asyncio.sleep(0)
        finished.append("spared")

    async def idle() -> None:
        await asyncio.sleep(3600)

    bystander = owner.spawn(idle(), name="worker-1")
    caller = owner.spawn(handler_like(), name="worker-0")
    await asyncio.wait_for(closed_from_thread.wait(), 10)
    assert bystander.cancelled()  # the others are cancelled and waited for
    await asyncio.wait_for(caller, 10)  # the spared one ends on its own
    assert finished == ["spared"] and owner.closed


async def test_busy_workers_wait_for_all_but_the_caller() -> None:
    busy = BusyWorkers()
    loop = asyncio.get_running_loop()
    a = loop.create_task(asyncio.sleep(3600))
    b = loop.create_task(asyncio.sleep(3600))
    try:
        await asyncio.wait_for(busy.wait_idle(), 1)  # nothing in hand
        busy.take(a)
        busy.take(b)
        waiter = loop.create_task(busy.wait_idle(caller=a))
        await asyncio.sleep(0.05)
        assert not waiter.done()  # b's work is waited for
        busy.done(b)
        await asyncio.wait_for(waiter, 1)  # a's is not: a is the caller
        waiter = loop.create_task(busy.wait_idle())
        await asyncio.sleep(0.05)
        assert not waiter.done()  # without a caller, a's work is waited for too
        busy.done(a)
        await asyncio.wait_for(waiter, 1)
    finally:
        a.cancel()
        b.cancel()

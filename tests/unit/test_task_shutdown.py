"""Closing never hangs on a task that swallowed its cancellation.

The orderly broker test once hung for minutes in ``stop()``: the broker's
NOTIFY_CONSUMER_IDS_CHANGED (which sets the rebalancer's wake-up event) arrived in the same loop
iteration as ``stop()`` cancelled the rebalancer task. On Python 3.11 ``asyncio.wait_for``
returns normally in that case, so the rebalancer swallowed the cancellation and went on with its
rounds, while ``TaskOwner.aclose`` waited for it forever. These tests inject exactly that
interleaving.
"""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

import pytest
from structlog.testing import capture_logs

from rmq_async.consumer import tasks as tasks_mod
from rmq_async.consumer.rebalance import Rebalancer
from rmq_async.consumer.tasks import TaskOwner


def _stub_runtime() -> Any:
    return SimpleNamespace(group="G", stopping=False,
                           options=SimpleNamespace(rebalance_interval=20.0))


async def test_rebalancer_woken_and_cancelled_in_one_iteration_ends() -> None:
    rebalancer = Rebalancer(_stub_runtime(), pull=None, orderly=None)  # type: ignore[arg-type]
    rounds = 0

    async def one_round() -> None:
        nonlocal rounds
        rounds += 1

    rebalancer.rebalance_once = one_round  # type: ignore[method-assign]
    owner = TaskOwner("consumer[G]")
    task = owner.spawn(rebalancer.run(), name="rebalance")
    while rounds < 1:
        await asyncio.sleep(0)
    await asyncio.sleep(0.01)  # parked in its wait for the next round
    # The broker's notification and stop() in the same loop iteration, as in the hang.
    rebalancer.wake()
    async with asyncio.timeout(5):
        await owner.aclose()
    assert task.cancelled()
    assert rounds == 1


async def test_owner_cancels_again_a_task_that_swallowed_the_cancellation(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(tasks_mod, "RECANCEL_INTERVAL", 0.05)
    swallowed = 0

    async def stubborn() -> None:
        nonlocal swallowed
        while True:
            try:
                await asyncio.sleep(3600)
            except asyncio.CancelledError:
                if swallowed == 0:
                    swallowed += 1
                    continue  # the first cancellation is lost, as wait_for on 3.11 loses it
                raise

    owner = TaskOwner("svc")
    task = owner.spawn(stubborn(), name="stubborn")
    await asyncio.sleep(0)
    with capture_logs() as logs:
        async with asyncio.timeout(5):
            await owner.aclose()
    assert task.cancelled() and swallowed == 1
    ignored = [e for e in logs if e["event"] == "task.ignored_cancel"]
    assert len(ignored) == 1 and ignored[0]["task"] == "svc:stubborn"
    assert "in stubborn" in ignored[0]["stack"]


async def test_owner_gives_up_loudly_on_a_task_that_never_ends(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(tasks_mod, "RECANCEL_INTERVAL", 0.05)
    release = asyncio.Event()

    async def immortal() -> None:
        while not release.is_set():
            try:
                await asyncio.sleep(3600)
            except asyncio.CancelledError:
                continue

    owner = TaskOwner("svc")
    task = owner.spawn(immortal(), name="immortal")
    await asyncio.sleep(0)
    with capture_logs() as logs:
        async with asyncio.timeout(5):
            await owner.aclose(abandon_after=0.3)
    assert not task.done()
    abandoned = [e for e in logs if e["event"] == "task.abandoned"]
    assert [e["task"] for e in abandoned] == ["svc:immortal"]
    release.set()
    task.cancel()
    await asyncio.wait([task], timeout=5)
    assert task.done()


async def test_cancel_by_key_is_bounded_too(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(tasks_mod, "RECANCEL_INTERVAL", 0.05)
    swallowed = False

    async def pull_loop() -> None:
        nonlocal swallowed
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            swallowed = True
        await asyncio.sleep(3600)

    owner = TaskOwner("pull")
    task = owner.spawn(pull_loop(), name="q0", key="q0")
    await asyncio.sleep(0)
    async with asyncio.timeout(5):
        await owner.cancel("q0")
    assert swallowed and task.cancelled()
    await owner.aclose()


async def test_stop_waits_for_every_service_side_by_side() -> None:
    """A sink whose final write overruns stop()'s timeout does not take the time of the
    listener calls that finish meanwhile: each service drains for the whole timeout."""
    from rmq_async.consumer.service import wait_all_idle

    finished: list[str] = []

    class Service:
        def __init__(self, name: str, seconds: float) -> None:
            self.name, self.seconds = name, seconds

        async def wait_idle(self, caller: object = None) -> None:
            await asyncio.sleep(self.seconds)
            finished.append(self.name)

    services = [Service("sink", 30.0), Service("concurrent", 0.1), Service("orderly", 0.2)]
    async with asyncio.timeout(5):
        assert await wait_all_idle(services, 0.5) is False  # type: ignore[arg-type]
    assert finished == ["concurrent", "orderly"]
    finished.clear()
    assert await wait_all_idle(services[1:], 0.5) is True  # type: ignore[arg-type]
    assert finished == ["concurrent", "orderly"]

"""pytest fixtures backed by a real local RocketMQ.

Load with ``pytest_plugins = ["rmq_async.devbroker.pytest_plugin"]``.

- ``rocketmq`` (session): one :class:`LocalRocketMQ` shared by every test that asks for it.
  It is started and stopped from a plain (synchronous) fixture on private event loops, so it
  works with pytest-asyncio's per-test loops: the JVMs are separate processes and the object
  keeps no loop-bound state. If it cannot start, each test using it errors with the
  :class:`DevBrokerError` text (never a silent skip).
- ``topic`` (function): a fresh, uniquely named topic with 8 queues on that broker.
- ``rocketmq_cluster`` (module): a :class:`LocalCluster`, by default two broker groups with one
  slave each and two name servers, shared by the tests of one module. A module shapes it with a
  ``ROCKETMQ_CLUSTER`` dict of :class:`LocalCluster` keyword arguments.

The shared broker delays every retry level by one second (``messageDelayLevel``), so a message
a listener asks to reconsume comes back after 1 s instead of 10 s or more.
"""

from __future__ import annotations

import asyncio
import re
import uuid
from collections.abc import Coroutine, Iterator
from typing import Any, TypeVar

import pytest
import pytest_asyncio

from .broker import LocalRocketMQ
from .cluster import LocalCluster

__all__ = ["FAST_DELAY_LEVELS", "SESSION_BROKER_CONFIG", "rocketmq", "rocketmq_cluster",
           "run_blocking", "topic"]

T = TypeVar("T")

#: Eighteen delay levels of one second each (the broker default spans 1 s … 2 h).
FAST_DELAY_LEVELS = " ".join(["1s"] * 18)
#: Broker settings of the shared test broker (on top of LocalRocketMQ's own defaults).
#:
#: The timer wheel (5.x messages with a delivery time, not the delay levels that retries use) is
#: left off: its services wake every 100 ms and take about a quarter of an idle broker's CPU,
#: which a test run with several brokers alive for minutes pays on two cores. A test that needs
#: timer messages passes ``{"timerWheelEnable": "true"}`` to its own broker.
SESSION_BROKER_CONFIG: dict[str, str] = {"messageDelayLevel": FAST_DELAY_LEVELS,
                                         "timerWheelEnable": "false"}


#: How long an interrupted :func:`run_blocking` waits for its coroutine's clean-up.
CLEANUP_SECONDS = 60.0


def run_blocking(coro: Coroutine[Any, Any, T]) -> T:
    """Run ``coro`` to completion on a private event loop of the calling (main) thread.

    The loop is never installed as the thread's current loop, so pytest-asyncio's loops are
    left alone. JVMs started here die with this thread (parent-death signal), which for the
    main thread means: with the test process.
    """
    loop = asyncio.new_event_loop()
    task = loop.create_task(coro)
    try:
        return loop.run_until_complete(task)
    except BaseException:
        # pytest-timeout's alarm (or Ctrl-C) raised inside the loop: the start is still under
        # way. Cancelled and drained here, its own clean-up (a shielded teardown) stops what
        # it started; left as it was, the loop closed under it and its JVMs lived on.
        if not task.done():
            task.cancel()
            loop.run_until_complete(asyncio.wait({task}, timeout=CLEANUP_SECONDS))
            if task.done() and not task.cancelled():
                task.exception()  # (its own error: the interruption is what is raised)
        raise
    finally:
        try:
            loop.run_until_complete(loop.shutdown_asyncgens())
            loop.run_until_complete(loop.shutdown_default_executor())
        finally:
            loop.close()


@pytest.fixture(scope="session")
def rocketmq() -> Iterator[LocalRocketMQ]:
    """The shared local RocketMQ (NameServer + Broker) of this test session."""
    rmq = LocalRocketMQ(broker_config=SESSION_BROKER_CONFIG)
    run_blocking(rmq.start_all())
    try:
        yield rmq
    finally:
        run_blocking(rmq.close())


_UNSAFE = re.compile(r"[^a-zA-Z0-9_-]+")


@pytest_asyncio.fixture
async def topic(rocketmq: LocalRocketMQ, request: pytest.FixtureRequest) -> str:
    """A new topic with 8 read/write queues, named after the test plus a random suffix."""
    base = _UNSAFE.sub("_", request.node.name)[:60].strip("_") or "test"
    name = f"T_{base}_{uuid.uuid4().hex[:8]}"
    await rocketmq.create_topic(name, queues=8)
    return name


@pytest.fixture(scope="module")
def rocketmq_cluster(request: pytest.FixtureRequest) -> Iterator[LocalCluster]:
    """A local cluster for the tests of one module (``ROCKETMQ_CLUSTER`` shapes it)."""
    shape: dict[str, Any] = {"groups": 2, "slaves": 1, "namesrvs": 2,
                             "broker_config": SESSION_BROKER_CONFIG}
    shape.update(getattr(request.module, "ROCKETMQ_CLUSTER", {}))
    cluster = LocalCluster(**shape)
    run_blocking(cluster.start_all())
    try:
        yield cluster
    finally:
        run_blocking(cluster.close())

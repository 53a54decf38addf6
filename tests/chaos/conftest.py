"""Fixtures of the chaos suite: proxies in front of the shared broker, a broker of the test's
own for kill -9, the Java reference consumer; the figures of every scenario at the end."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import pytest_asyncio

from rmq_async.devbroker import LocalRocketMQ
from rmq_async.devbroker.java import compile_java
from rmq_async.devbroker.pytest_plugin import SESSION_BROKER_CONFIG, run_blocking
from tests.chaos.common import REPORT
from tests.chaos.proxy import FaultProxy
from tests.helpers import SHORT_LIVED_BROKER_FLAGS

JAVA_DIR = Path(__file__).resolve().parent.parent / "java"


@dataclass
class Proxies:
    """A name-server proxy whose route answers point at a broker proxy."""

    namesrv: FaultProxy
    broker: FaultProxy

    @property
    def namesrv_addr(self) -> str:
        return self.namesrv.addr

    def all(self) -> tuple[FaultProxy, FaultProxy]:
        return self.namesrv, self.broker


async def start_proxies(rmq: LocalRocketMQ) -> Proxies:
    broker = await FaultProxy(rmq.broker_addr, name="broker").start()
    namesrv = await FaultProxy(rmq.namesrv_addr, name="namesrv",
                               rewrite={rmq.broker_addr: broker.addr}).start()
    return Proxies(namesrv, broker)


@pytest_asyncio.fixture
async def proxies(rocketmq: LocalRocketMQ) -> AsyncIterator[Proxies]:
    p = await start_proxies(rocketmq)
    try:
        yield p
    finally:
        for proxy in p.all():
            await proxy.close()


@pytest_asyncio.fixture
async def own_rocketmq() -> AsyncIterator[LocalRocketMQ]:
    """A broker of the test's own, to kill -9 and restart."""
    rmq = LocalRocketMQ(broker_config=SESSION_BROKER_CONFIG,
                        broker_jvm_flags=SHORT_LIVED_BROKER_FLAGS)
    await rmq.start_all()
    try:
        yield rmq
    finally:
        await rmq.close()


@dataclass
class JavaClasses:
    classpath: str


@pytest.fixture(scope="session")
def java_classes(rocketmq: LocalRocketMQ,
                 tmp_path_factory: pytest.TempPathFactory) -> Iterator[JavaClasses]:
    out_dir = tmp_path_factory.mktemp("chaos-java")
    classes = run_blocking(compile_java(sorted(JAVA_DIR.glob("*.java")), rocketmq.lib_dir,
                                        out_dir))
    yield JavaClasses(classpath=f"{classes}:{rocketmq.lib_dir}/*")


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    if REPORT:
        terminalreporter.section("chaos figures")
        for line in REPORT:
            terminalreporter.write_line(line)

"""Fixtures for broker tests: the Java reference programs compiled against the broker jars."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from rmq_async.devbroker import LocalRocketMQ
from rmq_async.devbroker.java import compile_java, run_java
from rmq_async.devbroker.pytest_plugin import run_blocking

JAVA_DIR = Path(__file__).resolve().parent.parent / "java"


@dataclass
class JavaPrograms:
    """The Java programs of tests/java, compiled once against the broker's Maven jars."""

    classpath: str
    lib_dir: Path

    async def run(self, main_class: str, *args: str, timeout: float = 120.0) -> str:
        rc, out, err = await run_java(main_class, list(args), self.classpath, timeout=timeout)
        if rc != 0:
            raise AssertionError(f"{main_class} exited {rc}:\n{err[-4000:]}\n{out[-2000:]}")
        return out


@pytest.fixture(scope="session")
def java_programs(rocketmq: LocalRocketMQ,
                  tmp_path_factory: pytest.TempPathFactory) -> Iterator[JavaPrograms]:
    out_dir = tmp_path_factory.mktemp("java-classes")
    sources = sorted(JAVA_DIR.glob("*.java"))
    classes = run_blocking(compile_java(sources, rocketmq.lib_dir, out_dir))
    yield JavaPrograms(classpath=f"{classes}:{rocketmq.lib_dir}/*", lib_dir=rocketmq.lib_dir)

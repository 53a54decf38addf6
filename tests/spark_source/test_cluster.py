"""The stream on a Spark standalone cluster on loopback: a master and two workers started from
the PySpark distribution (``spark-class``), the driver as a subprocess, reads in executors.

Which executor read what is taken from the executors' own logs (each worker keeps its
executors' stdout/stderr under its work dir): every partition read logs
``spark_source.partition_read`` with its row count and the reading process.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import signal
import socket
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from rmq_async.devbroker import LocalRocketMQ
from tests.helpers import produce, simple_messages, wait_until
from tests.spark_source.common import stored_offsets
from tests.spark_source.session import FULL
from tests.spark_source.test_stream import check_exactly_once, driver

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

pytestmark = [pytest.mark.broker, pytest.mark.spark]

CLUSTER_MESSAGES = 200_000 if FULL else 16_000
_READ = re.compile(r"spark_source\.partition_read\b.*")
_FIELD = re.compile(r"\b(rows|pid)=(\d+)")


def _spark_home() -> Path:
    import pyspark

    return Path(pyspark.__file__).resolve().parent


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextlib.asynccontextmanager
async def spark_daemon(args: list[str], log: Path) -> AsyncIterator[asyncio.subprocess.Process]:
    """``spark-class <args>`` in a session of its own (killed with everything it started)."""
    env = dict(os.environ, SPARK_HOME=str(_spark_home()), SPARK_LOCAL_IP="127.0.0.1",
               SPARK_DAEMON_MEMORY="256m", PYSPARK_PYTHON=sys.executable,
               SPARK_DAEMON_JAVA_OPTS="-XX:TieredStopAtLevel=1 -XX:+UseSerialGC")
    out = log.open("ab")
    proc = await asyncio.create_subprocess_exec(
        str(_spark_home() / "bin" / "spark-class"), *args, stdout=out,
        stderr=asyncio.subprocess.STDOUT, env=env, start_new_session=True)
    try:
        yield proc
    finally:
        out.close()
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        await proc.wait()


def _reads(work_dir: Path) -> list[tuple[int, int]]:
    """``(pid, rows)`` of every partition read logged by the executors of one worker."""
    found = []
    for path in work_dir.rglob("std*"):
        for line in path.read_text(errors="replace").splitlines():
            if _READ.search(line):
                fields = dict(_FIELD.findall(line))
                found.append((int(fields["pid"]), int(fields["rows"])))
    return found


@pytest.mark.slow(seconds=65)
@pytest.mark.timeout(600 if FULL else 180)
async def test_stream_on_a_standalone_cluster_reads_on_both_workers(
        rocketmq: LocalRocketMQ, topic: str, spark: SparkSession, tmp_path: Path) -> None:
    ns = rocketmq.namesrv_addr
    t0 = time.monotonic()
    await produce(ns, topic, simple_messages(topic, CLUSTER_MESSAGES, size=100), batch=128)
    maxes = await stored_offsets(ns, topic, CLUSTER_MESSAGES)
    assert sum(maxes.values()) == CLUSTER_MESSAGES

    port = _free_port()
    master_url = f"spark://127.0.0.1:{port}"
    master_log = tmp_path / "master.log"
    work = [tmp_path / "worker-1", tmp_path / "worker-2"]
    async with contextlib.AsyncExitStack() as stack:
        await stack.enter_async_context(spark_daemon(
            ["org.apache.spark.deploy.master.Master", "--host", "127.0.0.1", "--port", str(port),
             "--webui-port", str(_free_port())], master_log))
        for i, wdir in enumerate(work):
            wdir.mkdir()
            await stack.enter_async_context(spark_daemon(
                ["org.apache.spark.deploy.worker.Worker", "--host", "127.0.0.1",
                 "--webui-port", str(_free_port()), "--cores", "1", "--memory", "1g",
                 "--work-dir", str(wdir), master_url], tmp_path / f"worker-{i + 1}.log"))

        def registered() -> int:
            text = master_log.read_text(errors="replace") if master_log.exists() else ""
            return text.count("Registering worker")

        await wait_until(lambda: registered() >= 2, 90, interval=0.2, what="two registered workers")
        started = time.monotonic() - t0
        spec = {"namesrv": ns, "topic": topic, "path": str(tmp_path / "out"),
                "checkpoint": str(tmp_path / "checkpoint"), "available_now": True,
                "master": master_url,
                "options": {"maxMessagesPerTrigger": CLUSTER_MESSAGES // 2},
                "conf": {"spark.executor.cores": "1", "spark.cores.max": "2",
                         "spark.executor.memory": "512m", "spark.driver.host": "127.0.0.1",
                         "spark.executor.extraJavaOptions":
                             "-XX:TieredStopAtLevel=1 -XX:+UseSerialGC"}}
        async with driver(spec, tmp_path / "driver.log") as run:
            rc = await run.wait(500 if FULL else 120)
            assert rc == 0, run.output()[-6000:]

    per_worker = [_reads(w) for w in work]
    rows = check_exactly_once(spark, tmp_path / "out", maxes)
    assert all(per_worker), f"a worker read nothing: {per_worker}"
    assert sum(r for reads in per_worker for _, r in reads) == CLUSTER_MESSAGES
    summary = [(len({p for p, _ in reads}), sum(r for _, r in reads)) for reads in per_worker]
    print(f"\ncluster: workers up after {started:.1f}s; {rows} rows exactly once; "
          f"(reading processes, rows) per worker: {summary}; total {time.monotonic() - t0:.1f}s")

"""Smoke test of the benchmark harness: ``benchmarks/run.py --quick`` end to end.

It checks that the run completes and that its outputs exist and are well formed (every run
verified, figures present and consistent, the markdown tables regular, the PNG decodable); it
does not judge speeds.
"""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
import zlib
from pathlib import Path
from typing import Any

import pytest

from tests.helpers import JAVA_CONSUMER_FLAGS

REPO = Path(__file__).resolve().parents[2]
RUNNER = REPO / "benchmarks" / "run.py"
DRAINS = ("drain-1KiB", "drain-100B", "drain-16KiB")


def _png_size(data: bytes) -> tuple[int, int]:
    """Width and height from a PNG's IHDR chunk, after checking signature and chunk CRCs."""
    assert data[:8] == b"\x89PNG\r\n\x1a\n", "not a PNG signature"
    pos = 8
    size: tuple[int, int] | None = None
    seen_end = False
    while pos < len(data):
        (length,) = struct.unpack(">I", data[pos:pos + 4])
        kind = data[pos + 4:pos + 8]
        body = data[pos + 8:pos + 8 + length]
        (crc,) = struct.unpack(">I", data[pos + 8 + length:pos + 12 + length])
        assert zlib.crc32(kind + body) == crc, f"bad CRC in chunk {kind!r}"
        if kind == b"IHDR":
            size = struct.unpack(">II", body[:8])
        if kind == b"IEND":
            seen_end = True
            break
        pos += 12 + length
    assert size is not None, "no IHDR chunk"
    assert seen_end, "no IEND chunk"
    return size


def _tables(markdown: str) -> list[list[list[str]]]:
    """Every markdown table as rows of cells."""
    tables: list[list[list[str]]] = []
    current: list[list[str]] = []
    for line in markdown.splitlines():
        if line.startswith("|"):
            current.append([c.strip() for c in line.strip().strip("|").split("|")])
        elif current:
            tables.append(current)
            current = []
    if current:
        tables.append(current)
    return tables


@pytest.mark.broker
@pytest.mark.slow(seconds=160)
@pytest.mark.timeout(600)  # two benchmark rounds with a JVM contender: minutes on 2 cores
def test_bench_quick_writes_wellformed_outputs(tmp_path: Path) -> None:
    out = tmp_path / "bench"
    # The JVMs the harness starts (the Java consumers, the Spark driver) run on C1 alone here:
    # about 55 CPU seconds less on the test machine's two cores, where the tests of the other
    # workers run meanwhile. Speeds are not what this checks.
    quick_jit = "-XX:TieredStopAtLevel=1"
    child_env = {**os.environ,
                 "PYSPARK_SUBMIT_ARGS": f"--driver-java-options={quick_jit} pyspark-shell"}
    proc = subprocess.run(
        # A quarter of the quick sizes: this checks the harness and its outputs, not speeds.
        # The Java client's occasional 20 s start stall (benchmarks/README.md) is not what
        # this checks: its rebalance retries after 2 s here, as in the other tests.
        [sys.executable, str(RUNNER), "--quick", "--scale", "0.25", "--out", str(out),
         *(f"--java-flag={flag}" for flag in (*JAVA_CONSUMER_FLAGS, quick_jit))],
        cwd=REPO, env=child_env, capture_output=True, text=True, timeout=900, check=False,
    )
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stderr[-6000:]}"
    # The progress display names the contenders as they run.
    assert "java-tuned" in proc.stderr and "rmq_async-tuned" in proc.stderr

    data: dict[str, Any] = json.loads((out / "results.json").read_text())
    env = data["env"]
    for key in ("cpu_model", "cpu_count", "python", "java", "rocketmq_version",
                "rmq_async_version"):
        assert env[key], key
    assert data["config"]["mode"] == "quick"
    assert set(JAVA_CONSUMER_FLAGS) <= set(env["java_flags"])

    scenarios = data["scenarios"]
    for name in (*DRAINS, "latency"):
        sc = scenarios[name]
        assert sc["runs"], name
        names = {r["contender"] for r in sc["runs"]}
        assert any(n.startswith("rmq_async") for n in names), name
        assert any(n.startswith("java") for n in names), name
        for run in sc["runs"]:
            where = f"{name}/{run['contender']}/{run['round']}"
            assert run["verified"], f"{where}: {run['reason']}"
            assert run["consumed"] == sc["messages"], where
            assert run["duplicates"] == 0, where
            assert run["msgs_per_s"] > 0, where
            assert run["cpu_s_per_million"] > 0, where
            assert run["peak_rss_mib"] > 0, where
            assert 0 <= run["first_message_seconds"] <= run["seconds"], where
            assert 0.0 <= run["host_steal_pct"] <= 100.0, where
            # Serving the pulls costs the broker something, whoever pulls; the pure-Python
            # contenders also say how long their event loop waited for a CPU.
            if not run["contender"].startswith("rocketmq"):
                assert run["broker_cpu_s_per_million"] > 0, where
            if run["contender"].startswith(("rmq_async", "raw")):
                assert 0.0 <= run["loop_waited_s"] <= run["seconds"], where
                assert run["loop_involuntary_switches"] >= 0, where
    preload = scenarios["drain-1KiB"]["preload"]
    assert sum(preload["per_queue"]) == preload["messages"] == scenarios["drain-1KiB"]["messages"]
    # The quick run goes without the broker's warm-up round (tests/unit/test_bench_harness.py
    # checks the full run's).
    assert all(scenarios[name]["warm_up"] == [] for name in DRAINS)
    raw = {r["contender"] for r in scenarios["drain-1KiB"]["runs"]}
    assert {"raw-pull", "raw-pull-decode", "rmq_async", "java"} <= raw

    for run in scenarios["latency"]["runs"]:
        for metric in ("latency_b2c_ms", "latency_s2c_ms"):
            lat = run[metric]
            assert lat["n"] == scenarios["latency"]["messages"]
            assert lat["p50"] <= lat["p99"] <= lat["max"]
        assert run["producer"]["messages"] == scenarios["latency"]["messages"]

    summary = data["summary"]["drain-1KiB"]
    assert summary["rmq_async"]["java_peer"] == "java"
    assert summary["rmq_async"]["vs_java"]["msgs_per_s"] > 0
    assert summary["java"]["vs_java"] is None  # Java is the reference, not compared

    spark = scenarios["spark"]
    if "skipped" not in spark:
        assert {r["contender"] for r in spark["runs"]} == {"spark-sink", "spark-sink-bulk",
                                                              "plain-spark-arrow", "spark-source"}
        assert all(r["ok"] and r["rows"] == spark["messages"] for r in spark["runs"])
        assert data["summary"]["spark"]["sink_over_plain"] > 0
        assert data["summary"]["spark"]["source_over_plain"] > 0
        assert data["summary"]["spark"]["bulk_sink_over_plain"] > 0
        # Each timed path says where its CPU went: this process, Spark's, the broker's.
        for r in spark["runs"]:
            cpu = r["cpu_s_per_million"]
            assert cpu["python"] > 0 and cpu["spark"] > 0, r
            assert 0.0 <= r["host_steal_pct"] <= 100.0, r
            assert cpu["broker"] is not None and cpu["broker"] >= 0, r
        sink_cpu = data["summary"]["spark"]["spark-sink"]["cpu_s_per_million"]
        assert sink_cpu["broker"] > 0, sink_cpu  # the sink's pulls cost the broker something

    md = (out / "summary.md").read_text()
    # The host's steal over the whole run (every contender's figures move with it).
    assert 0.0 <= data["host_steal_pct"] <= 100.0
    assert f"{data['host_steal_pct']:.1f}% of the machine's time" in md
    # Each drain's rounds, in order, under its table.
    assert md.count("Rounds, msgs/s in run order") == len(DRAINS)
    assert "loop waited" in md and "broker" in md
    if "skipped" not in spark:
        assert "CPU seconds per million rows, per process" in md
    tables = _tables(md)
    assert len(tables) >= len(DRAINS) + 1
    for table in tables:
        assert len(table) >= 3, table  # header, rule, at least one row
        assert all(len(row) == len(table[0]) for row in table), table
        assert all(set(cell) <= set("-: ") for cell in table[1]), table[1]
    assert "rmq_async (tuned)" in md and "Java DefaultMQPushConsumer (tuned)" in md
    assert "not verified" not in md

    width, height = _png_size((out / "chart.png").read_bytes())
    assert width > 300 and height > 300

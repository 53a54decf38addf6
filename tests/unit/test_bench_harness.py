"""Pieces of the benchmark harness (``benchmarks/run.py``) that need no broker."""

from __future__ import annotations

import asyncio
import itertools
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType, SimpleNamespace
from typing import Any

import pytest

BENCH_DIR = Path(__file__).resolve().parents[2] / "benchmarks"


@pytest.fixture(scope="module")
def run_module() -> Iterator[ModuleType]:
    sys.path.insert(0, str(BENCH_DIR))
    try:
        import run

        yield run
    finally:
        sys.path.remove(str(BENCH_DIR))


def test_a_failed_childs_stderr_excerpt_names_the_error_above_the_frames(
        run_module: ModuleType, tmp_path: Path) -> None:
    # A JVM's stack trace ends in frames: the ten last lines alone said nothing of what failed.
    stderr = tmp_path / "spark.stderr"
    stderr.write_text("\n".join([
        "starting", "py4j.protocol.Py4JJavaError: An error occurred while calling o93.save.",
        "org.apache.spark.SparkException: Job aborted due to stage failure",
        "Caused by: java.io.IOException: No space left on device",
        *(f"\tat org.apache.spark.Frame{i}.run(Frame.java:{i})" for i in range(30)),
    ]))
    child = run_module.ChildRun(cmd=["true"], cwd=tmp_path, env={}, stderr_path=stderr)
    lines = child.stderr_tail(10).splitlines()
    assert lines[:3] == ["py4j.protocol.Py4JJavaError: An error occurred while calling o93.save.",
                         "org.apache.spark.SparkException: Job aborted due to stage failure",
                         "Caused by: java.io.IOException: No space left on device"]
    assert lines[3] == "..."
    assert lines[4:] == [f"\tat org.apache.spark.Frame{i}.run(Frame.java:{i})"
                         for i in range(20, 30)]
    # Nothing named above the tail: the tail alone, as before.
    stderr.write_text("one\ntwo\nthree")
    assert child.stderr_tail(10) == "one\ntwo\nthree"


def test_a_failed_childs_whole_stderr_is_kept_in_the_output(
        run_module: ModuleType, tmp_path: Path) -> None:
    # The work folder (where the child wrote it) is removed at the end of the run; the excerpt
    # in the reason may not be enough to tell what failed.
    work, out = tmp_path / "work", tmp_path / "out"
    work.mkdir()
    stderr = work / "spark.stderr"
    text = "\n".join(f"line {i}" for i in range(500))
    stderr.write_text(text)
    child = run_module.ChildRun(cmd=["true"], cwd=tmp_path, env={}, stderr_path=stderr)
    assert child.keep_stderr(out) == "failed/spark.stderr"
    assert (out / "failed" / "spark.stderr").read_text() == text
    # A child that never wrote one: nothing kept, no error.
    missing = run_module.ChildRun(cmd=["true"], cwd=tmp_path, env={},
                                  stderr_path=work / "drain-java-r1.stderr")
    assert missing.keep_stderr(out) == ""


def test_the_first_drain_on_a_broker_starts_with_an_untimed_round_of_every_contender(
        run_module: ModuleType, monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[tuple[str, str, int]] = []

    async def fake_run_contender(rt: Any, sc: Any, contender: str, rnd: int, topic: str,
                                 during: Any = None) -> dict[str, Any]:
        calls.append((sc.name, contender, rnd))
        return {"contender": contender, "round": rnd, "verified": True, "msgs_per_s": 1.0}

    monkeypatch.setattr(run_module, "run_contender", fake_run_contender)
    rt = SimpleNamespace(broker_warm=False)
    first = run_module.Scenario("drain-a", "a", "drain", 10, 1024, 2, ["x", "y", "slow"],
                                capped_rounds={"slow": 1})
    second = run_module.Scenario("drain-b", "b", "drain", 10, 100, 2, ["x", "y"])
    result = asyncio.run(run_module.run_drain(rt, first, first.contenders, topic="t1"))
    # Round 0 (every contender but the one capped to fewer rounds), then the timed rounds,
    # each starting with the next contender.
    assert calls == [("drain-a", "x", 0), ("drain-a", "y", 0),
                     ("drain-a", "x", 1), ("drain-a", "y", 1), ("drain-a", "slow", 1),
                     ("drain-a", "y", 2), ("drain-a", "x", 2)]
    assert [r["round"] for r in result["warm_up"]] == [0, 0]
    assert all(r["round"] >= 1 for r in result["runs"])
    assert rt.broker_warm
    # The drains after it meet a warm broker; a scenario without warm-up never has one.
    calls.clear()
    result = asyncio.run(run_module.run_drain(rt, second, second.contenders, topic="t2"))
    assert result["warm_up"] == [] and [c[2] for c in calls] == [1, 1, 2, 2]
    cold = SimpleNamespace(broker_warm=False)
    quick = run_module.Scenario("drain-q", "q", "drain", 10, 100, 1, ["x"], jit_warm_up=False)
    calls.clear()
    assert asyncio.run(run_module.run_drain(cold, quick, quick.contenders,
                                            topic="t3"))["warm_up"] == []
    assert calls == [("drain-q", "x", 1)] and not cold.broker_warm


def test_rounds_vary_who_comes_first_last_and_after_whom(run_module: ModuleType) -> None:
    """A rotation (A B C, B C A, C A B) put B after A in every round, so whatever A leaves
    behind (page cache, the broker's state) always fell on B. The orders now repeat as few
    adjacent pairs as can be, and vary who runs first."""
    from benchlib import round_orders

    def pairs(order: list[str]) -> list[tuple[str, str]]:
        return list(itertools.pairwise(order))

    for n in range(2, 8):
        names = [f"c{i}" for i in range(n)]
        orders = round_orders(names, 3)
        assert orders[0] == names and all(sorted(o) == names for o in orders)
        assert orders == round_orders(names, 3)  # the same in every run
        firsts = [o[0] for o in orders]
        assert len(set(firsts)) == min(n, 3), orders
        seen = [p for o in orders for p in pairs(o)]
        repeats = len(seen) - len(set(seen))
        # Three rounds of n contenders: no pair twice from four contenders on; with three, of
        # whose six ordered pairs the rounds use six, one (Williams' designs need six rounds).
        assert repeats <= {2: 2, 3: 1}.get(n, 0), (n, orders)
        for name in names:
            before = {dict((b, a) for a, b in pairs(o)).get(name) for o in orders}
            assert len(before) > 1, (name, orders)  # never always after the same one
    # The six contenders of the 1 KiB drain: Java runs after three different ones.
    drain = ["raw", "raw-decode", "rmq", "rmq-tuned", "java", "java-tuned"]
    assert {dict((b, a) for a, b in pairs(o))["java"] for o in round_orders(drain, 3)
            if o[0] != "java"} == {"rmq-tuned", "java-tuned", "raw-decode"}
    assert run_module.round_orders is round_orders  # the drains and latency rounds use it
    assert round_orders([], 2) == [[], []]
    assert len(round_orders([f"c{i}" for i in range(9)], 3)) == 3  # rotations past seven


def test_the_summary_lists_each_drains_rounds_and_its_warm_up(run_module: ModuleType) -> None:
    import report

    def run(contender: str, rnd: int, rate: float, **side: float) -> dict[str, Any]:
        return {"contender": contender, "round": rnd, "verified": True, "msgs_per_s": rate,
                **side}

    sc = {"kind": "drain", "contenders": ["rmq_async", "java"],
          "warm_up": [run("rmq_async", 0, 90_000.0, broker_cpu_s_per_million=9.8,
                          loop_waited_s=1.5), run("java", 0, 70_000.0)],
          "runs": [run("rmq_async", 1, 120_000.0, broker_cpu_s_per_million=3.5,
                       loop_waited_s=0.8),
                   run("java", 1, 80_000.0, broker_cpu_s_per_million=4.6),
                   run("rmq_async", 2, 150_000.0, loop_waited_s=0.2),
                   {**run("java", 2, 0.0), "verified": False}]}
    lines = report._rounds_lines(sc)
    assert "untimed and not in the medians" in lines[0]
    assert ("- rmq_async (defaults): 120,000 (broker 3.5 CPU s / M; loop waited 0.8 s), "
            "150,000 (loop waited 0.2 s); untimed warm-up before them: 90,000 (broker 9.8 "
            "CPU s / M; loop waited 1.5 s)") in lines
    # A run that failed verification is left out of the rounds, as of the medians.
    assert ("- Java DefaultMQPushConsumer (defaults): 80,000 (broker 4.6 CPU s / M); untimed "
            "warm-up before them: 70,000") in lines
    assert report._rounds_lines({**sc, "kind": "latency"}) == []


def test_the_plain_spark_batches_are_cut_as_the_sink_cuts_its_chunks(
        run_module: ModuleType) -> None:
    """Batches of 50,000 out of 32-message pulls: the sink closes a batch before a pull that
    would pass it (49,984 rows), so 1,000,000 rows make 21 batches; the baseline cut at exactly
    50,000 made 20, one Spark job fewer than the sink's."""
    import child

    pulls: list[list[Any]] = [[object()] * 32 for _ in range(31_250)]
    batches = child.pack_pulls(pulls, 50_000)
    assert [len(b) for b in batches] == [49_984] * 20 + [320]
    ragged = child.pack_pulls([[1, 2], [3], [4, 5, 6], [7]], 3)
    assert ragged == [[1, 2, 3], [4, 5, 6], [7]]
    assert child.pack_pulls([[1, 2, 3, 4]], 3) == [[1, 2, 3, 4]]  # a pull is never split


def test_the_spark_outputs_are_checked_down_to_the_bodies(
        run_module: ModuleType, tmp_path: Path) -> None:
    """Row count and distinct (queue, offset) alone passed output with truncated or mixed-up
    bodies: every body must have its size and the preload's index, each index once."""
    import child
    import pyarrow as pa
    import pyarrow.parquet as pq

    filler = run_module.make_filler(64)
    n, size = 500, 64

    def write(bodies: list[bytes], name: str) -> Path:
        folder = tmp_path / name
        folder.mkdir()
        half = len(bodies) // 2
        for part, rows in enumerate((range(half), range(half, len(bodies)))):
            pq.write_table(pa.table({
                "queue_id": pa.array([i % 4 for i in rows], pa.int32()),
                "queue_offset": pa.array([i // 4 for i in rows], pa.int64()),
                "body": pa.array([bodies[i] for i in rows], pa.binary()),
            }), folder / f"part-{part}.parquet")
        (folder / "_SUCCESS").write_bytes(b"")
        return folder

    good = [run_module.make_body(i, size, filler) for i in range(n)]
    assert child._verify_parquet(write(good, "good"), n, None, size) == (True, "")
    truncated = list(good)
    truncated[7] = truncated[7][:-1]
    ok, why = child._verify_parquet(write(truncated, "truncated"), n, None, size)
    assert not ok and "bytes" in why
    twice = list(good)
    twice[9] = good[8]  # the same message twice, another missing: the keys cannot tell
    ok, why = child._verify_parquet(write(twice, "twice"), n, None, size)
    assert not ok and "indexes" in why
    garbled = list(good)
    garbled[3] = b"x" * size
    ok, why = child._verify_parquet(write(garbled, "garbled"), n, None, size)
    assert not ok and "12-digit" in why
    # Without body_size (as before): the keys only.
    assert child._verify_parquet(write(twice, "keys-only"), n)[0]

"""Pieces of the benchmark harness (``benchmarks/run.py``) that need no broker."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

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

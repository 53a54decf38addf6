"""make test's workers take the files with the longest tests first (tests/scheduling.py)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

FILES = {
    # Many quick tests: xdist's own order (most tests first) would start here.
    "test_a_many.py": "".join(f"def test_quick_{i}(record):\n    record('a{i}')\n\n"
                              for i in range(6)),
    "test_b_some.py": (
        "import pytest\n\n"
        "def test_b_quick(record):\n    record('b0')\n\n"
        "@pytest.mark.slow(seconds=5)\ndef test_b_slow(record):\n    record('b1')\n\n"
        "@pytest.mark.slow(seconds=6)\ndef test_b_slower(record):\n    record('b2')\n"
    ),
    "test_c_long.py": (
        "import pytest\n\n"
        "@pytest.mark.slow(seconds=60)\ndef test_c_long(record):\n    record('c0')\n"
    ),
    "test_d_plain.py": "def test_d(record):\n    record('d0')\n",
    "conftest.py": (
        "import os\nimport pytest\n\n"
        "@pytest.fixture\ndef record():\n"
        "    def write(name):\n"
        "        with open(os.environ['ORDER_FILE'], 'a') as f:\n"
        "            f.write(name + '\\n')\n"
        "    return write\n"
    ),
}


def _run(tmp_path: Path, *args: str) -> list[str]:
    for name, text in FILES.items():
        (tmp_path / name).write_text(text)
    order = tmp_path / "order.txt"
    order.unlink(missing_ok=True)
    env = dict(os.environ, PYTHONPATH=str(REPO), ORDER_FILE=str(order))
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "tests.scheduling", "-p", "no:cacheprovider",
         "-o", "markers=slow", "--rootdir", str(tmp_path), "-q", *args, str(tmp_path)],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=100)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return order.read_text().split()


@pytest.mark.timeout(120)
def test_files_with_the_longest_slow_tests_run_first(tmp_path: Path) -> None:
    # Heaviest file first (60 s), then 5 + 6 s; a file's tests stay together in their order;
    # files without slow tests keep the order they were collected in.
    assert _run(tmp_path, "-p", "no:xdist") == [
        "c0", "b0", "b1", "b2", "a0", "a1", "a2", "a3", "a4", "a5", "d0"]


@pytest.mark.timeout(120)
def test_a_loadfile_worker_takes_them_in_that_order(tmp_path: Path) -> None:
    # What make test passes: xdist keeps the collection order instead of its own.
    assert _run(tmp_path, "-n", "1", "--dist", "loadfile", "--no-loadscope-reorder") == [
        "c0", "b0", "b1", "b2", "a0", "a1", "a2", "a3", "a4", "a5", "d0"]

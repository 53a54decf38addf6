"""A test that hangs fails with the await chain of every task, and the run goes on."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

HANGING = textwrap.dedent('''
    import asyncio
    import pytest

    async def wait_for_nothing(event: asyncio.Event) -> None:
        await event.wait()          # nobody ever sets it

    async def test_hangs() -> None:
        event = asyncio.Event()
        task = asyncio.get_running_loop().create_task(wait_for_nothing(event), name="parked-task")
        await asyncio.gather(task)

    def test_after_the_hang() -> None:
        assert True
''')


@pytest.mark.timeout(120)
def test_hanging_test_fails_with_task_stacks_and_the_run_goes_on(tmp_path: Path) -> None:
    (tmp_path / "test_hang_demo.py").write_text(HANGING)
    env = dict(os.environ, PYTHONPATH=str(REPO))
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "tests.hang_report", "-p", "no:cacheprovider",
         "-o", "asyncio_mode=auto", "-o", "timeout_method=signal", "--timeout", "2",
         "--rootdir", str(tmp_path), str(tmp_path / "test_hang_demo.py")],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=100)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 1, out
    assert "1 failed, 1 passed" in out, out
    assert "timed out after 2" in out
    # The parked task is named, with the line it waits on and the future under it.
    assert "task 'parked-task' (pending)" in out, out
    assert "in wait_for_nothing" in out
    assert "waiting on <Future pending" in out
    # The test's own task shows the gather it is stuck in; the threads are listed too.
    assert "in test_hangs" in out
    assert "thread 'MainThread'" in out

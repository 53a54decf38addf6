"""Every test runs under a timeout that fails it with the stacks of every thread and task.

pytest-timeout supplies the settings (``timeout`` in pyproject, ``@pytest.mark.timeout(N)`` per
test); this plugin takes over its timer so that a test which overruns fails with a report of
what each thread *and each asyncio task* was waiting on (pytest-timeout alone shows threads
only, and a hung consumer is a task parked on a future, not a busy thread).

The alarm raises ``Failed`` in the main thread, which is running the test's event loop, so the
test ends and the run goes on. If the failed test then cannot even tear down (a task that will
not be cancelled), a second alarm prints everything again and ends the run with exit code 1: a
hang can make the run fail, never make it wait.
"""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import threading
from types import FrameType
from typing import Any

import pytest

from rmq_async.diagnostics import format_tasks, format_threads

#: How long a test that timed out may take to tear down before the run is ended.
TEARDOWN_GRACE = 90.0


def _dump() -> str:
    parts = ["", "=" * 30 + " threads " + "=" * 30, format_threads()]
    loop = asyncio._get_running_loop()  # the test's loop, when the alarm interrupted it
    if loop is not None:
        parts += ["=" * 30 + " asyncio tasks " + "=" * 30, format_tasks(loop)]
    else:
        parts.append("(no event loop was running in the main thread)")
    return "\n".join(parts)


def _write_uncaptured(item: pytest.Item, text: str, *, resume: bool = True) -> None:
    capman = item.config.pluginmanager.getplugin("capturemanager")
    if capman is not None:
        capman.suspend_global_capture(in_=True)
    sys.stderr.write(text + "\n")
    sys.stderr.flush()
    if capman is not None and resume:
        capman.resume_global_capture()


@pytest.hookimpl(tryfirst=True)
def pytest_timeout_set_timer(item: pytest.Item, settings: Any) -> bool | None:
    if settings.method != "signal" or threading.current_thread() is not threading.main_thread():
        return None  # pytest-timeout's own thread method takes it

    def last_resort(signum: int, frame: FrameType | None) -> None:
        _write_uncaptured(item, f"\n{item.nodeid}: still not torn down {TEARDOWN_GRACE:.0f}s "
                                f"after its timeout; ending the test run.{_dump()}", resume=False)
        os._exit(1)

    def on_timeout(signum: int, frame: FrameType | None) -> None:
        __tracebackhide__ = True
        report = _dump()
        _write_uncaptured(item, f"\n{item.nodeid}: timed out after {settings.timeout}s{report}")
        signal.signal(signal.SIGALRM, last_resort)
        signal.setitimer(signal.ITIMER_REAL, TEARDOWN_GRACE)
        pytest.fail(f"Timeout: {item.nodeid} ran longer than {settings.timeout}s "
                    "(the stacks of every thread and asyncio task are printed above)",
                    pytrace=False)

    def cancel() -> None:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, signal.SIG_DFL)

    item.cancel_timeout = cancel  # type: ignore[attr-defined]  # read by pytest-timeout
    signal.signal(signal.SIGALRM, on_timeout)
    signal.setitimer(signal.ITIMER_REAL, settings.timeout)
    return True

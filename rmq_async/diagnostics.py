"""What is every thread and every asyncio task doing right now?

Text dumps for the moment something seems stuck: :func:`format_tasks` lists each asyncio task
of a loop with its whole await chain (``Task.print_stack`` shows only the outermost coroutine
frame) and the future it is parked on; :func:`format_threads` lists the Python stack of every
thread. The test suite prints both when a test exceeds its timeout; an application can print
them from a signal handler or a debug endpoint.
"""

from __future__ import annotations

import asyncio
import sys
import threading
import traceback
from types import FrameType
from typing import Any

__all__ = ["format_task", "format_tasks", "format_threads"]


def _frame_line(frame: FrameType) -> str:
    code = frame.f_code
    return f'  File "{code.co_filename}", line {frame.f_lineno}, in {code.co_name}'


def _await_chain(coro: Any) -> list[str]:
    """The frames of a suspended coroutine and of everything it awaits, outermost first."""
    lines: list[str] = []
    seen: set[int] = set()
    obj = coro
    while obj is not None and id(obj) not in seen:
        seen.add(id(obj))
        frame = (getattr(obj, "cr_frame", None) or getattr(obj, "gi_frame", None)
                 or getattr(obj, "ag_frame", None))
        if frame is not None:
            lines.append(_frame_line(frame))
        obj = (getattr(obj, "cr_await", None) or getattr(obj, "gi_yieldfrom", None)
               or getattr(obj, "ag_await", None))
    return lines


def format_task(task: asyncio.Task[Any]) -> str:
    """One task: its name, state, await chain and the future it is parked on."""
    state = "done" if task.done() else "pending"
    if task.cancelling():
        state += f", cancelling x{task.cancelling()}"
    out = [f"- task {task.get_name()!r} ({state})"]
    out.extend(_await_chain(task.get_coro()))
    waiter = getattr(task, "_fut_waiter", None)
    if waiter is not None:
        out.append(f"    waiting on {waiter!r}")
    return "\n".join(out)


def format_tasks(loop: asyncio.AbstractEventLoop | None = None) -> str:
    """Every task of ``loop`` (default: the running loop) with its await chain."""
    if loop is None:
        loop = asyncio.get_running_loop()
    tasks = sorted(asyncio.all_tasks(loop), key=lambda t: t.get_name())
    return "\n".join([f"{len(tasks)} asyncio task(s):", *(format_task(t) for t in tasks)])


def format_threads() -> str:
    """The Python stack of every thread, the calling one included."""
    names = {t.ident: t.name for t in threading.enumerate()}
    out: list[str] = []
    for ident, frame in sys._current_frames().items():
        out.append(f"- thread {names.get(ident, '<unknown>')!r} ({ident})")
        out.append("".join(traceback.format_stack(frame)).rstrip())
    return "\n".join(out)

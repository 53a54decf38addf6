"""Checks, over the whole suite, that the library raises only :class:`rmq_async.RocketMQError`.

Every ``pytest.raises`` of the suite goes through :func:`checked_raises`. When the exception it
caught passed through a frame of the ``rmq_async`` package and did not start in test code (a
listener, sink or callback a test handed to the library raises what it likes), it must be a
``RocketMQError``; otherwise the test fails naming the exception and where it came from.

Not checked, because they are the asyncio / process contract rather than library errors:
``asyncio.CancelledError`` (the caller's task was cancelled), a bare ``TimeoutError`` (an
``asyncio.timeout`` the caller owns expired), ``SystemExit`` and ``KeyboardInterrupt``.
"""

from __future__ import annotations

import asyncio
import os
import traceback
from types import TracebackType
from typing import Any

import pytest

import rmq_async
from rmq_async.errors import RocketMQError

LIBRARY_DIR = os.path.dirname(os.path.abspath(rmq_async.__file__)) + os.sep
TESTS_DIR = os.path.dirname(os.path.abspath(__file__)) + os.sep
EXEMPT: tuple[type[BaseException], ...] = (asyncio.CancelledError, SystemExit, KeyboardInterrupt)

_real_raises = pytest.raises
checked: list[str] = []
"""``type name`` of every library-raised exception the check has passed (for the tests)."""


def violation(exc: BaseException) -> str | None:
    """Why ``exc`` breaks the rule, or ``None`` when it does not."""
    frames = traceback.extract_tb(exc.__traceback__)
    if not frames:
        return None
    if not any(f.filename.startswith(LIBRARY_DIR) for f in frames):
        return None
    if frames[-1].filename.startswith(TESTS_DIR):
        return None
    if isinstance(exc, RocketMQError):
        checked.append(type(exc).__name__)
        return None
    if isinstance(exc, EXEMPT) or type(exc) is TimeoutError:
        return None
    origin = frames[-1]
    return (f"{type(exc).__module__}.{type(exc).__qualname__} ({exc}) escaped the public API from "
            f"{origin.filename}:{origin.lineno} in {origin.name}; raise a rmq_async.RocketMQError "
            "subclass instead")


def _check(exc: BaseException | None) -> None:
    if exc is None:
        return
    why = violation(exc)
    if why is not None:
        pytest.fail(why, pytrace=False)


class _CheckedContext:
    """Wraps the context manager ``pytest.raises`` returns, checking what it caught."""

    def __init__(self, inner: Any) -> None:
        self._inner = inner

    def __enter__(self) -> Any:
        return self._inner.__enter__()

    def __exit__(self, et: type[BaseException] | None, ev: BaseException | None,
                 tb: TracebackType | None) -> bool:
        suppressed = bool(self._inner.__exit__(et, ev, tb))
        if suppressed:
            _check(ev)
        return suppressed

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


def checked_raises(*args: Any, **kwargs: Any) -> Any:
    """``pytest.raises`` with the error-tree check on the exception it catches."""
    result = _real_raises(*args, **kwargs)
    if isinstance(result, pytest.ExceptionInfo):  # the ``raises(E, func, *args)`` form
        _check(result.value)
        return result
    return _CheckedContext(result)


def pytest_configure(config: pytest.Config) -> None:
    pytest.raises = checked_raises  # type: ignore[assignment]


def pytest_unconfigure(config: pytest.Config) -> None:
    pytest.raises = _real_raises

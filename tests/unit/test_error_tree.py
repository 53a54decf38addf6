"""One error tree: every exception class of rmq_async derives from ``RocketMQError``.

The dynamic half (every exception a test catches from the public API is a ``RocketMQError``)
runs over the whole suite through ``tests/error_tree.py``; the tests below check the rule and
the hook themselves.
"""

from __future__ import annotations

import asyncio
import importlib
import inspect
import pkgutil

import pytest

import rmq_async
from rmq_async import (
    IllegalStateError,
    InvalidArgumentError,
    InvalidOptionError,
    InvalidTypeError,
    Producer,
    PushConsumer,
    RocketMQError,
)
from tests import error_tree


def _library_modules() -> list[str]:
    names = [rmq_async.__name__]
    for info in pkgutil.walk_packages(rmq_async.__path__, prefix="rmq_async."):
        names.append(info.name)
    return names


def test_every_exception_class_of_the_library_derives_from_rocketmq_error() -> None:
    seen: list[str] = []
    offenders: list[str] = []
    for name in _library_modules():
        if name.endswith("__main__"):
            continue
        module = importlib.import_module(name)
        for _, cls in inspect.getmembers(module, inspect.isclass):
            if cls.__module__ != module.__name__ or not issubclass(cls, BaseException):
                continue
            seen.append(cls.__qualname__)
            if not issubclass(cls, RocketMQError):
                offenders.append(f"{name}.{cls.__qualname__}")
    assert not offenders, f"not under RocketMQError: {offenders}"
    # The walk found the library's branches (it would pass vacuously on an empty import).
    for expected in ("RocketMQError", "MQClientError", "MQBrokerError", "NoRouteError",
                     "RemotingError", "RemotingTimeout", "ConnectionClosed", "ProtocolError",
                     "InvalidOptionError", "DevBrokerError", "SinkClosedError", "SourceError",
                     "DataLossError", "NameServerUnavailable"):
        assert expected in seen


def test_every_exported_exception_is_under_the_root() -> None:
    exported = [getattr(rmq_async, n) for n in rmq_async.__all__]
    errors = [c for c in exported if inspect.isclass(c) and issubclass(c, BaseException)]
    assert RocketMQError in errors and InvalidOptionError in errors
    assert all(issubclass(c, RocketMQError) for c in errors)


def test_builtin_compatibility_is_kept() -> None:
    assert issubclass(InvalidArgumentError, ValueError)
    assert issubclass(InvalidOptionError, ValueError)
    assert issubclass(InvalidTypeError, TypeError)
    assert issubclass(IllegalStateError, RuntimeError)
    assert issubclass(rmq_async.RemotingTimeout, TimeoutError)


async def test_public_api_raises_typed_errors_for_bad_input() -> None:
    with pytest.raises(InvalidOptionError) as info:
        PushConsumer("g1", namesrv="127.0.0.1:9876", pull_batch_size=0)
    assert info.value.option == "pull_batch_size"
    with pytest.raises(InvalidArgumentError, match="host:port"):
        PushConsumer("g1", namesrv="nowhere")
    consumer = PushConsumer("g1", namesrv="127.0.0.1:9876")
    with pytest.raises(InvalidArgumentError, match="retry topic"):
        consumer.subscribe("%RETRY%g1")
    with pytest.raises(InvalidArgumentError, match="subscribe at least one topic"):
        await consumer.start()
    with pytest.raises(InvalidOptionError, match="unknown producer option"):
        Producer("p1", namesrv="127.0.0.1:9876", no_such_option=1)


def test_allocation_strategies_raise_typed_errors() -> None:
    from rmq_async.consumer.allocate import AllocateAveragely

    with pytest.raises(InvalidArgumentError, match="client id is empty"):
        AllocateAveragely().allocate("g1", "", [], [])


def test_the_hook_rejects_a_leak_and_accepts_the_asyncio_contract() -> None:
    def library_like() -> None:
        raise KeyError("leaked")

    # Pretend the frame is the library's: compile a raiser under the package's file name.
    code = compile("def leak():\n    raise KeyError('leaked')\n", error_tree.LIBRARY_DIR + "fake.py",
                   "exec")
    scope: dict[str, object] = {}
    exec(code, scope)
    try:
        scope["leak"]()  # type: ignore[operator]
    except KeyError as exc:
        assert error_tree.violation(exc) is not None
    cancelled = compile("def c():\n    raise asyncio.CancelledError()\n",
                        error_tree.LIBRARY_DIR + "fake.py", "exec")
    scope = {"asyncio": asyncio}
    exec(cancelled, scope)
    try:
        scope["c"]()  # type: ignore[operator]
    except asyncio.CancelledError as exc:
        assert error_tree.violation(exc) is None
    try:
        library_like()
    except KeyError as exc:  # started in test code
        assert error_tree.violation(exc) is None


def test_producer_send_timeout_is_seconds_or_timedelta() -> None:
    from datetime import timedelta

    p = Producer("p1", namesrv="127.0.0.1:9876", send_timeout=timedelta(milliseconds=1500))
    assert p.options.send_timeout == 1.5
    with pytest.raises(InvalidOptionError, match="send_timeout"):
        Producer("p1", namesrv="127.0.0.1:9876", send_timeout=0)

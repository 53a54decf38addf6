"""Errors raised by the local development broker."""

from __future__ import annotations

from rmq_async.errors import IllegalStateError

__all__ = ["DevBrokerError"]


class DevBrokerError(IllegalStateError):
    """The local RocketMQ could not be prepared, started, stopped or queried.

    The message is meant for a human: it names the failing step and, for start-up
    failures, quotes the tail of the relevant JVM logs.
    """

"""Errors raised by the sans-IO protocol layer."""

from __future__ import annotations

from rmq_async.errors import RocketMQError

__all__ = ["ProtocolError"]


class ProtocolError(RocketMQError):
    """Something received from the peer is malformed: a frame, a header, a body, a message.

    The remoting layer treats it as fatal for the connection it came from.
    """

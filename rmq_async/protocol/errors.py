"""Errors raised by the sans-IO protocol layer."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from rmq_async.errors import RocketMQError

__all__ = ["BodyDecompressionError", "ProtocolError"]


class ProtocolError(RocketMQError):
    """Something received from the peer is malformed: a frame, a header, a body, a message.

    The remoting layer treats it as fatal for the connection it came from.
    """

    #: For a frame decoder's failure: the commands of the same read completed before the bad
    #: frame (the peer's answers that did arrive), which the connection still delivers.
    decoded: Sequence[Any] = ()


class BodyDecompressionError(ProtocolError):
    """A stored message's body is marked compressed but cannot be inflated with its type.

    The record around it is intact, so a consumer skips just that message (reported with its
    queue and offset) and goes on with the ones behind it.
    """

    def __init__(self, compression: str, reason: str) -> None:
        super().__init__(f"cannot inflate the {compression} body: {reason}")
        self.compression = compression
        self.reason = reason

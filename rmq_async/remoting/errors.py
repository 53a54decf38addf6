"""Errors raised by the remoting layer."""

from __future__ import annotations

from rmq_async.errors import RocketMQError


class RemotingError(RocketMQError):
    """Base class of every failure to exchange a command with a peer."""

    def __init__(self, message: str, *, addr: str | None = None) -> None:
        super().__init__(message)
        self.addr = addr


class RemotingConnectError(RemotingError):
    """The TCP (or TLS) connection to the peer could not be established."""


class TlsVerificationError(RemotingConnectError):
    """The peer's TLS certificate was refused: not signed by a trusted CA, expired, or not
    issued for the address connected to. Retrying cannot help until the configuration changes.
    """

    def __init__(self, message: str, *, addr: str | None = None, reason: str = "") -> None:
        super().__init__(message, addr=addr)
        self.reason = reason


class ConnectionClosed(RemotingError):
    """The connection was closed (by us, by the peer, or after a protocol error).

    Every request still waiting for its response when a connection closes fails with this
    error; ``__cause__`` carries the underlying reason when there is one (for example a
    :class:`~rmq_async.protocol.errors.ProtocolError` for a peer that sent garbage).
    """


class ConnectionLostInFlight(ConnectionClosed):
    """The connection closed after the request was sent and before its response came.

    As after a :class:`RemotingTimeout`, the peer may have acted on the request (a broker may
    have stored the message): the producer does not send such a message again.
    """


class RemotingTimeout(RemotingError, TimeoutError):
    """No response arrived within the request's timeout."""

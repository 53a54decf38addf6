"""Remoting layer: asyncio connections that carry RemotingCommand frames."""

from rmq_async.remoting.client import RemotingClient
from rmq_async.remoting.connection import Connection, RequestHandler, RpcHook, split_addr
from rmq_async.remoting.errors import (
    ConnectionClosed,
    ConnectionLostInFlight,
    RemotingConnectError,
    RemotingError,
    RemotingTimeout,
    TlsVerificationError,
)

__all__ = [
    "Connection",
    "ConnectionClosed",
    "ConnectionLostInFlight",
    "RemotingClient",
    "RemotingConnectError",
    "RemotingError",
    "RemotingTimeout",
    "TlsVerificationError",
    "RequestHandler",
    "RpcHook",
    "split_addr",
]

"""Client layer: name-server routes, the broker API as typed calls, the client instance."""

from rmq_async.client.api import MQClientAPI, PullResult, PullStatus, SendResult
from rmq_async.client.errors import (
    MQBrokerError,
    MQClientError,
    NameServerUnavailable,
    NoPermissionError,
    NoRouteError,
)
from rmq_async.client.instance import ClientInstance

__all__ = [
    "ClientInstance",
    "MQBrokerError",
    "MQClientAPI",
    "MQClientError",
    "NameServerUnavailable",
    "NoPermissionError",
    "NoRouteError",
    "PullResult",
    "PullStatus",
    "SendResult",
]

"""rmq_async: an asyncio-native push consumer for Apache RocketMQ, speaking its protocol itself."""

from rmq_async.app import App
from rmq_async.client.errors import (
    MQBrokerError,
    MQClientError,
    NameServerUnavailable,
    NoPermissionError,
    NoRouteError,
)
from rmq_async.consumer.events import ConsumerError, ConsumerErrorKind
from rmq_async.consumer.middleware import CallNext, ConsumeCall, Middleware
from rmq_async.consumer.options import ConsumeFromWhere, InvalidOptionError, MessageModel
from rmq_async.consumer.push import PushConsumer
from rmq_async.consumer.results import ConsumeContext, ConsumeResult, DeadLetter, RetryLater
from rmq_async.devbroker.errors import DevBrokerError
from rmq_async.errors import (
    IllegalStateError,
    InvalidArgumentError,
    InvalidTypeError,
    MissingExtraError,
    RocketMQError,
)
from rmq_async.payloads import PayloadDecodeError
from rmq_async.producer import Producer
from rmq_async.protocol.errors import ProtocolError
from rmq_async.protocol.types import Message, MessageExt, MessageQueue
from rmq_async.remoting.errors import (
    ConnectionClosed,
    ConnectionLostInFlight,
    RemotingConnectError,
    RemotingError,
    RemotingTimeout,
    TlsVerificationError,
)

__version__ = "0.1.0"

__all__ = [
    "App",
    "CallNext",
    "ConnectionClosed",
    "ConnectionLostInFlight",
    "ConsumeCall",
    "ConsumeContext",
    "ConsumeFromWhere",
    "ConsumeResult",
    "ConsumerError",
    "ConsumerErrorKind",
    "DeadLetter",
    "DevBrokerError",
    "IllegalStateError",
    "InvalidArgumentError",
    "InvalidOptionError",
    "InvalidTypeError",
    "MissingExtraError",
    "MQBrokerError",
    "MQClientError",
    "Message",
    "MessageExt",
    "MessageModel",
    "MessageQueue",
    "Middleware",
    "NameServerUnavailable",
    "NoPermissionError",
    "NoRouteError",
    "PayloadDecodeError",
    "Producer",
    "ProtocolError",
    "PushConsumer",
    "RemotingConnectError",
    "RemotingError",
    "RemotingTimeout",
    "RetryLater",
    "RocketMQError",
    "TlsVerificationError",
    "__version__",
]

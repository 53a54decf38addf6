"""Sans-IO RocketMQ remoting protocol: frames, codes, headers, bodies, stored messages, filters.

Nothing here does I/O; every function works on bytes and small dataclasses.
"""

from __future__ import annotations

from . import bodies, codes, command, filter, headers, jsonutil, message, types
from .bodies import (
    BrokerData,
    ClusterInfo,
    ConsumeMessageDirectlyResult,
    ConsumerData,
    ConsumerRunningInfo,
    GetConsumerStatusBody,
    HeartbeatData,
    LockBatchRequestBody,
    LockBatchResponseBody,
    ProducerData,
    QueueData,
    ResetOffsetBody,
    TopicRouteData,
    UnlockBatchRequestBody,
    consumer_queues,
    master_address,
    producer_queues,
)
from .codes import (
    CURRENT_VERSION,
    RPC_ONEWAY,
    RPC_TYPE_RESPONSE,
    LanguageCode,
    MessageSysFlag,
    PullSysFlag,
    RequestCode,
    ResponseCode,
    SerializeType,
)
from .command import FrameDecoder, RemotingCommand, next_opaque
from .errors import ProtocolError
from .filter import SubscriptionData, build_subscription, java_string_hash, tag_matches
from .jsonutil import fastjson_dumps, tolerant_loads
from .message import (
    UniqKeyGenerator,
    decode_message,
    decode_messages,
    decode_properties,
    encode_batch,
    encode_properties,
    encode_stored_message,
    offset_msg_id,
)
from .types import Message, MessageExt, MessageQueue

__all__ = [
    "CURRENT_VERSION",
    "RPC_ONEWAY",
    "RPC_TYPE_RESPONSE",
    "BrokerData",
    "ClusterInfo",
    "ConsumeMessageDirectlyResult",
    "ConsumerData",
    "ConsumerRunningInfo",
    "FrameDecoder",
    "GetConsumerStatusBody",
    "HeartbeatData",
    "LanguageCode",
    "LockBatchRequestBody",
    "LockBatchResponseBody",
    "Message",
    "MessageExt",
    "MessageQueue",
    "MessageSysFlag",
    "ProducerData",
    "ProtocolError",
    "PullSysFlag",
    "QueueData",
    "RemotingCommand",
    "RequestCode",
    "ResetOffsetBody",
    "ResponseCode",
    "SerializeType",
    "SubscriptionData",
    "TopicRouteData",
    "UniqKeyGenerator",
    "UnlockBatchRequestBody",
    "bodies",
    "build_subscription",
    "codes",
    "command",
    "consumer_queues",
    "decode_message",
    "decode_messages",
    "decode_properties",
    "encode_batch",
    "encode_properties",
    "encode_stored_message",
    "fastjson_dumps",
    "filter",
    "headers",
    "java_string_hash",
    "jsonutil",
    "master_address",
    "message",
    "next_opaque",
    "offset_msg_id",
    "producer_queues",
    "tag_matches",
    "tolerant_loads",
    "types",
]

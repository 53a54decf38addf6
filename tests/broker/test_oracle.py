"""Byte oracle: rmq_async's codec against the Java implementation, byte for byte.

tests/java/OracleCodec.java is compiled against the RocketMQ Maven jars of the dev broker and
run once per direction (no broker process is needed, only the jars and a JDK):

* ``encode``: Java builds every case as the Java client or broker builds it
  (``createRequestCommand`` / ``createResponseCommandWithHeader`` + ``addExtField``) and writes
  it as ``NettyEncoder`` does (``fastEncodeHeader`` + body). rmq_async must produce the same
  frame bytes from the same inputs, in both serialize types.
* ``decode``: frames written by rmq_async are read with ``RemotingCommand.decode`` and
  ``decodeCommandCustomHeader``; every command field, extFields entry, header field and body
  must come out as we meant it.
* ``messages``: stored-message records written by ``MessageDecoder.encode`` or by the store's
  ``MessageExtEncoder`` (v1 and v2 magic, IPv4/IPv6 hosts, zlib bodies, unicode properties)
  must decode with :func:`decode_messages` to exactly what Java's own client-side decode sees.

Two cases have tests of their own: a heartbeat whose consumer has several subscriptions (Java
writes its HashSet in hash order, which ``bodies.ConsumerData`` reproduces whatever order it is
given), and ACL-signed FastCodesHeader commands in ROCKETMQ serialization, where Java writes
every header field twice (a quirk we do not copy).
"""

from __future__ import annotations

import base64
import functools
import hashlib
import ipaddress
import json
import struct
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from rmq_async.consumer.options import ConsumerOptions, Credentials
from rmq_async.devbroker.java import compile_java, run_java
from rmq_async.devbroker.maven import ensure_jars
from rmq_async.devbroker.pytest_plugin import run_blocking
from rmq_async.protocol import headers as h
from rmq_async.protocol.bodies import ConsumerData, HeartbeatData, ProducerData, encode_lock_batch_request
from rmq_async.protocol.codes import (
    CURRENT_VERSION,
    MSG_TRANSACTION_PREPARED_TYPE,
    RPC_ONEWAY,
    RPC_TYPE_RESPONSE,
    LanguageCode,
    RequestCode,
    ResponseCode,
    SerializeType,
)
from rmq_async.protocol.command import ExtFields, RemotingCommand
from rmq_async.protocol.filter import build_subscription
from rmq_async.protocol.jsonutil import java_hash_order, java_hashmap_order
from rmq_async.protocol.message import (
    MAGIC_V1,
    MAGIC_V2,
    decode_messages,
    encode_batch,
    encode_properties,
    encode_stored_message,
)
from rmq_async.protocol.types import Message, MessageExt, MessageQueue

pytestmark = pytest.mark.broker

SOURCE = Path(__file__).resolve().parent.parent / "java" / "OracleCodec.java"
JAVA_TIMEOUT = 60.0
MIB = 1024 * 1024

#: Java classes of the headers whose package is not ...remoting.protocol.header.
_JAVA_CLASS: dict[type[h.CommandHeader], str] = {
    h.GetRouteInfoRequestHeader:
        "org.apache.rocketmq.remoting.protocol.header.namesrv.GetRouteInfoRequestHeader",
}

#: A consumer with several subscriptions: Java writes its HashSet<SubscriptionData> in hash
#: order; ConsumerData must write the same order whatever order it holds them in.
SUBSCRIPTION_SET_CASE = "heartbeat-subscriptions"

ACL = ("oracleAccessKey", "oracleSecretKey-12345")
#: Java writes this one with duplicate keys (see test_java_acl_hook_writes_fast_header_fields_twice).
ACL_FAST_BINARY_CASE = "acl-send-v2/ROCKETMQ"

UNICODE_REMARK = 'ошибка: broker busy "quoted" \\ back\nslash\ttab 中文 😀 \u2028 \u0001'
UNICODE_EXTRAS = [("ключ", "значение"), ("中文键", "值 😀"), ("emoji😀", 'tab\t"q"\\')]


@functools.cache
def pattern(size: int) -> bytes:
    """Deterministic filler; OracleCodec.pattern writes the same bytes."""
    return bytes(((i * 131) + (i >> 8)) & 0xFF for i in range(size))


@dataclass(frozen=True)
class OracleJava:
    classpath: str

    async def run(self, *args: str) -> None:
        rc, out, err = await run_java("OracleCodec", list(args), self.classpath,
                                      timeout=JAVA_TIMEOUT)
        if rc != 0:
            raise AssertionError(f"OracleCodec {args[0]} exited {rc}:\n{err[-4000:]}\n{out[-2000:]}")


@pytest.fixture(scope="module")
def oracle() -> Iterator[OracleJava]:
    lib = run_blocking(ensure_jars())
    classes = run_blocking(compile_java([SOURCE], lib))
    yield OracleJava(classpath=f"{classes}:{lib}/*")


# ---------------------------------------------------------------------------------------------
# Command cases


def _java_header_fields(header: h.CommandHeader) -> tuple[list[list[str]], list[list[str]]]:
    """(fields of the Java header object, extFields Java adds beside it with addExtField)."""
    java_names = {n for n in type(header).JAVA_PUT_ORDER.split(",") if n}
    fields_: list[list[str]] = []
    added: list[list[str]] = []
    for key, value in header.to_ext_fields().items():
        (fields_ if key in java_names else added).append([key, value])
    return fields_, added


def _i32(value: int) -> int:
    value &= 0xFFFFFFFF
    return value - (1 << 32) if value >= 1 << 31 else value


def _body_bytes(spec: dict[str, Any]) -> bytes:
    kind = spec["kind"]
    if kind == "none":
        return b""
    if kind == "raw":
        return base64.b64decode(spec["data"])
    if kind == "pattern":
        return pattern(spec["size"])
    if kind == "heartbeat":
        consumers = []
        for c in spec["consumers"]:
            subs = [
                build_subscription(s["topic"], s["expression"], sub_version=s["version"],
                                   expression_type=s["type"])
                for s in c["subscriptions"]
            ]
            if spec.get("pythonSubscriptionOrder") == "java-hashset":
                # Already in Java's order: ConsumerData must leave it as it is.
                subs = java_hash_order(subs, [s.java_hash_code() for s in subs])
            consumers.append(ConsumerData(
                group_name=c["groupName"],
                consume_type=c["consumeType"],
                message_model=c["messageModel"],
                consume_from_where=c["consumeFromWhere"],
                unit_mode=c["unitMode"],
                subscription_data_set=subs,
            ))
        return HeartbeatData(
            client_id=spec["clientID"],
            consumer_data_set=consumers,
            producer_data_set=[ProducerData(g) for g in spec["producers"]],
            heartbeat_fingerprint=spec["fingerprint"],
            without_sub=spec["withoutSub"],
        ).to_json_bytes()
    if kind == "lock":
        return encode_lock_batch_request(
            spec["group"], spec["clientId"], [MessageQueue(t, b, q) for t, b, q in spec["mqs"]],
            spec["onlyThisBroker"],
        )
    if kind == "batch":
        return encode_batch(
            Message(m["topic"], base64.b64decode(m["body"]), properties=dict(m["props"]),
                    flag=m["flag"])
            for m in spec["messages"]
        )
    raise ValueError(kind)


@dataclass
class CommandCase:
    name: str
    code: int
    kind: str = "request"  # request | oneway | response
    header: h.CommandHeader | None = None
    extras: list[tuple[str, str]] = field(default_factory=list)
    #: extFields given as a whole map (Java ``setExtFields(new HashMap<>())``, no header).
    plain_map: list[tuple[str, str]] | None = None
    #: (access key, secret key): signed by the ACL hook (Java ``AclClientRPCHook``).
    acl: tuple[str, str] | None = None
    remark: str | None = None
    body: dict[str, Any] = field(default_factory=lambda: {"kind": "none"})
    language: LanguageCode = LanguageCode.PYTHON
    version: int = CURRENT_VERSION
    opaque: int = 0
    serialize: SerializeType = SerializeType.JSON

    @property
    def label(self) -> str:
        return f"{self.name}/{self.serialize.name}"

    @property
    def flag(self) -> int:
        return {"request": 0, "oneway": RPC_ONEWAY, "response": RPC_TYPE_RESPONSE}[self.kind]

    def to_json(self) -> dict[str, Any]:
        header_spec: dict[str, Any] | None = None
        added: list[list[str]] = []
        if self.header is not None:
            java_fields, added = _java_header_fields(self.header)
            cls = type(self.header)
            header_spec = {"class": _JAVA_CLASS.get(cls, cls.__name__), "fields": java_fields}
        return {
            "name": self.label,
            "code": self.code,
            "kind": self.kind,
            "opaque": self.opaque,
            "language": LanguageCode(self.language).name,
            "version": self.version,
            "remark": self.remark,
            "serialize": self.serialize.name,
            "header": header_spec,
            "extras": added + [list(kv) for kv in self.extras],
            "map": [list(kv) for kv in self.plain_map] if self.plain_map is not None else None,
            "acl": list(self.acl) if self.acl is not None else None,
            "body": self.body,
        }

    def command(self) -> RemotingCommand:
        """The same command built with rmq_async, as its client or a broker would."""
        ext: dict[str, str] | None = None
        if self.header is not None:
            ext = self.header.to_ext_fields()
        elif self.plain_map is not None:
            ext = dict(self.plain_map)
        cmd = RemotingCommand(
            code=self.code,
            language=self.language,
            version=self.version,
            opaque=self.opaque,
            flag=self.flag,
            remark=self.remark,
            ext_fields=ext,
            body=_body_bytes(self.body),
            serialize_type=self.serialize,
        )
        for key, value in self.extras:
            cmd.add_ext_field(key, value)
        if self.acl is not None:
            hook = ConsumerOptions(consumer_group="oracle",
                                   credentials=Credentials(*self.acl)).rpc_hook()
            assert hook is not None
            hook(cmd)
        return cmd


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


def _batch_item(topic: str, body: bytes, flag: int, props: list[tuple[str, str]]) -> dict[str, Any]:
    # Java's Message keeps its properties in a HashMap; encode_properties writes a mapping in
    # its own order, so the case lists them in the HashMap's iteration order.
    ordered = dict(props)
    return {
        "topic": topic,
        "body": _b64(body),
        "flag": flag,
        "props": [[k, ordered[k]] for k in java_hashmap_order(list(ordered))],
    }


def base_cases() -> list[CommandCase]:
    mq = MessageQueue("TopicTest", "broker-a", 3)
    group = "GID_oracle"
    client_id = "127.0.0.1@4242#1700000000000"
    heartbeat = {
        "kind": "heartbeat",
        "clientID": client_id,
        "fingerprint": 0,
        "withoutSub": False,
        "producers": ["PID_oracle"],
        "consumers": [{
            "groupName": group,
            "consumeType": "CONSUME_PASSIVELY",
            "messageModel": "CLUSTERING",
            "consumeFromWhere": "CONSUME_FROM_FIRST_OFFSET",
            "unitMode": False,
            "subscriptions": [
                {"topic": "TopicTest", "expression": "TagA || TagB || 标签", "type": "TAG",
                 "version": 1700000000001},
            ],
        }],
    }
    heartbeat_retry = json.loads(json.dumps(heartbeat))
    heartbeat_retry["consumers"][0]["subscriptions"].append(
        {"topic": f"%RETRY%{group}", "expression": "*", "type": "TAG", "version": 1700000000002}
    )
    heartbeat_retry["consumers"][0]["subscriptions"].append(
        {"topic": "OrdersSql", "expression": "a > 5 AND b = 'x'", "type": "SQL92",
         "version": 1700000000003}
    )
    heartbeat_retry_java_order = dict(heartbeat_retry, pythonSubscriptionOrder="java-hashset")
    lock_body = {
        "kind": "lock", "group": group, "clientId": client_id, "onlyThisBroker": False,
        "mqs": [["TopicTest", "broker-a", q] for q in (0, 5, 2, 7, 1)] + [["主题", "broker-b", 4]],
    }
    props = encode_properties({
        "UNIQ_KEY": "7F0000011F9018B4AAC2754A8D0F0000", "WAIT": "true", "TAGS": "标签A",
        "KEYS": "k1 ключ2", "用户属性": "значение 😀",
    })
    send = h.SendMessageRequestHeaderV2(
        producer_group="PID_oracle", topic=mq.topic, default_topic="TBW102",
        default_topic_queue_nums=4, queue_id=mq.queue_id, sys_flag=0,
        born_timestamp=1700000000123, flag=0, properties=props, reconsume_times=0,
        unit_mode=False, batch=False, bname=mq.broker_name,
    )
    batch_send = h.SendMessageRequestHeaderV2(
        producer_group="PID_oracle", topic=mq.topic, queue_id=mq.queue_id,
        born_timestamp=1700000000456, properties=encode_properties({"WAIT": "true"}),
        reconsume_times=0, unit_mode=False, batch=True, bname=mq.broker_name,
    )
    batch_body = {"kind": "batch", "messages": [
        _batch_item(mq.topic, b"first", 0, [("UNIQ_KEY", "7F0000011F9018B4AAC2754A8D0F0001"),
                                            ("WAIT", "true"), ("TAGS", "TagA")]),
        _batch_item(mq.topic, "второе 😀".encode(), 5, [("KEYS", "k1 k2"), ("自定义", "值")]),
        _batch_item(mq.topic, b"", 0, [("UNIQ_KEY", "7F0000011F9018B4AAC2754A8D0F0003")]),
    ]}
    pull = h.PullMessageRequestHeader(
        consumer_group=group, topic=mq.topic, queue_id=mq.queue_id, queue_offset=100,
        max_msg_nums=32, sys_flag=7, commit_offset=99, suspend_timeout_millis=15000,
        subscription="TagA || 标签", sub_version=1700000000001, expression_type="TAG",
        bname=mq.broker_name,
    )
    pull_all = h.PullMessageRequestHeader(
        consumer_group="组-" + group, topic=mq.topic, queue_id=0, queue_offset=2**40,
        max_msg_nums=1, sys_flag=0, commit_offset=0, suspend_timeout_millis=0,
        subscription="*", sub_version=0, expression_type="TAG", max_msg_bytes=1 << 20,
        request_source=-1, proxy_forward_client_id="proxy-1", bname=mq.broker_name,
    )
    record = bytes.fromhex("000000b8daa320a7") + pattern(176)
    return [
        CommandCase("route", RequestCode.GET_ROUTEINFO_BY_TOPIC,
                    header=h.GetRouteInfoRequestHeader(topic="TopicTest")),
        CommandCase("route-unicode", RequestCode.GET_ROUTEINFO_BY_TOPIC,
                    header=h.GetRouteInfoRequestHeader(topic="主题-Topic",
                                                       accept_standard_json_only=True),
                    extras=UNICODE_EXTRAS, remark=UNICODE_REMARK),
        CommandCase("heartbeat", RequestCode.HEART_BEAT, header=h.HeartbeatRequestHeader(),
                    body=heartbeat),
        CommandCase(SUBSCRIPTION_SET_CASE, RequestCode.HEART_BEAT,
                    header=h.HeartbeatRequestHeader(), body=heartbeat_retry),
        CommandCase("heartbeat-subscriptions-java-order", RequestCode.HEART_BEAT,
                    header=h.HeartbeatRequestHeader(), body=heartbeat_retry_java_order),
        CommandCase("unregister", RequestCode.UNREGISTER_CLIENT,
                    header=h.UnregisterClientRequestHeader(client_id=client_id,
                                                           consumer_group=group)),
        CommandCase("consumer-list", RequestCode.GET_CONSUMER_LIST_BY_GROUP,
                    header=h.GetConsumerListByGroupRequestHeader(consumer_group=group)),
        CommandCase("query-offset", RequestCode.QUERY_CONSUMER_OFFSET,
                    header=h.QueryConsumerOffsetRequestHeader(
                        consumer_group=group, topic=mq.topic, queue_id=3, bname=mq.broker_name)),
        CommandCase("query-offset-zero", RequestCode.QUERY_CONSUMER_OFFSET,
                    header=h.QueryConsumerOffsetRequestHeader(
                        consumer_group=group, topic=mq.topic, queue_id=3,
                        set_zero_if_not_found=False)),
        CommandCase("update-offset", RequestCode.UPDATE_CONSUMER_OFFSET, kind="oneway",
                    header=h.UpdateConsumerOffsetRequestHeader(
                        consumer_group=group, topic=mq.topic, queue_id=3,
                        commit_offset=123456789012, bname=mq.broker_name)),
        CommandCase("pull", RequestCode.PULL_MESSAGE, header=pull),
        CommandCase("pull-all-fields", RequestCode.PULL_MESSAGE, header=pull_all,
                    extras=UNICODE_EXTRAS),
        CommandCase("send-back", RequestCode.CONSUMER_SEND_MSG_BACK,
                    header=h.ConsumerSendMsgBackRequestHeader(
                        offset=987654321, group=group, delay_level=0,
                        origin_msg_id="7F0000011F9018B4AAC2754A8D0F0000",
                        origin_topic=mq.topic, max_reconsume_times=16, bname=mq.broker_name)),
        CommandCase("lock", RequestCode.LOCK_BATCH_MQ, header=h.LockBatchMqRequestHeader(),
                    body=lock_body),
        CommandCase("unlock", RequestCode.UNLOCK_BATCH_MQ, kind="oneway",
                    header=h.UnlockBatchMqRequestHeader(), body=lock_body),
        CommandCase("max-offset", RequestCode.GET_MAX_OFFSET,
                    header=h.GetMaxOffsetRequestHeader(topic=mq.topic, queue_id=3,
                                                       bname=mq.broker_name)),
        CommandCase("min-offset", RequestCode.GET_MIN_OFFSET,
                    header=h.GetMinOffsetRequestHeader(topic=mq.topic, queue_id=3,
                                                       bname=mq.broker_name)),
        CommandCase("search-offset", RequestCode.SEARCH_OFFSET_BY_TIMESTAMP,
                    header=h.SearchOffsetRequestHeader(topic=mq.topic, queue_id=3,
                                                       timestamp=1700000000000,
                                                       boundary_type="UPPER",
                                                       bname=mq.broker_name)),
        CommandCase("search-offset-plain", RequestCode.SEARCH_OFFSET_BY_TIMESTAMP,
                    header=h.SearchOffsetRequestHeader(topic=mq.topic, queue_id=3,
                                                       timestamp=-1)),
        CommandCase("send-v2", RequestCode.SEND_MESSAGE_V2, header=send,
                    body={"kind": "raw", "data": _b64("hello 世界 😀".encode())}),
        CommandCase("send-v2-1mib", RequestCode.SEND_MESSAGE_V2, header=send,
                    body={"kind": "pattern", "size": MIB}),
        CommandCase("send-v2-empty-body", RequestCode.SEND_MESSAGE_V2, header=send,
                    extras=UNICODE_EXTRAS),
        CommandCase("send-batch", RequestCode.SEND_BATCH_MESSAGE, header=batch_send,
                    body=batch_body),
        CommandCase("pull-found", ResponseCode.SUCCESS, kind="response",
                    language=LanguageCode.JAVA,
                    header=h.PullMessageResponseHeader(
                        suggest_which_broker_id=0, next_begin_offset=105, min_offset=0,
                        max_offset=200, topic_sys_flag=0, group_sys_flag=0),
                    remark="FOUND", body={"kind": "raw", "data": _b64(record)}),
        CommandCase("pull-not-found", ResponseCode.PULL_NOT_FOUND, kind="response",
                    language=LanguageCode.JAVA,
                    header=h.PullMessageResponseHeader(
                        suggest_which_broker_id=1, next_begin_offset=7, min_offset=3,
                        max_offset=7, offset_delta=2, forbidden_type=0),
                    remark="no new message 😴"),
        CommandCase("send-result", ResponseCode.SUCCESS, kind="response",
                    language=LanguageCode.JAVA,
                    header=h.SendMessageResponseHeader(
                        msg_id="7F00000100002A9F000000003ADE68B1", queue_id=3,
                        queue_offset=42, batch_uniq_id="7F0000011F9018B4AAC2754A8D0F0001",
                        msg_region="DefaultRegion", trace_on="true")),
        CommandCase("query-offset-result", ResponseCode.SUCCESS, kind="response",
                    language=LanguageCode.JAVA,
                    header=h.QueryConsumerOffsetResponseHeader(offset=77)),
        CommandCase("max-offset-result", ResponseCode.SUCCESS, kind="response",
                    language=LanguageCode.JAVA,
                    header=h.GetMaxOffsetResponseHeader(offset=2**40 + 1)),
        CommandCase("search-offset-result", ResponseCode.SUCCESS, kind="response",
                    language=LanguageCode.JAVA,
                    header=h.SearchOffsetResponseHeader(offset=0)),
        CommandCase("error", ResponseCode.SYSTEM_ERROR, kind="response",
                    language=LanguageCode.JAVA, remark=UNICODE_REMARK),
        CommandCase("extras-only", RequestCode.GET_BROKER_CLUSTER_INFO, extras=UNICODE_EXTRAS,
                    remark="", body={"kind": "pattern", "size": MIB}),
        CommandCase("acl-query-offset", RequestCode.QUERY_CONSUMER_OFFSET, acl=ACL,
                    header=h.QueryConsumerOffsetRequestHeader(
                        consumer_group=group, topic=mq.topic, queue_id=3, bname=mq.broker_name)),
        CommandCase("acl-heartbeat", RequestCode.HEART_BEAT, acl=ACL,
                    header=h.HeartbeatRequestHeader(), body=heartbeat),
        CommandCase("acl-send-v2", RequestCode.SEND_MESSAGE_V2, acl=ACL, header=send,
                    body={"kind": "raw", "data": _b64("подпись 😀".encode())}),
        CommandCase("plain-map", RequestCode.GET_BROKER_CLUSTER_INFO, plain_map=UNICODE_EXTRAS,
                    body={"kind": "raw", "data": _b64(bytes(range(256)))}),
        CommandCase("plain-map-then-added", RequestCode.GET_BROKER_CLUSTER_INFO,
                    plain_map=UNICODE_EXTRAS[:2], extras=UNICODE_EXTRAS[2:]),
        CommandCase("bare", RequestCode.GET_BROKER_CLUSTER_INFO, language=LanguageCode.GO,
                    version=0),
    ]


def all_cases() -> list[CommandCase]:
    out: list[CommandCase] = []
    for serialize in (SerializeType.JSON, SerializeType.ROCKETMQ):
        for c in base_cases():
            c.serialize = serialize
            c.opaque = 1000 + len(out)
            out.append(c)
    return out


def split_frames(data: bytes) -> list[bytes]:
    frames: list[bytes] = []
    pos = 0
    while pos < len(data):
        (length,) = struct.unpack_from(">i", data, pos)
        frames.append(data[pos:pos + 4 + length])
        pos += 4 + length
    return frames


def _describe(frame: bytes) -> str:
    cmd = RemotingCommand.decode(frame[4:])
    return f"ext order {list((cmd.ext_fields or {}).items())!r}, body {len(cmd.body)} B"


@pytest.fixture(scope="module")
def java_frames(oracle: OracleJava, tmp_path_factory: pytest.TempPathFactory) -> dict[str, bytes]:
    """Every case encoded by Java (one JVM run), by case label."""
    cases = all_cases()
    folder = tmp_path_factory.mktemp("oracle-encode")
    spec = folder / "cases.json"
    spec.write_text(json.dumps([c.to_json() for c in cases]), encoding="utf-8")
    run_blocking(oracle.run("encode", str(spec), str(folder / "java.bin")))
    frames = split_frames((folder / "java.bin").read_bytes())
    assert len(frames) == len(cases)
    return {c.label: f for c, f in zip(cases, frames, strict=True)}


def _mismatches(cases: list[CommandCase], java_frames: dict[str, bytes]) -> list[str]:
    out: list[str] = []
    for case in cases:
        ours = case.command().encode()
        theirs = java_frames[case.label]
        if ours != theirs:
            out.append(
                f"{case.label}: {len(ours)} vs {len(theirs)} bytes\n"
                f"  ours: {_describe(ours)}\n  java: {_describe(theirs)}"
            )
    return out


def binary_ext_keys(frame: bytes) -> list[str]:
    """The extFields keys of a ROCKETMQ-serialized frame, in written order, duplicates kept."""
    (info,) = struct.unpack_from(">I", frame, 4)
    assert info >> 24 == 1
    pos = 8 + 13
    (remark_len,) = struct.unpack_from(">i", frame, pos)
    pos += 4 + remark_len
    (ext_len,) = struct.unpack_from(">i", frame, pos)
    pos += 4
    end = pos + ext_len
    keys: list[str] = []
    while pos < end:
        (klen,) = struct.unpack_from(">h", frame, pos)
        keys.append(frame[pos + 2:pos + 2 + klen].decode("utf-8"))
        pos += 2 + klen
        (vlen,) = struct.unpack_from(">i", frame, pos)
        pos += 4 + vlen
    return keys


def test_java_encodes_the_bytes_we_encode(java_frames: dict[str, bytes]) -> None:
    cases = [c for c in all_cases()
             if c.name != SUBSCRIPTION_SET_CASE and c.label != ACL_FAST_BINARY_CASE]
    mismatches = _mismatches(cases, java_frames)
    assert not mismatches, "frames differ from Java's:\n" + "\n".join(mismatches)
    # The cases really cover what they should.
    assert max(len(f) for f in java_frames.values()) > MIB
    assert {f[4] for f in java_frames.values()} == {0, 1}  # both serialize types
    assert {c.code for c in cases} >= {
        RequestCode.GET_ROUTEINFO_BY_TOPIC, RequestCode.HEART_BEAT, RequestCode.UNREGISTER_CLIENT,
        RequestCode.GET_CONSUMER_LIST_BY_GROUP, RequestCode.QUERY_CONSUMER_OFFSET,
        RequestCode.UPDATE_CONSUMER_OFFSET, RequestCode.PULL_MESSAGE,
        RequestCode.CONSUMER_SEND_MSG_BACK, RequestCode.LOCK_BATCH_MQ, RequestCode.UNLOCK_BATCH_MQ,
        RequestCode.GET_MAX_OFFSET, RequestCode.GET_MIN_OFFSET,
        RequestCode.SEARCH_OFFSET_BY_TIMESTAMP, RequestCode.SEND_MESSAGE_V2,
        RequestCode.SEND_BATCH_MESSAGE,
    }


def test_java_acl_hook_writes_fast_header_fields_twice(java_frames: dict[str, bytes]) -> None:
    """Java quirk, deliberately not copied: with ACL, a FastCodesHeader is written twice.

    The ACL hook calls ``makeCustomHeaderToNet`` (copying the header into extFields) to sign
    them; ``fastEncodeHeader`` then writes the header's own fields and the whole extFields map.
    The receiver keeps one value per key, so both frames mean the same command.
    """
    (case,) = [c for c in all_cases() if c.label == ACL_FAST_BINARY_CASE]
    cmd = case.command()
    ours = cmd.encode()
    theirs = java_frames[case.label]
    assert RemotingCommand.decode(theirs[4:]) == RemotingCommand.decode(ours[4:])
    assert isinstance(cmd.ext_fields, ExtFields)
    own = set(cmd.ext_fields.header_keys)
    ours_keys = binary_ext_keys(ours)
    assert len(ours_keys) == len(set(ours_keys)) == len(cmd.ext_fields)
    fast_part = [k for k in ours_keys if k in own]
    cmd.serialize_type = SerializeType.JSON
    hashmap_order = list(json.loads(cmd.encode_header_json())["extFields"])
    assert binary_ext_keys(theirs) == fast_part + hashmap_order


def test_heartbeat_subscription_set_in_java_order(java_frames: dict[str, bytes]) -> None:
    cases = [c for c in all_cases() if c.name == SUBSCRIPTION_SET_CASE]
    assert len(cases) == 2
    mismatches = _mismatches(cases, java_frames)
    assert not mismatches, "frames differ from Java's:\n" + "\n".join(mismatches)


async def test_java_decodes_what_we_encode(oracle: OracleJava, tmp_path: Path) -> None:
    cases = all_cases()
    spec = tmp_path / "cases.json"
    spec.write_text(json.dumps([c.to_json() for c in cases]), encoding="utf-8")
    commands = [c.command() for c in cases]
    (tmp_path / "ours.bin").write_bytes(b"".join(cmd.encode() for cmd in commands))
    out = tmp_path / "decoded.jsonl"
    await oracle.run("decode", str(spec), str(tmp_path / "ours.bin"), str(out))
    lines = [json.loads(line) for line in out.read_text(encoding="utf-8").splitlines()]
    assert len(lines) == len(cases)

    headers_checked = 0
    for case, cmd, seen in zip(cases, commands, lines, strict=True):
        where = case.label
        assert seen["code"] == case.code, where
        assert seen["language"] == LanguageCode(case.language).name, where
        assert seen["version"] == case.version, where
        assert seen["opaque"] == case.opaque, where
        assert seen["flag"] == case.flag, where
        # Java reads an empty remark of the ROCKETMQ header as null.
        assert (seen["remark"] or None) == (case.remark or None), where
        assert seen["serialize"] == case.serialize.name, where
        assert (seen["extFields"] or {}) == dict(cmd.ext_fields or {}), where
        assert seen["bodyLength"] == len(cmd.body), where
        assert seen["bodySha256"] == hashlib.sha256(cmd.body).hexdigest(), where
        if case.header is not None:
            ours = case.header.to_ext_fields()
            java_header: dict[str, str | None] = seen["header"]
            for name, value in java_header.items():
                assert value == ours.get(name), f"{where}: header field {name}"
            java_names = {n for n in type(case.header).JAVA_PUT_ORDER.split(",") if n}
            assert {k for k in ours if k in java_names} <= set(java_header), where
            headers_checked += 1
        kind = case.body["kind"]
        if kind in ("heartbeat", "lock"):
            # Java's bean, decoded from our body and written again, holds what we wrote (its
            # sets are HashSets, so set-valued arrays are compared as sets).
            assert _unordered(json.loads(seen["body"])) == _unordered(json.loads(cmd.body)), where
        elif kind == "batch":
            expected = [
                {"flag": m["flag"], "body": m["body"], "properties": dict(m["props"])}
                for m in case.body["messages"]
            ]
            assert seen["body"] == expected, where
    assert headers_checked == sum(1 for c in cases if c.header is not None) > 40


_SET_FIELDS = {"consumerDataSet", "producerDataSet", "subscriptionDataSet", "tagsSet", "codeSet",
               "mqSet"}


def _unordered(value: Any, key: str = "") -> Any:
    if isinstance(value, dict):
        return {k: _unordered(v, k) for k, v in value.items()}
    if isinstance(value, list):
        items = [_unordered(v) for v in value]
        if key in _SET_FIELDS:
            return sorted(items, key=lambda v: json.dumps(v, sort_keys=True))
        return items
    return value


# ---------------------------------------------------------------------------------------------
# Stored messages


@dataclass
class StoredCase:
    name: str
    encoder: str  # "decoder" (MessageDecoder.encode) or "store" (MessageExtEncoder)
    topic: str = "TopicTest"
    body: bytes = b"hello world"
    version: int = 1
    compress: str | None = None
    type_bits: bool = True
    queue_id: int = 3
    flag: int = 7
    queue_offset: int = 1234
    commit_log_offset: int = 987654321
    sys_flag: int = 0
    born_timestamp: int = 1700000000123
    born_host: str = "10.0.0.5"
    born_port: int = 40001
    store_timestamp: int = 1700000000456
    store_host: str = "192.168.1.20"
    store_port: int = 10911
    reconsume_times: int = 2
    prepared_transaction_offset: int = 0
    props: list[tuple[str, str]] = field(default_factory=lambda: [
        ("TAGS", "TagA"), ("KEYS", "key1 key2"), ("UNIQ_KEY", "0A000005109C18B4AAC2754A8D0F0000"),
    ])

    def to_json(self) -> dict[str, Any]:
        return {
            "name": self.name, "encoder": self.encoder, "topic": self.topic,
            "body": _b64(self.body), "version": self.version, "compress": self.compress,
            "typeBits": self.type_bits, "queueId": self.queue_id, "flag": self.flag,
            "queueOffset": self.queue_offset, "commitLogOffset": self.commit_log_offset,
            "sysFlag": self.sys_flag, "bornTimestamp": self.born_timestamp,
            "bornHost": self.born_host, "bornPort": self.born_port,
            "storeTimestamp": self.store_timestamp, "storeHost": self.store_host,
            "storePort": self.store_port, "reconsumeTimes": self.reconsume_times,
            "preparedTransactionOffset": self.prepared_transaction_offset,
            "props": [list(kv) for kv in self.props],
        }


def stored_cases() -> list[StoredCase]:
    unicode_props = [
        ("TAGS", "标签"), ("KEYS", "ключ1 ключ2 🔑"), ("UNIQ_KEY", "7F0000011F9018B4AAC2754A8D0F0009"),
        ("用户", "значение with spaces\tand tab"), ("emoji😀", "😀" * 40), ("WAIT", "true"),
    ]
    big = pattern(300_000)
    text = ("RocketMQ stored message, zlib compressed " * 400).encode()
    long_topic = "T" + "x" * 199
    cases: list[StoredCase] = []
    for encoder in ("decoder", "store"):
        cases += [
            StoredCase(f"{encoder}-plain", encoder),
            StoredCase(f"{encoder}-unicode", encoder, topic="主题_Topic", props=unicode_props,
                       body="тело сообщения 😀".encode()),
            StoredCase(f"{encoder}-empty", encoder, body=b"", props=[]),
            StoredCase(f"{encoder}-zlib", encoder, body=text, compress="ZLIB"),
            StoredCase(f"{encoder}-zlib-untyped", encoder, body=big, compress="ZLIB",
                       type_bits=False),
            StoredCase(f"{encoder}-ipv6-born", encoder, born_host="2001:db8::1"),
            StoredCase(f"{encoder}-ipv6-both", encoder, born_host="2001:db8::1:0:0:1",
                       store_host="::1", store_port=10911, commit_log_offset=2**40 + 17),
            StoredCase(f"{encoder}-ipv6-store", encoder, store_host="fe80::abcd",
                       sys_flag=MSG_TRANSACTION_PREPARED_TYPE, prepared_transaction_offset=55),
        ]
    cases += [
        StoredCase("store-v2-long-topic", "store", topic=long_topic, version=2),
        StoredCase("store-v2-short-topic", "store", version=2, props=unicode_props),
        StoredCase("store-v2-zlib-ipv6", "store", topic=long_topic + "_" + "主" * 60, version=2,
                   body=text, compress="ZLIB", born_host="2001:db8::2", store_host="::1"),
    ]
    return cases


def _host(text: str) -> tuple[ipaddress.IPv4Address | ipaddress.IPv6Address, int]:
    addr, _, port = text.rpartition(":")
    return ipaddress.ip_address(addr.strip("[]")), int(port)


def _host_text(addr: str, port: int) -> str:
    ip = ipaddress.ip_address(addr)
    return f"[{ip.compressed}]:{port}" if ip.version == 6 else f"{addr}:{port}"


def _check_stored(ours: MessageExt, java: dict[str, Any], case: StoredCase) -> None:
    where = case.name
    body = base64.b64decode(java["body"])
    assert ours.body == body == case.body, where
    assert ours.topic == java["topic"] == case.topic, where
    # Java leaves the map null for a record without properties.
    assert ours.properties == (java["properties"] or {}) == dict(case.props), where
    assert ours.tags == java["tags"], where
    assert ours.keys == (java["keys"].split(" ") if java["keys"] else []), where
    assert ours.queue_id == java["queueId"] == case.queue_id, where
    assert ours.flag == java["flag"] == case.flag, where
    assert ours.queue_offset == java["queueOffset"] == case.queue_offset, where
    assert ours.commit_log_offset == java["commitLogOffset"] == case.commit_log_offset, where
    assert ours.sys_flag == java["sysFlag"], where
    assert ours.store_size == java["storeSize"], where
    assert ours.body_crc == java["bodyCRC"], where
    assert ours.born_timestamp == java["bornTimestamp"] == case.born_timestamp, where
    assert ours.store_timestamp == java["storeTimestamp"] == case.store_timestamp, where
    assert ours.reconsume_times == java["reconsumeTimes"] == case.reconsume_times, where
    assert (ours.prepared_transaction_offset == java["preparedTransactionOffset"]
            == case.prepared_transaction_offset), where
    assert _host(ours.born_host) == (ipaddress.ip_address(java["bornHost"]), java["bornPort"])
    assert _host(ours.born_host) == (ipaddress.ip_address(case.born_host), case.born_port)
    assert _host(ours.store_host) == (ipaddress.ip_address(java["storeHost"]), java["storePort"])
    assert _host(ours.store_host) == (ipaddress.ip_address(case.store_host), case.store_port)
    assert ours.offset_msg_id == java["offsetMsgId"], where
    assert ours.msg_id == java["msgId"], where


async def test_we_decode_what_java_stores(oracle: OracleJava, tmp_path: Path) -> None:
    cases = stored_cases()
    spec = tmp_path / "msgs.json"
    spec.write_text(json.dumps([c.to_json() for c in cases]), encoding="utf-8")
    records = tmp_path / "records.bin"
    out = tmp_path / "java.jsonl"
    await oracle.run("messages", str(spec), str(records), str(out))
    java = [json.loads(line) for line in out.read_text(encoding="utf-8").splitlines()]
    data = records.read_bytes()

    ours = decode_messages(data)
    assert len(ours) == len(java) == len(cases)
    for msg, seen, case in zip(ours, java, cases, strict=True):
        _check_stored(msg, seen, case)

    # Each record alone decodes the same, and encode_stored_message writes it byte for byte
    # (zlib level 5 included), except 4.x-style compressed records, which it does not write.
    pos = 0
    rewritten = 0
    for msg, case in zip(ours, cases, strict=True):
        record = data[pos:pos + msg.store_size]
        (single,) = decode_messages(record)
        assert single.body == msg.body and single.commit_log_offset == msg.commit_log_offset
        if case.type_bits or case.compress is None:
            assert _java_record(case) == record, case.name
            rewritten += 1
        pos += msg.store_size
    assert pos == len(data)
    assert rewritten == len(cases) - 2

    magics = {struct.unpack_from(">i", data, p)[0] for p in _record_starts(data, ours, 4)}
    assert magics == {MAGIC_V1, MAGIC_V2}  # both covered
    flags = [m.sys_flag for m in ours]
    assert any(f & 0x10 for f in flags) and any(f & 0x20 for f in flags)  # IPv6 born and store
    compressed = [struct.unpack_from(">i", data, p)[0] for p in _record_starts(data, ours, 36)]
    assert sum(1 for f in compressed if f & 0x1) == 5  # zlib records, stored compressed


def _java_record(case: StoredCase) -> bytes:
    """``case`` written with encode_stored_message (what fake brokers in tests use).

    Java's message keeps its properties in a HashMap and writes them in that map's iteration
    order, while encode_properties keeps the mapping's order: the properties go in Java's order.
    """
    props = dict(case.props)
    msg = MessageExt(
        case.topic, case.body, case.queue_id, case.queue_offset, case.flag, case.sys_flag,
        {k: props[k] for k in java_hashmap_order(list(props))},
        commit_log_offset=case.commit_log_offset, born_timestamp=case.born_timestamp,
        born_host=_host_text(case.born_host, case.born_port),
        store_timestamp=case.store_timestamp,
        store_host=_host_text(case.store_host, case.store_port),
        reconsume_times=case.reconsume_times,
        prepared_transaction_offset=case.prepared_transaction_offset,
    )
    return encode_stored_message(msg, magic=MAGIC_V2 if case.version == 2 else MAGIC_V1,
                                 compress=case.compress is not None)


def _record_starts(data: bytes, msgs: list[MessageExt], offset: int) -> Iterator[int]:
    pos = 0
    for m in msgs:
        yield pos + offset
        pos += m.store_size

"""ConsumerOptions: Java defaults, validation ranges, kwargs hints, client id, ACL signing;
ConsumeResult / ConsumeContext helpers."""

from __future__ import annotations

import base64
import hashlib
import hmac
import os
import ssl
from dataclasses import FrozenInstanceError
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest

from rmq_async.consumer.allocate import AllocateAveragely, AllocateConsistentHash
from rmq_async.consumer.options import (
    ConsumeFromWhere,
    ConsumerOptions,
    Credentials,
    InvalidOptionError,
    MessageModel,
    build_client_id,
    check_group_name,
    default_client_ip,
    pick_client_ip,
    resolve_instance_name,
)
from rmq_async.consumer.results import (
    ConsumeContext,
    ConsumeResult,
    DirectConsumeResult,
    direct_consume_result,
    normalize_result,
)
from rmq_async.protocol.types import MessageQueue

# ---------------------------------------------------------------------- defaults


def test_defaults_are_the_java_client_defaults() -> None:
    o = ConsumerOptions.from_kwargs("g1")
    assert o.consumer_group == "g1"
    assert o.message_model is MessageModel.CLUSTERING
    assert o.consume_from_where is ConsumeFromWhere.LAST_OFFSET
    assert isinstance(o.allocate_strategy, AllocateAveragely)
    assert (o.pull_batch_size, o.pull_interval) == (32, 0.0)
    assert (o.pull_threshold_for_queue, o.pull_threshold_size_for_queue) == (1000, 100)
    assert (o.pull_threshold_for_topic, o.pull_threshold_size_for_topic) == (-1, -1)
    assert o.consume_concurrently_max_span == 2000
    assert o.consume_message_batch_max_size == 1
    assert o.consume_concurrency == 20
    assert o.max_reconsume_times == -1
    assert o.consume_timeout == 900.0
    assert o.suspend_current_queue_time == 1.0
    assert (o.instance_name, o.unit_name) == ("DEFAULT", None)
    assert (o.persist_offset_interval, o.heartbeat_interval) == (5.0, 30.0)
    assert (o.route_refresh_interval, o.rebalance_interval) == (30.0, 20.0)
    assert o.pull_time_delay_when_exception == 1.0
    assert o.pull_time_delay_when_flow_control == 0.05
    assert o.pull_time_delay_when_broker_flow_control == 0.02
    assert o.pull_time_delay_when_suspend == 1.0
    assert (o.broker_suspend_max_time, o.consumer_timeout_when_suspend) == (15.0, 30.0)
    assert o.pull_max_idle_time == 120.0
    assert o.post_subscription_when_pull is False
    assert o.offset_store_dir == Path.home() / ".rocketmq_offsets"
    assert o.credentials is None and o.ssl_context is None
    assert o.rpc_hook() is None


def test_default_consume_timestamp_is_half_an_hour_ago_local_time() -> None:
    o = ConsumerOptions.from_kwargs("g1")
    stamp = o.consume_timestamp
    assert isinstance(stamp, datetime) and stamp.tzinfo is None
    expected = datetime.now() - timedelta(minutes=30)
    assert abs((stamp - expected).total_seconds()) < 5
    assert abs(o.consume_timestamp_ms() - stamp.timestamp() * 1000) < 1


def test_effective_max_reconsume_times() -> None:
    o = ConsumerOptions.from_kwargs("g1")
    assert o.effective_max_reconsume_times(orderly=False) == 16
    assert o.effective_max_reconsume_times(orderly=True) == 2**31 - 1
    o3 = o.replace(max_reconsume_times=3)
    assert o3.effective_max_reconsume_times(orderly=False) == 3
    assert o3.effective_max_reconsume_times(orderly=True) == 3


def test_options_are_frozen() -> None:
    o = ConsumerOptions.from_kwargs("g1")
    with pytest.raises(FrozenInstanceError):
        o.pull_batch_size = 5  # type: ignore[misc]


def test_enums_carry_java_names_and_accept_strings() -> None:
    assert str(ConsumeFromWhere.LAST_OFFSET) == "CONSUME_FROM_LAST_OFFSET"
    assert str(MessageModel.BROADCASTING) == "BROADCASTING"
    o = ConsumerOptions.from_kwargs(
        "g1", message_model="broadcasting", consume_from_where="CONSUME_FROM_FIRST_OFFSET"
    )
    assert o.message_model is MessageModel.BROADCASTING
    assert o.consume_from_where is ConsumeFromWhere.FIRST_OFFSET
    assert ConsumerOptions.from_kwargs("g1", consume_from_where="timestamp").consume_from_where \
        is ConsumeFromWhere.TIMESTAMP
    assert ConsumeFromWhere.MIN_OFFSET.effective is ConsumeFromWhere.LAST_OFFSET
    assert ConsumeFromWhere.TIMESTAMP.effective is ConsumeFromWhere.TIMESTAMP
    with pytest.raises(InvalidOptionError, match="message_model"):
        ConsumerOptions.from_kwargs("g1", message_model="CLUSTER")


def test_custom_strategy_and_paths_and_credentials_are_normalised(tmp_path: Path) -> None:
    s = AllocateConsistentHash()
    o = ConsumerOptions.from_kwargs(
        "g1", allocate_strategy=s, offset_store_dir=str(tmp_path), credentials=("ak", "sk")
    )
    assert o.allocate_strategy is s
    assert o.offset_store_dir == tmp_path
    assert o.credentials == Credentials("ak", "sk", None)
    ctx = ssl.create_default_context()
    assert ConsumerOptions.from_kwargs("g1", ssl_context=ctx).ssl_context is ctx


# ---------------------------------------------------------------------- validation


RANGES: list[tuple[str, Any, Any, Any]] = [
    # option, lowest valid, highest valid, an invalid value
    ("pull_batch_size", 1, 1024, 1025),
    ("pull_batch_size", 1, 1024, 0),
    ("pull_threshold_for_queue", 1, 65535, 65536),
    ("pull_threshold_size_for_queue", 1, 1024, 0),
    ("pull_threshold_for_topic", 1, 6553500, 0),
    ("pull_threshold_size_for_topic", 1, 102400, 102401),
    ("consume_concurrently_max_span", 1, 65535, 0),
    ("consume_message_batch_max_size", 1, 1024, 1025),
    ("consume_concurrency", 1, 1000, 1001),
    ("consume_concurrency", 1, 1000, 0),
    ("max_reconsume_times", -1, 2**31 - 1, -2),
    ("pull_interval", 0.0, 65.535, 65.536),
    ("pull_interval", 0.0, 65.535, -0.1),
    ("heartbeat_interval", 0.001, 3600.0, 0),
    ("consume_timeout", 30.0, 86400.0, 0),
    ("suspend_current_queue_time", 0.0, 3600.0, -0.001),
]


@pytest.mark.parametrize(("name", "lo", "hi", "bad"), RANGES)
def test_ranges_follow_java_check_config(name: str, lo: Any, hi: Any, bad: Any) -> None:
    assert getattr(ConsumerOptions.from_kwargs("g1", **{name: lo}), name) == lo
    assert getattr(ConsumerOptions.from_kwargs("g1", **{name: hi}), name) == hi
    with pytest.raises(InvalidOptionError) as info:
        ConsumerOptions.from_kwargs("g1", **{name: bad})
    assert info.value.option == name
    assert name in str(info.value)
    assert isinstance(info.value, ValueError)


def test_topic_thresholds_accept_minus_one() -> None:
    o = ConsumerOptions.from_kwargs("g1", pull_threshold_for_topic=-1)
    assert o.pull_threshold_for_topic == -1


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("pull_batch_size", 3.0),
        ("pull_batch_size", True),
        ("pull_batch_size", "32"),
        ("heartbeat_interval", "30"),
        ("pull_interval", float("nan")),
        # 0 would pull again at once: flow control and pause() turned off.
        ("pull_time_delay_when_flow_control", 0),
        ("pull_time_delay_when_suspend", 0.0),
        ("post_subscription_when_pull", 1),
        ("instance_name", ""),
        ("client_ip", "  "),
        ("language", "xyz"),  # not a LanguageCode name: no broker would know it
        ("language", 3),
        ("unit_name", 5),
        ("allocate_strategy", object()),
        ("credentials", ("ak",)),
        ("credentials", ("ak", "")),
        ("ssl_context", "tls"),
        ("offset_store_dir", 5),
    ],
)
def test_wrong_types_are_rejected(name: str, value: Any) -> None:
    with pytest.raises(InvalidOptionError) as info:
        ConsumerOptions.from_kwargs("g1", **{name: value})
    assert info.value.option == name


def test_the_language_is_a_language_code_name_in_any_case() -> None:
    assert ConsumerOptions.from_kwargs("g1").language == "PYTHON"
    assert ConsumerOptions.from_kwargs("g1", language=" java ").language == "JAVA"
    assert ConsumerOptions.from_kwargs("g1", language="Node_JS").language == "NODE_JS"


@pytest.mark.parametrize("ts", ["2024010112000", "20241301120000", "2024-01-01 12:00", ""])
def test_bad_consume_timestamp(ts: str) -> None:
    with pytest.raises(InvalidOptionError, match="yyyyMMddHHmmss"):
        ConsumerOptions.from_kwargs("g1", consume_timestamp=ts)


def test_consume_timestamp_ms_reads_local_time() -> None:
    o = ConsumerOptions.from_kwargs("g1", consume_timestamp="20240102030405")
    assert o.consume_timestamp == datetime(2024, 1, 2, 3, 4, 5)
    assert o.consume_timestamp_ms() == int(datetime(2024, 1, 2, 3, 4, 5).timestamp() * 1000)


def test_consume_timestamp_takes_a_datetime_naive_or_aware() -> None:
    naive = ConsumerOptions.from_kwargs("g1", consume_timestamp=datetime(2024, 1, 2, 3, 4, 5))
    assert naive.consume_timestamp_ms() == int(datetime(2024, 1, 2, 3, 4, 5).timestamp() * 1000)
    aware = datetime(2024, 1, 2, 3, 4, 5, tzinfo=UTC)
    assert ConsumerOptions.from_kwargs("g1", consume_timestamp=aware).consume_timestamp_ms() \
        == 1704164645000


def test_consume_timeout_is_in_seconds() -> None:
    o = ConsumerOptions.from_kwargs("g1", consume_timeout=2)
    assert o.consume_timeout == 2.0
    with pytest.raises(InvalidOptionError, match="seconds"):
        ConsumerOptions.from_kwargs("g1", consume_timeout=-1)


def test_durations_accept_timedelta() -> None:
    o = ConsumerOptions.from_kwargs(
        "g1", consume_timeout=timedelta(minutes=2), persist_offset_interval=timedelta(seconds=1.5),
        suspend_current_queue_time=timedelta(milliseconds=250),
    )
    assert (o.consume_timeout, o.persist_offset_interval) == (120.0, 1.5)
    assert o.suspend_current_queue_time == 0.25
    assert o.replace(pull_interval=timedelta(milliseconds=20)).pull_interval == 0.02


def test_java_names_are_accepted_in_java_units() -> None:
    o = ConsumerOptions.from_kwargs(
        "g1", consumeTimeout=2, suspendCurrentQueueTimeMillis=500, pullInterval=250,
        persistConsumerOffsetInterval=1000, heartbeatBrokerInterval=10_000,
        pollNameServerInterval=5000, mqClientApiTimeout=1500, pullBatchSize=16,
        consumeTimestamp="20240102030405", consumeThreadMin=4, consumeThreadMax=64,
        messageModel="BROADCASTING", pullTimeDelayMillsWhenException=2000,
    )
    assert o.consume_timeout == 120.0
    assert o.suspend_current_queue_time == 0.5
    assert o.pull_interval == 0.25
    assert (o.persist_offset_interval, o.heartbeat_interval) == (1.0, 10.0)
    assert (o.route_refresh_interval, o.api_timeout) == (5.0, 1.5)
    assert o.pull_batch_size == 16 and o.consume_concurrency == 4
    assert o.consume_timestamp == datetime(2024, 1, 2, 3, 4, 5)
    assert o.message_model is MessageModel.BROADCASTING
    assert o.pull_time_delay_when_exception == 2.0
    assert ConsumerOptions.from_kwargs(
        "g1", suspend_current_queue_time_millis=50).suspend_current_queue_time == 0.05
    assert ConsumerOptions.from_kwargs("g1", useTLS=True).tls is True
    with pytest.raises(InvalidOptionError, match="already sets"):
        ConsumerOptions.from_kwargs("g1", consumeTimeout=1, consume_timeout=60)
    with pytest.raises(InvalidOptionError, match="pull_interval"):
        ConsumerOptions.from_kwargs("g1", pullInterval=70_000)


def test_the_thread_maximum_is_checked_as_java_checks_it_and_sets_nothing() -> None:
    # The Java pool's queue is unbounded: it runs consumeThreadMin threads, never more.
    assert ConsumerOptions.from_kwargs("g1", consumeThreadMax=64).consume_concurrency == 20
    assert ConsumerOptions.from_kwargs(
        "g1", consumeThreadMax=64, consumeThreadMin=10).consume_concurrency == 10
    assert ConsumerOptions.from_kwargs(
        "g1", consume_concurrency=5, consumeThreadMax=5).consume_concurrency == 5
    # checkConfig: consumeThreadMin (30) is larger than consumeThreadMax (20).
    with pytest.raises(InvalidOptionError, match=r"consumeThreadMax.*below the 30"):
        ConsumerOptions.from_kwargs("g1", consumeThreadMin=30, consumeThreadMax=20)
    with pytest.raises(InvalidOptionError, match="below the 20"):
        ConsumerOptions.from_kwargs("g1", consumeThreadMax=10)  # the default core size, 20
    with pytest.raises(InvalidOptionError, match="out of range"):
        ConsumerOptions.from_kwargs("g1", consumeThreadMin=1, consumeThreadMax=1001)
    with pytest.raises(InvalidOptionError, match="expected an int"):
        ConsumerOptions.from_kwargs("g1", consumeThreadMax="8")
    base = ConsumerOptions.from_kwargs("g1", consume_concurrency=40)
    with pytest.raises(InvalidOptionError, match="below the 40"):
        base.replace(consumeThreadMax=30)
    assert base.replace(consumeThreadMax=30, consumeThreadMin=8).consume_concurrency == 8
    with pytest.raises(InvalidOptionError, match="already sets"):
        ConsumerOptions.from_kwargs("g1", consumeThreadMin=4, consume_concurrency=8)


def test_long_poll_timeout_must_exceed_broker_suspend() -> None:
    with pytest.raises(InvalidOptionError, match="consumer_timeout_when_suspend"):
        ConsumerOptions.from_kwargs("g1", broker_suspend_max_time=30.0)


@pytest.mark.parametrize(
    ("group", "fragment"),
    [
        ("", "blank"),
        ("   ", "blank"),
        ("has space", "illegal characters"),
        ("dot.ted", "illegal characters"),
        ("ümlaut", "illegal characters"),
        ("trailing\n", "illegal characters"),  # Java's matches() takes the whole name
        ("x" * 121, "longer than 120"),
        ("DEFAULT_CONSUMER", "reserved"),
    ],
)
def test_group_name_rules(group: str, fragment: str) -> None:
    with pytest.raises(InvalidOptionError, match=fragment):
        ConsumerOptions.from_kwargs(group)


def test_group_name_allowed_characters() -> None:
    for group in ["a", "A-b_c%d|e9", "x" * 120, "%RETRY%x"]:
        assert check_group_name(group) == group


def test_unknown_option_gets_a_hint() -> None:
    with pytest.raises(InvalidOptionError, match="did you mean 'pull_batch_size'"):
        ConsumerOptions.from_kwargs("g1", pull_batchsize=10)
    with pytest.raises(InvalidOptionError, match="did you mean 'pull_max_idle_time'"):
        ConsumerOptions.from_kwargs("g1", pullMaxIdleTime=10)
    with pytest.raises(InvalidOptionError, match="did you mean 'allocate_strategy'"):
        ConsumerOptions.from_kwargs("g1", allocateMessageQueueStrategy=object())
    with pytest.raises(InvalidOptionError, match=r"unknown consumer option$"):
        ConsumerOptions.from_kwargs("g1", zzzzzz=1)
    with pytest.raises(InvalidOptionError, match="unknown"):
        ConsumerOptions.from_kwargs("g1").replace(nope=1)


def test_replace_revalidates() -> None:
    o = ConsumerOptions.from_kwargs("g1")
    assert o.replace(pull_batch_size=64).pull_batch_size == 64
    with pytest.raises(InvalidOptionError):
        o.replace(pull_batch_size=0)


# ---------------------------------------------------------------------- client id


def test_client_id_rewrites_default_instance_in_clustering() -> None:
    assert resolve_instance_name("DEFAULT", MessageModel.CLUSTERING, pid=42, nanos=7) == "42#7"
    assert resolve_instance_name("DEFAULT", MessageModel.BROADCASTING, pid=42, nanos=7) \
        == "DEFAULT"
    assert resolve_instance_name("app", MessageModel.CLUSTERING, pid=42, nanos=7) == "app"
    cid = build_client_id("10.1.2.3", "DEFAULT", None, MessageModel.CLUSTERING)
    ip, instance = cid.split("@")
    pid, nanos = instance.split("#")
    assert ip == "10.1.2.3" and int(pid) == os.getpid() and int(nanos) > 0


def test_client_ids_of_one_process_are_distinct() -> None:
    ids = {build_client_id("1.2.3.4", "DEFAULT", None, MessageModel.CLUSTERING)
           for _ in range(1000)}
    assert len(ids) == 1000


def test_client_id_with_unit_name() -> None:
    assert build_client_id("1.2.3.4", "app", "unit1", MessageModel.CLUSTERING) \
        == "1.2.3.4@app@unit1"
    assert build_client_id("1.2.3.4", "app", "  ", MessageModel.BROADCASTING) == "1.2.3.4@app"
    assert build_client_id("1.2.3.4", "DEFAULT", None, MessageModel.BROADCASTING) \
        == "1.2.3.4@DEFAULT"


def test_pick_client_ip_prefers_public_then_last_private() -> None:
    assert pick_client_ip(["127.0.0.1", "10.0.0.5", "8.8.4.4", "1.1.1.1"]) == "8.8.4.4"
    assert pick_client_ip(["127.0.0.1", "10.0.0.5", "192.168.1.9"]) == "192.168.1.9"
    assert pick_client_ip(["172.16.0.1", "172.32.0.1"]) == "172.32.0.1"  # 172.32 is public
    assert pick_client_ip(["127.0.0.1", "0.0.0.0", "garbage"]) == "127.0.0.1"
    assert pick_client_ip([]) == "127.0.0.1"


def test_default_client_ip_is_a_usable_ipv4_address() -> None:
    ip = default_client_ip()
    parts = [int(p) for p in ip.split(".")]
    assert len(parts) == 4 and all(0 <= p <= 255 for p in parts)
    assert ConsumerOptions.from_kwargs("g1").client_ip == ip


# ---------------------------------------------------------------------- ACL


def test_signature_follows_acl_client_rpc_hook() -> None:
    creds = Credentials("RocketMQ", "12345678")
    fields = {"topic": "T", "consumerGroup": "g", "queueId": "0"}
    body = b"\x01\x02"
    creds.sign_fields(fields, body)
    assert fields["AccessKey"] == "RocketMQ"
    assert "SecurityToken" not in fields
    # Values sorted by key: AccessKey, consumerGroup, queueId, topic (uppercase sorts first).
    content = ("RocketMQ" + "g" + "0" + "T").encode() + body
    expected = base64.b64encode(hmac.new(b"12345678", content, hashlib.sha1).digest()).decode()
    assert fields["Signature"] == expected


def test_signature_includes_security_token_and_ignores_old_signature() -> None:
    creds = Credentials("ak", "sk", "tok")
    fields = {"a": "1", "Signature": "stale"}
    creds.sign_fields(fields, None)
    content = "ak" + "tok" + "1"  # AccessKey, SecurityToken, a
    expected = base64.b64encode(hmac.new(b"sk", content.encode(), hashlib.sha1).digest()).decode()
    assert fields["Signature"] == expected
    assert fields["SecurityToken"] == "tok"


def test_rpc_hook_signs_a_command_object() -> None:
    class Cmd:
        def __init__(self) -> None:
            self.ext_fields: dict[str, str] | None = None
            self.body: bytes | None = b"body"

    hook = ConsumerOptions.from_kwargs("g1", credentials=("ak", "sk")).rpc_hook()
    assert hook is not None
    cmd = Cmd()
    hook(cmd)
    assert cmd.ext_fields is not None
    assert cmd.ext_fields["AccessKey"] == "ak"
    content = b"ak" + b"body"
    expected = base64.b64encode(hmac.new(b"sk", content, hashlib.sha1).digest()).decode()
    assert cmd.ext_fields["Signature"] == expected


def test_credentials_repr_hides_the_secret() -> None:
    assert "sk-secret" not in repr(Credentials("ak", "sk-secret", "tok-secret"))
    assert "tok-secret" not in repr(Credentials("ak", "sk-secret", "tok-secret"))


# ---------------------------------------------------------------------- results


def test_normalize_result_concurrent() -> None:
    assert normalize_result(ConsumeResult.SUCCESS) is ConsumeResult.SUCCESS
    assert normalize_result(None) is ConsumeResult.SUCCESS  # returned normally
    assert normalize_result(RuntimeError("x")) is ConsumeResult.RECONSUME_LATER
    assert normalize_result("CONSUME_SUCCESS") is ConsumeResult.SUCCESS
    assert normalize_result("reconsume_later") is ConsumeResult.RECONSUME_LATER
    assert normalize_result(ConsumeResult.COMMIT) is ConsumeResult.SUCCESS
    assert normalize_result(ConsumeResult.SUSPEND_CURRENT_QUEUE_A_MOMENT) \
        is ConsumeResult.RECONSUME_LATER
    assert normalize_result(True) is ConsumeResult.SUCCESS
    assert normalize_result(42) is ConsumeResult.SUCCESS
    assert normalize_result("done") is ConsumeResult.SUCCESS


def test_normalize_result_orderly() -> None:
    suspend = ConsumeResult.SUSPEND_CURRENT_QUEUE_A_MOMENT
    assert normalize_result(None, orderly=True) is ConsumeResult.SUCCESS
    assert normalize_result(ValueError(), orderly=True) is suspend
    assert normalize_result(ConsumeResult.RECONSUME_LATER, orderly=True) is suspend
    for r in (ConsumeResult.SUCCESS, ConsumeResult.COMMIT, ConsumeResult.ROLLBACK, suspend):
        assert normalize_result(r, orderly=True) is r


def test_ack_index_semantics() -> None:
    mq = MessageQueue("T", "b", 0)
    ok = ConsumeResult.SUCCESS
    assert ConsumeContext(mq).acked_count(5, ok) == 5
    assert ConsumeContext(mq, ack_index=1).acked_count(5, ok) == 2
    assert ConsumeContext(mq, ack_index=4).acked_count(5, ok) == 5
    assert ConsumeContext(mq, ack_index=99).acked_count(5, ok) == 5
    assert ConsumeContext(mq, ack_index=-1).acked_count(5, ok) == 0
    assert ConsumeContext(mq, ack_index=-7).acked_count(5, ok) == 0
    assert ConsumeContext(mq, ack_index=4).acked_count(5, ConsumeResult.RECONSUME_LATER) == 0
    ctx = ConsumeContext(mq)
    assert (ctx.delay_level_when_next_consume, ctx.auto_commit) == (0, True)
    assert ctx.suspend_current_queue_time_millis == -1


def test_direct_consume_result_names() -> None:
    assert direct_consume_result(ConsumeResult.SUCCESS) is DirectConsumeResult.CR_SUCCESS
    assert direct_consume_result(ConsumeResult.RECONSUME_LATER) is DirectConsumeResult.CR_LATER
    assert direct_consume_result(ConsumeResult.SUSPEND_CURRENT_QUEUE_A_MOMENT) \
        is DirectConsumeResult.CR_LATER
    assert direct_consume_result(ConsumeResult.COMMIT) is DirectConsumeResult.CR_COMMIT
    assert direct_consume_result(ConsumeResult.ROLLBACK) is DirectConsumeResult.CR_ROLLBACK
    assert direct_consume_result(None) is DirectConsumeResult.CR_SUCCESS  # returned normally
    assert direct_consume_result(KeyError()) is DirectConsumeResult.CR_THROW_EXCEPTION
    assert str(DirectConsumeResult.CR_SUCCESS) == "CR_SUCCESS"


def test_a_signed_commands_repr_shows_neither_its_token_nor_its_signature() -> None:
    from rmq_async.protocol.command import RemotingCommand

    cmd = RemotingCommand.request(11, ext_fields={"topic": "T"})
    ConsumerOptions.from_kwargs(
        "g1", credentials=("ak", "sk", "session-token-123")).rpc_hook()(cmd)  # type: ignore[misc]
    assert cmd.ext_fields is not None and cmd.ext_fields["SecurityToken"] == "session-token-123"
    shown = repr(cmd)
    assert "session-token-123" not in shown and cmd.ext_fields["Signature"] not in shown
    assert "'AccessKey': 'ak'" in shown and "'SecurityToken': '***'" in shown
    assert "'topic': 'T'" in shown
    assert "'topic': 'T'" in repr(RemotingCommand.request(11, ext_fields={"topic": "T"}))

"""JSON bodies: route data, heartbeat, locks, resets, admin replies."""

from __future__ import annotations

import pytest

from rmq_async.protocol.bodies import (
    BrokerData,
    ClusterInfo,
    ConsumeMessageDirectlyResult,
    ConsumerData,
    ConsumerRunningInfo,
    ConsumeStatus,
    GetConsumerStatusBody,
    HeartbeatData,
    LockBatchRequestBody,
    LockBatchResponseBody,
    ProcessQueueInfo,
    ProducerData,
    QueueData,
    ResetOffsetBody,
    TopicRouteData,
    consumer_queues,
    decode_consumer_list,
    decode_lock_batch_response,
    encode_lock_batch_request,
    master_address,
    mq_hash_code,
    producer_queues,
)
from rmq_async.protocol.errors import ProtocolError
from rmq_async.protocol.filter import build_subscription
from rmq_async.protocol.jsonutil import tolerant_loads
from rmq_async.protocol.types import MessageQueue

STANDARD_ROUTE = (
    b'{"brokerDatas":[{"brokerAddrs":{"0":"10.0.0.1:10911"},"brokerName":"broker-a",'
    b'"cluster":"DefaultCluster","enableActingMaster":false}],"filterServerTable":{},'
    b'"queueDatas":[{"brokerName":"broker-a","perm":6,"readQueueNums":4,"topicSysFlag":0,'
    b'"writeQueueNums":4}]}'
)
LEGACY_ROUTE = (
    b'{"brokerDatas":[{"brokerAddrs":{0:"10.0.0.1:10911",1:"10.0.0.2:10911"},'
    b'"brokerName":"broker-b","cluster":"c"},{"brokerAddrs":{1:"10.0.0.3:10911"},'
    b'"brokerName":"broker-c","cluster":"c"},{"brokerAddrs":{0:"10.0.0.4:10911"},'
    b'"brokerName":"broker-a","cluster":"c"}],"filterServerTable":{},"queueDatas":['
    b'{"brokerName":"broker-b","perm":6,"readQueueNums":2,"topicSysFlag":0,"writeQueueNums":3},'
    b'{"brokerName":"broker-c","perm":6,"readQueueNums":1,"topicSysFlag":0,"writeQueueNums":1},'
    b'{"brokerName":"broker-a","perm":2,"readQueueNums":5,"topicSysFlag":0,"writeQueueNums":1}]}'
)


def test_standard_route_parse_and_reencode() -> None:
    route = TopicRouteData.from_json_bytes(STANDARD_ROUTE)
    assert route.broker_datas == [
        BrokerData("DefaultCluster", "broker-a", {0: "10.0.0.1:10911"}, False, None)
    ]
    assert route.queue_datas == [QueueData("broker-a", 4, 4, 6, 0)]
    assert route.to_json_bytes() == STANDARD_ROUTE  # the reference's computed example
    assert consumer_queues(route, "T") == [MessageQueue("T", "broker-a", i) for i in range(4)]


def test_legacy_route_with_bare_integer_keys() -> None:
    route = TopicRouteData.from_json_bytes(LEGACY_ROUTE)
    assert route.broker_datas[0].broker_addrs == {0: "10.0.0.1:10911", 1: "10.0.0.2:10911"}
    # consumer: readable queue data, in route order; broker-a is write-only
    assert consumer_queues(route, "T") == [
        MessageQueue("T", "broker-b", 0), MessageQueue("T", "broker-b", 1),
        MessageQueue("T", "broker-c", 0),
    ]
    # producer: by broker name, writable, broker has a master (broker-c has none)
    assert producer_queues(route, "T") == [
        MessageQueue("T", "broker-a", 0),
        MessageQueue("T", "broker-b", 0), MessageQueue("T", "broker-b", 1),
        MessageQueue("T", "broker-b", 2),
    ]
    assert master_address(route, "broker-b") == "10.0.0.1:10911"
    assert master_address(route, "broker-c") is None
    assert master_address(route, "nope") is None
    assert route.broker_datas[1].select_broker_addr() == "10.0.0.3:10911"
    # the legacy form re-encodes with bare keys and parses back equal
    assert TopicRouteData.from_json_bytes(route.to_json_bytes(standard=False)) == route


def test_order_topic_conf_defines_producer_queues() -> None:
    route = TopicRouteData.from_json_bytes(STANDARD_ROUTE)
    route.order_topic_conf = "broker-x:2;broker-y:1"
    assert producer_queues(route, "T") == [
        MessageQueue("T", "broker-x", 0), MessageQueue("T", "broker-x", 1),
        MessageQueue("T", "broker-y", 0),
    ]
    route.order_topic_conf = "broker-x:two"
    with pytest.raises(ProtocolError):
        producer_queues(route, "T")


@pytest.mark.parametrize(
    "data",
    [
        b"[]",
        b'{"queueDatas":{}}',
        b'{"queueDatas":[{"brokerName":"a"}]}',
        b'{"queueDatas":[{"brokerName":1,"perm":6,"readQueueNums":1,"writeQueueNums":1}]}',
        b'{"brokerDatas":[{"brokerName":"a","brokerAddrs":{"x":"1:1"}}]}',
        b'{"brokerDatas":[{"brokerName":"a","brokerAddrs":{"0":5}}]}',
        b'{"brokerDatas":[{"brokerName":"a","enableActingMaster":"maybe"}]}',
        b"not json",
    ],
)
def test_route_rejects_malformed(data: bytes) -> None:
    with pytest.raises(ProtocolError):
        TopicRouteData.from_json_bytes(data)


def test_cluster_info_legacy_form() -> None:
    data = (b'{"brokerAddrTable":{"broker-a":{"brokerAddrs":{0:"10.0.0.1:10911"},'
            b'"brokerName":"broker-a","cluster":"DefaultCluster"}},'
            b'"clusterAddrTable":{"DefaultCluster":["broker-a"]}}')
    info = ClusterInfo.from_json_bytes(data)
    assert info.broker_addr_table["broker-a"].broker_addrs == {0: "10.0.0.1:10911"}
    assert info.cluster_addr_table == {"DefaultCluster": ["broker-a"]}
    assert ClusterInfo.from_json_bytes(info.to_json_bytes()) == info


def test_heartbeat_matches_java_bytes() -> None:
    sub = build_subscription(
        "TopicTest", "TagA || TagB || order-created || 中文 || a || zzz", sub_version=1700000000000
    )
    hb = HeartbeatData("10.0.0.5@4242#123456789", [ConsumerData("g1", subscription_data_set=[sub])])
    # HeartbeatData.encode() of the equivalent Java objects (RocketMQ 5.3.3, fastjson 1.2.83).
    assert hb.to_json_bytes().decode("utf-8") == (
        '{"clientID":"10.0.0.5@4242#123456789","consumerDataSet":[{"consumeFromWhere":'
        '"CONSUME_FROM_LAST_OFFSET","consumeType":"CONSUME_PASSIVELY","groupName":"g1",'
        '"messageModel":"CLUSTERING","subscriptionDataSet":[{"classFilterMode":false,'
        '"codeSet":[2598919,97,646394,121146,-392709271,2598920],"expressionType":"TAG",'
        '"subString":"TagA || TagB || order-created || 中文 || a || zzz",'
        '"subVersion":1700000000000,"tagsSet":["TagA","a","中文","zzz","order-created","TagB"],'
        '"topic":"TopicTest"}],"unitMode":false}],"heartbeatFingerprint":0,'
        '"producerDataSet":[],"withoutSub":false}'
    )
    assert hb.encode() == hb.to_json_bytes()


def test_heartbeat_with_producer() -> None:
    hb = HeartbeatData("cid", producer_data_set=[ProducerData("pg")])
    assert tolerant_loads(hb.to_json_bytes())["producerDataSet"] == [{"groupName": "pg"}]


def test_lock_request_matches_java_bytes() -> None:
    mqs = [MessageQueue("TopicTest", "broker-a" if i % 2 == 0 else "broker-b", i)
           for i in range(5)]
    assert encode_lock_batch_request("g1", "cid", mqs).decode() == (
        '{"clientId":"cid","consumerGroup":"g1","mqSet":['
        '{"brokerName":"broker-a","queueId":2,"topic":"TopicTest"},'
        '{"brokerName":"broker-b","queueId":3,"topic":"TopicTest"},'
        '{"brokerName":"broker-a","queueId":4,"topic":"TopicTest"},'
        '{"brokerName":"broker-a","queueId":0,"topic":"TopicTest"},'
        '{"brokerName":"broker-b","queueId":1,"topic":"TopicTest"}],"onlyThisBroker":false}'
    )
    parsed = LockBatchRequestBody.from_json_bytes(encode_lock_batch_request("g1", "cid", mqs))
    assert set(parsed.mq_set) == set(mqs) and parsed.consumer_group == "g1"


def test_mq_hash_code_is_java_hash_code() -> None:
    # new MessageQueue("TopicTest", "broker-a", 0).hashCode() on Java 17
    assert mq_hash_code(MessageQueue("TopicTest", "broker-a", 0)) == -222122291


def test_lock_response_and_consumer_list() -> None:
    data = b'{"lockOKMQSet":[{"brokerName":"b","queueId":1,"topic":"t"}]}'
    assert decode_lock_batch_response(data) == {MessageQueue("t", "b", 1)}
    assert decode_lock_batch_response(b"{}") == set()
    body = LockBatchResponseBody({MessageQueue("t", "b", 2)}).to_json_bytes()
    assert decode_lock_batch_response(body) == {MessageQueue("t", "b", 2)}
    assert decode_consumer_list(b'{"consumerIdList":["a@1","b@2"]}') == ["a@1", "b@2"]
    with pytest.raises(ProtocolError):
        decode_consumer_list(b'{"consumerIdList":[1]}')
    with pytest.raises(ProtocolError):
        decode_lock_batch_response(b'{"lockOKMQSet":[{"brokerName":"b","topic":"t"}]}')


def test_reset_offset_body_java_form() -> None:
    # ResetOffsetBody.encode() from Java (HashMap<MessageQueue, Long> with object keys).
    java = (b'{"offsetTable":{{"brokerName":"broker-a","queueId":1,"topic":"TopicTest"}:200,'
            b'{"brokerName":"broker-a","queueId":0,"topic":"TopicTest"}:100}}')
    body = ResetOffsetBody.from_json_bytes(java)
    expected = {MessageQueue("TopicTest", "broker-a", 0): 100,
                MessageQueue("TopicTest", "broker-a", 1): 200}
    assert body.offset_table == expected
    assert ResetOffsetBody(expected).to_json_bytes() == java


def test_reset_offset_body_cpp_list_form() -> None:
    data = (b'{"offsetTable":[{"brokerName":"b","offset":7,"queueId":0,"topic":"t"},'
            b'{"brokerName":"b","offset":9,"queueId":1,"topic":"t"}]}')
    assert ResetOffsetBody.from_json_bytes(data).offset_table == {
        MessageQueue("t", "b", 0): 7, MessageQueue("t", "b", 1): 9
    }


def test_reset_offset_body_string_keys() -> None:
    data = b'{"offsetTable":{"{\\"brokerName\\":\\"b\\",\\"queueId\\":3,\\"topic\\":\\"t\\"}":5}}'
    assert ResetOffsetBody.from_json_bytes(data).offset_table == {MessageQueue("t", "b", 3): 5}


@pytest.mark.parametrize(
    "data",
    [
        b'{"offsetTable":{{"brokerName":"b","queueId":0,"topic":"t"}:"x"}}',
        b'{"offsetTable":{"plain":1}}',
        b'{"offsetTable":[{"brokerName":"b","queueId":0,"topic":"t"}]}',
        b'{"offsetTable":5}',
    ],
)
def test_reset_offset_body_malformed(data: bytes) -> None:
    with pytest.raises(ProtocolError):
        ResetOffsetBody.from_json_bytes(data)


def test_consumer_status_body() -> None:
    body = GetConsumerStatusBody({MessageQueue("t", "b", 0): 10})
    data = body.to_json_bytes()
    assert data == b'{"consumerTable":{},"messageQueueTable":{{"brokerName":"b","queueId":0,"topic":"t"}:10}}'
    assert GetConsumerStatusBody.from_json_bytes(data) == body


def test_consumer_running_info() -> None:
    mq1, mq0 = MessageQueue("t", "b", 1), MessageQueue("t", "b", 0)
    info = ConsumerRunningInfo(
        properties={"PROP_CONSUME_TYPE": "CONSUME_PASSIVELY"},
        subscription_set=[build_subscription("z", "*", sub_version=1),
                          build_subscription("a", "x", sub_version=2)],
        mq_table={mq1: ProcessQueueInfo(commit_offset=5, locked=True), mq0: ProcessQueueInfo()},
        status_table={"t": ConsumeStatus(pull_rt=1.5, consume_failed_msgs=2)},
    )
    data = info.to_json_bytes()
    text = data.decode()
    # fastjson form: bean fields sorted, map keys that are objects, TreeMap/TreeSet order
    assert text.startswith('{"mqPopTable":{},"mqTable":{{"brokerName":"b","queueId":0,')
    assert '"consumeFailedMsgs":2,"consumeFailedTPS":0.0,"consumeOKTPS":0.0' in text
    assert '"pullRT":1.5' in text and '"cachedMsgSizeInMiB":0' in text and '"droped":false' in text
    parsed = tolerant_loads(data)
    assert [s["topic"] for s in parsed["subscriptionSet"]] == ["a", "z"]
    assert parsed["mqTable"][mq1]["commitOffset"] == 5 and parsed["mqTable"][mq1]["locked"]
    assert "jstack" not in parsed


def test_consume_message_directly_result_matches_java() -> None:
    result = ConsumeMessageDirectlyResult("CR_SUCCESS", remark="ok", spent_time_mills=12)
    assert result.to_json_bytes() == (
        b'{"autoCommit":true,"consumeResult":"CR_SUCCESS","order":false,"remark":"ok",'
        b'"spentTimeMills":12}'
    )


def test_a_broker_name_with_a_lone_surrogate_sorts_as_java_sorts_it() -> None:
    """JSON may carry a lone surrogate (\\ud800) in a broker name: the publish queues are
    still listed (Java's String compareTo orders UTF-16 units), not an untyped
    UnicodeEncodeError."""
    from rmq_async.protocol.bodies import TopicRouteData, producer_queues

    body = (b'{"brokerDatas":[{"brokerAddrs":{"0":"1.1.1.1:10911"},"brokerName":"b\\ud800",'
            b'"cluster":"c"},{"brokerAddrs":{"0":"1.1.1.2:10911"},"brokerName":"a",'
            b'"cluster":"c"}],"queueDatas":[{"brokerName":"b\\ud800","perm":6,'
            b'"readQueueNums":1,"writeQueueNums":1},{"brokerName":"a","perm":6,'
            b'"readQueueNums":1,"writeQueueNums":1}]}')
    queues = producer_queues(TopicRouteData.from_json_bytes(body), "t")
    assert [q.broker_name for q in queues] == ["a", "b\ud800"]

"""The send-back fallback (a copy produced into ``%RETRY%<group>`` when CONSUMER_SEND_MSG_BACK
fails) retries as Java's inner producer does: three attempts within its send timeout, again only
after an answer its producer retries, never after a timeout. No broker: the client layer is a
stand-in that answers from a script."""

from __future__ import annotations

from typing import Any

import pytest

from rmq_async import PushConsumer
from rmq_async.client.errors import MQBrokerError
from rmq_async.consumer.offset_store import _MemoryTable
from rmq_async.consumer.runtime import RETRY_RESEND_ATTEMPTS, ConsumerRuntime
from rmq_async.consumer.tasks import TaskOwner
from rmq_async.protocol.codes import ResponseCode
from rmq_async.protocol.types import MessageExt, MessageQueue
from rmq_async.remoting.errors import RemotingTimeout

GROUP = "G_fallback"
RETRY_TOPIC = f"%RETRY%{GROUP}"


def busy(request: str = "SEND_MESSAGE") -> MQBrokerError:
    return MQBrokerError(ResponseCode.SYSTEM_BUSY, "[TIMEOUT_CLEAN_QUEUE]broker busy",
                         request=request)


class Api:
    """Refuses every CONSUMER_SEND_MSG_BACK; answers each send with the next scripted outcome."""

    def __init__(self, outcomes: list[BaseException | None]) -> None:
        self.outcomes = outcomes
        self.sends: list[tuple[str, MessageQueue, float]] = []
        self.kwargs: list[dict[str, Any]] = []

    async def consumer_send_msg_back(self, addr: str, msg: MessageExt, group: str,
                                     delay_level: int, max_reconsume_times: int) -> None:
        raise busy("CONSUMER_SEND_MSG_BACK")

    async def send_message(self, addr: str, mq: MessageQueue, **kw: Any) -> None:
        self.sends.append((addr, mq, kw.get("timeout", 3.0)))
        self.kwargs.append(kw)
        outcome = self.outcomes.pop(0)
        if outcome is not None:
            raise outcome


class Instance:
    def __init__(self, api: Api, brokers: list[str]) -> None:
        self.api = api
        self.brokers = brokers

    async def find_broker_master(self, broker_name: str, topic: str | None = None) -> str:
        return f"addr-of-{broker_name}"

    async def publish_queues(self, topic: str) -> list[MessageQueue]:
        assert topic == RETRY_TOPIC
        return [MessageQueue(topic, name, 0) for name in self.brokers]


def runtime(api: Api, brokers: list[str]) -> ConsumerRuntime:
    c = PushConsumer(GROUP, namesrv="127.0.0.1:9876")
    return ConsumerRuntime(
        group=c.group, client_id=c.client_id, options=c.options, subscriptions=c.subscriptions,
        process_queues=c.process_queues, paused=set(), stats=c.stats, errors=c.errors,
        instance=Instance(api, brokers), offset_store=_MemoryTable(),  # type: ignore[arg-type]
        tasks=TaskOwner("test"),
    )


def failed_message() -> MessageExt:
    return MessageExt(topic="orders", body=b"x", queue_id=3, queue_offset=7,
                      properties={"UNIQ_KEY": "K1"}, broker_name="broker-a")


async def test_a_busy_broker_is_asked_again_up_to_three_times() -> None:
    api = Api([busy(), busy(), None])
    rt = runtime(api, ["broker-a"])
    assert await rt.send_message_back(failed_message(), 0)
    assert RETRY_RESEND_ATTEMPTS == 3
    assert [(addr, mq.broker_name) for addr, mq, _ in api.sends] == [("addr-of-broker-a",
                                                                      "broker-a")] * 3
    # Each attempt gets what is left of one send timeout.
    timeouts = [t for _, _, t in api.sends]
    assert 0 < timeouts[2] <= timeouts[1] <= timeouts[0] <= 3.0


async def test_the_attempts_go_to_the_other_groups_first_then_round_again() -> None:
    api = Api([busy(), busy(), None])
    rt = runtime(api, ["broker-a", "broker-b"])
    assert await rt.send_message_back(failed_message(), 0)
    assert [mq.broker_name for _, mq, _ in api.sends] == ["broker-b", "broker-a", "broker-b"]


async def test_three_busy_answers_and_the_message_is_not_handed_back() -> None:
    api = Api([busy(), busy(), busy()])
    rt = runtime(api, ["broker-a"])
    assert not await rt.send_message_back(failed_message(), 0)
    assert len(api.sends) == 3


@pytest.mark.parametrize("error", [
    MQBrokerError(ResponseCode.MESSAGE_ILLEGAL, "the message is illegal", request="SEND_MESSAGE"),
    RemotingTimeout("no answer within 3.0 s"),  # the broker may have stored it: not sent twice
], ids=["final-answer", "timeout"])
async def test_a_final_answer_or_a_timeout_ends_the_attempts(error: BaseException) -> None:
    api = Api([error, None, None])
    rt = runtime(api, ["broker-a", "broker-b"])
    assert not await rt.send_message_back(failed_message(), 0)
    assert len(api.sends) == 1


@pytest.mark.parametrize(("delay_level", "limit", "counts"), [
    (0, -1, (3, 16)),  # a retry: reconsume times + 1, the group's limit
    (-1, -1, (17, 16)),  # a dead letter: over the limit, so the broker moves it to the DLQ
    (-1, 2**31 - 1, (2**31 - 1, 2**31 - 2)),  # within Java's int (2**31 overflowed it)
])
async def test_the_copy_carries_its_counts_in_the_header_and_its_properties(
        delay_level: int, limit: int, counts: tuple[int, int]) -> None:
    """As Java's sendMessageBackAsNormalMessage: the counts in the properties and, copied by
    its producer, in the request header, where the broker reads them; within Java's int (a
    dead letter at a limit of 2**31-1 said 2**31 retries)."""
    from rmq_async.protocol.message import decode_properties

    api = Api([None])
    rt = runtime(api, ["broker-a"])
    rt.options = rt.options.replace(max_reconsume_times=limit)
    msg = failed_message()
    msg.reconsume_times = 2
    msg.properties = {**msg.properties, "RECONSUME_TIME": "2", "MAX_RECONSUME_TIMES": "16"}
    assert await rt.send_message_back(msg, delay_level)
    kw = api.kwargs[0]
    assert (kw["reconsume_times"], kw["max_reconsume_times"]) == counts
    props = decode_properties(kw["properties"])
    assert (props["RECONSUME_TIME"], props["MAX_RECONSUME_TIMES"]) == tuple(map(str, counts))
    assert props["RETRY_TOPIC"] == "orders" and props["ORIGIN_MESSAGE_ID"] == msg.msg_id


async def test_a_dead_letter_sent_directly_keeps_within_javas_int_and_its_reason() -> None:
    """With max_reconsume_times at 2**31-1 the dead letter's direct send said 2**31 retries,
    which the broker cannot read; the send failed and the copy went through the send-back
    path, which carries no reason."""
    from rmq_async.consumer.dead_letter import send_to_dlq
    from rmq_async.protocol.message import decode_properties

    api = Api([None])
    rt = runtime(api, ["broker-a"])
    rt.options = rt.options.replace(max_reconsume_times=2**31 - 1)
    assert await send_to_dlq(rt, failed_message(), "bad body")
    kw = api.kwargs[0]
    assert (kw["reconsume_times"], kw["max_reconsume_times"]) == (2**31 - 1, 2**31 - 2)
    assert decode_properties(kw["properties"])["RMQ_DLQ_REASON"] == "bad body"

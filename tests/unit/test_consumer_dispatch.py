"""Dispatch of pulled messages to listeners, without a broker."""

from __future__ import annotations

from typing import Any

from rmq_async import ConsumeResult, MessageExt, PushConsumer
from rmq_async.consumer.process_queue import ProcessQueue
from rmq_async.protocol.types import PROPERTY_RETRY_TOPIC, MessageQueue


class _Recorder:
    def __init__(self) -> None:
        self.calls: list[tuple[list[str], MessageQueue]] = []

    def submit(self, msgs: list[MessageExt], pq: Any, mq: MessageQueue) -> None:
        self.calls.append(([m.properties.get(PROPERTY_RETRY_TOPIC, m.topic) for m in msgs], mq))


def test_a_retry_pull_mixing_topics_is_split_by_origin() -> None:
    consumer = PushConsumer("G_dispatch", namesrv="127.0.0.1:9876")
    for topic in ("A", "B"):
        consumer.subscribe(topic, listener=lambda msgs: ConsumeResult.SUCCESS)
    recorder = _Recorder()
    consumer.consume_service = recorder  # type: ignore[assignment]
    retry = MessageQueue(consumer.retry_topic, "broker-a", 0)
    msgs = [MessageExt(consumer.retry_topic, b"", queue_offset=i,
                       properties={PROPERTY_RETRY_TOPIC: "AB"[i % 2]}) for i in range(6)]
    consumer.dispatch(msgs, ProcessQueue(), retry, True)
    assert sorted(tuple(origins) for origins, _ in recorder.calls) == [("A",) * 3, ("B",) * 3]
    assert all(mq == retry for _, mq in recorder.calls)

    plain = MessageQueue("A", "broker-a", 1)
    consumer.dispatch([MessageExt("A", b"x")], ProcessQueue(), plain, True)
    assert recorder.calls[-1] == (["A"], plain)

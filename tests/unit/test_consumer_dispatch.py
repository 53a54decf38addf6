"""Routing of pulled chunks to the consumption services, without a broker."""

from __future__ import annotations

from typing import Any

from rmq_async import ConsumeResult, MessageExt, PushConsumer
from rmq_async.consumer.process_queue import ProcessQueue
from rmq_async.consumer.service import ServiceRouter
from rmq_async.protocol.types import PROPERTY_RETRY_TOPIC, MessageQueue


class _Recorder:
    def __init__(self, in_order: bool = False) -> None:
        self.in_order = in_order
        self.calls: list[tuple[list[str], MessageQueue, bool]] = []

    def submit(self, msgs: list[MessageExt], pq: Any, mq: MessageQueue, first: bool) -> None:
        self.calls.append(([m.properties.get(PROPERTY_RETRY_TOPIC, m.topic) for m in msgs], mq,
                           first))


class _Sink:
    def want_more(self) -> bool:
        return True


def _router(consumer: PushConsumer) -> tuple[ServiceRouter, _Recorder, _Recorder, _Recorder]:
    concurrent, orderly, sink = _Recorder(), _Recorder(in_order=True), _Recorder()
    router = ServiceRouter(consumer.subscriptions, concurrent=concurrent,  # type: ignore[arg-type]
                           orderly=orderly, sink=sink)  # type: ignore[arg-type]
    return router, concurrent, orderly, sink


def test_a_retry_pull_mixing_topics_is_split_by_origin() -> None:
    consumer = PushConsumer("G_dispatch", namesrv="127.0.0.1:9876")
    for topic in ("A", "B"):
        consumer.subscribe(topic, listener=lambda msgs: ConsumeResult.SUCCESS)
    router, recorder, orderly, sink = _router(consumer)
    retry = MessageQueue(consumer.retry_topic, "broker-a", 0)
    msgs = [MessageExt(consumer.retry_topic, b"", queue_offset=i,
                       properties={PROPERTY_RETRY_TOPIC: "AB"[i % 2]}) for i in range(6)]
    router.submit(msgs, ProcessQueue(), retry, True)
    assert sorted(tuple(origins) for origins, _, _ in recorder.calls) == [("A",) * 3, ("B",) * 3]
    assert all(mq == retry for _, mq, _ in recorder.calls)

    plain = MessageQueue("A", "broker-a", 1)
    router.submit([MessageExt("A", b"x")], ProcessQueue(), plain, True)
    assert recorder.calls[-1] == (["A"], plain, True)
    assert not orderly.calls and not sink.calls


def test_each_chunk_goes_to_the_service_of_its_topic() -> None:
    consumer = PushConsumer("G_dispatch", namesrv="127.0.0.1:9876")
    consumer.subscribe("L", listener=lambda msgs: ConsumeResult.SUCCESS)
    consumer.subscribe("O", listener=lambda msgs: ConsumeResult.SUCCESS, orderly=True)
    consumer.subscribe("S", sink=_Sink())  # type: ignore[arg-type]
    router, concurrent, orderly, sink = _router(consumer)
    for topic, service in (("L", concurrent), ("O", orderly), ("S", sink)):
        assert router.service_for(topic) is service
        mq = MessageQueue(topic, "broker-a", 0)
        router.submit([MessageExt(topic, b"x")], ProcessQueue(), mq, False)
        assert service.calls[-1] == ([topic], mq, False)
    assert (len(concurrent.calls), len(orderly.calls), len(sink.calls)) == (1, 1, 1)
    # A retry pull of a consumer that is not all orderly: split by origin, a sink's part to it.
    assert router.service_for(consumer.retry_topic) is concurrent
    retry = MessageQueue(consumer.retry_topic, "broker-a", 0)
    msgs = [MessageExt(consumer.retry_topic, b"", queue_offset=i,
                       properties={PROPERTY_RETRY_TOPIC: "LS"[i % 2]}) for i in range(4)]
    router.submit(msgs, ProcessQueue(), retry, False)
    assert concurrent.calls[-1] == (["L", "L"], retry, False)
    assert sink.calls[-1] == (["S", "S"], retry, False)


def test_a_retry_pull_keeps_the_parts_bound_for_one_sink_together() -> None:
    # Two topics land in one sink: their retried messages interleave in the retry queue. Offered
    # apart, the two parts could fall into two batches whose ranges of that queue interleave
    # (10-14 and 11-15), and a replaceWhere write of one range would delete the other's rows.
    consumer = PushConsumer("G_dispatch", namesrv="127.0.0.1:9876")
    shared, other = _Sink(), _Sink()
    consumer.subscribe("A", sink=shared)  # type: ignore[arg-type]
    consumer.subscribe("B", sink=shared)  # type: ignore[arg-type]
    consumer.subscribe("C", sink=other)  # type: ignore[arg-type]
    consumer.subscribe("L", listener=lambda msgs: ConsumeResult.SUCCESS)
    router, concurrent, _, sink = _router(consumer)
    retry = MessageQueue(consumer.retry_topic, "broker-a", 0)
    origins = "ABLACBLB"
    msgs = [MessageExt(consumer.retry_topic, b"", queue_offset=10 + i,
                       properties={PROPERTY_RETRY_TOPIC: o}) for i, o in enumerate(origins)]
    router.submit(msgs, ProcessQueue(), retry, False)
    assert sorted(sink.calls) == [(["A", "B", "A", "B", "B"], retry, False),
                                  (["C"], retry, False)]
    assert concurrent.calls == [(["L", "L"], retry, False)]

"""A corrupt record in a real pull answer: the records before it are delivered, it is reported
with its queue and offset, and the queue moves on (the records after it are delivered too).

The broker cannot be made to store a corrupt record, so the broker proxy spoils the magic code
of the third record of one PULL_MESSAGE answer on its way to the consumer.
"""

from __future__ import annotations

import pytest

from rmq_async import Message
from rmq_async.consumer.events import ConsumerError, ConsumerErrorKind
from rmq_async.devbroker import LocalRocketMQ
from tests.chaos.common import Tally, body_of, consumer, offsets_settled, report, wait_for
from tests.chaos.proxy import FaultProxy
from tests.helpers import AdminClient, produce, unique, wait_until_async

pytestmark = [pytest.mark.broker, pytest.mark.chaos]


async def test_corrupt_third_record_is_reported_skipped_and_the_queue_moves_on(
        rocketmq: LocalRocketMQ) -> None:
    topic = unique("T_chaos_corrupt")
    await rocketmq.create_topic(topic, queues=1)
    group = unique("G_chaos_corrupt")
    n = 500
    keys = [body_of("corrupt", i).decode() for i in range(n)]
    await produce(rocketmq.namesrv_addr, topic, [Message(topic, k.encode()) for k in keys])
    key_at: dict[int, str] = {}
    async with AdminClient(rocketmq.namesrv_addr) as admin:

        async def all_indexed() -> bool:  # the broker indexes a message just after SEND_OK
            key_at.update((m.queue_offset, m.body.decode()) for m in await admin.read_all(topic))
            return len(key_at) == n

        await wait_until_async(all_indexed, 30, what=f"{n} messages indexed")

    broker = await FaultProxy(rocketmq.broker_addr, name="broker", frames=True).start()
    namesrv = await FaultProxy(rocketmq.namesrv_addr, name="namesrv",
                               rewrite={rocketmq.broker_addr: broker.addr}).start()
    try:
        broker.corrupt_next_pull(2)  # the third record of the first answer holding three
        tally = Tally()
        errors: list[ConsumerError] = []
        c = consumer(namesrv.addr, group)
        c.subscribe(topic, listener=tally.listener("c1"))
        c.on_error(errors.append)
        async with c:
            await wait_for(lambda: tally.count >= n - 1 and bool(errors), 60,
                           "every message but the corrupt one, and its report")
            stats = c.stats_snapshot()[topic]
        committed, maxes = await offsets_settled(rocketmq.namesrv_addr, group, topic)
    finally:
        await namesrv.close()
        await broker.close()

    [bad_offset] = broker.stats.corrupted
    missing = [k for k in keys if k not in tally.seen]
    report("corrupt-record", sent=n, lost=len(missing) - 1, duplicates=sum(
        v - 1 for v in tally.seen.values()), recovery=None,
           extra=f"corrupt_offset={bad_offset} reported={[e.offset for e in errors]}")
    # Reported once, with its queue and offset; counted in the stats.
    assert [(e.kind, e.queue.queue_id if e.queue else None, e.offset) for e in errors] == [
        (ConsumerErrorKind.CORRUPT_RECORD, 0, bad_offset)]
    assert stats["errors"] == {"corrupt_record": 1}
    # Exactly the corrupt record was skipped: the two before it in its answer and everything
    # after it were delivered, once each.
    assert missing == [key_at[bad_offset]]
    assert all(v == 1 for v in tally.seen.values())
    # The queue moved past it.
    assert committed == maxes and sum(maxes.values()) == n

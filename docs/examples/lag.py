"""Operations: a group's lag per queue, from the brokers (what ``rmq-async lag`` prints)."""

import asyncio

from rmq_async import ConsumeResult, Message, MessageExt, Producer, PushConsumer
from rmq_async.cli.lag import format_lag, group_lag


async def main(namesrv: str, topic: str) -> int:
    consumed = asyncio.Event()
    consumer = PushConsumer("lag-demo", namesrv=namesrv,
                            consume_from_where="CONSUME_FROM_FIRST_OFFSET")

    @consumer.subscribe(topic)
    async def handle(msgs: list[MessageExt]) -> ConsumeResult:
        consumed.set()
        return ConsumeResult.SUCCESS

    async with Producer("lag-demo-producer", namesrv=namesrv) as producer:
        await producer.send(Message(topic, b"first"))
        async with consumer:
            await asyncio.wait_for(consumed.wait(), timeout=30)
        # The consumer has stopped (and persisted its offsets); three more arrive.
        for _ in range(3):
            await producer.send(Message(topic, b"later"))

    # A broker indexes a stored message a moment after the send returns: ask until
    # its queues hold all four.
    rows = await group_lag(namesrv, "lag-demo", topic)
    for _ in range(100):
        if sum(r.broker_offset for r in rows) >= 4:
            break
        await asyncio.sleep(0.1)
        rows = await group_lag(namesrv, "lag-demo", topic)
    print(format_lag(rows))
    return sum(r.diff for r in rows)  # 3


if __name__ == "__main__":
    print(asyncio.run(main("127.0.0.1:9876", "lag_demo")))

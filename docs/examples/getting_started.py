"""Getting started: send ten messages, consume them, stop cleanly."""

import asyncio

from rmq_async import ConsumeResult, Message, MessageExt, Producer, PushConsumer


async def main(namesrv: str, topic: str) -> list[str]:
    received: list[str] = []
    all_in = asyncio.Event()

    consumer = PushConsumer("getting-started", namesrv=namesrv,
                            consume_from_where="CONSUME_FROM_FIRST_OFFSET")

    @consumer.subscribe(topic, tags="*")
    async def handle(msgs: list[MessageExt]) -> ConsumeResult:
        for m in msgs:
            received.append(m.body.decode())
        if len(received) >= 10:
            all_in.set()
        return ConsumeResult.SUCCESS

    async with Producer("getting-started-producer", namesrv=namesrv) as producer:
        for i in range(10):
            await producer.send(Message(topic, f"hello {i}".encode(), tags="greeting"))

    async with consumer:  # start(); leaving the block calls stop()
        await asyncio.wait_for(all_in.wait(), timeout=30)
    return sorted(received)


if __name__ == "__main__":
    print(asyncio.run(main("127.0.0.1:9876", "getting_started")))

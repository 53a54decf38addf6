"""Getting started: send ten messages, consume them, stop cleanly."""

import asyncio

from rmq_async import Message, MessageExt, Producer, PushConsumer


async def main(namesrv: str, topic: str) -> list[str]:
    received: list[str] = []
    all_in = asyncio.Event()

    consumer = PushConsumer("getting-started", namesrv=namesrv,
                            consume_from_where="CONSUME_FROM_FIRST_OFFSET")

    @consumer.subscribe(topic, tags="*")
    async def handle(msg: MessageExt) -> None:  # returning acknowledges; raising retries
        received.append(msg.body.decode())
        if len(received) >= 10:
            all_in.set()

    async with Producer("getting-started-producer", namesrv=namesrv) as producer:
        for i in range(10):
            await producer.send(Message(topic, f"hello {i}".encode(), tags="greeting"))

    async with consumer:  # start(); leaving the block calls stop()
        await asyncio.wait_for(all_in.wait(), timeout=30)
    return sorted(received)


if __name__ == "__main__":
    print(asyncio.run(main("127.0.0.1:9876", "getting_started")))

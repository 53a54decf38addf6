"""Orderly consumption: messages with one key go to one queue and are consumed in order."""

import asyncio

from rmq_async import ConsumeResult, Message, MessageExt, Producer, PushConsumer
from rmq_async.producer import select_by_key


async def main(namesrv: str, topic: str) -> dict[str, list[int]]:
    seen: dict[str, list[int]] = {}
    done = asyncio.Event()
    consumer = PushConsumer("orderly-demo", namesrv=namesrv,
                            consume_from_where="CONSUME_FROM_FIRST_OFFSET")

    @consumer.subscribe(topic, orderly=True)
    async def handle(msgs: list[MessageExt]) -> ConsumeResult:
        for m in msgs:
            key, step = m.body.decode().split(":")
            seen.setdefault(key, []).append(int(step))
        if sum(len(v) for v in seen.values()) >= 30:
            done.set()
        return ConsumeResult.SUCCESS

    async with Producer("orderly-demo-producer", namesrv=namesrv) as producer:
        for step in range(10):
            for key in ("order-1", "order-2", "order-3"):
                await producer.send(Message(topic, f"{key}:{step}".encode(), keys=[key]),
                                    selector=select_by_key)
    async with consumer:
        await asyncio.wait_for(done.wait(), timeout=30)
    return seen  # each key's steps arrive as 0, 1, ..., 9


if __name__ == "__main__":
    print(asyncio.run(main("127.0.0.1:9876", "orderly_demo")))

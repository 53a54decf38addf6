"""A failed message comes back: RECONSUME_LATER (or raising) retries it after a delay."""

import asyncio

from rmq_async import ConsumeContext, ConsumeResult, Message, MessageExt, Producer, PushConsumer


async def main(namesrv: str, topic: str) -> list[int]:
    attempts: list[int] = []  # reconsume_times of each delivery
    done = asyncio.Event()
    consumer = PushConsumer("retry-demo", namesrv=namesrv,
                            consume_from_where="CONSUME_FROM_FIRST_OFFSET")

    @consumer.subscribe(topic)
    async def handle(msgs: list[MessageExt], ctx: ConsumeContext) -> ConsumeResult:
        attempts.extend(m.reconsume_times for m in msgs)
        if msgs[0].reconsume_times == 0:
            ctx.delay_level_when_next_consume = 1  # come back after 1 s (level 1)
            return ConsumeResult.RECONSUME_LATER
        done.set()
        return ConsumeResult.SUCCESS

    async with Producer("retry-demo-producer", namesrv=namesrv) as producer:
        await producer.send(Message(topic, b"flaky"))
    async with consumer:
        await asyncio.wait_for(done.wait(), timeout=30)
    return attempts


if __name__ == "__main__":
    print(asyncio.run(main("127.0.0.1:9876", "retry_demo")))

"""Typed payloads: JSON bodies decoded into a dataclass; an undecodable body is dead-lettered."""

import asyncio
import json
from dataclasses import dataclass

from rmq_async import Message, Producer, PushConsumer


@dataclass
class Order:
    id: int
    amount: float


async def main(namesrv: str, topic: str) -> list[Order]:
    orders: list[Order] = []
    done = asyncio.Event()
    consumer = PushConsumer("payloads-demo", namesrv=namesrv,
                            consume_from_where="CONSUME_FROM_FIRST_OFFSET")

    @consumer.subscribe(topic, model=Order)
    async def on_order(order: Order) -> None:
        orders.append(order)
        if len(orders) >= 3:
            done.set()

    async with Producer("payloads-demo-producer", namesrv=namesrv) as producer:
        await producer.send(Message(topic, b"{not json"))  # poison: straight to %DLQ%payloads-demo
        for i in range(3):
            await producer.send(Message(topic, json.dumps({"id": i, "amount": 9.5 * i}).encode()))
    async with consumer:
        await asyncio.wait_for(done.wait(), timeout=30)
    return sorted(orders, key=lambda o: o.id)


if __name__ == "__main__":
    print(asyncio.run(main("127.0.0.1:9876", "payloads_demo")))

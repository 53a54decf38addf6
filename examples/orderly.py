"""Orderly consumption: every order's events are handled in the order they were sent.

The producer sends the events of each order (created -> paid -> shipped -> delivered) to one
queue, chosen by a hash of the order id; the orderly listener then sees each queue's messages
one batch at a time, in queue order, while this client holds the broker's lock on that queue.
A listener that cannot handle a batch yet returns SUSPEND_CURRENT_QUEUE_A_MOMENT: the same batch
comes back after ``suspend_current_queue_time`` seconds and nothing behind it overtakes it.

Run it against the local dev broker:

    python -m rmq_async.devbroker up          # prints NAMESRV_ADDR=127.0.0.1:<port>
    python examples/orderly.py --namesrv 127.0.0.1:<port>

or, with no --namesrv, it starts a throw-away local broker itself.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import signal
import uuid

from rmq_async import ConsumeResult, Message, MessageExt, Producer, PushConsumer
from rmq_async.producer import select_by_key

STEPS = ["created", "paid", "shipped", "delivered"]


async def ensure_topic(namesrv: str, topic: str, queues: int) -> None:
    """Create ``topic`` on every master broker of the cluster unless it already has a route."""
    from rmq_async.client.instance import ClientInstance

    admin = ClientInstance(namesrv, "127.0.0.1@example-admin")
    try:
        await admin.ensure_topic(topic, queues)
    finally:
        await admin.close()


async def run(namesrv: str, topic: str, group: str, orders: int, seconds: float) -> bool:
    run_id = uuid.uuid4().hex[:6]  # events of earlier runs on the same topic are skipped
    progress: dict[str, list[str]] = collections.defaultdict(list)
    hiccup_done = False
    done = asyncio.Event()
    consumer = PushConsumer(group, namesrv=namesrv, consume_from_where="CONSUME_FROM_FIRST_OFFSET",
                            consume_message_batch_max_size=4,
                            suspend_current_queue_time=0.5)

    @consumer.subscribe(topic, tags="order", orderly=True, batch=True)
    async def on_events(msgs: list[MessageExt]) -> ConsumeResult:
        nonlocal hiccup_done
        if not hiccup_done and any(m.body.endswith(b":shipped") for m in msgs):
            # Pretend the shipping service is briefly unavailable: try this batch again soon.
            hiccup_done = True
            print(f"queue {msgs[0].queue_id}: shipping service busy, suspending the queue")
            return ConsumeResult.SUSPEND_CURRENT_QUEUE_A_MOMENT
        for m in msgs:
            order_id, _, step = m.body.decode().partition(":")
            if not order_id.startswith(run_id):
                continue
            expected = STEPS[len(progress[order_id])]
            if step != expected:
                raise AssertionError(f"{order_id}: got {step} before {expected}")
            progress[order_id].append(step)
            if step == STEPS[-1]:
                print(f"queue {m.queue_id}@{m.queue_offset}: {order_id} "
                      f"{' -> '.join(progress[order_id])}")
        if len(progress) == orders and all(len(p) == len(STEPS) for p in progress.values()):
            done.set()
        return ConsumeResult.SUCCESS

    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(NotImplementedError):
            loop.add_signal_handler(sig, done.set)

    async with Producer(f"{group}-producer", namesrv=namesrv) as producer:
        for step in STEPS:  # interleaved: step 1 of every order, then step 2, ...
            for n in range(orders):
                order_id = f"{run_id}-order-{n:04d}"
                await producer.send(Message(topic, f"{order_id}:{step}".encode(),
                                            tags="order", keys=[order_id]),
                                    selector=select_by_key)
    async with consumer:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(done.wait(), seconds)
    complete = sum(len(p) == len(STEPS) for p in progress.values())
    print(f"{complete} of {orders} orders went through all steps in order")
    return complete == orders


async def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawTextHelpFormatter)
    parser.add_argument("--namesrv", help="name server address; default: start a local broker")
    parser.add_argument("--topic", default="orderly_demo")
    parser.add_argument("--group", default="orderly_demo_group")
    parser.add_argument("--orders", type=int, default=20)
    parser.add_argument("--seconds", type=float, default=60.0, help="give up after this long")
    args = parser.parse_args()
    if args.namesrv:
        await ensure_topic(args.namesrv, args.topic, queues=4)
        ok = await run(args.namesrv, args.topic, args.group, args.orders, args.seconds)
        return 0 if ok else 1
    from rmq_async.devbroker import LocalRocketMQ

    async with LocalRocketMQ() as rmq:
        await rmq.create_topic(args.topic, queues=4, order=True)
        ok = await run(rmq.namesrv_addr, args.topic, args.group, args.orders, args.seconds)
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(asyncio.run(main()))

"""A decorator-registered async listener inside an async app, with a clean shutdown on Ctrl-C.

Run it against the local dev broker:

    python -m rmq_async.devbroker up          # prints NAMESRV_ADDR=127.0.0.1:<port>
    python examples/listener.py --namesrv 127.0.0.1:<port> --topic demo --produce 100

or, with no --namesrv, it starts a throw-away local broker itself.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import signal

from rmq_async import ConsumeResult, Message, MessageExt, Producer, PushConsumer


async def run(namesrv: str, topic: str, group: str, produce: int, seconds: float | None) -> int:
    consumer = PushConsumer(group, namesrv=namesrv, consume_from_where="CONSUME_FROM_FIRST_OFFSET")
    received = 0

    @consumer.subscribe(topic, tags="*", batch=True)
    async def on_messages(msgs: list[MessageExt]) -> ConsumeResult:
        nonlocal received
        for m in msgs:
            received += 1
            print(f"{m.topic}[{m.queue_id}]@{m.queue_offset} tags={m.tags} "
                  f"keys={m.keys} body={m.body[:60]!r}")
        return ConsumeResult.SUCCESS

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(NotImplementedError):
            loop.add_signal_handler(sig, stop.set)

    async with consumer:
        if produce:
            async with Producer(f"{group}-producer", namesrv=namesrv) as producer:
                for i in range(produce):
                    await producer.send(Message(topic, f"hello {i}".encode(), tags="greeting",
                                                keys=[f"k{i}"]))
        if seconds is not None:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), seconds)
        else:
            await stop.wait()          # Ctrl-C ends the wait; `async with` stops the consumer
    print(f"stopped cleanly after {received} messages")
    return received


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    parser.add_argument("--namesrv", help="name server address; default: start a local broker")
    parser.add_argument("--topic", default="listener_demo")
    parser.add_argument("--group", default="listener_demo_group")
    parser.add_argument("--produce", type=int, default=20, help="send this many messages first")
    parser.add_argument("--seconds", type=float, default=None, help="stop after this long")
    args = parser.parse_args()
    if args.namesrv:
        await run(args.namesrv, args.topic, args.group, args.produce, args.seconds)
        return
    from rmq_async.devbroker import LocalRocketMQ

    async with LocalRocketMQ() as rmq:
        await rmq.create_topic(args.topic, queues=4)
        await run(rmq.namesrv_addr, args.topic, args.group, args.produce, args.seconds)


if __name__ == "__main__":
    asyncio.run(main())

"""A decorator-registered async listener, runnable two ways.

With the ``rmq-async`` command (module-level ``consumer``, configured from the environment:
``NAMESRV_ADDR``, ``RMQ_TOPIC``, ``RMQ_GROUP``)::

    rmq-async broker up                          # prints NAMESRV_ADDR=127.0.0.1:<port>
    NAMESRV_ADDR=127.0.0.1:<port> rmq-async run examples.listener:consumer --workers 2

SIGTERM or Ctrl-C drains the consumers and exits 0.

As a script inside its own async app, with a clean shutdown on Ctrl-C::

    python examples/listener.py --namesrv 127.0.0.1:<port> --topic demo --produce 100

or, with no --namesrv, it starts a throw-away local broker itself.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import signal
import sys
from collections.abc import Callable

from rmq_async import ConsumeResult, Message, MessageExt, Producer, PushConsumer


def build_consumer(namesrv: str, topic: str, group: str,
                   on_message: Callable[[MessageExt], None] | None = None) -> PushConsumer:
    """A consumer of ``topic`` that prints each message (and reports it to ``on_message``)."""
    consumer = PushConsumer(group, namesrv=namesrv, consume_from_where="CONSUME_FROM_FIRST_OFFSET")
    # Slows every message down, to watch in-flight work drain on SIGTERM.
    delay = float(os.environ.get("RMQ_LISTENER_DELAY", "0"))

    @consumer.subscribe(topic, tags="*", batch=True)
    async def on_messages(msgs: list[MessageExt]) -> ConsumeResult:
        for m in msgs:
            if delay:
                await asyncio.sleep(delay)
            # One write per line: workers of `rmq-async run --workers N` share stdout, and
            # print() writes the text and the newline separately when unbuffered.
            sys.stdout.write(f"{m.topic}[{m.queue_id}]@{m.queue_offset} tags={m.tags} "
                             f"keys={m.keys} body={m.body[:60]!r} pid={os.getpid()}\n")
            sys.stdout.flush()
            if on_message is not None:
                on_message(m)
        return ConsumeResult.SUCCESS

    return consumer


consumer = build_consumer(os.environ.get("NAMESRV_ADDR", "127.0.0.1:9876"),
                          os.environ.get("RMQ_TOPIC", "listener_demo"),
                          os.environ.get("RMQ_GROUP", "listener_demo_group"))
"""What ``rmq-async run examples.listener:consumer`` runs."""


async def run(namesrv: str, topic: str, group: str, produce: int, seconds: float | None) -> int:
    received = 0

    def count(_: MessageExt) -> None:
        nonlocal received
        received += 1

    app_consumer = build_consumer(namesrv, topic, group, count)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(NotImplementedError):
            loop.add_signal_handler(sig, stop.set)

    async with app_consumer:
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

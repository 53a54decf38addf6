"""A consumer process the chaos tests can ``kill -9``.

``python -m tests.chaos.consumer_proc <namesrv> <topic> <group> <instance>`` prints ``READY``,
then ``M <key> <queue id>`` for every message its listener got (flushed per listener call,
before the call returns), and stops cleanly (offsets committed) when its stdin closes.
"""

from __future__ import annotations

import asyncio
import logging
import sys

import structlog

from rmq_async import ConsumeResult, MessageExt
from tests.chaos.common import consumer, key_of


async def main(namesrv: str, topic: str, group: str, instance: str) -> None:
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING),
                        logger_factory=structlog.PrintLoggerFactory(sys.stderr))
    c = consumer(namesrv, group, instance_name=instance, consume_message_batch_max_size=16,
                 consume_concurrency=4)

    @c.subscribe(topic)
    async def on(msgs: list[MessageExt]) -> ConsumeResult:
        sys.stdout.write("".join(f"M {key_of(m)} {m.queue_id}\n" for m in msgs))
        sys.stdout.flush()
        await asyncio.sleep(0.005)  # a batch takes a while: kill -9 lands mid-batch
        return ConsumeResult.SUCCESS

    loop = asyncio.get_running_loop()
    async with c:
        print("READY", flush=True)
        await loop.run_in_executor(None, sys.stdin.read)  # until stdin closes
    print("STOPPED", flush=True)


if __name__ == "__main__":
    asyncio.run(main(*sys.argv[1:5]))

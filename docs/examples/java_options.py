"""Java setting names work, in their Java units; the options read back in seconds."""

import asyncio
from datetime import datetime, timedelta

from rmq_async import PushConsumer


async def main(namesrv: str, topic: str) -> dict[str, object]:
    consumer = PushConsumer(
        "java-names-demo", namesrv=namesrv,
        consumeThreadMin=8,                    # -> consume_concurrency=8
        pullBatchSize=16,                      # -> pull_batch_size=16
        consumeTimeout=15,                     # minutes -> consume_timeout=900.0 s
        suspendCurrentQueueTimeMillis=500,     # ms -> suspend_current_queue_time=0.5 s
        persistConsumerOffsetInterval=5000,    # ms -> persist_offset_interval=5.0 s
        consumeTimestamp="20240101120000",     # -> consume_timestamp=datetime(2024, 1, 1, 12)
    )
    same = PushConsumer(
        "java-names-demo", namesrv=namesrv,
        consume_concurrency=8, pull_batch_size=16, consume_timeout=timedelta(minutes=15),
        suspend_current_queue_time=0.5, persist_offset_interval=5.0,
        consume_timestamp=datetime(2024, 1, 1, 12),
    )
    o = consumer.options
    for name in ("consume_concurrency", "pull_batch_size", "consume_timeout",
                 "suspend_current_queue_time", "persist_offset_interval", "consume_timestamp"):
        assert getattr(o, name) == getattr(same.options, name), name
    return {"consume_timeout": o.consume_timeout,
            "suspend_current_queue_time": o.suspend_current_queue_time,
            "consume_concurrency": o.consume_concurrency}


if __name__ == "__main__":
    print(asyncio.run(main("127.0.0.1:9876", "unused")))

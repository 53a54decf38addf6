"""Helpers of the Spark source tests."""

from __future__ import annotations

from rmq_async.protocol.types import MessageQueue
from tests.helpers import AdminClient, wait_until_async


async def stored_offsets(namesrv: str, topic: str, expected: int,
                         timeout: float = 60.0) -> dict[MessageQueue, int]:
    """The max offset of each queue once the topic's queues hold ``expected`` messages.

    A send is answered once the message is in the commit log; the consume queues, which max
    offsets and pulls read, follow a moment later.
    """
    async with AdminClient(namesrv) as admin:
        maxes: dict[MessageQueue, int] = {}

        async def complete() -> bool:
            maxes.update(await admin.max_offsets(topic))
            return sum(maxes.values()) >= expected

        await wait_until_async(complete, timeout, what=f"{expected} messages in {topic}'s queues")
        return maxes

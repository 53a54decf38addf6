"""Broadcasting: every member of the group receives every message."""

import asyncio
import tempfile

from rmq_async import ConsumeResult, Message, MessageExt, MessageModel, Producer, PushConsumer


async def main(namesrv: str, topic: str) -> list[int]:
    counts = [0, 0]
    done = [asyncio.Event(), asyncio.Event()]
    with tempfile.TemporaryDirectory() as offsets:  # broadcasting offsets are kept locally
        members = [
            PushConsumer("broadcast-demo", namesrv=namesrv, message_model=MessageModel.BROADCASTING,
                         consume_from_where="CONSUME_FROM_FIRST_OFFSET", offset_store_dir=offsets,
                         instance_name=f"member-{i}")
            for i in range(2)
        ]

        def handler_of(i: int):  # one listener per member, counting what that member receives
            async def handle(msgs: list[MessageExt]) -> ConsumeResult:
                counts[i] += len(msgs)
                if counts[i] >= 5:
                    done[i].set()
                return ConsumeResult.SUCCESS

            return handle

        for i, member in enumerate(members):
            member.subscribe(topic, listener=handler_of(i))

        async with members[0], members[1]:
            async with Producer("broadcast-demo-producer", namesrv=namesrv) as producer:
                for n in range(5):
                    await producer.send(Message(topic, f"news {n}".encode()))
            await asyncio.wait_for(asyncio.gather(done[0].wait(), done[1].wait()), timeout=30)
    return counts  # [5, 5]: both members saw all five


if __name__ == "__main__":
    print(asyncio.run(main("127.0.0.1:9876", "broadcast_demo")))

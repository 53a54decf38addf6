"""Broadcasting: every member of the group receives every message.

Typical use: each instance of a service keeps a local copy of some settings and must apply
every change. With ``message_model="BROADCASTING"`` each consumer reads every queue itself and
keeps its offsets in a local file (``<offset_store_dir>/<client id>/<group>/offsets.json``, written
atomically), so a restarted instance continues where it stopped. A concurrent listener's failed
message is logged with its id and not retried, as in the Java client; an orderly listener, as
here, retries the batch in place after ``suspend_current_queue_time``. The listener is orderly
too, and all changes of one setting go to one queue, so every node applies them in the
order they were made.

This demo runs two "cache nodes" in one process (two consumers with their own instance names),
sends a few setting changes, shows that both nodes applied all of them, then restarts one node
and shows that it resumes from its own offsets file.

    python -m rmq_async.devbroker up          # prints NAMESRV_ADDR=127.0.0.1:<port>
    python examples/broadcast.py --namesrv 127.0.0.1:<port>

or, with no --namesrv, it starts a throw-away local broker itself.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import tempfile
import uuid
from pathlib import Path

from rmq_async import ConsumeResult, Message, MessageExt, Producer, PushConsumer
from rmq_async.producer import select_by_key


class CacheNode:
    """One service instance: a broadcasting consumer feeding a local dict."""

    def __init__(self, name: str, namesrv: str, topic: str, group: str, offsets: Path,
                 run_id: str) -> None:
        self.name = name
        self.run_id = run_id
        self.settings: dict[str, str] = {}
        self.applied = 0
        self.changed = asyncio.Event()
        self.consumer = PushConsumer(group, namesrv=namesrv, message_model="BROADCASTING",
                                     instance_name=name, offset_store_dir=offsets,
                                     consume_from_where="CONSUME_FROM_FIRST_OFFSET")
        # Orderly: a queue's changes are applied one after the other, in the order sent.
        self.consumer.subscribe(topic, tags="setting", listener=self.on_change, orderly=True,
                                batch=True)

    async def on_change(self, msgs: list[MessageExt]) -> ConsumeResult:
        for m in msgs:
            run_id, _, change = m.body.decode().partition(" ")
            if run_id != self.run_id:  # a change sent by an earlier run of this demo
                continue
            key, _, value = change.partition("=")
            self.settings[key] = value
            self.applied += 1
            print(f"[{self.name}] {key} = {value}  (queue {m.queue_id}@{m.queue_offset})")
        self.changed.set()
        return ConsumeResult.SUCCESS

    async def wait_for(self, count: int, seconds: float) -> None:
        async with asyncio.timeout(seconds):
            while self.applied < count:
                self.changed.clear()
                await self.changed.wait()


async def ensure_topic(namesrv: str, topic: str, queues: int) -> None:
    """Create ``topic`` on every master broker of the cluster unless it already has a route."""
    from rmq_async.client.instance import ClientInstance

    admin = ClientInstance(namesrv, "127.0.0.1@example-admin")
    try:
        await admin.ensure_topic(topic, queues)
    finally:
        await admin.close()


async def send(namesrv: str, topic: str, run_id: str, changes: list[tuple[str, str]]) -> None:
    async with Producer("broadcast-demo-producer", namesrv=namesrv) as producer:
        for key, value in changes:
            # All changes of one setting go to one queue, so every node applies them in order.
            await producer.send(Message(topic, f"{run_id} {key}={value}".encode(),
                                        tags="setting", keys=[key]), selector=select_by_key)


async def run(namesrv: str, topic: str, group: str, offsets: Path, seconds: float) -> bool:
    run_id = uuid.uuid4().hex[:6]
    first = [("color", "blue"), ("limit", "10"), ("mode", "fast"), ("limit", "20")]
    await send(namesrv, topic, run_id, first)
    nodes = [CacheNode(f"node-{i}", namesrv, topic, group, offsets, run_id) for i in (1, 2)]
    for node in nodes:
        await node.consumer.start()
    try:
        for node in nodes:
            await node.wait_for(len(first), seconds)
    finally:
        for node in nodes:
            await node.consumer.stop()
    same = nodes[0].settings == nodes[1].settings
    print(f"both nodes applied all {len(first)} changes: {same} -> {nodes[0].settings}")

    # node-1 restarts: its offsets file says what it has already applied.
    later = [("mode", "safe")]
    await send(namesrv, topic, run_id, later)
    restarted = CacheNode("node-1", namesrv, topic, group, offsets, run_id)
    async with restarted.consumer:
        await restarted.wait_for(len(later), seconds)
        with contextlib.suppress(TimeoutError):  # anything more would be a replay
            await restarted.wait_for(len(later) + 1, 1.0)
    print(f"restarted node-1 applied {restarted.applied} change(s) (only the new one): "
          f"{restarted.settings}")
    return same and restarted.applied == len(later)


async def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawTextHelpFormatter)
    parser.add_argument("--namesrv", help="name server address; default: start a local broker")
    parser.add_argument("--topic", default="broadcast_demo")
    parser.add_argument("--group", default="broadcast_demo_group")
    parser.add_argument("--offset-dir", type=Path, default=None,
                        help="where the nodes keep their offsets (default: a temporary folder)")
    parser.add_argument("--seconds", type=float, default=30.0, help="give up after this long")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="broadcast-demo-") as tmp:
        offsets = args.offset_dir or Path(tmp)
        if args.namesrv:
            await ensure_topic(args.namesrv, args.topic, queues=4)
            ok = await run(args.namesrv, args.topic, args.group, offsets, args.seconds)
        else:
            from rmq_async.devbroker import LocalRocketMQ

            async with LocalRocketMQ() as rmq:
                await rmq.create_topic(args.topic, queues=4)
                ok = await run(rmq.namesrv_addr, args.topic, args.group, offsets, args.seconds)
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(asyncio.run(main()))

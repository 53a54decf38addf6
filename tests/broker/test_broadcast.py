"""Broadcasting against the real broker: every member gets everything, offsets in local files."""

from __future__ import annotations

import asyncio
import collections
import json
import os
import signal
import sys
import textwrap
from pathlib import Path

import pytest
from structlog.testing import capture_logs

from rmq_async import ConsumeResult, MessageExt, PushConsumer
from rmq_async.consumer.offset_store import LocalFileOffsetStore
from rmq_async.devbroker import LocalRocketMQ
from rmq_async.protocol.types import MessageQueue
from tests.helpers import AdminClient, produce, simple_messages, unique, wait_until

pytestmark = pytest.mark.broker

REPO = Path(__file__).resolve().parents[2]

Seen = collections.Counter[tuple[int, int]]


def _broadcast(namesrv: str, group: str, topic: str, name: str, store: Path, seen: Seen,
               fail_every: int = 0) -> PushConsumer:
    c = PushConsumer(group, namesrv=namesrv, message_model="BROADCASTING", instance_name=name,
                     offset_store_dir=store, consume_from_where="CONSUME_FROM_FIRST_OFFSET",
                     persist_offset_interval=0.5, consume_message_batch_max_size=8)

    async def on(msgs: list[MessageExt]) -> ConsumeResult:
        for m in msgs:
            seen[(m.queue_id, m.queue_offset)] += 1
        if fail_every and any(m.queue_offset % fail_every == 0 for m in msgs):
            return ConsumeResult.RECONSUME_LATER
        return ConsumeResult.SUCCESS

    c.subscribe(topic, listener=on)
    return c


def _offsets_file(store: Path, consumer: PushConsumer) -> Path:
    store_obj = consumer.offset_store
    assert isinstance(store_obj, LocalFileOffsetStore)
    assert store_obj.path.is_relative_to(store)
    return store_obj.path


async def test_every_member_gets_everything_and_resumes_from_its_own_file(
        rocketmq: LocalRocketMQ, tmp_path: Path) -> None:
    ns = rocketmq.namesrv_addr
    topic = unique("T_bcast")
    await rocketmq.create_topic(topic, queues=4)
    group = unique("G_bcast")
    seen = [Seen() for _ in range(3)]
    consumers = [_broadcast(ns, group, topic, f"bc{i}", tmp_path, seen[i],
                            fail_every=1000 if i == 0 else 0) for i in range(3)]
    placed: list[tuple[int, int]] = []
    with capture_logs() as logs:
        for c in consumers:
            await c.start()
        placed += await produce(ns, topic, simple_messages(topic, 10_000, size=48), batch=50)
        await wait_until(lambda: all(len(s) >= 10_000 for s in seen), 60,
                         what="10,000 messages at each of three consumers")
        await consumers[2].stop()
        second = await produce(ns, topic, simple_messages(topic, 1000, size=48), batch=50)
        placed += second
        await wait_until(lambda: all(len(s) >= 11_000 for s in seen[:2]), 30, what="1,000 more")
        for c in consumers[:2]:
            await c.stop()
    for i, s in enumerate(seen):
        expected = set(placed) if i < 2 else set(placed) - set(second)
        assert set(s) == expected, f"consumer {i}"
        assert set(s.values()) == {1}, f"consumer {i} got a message twice"
    # Failed messages of a broadcasting consumer are logged with their ids, not retried.
    failed = [e for e in logs if e["event"] == "consume.broadcast_failed_dropped"]
    assert all(any(o % 1000 == 0 for o in e["offsets"]) for e in failed)
    assert all(len(e["msg_ids"]) == len(e["offsets"]) and all(e["msg_ids"]) for e in failed)
    failed_marks = {(int(e["queue"].split("queueId=")[1].rstrip("]")), o)
                    for e in failed for o in e["offsets"] if o % 1000 == 0}
    assert failed_marks == {p for p in placed if p[1] % 1000 == 0}

    # Each member's file holds what that member consumed.
    async with AdminClient(ns) as admin:
        maxes = await admin.max_offsets(topic)
    files = [_offsets_file(tmp_path, c) for c in consumers]
    assert len(set(files)) == 3
    for i, path in enumerate(files):
        table = json.loads(path.read_text())["offsetTable"]
        stored = {MessageQueue(e["topic"], e["brokerName"], e["queueId"]): e["offset"]
                  for e in table}
        if i < 2:
            assert stored == maxes
        else:
            assert sum(stored.values()) == sum(maxes.values()) - 1000

    # Restart: each continues from its own offsets.
    third = await produce(ns, topic, simple_messages(topic, 1000, size=48), batch=50)
    again = [Seen() for _ in range(3)]
    restarted = [_broadcast(ns, group, topic, f"bc{i}", tmp_path, again[i]) for i in range(3)]
    try:
        for c in restarted:
            await c.start()
        await wait_until(lambda: len(again[0]) >= 1000 and len(again[1]) >= 1000
                         and len(again[2]) >= 2000, 30, what="the rest after the restart")
        await asyncio.sleep(1.0)  # nothing else may come
    finally:
        for c in restarted:
            await c.stop()
    assert set(again[0]) == set(again[1]) == set(third)
    assert set(again[2]) == set(second) | set(third)


_KILLED_CONSUMER = textwrap.dedent("""\
    import asyncio, logging, sys
    import structlog
    from rmq_async import ConsumeResult, PushConsumer

    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))

    async def main() -> None:
        ns, group, topic, store = sys.argv[1:5]
        c = PushConsumer(group, namesrv=ns, message_model="BROADCASTING", instance_name="victim",
                         offset_store_dir=store, consume_from_where="CONSUME_FROM_FIRST_OFFSET",
                         persist_offset_interval=0.02, consume_concurrency=2)
        count = 0

        async def on(msgs):
            nonlocal count
            count += len(msgs)
            if count % 500 == 0:
                print("consumed", count, flush=True)
            await asyncio.sleep(0.0005)
            return ConsumeResult.SUCCESS

        c.subscribe(topic, listener=on, batch=True)
        await c.start()
        await asyncio.Event().wait()

    asyncio.run(main())
    """)


async def test_kill_9_leaves_an_offsets_file_that_loads(
        rocketmq: LocalRocketMQ, tmp_path: Path) -> None:
    ns = rocketmq.namesrv_addr
    topic = unique("T_bkill")
    await rocketmq.create_topic(topic, queues=4)
    group = unique("G_bkill")
    placed = await produce(ns, topic, simple_messages(topic, 6000, size=48), batch=50)
    script = tmp_path / "victim.py"
    script.write_text(_KILLED_CONSUMER)
    store = tmp_path / "offsets"
    proc = await asyncio.create_subprocess_exec(
        sys.executable, str(script), ns, group, topic, str(store), cwd=REPO,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.DEVNULL,
        env={**os.environ, "PYTHONPATH": str(REPO)})
    try:
        assert proc.stdout is not None
        while True:  # mid-stream: a part consumed, offsets being written many times a second
            line = await asyncio.wait_for(proc.stdout.readline(), 60)
            assert line, "the consumer process ended early"
            words = line.split()
            if words[:1] == [b"consumed"] and int(words[1]) >= 2000:
                break
    finally:
        if proc.returncode is None:
            proc.send_signal(signal.SIGKILL)
        await proc.wait()
    assert proc.returncode == -signal.SIGKILL

    files = list(store.rglob("offsets.json"))
    assert len(files) == 1
    client_id = files[0].parent.parent.name
    loaded = LocalFileOffsetStore(store, client_id, group)
    await loaded.load()
    offsets = loaded.stored()
    assert len(offsets) == 4 and all(o >= 0 for o in offsets.values())
    consumed_before = sum(offsets.values())
    assert 0 < consumed_before < len(placed)
    leftovers = [p for p in files[0].parent.iterdir() if p.name != "offsets.json"]
    assert leftovers == [], "load() removes temporary files a killed writer left behind"
    print(f"\nkill -9: the offsets file loads; {consumed_before} messages behind its offsets")

    # A new consumer with the same client id continues from the file.
    seen = Seen()
    c = _broadcast(ns, group, topic, "victim", store, seen)
    assert c.client_id == client_id
    try:
        await c.start()
        await wait_until(lambda: len(seen) >= len(placed) - consumed_before, 30,
                         what="the rest of the messages")
    finally:
        await c.stop()
    assert all(off >= offsets[MessageQueue(topic, "broker-a", qid)] for qid, off in seen)
    assert len(seen) == len(placed) - consumed_before


async def test_broadcast_example_runs(rocketmq: LocalRocketMQ) -> None:
    topic = unique("T_bc_example")
    await rocketmq.create_topic(topic, queues=4)
    proc = await asyncio.create_subprocess_exec(
        sys.executable, str(REPO / "examples" / "broadcast.py"), "--namesrv",
        rocketmq.namesrv_addr, "--topic", topic, "--group", unique("G_bc_example"),
        cwd=REPO, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT)
    out, _ = await asyncio.wait_for(proc.communicate(), 90)
    text = out.decode()
    assert proc.returncode == 0, text[-3000:]
    assert "both nodes applied all 4 changes: True" in text
    assert "restarted node-1 applied 1 change(s)" in text

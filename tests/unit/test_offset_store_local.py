"""LocalFileOffsetStore: the broadcasting consumer's offsets file."""

from __future__ import annotations

import asyncio
import contextlib
import json
import threading
from pathlib import Path

from rmq_async.consumer.offset_store import OFFSET_NOT_FOUND, LocalFileOffsetStore
from rmq_async.protocol.types import MessageQueue

Q0 = MessageQueue("T", "broker-a", 0)
Q1 = MessageQueue("T", "broker-a", 1)
Q2 = MessageQueue("U", "broker-b", 3)


async def test_round_trip_in_standard_json(tmp_path: Path) -> None:
    store = LocalFileOffsetStore(tmp_path, "10.0.0.1@node", "G")
    await store.load()
    assert store.stored() == {}
    store.update(Q0, 10, increase_only=True)
    store.update(Q1, 7, increase_only=True)
    store.update(Q1, 5, increase_only=True)  # never moves back
    await store.persist_all({Q0, Q1}, oneway=True)
    assert store.path == tmp_path / "10.0.0.1@node" / "G" / "offsets.json"
    raw = json.loads(store.path.read_text())
    assert raw == {"offsetTable": [
        {"brokerName": "broker-a", "offset": 10, "queueId": 0, "topic": "T"},
        {"brokerName": "broker-a", "offset": 7, "queueId": 1, "topic": "T"},
    ]}
    again = LocalFileOffsetStore(tmp_path, "10.0.0.1@node", "G")
    await again.load()
    assert again.read_memory(Q0) == 10
    assert await again.read_store(Q1) == 7
    assert await again.read_store(Q2) == OFFSET_NOT_FOUND


async def test_a_queue_given_up_keeps_its_entry(tmp_path: Path) -> None:
    store = LocalFileOffsetStore(tmp_path, "cid", "G")
    await store.load()
    store.update(Q0, 3, increase_only=False)
    store.update(Q1, 4, increase_only=False)
    await store.persist(Q0)
    store.remove(Q0)  # the rebalancer forgot the queue
    store.update(Q1, 9, increase_only=False)
    await store.persist_all({Q1}, oneway=True)
    assert store.read_memory(Q0) == OFFSET_NOT_FOUND
    assert await store.read_store(Q0) == 3
    assert store.stored() == {Q0: 3, Q1: 9}


async def test_frozen_offset_ignores_updates(tmp_path: Path) -> None:
    store = LocalFileOffsetStore(tmp_path, "cid", "G")
    store.update(Q0, 50, increase_only=True)
    store.freeze(Q0, 20)  # an offset reset
    store.update(Q0, 60, increase_only=True)  # a late result of a dropped queue
    await store.persist(Q0)
    assert store.stored() == {Q0: 20}
    store.remove(Q0)
    store.update(Q0, 21, increase_only=True)
    assert store.read_memory(Q0) == 21


async def test_reads_the_java_clients_file(tmp_path: Path) -> None:
    path = tmp_path / "cid" / "G" / "offsets.json"
    path.parent.mkdir(parents=True)
    # fastjson's form of Map<MessageQueue, AtomicLong>, as the Java client writes it.
    path.write_text('{\n\t"offsetTable":{{"brokerName":"broker-a","queueId":0,"topic":"T"}:12,'
                    '{"brokerName":"broker-b","queueId":3,"topic":"U"}:40\n\t}\n}')
    store = LocalFileOffsetStore(tmp_path, "cid", "G")
    await store.load()
    assert store.stored() == {Q0: 12, Q2: 40}


async def test_unreadable_file_falls_back_to_backup_then_empty(tmp_path: Path) -> None:
    store = LocalFileOffsetStore(tmp_path, "cid", "G")
    store.path.parent.mkdir(parents=True)
    store.path.write_text('{"offsetTable": [{"brokerName": "broker-a", "off')
    backup = store.path.with_suffix(".json.bak")
    backup.write_text(json.dumps({"offsetTable": [
        {"brokerName": "broker-a", "offset": 8, "queueId": 1, "topic": "T"}]}))
    await store.load()
    assert store.stored() == {Q1: 8}
    backup.write_text("[1, 2")
    empty = LocalFileOffsetStore(tmp_path, "cid", "G")
    await empty.load()
    assert empty.stored() == {}


async def test_load_removes_temporary_files_of_a_killed_writer(tmp_path: Path) -> None:
    store = LocalFileOffsetStore(tmp_path, "cid", "G")
    store.update(Q0, 1, increase_only=False)
    await store.persist(Q0)
    stale = store.path.parent / ".offsets-abc123.tmp"
    stale.write_text('{"offsetTable": [')  # cut short by kill -9 before the rename
    reloaded = LocalFileOffsetStore(tmp_path, "cid", "G")
    await reloaded.load()
    assert reloaded.stored() == {Q0: 1}
    assert sorted(p.name for p in store.path.parent.iterdir()) == ["offsets.json"]


async def test_two_processes_sharing_the_file_keep_each_others_entries(tmp_path: Path) -> None:
    # Broadcasting consumers of one group and instance name on one host share the file: each
    # write must keep what the other wrote since its load (as Java's store, which reads the
    # file again before writing), and a queue taken reads the file as it is now.
    a = LocalFileOffsetStore(tmp_path, "cid", "G")
    b = LocalFileOffsetStore(tmp_path, "cid", "G")
    await a.load()
    await b.load()
    b.update(Q2, 500, increase_only=False)
    await b.persist_all({Q2}, oneway=False)
    assert await a.read_store(Q2) == 500  # read now, not from a's load
    a.update(Q0, 42, increase_only=False)
    await a.persist_all({Q0}, oneway=False)
    fresh = LocalFileOffsetStore(tmp_path, "cid", "G")
    await fresh.load()
    assert fresh.stored() == {Q0: 42, Q2: 500}


async def _persist_cancelled_in_its_thread(store: LocalFileOffsetStore,
                                           entered: threading.Event) -> None:
    """Persist Q0 at 10 and cancel that persist once its thread has ``entered`` the point the
    test holds it at (stop()'s stage running out), then move Q0 on to 20."""
    store.update(Q0, 10, increase_only=True)
    first = asyncio.create_task(store.persist_all({Q0}, oneway=False))
    assert await asyncio.to_thread(entered.wait, 10)
    first.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await first
    store.update(Q0, 20, increase_only=True)


async def _stored_q0(tmp_path: Path) -> int | None:
    again = LocalFileOffsetStore(tmp_path, "10.0.0.1@node", "G")
    await again.load()
    return again.read_memory(Q0)


async def test_a_cancelled_persist_still_writing_cannot_put_older_offsets_over_newer(
        tmp_path: Path) -> None:
    """A persist cancelled while its thread writes (stop()'s stage ran out) released the
    store's lock with that thread still running; the final persist then wrote the newer
    offsets beside it, and the older snapshot could replace the file last (a broadcasting
    queue consumed again from an older offset at the next start)."""
    store = LocalFileOffsetStore(tmp_path, "10.0.0.1@node", "G")
    await store.load()
    hold, entered = threading.Event(), threading.Event()
    write_file = store._write_file
    calls = 0

    def slow_first_write(payload: bytes) -> None:
        nonlocal calls
        calls += 1
        if calls == 1:
            entered.set()
            assert hold.wait(10)
        write_file(payload)

    store._write_file = slow_first_write  # type: ignore[method-assign]
    await _persist_cancelled_in_its_thread(store, entered)
    final = asyncio.create_task(store.persist_all({Q0}, oneway=False))
    await asyncio.sleep(0.1)
    hold.set()  # the older write goes on now
    await final
    await asyncio.sleep(0.2)  # (the cancelled persist's thread has ended by now)
    assert await _stored_q0(tmp_path) == 20


async def test_an_older_snapshot_whose_thread_runs_after_a_newer_ones_is_not_written(
        tmp_path: Path) -> None:
    """The other order of the race above: the cancelled persist's thread starts only after
    the final persist wrote; it must not replace the file with its older offsets."""
    store = LocalFileOffsetStore(tmp_path, "10.0.0.1@node", "G")
    await store.load()
    hold, entered, ended = threading.Event(), threading.Event(), threading.Event()
    merge = store._merge_and_write
    calls = 0

    def late_first(own: dict[MessageQueue, int], snapshot: int) -> dict[MessageQueue, int]:
        nonlocal calls
        calls += 1
        if calls != 1:
            return merge(own, snapshot)
        entered.set()
        try:
            assert hold.wait(10)  # before it takes the write lock
            return merge(own, snapshot)
        finally:
            ended.set()

    store._merge_and_write = late_first  # type: ignore[method-assign]
    await _persist_cancelled_in_its_thread(store, entered)
    await store.persist_all({Q0}, oneway=False)  # written: 20
    hold.set()  # the older snapshot's thread runs now, and must skip its write
    assert await asyncio.to_thread(ended.wait, 10)
    assert await _stored_q0(tmp_path) == 20

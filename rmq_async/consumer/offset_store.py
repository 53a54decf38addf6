"""Consume-offset stores: on the broker (clustering) and in a local file (broadcasting)."""

from __future__ import annotations

import asyncio
import json
import os
import tempfile
import threading
from collections.abc import Awaitable, Callable, Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

import anyio
import structlog

from rmq_async.client.errors import MQBrokerError, MQClientError
from rmq_async.client.instance import MASTER_ID
from rmq_async.errors import InvalidArgumentError
from rmq_async.protocol.codes import ResponseCode
from rmq_async.protocol.errors import ProtocolError
from rmq_async.protocol.jsonutil import tolerant_loads
from rmq_async.protocol.types import MessageQueue
from rmq_async.remoting.errors import RemotingError

if TYPE_CHECKING:
    from rmq_async.client.instance import ClientInstance

log = structlog.get_logger(__name__)

#: ``read_offset`` results that are not offsets (Java's -1 / -2 conventions).
OFFSET_NOT_FOUND = -1
OFFSET_READ_ERROR = -2

_TEMP_PREFIX = ".offsets-"
_TEMP_SUFFIX = ".tmp"


class OffsetStore(Protocol):
    async def load(self) -> None: ...

    def update(self, mq: MessageQueue, offset: int, *, increase_only: bool) -> None: ...

    def read_memory(self, mq: MessageQueue) -> int: ...

    async def read_store(self, mq: MessageQueue) -> int: ...

    async def persist(self, mq: MessageQueue) -> None: ...

    async def persist_all(self, mqs: set[MessageQueue], *, oneway: bool) -> None: ...

    def remove(self, mq: MessageQueue) -> None: ...

    def freeze(self, mq: MessageQueue, offset: int) -> None: ...

    def snapshot(self) -> dict[MessageQueue, int]: ...


class _MemoryTable:
    def __init__(self) -> None:
        self._table: dict[MessageQueue, int] = {}
        self._frozen: set[MessageQueue] = set()

    def update(self, mq: MessageQueue, offset: int, *, increase_only: bool) -> None:
        if mq in self._frozen:
            return
        current = self._table.get(mq)
        if current is None or not increase_only or offset > current:
            self._table[mq] = offset

    def freeze(self, mq: MessageQueue, offset: int) -> None:
        """Set ``offset`` and ignore later updates until the queue is removed."""
        self._table[mq] = offset
        self._frozen.add(mq)

    def read_memory(self, mq: MessageQueue) -> int:
        return self._table.get(mq, OFFSET_NOT_FOUND)

    def remove(self, mq: MessageQueue) -> None:
        self._table.pop(mq, None)
        self._frozen.discard(mq)

    def snapshot(self) -> dict[MessageQueue, int]:
        return dict(self._table)


async def write_topic_by_topic(queues: Iterable[MessageQueue],
                               broker: Callable[[MessageQueue], str],
                               write: Callable[[MessageQueue], Awaitable[None]]) -> None:
    """``write`` each queue's offset: the queues of one topic on one ``broker`` one after the
    other, other topics and brokers side by side.

    Not every queue at once: a 5.3.3 broker keeps a group's offsets of a topic in a map it
    creates on the first write without a lock (``ConsumerOffsetManager.commitOffset``), and of
    two first writes that meet there one is lost.
    """
    runs: dict[tuple[str, str], list[MessageQueue]] = {}
    for mq in queues:
        runs.setdefault((broker(mq), mq.topic), []).append(mq)

    async def run(run_queues: list[MessageQueue]) -> None:
        for mq in run_queues:
            await write(mq)

    await asyncio.gather(*(run(run_queues) for run_queues in runs.values()))


class BrokerOffsetStore(_MemoryTable):
    """Offsets kept in memory and persisted to the queue's master broker (Java RemoteBrokerOffsetStore)."""

    def __init__(self, instance: ClientInstance, group: str) -> None:
        super().__init__()
        self._instance = instance
        self._group = group
        # (address, offset) last written per queue: a periodic round skips a queue whose
        # offset that replica already has, not one whose write went to another replica (the
        # slave that stood in for a master that is back).
        self._persisted: dict[MessageQueue, tuple[str, int]] = {}
        # One write per queue at a time: a broker runs the requests of a connection side by
        # side and may apply an older offset after a newer one sent while it was in flight.
        # The exception is stop() giving up on a round that waits for a stalled broker: the
        # cancelled write is still at the broker when the final one goes, and should the
        # broker apply it last, the queue's messages after it are consumed again (none lost).
        self._writing: dict[MessageQueue, asyncio.Lock] = {}

    async def load(self) -> None:
        return None

    async def read_store(self, mq: MessageQueue) -> int:
        """Query the broker: the offset, ``OFFSET_NOT_FOUND`` or ``OFFSET_READ_ERROR``."""
        try:
            # Java fetchConsumeOffsetFromBroker: the master only, or after a route refresh
            # any replica (the master first).
            inst = self._instance
            try:
                addr, _ = await inst.find_broker_in_subscribe(mq.broker_name, MASTER_ID,
                                                              only_this_broker=True)
            except MQClientError:
                await inst.update_route(mq.topic)
                addr, _ = await inst.find_broker_in_subscribe(mq.broker_name, MASTER_ID)
            offset = await inst.api.query_consumer_offset(addr, self._group, mq)
        except MQBrokerError as exc:
            if exc.code == ResponseCode.QUERY_NOT_FOUND:
                return OFFSET_NOT_FOUND
            log.warning("offset.query_failed", queue=str(mq), error=str(exc))
            return OFFSET_READ_ERROR
        except (MQClientError, RemotingError, ProtocolError) as exc:
            log.warning("offset.query_failed", queue=str(mq), error=str(exc))
            return OFFSET_READ_ERROR
        super().update(mq, offset, increase_only=False)
        self._persisted[mq] = (addr, offset)
        return offset

    async def persist(self, mq: MessageQueue) -> None:
        offset = self._table.get(mq)
        if offset is None or offset < 0:
            return
        await self._send(mq, offset, oneway=False)

    async def persist_all(self, mqs: set[MessageQueue], *, oneway: bool) -> None:
        """Send the offsets of ``mqs``, a topic's queues on one broker one after the other
        (see :func:`write_topic_by_topic`), the rest side by side."""
        async def one(mq: MessageQueue) -> None:
            # Each queue's offset is read when its turn comes (and again by _send once its
            # broker's address is known): meanwhile the pull loop may have frozen the queue
            # at the offset the broker corrected (OFFSET_ILLEGAL, an admin's reset) and
            # persisted that, or given the queue up. An older value sent after that would
            # undo it.
            offset = self._table.get(mq)
            if offset is None or offset < 0:
                return
            if oneway and self._persisted.get(mq) == (self._write_addr(mq), offset):
                return
            await self._send(mq, offset, oneway=oneway)

        await write_topic_by_topic([mq for mq in self._table if mq in mqs],
                                   lambda mq: mq.broker_name, one)

    async def _send(self, mq: MessageQueue, offset: int, *, oneway: bool) -> None:
        try:
            # Java updateConsumeOffsetToBroker: the master, else any replica of the group
            # (a slave keeps the offset while its master is down).
            addr, _ = await self._instance.find_broker_in_subscribe(
                mq.broker_name, MASTER_ID, topic=mq.topic)
            lock = self._writing.get(mq)
            if lock is None:
                lock = self._writing[mq] = asyncio.Lock()
            try:
                async with lock:
                    # Finding the address, or the queue's write before, may have waited: send
                    # what the queue has now.
                    latest = self._table.get(mq)
                    if latest is None:
                        # Given up meanwhile; giving it up persisted its latest offset. An
                        # older one sent now would move the broker back under the queue's
                        # next owner.
                        return
                    if latest >= 0:
                        offset = latest
                    await self._instance.api.update_consumer_offset(addr, self._group, mq,
                                                                    offset, oneway=oneway)
            finally:
                # A queue given up while this write held its lock (remove() leaves a held
                # lock alone): the lock goes now, as it would have then.
                if mq not in self._table and not lock.locked() and self._writing.get(mq) is lock:
                    del self._writing[mq]
        except (MQClientError, RemotingError, ProtocolError) as exc:
            log.warning("offset.persist_failed", queue=str(mq), offset=offset, error=str(exc))
            return
        self._persisted[mq] = (addr, offset)
        log.debug("offset.persisted", queue=str(mq), offset=offset)

    def _write_addr(self, mq: MessageQueue) -> str | None:
        """Where an offset of ``mq`` would be written now (known route only)."""
        entry = self._instance.brokers.get(mq.broker_name)
        if entry is None or not entry.addrs:
            return None
        return entry.addrs.get(MASTER_ID) or entry.addrs[min(entry.addrs)]

    def remove(self, mq: MessageQueue) -> None:
        super().remove(mq)
        self._persisted.pop(mq, None)
        lock = self._writing.get(mq)
        if lock is not None and not lock.locked():
            del self._writing[mq]


class LocalFileOffsetStore(_MemoryTable):
    """Offsets of a broadcasting consumer, kept in a JSON file of its own (Java LocalFileOffsetStore).

    The file is ``<dir>/<client_id>/<group>/offsets.json``, in standard JSON:
    ``{"offsetTable": [{"brokerName", "offset", "queueId", "topic"}, ...]}``. A file written by
    the Java client (a map with object keys, fastjson's form) is read too. Every write goes
    to a temporary file in the same folder, is flushed to disk and then renamed over the old
    one, so a crash at any moment (``kill -9`` included) leaves either the previous complete
    file or the new complete file, never a torn one.

    The store keeps a copy of what the file holds. A queue that is given up keeps its entry in
    the file (only the in-memory offset is forgotten), so a later round that takes the queue
    again, or the next run, continues from it.
    """

    def __init__(self, directory: str | Path, client_id: str, group: str) -> None:
        super().__init__()
        safe_cid = client_id.replace(os.sep, "_")
        self.path = Path(directory).expanduser() / safe_cid / group / "offsets.json"
        self._file: dict[MessageQueue, int] = {}
        self._write_lock = anyio.Lock()
        # The writes themselves, in their threads, one at a time and newest last: a persist
        # cancelled while its thread writes (stop()'s stage ran out) lets the next one go on
        # the event loop's side while that thread still runs, and an older snapshot replacing
        # the file after a newer one would move the queues back.
        self._thread_lock = threading.Lock()
        self._snapshots = 0  # taken (the event loop's side)
        self._written = 0  # the newest written (the threads' side)

    async def load(self) -> None:
        data = await anyio.to_thread.run_sync(self._read_file)
        self._file = dict(data)
        self._table.update(data)
        log.info("offset.file_loaded", path=str(self.path), queues=len(data))

    def _read_file(self) -> dict[MessageQueue, int]:
        self._remove_stale_temp_files()
        return self._read_current()

    def _read_current(self) -> dict[MessageQueue, int]:
        """What the file holds now (another process of the group on this host, sharing the
        file as broadcasting consumers of one instance name do, may have written since)."""
        for candidate in (self.path, self.path.with_suffix(".json.bak")):
            try:
                raw = tolerant_loads(candidate.read_bytes())
                return _parse_offset_file(raw)
            except FileNotFoundError:
                continue
            except (OSError, ValueError, KeyError, TypeError, AttributeError,
                    ProtocolError) as exc:
                log.warning("offset.file_unreadable", path=str(candidate), error=str(exc))
                continue
        return {}

    def _remove_stale_temp_files(self) -> None:
        """Temporary files a writer killed before its rename left behind (never read)."""
        try:
            stale = list(self.path.parent.glob(_TEMP_PREFIX + "*" + _TEMP_SUFFIX))
        except OSError:
            return
        for tmp in stale:
            try:
                tmp.unlink()
            except OSError:
                continue
            log.info("offset.stale_temp_removed", path=str(tmp))

    async def read_store(self, mq: MessageQueue) -> int:
        # Read again, as Java's READ_FROM_STORE does: not the copy of the last load or write.
        async with self._write_lock:
            self._file = await anyio.to_thread.run_sync(self._read_current)
        offset = self._file.get(mq)
        if offset is None:
            return OFFSET_NOT_FOUND
        super().update(mq, offset, increase_only=False)
        return offset

    def stored(self) -> dict[MessageQueue, int]:
        """What the offsets file holds (as of the last load or write)."""
        return dict(self._file)

    async def persist(self, mq: MessageQueue) -> None:
        await self.persist_all({mq}, oneway=False)

    async def persist_all(self, mqs: set[MessageQueue], *, oneway: bool) -> None:
        # The file always holds every queue known, not only ``mqs``: what it holds now (as
        # Java's store, which reads it again before each write, so that the entries another
        # process of the group wrote stay), with this store's offsets over it.
        async with self._write_lock:
            own = {mq: off for mq, off in self._table.items() if off >= 0}
            self._snapshots += 1
            try:
                merged = await anyio.to_thread.run_sync(self._merge_and_write, own,
                                                        self._snapshots)
            except OSError as exc:  # as Java's store: logged, the next round tries again
                log.warning("offset.file_write_failed", path=str(self.path),
                            error=f"{type(exc).__name__}: {exc}")
                return
            self._file = merged

    def _merge_and_write(self, own: dict[MessageQueue, int],
                         snapshot: int) -> dict[MessageQueue, int]:
        """In a worker thread: the file's entries with ``own`` over them, written unless
        the file already holds exactly that, or a later snapshot than ``snapshot`` was
        written already; returns what the file holds then."""
        with self._thread_lock:
            if snapshot < self._written:
                return self._read_current()
            merged = self._merge_and_write_now(own)
            self._written = max(self._written, snapshot)
            return merged

    def _merge_and_write_now(self, own: dict[MessageQueue, int]) -> dict[MessageQueue, int]:
        current = self._read_current()
        merged = {**current, **own}
        if merged == current and self.path.exists():
            return current
        table = [
            {"brokerName": mq.broker_name, "offset": off, "queueId": mq.queue_id,
             "topic": mq.topic}
            for mq, off in sorted(merged.items(), key=lambda kv: kv[0].java_sort_key())
        ]
        self._write_file(json.dumps({"offsetTable": table}, separators=(",", ":")).encode())
        log.debug("offset.file_written", path=str(self.path), queues=len(merged))
        return merged

    def _write_file(self, payload: bytes) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=_TEMP_PREFIX, suffix=_TEMP_SUFFIX, dir=self.path.parent)
        try:
            with os.fdopen(fd, "wb") as fh:
                fh.write(payload)
                fh.flush()
                os.fsync(fh.fileno())
            os.replace(tmp, self.path)
        except BaseException:
            try:
                os.unlink(tmp)
            except OSError:
                pass
            raise
        # Make the rename itself durable.
        try:
            dir_fd = os.open(self.path.parent, os.O_RDONLY)
        except OSError:
            return
        try:
            os.fsync(dir_fd)
        except OSError:
            pass
        finally:
            os.close(dir_fd)


def _parse_offset_file(raw: object) -> dict[MessageQueue, int]:
    """Entries of an offsets file; Java's object-keyed map form is accepted too."""
    if not isinstance(raw, dict):
        raise InvalidArgumentError("offsets file is not a JSON object")
    table = raw.get("offsetTable", [])
    result: dict[MessageQueue, int] = {}
    if isinstance(table, dict):
        for key, value in table.items():
            if not isinstance(key, MessageQueue):
                raise InvalidArgumentError(f"offsets file: unexpected key {key!r}")
            if int(value) >= 0:
                result[key] = int(value)
        return result
    for entry in table:
        mq = MessageQueue(str(entry["topic"]), str(entry["brokerName"]), int(entry["queueId"]))
        offset = int(entry["offset"])
        if offset >= 0:
            result[mq] = offset
    return result

"""Consume-offset stores: on the broker (clustering) and in a local file (broadcasting)."""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

import anyio
import structlog

from rmq_async.client.errors import MQBrokerError, MQClientError
from rmq_async.protocol.codes import ResponseCode
from rmq_async.protocol.types import MessageQueue
from rmq_async.remoting.errors import RemotingError

if TYPE_CHECKING:
    from rmq_async.client.instance import ClientInstance

log = structlog.get_logger(__name__)

#: ``read_offset`` results that are not offsets (Java's -1 / -2 conventions).
OFFSET_NOT_FOUND = -1
OFFSET_READ_ERROR = -2


class OffsetStore(Protocol):
    async def load(self) -> None: ...

    def update(self, mq: MessageQueue, offset: int, *, increase_only: bool) -> None: ...

    def read_memory(self, mq: MessageQueue) -> int: ...

    async def read_store(self, mq: MessageQueue) -> int: ...

    async def persist(self, mq: MessageQueue) -> None: ...

    async def persist_all(self, mqs: set[MessageQueue], *, oneway: bool) -> None: ...

    def remove(self, mq: MessageQueue) -> None: ...

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


class BrokerOffsetStore(_MemoryTable):
    """Offsets kept in memory and persisted to the queue's master broker (Java RemoteBrokerOffsetStore)."""

    def __init__(self, instance: ClientInstance, group: str) -> None:
        super().__init__()
        self._instance = instance
        self._group = group
        self._persisted: dict[MessageQueue, int] = {}

    async def load(self) -> None:
        return None

    async def read_store(self, mq: MessageQueue) -> int:
        """Query the broker: the offset, ``OFFSET_NOT_FOUND`` or ``OFFSET_READ_ERROR``."""
        try:
            addr = await self._instance.find_broker_master(mq.broker_name, mq.topic)
            offset = await self._instance.api.query_consumer_offset(addr, self._group, mq)
        except MQBrokerError as exc:
            if exc.code == ResponseCode.QUERY_NOT_FOUND:
                return OFFSET_NOT_FOUND
            log.warning("offset.query_failed", queue=str(mq), error=str(exc))
            return OFFSET_READ_ERROR
        except (MQClientError, RemotingError) as exc:
            log.warning("offset.query_failed", queue=str(mq), error=str(exc))
            return OFFSET_READ_ERROR
        super().update(mq, offset, increase_only=False)
        self._persisted[mq] = offset
        return offset

    async def persist(self, mq: MessageQueue) -> None:
        offset = self._table.get(mq)
        if offset is None or offset < 0:
            return
        await self._send(mq, offset, oneway=False)

    async def persist_all(self, mqs: set[MessageQueue], *, oneway: bool) -> None:
        for mq, offset in list(self._table.items()):
            if mq not in mqs or offset < 0:
                continue
            if oneway and self._persisted.get(mq) == offset:
                continue
            await self._send(mq, offset, oneway=oneway)

    async def _send(self, mq: MessageQueue, offset: int, *, oneway: bool) -> None:
        try:
            addr = await self._instance.find_broker_master(mq.broker_name, mq.topic)
            await self._instance.api.update_consumer_offset(addr, self._group, mq, offset,
                                                            oneway=oneway)
        except (MQClientError, RemotingError) as exc:
            log.warning("offset.persist_failed", queue=str(mq), offset=offset, error=str(exc))
            return
        self._persisted[mq] = offset
        log.debug("offset.persisted", queue=str(mq), offset=offset)

    def remove(self, mq: MessageQueue) -> None:
        super().remove(mq)
        self._persisted.pop(mq, None)


class LocalFileOffsetStore(_MemoryTable):
    """Offsets of a broadcasting consumer, kept in a JSON file of its own (Java LocalFileOffsetStore).

    The file is ``<dir>/<client_id>/<group>/offsets.json``. Every write goes to a temporary file
    in the same folder which is then renamed over the old one, so a crash at any moment leaves
    either the previous complete file or the new complete file, never a torn one.
    """

    def __init__(self, directory: str | Path, client_id: str, group: str) -> None:
        super().__init__()
        safe_cid = client_id.replace(os.sep, "_")
        self.path = Path(directory).expanduser() / safe_cid / group / "offsets.json"

    async def load(self) -> None:
        data = await anyio.to_thread.run_sync(self._read_file)
        for mq, offset in data.items():
            self._table[mq] = offset
        log.info("offset.file_loaded", path=str(self.path), queues=len(data))

    def _read_file(self) -> dict[MessageQueue, int]:
        for candidate in (self.path, self.path.with_suffix(".json.bak")):
            try:
                raw = json.loads(candidate.read_text("utf-8"))
            except FileNotFoundError:
                continue
            except (OSError, ValueError) as exc:
                log.warning("offset.file_unreadable", path=str(candidate), error=str(exc))
                continue
            result: dict[MessageQueue, int] = {}
            for entry in raw.get("offsetTable", []):
                mq = MessageQueue(entry["topic"], entry["brokerName"], int(entry["queueId"]))
                result[mq] = int(entry["offset"])
            return result
        return {}

    async def read_store(self, mq: MessageQueue) -> int:
        data = await anyio.to_thread.run_sync(self._read_file)
        offset = data.get(mq)
        if offset is None:
            return OFFSET_NOT_FOUND
        super().update(mq, offset, increase_only=False)
        return offset

    async def persist(self, mq: MessageQueue) -> None:
        await self.persist_all({mq}, oneway=False)

    async def persist_all(self, mqs: set[MessageQueue], *, oneway: bool) -> None:
        # The file always holds every queue we know, not only ``mqs``.
        table = [
            {"brokerName": mq.broker_name, "offset": off, "queueId": mq.queue_id, "topic": mq.topic}
            for mq, off in sorted(self._table.items(), key=lambda kv: kv[0].java_sort_key())
            if off >= 0
        ]
        payload = json.dumps({"offsetTable": table}, separators=(",", ":")).encode("utf-8")
        await anyio.to_thread.run_sync(self._write_file, payload)

    def _write_file(self, payload: bytes) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=".offsets-", suffix=".tmp", dir=self.path.parent)
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

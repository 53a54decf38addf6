"""Queue allocation strategies: which queues of a topic this client consumes.

Each strategy mirrors one of the Java client's ``AllocateMessageQueueStrategy`` classes and
returns exactly the same queues for the same inputs, so that a group mixing rmq_async and Java
clients splits a topic without overlap or gap.

The caller (the rebalancer) sorts both inputs first, as Java's ``RebalanceImpl`` does; use
:func:`sort_inputs`. The strategies themselves take the lists as given: an unsorted input gives
the answer Java would give for that same unsorted input.

Any object with a ``name`` attribute and an ``allocate`` method of the same signature can be
passed as the consumer's ``allocate_strategy`` (see :class:`AllocateStrategy`).
"""

from __future__ import annotations

import bisect
import hashlib
from collections.abc import Callable, Collection, Iterable, Sequence
from typing import Protocol, runtime_checkable

import structlog

from rmq_async.errors import InvalidArgumentError
from rmq_async.protocol.types import MessageQueue, java_string_sort_key

log = structlog.get_logger(__name__)

__all__ = [
    "AllocateAveragely",
    "AllocateAveragelyByCircle",
    "AllocateByConfig",
    "AllocateByMachineRoom",
    "AllocateConsistentHash",
    "AllocateMachineRoomNearby",
    "AllocateStrategy",
    "MachineRoomResolver",
    "md5_hash",
    "sort_inputs",
]


@runtime_checkable
class AllocateStrategy(Protocol):
    """What the rebalancer needs from an allocation strategy.

    ``allocate`` receives the consumer group, this client's id, every queue of the topic and
    every client id of the group (both sorted by the caller), and returns the queues this client
    should consume. It must be a pure function of its inputs: every member of the group runs it
    independently and they only agree if they compute the same split.
    """

    @property
    def name(self) -> str: ...

    def allocate(
        self,
        consumer_group: str,
        current_cid: str,
        mq_all: list[MessageQueue],
        cid_all: list[str],
    ) -> list[MessageQueue]: ...


def sort_inputs(
    mq_all: Iterable[MessageQueue], cid_all: Iterable[str]
) -> tuple[list[MessageQueue], list[str]]:
    """Sort queues and client ids exactly as Java's ``RebalanceImpl`` does before allocating.

    Queues by ``MessageQueue.compareTo`` (topic, broker name, queue id); client ids by
    ``String.compareTo`` (UTF-16 code units, which differs from Python's code-point order only
    for characters outside the Basic Multilingual Plane).
    """
    mqs = sorted(mq_all, key=MessageQueue.java_sort_key)
    cids = sorted(cid_all, key=java_string_sort_key)
    return mqs, cids


def _check(
    strategy: str,
    consumer_group: str,
    current_cid: str,
    mq_all: Sequence[MessageQueue],
    cid_all: Sequence[str],
) -> bool:
    """The argument check every Java strategy runs first.

    Raises ``ValueError`` for an empty client id or empty lists; returns ``False`` (allocate
    nothing) when this client is not in ``cid_all`` yet, which happens right after start while
    the broker has not seen its first heartbeat.
    """
    if not current_cid:
        raise InvalidArgumentError("current client id is empty")
    if not mq_all:
        raise InvalidArgumentError("mq_all is empty")
    if not cid_all:
        raise InvalidArgumentError("cid_all is empty")
    if current_cid not in cid_all:
        log.info(
            "allocate.client_not_in_group",
            strategy=strategy,
            group=consumer_group,
            client_id=current_cid,
            consumers=len(cid_all),
        )
        return False
    return True


class AllocateAveragely:
    """Contiguous blocks; the first ``len(mq_all) % len(cid_all)`` clients get one queue more.

    Java ``AllocateMessageQueueAveragely`` (the default).
    """

    name = "AVG"

    def allocate(
        self,
        consumer_group: str,
        current_cid: str,
        mq_all: list[MessageQueue],
        cid_all: list[str],
    ) -> list[MessageQueue]:
        if not _check(self.name, consumer_group, current_cid, mq_all, cid_all):
            return []
        n, m = len(mq_all), len(cid_all)
        index = cid_all.index(current_cid)
        mod = n % m
        gets_extra = mod > 0 and index < mod
        size = 1 if n <= m else (n // m + 1 if gets_extra else n // m)
        start = index * size if gets_extra else index * size + mod
        count = min(size, n - start)
        if count <= 0:
            return []
        return mq_all[start : start + count]

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


class AllocateAveragelyByCircle:
    """Round robin: client ``i`` takes queues ``i, i + m, i + 2m, ...``.

    Java ``AllocateMessageQueueAveragelyByCircle``.
    """

    name = "AVG_BY_CIRCLE"

    def allocate(
        self,
        consumer_group: str,
        current_cid: str,
        mq_all: list[MessageQueue],
        cid_all: list[str],
    ) -> list[MessageQueue]:
        if not _check(self.name, consumer_group, current_cid, mq_all, cid_all):
            return []
        index = cid_all.index(current_cid)
        return mq_all[index :: len(cid_all)]

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


class AllocateByConfig:
    """Always the configured queues, whatever the group looks like.

    Java ``AllocateMessageQueueByConfig``; like it, no argument check is made.
    """

    name = "CONFIG"

    def __init__(self, queues: Iterable[MessageQueue]) -> None:
        self.queues: tuple[MessageQueue, ...] = tuple(queues)

    def allocate(
        self,
        consumer_group: str,
        current_cid: str,
        mq_all: list[MessageQueue],
        cid_all: list[str],
    ) -> list[MessageQueue]:
        return list(self.queues)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({list(self.queues)!r})"


def _java_split(text: str, sep: str) -> list[str]:
    # Java String.split(regex) with limit 0: trailing empty strings are removed, except that
    # an input without any separator comes back unchanged (even when empty).
    parts = text.split(sep)
    if len(parts) == 1:
        return parts
    while parts and parts[-1] == "":
        parts.pop()
    return parts


class AllocateByMachineRoom:
    """Only queues of brokers named ``<room>@<name>`` whose room is in ``rooms``.

    Java ``AllocateMessageQueueByMachineRoom``: the matching queues (in ``mq_all`` order) are
    split in contiguous blocks of ``len // m``; the remainder goes one each to the first clients.
    """

    name = "MACHINE_ROOM"

    def __init__(self, rooms: Iterable[str]) -> None:
        self.rooms: frozenset[str] = frozenset(rooms)

    def allocate(
        self,
        consumer_group: str,
        current_cid: str,
        mq_all: list[MessageQueue],
        cid_all: list[str],
    ) -> list[MessageQueue]:
        if not _check(self.name, consumer_group, current_cid, mq_all, cid_all):
            return []
        index = cid_all.index(current_cid)
        premq: list[MessageQueue] = []
        for mq in mq_all:
            parts = _java_split(mq.broker_name, "@")
            if len(parts) == 2 and parts[0] in self.rooms:
                premq.append(mq)
        m = len(cid_all)
        per, rem = divmod(len(premq), m)
        start = per * index
        result = premq[start : start + per]
        if rem > index:
            result.append(premq[index + per * m])
        return result

    def __repr__(self) -> str:
        return f"{type(self).__name__}({sorted(self.rooms)!r})"


@runtime_checkable
class MachineRoomResolver(Protocol):
    """Tells which machine room a broker's queue and a client live in (never empty)."""

    def broker_room(self, mq: MessageQueue) -> str: ...

    def consumer_room(self, cid: str) -> str: ...


class AllocateMachineRoomNearby:
    """Prefer queues of the client's own machine room; share rooms that have no client.

    Java ``AllocateMachineRoomNearby``: queues whose broker is in the current client's room are
    split by ``inner`` among the clients of that room; queues of rooms without any client are
    split by ``inner`` among all clients (room by room, rooms in Java string order).
    """

    def __init__(self, inner: AllocateStrategy, resolver: MachineRoomResolver) -> None:
        self.inner = inner
        self.resolver = resolver

    @property
    def name(self) -> str:
        return f"MACHINE_ROOM_NEARBY-{self.inner.name}"

    def allocate(
        self,
        consumer_group: str,
        current_cid: str,
        mq_all: list[MessageQueue],
        cid_all: list[str],
    ) -> list[MessageQueue]:
        if not _check(self.name, consumer_group, current_cid, mq_all, cid_all):
            return []
        room_queues: dict[str, list[MessageQueue]] = {}
        for mq in mq_all:
            room = self.resolver.broker_room(mq)
            if not room:
                raise InvalidArgumentError(f"machine room is empty for queue {mq}")
            room_queues.setdefault(room, []).append(mq)
        room_clients: dict[str, list[str]] = {}
        for cid in cid_all:
            room = self.resolver.consumer_room(cid)
            if not room:
                raise InvalidArgumentError(f"machine room is empty for client id {cid}")
            room_clients.setdefault(room, []).append(cid)

        result: list[MessageQueue] = []
        my_room = self.resolver.consumer_room(current_cid)
        mine = room_queues.pop(my_room, None)
        if mine:
            result.extend(
                self.inner.allocate(consumer_group, current_cid, mine, room_clients[my_room])
            )
        for room in sorted(room_queues, key=java_string_sort_key):
            if room not in room_clients:
                result.extend(
                    self.inner.allocate(consumer_group, current_cid, room_queues[room], cid_all)
                )
        return result

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.inner!r}, {self.resolver!r})"


def md5_hash(key: str) -> int:
    """The Java ring's default hash: first 4 bytes of MD5(UTF-8 key), unsigned big-endian."""
    return int.from_bytes(hashlib.md5(key.encode("utf-8")).digest()[:4], "big")


class AllocateConsistentHash:
    """Consistent hashing on a ring of ``virtual_nodes`` points per client.

    Java ``AllocateMessageQueueConsistentHash`` with its ``ConsistentHashRouter``: client ``c``
    puts points at ``hash(f"{c}-{r}")``; a later point at the same position replaces an earlier
    one; a queue belongs to the first point at or after ``hash(str(mq))``, wrapping around.
    ``hash_fn`` maps a string to an int (Java ``HashFunction``); points are ordered as ints.
    """

    name = "CONSISTENT_HASH"

    def __init__(
        self, virtual_nodes: int = 10, hash_fn: Callable[[str], int] = md5_hash
    ) -> None:
        if virtual_nodes < 0:
            raise InvalidArgumentError(f"virtual_nodes must be >= 0, got {virtual_nodes}")
        self.virtual_nodes = virtual_nodes
        self.hash_fn = hash_fn

    def build_ring(self, cid_all: Collection[str]) -> tuple[list[int], list[str]]:
        """The ring as two parallel lists: sorted positions and the client owning each."""
        hash_fn = self.hash_fn
        owner_of: dict[int, str] = {}
        # Points per client still on the ring: a client listed twice continues its replica
        # numbering after the points it already has (Java getExistingReplicas).
        points: dict[str, int] = {}
        for cid in cid_all:
            existing = points.get(cid, 0)
            for r in range(self.virtual_nodes):
                pos = hash_fn(f"{cid}-{r + existing}")
                previous = owner_of.get(pos)
                if previous is not None:
                    points[previous] -= 1
                owner_of[pos] = cid
                points[cid] = points.get(cid, 0) + 1
        positions = sorted(owner_of)
        return positions, [owner_of[p] for p in positions]

    def allocate(
        self,
        consumer_group: str,
        current_cid: str,
        mq_all: list[MessageQueue],
        cid_all: list[str],
    ) -> list[MessageQueue]:
        if not _check(self.name, consumer_group, current_cid, mq_all, cid_all):
            return []
        positions, owners = self.build_ring(cid_all)
        if not positions:
            return []
        result: list[MessageQueue] = []
        for mq in mq_all:
            i = bisect.bisect_left(positions, self.hash_fn(str(mq)))
            owner = owners[i] if i < len(positions) else owners[0]
            if owner == current_cid:
                result.append(mq)
        return result

    def __repr__(self) -> str:
        return f"{type(self).__name__}(virtual_nodes={self.virtual_nodes})"

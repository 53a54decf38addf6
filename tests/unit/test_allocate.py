"""Allocation strategies: hand-computed cases, Java quirks, and partition properties."""

from __future__ import annotations

import hashlib
from collections.abc import Callable

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rmq_async.consumer.allocate import (
    AllocateAveragely,
    AllocateAveragelyByCircle,
    AllocateByConfig,
    AllocateByMachineRoom,
    AllocateConsistentHash,
    AllocateMachineRoomNearby,
    AllocateStrategy,
    md5_hash,
    sort_inputs,
)
from rmq_async.protocol.types import MessageQueue

GROUP = "g"


def queues(n: int, topic: str = "T", broker: str = "broker-a") -> list[MessageQueue]:
    return [MessageQueue(topic, broker, i) for i in range(n)]


def ids(mqs: list[MessageQueue]) -> list[int]:
    return [mq.queue_id for mq in mqs]


# ---------------------------------------------------------------------- sorting


def test_sort_inputs_orders_queues_by_topic_broker_then_numeric_queue_id() -> None:
    mqs = [
        MessageQueue("b", "x", 10),
        MessageQueue("a", "y", 0),
        MessageQueue("b", "x", 2),
        MessageQueue("a", "x", 5),
    ]
    sorted_mqs, _ = sort_inputs(mqs, ["c"])
    assert sorted_mqs == [
        MessageQueue("a", "x", 5),
        MessageQueue("a", "y", 0),
        MessageQueue("b", "x", 2),
        MessageQueue("b", "x", 10),
    ]


def test_sort_inputs_orders_client_ids_by_utf16_code_units() -> None:
    bmp_high = "\uffff"  # one UTF-16 unit 0xFFFF
    astral = "\U00010000"  # surrogate pair 0xD800 0xDC00: sorts first in Java
    assert bmp_high < astral  # Python compares code points
    _, cids = sort_inputs([MessageQueue("t", "b", 0)], [bmp_high, "a", astral])
    assert cids == ["a", astral, bmp_high]


def test_sort_inputs_accepts_any_iterable_and_returns_new_lists() -> None:
    mq_set = set(queues(3))
    mqs, cids = sort_inputs(mq_set, iter(["b", "a"]))
    assert mqs == queues(3)
    assert cids == ["a", "b"]


# ---------------------------------------------------------------------- argument checks


ALL_CHECKING: list[Callable[[], AllocateStrategy]] = [
    AllocateAveragely,
    AllocateAveragelyByCircle,
    lambda: AllocateByMachineRoom({"r"}),
    AllocateConsistentHash,
    lambda: AllocateMachineRoomNearby(AllocateAveragely(), _PrefixRooms()),
]


@pytest.mark.parametrize("make", ALL_CHECKING)
def test_empty_inputs_raise_value_error(make: Callable[[], AllocateStrategy]) -> None:
    s = make()
    with pytest.raises(ValueError, match="client id"):
        s.allocate(GROUP, "", queues(2), ["a"])
    with pytest.raises(ValueError, match="mq_all"):
        s.allocate(GROUP, "a", [], ["a"])
    with pytest.raises(ValueError, match="cid_all"):
        s.allocate(GROUP, "a", queues(2), [])


@pytest.mark.parametrize("make", ALL_CHECKING)
def test_client_not_in_group_gets_nothing(make: Callable[[], AllocateStrategy]) -> None:
    assert make().allocate(GROUP, "r-zz", queues(4), ["r-a", "r-b"]) == []


def test_strategies_satisfy_the_protocol() -> None:
    for make in ALL_CHECKING:
        assert isinstance(make(), AllocateStrategy)
    assert isinstance(AllocateByConfig([]), AllocateStrategy)


# ---------------------------------------------------------------------- AVG


def test_avg_eight_queues_three_clients() -> None:
    s = AllocateAveragely()
    cids = ["c0", "c1", "c2"]
    mqs = queues(8)
    # 8 = 3 + 3 + 2: the first 8 % 3 = 2 clients get one more, blocks are contiguous.
    assert ids(s.allocate(GROUP, "c0", mqs, cids)) == [0, 1, 2]
    assert ids(s.allocate(GROUP, "c1", mqs, cids)) == [3, 4, 5]
    assert ids(s.allocate(GROUP, "c2", mqs, cids)) == [6, 7]
    assert s.name == "AVG"


def test_avg_more_clients_than_queues() -> None:
    s = AllocateAveragely()
    cids = ["c0", "c1", "c2", "c3"]
    mqs = queues(2)
    assert ids(s.allocate(GROUP, "c0", mqs, cids)) == [0]
    assert ids(s.allocate(GROUP, "c1", mqs, cids)) == [1]
    assert s.allocate(GROUP, "c2", mqs, cids) == []
    assert s.allocate(GROUP, "c3", mqs, cids) == []


def test_avg_even_split() -> None:
    s = AllocateAveragely()
    cids = ["a", "b"]
    assert ids(s.allocate(GROUP, "b", queues(4), cids)) == [2, 3]


def test_avg_takes_the_lists_as_given() -> None:
    # The caller sorts; an unsorted client list gives Java's answer for that same list.
    s = AllocateAveragely()
    assert ids(s.allocate(GROUP, "a", queues(4), ["b", "a"])) == [2, 3]


# ---------------------------------------------------------------------- AVG_BY_CIRCLE


def test_avg_by_circle_round_robin() -> None:
    s = AllocateAveragelyByCircle()
    cids = ["c0", "c1", "c2"]
    mqs = queues(8)
    assert ids(s.allocate(GROUP, "c0", mqs, cids)) == [0, 3, 6]
    assert ids(s.allocate(GROUP, "c1", mqs, cids)) == [1, 4, 7]
    assert ids(s.allocate(GROUP, "c2", mqs, cids)) == [2, 5]
    assert ids(s.allocate(GROUP, "c2", queues(2), cids)) == []
    assert s.name == "AVG_BY_CIRCLE"


# ---------------------------------------------------------------------- CONFIG


def test_by_config_returns_the_configured_queues_without_checks() -> None:
    fixed = [MessageQueue("X", "b", 7), MessageQueue("X", "b", 1)]
    s = AllocateByConfig(fixed)
    assert s.allocate(GROUP, "anyone", queues(3), ["other"]) == fixed
    assert s.allocate(GROUP, "", [], []) == fixed
    out = s.allocate(GROUP, "a", queues(1), ["a"])
    out.clear()  # the strategy hands out copies
    assert s.allocate(GROUP, "a", queues(1), ["a"]) == fixed
    assert s.name == "CONFIG"


# ---------------------------------------------------------------------- MACHINE_ROOM


def test_by_machine_room_filters_and_splits() -> None:
    mqs = [
        *queues(3, broker="room1@b1"),
        *queues(2, broker="room2@b2"),
        *queues(2, broker="room1@b3"),
        *queues(1, broker="plain"),
        *queues(1, broker="room1@b4@x"),
    ]
    s = AllocateByMachineRoom({"room1"})
    cids = ["a", "b"]
    # Matching: b1q0 b1q1 b1q2 b3q0 b3q1 (5); 5 // 2 = 2 each, remainder 1 to client 0,
    # taken from index 0 + 2 * 2 = 4.
    a = s.allocate(GROUP, "a", mqs, cids)
    b = s.allocate(GROUP, "b", mqs, cids)
    assert [(q.broker_name, q.queue_id) for q in a] == [
        ("room1@b1", 0),
        ("room1@b1", 1),
        ("room1@b3", 1),
    ]
    assert [(q.broker_name, q.queue_id) for q in b] == [("room1@b1", 2), ("room1@b3", 0)]
    assert s.name == "MACHINE_ROOM"


def test_by_machine_room_uses_java_split_rules() -> None:
    # Java "x@".split("@") drops the trailing empty part (1 part); "x@y@" keeps 2 parts.
    mqs = [
        MessageQueue("T", "room1@", 0),
        MessageQueue("T", "room1@b@", 0),
        MessageQueue("T", "@room1", 0),
    ]
    got = AllocateByMachineRoom({"room1", ""}).allocate(GROUP, "a", mqs, ["a"])
    assert [q.broker_name for q in got] == ["room1@b@", "@room1"]


# ---------------------------------------------------------------------- MACHINE_ROOM_NEARBY


class _PrefixRooms:
    """Room = text before the first '-' of the broker name / client id."""

    def broker_room(self, mq: MessageQueue) -> str:
        return mq.broker_name.split("-")[0]

    def consumer_room(self, cid: str) -> str:
        return cid.split("-")[0]


def test_machine_room_nearby_prefers_own_room_and_shares_orphan_rooms() -> None:
    mqs = [
        *queues(2, broker="bj-b3"),
        *queues(4, broker="hz-b1"),
        *queues(2, broker="sh-b2"),
    ]
    cids = ["hz-c1", "hz-c2", "sh-c3"]
    s = AllocateMachineRoomNearby(AllocateAveragely(), _PrefixRooms())
    assert s.name == "MACHINE_ROOM_NEARBY-AVG"

    def got(cid: str) -> list[tuple[str, int]]:
        return [(q.broker_name, q.queue_id) for q in s.allocate(GROUP, cid, mqs, cids)]

    # hz: its 4 queues split by AVG between hz-c1 and hz-c2; bj has no client, so its 2
    # queues are split by AVG among all three clients (c1 gets bj q0, c2 gets bj q1).
    assert got("hz-c1") == [("hz-b1", 0), ("hz-b1", 1), ("bj-b3", 0)]
    assert got("hz-c2") == [("hz-b1", 2), ("hz-b1", 3), ("bj-b3", 1)]
    assert got("sh-c3") == [("sh-b2", 0), ("sh-b2", 1)]


def test_machine_room_nearby_rejects_empty_rooms() -> None:
    class Blank(_PrefixRooms):
        def consumer_room(self, cid: str) -> str:
            return ""

    s = AllocateMachineRoomNearby(AllocateAveragely(), Blank())
    with pytest.raises(ValueError, match="client id"):
        s.allocate(GROUP, "hz-a", queues(1, broker="hz-b"), ["hz-a"])
    s2 = AllocateMachineRoomNearby(AllocateAveragely(), _PrefixRooms())
    with pytest.raises(ValueError, match="queue"):
        s2.allocate(GROUP, "hz-a", queues(1, broker="-b"), ["hz-a"])


def test_machine_room_nearby_orphan_rooms_in_java_string_order() -> None:
    # Two rooms without clients: "b" is handled before "c" whatever the queue order.
    mqs = [*queues(1, broker="c-x"), *queues(1, broker="b-x"), *queues(1, broker="a-x")]
    s = AllocateMachineRoomNearby(AllocateByConfigEcho(), _PrefixRooms())
    got = s.allocate(GROUP, "a-1", mqs, ["a-1"])
    assert [q.broker_name for q in got] == ["a-x", "b-x", "c-x"]


class AllocateByConfigEcho:
    """Inner strategy returning every queue it is given (shows the call order)."""

    name = "ECHO"

    def allocate(
        self, consumer_group: str, current_cid: str, mq_all: list[MessageQueue],
        cid_all: list[str],
    ) -> list[MessageQueue]:
        return list(mq_all)


# ---------------------------------------------------------------------- CONSISTENT_HASH


def test_md5_hash_matches_java_reference_value() -> None:
    # Value computed with the JDK implementation (protocol reference, section 9.2).
    assert md5_hash("127.0.0.1@1234#5678-0") == 3311031524


def test_md5_hash_is_first_four_digest_bytes_unsigned() -> None:
    for key in ["", "a", "MessageQueue [topic=T, brokerName=b, queueId=0]", "ü€"]:
        digest = hashlib.md5(key.encode("utf-8")).digest()
        expected = (digest[0] << 24) | (digest[1] << 16) | (digest[2] << 8) | digest[3]
        assert md5_hash(key) == expected
        assert 0 <= md5_hash(key) < 2**32


def table_hash(table: dict[str, int]) -> Callable[[str], int]:
    def h(key: str) -> int:
        return table[key]

    return h


def test_consistent_hash_ring_lookup_with_ties_and_wrap() -> None:
    mqs = queues(4)
    table = {"A-0": 100, "B-0": 200}
    table.update({str(mqs[0]): 50, str(mqs[1]): 150, str(mqs[2]): 250, str(mqs[3]): 100})
    s = AllocateConsistentHash(virtual_nodes=1, hash_fn=table_hash(table))
    # q0 -> 100 (A); q1 -> 200 (B); q2 above every point wraps to 100 (A);
    # q3 exactly on A's point belongs to A.
    assert ids(s.allocate(GROUP, "A", mqs, ["A", "B"])) == [0, 2, 3]
    assert ids(s.allocate(GROUP, "B", mqs, ["A", "B"])) == [1]
    assert s.name == "CONSISTENT_HASH"


def test_consistent_hash_later_point_overwrites_same_position() -> None:
    mqs = queues(3)
    table = {"A-0": 100, "B-0": 100}
    table.update({str(mq): 10 * mq.queue_id for mq in mqs})
    s = AllocateConsistentHash(virtual_nodes=1, hash_fn=table_hash(table))
    assert s.allocate(GROUP, "A", mqs, ["A", "B"]) == []
    assert ids(s.allocate(GROUP, "B", mqs, ["A", "B"])) == [0, 1, 2]


def test_consistent_hash_duplicate_client_continues_replica_numbering() -> None:
    seen: list[str] = []

    def h(key: str) -> int:
        seen.append(key)
        return len(seen)

    s = AllocateConsistentHash(virtual_nodes=2, hash_fn=h)
    s.build_ring(["A", "A", "B"])
    assert seen == ["A-0", "A-1", "A-2", "A-3", "B-0", "B-1"]


def test_consistent_hash_zero_virtual_nodes_allocates_nothing() -> None:
    s = AllocateConsistentHash(virtual_nodes=0)
    assert s.allocate(GROUP, "a", queues(3), ["a"]) == []
    with pytest.raises(ValueError):
        AllocateConsistentHash(virtual_nodes=-1)


def reference_consistent_owner(
    mq: MessageQueue, cids: list[str], v: int, h: Callable[[str], int]
) -> str:
    """Straight-line restatement of the Java ring: positions overwritten in insertion order,
    owner = smallest position >= hash(mq), else the smallest position overall."""
    ring: dict[int, str] = {}
    for cid in cids:
        for r in range(v):
            ring[h(f"{cid}-{r}")] = cid
    target = h(str(mq))
    at_or_after = [p for p in ring if p >= target]
    return ring[min(at_or_after)] if at_or_after else ring[min(ring)]


def test_consistent_hash_default_md5_matches_reference_ring() -> None:
    mqs = [MessageQueue("TopicTest", f"broker-{b}", q) for b in "ab" for q in range(8)]
    cids = [f"10.0.0.{i}@{1000 + i}#{i}" for i in range(5)]
    s = AllocateConsistentHash()
    for cid in cids:
        expected = [mq for mq in mqs if reference_consistent_owner(mq, cids, 10, md5_hash) == cid]
        assert s.allocate(GROUP, cid, mqs, cids) == expected


# ---------------------------------------------------------------------- properties


unique_cids = st.lists(
    st.text(alphabet="abcdefghij@#.0123456789", min_size=1, max_size=12),
    min_size=1,
    max_size=16,
    unique=True,
)


def partition_check(strategy: AllocateStrategy, n_queues: int, n_brokers: int,
                    cids: list[str]) -> dict[str, list[MessageQueue]]:
    mq_all = [MessageQueue("T", f"b{b}", q) for b in range(n_brokers) for q in range(n_queues)]
    mqs, sorted_cids = sort_inputs(mq_all, cids)
    parts = {cid: strategy.allocate(GROUP, cid, mqs, sorted_cids) for cid in sorted_cids}
    flat = [mq for part in parts.values() for mq in part]
    assert len(flat) == len(set(flat)), "a queue was given to two clients"
    assert set(flat) == set(mqs), "a queue was given to nobody"
    return parts


@settings(max_examples=150, deadline=None)
@given(st.integers(1, 40), st.integers(1, 3), unique_cids)
def test_avg_partitions_contiguously_and_evenly(n: int, brokers: int, cids: list[str]) -> None:
    parts = partition_check(AllocateAveragely(), n, brokers, cids)
    sizes = [len(p) for p in parts.values()]
    assert max(sizes) - min(sizes) <= 1
    mqs, _ = sort_inputs([q for p in parts.values() for q in p], [])
    # Concatenating the parts in client order gives back the sorted queue list.
    assert [q for p in parts.values() for q in p] == mqs


@settings(max_examples=150, deadline=None)
@given(st.integers(1, 40), st.integers(1, 3), unique_cids)
def test_avg_by_circle_partitions(n: int, brokers: int, cids: list[str]) -> None:
    parts = partition_check(AllocateAveragelyByCircle(), n, brokers, cids)
    sizes = [len(p) for p in parts.values()]
    assert max(sizes) - min(sizes) <= 1


@settings(max_examples=100, deadline=None)
@given(st.integers(1, 40), st.integers(1, 3), unique_cids, st.integers(1, 12))
def test_consistent_hash_partitions(n: int, brokers: int, cids: list[str], v: int) -> None:
    partition_check(AllocateConsistentHash(virtual_nodes=v), n, brokers, cids)


@settings(max_examples=100, deadline=None)
@given(
    st.lists(st.sampled_from(["hz", "sh", "bj", "gz"]), min_size=1, max_size=4, unique=True),
    st.lists(st.tuples(st.sampled_from(["hz", "sh", "bj", "gz"]), st.integers(0, 9)),
             min_size=1, max_size=10, unique=True),
)
def test_machine_room_nearby_partitions(broker_rooms: list[str],
                                        clients: list[tuple[str, int]]) -> None:
    mq_all = [MessageQueue("T", f"{room}-b", q) for room in broker_rooms for q in range(3)]
    cids = [f"{room}-{i}" for room, i in clients]
    mqs, sorted_cids = sort_inputs(mq_all, cids)
    s = AllocateMachineRoomNearby(AllocateAveragely(), _PrefixRooms())
    parts = {cid: s.allocate(GROUP, cid, mqs, sorted_cids) for cid in sorted_cids}
    flat = [q for p in parts.values() for q in p]
    assert len(flat) == len(set(flat))
    assert set(flat) == set(mqs)
    client_rooms = {room for room, _ in clients}
    for cid, part in parts.items():
        for q in part:
            room = q.broker_name.split("-")[0]
            # A queue of a room that has clients never leaves that room.
            assert room == cid.split("-")[0] or room not in client_rooms

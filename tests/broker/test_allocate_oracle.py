"""The allocation strategies and sorting against the Java client's own classes.

tests/java/AllocateOracle.java runs the real Java strategies (from the RocketMQ Maven jars of
the dev broker) on generated cases; every answer must equal ours, queue for queue. No broker
process is needed, only the jars and a JDK, but it shares the broker tests' requirements.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from rmq_async.consumer.allocate import (
    AllocateAveragely,
    AllocateAveragelyByCircle,
    AllocateByMachineRoom,
    AllocateConsistentHash,
    AllocateMachineRoomNearby,
    AllocateStrategy,
    sort_inputs,
)
from rmq_async.devbroker.java import compile_java, run_java
from rmq_async.devbroker.maven import ensure_jars
from rmq_async.protocol.types import MessageQueue, java_string_sort_key

pytestmark = pytest.mark.broker

SOURCE = Path(__file__).resolve().parent.parent / "java" / "AllocateOracle.java"
OUTSIDER = "zz-outsider@1"


class PrefixRooms:
    """Same resolver as the Java program: room = text before the first '-'."""

    def broker_room(self, mq: MessageQueue) -> str:
        return mq.broker_name.split("-", 1)[0]

    def consumer_room(self, cid: str) -> str:
        return cid.split("-", 1)[0]


@dataclass
class Case:
    strategy: str
    param: str
    mqs: list[MessageQueue]
    cids: list[str]
    asks: list[str] = field(default_factory=list)

    def ours(self) -> AllocateStrategy:
        if self.strategy == "AVG":
            return AllocateAveragely()
        if self.strategy == "AVG_BY_CIRCLE":
            return AllocateAveragelyByCircle()
        if self.strategy == "CONSISTENT_HASH":
            return AllocateConsistentHash(virtual_nodes=int(self.param))
        if self.strategy == "MACHINE_ROOM":
            return AllocateByMachineRoom(self.param.split(","))
        return AllocateMachineRoomNearby(AllocateAveragely(), PrefixRooms())


ROOMS = ["hz", "sh", "bj", "gz"]
TOPICS = ["TopicTest", "orders", "%RETRY%grp", "T_x-1"]
ODD_CHARS = ["ü", "\uffff", "\U0001f600", "Z", "a", "é"]


def gen_cases(seed: int, count: int) -> list[Case]:
    rnd = random.Random(seed)
    cases: list[Case] = []
    strategies = ["AVG", "AVG_BY_CIRCLE", "CONSISTENT_HASH", "MACHINE_ROOM", "MACHINE_ROOM_NEARBY"]
    for i in range(count):
        strategy = strategies[i % len(strategies)]
        param = ""
        if strategy == "CONSISTENT_HASH":
            param = str(rnd.randint(1, 12))
        elif strategy == "MACHINE_ROOM":
            param = ",".join(rnd.sample(ROOMS, rnd.randint(1, 3)))
        mq_set: set[MessageQueue] = set()
        for _ in range(rnd.randint(1, 40)):
            room = rnd.choice(ROOMS)
            if strategy == "MACHINE_ROOM":
                broker = rnd.choice([f"{room}@b{rnd.randint(0, 3)}", f"plain{rnd.randint(0, 2)}",
                                     f"{room}@x@y", f"{room}@"])
            elif strategy == "MACHINE_ROOM_NEARBY":
                broker = f"{room}-broker{rnd.randint(0, 2)}"
            else:
                broker = rnd.choice(["broker-a", "broker-b", "broker-c", "Broker-a", "brok"])
            mq_set.add(MessageQueue(rnd.choice(TOPICS), broker, rnd.randint(0, 31)))
        cid_set: set[str] = set()
        for _ in range(rnd.randint(1, 12)):
            ip = f"10.{rnd.randint(0, 255)}.{rnd.randint(0, 255)}.{rnd.randint(1, 254)}"
            cid = f"{ip}@{rnd.randint(1, 99999)}#{rnd.randint(0, 10**12)}"
            if rnd.random() < 0.3:
                cid += rnd.choice(ODD_CHARS)
            if strategy == "MACHINE_ROOM_NEARBY":
                cid = f"{rnd.choice(ROOMS)}-{cid}"
            cid_set.add(cid)
            if rnd.random() < 0.2:
                # Siblings differing only in a character whose UTF-16 order differs from its
                # code point order ("\uffff" vs an astral character).
                cid_set.update(cid + ch for ch in rnd.sample(ODD_CHARS, 3))
        mqs, cids = list(mq_set), list(cid_set)
        if i % 2 == 0:
            # What the rebalancer does; odd cases keep a random order (strategies take the
            # lists as given, in Java too).
            mqs, cids = sort_inputs(mqs, cids)
        else:
            rnd.shuffle(mqs)
            rnd.shuffle(cids)
        cases.append(Case(strategy, param, mqs, cids, [*cids, OUTSIDER]))
    # Argument errors.
    one = [MessageQueue("T", "hz-b", 0)]
    cases.append(Case("AVG", "", [], ["a"], ["a", ""]))
    cases.append(Case("CONSISTENT_HASH", "10", one, [], ["a"]))
    cases.append(Case("MACHINE_ROOM_NEARBY", "", [MessageQueue("T", "-b", 0)], ["hz-a"], ["hz-a"]))
    return cases


def render(cases: list[Case]) -> str:
    lines: list[str] = []
    for c in cases:
        lines.append(f"CASE\t{c.strategy}\t{c.param}")
        lines.extend(f"MQ\t{mq.topic}\t{mq.broker_name}\t{mq.queue_id}" for mq in c.mqs)
        lines.extend(f"CID\t{cid}" for cid in c.cids)
        lines.extend(f"ASK\t{a}" for a in c.asks)
        lines.append("END")
    return "\n".join(lines) + "\n"


def positions(text: str) -> list[int]:
    return [int(x) for x in text.split(",")] if text else []


async def test_strategies_and_sorting_match_the_java_client(tmp_path: Path) -> None:
    lib = await ensure_jars()
    classes = await compile_java([SOURCE], lib)
    cases = gen_cases(seed=20240611, count=400)
    spec = tmp_path / "cases.txt"
    spec.write_text(render(cases), encoding="utf-8")
    rc, out, err = await run_java(
        "AllocateOracle", [str(spec)], f"{classes}:{lib}/*", timeout=120.0
    )
    assert rc == 0, err[-4000:]

    checked = 0
    errors_seen = 0
    for line in out.splitlines():
        kind, case_no, *rest = line.split(" ", 3)
        c = cases[int(case_no)]
        if kind == "SORTMQ":
            order = sorted(range(len(c.mqs)), key=lambda i: c.mqs[i].java_sort_key())
            assert positions(rest[0] if rest else "") == order, f"case {case_no}: queue order"
            assert [c.mqs[i] for i in order] == sort_inputs(c.mqs, [])[0]
        elif kind == "SORTCID":
            order = sorted(range(len(c.cids)), key=lambda i: java_string_sort_key(c.cids[i]))
            assert positions(rest[0] if rest else "") == order, f"case {case_no}: client order"
            assert [c.cids[i] for i in order] == sort_inputs([], c.cids)[1]
        elif kind in ("ALLOC", "ERROR"):
            ask = c.asks[int(rest[0])]
            try:
                ours: list[MessageQueue] | str = c.ours().allocate("oracle_group", ask, c.mqs,
                                                                   c.cids)
            except ValueError:
                ours = "IllegalArgumentException"
            if kind == "ERROR":
                errors_seen += 1
                assert ours == rest[1], f"case {case_no} ({c.strategy}) for {ask!r}"
            else:
                assert isinstance(ours, list), f"case {case_no}: we raised, Java did not"
                theirs = [c.mqs[i] for i in positions(rest[1] if len(rest) > 1 else "")]
                assert ours == theirs, f"case {case_no} ({c.strategy} {c.param}) for {ask!r}"
            checked += 1
        else:
            raise AssertionError(f"unexpected output line {line!r}")
    expected_answers = sum(len(c.asks) for c in cases)
    assert checked == expected_answers
    assert errors_seen >= 4  # the argument-error cases really ran

"""The ``rmq-async`` command against the real broker: run with workers, lag, tail."""

from __future__ import annotations

import asyncio
import json
import os
import random
import re
import signal
import socket
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from rmq_async import ConsumeResult, Message, PushConsumer
from rmq_async.client.errors import MQBrokerError
from rmq_async.devbroker import LocalRocketMQ
from rmq_async.protocol.types import MessageExt, MessageQueue
from tests.helpers import (
    AdminClient,
    produce,
    simple_messages,
    unique,
    wait_until,
    wait_until_async,
)

pytestmark = pytest.mark.broker

ROOT = Path(__file__).resolve().parents[2]
RMQ_ASYNC = Path(sys.executable).parent / "rmq-async"


class Command:
    """A running ``rmq-async`` process whose stdout and stderr lines are collected."""

    def __init__(self, proc: asyncio.subprocess.Process) -> None:
        self.proc = proc
        self.out: list[str] = []
        self.err: list[str] = []
        assert proc.stdout is not None and proc.stderr is not None
        self._readers = [asyncio.create_task(self._read(proc.stdout, self.out)),
                         asyncio.create_task(self._read(proc.stderr, self.err))]

    @classmethod
    async def start(cls, *args: str, env: dict[str, str] | None = None) -> Command:
        assert RMQ_ASYNC.exists(), f"the console script is not installed: {RMQ_ASYNC}"
        proc = await asyncio.create_subprocess_exec(
            str(RMQ_ASYNC), *args, cwd=ROOT, stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
            env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})},
        )
        return cls(proc)

    @staticmethod
    async def _read(stream: asyncio.StreamReader, into: list[str]) -> None:
        while line := await stream.readline():
            into.append(line.decode(errors="replace").rstrip("\n"))

    async def wait(self, timeout: float) -> int:
        try:
            return await asyncio.wait_for(self.proc.wait(), timeout)
        finally:
            await self.close()

    async def close(self) -> None:
        if self.proc.returncode is None:
            self.proc.kill()
            await self.proc.wait()
        await asyncio.gather(*self._readers)

    def tail(self) -> str:
        return "\n".join(["--- stdout", *self.out[-40:], "--- stderr", *self.err[-60:]])


def _free_port_pair() -> int:
    # Below Linux's ephemeral range (32768 and up by default), where the suite's outgoing
    # connections take their ports between this check and the metrics servers' bind, and
    # below the dev broker's (from 20000), where other workers' brokers take theirs.
    rng = random.Random()
    for _ in range(200):
        port = rng.randrange(10000, 19999)
        try:
            for p in (port, port + 1):
                with socket.socket() as s:
                    s.bind(("0.0.0.0", p))
        except OSError:
            continue
        return port
    raise AssertionError("no two free ports in a row")


def _scrape(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as resp:
        return resp.read().decode()


async def _consumer_ids(admin: AdminClient, topic: str, group: str) -> list[str]:
    addr = await admin.instance.find_any_broker(topic)
    try:
        return await admin.instance.api.get_consumer_ids(addr, group)
    except MQBrokerError:
        return []


@pytest.mark.timeout(120)
async def test_run_two_workers_drains_on_sigterm(rocketmq: LocalRocketMQ, topic: str) -> None:
    """``rmq-async run examples.listener:consumer --workers 2``: both workers consume and serve
    their Prometheus metrics (``--metrics-port``, one port per worker); SIGTERM
    drains within the grace period (listener calls in flight finish) and exits 0; mqadmin
    consumerProgress then shows, per queue, the first offset never acknowledged: every
    acknowledged prefix persisted, nothing below it unconsumed."""
    ns, group, grace, n = rocketmq.namesrv_addr, unique("G_cli_run"), 10.0, 300
    port = _free_port_pair()
    cmd = await Command.start(
        "run", "examples.listener:consumer", "--workers", "2", "--grace", str(grace),
        "--metrics-port", str(port),
        env={"NAMESRV_ADDR": ns, "RMQ_TOPIC": topic, "RMQ_GROUP": group,
             "RMQ_LISTENER_DELAY": "0.1"},
    )
    line_re = re.compile(rf"^{re.escape(topic)}\[(\d+)\]@(\d+) .* pid=(\d+)$")

    def printed() -> list[tuple[int, int, int]]:
        return [(int(m[1]), int(m[2]), int(m[3])) for m in map(line_re.match, cmd.out) if m]

    try:
        async with AdminClient(ns) as admin:
            ids: list[str] = []

            async def two_members() -> bool:
                ids[:] = await _consumer_ids(admin, topic, group)
                return len(ids) == 2

            deadline = time.monotonic() + 60
            while not await two_members():
                assert cmd.proc.returncode is None, cmd.tail()
                assert time.monotonic() < deadline, cmd.tail()
                await asyncio.sleep(0.2)
        await produce(ns, topic, simple_messages(topic, n), batch=1, concurrency=8)
        await wait_until(lambda: len({p for _, _, p in printed()}) == 2 and len(printed()) >= 60,
                         60, what=f"both workers consuming\n{cmd.tail()}")
        # Each worker serves its own Prometheus endpoint: port + worker index.
        scraped = [await asyncio.to_thread(_scrape, p) for p in (port, port + 1)]
        for text in scraped:
            consumed = re.findall(rf'^rocketmq_consumer_messages_consumed_total{{[^}}]*group="{group}"'
                                  rf'[^}}]*}} (\S+)$', text, re.M)
            assert consumed, text[-2000:]
        at_signal = len(printed())
        t0 = time.monotonic()
        cmd.proc.send_signal(signal.SIGTERM)
        rc = await cmd.wait(grace + 10)
        took = time.monotonic() - t0
    finally:
        await cmd.close()
    assert rc == 0, cmd.tail()
    assert took < grace, f"drain took {took:.2f}s\n{cmd.tail()}"
    assert sum("cli.stopped" in ln for ln in cmd.err) == 2, cmd.tail()
    seen = printed()
    # Every line about the topic is whole (two workers write to one stdout).
    garbled = [ln for ln in cmd.out if topic in ln and not line_re.match(ln)]
    assert not garbled, garbled[:5]
    progress = await rocketmq.mqadmin("consumerProgress", "-g", group)
    rows = re.findall(rf"^{re.escape(topic[:40])}\S*\s+\S+\s+(\d+)\s+(\d+)\s+(\d+)\s+(-?\d+)\s",
                      progress, re.M)
    committed = {int(q): int(c) for q, _b, c, _d in rows}
    assert len(committed) == 8, progress
    by_queue: dict[int, set[int]] = {}
    owners: dict[int, set[int]] = {}
    for q, off, pid in seen:
        by_queue.setdefault(q, set()).add(off)
        owners.setdefault(q, set()).add(pid)
    beyond = 0
    for q, upto in committed.items():
        got = by_queue.get(q, set())
        first_gap = next(k for k in range(len(got) + 1) if k not in got)
        # Nothing below the committed offset went unconsumed (no message lost) ...
        assert upto <= first_gap, (q, upto, first_gap)
        # ... and every acknowledged prefix was persisted: the committed offset is the first
        # offset never acknowledged (a queue that moved between the workers may have been
        # acknowledged by its former owner beyond where the new one stopped).
        if len(owners.get(q, ())) == 1:
            assert upto == first_gap, (q, upto, sorted(got)[:first_gap + 3])
        beyond += sum(1 for off in got if off >= upto)
    print(f"\nrun --workers 2: {len(seen)} lines ({at_signal} at SIGTERM), drained in "
          f"{took:.2f}s (grace {grace:.0f}s), committed {sum(committed.values())}/{n}, "
          f"{beyond} acknowledged above a gap (redelivered later)")


@pytest.mark.timeout(90)
async def test_run_ends_when_the_app_stops_itself(rocketmq: LocalRocketMQ, topic: str) -> None:
    """A handler calls ``app.stop()``: the consumers stop, and ``rmq-async run`` ends with
    status 0 instead of running on with nothing to run (and a supervisor sees it end)."""
    ns, group = rocketmq.namesrv_addr, unique("G_cli_self_stop")
    cmd = await Command.start(
        "run", "tests.broker.self_stopping_app:app", "--grace", "10",
        env={"NAMESRV_ADDR": ns, "RMQ_TOPIC": topic, "RMQ_GROUP": group},
    )
    try:
        await produce(ns, topic, simple_messages(topic, 3), batch=1)
        await wait_until(lambda: sum(ln.startswith("got ") for ln in cmd.out) >= 3, 60,
                         what=f"the first messages\n{cmd.tail()}")
        assert cmd.proc.returncode is None, cmd.tail()
        await produce(ns, topic, [Message(topic, b"stop")])
        rc = await cmd.wait(30)
    finally:
        await cmd.close()
    assert rc == 0, cmd.tail()
    assert any("cli.app_stopped_itself" in ln for ln in cmd.err), cmd.tail()


@pytest.mark.timeout(90)
async def test_lag_prints_the_brokers_offsets(rocketmq: LocalRocketMQ, topic: str) -> None:
    ns, group = rocketmq.namesrv_addr, unique("G_cli_lag")
    await produce(ns, topic, simple_messages(topic, 40), batch=1, concurrency=8)
    got: list[MessageExt] = []
    consumer = PushConsumer(group, namesrv=ns, consume_from_where="CONSUME_FROM_FIRST_OFFSET")

    async def keep(msgs: list[MessageExt]) -> ConsumeResult:
        got.extend(msgs)
        return ConsumeResult.SUCCESS

    consumer.subscribe(topic, listener=keep)
    async with consumer:
        await wait_until(lambda: len(got) >= 40, 30, what="40 messages")
    await produce(ns, topic, simple_messages(topic, 12), batch=1, concurrency=4)
    async with AdminClient(ns) as admin:
        maxes: dict[MessageQueue, int] = {}

        async def indexed() -> bool:
            # The broker indexes a message a moment after the send returns.
            maxes.update(await admin.max_offsets(topic))
            return sum(maxes.values()) == 52

        await wait_until_async(indexed, 30, what="52 messages indexed")
        committed = await admin.committed_offsets(group, topic)
    cmd = await Command.start("lag", group, "--namesrv", ns, "--json")
    assert await cmd.wait(30) == 0, cmd.tail()
    doc = json.loads("\n".join(cmd.out))
    rows = [r for r in doc["queues"] if r["topic"] == topic]
    assert len(rows) == 8
    for r in rows:
        mq = next(q for q in maxes if q.queue_id == r["queue_id"])
        assert (r["broker_offset"], r["consumer_offset"]) == (maxes[mq], committed[mq])
        assert r["diff"] == maxes[mq] - committed[mq]
    assert sum(r["diff"] for r in rows) == 12
    table = await Command.start("lag", group, "--namesrv", ns, "--topic", topic)
    assert await table.wait(30) == 0, table.tail()
    assert table.out[0].split() == ["TOPIC", "BROKER", "QUEUE", "BROKER_OFFSET",
                                    "CONSUMER_OFFSET", "DIFF", "LAST_CONSUMED_UTC"]
    assert len(table.out) == 1 + 8 + 1 and table.out[-1] == "TOTAL DIFF: 12", table.tail()
    missing = await Command.start("lag", unique("G_never"), "--namesrv", ns)
    assert await missing.wait(30) == 1  # a failure, not a usage error
    assert any("has no consumption progress" in ln for ln in missing.err), missing.tail()


async def test_lag_of_a_group_that_has_committed_nothing_asks_who_is_online(
        rocketmq: LocalRocketMQ, topic: str) -> None:
    """The brokers know no offset of a new group: its lag is an empty table while a client
    consumes in clustering mode, a failure while it broadcasts or once nobody is online (the
    broker's GET_CONSUMER_CONNECTION_LIST answer, as Java's examineConsumeStats reads it)."""
    from rmq_async.cli.common import CommandFailed
    from rmq_async.cli.lag import group_lag

    ns = rocketmq.namesrv_addr

    async def idle(msgs: list[MessageExt]) -> ConsumeResult:
        return ConsumeResult.SUCCESS

    async def lag_when_routed(group: str) -> list[object]:
        # The group's retry topic is created by its first heartbeat and routed from then on.
        deadline = time.monotonic() + 30
        while True:
            try:
                return list(await group_lag(ns, group))
            except CommandFailed as exc:
                if "no consumption progress" not in str(exc) or time.monotonic() > deadline:
                    raise
            await asyncio.sleep(0.5)

    # Its pulls of the empty queues are held for a minute: no NO_NEW_MSG answer moves an
    # offset into its store (which stop() would commit) while the test runs.
    clustering = PushConsumer(unique("G_lag_new"), namesrv=ns, broker_suspend_max_time=60.0,
                              consumer_timeout_when_suspend=75.0)
    clustering.subscribe(topic, listener=idle)
    async with clustering:  # the topic is empty: nothing is consumed, nothing committed
        assert await lag_when_routed(clustering.group) == []
    with pytest.raises(CommandFailed, match="no consumer of the group is online"):
        await group_lag(ns, clustering.group)

    broadcasting = PushConsumer(unique("G_lag_bc"), namesrv=ns, message_model="BROADCASTING")
    broadcasting.subscribe(topic, listener=idle)
    async with broadcasting:
        with pytest.raises(CommandFailed, match="broadcasting mode"):
            await lag_when_routed(broadcasting.group)


@pytest.mark.timeout(90)
async def test_tail_prints_new_messages_and_exits_0_on_ctrl_c(rocketmq: LocalRocketMQ,
                                                                topic: str) -> None:
    ns = rocketmq.namesrv_addr
    await produce(ns, topic, simple_messages(topic, 3, prefix="old"), batch=1)
    cmd = await Command.start("tail", topic, "--namesrv", ns, "--json")
    try:
        await wait_until(lambda: any("tail.ready" in ln for ln in cmd.err), 30,
                         what=f"tail ready\n{cmd.tail()}")
        placed = await produce(ns, topic, simple_messages(topic, 5, prefix="new"), batch=1)
        await wait_until(lambda: len(cmd.out) >= 5, 30, what=f"5 lines\n{cmd.tail()}")
        await asyncio.sleep(0.3)  # nothing else arrives
        cmd.proc.send_signal(signal.SIGINT)
        rc = await cmd.wait(15)
    finally:
        await cmd.close()
    assert rc == 0, cmd.tail()
    shown = [json.loads(ln) for ln in cmd.out]
    assert sorted(s["body"][:13] for s in shown) == [f"new{i:010d}" for i in range(5)]
    assert sorted((s["queue_id"], s["offset"]) for s in shown) == sorted(placed)
    assert all(s["topic"] == topic and s["keys"].startswith("new") for s in shown)


@pytest.mark.timeout(120)
async def test_tails_of_other_tags_share_the_fixed_group(rocketmq: LocalRocketMQ,
                                                         topic: str) -> None:
    """Two tails at once, both in the fixed group ``rmq_async_tail``: each gets every message
    of its own tags. The later tail's heartbeat makes its subscription (tags b) the group's on
    the broker; the earlier one still gets its tag-a messages because its pulls carry their
    own subscription."""
    ns = rocketmq.namesrv_addr
    tails = {}
    try:
        for tag in ("a", "b"):
            cmd = tails[tag] = await Command.start("tail", topic, "--namesrv", ns, "--json",
                                                   "--tags", tag)
            await wait_until(lambda c=cmd: any("tail.ready" in ln for ln in c.err), 30,
                             what=f"tail --tags {tag} ready\n{cmd.tail()}")
        await produce(ns, topic, simple_messages(topic, 4, tags="a", prefix="a")
                      + simple_messages(topic, 4, tags="b", prefix="b"), batch=1)
        for tag, cmd in tails.items():
            await wait_until(lambda c=cmd: len(c.out) >= 4, 30,
                             what=f"4 lines of tag {tag}\n{cmd.tail()}")
        await asyncio.sleep(0.5)  # nothing else arrives
        for cmd in tails.values():
            cmd.proc.send_signal(signal.SIGINT)
        codes = [await cmd.wait(15) for cmd in tails.values()]
    finally:
        for cmd in tails.values():
            await cmd.close()
    assert codes == [0, 0], [c.tail() for c in tails.values()]
    for tag, cmd in tails.items():
        shown = [json.loads(ln) for ln in cmd.out]
        assert sorted(s["body"][:11] for s in shown) == [f"{tag}{i:010d}" for i in range(4)]
        assert {s["tags"] for s in shown} == {tag}

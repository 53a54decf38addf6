"""Shared helpers for the broker tests: producing, reading back, waiting."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import gc
import socket
import time
import uuid
from collections.abc import Awaitable, Callable, Iterator, Sequence
from typing import Any

from rmq_async.client.api import SendResult
from rmq_async.client.instance import ClientInstance
from rmq_async.producer import Producer
from rmq_async.protocol.message import encode_batch, encode_properties
from rmq_async.protocol.types import Message, MessageExt, MessageQueue

#: JVM flags for the Java push consumers the tests start: the 2 s rebalance interval the tests
#: give rmq_async too. At Java's default (20 s) a start now and then stalls for 20 s: the
#: heartbeat that would carry the first rebalance's subscription version to the broker is
#: skipped while the client's scheduled heartbeat holds its lock ("lock heartBeat, but
#: failed" in the client log), and the broker refuses every pull (SUBSCRIPTION_NOT_LATEST)
#: until a later rebalance that changes something sends one.
JAVA_CONSUMER_FLAGS = ("-Drocketmq.client.rebalance.waitInterval=2000",)

#: JVM flags of the brokers a test module or test starts for itself (a cluster, an ACL or TLS
#: broker, another version, one to kill): C1 only, which saves each start ~3 CPU seconds of
#: C2 compiles on the 2-core test machine. They carry little traffic in ``make test``; the
#: shared session broker, which serves the heavy tests, and the benchmark's keep the JVM's
#: defaults.
SHORT_LIVED_BROKER_FLAGS = ("-XX:TieredStopAtLevel=1",)
#: Broker settings that go with ``SHORT_LIVED_BROKER_FLAGS``: the timer wheel off (no test of
#: these brokers sends timer messages). Its flush service compares the whole wheel (16 MiB at
#: the default three days) with its file byte by byte every second: about 0.03 CPU s with C2,
#: but 0.3 with C1 alone, a third of a core for every such broker alive.
SHORT_LIVED_BROKER_CONFIG = {"timerWheelEnable": "false"}
#: The send timeout of the producers that fill topics for a test (Java's default is 3 s). A
#: first send to a broker that has just started (C1 alone, TLS and ACL checks cold) once took
#: longer than 3 s on the two loaded cores of a full run; what these sends check is delivery.
TEST_SEND_TIMEOUT = 15.0


class NotAnException(BaseException):
    """A ``BaseException`` that is not an ``Exception``, as pytest's ``Failed`` raised by
    ``pytest.fail()`` in a listener, handler or write under test."""


async def send_batch_unchecked(producer: Producer, msgs: Sequence[Message], *,
                               queue: MessageQueue | None = None) -> SendResult:
    """Store ``msgs`` (of one topic) in one batch request as a client that checks nothing
    would, through the producer's request path past its checks: the producer refuses an
    empty body, as Java's does, but a consumer must take one that another client stored."""
    prepared = []
    for m in msgs:
        props = {**m.all_properties(), "WAIT": "true", "UNIQ_KEY": producer._unique_id(m)}
        prepared.append(Message(m.topic, bytes(m.body), properties=props, flag=m.flag))
    return await producer._send_with_retry(
        msgs[0].topic, queue, None, None, encode_batch(prepared),
        encode_properties({"WAIT": "true"}), 0, 0, batch=True,
        msg_id=",".join(m.properties["UNIQ_KEY"] for m in prepared))


@contextlib.contextmanager
def collector_off() -> Iterator[None]:
    """Python's cyclic garbage collector switched off inside (after a collection, so that
    nothing of earlier tests is left for it), as it was on the way out, then run once: what
    is freed inside is what the code under test freed itself."""
    gc.collect()
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()
        gc.collect()


def no_broker(monkeypatch: Any) -> None:
    """Starts reach no name server or broker: routes and heartbeats answer nothing."""
    async def route(self: ClientInstance, topic: str) -> None:
        return None

    async def heartbeats(self: ClientInstance) -> dict[str, bool]:
        return {}

    monkeypatch.setattr(ClientInstance, "update_route", route)
    monkeypatch.setattr(ClientInstance, "send_heartbeats", heartbeats)


def unique(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex[:10]}"


async def wait_until(predicate: Callable[[], bool], timeout: float, *, interval: float = 0.05,
                     what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        await asyncio.sleep(interval)


async def wait_until_async(predicate: Callable[[], Awaitable[bool]], timeout: float, *,
                           interval: float = 0.2, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not await predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        await asyncio.sleep(interval)


async def produce(namesrv: str, topic: str, messages: Sequence[Message], *,
                  batch: int = 64, concurrency: int = 4) -> list[tuple[int, int]]:
    """Send ``messages`` (batched, a few batches in flight) and return (queue_id, offset) of each."""
    placed: list[tuple[int, int]] = []
    async with Producer(unique("PG"), namesrv, send_timeout=TEST_SEND_TIMEOUT) as producer:
        sem = asyncio.Semaphore(concurrency)

        async def send_chunk(chunk: Sequence[Message]) -> None:
            async with sem:
                if len(chunk) == 1:
                    r = await producer.send(chunk[0])
                else:
                    r = await producer.send_batch(list(chunk))
                for i in range(len(chunk)):
                    placed.append((r.queue_id, r.queue_offset + i))

        chunks = [messages[i:i + batch] for i in range(0, len(messages), batch)]
        await asyncio.gather(*(send_chunk(c) for c in chunks))
    return placed


def simple_messages(topic: str, n: int, *, size: int = 100, tags: str | None = None,
                    prefix: str = "m") -> list[Message]:
    pad = b"x" * max(0, size - 16)
    return [Message(topic, f"{prefix}{i:010d}".encode() + pad[: max(0, size - 11)], tags=tags,
                    keys=[f"{prefix}{i}"])
            for i in range(n)]


class AdminClient:
    """Reads offsets straight from the broker for assertions."""

    def __init__(self, namesrv: str) -> None:
        self.instance = ClientInstance(namesrv, f"127.0.0.1@admin-{uuid.uuid4().hex[:8]}")

    async def __aenter__(self) -> AdminClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.instance.close()

    async def queues(self, topic: str) -> list[MessageQueue]:
        await self.instance.update_route(topic)
        return sorted(await self.instance.subscribe_queues(topic))

    async def max_offsets(self, topic: str) -> dict[MessageQueue, int]:
        out = {}
        for mq in await self.queues(topic):
            addr = await self.instance.find_broker_master(mq.broker_name, topic)
            out[mq] = await self.instance.api.get_max_offset(addr, mq)
        return out

    async def committed_offsets(self, group: str, topic: str) -> dict[MessageQueue, int]:
        from rmq_async.client.errors import MQBrokerError

        out = {}
        for mq in await self.queues(topic):
            addr = await self.instance.find_broker_master(mq.broker_name, topic)
            try:
                out[mq] = await self.instance.api.query_consumer_offset(addr, group, mq)
            except MQBrokerError:
                out[mq] = -1
        return out

    async def read_all(self, topic: str, *, group: str = "rmq_async_test_reader",
                       max_per_queue: int | None = None) -> list[MessageExt]:
        """Raw PULL_MESSAGE over every queue from offset 0 to the max offset."""
        msgs: list[MessageExt] = []
        for mq in await self.queues(topic):
            addr = await self.instance.find_broker_master(mq.broker_name, topic)
            end = await self.instance.api.get_max_offset(addr, mq)
            offset = 0
            while offset < end:
                r = await self.instance.api.pull_message(
                    addr, group=group, mq=mq, queue_offset=offset, max_msg_nums=32,
                    suspend_timeout=0.0, timeout=10.0, subscription="*",
                )
                got = r.decode()
                if not got and r.next_begin_offset <= offset:
                    break
                offset = r.next_begin_offset
                for m in got:
                    m.broker_name = mq.broker_name
                msgs.extend(got)
                if max_per_queue is not None and offset >= max_per_queue:
                    break
        return msgs


@dataclasses.dataclass
class PortRace:
    """What :func:`first_broker_port_taken` sees: the port it hands out taken, every broker port
    picked, and every log entry while it runs."""

    busy: int
    picks: list[int]
    logs: list[dict[str, Any]]

    @property
    def retries(self) -> list[dict[str, Any]]:
        """The dev broker's warnings of a start given up because a port was taken."""
        return [e for e in self.logs
                if e["event"] in ("devbroker.port_taken", "devbroker.cluster.port_taken")]

    def assert_retried_for_taken_ports(self) -> None:
        """The first start failed on the taken port and was made again on other ports; every
        further pick followed a start given up because a port was taken (between a real pick
        and the JVM's bind another test worker may take that one too)."""
        retries = self.retries
        assert self.picks[0] == self.busy, self.picks
        assert retries, "the taken port cost no second start"
        assert len(self.picks) == len(retries) + 1, (self.picks, retries)
        first = retries[0]
        assert self.busy in first.get("ports", [first.get("broker_port")]), first
        assert self.busy not in self.picks[1:], self.picks


@contextlib.contextmanager
def first_broker_port_taken(monkeypatch: Any) -> Iterator[PortRace]:
    """The dev broker's first broker port pick returns a port someone else listens on (as when
    another test worker takes it between the pick and the JVM's bind); later picks are real."""
    from structlog.testing import capture_logs

    from rmq_async.devbroker import config as cfg

    real = cfg.pick_broker_port
    with socket.socket() as taken, capture_logs() as logs:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        race = PortRace(taken.getsockname()[1], [], logs)

        def pick(**kw: Any) -> int:
            port = race.busy if not race.picks else real(**kw)
            race.picks.append(port)
            return port

        monkeypatch.setattr(cfg, "pick_broker_port", pick)
        yield race

"""``rmq-async tail`` / ``lag`` / ``broker`` and :class:`App` without a broker: a reader that
goes away, start and stop racing, a broker group whose master is down, the exit statuses."""

from __future__ import annotations

import asyncio
import contextlib
import io
import os
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import structlog

import rmq_async.cli.lag as lag_module
import rmq_async.cli.tail as tail_module
from rmq_async import App, IllegalStateError, PushConsumer
from rmq_async.cli import main
from rmq_async.cli.common import CommandFailed
from rmq_async.client.errors import MQBrokerError, NoRouteError
from rmq_async.consumer.listener import ListenerAdapter
from rmq_async.consumer.middleware import run_call
from rmq_async.consumer.options import ConsumeFromWhere, MessageModel
from rmq_async.consumer.results import ConsumeContext, ConsumeResult
from rmq_async.protocol.bodies import (
    BrokerData,
    ConsumerConnection,
    ConsumeStats,
    OffsetWrapper,
    TopicRouteData,
)
from rmq_async.protocol.codes import ResponseCode
from rmq_async.protocol.types import MessageExt, MessageQueue

NS = "127.0.0.1:9876"
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(autouse=True)
def _keep_logging_config() -> Iterator[None]:
    # main() configures structlog for the process; the suite's own set-up comes back after.
    saved = structlog.get_config()
    yield
    structlog.configure(**saved)


# ---------------------------------------------------------------------------------- tail

class FakeTailConsumer:
    """Stands for the tail's PushConsumer: hands an endless stream of messages to the listener
    through the real ListenerAdapter and run_call, as the consume service does (so a listener
    exception becomes a failed outcome, not a crash)."""

    made: list[FakeTailConsumer] = []

    def __init__(self, group: str, namesrv: str, **opts: Any) -> None:
        self.group, self.opts = group, opts
        self.mq = MessageQueue("T", "broker-a", 0)
        self.process_queues = {self.mq: object()}
        self.outcomes: list[ConsumeResult] = []
        mq = self.mq

        class Instance:
            async def subscribe_queues(self, topic: str) -> list[MessageQueue]:
                return [mq]

        self.instance = Instance()
        FakeTailConsumer.made.append(self)

    def subscribe(self, topic: str, tags: str = "*", listener: Any = None) -> None:
        self.adapter = ListenerAdapter(listener)

    async def _deliver(self) -> None:
        offset = 0
        while True:
            m = MessageExt(topic="T", body=b"hello", queue_id=0, queue_offset=offset,
                           store_timestamp=1_700_000_000_000)
            out = await run_call(self.adapter, [m], ConsumeContext(message_queue=self.mq),
                                 group=self.group, topic="T", queue=self.mq, orderly=False,
                                 middlewares=[])
            self.outcomes.append(out.result)
            offset += 1
            await asyncio.sleep(0.01)

    async def start(self) -> None:
        self.task = asyncio.create_task(self._deliver())

    async def stop(self, timeout: float = 30.0) -> None:
        self.task.cancel()


@pytest.fixture
def fake_tail_consumer(monkeypatch: pytest.MonkeyPatch) -> type[FakeTailConsumer]:
    FakeTailConsumer.made = []
    monkeypatch.setattr(tail_module, "PushConsumer", FakeTailConsumer)
    return FakeTailConsumer


class ClosedPipe(io.StringIO):
    def write(self, s: str) -> int:
        raise BrokenPipeError(32, "Broken pipe")

    def flush(self) -> None:
        raise BrokenPipeError(32, "Broken pipe")


async def test_tail_stops_with_status_0_when_its_reader_goes_away(
        fake_tail_consumer: type[FakeTailConsumer]) -> None:
    async with asyncio.timeout(5):
        rc = await tail_module.tail(NS, "T", out=ClosedPipe())
    assert rc == 0
    (consumer,) = fake_tail_consumer.made
    # The message that met the closed pipe is not a failed message (no redelivery, no log
    # line per message); nothing is printed after it.
    assert consumer.outcomes and set(consumer.outcomes) == {ConsumeResult.SUCCESS}


@pytest.mark.parametrize("sig", ["SIGINT", "SIGTERM", "SIGHUP"])
async def test_a_signal_while_tail_starts_ends_it_with_status_0(sig: str) -> None:
    """Ctrl-C (or SIGTERM, or SIGHUP: the terminal closed) while the name server does not
    answer: tail went on starting until the request timed out (3 s), then failed (status 1);
    a SIGHUP killed it."""
    import signal

    from tests.fake_broker import silent_listener

    assert getattr(signal, sig) in tail_module.STOP_SIGNALS
    async with silent_listener() as (addr, _):
        loop = asyncio.get_running_loop()
        loop.call_later(0.5, os.kill, os.getpid(), getattr(signal, sig))
        async with asyncio.timeout(10):
            rc = await tail_module.tail(addr, "T", out=io.StringIO())
    assert rc == 0


async def test_tail_points_a_closed_stream_at_devnull(
        fake_tail_consumer: type[FakeTailConsumer]) -> None:
    """As the Python docs advise: the buffered rest, and later writes, go to /dev/null."""
    r, w = os.pipe()
    os.close(r)  # the reader is gone before the first line
    out = os.fdopen(w, "w", encoding="utf-8")
    try:
        async with asyncio.timeout(5):
            assert await tail_module.tail(NS, "T", count=100, out=out) == 0
        out.write("more\n")
        out.flush()  # no BrokenPipeError: the descriptor now points at os.devnull
        assert os.path.samestat(os.fstat(w), os.stat(os.devnull))
    finally:
        out.close()


_PIPE_SCRIPT = """
import sys
sys.path.insert(0, {tests!r})
import rmq_async.cli.lag as lag_module
import rmq_async.cli.tail as tail_module
from rmq_async.cli import main
from rmq_async.cli.lag import QueueLag
from test_cli_commands import FakeTailConsumer

tail_module.PushConsumer = FakeTailConsumer

async def many_rows(namesrv, group, topic=None, **kw):
    return [QueueLag("T" * 40, "broker-a", i, 10 * i, i, 0) for i in range(20000)]

lag_module.group_lag = many_rows
sys.exit(main(sys.argv[1:]))
"""


@pytest.mark.parametrize("argv", [["tail", "T", "--namesrv", NS],
                                  ["lag", "G", "--namesrv", NS]])
def test_a_closed_stdout_ends_the_command_with_status_0_and_no_traceback(
        tmp_path: Path, argv: list[str]) -> None:
    """``rmq-async tail T | head -3`` (and ``lag G | head -3``) exit 0 once head is gone."""
    script = tmp_path / "pipe_cmd.py"
    script.write_text(_PIPE_SCRIPT.format(tests=str(Path(__file__).parent)))
    proc = subprocess.Popen([sys.executable, str(script), *argv], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert proc.stdout is not None and proc.stderr is not None
    lines = [proc.stdout.readline() for _ in range(3)]
    proc.stdout.close()  # `head -3` exits
    try:
        rc = proc.wait(timeout=20)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    err = proc.stderr.read().decode()
    proc.stderr.close()
    assert all(lines), lines
    assert rc == 0, err[-2000:]
    assert "Traceback" not in err and "Exception ignored" not in err, err[-2000:]


async def test_tail_uses_one_fixed_group_with_per_run_offsets(
        fake_tail_consumer: type[FakeTailConsumer]) -> None:
    """No group (and %RETRY% topic) created on the broker per run; each run still starts
    where its own options say (a fresh offset folder), and each pull carries its own
    subscription so tails of other tags in the same group do not filter it."""
    for from_beginning in (False, True):
        async with asyncio.timeout(5):
            await tail_module.tail(NS, "T", count=1, from_beginning=from_beginning,
                                   out=io.StringIO())
    first, second = fake_tail_consumer.made
    assert first.group == second.group == tail_module.TAIL_GROUP == "rmq_async_tail"
    for c in (first, second):
        assert c.opts["message_model"] == MessageModel.BROADCASTING
        assert c.opts["post_subscription_when_pull"] is True
    assert first.opts["consume_from_where"] == ConsumeFromWhere.LAST_OFFSET
    assert second.opts["consume_from_where"] == ConsumeFromWhere.FIRST_OFFSET
    assert first.opts["offset_store_dir"] != second.opts["offset_store_dir"]
    assert not await asyncio.to_thread(os.path.exists, first.opts["offset_store_dir"])  # gone
    # The options are the real consumer's.
    real = PushConsumer(tail_module.TAIL_GROUP, namesrv=NS,
                        **{k: v for k, v in first.opts.items() if k != "offset_store_dir"})
    assert real.options.post_subscription_when_pull is True


# ---------------------------------------------------------------------------------- App

class SlowStart(PushConsumer):
    """A consumer whose start takes a while (route look-ups, heartbeats, startup hooks)."""

    running = False

    async def start(self) -> None:
        await asyncio.sleep(0.2)
        self.running = True

    async def stop(self, timeout: Any = 30.0) -> None:
        self.running = False


async def test_app_stop_during_start_waits_and_stops_what_was_started() -> None:
    a, b = SlowStart("GA", namesrv=NS), SlowStart("GB", namesrv=NS)
    app = App(a, b)
    starting = asyncio.create_task(app.start())
    await asyncio.sleep(0.05)  # a is starting
    with pytest.raises(IllegalStateError, match="before the app starts"):
        app.add(SlowStart("GC", namesrv=NS))
    await app.stop()
    assert starting.done() and starting.exception() is None
    assert not app.is_running
    assert [c.running for c in app] == [False, False]
    await app.start()  # and it can start again
    assert app.is_running and [c.running for c in app] == [True, True]
    await app.stop()


async def test_app_stop_during_a_failing_start_returns_once_it_failed() -> None:
    class Refused(SlowStart):
        async def start(self) -> None:
            await asyncio.sleep(0.1)
            raise IllegalStateError("refused")

    a, b = SlowStart("GA", namesrv=NS), Refused("GB", namesrv=NS)
    app = App(a, b)
    starting = asyncio.create_task(app.start())
    await asyncio.sleep(0.05)
    await app.stop()
    assert starting.done()
    with pytest.raises(IllegalStateError, match="refused"):
        await starting
    assert not app.is_running and not a.running


async def test_a_stop_after_a_cancelled_one_stops_the_members_still_running() -> None:
    class SlowStop(SlowStart):
        async def stop(self, timeout: Any = 30.0) -> None:
            if self.running:
                await asyncio.sleep(0.3)  # listeners finishing, offsets persisted
                self.running = False

    a, b = SlowStop("GA", namesrv=NS), SlowStop("GB", namesrv=NS)
    app = App(a, b)
    await app.start()
    stopping = asyncio.create_task(app.stop())
    await asyncio.sleep(0.05)
    stopping.cancel()  # a drain cut short (the CLI's grace period), or a caller's timeout
    with pytest.raises(asyncio.CancelledError):
        await stopping
    assert [c.running for c in app] == [True, True]
    assert app.is_running  # not stopped yet: a second stop() has work to do
    await app.stop()
    assert [c.running for c in app] == [False, False] and not app.is_running


# ---------------------------------------------------------------------------------- lag

MASTER_A, SLAVE_B = "10.0.0.1:10911", "10.0.0.2:10911"


class FakeLagInstance:
    """ClientInstance for ``group_lag``: scripted routes and consume stats."""

    routes: dict[str, TopicRouteData] = {}
    stats: dict[str, dict[MessageQueue, OffsetWrapper]] = {}
    connections: dict[str, ConsumerConnection] = {}  # broker address -> its answer
    asked: list[str] = []
    route_lookups: list[str] = []

    def __init__(self, namesrv: str, cid: str, **kw: Any) -> None:
        from rmq_async.client.instance import parse_namesrv

        parse_namesrv(namesrv)
        outer = self

        class Api:
            async def get_consume_stats(self, addr: str, group: str,
                                        topic: str | None = None) -> ConsumeStats:
                outer.asked.append(addr)
                return ConsumeStats(dict(outer.stats.get(addr, {})))

            async def get_consumer_connection_list(self, addr: str,
                                                   group: str) -> ConsumerConnection:
                if addr not in outer.connections:
                    raise MQBrokerError(ResponseCode.CONSUMER_NOT_ONLINE,
                                        "the consumer group not online")
                return outer.connections[addr]

        self.api = Api()

    async def update_route(self, topic: str) -> TopicRouteData:
        self.route_lookups.append(topic)
        if topic not in self.routes:
            raise NoRouteError(topic)
        return self.routes[topic]

    async def close(self) -> None:
        pass


def _two_groups_b_master_down() -> TopicRouteData:
    return TopicRouteData(broker_datas=[
        BrokerData("c", "broker-a", {0: MASTER_A}),
        BrokerData("c", "broker-b", {1: SLAVE_B}),  # master down, its slave up
    ])


@pytest.fixture
def fake_lag(monkeypatch: pytest.MonkeyPatch) -> type[FakeLagInstance]:
    FakeLagInstance.routes, FakeLagInstance.stats = {}, {}
    FakeLagInstance.connections = {}
    FakeLagInstance.asked, FakeLagInstance.route_lookups = [], []
    monkeypatch.setattr(lag_module, "ClientInstance", FakeLagInstance)
    return FakeLagInstance


async def test_lag_asks_a_slave_when_the_master_is_down(fake_lag: type[FakeLagInstance]) -> None:
    fake_lag.routes = {"%RETRY%G": _two_groups_b_master_down()}
    fake_lag.stats = {MASTER_A: {MessageQueue("T", "broker-a", 0): OffsetWrapper(100, 90)},
                      SLAVE_B: {MessageQueue("T", "broker-b", 0): OffsetWrapper(5000, 100)}}
    rows = await lag_module.group_lag(NS, "G")
    assert sorted(fake_lag.asked) == [MASTER_A, SLAVE_B]
    assert [(r.broker, r.diff) for r in rows] == [("broker-a", 10), ("broker-b", 4900)]


async def test_lag_with_a_topic_falls_back_to_its_route(fake_lag: type[FakeLagInstance]) -> None:
    """No retry topic (a group whose offsets were committed by a source, say): with --topic
    the topic's route, then its pop retry topic's, locate the brokers (Java's order)."""
    fake_lag.routes = {"T": TopicRouteData(broker_datas=[BrokerData("c", "broker-a",
                                                                    {0: MASTER_A})])}
    fake_lag.stats = {MASTER_A: {MessageQueue("T", "broker-a", 0): OffsetWrapper(7, 3)}}
    rows = await lag_module.group_lag(NS, "G", "T")
    assert fake_lag.route_lookups == ["%RETRY%G", "T"]
    assert [(r.topic, r.diff) for r in rows] == [("T", 4)]
    assert lag_module.route_topics("G", "T") == ["%RETRY%G", "T", "%RETRY%G_T"]
    assert lag_module.route_topics("G") == ["%RETRY%G"]


async def test_lag_without_route_or_rows_is_a_failure_not_a_usage_error(
        fake_lag: type[FakeLagInstance]) -> None:
    with pytest.raises(CommandFailed, match="has no consumption progress"):
        await lag_module.group_lag(NS, "G", "T")
    assert fake_lag.route_lookups == ["%RETRY%G", "T", "%RETRY%G_T"]
    fake_lag.routes = {"%RETRY%G": _two_groups_b_master_down()}
    with pytest.raises(CommandFailed, match="offset table is empty and no consumer of the "
                                            "group is online"):
        await lag_module.group_lag(NS, "G")


async def test_an_empty_offset_table_is_an_answer_only_for_an_online_clustering_group(
        fake_lag: type[FakeLagInstance]) -> None:
    """Java's examineConsumeStats: with no queue in the answers, the group's connections
    decide. A clustering group with a client online has committed nothing yet: an empty
    table (exit 0). Broadcasting keeps its offsets in the clients: a failure."""
    fake_lag.routes = {"%RETRY%G": _two_groups_b_master_down()}
    fake_lag.connections = {SLAVE_B: ConsumerConnection(["10.0.0.1@1"], "CLUSTERING",
                                                        "CONSUME_PASSIVELY")}
    assert await lag_module.group_lag(NS, "G") == []
    assert lag_module.format_lag([]).splitlines()[-1] == "TOTAL DIFF: 0"
    fake_lag.connections = {MASTER_A: ConsumerConnection([], "CLUSTERING", ""),  # none here
                            SLAVE_B: ConsumerConnection(["10.0.0.1@1"], "BROADCASTING", "")}
    with pytest.raises(CommandFailed, match="broadcasting mode"):
        await lag_module.group_lag(NS, "G")


async def test_a_full_output_pipe_holds_the_listener_not_the_event_loop(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """tail wrote its lines on the event loop's thread: a reader that stopped reading (``|
    less``) blocked the whole loop in write(), signals, --seconds and heartbeats included."""
    import asyncio
    import os

    read_fd, write_fd = os.pipe()
    stdout = open(write_fd, "w")  # noqa: ASYNC230, SIM115 - the pipe as standard output
    monkeypatch.setattr(sys, "stdout", stdout)
    try:
        output = await tail_module._Output.open(sys.stdout)
        assert output._transport is not None  # a pipe: written through the event loop
        ticks = 0

        async def ticker() -> None:
            nonlocal ticks
            while True:
                await asyncio.sleep(0.01)
                ticks += 1

        async def writer() -> int:
            n = 0
            for _ in range(5_000):  # ~500 KB: far more than the pipe and the buffer hold
                if not await output.write("x" * 100):
                    break
                n += 1
            return n

        tick = asyncio.create_task(ticker())
        write = asyncio.create_task(writer())
        await asyncio.sleep(0.5)
        assert ticks >= 5 and not write.done()  # the loop ran (blocked: 0); the writer waits
        os.set_blocking(read_fd, False)
        got = 0
        async with asyncio.timeout(10):
            while not write.done():
                with contextlib.suppress(BlockingIOError):
                    got += len(os.read(read_fd, 65536))
                await asyncio.sleep(0)
        assert await write == 5_000
        gone = asyncio.Event()
        output.when_reader_gone(gone.set)
        os.close(read_fd)  # the reader goes away: noticed without a write
        async with asyncio.timeout(5):
            await gone.wait()
        async with asyncio.timeout(5):
            while await output.write("y"):
                await asyncio.sleep(0.01)
        tick.cancel()
        await output.aclose()
    finally:
        with contextlib.suppress(OSError):
            os.close(read_fd)
        with contextlib.suppress(OSError):
            stdout.close()


def test_tails_last_lines_reach_a_slow_reader(monkeypatch: pytest.MonkeyPatch) -> None:
    """Closing the output dropped what its transport still held (up to 64 KiB of the last
    lines) when the reader was slower than tail: the event loop ended right after."""
    import asyncio
    import os
    import threading
    import time

    read_fd, write_fd = os.pipe()
    stdout = open(write_fd, "w")  # noqa: SIM115 - the pipe as standard output
    monkeypatch.setattr(sys, "stdout", stdout)
    got = bytearray()

    def slow_reader() -> None:
        time.sleep(0.3)
        while chunk := os.read(read_fd, 4096):
            got.extend(chunk)
            time.sleep(0.002)

    async def write_and_close() -> None:  # what tail() does, its loop ending with it
        output = await tail_module._Output.open(sys.stdout)
        assert output._transport is not None
        for i in range(2_000):
            assert await output.write(f"line {i:05d} " + "x" * 100)
        await output.aclose()

    reader = threading.Thread(target=slow_reader)
    reader.start()
    try:
        asyncio.run(write_and_close())
        stdout.close()  # the last descriptor of the pipe's write end: the reader sees its end
        reader.join(10)
    finally:
        with contextlib.suppress(OSError):
            stdout.close()
        os.close(read_fd)
    lines = got.decode().splitlines()
    assert len(lines) == 2_000 and lines[-1].startswith("line 01999")


# ---------------------------------------------------------------------------------- exit status

def test_invalid_arguments_are_usage_errors(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["lag", "G", "--namesrv", "bogus"]) == 2
    assert "rmq-async: error: name server address must be host:port" in capsys.readouterr().err
    assert main(["tail", "T", "--namesrv", "bogus"]) == 2
    assert "host:port" in capsys.readouterr().err
    assert main(["tail", "%RETRY%x", "--namesrv", NS]) == 2
    assert "retry topic" in capsys.readouterr().err
    # Names no broker would create: before any network I/O (they reached the name server).
    for argv, said in ((["tail", ""], "blank"), (["tail", "a b"], "illegal characters"),
                       (["lag", ""], "blank"), (["lag", "G", "--topic", "a b"], "illegal")):
        assert main([*argv, "--namesrv", "127.0.0.1:1"]) == 2, argv
        assert said in capsys.readouterr().err, argv
    # A port outside 1-65535: an OverflowError traceback, or a connect to another port.
    for bad in ("127.0.0.1:99999", "localhost:99999", "127.0.0.1:0", "h:\u0663"):
        assert main(["lag", "G", "--namesrv", bad]) == 2, bad
        assert "port 1-65535" in capsys.readouterr().err, bad
        assert main(["tail", "T", "--namesrv", bad]) == 2, bad
        assert "port 1-65535" in capsys.readouterr().err, bad
    with pytest.raises(SystemExit) as exited:
        main(["run", "m:c", "--metrics-port", "70000"])
    assert exited.value.code == 2
    # Worker i serves on PORT + i: the last worker's port must be a port too, found before
    # any worker starts (the target is not even imported).
    assert main(["run", "no_such_module:c", "--metrics-port", "65534", "--workers", "3"]) == 2
    assert "worker 2 would serve on port 65536" in capsys.readouterr().err


def test_runtime_failures_exit_1(capsys: pytest.CaptureFixture[str],
                                 fake_lag: type[FakeLagInstance]) -> None:
    assert main(["lag", "G", "--namesrv", NS]) == 1
    assert "has no consumption progress" in capsys.readouterr().err


def test_broker_failures_exit_1_and_its_usage_errors_2(
        capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch,
        tmp_path: Path) -> None:
    from rmq_async.devbroker import cli as devbroker_cli
    from rmq_async.devbroker.errors import DevBrokerError

    monkeypatch.setenv("RMQ_ASYNC_STATE_FILE", str(tmp_path / "state.json"))
    assert main(["broker", "up", "--groups", "0"]) == 2
    assert "--groups and --namesrvs must be >= 1" in capsys.readouterr().err

    def broken(args: object) -> int:
        raise DevBrokerError("the broker did not start: see its log")

    monkeypatch.setattr(devbroker_cli, "cmd_status", broken)
    assert main(["broker", "status"]) == 1
    assert "the broker did not start" in capsys.readouterr().err
    with pytest.raises(SystemExit) as info:  # argparse's own errors stay 2
        main(["broker", "nonsense"])
    assert info.value.code == 2


def test_a_metrics_port_in_use_is_a_failure(capsys: pytest.CaptureFixture[str],
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("prometheus_client")
    from types import ModuleType

    mod = ModuleType("cli_metrics_target_mod")
    c = PushConsumer("g_metrics", namesrv=NS)
    c.subscribe("T", listener=lambda msgs: None)
    mod.consumer = c  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "cli_metrics_target_mod", mod)
    with socket.socket() as busy:
        busy.bind(("0.0.0.0", 0))
        busy.listen()
        port = busy.getsockname()[1]
        assert main(["run", "cli_metrics_target_mod:consumer", "--metrics-port", str(port)]) == 1
    assert f"cannot serve metrics on port {port}" in capsys.readouterr().err



def test_ctrl_c_in_lag_and_a_bad_worker_index_end_without_a_traceback(
        capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    async def interrupted(*a: Any, **kw: Any) -> Any:
        raise KeyboardInterrupt

    monkeypatch.setattr(lag_module, "group_lag", interrupted)
    assert main(["lag", "G", "--namesrv", NS]) == 130
    assert capsys.readouterr().err.strip() == "rmq-async: interrupted"
    monkeypatch.setenv("RMQ_ASYNC_WORKER", "first")
    assert main(["run", "m:c"]) == 2
    assert "RMQ_ASYNC_WORKER='first' is not a worker index" in capsys.readouterr().err

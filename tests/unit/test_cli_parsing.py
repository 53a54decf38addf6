"""The ``rmq-async`` command without a broker: targets, output formats, usage errors."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType, SimpleNamespace
from typing import Any

import pytest
import structlog
from structlog.testing import capture_logs

from rmq_async import App, IllegalStateError, InvalidTypeError, PushConsumer
from rmq_async.cli import build_parser, main
from rmq_async.cli.common import CliError
from rmq_async.cli.lag import QueueLag, format_lag
from rmq_async.cli.run import as_app, listener_timeout, load_target
from rmq_async.cli.tail import format_message
from rmq_async.protocol.types import MessageExt

NS = "127.0.0.1:9876"


@pytest.fixture(autouse=True)
def _keep_logging_config() -> Iterator[None]:
    # main() configures structlog for the process; the suite's own set-up comes back after.
    saved = structlog.get_config()
    yield
    structlog.configure(**saved)


def _consumer(group: str) -> PushConsumer:
    c = PushConsumer(group, namesrv=NS)
    c.subscribe("T", listener=lambda msgs: None)
    return c


@pytest.fixture
def target_module(monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    mod = ModuleType("cli_target_mod")
    mod.one = _consumer("g_one")  # type: ignore[attr-defined]
    mod.several = [_consumer("g_a"), _consumer("g_b")]  # type: ignore[attr-defined]
    mod.app = App(_consumer("g_app"))  # type: ignore[attr-defined]

    async def factory() -> PushConsumer:
        return _consumer("g_factory")

    mod.factory = factory  # type: ignore[attr-defined]
    mod.nested = ModuleType("nested")  # type: ignore[attr-defined]
    mod.nested.inner = _consumer("g_inner")  # type: ignore[attr-defined]
    mod.wrong = 42  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "cli_target_mod", mod)
    return mod


async def test_targets_become_apps(target_module: ModuleType) -> None:
    assert [c.group for c in await as_app(load_target("cli_target_mod:one"))] == ["g_one"]
    assert [c.group for c in await as_app(load_target("cli_target_mod:several"))] == ["g_a", "g_b"]
    app = await as_app(load_target("cli_target_mod:app"))
    assert app is target_module.app
    assert [c.group for c in await as_app(load_target("cli_target_mod:factory"))] == ["g_factory"]
    assert [c.group for c in await as_app(load_target("cli_target_mod:nested.inner"))] == ["g_inner"]
    with pytest.raises(CliError, match="expected a PushConsumer"):
        await as_app(load_target("cli_target_mod:wrong"))


def test_bad_targets_are_usage_errors(target_module: ModuleType) -> None:
    with pytest.raises(CliError, match="module:attribute"):
        load_target("no_colon")
    with pytest.raises(CliError, match="cannot import"):
        load_target("no_such_module_xyz:consumer")
    with pytest.raises(CliError, match="has no attribute 'missing'"):
        load_target("cli_target_mod:missing")
    with pytest.raises(CliError, match=r"cannot import '\.foo'"):  # was a TypeError traceback
        load_target(".foo:consumer")


async def test_a_target_that_fails_is_a_failed_command_not_a_traceback(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    from rmq_async.cli.common import CommandFailed

    (tmp_path / "cli_broken_mod.py").write_text("raise RuntimeError('no configuration')\n")
    (tmp_path / "cli_bad_port_mod.py").write_text("PORT = int('eighty')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(CommandFailed, match="importing 'cli_broken_mod' failed: RuntimeError"):
        load_target("cli_broken_mod:consumer")
    # The module's own ValueError is its failure too, not a usage error.
    with pytest.raises(CommandFailed, match="importing 'cli_bad_port_mod' failed: ValueError"):
        load_target("cli_bad_port_mod:consumer")
    mod = ModuleType("cli_failing_factory_mod")

    def make() -> PushConsumer:
        raise ValueError("no such environment")

    mod.make = make  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "cli_failing_factory_mod", mod)
    with pytest.raises(CommandFailed, match="make failed: ValueError: no such environment"):
        await as_app(load_target("cli_failing_factory_mod:make"))


def test_app_rejects_what_it_cannot_run() -> None:
    c = _consumer("g1")
    app = App(c)
    with pytest.raises(IllegalStateError, match="already part"):
        app.add(c)
    with pytest.raises(InvalidTypeError):
        app.add("not a consumer")  # type: ignore[arg-type]
    assert len(app) == 1 and list(app) == [c] and not app.is_running


async def test_an_empty_app_does_not_start() -> None:
    with pytest.raises(IllegalStateError, match="no consumers"):
        await App().start()


def test_listener_timeout_keeps_time_to_persist() -> None:
    assert listener_timeout(30.0) == 28.0
    assert listener_timeout(4.0) == 3.0
    assert 0 < listener_timeout(0.5) < 0.5


def test_lag_table_and_json() -> None:
    rows = [QueueLag("T", "broker-a", 0, 10, 7, 0), QueueLag("T", "broker-a", 1, 5, 5, 1_700_000_000_000)]
    text = format_lag(rows).splitlines()
    assert text[0].split() == ["TOPIC", "BROKER", "QUEUE", "BROKER_OFFSET", "CONSUMER_OFFSET",
                               "DIFF", "LAST_CONSUMED_UTC"]
    assert text[1].split() == ["T", "broker-a", "0", "10", "7", "3", "-"]
    assert text[2].split()[:6] == ["T", "broker-a", "1", "5", "5", "0"]
    assert text[2].endswith("2023-11-14 22:13:20")
    assert text[-1] == "TOTAL DIFF: 3"
    doc = json.loads(format_lag(rows, as_json=True))
    assert doc["total_diff"] == 3 and doc["queues"][0]["diff"] == 3


def test_tail_line_formats() -> None:
    m = MessageExt("T", "héllo".encode() * 100, queue_id=3, queue_offset=41,
                   store_timestamp=1_700_000_000_123)
    m.properties = {"TAGS": "a", "KEYS": "k1 k2"}
    line = format_message(m, max_body=5)
    assert line == "T[3]@41 2023-11-14T22:13:20.123+00:00 tags=a keys=k1 k2 body=héllo..."
    doc = json.loads(format_message(m, max_body=-1, as_json=True))
    assert doc["body"] == "héllo" * 100 and doc["offset"] == 41 and doc["keys"] == "k1 k2"


def test_parser_rejects_bad_numbers(capsys: pytest.CaptureFixture[str]) -> None:
    for argv in (["run", "m:c", "--workers", "0"], ["run", "m:c", "--grace", "-1"]):
        with pytest.raises(SystemExit) as info:
            build_parser().parse_args(argv)
        assert info.value.code == 2
    assert "must be" in capsys.readouterr().err


def test_usage_errors_exit_2(capsys: pytest.CaptureFixture[str],
                             monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("NAMESRV_ADDR", raising=False)
    monkeypatch.setenv("RMQ_ASYNC_STATE_FILE", "/nonexistent/state.json")
    assert main(["lag", "g1"]) == 2
    assert "no name server" in capsys.readouterr().err
    assert main(["run", "no_colon"]) == 2
    assert "module:attribute" in capsys.readouterr().err


def test_broker_subcommand_is_the_dev_broker_cli(tmp_path: Path) -> None:
    exe = Path(sys.executable).parent / "rmq-async"
    env = {"RMQ_ASYNC_STATE_FILE": str(tmp_path / "state.json"), "PATH": "/usr/bin:/bin"}
    done = subprocess.run([str(exe), "broker", "status"], capture_output=True, text=True,
                          env=env, timeout=60, check=False)
    assert (done.returncode, done.stdout.strip()) == (1, "not running")


async def test_the_supervisor_kills_workers_that_ignore_the_stop_signal(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The grace period runs from the stop signal, even when no worker ever exits by itself."""
    import asyncio
    import os
    import signal
    import time

    from rmq_async.cli import run as run_module

    real_exec = asyncio.create_subprocess_exec

    async def stuck_worker(*args: object, **kw: object) -> asyncio.subprocess.Process:
        # A worker whose drain never ends (its loop blocked, say): it ignores SIGTERM.
        return await real_exec(
            sys.executable, "-c",
            "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
            "print('ready', flush=True); time.sleep(60)",
            stdout=subprocess.PIPE, start_new_session=True)

    monkeypatch.setattr(run_module.asyncio, "create_subprocess_exec", stuck_worker)
    monkeypatch.setattr(run_module, "OVERRUN_MARGIN", 0.3)
    loop = asyncio.get_running_loop()
    loop.call_later(0.5, os.kill, os.getpid(), signal.SIGTERM)
    started = time.monotonic()
    async with asyncio.timeout(20):
        rc = await run_module.run_supervisor("x:y", 2, 0.5, [])
    assert rc == 1
    assert time.monotonic() - started < 5  # signal at 0.5 s, kill at 0.5 + 0.5 + 0.3 s


async def test_workers_that_cannot_load_the_target_make_a_usage_error() -> None:
    """``--workers 2`` with a target that does not exist exited 1 where ``--workers 1`` (the
    worker itself) exits 2."""
    import asyncio

    from rmq_async.cli import run as run_module

    async with asyncio.timeout(60):
        rc = await run_module.run_supervisor("no_such_module_for_this_test:app", 2, 0.5, [])
    assert rc == 2


def test_workers_whose_supervisor_is_killed_drain_and_end(tmp_path: Path) -> None:
    """The workers run in sessions of their own, so nothing reached them when the supervisor
    died without passing a stop on (SIGKILL): they consumed on, unsupervised. Their stop
    pipes end with it: each drains and ends."""
    import signal
    import time

    (tmp_path / "draining_app_mod.py").write_text(_DRAINING_APP)
    marks = tmp_path / "marks"
    marks.mkdir()
    env = {**os.environ, "PYTHONPATH": str(tmp_path), "MARKS": str(marks)}
    supervisor = subprocess.Popen(
        [sys.executable, "-m", "rmq_async.cli", "run", "draining_app_mod:app", "--workers", "2",
         "--grace", "10"], env=env, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 30
        while len(started := list(marks.glob("started-*"))) < 2:
            assert time.monotonic() < deadline, "the workers never started"
            time.sleep(0.05)
        supervisor.send_signal(signal.SIGKILL)
        supervisor.wait()
        pids = {int(p.name.split("-")[1]) for p in started}
        while {int(p.name.split("-")[1]) for p in marks.glob("drained-*")} != pids:
            assert time.monotonic() < deadline + 15, "the workers did not drain"
            time.sleep(0.05)
        for pid in pids:  # and they end
            while os.path.exists(f"/proc/{pid}") and "zombie" not in _proc_state(pid):
                assert time.monotonic() < deadline + 30, f"worker {pid} did not end"
                time.sleep(0.05)
    finally:
        with contextlib.suppress(ProcessLookupError):
            supervisor.kill()


def _proc_state(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/status") as f:
            return next((line for line in f if line.startswith("State:")), "").lower()
    except OSError:
        return "zombie"


async def test_a_second_signal_while_the_target_starts_exits_1_at_once(
        monkeypatch: pytest.MonkeyPatch) -> None:
    import asyncio
    import os
    import signal
    import time

    from rmq_async.cli.run import run_worker

    mod = ModuleType("cli_slow_start_mod")

    async def make() -> PushConsumer:
        await asyncio.sleep(30)  # a factory waiting for a configuration service, say
        return _consumer("g_slow")

    mod.make = make  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "cli_slow_start_mod", mod)
    loop = asyncio.get_running_loop()
    loop.call_later(0.2, os.kill, os.getpid(), signal.SIGINT)  # stop once started...
    loop.call_later(0.4, os.kill, os.getpid(), signal.SIGINT)  # ...no: now
    started = time.monotonic()
    async with asyncio.timeout(10):
        rc = await run_worker("cli_slow_start_mod:make", grace=5.0)
    assert rc == 1
    assert time.monotonic() - started < 3


_DRAINING_APP = '''
import asyncio, faulthandler, os, pathlib, signal
from rmq_async.app import App

if os.environ.get("TAKE_USR_SIGNALS"):  # the "dump the stacks" idiom
    faulthandler.register(signal.SIGUSR1)
    faulthandler.register(signal.SIGUSR2)

class Draining(App):
    """Starts at once (or after START_DELAY s), and its drain takes a moment."""

    @property
    def consumers(self):
        return []

    async def start(self):
        await asyncio.sleep(float(os.environ.get("START_DELAY", "0")))
        pathlib.Path(os.environ["MARKS"], f"started-{os.getpid()}").touch()

    async def stop(self, timeout=30.0):
        await asyncio.sleep(0.5)
        pathlib.Path(os.environ["MARKS"], f"drained-{os.getpid()}").touch()

app = Draining()
'''


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="process groups as on Linux")
@pytest.mark.parametrize("when", ["running", "starting", "target-took-sigusr"])
async def test_workers_drain_when_every_process_gets_the_stop_signal(
        when: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """systemd (``KillMode=control-group``) sends SIGTERM to the supervisor and its workers at
    once: each worker took the supervisor's forwarded copy for a second signal and left its
    drain (exit 1). And a SIGTERM while the workers were still starting killed them (their
    handlers were not in place yet). The supervisor's stop reaches the workers through a pipe,
    so a target that takes a signal for itself (faulthandler's stack dumps on SIGUSR1) does
    not lose it; there only the supervisor gets the SIGTERM."""
    import asyncio
    import signal
    import time

    from rmq_async.cli import run as run_module

    (tmp_path / "draining_app_mod.py").write_text(_DRAINING_APP)
    marks = tmp_path / "marks"
    marks.mkdir()
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    monkeypatch.setenv("MARKS", str(marks))
    monkeypatch.setenv("START_DELAY", "1.5" if when == "starting" else "0")
    if when == "target-took-sigusr":
        monkeypatch.setenv("TAKE_USR_SIGNALS", "1")
    pids: list[int] = []
    real_exec = asyncio.create_subprocess_exec

    async def recorded(*args: Any, **kw: Any) -> asyncio.subprocess.Process:
        proc = await real_exec(*args, **kw)
        pids.append(proc.pid)
        return proc

    monkeypatch.setattr(run_module.asyncio, "create_subprocess_exec", recorded)

    async def everyone_stops() -> None:
        if when != "starting":
            async with asyncio.timeout(30):
                while len(list(marks.glob("started-*"))) < 2:
                    await asyncio.sleep(0.05)
        else:
            async with asyncio.timeout(30):
                while len(pids) < 2:
                    await asyncio.sleep(0.01)
        for pid in (os.getpid(), *(pids if when != "target-took-sigusr" else ())):
            os.kill(pid, signal.SIGTERM)

    killer = asyncio.ensure_future(everyone_stops())
    started = time.monotonic()
    try:
        async with asyncio.timeout(60):
            rc = await run_module.run_supervisor("draining_app_mod:app", 2, 10.0, [])
    finally:
        killer.cancel()
    assert rc == 0
    assert len(list(marks.glob("drained-*"))) == 2
    assert time.monotonic() - started < 30


_ONE_CRASHES_APP = '''
import asyncio, os, pathlib
from rmq_async.app import App

class OneCrashes(App):
    """Worker 0 dies on its own a moment after its start; the others drain for 2 s."""

    @property
    def consumers(self):
        return []

    async def start(self):
        marks = pathlib.Path(os.environ["MARKS"])
        worker = os.environ["RMQ_ASYNC_WORKER"]
        (marks / f"started-{worker}").touch()
        if worker == "0":
            async def crash():
                await asyncio.sleep(1.0)
                (marks / "crashed-0").touch()
                os._exit(int(os.environ["EXIT_CODE"]))
            self.crash = asyncio.ensure_future(crash())

    async def stop(self, timeout=30.0):
        await asyncio.sleep(2.0)
        pathlib.Path(os.environ["MARKS"], f"drained-{os.environ['RMQ_ASYNC_WORKER']}").touch()

app = OneCrashes()
'''


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="process groups as on Linux")
@pytest.mark.parametrize(("exit_code", "status"), [(3, 1), (0, 0)])
async def test_the_first_signal_after_a_worker_crashed_is_not_taken_for_a_second(
        exit_code: int, status: int, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A worker that exits on its own makes the supervisor stop the others (one request
    each); the operator's SIGTERM after that is the operator's first: it passed a second
    request on, which the draining worker took for a forced exit and left its drain. A
    worker that ended with status 0 (its app stopped itself) is no failure."""
    import signal

    from rmq_async.cli import run as run_module

    (tmp_path / "one_crashes_mod.py").write_text(_ONE_CRASHES_APP)
    marks = tmp_path / "marks"
    marks.mkdir()
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    monkeypatch.setenv("MARKS", str(marks))
    monkeypatch.setenv("EXIT_CODE", str(exit_code))

    async def signal_after_the_crash() -> None:
        async with asyncio.timeout(30):
            while not (marks / "crashed-0").exists():
                await asyncio.sleep(0.05)
        await asyncio.sleep(0.5)  # the supervisor has seen it and stopped worker 1
        os.kill(os.getpid(), signal.SIGTERM)

    operator = asyncio.ensure_future(signal_after_the_crash())
    try:
        async with asyncio.timeout(60):
            rc = await run_module.run_supervisor("one_crashes_mod:app", 2, 10.0, [])
    finally:
        operator.cancel()
    assert rc == status
    assert operator.done() and not operator.cancelled(), "the signal was not sent in time"
    assert (marks / "drained-1").exists(), "worker 1 left its drain"


_STUCK_HANDLER_APP = '''
import asyncio, concurrent.futures, contextlib, os, pathlib, threading, time
from rmq_async.app import App
from rmq_async.consumer.listener import ListenerAdapter
from rmq_async.consumer.results import ConsumeContext
from rmq_async.protocol.types import MessageExt, MessageQueue

class StuckHandler(App):
    """STUCK=handler: a plain handler stuck in its worker thread; stop() gives up on it
    (cancelling the task that awaits it), the thread runs on. STUCK=hook: the same of a
    plain hook over its time. STUCK=no: a library's executor thread, idle, which ends with
    the interpreter."""

    @property
    def consumers(self):
        return []

    async def start(self):
        running = threading.Event()
        if os.environ["STUCK"] == "handler":
            def handler(msg):
                running.set()
                time.sleep(60)

            adapter = ListenerAdapter(handler)
            self.call = asyncio.ensure_future(adapter.invoke(
                [MessageExt("T", b"x", 0, 0)], ConsumeContext(MessageQueue("T", "b", 0))))
        else:
            self.pool = concurrent.futures.ThreadPoolExecutor(1)
            self.pool.submit(running.set)
            self.call = asyncio.ensure_future(asyncio.sleep(0))
        while not running.is_set():
            await asyncio.sleep(0.01)
        pathlib.Path(os.environ["MARKS"], "started").touch()

    async def stop(self, timeout=30.0):
        self.call.cancel()
        await asyncio.wait({self.call})
        if os.environ["STUCK"] == "hook":  # a plain on_shutdown hook over its time
            from rmq_async.consumer.hooks import call_user

            # Given up once it runs in its thread (a wait given up before the thread took
            # the call would leave nothing running: the call is then dropped unstarted).
            began = threading.Event()

            def hook():
                began.set()
                time.sleep(60)

            hook_call = asyncio.ensure_future(call_user(hook))
            for _ in range(1000):
                if began.is_set():
                    break
                await asyncio.sleep(0.01)
            hook_call.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await hook_call

app = StuckHandler()
'''


@pytest.mark.parametrize("stuck", ["handler", "hook", "no"])
def test_a_handler_thread_left_running_ends_the_process_with_status_1(
        tmp_path: Path, stuck: str) -> None:
    """``run`` drained (its stop gave up on a plain handler still running), but the process
    waited for the handler's thread, whatever the signals, and then exited 0. Only handler
    threads count: a library's idle executor thread leaves a drained run at 0."""
    import signal
    import time

    (tmp_path / "stuck_app_mod.py").write_text(_STUCK_HANDLER_APP)
    env = {**os.environ, "PYTHONPATH": str(tmp_path), "MARKS": str(tmp_path), "STUCK": stuck}
    proc = subprocess.Popen([sys.executable, "-m", "rmq_async.cli", "run", "stuck_app_mod:app",
                             "--grace", "2"], env=env, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 30
        while not (tmp_path / "started").exists():
            assert time.monotonic() < deadline and proc.poll() is None, "never started"
            time.sleep(0.05)
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=20)
    finally:
        with contextlib.suppress(ProcessLookupError):
            proc.kill()
    assert proc.returncode == (0 if stuck == "no" else 1), err
    assert ("cli.threads_left" in err) is (stuck != "no")


class _SlowDrain(App):
    @property
    def consumers(self) -> list[PushConsumer]:
        return []

    async def start(self) -> None:
        return None

    async def stop(self, timeout: float | None = 30.0) -> None:
        await asyncio.sleep(0.5)


@pytest.mark.parametrize(("written", "close", "status"), [
    (b"s", True, 0),    # a stop, then the supervisor dies while the worker drains: one stop
    (b"", True, 0),     # the supervisor dies: a stop
    (b"ss", False, 1),  # two stops at once: the second forces the exit (no traceback)
])
async def test_a_workers_stop_pipe(written: bytes, close: bool, status: int,
                                   monkeypatch: pytest.MonkeyPatch) -> None:
    from rmq_async.cli import run as run_module

    mod = ModuleType("cli_slow_drain_mod")
    mod.app = _SlowDrain()  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "cli_slow_drain_mod", mod)
    read_end, write_end = os.pipe()
    monkeypatch.setenv(run_module.STOP_FD_ENV, str(read_end))
    loop = asyncio.get_running_loop()

    def supervisor() -> None:
        if written:
            os.write(write_end, written)
        if close:
            loop.call_later(0.2, os.close, write_end)  # during the drain

    loop.call_later(0.3, supervisor)
    try:
        async with asyncio.timeout(10):
            rc = await run_module.run_worker("cli_slow_drain_mod:app", grace=5.0)
    finally:
        if not close:
            os.close(write_end)
    assert rc == status
    with pytest.raises(OSError):
        os.fstat(read_end)  # closed by the worker


class _UndoneDrain(App):
    """Stops in time, but its consumer's final offsets did not all go out."""

    def __init__(self, shortfalls: tuple[str, ...]) -> None:
        super().__init__()
        # (A running consumer: its wait_stopped() returns only once it is stopped.)
        self._member = SimpleNamespace(group="G1", stop_shortfalls=(),
                                       wait_stopped=asyncio.Event().wait)
        self._shortfalls = shortfalls

    @property
    def consumers(self) -> list[PushConsumer]:
        return [self._member]  # type: ignore[list-item]

    async def start(self) -> None:
        return None

    async def stop(self, timeout: float | None = 30.0) -> None:
        self._member.stop_shortfalls = self._shortfalls


@pytest.mark.parametrize(("shortfalls", "status"), [((), 0), (("offsets", "unlocks"), 1)])
async def test_a_drain_that_left_work_undone_exits_1(shortfalls: tuple[str, ...], status: int,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    # A drain within the grace period whose final offsets timed out (or whose listener calls
    # were given up) exited 0, as if everything had been handed back.
    from rmq_async.cli import run as run_module

    mod = ModuleType("cli_undone_drain_mod")
    mod.app = _UndoneDrain(shortfalls)  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "cli_undone_drain_mod", mod)
    read_end, write_end = os.pipe()
    monkeypatch.setenv(run_module.STOP_FD_ENV, str(read_end))
    asyncio.get_running_loop().call_later(0.3, os.write, write_end, b"s")
    try:
        with capture_logs() as logs:
            async with asyncio.timeout(10):
                rc = await run_module.run_worker("cli_undone_drain_mod:app", grace=5.0)
    finally:
        os.close(write_end)
    assert rc == status
    undone = [e for e in logs if e["event"] == "cli.drain_incomplete"]
    if status:
        assert undone and undone[0]["left_undone"] == {"G1": ["offsets", "unlocks"]}
    else:
        assert not undone


class _SlowStart(App):
    """Takes 1.5 s to start; its drain takes 1.5 s and records the listener timeout it got."""

    def __init__(self) -> None:
        super().__init__()
        self.stop_timeouts: list[float | None] = []

    @property
    def consumers(self) -> list[PushConsumer]:
        return []

    async def start(self) -> None:
        await asyncio.sleep(1.5)

    async def stop(self, timeout: float | None = 30.0) -> None:
        self.stop_timeouts.append(timeout)
        await asyncio.sleep(1.5)


async def test_the_grace_period_counts_from_a_signal_that_came_during_the_start(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # The worker counted --grace from the end of its start, the supervisor (and systemd or
    # Kubernetes) from the signal: a worker stopped during a slow start drained past the
    # supervisor's deadline and was killed and reported as failed.
    from rmq_async.cli import run as run_module

    app = _SlowStart()
    mod = ModuleType("cli_slow_start_app_mod")
    mod.app = app  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "cli_slow_start_app_mod", mod)
    read_end, write_end = os.pipe()
    monkeypatch.setenv(run_module.STOP_FD_ENV, str(read_end))
    loop = asyncio.get_running_loop()
    signalled: list[float] = []

    def supervisor() -> None:
        signalled.append(loop.time())
        os.write(write_end, b"s")

    loop.call_later(0.2, supervisor)  # during the start
    grace = 2.0
    try:
        with capture_logs() as logs:
            async with asyncio.timeout(10):
                rc = await run_module.run_worker("cli_slow_start_app_mod:app", grace=grace)
    finally:
        os.close(write_end)
    ended = loop.time()
    # 1.3 s of the 2 s went to the start: the drain gets the floor of a second (0.7 s were
    # left), and its 1.5 s do not fit (with the whole grace period they did).
    assert rc == 1
    assert ended - signalled[0] < 1.3 + run_module.DRAIN_FLOOR + 1.0
    events = [e["event"] for e in logs]
    assert "cli.drain_shortened" in events and "cli.drain_timeout" in events
    (given,) = app.stop_timeouts
    assert given == pytest.approx(run_module.listener_timeout(run_module.DRAIN_FLOOR))


class _Member:
    """Stands for a consumer: stopped or running, its wait_stopped() as PushConsumer's."""

    def __init__(self, group: str, *, running: bool = True) -> None:
        self.group = group
        self.stop_shortfalls: tuple[str, ...] = ()
        self._stopped = asyncio.Event()
        self.set(running=running)

    @property
    def stopped(self) -> bool:
        return self._stopped.is_set()

    def set(self, *, running: bool) -> None:
        if running:
            self._stopped.clear()
        else:
            self._stopped.set()

    async def wait_stopped(self) -> None:
        while not self.stopped:
            await self._stopped.wait()


class _Members(App):
    def __init__(self, *members: Any) -> None:
        super().__init__()
        self._members = list(members)

    @property
    def consumers(self) -> list[PushConsumer]:
        return self._members


async def test_an_app_is_stopped_only_when_no_member_runs_at_the_same_time() -> None:
    # A member that stopped and started again (a handler restarting its consumer) does not
    # count as stopped; nor does one stop after the other's restart.
    a, b = _Member("A"), _Member("B")
    app = _Members(a, b)
    waiting = asyncio.ensure_future(app.wait_stopped())
    a.set(running=False)
    await asyncio.sleep(0.05)  # the waiter is past A, waiting for B
    a.set(running=True)  # A restarted
    b.set(running=False)
    await asyncio.sleep(0.05)
    assert not waiting.done()
    a.set(running=False)
    await asyncio.wait_for(waiting, 1)


async def test_a_failure_to_watch_the_members_is_not_taken_for_a_stop(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from rmq_async.cli import run as run_module

    broken = SimpleNamespace(group="G", stop_shortfalls=(), stopped=False)

    async def fails() -> None:
        raise RuntimeError("cannot tell")

    broken.wait_stopped = fails
    stop = asyncio.Event()
    with capture_logs() as logs:
        watch = asyncio.ensure_future(run_module._until_stop_or_stopped(stop, _Members(broken)))
        await asyncio.sleep(0.1)
        assert not watch.done()  # not "the app stopped itself"
        stop.set()
        assert await asyncio.wait_for(watch, 1) is True
    assert [e["event"] for e in logs] == ["cli.wait_stopped_failed"]

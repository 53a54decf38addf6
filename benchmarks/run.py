"""rmq_async against the Java client (and other Python clients), side by side on one broker.

``make bench`` (``python benchmarks/run.py``) runs the full set, ``make bench-quick``
(``--quick``) a small one. One run:

1. starts a real local RocketMQ (NameServer + Broker) once and compiles the Java contender;
2. per scenario, creates a topic with 8 queues and preloads it with the rmq_async producer
   (batch sends, several in flight);
3. runs every contender in turn, round after round, each round starting with the next one
   (A B C, B C A, C A B …), each in a process of its own with a fresh consumer group starting
   at the first offset, and checks that it consumed exactly the preloaded messages, each once;
4. writes ``results.json`` (every raw figure and the environment), ``summary.md`` (medians and
   rmq_async / Java ratios) and ``chart.png`` under ``benchmarks/results/<timestamp>/``
   (or ``--out``).

A progress line on stderr tells which contender runs, how many messages it has and for how
long. The exit status is 1 when any run failed verification.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import contextlib
import json
import os
import platform
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any, TextIO

BENCH_DIR = Path(__file__).resolve().parent
REPO = BENCH_DIR.parent
if str(REPO) not in sys.path:
    sys.path.insert(1, str(REPO))

import report  # noqa: E402
from benchlib import (  # noqa: E402
    PROBE_TAG,
    WARMUP_TAG,
    host_cpu_ticks,
    round_orders,
    steal_percent,
)

import rmq_async  # noqa: E402
from rmq_async.client.instance import ClientInstance  # noqa: E402
from rmq_async.devbroker import LocalRocketMQ  # noqa: E402
from rmq_async.devbroker.java import compile_java  # noqa: E402
from rmq_async.devbroker.maven import find_tool  # noqa: E402
from rmq_async.devbroker.procs import pdeathsig_preexec  # noqa: E402
from rmq_async.producer import Producer  # noqa: E402
from rmq_async.protocol.types import Message, MessageQueue  # noqa: E402

QUEUES = 8
TUNED_BATCH = 32
JAVA_FLAGS = ("-Xms256m", "-Xmx1g", "-Djava.net.preferIPv4Stack=true",
              "-Drmq.logback.configurationFile=rmq.client.logback.xml")

#: Added for ``--quick``: the Java client rebalances every 2 s instead of 20 s, so its
#: occasional start stall (the first rebalance's subscription not yet heartbeated, see
#: benchmarks/README.md) costs 2 s, not 20, of the quick run's three minutes. It comes before
#: the first message, so no drain rate includes it, in either mode.
QUICK_JAVA_FLAGS = ("-Drocketmq.client.rebalance.waitInterval=2000",)


# ---------------------------------------------------------------------- plan


@dataclass
class Scenario:
    name: str
    title: str
    kind: str  # drain | latency | spark
    messages: int
    body_size: int
    rounds: int
    contenders: list[str]
    #: contenders run in fewer rounds than the others (slow extras, to keep the run short)
    capped_rounds: dict[str, int] = field(default_factory=dict)
    rate: int = 0  # latency: messages per second
    warmup_seconds: float = 0.0  # latency: traffic at the rate before the measured messages
    batch_rows: int = 50_000  # spark
    #: spark: one untimed pass of each path before the rounds (the JVMs' JIT); drains: the
    #: first drain on the broker starts with an untimed pass of every contender (the broker's
    #: JIT). The quick run, which checks the harness rather than speeds, goes without.
    jit_warm_up: bool = True


def plan(quick: bool, rounds: int | None) -> list[Scenario]:
    consumers = ["rmq_async", "rmq_async-tuned", "java", "java-tuned", "rocketmq-cpp"]
    raw = ["raw-pull", "raw-pull-decode"]
    if quick:
        r = rounds or 1
        return [
            Scenario("drain-1KiB", "Drain: 40,000 x 1 KiB on 8 queues (quick)", "drain",
                     40_000, 1024, r, raw + consumers, jit_warm_up=False),
            Scenario("drain-100B", "Drain: 40,000 x 100 B (quick)", "drain", 40_000, 100, r,
                     ["rmq_async-tuned", "java-tuned"], jit_warm_up=False),
            Scenario("drain-16KiB", "Drain: 4,000 x 16 KiB (quick)", "drain", 4_000, 16384, r,
                     ["rmq_async-tuned", "java-tuned"], jit_warm_up=False),
            Scenario("latency", "Latency at 2,000 msg/s for 3 s, 1 KiB (quick)", "latency",
                     6_000, 1024, r, ["rmq_async", "rmq_async-tuned", "java", "java-tuned"],
                     rate=2_000, warmup_seconds=1.0),
            Scenario("spark", "Spark sink, source, plain: 40,000 x 1 KiB into Parquet (quick)", "spark",
                     40_000, 1024, 1, [], batch_rows=10_000, jit_warm_up=False),
        ]
    r = rounds or 3
    # The PyPI client drains about 5x slower than the others: one round of the big drain.
    return [
        Scenario("drain-1KiB", "Drain: 1,000,000 x 1 KiB on 8 queues", "drain", 1_000_000,
                 1024, r, raw + consumers, capped_rounds={"rocketmq-cpp": 1}),
        Scenario("drain-100B", "Drain: 300,000 x 100 B on 8 queues", "drain", 300_000, 100, r,
                 consumers[:4]),
        Scenario("drain-16KiB", "Drain: 50,000 x 16 KiB on 8 queues", "drain", 50_000, 16384,
                 r, consumers[:4]),
        Scenario("latency", "Latency at 5,000 msg/s for 8 s, 1 KiB", "latency", 40_000, 1024,
                 r, consumers, rate=5_000, warmup_seconds=2.0),
        # Three rounds like the drains (the first one also warms the broker's and Spark's JIT
        # for the sink's path); the source, which takes longest, runs in the first only.
        Scenario("spark", "Spark sink, source, plain: 1,000,000 x 1 KiB into Parquet", "spark", 1_000_000,
                 1024, r, [], batch_rows=50_000, capped_rounds={"spark-source": 1}),
    ]


# ---------------------------------------------------------------------- progress display


class Progress:
    """One status line on stderr: rewritten in place on a terminal, every few seconds if not."""

    def __init__(self, stream: TextIO = sys.stderr) -> None:
        self.stream = stream
        self.tty = stream.isatty()
        self._last = 0.0
        self._width = 0

    def update(self, text: str, *, force: bool = False) -> None:
        now = time.monotonic()
        if not force and now - self._last < (0.2 if self.tty else 5.0):
            return
        self._last = now
        if self.tty:
            pad = max(0, self._width - len(text))
            self.stream.write("\r" + text + " " * pad)
            self._width = len(text)
        else:
            self.stream.write(text + "\n")
        self.stream.flush()

    def line(self, text: str) -> None:
        """A permanent line (the status line is redrawn below it)."""
        if self.tty and self._width:
            self.stream.write("\r" + " " * self._width + "\r")
            self._width = 0
        self.stream.write(text + "\n")
        self.stream.flush()


# ---------------------------------------------------------------------- environment


def _cmd_output(cmd: Sequence[str]) -> str:
    try:
        proc = subprocess.run(list(cmd), capture_output=True, text=True, timeout=30, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return ""
    return (proc.stdout + proc.stderr).strip()


def environment(rmq: LocalRocketMQ, cpp_python: str | None) -> dict[str, Any]:
    cpu_model = ""
    with contextlib.suppress(OSError), open("/proc/cpuinfo", encoding="utf-8") as fh:
        for line in fh:
            if line.startswith("model name"):
                cpu_model = line.split(":", 1)[1].strip()
                break
    mem_kib = 0
    with contextlib.suppress(OSError), open("/proc/meminfo", encoding="utf-8") as fh:
        for line in fh:
            if line.startswith("MemTotal:"):
                mem_kib = int(line.split()[1])
    java_version = _cmd_output([str(find_tool("java")), "-version"]).splitlines()
    commit = _cmd_output(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"])
    dirty = _cmd_output(["git", "-C", str(REPO), "status", "--porcelain", "--", "rmq_async"])
    versions: dict[str, str] = {}
    for mod in ("uvloop", "pyspark", "pyarrow", "matplotlib", "psutil"):
        try:
            versions[mod] = __import__(mod).__version__
        except ImportError:
            versions[mod] = "not installed"
    client_jar = next((p.name for p in rmq.lib_dir.glob("rocketmq-client-*.jar")), "")
    env: dict[str, Any] = {
        "cpu_model": cpu_model or platform.processor(),
        "cpu_count": os.cpu_count(),
        "cpu_affinity": len(os.sched_getaffinity(0)),
        "memory_gib": round(mem_kib / 1024 / 1024, 1),
        "load_average_at_start": [round(x, 2) for x in os.getloadavg()],
        "kernel": platform.release(),
        "python": f"Python {platform.python_version()} ({platform.python_implementation()})",
        "java": java_version[0] if java_version else "unknown",
        "java_full": java_version,
        "java_flags": list(JAVA_FLAGS),
        "rocketmq_version": rmq.version,
        "rocketmq_client_jar": client_jar,
        "rmq_async_version": rmq_async.__version__,
        "git_commit": (commit or "unknown") + ("+dirty" if dirty else ""),
        "packages": versions,
    }
    if cpp_python:
        out = _cmd_output([cpp_python, "-c",
                           "import importlib.metadata as m; print(m.version('rocketmq'))"])
        env["pypi_rocketmq"] = {"python": cpp_python, "version": out}
    return env


def find_cpp_python(explicit: str | None) -> tuple[str | None, str]:
    """An interpreter that imports the PyPI ``rocketmq`` client, and why not when none does."""
    candidates = [explicit] if explicit else [
        os.environ.get("RMQ_BENCH_ROCKETMQ_PYTHON", ""), sys.executable]
    for py in candidates:
        if not py:
            continue
        proc = subprocess.run([py, "-c", "import rocketmq.client"], capture_output=True,
                              text=True, timeout=60, check=False)
        if proc.returncode == 0:
            return py, ""
    return None, ("the PyPI package `rocketmq` is not importable (install it, or point "
                  "--rocketmq-python / RMQ_BENCH_ROCKETMQ_PYTHON at an interpreter that has it)")


# ---------------------------------------------------------------------- producing


def make_filler(size: int) -> bytes:
    """Random printable bytes (no NUL: one contender's wrapper cuts bodies at the first NUL)."""
    return base64.b64encode(os.urandom((4096 + size) * 3 // 4 + 3))


def make_body(index: int, size: int, filler: bytes) -> bytes:
    head = b"%012d|" % index
    if size <= len(head):
        return head[:size]
    return head + filler[(index * 7) % 4096:][: size - len(head)]


async def queue_max_offsets(namesrv: str, topic: str) -> dict[MessageQueue, int]:
    instance = ClientInstance(namesrv, f"127.0.0.1@bench-admin-{uuid.uuid4().hex[:8]}")
    try:
        await instance.update_route(topic)
        out = {}
        for mq in sorted(await instance.subscribe_queues(topic)):
            addr = await instance.find_broker_master(mq.broker_name, topic)
            out[mq] = await instance.api.get_max_offset(addr, mq)
        return out
    finally:
        await instance.close()


async def preload(namesrv: str, topic: str, count: int, size: int, progress: Progress,
                  label: str) -> dict[str, Any]:
    """Fill ``topic`` with ``count`` messages of ``size`` bytes; batch sends, 8 in flight."""
    per_batch = max(1, min(512, (256 * 1024) // (size + 64)))
    filler = make_filler(size)
    batches = (count + per_batch - 1) // per_batch
    next_batch = 0
    sent = 0
    started = time.perf_counter()

    async with Producer(f"bench_preload_{uuid.uuid4().hex[:8]}", namesrv) as producer:

        async def worker() -> None:
            nonlocal next_batch, sent
            while next_batch < batches:
                b = next_batch
                next_batch += 1
                lo, hi = b * per_batch, min(count, (b + 1) * per_batch)
                msgs = [Message(topic, make_body(i, size, filler), tags="bench")
                        for i in range(lo, hi)]
                await producer.send_batch(msgs)
                sent += hi - lo
                elapsed = time.perf_counter() - started
                progress.update(f"[{label}] preloading {sent:>10,}/{count:,} "
                                f"{elapsed:6.1f} s {sent / max(elapsed, 1e-9):>9,.0f} msg/s")

        async with asyncio.TaskGroup() as tg:
            for _ in range(8):
                tg.create_task(worker())
    seconds = time.perf_counter() - started
    # The broker indexes stored messages asynchronously: wait until every one is visible.
    deadline = time.monotonic() + 60
    while True:
        offsets = await queue_max_offsets(namesrv, topic)
        total = sum(offsets.values())
        if total == count:
            break
        if total > count or time.monotonic() > deadline:
            raise RuntimeError(f"topic {topic} holds {total} messages after preloading {count}")
        await asyncio.sleep(0.1)
    progress.line(f"[{label}] preloaded {count:,} x {size} B in {seconds:.1f} s "
                  f"({count / seconds:,.0f} msg/s); per queue: "
                  f"{sorted(offsets.values())}")
    return {"messages": count, "body_size": size, "seconds": round(seconds, 3),
            "per_queue": [offsets[mq] for mq in sorted(offsets)]}


async def produce_at_rate(namesrv: str, topic: str, rate: int, count: int,
                          size: int, tag: str = "bench") -> dict[str, Any]:
    """Send ``count`` messages at ``rate`` per second: a batch every 5 ms, round-robin queues."""
    tick = 0.005
    per_tick = max(1, round(rate * tick))
    filler = make_filler(size)
    started = time.perf_counter()
    lag_max = 0.0
    async with Producer(f"bench_rate_{uuid.uuid4().hex[:8]}", namesrv) as producer:
        async with asyncio.TaskGroup() as tg:
            sent = 0
            i = 0
            while sent < count:
                due = started + i * tick
                now = time.perf_counter()
                if due > now:
                    await asyncio.sleep(due - now)
                else:
                    lag_max = max(lag_max, now - due)
                n = min(per_tick, count - sent)
                msgs = [Message(topic, make_body(sent + k, size, filler), tags=tag)
                        for k in range(n)]
                tg.create_task(producer.send_batch(msgs))
                sent += n
                i += 1
        seconds = time.perf_counter() - started
    return {"messages": count, "target_rate": rate, "seconds": round(seconds, 3),
            "achieved_rate": round(count / seconds, 1), "batch": per_tick,
            "max_schedule_lag_ms": round(lag_max * 1000, 1)}


# ---------------------------------------------------------------------- contender processes


@dataclass
class ChildRun:
    """A contender process: its line protocol, progress and result."""

    cmd: list[str]
    cwd: Path
    env: dict[str, str]
    stderr_path: Path
    count: int = 0
    ready: asyncio.Event = field(default_factory=asyncio.Event)
    result: dict[str, Any] | None = None
    phase: str = ""
    lines: list[str] = field(default_factory=list)
    during_error: str = ""

    async def run(self, timeout: float, on_progress: Callable[[ChildRun], None],
                  during: Callable[[ChildRun], Any] | None = None) -> tuple[int, str]:
        err = await asyncio.to_thread(open, self.stderr_path, "wb")
        with err:
            proc = await asyncio.create_subprocess_exec(
                *self.cmd, cwd=self.cwd, env=self.env, stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE, stderr=err, start_new_session=True,
                preexec_fn=pdeathsig_preexec(os.getpid()),
            )
        assert proc.stdout is not None
        stdout = proc.stdout

        async def read() -> None:
            while True:
                raw = await stdout.readline()
                if not raw:
                    return
                line = raw.decode(errors="replace").rstrip("\n")
                if line.startswith("PROGRESS "):
                    with contextlib.suppress(ValueError):
                        self.count = int(line.split()[1])
                    on_progress(self)
                elif line == "READY":
                    self.ready.set()
                elif line.startswith("RESULT "):
                    self.result = json.loads(line[7:])
                elif line.startswith("PHASE "):
                    self.phase = line[6:]
                    on_progress(self)
                else:
                    self.lines.append(line)

        async def guarded(work: Callable[[ChildRun], Any]) -> None:
            try:
                await work(self)
            except Exception as exc:  # reported with the run; the child is stopped
                self.during_error = f"{type(exc).__name__}: {exc}"
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)

        try:
            async with asyncio.timeout(timeout):
                async with asyncio.TaskGroup() as tg:
                    reader = tg.create_task(read())
                    helper = tg.create_task(guarded(during)) if during is not None else None
                    await reader
                    # The child closed its output (it exited): nothing more to feed it.
                    if helper is not None and not helper.done():
                        helper.cancel()
                await proc.wait()
        except TimeoutError:
            return -1, f"killed after {timeout:.0f} s"
        finally:
            if proc.returncode is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                await proc.wait()
        return proc.returncode or 0, ""

    def stderr_tail(self, n: int = 15) -> str:
        """The last ``n`` lines of the child's stderr, after the last lines naming an error
        (a JVM's stack trace ends in frames: the exception and its causes are above them)."""
        try:
            text = self.stderr_path.read_text(errors="replace")
        except OSError:
            return ""
        lines = text.splitlines()
        tail = lines[-n:]
        named = [line for line in lines[:-n] if _NAMES_AN_ERROR.search(line)][-4:]
        return "\n".join([*named, *(["..."] if named else []), *tail])

    def keep_stderr(self, out: Path) -> str:
        """Copy the child's whole stderr to ``out/failed/`` (the work folder is removed at the
        end of the run) and return its path relative to ``out``; "" if there is none."""
        kept = out / "failed" / self.stderr_path.name
        try:
            kept.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(self.stderr_path, kept)
        except OSError:
            return ""
        return str(kept.relative_to(out))


#: A stderr line that names an error: a Python or Java exception, or a JVM's "Caused by".
_NAMES_AN_ERROR = re.compile(r"(Error|Exception|Caused by)\b")


@dataclass
class Runtime:
    rmq: LocalRocketMQ
    java_classes: Path
    cpp_python: str | None
    work: Path
    progress: Progress
    stall_timeout: float
    #: the run's output folder: a failed child's whole stderr is kept in its ``failed/``
    out: Path
    profile_dir: Path | None = None
    java_flags: tuple[str, ...] = JAVA_FLAGS
    #: The broker has served a warm-up pass of every drain contender (see :func:`run_drain`).
    broker_warm: bool = False


def contender_command(rt: Runtime, contender: str, spec: dict[str, Any]) -> list[str]:
    if contender.startswith("java"):
        args = [f"namesrv={spec['namesrv']}", f"group={spec['group']}", f"topic={spec['topic']}",
                f"expected={spec['expected']}", f"queues={spec['queues']}",
                f"latency={'true' if spec.get('latency') else 'false'}",
                f"timeout={spec['stall_timeout']}", f"clktck={os.sysconf('SC_CLK_TCK')}"]
        if spec.get("broker_pid"):
            args.append(f"brokerpid={spec['broker_pid']}")
        if contender == "java-tuned":
            args.append(f"batch={TUNED_BATCH}")
        home = Path(tempfile.mkdtemp(prefix="java-home-", dir=rt.work))
        cp = f"{rt.java_classes}{os.pathsep}{rt.rmq.lib_dir}/*"
        return [str(find_tool("java")), *rt.java_flags, f"-Duser.home={home}", "-cp", cp,
                "BenchConsumer", *args]
    if contender == "rocketmq-cpp":
        assert rt.cpp_python is not None
        return [rt.cpp_python, str(BENCH_DIR / "cpp_child.py"), json.dumps(spec)]
    child_spec = dict(spec)
    if contender.startswith("raw"):
        child_spec.update(kind="raw", decode=contender == "raw-pull-decode", uvloop=True)
    else:
        child_spec.update(kind="push")
        if contender == "rmq_async-tuned":
            child_spec.update(uvloop=True,
                              options={"consume_message_batch_max_size": TUNED_BATCH})
    return [sys.executable, str(BENCH_DIR / "child.py"), json.dumps(child_spec)]


def child_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("JAVA_TOOL_OPTIONS", "NAMESRV_ADDR")}
    env["PYTHONUNBUFFERED"] = "1"
    env["PYTHONPATH"] = os.pathsep.join([str(BENCH_DIR), str(REPO)])
    return env


def verify(sc: Scenario, contender: str, result: dict[str, Any] | None, rc: int,
           why: str) -> tuple[bool, str]:
    if why:
        return False, why
    if result is None:
        return False, why or f"no result (exit status {rc})"
    if not result.get("ok"):
        return False, result.get("reason") or "the contender gave up"
    if result["consumed"] != sc.messages:
        return False, f"consumed {result['consumed']} of {sc.messages}"
    if result.get("duplicates"):
        return False, f"{result['duplicates']} duplicate deliveries"
    if not contender.startswith("raw") and result.get("body_bytes") != sc.messages * sc.body_size:
        return False, (f"bodies add up to {result.get('body_bytes')} bytes, not "
                       f"{sc.messages * sc.body_size}")
    return True, ""


async def run_contender(rt: Runtime, sc: Scenario, contender: str, rnd: int, topic: str,
                        during: Callable[[ChildRun], Any] | None = None) -> dict[str, Any]:
    group = f"bench_{contender.replace('-', '_')}_{sc.name.replace('-', '_')}_r{rnd}_" \
            f"{uuid.uuid4().hex[:6]}"
    spec: dict[str, Any] = {
        "namesrv": rt.rmq.namesrv_addr, "group": group, "topic": topic,
        "expected": sc.messages, "queues": QUEUES, "latency": sc.kind == "latency",
        "stall_timeout": rt.stall_timeout, "broker_pid": rt.rmq.pids.get("broker"),
    }
    if rt.profile_dir is not None and contender.startswith("rmq_async"):
        spec["profile"] = str(rt.profile_dir / f"{sc.name}-{contender}-r{rnd}.pstats")
    cmd = contender_command(rt, contender, spec)
    child = ChildRun(cmd=cmd, cwd=BENCH_DIR, env=child_env(),
                     stderr_path=rt.work / f"{sc.name}-{contender}-r{rnd}.stderr")
    label = f"{sc.name} round {rnd}/{sc.rounds}" if rnd else f"{sc.name} warm-up, untimed"
    started = time.perf_counter()

    def show(c: ChildRun) -> None:
        elapsed = time.perf_counter() - started
        rt.progress.update(f"[{label}] {contender:<16} {c.count:>10,}/{sc.messages:,} "
                           f"{elapsed:6.1f} s")

    rt.progress.update(f"[{label}] {contender:<16} starting", force=True)
    timeout = 120 + rt.stall_timeout + sc.messages / 2_000
    host0 = host_cpu_ticks()
    rc, why = await child.run(timeout, show, during)
    steal = steal_percent(host0, host_cpu_ticks())
    if child.during_error:
        why = f"the producer side failed: {child.during_error}"
    wall = time.perf_counter() - started
    res = child.result
    ok, reason = verify(sc, contender, res, rc, why)
    if not ok and not res:
        reason += f"; stderr: {child.stderr_tail(8)}"
    if not ok and (kept := child.keep_stderr(rt.out)):
        reason += f"; its stderr kept in {kept}"
    row: dict[str, Any] = {"contender": contender, "round": rnd, "group": group,
                           "exit_status": rc, "process_wall_seconds": round(wall, 3),
                           "host_steal_pct": steal}
    if res:
        row.update(res)
        row["child_reason"] = res.get("reason", "")
        seconds = float(res["seconds"])
        consumed = int(res["consumed"])
        cpu = float(res["cpu_user"]) + float(res["cpu_sys"])
        # Drain rate: first to last message (start-up, measured apart, is not a drain cost).
        drain = seconds - max(0.0, float(res.get("first_message_seconds", 0.0)))
        row.update(
            msgs_per_s=round(consumed / drain, 1) if drain > 0 else None,
            mb_per_s=round(consumed * sc.body_size / drain / 1e6, 2) if drain > 0 else None,
            end_to_end_msgs_per_s=round(consumed / seconds, 1) if seconds > 0 else None,
            cpu_s_per_million=round(cpu / consumed * 1e6, 2) if consumed else None,
            peak_rss_mib=round(int(res["peak_rss_kib"]) / 1024, 1),
            broker_cpu_s_per_million=round(float(res["broker_cpu"]) / consumed * 1e6, 2)
            if consumed and res.get("broker_cpu") is not None else None,
        )
    row.update(verified=ok, reason=reason)
    mark = "ok" if ok else f"NOT VERIFIED: {reason}"
    if res and sc.kind == "latency" and res.get("latency_b2c_ms"):
        b2c = res["latency_b2c_ms"]
        detail = f"B2C p50 {b2c['p50']} ms, p99 {b2c['p99']} ms, max {b2c['max']} ms"
    elif res:
        detail = (f"{res['consumed']:,} msgs, first after {res['first_message_seconds']:.2f} s, "
                  f"all after {res['seconds']:.2f} s: {row.get('msgs_per_s') or 0:,.0f} msg/s")
    else:
        detail = "no result"
    if res:
        detail += (f", CPU {float(res['cpu_user']) + float(res['cpu_sys']):.1f} s, "
                   f"peak RSS {row['peak_rss_mib']:.0f} MiB")
        if res.get("broker_cpu") is not None:
            detail += f", broker CPU {float(res['broker_cpu']):.1f} s"
        if res.get("loop_waited_s") is not None:
            detail += f", event loop waited for a CPU {float(res['loop_waited_s']):.1f} s"
    if steal is not None:
        detail += f", steal {steal:.1f}%"
    rt.progress.line(f"[{label}] {contender:<16} {detail} — {mark}")
    return row


# ---------------------------------------------------------------------- scenarios


async def new_topic(rt: Runtime, prefix: str) -> str:
    topic = f"{prefix}_{uuid.uuid4().hex[:8]}"
    await rt.rmq.create_topic(topic, queues=QUEUES)
    return topic


async def run_drain(rt: Runtime, sc: Scenario, contenders: list[str],
                    topic: str | None = None) -> dict[str, Any]:
    if topic is None:
        topic = await new_topic(rt, f"bench_{sc.name.replace('-', '_')}")
        load = await preload(rt.rmq.namesrv_addr, topic, sc.messages, sc.body_size, rt.progress,
                             sc.name)
    else:
        load = {"reused_topic": topic}
    warm_up = []
    if sc.jit_warm_up and not rt.broker_warm:
        # Round 0, not counted: every contender drains the topic once, so that the timed
        # rounds meet a broker whose JIT has compiled its pull path (a freshly started broker
        # spent 2.5 to 4 times the CPU per message in the first round's first drains as in
        # the later rounds', and every contender of that round ran slower for it).
        for contender in contenders:
            if sc.capped_rounds.get(contender, sc.rounds) >= sc.rounds:
                warm_up.append(await run_contender(rt, sc, contender, 0, topic))
        rt.broker_warm = True
    runs = []
    for rnd, order in enumerate(round_orders(contenders, sc.rounds), start=1):
        for contender in order:
            if rnd <= sc.capped_rounds.get(contender, sc.rounds):
                runs.append(await run_contender(rt, sc, contender, rnd, topic))
    return {"topic": topic, "preload": load, "warm_up": warm_up, "runs": runs}


async def run_latency(rt: Runtime, sc: Scenario, contenders: list[str]) -> dict[str, Any]:
    runs = []
    for rnd, order in enumerate(round_orders(contenders, sc.rounds), start=1):
        for contender in order:
            topic = await new_topic(rt, "bench_latency")
            producer_info: dict[str, Any] = {}

            async def during(child: ChildRun, topic: str = topic,
                             info: dict[str, Any] = producer_info) -> None:
                await send_probes_until_ready(rt.rmq.namesrv_addr, topic, child)
                if sc.warmup_seconds > 0:
                    info["warmup"] = await produce_at_rate(
                        rt.rmq.namesrv_addr, topic, sc.rate, int(sc.rate * sc.warmup_seconds),
                        sc.body_size, tag=WARMUP_TAG)
                info.update(await produce_at_rate(rt.rmq.namesrv_addr, topic, sc.rate,
                                                  sc.messages, sc.body_size))

            row = await run_contender(rt, sc, contender, rnd, topic, during)
            row["producer"] = producer_info
            runs.append(row)
    return {"rate": sc.rate, "runs": runs}


async def send_probes_until_ready(namesrv: str, topic: str, child: ChildRun) -> None:
    """One probe per queue every half second until the consumer has seen one from each."""
    async with Producer(f"bench_probe_{uuid.uuid4().hex[:8]}", namesrv) as producer:
        queues = await producer.instance.publish_queues(topic)
        while not child.ready.is_set():
            for mq in queues:
                await producer.send(Message(topic, b"probe", tags=PROBE_TAG), queue=mq)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(child.ready.wait(), 0.5)


async def run_spark(rt: Runtime, sc: Scenario, topic: str) -> dict[str, Any]:
    spec = {"kind": "spark", "namesrv": rt.rmq.namesrv_addr,
            "group": f"bench_spark_{uuid.uuid4().hex[:6]}", "topic": topic,
            "expected": sc.messages, "body_size": sc.body_size, "queues": QUEUES,
            "batch_rows": sc.batch_rows, "rounds": sc.rounds, "stall_timeout": rt.stall_timeout,
            "source_rounds": sc.capped_rounds.get("spark-source", sc.rounds),
            "work_dir": str(rt.work / "spark"), "broker_pid": rt.rmq.pids.get("broker"),
            "warm_up": sc.jit_warm_up}
    if rt.profile_dir is not None:
        spec["profile"] = str(rt.profile_dir / f"{sc.name}-spark.pstats")
    child = ChildRun(cmd=[sys.executable, str(BENCH_DIR / "child.py"), json.dumps(spec)],
                     cwd=BENCH_DIR, env=child_env(), stderr_path=rt.work / "spark.stderr")
    started = time.perf_counter()

    def show(c: ChildRun) -> None:
        rt.progress.update(f"[spark] {c.phase or 'starting Spark':<24} {c.count:>10,}/"
                           f"{sc.messages:,} rows {time.perf_counter() - started:6.1f} s")

    rt.progress.update("[spark] starting Spark", force=True)
    rc, why = await child.run(600 + sc.messages / 1_000, show)
    res = child.result
    failed = res is None or not all(r["ok"] for r in res["runs"])
    kept = child.keep_stderr(rt.out) if failed else ""
    if kept:
        rt.progress.line(f"[spark] the Spark child's stderr is kept in {kept}")
    if res is None:
        reason = why or f"no result (exit status {rc}): {child.stderr_tail(10)}"
        if kept:
            reason += f"; its stderr kept in {kept}"
        rt.progress.line(f"[spark] NOT VERIFIED: {reason}")
        return {"runs": [], "error": reason, "batch_rows": sc.batch_rows}
    for r in res["runs"]:
        mark = "ok" if r["ok"] else f"NOT VERIFIED: {r['reason']}"
        steal = "" if r.get("host_steal_pct") is None else f", steal {r['host_steal_pct']:.1f}%"
        rt.progress.line(f"[spark round {r['round']}] {r['contender']:<18} {r['rows']:,} rows in "
                         f"{r['seconds']:.1f} s = {r['rows_per_s']:,.0f} rows/s{steal} — {mark}")
    return {**res, "topic": topic}


# ---------------------------------------------------------------------- main


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    p.add_argument("--quick", action="store_true", help="a small run (about 2 minutes)")
    p.add_argument("--out", type=Path, default=None,
                   help="output folder (default: benchmarks/results/<timestamp>)")
    p.add_argument("--rounds", type=int, default=None, help="rounds per scenario")
    p.add_argument("--scale", type=float, default=1.0,
                   help="multiply every scenario's message count by this factor")
    p.add_argument("--only", default="", help="comma-separated scenario names to run")
    p.add_argument("--contenders", default="", help="comma-separated contenders to run")
    p.add_argument("--rocketmq-python", default=None,
                   help="interpreter with the PyPI `rocketmq` client (default: "
                        "$RMQ_BENCH_ROCKETMQ_PYTHON, then this interpreter)")
    p.add_argument("--profile", type=Path, default=None,
                   help="run the rmq_async contenders under cProfile, writing one .pstats file "
                        "per run into this folder (slows them down: not for comparisons)")
    p.add_argument("--java-flag", action="append", default=[],
                   help="an extra JVM flag for the Java contenders (repeatable; the comparisons "
                        "use Java's defaults: for checks of the harness, not for figures)")
    p.add_argument("--stall-timeout", type=float, default=60.0,
                   help="seconds without progress before a contender is given up")
    return p.parse_args(argv)


async def main_async(args: argparse.Namespace) -> int:
    import logging

    import structlog

    structlog.configure(
        wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING),
        logger_factory=structlog.PrintLoggerFactory(sys.stderr),
    )
    started_at = datetime.now().strftime("%Y-%m-%d %H:%M:%S")
    stamp = datetime.now().strftime("%Y%m%d-%H%M%S")
    out = args.out or BENCH_DIR / "results" / stamp
    progress = Progress()
    scenarios = plan(args.quick, args.rounds)
    if args.scale != 1.0:
        for sc in scenarios:
            sc.messages = max(QUEUES, int(sc.messages * args.scale))
            sc.title += f" (scaled x{args.scale:g}: {sc.messages:,} messages)"
    if args.only:
        wanted = set(args.only.split(","))
        scenarios = [s for s in scenarios if s.name in wanted]
    only_contenders = set(args.contenders.split(",")) if args.contenders else None
    cpp_python, cpp_why = find_cpp_python(args.rocketmq_python)
    skipped: dict[str, str] = {}
    if cpp_python is None:
        skipped["rocketmq-cpp"] = cpp_why
    try:
        import pyspark  # noqa: F401
    except ImportError:
        spark_missing = "pyspark is not installed (the `spark` extra)"
    else:
        spark_missing = ""
    t_all = time.perf_counter()
    host_all = host_cpu_ticks()
    work = Path(tempfile.mkdtemp(prefix="rmq-bench-"))
    result: dict[str, Any] = {
        "schema": 1, "started_at": started_at,
        "config": {"mode": "quick" if args.quick else "full", "queues": QUEUES,
                   "tuned_consume_message_batch_max_size": TUNED_BATCH,
                   "stall_timeout": args.stall_timeout,
                   "scenarios": [s.__dict__ for s in scenarios]},
        "scenarios": {}, "skipped_contenders": skipped,
    }
    progress.line(f"rmq_async benchmark ({result['config']['mode']}): output in {out}")
    try:
        async with LocalRocketMQ() as rmq:
            progress.line(f"broker up: namesrv {rmq.namesrv_addr}, RocketMQ {rmq.version}")
            java_classes = await compile_java(sorted((BENCH_DIR / "java").glob("*.java")),
                                              rmq.lib_dir)
            result["env"] = environment(rmq, cpp_python)
            java_flags = (*JAVA_FLAGS, *(QUICK_JAVA_FLAGS if args.quick else ()),
                          *args.java_flag)
            result["env"]["java_flags"] = list(java_flags)
            rt = Runtime(rmq=rmq, java_classes=java_classes, cpp_python=cpp_python, work=work,
                         progress=progress, stall_timeout=args.stall_timeout, out=out,
                         profile_dir=args.profile, java_flags=java_flags)
            if args.profile is not None:
                args.profile.mkdir(parents=True, exist_ok=True)
            drain_topics: dict[str, str] = {}
            for sc in scenarios:
                contenders = [c for c in sc.contenders if c not in skipped
                              and (only_contenders is None or c in only_contenders)]
                entry: dict[str, Any] = {"title": sc.title, "kind": sc.kind,
                                         "messages": sc.messages, "body_size": sc.body_size,
                                         "rounds": sc.rounds, "contenders": contenders}
                t_sc = time.perf_counter()
                if sc.kind == "drain":
                    entry.update(await run_drain(rt, sc, contenders))
                    drain_topics[f"{sc.body_size}:{sc.messages}"] = entry["topic"]
                elif sc.kind == "latency":
                    entry.update(await run_latency(rt, sc, contenders))
                elif spark_missing:
                    entry["skipped"] = spark_missing
                else:
                    topic = drain_topics.get(f"{sc.body_size}:{sc.messages}")
                    if topic is None:
                        topic = await new_topic(rt, "bench_spark")
                        entry["preload"] = await preload(rmq.namesrv_addr, topic, sc.messages,
                                                         sc.body_size, progress, sc.name)
                    entry.update(await run_spark(rt, sc, topic))
                entry["scenario_seconds"] = round(time.perf_counter() - t_sc, 1)
                result["scenarios"][sc.name] = entry
    finally:
        shutil.rmtree(work, ignore_errors=True)
    result["total_seconds"] = round(time.perf_counter() - t_all, 1)
    result["host_steal_pct"] = steal_percent(host_all, host_cpu_ticks())
    paths = report.write_all(result, out)
    progress.line(f"done in {result['total_seconds']:.0f} s: " +
                  ", ".join(str(p) for p in paths.values()))
    failures = [r for sc in result["scenarios"].values() for r in sc.get("runs", [])
                if not r.get("verified", r.get("ok", False))]
    if failures or any(sc.get("error") for sc in result["scenarios"].values()):
        progress.line(f"{len(failures)} run(s) failed verification")
        return 1
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    return asyncio.run(main_async(args))


if __name__ == "__main__":
    raise SystemExit(main())

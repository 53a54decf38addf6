"""What every benchmark child process shares: the line protocol, counting, and its own costs.

Standard library only: the child of the ``rocketmq`` (PyPI) contender imports this module from
an interpreter that may not have rmq_async installed.

Line protocol on standard output (the runner reads it):

* ``READY`` once the consumer receives messages (latency runs: once a probe, a message tagged
  :data:`PROBE_TAG`, has arrived from every queue; the runner repeats probes until then);
* ``PROGRESS <count>`` a few times a second;
* ``RESULT <json>`` once, at the end (see :meth:`Tally.result`).
"""

from __future__ import annotations

import itertools
import json
import math
import os
import resource
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

PROBE_TAG = "probe"
"""Tag of the messages sent to every queue, until the consumer has seen one from each, to learn
that it is live before a latency run starts. Probes are not counted."""

WARMUP_TAG = "warmup"
"""Tag of the messages sent at the measured rate before a latency run's measured messages, so
that every contender (a JVM most of all) is warm when measuring starts. Not counted either."""

UNCOUNTED_TAGS = frozenset({PROBE_TAG, WARMUP_TAG})

PROGRESS_INTERVAL = 0.25


#: Above this many contenders the rounds are plain rotations (the search below is over every
#: order of the contenders: 5,040 at seven).
_ORDER_SEARCH_MAX = 7


def round_orders(contenders: Sequence[str], rounds: int) -> list[list[str]]:
    """The contenders' order in each of ``rounds`` rounds: the first as given, each later one
    the order that repeats fewest of the rounds before's adjacent pairs (a contender right
    after the same one: its page cache, the broker's state after it), then puts first and last
    ones that have been there least (the first of the enumeration among equals, so that every
    run uses the same orders). A plain rotation (A B C, B C A, C A B) keeps every pair: B
    would follow A in every round."""
    items = list(contenders)
    if len(items) > _ORDER_SEARCH_MAX:
        return [items[r % len(items):] + items[:r % len(items)] for r in range(rounds)]
    pairs: dict[tuple[str, str], int] = {}
    firsts: dict[str, int] = {}
    lasts: dict[str, int] = {}
    orders: list[list[str]] = []
    for r in range(rounds):
        if r == 0 or not items:
            best = list(items)
        else:
            best = list(min(itertools.permutations(items), key=lambda p: (
                sum(pairs.get(ab, 0) for ab in itertools.pairwise(p)),
                firsts.get(p[0], 0), lasts.get(p[-1], 0))))
        for ab in itertools.pairwise(best):
            pairs[ab] = pairs.get(ab, 0) + 1
        if best:
            firsts[best[0]] = firsts.get(best[0], 0) + 1
            lasts[best[-1]] = lasts.get(best[-1], 0) + 1
        orders.append(best)
    return orders


def emit(line: str) -> None:
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def cpu_times() -> tuple[float, float]:
    """(user, system) CPU seconds of this process, all threads."""
    ru = resource.getrusage(resource.RUSAGE_SELF)
    return ru.ru_utime, ru.ru_stime


def host_cpu_ticks() -> tuple[int, int] | None:
    """(steal, all) clock ticks of the whole machine so far, from the ``cpu`` line of
    ``/proc/stat``; None where that file is not there.

    Steal is time a virtual CPU of this machine wanted to run while the hypervisor ran something
    else: on a shared host it slows every contender, and a single-threaded one more than a
    multi-threaded one, so a run's figures are read together with it.
    """
    try:
        with open("/proc/stat", encoding="ascii") as fh:
            fields = fh.readline().split()
    except OSError:
        return None
    if len(fields) < 9 or fields[0] != "cpu":
        return None
    # user nice system idle iowait irq softirq steal (guest time is already in user and nice)
    ticks = [int(v) for v in fields[1:9]]
    return ticks[7], sum(ticks)


def steal_percent(start: tuple[int, int] | None, end: tuple[int, int] | None) -> float | None:
    """Steal between two :func:`host_cpu_ticks` readings, in percent of the machine's time."""
    if start is None or end is None or end[1] <= start[1]:
        return None
    return round(100.0 * (end[0] - start[0]) / (end[1] - start[1]), 1)


def _stat_fields(pid: int | str) -> list[str] | None:
    """The fields of ``/proc/<pid>/stat`` after the command name (the state, field 3, first);
    None when the process is gone or ``/proc`` is not there."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii") as fh:
            stat = fh.read()
    except OSError:
        return None
    return stat[stat.rindex(")") + 2 :].split()


def process_cpu_seconds(pid: int) -> float | None:
    """User + system CPU seconds of process ``pid`` (all its threads) from ``/proc``; None when
    it is gone or ``/proc`` is not there."""
    fields = _stat_fields(pid)
    if fields is None:
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def thread_waits() -> tuple[float, int] | None:
    """(seconds runnable but waiting for a CPU, involuntary context switches) of the calling
    thread so far, from ``/proc/thread-self``; None where those files are not there.

    rmq_async's event loop is one thread: while another thread (the broker's, on this
    machine) runs on its core, nothing of the consumer moves, and a round that lost much time
    that way is a contended round, not a slower consumer.
    """
    try:
        with open("/proc/thread-self/schedstat", encoding="ascii") as fh:
            waited_ns = int(fh.read().split()[1])
        with open("/proc/thread-self/status", encoding="ascii") as fh:
            status = fh.read()
    except (OSError, IndexError, ValueError):
        return None
    for line in status.splitlines():
        if line.startswith("nonvoluntary_ctxt_switches:"):
            return waited_ns / 1e9, int(line.split()[1])
    return None


#: :func:`side_readings`: the calling thread's :func:`thread_waits` and the broker's CPU seconds.
SideReadings = tuple[tuple[float, int] | None, float | None]


def side_readings(broker_pid: int | None) -> SideReadings:
    """What a timed run reads at its start and at its end besides its own CPU: the event
    loop's waits (call it on that thread) and the broker's CPU (when its pid is known)."""
    return thread_waits(), process_cpu_seconds(broker_pid) if broker_pid else None


def side_figures(start: SideReadings, end: SideReadings) -> dict[str, Any]:
    """The figures of two :func:`side_readings` for a run's result (None where unknown)."""
    (waits0, broker0), (waits1, broker1) = start, end
    out: dict[str, Any] = dict.fromkeys(
        ("loop_waited_s", "loop_involuntary_switches", "broker_cpu"))
    if waits0 is not None and waits1 is not None:
        out["loop_waited_s"] = round(waits1[0] - waits0[0], 3)
        out["loop_involuntary_switches"] = waits1[1] - waits0[1]
    if broker0 is not None and broker1 is not None:
        out["broker_cpu"] = round(broker1 - broker0, 3)
    return out


def tree_cpu_seconds(root: int) -> dict[tuple[int, int], float]:
    """CPU seconds of every live process below ``root`` (children, their children, ...), with
    the CPU of the children each has waited for, keyed by (pid, start time) so that a reused
    pid is another process; from one pass over ``/proc``."""
    try:
        names = os.listdir("/proc")
    except OSError:
        return {}
    table = {int(name): fields for name in names
             if name.isdigit() and (fields := _stat_fields(name)) is not None}
    children: dict[int, list[int]] = {}
    for pid, fields in table.items():
        children.setdefault(int(fields[1]), []).append(pid)  # fields[1]: the parent's pid
    tick = os.sysconf("SC_CLK_TCK")
    out: dict[tuple[int, int], float] = {}
    todo = [root]
    while todo:
        for pid in children.get(todo.pop(), []):
            fields = table[pid]
            ticks = sum(int(fields[i]) for i in (11, 12, 13, 14))  # utime stime cutime cstime
            out[(pid, int(fields[19]))] = ticks / tick  # fields[19]: starttime
            todo.append(pid)
    return out


def peak_rss_kib() -> int:
    """Peak resident set size of this process (``VmHWM``), KiB."""
    try:
        with open("/proc/self/status", encoding="ascii") as fh:
            for line in fh:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)


def percentiles(values: Sequence[float]) -> dict[str, float] | None:
    """Nearest-rank percentiles (p50, p90, p99, p99.9), max and mean; None when empty."""
    n = len(values)
    if n == 0:
        return None
    v = sorted(values)

    def rank(q: float) -> float:
        i = math.ceil(q * n) - 1
        return v[max(0, min(n - 1, i))]

    return {"n": n, "p50": rank(0.50), "p90": rank(0.90), "p99": rank(0.99),
            "p999": rank(0.999), "max": v[-1], "mean": round(sum(v) / n, 3)}


@dataclass
class Tally:
    """Counts what a listener saw and flags duplicates with one bit per (queue, offset).

    ``expected`` bounds the offsets of a freshly preloaded topic, so a bitmap of
    ``expected`` bits per queue holds every offset; an offset past it cannot be ours and is
    counted as a duplicate too (the run then fails verification).
    """

    expected: int
    latency: bool = False
    consumed: int = 0
    duplicates: int = 0
    body_bytes: int = 0
    listener_calls: int = 0
    probe_queues: set[int] = field(default_factory=set)
    first_at: float = 0.0
    end_at: float = 0.0
    b2c: list[int] = field(default_factory=list)
    s2c: list[int] = field(default_factory=list)
    _maps: dict[int, bytearray] = field(default_factory=dict)

    def mark(self, queue_id: int, offset: int) -> None:
        bitmap = self._maps.get(queue_id)
        if bitmap is None:
            bitmap = self._maps[queue_id] = bytearray(self.expected // 8 + 1)
        word = offset >> 3
        if word >= len(bitmap):
            self.duplicates += 1
            return
        bit = 1 << (offset & 7)
        if bitmap[word] & bit:
            self.duplicates += 1
        else:
            bitmap[word] |= bit

    def add(self, n: int, now: float) -> bool:
        """Count ``n`` messages of one listener call; True when the expected count is reached."""
        before = self.consumed
        self.consumed = before + n
        self.listener_calls += 1
        if before == 0:
            self.first_at = now
        if before < self.expected <= self.consumed:
            self.end_at = now
            return True
        return False

    def result(self, *, ok: bool, reason: str, started_at: float, ready_at: float,
               cpu_start: tuple[float, float], cpu_end: tuple[float, float],
               extra: dict[str, Any] | None = None) -> dict[str, Any]:
        total = cpu_times()
        end = self.end_at if ok and self.end_at else time.perf_counter()
        out: dict[str, Any] = {
            "ok": ok,
            "reason": reason,
            "consumed": self.consumed,
            "duplicates": self.duplicates,
            "body_bytes": self.body_bytes,
            "listener_calls": self.listener_calls,
            "seconds": round(end - started_at, 6),
            "first_message_seconds": round(self.first_at - started_at, 6) if self.first_at else -1,
            "ready_seconds": round(ready_at - started_at, 6) if ready_at else -1,
            "cpu_user": round(cpu_end[0] - cpu_start[0], 3),
            "cpu_sys": round(cpu_end[1] - cpu_start[1], 3),
            "cpu_user_total": round(total[0], 3),
            "cpu_sys_total": round(total[1], 3),
            "peak_rss_kib": peak_rss_kib(),
            "runtime": f"Python {sys.version.split()[0]}",
            "latency_b2c_ms": percentiles(self.b2c) if self.latency else None,
            "latency_s2c_ms": percentiles(self.s2c) if self.latency else None,
        }
        if extra:
            out.update(extra)
        return out


def emit_result(result: dict[str, Any]) -> None:
    emit("RESULT " + json.dumps(result, separators=(",", ":")))

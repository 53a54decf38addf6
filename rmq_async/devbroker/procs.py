"""Child JVM processes: spawning (with a parent-death signal), pid records, stopping, reaping.

Every run of a local RocketMQ owns a run folder and writes ``pids.json`` into it, plus a copy
in a shared registry folder (:func:`registry_dir`). A later start reaps the runs whose owner
process is gone: their JVMs are killed (after checking the pid still runs a command that
mentions the run folder, so a recycled pid is never hit) and their folders removed.

Processes are plain :class:`subprocess.Popen` objects rather than asyncio transports so that a
broker started in one event loop can be used, stopped and waited for from another (pytest gives
each test its own loop).
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import json
import os
import shutil
import signal
import stat
import subprocess
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anyio
import structlog

from rmq_async.devbroker.errors import DevBrokerError

__all__ = [
    "RunRecord",
    "pdeathsig_preexec",
    "pid_alive",
    "pid_cmdline",
    "pid_start_ticks",
    "reap_stale_runs",
    "registry_dir",
    "runs_root",
    "spawn",
    "stop_process",
    "stop_pid",
    "pid_mentions",
    "write_whole",
    "wait_exit",
]

log = structlog.get_logger(__name__)

_PR_SET_PDEATHSIG = 1


def runs_root() -> Path:
    """``$RMQ_ASYNC_RUN_DIR``, else ``<tmp>/rmq_async-devbroker-<uid>``: run folders + registry.

    Created private (0700). Its run records decide which processes a start kills and which
    folders it deletes, so a folder this user does not own, or that others may write to (one
    another local user created first in the shared temporary folder), is refused with a
    :class:`DevBrokerError`.
    """
    explicit = os.environ.get("RMQ_ASYNC_RUN_DIR")
    if explicit:
        path = Path(explicit).expanduser().resolve()
    else:
        path = Path(tempfile.gettempdir()) / f"rmq_async-devbroker-{os.getuid()}"
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    info = os.lstat(path)
    if (not stat.S_ISDIR(info.st_mode) or info.st_uid != os.getuid()
            or info.st_mode & (stat.S_IWGRP | stat.S_IWOTH)):
        raise DevBrokerError(
            f"the dev broker's run folder {path} is not a private folder of this user (owner "
            f"uid {info.st_uid}, mode {stat.S_IMODE(info.st_mode):o}); remove it, or set "
            "RMQ_ASYNC_RUN_DIR to a folder of your own")
    return path


def registry_dir() -> Path:
    """Shared folder of run records (one JSON file per live run)."""
    path = runs_root() / "registry"
    path.mkdir(parents=True, exist_ok=True)
    return path


def pdeathsig_preexec(parent_pid: int,
                      sig: signal.Signals = signal.SIGKILL) -> Callable[[], None]:
    """A ``preexec_fn`` that asks Linux to send ``sig`` to the child when its parent thread
    exits."""
    libc_name = ctypes.util.find_library("c") or "libc.so.6"
    libc = ctypes.CDLL(libc_name, use_errno=True)

    def preexec() -> None:
        libc.prctl(_PR_SET_PDEATHSIG, sig, 0, 0, 0)
        # The parent may have died between fork and prctl: then nobody would ever signal us.
        if os.getppid() != parent_pid:
            os.kill(os.getpid(), sig)

    return preexec


def spawn(cmd: Sequence[str], *, cwd: Path, env: Mapping[str, str], output: Path,
          die_with_parent: bool, stdin_pipe: bool = False) -> subprocess.Popen[bytes]:
    """Start ``cmd`` in its own session with stdout+stderr appended to ``output``.

    ``die_with_parent`` sets ``PR_SET_PDEATHSIG=SIGKILL``. Linux delivers it when the *thread*
    that forked the child ends, so call this from a long-lived thread (the event-loop thread).
    """
    output.parent.mkdir(parents=True, exist_ok=True)
    preexec = pdeathsig_preexec(os.getpid()) if die_with_parent else None
    with open(output, "ab") as out:
        return subprocess.Popen(
            list(cmd),
            cwd=cwd,
            env=dict(env),
            stdin=subprocess.PIPE if stdin_pipe else subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            preexec_fn=preexec,
            close_fds=True,
        )


def output_tail(path: Path, n: int) -> list[str]:
    """The last ``n`` lines of a process's output file (of its last 256 KiB)."""
    try:
        with open(path, "rb") as fh:
            fh.seek(0, os.SEEK_END)
            size = fh.tell()
            fh.seek(max(0, size - 256 * 1024))
            data = fh.read()
    except OSError:
        return []
    return data.decode(errors="replace").splitlines()[-n:]


def output_since(path: Path, offset: int) -> str:
    """What a process wrote to its output file after ``offset`` bytes."""
    try:
        with open(path, "rb") as fh:
            fh.seek(offset)
            return fh.read().decode(errors="replace")
    except OSError:
        return ""


def output_size(path: Path) -> int:
    """The size of an output file, 0 when there is none yet."""
    try:
        return path.stat().st_size
    except OSError:
        return 0


def pid_alive(pid: int) -> bool:
    """True if ``pid`` exists and is not a zombie."""
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return True
    # Field 3 (after the parenthesised command) is the state; Z = zombie, X = dead.
    state = stat.rsplit(")", 1)[-1].split()[0] if ")" in stat else ""
    return state not in ("Z", "X")


def pid_start_ticks(pid: int) -> int | None:
    """Start time of ``pid`` in clock ticks since boot (``/proc/<pid>/stat`` field 22)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat.rsplit(")", 1)[-1].split()
    try:
        return int(fields[19])
    except (IndexError, ValueError):
        return None


def pid_cmdline(pid: int) -> str:
    """The command line of ``pid`` joined by spaces ("" when unreadable)."""
    try:
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return ""
    return raw.replace(b"\0", b" ").decode(errors="replace")


async def wait_exit(proc: subprocess.Popen[bytes], limit: float | None) -> bool:
    """Wait (without blocking the loop) until ``proc`` exits; False if ``limit`` seconds ran out.

    Uses a pidfd, which becomes readable when the process ends, so no polling is involved.
    """
    if proc.poll() is not None:
        return True
    try:
        fd = os.pidfd_open(proc.pid)
    except ProcessLookupError:
        proc.wait()
        return True
    try:
        with anyio.move_on_after(limit):
            await anyio.wait_readable(fd)
    finally:
        os.close(fd)
    # Readable means exited: reap it (instant) so returncode is set.
    return proc.poll() is not None or _reap_now(proc)


def _reap_now(proc: subprocess.Popen[bytes]) -> bool:
    try:
        proc.wait(timeout=0.5)
    except subprocess.TimeoutExpired:
        return False
    return True


async def stop_process(proc: subprocess.Popen[bytes], *, grace: float = 20.0) -> int:
    """SIGTERM ``proc``, wait up to ``grace`` seconds, then SIGKILL; return its exit status."""
    if proc.poll() is None:
        if grace > 0:
            with contextlib.suppress(ProcessLookupError):
                proc.send_signal(signal.SIGTERM)
            await wait_exit(proc, grace)
        if proc.poll() is None:
            if grace > 0:
                log.warning("devbroker.process.kill", pid=proc.pid, after_seconds=grace)
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
            await wait_exit(proc, None)
    rc = proc.returncode
    assert rc is not None
    return rc


def pid_mentions(pid: int, text: str) -> bool:
    """``pid`` runs and its command line contains ``text`` (a run's JVMs name its folder): not
    a pid reused by another process."""
    return pid_alive(pid) and text in pid_cmdline(pid)


def write_whole(path: Path, text: str) -> None:
    """Write ``path`` so that a reader sees the old content or the new, never half of it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    partial.write_text(text)
    partial.replace(path)


def stop_pid(pid: int, *, grace: float = 20.0, must_mention: str | None = None) -> bool:
    """Blocking SIGTERM-then-SIGKILL of a pid that is not our child (detached runs, stale runs).

    With ``must_mention``, the pid is only signalled if its command line contains that text.
    Returns True if a process was signalled.
    """
    if not (pid_alive(pid) if must_mention is None else pid_mentions(pid, must_mention)):
        return False
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + grace
    while pid_alive(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    if pid_alive(pid):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
        while pid_alive(pid):
            time.sleep(0.02)
    return True


@dataclass
class RunRecord:
    """What a run leaves on disk so that it can be found and cleaned up later."""

    run_id: str
    workdir: Path
    owner_pid: int | None  # None: detached (command-line ``up``), never reaped as stale
    remove_workdir: bool
    owner_start: int | None = None
    pids: dict[str, int] = field(default_factory=dict)
    info: dict[str, Any] = field(default_factory=dict)

    def disown(self) -> None:
        """A detached run that is up: no owner from now on (it belongs to ``down``)."""
        self.owner_pid = None
        self.owner_start = None

    @property
    def registry_file(self) -> Path:
        return registry_dir() / f"{self.run_id}.json"

    @property
    def pid_file(self) -> Path:
        return self.workdir / "pids.json"

    def to_json(self) -> str:
        return json.dumps(
            {
                "run_id": self.run_id,
                "workdir": str(self.workdir),
                "owner_pid": self.owner_pid,
                "owner_start": self.owner_start,
                "remove_workdir": self.remove_workdir,
                "pids": self.pids,
                "info": self.info,
            },
            indent=1,
        )

    @classmethod
    def from_json(cls, text: str) -> RunRecord:
        data = json.loads(text)
        return cls(
            run_id=str(data["run_id"]),
            workdir=Path(data["workdir"]),
            owner_pid=None if data.get("owner_pid") is None else int(data["owner_pid"]),
            remove_workdir=bool(data.get("remove_workdir", False)),
            owner_start=None if data.get("owner_start") is None else int(data["owner_start"]),
            pids={str(k): int(v) for k, v in dict(data.get("pids", {})).items()},
            info=dict(data.get("info", {})),
        )

    def save(self) -> None:
        text = self.to_json()
        for target in (self.pid_file, self.registry_file):
            write_whole(target, text)

    def forget(self) -> None:
        """Remove the registry entry (and the run folder when this run created it)."""
        with contextlib.suppress(FileNotFoundError):
            self.registry_file.unlink()
        if self.remove_workdir:
            shutil.rmtree(self.workdir, ignore_errors=True)
        else:
            with contextlib.suppress(FileNotFoundError):
                self.pid_file.unlink()

    def owner_alive(self) -> bool:
        """True while the owning process (same pid and same start time) still runs."""
        if self.owner_pid is None or not pid_alive(self.owner_pid):
            return False
        return self.owner_start is None or pid_start_ticks(self.owner_pid) == self.owner_start

    def kill_all(self, *, grace: float = 10.0) -> list[int]:
        """Stop every recorded JVM still running for this run folder; return the pids hit."""
        hit = []
        order = sorted(self.pids, key=lambda name: name != "broker")  # broker before namesrv
        for pid in (self.pids[name] for name in order):
            if stop_pid(pid, grace=grace, must_mention=str(self.workdir)):
                hit.append(pid)
        return hit


def reap_stale_runs() -> list[RunRecord]:
    """Kill and remove runs whose owner process died without cleaning up."""
    reaped = []
    for entry in sorted(registry_dir().glob("*.json")):
        try:
            record = RunRecord.from_json(entry.read_text())
        except (OSError, ValueError, KeyError, TypeError):
            with contextlib.suppress(OSError):
                entry.unlink()
            continue
        if record.owner_pid is not None and record.owner_alive():
            continue
        if record.owner_pid is None and any(pid_mentions(p, str(record.workdir))
                                            for p in record.pids.values()):
            continue  # a detached run that is still up: it belongs to `down`
        killed = record.kill_all(grace=5.0)
        record.forget()
        log.info("devbroker.reaped", run_id=record.run_id, workdir=str(record.workdir),
                 killed=killed)
        reaped.append(record)
    return reaped

"""Compile and run small Java programs against the RocketMQ jars (reference clients in tests).

- :func:`compile_java` runs ``javac`` once per distinct set of sources (a content hash names
  the output folder), so repeated test runs reuse the classes.
- :func:`run_java` runs a ``main`` to completion and returns ``(rc, stdout, stderr)``.
- :func:`start_java` starts a long-running program and returns a :class:`JavaProcess` (an async
  context manager) whose stdout lines are collected as they arrive; it is killed on exit and,
  should this process die first, by the kernel (parent-death signal).

Every JVM gets a small heap, its own temporary ``user.home`` (client logs land there) and the
client logback configuration.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import os
import re
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import TracebackType

import anyio
import anyio.to_thread
import structlog

from rmq_async.errors import InvalidArgumentError

from .config import jvm_tmpdir
from .errors import DevBrokerError
from .maven import cache_root, find_tool
from .procs import pdeathsig_preexec

__all__ = [
    "JAVA_CLIENT_FLAGS",
    "JavaProcess",
    "classpath",
    "compile_java",
    "java_command",
    "run_java",
    "start_java",
]

log = structlog.get_logger(__name__)

#: Flags for client-side JVMs (tests' reference producers and consumers).
JAVA_CLIENT_FLAGS: tuple[str, ...] = (
    "-Xmx256m",
    "-XX:+UseSerialGC",
    "-XX:TieredStopAtLevel=1",
    "-Djava.net.preferIPv4Stack=true",
    "-Drmq.logback.configurationFile=rmq.client.logback.xml",
)

_CLASS_RE = re.compile(r"^[A-Za-z_$][\w$]*(\.[A-Za-z_$][\w$]*)*$")


def classpath(lib_dir: Path | str, *class_dirs: Path | str) -> list[str]:
    """Class folders first, then every jar of ``lib_dir``."""
    return [*(str(d) for d in class_dirs), f"{lib_dir}/*"]


def _sources_digest(sources: Sequence[Path], lib_dir: Path, javac: Path) -> str:
    h = hashlib.sha256()
    h.update(str(javac).encode())
    h.update(b"\0")
    h.update(str(Path(lib_dir).resolve()).encode())
    for src in sorted(sources, key=lambda p: p.name):
        h.update(b"\0")
        h.update(src.name.encode())
        h.update(b"\0")
        h.update(src.read_bytes())
    return h.hexdigest()[:20]


def _plan_compile(sources: list[Path | str], lib: Path, out_dir: Path | str | None,
                  javac: Path) -> tuple[list[Path], Path, Path | None]:
    """(sources, class folder, staging folder or None when already compiled)."""
    paths = [Path(s).resolve() for s in sources]
    if not paths:
        raise InvalidArgumentError("compile_java needs at least one source file")
    for p in paths:
        if p.suffix != ".java" or not p.is_file():
            raise InvalidArgumentError(f"not a Java source file: {p}")
    base = Path(out_dir) if out_dir is not None else cache_root() / "java-classes"
    target = base / _sources_digest(paths, lib, javac)
    if (target / ".complete").is_file():
        return paths, target, None
    base.mkdir(parents=True, exist_ok=True)
    return paths, target, Path(tempfile.mkdtemp(prefix=".javac-", dir=base))


def _publish_compile(staging: Path, target: Path) -> None:
    (staging / ".complete").write_text("ok\n")
    try:
        staging.rename(target)
    except OSError:
        # Another process finished the same compilation first: use theirs.
        shutil.rmtree(staging, ignore_errors=True)
        if not (target / ".complete").is_file():
            raise


async def compile_java(sources: Sequence[Path | str], lib_dir: Path | str,
                       out_dir: Path | str | None = None) -> Path:
    """Compile ``sources`` against ``lib_dir/*``; return the folder holding the classes.

    The folder is ``<out_dir>/<hash of the sources, lib folder and javac>``; when it already
    exists nothing is compiled. ``out_dir`` defaults to ``<cache root>/java-classes``.
    A compile error raises :class:`DevBrokerError` with javac's messages.
    """
    javac = find_tool("javac")
    paths, target, staging = await anyio.to_thread.run_sync(
        _plan_compile, list(sources), Path(lib_dir), out_dir, javac
    )
    if staging is None:
        return target
    cmd = [str(javac), "-J-Xmx256m", "-encoding", "UTF-8", "-nowarn", "-proc:none",
           "-cp", f"{lib_dir}/*", "-d", str(staging), *(str(p) for p in paths)]
    started = time.monotonic()
    proc = await anyio.run_process(cmd, check=False, stderr=subprocess.STDOUT)
    if proc.returncode != 0:
        shutil.rmtree(staging, ignore_errors=True)
        raise DevBrokerError(
            f"javac failed ({proc.returncode}) for {', '.join(p.name for p in paths)}:\n"
            f"{proc.stdout.decode(errors='replace')}"
        )
    await anyio.to_thread.run_sync(_publish_compile, staging, target)
    log.info("devbroker.java.compiled", sources=[p.name for p in paths], folder=str(target),
             seconds=round(time.monotonic() - started, 2))
    return target


def java_command(main_class: str, args: Sequence[str], cp: Sequence[Path | str] | str, *,
                 user_home: Path, jvm_flags: Sequence[str] = ()) -> list[str]:
    """The ``java`` command line for ``main_class`` with the client flags."""
    if not _CLASS_RE.match(main_class):
        raise InvalidArgumentError(f"not a Java class name: {main_class!r}")
    cp_text = cp if isinstance(cp, str) else os.pathsep.join(str(c) for c in cp)
    return [str(find_tool("java")), *JAVA_CLIENT_FLAGS, *jvm_flags,
            f"-Duser.home={user_home}", f"-Djava.io.tmpdir={jvm_tmpdir(user_home)}",
            "-cp", cp_text, main_class, *args]


def _child_env(env: Mapping[str, str] | None) -> dict[str, str]:
    out = {k: v for k, v in os.environ.items() if k != "JAVA_TOOL_OPTIONS"}
    if env:
        out.update(env)
    return out


async def run_java(main_class: str, args: Sequence[str], classpath: Sequence[Path | str] | str,
                   *, timeout: float, env: Mapping[str, str] | None = None,
                   jvm_flags: Sequence[str] = ()) -> tuple[int, str, str]:
    """Run ``main_class`` to completion; return ``(exit status, stdout, stderr)``.

    Raises :class:`DevBrokerError` (with the output so far) if it runs longer than ``timeout``
    seconds; the JVM is killed then.
    """
    with tempfile.TemporaryDirectory(prefix="rmq-java-") as home:
        cmd = java_command(main_class, args, classpath, user_home=Path(home), jvm_flags=jvm_flags)
        proc = await asyncio.create_subprocess_exec(
            *cmd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            env=_child_env(env), cwd=home, start_new_session=True,
            preexec_fn=pdeathsig_preexec(os.getpid()),
        )
        communicate = asyncio.ensure_future(proc.communicate())
        try:
            done, _ = await asyncio.wait({communicate}, timeout=timeout)
            if not done:
                with contextlib.suppress(ProcessLookupError):
                    proc.kill()
                out, err = await communicate
                raise DevBrokerError(
                    f"java {main_class} did not finish within {timeout}s (killed).\n"
                    f"stdout:\n{out.decode(errors='replace')[-4000:]}\n"
                    f"stderr:\n{err.decode(errors='replace')[-4000:]}"
                )
            out, err = communicate.result()
        finally:
            if not communicate.done():
                with contextlib.suppress(ProcessLookupError):
                    proc.kill()
                communicate.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await communicate
        rc = proc.returncode
        assert rc is not None
        return rc, out.decode(errors="replace"), err.decode(errors="replace")


class JavaProcess:
    """A long-running Java program; its stdout lines are collected in :attr:`lines`.

    Use as ``async with start_java(...) as jp:``. On exit stdin is closed (a polite stop for
    programs that watch it), then SIGTERM after ``stop_grace`` seconds, then SIGKILL.
    """

    def __init__(self, cmd: list[str], *, env: Mapping[str, str] | None, home: Path,
                 stop_grace: float = 5.0, main_class: str = "") -> None:
        self._cmd = cmd
        self.main_class = main_class
        self._env = _child_env(env)
        self._home = home
        self.stop_grace = stop_grace
        self.lines: list[str] = []
        self._proc: asyncio.subprocess.Process | None = None
        self._reader: asyncio.Task[None] | None = None
        self._changed = asyncio.Event()
        self._eof = False

    @property
    def pid(self) -> int:
        if self._proc is None:
            raise DevBrokerError("Java process not started")
        return self._proc.pid

    @property
    def returncode(self) -> int | None:
        return None if self._proc is None else self._proc.returncode

    @property
    def stderr_path(self) -> Path:
        return self._home / "stderr.log"

    def stderr_tail(self, n: int = 40) -> str:
        try:
            text = self.stderr_path.read_text(errors="replace")
        except OSError:
            return ""
        return "\n".join(text.splitlines()[-n:])

    async def __aenter__(self) -> JavaProcess:
        err = os.open(self.stderr_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            self._proc = await asyncio.create_subprocess_exec(
                *self._cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err,
                env=self._env, cwd=self._home, start_new_session=True,
                preexec_fn=pdeathsig_preexec(os.getpid()),
            )
        except BaseException:
            shutil.rmtree(self._home, ignore_errors=True)
            raise
        finally:
            os.close(err)
        self._reader = asyncio.create_task(self._read_lines(), name=f"java-stdout-{self.pid}")
        log.info("devbroker.java.started", pid=self.pid, main=self.main_class)
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> None:
        await self.stop()

    async def _read_lines(self) -> None:
        assert self._proc is not None and self._proc.stdout is not None
        try:
            while True:
                raw = await self._proc.stdout.readline()
                if not raw:
                    break
                self.lines.append(raw.decode(errors="replace").rstrip("\r\n"))
                self._changed.set()
        finally:
            self._eof = True
            self._changed.set()

    async def send(self, line: str) -> None:
        """Write one line to the program's stdin."""
        assert self._proc is not None and self._proc.stdin is not None
        self._proc.stdin.write(line.encode() + b"\n")
        await self._proc.stdin.drain()

    async def wait_for(self, pattern: str | re.Pattern[str], timeout: float, *,
                       start: int = 0) -> str:
        """The first line at index >= ``start`` containing ``pattern`` (a substring or regex).

        Raises :class:`DevBrokerError` (quoting stdout and stderr) on timeout or if the program
        ends first.
        """
        regex = pattern if isinstance(pattern, re.Pattern) else re.compile(re.escape(pattern))
        deadline = time.monotonic() + timeout
        index = start
        while True:
            while index < len(self.lines):
                if regex.search(self.lines[index]):
                    return self.lines[index]
                index += 1
            if self._eof:
                raise DevBrokerError(self._explain(f"ended before printing {regex.pattern!r}"))
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise DevBrokerError(self._explain(f"printed no {regex.pattern!r} in {timeout}s"))
            self._changed.clear()
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(remaining):  # not wait_for: see Rebalancer.run
                    await self._changed.wait()

    def _explain(self, what: str) -> str:
        out = "\n".join(self.lines[-40:])
        return (f"Java process {self.pid} {what} (exit status {self.returncode}).\n"
                f"stdout:\n{out}\nstderr:\n{self.stderr_tail()}")

    async def stop(self) -> int | None:
        """Close stdin, then SIGTERM after ``stop_grace`` seconds, then SIGKILL; wait for exit."""
        proc = self._proc
        if proc is None:
            return None
        try:
            if proc.returncode is None and proc.stdin is not None:
                with contextlib.suppress(OSError, RuntimeError):
                    proc.stdin.close()
            for sig in (signal.SIGTERM, signal.SIGKILL):
                if proc.returncode is not None:
                    break
                try:
                    async with asyncio.timeout(self.stop_grace):
                        await asyncio.shield(proc.wait())
                except TimeoutError:
                    with contextlib.suppress(ProcessLookupError):
                        proc.send_signal(sig)
            await proc.wait()
        finally:
            if self._reader is not None:
                with contextlib.suppress(asyncio.CancelledError):
                    await self._reader
            shutil.rmtree(self._home, ignore_errors=True)
        log.info("devbroker.java.stopped", pid=proc.pid, main=self.main_class,
                 status=proc.returncode)
        return proc.returncode


def start_java(main_class: str, args: Sequence[str], classpath: Sequence[Path | str] | str, *,
               env: Mapping[str, str] | None = None, jvm_flags: Sequence[str] = (),
               stop_grace: float = 5.0) -> JavaProcess:
    """A :class:`JavaProcess` for ``main_class`` (started by ``async with``)."""
    home = Path(tempfile.mkdtemp(prefix="rmq-java-"))
    cmd = java_command(main_class, args, classpath, user_home=home, jvm_flags=jvm_flags)
    return JavaProcess(cmd, env=env, home=home, stop_grace=stop_grace, main_class=main_class)

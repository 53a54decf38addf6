"""The resident admin helper: one JVM (``java/DevAdmin.java``) per local RocketMQ or cluster.

It creates topics, reads routes, registers brokers and manages ACL accounts on request, so
each such step costs a socket round trip instead of a JVM start. It prints the port it
listens on, answers one request per connection (tab-separated words in, result lines out,
``ERR <reason>`` on failure) and exits when its stdin, our pipe, closes.
"""

from __future__ import annotations

import contextlib
import re
import secrets
import subprocess
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

import anyio

from .errors import DevBrokerError
from .procs import output_since, output_size, output_tail, spawn, stop_process

_PORT_RE = re.compile(r"DEVADMIN PORT (\d+)")


class AdminHelper:
    """One admin helper process and the requests sent to it."""

    def __init__(self) -> None:
        self.proc: subprocess.Popen[bytes] | None = None
        self._port = 0
        self._token = ""
        self._out: Path | None = None
        self._out_offset = 0

    def spawn(self, cmd: Sequence[str], *, cwd: Path, env: Mapping[str, str], output: Path,
              die_with_parent: bool) -> None:
        """Start the helper, its output appended to ``output``."""
        # A helper started again (after a port clash) appends to the same file: its port is
        # the one printed after this point.
        self._out, self._out_offset = output, output_size(output)
        # Requests start with a token only this process knows: the helper's loopback port
        # takes connections from every local user, and it signs as the internal super user.
        self._token = secrets.token_hex(16)
        self.proc = spawn(cmd, cwd=cwd, env={**env, "RMQ_DEVADMIN_TOKEN": self._token},
                          output=output, die_with_parent=die_with_parent, stdin_pipe=True)
        self._port = 0

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    async def ready(self, timeout: float) -> int:
        """The helper's port, waiting for it to print it."""
        if self._port:
            return self._port
        if self._out is None:
            raise DevBrokerError("the admin helper was not started")
        deadline = time.monotonic() + timeout
        while True:
            m = _PORT_RE.search(output_since(self._out, self._out_offset))
            if m:
                self._port = int(m.group(1))
                return self._port
            if not self.alive or time.monotonic() > deadline:
                tail = "\n".join(output_tail(self._out, 40))
                raise DevBrokerError(f"the admin helper did not start:\n{tail}")
            await anyio.sleep(0.05)

    async def request(self, *words: str, timeout: float = 30.0) -> list[str]:
        """Send one request; return its result lines.

        Raises :class:`DevBrokerError` when the helper answers ``ERR`` or not at all.
        """
        port = await self.ready(timeout)
        with anyio.fail_after(timeout):
            stream = await anyio.connect_tcp("127.0.0.1", port)
            async with stream:
                await stream.send("\t".join((self._token, *words)).encode() + b"\n")
                chunks = []
                while True:
                    try:
                        chunks.append(await stream.receive())
                    except anyio.EndOfStream:
                        break
        lines = b"".join(chunks).decode(errors="replace").splitlines()
        if not lines:
            raise DevBrokerError(f"the admin helper gave no answer to {words[0]!r}")
        if lines[0].startswith("ERR"):
            raise DevBrokerError(f"admin {' '.join(_shown(words))}: {lines[0][4:]}")
        return lines

    def close_stdin(self) -> None:
        """Ask the helper to exit (it does when its stdin closes)."""
        if self.proc is not None and self.proc.stdin is not None:
            with contextlib.suppress(OSError):
                self.proc.stdin.close()

    async def stop(self, grace: float) -> None:
        """Close its stdin and wait for it to exit (killed after ``grace`` seconds)."""
        self.close_stdin()
        if self.proc is not None:
            await stop_process(self.proc, grace=grace)
            self.proc = None


def _shown(words: tuple[str, ...]) -> list[str]:
    """A request's words as an error quotes them: a ``user`` request's secret key left out."""
    shown = list(words)
    if shown and shown[0] == "user" and len(shown) > 3:
        shown[3] = "<secret>"
    return shown

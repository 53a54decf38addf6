"""``rmq-async run module:attr``: run consumers until SIGTERM / SIGINT, then drain.

The target is a :class:`~rmq_async.PushConsumer`, an :class:`~rmq_async.App`, a list of
consumers, or a callable (sync or async) returning one of those. On the first SIGTERM or SIGINT
the consumers stop: pulling ends at once, listener calls in flight finish within the grace
period and their offsets are persisted; the process exits 0. A second signal, or a drain that
overruns the grace period, exits 1 at once; a drain that ended in time but left work undone
(a consumer's ``stop_shortfalls``: listener calls given up, offsets not persisted, orderly
locks not given back, a sink not closed) exits 1 after it. The grace period counts from the
signal: one that comes while the target is still starting leaves the drain what is left of it
(at least a second).

With ``--workers N`` (N > 1) the process supervises N worker processes, each running the same
command with its own import of the target (so its own consumer instances, members of the same
groups). It forwards SIGTERM / SIGINT to them and exits 0 when every worker exited 0 after a
signal; a worker that exits on its own makes the supervisor stop the others and exit 1.

``--metrics-port P`` serves the consumers' Prometheus metrics (the ``prometheus`` extra,
:mod:`rmq_async.observability.prometheus`) at ``http://host:P/metrics``; with ``--workers N``
worker ``i`` serves its own on port ``P + i``.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import inspect
import os
import signal
import stat
import sys
import time
from collections.abc import Sequence
from typing import Any

import anyio
import structlog

from rmq_async.app import App
from rmq_async.cli.common import CliError, CommandFailed
from rmq_async.consumer.push import PushConsumer
from rmq_async.errors import RocketMQError

__all__ = ["as_app", "load_target", "run_supervisor", "run_worker"]

log = structlog.get_logger("rmq_async.cli")

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
#: A supervisor stops its workers through a pipe of their own, not with a signal: a byte per
#: stop request (its end when the supervisor is gone). A worker that gets a stop signal itself
#: as well (systemd's ``KillMode=control-group`` sends SIGTERM to every process of the unit)
#: then takes the two for one request, not for a second, forcing one; and no signal handler
#: of the target's (``faulthandler.register``, say) can take the stop away. The pipe's
#: descriptor in the worker:
STOP_FD_ENV = "RMQ_ASYNC_STOP_FD"
#: A worker's exit status for a usage error (its target could not be loaded), passed on.
USAGE_STATUS = 2


def _worker_preexec() -> None:
    """A worker's stop signals wait (blocked, pending) until its handlers are in place: one
    sent while it starts is a stop request, not its death. (A worker whose supervisor dies
    sees its stop pipe end: no parent-death signal, which Linux may send more than once.)"""
    signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)


#: Seconds the supervisor gives its workers beyond ``--grace`` (their own drain is bounded by
#: it) before it kills them.
OVERRUN_MARGIN = 5.0

#: Seconds a worker's drain gets at least, when a stop requested during a slow start left
#: less of the grace period (within OVERRUN_MARGIN).
DRAIN_FLOOR = 1.0
WORKER_ENV = "RMQ_ASYNC_WORKER"
"""Set to the worker's index (0-based) in each worker process of ``--workers N``."""


def load_target(spec: str) -> object:
    """Import ``module:attr`` (``attr`` may be dotted) with the current directory importable."""
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise CliError(f"expected module:attribute (like examples.listener:consumer), got {spec!r}")
    if module_name.startswith("."):
        raise CliError(f"cannot import {module_name!r}: a relative name; give the module's "
                       "full name")
    cwd = os.getcwd()
    if cwd not in sys.path:
        sys.path.insert(0, cwd)
    try:
        obj: object = importlib.import_module(module_name)
    except ImportError as exc:
        raise CliError(f"cannot import {module_name!r}: {exc}") from exc
    except Exception as exc:  # the module's own code failed (a SyntaxError among them)
        raise CommandFailed(f"importing {module_name!r} failed: "
                            f"{type(exc).__name__}: {exc}") from exc
    for part in attr.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError as exc:
            raise CliError(f"{spec!r}: {type(obj).__name__} has no attribute {part!r}") from exc
    return obj


async def as_app(target: object) -> App:
    """The :class:`App` a target stands for (calling a factory first)."""
    obj = target
    if callable(obj) and not isinstance(obj, PushConsumer | App):
        try:
            obj = obj()
            if inspect.isawaitable(obj):
                obj = await obj
        except RocketMQError:
            raise
        except Exception as exc:
            raise CommandFailed(f"the target's factory {_qualname(target)} failed: "
                                f"{type(exc).__name__}: {exc}") from exc
    if isinstance(obj, App):
        return obj
    if isinstance(obj, PushConsumer):
        return App(obj)
    if isinstance(obj, list | tuple) and obj and all(isinstance(c, PushConsumer) for c in obj):
        return App(*obj)
    raise CliError(f"the target is a {type(obj).__name__}; expected a PushConsumer, an App, a "
                   "list of PushConsumers or a callable returning one of those")


def _qualname(fn: object) -> str:
    return str(getattr(fn, "__qualname__", None) or repr(fn))


def listener_timeout(grace: float) -> float:
    """How long in-flight listener calls may run: the grace period minus time kept for
    persisting offsets and unregistering (a quarter of it, at most 2 s)."""
    return max(grace - min(2.0, grace / 4), 0.0)


def _serve_metrics(app: App, port: int) -> Any:
    """Export the app's consumers to Prometheus and serve them on ``port`` (``prometheus``
    extra); returns the server."""
    try:
        from rmq_async.observability.prometheus import instrument, start_metrics_server
    except ImportError as exc:
        raise CliError(f"--metrics-port needs the prometheus extra "
                       f"(pip install 'rmq_async[prometheus]'): {exc}") from exc
    for c in app.consumers:
        instrument(c)
    try:
        server = start_metrics_server(port)
    except OSError as exc:  # in use, say: a failure of the run, not of the command line
        raise CommandFailed(f"cannot serve metrics on port {port}: {exc}") from exc
    log.info("cli.metrics_serving", port=server.port, path="/metrics")
    return server


async def run_worker(spec: str, grace: float, metrics_port: int | None = None) -> int:
    """Run the target in this process until a stop signal; the exit status."""
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    sources: list[str] = []  # of each stop request: "supervisor" or "outside"
    forced: list[str] = []  # the request that forced the exit (a list: set by request())
    started = False
    requested_at: list[float] = []  # monotonic time of the first stop request
    drain: asyncio.Task[None] | None = None
    this = asyncio.current_task()

    def request(source: str, name: str) -> None:
        if not sources:
            sources.append(source)
            requested_at.append(time.monotonic())
            log.info("cli.stop_requested", signal=name, grace=grace)
            stop.set()
            return
        if source not in sources:
            # The same stop, heard from the other side too (the supervisor forwards what
            # reached the whole process group): not a second request.
            sources.append(source)
            return
        if forced:
            return
        forced.append(name)
        log.warning("cli.forced_exit", signal=name)
        if drain is not None:
            drain.cancel()
        elif not started and this is not None:
            # Still starting (loading the target, app.start()): give that up at once.
            this.cancel()
        # (Started, the drain not begun yet: it is not begun.)

    def on_signal(signum: int) -> None:
        request("outside", signal.Signals(signum).name)

    stop_fd = _stop_fd()

    def on_stop_pipe() -> None:
        assert stop_fd is not None
        try:
            data = os.read(stop_fd, 64)
        except BlockingIOError:
            return
        except OSError:
            data = b""
        if not data:
            # The supervisor is gone: a stop, unless it had asked for one (not a second).
            loop.remove_reader(stop_fd)
            if "supervisor" not in sources:
                request("supervisor", "supervisor-gone")
            return
        for _ in data:
            request("supervisor", "supervisor")

    metrics: Any = None
    try:
        for sig in STOP_SIGNALS:
            loop.add_signal_handler(sig, on_signal, sig)
        if stop_fd is not None:
            loop.add_reader(stop_fd, on_stop_pipe)
        # A supervisor's worker starts with them blocked: what came meanwhile is handled now.
        signal.pthread_sigmask(signal.SIG_UNBLOCK, STOP_SIGNALS)
        try:
            app = await as_app(load_target(spec))
            if metrics_port is not None:
                metrics = _serve_metrics(app, metrics_port)
            try:
                await app.start()
            except Exception as exc:
                log.error("cli.start_failed", target=spec, error=repr(exc))
                return 1
        except asyncio.CancelledError:
            if not forced:  # not the second signal: this task itself was cancelled
                raise
            return 1
        started = True
        log.info("cli.running", target=spec, pid=os.getpid(),
                 consumers=[c.group for c in app.consumers])
        if not await _until_stop_or_stopped(stop, app):
            # The app's own code stopped it (app.stop() or the consumers' stop() from a
            # handler): nothing left to run, the process ends as after a drain.
            await app.stop()  # (returns once a stop under way has gone through)
            undone = _left_undone(app)
            log.info("cli.app_stopped_itself", **({"left_undone": undone} if undone else {}))
            return 1 if undone else 0
        if forced:  # two requests before this task went on: the second forces the exit
            return 1
        t0 = time.monotonic()
        # The grace period runs from the stop request, as the supervisor's (and systemd's or
        # Kubernetes') clock does: a request that came while the target was starting leaves
        # the drain what the start did not use, but at least a second (the supervisor allows
        # OVERRUN_MARGIN beyond the grace period) so that the consumers still stop in order.
        left = grace - (t0 - requested_at[0])
        budget = max(left, min(grace, DRAIN_FLOOR))
        if left < budget:
            log.warning("cli.drain_shortened", grace=grace, drain_budget=round(budget, 3),
                        started_after_request=round(t0 - requested_at[0], 3))
        drain = asyncio.create_task(app.stop(listener_timeout(budget)), name="cli-drain")
        try:
            await asyncio.wait_for(drain, budget)  # cancels the drain when it overruns
        except TimeoutError:
            log.error("cli.drain_timeout", grace=grace, drain_budget=round(budget, 3))
            return 1
        except asyncio.CancelledError:
            if not forced:  # this task itself was cancelled
                raise
            return 1  # a second signal cancelled the drain
        log.info("cli.stopped", took=round(time.monotonic() - t0, 3))
        undone = _left_undone(app)
        if undone:
            # Within the grace period, but not all of it done: listener calls given up (their
            # messages come again), offsets or orderly locks not handed back. A supervisor
            # (systemd, Kubernetes) sees it in the status.
            log.error("cli.drain_incomplete", left_undone=undone)
            return 1
        return 0
    finally:
        for sig in STOP_SIGNALS:
            loop.remove_signal_handler(sig)
        if stop_fd is not None:
            loop.remove_reader(stop_fd)
            os.close(stop_fd)
        if metrics is not None:
            await anyio.to_thread.run_sync(metrics.close)


def _left_undone(app: App) -> dict[str, list[str]]:
    """What the consumers' last stops left undone, per group (their ``stop_shortfalls``)."""
    return {c.group: list(c.stop_shortfalls) for c in app.consumers if c.stop_shortfalls}


async def _until_stop_or_stopped(stop: asyncio.Event, app: App) -> bool:
    """Wait for a stop request (True) or for every consumer of ``app`` to have stopped on its
    own (False)."""
    if not app.consumers:  # (an App subclass that runs something else: only a request)
        await stop.wait()
        return True
    requested = asyncio.ensure_future(stop.wait())
    stopped = asyncio.ensure_future(app.wait_stopped())
    try:
        await asyncio.wait({requested, stopped}, return_when=asyncio.FIRST_COMPLETED)
        if not stop.is_set() and stopped.exception() is not None:
            # Not a stop: the look at the consumers failed. Only a request ends the run.
            log.error("cli.wait_stopped_failed", error=repr(stopped.exception()))
            await requested
    finally:
        for task in (requested, stopped):
            task.cancel()
        await asyncio.gather(requested, stopped, return_exceptions=True)
    return stop.is_set()


def _stop_fd() -> int | None:
    """This worker's end of its supervisor's stop pipe (None when not a supervisor's)."""
    raw = os.environ.pop(STOP_FD_ENV, None)
    if raw is None:
        return None
    try:
        fd = int(raw)
        if fd < 3 or not stat.S_ISFIFO(os.fstat(fd).st_mode):
            raise ValueError("not a pipe")
        os.set_inheritable(fd, False)
        os.set_blocking(fd, False)
    except (ValueError, OSError) as exc:
        raise CliError(f"{STOP_FD_ENV}={raw!r} is not the read end of a pipe (it is set by "
                       "run --workers for its workers)") from exc
    return fd


async def run_supervisor(spec: str, workers: int, grace: float,
                         child_args: Sequence[str], metrics_port: int | None = None) -> int:
    """Start ``workers`` worker processes and supervise them; the exit status. With
    ``metrics_port`` P, worker ``i`` serves its metrics on port P + i."""
    loop = asyncio.get_running_loop()
    procs: list[asyncio.subprocess.Process] = []
    stop_pipes: list[int] = []  # the write end of each worker's stop pipe
    stopping: list[str] = []  # what asked for the stop: a signal's name, "worker-exited"...
    signals: list[int] = []  # the stop signals from outside
    passed_on = 0  # the stop requests written to every worker's pipe
    stop_requested = asyncio.Event()  # starts the grace period's clock in the wait below

    def tell_stop(i: int) -> None:
        with contextlib.suppress(OSError):  # a worker that has ended: EPIPE
            os.write(stop_pipes[i], b"s")

    def request_stop(reason: str) -> None:
        nonlocal passed_on
        if not stopping:
            log.info("cli.stop_requested", signal=reason, grace=grace, workers=len(procs))
            stop_requested.set()
        stopping.append(reason)
        # The workers hear as many requests as signals came (a second one forces their
        # exit), and one for a worker that exited on its own: the operator's first signal
        # after that is still a first request, not a second one.
        wanted = max(len(signals), 1)
        while passed_on < wanted:
            passed_on += 1
            for i, p in enumerate(procs):
                if p.returncode is None:
                    tell_stop(i)

    def forward(signum: int) -> None:
        signals.append(signum)
        request_stop(signal.Signals(signum).name)

    for sig in STOP_SIGNALS:
        loop.add_signal_handler(sig, forward, sig)
    stopper: asyncio.Task[bool] | None = None
    try:
        for i in range(workers):
            if stopping:
                break  # a stop signal during the start: no more workers
            env = {**os.environ, WORKER_ENV: str(i)}
            port_args = [] if metrics_port is None else ["--metrics-port", str(metrics_port + i)]
            # Own sessions: a terminal's Ctrl-C reaches only the supervisor, which passes it
            # on once, through the worker's stop pipe (see STOP_FD_ENV). Should the supervisor
            # die without doing so (SIGKILL), the pipe ends: each worker drains and ends
            # instead of consuming on unsupervised.
            read_end, write_end = os.pipe()
            os.set_blocking(write_end, False)  # a stalled worker never holds the supervisor
            try:
                proc = await asyncio.create_subprocess_exec(
                    sys.executable, "-m", "rmq_async.cli", "run", spec, "--workers", "1",
                    "--grace", str(grace), *port_args, *child_args,
                    env={**env, STOP_FD_ENV: str(read_end)}, pass_fds=(read_end,),
                    start_new_session=True, preexec_fn=_worker_preexec,
                )
            except BaseException:
                os.close(write_end)
                raise
            finally:
                os.close(read_end)
            procs.append(proc)
            stop_pipes.append(write_end)
            if stopping:  # the signal came while this one was being started
                tell_stop(len(procs) - 1)
        log.info("cli.workers_started", pids=[p.pid for p in procs])
        waits = {asyncio.create_task(p.wait(), name=f"worker-{i}"): i
                 for i, p in enumerate(procs)}
        stopper = asyncio.create_task(stop_requested.wait(), name="stop-requested")
        failed = False
        usage = False
        pending = set(waits)
        deadline: float | None = None
        while pending:
            if stopping and deadline is None:
                deadline = time.monotonic() + grace + OVERRUN_MARGIN
            timeout = None if deadline is None else max(deadline - time.monotonic(), 0.0)
            # Until a stop is requested, the stop request itself also ends the wait: the
            # grace period runs from the signal, not from the first worker that exits.
            waiting = pending if deadline is not None else pending | {stopper}
            done, _ = await asyncio.wait(waiting, timeout=timeout,
                                         return_when=asyncio.FIRST_COMPLETED)
            done.discard(stopper)
            pending -= done
            if not done:
                if deadline is None or time.monotonic() < deadline:
                    continue  # the stop request: the clock starts now
                # The workers overran the grace period.
                log.error("cli.workers_overran", grace=grace,
                          pids=[procs[waits[t]].pid for t in pending])
                for t in pending:
                    with contextlib.suppress(ProcessLookupError):
                        procs[waits[t]].kill()
                await asyncio.gather(*pending)
                return 1
            for t in done:
                i = waits[t]
                code = t.result()
                if not stopping and code == 0:
                    # Its app stopped itself (rmq-async run ends then): the others stop too,
                    # as one process would.
                    log.info("cli.worker_finished", worker=i, pid=procs[i].pid)
                    request_stop("worker-finished")
                elif not stopping:
                    log.error("cli.worker_exited", worker=i, pid=procs[i].pid, code=code)
                    failed = True
                    usage = usage or code == USAGE_STATUS  # a target it could not load
                    request_stop("worker-exited")
                elif code != 0:
                    log.error("cli.worker_failed", worker=i, pid=procs[i].pid, code=code)
                    failed = True
                else:
                    log.info("cli.worker_stopped", worker=i, pid=procs[i].pid)
        return USAGE_STATUS if usage else 1 if failed else 0
    finally:
        if stopper is not None:
            stopper.cancel()
        for sig in STOP_SIGNALS:
            loop.remove_signal_handler(sig)
        for p in procs:
            if p.returncode is None:
                with contextlib.suppress(ProcessLookupError):
                    p.kill()
                await p.wait()
        for fd in stop_pipes:
            os.close(fd)

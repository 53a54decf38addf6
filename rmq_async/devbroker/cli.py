"""Command line: ``python -m rmq_async.devbroker up|down|status|fetch [--version V]``.

- ``fetch``  resolves the jars (Maven) and prints the ``lib`` folder.
- ``up``     starts a detached NameServer + Broker (they outlive this command) and prints
             ``NAMESRV_ADDR=…`` and ``BROKER_ADDR=…``; the state file is
             ``<cache root>/devbroker-state.json``. ``--groups N --slaves M --namesrvs K``
             starts a cluster instead (:class:`~.cluster.LocalCluster`): ``NAMESRV_ADDR`` then
             lists every name server and ``BROKER_ADDR`` every master (``;``-separated), and
             one ``BROKER_<NAME>_<ID>=…`` line per broker follows. With a run already up it
             prints that run's lines, if it was started with the same options (else exit 1).
- ``status`` prints the same lines for the running broker, or ``not running`` (exit 1).
- ``down``   stops it and removes its run folder (store and logs).

Logs go to stderr so that stdout can be used as ``eval "$(python -m rmq_async.devbroker up)"``.
Exit statuses are those of ``rmq-async broker``: 2 for a usage error (found before anything
starts), 1 for a failure while running (and for ``status`` when nothing runs).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import fcntl
import logging
import os
import signal
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import structlog

from .broker import LocalRocketMQ
from .cluster import LocalCluster
from .errors import DevBrokerError
from .maven import DEFAULT_VERSION, cache_root, check_jdk, ensure_jars_sync
from .procs import RunRecord, pid_mentions, reap_stale_runs, write_whole
from .versions import profile

__all__ = ["main", "running_namesrv", "state_file"]


def state_file() -> Path:
    """Where ``up`` records the detached run (``$RMQ_ASYNC_STATE_FILE`` overrides)."""
    explicit = os.environ.get("RMQ_ASYNC_STATE_FILE")
    if explicit:
        return Path(explicit).expanduser().resolve()
    return cache_root() / "devbroker-state.json"


def _load_state() -> RunRecord | None:
    path = state_file()
    try:
        return RunRecord.from_json(path.read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError, KeyError, TypeError):
        with contextlib.suppress(OSError):
            path.unlink()
        return None


def _running(record: RunRecord) -> bool:
    def alive(pid: int) -> bool:
        return pid_mentions(pid, str(record.workdir))

    if "brokers" in record.info:  # a cluster: every recorded JVM must still run
        return bool(record.pids) and all(alive(pid) for pid in record.pids.values())
    return all(alive(record.pids.get(name, -1)) for name in ("namesrv", "broker"))


def running_namesrv() -> str | None:
    """The name server address of the broker ``up`` started, if it still runs."""
    record = _load_state()
    if record is None or not _running(record):
        return None
    addr = record.info.get("namesrv_addr")
    return str(addr) if addr else None


def _print_addrs(record: RunRecord) -> None:
    info = record.info
    print(f"NAMESRV_ADDR={info.get('namesrv_addr', '')}")
    print(f"BROKER_ADDR={info.get('broker_addr', '')}")
    brokers = info.get("brokers")
    if isinstance(brokers, dict):
        for key, addr in brokers.items():
            print(f"BROKER_{key.upper().replace('-', '_')}={addr}")
    print(f"ROCKETMQ_WORKDIR={record.workdir}")


def _clear(record: RunRecord) -> None:
    # The store is deleted right after, so an orderly broker shutdown (~13 s) buys nothing.
    record.kill_all(grace=2.0)
    record.forget()
    with contextlib.suppress(FileNotFoundError):
        state_file().unlink()


def _parse_kv(items: Sequence[str]) -> dict[str, str]:
    out = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise SystemExit(f"--broker-config expects key=value, got {item!r}")
        out[key] = value
    return out


def cmd_fetch(args: argparse.Namespace) -> int:
    _check_version(args.version)
    check_jdk()  # make setup: a missing compiler or an old Java said here, not at a test
    print(ensure_jars_sync(args.version))
    return 0


def _check_version(version: str) -> None:
    try:
        profile(version)
    except DevBrokerError as exc:  # not a version this module starts: a usage error
        raise SystemExit(str(exc)) from exc


def cmd_up(args: argparse.Namespace) -> int:
    # One `up` at a time (two at once each started a broker, and one was known to nothing);
    # SIGTERM and SIGHUP stop a start as Ctrl-C does, cleaning up what it started.
    state_file().parent.mkdir(parents=True, exist_ok=True)
    with open(state_file().with_name(state_file().name + ".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        previous = {sig: signal.signal(sig, signal.default_int_handler)
                    for sig in (signal.SIGTERM, signal.SIGHUP)}
        try:
            return _up(args)
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)


def _up(args: argparse.Namespace) -> int:
    if args.groups < 1 or args.slaves < 0 or args.namesrvs < 1:
        raise SystemExit("--groups and --namesrvs must be >= 1, --slaves >= 0")
    # The options are checked (a usage error) before anything starts.
    cluster: LocalCluster | None = None
    rmq: LocalRocketMQ | None = None
    try:
        if (args.groups, args.slaves, args.namesrvs) != (1, 0, 1):
            cluster = LocalCluster(args.version, groups=args.groups, slaves=args.slaves,
                                   namesrvs=args.namesrvs, detached=True,
                                   heap=args.heap or "320m",
                                   broker_config=_parse_kv(args.broker_config),
                                   ready_timeout=180.0 if args.timeout is None else args.timeout)
        else:
            rmq = LocalRocketMQ(args.version, detached=True, heap=args.heap or "512m",
                                broker_config=_parse_kv(args.broker_config),
                                ready_timeout=90.0 if args.timeout is None else args.timeout)
    except (ValueError, DevBrokerError) as exc:
        raise SystemExit(str(exc)) from exc
    wanted = _wanted(args)
    existing = _load_state()
    if existing is not None:
        if _running(existing):
            _check_same(existing, wanted)
            _print_addrs(existing)
            return 0
        _clear(existing)
    record: RunRecord
    if cluster is not None:
        asyncio.run(cluster.start_all())
        record = cluster.record
        record.pids = {k: v for k, v in record.pids.items() if k != "admin"}
    else:
        assert rmq is not None
        asyncio.run(rmq.start_all())
        record = rmq.record
        # The resident admin helper ends with this command; only the servers stay.
        record.pids = {k: v for k, v in record.pids.items() if k in ("namesrv", "broker")}
    record.info["up_options"] = wanted
    record.save()
    write_whole(state_file(), record.to_json())  # a reader never sees half a state file
    _print_addrs(record)
    return 0


def _wanted(args: argparse.Namespace) -> dict[str, Any]:
    """The options of ``up`` that shape what runs (what a second ``up`` must agree with)."""
    return {"version": args.version, "groups": args.groups, "slaves": args.slaves,
            "namesrvs": args.namesrvs, "heap": args.heap,
            "broker_config": sorted(args.broker_config)}


def _check_same(running: RunRecord, wanted: dict[str, Any]) -> None:
    """``up`` with a run already up reports that run, when it is what was asked for; a run
    started with other options is an error, not a silent substitute. (A state file written
    before the options were recorded is taken as it is.)"""
    had = running.info.get("up_options")
    if not isinstance(had, dict) or had == wanted:
        return
    differ = ", ".join(f"--{key.replace('_', '-')} {had.get(key)!r} (asked: {wanted[key]!r})"
                       for key in wanted if had.get(key) != wanted[key])
    raise DevBrokerError(f"a broker is already running with other options: {differ}; it is "
                         "left as it is (`down` first to start another)")


def cmd_status(args: argparse.Namespace) -> int:
    record = _load_state()
    if record is None or not _running(record):
        # A crashed run's folder (its logs say why) stays until `down` or the next `up`.
        print("not running")
        return 1
    _print_addrs(record)
    return 0


def cmd_down(args: argparse.Namespace) -> int:
    reap_stale_runs()  # runs whose starting process died halfway
    record = _load_state()
    if record is None:
        print("not running")
        return 0
    _clear(record)
    print("stopped")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m rmq_async.devbroker",
                                     description="A local Apache RocketMQ for development.")
    sub = parser.add_subparsers(dest="command", required=True)
    for name, helptext in (
        ("fetch", "download the RocketMQ jars (Maven) and print their folder"),
        ("up", "start a detached NameServer + Broker and print NAMESRV_ADDR"),
        ("status", "print the running broker's addresses, or 'not running'"),
        ("down", "stop the detached broker and delete its store"),
    ):
        p = sub.add_parser(name, help=helptext)
        p.add_argument("--version", default=DEFAULT_VERSION, help="RocketMQ version")
        if name == "up":
            p.add_argument("--heap", default=None,
                           help="broker heap (-Xmx; 512m, or 320m per broker of a cluster)")
            p.add_argument("--groups", type=int, default=1,
                           help="broker groups broker-a, broker-b, ... (default 1)")
            p.add_argument("--slaves", type=int, default=0,
                           help="slaves per broker group (default 0)")
            p.add_argument("--namesrvs", type=int, default=1,
                           help="name servers (default 1)")
            p.add_argument("--timeout", type=float, default=None,
                           help="start-up limit, seconds (default 90; 180 for a cluster)")
            p.add_argument("--broker-config", action="append", default=[], metavar="KEY=VALUE",
                           help="extra broker.conf setting (repeatable)")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    structlog.configure(
        logger_factory=structlog.PrintLoggerFactory(sys.stderr),
        wrapper_class=structlog.make_filtering_bound_logger(logging.INFO),
    )
    args = build_parser().parse_args(argv)
    handlers = {"fetch": cmd_fetch, "up": cmd_up, "status": cmd_status, "down": cmd_down}
    try:
        return handlers[args.command](args)
    except SystemExit as exc:
        if isinstance(exc.code, str):  # an option value its checks refuse: a usage error
            print(f"error: {exc.code}", file=sys.stderr)
            return 2
        raise
    except DevBrokerError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1

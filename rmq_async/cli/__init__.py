"""The ``rmq-async`` command.

::

    rmq-async run module:attr [--workers N] [--grace SECONDS] [--metrics-port P]
                  [--log-format json|console]
    rmq-async lag GROUP [--topic T] [--json]
    rmq-async tail TOPIC [--tags EXPR] [--from-beginning] [--count N] [--seconds S] [--json]
    rmq-async broker up|down|status|fetch [...]

``lag`` and ``tail`` find the name server in ``--namesrv``, else ``$NAMESRV_ADDR``, else the dev
broker started by ``rmq-async broker up``. ``run`` takes the name server from the consumers the
target builds.

Exit status:

- 0 on success, including a stop by SIGTERM / SIGINT that drained in time and a ``tail`` or
  ``lag`` whose reader went away (``| head``);
- 1 when the command failed while running: a broker or name server unreachable or refusing, a
  group without consumption progress (``lag``), a consumer that did not start or a drain that
  overran (``run``), the dev broker failing to start (``broker``), ``broker status`` with no
  broker running;
- 2 for a usage error, found before any network I/O: argparse's own errors, a target that is
  not ``module:attr`` or not a consumer, an invalid argument (a name server address that is
  not ``host:port``, a retry topic to ``tail``), no name server to use.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from collections.abc import Sequence
from typing import NoReturn

import structlog

from rmq_async.cli.common import (
    LOG_FORMATS,
    LOG_LEVELS,
    CliError,
    CommandFailed,
    configure_logging,
    reader_gone,
)
from rmq_async.errors import RocketMQError

__all__ = ["build_parser", "console", "main"]


def _positive(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
    return value


def _workers(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {text}")
    return value


def _port(text: str) -> int:
    value = int(text)
    if not 0 < value < 65536:
        raise argparse.ArgumentTypeError(f"must be a port (1-65535), got {text}")
    return value


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of ``rmq-async``."""
    parser = argparse.ArgumentParser(prog="rmq-async",
                                     description="Run and inspect Apache RocketMQ consumers.")
    parser.add_argument("--log-format", choices=LOG_FORMATS, default="console",
                        help="structured logs on stderr: console lines or JSON lines")
    parser.add_argument("--log-level", choices=LOG_LEVELS, default="info")
    sub = parser.add_subparsers(dest="command", required=True)

    run = sub.add_parser("run", help="run a PushConsumer, an App or a list of consumers",
                         description="Run module:attr until SIGTERM/SIGINT, then drain.")
    run.add_argument("target", help="module:attr (a PushConsumer, App, list, or a factory)")
    run.add_argument("--workers", type=_workers, default=1,
                     help="worker processes, each with its own consumer instances (default 1)")
    run.add_argument("--grace", type=_positive, default=30.0,
                     help="seconds to drain on SIGTERM/SIGINT before giving up (default 30)")
    run.add_argument("--metrics-port", type=_port, default=None, metavar="PORT",
                     help="serve Prometheus metrics on PORT (worker i of --workers: PORT + i)")
    run.add_argument("--log-format", dest="run_log_format", choices=LOG_FORMATS, default=None)
    run.add_argument("--log-level", dest="run_log_level", choices=LOG_LEVELS, default=None)

    lag = sub.add_parser("lag", help="per-queue broker offset, committed offset and diff")
    lag.add_argument("group")
    lag.add_argument("--topic", help="only this topic")
    lag.add_argument("--namesrv", help="name server host:port[;host:port]")
    lag.add_argument("--json", action="store_true", help="print JSON instead of a table")

    tail = sub.add_parser("tail", help="print a topic's messages as they arrive")
    tail.add_argument("topic")
    tail.add_argument("--namesrv", help="name server host:port[;host:port]")
    tail.add_argument("--tags", default="*", help="TAG expression (default *)")
    tail.add_argument("--from-beginning", action="store_true",
                      help="start at each queue's first message instead of its end")
    tail.add_argument("--count", type=_workers, default=None, help="stop after N messages")
    tail.add_argument("--seconds", type=_positive, default=None, help="stop after S seconds")
    tail.add_argument("--max-body", type=int, default=200,
                      help="characters of body shown (-1: all; default 200)")
    tail.add_argument("--json", action="store_true", help="one JSON object per line")

    broker = sub.add_parser("broker", help="the local development broker (up|down|status|fetch)",
                            add_help=False)
    broker.add_argument("broker_args", nargs=argparse.REMAINDER)
    return parser


#: Exit statuses of ``rmq-async`` (argparse exits with ``USAGE`` by itself).
OK, FAILED, USAGE = 0, 1, 2
#: A command interrupted by Ctrl-C (128 + SIGINT, as shells report it).
INTERRUPTED = 130


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``rmq-async``; returns the exit status."""
    args = build_parser().parse_args(argv)
    fmt = getattr(args, "run_log_format", None) or args.log_format
    level = getattr(args, "run_log_level", None) or args.log_level
    try:
        if args.command == "broker":
            return _broker(args.broker_args, fmt, level)
        if args.command == "run":
            return _run(args, fmt, level)
        configure_logging(fmt, level)
        if args.command == "lag":
            return asyncio.run(_lag(args))
        if args.command == "tail":
            return asyncio.run(_tail(args))
    except CliError as exc:
        print(f"rmq-async: error: {exc}", file=sys.stderr)
        return USAGE
    except CommandFailed as exc:
        print(f"rmq-async: error: {exc}", file=sys.stderr)
        return FAILED
    except RocketMQError as exc:
        print(f"rmq-async: {type(exc).__name__}: {exc}", file=sys.stderr)
        return FAILED
    except KeyboardInterrupt:  # Ctrl-C in a command without handlers of its own (lag)
        print("rmq-async: interrupted", file=sys.stderr)
        return INTERRUPTED
    raise AssertionError(f"unhandled command {args.command!r}")  # pragma: no cover


#: How long the command waits, once done, for worker threads still running before it ends.
THREADS_GRACE = 0.5


def console() -> NoReturn:
    """The ``rmq-async`` command: :func:`main`, then exit with its status.

    User code still running in a worker thread when ``run`` has drained (a plain handler past
    the grace period, whose message was not acknowledged and comes again; a plain hook over
    its time; a sink's write given up) would keep the process alive until it returns, a
    second signal notwithstanding; the process ends at once instead, with status 1, and says
    which threads it left. (Other threads, a library's executor say, end as the interpreter
    does.)
    """
    import os

    from rmq_async.consumer.tasks import USER_THREADS

    status = main()
    deadline = time.monotonic() + THREADS_GRACE
    while (busy := [t for t in list(USER_THREADS) if t.is_alive()]) \
            and time.monotonic() < deadline:
        time.sleep(0.02)
    left = [t.name for t in busy]
    if left:
        structlog.get_logger("rmq_async.cli").error("cli.threads_left", threads=left)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(status or FAILED)
    sys.exit(status)


def _broker(argv: Sequence[str], fmt: str, level: str) -> int:
    # The dev broker's own command line (rmq_async.devbroker.cli), with this command's exit
    # statuses: its failures (DevBrokerError) are 1, its usage errors 2.
    from rmq_async.devbroker import cli as devbroker_cli
    from rmq_async.devbroker.errors import DevBrokerError

    args = devbroker_cli.build_parser().parse_args(argv)
    configure_logging(fmt, level)
    try:
        code: int = getattr(devbroker_cli, f"cmd_{args.command}")(args)
    except SystemExit as exc:
        if isinstance(exc.code, str):  # its checks of option values: SystemExit("message")
            raise CliError(exc.code) from exc
        raise
    except DevBrokerError as exc:
        raise CommandFailed(str(exc)) from exc
    return code


def _run(args: argparse.Namespace, fmt: str, level: str) -> int:
    import os

    from rmq_async.cli.run import WORKER_ENV, run_supervisor, run_worker

    worker = os.environ.get(WORKER_ENV)
    if worker is not None and not worker.isdigit():
        raise CliError(f"{WORKER_ENV}={worker!r} is not a worker index (it is set by "
                       "run --workers for its workers)")
    configure_logging(fmt, level, **({"worker": int(worker)} if worker is not None else {}))
    if args.metrics_port is not None and args.metrics_port + args.workers - 1 > 65535:
        raise CliError(f"--metrics-port {args.metrics_port} with --workers {args.workers}: worker "
                       f"{args.workers - 1} would serve on port "
                       f"{args.metrics_port + args.workers - 1}, past 65535")
    if args.workers > 1:
        child_args = ["--log-format", fmt, "--log-level", level]
        return asyncio.run(run_supervisor(args.target, args.workers, args.grace, child_args,
                                          args.metrics_port))
    return asyncio.run(run_worker(args.target, args.grace, args.metrics_port))


async def _lag(args: argparse.Namespace) -> int:
    from rmq_async.cli.common import resolve_namesrv
    from rmq_async.cli.lag import format_lag, group_lag

    rows = await group_lag(resolve_namesrv(args.namesrv), args.group, args.topic)
    try:
        print(format_lag(rows, as_json=args.json), flush=True)
    except BrokenPipeError:  # `rmq-async lag G | head -3`
        reader_gone(sys.stdout)
    return OK


async def _tail(args: argparse.Namespace) -> int:
    from rmq_async.cli.common import resolve_namesrv
    from rmq_async.cli.tail import tail

    return await tail(resolve_namesrv(args.namesrv), args.topic, tags=args.tags,
                      from_beginning=args.from_beginning, count=args.count,
                      seconds=args.seconds, max_body=args.max_body, as_json=args.json)

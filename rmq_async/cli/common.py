"""What the ``rmq-async`` subcommands share: errors, logging set-up, the name server address."""

from __future__ import annotations

import logging
import os
import sys
from typing import Any, TextIO

import structlog

from rmq_async.errors import RocketMQError

__all__ = ["CliError", "CommandFailed", "configure_logging", "reader_gone", "resolve_namesrv"]

LOG_FORMATS = ("console", "json")
LOG_LEVELS = ("debug", "info", "warning", "error")


class CliError(RocketMQError):
    """A usage error, found before any network I/O (a bad target, an invalid argument such as
    a name server address that is not ``host:port``, no name server): printed, exit status 2."""


class CommandFailed(RocketMQError):
    """A well-formed command that could not do its work (for example a group without
    consumption progress): printed, exit status 1."""


def reader_gone(stream: TextIO) -> None:
    """The reader of ``stream`` went away (``BrokenPipeError``, as in ``... | head -3``).

    As the Python documentation advises for programs that do not die of SIGPIPE, the stream's
    file descriptor is pointed at ``os.devnull``: what is still buffered, and anything printed
    later, is discarded instead of raising ``BrokenPipeError`` again (at the latest when the
    interpreter flushes the standard streams on exit). A stream without a file descriptor is
    left as it is.
    """
    try:
        fd = stream.fileno()
    except (OSError, ValueError):  # io.UnsupportedOperation is both
        return
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, fd)
    finally:
        os.close(devnull)


def configure_logging(fmt: str = "console", level: str = "info", **context: Any) -> None:
    """structlog to stderr, as JSON lines or coloured console lines, at ``level``.

    ``context`` (for example ``worker=1``) is bound to every event of the process.
    """
    renderer: Any = (structlog.processors.JSONRenderer() if fmt == "json"
                     else structlog.dev.ConsoleRenderer(colors=sys.stderr.isatty()))
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.format_exc_info,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(
            getattr(logging, level.upper(), logging.INFO)),
        logger_factory=structlog.PrintLoggerFactory(sys.stderr),
        cache_logger_on_first_use=False,
    )
    structlog.contextvars.clear_contextvars()
    if context:
        structlog.contextvars.bind_contextvars(**context)


def resolve_namesrv(explicit: str | None) -> str:
    """``--namesrv``, else ``$NAMESRV_ADDR``, else the running dev broker (``broker up``)."""
    if explicit:
        return explicit
    env = os.environ.get("NAMESRV_ADDR")
    if env:
        return env
    from rmq_async.devbroker.cli import running_namesrv

    found = running_namesrv()
    if found:
        return found
    raise CliError("no name server: pass --namesrv host:port, set NAMESRV_ADDR, "
                   "or start the dev broker with `rmq-async broker up`")

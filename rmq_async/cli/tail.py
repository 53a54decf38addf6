"""``rmq-async tail TOPIC``: print a topic's messages as they arrive.

A broadcasting consumer of the fixed group :data:`TAIL_GROUP` reads every queue from its current
end (or from the first offset with ``--from-beginning``). Its offsets live in a temporary folder
that is deleted on exit, so tailing leaves no committed progress behind, and each run starts
where its own options say, never where an earlier run stopped. Tails running side by side each
get every message (broadcasting gives every member every queue), and each pull carries its own
subscription (``post_subscription_when_pull``), so the broker filters it by that tail's
``--tags`` whatever the group's other tails subscribe. The group being fixed, the broker creates
its subscription group and ``%RETRY%`` topic once, not once per run.

Ctrl-C (or SIGTERM, or SIGHUP: its terminal closed), ``--count``, ``--seconds`` or a reader
that goes away (``| head -3``) ends it with status 0; a pipe's reader going away is noticed at
once, a reader that stops reading holds the output, not the consumer's event loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import stat
import sys
import tempfile
import time
from collections.abc import Callable, Coroutine
from datetime import UTC, datetime
from typing import Any, TextIO

import structlog

from rmq_async.cli.common import CliError, reader_gone
from rmq_async.consumer.options import ConsumeFromWhere, MessageModel
from rmq_async.consumer.push import PushConsumer
from rmq_async.consumer.results import ConsumeResult
from rmq_async.errors import InvalidArgumentError, InvalidTypeError
from rmq_async.protocol.types import MessageExt

__all__ = ["TAIL_GROUP", "format_message", "tail"]

#: The consumer group of every ``rmq-async tail`` (broadcasting, offsets kept per run).
TAIL_GROUP = "rmq_async_tail"

log = structlog.get_logger("rmq_async.cli")


def format_message(m: MessageExt, *, max_body: int = 200, as_json: bool = False) -> str:
    """One output line for a message: queue, offset, tags, keys, store time and body."""
    body = m.body.decode("utf-8", "replace")
    if max_body >= 0 and len(body) > max_body:
        body = body[:max_body] + "..."
    keys = " ".join(m.keys)
    stored = datetime.fromtimestamp(m.store_timestamp / 1000, UTC).isoformat(timespec="milliseconds")
    if as_json:
        return json.dumps({"topic": m.topic, "queue_id": m.queue_id, "offset": m.queue_offset,
                           "msg_id": m.msg_id, "tags": m.tags, "keys": keys,
                           "store_time": stored, "properties": dict(m.properties),
                           "body": body}, ensure_ascii=False)
    return (f"{m.topic}[{m.queue_id}]@{m.queue_offset} {stored} tags={m.tags or '-'} "
            f"keys={keys or '-'} body={body}")


async def tail(namesrv: str, topic: str, *, tags: str = "*", from_beginning: bool = False,
               count: int | None = None, seconds: float | None = None, max_body: int = 200,
               as_json: bool = False, out: TextIO | None = None) -> int:
    """Print ``topic``'s messages until a signal, ``count`` messages, ``seconds`` or the
    output's reader going away; status 0.

    Raises :class:`~rmq_async.cli.common.CliError` for arguments the consumer refuses (the
    name server address, the topic, the tag expression) before any network I/O.
    """
    stream = out if out is not None else sys.stdout
    output = await _Output.open(stream)
    done = asyncio.Event()
    output.when_reader_gone(done.set)
    printed = 0
    closed = False

    async def show(msgs: list[MessageExt]) -> ConsumeResult:
        nonlocal printed, closed
        for m in msgs:
            if closed or (count is not None and printed >= count):
                break
            line = format_message(m, max_body=max_body, as_json=as_json)
            if not await output.write(line):
                # The reader went away (`| head -3`): stop, as --count does.
                closed = True
                log.info("tail.output_closed", topic=topic, printed=printed)
                break
            printed += 1
        if closed or (count is not None and printed >= count):
            done.set()
        return ConsumeResult.SUCCESS

    loop = asyncio.get_running_loop()
    for sig in STOP_SIGNALS:
        loop.add_signal_handler(sig, done.set)
    try:
        with tempfile.TemporaryDirectory(prefix="rmq-async-tail-") as offsets_dir:
            try:
                consumer = PushConsumer(
                    TAIL_GROUP, namesrv=namesrv,
                    message_model=MessageModel.BROADCASTING,
                    consume_from_where=(ConsumeFromWhere.FIRST_OFFSET if from_beginning
                                        else ConsumeFromWhere.LAST_OFFSET),
                    consume_concurrency=1,
                    # A per-run folder: no run resumes another's offsets. (The client id is
                    # ip@DEFAULT for every broadcasting consumer of a host, as in Java.)
                    offset_store_dir=offsets_dir,
                    # The broker filters each pull by its own subscription, not by the group's
                    # latest heartbeat, which another tail of other tags or topics may send.
                    post_subscription_when_pull=True,
                )
                consumer.subscribe(topic, tags=tags, listener=show)
            except (InvalidArgumentError, InvalidTypeError) as exc:
                raise CliError(str(exc)) from exc  # before any network I/O: a usage error
            # A signal while it starts (a name server that does not answer, say) ends it too.
            if await _unless(done, consumer.start()):
                try:
                    if await _unless(done, _wait_ready(consumer, topic)):
                        log.info("tail.ready", topic=topic, queues=len(consumer.process_queues))
                        with contextlib.suppress(TimeoutError):
                            await asyncio.wait_for(done.wait(), seconds)
                finally:
                    # A line in flight to a reader that stopped reading is not waited for.
                    await consumer.stop(STOP_SECONDS)
    finally:
        for sig in STOP_SIGNALS:
            loop.remove_signal_handler(sig)
        await output.aclose()
    log.info("tail.stopped", topic=topic, printed=printed)
    return 0


#: The signals that end a tail with status 0 (SIGHUP: the terminal it printed to closed).
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
#: How long tail's consumer may take to stop (its listener prints; nothing else to wait for).
STOP_SECONDS = 2.0
#: How long tail's last lines may take to reach its reader, once it stops.
CLOSE_FLUSH_SECONDS = 2.0


class _PipeProtocol(asyncio.Protocol):
    """Flow control of a write pipe: writers wait while the transport's buffer is full."""

    def __init__(self) -> None:
        self.writable = asyncio.Event()
        self.writable.set()
        self.gone = asyncio.Event()  # the connection is lost
        self.on_lost: Callable[[], None] | None = None

    @property
    def lost(self) -> bool:
        return self.gone.is_set()

    def pause_writing(self) -> None:
        self.writable.clear()

    def resume_writing(self) -> None:
        self.writable.set()

    def connection_lost(self, exc: Exception | None) -> None:
        # Also when the reader closes its end with nothing being written (a pipe is watched
        # for that): tail then ends at once, not at the next message's write.
        self.gone.set()
        self.writable.set()
        if self.on_lost is not None:
            self.on_lost()


class _Output:
    """Where tail's lines go.

    Standard output that is a pipe or a terminal is written through an asyncio pipe transport
    on a descriptor of its own (opened again through ``/proc/self/fd``, so that the non-blocking
    mode stays off the process's standard streams): a reader that stops reading (``| less``)
    then holds the listener, not the event loop, and signals, ``--seconds`` and heartbeats go
    on. Anything else (a file, a test's ``StringIO``) is written directly.
    """

    def __init__(self, stream: TextIO, transport: asyncio.WriteTransport | None = None,
                 protocol: _PipeProtocol | None = None) -> None:
        self._stream = stream
        self._transport = transport
        self._protocol = protocol

    @classmethod
    async def open(cls, stream: TextIO) -> _Output:
        if stream is not sys.stdout:
            return cls(stream)
        try:
            fd = stream.fileno()
            mode = os.fstat(fd).st_mode
            if not (stat.S_ISFIFO(mode) or stat.S_ISCHR(mode)):
                return cls(stream)
            own = os.open(f"/proc/self/fd/{fd}", os.O_WRONLY | os.O_NOCTTY)
        except (OSError, ValueError):  # no descriptor, or not one to open again (a socket)
            return cls(stream)
        stream.flush()
        protocol = _PipeProtocol()
        transport, _ = await asyncio.get_running_loop().connect_write_pipe(
            lambda: protocol, os.fdopen(own, "wb", buffering=0))
        return cls(stream, transport, protocol)

    def when_reader_gone(self, callback: Callable[[], None]) -> None:
        """Call ``callback`` as soon as a pipe's reader goes away (not for direct writes)."""
        if self._protocol is not None:
            self._protocol.on_lost = callback

    async def write(self, line: str) -> bool:
        """Write one line; False when the reader went away."""
        if self._transport is None or self._protocol is None:
            try:
                print(line, file=self._stream, flush=True)
            except BrokenPipeError:
                reader_gone(self._stream)
                return False
            return True
        if self._protocol.lost:
            return False
        self._transport.write(line.encode() + b"\n")
        await self._protocol.writable.wait()
        return not self._protocol.lost

    async def aclose(self) -> None:
        """Close a pipe after what is buffered, given :data:`CLOSE_FLUSH_SECONDS` to reach
        the reader; what a reader that stopped reading (``| less``) has not taken by then is
        dropped."""
        transport, protocol = self._transport, self._protocol
        if transport is None or protocol is None:
            return
        transport.close()
        try:
            await asyncio.wait_for(protocol.gone.wait(), CLOSE_FLUSH_SECONDS)
        except TimeoutError:
            transport.abort()


async def _unless(done: asyncio.Event, work: Coroutine[Any, Any, Any]) -> bool:
    """Run ``work`` until it ends, or until ``done`` is set first (it is then cancelled):
    whether it ended. Its exceptions propagate."""
    task = asyncio.ensure_future(work)
    waiter = asyncio.ensure_future(done.wait())
    try:
        await asyncio.wait({task, waiter}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        waiter.cancel()
        if not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
    if task.cancelled():
        return False
    task.result()
    return True


async def _wait_ready(consumer: PushConsumer, topic: str, limit: float = 10.0) -> None:
    # Every queue of the topic has its start offset once it has a process queue.
    wanted = len(await consumer.instance.subscribe_queues(topic))
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline:
        if sum(1 for mq in consumer.process_queues if mq.topic == topic) >= wanted:
            return
        await asyncio.sleep(0.05)

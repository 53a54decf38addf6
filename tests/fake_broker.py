"""Loopback fakes for unit tests that inject faults a real broker cannot produce on demand.

Only for faults (a slow answer after the client's timeout, GO_AWAY, SYSTEM_BUSY, a broker
that moved, a connect that hangs): everything else is tested against the real broker.

* :class:`FakeBroker` decodes requests with the project's codec and answers each one with a
  coroutine the test gives, in a task of its own, so a slow answer holds back no other (a
  broker works on the requests of one connection concurrently). It plays a name server too
  (:func:`route_answer`).
* :func:`silent_listener` accepts TCP connections and never says a word: a TLS client's
  handshake with it hangs until its connect timeout, as a connect to a black-holed address.
"""

from __future__ import annotations

import asyncio
import contextlib
import ssl
from collections.abc import AsyncIterator, Awaitable, Callable

from rmq_async.protocol.bodies import BrokerData, QueueData, TopicRouteData
from rmq_async.protocol.codes import ResponseCode
from rmq_async.protocol.command import FrameDecoder, RemotingCommand
from rmq_async.protocol.errors import ProtocolError
from rmq_async.protocol.message import decode_properties
from rmq_async.protocol.types import PROPERTY_UNIQ_KEY

#: Answers one request: ``(request, number of its connection, from 0)`` -> response, or
#: ``None`` for no answer at all.
Answer = Callable[[RemotingCommand, int], Awaitable[RemotingCommand | None]]


class FakeBroker:
    """A scripted peer on ``127.0.0.1``; use it as ``async with FakeBroker(answer) as b``."""

    def __init__(self, answer: Answer) -> None:
        self.answer = answer
        #: Every request received, with the number of the connection it came on.
        self.received: list[tuple[int, RemotingCommand]] = []
        #: Numbers of the connections the client closed (EOF or reset seen).
        self.closed: list[int] = []
        self._server: asyncio.Server | None = None
        self._writers: list[asyncio.StreamWriter] = []
        self._serving: set[asyncio.Task[object]] = set()  # one per connection
        self._tasks: set[asyncio.Task[None]] = set()  # one per answer under way

    async def __aenter__(self) -> FakeBroker:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        """Stop listening, drop every connection and end every answer under way."""
        if self._server is not None:
            self._server.close()
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for writer in self._writers:
            writer.transport.abort()
        # Each connection's reader ends on its own once its transport is gone (cancelled,
        # asyncio's stream callback would log the cancellation as an error).
        if self._serving:
            await asyncio.wait(self._serving, timeout=5)

    @property
    def addr(self) -> str:
        assert self._server is not None
        return f"127.0.0.1:{self._server.sockets[0].getsockname()[1]}"

    @property
    def connections(self) -> int:
        return len(self._writers)

    def codes(self) -> list[int]:
        return [cmd.code for _, cmd in self.received]

    def _spawn(self, coro: Awaitable[None]) -> None:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        number = len(self._writers)
        self._writers.append(writer)
        serving = asyncio.current_task()
        assert serving is not None
        self._serving.add(serving)
        serving.add_done_callback(self._serving.discard)
        decoder = FrameDecoder()
        try:
            while data := await reader.read(65536):
                for cmd in decoder.feed(data):
                    self.received.append((number, cmd))
                    self._spawn(self._reply(cmd, number, writer))
        except (ConnectionError, ProtocolError):
            pass
        self.closed.append(number)
        writer.close()

    async def _reply(self, cmd: RemotingCommand, number: int,
                     writer: asyncio.StreamWriter) -> None:
        response = await self.answer(cmd, number)
        if response is not None and not cmd.is_oneway and not writer.is_closing():
            writer.write(response.encode())


def send_ok(cmd: RemotingCommand, *, offset_msg_id: str = "0A00000100002A9F0000000000000000",
            queue_offset: int = 0) -> RemotingCommand:
    """A broker's SUCCESS answer to SEND_MESSAGE(_V2) / SEND_BATCH_MESSAGE."""
    queue_id = (cmd.ext_fields or {}).get("e") or (cmd.ext_fields or {}).get("queueId") or "0"
    return cmd.response_to(ResponseCode.SUCCESS, ext_fields={
        "msgId": offset_msg_id, "queueId": queue_id, "queueOffset": str(queue_offset)})


def route_answer(cmd: RemotingCommand, brokers: dict[str, str], *,
                 queues: int = 2) -> RemotingCommand:
    """A name server's answer to GET_ROUTEINFO_BY_TOPIC: ``brokers`` (name -> master
    address), each with ``queues`` read and write queues."""
    route = TopicRouteData(
        queue_datas=[QueueData(name, queues, queues, perm=6) for name in brokers],
        broker_datas=[BrokerData("DefaultCluster", name, {0: addr})
                      for name, addr in brokers.items()],
    )
    return cmd.response_to(ResponseCode.SUCCESS, body=route.to_json_bytes())


def uniq_key(cmd: RemotingCommand) -> str | None:
    """The ``UNIQ_KEY`` property of a SEND_MESSAGE_V2 request."""
    return decode_properties((cmd.ext_fields or {}).get("i", "")).get(PROPERTY_UNIQ_KEY)


@contextlib.asynccontextmanager
async def silent_listener() -> AsyncIterator[tuple[str, list[asyncio.StreamWriter]]]:
    """``(address, accepted connections)`` of a listener that never sends a byte."""
    accepted: list[asyncio.StreamWriter] = []
    server = await asyncio.start_server(lambda r, w: accepted.append(w), "127.0.0.1", 0)
    try:
        yield f"127.0.0.1:{server.sockets[0].getsockname()[1]}", accepted
    finally:
        server.close()
        for writer in accepted:
            writer.transport.abort()


def insecure_tls() -> ssl.SSLContext:
    """A client TLS context that accepts any certificate (for :func:`silent_listener`)."""
    ctx = ssl.create_default_context()
    ctx.check_hostname = False
    ctx.verify_mode = ssl.CERT_NONE
    return ctx

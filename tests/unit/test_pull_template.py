"""A pull frame written from its template is byte for byte the frame the encoder writes."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from rmq_async.client.api import MQClientAPI
from rmq_async.protocol.command import FrameDecoder, FrameTemplate, RemotingCommand
from rmq_async.protocol.types import MessageQueue


class Capture:
    """Stands in for the RemotingClient: records what start_pull hands it."""

    def __init__(self) -> None:
        self.sent: list[tuple[bytes | None, RemotingCommand]] = []

    async def start_invoke(self, addr: str, make_cmd: Any, timeout: float, *,
                           frame: tuple[int, bytes] | None = None) -> asyncio.Future[Any]:
        cmd = make_cmd()
        if frame is not None:
            cmd.opaque = frame[0]
        self.sent.append((frame[1] if frame else None, cmd))
        return asyncio.get_running_loop().create_future()


@pytest.mark.parametrize("expression", [None, "a || b", 'x"\\\u00e9'])
@pytest.mark.parametrize(("offset", "commit", "suspend"),
                         [(0, -1, 15.0), (123456789012, 123456789000, 15.0), (7, 3, 0.0)])
async def test_template_frame_equals_encoded_command(expression: str | None, offset: int,
                                                     commit: int, suspend: float) -> None:
    capture = Capture()
    api = MQClientAPI(capture)  # type: ignore[arg-type]
    mq = MessageQueue("T_topic-1", "broker-a", 5)
    for queue_offset in (offset, offset + 32):  # the second comes from the cached template
        await api.start_pull("127.0.0.1:1", group="G_1", mq=mq, queue_offset=queue_offset,
                             commit_offset=commit, suspend_timeout=suspend,
                             subscription=expression, sub_version=1700000000123)
    assert len(capture.sent) == 2
    for frame, cmd in capture.sent:
        assert frame is not None
        assert frame == cmd.encode()
        (decoded,) = FrameDecoder().feed(frame)
        assert decoded.ext_fields is not None and decoded.opaque == cmd.opaque


def test_template_refuses_a_sentinel_found_twice() -> None:
    cmd = RemotingCommand.request(10, ext_fields={"a": "-5", "b": "-5"})
    assert FrameTemplate.build(cmd, {"a": "-5"}) is None
    cmd = RemotingCommand.request(10, ext_fields={"a": "-5", "b": "7"})
    tpl = FrameTemplate.build(cmd, {"a": "-5"})
    assert tpl is not None
    expected = RemotingCommand.request(10, ext_fields={"a": "42", "b": "7"})
    assert tpl.render(expected.opaque, {"a": 42}) == expected.encode()

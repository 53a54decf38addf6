"""A pull answer's offsets: the inline reading of plain decimals agrees with the typed header,
and every other shape gets the typed header's error."""

from __future__ import annotations

import asyncio

import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from rmq_async.client.api import PendingPull, PullResult, PullStatus
from rmq_async.protocol import headers as h
from rmq_async.protocol.codes import ResponseCode
from rmq_async.protocol.command import RemotingCommand
from rmq_async.protocol.errors import ProtocolError

NAMES = ("nextBeginOffset", "minOffset", "maxOffset", "suggestWhichBrokerId", "offsetDelta")


def _result(ext: dict[str, str], code: int = ResponseCode.SUCCESS) -> PullResult:
    async def answer() -> PullResult:
        fut = asyncio.get_running_loop().create_future()
        fut.set_result(RemotingCommand(code=code, flag=1, ext_fields=ext, body=b"stored"))
        return await PendingPull("127.0.0.1:10911", 0, fut).result()

    return asyncio.run(answer())


def _expected(ext: dict[str, str]) -> tuple[int, int, int, int, int | None]:
    rh = h.PullMessageResponseHeader.from_ext_fields(ext)
    return (rh.next_begin_offset, rh.min_offset, rh.max_offset, rh.suggest_which_broker_id,
            rh.offset_delta)


values = st.one_of(
    st.integers(min_value=0, max_value=10**18).map(str),
    st.integers(min_value=-(2**63), max_value=2**63 - 1).map(str),
    st.sampled_from(["", " 1", "1 ", "+1", "0x10", "1.0", "٣", "9" * 19, "9" * 25, "abc", "-0"]),
)


@given(st.dictionaries(st.sampled_from(NAMES), values), st.booleans())
@example({"minOffset": ""}, True)
@example({"offsetDelta": ""}, True)
@example({"nextBeginOffset": "-5"}, True)
@example({"maxOffset": "9" * 19}, True)
@example({"maxOffset": "\u0663"}, True)
@example({}, True)
def test_offsets_read_inline_agree_with_the_typed_header(ext: dict[str, str],
                                                               all_four: bool) -> None:
    if all_four:
        for name in NAMES[:4]:
            ext.setdefault(name, "7")
    try:
        expected = _expected(ext)
    except ProtocolError as exc:
        with pytest.raises(ProtocolError) as got:
            _result(ext)
        assert str(got.value) == str(exc)
        return
    result = _result(ext)
    assert (result.next_begin_offset, result.min_offset, result.max_offset,
            result.suggest_which_broker_id, result.offset_delta) == expected


def test_found_keeps_the_body_and_other_answers_drop_it() -> None:
    ext = {"nextBeginOffset": "32", "minOffset": "0", "maxOffset": "1000",
           "suggestWhichBrokerId": "0", "offsetDelta": "5"}
    found = _result(ext)
    assert (found.status, found.body, found.next_begin_offset, found.offset_delta) == (
        PullStatus.FOUND, b"stored", 32, 5)
    retry = _result(ext, ResponseCode.PULL_RETRY_IMMEDIATELY)
    assert retry.body == b"" and retry.status is PullStatus.NO_MATCHED_MSG

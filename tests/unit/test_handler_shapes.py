"""Handler shapes, payload decoding, subscription sharing and the middleware chain (no broker)."""

from __future__ import annotations

import dataclasses
import enum
import functools
import json
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple, NotRequired, TypedDict

import msgpack
import msgspec
import pydantic
import pytest
import typing_extensions

from rmq_async import (
    CallNext,
    ConsumeCall,
    ConsumeContext,
    ConsumeResult,
    DeadLetter,
    MessageExt,
    PushConsumer,
    RetryLater,
)
from rmq_async.consumer.listener import ListenerAdapter, inspect_handler
from rmq_async.consumer.middleware import run_call
from rmq_async.errors import InvalidTypeError
from rmq_async.payloads import PayloadDecodeError, build_payload_decoder
from rmq_async.protocol.types import MessageQueue

MQ = MessageQueue("T", "b", 0)


def _msg(body: bytes = b"x", **props: str) -> MessageExt:
    m = MessageExt("T", body, 0, 0)
    m.properties = dict(props)
    return m


# ------------------------------------------------------------------------- shapes


async def per_message(msg: MessageExt) -> None: ...
async def unannotated(msg): ...  # type: ignore[no-untyped-def]
async def batch_list(msgs: list[MessageExt]) -> None: ...
async def batch_seq(msgs: Sequence[MessageExt]) -> None: ...
async def with_ctx(msg: MessageExt, ctx: ConsumeContext) -> None: ...
async def ctx_kwonly(msg: MessageExt, *, context: ConsumeContext) -> None: ...
async def with_default(msg: MessageExt, retries: int = 3) -> None: ...
def plain_def(msgs: list[MessageExt], c: ConsumeContext) -> None: ...


@pytest.mark.parametrize(("fn", "batch", "ctx", "is_async"), [
    (per_message, False, None, True),
    (unannotated, False, None, True),
    (batch_list, True, None, True),
    (batch_seq, True, None, True),
    (with_ctx, False, "ctx", True),
    (ctx_kwonly, False, "context", True),
    (with_default, False, None, True),
    (plain_def, True, "c", False),
])
def test_shape_is_read_from_annotations(fn: Any, batch: bool, ctx: str | None,
                                        is_async: bool) -> None:
    shape = inspect_handler(fn)
    assert (shape.batch, shape.context_param, shape.is_async) == (batch, ctx, is_async)


def test_batch_true_opts_in_and_conflicts_are_refused() -> None:
    assert inspect_handler(unannotated, batch=True).batch
    assert inspect_handler(per_message, batch=True).batch
    assert not inspect_handler(unannotated, batch=False).batch
    with pytest.raises(TypeError, match="batch=False"):
        inspect_handler(batch_list, batch=False)


def test_locally_defined_annotations_still_count() -> None:
    class LocalOrder:
        pass

    # ``LocalOrder`` cannot be resolved from the module: the raw annotations are read.
    async def local(msgs: list[LocalOrder], c: ConsumeContext) -> None: ...

    shape = inspect_handler(local)
    assert shape.batch and shape.context_param == "c"


def test_context_is_never_injected_by_position() -> None:
    async def two(msg: MessageExt, retries: int = 3) -> None: ...

    assert inspect_handler(two).context_param is None


@pytest.mark.parametrize(("src", "match"), [
    ("async def h(): ...", "no positional parameter"),
    ("async def h(msgs, retries): ...", "'retries' has no default"),
    ("async def h(ctx: ConsumeContext): ...", "annotated ConsumeContext"),
    ("async def h(m, a: ConsumeContext, b: ConsumeContext): ...", "two ConsumeContext"),
    ("async def h(m, *, extra): ...", "'extra' has no default"),
    ("async def h(m, c: ConsumeContext, /): ...", "positional-only"),
    # Called, a generator function runs none of its body: every message would be
    # acknowledged unprocessed.
    ("async def h(m):\n    yield m", "generator function"),
    ("def h(m):\n    yield m", "generator function"),
    ("import functools\nasync def g(m, n):\n    yield m\nh = functools.partial(g, n=1)",
     "generator function"),
    ("class C:\n    async def __call__(self, m):\n        yield m\nh = C()",
     "generator function"),
    ("import functools\ndef g(m):\n    yield m\n@functools.wraps(g)\n"
     "def h(*a, **k):\n    return g(*a, **k)", "generator function"),
])
def test_bad_signatures_raise_type_error_at_subscribe(src: str, match: str) -> None:
    ns: dict[str, Any] = {"ConsumeContext": ConsumeContext}
    exec(src, ns)
    with pytest.raises(TypeError, match=match):
        inspect_handler(ns["h"])
    consumer = PushConsumer("G", namesrv="127.0.0.1:9876")
    with pytest.raises(TypeError, match=match):
        consumer.subscribe("T")(ns["h"])
    assert consumer.subscription_data("T") is None


def test_not_callable_is_a_type_error() -> None:
    with pytest.raises(TypeError, match="callable"):
        inspect_handler(42)  # type: ignore[arg-type]


def test_subscribe_returns_the_function_unchanged() -> None:
    consumer = PushConsumer("G", namesrv="127.0.0.1:9876")
    decorated = consumer.subscribe("T")(per_message)
    assert decorated is per_message
    assert consumer.subscribe("U", listener=batch_list) is batch_list


async def test_adapter_calls_each_shape() -> None:
    got: list[Any] = []

    async def h1(msg: MessageExt, ctx: ConsumeContext) -> None:
        got.append((msg.body, ctx.message is msg, ctx.messages == [msg]))

    def h2(msgs: list[MessageExt]) -> str:
        got.append([m.body for m in msgs])
        return "SUCCESS"

    ctx = ConsumeContext(MQ)
    assert await ListenerAdapter(h1).invoke([_msg(b"a")], ctx) is None
    assert await ListenerAdapter(h2).invoke([_msg(b"a"), _msg(b"b")], ConsumeContext(MQ)) == "SUCCESS"
    assert got == [(b"a", True, True), [b"a", b"b"]]


# ------------------------------------------------------------------------- payloads


@dataclasses.dataclass
class DcOrder:
    id: int
    item: str


class PydOrder(pydantic.BaseModel):
    id: int
    item: str


class StructOrder(msgspec.Struct):
    id: int
    item: str


@pytest.mark.parametrize("model", [DcOrder, PydOrder, StructOrder])
def test_models_from_json_and_msgpack(model: type) -> None:
    decode = build_payload_decoder(model, None)
    data = {"id": 7, "item": "pen"}
    assert decode(_msg(json.dumps(data).encode())) == model(**data)
    packed = _msg(msgpack.packb(data), CONTENT_TYPE="application/msgpack")
    assert decode(packed) == model(**data)
    for bad in (b"{", b"[1]", b'{"id": 1}', b"null"):
        with pytest.raises(PayloadDecodeError, match=f"not decodable as {model.__name__}"):
            decode(_msg(bad))
    with pytest.raises(PayloadDecodeError, match="unsupported content type"):
        decode(_msg(b"{}", CONTENT_TYPE="text/xml"))


def test_custom_decoder_and_plain_types() -> None:
    assert build_payload_decoder(None, bytes.upper)(_msg(b"ab")) == b"AB"
    as_dict = build_payload_decoder(dict, None)
    assert as_dict(_msg(b'{"a": 1}')) == {"a": 1}
    with pytest.raises(PayloadDecodeError):
        as_dict(_msg(b"[1]"))
    both = build_payload_decoder(DcOrder, lambda b: msgpack.unpackb(b))
    assert both(_msg(msgpack.packb({"id": 1, "item": "x"}))) == DcOrder(1, "x")
    with pytest.raises(TypeError):
        build_payload_decoder("Order", None)  # type: ignore[arg-type]


class TdOrder(TypedDict):
    id: int
    item: str


class TdNote(TypedDict):  # this module has postponed annotations, as many do
    id: int
    note: NotRequired[str]


class TeOrder(typing_extensions.TypedDict):  # the flavour pydantic asks for before 3.12
    id: int
    seen: typing_extensions.ReadOnly[NotRequired[bool]]


class NtOrder(NamedTuple):
    id: int
    item: str


class Colour(enum.Enum):
    RED = "red"


def test_a_model_no_body_can_decode_into_is_refused_when_subscribing() -> None:
    """A NamedTuple, an Enum or a plain class would send every message to the dead-letter
    queue: refused up front instead. Abstract classes of what bodies decode into are fine."""
    for model in (NtOrder, Colour, ListenerAdapter):
        with pytest.raises(InvalidTypeError, match="no body decodes into it"):
            build_payload_decoder(model, None)
    as_mapping = build_payload_decoder(Mapping, None)
    assert as_mapping(_msg(b'{"a": 1}')) == {"a": 1}
    consumer = PushConsumer("G_models", namesrv="127.0.0.1:9876")
    with pytest.raises(InvalidTypeError):
        consumer.subscribe("T", listener=lambda order: None, model=NtOrder)


def test_typeddict_and_number_models() -> None:
    as_td = build_payload_decoder(TdOrder, None)
    assert as_td(_msg(b'{"id": 7, "item": "pen"}')) == {"id": 7, "item": "pen"}
    # A key the producer added later is kept, not a reason to dead-letter the message.
    assert as_td(_msg(b'{"id": 7, "item": "pen", "x": 1}'))["x"] == 1
    for bad in (b'{"id": 7}', b"[1]"):
        with pytest.raises(PayloadDecodeError, match="TdOrder"):
            as_td(_msg(bad))
    as_note = build_payload_decoder(TdNote, None)
    assert as_note(_msg(b'{"id": 1}')) == {"id": 1}  # NotRequired, whatever 3.11 says
    with pytest.raises(PayloadDecodeError, match="missing keys"):
        as_note(_msg(b'{"note": "x"}'))
    assert build_payload_decoder(TeOrder, None)(_msg(b'{"id": 2}')) == {"id": 2}
    as_float = build_payload_decoder(float, None)
    assert as_float(_msg(b"10.5")) == 10.5
    whole = as_float(_msg(b"10"))  # JSON has one number type: 10 is a float too
    assert whole == 10.0 and type(whole) is float
    as_int = build_payload_decoder(int, None)
    assert as_int(_msg(b"10")) == 10
    for model, body in ((float, b"true"), (int, b"true"), (int, b"1.5")):
        with pytest.raises(PayloadDecodeError):
            build_payload_decoder(model, None)(_msg(body))


async def test_a_decoder_that_cannot_reach_its_registry_is_retried_not_dead_lettered() -> None:
    def decoder(body: bytes) -> Any:
        raise ConnectionRefusedError("schema registry down")

    async def one(order: Any) -> None:
        raise AssertionError("not called")

    ctx = ConsumeContext(MQ)
    out = await run_call(ListenerAdapter(one, decoder=decoder), [_msg(b"{}")], ctx, group="G",
                         topic="T", queue=MQ, orderly=False, middlewares=[])
    assert out.result is ConsumeResult.RECONSUME_LATER and out.dead_reason is None
    assert isinstance(out.error, ConnectionRefusedError) and not ctx.dead_letters


async def test_a_body_error_that_is_an_oserror_is_still_poison() -> None:
    """gzip says a body is not gzip with BadGzipFile, an OSError: that is about the body, so
    the message is dead-lettered, not retried for ever (an orderly queue would stall)."""
    import gzip

    async def one(order: Any) -> None:
        raise AssertionError("not called")

    ctx = ConsumeContext(MQ)
    out = await run_call(ListenerAdapter(one, decoder=lambda b: json.loads(gzip.decompress(b))),
                         [_msg(b"not gzip")], ctx, group="G", topic="T", queue=MQ,
                         orderly=True, middlewares=[])
    assert out.dead_reason is not None and "BadGzipFile" in out.dead_reason


async def test_a_client_library_error_caused_by_a_refused_connection_is_retried() -> None:
    """An HTTP client wraps the refused connection in an error of its own (requests'
    ConnectionError is an OSError, not Python's): found among the causes, it is retried."""
    class ClientError(OSError):
        pass

    def decoder(body: bytes) -> Any:
        try:
            raise ConnectionRefusedError("registry down")
        except ConnectionRefusedError as exc:
            raise ClientError("max retries exceeded") from exc

    async def one(order: Any) -> None:
        raise AssertionError("not called")

    out = await run_call(ListenerAdapter(one, decoder=decoder), [_msg(b"{}")],
                         ConsumeContext(MQ), group="G", topic="T", queue=MQ, orderly=False,
                         middlewares=[])
    assert out.result is ConsumeResult.RECONSUME_LATER and out.dead_reason is None


async def test_a_body_error_raised_from_none_while_a_connection_error_was_handled_is_poison(
) -> None:
    """``raise ... from None`` says the error being handled is not the cause: a decoder that
    falls back to a local schema after its registry refused, and finds the body bad, has a
    body error (dead-lettered), not a registry outage (retried, for ever when orderly)."""
    def decoder(body: bytes) -> Any:
        try:
            raise ConnectionRefusedError("registry down")
        except ConnectionRefusedError:
            raise ValueError("unknown schema id 7") from None

    async def one(order: Any) -> None:
        raise AssertionError("not called")

    with pytest.raises(PayloadDecodeError):
        build_payload_decoder(None, decoder)(_msg(b"{}"))
    out = await run_call(ListenerAdapter(one, decoder=decoder), [_msg(b"{}")],
                         ConsumeContext(MQ), group="G", topic="T", queue=MQ, orderly=True,
                         middlewares=[])
    assert out.dead_reason is not None and "unknown schema id 7" in out.dead_reason

    def implicit(body: bytes) -> Any:  # raised while handling it, not from None: retried
        try:
            raise ConnectionRefusedError("registry down")
        except ConnectionRefusedError:
            raise ValueError("no schema")

    out = await run_call(ListenerAdapter(one, decoder=implicit), [_msg(b"{}")],
                         ConsumeContext(MQ), group="G", topic="T", queue=MQ, orderly=False,
                         middlewares=[])
    assert out.result is ConsumeResult.RECONSUME_LATER and out.dead_reason is None


async def test_a_decoder_asking_for_a_retry_is_retried() -> None:
    def decoder(body: bytes) -> Any:
        raise RetryLater()  # its registry client failed with an error of its own

    async def one(order: Any) -> None:
        raise AssertionError("not called")

    out = await run_call(ListenerAdapter(one, decoder=decoder), [_msg(b"{}")],
                         ConsumeContext(MQ), group="G", topic="T", queue=MQ, orderly=True,
                         middlewares=[])
    assert out.result is ConsumeResult.SUSPEND_CURRENT_QUEUE_A_MOMENT
    assert out.dead_reason is None


async def test_undecodable_per_message_is_dead_letter_and_batch_filters_poison() -> None:
    async def one(order: DcOrder) -> None: ...

    with pytest.raises(DeadLetter, match="not decodable as DcOrder"):
        await ListenerAdapter(one, model=DcOrder).invoke([_msg(b"{")], ConsumeContext(MQ))

    seen: list[list[DcOrder]] = []

    async def many(orders: list[DcOrder]) -> None:
        seen.append(orders)

    good = _msg(b'{"id": 1, "item": "a"}')
    bad = _msg(b"oops")
    ctx = ConsumeContext(MQ)
    await ListenerAdapter(many, model=DcOrder).invoke([good, bad], ctx)
    assert seen == [[DcOrder(1, "a")]]
    assert [(m, r.split(":")[0]) for m, r in ctx.dead_letters] == [
        (bad, "payload not decodable as DcOrder")]


# ------------------------------------------------------------------------- subscriptions


def test_disjoint_tags_share_a_topic_and_overlaps_raise() -> None:
    c = PushConsumer("G", namesrv="127.0.0.1:9876")
    c.subscribe("T", tags="a || b")(per_message)
    c.subscribe("T", tags="c", batch=True)(batch_list)
    data = c.subscription_data("T")
    assert data is not None and data.tags_set == ["a", "b", "c"] and data.sub_string == "a || b || c"
    a, cc = _msg(), _msg()
    a.properties = {"TAGS": "b"}
    cc.properties = {"TAGS": "c"}
    assert c.listener_for("T", a).fn is per_message  # type: ignore[union-attr]
    assert c.listener_for("T", cc).fn is batch_list  # type: ignore[union-attr]
    assert c.listener_for("T", _msg()) is None  # no tag: no handler
    for kwargs in ({"tags": "b"}, {"tags": "*"}, {"tags": "c || d"}, {"sql": "a > 1"},
                   {"tags": "z", "orderly": True}):
        with pytest.raises(ValueError, match="already subscribed"):
            c.subscribe("T", **kwargs)(per_message)  # type: ignore[arg-type]
    c2 = PushConsumer("G", namesrv="127.0.0.1:9876")
    c2.subscribe("T")(per_message)
    with pytest.raises(ValueError, match="'\\*' takes every tag"):
        c2.subscribe("T", tags="a")(per_message)


def test_sql_subscription_data() -> None:
    c = PushConsumer("G", namesrv="127.0.0.1:9876")
    c.subscribe("T", sql="a > 1")(per_message)
    data = c.subscription_data("T")
    assert data is not None and (data.expression_type, data.sub_string) == ("SQL92", "a > 1")
    with pytest.raises(ValueError, match="tags= or sql="):
        c.subscribe("U", tags="x", sql="a > 1")(per_message)


# ------------------------------------------------------------------------- middlewares


async def test_middleware_order_results_and_verdicts() -> None:
    log: list[str] = []

    def mw(name: str) -> Any:
        async def m(call: ConsumeCall, call_next: CallNext) -> None:
            log.append(f"{name}>")
            try:
                await call_next(call)
            except Exception as exc:
                log.append(f"{name}!{type(exc).__name__}")
                raise
            log.append(f"<{name}")
        return m

    result: Any = None

    async def handler(msg: MessageExt) -> Any:
        log.append("handler")
        if isinstance(result, Exception):
            raise result
        return result

    adapter = ListenerAdapter(handler)

    async def run(orderly: bool = False, mws: Sequence[Any] = ()) -> Any:
        log.clear()
        return await run_call(adapter, [_msg()], ConsumeContext(MQ), group="G", topic="T",
                              queue=MQ, orderly=orderly, middlewares=list(mws))

    out = await run(mws=[mw("a"), mw("b")])
    assert out.result is ConsumeResult.SUCCESS and log == ["a>", "b>", "handler", "<b", "<a"]
    result = ConsumeResult.RECONSUME_LATER
    out = await run(mws=[mw("a")])
    assert out.result is ConsumeResult.RECONSUME_LATER and log[-1] == "a!RetryLater"
    out = await run(orderly=True)
    assert out.result is ConsumeResult.SUSPEND_CURRENT_QUEUE_A_MOMENT
    result = ValueError("boom")
    out = await run(orderly=True)
    assert out.result is ConsumeResult.SUSPEND_CURRENT_QUEUE_A_MOMENT and out.dead_reason is None

    async def swallow(call: ConsumeCall, call_next: CallNext) -> None:
        try:
            await call_next(call)
        except ValueError:
            pass

    async def to_dlq(call: ConsumeCall, call_next: CallNext) -> None:
        try:
            await call_next(call)
        except ValueError as exc:
            raise DeadLetter(f"bad: {exc}") from exc

    assert (await run(mws=[swallow])).result is ConsumeResult.SUCCESS
    out = await run(mws=[to_dlq])
    assert out.dead_reason == "bad: boom"
    result = RetryLater()
    assert (await run()).result is ConsumeResult.RECONSUME_LATER


async def test_a_dedup_middleware_fails_only_what_the_handler_saw() -> None:
    msgs = [_msg(b"1"), _msg(b"2"), _msg(b"3")]
    for offset, m in enumerate(msgs):  # one call's messages: one queue, distinct offsets
        m.queue_offset = offset

    async def dedup(call: ConsumeCall, call_next: CallNext) -> None:
        await call_next(dataclasses.replace(call, messages=[m for m in call.messages
                                                            if m.body != b"2"]))

    async def handler(batch: list[MessageExt]) -> None:
        assert [m.body for m in batch] == [b"1", b"3"]
        raise RuntimeError("fails")

    out = await run_call(ListenerAdapter(handler), msgs, ConsumeContext(MQ), group="G",
                         topic="T", queue=MQ, orderly=False, middlewares=[dedup])
    assert out.result is ConsumeResult.RECONSUME_LATER and out.acked == [msgs[1]]


def test_middleware_registration() -> None:
    c = PushConsumer("G", namesrv="127.0.0.1:9876")

    async def m1(call: ConsumeCall, call_next: CallNext) -> None: ...

    assert c.middleware(m1) is m1
    assert c.add_middleware(m1) is m1
    assert c.subscriptions.middlewares == [m1, m1]
    with pytest.raises(TypeError):
        c.add_middleware(3)  # type: ignore[arg-type]


def test_a_middleware_that_is_not_a_coroutine_function_is_refused() -> None:
    """A plain ``def`` middleware (its ``call_next(call)`` never awaited) or a generator would
    fail every call of every subscription, the handlers never reached: refused when added,
    as handlers of a wrong shape are at subscribe."""
    c = PushConsumer("G", namesrv="127.0.0.1:9876")

    def plain(call: ConsumeCall, call_next: CallNext) -> None:
        call_next(call)

    async def agen(call: ConsumeCall, call_next: CallNext) -> Any:
        await call_next(call)
        yield

    class Bound:
        async def __call__(self, call: ConsumeCall, call_next: CallNext) -> None:
            await call_next(call)

    async def with_prefix(prefix: str, call: ConsumeCall, call_next: CallNext) -> None:
        await call_next(call)

    for bad in (plain, agen):
        with pytest.raises(InvalidTypeError, match="async def"):
            c.add_middleware(bad)  # type: ignore[arg-type]
    assert c.subscriptions.middlewares == []
    ok = [Bound(), functools.partial(with_prefix, "p")]
    for mw in ok:
        c.add_middleware(mw)
    assert c.subscriptions.middlewares == ok


async def test_an_orderly_retry_later_that_names_a_success_is_a_failure() -> None:
    """``RetryLater`` is a failure whatever result it names: an orderly ``RetryLater(COMMIT)``
    (or SUCCESS) suspends the queue, it does not commit the messages."""
    async def handler(msg: MessageExt) -> None:
        raise RetryLater(ConsumeResult.COMMIT)

    for orderly, failed in ((True, ConsumeResult.SUSPEND_CURRENT_QUEUE_A_MOMENT),
                            (False, ConsumeResult.RECONSUME_LATER)):
        for named in (ConsumeResult.COMMIT, ConsumeResult.SUCCESS):
            async def raising(msg: MessageExt, named: ConsumeResult = named) -> None:
                raise RetryLater(named)

            out = await run_call(ListenerAdapter(raising), [_msg()], ConsumeContext(MQ),
                                 group="G", topic="T", queue=MQ, orderly=orderly,
                                 middlewares=[])
            assert out.result is failed, (orderly, named, out.result)
    for kept in (ConsumeResult.ROLLBACK, ConsumeResult.SUSPEND_CURRENT_QUEUE_A_MOMENT):
        async def keeping(msg: MessageExt, kept: ConsumeResult = kept) -> None:
            raise RetryLater(kept)

        out = await run_call(ListenerAdapter(keeping), [_msg()], ConsumeContext(MQ),
                             group="G", topic="T", queue=MQ, orderly=True, middlewares=[])
        assert out.result is kept


async def test_a_middleware_that_calls_the_handler_again_starts_it_from_a_clean_context(
) -> None:
    """A retrying middleware: the second call of the handler does not inherit the first's
    ``ack_index`` or ``dead_letters`` (which would acknowledge part of a batch the second call
    consumed whole, or dead-letter a message it consumed)."""
    msgs = [_msg(b"1"), _msg(b"2"), _msg(b"3")]
    for offset, m in enumerate(msgs):
        m.queue_offset = offset
    attempts: list[int] = []

    async def handler(batch: list[MessageExt], ctx: ConsumeContext) -> None:
        attempts.append(len(batch))
        assert ctx.ack_index is None and ctx.dead_letters == []
        if len(attempts) == 1:
            ctx.ack_index = 0
            ctx.dead_letters.append((batch[2], "first attempt"))
            raise RuntimeError("transient")

    async def retry_once(call: ConsumeCall, call_next: CallNext) -> None:
        try:
            await call_next(call)
        except RuntimeError:
            await call_next(call)

    ctx = ConsumeContext(MQ)
    out = await run_call(ListenerAdapter(handler), msgs, ctx, group="G", topic="T", queue=MQ,
                         orderly=False, middlewares=[retry_once])
    assert attempts == [3, 3] and out.result is ConsumeResult.SUCCESS and out.error is None
    assert ctx.ack_index is None and ctx.dead_letters == []


def test_copies_into_the_retry_topic_keep_the_message_but_not_what_delivery_added() -> None:
    """The dead-letter copy and the send-back fallback's copy: the user's properties, keys and
    tags stay; what the pull added and the transaction mark go (a TRAN_MSG copy would be
    stored as a half message); RETRY_TOPIC / ORIGIN_MESSAGE_ID point at the original."""
    from rmq_async.consumer.dead_letter import dead_letter_properties
    from rmq_async.consumer.runtime import retry_copy_properties
    from rmq_async.payloads import MAX_REASON_CHARS
    from rmq_async.protocol.types import MessageExt

    msg = MessageExt(topic="orders", body=b"x", queue_id=1, queue_offset=7, properties={
        "TAGS": "paid", "KEYS": "k1 k2", "UNIQ_KEY": "UID1", "region": "eu",
        "TRAN_MSG": "true", "CONSUME_START_TIME": "1", "MIN_OFFSET": "0", "MAX_OFFSET": "9",
        "DELAY": "3"})
    props = retry_copy_properties(msg)
    assert props == {"TAGS": "paid", "KEYS": "k1 k2", "UNIQ_KEY": "UID1", "region": "eu",
                     "RETRY_TOPIC": "orders", "ORIGIN_MESSAGE_ID": "UID1"}
    # A redelivered message keeps pointing at where it was first sent.
    again = MessageExt(topic="%RETRY%g", body=b"x", queue_id=0, queue_offset=1,
                       properties={**props, "UNIQ_KEY": "UID2"})
    assert retry_copy_properties(again)["RETRY_TOPIC"] == "orders"
    assert retry_copy_properties(again)["ORIGIN_MESSAGE_ID"] == "UID1"
    dlq = dead_letter_properties(msg, "ValueError: " + "b" * 5000)
    assert "TRAN_MSG" not in dlq and dlq["region"] == "eu"
    assert len(dlq["RMQ_DLQ_REASON"]) == MAX_REASON_CHARS
    assert dlq["RMQ_DLQ_REASON"].startswith("ValueError: b") and dlq["RMQ_DLQ_REASON"].endswith("...")


def test_an_optional_context_parameter_gets_the_context() -> None:
    """``ctx: ConsumeContext | None = None`` (or ``Optional[...]``) is the context parameter,
    written as a string (``from __future__ import annotations`` here) or evaluated."""
    import typing

    async def union(msgs: list[MessageExt], ctx: ConsumeContext | None = None) -> None: ...

    async def optional(msgs: list[MessageExt],
                       ctx: typing.Optional[ConsumeContext] = None) -> None: ...  # noqa: UP045

    async def evaluated(msgs: list[MessageExt], ctx: Any = None) -> None: ...

    evaluated.__annotations__["ctx"] = ConsumeContext | None
    for fn in (union, optional, evaluated):
        assert inspect_handler(fn).context_param == "ctx", fn.__name__

    async def other(msgs: list[MessageExt], extra: int | None = None) -> None: ...

    assert inspect_handler(other).context_param is None


@pytest.mark.parametrize("kind", ["plain", "async", "plain-batch", "async-batch"])
async def test_a_blocking_decoder_runs_off_the_event_loop(kind: str) -> None:
    """A ``decoder=`` reaching a schema registry (as the docs suggest it may) ran on the event
    loop, for plain handlers too, and stalled every pull and heartbeat for as long."""
    import asyncio
    import threading
    import time

    from rmq_async import MessageExt, MessageQueue
    from rmq_async.consumer.listener import ListenerAdapter
    from rmq_async.consumer.results import ConsumeContext

    loop_thread = threading.get_ident()
    decoded_on: list[int] = []

    def registry_decoder(body: bytes) -> str:
        decoded_on.append(threading.get_ident())
        time.sleep(0.6)
        return body.decode()

    got: list[object] = []

    def plain(payload: str) -> None:
        got.append(payload)

    async def coro(payload: str) -> None:
        got.append(payload)

    def plain_batch(payloads: list[str]) -> None:
        got.append(payloads)

    async def coro_batch(payloads: list[str]) -> None:
        got.append(payloads)

    fn = {"plain": plain, "async": coro, "plain-batch": plain_batch,
          "async-batch": coro_batch}[kind]
    adapter = ListenerAdapter(fn, decoder=registry_decoder)
    gaps: list[float] = []

    async def ticker() -> None:
        last = time.monotonic()
        while True:
            await asyncio.sleep(0.01)
            now = time.monotonic()
            gaps.append(now - last)
            last = now

    ticking = asyncio.ensure_future(ticker())
    try:
        await asyncio.sleep(0.03)
        await adapter.invoke([MessageExt("T", b"x", 0, 0)],
                             ConsumeContext(MessageQueue("T", "b", 0)))
    finally:
        ticking.cancel()
    assert got == ([["x"]] if "batch" in kind else ["x"])
    assert decoded_on and loop_thread not in decoded_on
    # On the loop, the decoder's 0.6 s would be one gap of the ticker's: it ticked through them
    # (a bound on the longest gap would fail on any stall of a loaded machine).
    assert len(gaps) >= 10, f"the event loop ticked {len(gaps)} times in the decoder's 0.6 s"


async def test_plain_handlers_run_on_the_consumers_own_threads() -> None:
    """Plain handlers took their threads from anyio's process-wide default of 40: forty slow
    ones held up every other ``to_thread`` user (an offset file's write, a Spark write), and
    a ``consume_concurrency`` above 40 was not reached. Each consume service has threads of
    its own now, as many as ``consume_concurrency``."""
    import asyncio
    import threading

    import anyio

    from rmq_async import ConsumeResult, MessageExt, MessageQueue, PushConsumer
    from rmq_async.consumer.results import ConsumeContext

    consumer = PushConsumer("G_threads", namesrv="127.0.0.1:9876", consume_concurrency=3)
    release = threading.Event()
    inside: list[int] = []

    def slow(msg: MessageExt) -> ConsumeResult:
        inside.append(msg.queue_offset)
        release.wait(10)
        return ConsumeResult.SUCCESS

    consumer.subscribe("T", listener=slow)
    consumer.subscribe("O", listener=lambda m: None, orderly=True)
    consumer.subscribe("S", tags="a", listener=lambda m: None)  # two handlers, one topic
    consumer.subscribe("S", tags="b", listener=lambda m: None)
    consumer._thread_limiters = (anyio.CapacityLimiter(3), anyio.CapacityLimiter(3))
    consumer._give_threads()
    concurrent, orderly = consumer._thread_limiters
    adapter = consumer.subscriptions.topics["T"].listener
    assert adapter is not None and adapter.limiter is concurrent
    assert consumer.subscriptions.topics["O"].listener.limiter is orderly  # type: ignore[union-attr]
    shared_topic = consumer.subscriptions.topics["S"]
    assert [a.limiter for a in shared_topic.by_tag.values()] == [concurrent, concurrent]

    shared = anyio.to_thread.current_default_thread_limiter()
    calls = [asyncio.ensure_future(adapter.invoke(
        [MessageExt("T", b"x", 0, i)], ConsumeContext(MessageQueue("T", "b", 0))))
        for i in range(4)]
    try:
        async with asyncio.timeout(5):
            while len(inside) < 3:
                await asyncio.sleep(0.01)
        await asyncio.sleep(0.1)
        assert len(inside) == 3  # the fourth waits for one of the consumer's three threads
        assert concurrent.borrowed_tokens == 3 and shared.borrowed_tokens == 0
    finally:
        release.set()
    assert await asyncio.gather(*calls) == [ConsumeResult.SUCCESS] * 4


def _three_orders_the_first_unreadable() -> list[MessageExt]:
    bodies = [b"{not json", json.dumps({"id": 1}).encode(), json.dumps({"id": 2}).encode()]
    return [MessageExt("T", body, 0, offset) for offset, body in enumerate(bodies)]


async def test_a_batch_of_decoded_objects_lines_up_with_ctx_messages() -> None:
    """A body left out of a ``model=`` batch (to the dead-letter queue) stayed in
    ``ctx.messages``: zipped with the decoded objects, each order got the message before it;
    and ``ack_index``, which the service applies to the messages handed over, counted over
    ``ctx.messages`` acknowledged a message the handler meant as failed."""
    from rmq_async.consumer.consume import _apply_outcome

    seen: list[tuple[int, int]] = []

    async def pairs(orders: list[dict[str, int]], ctx: ConsumeContext) -> None:
        seen.extend((o["id"], m.queue_offset) for o, m in zip(orders, ctx.messages, strict=True))

    await run_call(ListenerAdapter(pairs, model=dict), _three_orders_the_first_unreadable(),
                   ConsumeContext(MQ), group="G", topic="T", queue=MQ, orderly=False,
                   middlewares=[])
    assert seen == [(1, 1), (2, 2)]

    async def done_through_offset_1(orders: list[dict[str, int]], ctx: ConsumeContext) -> None:
        ctx.ack_index = next(i for i, m in enumerate(ctx.messages) if m.queue_offset == 1)

    msgs = _three_orders_the_first_unreadable()
    ctx = ConsumeContext(MQ)
    outcome = await run_call(ListenerAdapter(done_through_offset_1, model=dict), msgs, ctx,
                             group="G", topic="T", queue=MQ, orderly=False, middlewares=[])
    failed: list[tuple[MessageExt, int]] = []
    dead: list[tuple[MessageExt, str]] = []
    _apply_outcome(outcome, msgs, ctx, failed, dead)
    assert [m.queue_offset for m, _ in dead] == [0]
    assert [m.queue_offset for m, _ in failed] == [2]

"""Typed payloads: message bodies decoded into the object a handler asks for.

``consumer.subscribe("orders", model=Order)`` hands the handler an ``Order`` instead of a
:class:`~rmq_async.protocol.types.MessageExt` (the message stays reachable as
``ConsumeContext.message``). How a body becomes an object:

1. **Wire format.** With ``decoder=`` the given ``Callable[[bytes], T]`` reads the body. Without
   it the message's ``CONTENT_TYPE`` user property decides: ``application/msgpack`` (or
   ``application/x-msgpack``) is msgpack; absent, ``application/json`` or any ``+json`` type is
   JSON. Any other content type cannot be decoded.
2. **Model.** With ``model=`` the decoded data becomes an instance of it:

   * a pydantic model (``pydantic`` extra): validated by pydantic (``model_validate_json`` for
     JSON bodies, so pydantic's strictness rules apply);
   * a msgspec ``Struct`` (``msgspec`` extra): decoded and validated by msgspec in one step;
   * a dataclass: the decoded object must be a JSON object whose keys are the dataclass's
     fields (unknown or missing required fields fail); field values are not converted;
   * a ``TypedDict`` (``typing``'s or ``typing_extensions``'): the decoded object must be a
     JSON object with its required keys; the handler gets that ``dict`` (other keys kept,
     values not converted);
   * a class a decoded value can be: ``dict``, ``list``, ``str``, ``int``, ``float`` (a
     whole number is converted), ``bool``, ``bytes`` (msgpack), or an abstract class of
     theirs such as ``Mapping``: the decoded value must already be an instance of it.

   Any other class (a ``NamedTuple``, an ``Enum``, a plain class) is refused when the
   subscription is made, since no body could ever decode into it.

   With ``decoder=`` and ``model=`` together, the decoder's result is converted into the model.

A body that fails any step raises :class:`PayloadDecodeError`; the consumer treats such a
message as poison and sends it to ``%DLQ%<group>`` at once, with the reason. What a
``decoder=`` raises that is not about the body propagates instead, and the message is retried
like any failed call: Python's own ``ConnectionError`` and ``TimeoutError``, a failed name
lookup (``socket.gaierror``), an error whose causes include one of those (an HTTP client's
own error for a refused connection), and :class:`~rmq_async.consumer.results.RetryLater`,
which a decoder may raise itself. Other exceptions are about the body, ``OSError`` s too
(``gzip`` raises ``BadGzipFile``, an ``OSError``, for a body that is not gzip).
"""

from __future__ import annotations

import dataclasses
import json
import socket
import typing
from collections.abc import Callable
from typing import Any, TypeVar

import msgpack  # type: ignore[import-untyped, unused-ignore]

from rmq_async.consumer.results import RetryLater
from rmq_async.errors import InvalidArgumentError, InvalidTypeError, RocketMQError
from rmq_async.protocol.types import MessageExt

__all__ = [
    "CONTENT_TYPE_JSON",
    "CONTENT_TYPE_MSGPACK",
    "PROPERTY_CONTENT_TYPE",
    "PayloadDecodeError",
    "build_payload_decoder",
]

T = TypeVar("T")

#: The user property naming a body's wire format.
PROPERTY_CONTENT_TYPE = "CONTENT_TYPE"
CONTENT_TYPE_JSON = "application/json"
CONTENT_TYPE_MSGPACK = "application/msgpack"
_MSGPACK_TYPES = frozenset({CONTENT_TYPE_MSGPACK, "application/x-msgpack", "application/vnd.msgpack"})

#: What JSON and msgpack bodies decode into: a plain model= must be one of these or above one.
_DECODED_KINDS: tuple[type[Any], ...] = (dict, list, str, int, float, bool, bytes)

#: The longest reason text a dead-lettered message carries.
MAX_REASON_CHARS = 1000


class PayloadDecodeError(RocketMQError, ValueError):
    """A message body could not be decoded into the subscription's payload type."""


#: Raised by a decoder= (or found among the causes of what it raised) for reasons other than
#: the body: retried, not dead-lettered.
_NOT_THE_BODY = (RetryLater, ConnectionError, TimeoutError, socket.gaierror)


def _not_the_body(exc: BaseException) -> bool:
    """``exc`` or one of its causes says the decoder could not reach something (an HTTP
    client's own error wrapping a refused connection, say), or asks for a retry.

    The causes are Python's own chain as a traceback prints it: ``raise ... from e`` names
    ``e``; an error raised while another was handled names that one, unless raised
    ``from None`` (the decoder said the other is not the cause)."""
    seen: set[int] = set()
    cur: BaseException | None = exc
    while cur is not None and id(cur) not in seen and len(seen) < 16:
        if isinstance(cur, _NOT_THE_BODY):
            return True
        seen.add(id(cur))
        cur = cur.__cause__ if cur.__cause__ is not None or cur.__suppress_context__ \
            else cur.__context__
    return False


def _wire_format(msg: MessageExt) -> str:
    raw = msg.get_property(PROPERTY_CONTENT_TYPE)
    if raw is None:
        return "json"
    ctype = raw.split(";", 1)[0].strip().lower()
    if ctype in _MSGPACK_TYPES:
        return "msgpack"
    if ctype in ("", CONTENT_TYPE_JSON, "text/json") or ctype.endswith("+json"):
        return "json"
    raise PayloadDecodeError(f"unsupported content type {raw!r}")


def _load(body: bytes, fmt: str) -> Any:
    if fmt == "msgpack":
        return msgpack.unpackb(body, raw=False, strict_map_key=False)
    return json.loads(body)


def _is_pydantic_model(model: type[Any]) -> bool:
    return callable(getattr(model, "model_validate_json", None)) and callable(
        getattr(model, "model_validate", None))


def _is_msgspec_struct(model: type[Any]) -> bool:
    return hasattr(model, "__struct_fields__")


def _is_typeddict(model: type[Any]) -> bool:
    # typing's and typing_extensions' (which typing.is_typeddict does not know on 3.11) alike.
    return (issubclass(model, dict) and hasattr(model, "__required_keys__")
            and hasattr(model, "__total__"))


def _required_keys(model: type[Any]) -> frozenset[str]:
    """A TypedDict's required keys, read from its annotations: on 3.11, with postponed
    annotations (``from __future__ import annotations``), ``__required_keys__`` misses what
    ``Required[...]`` / ``NotRequired[...]`` say."""
    required = set(model.__required_keys__)
    try:
        hints = typing.get_type_hints(model, include_extras=True)
    except Exception:  # an annotation that does not resolve here: keep what the class says
        return frozenset(required)
    for key, hint in hints.items():
        origin = typing.get_origin(hint)
        # Annotated[...] and ReadOnly[...] (typing_extensions', or 3.13's: known by its name)
        # say nothing about whether the key is required: look inside.
        while origin is typing.Annotated or getattr(origin, "_name", None) == "ReadOnly":
            hint = typing.get_args(hint)[0]
            origin = typing.get_origin(hint)
        if origin is typing.NotRequired:
            required.discard(key)
        elif origin is typing.Required:
            required.add(key)
    return frozenset(required)


def _model_converter(model: type[Any]) -> tuple[Callable[[bytes, str], Any],
                                                  Callable[[Any], Any]]:
    """(from body and wire format, from already decoded data) for ``model``."""
    if _is_pydantic_model(model):
        def pyd_body(body: bytes, fmt: str) -> Any:
            if fmt == "json":
                return model.model_validate_json(body)
            return model.model_validate(_load(body, fmt))

        return pyd_body, lambda data: model.model_validate(data)
    if _is_msgspec_struct(model):
        import msgspec

        json_decoder = msgspec.json.Decoder(model)
        msgpack_decoder = msgspec.msgpack.Decoder(model)

        def struct_body(body: bytes, fmt: str) -> Any:
            if fmt == "json":
                return json_decoder.decode(body)
            return msgpack_decoder.decode(body)

        return struct_body, lambda data: msgspec.convert(data, model)
    if dataclasses.is_dataclass(model):
        def from_data_dc(data: Any) -> Any:
            if not isinstance(data, dict):
                raise PayloadDecodeError(
                    f"expected a JSON object for {model.__name__}, got {type(data).__name__}")
            return model(**data)

        return (lambda body, fmt: from_data_dc(_load(body, fmt))), from_data_dc

    if _is_typeddict(model):
        required = _required_keys(model)

        def from_data_td(data: Any) -> Any:
            if not isinstance(data, dict):
                raise PayloadDecodeError(
                    f"expected a JSON object for {model.__name__}, got {type(data).__name__}")
            missing = required - data.keys()
            if missing:
                raise PayloadDecodeError(f"{model.__name__}: missing keys {sorted(missing)}")
            return data

        return (lambda body, fmt: from_data_td(_load(body, fmt))), from_data_td

    if not any(issubclass(kind, model) for kind in _DECODED_KINDS):
        raise InvalidTypeError(
            f"model={model.__name__}: no body decodes into it; give a pydantic model, a "
            "msgspec Struct, a dataclass, a TypedDict or one of dict, list, str, int, float, "
            "bool, bytes")
    whole_to_float = model is float

    def from_data_plain(data: Any) -> Any:
        if whole_to_float and type(data) is int:
            return float(data)
        if not isinstance(data, model) or (isinstance(data, bool) and model in (int, float)):
            raise PayloadDecodeError(
                f"expected {model.__name__}, got {type(data).__name__}")
        return data

    return (lambda body, fmt: from_data_plain(_load(body, fmt))), from_data_plain


def build_payload_decoder(model: type[Any] | None,
                          decoder: Callable[[bytes], Any] | None) -> Callable[[MessageExt], Any]:
    """The function turning a message into the handler's payload (see the module docs).

    It raises :class:`PayloadDecodeError` (with the cause chained) for a body it cannot read.
    """
    if model is None and decoder is None:
        raise InvalidArgumentError("give model= or decoder= (or neither, for MessageExt payloads)")
    if model is not None and not isinstance(model, type):
        raise InvalidTypeError(f"model= takes a class, got {model!r}")
    if decoder is not None and not callable(decoder):
        raise InvalidTypeError(f"decoder= takes a Callable[[bytes], T], got {decoder!r}")
    name = model.__name__ if model is not None else getattr(decoder, "__qualname__", "decoder")

    if decoder is not None:
        dec = decoder
        convert = _model_converter(model)[1] if model is not None else None

        def decode_custom(msg: MessageExt) -> Any:
            try:
                data = dec(msg.body)
                return convert(data) if convert is not None else data
            except PayloadDecodeError:
                raise
            except Exception as exc:
                if _not_the_body(exc):
                    # The decoder could not reach what it needs (a schema registry), or asked
                    # for a retry itself: the body may be fine, so the message is retried.
                    raise
                raise PayloadDecodeError(_reason(name, exc)) from exc

        return decode_custom

    assert model is not None
    from_body = _model_converter(model)[0]

    def decode_model(msg: MessageExt) -> Any:
        try:
            return from_body(msg.body, _wire_format(msg))
        except PayloadDecodeError as exc:
            raise PayloadDecodeError(_reason(name, exc)) from exc
        except Exception as exc:
            raise PayloadDecodeError(_reason(name, exc)) from exc

    return decode_model


def _reason(name: str, exc: Exception) -> str:
    text = f"payload not decodable as {name}: {type(exc).__name__}: {exc}"
    return text if len(text) <= MAX_REASON_CHARS else text[:MAX_REASON_CHARS - 3] + "..."

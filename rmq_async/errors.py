"""The root of every exception rmq_async raises: :class:`RocketMQError`.

Catch ``RocketMQError`` to handle anything the library raises for its own conditions. The
layers keep their own branches below it:

* :class:`~rmq_async.remoting.errors.RemotingError` (connect failures, closed connections,
  timeouts): the network;
* :class:`~rmq_async.protocol.errors.ProtocolError`: malformed data from a peer;
* :class:`~rmq_async.client.errors.MQClientError` and
  :class:`~rmq_async.client.errors.MQBrokerError`: typed answers of brokers and name servers;
* :class:`InvalidArgumentError` and :class:`~rmq_async.consumer.options.InvalidOptionError`:
  bad input to the API (also ``ValueError``s, so ``except ValueError`` keeps working);
* :class:`InvalidTypeError`: a value of the wrong type (also a ``TypeError``);
* :class:`IllegalStateError`: a call the object's state does not allow (also a
  ``RuntimeError``), such as starting a consumer twice;
* :class:`MissingExtraError`: a module of an optional extra imported without the extra
  installed (also an ``ImportError``);
* :class:`~rmq_async.devbroker.errors.DevBrokerError`: the local development broker.

Two builtin exceptions keep their asyncio meaning and are not wrapped: ``asyncio.CancelledError``
(the calling task was cancelled) and, from ``asyncio.timeout`` blocks the caller owns,
``TimeoutError``. A request that times out inside the library raises
:class:`~rmq_async.remoting.errors.RemotingTimeout`, which is both a ``RocketMQError`` and a
``TimeoutError``.
"""

from __future__ import annotations

__all__ = ["IllegalStateError", "InvalidArgumentError", "InvalidTypeError", "MissingExtraError",
           "RocketMQError"]


class RocketMQError(Exception):
    """Base class of every exception raised by rmq_async for its own conditions."""


class InvalidArgumentError(RocketMQError, ValueError):
    """An argument the library cannot work with (a ``ValueError`` too)."""


class InvalidTypeError(RocketMQError, TypeError):
    """An argument of a type the library cannot work with (a ``TypeError`` too)."""


class IllegalStateError(RocketMQError, RuntimeError):
    """The call is not allowed in the object's current state (a ``RuntimeError`` too)."""


class MissingExtraError(RocketMQError, ImportError):
    """A module of an optional extra was imported without the extra installed (an
    ``ImportError`` too); the message names the ``pip install`` that adds it."""

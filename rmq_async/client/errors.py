"""Errors raised by the client layer (typed broker and name-server answers)."""

from __future__ import annotations

from rmq_async.errors import RocketMQError
from rmq_async.protocol.codes import ResponseCode


class MQClientError(RocketMQError):
    """Base class of the client layer's errors."""


class MQBrokerError(MQClientError):
    """A broker or name server answered with an error code."""

    def __init__(self, code: int, remark: str | None, *, addr: str | None = None,
                 request: str | None = None) -> None:
        self.code = code
        self.remark = remark or ""
        self.addr = addr
        self.request = request
        try:
            name = ResponseCode(code).name
        except ValueError:
            name = str(code)
        where = f" from {addr}" if addr else ""
        what = f"{request} " if request else ""
        super().__init__(f"{what}failed{where}: {name} ({code}) {self.remark}".rstrip())


#: Broker answers after which Java's producer sends again (on another broker where it can:
#: 5.3.3's ``DefaultMQProducer.retryResponseCodes``, and GO_AWAY, a broker shutting down);
#: any other answer is final.
RETRY_SEND_CODES = frozenset({
    ResponseCode.TOPIC_NOT_EXIST, ResponseCode.SERVICE_NOT_AVAILABLE, ResponseCode.SYSTEM_ERROR,
    ResponseCode.SYSTEM_BUSY, ResponseCode.NO_PERMISSION, ResponseCode.NO_BUYER_ID,
    ResponseCode.NOT_IN_CURRENT_UNIT, ResponseCode.GO_AWAY,
})


class NoPermissionError(MQBrokerError):
    """The broker refused the request for lack of permission (ACL): check the credentials."""


class NoRouteError(MQClientError):
    """No name server knows a route for the topic."""

    def __init__(self, topic: str, detail: str = "") -> None:
        self.topic = topic
        super().__init__(f"no route for topic {topic!r}" + (f": {detail}" if detail else ""))


class NameServerUnavailable(MQClientError):
    """None of the configured name servers answered."""


def is_acl_refusal(code: int, remark: str | None) -> bool:
    """True for a refusal by the broker's access control, in either form brokers send it.

    5.3's authentication and authorization answer NO_PERMISSION. ACL 1.0 (4.9.x to 5.2.x,
    ``plain_acl.yml``) raises ``AclException`` in the request hook, which the remoting server
    turns into SYSTEM_ERROR with the exception's text as remark (``NettyRemotingAbstract``).
    """
    if code == ResponseCode.NO_PERMISSION:
        return True
    return code == ResponseCode.SYSTEM_ERROR and "AclException" in (remark or "")


def broker_error(code: int, remark: str | None, *, addr: str | None = None,
                 request: str | None = None) -> MQBrokerError:
    """Build the most specific error type for a response code (``code`` is kept as sent)."""
    if is_acl_refusal(code, remark):
        return NoPermissionError(code, remark, addr=addr, request=request)
    return MQBrokerError(code, remark, addr=addr, request=request)

"""Requests the broker (or an admin tool through the broker) sends to a consumer."""

from __future__ import annotations

from typing import TYPE_CHECKING

import structlog

from rmq_async.protocol.codes import RequestCode
from rmq_async.protocol.command import RemotingCommand
from rmq_async.remoting.connection import Connection, unsupported_response

if TYPE_CHECKING:
    from rmq_async.consumer.push import PushConsumer

log = structlog.get_logger(__name__)


class BrokerRequestHandler:
    """Answers broker-initiated requests on the consumer's remoting connections."""

    def __init__(self, consumer: PushConsumer) -> None:
        self._consumer = consumer

    async def __call__(self, cmd: RemotingCommand, conn: Connection) -> RemotingCommand | None:
        c = self._consumer
        if cmd.code == RequestCode.NOTIFY_CONSUMER_IDS_CHANGED:
            log.info("rebalance.notified", group=c.group, broker=conn.addr)
            c.rebalancer.wake()
            return None
        return unsupported_response(cmd)

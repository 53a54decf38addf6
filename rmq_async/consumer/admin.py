"""Requests the broker (or an admin tool through the broker) sends to a consumer.

Answered on the consumer's remoting connections (Java ``ClientRemotingProcessor``):

* ``NOTIFY_CONSUMER_IDS_CHANGED`` (oneway): a member joined or left; rebalance now.
* ``RESET_CONSUMER_CLIENT_OFFSET`` (oneway): ``mqadmin resetOffsetByTime`` on a broker that does
  not reset offsets itself (4.x, or 5.x with ``useServerSideResetOffset=false``). The listed
  queues this client holds are dropped, their new offsets are set, persisted and the queues
  forgotten; an immediate rebalance recreates them, and they start from the new offsets.

  Java sleeps 10 s between dropping and persisting, to let in-flight listener calls end before
  the new offset is written. Here that wait is not needed: a dropped queue's results commit
  nothing (both consume services check the drop flag before updating an offset) and the new
  offset is *frozen* in the offset store until the queue is removed, so a late result cannot
  overwrite it. Orderly queues are still released the orderly way (after the batch in flight,
  then unlocked). A pull sent just before the drop carries the old offset for the broker to
  commit, so the new offsets are written once more a second later (:data:`RESET_SETTLE`),
  before the queues are taken again.
* ``GET_CONSUMER_STATUS_FROM_CLIENT``: the in-memory consume offsets of one topic
  (``mqadmin getConsumerStatus``).
* ``GET_CONSUMER_RUNNING_INFO``: properties, subscriptions, per-queue process-queue state and
  per-topic statistics (``mqadmin consumerStatus``, ``consumerProgress -s true``); with
  ``jstackEnable`` the stacks of the process's asyncio tasks and threads.
* ``CONSUME_MESSAGE_DIRECTLY``: the admin's ``queryMsgById -g <group> -d <clientId>`` asks the
  broker to forward one stored message; the listener runs on it once and the result is
  reported. Nothing is acknowledged or sent back: it is a diagnostic call, as in Java.

Anything else is answered with REQUEST_CODE_NOT_SUPPORTED.
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import sys
import time
import traceback
from collections.abc import Coroutine
from datetime import datetime
from typing import TYPE_CHECKING, Any, Protocol

import structlog

from rmq_async.client.errors import MQClientError, NoPermissionError
from rmq_async.consumer.middleware import run_call
from rmq_async.consumer.options import JAVA_OPTION_NAMES, ConsumerOptions, MessageModel
from rmq_async.consumer.results import (
    ConsumeContext,
    DirectConsumeResult,
    direct_consume_result,
)
from rmq_async.consumer.subscriptions import reset_retry_topic
from rmq_async.consumer.tasks import enter_user_call
from rmq_async.protocol.bodies import (
    ConsumeMessageDirectlyResult,
    ConsumerRunningInfo,
    ConsumeStatus,
    GetConsumerStatusBody,
    ProcessQueueInfo,
    ResetOffsetBody,
)
from rmq_async.protocol.codes import RequestCode, ResponseCode
from rmq_async.protocol.command import RemotingCommand
from rmq_async.protocol.errors import ProtocolError
from rmq_async.protocol.headers import (
    ConsumeMessageDirectlyResultRequestHeader,
    GetConsumerRunningInfoRequestHeader,
    GetConsumerStatusRequestHeader,
    ResetOffsetRequestHeader,
)
from rmq_async.protocol.message import decode_message
from rmq_async.protocol.types import PROPERTY_CONSUME_START_TIME, MessageExt, MessageQueue
from rmq_async.remoting.connection import Connection, unsupported_response
from rmq_async.remoting.errors import RemotingError

if TYPE_CHECKING:
    from rmq_async.client.instance import ClientInstance
    from rmq_async.consumer.listener import ListenerAdapter
    from rmq_async.consumer.offset_store import OffsetStore
    from rmq_async.consumer.options import ConsumerOptions
    from rmq_async.consumer.process_queue import ProcessQueue
    from rmq_async.consumer.pull import PullService
    from rmq_async.consumer.rebalance import Rebalancer
    from rmq_async.consumer.stats import ConsumerStats
    from rmq_async.consumer.subscriptions import Subscriptions
    from rmq_async.protocol.bodies import HeartbeatData
    from rmq_async.protocol.filter import SubscriptionData

log = structlog.get_logger(__name__)


#: Seconds after an admin reset's offsets were written that they are written again, once the
#: pulls sent before the reset (whose piggy-backed commits carry the old offsets) are taken.
RESET_SETTLE = 1.0


class ConsumerView(Protocol):
    """What the broker's requests read and do on a consumer (``PushConsumer`` is one)."""

    options: ConsumerOptions
    group: str
    client_id: str
    namesrv: list[str]
    retry_topic: str
    start_timestamp: int
    process_queues: dict[MessageQueue, ProcessQueue]
    stats: ConsumerStats
    instance: ClientInstance
    offset_store: OffsetStore
    pull_service: PullService
    rebalancer: Rebalancer
    subscriptions: Subscriptions

    @property
    def stopping(self) -> bool: ...

    def subscribed_topics(self) -> list[str]: ...

    def subscription_data(self, topic: str) -> SubscriptionData | None: ...

    def listener_for(self, topic: str, msg: MessageExt | None = None,
                     ) -> ListenerAdapter | None: ...

    def is_orderly(self, topic: str) -> bool: ...

    def task_family(self) -> object | None: ...

    def is_paused(self, topic: str) -> bool: ...

    def heartbeat_data(self) -> HeartbeatData: ...

    def _owner_spawn(self, coro: Coroutine[Any, Any, Any], name: str) -> None: ...

__all__ = [
    "CLIENT_VERSION_DESC",
    "PROP_CLIENT_VERSION",
    "PROP_CONSUMER_START_TIMESTAMP",
    "PROP_CONSUME_ORDERLY",
    "PROP_CONSUME_TYPE",
    "PROP_NAMESERVER_ADDR",
    "PROP_THREADPOOL_CORE_SIZE",
    "BrokerRequestHandler",
    "ConsumerView",
    "build_running_info",
    "process_queue_info",
    "raise_if_refused",
]

# Property names of ConsumerRunningInfo that the admin tools read.
PROP_NAMESERVER_ADDR = "PROP_NAMESERVER_ADDR"
PROP_THREADPOOL_CORE_SIZE = "PROP_THREADPOOL_CORE_SIZE"
PROP_CONSUME_ORDERLY = "PROP_CONSUMEORDERLY"
PROP_CONSUME_TYPE = "PROP_CONSUME_TYPE"
PROP_CLIENT_VERSION = "PROP_CLIENT_VERSION"
PROP_CONSUMER_START_TIMESTAMP = "PROP_CONSUMER_START_TIMESTAMP"

#: The protocol version this client speaks (``CURRENT_VERSION`` 479), as Java names it.
CLIENT_VERSION_DESC = "V5_3_3"
CONSUME_TYPE_PUSH = "CONSUME_PASSIVELY"

#: Upper bound of the stack dump sent for ``jstackEnable``.
MAX_STACK_DUMP = 256 * 1024

# Options whose value is not a plain setting (secrets, objects) are left out of running info.
_HIDDEN_OPTIONS = frozenset({"credentials", "ssl_context"})


def _camel(name: str) -> str:
    head, *rest = name.split("_")
    return head + "".join(part[:1].upper() + part[1:] for part in rest)


def option_properties(options: ConsumerOptions) -> dict[str, str]:
    """The options as Java's running info writes a consumer's settings (``object2Properties``
    of the ``DefaultMQPushConsumer``): an option with a Java setting under the Java name, in
    the Java unit (``consumeTimeout`` in minutes, ``pullInterval`` and the other intervals in
    ms, ``consumeTimestamp`` as ``yyyyMMddHHmmss``, ``consume_concurrency`` as both
    ``consumeThreadMin`` and ``consumeThreadMax``); any other under its own name in camelCase,
    in this library's unit (seconds). Credentials and TLS contexts are left out."""
    java: dict[str, list[tuple[str, str]]] = {}
    for java_name, (option, unit) in JAVA_OPTION_NAMES.items():
        java.setdefault(option, []).append((java_name, unit))
    props: dict[str, str] = {}
    for name in type(options).__dataclass_fields__:
        if name in _HIDDEN_OPTIONS:
            continue
        value = getattr(options, name)
        if value is None:
            continue
        for key, unit in java.get(name, [(_camel(name), "")]):
            props[key] = _java_value(value, unit)
    return props


def _java_value(value: Any, unit: str) -> str:
    if unit == "ms":
        return str(round(value * 1000))
    if unit == "minutes":
        minutes = value / 60
        return str(int(minutes)) if minutes == int(minutes) else str(minutes)
    if isinstance(value, datetime):
        local = value.astimezone() if value.tzinfo is not None else value
        return local.strftime("%Y%m%d%H%M%S")
    return _option_value(value)


def _option_value(value: Any) -> str:
    name = getattr(value, "name", None)
    if isinstance(name, str) and hasattr(value, "allocate"):
        return name
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


def process_queue_info(pq: ProcessQueue, commit_offset: int) -> ProcessQueueInfo:
    """Java ``ProcessQueueInfo`` of one process queue."""
    d = pq.to_info(commit_offset)
    return ProcessQueueInfo(
        commit_offset=d["commitOffset"],
        cached_msg_min_offset=d["cachedMsgMinOffset"],
        cached_msg_max_offset=d["cachedMsgMaxOffset"],
        cached_msg_count=d["cachedMsgCount"],
        cached_msg_size_in_mib=d["cachedMsgSizeInMiB"],
        transaction_msg_min_offset=d["transactionMsgMinOffset"],
        transaction_msg_max_offset=d["transactionMsgMaxOffset"],
        transaction_msg_count=d["transactionMsgCount"],
        locked=d["locked"],
        try_unlock_times=d["tryUnlockTimes"],
        last_lock_timestamp=d["lastLockTimestamp"],
        droped=d["droped"],
        last_pull_timestamp=d["lastPullTimestamp"],
        last_consume_timestamp=d["lastConsumeTimestamp"],
    )


def _consume_status(snapshot: dict[str, Any]) -> ConsumeStatus:
    return ConsumeStatus(
        pull_rt=float(snapshot["pullRT"]),
        pull_tps=float(snapshot["pullTPS"]),
        consume_rt=float(snapshot["consumeRT"]),
        consume_ok_tps=float(snapshot["consumeOKTPS"]),
        consume_failed_tps=float(snapshot["consumeFailedTPS"]),
        consume_failed_msgs=int(snapshot["consumeFailedMsgs"]),
    )


def build_running_info(consumer: ConsumerView, *, jstack: bool = False) -> ConsumerRunningInfo:
    """The consumer's ``ConsumerRunningInfo`` as ``mqadmin consumerStatus`` reads it."""
    c = consumer
    import rmq_async

    props = option_properties(c.options)
    if c.options.credentials is not None:
        props["accessKey"] = c.options.credentials.access_key
    props["useTLS"] = "true" if c.options.tls_enabled else "false"
    props["clientId"] = c.client_id
    # Java has one listener kind per consumer; the admin tools expect every queue of an orderly
    # consumer to be locked, so a consumer mixing both kinds reports itself as concurrent.
    own_topics = [t for t in c.subscribed_topics() if t != c.retry_topic]
    orderly = bool(own_topics) and all(c.is_orderly(t) for t in own_topics)
    props[PROP_CONSUME_ORDERLY] = "true" if orderly else "false"
    props[PROP_THREADPOOL_CORE_SIZE] = str(c.options.consume_concurrency)
    props[PROP_CONSUMER_START_TIMESTAMP] = str(c.start_timestamp)
    props[PROP_NAMESERVER_ADDR] = "".join(f"{addr};" for addr in c.namesrv)
    props[PROP_CONSUME_TYPE] = CONSUME_TYPE_PUSH
    props[PROP_CLIENT_VERSION] = CLIENT_VERSION_DESC

    subs = [d for d in (c.subscription_data(t) for t in c.subscribed_topics()) if d is not None]
    mq_table: dict[MessageQueue, ProcessQueueInfo] = {}
    for mq, pq in sorted(c.process_queues.items()):
        mq_table[mq] = process_queue_info(pq, _commit_offset(c, mq, pq))
    status = {
        topic: _consume_status(c.stats.snapshot(topic)) for topic in c.subscribed_topics()
    }
    user_info = {
        "client": f"rmq_async {rmq_async.__version__}",
        "python": sys.version.split()[0],
        "paused": ",".join(sorted(t for t in c.subscribed_topics() if c.is_paused(t))),
    }
    return ConsumerRunningInfo(
        properties=props,
        subscription_set=subs,
        mq_table=mq_table,
        status_table=status,
        user_consumer_info=user_info,
        jstack=_stack_dump() if jstack else None,
    )


def _commit_offset(c: ConsumerView, mq: MessageQueue, pq: ProcessQueue) -> int:
    """The queue's consume offset in memory; for a queue that has nothing cached and no offset
    yet (nothing consumed since it was assigned), the offset its pulls continue from."""
    offset = c.offset_store.read_memory(mq)
    if offset < 0 and pq.msg_count == 0 and c.pull_service is not None:
        req = c.pull_service.requests.get(mq)
        if req is not None:
            offset = req.next_offset
    return offset


def _stack_dump() -> str:
    """Stacks of this process's asyncio tasks and threads (the ``jstack`` of running info)."""
    out = io.StringIO()
    try:
        tasks = sorted(asyncio.all_tasks(), key=lambda t: t.get_name())
    except RuntimeError:
        tasks = []
    for task in tasks:
        task.print_stack(limit=12, file=out)
        if out.tell() > MAX_STACK_DUMP:
            break
    for ident, frame in sys._current_frames().items():
        out.write(f"\nThread {ident} (most recent call last):\n")
        traceback.print_stack(frame, limit=12, file=out)
        if out.tell() > MAX_STACK_DUMP:
            break
    return out.getvalue()[:MAX_STACK_DUMP]


async def raise_if_refused(consumer: ConsumerView, heartbeats: dict[str, bool]) -> None:
    """After the first heartbeats of ``start()``: fail if a broker refuses this client.

    A broker that could not be reached is left to the periodic heartbeat (it may come back),
    but one that answers NO_PERMISSION (ACL: unknown access key, wrong secret, no credentials,
    or no right to the group) would refuse every later request as well, so ``start()`` raises
    :class:`NoPermissionError` at once instead of retrying forever.
    """
    c = consumer
    for addr, ok in heartbeats.items():
        if ok:
            continue
        try:
            await c.instance.api.heartbeat(addr, c.heartbeat_data())
        except NoPermissionError as exc:
            who = (f"access key {c.options.credentials.access_key!r}"
                   if c.options.credentials is not None else "no credentials")
            raise NoPermissionError(
                exc.code,
                f"{exc.remark} (consumer group {c.group!r}, {who}; check the credentials "
                "option and the account's rights on the broker)",
                addr=addr, request="HEART_BEAT",
            ) from exc
        except (MQClientError, RemotingError):
            continue


class BrokerRequestHandler:
    """Answers broker-initiated requests on the consumer's remoting connections."""

    def __init__(self, consumer: ConsumerView) -> None:
        self._consumer = consumer
        self._reset_lock = asyncio.Lock()

    async def __call__(self, cmd: RemotingCommand, conn: Connection) -> RemotingCommand | None:
        c = self._consumer
        code = cmd.code
        try:
            if code == RequestCode.NOTIFY_CONSUMER_IDS_CHANGED:
                log.info("rebalance.notified", group=c.group, broker=conn.addr)
                c.rebalancer.wake()
                return None
            if code == RequestCode.RESET_CONSUMER_CLIENT_OFFSET:
                await self._reset_offset(cmd, conn)
                return None
            if code == RequestCode.GET_CONSUMER_STATUS_FROM_CLIENT:
                return self._consumer_status(cmd)
            if code == RequestCode.GET_CONSUMER_RUNNING_INFO:
                return self._running_info(cmd)
            if code == RequestCode.CONSUME_MESSAGE_DIRECTLY:
                return await self._consume_directly(cmd)
        except ProtocolError as exc:
            log.warning("admin.bad_request", code=code, broker=conn.addr, error=str(exc))
            return cmd.response_to(ResponseCode.SYSTEM_ERROR, remark=f"bad request: {exc}")
        return unsupported_response(cmd)

    def _not_this_group(self, cmd: RemotingCommand, group: str) -> RemotingCommand:
        return cmd.response_to(
            ResponseCode.SYSTEM_ERROR,
            remark=f"The Consumer Group <{group}> not exist in this consumer",
        )

    # ------------------------------------------------------------------ reset offset

    async def _reset_offset(self, cmd: RemotingCommand, conn: Connection) -> None:
        c = self._consumer
        header = ResetOffsetRequestHeader.from_ext_fields(cmd.ext_fields)
        table = ResetOffsetBody.from_json_bytes(cmd.body).offset_table if cmd.body else {}
        log.info("admin.reset_offset", group=header.group, topic=header.topic, broker=conn.addr,
                 timestamp=header.timestamp, queues=len(table))
        if header.group != c.group or c.stopping:
            return
        # The consumer owns the work, not this connection: a connection that closes half way
        # must not leave dropped queues behind.
        c._owner_spawn(self._serial_reset(header.topic, table), "reset-offset")

    async def _serial_reset(self, topic: str, table: dict[MessageQueue, int]) -> None:
        async with self._reset_lock:
            await self.reset_offsets(topic, table)

    async def reset_offsets(self, topic: str, table: dict[MessageQueue, int]) -> None:
        """Move the held queues of ``topic`` listed in ``table`` to their new offsets."""
        c = self._consumer
        # No rebalance round meanwhile: it would take a queue removed here again before its
        # new offset reached the broker.
        async with c.rebalancer.table_lock:
            targets = [(mq, pq) for mq, pq in c.process_queues.items()
                       if mq.topic == topic and mq in table]
            # Drop first, so no result of a batch still with the listener commits anything.
            for _, pq in targets:
                pq.dropped = True
                pq.clear()
            for mq, _ in targets:
                offset = table[mq]
                c.offset_store.freeze(mq, offset)
                # Persists the frozen offset (orderly: after the batch in flight, then unlocks).
                await c.rebalancer.remove_queue(mq, reason="offset_reset")
                log.info("admin.queue_reset", queue=str(mq), offset=offset)
            if targets and c.options.message_model == MessageModel.CLUSTERING:
                await self._write_resets_again(table, [mq for mq, _ in targets])
        if targets:
            c.rebalancer.wake()

    async def _write_resets_again(self, table: dict[MessageQueue, int],
                                  queues: list[MessageQueue]) -> None:
        """Write the reset offsets once more, :data:`RESET_SETTLE` seconds on.

        A PULL_MESSAGE sent just before a queue was dropped carries the old offset for the
        broker to commit, and the broker's pull threads can apply it after the reset's update
        (Java sleeps 10 s before writing reset offsets, for the pulls in flight to be taken).
        By now they have been; a queue whose orderly release waits for its batch is left to
        that release, which persists the reset offset after the batch.
        """
        c = self._consumer
        await asyncio.sleep(RESET_SETTLE)
        for mq in queues:
            if mq in c.process_queues or c.rebalancer.releasing(mq):
                continue
            c.offset_store.freeze(mq, table[mq])
            try:
                await c.offset_store.persist(mq)
            finally:
                c.offset_store.remove(mq)

    # ------------------------------------------------------------------ status / running info

    def _consumer_status(self, cmd: RemotingCommand) -> RemotingCommand:
        c = self._consumer
        header = GetConsumerStatusRequestHeader.from_ext_fields(cmd.ext_fields)
        # As Java's client: another group's status is an empty table (not an error), and a
        # blank topic asks for every topic's offsets.
        offsets = {} if header.group != c.group else {
            mq: off for mq, off in c.offset_store.snapshot().items()
            if not header.topic.strip() or mq.topic == header.topic}
        body = GetConsumerStatusBody(message_queue_table=offsets)
        return cmd.response_to(ResponseCode.SUCCESS, body=body.to_json_bytes())

    def _running_info(self, cmd: RemotingCommand) -> RemotingCommand:
        c = self._consumer
        header = GetConsumerRunningInfoRequestHeader.from_ext_fields(cmd.ext_fields)
        if header.consumer_group != c.group:
            return self._not_this_group(cmd, header.consumer_group)
        info = build_running_info(c, jstack=header.jstack_enable)
        return cmd.response_to(ResponseCode.SUCCESS, body=info.to_json_bytes())

    # ------------------------------------------------------------------ consume directly

    async def _consume_directly(self, cmd: RemotingCommand) -> RemotingCommand:
        c = self._consumer
        header = ConsumeMessageDirectlyResultRequestHeader.from_ext_fields(cmd.ext_fields)
        if header.consumer_group != c.group:
            return self._not_this_group(cmd, header.consumer_group)
        msg = decode_message(cmd.body)
        msg.broker_name = header.broker_name or ""
        reset_retry_topic([msg], c.retry_topic)
        listener = c.listener_for(msg.topic, msg)
        if listener is None:
            return cmd.response_to(
                ResponseCode.SYSTEM_ERROR,
                remark=f"no listener for topic {msg.topic!r} in group {c.group!r}",
            )
        msg.properties[PROPERTY_CONSUME_START_TIME] = str(int(time.time() * 1000))
        mq = MessageQueue(msg.topic, msg.broker_name, msg.queue_id)
        ctx = ConsumeContext(message_queue=mq)
        orderly = c.is_orderly(msg.topic)
        started = time.monotonic()
        # Through the middlewares, as consumption would (one may unwrap or transform it). A
        # user call of the consumer, as a handler's: a stop() it makes (or a task it awaits
        # makes) does not wait for it, nor cancel it with the connection it came on.
        me, family = asyncio.current_task(), c.task_family()
        with (enter_user_call(me, family) if me is not None and family is not None
              else contextlib.nullcontext()):
            outcome = await run_call(listener, [msg], ctx, group=c.group, topic=msg.topic,
                                     queue=mq, orderly=orderly,
                                     middlewares=c.subscriptions.middlewares)
        spent = int((time.monotonic() - started) * 1000)
        dead = outcome.dead_reason or next((reason for _, reason in ctx.dead_letters), None)
        remark: str | None = None
        if outcome.error is not None:
            verdict = DirectConsumeResult.CR_THROW_EXCEPTION
            remark = "".join(traceback.format_exception(outcome.error, limit=8))
        elif dead is not None:
            # Consumption would send it to the dead-letter queue: say so, with the reason.
            verdict = DirectConsumeResult.CR_THROW_EXCEPTION
            remark = f"dead letter: {dead}"
        else:
            verdict = direct_consume_result(outcome.result)
        result = ConsumeMessageDirectlyResult(
            consume_result=str(verdict),
            order=orderly,
            auto_commit=ctx.auto_commit,
            remark=remark,
            spent_time_mills=spent,
        )
        log.info("admin.consumed_directly", msg_id=msg.msg_id, topic=msg.topic,
                 result=result.consume_result, ms=spent)
        return cmd.response_to(ResponseCode.SUCCESS, body=result.to_json_bytes())

"""The broker and name-server API as typed async calls (Java ``MQClientAPIImpl``)."""

from __future__ import annotations

import asyncio
import enum
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from rmq_async.client.errors import NoRouteError, broker_error
from rmq_async.protocol import headers as h
from rmq_async.protocol.bodies import (
    ClusterInfo,
    ConsumerConnection,
    ConsumeStats,
    HeartbeatData,
    TopicRouteData,
    decode_consumer_list,
    decode_lock_batch_response,
    encode_lock_batch_request,
)
from rmq_async.protocol.codes import (
    LanguageCode,
    PullSysFlag,
    RequestCode,
    ResponseCode,
)
from rmq_async.protocol.command import FrameTemplate, RemotingCommand, next_opaque
from rmq_async.protocol.filter import SubscriptionData
from rmq_async.protocol.message import decode_messages
from rmq_async.protocol.types import MessageExt, MessageQueue
from rmq_async.remoting.client import RemotingClient

_OffsetAnswer = h.GetMaxOffsetResponseHeader | h.GetMinOffsetResponseHeader | h.SearchOffsetResponseHeader


class PullStatus(enum.Enum):
    FOUND = "FOUND"
    NO_NEW_MSG = "NO_NEW_MSG"
    NO_MATCHED_MSG = "NO_MATCHED_MSG"
    OFFSET_ILLEGAL = "OFFSET_ILLEGAL"


_PULL_STATUS = {
    ResponseCode.SUCCESS: PullStatus.FOUND,
    ResponseCode.PULL_NOT_FOUND: PullStatus.NO_NEW_MSG,
    ResponseCode.PULL_RETRY_IMMEDIATELY: PullStatus.NO_MATCHED_MSG,
    ResponseCode.PULL_OFFSET_MOVED: PullStatus.OFFSET_ILLEGAL,
}
_PULL_TEMPLATES_MAX = 4096
# Values no real pull carries, marking where a pull template's changing numbers go.
_HOLE_QUEUE_OFFSET = -7777777777777777771
_HOLE_COMMIT_OFFSET = -7777777777777777772
_HOLE_SYS_FLAG = -777777773
_PULL_STATUS_BY_CODE: dict[int, PullStatus] = {int(k): v for k, v in _PULL_STATUS.items()}


@dataclass(slots=True)
class PullResult:
    status: PullStatus
    next_begin_offset: int
    min_offset: int
    max_offset: int
    suggest_which_broker_id: int
    body: bytes
    offset_delta: int | None = None

    def decode(self) -> list[MessageExt]:
        """The stored messages of a FOUND result (empty otherwise)."""
        if not self.body:
            return []
        msgs = decode_messages(self.body)
        if self.offset_delta:
            for m in msgs:
                m.queue_offset += self.offset_delta
        return msgs


@dataclass(slots=True)
class SendResult:
    """What the broker answered to a send (Java ``SendResult``)."""

    msg_id: str
    """The message's ``UNIQ_KEY``, the id the producer gave it, which a consumer sees as
    ``MessageExt.msg_id`` (a batch: the messages' ids, comma-joined). A send made without
    one (``MQClientAPI.send_message`` with no ``msg_id``) has :attr:`offset_msg_id` here."""
    queue_id: int
    queue_offset: int
    """The queue offset of the stored message (a batch: of its first message)."""
    broker_name: str
    status_code: int
    transaction_id: str | None = None
    offset_msg_id: str = ""
    """The broker's id of the stored message: its store host and commit-log offset (a
    batch: one per message, comma-joined)."""


_PULL_NEXT, _PULL_MIN, _PULL_MAX = "nextBeginOffset", "minOffset", "maxOffset"
_PULL_SUGGEST, _PULL_DELTA = "suggestWhichBrokerId", "offsetDelta"


class PendingPull:
    """A PULL_MESSAGE in flight: :meth:`result` waits for the answer, :meth:`cancel` drops it."""

    __slots__ = ("addr", "future", "queue_offset", "sent_at")

    def __init__(self, addr: str, queue_offset: int,
                 future: asyncio.Future[RemotingCommand]) -> None:
        self.addr = addr
        self.queue_offset = queue_offset
        self.future = future
        self.sent_at = time.monotonic()

    def cancel(self) -> None:
        self.future.cancel()

    async def result(self) -> PullResult:
        resp = await self.future
        code = resp.code
        status = _PULL_STATUS_BY_CODE.get(code)
        if status is None:
            raise broker_error(code, resp.remark, addr=self.addr, request="PULL_MESSAGE")
        ext = resp.ext_fields or {}
        try:
            # The four offsets as brokers write them (short plain decimals), read inline; any
            # other shape goes through the typed header, which says what is wrong with it.
            fields = [ext[_PULL_NEXT], ext[_PULL_MIN], ext[_PULL_MAX], ext[_PULL_SUGGEST]]
            delta = ext.get(_PULL_DELTA)
            if delta is not None:
                fields.append(delta)
            text = "".join(fields)
            if not (text.isdigit() and text.isascii()
                    and min(map(len, fields)) > 0 and max(map(len, fields)) < 19):
                raise ValueError
        except (KeyError, ValueError):
            rh = h.PullMessageResponseHeader.from_ext_fields(ext)
            nb, mn, mx, sb, od = (rh.next_begin_offset, rh.min_offset, rh.max_offset,
                                  rh.suggest_which_broker_id, rh.offset_delta)
        else:
            nb, mn, mx, sb = int(fields[0]), int(fields[1]), int(fields[2]), int(fields[3])
            od = None if delta is None else int(delta)
        return PullResult(status, nb, mn, mx, sb,
                          resp.body if code == ResponseCode.SUCCESS else b"", od)


class MQClientAPI:
    """One method per broker / name-server request. Errors become :class:`MQBrokerError`."""

    def __init__(self, remoting: RemotingClient, *, timeout: float = 3.0,
                 language: int = LanguageCode.PYTHON) -> None:
        self._pull_templates: dict[tuple[Any, ...], FrameTemplate | None] = {}
        self.remoting = remoting
        self.timeout = timeout
        self.language = language
        """The LanguageCode a heartbeat carries (Java sets the client's on HEART_BEAT only;
        brokers record it per client and show it in the group's connections)."""

    async def _call(self, addr: str, code: int, ext: dict[str, str] | None, body: bytes = b"",
                    *, timeout: float | None = None, ok: tuple[int, ...] = (ResponseCode.SUCCESS,),
                    name: str = "", resend_on_go_away: bool = True,
                    language: int | None = None) -> RemotingCommand:
        req = RemotingCommand.request(code, ext_fields=ext, body=body)
        if language is not None:
            req.language = language
        resp = await self.remoting.invoke(addr, req, self.timeout if timeout is None else timeout,
                                          resend_on_go_away=resend_on_go_away)
        if resp.code not in ok:
            raise broker_error(resp.code, resp.remark, addr=addr, request=name or str(code))
        return resp

    async def _oneway(self, addr: str, code: int, ext: dict[str, str] | None,
                      body: bytes = b"") -> None:
        req = RemotingCommand.request(code, ext_fields=ext, body=body, oneway=True)
        await self.remoting.invoke_oneway(addr, req)

    # ------------------------------------------------------------------ name server

    async def get_route(self, namesrv: str, topic: str) -> TopicRouteData:
        ext = h.GetRouteInfoRequestHeader(topic=topic).to_ext_fields()
        req = RemotingCommand.request(RequestCode.GET_ROUTEINFO_BY_TOPIC, ext_fields=ext)
        resp = await self.remoting.invoke(namesrv, req, self.timeout)
        if resp.code == ResponseCode.TOPIC_NOT_EXIST:
            raise NoRouteError(topic, resp.remark or "")
        if resp.code != ResponseCode.SUCCESS:
            raise broker_error(resp.code, resp.remark, addr=namesrv, request="GET_ROUTEINFO_BY_TOPIC")
        return TopicRouteData.from_json_bytes(resp.body)

    async def get_cluster_info(self, namesrv: str) -> ClusterInfo:
        resp = await self._call(namesrv, RequestCode.GET_BROKER_CLUSTER_INFO, None,
                                name="GET_BROKER_CLUSTER_INFO")
        return ClusterInfo.from_json_bytes(resp.body)

    # ------------------------------------------------------------------ membership

    async def heartbeat(self, addr: str, data: HeartbeatData, *,
                        resend_on_go_away: bool = True) -> int:
        """Send a heartbeat; returns the broker's version ordinal."""
        resp = await self._call(addr, RequestCode.HEART_BEAT, {}, data.to_json_bytes(),
                                name="HEART_BEAT", resend_on_go_away=resend_on_go_away,
                                language=self.language)
        return resp.version

    async def unregister_client(self, addr: str, client_id: str, producer_group: str | None,
                                consumer_group: str | None) -> None:
        ext = h.UnregisterClientRequestHeader(
            client_id=client_id, producer_group=producer_group, consumer_group=consumer_group
        ).to_ext_fields()
        await self._call(addr, RequestCode.UNREGISTER_CLIENT, ext, name="UNREGISTER_CLIENT")

    async def get_consumer_ids(self, addr: str, group: str) -> list[str]:
        ext = h.GetConsumerListByGroupRequestHeader(consumer_group=group).to_ext_fields()
        resp = await self._call(addr, RequestCode.GET_CONSUMER_LIST_BY_GROUP, ext,
                                name="GET_CONSUMER_LIST_BY_GROUP")
        return decode_consumer_list(resp.body)

    async def get_consume_stats(self, addr: str, group: str,
                                topic: str | None = None) -> ConsumeStats:
        """GET_CONSUME_STATS: the group's offsets on one broker (every topic, or ``topic``)."""
        ext = {"consumerGroup": group}
        if topic is not None:
            ext["topic"] = topic
        resp = await self._call(addr, RequestCode.GET_CONSUME_STATS, ext, name="GET_CONSUME_STATS")
        return ConsumeStats.from_json_bytes(resp.body or b"{}")

    async def get_consumer_connection_list(self, addr: str, group: str) -> ConsumerConnection:
        """GET_CONSUMER_CONNECTION_LIST: the group's clients connected to one broker; a group
        with none is the broker's CONSUMER_NOT_ONLINE error."""
        resp = await self._call(addr, RequestCode.GET_CONSUMER_CONNECTION_LIST,
                                {"consumerGroup": group}, name="GET_CONSUMER_CONNECTION_LIST")
        return ConsumerConnection.from_json_bytes(resp.body or b"{}")

    # ------------------------------------------------------------------ offsets

    async def query_consumer_offset(self, addr: str, group: str, mq: MessageQueue) -> int:
        ext = h.QueryConsumerOffsetRequestHeader(
            consumer_group=group, topic=mq.topic, queue_id=mq.queue_id, bname=mq.broker_name
        ).to_ext_fields()
        resp = await self._call(addr, RequestCode.QUERY_CONSUMER_OFFSET, ext,
                                name="QUERY_CONSUMER_OFFSET")
        return h.QueryConsumerOffsetResponseHeader.from_ext_fields(resp.ext_fields or {}).offset

    async def update_consumer_offset(self, addr: str, group: str, mq: MessageQueue, offset: int,
                                     *, oneway: bool = True) -> None:
        ext = h.UpdateConsumerOffsetRequestHeader(
            consumer_group=group, topic=mq.topic, queue_id=mq.queue_id, commit_offset=offset,
            bname=mq.broker_name,
        ).to_ext_fields()
        if oneway:
            await self._oneway(addr, RequestCode.UPDATE_CONSUMER_OFFSET, ext)
        else:
            await self._call(addr, RequestCode.UPDATE_CONSUMER_OFFSET, ext,
                             name="UPDATE_CONSUMER_OFFSET")

    async def _offset_call(self, addr: str, code: RequestCode, header: h.CommandHeader,
                           answer: type[_OffsetAnswer]) -> int:
        resp = await self._call(addr, code, header.to_ext_fields(), name=code.name)
        return answer.from_ext_fields(resp.ext_fields or {}).offset

    async def get_max_offset(self, addr: str, mq: MessageQueue) -> int:
        """The queue's exclusive max offset (where the next message will be written)."""
        header = h.GetMaxOffsetRequestHeader(topic=mq.topic, queue_id=mq.queue_id,
                                             bname=mq.broker_name)
        return await self._offset_call(addr, RequestCode.GET_MAX_OFFSET, header,
                                       h.GetMaxOffsetResponseHeader)

    async def get_min_offset(self, addr: str, mq: MessageQueue) -> int:
        header = h.GetMinOffsetRequestHeader(topic=mq.topic, queue_id=mq.queue_id,
                                             bname=mq.broker_name)
        return await self._offset_call(addr, RequestCode.GET_MIN_OFFSET, header,
                                       h.GetMinOffsetResponseHeader)

    async def search_offset(self, addr: str, mq: MessageQueue, timestamp_ms: int) -> int:
        """The offset of the first message stored at or after ``timestamp_ms``."""
        header = h.SearchOffsetRequestHeader(topic=mq.topic, queue_id=mq.queue_id,
                                             timestamp=timestamp_ms, bname=mq.broker_name)
        return await self._offset_call(addr, RequestCode.SEARCH_OFFSET_BY_TIMESTAMP, header,
                                       h.SearchOffsetResponseHeader)

    # ------------------------------------------------------------------ pull

    async def pull_message(
        self,
        addr: str,
        *,
        group: str,
        mq: MessageQueue,
        queue_offset: int,
        max_msg_nums: int = 32,
        commit_offset: int = -1,
        suspend_timeout: float = 15.0,
        timeout: float = 30.0,
        subscription: SubscriptionData | str | None = None,
        sub_version: int = 0,
        expression_type: str = "TAG",
    ) -> PullResult:
        """PULL_MESSAGE with long polling (``suspend_timeout`` > 0) and offset piggy-back.

        ``subscription`` (an expression or SubscriptionData) is sent with the SUBSCRIPTION flag,
        so the broker does not need a heartbeat-registered subscription.
        """
        pending = await self.start_pull(
            addr, group=group, mq=mq, queue_offset=queue_offset, max_msg_nums=max_msg_nums,
            commit_offset=commit_offset, suspend_timeout=suspend_timeout, timeout=timeout,
            subscription=subscription, sub_version=sub_version, expression_type=expression_type)
        return await pending.result()

    async def start_pull(
        self,
        addr: str,
        *,
        group: str,
        mq: MessageQueue,
        queue_offset: int,
        max_msg_nums: int = 32,
        commit_offset: int = -1,
        suspend_timeout: float = 15.0,
        timeout: float = 30.0,
        subscription: SubscriptionData | str | None = None,
        sub_version: int = 0,
        expression_type: str = "TAG",
    ) -> PendingPull:
        """Send a PULL_MESSAGE (as :meth:`pull_message`) and return it in flight."""
        sys_flag = 0
        if commit_offset > 0:
            sys_flag |= PullSysFlag.FLAG_COMMIT_OFFSET
        if suspend_timeout > 0:
            sys_flag |= PullSysFlag.FLAG_SUSPEND
        expression: str | None = None
        if subscription is not None:
            sys_flag |= PullSysFlag.FLAG_SUBSCRIPTION
            if isinstance(subscription, SubscriptionData):
                expression = subscription.sub_string
                expression_type = subscription.expression_type
                sub_version = subscription.sub_version
            else:
                expression = subscription
        suspend_ms = int(suspend_timeout * 1000)
        commit = max(commit_offset, 0)

        def header(queue_offset: Any, sys_flag: Any, commit: Any) -> h.PullMessageRequestHeader:
            return h.PullMessageRequestHeader(
                consumer_group=group,
                topic=mq.topic,
                queue_id=mq.queue_id,
                queue_offset=queue_offset,
                max_msg_nums=max_msg_nums,
                sys_flag=sys_flag,
                commit_offset=commit,
                suspend_timeout_millis=suspend_ms,
                subscription=expression,
                sub_version=sub_version,
                expression_type=expression_type,
                bname=mq.broker_name,
            )

        def make_cmd() -> RemotingCommand:
            return RemotingCommand.request(
                RequestCode.PULL_MESSAGE,
                ext_fields=header(queue_offset, sys_flag, commit).to_ext_fields())

        # The same pull goes out again and again with a new offset: its frame is encoded once
        # per queue and subscription, and only the changing numbers are written per pull.
        key = (mq, group, max_msg_nums, suspend_ms, expression, sub_version, expression_type)
        template = self._pull_templates.get(key)
        if template is None and key not in self._pull_templates:
            if len(self._pull_templates) >= _PULL_TEMPLATES_MAX:
                self._pull_templates.clear()
            template = self._pull_templates[key] = FrameTemplate.build(
                RemotingCommand.request(RequestCode.PULL_MESSAGE, ext_fields=header(
                    _HOLE_QUEUE_OFFSET, _HOLE_SYS_FLAG, _HOLE_COMMIT_OFFSET).to_ext_fields()),
                {"queue_offset": str(_HOLE_QUEUE_OFFSET), "sys_flag": str(_HOLE_SYS_FLAG),
                 "commit_offset": str(_HOLE_COMMIT_OFFSET)})
        frame = None
        if template is not None:
            opaque = next_opaque()
            frame = (opaque, template.render(opaque, {
                "queue_offset": queue_offset, "sys_flag": sys_flag, "commit_offset": commit}))
        future = await self.remoting.start_invoke(addr, make_cmd, timeout, frame=frame)
        return PendingPull(addr, queue_offset, future)


    # ------------------------------------------------------------------ failures, locks

    async def consumer_send_msg_back(self, addr: str, msg: MessageExt, group: str,
                                     delay_level: int, max_reconsume_times: int) -> None:
        ext = h.ConsumerSendMsgBackRequestHeader(
            offset=msg.commit_log_offset,
            group=group,
            delay_level=delay_level,
            origin_msg_id=msg.msg_id,
            origin_topic=msg.topic,
            unit_mode=False,
            max_reconsume_times=max_reconsume_times,
            bname=msg.broker_name or None,
        ).to_ext_fields()
        await self._call(addr, RequestCode.CONSUMER_SEND_MSG_BACK, ext, timeout=5.0,
                         name="CONSUMER_SEND_MSG_BACK")

    async def lock_batch_mq(self, addr: str, group: str, client_id: str,
                            mqs: list[MessageQueue], *, timeout: float = 1.0) -> set[MessageQueue]:
        body = encode_lock_batch_request(group, client_id, mqs)
        resp = await self._call(addr, RequestCode.LOCK_BATCH_MQ, {}, body, timeout=timeout,
                                name="LOCK_BATCH_MQ")
        return set(decode_lock_batch_response(resp.body))

    async def unlock_batch_mq(self, addr: str, group: str, client_id: str,
                              mqs: list[MessageQueue], *, oneway: bool = False) -> None:
        body = encode_lock_batch_request(group, client_id, mqs)
        if oneway:
            await self._oneway(addr, RequestCode.UNLOCK_BATCH_MQ, {}, body)
        else:
            await self._call(addr, RequestCode.UNLOCK_BATCH_MQ, {}, body, timeout=1.0,
                             name="UNLOCK_BATCH_MQ")

    # ------------------------------------------------------------------ send

    async def send_message(self, addr: str, mq: MessageQueue, *, producer_group: str, body: bytes,
                           properties: str, sys_flag: int = 0, flag: int = 0, batch: bool = False,
                           born_timestamp: int | None = None, reconsume_times: int | None = None,
                           max_reconsume_times: int | None = None,
                           default_topic: str = "TBW102", default_topic_queue_nums: int = 4,
                           timeout: float = 3.0, msg_id: str | None = None) -> SendResult:
        """SEND_MESSAGE_V2 or SEND_BATCH_MESSAGE. ``msg_id`` is the ``UNIQ_KEY`` the message
        carries in ``properties`` (a batch's, comma-joined), returned as
        :attr:`SendResult.msg_id`."""
        import time as _time

        header = h.SendMessageRequestHeaderV2(
            producer_group=producer_group,
            topic=mq.topic,
            default_topic=default_topic,
            default_topic_queue_nums=default_topic_queue_nums,
            queue_id=mq.queue_id,
            sys_flag=sys_flag,
            born_timestamp=born_timestamp if born_timestamp is not None else int(_time.time() * 1000),
            flag=flag,
            properties=properties or None,
            reconsume_times=reconsume_times if reconsume_times is not None else 0,
            unit_mode=False,
            max_reconsume_times=max_reconsume_times,
            batch=batch,
            bname=mq.broker_name,
        )
        code = RequestCode.SEND_BATCH_MESSAGE if batch else RequestCode.SEND_MESSAGE_V2
        resp = await self._call(
            addr, code, header.to_ext_fields(), body, timeout=timeout,
            ok=(ResponseCode.SUCCESS, ResponseCode.FLUSH_DISK_TIMEOUT,
                ResponseCode.FLUSH_SLAVE_TIMEOUT, ResponseCode.SLAVE_NOT_AVAILABLE),
            name="SEND_BATCH_MESSAGE" if batch else "SEND_MESSAGE_V2",
        )
        rh = h.SendMessageResponseHeader.from_ext_fields(resp.ext_fields or {})
        return SendResult(
            msg_id=rh.msg_id if msg_id is None else msg_id,
            queue_id=rh.queue_id,
            queue_offset=rh.queue_offset,
            broker_name=mq.broker_name,
            status_code=resp.code,
            transaction_id=rh.transaction_id,
            offset_msg_id=rh.msg_id,
        )

    # ------------------------------------------------------------------ admin

    async def get_broker_config(self, addr: str, *, timeout: float = 10.0) -> dict[str, str]:
        """GET_BROKER_CONFIG: the running broker's settings (its ``key=value`` lines)."""
        resp = await self._call(addr, RequestCode.GET_BROKER_CONFIG, None, timeout=timeout,
                                name="GET_BROKER_CONFIG")
        lines = (resp.body or b"").decode().splitlines()
        return dict(line.split("=", 1) for line in lines if "=" in line)

    async def update_broker_config(self, addr: str, values: Mapping[str, str], *,
                                   timeout: float = 10.0) -> None:
        """UPDATE_BROKER_CONFIG: change settings of the running broker (those it allows)."""
        body = "".join(f"{k}={v}\n" for k, v in values.items()).encode()
        await self._call(addr, RequestCode.UPDATE_BROKER_CONFIG, None, body, timeout=timeout,
                         name="UPDATE_BROKER_CONFIG")

    async def create_topic(self, addr: str, topic: str, *, read_queues: int = 8,
                           write_queues: int = 8, perm: int = 6, order: bool = False,
                           timeout: float = 10.0) -> None:
        ext = h.CreateTopicRequestHeader(
            topic=topic, default_topic="TBW102", read_queue_nums=read_queues,
            write_queue_nums=write_queues, perm=perm, topic_filter_type="SINGLE_TAG",
            topic_sys_flag=0, order=order,
        ).to_ext_fields()
        await self._call(addr, RequestCode.UPDATE_AND_CREATE_TOPIC, ext, timeout=timeout,
                         name="UPDATE_AND_CREATE_TOPIC")

"""``rmq-async lag GROUP``: per queue broker offset, committed offset and their difference.

The figures are the brokers' own (GET_CONSUME_STATS, what ``mqadmin consumerProgress`` shows),
gathered as Java's ``DefaultMQAdminExtImpl.examineConsumeStats`` does: the brokers are found
through the route of the group's retry topic (with ``--topic``, else the topic's own route, else
its pop retry topic's), each broker group is asked through its master, or a slave while the
master is down (``BrokerData.selectBrokerAddr``), and the rows are printed sorted by topic,
broker and queue, with the total difference last. No route is an error (exit status 1), as in
``mqadmin``; so is an answer without a queue, unless a client of the group is online and
consumes in clustering mode (it has committed no offset yet): then the table is empty.
"""

from __future__ import annotations

import json
import os
import uuid
from dataclasses import dataclass
from datetime import UTC, datetime

from rmq_async.cli.common import CliError, CommandFailed
from rmq_async.client.errors import MQBrokerError, NoRouteError
from rmq_async.client.instance import ClientInstance
from rmq_async.consumer.options import check_group_name, check_topic_name, default_client_ip
from rmq_async.consumer.subscriptions import RETRY_GROUP_TOPIC_PREFIX
from rmq_async.errors import InvalidArgumentError
from rmq_async.protocol.bodies import TopicRouteData

__all__ = ["QueueLag", "format_lag", "group_lag", "route_topics"]


@dataclass(frozen=True, slots=True)
class QueueLag:
    """One queue's progress for a group."""

    topic: str
    broker: str
    queue_id: int
    broker_offset: int
    consumer_offset: int
    last_timestamp: int

    @property
    def diff(self) -> int:
        """Messages stored but not yet consumed by the group."""
        return self.broker_offset - self.consumer_offset


def route_topics(group: str, topic: str | None = None) -> list[str]:
    """The topics whose routes locate ``group``'s brokers, in the order tried (Java
    ``examineConsumeStats``): its retry topic, then with ``topic`` that topic and its pop
    retry topic (``%RETRY%<group>_<topic>``)."""
    topics = [RETRY_GROUP_TOPIC_PREFIX + group]
    if topic:
        topics += [topic, f"{RETRY_GROUP_TOPIC_PREFIX}{group}_{topic}"]
    return topics


async def group_lag(namesrv: str, group: str, topic: str | None = None,
                    *, timeout: float = 5.0) -> list[QueueLag]:
    """Every queue's progress for ``group`` (only ``topic``'s when given), from the brokers.

    Raises :class:`~rmq_async.cli.common.CliError` for a name server address that is not
    ``host:port`` (before any network I/O) and
    :class:`~rmq_async.cli.common.CommandFailed` when no route leads to the group's brokers,
    or they report no queue for it and no client of the group is online (or it broadcasts).
    An online clustering group that has committed nothing yet has no rows.
    """
    cid = f"{default_client_ip()}@rmq-async-lag-{os.getpid()}-{uuid.uuid4().hex[:6]}"
    try:
        check_group_name(group, option="group", reserved="")
        if topic is not None:
            check_topic_name(topic)
        instance = ClientInstance(namesrv, cid, api_timeout=timeout)
    except InvalidArgumentError as exc:
        raise CliError(str(exc)) from exc
    try:
        route: TopicRouteData | None = None
        missing: list[str] = []
        for name in route_topics(group, topic):
            try:
                route = await instance.update_route(name)
                break
            except NoRouteError:
                missing.append(name)
        if route is None:
            raise CommandFailed(f"group {group!r} has no consumption progress on this cluster "
                                f"(no route for {' nor '.join(map(repr, missing))})")
        rows: list[QueueLag] = []
        for bd in route.broker_datas:
            addr = bd.select_broker_addr()  # the master, else a slave (the master is down)
            if addr is None:
                continue
            stats = await instance.api.get_consume_stats(addr, group, topic)
            for mq, w in stats.offset_table.items():
                rows.append(QueueLag(mq.topic, mq.broker_name, mq.queue_id, w.broker_offset,
                                     w.consumer_offset, w.last_timestamp))
        if not rows:
            # As Java's examineConsumeStats: an empty table is an answer only for a group
            # consuming in clustering mode with a client online (it has committed nothing yet).
            where = f"no consume stats for group {group!r}" + (
                f" on topic {topic!r}" if topic else "")
            model = await _online_message_model(instance, route, group)
            if model is None:
                raise CommandFailed(f"{where}: the brokers' offset table is empty and no "
                                    "consumer of the group is online")
            if model == "BROADCASTING":
                raise CommandFailed(f"{where}: the group consumes in broadcasting mode, whose "
                                    "offsets stay with the clients")
        return sorted(rows, key=lambda r: (r.topic, r.broker, r.queue_id))
    finally:
        await instance.close()


async def _online_message_model(instance: ClientInstance, route: TopicRouteData,
                                group: str) -> str | None:
    """The message model of the group's online clients, as a broker of ``route`` reports them
    (GET_CONSUMER_CONNECTION_LIST); None when no broker knows a client of the group."""
    for bd in route.broker_datas:
        addr = bd.select_broker_addr()
        if addr is None:
            continue
        try:
            connection = await instance.api.get_consumer_connection_list(addr, group)
        except MQBrokerError:  # CONSUMER_NOT_ONLINE: none of the group's clients here
            continue
        if connection.client_ids:
            return connection.message_model
    return None


def format_lag(rows: list[QueueLag], *, as_json: bool = False) -> str:
    """The table (or JSON document) ``rmq-async lag`` prints."""
    total = sum(r.diff for r in rows)
    if as_json:
        return json.dumps({
            "queues": [{"topic": r.topic, "broker": r.broker, "queue_id": r.queue_id,
                        "broker_offset": r.broker_offset, "consumer_offset": r.consumer_offset,
                        "diff": r.diff, "last_timestamp": r.last_timestamp} for r in rows],
            "total_diff": total,
        }, indent=2)
    header = ("TOPIC", "BROKER", "QUEUE", "BROKER_OFFSET", "CONSUMER_OFFSET", "DIFF",
              "LAST_CONSUMED_UTC")
    table = [header] + [
        (r.topic, r.broker, str(r.queue_id), str(r.broker_offset), str(r.consumer_offset),
         str(r.diff), _when(r.last_timestamp)) for r in rows
    ]
    widths = [max(len(row[i]) for row in table) for i in range(len(header))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip()
             for row in table]
    lines.append(f"TOTAL DIFF: {total}")
    return "\n".join(lines)


def _when(ms: int) -> str:
    if ms <= 0:
        return "-"
    return datetime.fromtimestamp(ms / 1000, UTC).strftime("%Y-%m-%d %H:%M:%S")

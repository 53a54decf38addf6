"""The client instance: routes, broker addresses, heartbeats and route refresh for one client id."""

from __future__ import annotations

import asyncio
import contextlib
import random
import ssl as _ssl
import time
from collections.abc import Callable, Collection
from dataclasses import dataclass, field
from typing import Any

import structlog

from rmq_async.client.api import MQClientAPI
from rmq_async.client.errors import (
    MQClientError,
    NameServerUnavailable,
    NoPermissionError,
    NoRouteError,
)
from rmq_async.errors import InvalidArgumentError
from rmq_async.protocol.bodies import (
    HeartbeatData,
    TopicRouteData,
    consumer_queues,
    producer_queues,
)
from rmq_async.protocol.codes import LanguageCode
from rmq_async.protocol.errors import ProtocolError
from rmq_async.protocol.types import MessageQueue
from rmq_async.remoting.client import RemotingClient
from rmq_async.remoting.connection import Connection, RequestHandler, RpcHook
from rmq_async.remoting.errors import RemotingError, TlsVerificationError

log = structlog.get_logger(__name__)

MASTER_ID = 0


@dataclass(slots=True)
class _BrokerAddrs:
    cluster: str
    addrs: dict[int, str] = field(default_factory=dict)

    def master(self) -> str | None:
        return self.addrs.get(MASTER_ID)

    def any(self) -> str | None:
        master = self.master()
        if master is not None:
            return master
        return next(iter(self.addrs.values()), None)


class _AnnouncingRemoting(RemotingClient):
    """A :class:`RemotingClient` that calls ``on_connect(addr)`` once per new connection
    (Java's ``ChannelEventListener.onChannelActive``)."""

    def __init__(self, *, on_connect: Callable[[str], None], **kwargs: object) -> None:
        super().__init__(**kwargs)  # type: ignore[arg-type]
        self._on_connect = on_connect

    def _connection_made(self, addr: str, conn: Connection) -> None:
        # Where the connection is made, not in a caller of connection(): every caller may
        # have stopped waiting (a timeout, a cancelled pull) when it is.
        self._on_connect(addr)


class ClientInstance:
    """Shared client state of one client id (Java ``MQClientInstance``, minus consumer logic).

    It owns the :class:`RemotingClient`, knows every topic route it was asked about and every
    broker address found in them (forgetting an address once no held route lists it), and runs
    two periodic tasks when started: route refresh and heartbeat. What a heartbeat carries
    comes from ``heartbeat_source``, a callable the owner (a consumer or producer) provides;
    the instance itself knows nothing about consumers. ``route_topics``, when given, names the
    topics whose routes the owner still uses (a consumer's subscriptions): the refresh keeps
    only theirs, and forgets a route nobody uses any more (Java refreshes the subscribed
    topics only); without it every route fetched is kept and refreshed (a producer's, as
    Java's publish table).
    """

    def __init__(
        self,
        namesrv: str | list[str],
        client_id: str,
        *,
        heartbeat_source: Callable[[], HeartbeatData] | None = None,
        route_topics: Callable[[], Collection[str]] | None = None,
        request_handler: RequestHandler | None = None,
        rpc_hook: RpcHook | None = None,
        ssl: _ssl.SSLContext | None = None,
        api_timeout: float = 3.0,
        connect_timeout: float = 3.0,
        language: int = LanguageCode.PYTHON,
    ) -> None:
        self.namesrv_addrs = parse_namesrv(namesrv)
        self.client_id = client_id
        self.heartbeat_source = heartbeat_source
        self.route_topics = route_topics
        self.remoting: RemotingClient = _AnnouncingRemoting(
            connect_timeout=connect_timeout, ssl=ssl, rpc_hook=rpc_hook,
            request_handler=request_handler, on_connect=self._connected,
        )
        self._connect_heartbeats: set[asyncio.Task[None]] = set()
        self.api = MQClientAPI(self.remoting, timeout=api_timeout, language=language)
        self.routes: dict[str, TopicRouteData] = {}
        self.brokers: dict[str, _BrokerAddrs] = {}
        self.broker_versions: dict[str, int] = {}
        self._namesrv_index = random.randrange(len(self.namesrv_addrs))
        self._route_locks: dict[str, asyncio.Lock] = {}
        self._heartbeat_lock = asyncio.Lock()
        self._leaving = False  # unregister() under way: no heartbeat on a new connection
        #: Did at least one broker answer the last heartbeat round (or a heartbeat sent on a
        #: new connection since)? ``None`` before the first round.
        self.brokers_reachable: bool | None = None
        #: ``time.monotonic()`` of the last heartbeat a broker answered.
        self.last_heartbeat_ok: float | None = None

    # ------------------------------------------------------------------ name server

    async def fetch_route(self, topic: str) -> TopicRouteData:
        """Ask the name servers for ``topic``'s route, failing over from one to the next.

        Raises :class:`NameServerUnavailable` when none answered, and the refusal itself
        (:class:`TlsVerificationError`, :class:`NoPermissionError`) when every one refused
        this client the same way: a configuration problem, not an outage."""
        errors: list[str] = []
        refused: list[TlsVerificationError] = []
        denied: list[NoPermissionError] = []
        n = len(self.namesrv_addrs)
        for attempt in range(n):
            addr = self.namesrv_addrs[(self._namesrv_index + attempt) % n]
            try:
                route = await self.api.get_route(addr, topic)
            except NoRouteError:
                raise
            except (RemotingError, MQClientError, ProtocolError) as exc:
                # ProtocolError: an answer this name server garbled; the next may be sound.
                if isinstance(exc, TlsVerificationError):
                    refused.append(exc)
                elif isinstance(exc, NoPermissionError):
                    denied.append(exc)
                errors.append(f"{addr}: {exc}")
                log.warning("namesrv.request_failed", namesrv=addr, topic=topic, error=str(exc))
                continue
            self._namesrv_index = (self._namesrv_index + attempt) % n
            return route
        # Move on so the next call starts with another name server.
        self._namesrv_index = (self._namesrv_index + 1) % n
        if len(refused) == n:
            # A configuration problem, not an outage: say so with its own type.
            raise refused[0]
        if len(denied) == n:
            # Every name server answered, refusing these credentials: not an outage either.
            raise denied[0]
        raise NameServerUnavailable(f"no name server answered for topic {topic!r}: "
                                    + "; ".join(errors))

    async def update_route(self, topic: str) -> TopicRouteData:
        lock = self._route_locks.setdefault(topic, asyncio.Lock())
        async with lock:
            route = await self.fetch_route(topic)
            old = self.routes.get(topic)
            self.routes[topic] = route
            for bd in route.broker_datas:
                entry = self.brokers.setdefault(bd.broker_name, _BrokerAddrs(bd.cluster))
                entry.addrs = dict(bd.broker_addrs)
            if old is None or old != route:
                log.info("route.updated", topic=topic,
                         queues=len(consumer_queues(route, topic)),
                         brokers=[bd.broker_name for bd in route.broker_datas])
            # Synchronous, right after the assignments above: the sweep sees this route and
            # every other held one as they are.
            self._forget_offline_brokers()
            return route

    def _forget_offline_brokers(self) -> None:
        """Drop every broker address that no held topic route lists any more, and every broker
        name left without an address (Java ``cleanOfflineBroker``).

        ``self.brokers[name].addrs`` holds what the route last written for ``name`` said, and
        routes of several topics may name the same broker with different replicas; so an
        address stays while any held route lists it under that broker name, whichever route
        wrote the entry. (Java keeps an address listed under any name; a name that a route
        now gives another broker's address is dropped here.) Versions learned from
        heartbeats go with their addresses.
        """
        listed: dict[str, set[str]] = {}
        for route in self.routes.values():
            for bd in route.broker_datas:
                listed.setdefault(bd.broker_name, set()).update(bd.broker_addrs.values())
        for name, entry in list(self.brokers.items()):
            still = listed.get(name, set())
            for broker_id, addr in list(entry.addrs.items()):
                if addr not in still:
                    del entry.addrs[broker_id]
                    log.info("broker.offline_removed", broker=name, broker_id=broker_id,
                             addr=addr)
            if not entry.addrs:
                del self.brokers[name]
                log.info("broker.offline_name_removed", broker=name)
        known = self._known_addrs()
        for addr in [a for a in self.broker_versions if a not in known]:
            del self.broker_versions[addr]

    async def route(self, topic: str) -> TopicRouteData:
        route = self.routes.get(topic)
        if route is None:
            route = await self.update_route(topic)
        return route

    async def subscribe_queues(self, topic: str) -> list[MessageQueue]:
        return consumer_queues(await self.route(topic), topic)

    async def publish_queues(self, topic: str) -> list[MessageQueue]:
        return producer_queues(await self.route(topic), topic)

    async def find_broker_master(self, broker_name: str, topic: str | None = None) -> str:
        entry = self.brokers.get(broker_name)
        addr = entry.master() if entry else None
        if addr is None and topic is not None:
            await self.update_route(topic)
            entry = self.brokers.get(broker_name)
            addr = entry.master() if entry else None
        if addr is None:
            raise MQClientError(f"no master address known for broker {broker_name!r}")
        return addr

    def _find_in_subscribe(self, broker_name: str, broker_id: int,
                           only_this_broker: bool) -> tuple[str, int] | None:
        entry = self.brokers.get(broker_name)
        if entry is None or not entry.addrs:
            return None
        addr = entry.addrs.get(broker_id)
        if addr is not None:
            return addr, broker_id
        if broker_id != MASTER_ID and (nxt := entry.addrs.get(broker_id + 1)) is not None:
            return nxt, broker_id + 1
        if only_this_broker:
            return None
        # Java iterates a HashMap of small Long keys, i.e. by ascending broker id: the master
        # first when it is there, else the lowest slave.
        first = min(entry.addrs)
        return entry.addrs[first], first

    async def find_broker_in_subscribe(self, broker_name: str, broker_id: int, *,
                                       only_this_broker: bool = False,
                                       topic: str | None = None) -> tuple[str, int]:
        """``(address, broker id)`` of the replica of ``broker_name`` to read from (Java
        ``findBrokerAddressInSubscribe``): ``broker_id`` when the route has it, else for a slave
        id the next one, else (unless ``only_this_broker``) any replica, the master first.
        The route of ``topic`` is fetched again once when nothing matches."""
        found = self._find_in_subscribe(broker_name, broker_id, only_this_broker)
        if found is None and topic is not None:
            await self.update_route(topic)
            found = self._find_in_subscribe(broker_name, broker_id, only_this_broker)
        if found is None:
            raise MQClientError(f"the broker {broker_name!r} (id {broker_id}) is not in the "
                                "route")
        return found

    async def find_any_broker(self, topic: str) -> str:
        route = await self.route(topic)
        candidates = [bd for bd in route.broker_datas if bd.broker_addrs]
        if not candidates:
            raise NoRouteError(topic, "route has no broker address")
        bd = random.choice(candidates)
        return bd.broker_addrs.get(MASTER_ID) or next(iter(bd.broker_addrs.values()))

    def all_broker_addrs(self) -> list[str]:
        return sorted(self._known_addrs())

    def _known_addrs(self) -> set[str]:
        return {addr for entry in self.brokers.values() for addr in entry.addrs.values()}

    async def ensure_topic(self, topic: str, queues: int, *, timeout: float = 30.0) -> None:
        """Create ``topic`` on every master broker of the cluster unless it already has a route,
        then wait until the name servers serve its route."""
        try:
            await self.update_route(topic)
            return
        except NoRouteError:
            pass
        cluster = await self.api.get_cluster_info(self.namesrv_addrs[self._namesrv_index])
        for broker in cluster.broker_addr_table.values():
            addr = broker.master_addr
            if addr is not None:
                await self.api.create_topic(addr, topic, read_queues=queues, write_queues=queues)
        try:
            # The broker registers the route with the name server.
            async with asyncio.timeout(timeout):
                while True:
                    try:
                        await self.update_route(topic)
                        return
                    except NoRouteError:
                        await asyncio.sleep(0.2)
        except TimeoutError:
            raise MQClientError(f"topic {topic!r} was created but the name servers served no "
                                f"route for it within {timeout:g} s") from None

    # ------------------------------------------------------------------ periodic work

    async def refresh_routes(self) -> None:
        topics = list(self.routes)
        if self.route_topics is not None:
            used = set(self.route_topics())
            unused = [topic for topic in topics if topic not in used]
            if unused:
                # An unsubscribed topic, or one looked up for a single send (a dead letter's):
                # not fetched every round for good, and its brokers are not kept for it.
                for topic in unused:
                    del self.routes[topic]
                    lock = self._route_locks.get(topic)
                    if lock is not None and not lock.locked():
                        del self._route_locks[topic]
                log.info("route.unused_forgotten", topics=unused)
                self._forget_offline_brokers()
                topics = [topic for topic in topics if topic in used]
        for topic in topics:
            try:
                await self.update_route(topic)
            except (MQClientError, RemotingError, ProtocolError) as exc:
                log.warning("route.refresh_failed", topic=topic, error=str(exc))

    async def send_heartbeats(self) -> dict[str, bool]:
        """Send a heartbeat to every known broker address; return which ones succeeded."""
        if self.heartbeat_source is None:
            return {}
        async with self._heartbeat_lock:
            data = self.heartbeat_source()
            addrs = self._heartbeat_addrs(data)
            if not addrs and not data.consumer_data_set:
                return {}  # a producer that knows no broker yet (before its first send)
            results = await asyncio.gather(
                *(self.api.heartbeat(addr, data) for addr in addrs), return_exceptions=True
            )
        status: dict[str, bool] = {}
        known = self._known_addrs()  # a route update during the round may have dropped some
        for addr, res in zip(addrs, results, strict=True):
            if isinstance(res, BaseException):
                status[addr] = False
                log.warning("heartbeat.failed", broker=addr, error=str(res))
            else:
                status[addr] = True
                if addr in known:
                    self.broker_versions[addr] = res
        self._heartbeat_round_done(status)
        return status

    def _heartbeat_addrs(self, data: HeartbeatData) -> list[str]:
        """Where a heartbeat goes: every known broker, or only the masters when it carries no
        consumer (Java ``sendHeartbeatToAllBroker``: a producer writes to masters only)."""
        if data.consumer_data_set:
            return self.all_broker_addrs()
        return sorted({a for entry in self.brokers.values()
                       if (a := entry.master()) is not None})

    def _heartbeat_round_done(self, status: dict[str, bool]) -> None:
        reachable = any(status.values())
        if reachable:
            self.last_heartbeat_ok = time.monotonic()
        if reachable != self.brokers_reachable:
            if reachable:
                log.info("heartbeat.brokers_reachable", brokers=sorted(a for a, ok in status.items()
                                                                        if ok))
            else:
                log.warning("heartbeat.no_broker_reachable", brokers=sorted(status))
        self.brokers_reachable = reachable

    def _connected(self, addr: str) -> None:
        """A new connection to a broker: send it a heartbeat right away, as Java's client does
        (``enableHeartbeatChannelEventListener``). A broker forgets a client whose connection
        closed; without this, a consumer that reconnected after a timeout, a reset or a broker
        restart would have its pulls refused ("the consumer's group info not exist") until the
        next periodic heartbeat, up to ``heartbeat_interval`` later."""
        if self.heartbeat_source is None or self.remoting.closed or self._leaving:
            return  # (leaving: a heartbeat would announce the group being unregistered)
        if addr not in self._heartbeat_addrs(self.heartbeat_source()):
            return  # a name server (or, for a producer, a slave)
        task = asyncio.get_running_loop().create_task(self._heartbeat_one(addr),
                                                      name=f"heartbeat-on-connect {addr}")
        self._connect_heartbeats.add(task)
        task.add_done_callback(self._connect_heartbeats.discard)

    async def _heartbeat_one(self, addr: str) -> None:
        assert self.heartbeat_source is not None
        try:
            # Not sent again on a GO_AWAY: that would make a connection, which would send a
            # heartbeat of its own, answered GO_AWAY too, for as long as the broker shuts down.
            version = await self.api.heartbeat(addr, self.heartbeat_source(),
                                               resend_on_go_away=False)
        except Exception as exc:  # the periodic heartbeat tries again
            log.warning("heartbeat.on_connect_failed", broker=addr, error=str(exc))
            return
        if addr in self._known_addrs():  # not dropped from the routes meanwhile
            self.broker_versions[addr] = version
        self._heartbeat_round_done({addr: True})

    async def route_refresh_loop(self, interval: float) -> None:
        while True:
            await asyncio.sleep(interval)
            try:
                await self.refresh_routes()
            except Exception as exc:  # a round must never end the loop
                log.error("route.refresh_round_failed", error=f"{type(exc).__name__}: {exc}",
                          exc_info=exc)

    async def heartbeat_loop(self, interval: float) -> None:
        while True:
            await asyncio.sleep(interval)
            try:
                await self.send_heartbeats()
            except Exception as exc:  # a round must never end the loop
                log.error("heartbeat.round_failed", error=f"{type(exc).__name__}: {exc}",
                          exc_info=exc)

    async def unregister(self, producer_group: str | None, consumer_group: str | None) -> None:
        """UNREGISTER_CLIENT, at once, on every broker the heartbeats go to (a broker that is
        down costs one request timeout, not one per broker as Java's loop does; a producer's
        goes to the masters only, where Java would connect to each slave to say it); failures
        are left alone. From here on a new connection sends no heartbeat of its own: it would
        announce the group being unregistered, and the broker handles HEART_BEAT and
        UNREGISTER_CLIENT on different threads (Java takes the group out of its table first).
        """
        self._leaving = True

        async def one(addr: str) -> None:
            with contextlib.suppress(MQClientError, RemotingError):
                await self.api.unregister_client(addr, self.client_id, producer_group,
                                                 consumer_group)

        if self.heartbeat_source is not None:
            addrs = self._heartbeat_addrs(self.heartbeat_source())
        else:
            addrs = self.all_broker_addrs()
        await asyncio.gather(*(one(addr) for addr in addrs))

    async def close(self, *, spare: asyncio.Task[Any] | None = None) -> None:
        """Close the connections; ``spare``: see :meth:`RemotingClient.close`."""
        for task in list(self._connect_heartbeats):
            task.cancel()
        await self.remoting.close(spare=spare)
        if self._connect_heartbeats:
            await asyncio.gather(*self._connect_heartbeats, return_exceptions=True)


def parse_namesrv(namesrv: str | list[str]) -> list[str]:
    """Accept ``"a:9876;b:9876"`` (Java's separator) or a list of addresses."""
    if isinstance(namesrv, str):
        parts = [p.strip() for p in namesrv.replace(",", ";").split(";")]
    else:
        parts = [p.strip() for p in namesrv]
    addrs = [p for p in parts if p]
    if not addrs:
        raise InvalidArgumentError("at least one name server address (host:port) is required")
    for a in addrs:
        host, sep, port = a.rpartition(":")
        if (not sep or not host or not port.isascii() or not port.isdigit()
                or not 0 < int(port) < 65536):
            raise InvalidArgumentError(
                f"name server address must be host:port (port 1-65535), got {a!r}")
    return addrs

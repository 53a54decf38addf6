"""ClientInstance against name servers and brokers that fail in ways the real ones rarely do:
what it raises, whom it asks next, and what it sends while a client leaves (local asyncio
servers speaking the remoting protocol; no broker)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path

import pytest

from rmq_async import NameServerUnavailable
from rmq_async.client.errors import MQClientError, NoPermissionError, NoRouteError
from rmq_async.client.instance import ClientInstance, _BrokerAddrs
from rmq_async.errors import InvalidArgumentError
from rmq_async.protocol.bodies import (
    BrokerData,
    ClusterInfo,
    ConsumerData,
    HeartbeatData,
    QueueData,
    TopicRouteData,
)
from rmq_async.protocol.codes import RequestCode, ResponseCode
from rmq_async.protocol.command import RemotingCommand
from tests.fake_broker import FakeBroker

ROUTE = TopicRouteData([QueueData("b", 4, 4, 6)], [BrokerData("c", "b", {0: "127.0.0.1:10911"})])


@asynccontextmanager
async def answering(body: bytes, seen: list[str] | None = None) -> AsyncIterator[str]:
    """A FakeBroker answering every request SUCCESS with ``body``; yields its address (and
    puts the names of the requests it got into ``seen``)."""
    async def answer(cmd: RemotingCommand, number: int) -> RemotingCommand:
        return cmd.response_to(ResponseCode.SUCCESS, body=body)

    async with FakeBroker(answer) as broker:
        try:
            yield broker.addr
        finally:
            if seen is not None:
                seen.extend(RequestCode(code).name for code in broker.codes())


async def test_a_garbled_route_answer_fails_over_to_the_next_name_server() -> None:
    """A body that does not parse (a proxy's error page) is that name server's failure: the
    next one is asked, and a refresh round goes on with its other topics."""
    async with answering(b"<html>proxy error</html>") as bad, \
            answering(ROUTE.to_json_bytes()) as good:
        inst = ClientInstance([bad, good], "cid")
        try:
            inst._namesrv_index = 0
            route = await inst.fetch_route("T")
            assert route.broker_datas[0].broker_addrs == {0: "127.0.0.1:10911"}
            inst.routes = {"T1": TopicRouteData(), "T2": TopicRouteData()}
            asked: list[str] = []
            fetch = inst.fetch_route

            async def from_the_bad_one_first(topic: str) -> TopicRouteData:
                asked.append(topic)
                inst._namesrv_index = 0
                return await fetch(topic)

            inst.fetch_route = from_the_bad_one_first  # type: ignore[method-assign]
            await inst.refresh_routes()
            assert asked == ["T1", "T2"] and inst.routes["T2"].broker_datas
        finally:
            await inst.close()


async def test_no_name_server_answering_is_name_server_unavailable() -> None:
    inst = ClientInstance("127.0.0.1:1;127.0.0.1:2", "cid", api_timeout=0.5, connect_timeout=0.5)
    try:
        with pytest.raises(NameServerUnavailable, match="no name server answered"):
            await inst.fetch_route("T")
    finally:
        await inst.close()


async def test_name_servers_that_all_refuse_the_credentials_raise_no_permission() -> None:
    # Every name server answered, with an access-control refusal (5.3's NO_PERMISSION, or
    # ACL 1.0's SYSTEM_ERROR naming AclException): read as "no name server answered", an
    # outage, where the fix is the client's credentials.
    async def refuse(cmd: RemotingCommand, number: int) -> RemotingCommand:
        return cmd.response_to(ResponseCode.NO_PERMISSION, remark="no permission for topic")

    async def acl_v1(cmd: RemotingCommand, number: int) -> RemotingCommand:
        return cmd.response_to(ResponseCode.SYSTEM_ERROR,
                               remark="org.apache.rocketmq.acl.common.AclException: no access")

    async with FakeBroker(refuse) as one, FakeBroker(acl_v1) as two:
        inst = ClientInstance([one.addr, two.addr], "cid")
        try:
            with pytest.raises(NoPermissionError):
                await inst.fetch_route("T")
        finally:
            await inst.close()
    # One refusing and one down: an outage still (the other might have answered).
    async with FakeBroker(refuse) as one:
        inst = ClientInstance([one.addr, "127.0.0.1:1"], "cid", api_timeout=0.5,
                              connect_timeout=0.5)
        try:
            with pytest.raises(NameServerUnavailable):
                await inst.fetch_route("T")
        finally:
            await inst.close()


async def test_ensure_topic_whose_route_never_comes_raises_a_client_error() -> None:
    inst = ClientInstance("127.0.0.1:9", "cid")

    async def no_route(topic: str) -> TopicRouteData:
        raise NoRouteError(topic)

    async def cluster(addr: str) -> ClusterInfo:
        return ClusterInfo(broker_addr_table={}, cluster_addr_table={})

    inst.update_route = no_route  # type: ignore[method-assign]
    inst.api.get_cluster_info = cluster  # type: ignore[method-assign]
    try:
        with pytest.raises(MQClientError, match=r"no route for it within 0\.3 s"):
            await inst.ensure_topic("T", 4, timeout=0.3)
    finally:
        await inst.close()


async def test_unregistering_on_a_new_connection_sends_no_heartbeat_first() -> None:
    """The on-connect heartbeat announced the group being unregistered in the same breath
    (the broker handles the two on different threads)."""
    seen: list[str] = []
    async with answering(b"", seen) as addr:
        beat = HeartbeatData(client_id="cid", consumer_data_set=[ConsumerData(group_name="G")])
        source: Callable[[], HeartbeatData] = lambda: beat  # noqa: E731
        inst = ClientInstance("127.0.0.1:9876", "cid", heartbeat_source=source)
        inst.routes["T"] = TopicRouteData([QueueData("b", 4, 4, 6)],
                                          [BrokerData("c", "b", {0: addr})])
        inst.brokers["b"] = _BrokerAddrs("c", {0: addr})
        try:
            await inst.unregister(None, "G")
            await asyncio.sleep(0.2)
        finally:
            await inst.close()
    assert seen == ["UNREGISTER_CLIENT"]


def test_a_ca_file_without_certificates_is_an_invalid_argument(tmp_path: Path) -> None:
    from rmq_async.remoting.tls import client_ssl_context

    bad = tmp_path / "ca.pem"
    bad.write_text("not a certificate\n")
    with pytest.raises(InvalidArgumentError, match="tls_ca_file"):
        client_ssl_context(tls=True, tls_ca_file=bad)



async def test_a_garbled_topic_list_fails_over_to_the_next_name_server() -> None:
    """The Spark source's topic pattern: a body that does not parse raised a bare
    JSONDecodeError (or AttributeError) instead of asking the next name server."""
    from rmq_async.sources.ranges import matching_topics

    listing = b'{"topicList":["orders-1","orders-2","users","%RETRY%G"]}'
    async with answering(b"[1, 2]") as odd, answering(b"<html/>") as bad, \
            answering(listing) as good:
        inst = ClientInstance([odd, bad, good], "cid")
        try:
            assert await matching_topics(inst, "orders-.*") == ["orders-1", "orders-2"]
        finally:
            await inst.close()
        inst = ClientInstance([odd, bad], "cid")
        try:
            with pytest.raises(NameServerUnavailable, match="does not parse"):
                await matching_topics(inst, "orders-.*")
        finally:
            await inst.close()

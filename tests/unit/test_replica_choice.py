"""Which replica of a broker group a request goes to (Java findBrokerAddressInSubscribe)."""

from __future__ import annotations

import pytest

from rmq_async.client.errors import MQClientError
from rmq_async.client.instance import ClientInstance, _BrokerAddrs


def _instance(addrs: dict[int, str]) -> ClientInstance:
    inst = ClientInstance("127.0.0.1:9876", "127.0.0.1@test")
    inst.brokers["broker-a"] = _BrokerAddrs("DefaultCluster", dict(addrs))
    return inst


async def test_suggested_replica_is_used_when_present() -> None:
    inst = _instance({0: "m:1", 1: "s1:1", 2: "s2:1"})
    assert await inst.find_broker_in_subscribe("broker-a", 0) == ("m:1", 0)
    assert await inst.find_broker_in_subscribe("broker-a", 1) == ("s1:1", 1)
    assert await inst.find_broker_in_subscribe("broker-a", 2) == ("s2:1", 2)
    await inst.close()


async def test_missing_slave_takes_the_next_id_then_the_master() -> None:
    inst = _instance({0: "m:1", 2: "s2:1"})
    assert await inst.find_broker_in_subscribe("broker-a", 1) == ("s2:1", 2)
    inst.brokers["broker-a"].addrs = {0: "m:1"}
    assert await inst.find_broker_in_subscribe("broker-a", 1) == ("m:1", 0)
    assert await inst.find_broker_in_subscribe("broker-a", 3) == ("m:1", 0)
    await inst.close()


async def test_master_down_falls_back_to_the_lowest_slave() -> None:
    inst = _instance({2: "s2:1", 1: "s1:1"})
    assert await inst.find_broker_in_subscribe("broker-a", 0) == ("s1:1", 1)
    with pytest.raises(MQClientError):
        await inst.find_broker_in_subscribe("broker-a", 0, only_this_broker=True)
    with pytest.raises(MQClientError):
        await inst.find_broker_in_subscribe("broker-z", 0)
    await inst.close()

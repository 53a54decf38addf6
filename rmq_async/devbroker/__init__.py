"""A real local Apache RocketMQ (NameServer + Broker from the Maven Central jars).

Used by the test suite, ``make demo`` and the benchmarks; also runnable from the command line:
``python -m rmq_async.devbroker up|down|status|fetch``.
"""

from __future__ import annotations

from .broker import AclAccount, LocalRocketMQ, TlsServerFiles
from .cluster import LocalCluster
from .errors import DevBrokerError
from .maven import DEFAULT_VERSION, ensure_jars, ensure_jars_sync

__all__ = [
    "DEFAULT_VERSION",
    "AclAccount",
    "DevBrokerError",
    "LocalCluster",
    "LocalRocketMQ",
    "TlsServerFiles",
    "ensure_jars",
    "ensure_jars_sync",
]

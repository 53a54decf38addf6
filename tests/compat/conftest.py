"""Fixtures of the compatibility subset: one local RocketMQ per server version under test.

The versions come from ``RMQ_COMPAT_VERSIONS`` (comma- or space-separated; default
``4.9.7``, the one ``make test`` runs besides the full suite on 5.3.3). ``make test-compat``
sets it to every supported version. Each version's broker is module-scoped and parametrized, so
pytest runs every scenario on one version before it starts the next broker.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterator

import pytest

from rmq_async.devbroker import AclAccount, LocalRocketMQ
from rmq_async.devbroker.pytest_plugin import SESSION_BROKER_CONFIG, run_blocking
from rmq_async.devbroker.versions import profile
from tests.helpers import SHORT_LIVED_BROKER_CONFIG, SHORT_LIVED_BROKER_FLAGS

DEFAULT_COMPAT_VERSIONS = "4.9.7"
#: The account of the ACL scenario's broker (a normal user: publish and subscribe only).
ACL_ACCOUNT = AclAccount("compat_user", "compat-secret-1", admin=False)


def compat_versions() -> list[str]:
    raw = os.environ.get("RMQ_COMPAT_VERSIONS", DEFAULT_COMPAT_VERSIONS)
    versions = [v for v in re.split(r"[,\s]+", raw) if v]
    for v in versions:
        profile(v)  # an unsupported version fails the collection with a clear message
    return versions


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "compat_version" in metafunc.fixturenames:
        versions = compat_versions()
        metafunc.parametrize("compat_version", versions, ids=[f"v{v}" for v in versions],
                             scope="module")


@pytest.fixture(scope="module")
def compat_broker(compat_version: str) -> Iterator[LocalRocketMQ]:
    """A NameServer + Broker of ``compat_version`` (retry delays of 1 s, like the session one)."""
    rmq = LocalRocketMQ(compat_version, broker_config=SESSION_BROKER_CONFIG,
                        broker_jvm_flags=SHORT_LIVED_BROKER_FLAGS)
    run_blocking(rmq.start_all())
    try:
        yield rmq
    finally:
        run_blocking(rmq.close())


@pytest.fixture(scope="module")
def compat_acl_broker(compat_version: str) -> Iterator[LocalRocketMQ]:
    """A broker of ``compat_version`` with ACL on (ACL 1.0 before 5.3, 2.0 from 5.3)."""
    rmq = LocalRocketMQ(compat_version, acl=ACL_ACCOUNT, broker_config=SHORT_LIVED_BROKER_CONFIG,
                        broker_jvm_flags=SHORT_LIVED_BROKER_FLAGS)
    run_blocking(rmq.start_all())
    try:
        yield rmq
    finally:
        run_blocking(rmq.close())

"""The dev broker's per-version start-up facts, and ACL refusals in both broker forms."""

from __future__ import annotations

import pytest

from rmq_async import NoPermissionError
from rmq_async.client.errors import MQBrokerError, broker_error
from rmq_async.devbroker.errors import DevBrokerError
from rmq_async.devbroker.versions import (
    SUPPORTED_VERSIONS,
    PlainAclAccount,
    logback_files,
    profile,
    render_plain_acl,
)
from rmq_async.errors import InvalidArgumentError
from rmq_async.protocol.codes import ResponseCode


def test_profiles_of_the_supported_versions() -> None:
    assert SUPPORTED_VERSIONS == ("4.9.7", "5.1.4", "5.3.3")
    v4, v51, v53 = (profile(v) for v in SUPPORTED_VERSIONS)
    assert (v4.legacy, v51.legacy, v53.legacy) == (True, False, False)
    assert (v4.acl_model, v51.acl_model, v53.acl_model) == ("plain", "plain", "auth")
    assert "java.base/jdk.internal.ref=ALL-UNNAMED" in v4.server_jvm_flags()
    assert v51.server_jvm_flags() == v53.server_jvm_flags() == ()
    assert v4.acl_broker_settings() == {"aclEnable": "true"}
    with pytest.raises(DevBrokerError):
        v53.acl_broker_settings()
    assert profile("5.3.4-SNAPSHOT").acl_model == "auth"


@pytest.mark.parametrize("bad", ["4.8.0", "3.2.6", "latest", ""])
def test_unsupported_versions_are_refused(bad: str) -> None:
    with pytest.raises(DevBrokerError):
        profile(bad)


def test_logback_files_only_for_4x() -> None:
    files = logback_files(profile("4.9.7"))
    assert sorted(files) == ["logback_broker.xml", "logback_namesrv.xml", "logback_tools.xml"]
    assert "${user.home}/logs/rocketmqlogs/broker.log" in files["logback_broker.xml"]
    assert logback_files(profile("5.1.4")) == {}
    # Rolled over by size, as the 5.x configurations in the jars are (tests/compat starts a
    # 4.9.7 broker with these files: its readiness is read from this log).
    import xml.etree.ElementTree as ET

    appender = ET.fromstring(files["logback_broker.xml"]).find("appender")
    assert appender is not None
    assert appender.get("class") == "ch.qos.logback.core.rolling.RollingFileAppender"
    assert appender.findtext("triggeringPolicy/maxFileSize") == "128MB"
    assert appender.findtext("rollingPolicy/maxIndex") == "3"


def test_plain_acl_file() -> None:
    text = render_plain_acl([PlainAclAccount("admin_user", "admin-secret", admin=True),
                             PlainAclAccount("normal_user", "normal-secret", admin=False)])
    assert "globalWhiteRemoteAddresses: []" in text
    assert "  - accessKey: admin_user\n    secretKey: admin-secret\n" in text
    assert text.count("defaultTopicPerm: PUB|SUB") == 2
    assert "admin: true" in text and "admin: false" in text
    for bad in (PlainAclAccount("alice", "long-enough-1", admin=False),
                PlainAclAccount("has space", "long-enough-1", admin=False)):
        with pytest.raises(InvalidArgumentError):
            render_plain_acl([bad])


def test_acl_refusals_of_both_generations_are_no_permission() -> None:
    v53 = broker_error(ResponseCode.NO_PERMISSION, "user mallory is not found")
    v4 = broker_error(
        ResponseCode.SYSTEM_ERROR,
        "org.apache.rocketmq.acl.common.AclException: Check signature failed for "
        "accessKey=compat_user, PlainPermissionManager.java:683",
        addr="127.0.0.1:10911", request="HEART_BEAT")
    assert isinstance(v53, NoPermissionError) and isinstance(v4, NoPermissionError)
    assert v4.code == ResponseCode.SYSTEM_ERROR  # the code as sent
    other = broker_error(ResponseCode.SYSTEM_ERROR, "java.lang.NullPointerException")
    assert type(other) is MQBrokerError


def test_acl_1_keys_are_checked_before_the_start() -> None:
    from rmq_async.devbroker import AclAccount, LocalRocketMQ

    with pytest.raises(InvalidArgumentError, match="more than 6"):
        LocalRocketMQ("4.9.7", acl=AclAccount("alice", "alice-secret-1"))
    LocalRocketMQ("5.3.3", acl=AclAccount("alice", "alice-secret-1"))  # 5.3 takes it

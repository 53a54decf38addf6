"""What differs between the RocketMQ server versions the dev broker runs (4.9.x, 5.1.x, 5.3.x).

Everything version-dependent in starting a local RocketMQ lives here, keyed by a
:class:`VersionProfile`:

- **Logging.** 5.x reads its (shaded) logback configuration from the jars, selected by the
  ``rmq.logback.configurationFile`` system property. 4.x loads
  ``$ROCKETMQ_HOME/conf/logback_{namesrv,broker,tools}.xml`` and exits when the file is missing:
  those files only ship with the binary distribution, so :func:`logback_files` writes them.
- **JVM flags.** 4.x unmaps files through ``DirectByteBuffer.cleaner()`` and
  ``jdk.internal.ref.Cleaner`` by reflection: JDK 17 refuses that unless ``java.nio`` is opened
  and ``jdk.internal.ref`` exported to the class path.
- **ACL.** Up to 5.2, "ACL 1.0": ``aclEnable=true`` on the broker plus the accounts file
  ``$ROCKETMQ_HOME/conf/plain_acl.yml`` (:func:`render_plain_acl`). From 5.3, authentication and
  authorization ("ACL 2.0") with users created through the admin API at run time.

The admin helper (``java/DevAdmin.java``) is one source compiled against each version's jars: it
names no class whose package moved between 4.x and 5.x, and reaches the 5.3-only user and ACL
calls by reflection.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from rmq_async.errors import InvalidArgumentError

from .errors import DevBrokerError

__all__ = [
    "SUPPORTED_VERSIONS",
    "AclModel",
    "PlainAclAccount",
    "VersionProfile",
    "logback_files",
    "profile",
    "render_plain_acl",
]

#: The server versions the dev broker is tested with (``make test-compat`` runs all of them).
SUPPORTED_VERSIONS: tuple[str, ...] = ("4.9.7", "5.1.4", "5.3.3")

#: ``"plain"``: ACL 1.0 (``plain_acl.yml``); ``"auth"``: 5.3 authentication and authorization.
AclModel = Literal["plain", "auth"]

_VERSION_RE = re.compile(r"^(\d+)\.(\d+)\.(\d+)")


@dataclass(frozen=True)
class VersionProfile:
    """The start-up facts of one RocketMQ server version."""

    version: str
    major: int
    minor: int
    patch: int

    @property
    def legacy(self) -> bool:
        """4.x: logback files under ``$ROCKETMQ_HOME/conf``, unshaded logback, old packages."""
        return self.major < 5

    @property
    def acl_model(self) -> AclModel:
        """``"auth"`` from 5.3 on, else ``"plain"`` (ACL 1.0)."""
        return "auth" if (self.major, self.minor) >= (5, 3) else "plain"

    def server_jvm_flags(self) -> tuple[str, ...]:
        """Extra flags for the name server, broker and mqadmin JVMs of this version."""
        if not self.legacy:
            return ()
        return (
            "--add-opens", "java.base/java.nio=ALL-UNNAMED",
            "--add-opens", "java.base/java.lang=ALL-UNNAMED",
            "--add-exports", "java.base/jdk.internal.ref=ALL-UNNAMED",
            "--add-opens", "java.base/jdk.internal.ref=ALL-UNNAMED",
        )

    def acl_broker_settings(self) -> dict[str, str]:
        """Broker settings of ACL 1.0 (the 5.3 settings need the account: see broker.py)."""
        if self.acl_model != "plain":
            raise DevBrokerError(f"RocketMQ {self.version} has no ACL 1.0 settings")
        return {"aclEnable": "true"}


def profile(version: str) -> VersionProfile:
    """The :class:`VersionProfile` of ``version`` (``major.minor.patch[-suffix]``).

    Versions before 4.9 are refused: their name servers send routes in fastjson's
    non-standard form and they were never started by this module.
    """
    m = _VERSION_RE.match(version)
    if m is None:
        raise DevBrokerError(f"not a RocketMQ release version: {version!r}")
    major, minor, patch = (int(g) for g in m.groups())
    if (major, minor) < (4, 9):
        raise DevBrokerError(
            f"RocketMQ {version} is not supported by the dev broker (4.9.x or newer; tested: "
            f"{', '.join(SUPPORTED_VERSIONS)})"
        )
    return VersionProfile(version=version, major=major, minor=minor, patch=patch)


@dataclass(frozen=True)
class PlainAclAccount:
    """One account of ``plain_acl.yml``: admin (everything) or publish+subscribe everywhere."""

    access_key: str
    secret_key: str
    admin: bool


def render_plain_acl(accounts: Sequence[PlainAclAccount]) -> str:
    """The ACL 1.0 accounts file: no white-listed address, so every request must be signed.

    Non-admin accounts may publish and subscribe on every topic and group (the default
    permissions), admin accounts may do everything, admin requests included.
    """
    lines = ["globalWhiteRemoteAddresses: []", "", "accounts:"]
    for acc in accounts:
        for value in (acc.access_key, acc.secret_key):
            if not re.fullmatch(r"[A-Za-z0-9_.@-]+", value):
                raise InvalidArgumentError(f"ACL 1.0 keys are plain words, not {value!r}")
            # PlainPermissionManager refuses the whole file when a key has 6 characters or less.
            if len(value) <= 6:
                raise InvalidArgumentError(f"ACL 1.0 keys need more than 6 characters: {value!r}")
        lines += [
            f"  - accessKey: {acc.access_key}",
            f"    secretKey: {acc.secret_key}",
            "    whiteRemoteAddress:",
            f"    admin: {'true' if acc.admin else 'false'}",
            "    defaultTopicPerm: PUB|SUB",
            "    defaultGroupPerm: PUB|SUB",
        ]
    return "\n".join(lines) + "\n"


_LOGBACK_TEMPLATE = """<?xml version="1.0" encoding="UTF-8"?>
<!-- Written by rmq_async.devbroker: RocketMQ 4.x reads its logging setup from here. -->
<configuration>
    <appender name="File" class="ch.qos.logback.core.rolling.RollingFileAppender">
        <file>${{user.home}}/logs/rocketmqlogs/{log_name}</file>
        <append>true</append>
        <rollingPolicy class="ch.qos.logback.core.rolling.FixedWindowRollingPolicy">
            <fileNamePattern>${{user.home}}/logs/rocketmqlogs/otherdays/{log_name}.%i</fileNamePattern>
            <minIndex>1</minIndex>
            <maxIndex>3</maxIndex>
        </rollingPolicy>
        <triggeringPolicy class="ch.qos.logback.core.rolling.SizeBasedTriggeringPolicy">
            <maxFileSize>128MB</maxFileSize>
        </triggeringPolicy>
        <encoder>
            <pattern>%d{{yyyy-MM-dd HH:mm:ss,SSS}} %p %t %c{{0}} - %m%n</pattern>
            <charset>UTF-8</charset>
        </encoder>
    </appender>
    <root level="INFO">
        <appender-ref ref="File"/>
    </root>
</configuration>
"""


def logback_files(prof: VersionProfile) -> dict[str, str]:
    """``conf/`` file name → content of the logback files ``prof``'s servers and tools need.

    Each JVM logs to one file under ``<user.home>/logs/rocketmqlogs`` (``namesrv.log``,
    ``broker.log``, ``tools.log``), the names the 5.x configurations use for their main log,
    rolled over at 128 MB with three older files kept (a long-lived ``broker up`` of a 4.x
    version grew its log without bound).
    """
    if not prof.legacy:
        return {}
    return {
        f"logback_{role}.xml": _LOGBACK_TEMPLATE.format(log_name=f"{role}.log")
        for role in ("namesrv", "broker", "tools")
    }

"""Pure helpers: free loopback ports, ``.properties`` rendering, JVM command lines."""

from __future__ import annotations

import errno
import random
import socket
from collections.abc import Mapping, Sequence
from pathlib import Path

from rmq_async.devbroker.errors import DevBrokerError
from rmq_async.errors import InvalidArgumentError

__all__ = [
    "BROKER_DEFAULTS",
    "NAMESRV_CLASS",
    "BROKER_CLASS",
    "ADMIN_CLASS",
    "broker_config",
    "broker_ports",
    "free_port",
    "jvm_command",
    "namesrv_config",
    "pick_broker_port",
    "port_is_free",
    "render_properties",
]

NAMESRV_CLASS = "org.apache.rocketmq.namesrv.NamesrvStartup"
BROKER_CLASS = "org.apache.rocketmq.broker.BrokerStartup"
ADMIN_CLASS = "org.apache.rocketmq.tools.command.MQAdminStartup"

#: Test-broker settings layered under the caller's ``broker_config``.
BROKER_DEFAULTS: dict[str, str] = {
    "brokerClusterName": "DefaultCluster",
    "brokerName": "broker-a",
    "brokerId": "0",
    "brokerRole": "ASYNC_MASTER",
    "flushDiskType": "ASYNC_FLUSH",
    "brokerIP1": "127.0.0.1",
    "brokerIP2": "127.0.0.1",
    "bindAddress": "127.0.0.1",
    "mappedFileSizeCommitLog": str(64 * 1024 * 1024),
    "mappedFileSizeConsumeQueue": "600000",
    "maxHashSlotNum": "50000",
    "maxIndexNum": "200000",
    "fileReservedTime": "1",
    "autoCreateTopicEnable": "true",
    "autoCreateSubscriptionGroup": "true",
    "defaultTopicQueueNums": "8",
    "enablePropertyFilter": "true",
    "longPollingEnable": "true",
    "timerWheelEnable": "true",
    "transientStorePoolEnable": "false",
    "warmMapedFileEnable": "false",
    "waitTimeMillsInSendQueue": "1000",
    # 5.3's transaction-metrics thread spins on a core until its first flush is due (it only
    # waits after a flush; apache/rocketmq#10515, fixed after 5.3.3): 3 s at the default
    # interval, about 2.5 CPU seconds of every start on a 2-core machine. At 500 ms it spins
    # that long once and then flushes a small file twice a second (0.2% of a core). 4.9
    # brokers do not know the key and ignore it.
    "transactionMetricFlushInterval": "500",
}

#: Port numbers tried for the broker; the fast channel (port - 2) and HA (port + 1) come along.
_BROKER_PORT_RANGE = (20000, 60000)


def port_is_free(port: int, host: str = "127.0.0.1") -> bool:
    """True if a listening TCP socket can be bound to ``host:port`` right now."""
    if not 0 < port < 65536:
        return False
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError as exc:
            if exc.errno in (errno.EADDRINUSE, errno.EACCES, errno.EADDRNOTAVAIL):
                return False
            raise
    return True


def free_port(host: str = "127.0.0.1") -> int:
    """A port the kernel reports free on ``host`` (ephemeral range)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        port: int = s.getsockname()[1]
        return port


def broker_ports(listen_port: int) -> tuple[int, int, int]:
    """(fast channel, main, HA) for a broker main port: ``port - 2, port, port + 1``."""
    return listen_port - 2, listen_port, listen_port + 1


def pick_broker_port(*, rng: random.Random | None = None, attempts: int = 200,
                     exclude: Sequence[int] = ()) -> int:
    """A main port ``p`` with ``p - 2`` and ``p`` free on loopback and ``p + 1`` on all interfaces.

    The HA server binds every interface, hence the wildcard check.
    """
    r = rng or random.Random()
    lo, hi = _BROKER_PORT_RANGE
    for _ in range(attempts):
        port = r.randrange(lo, hi)
        fast, main, ha = broker_ports(port)
        if {fast, main, ha} & set(exclude):
            continue
        if port_is_free(fast) and port_is_free(main) and port_is_free(ha, "0.0.0.0"):
            return port
    raise DevBrokerError("no free port triple found for the broker")


def _escape(value: str) -> str:
    out = value.replace("\\", "\\\\").replace("\n", "\\n").replace("\r", "\\r")
    if out.startswith(" "):
        out = "\\" + out
    return out


def render_properties(values: Mapping[str, str], header: str | None = None) -> str:
    """Java ``.properties`` text, keys in the given order, values escaped."""
    lines: list[str] = []
    if header:
        lines.extend(f"# {h}" for h in header.splitlines())
    for key, value in values.items():
        if not key or any(c in key for c in " =:\n\r#!\\"):
            raise InvalidArgumentError(f"invalid property key: {key!r}")
        lines.append(f"{key}={_escape(str(value))}")
    return "\n".join(lines) + "\n"


def namesrv_config(port: int) -> dict[str, str]:
    return {"listenPort": str(port), "bindAddress": "127.0.0.1"}


def broker_config(*, run_dir: Path, namesrv_addr: str, listen_port: int,
                  overrides: Mapping[str, str] | None = None) -> dict[str, str]:
    """The broker's properties: :data:`BROKER_DEFAULTS`, ports and paths, then ``overrides``.

    Overrides win, except for the keys this process relies on to find and reach the broker
    (ports, addresses, store path), which are rejected rather than silently ignored.
    """
    store = run_dir / "store"
    values = dict(BROKER_DEFAULTS)
    values.update(
        {
            "namesrvAddr": namesrv_addr,
            "listenPort": str(listen_port),
            "haListenPort": str(listen_port + 1),
            "storePathRootDir": str(store),
            "storePathCommitLog": str(store / "commitlog"),
        }
    )
    check_broker_overrides(overrides or {})
    for key, value in (overrides or {}).items():
        values[key] = str(value)
    return values


#: broker.conf settings a dev broker lays out itself (ports, addresses, store paths).
MANAGED_BROKER_KEYS = frozenset({"namesrvAddr", "listenPort", "haListenPort", "storePathRootDir",
                                 "bindAddress", "brokerIP1"})


def check_broker_overrides(overrides: Mapping[str, object]) -> None:
    """Refuse a ``broker_config`` that sets what the dev broker manages."""
    for key in overrides:
        if key in MANAGED_BROKER_KEYS:
            raise InvalidArgumentError(f"broker_config may not override {key!r}: it is managed "
                                       "by LocalRocketMQ")


def jvm_command(java: Path | str, *, lib_dir: Path, main_class: str, args: Sequence[str],
                user_home: Path, logback: str, heap: str, direct: str | None = None,
                extra: Sequence[str] = (), quick_start: bool = False,
                class_dirs: Sequence[Path] = ()) -> list[str]:
    """A ``java`` command line running ``main_class`` from ``lib_dir/*``.

    ``quick_start`` trades peak throughput for start-up time (short-lived tools).
    """
    cmd = [str(java), f"-Xmx{heap}"]
    if quick_start:
        cmd += ["-XX:TieredStopAtLevel=1", "-XX:+UseSerialGC", "-Xss512k"]
    else:
        cmd += [f"-Xms{heap}", "-XX:+UseG1GC"]
    if direct:
        cmd.append(f"-XX:MaxDirectMemorySize={direct}")
    cmd += [
        "--add-exports", "java.base/sun.nio.ch=ALL-UNNAMED",
        "-XX:-OmitStackTraceInFastThrow",
        "-Djava.net.preferIPv4Stack=true",
        f"-Duser.home={user_home}",
        # Temporary files (the broker's self-signed TLS certificate among them) stay in the run
        # folder instead of piling up in the system's temp folder.
        f"-Djava.io.tmpdir={jvm_tmpdir(Path(user_home))}",
        f"-Drmq.logback.configurationFile={logback}",
        *extra,
        "-cp", ":".join([*(str(d) for d in class_dirs), f"{lib_dir}/*"]),
        main_class,
        *args,
    ]
    return cmd


def jvm_tmpdir(user_home: Path) -> Path:
    """The ``java.io.tmpdir`` of a JVM whose home is ``user_home`` (created here)."""
    tmp = user_home / "tmp"
    tmp.mkdir(parents=True, exist_ok=True)
    return tmp

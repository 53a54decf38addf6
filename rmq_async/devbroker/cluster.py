"""A local RocketMQ cluster: N broker groups, each a master plus optional slaves, and one or more
name servers, all on loopback from the Maven Central jars.

``LocalCluster`` lays out the processes (ports, broker ids and roles, the name-server list) and
reuses the single-broker building blocks of :mod:`.broker` (configuration rendering, JVM command
lines, the resident admin helper protocol, process records). Groups are named ``broker-a``,
``broker-b``, … in one cluster; the master of a group has broker id 0 and runs as
``ASYNC_MASTER``, its slaves ids 1, 2, … as ``SLAVE`` (classic master/slave replication: a slave
learns its master's HA address from the name servers). Every broker allows reads from slaves
(``slaveReadEnable``), as production master/slave groups do, so that consumers can go on while a
master is down and follow the broker's ``suggestWhichBrokerId``.

Each broker and name server has a folder of its own under the run folder (configuration, store,
logs), so one can be killed and restarted on the same port and store.
"""

from __future__ import annotations

import contextlib
import os
import string
import subprocess
import tempfile
import time
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Any

import anyio
import structlog

from rmq_async.consumer.options import check_topic_name

from . import config as cfg
from .admin_helper import AdminHelper
from .broker import (
    _START_ATTEMPTS,
    ADMIN_SOURCE,
    BROKER_READY,
    BROKER_REGISTERED,
    NAMESRV_READY,
    _port_taken,
    runs_dir,
)
from .errors import DevBrokerError
from .java import compile_java
from .maven import DEFAULT_VERSION, ensure_jars, find_tool, version_dir
from .procs import (
    RunRecord,
    output_since,
    output_size,
    output_tail,
    pid_start_ticks,
    reap_stale_runs,
    spawn,
    stop_process,
)
from .versions import logback_files, profile

__all__ = ["BrokerNode", "LocalCluster", "NamesrvNode", "group_name"]

log = structlog.get_logger(__name__)

MASTER_ID = 0


def group_name(index: int) -> str:
    """``broker-a`` for 0, ``broker-b`` for 1, … ``broker-z``, then ``broker-26``, …"""
    if index < 0:
        raise ValueError("group index must be >= 0")
    return f"broker-{string.ascii_lowercase[index]}" if index < 26 else f"broker-{index}"


@dataclass
class NamesrvNode:
    """One name server of the cluster."""

    index: int
    port: int
    folder: Path
    proc: subprocess.Popen[bytes] | None = None

    @property
    def addr(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def key(self) -> str:
        return f"namesrv-{self.index}"

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None


@dataclass
class BrokerNode:
    """One broker process: a group's master (``broker_id`` 0) or one of its slaves."""

    broker_name: str
    broker_id: int
    port: int
    folder: Path
    proc: subprocess.Popen[bytes] | None = None
    config: dict[str, str] = field(default_factory=dict)

    @property
    def addr(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def key(self) -> str:
        return f"{self.broker_name}-{self.broker_id}"

    @property
    def is_master(self) -> bool:
        return self.broker_id == MASTER_ID

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    @property
    def out_path(self) -> Path:
        return self.folder / "broker.out"

    @property
    def log_path(self) -> Path:
        return self.folder / "logs" / "rocketmqlogs" / "broker.log"

    @property
    def conf_path(self) -> Path:
        return self.folder / "broker.conf"


class LocalCluster:
    """``groups`` broker groups x (1 master + ``slaves`` slaves) and ``namesrvs`` name servers.

    ``async with LocalCluster(groups=2, slaves=1, namesrvs=2) as c:`` starts every JVM and
    returns once every broker is registered in the name servers. :meth:`kill_broker`,
    :meth:`start_broker`, :meth:`kill_namesrv` and :meth:`start_namesrv` act on one process and
    keep its port and store. ``broker_jvm_flags`` go on every broker's ``java`` command line,
    as :class:`~rmq_async.devbroker.LocalRocketMQ`'s.
    """

    def __init__(
        self,
        version: str = DEFAULT_VERSION,
        *,
        groups: int = 2,
        slaves: int = 1,
        namesrvs: int = 2,
        broker_config: Mapping[str, str] | None = None,
        group_config: Mapping[str, Mapping[str, str]] | None = None,
        cluster: str = "DefaultCluster",
        heap: str = "320m",
        direct: str = "256m",
        namesrv_heap: str = "128m",
        workdir: Path | str | None = None,
        cache_dir: Path | str | None = None,
        ready_timeout: float = 180.0,
        detached: bool = False,
        broker_jvm_flags: Sequence[str] = (),
    ) -> None:
        if not 1 <= groups <= 64:
            raise ValueError(f"groups must be within 1..64, not {groups}")
        if not 0 <= slaves <= 4:
            raise ValueError(f"slaves must be within 0..4, not {slaves}")
        if not 1 <= namesrvs <= 4:
            raise ValueError(f"namesrvs must be within 1..4, not {namesrvs}")
        managed = {"brokerName", "brokerId", "brokerRole", "brokerClusterName"}
        for key in broker_config or {}:
            if key in managed:
                raise ValueError(f"broker_config may not set {key!r}: LocalCluster lays it out")
        names = [group_name(i) for i in range(groups)]
        for name in group_config or {}:
            if name not in names:
                raise ValueError(f"group_config names an unknown group {name!r} ({names})")
        self.version = version
        self.profile = profile(version)
        self._ready_keys: set[str] = set()  # brokers registered during start_all()
        self.groups = groups
        self.slaves = slaves
        self.namesrv_count = namesrvs
        self.cluster = cluster
        self.broker_names = names
        self.heap = heap
        self.direct = direct
        self.namesrv_heap = namesrv_heap
        self.cache_dir = cache_dir
        self.ready_timeout = ready_timeout
        self.detached = detached
        self.broker_jvm_flags = tuple(broker_jvm_flags)
        self._broker_config = dict(broker_config or {})
        self._group_config = {k: dict(v) for k, v in (group_config or {}).items()}
        self._given_workdir = Path(workdir).resolve() if workdir is not None else None
        self._workdir: Path | None = None
        self._lib_dir: Path | None = None
        self._java: Path | None = None
        self._admin_classes: Path | None = None
        self._admin = AdminHelper()
        self._record: RunRecord | None = None
        self._closed = False
        self.namesrvs: list[NamesrvNode] = []
        self.brokers: dict[tuple[str, int], BrokerNode] = {}
        #: Seconds from :meth:`start_all` to every broker registered (set once started).
        self.startup_seconds: float | None = None

    # ------------------------------------------------------------------ properties

    def _require(self) -> Path:
        if self._workdir is None:
            raise DevBrokerError("LocalCluster is not started")
        return self._workdir

    @property
    def workdir(self) -> Path:
        return self._require()

    @property
    def lib_dir(self) -> Path:
        self._require()
        assert self._lib_dir is not None
        return self._lib_dir

    @property
    def java(self) -> Path:
        self._require()
        assert self._java is not None
        return self._java

    @property
    def namesrv_addrs(self) -> list[str]:
        self._require()
        return [n.addr for n in self.namesrvs]

    @property
    def namesrv_addr(self) -> str:
        """Every name server, ``;``-separated (the Java client's ``namesrvAddr`` form)."""
        return ";".join(self.namesrv_addrs)

    def broker(self, broker_name: str, broker_id: int = MASTER_ID) -> BrokerNode:
        self._require()
        try:
            return self.brokers[(broker_name, broker_id)]
        except KeyError:
            raise DevBrokerError(f"no broker {broker_name!r} id {broker_id} in this cluster "
                                 f"({sorted(self.brokers)})") from None

    def broker_addr(self, broker_name: str, broker_id: int = MASTER_ID) -> str:
        return self.broker(broker_name, broker_id).addr

    def master_addrs(self) -> dict[str, str]:
        """``{broker name: master address}``."""
        return {name: self.broker_addr(name) for name in self.broker_names}

    @property
    def pids(self) -> dict[str, int]:
        """Pids of the running JVMs, keyed ``namesrv-I``, ``broker-x-ID`` and ``admin``."""
        out: dict[str, int] = {}
        for ns in self.namesrvs:
            if ns.proc is not None and ns.proc.poll() is None:
                out[ns.key] = ns.proc.pid
        for node in self.brokers.values():
            if node.proc is not None and node.proc.poll() is None:
                out[node.key] = node.proc.pid
        if self._admin.proc is not None and self._admin.alive:
            out["admin"] = self._admin.proc.pid
        return out

    @property
    def record(self) -> RunRecord:
        self._require()
        assert self._record is not None
        return self._record

    def _env(self) -> dict[str, str]:
        dropped = ("NAMESRV_ADDR", "JAVA_TOOL_OPTIONS")
        env = {k: v for k, v in os.environ.items() if k not in dropped}
        env["ROCKETMQ_HOME"] = str(self._require())
        return env

    # ------------------------------------------------------------------ lifecycle

    async def __aenter__(self) -> LocalCluster:
        await self.start_all()
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> None:
        await self.close()

    async def start_all(self) -> None:
        """Fetch the jars, start the name servers, then every broker; wait until all are
        registered."""
        if self._workdir is not None:
            raise DevBrokerError("LocalCluster already started")
        await anyio.to_thread.run_sync(reap_stale_runs)
        self._lib_dir = await ensure_jars(self.version, self.cache_dir)
        self._java = find_tool("java")
        self._admin_classes = await compile_java(
            [ADMIN_SOURCE], self._lib_dir, version_dir(self.version, self.cache_dir) / "classes"
        )
        if self._given_workdir is not None:
            self._given_workdir.mkdir(parents=True, exist_ok=True)
            self._workdir = self._given_workdir
            remove = False
        else:
            self._workdir = Path(tempfile.mkdtemp(prefix="cluster-", dir=runs_dir()))
            remove = True
        # A detached run is owned by the starting process until it is up, so a start killed
        # halfway (SIGKILL, a lost terminal) leaves nothing the reaper of the next start
        # would not stop; once up, it has no owner and outlives this process.
        owner = os.getpid()
        self._record = RunRecord(
            run_id=f"{self._workdir.name}-{uuid.uuid4().hex[:8]}", workdir=self._workdir,
            owner_pid=owner, owner_start=pid_start_ticks(owner) if owner else None,
            remove_workdir=remove,
        )
        started = time.monotonic()
        attempt = 1
        while True:
            try:
                self._layout()
                self._save_record()
                self._ready_keys = set()
                try:
                    with anyio.fail_after(self.ready_timeout):
                        async with anyio.create_task_group() as tg:
                            for ns in self.namesrvs:
                                tg.start_soon(self._start_namesrv, ns)
                        self._spawn_admin()
                        async with anyio.create_task_group() as tg:
                            for node in self.brokers.values():
                                tg.start_soon(self._start_broker, node)
                except TimeoutError:
                    raise self._not_ready() from None
                break
            except BaseException as exc:
                # Ports are picked free and bound by the JVMs a moment later: another process
                # (a second test worker starting its own broker) may take one in between.
                if attempt >= _START_ATTEMPTS or not _port_taken(exc):
                    # Shielded: a start cancelled (a timeout around it) must still stop what
                    # it started, or the JVMs run on until this process ends.
                    with anyio.CancelScope(shield=True):
                        await self._teardown()
                    raise
                await self._stop_processes()
                log.warning("devbroker.cluster.port_taken", attempt=attempt,
                            ports=[ns.port for ns in self.namesrvs]
                            + [n.port for n in self.brokers.values()])
                self.namesrvs.clear()
                self.brokers.clear()
                attempt += 1
        self.startup_seconds = round(time.monotonic() - started, 2)
        if self.detached:
            assert self._record is not None
            self._record.disown()
            self._save_record()
        log.info("devbroker.cluster.ready", namesrv=self.namesrv_addr,
                 brokers={n.key: n.addr for n in self.brokers.values()},
                 workdir=str(self._workdir), seconds=self.startup_seconds)

    def _layout(self) -> None:
        """Pick the ports and write every process's configuration."""
        run = self._require()
        conf = run / "conf"  # $ROCKETMQ_HOME/conf of every JVM
        conf.mkdir(exist_ok=True)
        for name, text in logback_files(self.profile).items():
            (conf / name).write_text(text)
        taken: list[int] = []
        for i in range(self.namesrv_count):
            port = cfg.free_port()
            while port in taken:
                port = cfg.free_port()
            taken.append(port)
            folder = run / f"namesrv-{i}"
            folder.mkdir(parents=True, exist_ok=True)
            (folder / "namesrv.conf").write_text(cfg.render_properties(cfg.namesrv_config(port)))
            self.namesrvs.append(NamesrvNode(i, port, folder))
        for name in self.broker_names:
            for broker_id in range(self.slaves + 1):
                port = cfg.pick_broker_port(exclude=taken)
                taken.extend(cfg.broker_ports(port))
                folder = run / f"{name}-{broker_id}"
                folder.mkdir(parents=True, exist_ok=True)
                overrides = {
                    "slaveReadEnable": "true",
                    **self._broker_config,
                    **self._group_config.get(name, {}),
                    "brokerClusterName": self.cluster,
                    "brokerName": name,
                    "brokerId": str(broker_id),
                    "brokerRole": "ASYNC_MASTER" if broker_id == MASTER_ID else "SLAVE",
                }
                values = cfg.broker_config(run_dir=folder, namesrv_addr=self.namesrv_addr,
                                           listen_port=port, overrides=overrides)
                node = BrokerNode(name, broker_id, port, folder, config=values)
                node.conf_path.write_text(cfg.render_properties(values))
                self.brokers[(name, broker_id)] = node

    def _save_record(self) -> None:
        assert self._record is not None
        self._record.pids = self.pids
        self._record.info = {
            "version": self.version,
            "namesrv_addr": self.namesrv_addr,
            "broker_addr": ";".join(self.master_addrs().values()),
            "brokers": {n.key: n.addr for n in self.brokers.values()},
            "cluster": self.cluster,
            "lib_dir": str(self._lib_dir),
        }
        self._record.save()

    def _spawn(self, main_class: str, folder: Path, conf: Path, out: Path, logback: str,
               heap: str, direct: str, *, quick_start: bool = False,
               flags: Sequence[str] = ()) -> subprocess.Popen[bytes]:
        cmd = cfg.jvm_command(
            self.java, lib_dir=self.lib_dir, main_class=main_class, args=["-c", str(conf)],
            user_home=folder, logback=logback, heap=heap, direct=direct,
            extra=[*self.profile.server_jvm_flags(), *flags], quick_start=quick_start,
        )
        return spawn(cmd, cwd=folder, env=self._env(), output=out,
                     die_with_parent=not self.detached)

    async def _start_namesrv(self, ns: NamesrvNode) -> None:
        out = ns.folder / "namesrv.out"
        offset = output_size(out)
        # Quick-start flags, as LocalRocketMQ's name server (route queries only).
        ns.proc = self._spawn(cfg.NAMESRV_CLASS, ns.folder, ns.folder / "namesrv.conf", out,
                              "rmq.namesrv.logback.xml", self.namesrv_heap, "64m",
                              quick_start=True)
        self._save_record()
        deadline = time.monotonic() + self.ready_timeout
        while True:
            if ns.proc.poll() is not None:
                raise self._failure(f"name server {ns.index} exited with status "
                                    f"{ns.proc.returncode}", out)
            if NAMESRV_READY in output_since(out, offset) and await _port_open(ns.port):
                log.info("devbroker.cluster.namesrv_ready", namesrv=ns.addr)
                return
            if time.monotonic() > deadline:
                raise self._failure(f"name server {ns.index} was not ready within "
                                    f"{self.ready_timeout}s", out)
            await anyio.sleep(0.1)

    async def _start_broker(self, node: BrokerNode) -> None:
        out_offset = output_size(node.out_path)
        log_offset = output_size(node.log_path)
        started = time.monotonic()
        node.proc = self._spawn(cfg.BROKER_CLASS, node.folder, node.conf_path, node.out_path,
                                "rmq.broker.logback.xml", self.heap, self.direct,
                                flags=self.broker_jvm_flags)
        self._save_record()
        deadline = started + self.ready_timeout
        booted = False
        nudged = 0.0
        while True:
            if node.proc.poll() is not None:
                raise self._failure(f"broker {node.key} exited with status "
                                    f"{node.proc.returncode}", node.out_path, node.log_path)
            if not booted and BROKER_READY in output_since(node.out_path, out_offset):
                booted = True
            if booted:
                registered = (BROKER_REGISTERED in output_since(node.log_path, log_offset)
                              and await self._listed(node))
                if not registered and time.monotonic() - nudged > 1.0:
                    # The first registration can miss a name server (the broker fills its list
                    # of reachable ones asynchronously) and the next one is 30 s later.
                    nudged = time.monotonic()
                    with contextlib.suppress(DevBrokerError):
                        await self.admin_request("register", node.addr)
                if registered:
                    self._ready_keys.add(node.key)
                    log.info("devbroker.cluster.broker_ready", broker=node.broker_name,
                             broker_id=node.broker_id, addr=node.addr,
                             seconds=round(time.monotonic() - started, 2))
                    return
            if time.monotonic() > deadline:
                what = "registered in the name servers" if booted else "booted"
                raise self._failure(f"broker {node.key} was not {what} within "
                                    f"{self.ready_timeout}s", node.out_path, node.log_path)
            await anyio.sleep(0.1)

    async def _listed(self, node: BrokerNode) -> bool:
        """True when every running name server lists ``node`` (asked directly: the admin
        helper's client sees one name server only)."""
        # Imported here: the client is only needed once processes run.
        from rmq_async.client.api import MQClientAPI
        from rmq_async.remoting.client import RemotingClient

        remoting = RemotingClient(connect_timeout=2.0)
        try:
            api = MQClientAPI(remoting, timeout=3.0)
            for ns in self.namesrvs:
                if not ns.running:
                    continue
                try:
                    info = await api.get_cluster_info(ns.addr)
                except Exception:  # not answering yet counts as not listed
                    return False
                data = info.broker_addr_table.get(node.broker_name)
                if data is None or data.broker_addrs.get(node.broker_id) != node.addr:
                    return False
            return True
        finally:
            await remoting.close()

    def _not_ready(self) -> DevBrokerError:
        """The error of a start that ran out of ``ready_timeout``: what was not ready, with
        the log lines of the first such broker (each broker's own deadline starts later)."""
        waiting = [n for n in self.brokers.values() if n.key not in self._ready_keys]
        if not waiting:
            return self._failure(f"not ready within {self.ready_timeout:g} s")
        first = waiting[0]
        return self._failure(
            f"not ready within {self.ready_timeout:g} s: broker(s) "
            f"{', '.join(n.key for n in waiting)} not registered", first.out_path, first.log_path)

    def _failure(self, what: str, *paths: Path) -> DevBrokerError:
        parts = [f"local RocketMQ cluster failed: {what} (run folder {self._workdir})"]
        for path in paths:
            lines = output_tail(path, 40)
            if lines:
                parts.append(f"--- last lines of {path} ---")
                parts.extend(lines)
        return DevBrokerError("\n".join(parts))

    # ------------------------------------------------------------------ one process at a time

    def kill_broker(self, broker_name: str, broker_id: int = MASTER_ID) -> None:
        """SIGKILL one broker (no shutdown hooks, no unregistration) and reap it."""
        node = self.broker(broker_name, broker_id)
        if node.proc is not None:
            if node.proc.poll() is None:
                node.proc.kill()
            node.proc.wait(timeout=30)
            node.proc = None
            log.info("devbroker.cluster.broker_killed", broker=broker_name, broker_id=broker_id)
            self._save_record()

    async def stop_broker(self, broker_name: str, broker_id: int = MASTER_ID, *,
                          grace: float = 20.0) -> None:
        """Stop one broker (SIGTERM, SIGKILL after ``grace`` seconds)."""
        node = self.broker(broker_name, broker_id)
        if node.proc is not None:
            rc = await stop_process(node.proc, grace=grace)
            node.proc = None
            log.info("devbroker.cluster.broker_stopped", broker=broker_name,
                     broker_id=broker_id, status=rc)
            self._save_record()

    async def start_broker(self, broker_name: str, broker_id: int = MASTER_ID) -> None:
        """(Re)start one broker on its port and store; returns once it is registered."""
        node = self.broker(broker_name, broker_id)
        if node.running:
            return
        try:
            await self._start_broker(node)
        except BaseException:
            if node.proc is not None:
                with anyio.CancelScope(shield=True):
                    await stop_process(node.proc, grace=5.0)
                node.proc = None
            raise

    def kill_namesrv(self, index: int) -> None:
        """SIGKILL one name server and reap it."""
        ns = self.namesrvs[index]
        if ns.proc is not None:
            if ns.proc.poll() is None:
                ns.proc.kill()
            ns.proc.wait(timeout=30)
            ns.proc = None
            log.info("devbroker.cluster.namesrv_killed", namesrv=ns.addr)
            self._save_record()

    async def start_namesrv(self, index: int) -> None:
        """(Re)start one name server on its port; brokers register with it within their
        registration period (30 s), or at once when asked (:meth:`register_all`)."""
        ns = self.namesrvs[index]
        if ns.running:
            return
        await self._start_namesrv(ns)

    async def register_all(self) -> None:
        """Ask every running broker to register with the name servers now."""
        for node in self.brokers.values():
            if node.running:
                await self.admin_request("register", node.addr)

    # ------------------------------------------------------------------ admin helper

    def _spawn_admin(self) -> None:
        run = self._require()
        assert self._admin_classes is not None
        cmd = cfg.jvm_command(
            self.java, lib_dir=self.lib_dir, main_class="DevAdmin", args=[self.namesrv_addr],
            user_home=run / "admin-home", logback="rmq.client.logback.xml", heap="128m",
            quick_start=True, class_dirs=[self._admin_classes],
        )
        self._admin.spawn(cmd, cwd=run, env=self._env(), output=run / "devadmin.out",
                          die_with_parent=not self.detached)
        self._save_record()

    async def admin_request(self, *words: str, timeout: float = 30.0) -> list[str]:
        """One request to the resident admin helper (see ``DevAdmin.java``); its result lines."""
        return await self._admin.request(*words, timeout=timeout)

    async def create_topic(self, name: str, queues: int = 8, order: bool = False, *,
                           timeout: float = 60.0) -> None:
        """Create (or update) ``name`` with ``queues`` queues on every group's master (and its
        slaves) and wait until the name servers serve a route naming every group."""
        check_topic_name(name)  # (an InvalidArgumentError, a ValueError too)
        if not 1 <= queues <= 1024:
            raise ValueError(f"queues must be within 1..1024, not {queues}")
        started = time.monotonic()
        deadline = started + timeout
        await self.admin_request("create", self.cluster, name, str(queues),
                                 "true" if order else "false", timeout=timeout)
        await self._create_on_slaves(name, queues, order, timeout)
        want = set(self.broker_names)
        while True:
            lines = await self.admin_request("route", name, timeout=timeout)
            have = {row.split("\t")[0] for row in lines[1:]
                    if row.split("\t")[1:2] == [str(queues)]} if lines[0] == "OK" else set()
            if want <= have:
                break
            if time.monotonic() > deadline:
                raise DevBrokerError(f"topic {name!r} has no route on {sorted(want - have)} "
                                     f"after {timeout}s: {lines}")
            await anyio.sleep(0.05)
        log.info("devbroker.topic.created", topic=name, queues=queues, order=order,
                 groups=len(want), seconds=round(time.monotonic() - started, 2))

    async def _create_on_slaves(self, name: str, queues: int, order: bool,
                                timeout: float) -> None:
        """The topic's configuration on every running slave at once. A slave copies its
        master's topic configurations only periodically and refuses pulls of a topic it does
        not know yet, so a topic created seconds before its master dies could not be read
        from the slave; a production topic is older than that period."""
        from rmq_async.client.api import MQClientAPI
        from rmq_async.remoting.client import RemotingClient

        remoting = RemotingClient(connect_timeout=2.0)
        try:
            api = MQClientAPI(remoting, timeout=timeout)
            for node in self.brokers.values():
                if not node.is_master and node.running:
                    await api.create_topic(node.addr, name, read_queues=queues,
                                           write_queues=queues, order=order, timeout=timeout)
        finally:
            await remoting.close()

    def tools_command(self, *args: str) -> list[str]:
        """The ``java`` command running ``mqadmin`` with ``args`` against the name servers."""
        argv = list(args)
        if argv and "-n" not in argv[1:]:
            argv += ["-n", self.namesrv_addr]
        return cfg.jvm_command(
            self.java, lib_dir=self.lib_dir, main_class=cfg.ADMIN_CLASS, args=argv,
            user_home=self._require() / "tools-home", logback="rmq.tools.logback.xml",
            heap="128m", quick_start=True, extra=self.profile.server_jvm_flags(),
        )

    async def mqadmin(self, *args: str, timeout: float = 60.0) -> str:
        """Run ``mqadmin <args> -n <name servers>`` and return its stdout."""
        with anyio.fail_after(timeout):
            proc = await anyio.run_process(self.tools_command(*args), env=self._env(),
                                           check=False, cwd=self._require())
        out = proc.stdout.decode(errors="replace")
        if proc.returncode != 0:
            raise DevBrokerError(f"mqadmin {' '.join(args)} exited with {proc.returncode}:\n"
                                 f"{out}\n{proc.stderr.decode(errors='replace')}")
        return out

    def rss_bytes(self) -> dict[str, int]:
        """Resident memory of every running JVM of the cluster (``/proc``), by process key."""
        out: dict[str, int] = {}
        page = os.sysconf("SC_PAGE_SIZE")
        for key, pid in self.pids.items():
            with contextlib.suppress(OSError, ValueError, IndexError):
                out[key] = int(Path(f"/proc/{pid}/statm").read_text().split()[1]) * page
        return out

    def describe(self) -> dict[str, Any]:
        """Addresses of every process, for printing."""
        return {
            "namesrv_addr": self.namesrv_addr,
            "brokers": {n.key: n.addr for n in self.brokers.values()},
            "workdir": str(self._require()),
        }

    # ------------------------------------------------------------------ teardown

    async def _teardown(self) -> None:
        await self._stop_processes()
        if self._record is not None:
            self._record.pids = {}
            self._record.forget()

    async def _stop_processes(self) -> None:
        grace = 20.0 if self._record is None or not self._record.remove_workdir else 0.0
        await self._admin.stop(grace)
        procs: list[subprocess.Popen[bytes]] = []
        for node in self.brokers.values():
            if node.proc is not None:
                procs.append(node.proc)
                node.proc = None
        for ns in self.namesrvs:
            if ns.proc is not None:
                procs.append(ns.proc)
                ns.proc = None
        async with anyio.create_task_group() as tg:
            for proc in procs:
                tg.start_soon(_stop, proc, grace)

    async def close(self) -> None:
        """Stop every JVM and remove the run folder (if this object created it)."""
        if self._closed or self._workdir is None:
            return
        self._closed = True
        with anyio.CancelScope(shield=True):
            await self._teardown()
        log.info("devbroker.cluster.closed", workdir=str(self._workdir))


async def _stop(proc: subprocess.Popen[bytes], grace: float) -> None:
    await stop_process(proc, grace=grace)


async def _port_open(port: int) -> bool:
    try:
        stream = await anyio.connect_tcp("127.0.0.1", port)
    except OSError:
        return False
    await stream.aclose()
    return True

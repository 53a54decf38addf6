"""A real Apache RocketMQ NameServer + Broker on loopback ports, for tests, demos and benchmarks.

``LocalRocketMQ`` runs the two JVMs from the Maven Central jars (see :mod:`.maven`) in a run
folder of their own: configuration files, logs (``-Duser.home=<run>``), the message store and
the pid record all live there, and the folder is removed on exit when this object created it.

Nothing in here keeps asyncio objects across calls: the instance can be started in one event
loop and used from others (pytest-asyncio gives every test a fresh loop).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import secrets
import subprocess
import tempfile
import time
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any

import anyio
import anyio.to_thread
import structlog

from rmq_async.consumer.options import check_topic_name
from rmq_async.errors import InvalidArgumentError

from . import config as cfg
from .admin_helper import AdminHelper
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
    runs_root,
    spawn,
    stop_process,
)
from .versions import PlainAclAccount, logback_files, profile, render_plain_acl

__all__ = ["AclAccount", "LocalRocketMQ"]

log = structlog.get_logger(__name__)

#: Starts tried when a picked port was taken before the JVM bound it.
_START_ATTEMPTS = 3

NAMESRV_READY = "The Name Server boot success"
BROKER_READY = "boot success"
BROKER_REGISTERED = "Registering current broker to name server completed"
ADMIN_SOURCE = Path(__file__).parent / "java" / "DevAdmin.java"


@dataclass(frozen=True)
class AclAccount:
    """An account the broker accepts when authentication is enabled.

    RocketMQ 5.3 authentication/authorization ("ACL 2.0"): ``admin=True`` makes the account a
    ``Super`` user (every request allowed, admin requests included); ``admin=False`` makes it a
    ``Normal`` user allowed to ``Pub``, ``Sub`` and ``Get`` on every topic and group, and
    nothing else. On 4.9.x to 5.2.x ("ACL 1.0", ``plain_acl.yml``) the same account is an
    ``admin`` account, or one with ``PUB|SUB`` on every topic and group. Requests must be signed
    (the ``AccessKey``/``Signature`` extension fields of the classic ACL client hook).
    """

    access_key: str
    secret_key: str
    admin: bool = True

    def __post_init__(self) -> None:
        for what, value in (("access_key", self.access_key), ("secret_key", self.secret_key)):
            if not value or any(c.isspace() or c in "\"\\" for c in value):
                raise InvalidArgumentError(f"{what} must be non-empty without blanks, quotes or "
                                 f"backslashes: {value!r}")
        if len(self.secret_key) < 6:
            raise InvalidArgumentError("secret_key must have at least 6 characters")


@dataclass(frozen=True)
class TlsServerFiles:
    """The certificate the name server and broker present on TLS connections, instead of the
    self-signed one they make up in RocketMQ's TLS test mode.

    ``cert_file``: PEM certificate (chain); ``key_file``: its private key as unencrypted PKCS#8
    PEM (what RocketMQ's ``tls.server.keyPath`` reads). The servers stay in
    ``tls.server.mode=permissive``: plain connections are served too (the broker registers with
    the name server over one), a connection that opens with a TLS handshake gets TLS.
    """

    cert_file: Path
    key_file: Path

    def jvm_properties(self, config_file: Path) -> list[str]:
        """System properties for a server JVM; ``config_file`` is where RocketMQ would look for
        a ``tls.properties`` (pointed into the run folder, so that no host-wide one applies)."""
        return [
            f"-Dtls.config.file={config_file}",
            "-Dtls.server.mode=permissive",
            "-Dtls.test.mode.enable=false",
            f"-Dtls.server.certPath={Path(self.cert_file).resolve()}",
            f"-Dtls.server.keyPath={Path(self.key_file).resolve()}",
        ]


#: Username of the internal super user that the helper and mqadmin sign with when ACL is on.
INTERNAL_ADMIN_USER = "rmq_async_devadmin"
_AUTHN = "org.apache.rocketmq.auth.authentication.provider"
_AUTHZ = "org.apache.rocketmq.auth.authorization.provider"


def acl_broker_config(admin_user: str, admin_password: str) -> dict[str, str]:
    """Broker settings enabling 5.x authentication + authorization with local (RocksDB) users,
    seeded with one super user that also signs the broker's own inner requests."""
    user = json.dumps({"username": admin_user, "password": admin_password},
                      separators=(",", ":"))
    inner = json.dumps({"accessKey": admin_user, "secretKey": admin_password},
                       separators=(",", ":"))
    return {
        "authenticationEnabled": "true",
        "authenticationProvider": f"{_AUTHN}.DefaultAuthenticationProvider",
        "authenticationMetadataProvider": f"{_AUTHN}.LocalAuthenticationMetadataProvider",
        "authorizationEnabled": "true",
        "authorizationProvider": f"{_AUTHZ}.DefaultAuthorizationProvider",
        "authorizationMetadataProvider": f"{_AUTHZ}.LocalAuthorizationMetadataProvider",
        "initAuthenticationUser": user,
        "innerClientAuthenticationCredentials": inner,
    }


def runs_dir() -> Path:
    """Parent of the run folders this module creates."""
    path = runs_root() / "runs"
    path.mkdir(parents=True, exist_ok=True)
    return path


_BARE_INT_KEY = re.compile(r"-?\d+\s*:")


def parse_lenient_json(text: str) -> Any:
    """Parse the JSON the RocketMQ tools print (fastjson writes integer map keys unquoted)."""
    out: list[str] = []
    i, n = 0, len(text)
    expect_key = False
    while i < n:
        c = text[i]
        if c == '"':
            j = i + 1
            while j < n and text[j] != '"':
                j += 2 if text[j] == "\\" else 1
            out.append(text[i:j + 1])
            i = j + 1
            expect_key = False
            continue
        if c in "{,":
            expect_key = True
            out.append(c)
        elif expect_key and not c.isspace():
            m = _BARE_INT_KEY.match(text, i)
            if m:
                key = m.group().rstrip(": \t\r\n")
                out.append(f'"{key}":')
                i = m.end()
                expect_key = False
                continue
            expect_key = False
            out.append(c)
        else:
            out.append(c)
        i += 1
    return json.loads("".join(out))


def _port_taken(exc: BaseException) -> bool:
    """``exc`` (or, from a task group, every error in it) is a start that failed because a
    picked port was taken."""
    if isinstance(exc, BaseExceptionGroup):
        return all(_port_taken(e) for e in exc.exceptions)
    return isinstance(exc, DevBrokerError) and "Address already in use" in str(exc)


class LocalRocketMQ:
    """A NameServer and one master Broker on 127.0.0.1, started from the real Apache jars.

    ``async with LocalRocketMQ() as rmq:`` fetches the jars if needed, picks free ports,
    starts both JVMs and returns once the broker is registered in the name server.
    :meth:`stop` / :meth:`start` stop and restart the *broker only*, on the same port and
    store; :meth:`kill_broker` SIGKILLs it.

    ``broker_jvm_flags`` go on the broker's ``java`` command line after the defaults, e.g.
    ``("-XX:TieredStopAtLevel=1",)``: a short-lived broker with little traffic then starts on
    about 3 CPU seconds less (no C2 compiles), at the cost of slower code under load. Such a
    broker should also get ``broker_config={"timerWheelEnable": "false"}`` unless it serves
    timer messages: the timer wheel's once-a-second flush, cheap once C2 has compiled it, takes
    about a third of a core under C1 alone.
    """

    def __init__(
        self,
        version: str = DEFAULT_VERSION,
        *,
        broker_config: Mapping[str, str] | None = None,
        acl: AclAccount | None = None,
        tls: TlsServerFiles | None = None,
        workdir: Path | str | None = None,
        heap: str = "512m",
        namesrv_heap: str = "256m",
        cache_dir: Path | str | None = None,
        ready_timeout: float = 90.0,
        detached: bool = False,
        broker_jvm_flags: Sequence[str] = (),
    ) -> None:
        overrides = dict(broker_config or {})
        cfg.check_broker_overrides(overrides)  # now, not after the jars and javac
        self.version = version
        self.profile = profile(version)
        self.acl = acl
        self.tls = tls
        self.heap = heap
        self.namesrv_heap = namesrv_heap
        self.cache_dir = cache_dir
        self.ready_timeout = ready_timeout
        self.detached = detached
        self.broker_jvm_flags = tuple(broker_jvm_flags)
        self.cluster = overrides.get("brokerClusterName", cfg.BROKER_DEFAULTS["brokerClusterName"])
        self.broker_name = overrides.get("brokerName", cfg.BROKER_DEFAULTS["brokerName"])
        self._admin_password = secrets.token_hex(12)
        if acl is not None:
            if self.profile.acl_model == "auth":
                acl_settings = acl_broker_config(INTERNAL_ADMIN_USER, self._admin_password)
            else:
                acl_settings = self.profile.acl_broker_settings()
                # ACL 1.0's own rules on keys, checked now rather than by a broker that refuses
                # to start.
                render_plain_acl([PlainAclAccount(acl.access_key, acl.secret_key, acl.admin)])
            overrides = {**acl_settings, **overrides}
        self._overrides = overrides
        self._given_workdir = Path(workdir).resolve() if workdir is not None else None
        self._workdir: Path | None = None
        self._lib_dir: Path | None = None
        self._java: Path | None = None
        self._namesrv_port = 0
        self._broker_port = 0
        self._namesrv: subprocess.Popen[bytes] | None = None
        self._broker: subprocess.Popen[bytes] | None = None
        self._admin = AdminHelper()
        self._admin_classes: Path | None = None
        self._record: RunRecord | None = None
        self._closed = False

    # ------------------------------------------------------------------ properties

    def _require(self) -> Path:
        if self._workdir is None:
            raise DevBrokerError("LocalRocketMQ is not started")
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
    def namesrv_addr(self) -> str:
        self._require()
        return f"127.0.0.1:{self._namesrv_port}"

    @property
    def broker_addr(self) -> str:
        self._require()
        return f"127.0.0.1:{self._broker_port}"

    @property
    def broker_port(self) -> int:
        self._require()
        return self._broker_port

    @property
    def namesrv_port(self) -> int:
        self._require()
        return self._namesrv_port

    @property
    def pids(self) -> dict[str, int]:
        """Pids of the running JVMs (``namesrv``, ``broker``)."""
        out = {}
        procs = (("namesrv", self._namesrv), ("broker", self._broker),
                 ("admin", self._admin.proc))
        for name, proc in procs:
            if proc is not None and proc.poll() is None:
                out[name] = proc.pid
        return out

    @property
    def record(self) -> RunRecord:
        """The run's on-disk record (pids, addresses, run folder)."""
        self._require()
        assert self._record is not None
        return self._record

    @property
    def broker_running(self) -> bool:
        return self._broker is not None and self._broker.poll() is None

    def _paths(self) -> dict[str, Path]:
        run = self._require()
        logs = run / "logs" / "rocketmqlogs"
        return {
            "namesrv_conf": run / "namesrv.conf",
            "broker_conf": run / "broker.conf",
            "namesrv_out": run / "namesrv.out",
            "broker_out": run / "broker.out",
            "namesrv_log": logs / "namesrv.log",
            "broker_log": logs / "broker.log",
            "admin_out": run / "devadmin.out",
        }

    def _env(self) -> dict[str, str]:
        dropped = ("NAMESRV_ADDR", "JAVA_TOOL_OPTIONS")
        env = {k: v for k, v in os.environ.items() if k not in dropped}
        env["ROCKETMQ_HOME"] = str(self._require())
        return env

    # ------------------------------------------------------------------ lifecycle

    async def __aenter__(self) -> LocalRocketMQ:
        await self.start_all()
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> None:
        await self.close()

    async def start_all(self) -> None:
        """Fetch the jars, start the name server and the broker, wait until both are ready."""
        if self._workdir is not None:
            raise DevBrokerError("LocalRocketMQ already started")
        await anyio.to_thread.run_sync(reap_stale_runs)
        self._lib_dir = await ensure_jars(self.version, self.cache_dir)
        self._java = find_tool("java")
        # One helper source, compiled against each version's own jars into that version's cache.
        self._admin_classes = await compile_java(
            [ADMIN_SOURCE], self._lib_dir, version_dir(self.version, self.cache_dir) / "classes"
        )
        if self._given_workdir is not None:
            self._given_workdir.mkdir(parents=True, exist_ok=True)
            self._workdir = self._given_workdir
            remove = False
        else:
            self._workdir = Path(tempfile.mkdtemp(prefix="run-", dir=runs_dir()))
            remove = True
        run_id = f"{self._workdir.name}-{uuid.uuid4().hex[:8]}"
        # A detached run is owned by the starting process until it is up, so a start killed
        # halfway (SIGKILL, a lost terminal) leaves nothing the reaper of the next start
        # would not stop; once up, it has no owner and outlives this process.
        owner = os.getpid()
        self._record = RunRecord(
            run_id=run_id, workdir=self._workdir, owner_pid=owner,
            owner_start=pid_start_ticks(owner) if owner else None, remove_workdir=remove,
        )
        started = time.monotonic()
        attempt = 1
        while True:
            try:
                await self._start_processes()
                break
            except DevBrokerError as exc:
                # Ports are picked free and bound by the JVM a moment later: another process
                # (a second test worker starting its own broker) may take one in between.
                if attempt >= _START_ATTEMPTS or not _port_taken(exc):
                    with anyio.CancelScope(shield=True):
                        await self._teardown()
                    raise
                await self._stop_processes()
                log.warning("devbroker.port_taken", attempt=attempt, namesrv_port=self._namesrv_port,
                            broker_port=self._broker_port)
                attempt += 1
            except BaseException:
                # Shielded: a start cancelled (a timeout around it) must still stop what it
                # started, or the JVMs run on until this process ends.
                with anyio.CancelScope(shield=True):
                    await self._teardown()
                raise
        if self.detached:
            assert self._record is not None
            self._record.disown()
            self._save_record()
        log.info("devbroker.ready", namesrv=self.namesrv_addr, broker=self.broker_addr,
                 workdir=str(self._workdir), seconds=round(time.monotonic() - started, 2))

    async def _start_processes(self) -> None:
        self._namesrv_port = cfg.free_port()
        self._broker_port = cfg.pick_broker_port(exclude=[self._namesrv_port])
        self._write_configs()
        self._save_record()
        await self._start_namesrv()
        self._spawn_admin()
        await self._start_broker()
        if self.acl is not None and self.profile.acl_model == "auth":
            # ACL 2.0 users live in the broker's metadata store: create it now (ACL 1.0
            # accounts were written to plain_acl.yml before the start).
            await self._create_account(self.acl)

    def _write_configs(self) -> None:
        p = self._paths()
        p["namesrv_conf"].write_text(cfg.render_properties(cfg.namesrv_config(self._namesrv_port)))
        values = cfg.broker_config(
            run_dir=self._require(), namesrv_addr=self.namesrv_addr,
            listen_port=self._broker_port, overrides=self._overrides,
        )
        p["broker_conf"].write_text(cfg.render_properties(values))
        conf = self._require() / "conf"
        conf.mkdir(exist_ok=True)
        for name, text in logback_files(self.profile).items():
            (conf / name).write_text(text)
        if self.acl is not None:
            # mqadmin signs with $ROCKETMQ_HOME/conf/tools.yml.
            (conf / "tools.yml").write_text(
                f"accessKey: {INTERNAL_ADMIN_USER}\nsecretKey: {self._admin_password}\n"
            )
            if self.profile.acl_model == "plain":
                # ACL 1.0: the broker reads its accounts from $ROCKETMQ_HOME/conf/plain_acl.yml.
                accounts = [
                    PlainAclAccount(INTERNAL_ADMIN_USER, self._admin_password, admin=True),
                    PlainAclAccount(self.acl.access_key, self.acl.secret_key, self.acl.admin),
                ]
                (conf / "plain_acl.yml").write_text(render_plain_acl(accounts))

    def _save_record(self) -> None:
        assert self._record is not None
        self._record.pids = self.pids
        self._record.info = {
            "version": self.version,
            "namesrv_addr": self.namesrv_addr,
            "broker_addr": self.broker_addr,
            "broker_name": self.broker_name,
            "cluster": self.cluster,
            "lib_dir": str(self._lib_dir),
        }
        self._record.save()

    def _spawn_jvm(self, main_class: str, conf: Path, out: Path, logback: str, heap: str,
                   direct: str, *, quick_start: bool = False,
                   flags: Sequence[str] = ()) -> subprocess.Popen[bytes]:
        run = self._require()
        tls = [] if self.tls is None else self.tls.jvm_properties(run / "tls.properties")
        cmd = cfg.jvm_command(
            self.java, lib_dir=self.lib_dir, main_class=main_class, args=["-c", str(conf)],
            user_home=run, logback=logback, heap=heap, direct=direct,
            extra=[*self.profile.server_jvm_flags(), *tls, *flags], quick_start=quick_start,
        )
        return spawn(cmd, cwd=run, env=self._env(), output=out, die_with_parent=not self.detached)

    async def _start_namesrv(self) -> None:
        p = self._paths()
        offset = output_size(p["namesrv_out"])
        # The name server only answers route queries: on the quick-start flags its start takes
        # 2.2-3.9 CPU s instead of 4.3-4.7 (measured), with nothing to lose at its load.
        self._namesrv = self._spawn_jvm(cfg.NAMESRV_CLASS, p["namesrv_conf"], p["namesrv_out"],
                                        "rmq.namesrv.logback.xml", self.namesrv_heap, "128m",
                                        quick_start=True)
        self._save_record()
        deadline = time.monotonic() + self.ready_timeout
        while True:
            if self._namesrv.poll() is not None:
                rc = self._namesrv.returncode
                raise self._failure(f"the name server exited with status {rc}")
            if NAMESRV_READY in output_since(p["namesrv_out"], offset) and await self._port_open(
                self._namesrv_port
            ):
                return
            if time.monotonic() > deadline:
                raise self._failure(f"the name server was not ready within {self.ready_timeout}s")
            await anyio.sleep(0.1)

    def _spawn_admin(self) -> None:
        """Start the resident admin client (it exits when its stdin, our pipe, closes)."""
        run = self._require()
        assert self._admin_classes is not None
        args = [self.namesrv_addr]
        env = self._env()
        if self.acl is not None:
            # The password through the environment: a command line is readable by anyone.
            args.append(INTERNAL_ADMIN_USER)
            env["RMQ_DEVADMIN_SECRET"] = self._admin_password
        cmd = cfg.jvm_command(
            self.java, lib_dir=self.lib_dir, main_class="DevAdmin", args=args,
            user_home=run / "admin-home", logback="rmq.client.logback.xml", heap="128m",
            quick_start=True, class_dirs=[self._admin_classes],
        )
        self._admin.spawn(cmd, cwd=run, env=env, output=self._paths()["admin_out"],
                          die_with_parent=not self.detached)
        self._save_record()

    async def admin_request(self, *words: str, timeout: float = 30.0) -> list[str]:
        """Send one request to the resident admin helper; return its result lines.

        Raises :class:`DevBrokerError` when the helper answers ``ERR``.
        """
        return await self._admin.request(*words, timeout=timeout)

    async def _create_account(self, acl: AclAccount) -> None:
        kind = "Super" if acl.admin else "Normal"
        await self.admin_request("user", self.broker_addr, acl.access_key, acl.secret_key, kind)
        if not acl.admin:
            await self.admin_request("acl", self.broker_addr, f"User:{acl.access_key}",
                                     "Topic:*,Group:*", "Pub,Sub,Get", "Allow")
        log.info("devbroker.acl.account", user=acl.access_key, type=kind)

    async def _registered(self) -> bool:
        rows = await self.admin_request("brokers", self.cluster)
        return any(r.split("\t")[-1] == self.broker_addr for r in rows[1:])

    async def _port_open(self, port: int) -> bool:
        try:
            stream = await anyio.connect_tcp("127.0.0.1", port)
        except OSError:
            return False
        await stream.aclose()
        return True

    async def _start_broker(self) -> None:
        p = self._paths()
        out_offset = output_size(p["broker_out"])
        log_offset = output_size(p["broker_log"])
        started = time.monotonic()
        self._broker = self._spawn_jvm(cfg.BROKER_CLASS, p["broker_conf"], p["broker_out"],
                                       "rmq.broker.logback.xml", self.heap, "512m",
                                       flags=self.broker_jvm_flags)
        self._save_record()
        deadline = started + self.ready_timeout
        booted = False
        nudged = 0.0
        while True:
            if self._broker.poll() is not None:
                raise self._failure(f"the broker exited with status {self._broker.returncode}")
            if not booted and BROKER_READY in output_since(p["broker_out"], out_offset):
                booted = True
                log.info("devbroker.broker.booted", seconds=round(time.monotonic() - started, 2))
            if booted:
                registered = BROKER_REGISTERED in output_since(p["broker_log"], log_offset)
                if not registered and self._admin.alive:
                    registered = await self._registered()
                    # The broker's first registration can miss the name server (its list of
                    # reachable name servers is filled asynchronously) and the next one is
                    # 10 s later: ask for one now.
                    if not registered and time.monotonic() - nudged > 1.0:
                        nudged = time.monotonic()
                        with contextlib.suppress(DevBrokerError):
                            await self.admin_request("register", self.broker_addr)
                if registered:
                    log.info("devbroker.broker.registered",
                             seconds=round(time.monotonic() - started, 2))
                    return
            if time.monotonic() > deadline:
                what = "registered in the name server" if booted else "booted"
                raise self._failure(f"the broker was not {what} within {self.ready_timeout}s")
            await anyio.sleep(0.1)

    def _failure(self, what: str) -> DevBrokerError:
        p = self._paths()
        parts = [f"local RocketMQ failed: {what} (run folder {self._workdir})"]
        for key in ("namesrv_out", "broker_out", "broker_log", "admin_out"):
            lines = output_tail(p[key], 40)
            if lines:
                parts.append(f"--- last lines of {p[key]} ---")
                parts.extend(lines)
        return DevBrokerError("\n".join(parts))

    async def stop(self, *, grace: float = 20.0) -> None:
        """Stop the broker only (SIGTERM, then SIGKILL after ``grace`` seconds)."""
        if self._broker is not None:
            rc = await stop_process(self._broker, grace=grace)
            log.info("devbroker.broker.stopped", status=rc)
            self._broker = None
            self._save_record()

    async def start(self) -> None:
        """(Re)start the broker on the same port and store; returns once it is registered."""
        self._require()
        if self.broker_running:
            return
        if self._namesrv is None or self._namesrv.poll() is not None:
            raise DevBrokerError("the name server is not running")
        try:
            await self._start_broker()
        except BaseException:
            if self._broker is not None:
                with anyio.CancelScope(shield=True):
                    await stop_process(self._broker, grace=5.0)
                self._broker = None
            raise

    def kill_broker(self) -> None:
        """SIGKILL the broker (no shutdown hooks, no unregistration) and reap it."""
        if self._broker is not None:
            if self._broker.poll() is None:
                self._broker.kill()
            self._broker.wait(timeout=30)
            log.info("devbroker.broker.killed")
            self._broker = None
            self._save_record()

    async def _stop_processes(self) -> None:
        # A store about to be deleted needs no orderly shutdown (the broker's takes ~13 s).
        grace = 20.0 if self._record is None or not self._record.remove_workdir else 0.0
        await self._admin.stop(grace)
        for attr in ("_broker", "_namesrv"):
            proc: subprocess.Popen[bytes] | None = getattr(self, attr)
            if proc is not None:
                await stop_process(proc, grace=grace)
                setattr(self, attr, None)

    async def _teardown(self) -> None:
        await self._stop_processes()
        if self._record is not None:
            self._record.pids = {}
            self._record.forget()

    async def close(self) -> None:
        """Stop both JVMs and remove the run folder (if this object created it)."""
        if self._closed or self._workdir is None:
            return
        self._closed = True
        with anyio.CancelScope(shield=True):
            await self._teardown()
        log.info("devbroker.closed", workdir=str(self._workdir))

    # ------------------------------------------------------------------ admin

    def broker_log_tail(self, n: int = 40) -> str:
        """The last ``n`` lines of the broker's stdout and ``broker.log``."""
        p = self._paths()
        out = output_tail(p["broker_out"], n)
        blog = output_tail(p["broker_log"], n)
        return "\n".join([*out, *blog])

    def tools_command(self, *args: str) -> list[str]:
        """The ``java`` command running ``mqadmin`` with ``args`` against this name server."""
        argv = list(args)
        if argv and "-n" not in argv[1:]:
            argv += ["-n", self.namesrv_addr]
        return cfg.jvm_command(
            self.java, lib_dir=self.lib_dir, main_class=cfg.ADMIN_CLASS, args=argv,
            user_home=self._require() / "tools-home", logback="rmq.tools.logback.xml",
            heap="128m", quick_start=True, extra=self.profile.server_jvm_flags(),
        )

    async def mqadmin(self, *args: str, timeout: float = 60.0) -> str:
        """Run ``mqadmin <args> -n <namesrv>`` and return its stdout.

        mqadmin exits 0 even when the command failed: check the text.
        """
        cmd = self.tools_command(*args)
        with anyio.fail_after(timeout):
            proc = await anyio.run_process(cmd, env=self._env(), check=False,
                                           cwd=self._require())
        out = proc.stdout.decode(errors="replace")
        if proc.returncode != 0:
            raise DevBrokerError(
                f"mqadmin {' '.join(args)} exited with {proc.returncode}:\n{out}\n"
                f"{proc.stderr.decode(errors='replace')}"
            )
        return out

    async def topic_route(self, topic: str) -> dict[str, Any] | None:
        """The name server's route of ``topic`` as JSON, or None when it has none."""
        out = await self.mqadmin("topicRoute", "-t", topic)
        start = out.find("{")
        if start < 0:
            return None
        try:
            data = parse_lenient_json(out[start:])
        except ValueError:
            return None
        return data if isinstance(data, dict) else None

    async def _create_topic_mqadmin(self, name: str, queues: int, order: bool,
                                    deadline: float) -> None:
        args = ["updateTopic", "-c", self.cluster, "-t", name, "-r", str(queues), "-w", str(queues)]
        if order:
            args += ["-o", "true"]
        out = await self.mqadmin(*args, timeout=max(1.0, deadline - time.monotonic()))
        if "success" not in out:
            raise DevBrokerError(f"creating topic {name!r} failed:\n{out}")
        while True:
            route = await self.topic_route(name)
            if route is not None and any(
                q.get("brokerName") == self.broker_name and q.get("readQueueNums") == queues
                for q in route.get("queueDatas", [])
            ):
                return
            if time.monotonic() > deadline:
                raise DevBrokerError(f"topic {name!r} has no route with {queues} queues: {route}")
            await anyio.sleep(0.2)

    async def create_topic(self, name: str, queues: int = 8, order: bool = False, *,
                           timeout: float = 60.0) -> None:
        """Create (or update) ``name`` with ``queues`` read/write queues on the broker and wait
        until the name server serves its route."""
        check_topic_name(name)
        if not 1 <= queues <= 1024:
            raise InvalidArgumentError(f"queues must be within 1..1024, not {queues}")
        started = time.monotonic()
        deadline = started + timeout
        if self._admin.alive:
            await self.admin_request("create", self.cluster, name, str(queues),
                                     "true" if order else "false", timeout=timeout)
            while True:
                lines = await self.admin_request("route", name, timeout=timeout)
                if lines[0] == "OK" and any(
                    row.split("\t")[:2] == [self.broker_name, str(queues)] for row in lines[1:]
                ):
                    break
                if time.monotonic() > deadline:
                    raise DevBrokerError(f"topic {name!r} has no route with {queues} queues "
                                         f"after {timeout}s: {lines}")
                await anyio.sleep(0.02)
        else:
            await self._create_topic_mqadmin(name, queues, order, deadline)
        log.info("devbroker.topic.created", topic=name, queues=queues, order=order,
                 seconds=round(time.monotonic() - started, 2))

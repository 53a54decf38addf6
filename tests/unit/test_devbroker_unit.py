"""rmq_async.devbroker without a broker: config rendering, ports, POM, tool lookup, processes."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import signal
import socket
import stat
import subprocess
import sys
import textwrap
import time
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

import anyio
import anyio.to_thread
import pytest

from rmq_async.devbroker import DevBrokerError, ensure_jars, ensure_jars_sync, maven, procs
from rmq_async.devbroker import config as cfg
from rmq_async.devbroker.broker import LocalRocketMQ, parse_lenient_json
from rmq_async.devbroker.cli import _parse_kv, build_parser
from rmq_async.devbroker.java import java_command

# ---------------------------------------------------------------- .properties rendering


def test_render_properties_keeps_order_and_escapes() -> None:
    text = cfg.render_properties({"b": "1", "a": "x\\y", "c": " lead", "d": "two\nlines"},
                                 header="generated")
    assert text.splitlines() == ["# generated", "b=1", "a=x\\\\y", "c=\\ lead", "d=two\\nlines"]


@pytest.mark.parametrize("key", ["", "a b", "a=b", "a:b", "#x"])
def test_render_properties_rejects_bad_keys(key: str) -> None:
    with pytest.raises(ValueError):
        cfg.render_properties({key: "v"})


def test_broker_config_defaults_ports_paths(tmp_path: Path) -> None:
    values = cfg.broker_config(run_dir=tmp_path, namesrv_addr="127.0.0.1:1234", listen_port=30911)
    assert values["listenPort"] == "30911"
    assert values["haListenPort"] == "30912"
    assert values["namesrvAddr"] == "127.0.0.1:1234"
    assert values["brokerIP1"] == "127.0.0.1"
    assert values["bindAddress"] == "127.0.0.1"
    assert values["storePathRootDir"] == str(tmp_path / "store")
    assert values["storePathCommitLog"] == str(tmp_path / "store" / "commitlog")
    assert values["waitTimeMillsInSendQueue"] == "1000"
    assert values["autoCreateTopicEnable"] == "true"
    assert "messageDelayLevel" not in values  # broker default unless asked
    assert "useServerSideResetOffset" not in values


def test_broker_config_overrides_win(tmp_path: Path) -> None:
    levels = " ".join(["1s"] * 18)
    values = cfg.broker_config(
        run_dir=tmp_path, namesrv_addr="127.0.0.1:1", listen_port=30911,
        overrides={"messageDelayLevel": levels, "brokerName": "b-x", "timerWheelEnable": "false"},
    )
    assert values["messageDelayLevel"] == levels
    assert values["brokerName"] == "b-x"
    assert values["timerWheelEnable"] == "false"
    rendered = cfg.render_properties(values)
    assert f"messageDelayLevel={levels}\n" in rendered


@pytest.mark.parametrize("key", ["listenPort", "namesrvAddr", "storePathRootDir", "brokerIP1"])
def test_broker_config_refuses_managed_keys(tmp_path: Path, key: str) -> None:
    with pytest.raises(ValueError, match=key):
        cfg.broker_config(run_dir=tmp_path, namesrv_addr="127.0.0.1:1", listen_port=30911,
                          overrides={key: "1"})


def test_local_rocketmq_names_follow_config() -> None:
    rmq = LocalRocketMQ(broker_config={"brokerName": "bx", "brokerClusterName": "cx"})
    assert (rmq.broker_name, rmq.cluster) == ("bx", "cx")
    default = LocalRocketMQ()
    assert (default.broker_name, default.cluster) == ("broker-a", "DefaultCluster")
    with pytest.raises(DevBrokerError, match="not started"):
        _ = default.namesrv_addr


def test_namesrv_config() -> None:
    assert cfg.namesrv_config(4321) == {"listenPort": "4321", "bindAddress": "127.0.0.1"}


def test_jvm_command_shape(tmp_path: Path) -> None:
    cmd = cfg.jvm_command("java", lib_dir=tmp_path / "lib", main_class=cfg.BROKER_CLASS,
                          args=["-c", "b.conf"], user_home=tmp_path, heap="512m",
                          logback="rmq.broker.logback.xml", direct="512m")
    assert cmd[0] == "java"
    assert "-Xmx512m" in cmd and "-Xms512m" in cmd
    assert f"-Duser.home={tmp_path}" in cmd
    assert "-Drmq.logback.configurationFile=rmq.broker.logback.xml" in cmd
    assert "-XX:MaxDirectMemorySize=512m" in cmd
    assert cmd[cmd.index("-cp") + 1] == f"{tmp_path / 'lib'}/*"
    assert cmd[-3:] == [cfg.BROKER_CLASS, "-c", "b.conf"]


# ---------------------------------------------------------------- ports


def test_port_is_free_sees_a_listener() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        assert not cfg.port_is_free(port)
    assert cfg.port_is_free(cfg.free_port())


def test_pick_broker_port_triple_is_free() -> None:
    port = cfg.pick_broker_port()
    fast, main, ha = cfg.broker_ports(port)
    assert (fast, main, ha) == (port - 2, port, port + 1)
    assert cfg.port_is_free(fast) and cfg.port_is_free(main) and cfg.port_is_free(ha, "0.0.0.0")


class _FirstThen(random.Random):
    """A random source whose first ``randrange`` answer is fixed, the rest random.

    The busy-port tests bind a port the system hands out (so it cannot already be
    taken by someone else) and make it the picker's first candidate.
    """

    def __init__(self, first: int) -> None:
        super().__init__()
        self._first: int | None = first

    def randrange(self, *args: Any, **kwargs: Any) -> int:
        if self._first is not None:
            first, self._first = self._first, None
            return first
        return super().randrange(*args, **kwargs)


def test_pick_broker_port_skips_a_busy_ha_port() -> None:
    with socket.socket() as s:
        s.bind(("0.0.0.0", 0))
        s.listen()
        first = s.getsockname()[1] - 1  # the candidate whose HA port is the bound one
        picked = cfg.pick_broker_port(rng=_FirstThen(first))
    assert picked != first


def test_pick_broker_port_skips_a_busy_fast_port() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        first = s.getsockname()[1] + 2  # the candidate whose fast port is the bound one
        picked = cfg.pick_broker_port(rng=_FirstThen(first))
    assert picked != first


def test_pick_broker_port_honours_exclude() -> None:
    first = random.Random(5).randrange(20000, 60000)
    assert cfg.pick_broker_port(rng=random.Random(5), exclude=[first + 1]) != first


# ---------------------------------------------------------------- POM and jar cache


def test_render_pom_lists_the_artifacts() -> None:
    pom = maven.render_pom("5.3.3")
    root = ET.fromstring(pom)
    ns = {"m": "http://maven.apache.org/POM/4.0.0"}
    assert root.findtext("m:packaging", namespaces=ns) == "pom"
    deps = [
        (d.findtext("m:groupId", namespaces=ns), d.findtext("m:artifactId", namespaces=ns),
         d.findtext("m:version", namespaces=ns))
        for d in root.iterfind("m:dependencies/m:dependency", ns)
    ]
    assert deps == [("org.apache.rocketmq", a, "5.3.3") for a in
                    ("rocketmq-namesrv", "rocketmq-broker", "rocketmq-tools", "rocketmq-client")]


@pytest.mark.parametrize("bad", ["", "5.3.3<", "../x", "5.3 .3"])
def test_render_pom_rejects_bad_versions(bad: str) -> None:
    with pytest.raises(ValueError):
        maven.render_pom(bad)


def test_cache_location(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("RMQ_ASYNC_CACHE", str(tmp_path / "c"))
    assert maven.version_dir("5.3.3") == tmp_path / "c" / "rocketmq-5.3.3"
    monkeypatch.delenv("RMQ_ASYNC_CACHE")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert maven.version_dir("5.3.3") == tmp_path / "xdg" / "rmq_async" / "rocketmq-5.3.3"
    assert maven.version_dir("5.3.3", tmp_path / "o") == tmp_path / "o" / "rocketmq-5.3.3"


def _fake_path(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, tools: dict[str, str]) -> Path:
    """PATH holding only the given executables (name -> script body)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    for name, body in tools.items():
        exe = bin_dir / name
        exe.write_text("#!/bin/sh\n" + body)
        exe.chmod(0o755)
    monkeypatch.setenv("PATH", str(bin_dir))
    monkeypatch.delenv("JAVA_HOME", raising=False)
    monkeypatch.delenv("MAVEN_HOME", raising=False)
    return bin_dir


# A stand-in for Maven: logs its arguments, then "downloads" two jars into -DoutputDirectory.
_FAKE_MVN = textwrap.dedent("""\
    echo "$@" >> "${0%/*}/mvn.calls"
    for a in "$@"; do
      case "$a" in -DoutputDirectory=*) out="${a#-DoutputDirectory=}";; esac
    done
    echo jar > "$out/rocketmq-broker-5.3.3.jar"
    echo jar > "$out/netty-all.jar"
    """)


async def test_ensure_jars_without_mvn_names_maven(monkeypatch: pytest.MonkeyPatch,
                                                   tmp_path: Path) -> None:
    _fake_path(monkeypatch, tmp_path, {"java": "exit 0"})
    with pytest.raises(DevBrokerError, match=r"`mvn` not found.*Maven"):
        await ensure_jars("5.3.3", tmp_path / "cache")
    with pytest.raises(DevBrokerError, match="`mvn` not found"):
        ensure_jars_sync("5.3.3", tmp_path / "cache")


async def test_ensure_jars_without_java_names_java(monkeypatch: pytest.MonkeyPatch,
                                                   tmp_path: Path) -> None:
    _fake_path(monkeypatch, tmp_path, {"mvn": _FAKE_MVN})
    with pytest.raises(DevBrokerError, match=r"`java` not found.*Java"):
        await ensure_jars("5.3.3", tmp_path / "cache")


async def test_ensure_jars_fetches_once(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    bin_dir = _fake_path(monkeypatch, tmp_path, {"mvn": _FAKE_MVN, "java": "exit 0"})
    lib = await ensure_jars("5.3.3", tmp_path / "cache")
    vdir = tmp_path / "cache" / "rocketmq-5.3.3"
    assert lib == vdir / "lib"
    assert sorted(p.name for p in lib.glob("*.jar")) == ["netty-all.jar",
                                                         "rocketmq-broker-5.3.3.jar"]
    assert (vdir / "pom.xml").read_text() == maven.render_pom("5.3.3")
    calls = (bin_dir / "mvn.calls").read_text().splitlines()
    assert len(calls) == 1
    argv = calls[0].split()
    assert f"{maven.DEPENDENCY_PLUGIN}:copy-dependencies" in argv
    assert "-DincludeScope=runtime" in argv
    # A corrupt download fails (not a warning under -q); a failure cached by Maven is retried.
    assert "--strict-checksums" in argv and "--update-snapshots" in argv
    assert argv[argv.index("-f") + 1] == str(vdir / "pom.xml")
    marker = json.loads((lib / maven.MARKER_NAME).read_text())
    assert marker["version"] == "5.3.3"

    # Warm: neither the async nor the sync form runs Maven again.
    assert await ensure_jars("5.3.3", tmp_path / "cache") == lib
    assert ensure_jars_sync("5.3.3", tmp_path / "cache") == lib
    assert len((bin_dir / "mvn.calls").read_text().splitlines()) == 1

    # A jar gone missing invalidates the marker: fetched again.
    (lib / "netty-all.jar").unlink()
    assert ensure_jars_sync("5.3.3", tmp_path / "cache") == lib
    assert len((bin_dir / "mvn.calls").read_text().splitlines()) == 2
    assert (lib / "netty-all.jar").is_file()


async def test_ensure_jars_reports_maven_failure(monkeypatch: pytest.MonkeyPatch,
                                                 tmp_path: Path) -> None:
    _fake_path(monkeypatch, tmp_path, {
        "mvn": "echo 'Could not resolve dependencies for project'; exit 1",
        "java": "exit 0",
    })
    with pytest.raises(DevBrokerError, match=r"(?s)exit 1.*Could not resolve dependencies"):
        await ensure_jars("5.3.3", tmp_path / "cache")
    vdir = tmp_path / "cache" / "rocketmq-5.3.3"
    assert not (vdir / "lib").exists()
    assert not list(vdir.glob("lib.partial-*"))


async def test_a_fetch_waiting_for_the_lock_ends_with_its_timeout(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Another process fetching the same version holds its lock: the wait was a blocking
    flock in a worker thread, which a timeout around the start could not end (it returned
    when the other process let go, seconds later)."""
    import fcntl

    _fake_path(monkeypatch, tmp_path, {"mvn": "exit 1", "java": "exit 0"})
    vdir = tmp_path / "cache" / "rocketmq-5.3.3"
    vdir.mkdir(parents=True)
    (vdir / "lib.partial-999999").mkdir()  # left by a fetch whose process died
    holder = os.open(vdir / ".lock", os.O_WRONLY | os.O_CREAT)  # held across the wait below
    try:
        fcntl.flock(holder, fcntl.LOCK_EX)
        started = time.monotonic()
        with anyio.move_on_after(0.5):
            await ensure_jars("5.3.3", tmp_path / "cache")
        assert time.monotonic() - started < 5.0  # (before: until the holder let go)
    finally:
        os.close(holder)
    with pytest.raises(DevBrokerError, match="exit 1"):  # the lock is free again: it runs
        await ensure_jars("5.3.3", tmp_path / "cache")
    assert not list(vdir.glob("lib.partial-*"))  # its own and the dead fetch's


async def test_a_maven_run_over_its_time_limit_is_a_clear_failure(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    _fake_path(monkeypatch, tmp_path, {"mvn": f"exec {sys.executable} -c 'import time; time.sleep(30)'",
                                       "java": "exit 0"})
    monkeypatch.setattr(maven, "MAVEN_TIMEOUT", 0.5)
    with pytest.raises(DevBrokerError, match=r"within 0\.5 s"):
        await ensure_jars("5.3.3", tmp_path / "cache")
    with pytest.raises(DevBrokerError, match=r"within 0\.5 s"):
        ensure_jars_sync("5.3.3", tmp_path / "cache")
    assert not list((tmp_path / "cache" / "rocketmq-5.3.3").glob("lib.partial-*"))


def test_maven_ends_with_a_killed_fetch(monkeypatch: pytest.MonkeyPatch,
                                        tmp_path: Path) -> None:
    """A fetch whose process is killed (Ctrl-C twice, a CI job cancelled) left Maven
    downloading on its own; it gets SIGTERM now, as the JVMs get their parent-death signal."""
    bin_dir = _fake_path(monkeypatch, tmp_path, {
        "mvn": f'echo $$ > "${{0%/*}}/mvn.pid"; exec {sys.executable} -c '
               "'import time; time.sleep(60)'",
        "java": "exit 0"})
    fetch = subprocess.Popen(
        [sys.executable, "-c", "import sys; from rmq_async.devbroker import ensure_jars_sync; "
                               "ensure_jars_sync('5.3.3', sys.argv[1])", str(tmp_path / "cache")],
        env={**os.environ})
    pid_file = bin_dir / "mvn.pid"
    try:
        deadline = time.monotonic() + 30
        while not (pid_file.exists() and pid_file.read_text().strip()):
            assert time.monotonic() < deadline and fetch.poll() is None, "Maven never started"
            time.sleep(0.02)
        mvn = int(pid_file.read_text())
        assert procs.pid_alive(mvn)
        fetch.kill()
        fetch.wait()
        deadline = time.monotonic() + 10
        while procs.pid_alive(mvn):
            assert time.monotonic() < deadline, "Maven outlived the fetch that started it"
            time.sleep(0.02)
    finally:
        fetch.kill()
        fetch.wait()
        if pid_file.exists() and pid_file.read_text().strip():
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(pid_file.read_text()), signal.SIGKILL)


@pytest.mark.parametrize(("java", "javac", "error"), [
    ('echo \'openjdk version "17.0.15" 2025-04-15\' >&2', "exit 0", None),
    ('echo \'openjdk version "21" 2023-09-19\' >&2', "exit 0", None),
    ('echo \'openjdk version "11.0.2" 2019-01-15\' >&2', "exit 0", "is Java 11"),
    ('echo \'java version "1.8.0_392"\' >&2', "exit 0", "is Java 8"),
    ('echo \'openjdk version "17.0.15"\' >&2', None, "a Java compiler"),
])
def test_setup_names_a_missing_compiler_or_an_old_java(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path, java: str, javac: str | None,
        error: str | None) -> None:
    """``make setup`` (``fetch``) checks the JDK: a runtime without ``javac`` passed it and then
    failed every broker start; Java 11 passed it and failed the Spark extra (PySpark 4 needs
    17); Java 8 failed the 5.x name server's flags."""
    tools = {"java": java} | ({"javac": javac} if javac is not None else {})
    _fake_path(monkeypatch, tmp_path, tools)
    if error is None:
        maven.check_jdk()
    else:
        with pytest.raises(DevBrokerError, match=error):
            maven.check_jdk()


def test_java_home_is_preferred(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    _fake_path(monkeypatch, tmp_path, {"java": "exit 0"})
    home = tmp_path / "jdk"
    (home / "bin").mkdir(parents=True)
    (home / "bin" / "java").write_text("#!/bin/sh\n")
    (home / "bin" / "java").chmod(0o755)
    monkeypatch.setenv("JAVA_HOME", str(home))
    assert maven.find_tool("java") == home / "bin" / "java"


# ---------------------------------------------------------------- tool output parsing


def test_parse_lenient_json_quotes_integer_keys() -> None:
    text = '{"brokerAddrs":{0:"127.0.0.1:1", 12 :"x"},"s":"k,1:\\"","l":[1,2,{3:4}]}'
    assert parse_lenient_json(text) == {
        "brokerAddrs": {"0": "127.0.0.1:1", "12": "x"}, "s": 'k,1:"', "l": [1, 2, {"3": 4}],
    }


def test_cli_parsing() -> None:
    assert _parse_kv(["a=1", "b=x=y"]) == {"a": "1", "b": "x=y"}
    with pytest.raises(SystemExit):
        _parse_kv(["novalue"])
    args = build_parser().parse_args(["up", "--version", "5.3.2", "--broker-config", "k=v"])
    assert (args.command, args.version, args.broker_config) == ("up", "5.3.2", ["k=v"])


def test_java_command_rejects_bad_class(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    _fake_path(monkeypatch, tmp_path, {"java": "exit 0"})
    cmd = java_command("a.b.Main", ["x"], ["/c", "/lib/*"], user_home=tmp_path)
    assert cmd[-2:] == ["a.b.Main", "x"]
    assert cmd[cmd.index("-cp") + 1] == "/c:/lib/*"
    assert "-Drmq.logback.configurationFile=rmq.client.logback.xml" in cmd
    with pytest.raises(ValueError):
        java_command("bad name;rm", [], "/x", user_home=tmp_path)


# ---------------------------------------------------------------- processes


@pytest.fixture
def run_root(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    root = tmp_path / "runs"
    monkeypatch.setenv("RMQ_ASYNC_RUN_DIR", str(root))
    return root


def _sleeper(tag: Path) -> subprocess.Popen[bytes]:
    """A process whose command line mentions ``tag`` (as a JVM's mentions its run folder),
    returned once it does: right after the fork the child still shows this process's command
    line, and the reaper kills only processes that mention their run folder."""
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)", str(tag)])
    deadline = time.monotonic() + 10
    while str(tag) not in procs.pid_cmdline(proc.pid):
        assert time.monotonic() < deadline, "the sleeper never showed its command line"
        time.sleep(0.01)
    return proc


async def test_a_refused_account_request_does_not_quote_its_secret(tmp_path: Path) -> None:
    """The admin helper's ERR answer to a ``user`` request became a DevBrokerError quoting
    every word of the request, the account's secret key included (out of start_all into
    pytest's, the CLI's and CI's output)."""
    from rmq_async.devbroker import AclAccount

    async def answer(stream: Any) -> None:
        async with stream:
            await stream.receive()
            await stream.send(b"ERR AuthenticationException: user exists\n")

    listener = await anyio.create_tcp_listener(local_host="127.0.0.1")
    port = listener.extra(anyio.abc.SocketAttribute.local_port)
    async with anyio.create_task_group() as tg:
        tg.start_soon(listener.serve, answer)
        rmq = LocalRocketMQ(acl=AclAccount("alice", "S3cr3t-Passw0rd", admin=False))
        rmq._workdir, rmq._broker_port = tmp_path, 10911  # as if started
        rmq._admin._port = port  # the helper's port
        with pytest.raises(DevBrokerError, match="user exists") as raised:
            await rmq._create_account(rmq.acl)  # type: ignore[arg-type]
        tg.cancel_scope.cancel()
    assert "S3cr3t-Passw0rd" not in str(raised.value) and "alice" in str(raised.value)


def _stand_in_jvms(monkeypatch: pytest.MonkeyPatch, run_root: Path) -> None:
    """Processes in the JVMs' place: name servers say they booted, brokers (and the admin
    helper) never do; their command line carries the run folder, as the JVMs' do."""
    from rmq_async.devbroker import broker as broker_mod
    from rmq_async.devbroker import cluster as cluster_mod

    def fake_jvm(java: Any, *, lib_dir: Any, main_class: str, args: Any, user_home: Path,
                 **kw: Any) -> list[str]:
        code = "import time; time.sleep(600)"
        if main_class == cfg.NAMESRV_CLASS:
            code = "print('The Name Server boot success', flush=True); " + code
        return [sys.executable, "-c", code, f"-Duser.home={user_home}"]

    async def jars(*args: Any, **kw: Any) -> Path:
        return run_root / "lib"

    async def port_open(*args: Any) -> bool:
        return True

    monkeypatch.setattr(cfg, "jvm_command", fake_jvm)
    for mod in (broker_mod, cluster_mod):
        monkeypatch.setattr(mod, "ensure_jars", jars)
        monkeypatch.setattr(mod, "compile_java", jars)
        monkeypatch.setattr(mod, "find_tool", lambda name: Path(sys.executable))
    monkeypatch.setattr(broker_mod.LocalRocketMQ, "_port_open", port_open)
    monkeypatch.setattr(cluster_mod, "_port_open", port_open)


def test_a_detached_start_killed_halfway_is_reaped(run_root: Path) -> None:
    """``broker up`` killed (SIGKILL, a lost terminal) while its broker was starting left a
    detached name server and broker that nothing stopped: no state file yet, and the reaper
    leaves detached runs with live processes to ``down``. The starting process owns the run
    until it is up, so the next start's reaper stops them."""
    child = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
        import sys, anyio
        from pathlib import Path
        from rmq_async.devbroker import broker as broker_mod, config as cfg

        def fake_jvm(java, *, lib_dir, main_class, args, user_home, **kw):
            code = "import time; time.sleep(600)"
            if main_class == cfg.NAMESRV_CLASS:
                code = "print('The Name Server boot success', flush=True); " + code
            return [sys.executable, "-c", code, f"-Duser.home={{user_home}}"]

        async def jars(*a, **kw):
            return Path({str(run_root)!r}) / "lib"

        async def port_open(*a):
            return True

        cfg.jvm_command = fake_jvm
        broker_mod.ensure_jars = broker_mod.compile_java = jars
        broker_mod.find_tool = lambda name: Path(sys.executable)
        broker_mod.LocalRocketMQ._port_open = port_open
        anyio.run(broker_mod.LocalRocketMQ(detached=True, ready_timeout=300).start_all)
    """)])
    registry = run_root / "registry"
    deadline = time.monotonic() + 20
    while True:  # until the broker stand-in runs (recorded in the run's registry entry)
        records = [procs.RunRecord.from_json(f.read_text()) for f in registry.glob("*.json")]
        if records and "broker" in records[0].pids:
            break
        assert time.monotonic() < deadline, "the start never reached its broker"
        time.sleep(0.05)
    child.kill()
    child.wait()
    (record,) = records
    assert all(procs.pid_alive(pid) for pid in record.pids.values())
    assert [r.run_id for r in procs.reap_stale_runs()] == [record.run_id]
    deadline = time.monotonic() + 10
    while any(procs.pid_alive(pid) for pid in record.pids.values()):
        assert time.monotonic() < deadline, "the reaper left the stand-ins running"
        time.sleep(0.05)
    assert not record.workdir.exists()


async def test_a_cluster_start_out_of_time_says_which_brokers_were_not_ready(
        monkeypatch: pytest.MonkeyPatch, run_root: Path) -> None:
    """The start's overall limit fired before any broker's own deadline: a bare TimeoutError
    with no broker named and no log lines (a traceback from ``rmq-async broker up``)."""
    from rmq_async.devbroker import cluster as cluster_mod

    _stand_in_jvms(monkeypatch, run_root)
    cluster = cluster_mod.LocalCluster(groups=1, slaves=1, namesrvs=1, ready_timeout=1.5)
    with pytest.raises(DevBrokerError, match=r"not ready within 1.5 s: broker\(s\) .*not registered"):
        await cluster.start_all()


@pytest.mark.parametrize("kind", ["broker", "cluster"])
async def test_a_cancelled_start_stops_what_it_started(
        monkeypatch: pytest.MonkeyPatch, run_root: Path, kind: str) -> None:
    """A start cancelled from outside (a timeout around ``start_all()``) ran its clean-up in
    the cancelled scope: its first await was cancelled too, and the name server and broker
    ran on until the test process ended. Stand-ins take the JVMs' place (each says it is
    ready, or never does, like the real ones; their command line carries the run folder)."""
    from rmq_async.devbroker import cluster as cluster_mod

    _stand_in_jvms(monkeypatch, run_root)
    target: Any = (LocalRocketMQ() if kind == "broker"
                   else cluster_mod.LocalCluster(groups=1, slaves=1, namesrvs=1))
    with anyio.move_on_after(2.0):
        await target.start_all()
    workdir = target._workdir
    assert workdir is not None
    left = [pid for pid in map(int, filter(str.isdigit, os.listdir("/proc")))
            if str(workdir) in procs.pid_cmdline(pid)]
    assert left == [] and not workdir.exists()
    assert list((run_root / "registry").glob("*.json")) == []


@pytest.mark.parametrize("mode", [0o777, 0o775, 0o757])
def test_a_run_folder_others_may_write_to_is_refused(monkeypatch: pytest.MonkeyPatch,
                                                     tmp_path: Path, mode: int) -> None:
    """The run records say which processes a start kills and which folders it deletes: a
    shared run folder another local user created first (or can write to) would let them
    choose both."""
    root = tmp_path / "shared"
    root.mkdir()
    root.chmod(mode)
    monkeypatch.setenv("RMQ_ASYNC_RUN_DIR", str(root))
    with pytest.raises(DevBrokerError, match="not a private folder"):
        procs.reap_stale_runs()
    root.chmod(0o700)
    assert procs.reap_stale_runs() == []
    fresh = tmp_path / "fresh"
    monkeypatch.setenv("RMQ_ASYNC_RUN_DIR", str(fresh))
    assert procs.runs_root() == fresh and stat.S_IMODE(fresh.stat().st_mode) == 0o700


def test_run_record_round_trip(run_root: Path, tmp_path: Path) -> None:
    rec = procs.RunRecord(run_id="r1", workdir=tmp_path / "w", owner_pid=os.getpid(),
                          owner_start=procs.pid_start_ticks(os.getpid()), remove_workdir=True,
                          pids={"broker": 12}, info={"namesrv_addr": "127.0.0.1:1"})
    rec.save()
    assert rec.registry_file.parent == run_root / "registry"
    again = procs.RunRecord.from_json(rec.registry_file.read_text())
    assert again == rec
    assert again.owner_alive()
    rec.forget()
    assert not rec.registry_file.exists()
    assert not (tmp_path / "w").exists()


def test_reap_stale_runs_kills_orphans_only(run_root: Path, tmp_path: Path) -> None:
    dead_owner = subprocess.Popen([sys.executable, "-c", "pass"])
    dead_owner.wait()
    stale_dir = tmp_path / "stale"
    live_dir = tmp_path / "live"
    stale_dir.mkdir()
    live_dir.mkdir()
    orphan = _sleeper(stale_dir)
    kept = _sleeper(live_dir)
    try:
        procs.RunRecord(run_id="stale", workdir=stale_dir, owner_pid=dead_owner.pid,
                        remove_workdir=True, pids={"broker": orphan.pid}).save()
        procs.RunRecord(run_id="live", workdir=live_dir, owner_pid=os.getpid(),
                        owner_start=procs.pid_start_ticks(os.getpid()), remove_workdir=True,
                        pids={"broker": kept.pid}).save()
        reaped = procs.reap_stale_runs()
        assert [r.run_id for r in reaped] == ["stale"]
        assert orphan.wait(timeout=10) is not None
        assert not stale_dir.exists()
        assert kept.poll() is None
        assert live_dir.exists()
    finally:
        for p in (orphan, kept):
            p.kill()
            p.wait()


def test_reap_never_signals_a_recycled_pid(run_root: Path, tmp_path: Path) -> None:
    unrelated = _sleeper(tmp_path / "elsewhere")
    try:
        procs.RunRecord(run_id="s", workdir=tmp_path / "gone", owner_pid=None,
                        remove_workdir=True, pids={"broker": 2**22 + 7}).save()
        procs.RunRecord(run_id="t", workdir=tmp_path / "gone2", owner_pid=999_999_999,
                        remove_workdir=True, pids={"broker": unrelated.pid}).save()
        reaped = procs.reap_stale_runs()
        assert sorted(r.run_id for r in reaped) == ["s", "t"]
        assert unrelated.poll() is None  # its command line does not mention the run folder
    finally:
        unrelated.kill()
        unrelated.wait()


def test_a_detached_run_whose_pids_were_reused_is_reaped(run_root: Path,
                                                         tmp_path: Path) -> None:
    """A detached run is left to `down` while one of its JVMs runs; a pid now used by an
    unrelated process (its command line does not name the run folder) made the reaper keep
    a dead run's record and folder for good. Its JVM that still runs keeps it, as before."""
    unrelated = _sleeper(tmp_path / "elsewhere")
    up_dir = tmp_path / "up"
    up_dir.mkdir()
    jvm = _sleeper(up_dir)
    try:
        dead_dir = tmp_path / "dead"
        dead_dir.mkdir()
        procs.RunRecord(run_id="dead", workdir=dead_dir, owner_pid=None, remove_workdir=True,
                        pids={"broker": unrelated.pid}).save()
        procs.RunRecord(run_id="up", workdir=up_dir, owner_pid=None, remove_workdir=True,
                        pids={"namesrv": unrelated.pid, "broker": jvm.pid}).save()
        assert [r.run_id for r in procs.reap_stale_runs()] == ["dead"]
        assert not dead_dir.exists() and up_dir.exists()
        assert unrelated.poll() is None and jvm.poll() is None  # nobody signalled
    finally:
        for p in (unrelated, jvm):
            p.kill()
            p.wait()


def _stubborn() -> subprocess.Popen[bytes]:
    """A child that ignores SIGTERM (prints "up" once the handler is in place)."""
    return subprocess.Popen(
        [sys.executable, "-c",
         "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
         "print('up', flush=True); time.sleep(120)"],
        stdout=subprocess.PIPE,
    )


async def test_stop_process_escalates_to_sigkill(tmp_path: Path) -> None:
    stubborn = _stubborn()
    assert stubborn.stdout is not None
    assert await anyio.to_thread.run_sync(stubborn.stdout.readline) == b"up\n"
    started = time.monotonic()
    rc = await procs.stop_process(stubborn, grace=0.5)
    assert rc == -signal.SIGKILL
    assert 0.4 < time.monotonic() - started < 10
    stubborn.stdout.close()


async def test_stop_process_polite_exit(tmp_path: Path) -> None:
    polite = procs.spawn([sys.executable, "-c", "import time; time.sleep(120)"], cwd=tmp_path,
                         env=os.environ, output=tmp_path / "out", die_with_parent=True)
    assert await procs.stop_process(polite, grace=10) == -signal.SIGTERM


def test_child_dies_with_its_parent(tmp_path: Path) -> None:
    """The parent-death signal: a spawned child goes when the spawning process is killed."""
    script = textwrap.dedent(f"""\
        import importlib.util, os, pathlib, sys, time
        spec = importlib.util.spec_from_file_location("devprocs", {procs.__file__!r})
        mod = importlib.util.module_from_spec(spec)
        sys.modules["devprocs"] = mod
        spec.loader.exec_module(mod)
        child = mod.spawn([sys.executable, "-c", "import time; time.sleep(120)"],
                          cwd={str(tmp_path)!r}, env=os.environ,
                          output=pathlib.Path({str(tmp_path / "child.out")!r}),
                          die_with_parent=True)
        print(child.pid, flush=True)
        time.sleep(120)
        """)
    parent = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE)
    try:
        assert parent.stdout is not None
        child_pid = int(parent.stdout.readline())
        assert procs.pid_alive(child_pid)
    finally:
        parent.send_signal(signal.SIGKILL)
        parent.wait()
    deadline = time.monotonic() + 10
    while procs.pid_alive(child_pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not procs.pid_alive(child_pid)


# ---------------------------------------------------------------- ACL


def test_acl_broker_config_enables_authn_and_authz() -> None:
    from rmq_async.devbroker.broker import acl_broker_config

    values = acl_broker_config("root", "s3cret-pw")
    assert values["authenticationEnabled"] == "true"
    assert values["authorizationEnabled"] == "true"
    assert values["authenticationMetadataProvider"].endswith("LocalAuthenticationMetadataProvider")
    assert values["authorizationMetadataProvider"].endswith("LocalAuthorizationMetadataProvider")
    assert json.loads(values["initAuthenticationUser"]) == {"username": "root",
                                                            "password": "s3cret-pw"}
    assert json.loads(values["innerClientAuthenticationCredentials"]) == {
        "accessKey": "root", "secretKey": "s3cret-pw"}
    # Survives .properties rendering unchanged (no escaping needed for JSON values).
    rendered = cfg.render_properties(values)
    assert 'initAuthenticationUser={"username":"root","password":"s3cret-pw"}\n' in rendered


def test_acl_settings_reach_the_broker_config_and_can_be_overridden() -> None:
    from rmq_async.devbroker import AclAccount

    rmq = LocalRocketMQ(acl=AclAccount("ak", "sk-123456"),
                        broker_config={"authorizationEnabled": "false"})
    assert rmq._overrides["authenticationEnabled"] == "true"
    assert rmq._overrides["authorizationEnabled"] == "false"
    assert "authenticationEnabled" not in LocalRocketMQ()._overrides


@pytest.mark.parametrize(("ak", "sk"), [("", "secret1"), ("a b", "secret1"), ("a", "sh"),
                                        ('a"', "secret1"), ("a", "sec ret1")])
def test_acl_account_validation(ak: str, sk: str) -> None:
    from rmq_async.devbroker import AclAccount

    with pytest.raises(ValueError):
        AclAccount(ak, sk)



def test_module_cli_usage_errors_exit_2(monkeypatch: pytest.MonkeyPatch,
                                        capsys: pytest.CaptureFixture[str]) -> None:
    """``python -m rmq_async.devbroker`` answers as ``rmq-async broker`` does: 2 for a usage
    error found before anything starts."""
    from rmq_async.devbroker import cli

    monkeypatch.setattr(cli.structlog, "configure", lambda **kw: None)  # keep the suite's
    monkeypatch.setattr(cli, "_load_state", lambda: None)
    assert cli.main(["up", "--groups", "0"]) == 2
    assert "--groups and --namesrvs must be >= 1" in capsys.readouterr().err
    assert cli.main(["up", "--broker-config", "novalue"]) == 2
    assert "expects key=value" in capsys.readouterr().err
    # Refused by the cluster's or the broker's own checks, before a jar or a JVM (they were
    # a ValueError traceback, or exit 1 after the Maven step and javac).
    for argv, said in [(["up", "--slaves", "5"], "slaves must be within"),
                       (["up", "--groups", "70"], "groups must be within"),
                       (["up", "--groups", "2", "--broker-config", "brokerName=x"],
                        "may not set 'brokerName'"),
                       (["up", "--broker-config", "listenPort=1"], "may not override"),
                       (["up", "--version", "foo"], "not a RocketMQ release version"),
                       (["up", "--version", "4.8.0"], "not supported"),
                       (["fetch", "--version", "4.8.0"], "not supported")]:
        assert cli.main(argv) == 2, argv
        assert said in capsys.readouterr().err, argv


def test_the_state_file_is_judged_by_processes_that_name_its_run(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
        capsys: pytest.CaptureFixture[str]) -> None:
    """Recorded pids now used by other processes (pid reuse) made ``status`` and ``up`` report
    a broker that is gone; and ``status`` of a crashed run deleted its folder, logs and all."""
    from rmq_async.devbroker import cli

    monkeypatch.setenv("RMQ_ASYNC_STATE_FILE", str(tmp_path / "state.json"))
    workdir = tmp_path / "run"
    (workdir / "logs").mkdir(parents=True)
    reused = procs.RunRecord(run_id="r", workdir=workdir, owner_pid=None, owner_start=None,
                             remove_workdir=True, pids={"namesrv": os.getpid(),
                                                        "broker": os.getppid()},
                             info={"namesrv_addr": "127.0.0.1:9876"})
    cli.state_file().write_text(reused.to_json())
    assert not cli._running(reused)  # alive, but not processes of this run
    assert cli.running_namesrv() is None
    assert cli.cmd_status(argparse.Namespace()) == 1
    assert "not running" in capsys.readouterr().out
    assert (workdir / "logs").exists() and cli.state_file().exists()  # left for a look
    with _sleeper(workdir) as one, _sleeper(workdir) as two:
        mine = procs.RunRecord(run_id="r", workdir=workdir, owner_pid=None, owner_start=None,
                               remove_workdir=True, pids={"namesrv": one.pid,
                                                          "broker": two.pid})
        assert cli._running(mine)
        one.kill()
        two.kill()


def test_up_with_a_run_up_reports_it_only_when_it_is_what_was_asked_for(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
        capsys: pytest.CaptureFixture[str]) -> None:
    """A second ``up`` printed the running broker's addresses whatever it asked for (another
    version, a cluster, other settings), which a script then used as if it had them."""
    from rmq_async.devbroker import cli

    monkeypatch.setattr(cli.structlog, "configure", lambda **kw: None)
    monkeypatch.setenv("RMQ_ASYNC_STATE_FILE", str(tmp_path / "state.json"))
    started = vars(cli.build_parser().parse_args(["up"]))
    running = procs.RunRecord(run_id="r", workdir=tmp_path / "run", owner_pid=None,
                              owner_start=None, remove_workdir=True, pids={},
                              info={"namesrv_addr": "127.0.0.1:9876",
                                    "up_options": cli._wanted(argparse.Namespace(**started))})
    monkeypatch.setattr(cli, "_load_state", lambda: running)
    monkeypatch.setattr(cli, "_running", lambda record: True)
    assert cli.main(["up", "--timeout", "30"]) == 0  # the same run: its addresses
    assert "NAMESRV_ADDR=127.0.0.1:9876" in capsys.readouterr().out
    for argv, said in [(["up", "--groups", "2"], "--groups 1 (asked: 2)"),
                       (["up", "--broker-config", "maxMessageSize=1024"], "--broker-config"),
                       (["up", "--heap", "1g"], "--heap None (asked: '1g')")]:
        assert cli.main(argv) == 1, argv
        out, err = capsys.readouterr()
        assert out == "" and "already running with other options" in err and said in err, err
    del running.info["up_options"]  # a state file from before the options were recorded
    assert cli.main(["up", "--groups", "2"]) == 0


def test_up_keeps_an_explicit_timeout_for_a_cluster_too(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """``--timeout`` below 180 s was raised to 180 s for a cluster, silently."""
    from rmq_async.devbroker import cli
    from rmq_async.devbroker.errors import DevBrokerError

    asked: list[float] = []

    def shape(version: str, **kw: Any) -> None:
        asked.append(kw["ready_timeout"])
        raise DevBrokerError("stop here")

    monkeypatch.setattr(cli.structlog, "configure", lambda **kw: None)
    monkeypatch.setattr(cli, "LocalCluster", shape)
    monkeypatch.setattr(cli, "LocalRocketMQ", shape)
    for argv in (["up", "--groups", "2", "--timeout", "60"], ["up", "--groups", "2"],
                 ["up", "--timeout", "30"], ["up"]):
        assert cli.main(argv) == 2, argv  # the constructors' refusals are usage errors
    assert asked == [60.0, 180.0, 30.0, 90.0]
    capsys.readouterr()


def test_module_cli_failures_exit_1(monkeypatch: pytest.MonkeyPatch,
                                    capsys: pytest.CaptureFixture[str]) -> None:
    from rmq_async.devbroker import cli
    from rmq_async.devbroker.errors import DevBrokerError

    def fail(version: str) -> None:
        raise DevBrokerError("Maven failed")

    monkeypatch.setattr(cli.structlog, "configure", lambda **kw: None)
    monkeypatch.setattr(cli, "ensure_jars_sync", fail)
    assert cli.main(["fetch"]) == 1
    assert "Maven failed" in capsys.readouterr().err


def test_an_interrupted_blocking_start_still_runs_its_clean_up() -> None:
    """pytest-timeout's alarm (or Ctrl-C) raises inside ``run_blocking``'s loop while a
    broker starts: the start was abandoned with the loop closed under it, its shielded
    teardown never ran, and its JVMs lived on for the rest of the worker's session."""
    import asyncio

    from rmq_async.devbroker.pytest_plugin import run_blocking

    class Interrupted(KeyboardInterrupt):  # Ctrl-C; pytest's Failed from its alarm likewise
        pass                                # leaves the loop from its select()

    cleaned: list[str] = []

    def interrupt() -> None:
        raise Interrupted

    async def start() -> None:
        asyncio.get_running_loop().call_later(0.05, interrupt)
        try:
            await asyncio.sleep(30)  # a JVM that does not come up
        finally:
            with anyio.CancelScope(shield=True):
                await asyncio.sleep(0.01)  # the teardown's own awaits
                cleaned.append("stopped what it started")

    with pytest.raises(Interrupted):
        run_blocking(start())
    assert cleaned == ["stopped what it started"]

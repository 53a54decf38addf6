"""rmq_async.devbroker against the real NameServer + Broker JVMs."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import pytest

from rmq_async.devbroker import DevBrokerError, LocalRocketMQ
from rmq_async.devbroker.broker import parse_lenient_json
from rmq_async.devbroker.java import classpath, compile_java, run_java, start_java
from rmq_async.devbroker.procs import pid_alive, pid_cmdline, reap_stale_runs
from tests.helpers import (
    SHORT_LIVED_BROKER_CONFIG,
    SHORT_LIVED_BROKER_FLAGS,
    AdminClient,
    first_broker_port_taken,
)

pytestmark = pytest.mark.broker

REPO = Path(__file__).resolve().parents[2]


def _listening(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(1.0)
        return s.connect_ex(("127.0.0.1", port)) == 0


def _route_queues(route: dict[str, object], broker_name: str) -> list[dict[str, object]]:
    datas = route.get("queueDatas")
    assert isinstance(datas, list)
    return [q for q in datas if isinstance(q, dict) and q.get("brokerName") == broker_name]


async def _mqadmin_route(rmq: LocalRocketMQ, topic: str) -> dict[str, object]:
    out = await rmq.mqadmin("topicRoute", "-t", topic)
    route = parse_lenient_json(out[out.index("{"):])
    assert isinstance(route, dict)
    return route


async def test_shared_broker_is_registered(rocketmq: LocalRocketMQ) -> None:
    assert rocketmq.namesrv_addr.startswith("127.0.0.1:")
    assert rocketmq.broker_addr == f"127.0.0.1:{rocketmq.broker_port}"
    assert _listening(rocketmq.namesrv_port)
    assert _listening(rocketmq.broker_port)
    assert _listening(rocketmq.broker_port - 2)  # fast channel
    out = await rocketmq.mqadmin("clusterList")
    rows = [line.split() for line in out.splitlines() if rocketmq.broker_addr in line]
    assert rows, out
    assert rows[0][:4] == [rocketmq.cluster, rocketmq.broker_name, "0", rocketmq.broker_addr]
    # Logs and store live in the run folder (-Duser.home / storePathRootDir).
    assert (rocketmq.workdir / "logs" / "rocketmqlogs" / "broker.log").is_file()
    assert (rocketmq.workdir / "store" / "commitlog").is_dir()
    assert "boot success" in rocketmq.broker_log_tail(400)
    # The test broker runs without the timer wheel (no wheel file in its store) and with the
    # transaction-metrics flush every 500 ms (the running broker's own configuration, asked
    # with GET_BROKER_CONFIG); the name server with the quick-start JVM flags the broker does
    # not take.
    assert not (rocketmq.workdir / "store" / "timerwheel").exists()
    async with AdminClient(rocketmq.namesrv_addr) as admin:
        live = await admin.instance.api.get_broker_config(rocketmq.broker_addr)
    assert live["timerWheelEnable"] == "false"
    assert live["transactionMetricFlushInterval"] == "500"
    namesrv_cmd = pid_cmdline(rocketmq.pids["namesrv"])
    broker_cmd = pid_cmdline(rocketmq.pids["broker"])
    assert namesrv_cmd and broker_cmd
    assert "-XX:TieredStopAtLevel=1" in namesrv_cmd and "-XX:+UseSerialGC" in namesrv_cmd
    assert "-XX:TieredStopAtLevel=1" not in broker_cmd and "-XX:+UseG1GC" in broker_cmd


async def test_topic_fixture_has_eight_queues_in_route(rocketmq: LocalRocketMQ,
                                                       topic: str) -> None:
    route = await _mqadmin_route(rocketmq, topic)
    queues = _route_queues(route, rocketmq.broker_name)
    assert len(queues) == 1
    assert queues[0]["readQueueNums"] == 8 and queues[0]["writeQueueNums"] == 8
    brokers = route["brokerDatas"]
    assert isinstance(brokers, list)
    assert brokers[0]["brokerAddrs"] == {"0": rocketmq.broker_addr}


async def test_create_topic_queue_counts_and_order(rocketmq: LocalRocketMQ) -> None:
    name = f"T_devbroker_{os.getpid()}_{time.monotonic_ns() % 10**8}"
    times = []
    for n in (3, 16):  # re-creating updates the queue count
        started = time.monotonic()
        await rocketmq.create_topic(name, queues=n)
        times.append(time.monotonic() - started)
        queues = _route_queues(await _mqadmin_route(rocketmq, name), rocketmq.broker_name)
        assert [(q["readQueueNums"], q["writeQueueNums"]) for q in queues] == [(n, n)]
    ordered = name + "_fifo"
    await rocketmq.create_topic(ordered, queues=4, order=True)
    topics = parse_lenient_json(
        (rocketmq.workdir / "store" / "config" / "topics.json").read_text()
    )["topicConfigTable"]
    assert topics[ordered]["order"] is True and topics[name]["order"] is False
    assert topics[ordered]["readQueueNums"] == 4
    status = await rocketmq.mqadmin("topicStatus", "-t", ordered)
    assert status.count(rocketmq.broker_name) == 4, status
    print(f"create_topic seconds: {[round(t, 3) for t in times]}")


async def test_the_admin_helper_answers_its_own_client_only(rocketmq: LocalRocketMQ) -> None:
    """The helper's loopback port takes connections from every local user and signs its
    requests as the internal admin: a request without the token its starter gave it is
    refused; the starter's own requests work."""
    import anyio

    port = await rocketmq._admin.ready(10)
    for request in (b"ping\n", b"wrong-token\tping\n", b"\n"):
        async with await anyio.connect_tcp("127.0.0.1", port) as stream:
            await stream.send(request)
            answer = b""
            with anyio.fail_after(10):
                while True:
                    try:
                        answer += await stream.receive()
                    except anyio.EndOfStream:
                        break
        assert answer.startswith(b"ERR not this helper's client"), (request, answer)
    assert await rocketmq.admin_request("ping") is not None
    assert os.environ.get("RMQ_DEVADMIN_TOKEN") is None
    helper = rocketmq._admin.proc
    assert helper is not None and rocketmq._admin._token not in pid_cmdline(helper.pid)


async def test_create_topic_rejects_bad_input(rocketmq: LocalRocketMQ) -> None:
    with pytest.raises(ValueError):
        await rocketmq.create_topic("bad topic!", queues=8)
    with pytest.raises(ValueError):
        await rocketmq.create_topic("T_ok", queues=0)


@pytest.mark.slow(seconds=30)
async def test_broker_stop_start_keeps_port_and_store(rocketmq: LocalRocketMQ,
                                                      topic: str) -> None:
    port = rocketmq.broker_port
    old_pid = rocketmq.pids["broker"]
    try:
        await rocketmq.stop()
        assert not rocketmq.broker_running
        assert not pid_alive(old_pid)
        assert not _listening(port)
        assert _listening(rocketmq.namesrv_port)  # the name server stays up

        await rocketmq.start()
        assert rocketmq.broker_port == port and _listening(port)
        new_pid = rocketmq.pids["broker"]
        assert new_pid != old_pid
        # Same store: the topic made before the restart is served again without re-creating it.
        queues = _route_queues(await _mqadmin_route(rocketmq, topic), rocketmq.broker_name)
        assert [q["readQueueNums"] for q in queues] == [8]

        rocketmq.kill_broker()
        assert not pid_alive(new_pid)
        await rocketmq.start()
        assert rocketmq.broker_port == port and _listening(port)
        await rocketmq.create_topic(topic + "_after_kill", queues=2)
    finally:
        if not rocketmq.broker_running:
            await rocketmq.start()


def _system_temp_files() -> set[str]:
    return {p.name for p in Path(tempfile.gettempdir()).iterdir() if p.is_file()}


@pytest.mark.slow(seconds=26)
async def test_own_instance_retries_a_taken_port_and_cleans_up(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """An instance of one's own: a picked broker port taken by someone else before the broker
    binds it (two test workers starting brokers at once) costs a second start on other ports,
    not a failure; on exit no process, run folder or temp file of either start is left."""
    temp_before = _system_temp_files()
    with first_broker_port_taken(monkeypatch) as race:
        async with LocalRocketMQ(broker_config={"brokerName": "broker-own", **SHORT_LIVED_BROKER_CONFIG},
                                 broker_jvm_flags=SHORT_LIVED_BROKER_FLAGS) as rmq:
            race.assert_retried_for_taken_ports()
            assert rmq.broker_port == race.picks[-1]
            workdir = rmq.workdir
            # The broker's self-signed TLS certificate lands in the run folder, not in /tmp.
            assert list((workdir / "tmp").glob("keyutil_*.crt"))
            pids = dict(rmq.pids)
            assert set(pids) == {"namesrv", "broker", "admin"}
            assert all(str(workdir) in pid_cmdline(p) for p in pids.values())
            assert " -XX:TieredStopAtLevel=1 " in pid_cmdline(pids["broker"])  # broker_jvm_flags
            assert rmq.broker_name == "broker-own"
            await rmq.create_topic("T_own", queues=8)
            conf = (workdir / "broker.conf").read_text()
            assert "brokerName=broker-own\n" in conf
            assert f"listenPort={rmq.broker_port}\n" in conf
            assert f"haListenPort={rmq.broker_port + 1}\n" in conf
    assert not any(pid_alive(p) for p in pids.values())
    assert not workdir.exists()
    left = {n for n in _system_temp_files() - temp_before if n.startswith("keyutil_")}
    assert not left, f"files left in the system temp folder: {sorted(left)}"


async def test_start_failure_quotes_the_logs() -> None:
    rmq = LocalRocketMQ(heap="1m")  # the broker JVM refuses to start with a 1 MiB heap
    with pytest.raises(DevBrokerError) as info:
        await rmq.start_all()
    text = str(info.value)
    assert "the broker exited with status" in text
    assert "broker.out ---" in text
    assert "heap" in text.lower()
    pids = rmq.record.pids
    assert pids == {}
    assert not rmq.workdir.exists()


def test_jvms_die_with_an_owner_killed_by_sigkill(tmp_path: Path) -> None:
    """No orphan JVMs: SIGKILL the Python process that owns a LocalRocketMQ."""
    script = textwrap.dedent(f"""\
        import asyncio, json, sys
        sys.path.insert(0, {str(REPO)!r})
        from rmq_async.devbroker import LocalRocketMQ

        async def main():
            rmq = LocalRocketMQ()
            await rmq.start_all()
            info = {{"pids": rmq.pids, "workdir": str(rmq.workdir)}}
            print("STARTED " + json.dumps(info), flush=True)
            await asyncio.sleep(600)

        asyncio.run(main())
        """)
    owner = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE,
                             stderr=subprocess.DEVNULL, cwd=tmp_path)
    try:
        assert owner.stdout is not None
        line = b""
        while not line.startswith(b"STARTED "):
            line = owner.stdout.readline()
            assert line, "the owner process ended before starting the broker"
        info = parse_lenient_json(line.decode()[len("STARTED "):])
        pids = list(info["pids"].values())
        assert len(pids) == 3 and all(pid_alive(p) for p in pids)
    finally:
        owner.send_signal(signal.SIGKILL)
        owner.wait()
        if owner.stdout is not None:
            owner.stdout.close()
    deadline = time.monotonic() + 15
    while any(pid_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(pid_alive(p) for p in pids)
    # The next start reaps the dead owner's run folder.
    workdir = Path(info["workdir"])
    assert workdir.exists()
    reaped = reap_stale_runs()
    assert workdir in [r.workdir for r in reaped]
    assert not workdir.exists()


def _cli(*args: str, env: dict[str, str], timeout: float = 180) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "rmq_async.devbroker", *args], env=env,
                          cwd=REPO, capture_output=True, text=True, timeout=timeout, check=False)


def _kv(text: str) -> dict[str, str]:
    return dict(line.split("=", 1) for line in text.splitlines() if "=" in line)


def test_cli_up_status_down(tmp_path: Path) -> None:
    env = dict(os.environ)
    env["RMQ_ASYNC_STATE_FILE"] = str(tmp_path / "state.json")
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")])
    down = _cli("status", env=env)
    assert (down.returncode, down.stdout.strip()) == (1, "not running")

    up = _cli("up", env=env)
    assert up.returncode == 0, up.stderr
    addrs = _kv(up.stdout)
    namesrv_port = int(addrs["NAMESRV_ADDR"].rsplit(":", 1)[1])
    broker_port = int(addrs["BROKER_ADDR"].rsplit(":", 1)[1])
    workdir = Path(addrs["ROCKETMQ_WORKDIR"])
    try:
        assert _listening(namesrv_port) and _listening(broker_port)
        state = parse_lenient_json((tmp_path / "state.json").read_text())
        pids = list(state["pids"].values())
        assert len(pids) == 2 and all(pid_alive(p) for p in pids)

        status = _cli("status", env=env)
        assert status.returncode == 0 and _kv(status.stdout) == addrs
        again = _cli("up", env=env)  # idempotent: reports the running one
        assert again.returncode == 0 and _kv(again.stdout) == addrs
        other = _cli("up", "--groups", "2", env=env)  # not what runs: an error, not its addrs
        assert other.returncode == 1 and other.stdout == "", other.stderr
        assert "already running with other options: --groups 1 (asked: 2)" in other.stderr
    finally:
        stopped = _cli("down", env=env)
    assert stopped.returncode == 0 and stopped.stdout.strip() == "stopped", stopped.stderr
    assert not any(pid_alive(p) for p in pids)
    assert not workdir.exists()
    after = _cli("status", env=env)
    assert (after.returncode, after.stdout.strip()) == (1, "not running")


async def test_compile_and_run_java_against_the_client_jar(rocketmq: LocalRocketMQ,
                                                           tmp_path: Path) -> None:
    src = tmp_path / "PrintVersion.java"
    src.write_text(textwrap.dedent("""\
        import org.apache.rocketmq.common.MQVersion;

        public class PrintVersion {
            public static void main(String[] args) {
                String v = MQVersion.getVersionDesc(MQVersion.CURRENT_VERSION);
                System.out.println("VERSION " + v);
                System.err.println("args " + String.join(",", args));
                System.exit(args.length);
            }
        }
        """))
    out_dir = tmp_path / "classes"
    classes = await compile_java([src], rocketmq.lib_dir, out_dir)
    assert (classes / "PrintVersion.class").is_file()
    stamp = (classes / "PrintVersion.class").stat().st_mtime_ns
    assert await compile_java([src], rocketmq.lib_dir, out_dir) == classes  # cached
    assert (classes / "PrintVersion.class").stat().st_mtime_ns == stamp

    cp = classpath(rocketmq.lib_dir, classes)
    rc, out, err = await run_java("PrintVersion", ["a", "b"], cp, timeout=60)
    assert rc == 2
    assert out.strip() == f"VERSION V{rocketmq.version.replace('.', '_')}"
    assert "args a,b" in err


async def test_compile_error_is_reported(rocketmq: LocalRocketMQ, tmp_path: Path) -> None:
    src = tmp_path / "Broken.java"
    src.write_text("public class Broken { void f() { int x = ; } }\n")
    with pytest.raises(DevBrokerError, match="javac failed"):
        await compile_java([src], rocketmq.lib_dir, tmp_path / "classes")


async def test_long_running_java_process(rocketmq: LocalRocketMQ, tmp_path: Path) -> None:
    src = tmp_path / "Echo.java"
    src.write_text(textwrap.dedent("""\
        import java.io.BufferedReader;
        import java.io.InputStreamReader;

        public class Echo {
            public static void main(String[] args) throws Exception {
                System.out.println("READY " + args[0]);
                BufferedReader in = new BufferedReader(new InputStreamReader(System.in));
                for (String line; (line = in.readLine()) != null; ) {
                    System.out.println("ECHO " + line);
                }
                System.out.println("BYE");
            }
        }
        """))
    classes = await compile_java([src], rocketmq.lib_dir, tmp_path / "classes")
    async with start_java("Echo", [rocketmq.namesrv_addr], classpath(rocketmq.lib_dir, classes),
                          ) as jp:
        assert await jp.wait_for("READY", 60) == f"READY {rocketmq.namesrv_addr}"
        await jp.send("hello")
        assert await jp.wait_for("ECHO", 30) == "ECHO hello"
        with pytest.raises(DevBrokerError, match="printed no"):
            await jp.wait_for("NEVER", 0.3)
        pid = jp.pid
    assert jp.returncode == 0  # closing stdin let it finish on its own
    assert jp.lines[-1] == "BYE"
    assert not pid_alive(pid)


async def test_run_java_timeout_kills(rocketmq: LocalRocketMQ, tmp_path: Path) -> None:
    src = tmp_path / "Sleeper.java"
    src.write_text("public class Sleeper { public static void main(String[] a) throws Exception"
                   " { System.out.println(\"zz\"); System.out.flush(); Thread.sleep(600000); } }\n")
    classes = await compile_java([src], rocketmq.lib_dir, tmp_path / "classes")
    started = time.monotonic()
    with pytest.raises(DevBrokerError, match="did not finish within 3"):
        await run_java("Sleeper", [], classpath(rocketmq.lib_dir, classes), timeout=3)
    assert time.monotonic() - started < 30

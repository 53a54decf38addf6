"""Turn the raw runs of a benchmark into medians, ratios, a markdown table and a PNG chart."""

from __future__ import annotations

import json
import statistics
from collections.abc import Iterable
from pathlib import Path
from typing import Any

#: Display names, and which contender a ratio compares with (rmq_async over Java, same tuning).
LABELS: dict[str, str] = {
    "raw-pull": "raw PULL loop, no decoding",
    "raw-pull-decode": "raw PULL loop + decoding",
    "rmq_async": "rmq_async (defaults)",
    "rmq_async-tuned": "rmq_async (tuned)",
    "java": "Java DefaultMQPushConsumer (defaults)",
    "java-tuned": "Java DefaultMQPushConsumer (tuned)",
    "rocketmq-cpp": "PyPI rocketmq (C++ client via ctypes)",
}
JAVA_PEER: dict[str, str] = {
    "rmq_async": "java",
    "rmq_async-tuned": "java-tuned",
    "raw-pull": "java-tuned",
    "raw-pull-decode": "java-tuned",
    "rocketmq-cpp": "java",
}


def _median(values: Iterable[float]) -> float | None:
    vals = [v for v in values if v is not None]
    return statistics.median(vals) if vals else None


def summarize(scenarios: dict[str, Any]) -> dict[str, Any]:
    """Medians per scenario and contender over the verified runs, and rmq_async/Java ratios."""
    out: dict[str, Any] = {}
    for name, sc in scenarios.items():
        if sc.get("kind") == "spark":
            out[name] = _summarize_spark(sc)
            continue
        per: dict[str, Any] = {}
        for contender in sc.get("contenders", []):
            runs = [r for r in sc["runs"] if r["contender"] == contender]
            good = [r for r in runs if r["verified"]]
            row: dict[str, Any] = {
                "runs": len(runs),
                "verified_runs": len(good),
                "msgs_per_s": _median(r["msgs_per_s"] for r in good),
                "mb_per_s": _median(r["mb_per_s"] for r in good),
                "cpu_s_per_million": _median(r["cpu_s_per_million"] for r in good),
                "peak_rss_mib": _median(r["peak_rss_mib"] for r in good),
                "first_message_seconds": _median(r["first_message_seconds"] for r in good),
                "end_to_end_msgs_per_s": _median(r["end_to_end_msgs_per_s"] for r in good),
                "broker_cpu_s_per_million": _median(r.get("broker_cpu_s_per_million")
                                                    for r in good),
                "loop_waited_s": _median(r.get("loop_waited_s") for r in good),
            }
            if sc.get("kind") == "latency":
                for metric in ("latency_b2c_ms", "latency_s2c_ms"):
                    stats = [r[metric] for r in good if r.get(metric)]
                    row[metric] = {
                        k: _median(s[k] for s in stats) for k in ("p50", "p90", "p99", "max")
                    } if stats else None
            per[contender] = row
        for contender, row in per.items():
            peer = per.get(JAVA_PEER.get(contender, ""))
            row["vs_java"] = _ratios(row, peer) if peer else None
            row["java_peer"] = JAVA_PEER.get(contender) if peer else None
        out[name] = per
    return out


def _ratio(a: float | None, b: float | None) -> float | None:
    if a is None or b is None or b == 0:
        return None
    return round(a / b, 3)


def _ratios(row: dict[str, Any], peer: dict[str, Any]) -> dict[str, float | None]:
    r = {
        "msgs_per_s": _ratio(row["msgs_per_s"], peer["msgs_per_s"]),
        "cpu_s_per_million": _ratio(row["cpu_s_per_million"], peer["cpu_s_per_million"]),
        "peak_rss_mib": _ratio(row["peak_rss_mib"], peer["peak_rss_mib"]),
    }
    for metric in ("latency_b2c_ms", "latency_s2c_ms"):
        mine, theirs = row.get(metric), peer.get(metric)
        if mine and theirs:
            r[f"{metric}_p99"] = _ratio(mine["p99"], theirs["p99"])
    return r


_SPARK_CPU_PROCESSES = ("python", "spark", "broker")


def _summarize_spark(sc: dict[str, Any]) -> dict[str, Any]:
    runs = sc.get("runs", [])
    out: dict[str, Any] = {}
    for contender in ("spark-sink", "spark-sink-bulk", "plain-spark-arrow", "spark-source"):
        good = [r for r in runs if r["contender"] == contender and r["ok"]]
        out[contender] = {"runs": len(good), "rows_per_s": _median(r["rows_per_s"] for r in good),
                          "seconds": _median(r["seconds"] for r in good),
                          "cpu_s_per_million": {
                              proc: _median(r["cpu_s_per_million"][proc] for r in good
                                            if r.get("cpu_s_per_million", {}).get(proc) is not None)
                              for proc in _SPARK_CPU_PROCESSES}}
    out["sink_over_plain"] = _ratio(out["spark-sink"]["rows_per_s"],
                                    out["plain-spark-arrow"]["rows_per_s"])
    out["bulk_sink_over_plain"] = _ratio(out["spark-sink-bulk"]["rows_per_s"],
                                         out["plain-spark-arrow"]["rows_per_s"])
    out["source_over_plain"] = _ratio(out["spark-source"]["rows_per_s"],
                                      out["plain-spark-arrow"]["rows_per_s"])
    out["source_over_sink"] = _ratio(out["spark-source"]["rows_per_s"],
                                     out["spark-sink"]["rows_per_s"])
    return out


# ---------------------------------------------------------------------- markdown


def _fmt(v: float | None, spec: str = ",.0f") -> str:
    return "n/a" if v is None else format(v, spec)


def _fmt_ratio(v: float | None) -> str:
    return "n/a" if v is None else f"{v:.2f}x"


def markdown(result: dict[str, Any]) -> str:
    env = result["env"]
    lines = [
        f"# rmq_async benchmark — {result['started_at']}",
        "",
        f"Mode: **{result['config']['mode']}**. Machine: {env['cpu_model']}, "
        f"{env['cpu_count']} cores, {env['memory_gib']} GiB; {env['python']}; {env['java']}; "
        f"RocketMQ {env['rocketmq_version']} (broker and Java client); rmq_async "
        f"{env['rmq_async_version']} at {env['git_commit']}.",
        "",
        "Medians over the verified runs (each run: a fresh consumer group, a process of its "
        "own, every message counted exactly once). Ratios: rmq_async / Java at the same "
        "tuning (for raw loops: / tuned Java; for the PyPI client: / Java defaults); "
        "throughput above 1x is faster, CPU and RSS below 1x are cheaper.",
        "",
    ]
    steal = _steal_line(result)
    if steal:
        lines += [steal, ""]
    summary = result["summary"]
    for name, sc in result["scenarios"].items():
        lines.append(f"## {sc['title']}")
        lines.append("")
        if sc.get("skipped"):
            lines += [f"Skipped: {sc['skipped']}", ""]
            continue
        if sc["kind"] == "spark":
            lines += _spark_table(sc, summary[name])
            continue
        per = summary[name]
        if sc["kind"] == "latency":
            lines += [
                "| contender | B2C p50 ms | B2C p99 ms | B2C max ms | S2C p50 ms | S2C p99 ms "
                "| S2C max ms | CPU s / M msgs | peak RSS MiB | p99 B2C vs Java |",
                "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
            ]
            for contender, row in per.items():
                b, s = row.get("latency_b2c_ms") or {}, row.get("latency_s2c_ms") or {}
                ratio = (row["vs_java"] or {}).get("latency_b2c_ms_p99")
                lines.append(
                    f"| {LABELS.get(contender, contender)}{_runs_note(row)} "
                    f"| {_fmt(b.get('p50'))} | {_fmt(b.get('p99'))} | {_fmt(b.get('max'))} "
                    f"| {_fmt(s.get('p50'))} | {_fmt(s.get('p99'))} | {_fmt(s.get('max'))} "
                    f"| {_fmt(row['cpu_s_per_million'], '.1f')} "
                    f"| {_fmt(row['peak_rss_mib'], '.0f')} | {_fmt_ratio(ratio)} |"
                )
        else:
            lines += [
                "| contender | msgs/s | MB/s | first msg after s | CPU s / M msgs | peak RSS MiB "
                "| broker CPU s / M msgs | loop waited s | msgs/s vs Java | CPU vs Java |",
                "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
            ]
            for contender, row in per.items():
                vs = row["vs_java"] or {}
                lines.append(
                    f"| {LABELS.get(contender, contender)}{_runs_note(row)} "
                    f"| {_fmt(row['msgs_per_s'])} | {_fmt(row['mb_per_s'], '.1f')} "
                    f"| {_fmt(row['first_message_seconds'], '.2f')} "
                    f"| {_fmt(row['cpu_s_per_million'], '.1f')} "
                    f"| {_fmt(row['peak_rss_mib'], '.0f')} "
                    f"| {_fmt(row.get('broker_cpu_s_per_million'), '.1f')} "
                    f"| {_fmt(row.get('loop_waited_s'), '.1f')} "
                    f"| {_fmt_ratio(vs.get('msgs_per_s'))} "
                    f"| {_fmt_ratio(vs.get('cpu_s_per_million'))} |"
                )
        lines.append("")
        lines += _rounds_lines(sc)
        failed = [r for r in sc["runs"] if not r["verified"]]
        for r in failed:
            lines.append(f"- **not verified**: {r['contender']} round {r['round']}: {r['reason']}")
        if failed:
            lines.append("")
    skipped = result.get("skipped_contenders") or {}
    if skipped:
        lines += ["## Contenders not run", ""]
        lines += [f"- {LABELS.get(k, k)}: {v}" for k, v in skipped.items()]
        lines.append("")
    lines += ["Raw figures, per run: `results.json`; chart: `chart.png`.", ""]
    return "\n".join(lines)


def _steal_line(result: dict[str, Any]) -> str:
    """The host's steal over the run and its spread over the timed runs (empty if unknown)."""
    total = result.get("host_steal_pct")
    if total is None:
        return ""
    per_run = [r["host_steal_pct"] for sc in result["scenarios"].values()
               for r in sc.get("runs", []) if r.get("host_steal_pct") is not None]
    spread = (f"; per timed run {min(per_run):.1f} to {max(per_run):.1f}%" if per_run else "")
    return (f"Steal (time the host ran something else while this machine's CPUs wanted to "
            f"run, from `/proc/stat`): {total:.1f}% of the machine's time over the whole "
            f"benchmark{spread}. It slows every contender, a single-threaded one (rmq_async's "
            f"event loop) more than a JVM spread over both cores: read a run with much of it "
            f"as a contended one.")


def _rounds_lines(sc: dict[str, Any]) -> list[str]:
    """Each contender's verified rounds, in order: the spread behind the medians, with the
    broker's CPU in each and, for the single-threaded rmq_async, how long its event loop's
    thread waited for a CPU (runnable while another thread ran on its core)."""
    if sc["kind"] != "drain":
        return []

    def shown(r: dict[str, Any]) -> str:
        if not r["verified"]:
            return "not verified"
        side = []
        if r.get("broker_cpu_s_per_million") is not None:
            side.append(f"broker {r['broker_cpu_s_per_million']:.1f} CPU s / M")
        if r.get("loop_waited_s") is not None:
            side.append(f"loop waited {r['loop_waited_s']:.1f} s")
        return _fmt(r["msgs_per_s"]) + (f" ({'; '.join(side)})" if side else "")

    out: list[str] = []
    for contender in sc.get("contenders", []):
        rounds = [shown(r) for r in sc["runs"] if r["contender"] == contender and r["verified"]]
        warm = [shown(r) for r in sc.get("warm_up", []) if r["contender"] == contender]
        if rounds:
            out.append(f"- {LABELS.get(contender, contender)}: {', '.join(rounds)}"
                       + (f"; untimed warm-up before them: {warm[0]}" if warm else ""))
    if not out:
        return []
    warm_note = (" Before the timed rounds, every contender drained the topic once on the "
                 "freshly started broker, untimed and not in the medians (its JIT compiles "
                 "the pull path during the first drains)." if sc.get("warm_up") else "")
    return ["Rounds, msgs/s in run order (the broker's CPU per million messages from the "
            "consumer's start to its last message; for rmq_async, the seconds its event loop's "
            f"thread spent runnable but waiting for a CPU, another thread on its core).{warm_note}",
            "", *out, ""]


def _runs_note(row: dict[str, Any]) -> str:
    if row["verified_runs"] == row["runs"]:
        return ""
    return f" ({row['verified_runs']}/{row['runs']} verified)"


def _spark_table(sc: dict[str, Any], s: dict[str, Any]) -> list[str]:
    sink, plain = s["spark-sink"], s["plain-spark-arrow"]
    none = {"rows_per_s": None, "seconds": None, "runs": 0}
    source = s.get("spark-source", none)
    bulk = s.get("spark-sink-bulk", none)
    lines = [
        "| path | rows/s | seconds | rounds |",
        "| --- | ---: | ---: | ---: |",
        f"| consumer + SparkSink → Parquet | {_fmt(sink['rows_per_s'])} "
        f"| {_fmt(sink['seconds'], '.1f')} | {sink.get('runs', 0)} |",
        f"| the same, broker's per-pull caps raised (256 messages / 1 MiB, pull_batch_size 256) "
        f"| {_fmt(bulk['rows_per_s'])} | {_fmt(bulk['seconds'], '.1f')} | {bulk.get('runs', 0)} |",
        f"| plain Spark, in-memory Arrow tables → Parquet | {_fmt(plain['rows_per_s'])} "
        f"| {_fmt(plain['seconds'], '.1f')} | {plain.get('runs', 0)} |",
        f"| RocketMQ source (format rocketmq, reads on the executors) → Parquet stream "
        f"| {_fmt(source['rows_per_s'])} | {_fmt(source['seconds'], '.1f')} "
        f"| {source.get('runs', 0)} |",
        "",
        f"Source / plain Spark: **{_fmt_ratio(s.get('source_over_plain'))}**, "
        f"source / sink: **{_fmt_ratio(s.get('source_over_sink'))}** (the source's figure "
        "includes pulling from the broker and the streaming query's own bookkeeping: "
        "offset log, commit log, file sink metadata).",
        "",
        f"Sink / plain Spark: **{_fmt_ratio(s['sink_over_plain'])}**; with the broker's "
        f"per-pull caps raised: **{_fmt_ratio(s.get('bulk_sink_over_plain'))}** "
        f"(medians; batches of {sc.get('batch_rows', 'n/a'):,} rows; building those Arrow "
        f"tables from the messages ran at {_fmt(sc.get('arrow_rows_per_s'))} rows/s, untimed "
        "for the plain path). Spark alone keeps both cores busy; the sink shares them with "
        "the broker serving the pulls and the consumer decoding them, both of which cost per "
        "pull: a default broker hands out at most 32 in-memory messages (256 KiB) per pull.",
        "",
        "CPU seconds per million rows, per process (medians; read from /proc around each timed "
        "path; a sink's figures include its consumer's start and stop):",
        "",
        "| path | this Python process | Spark (JVM and its Python workers) | broker | all |",
        "| --- | ---: | ---: | ---: | ---: |",
    ]
    for key, label in (("spark-sink", "consumer + SparkSink"),
                       ("spark-sink-bulk", "the same, broker's caps raised"),
                       ("plain-spark-arrow", "plain Spark from Arrow"),
                       ("spark-source", "RocketMQ source")):
        cpu = s.get(key, none).get("cpu_s_per_million") or {}
        parts = [cpu.get(proc) for proc in _SPARK_CPU_PROCESSES]
        total = sum(p for p in parts if p is not None) if any(p is not None for p in parts) else None
        lines.append(f"| {label} | " + " | ".join(_fmt(p, '.1f') for p in parts)
                     + f" | {_fmt(total, '.1f')} |")
    lines.append("")
    for r in sc.get("runs", []):
        if not r["ok"]:
            lines.append(f"- **not verified**: {r['contender']} round {r['round']}: {r['reason']}")
    return lines


# ---------------------------------------------------------------------- chart


def chart(result: dict[str, Any], path: Path) -> None:
    """Throughput per contender and drain scenario; latency percentiles per contender."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    summary = result["summary"]
    scenarios = result["scenarios"]
    drains = [n for n, sc in scenarios.items() if sc["kind"] == "drain" and n in summary]
    lat = [n for n, sc in scenarios.items() if sc["kind"] == "latency" and n in summary]
    panels = len(drains) + len(lat)
    fig, axes = plt.subplots(max(1, panels), 1, figsize=(10, 3.2 * max(1, panels)),
                             squeeze=False)
    i = 0
    for name in drains:
        ax = axes[i][0]
        i += 1
        per = summary[name]
        names = list(per)
        values = [per[c]["msgs_per_s"] or 0 for c in names]
        colors = [_color(c) for c in names]
        bars = ax.barh([LABELS.get(c, c) for c in names], values, color=colors)
        ax.bar_label(bars, labels=[f"{v:,.0f}" for v in values], padding=3, fontsize=8)
        ax.set_title(f"{scenarios[name]['title']}: messages / s (median)", fontsize=10)
        ax.invert_yaxis()
        ax.set_xlim(0, max([*values, 1]) * 1.25)
        ax.tick_params(labelsize=8)
    for name in lat:
        ax = axes[i][0]
        i += 1
        per = summary[name]
        names = [c for c in per if per[c].get("latency_b2c_ms")]
        labels = [LABELS.get(c, c) for c in names]
        ys = range(len(names))
        h = 0.38
        p50 = [per[c]["latency_b2c_ms"]["p50"] for c in names]
        p99 = [per[c]["latency_b2c_ms"]["p99"] for c in names]
        b1 = ax.barh([y - h / 2 for y in ys], p50, height=h, label="B2C p50", color="#4c72b0")
        b2 = ax.barh([y + h / 2 for y in ys], p99, height=h, label="B2C p99", color="#dd8452")
        ax.bar_label(b1, labels=[f"{v:,.0f}" for v in p50], padding=3, fontsize=8)
        ax.bar_label(b2, labels=[f"{v:,.0f}" for v in p99], padding=3, fontsize=8)
        ax.set_yticks(list(ys), labels)
        ax.invert_yaxis()
        ax.set_xscale("symlog", linthresh=10)
        ax.set_xlim(0, max([*p50, *p99, 10]) * 4)
        ax.set_title(f"{scenarios[name]['title']}: born → listener ms (median of runs)",
                     fontsize=10)
        ax.legend(fontsize=8, loc="upper right")
        ax.tick_params(labelsize=8)
    if panels == 0:
        axes[0][0].text(0.5, 0.5, "no scenario ran", ha="center", va="center")
    fig.suptitle(f"rmq_async benchmark ({result['config']['mode']}, {result['started_at']})",
                 fontsize=11)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _color(contender: str) -> str:
    if contender.startswith("raw"):
        return "#8c8c8c"
    if contender.startswith("rmq_async"):
        return "#4c72b0"
    if contender.startswith("java"):
        return "#dd8452"
    return "#55a868"


def write_all(result: dict[str, Any], out_dir: Path) -> dict[str, Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    result["summary"] = summarize(result["scenarios"])
    paths = {"json": out_dir / "results.json", "markdown": out_dir / "summary.md",
             "chart": out_dir / "chart.png"}
    paths["json"].write_text(json.dumps(result, indent=2, sort_keys=False) + "\n")
    paths["markdown"].write_text(markdown(result))
    chart(result, paths["chart"])
    return paths

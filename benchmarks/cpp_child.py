"""The PyPI ``rocketmq`` contender: a push consumer of the C++ RocketMQ client, via ctypes.

``rocketmq`` (0.4.x) wraps ``librocketmq``, the C++ client, which its wheel ships; Python sees
one callback per message, called from the C++ consume threads. Run by ``benchmarks/run.py``
as ``python benchmarks/cpp_child.py '<json spec>'`` from any interpreter that has ``rocketmq``
installed: this file needs nothing but that package and :mod:`benchlib`.

The C API has no consume-from-where setter: the client starts a new group at the broker's
answer for a group without an offset, which for a queue whose first message is still in memory
(always the case here) is offset 0, the same as CONSUME_FROM_FIRST_OFFSET.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import threading
import time
from typing import Any

from benchlib import (
    PROBE_TAG,
    PROGRESS_INTERVAL,
    UNCOUNTED_TAGS,
    Tally,
    cpu_times,
    emit,
    emit_result,
)


def run(spec: dict[str, Any]) -> dict[str, Any]:
    # The C++ client logs under $HOME/logs/rocketmq-cpp.
    os.environ["HOME"] = tempfile.mkdtemp(prefix="rmq-bench-cpp-")
    from rocketmq.client import (  # type: ignore[import-not-found, unused-ignore]
        PushConsumer,
        RecvMessage,
    )

    tally = Tally(int(spec["expected"]), latency=bool(spec.get("latency")))
    queues = int(spec["queues"])
    lock = threading.Lock()
    done = threading.Event()
    latency = tally.latency
    # The wrapper returns tags as bytes.
    uncounted = {t.encode() for t in UNCOUNTED_TAGS} | set(UNCOUNTED_TAGS)
    probe_tags = (PROBE_TAG, PROBE_TAG.encode())

    def on_message(msg: RecvMessage) -> None:
        now = time.perf_counter()
        with lock:
            if latency:
                tag = msg.tags
                if tag in uncounted:
                    if tag in probe_tags:
                        tally.probe_queues.add(msg.queue_id)
                    return
            tally.mark(msg.queue_id, msg.queue_offset)
            tally.body_bytes += len(msg.body)
            if latency:
                wall_ms = int(time.time() * 1000)
                tally.b2c.append(wall_ms - msg.born_timestamp)
                tally.s2c.append(wall_ms - msg.store_timestamp)
            if tally.add(1, now):
                done.set()

    consumer = PushConsumer(spec["group"])
    consumer.set_namesrv_addr(spec["namesrv"])
    consumer.set_instance_name(f"bench-{os.getpid()}")
    batch = int(spec.get("options", {}).get("consume_message_batch_max_size", 0))
    if batch:
        consumer.set_message_batch_max_size(batch)
    consumer.subscribe(spec["topic"], on_message)
    cpu0 = cpu_times()
    t0 = time.perf_counter()
    consumer.start()
    ready_at = 0.0
    ok = True
    reason = ""
    last, last_change = -1, time.perf_counter()
    stall = float(spec["stall_timeout"])
    while not done.wait(PROGRESS_INTERVAL):
        now = time.perf_counter()
        with lock:
            count = tally.consumed
            live = len(tally.probe_queues) >= queues if latency else count > 0
        if not ready_at and live:
            ready_at = now
            emit("READY")
        if count != last:
            last, last_change = count, now
        elif now - last_change > stall:
            ok, reason = False, f"no progress for {stall} s at {count} of {tally.expected}"
            break
        emit(f"PROGRESS {count}")
    cpu1 = cpu_times()
    emit(f"PROGRESS {tally.consumed}")
    time.sleep(0.3)  # late duplicates would arrive now
    with lock:
        result = tally.result(ok=ok, reason=reason, started_at=t0, ready_at=ready_at,
                              cpu_start=cpu0, cpu_end=cpu1)
    result["event_loop"] = "C++ client threads"
    try:
        from importlib.metadata import version

        result["client_version"] = f"rocketmq {version('rocketmq')}"
    except Exception:
        result["client_version"] = "rocketmq"
    emit_result(result)
    consumer.shutdown()
    return result


def main() -> None:
    run(json.loads(sys.argv[1]))
    sys.stdout.flush()
    # The C++ client's threads can outlive shutdown(); do not wait for them.
    os._exit(0)


if __name__ == "__main__":
    main()

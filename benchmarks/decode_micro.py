"""Micro-benchmark of stored-record decoding (no broker): µs per message of ``decode_messages``.

A pull body of 32 records x 1 KiB with 6 properties is decoded over and over; the figure is the
best of several repeats. ``--read`` chooses what the "listener" touches afterwards: ``body``
(nothing but the body), ``props`` (every message's properties) or ``all`` (properties, msg_id,
offset_msg_id).

    .venv/bin/python benchmarks/decode_micro.py
    RMQ_ASYNC_NO_EXTENSIONS=1 .venv/bin/python benchmarks/decode_micro.py
    .venv/bin/python benchmarks/decode_micro.py --module some_pkg.protocol.message  # another copy
"""

from __future__ import annotations

import argparse
import importlib
import time
from typing import Any

from rmq_async.protocol.message import encode_stored_message
from rmq_async.protocol.types import MessageExt


def build_body(records: int, size: int) -> bytes:
    parts = []
    for i in range(records):
        msg = MessageExt(
            topic="BenchTopic",
            body=bytes((i + j) & 0xFF for j in range(size)),
            queue_id=3,
            queue_offset=1000 + i,
            commit_log_offset=123_456_789 + i * 1200,
            born_timestamp=1_700_000_000_000 + i,
            born_host="10.0.0.7:51234",
            store_timestamp=1_700_000_000_005 + i,
            store_host="10.0.0.1:10911",
            properties={
                "TAGS": "TagA",
                "KEYS": f"key-{i} order-{i}",
                "UNIQ_KEY": f"0A00000700002A9F0000000000{i:06X}",
                "WAIT": "true",
                "CLUSTER": "DefaultCluster",
                "region": "eu-west",
            },
        )
        parts.append(encode_stored_message(msg))
    return b"".join(parts)


def run(decode: Any, body: bytes, read: str, loops: int, repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        n = 0
        start = time.perf_counter()
        for _ in range(loops):
            msgs = decode(body)
            for m in msgs:
                if read == "body":
                    _ = m.body
                elif read == "props":
                    _ = m.properties
                else:
                    _ = (m.body, m.properties, m.msg_id, m.offset_msg_id)
            n += len(msgs)
        best = min(best, (time.perf_counter() - start) / n)
    return best * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--module", default="rmq_async.protocol.message")
    ap.add_argument("--records", type=int, default=32)
    ap.add_argument("--size", type=int, default=1024)
    ap.add_argument("--loops", type=int, default=2000)
    ap.add_argument("--repeats", type=int, default=7)
    args = ap.parse_args()
    mod = importlib.import_module(args.module)
    body = build_body(args.records, args.size)
    impl = getattr(mod, "IMPLEMENTATION", "python (no IMPLEMENTATION attribute)")
    print(f"{args.module}: {impl}, {args.records} records x {args.size} B")
    for read in ("body", "props", "all"):
        us = run(mod.decode_messages, body, read, args.loops, args.repeats)
        print(f"  read {read:5}: {us:6.3f} µs/message")


if __name__ == "__main__":
    main()

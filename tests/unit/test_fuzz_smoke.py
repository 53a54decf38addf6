"""A short run of the decoder fuzzer (``make fuzz`` runs the long one): no decoder raises anything
but ProtocolError, the compiled and pure record decoders agree, and no input hangs."""

from __future__ import annotations

import io

from rmq_async.protocol import message
from tests.fuzz import fuzz_decoders

SMOKE_INPUTS = 20_000
SMOKE_SEED = 1  # not make fuzz's seed: the short run covers other inputs


def test_fuzz_smoke() -> None:
    out = io.StringIO()
    # A generous per-input limit: this shares the machine with the rest of the suite.
    report = fuzz_decoders.run(SMOKE_INPUTS, SMOKE_SEED, hang_seconds=5.0, time_limit=180,
                               out=out)
    assert not report.timed_out, out.getvalue()
    assert report.inputs == SMOKE_INPUTS
    assert [t.name for t in report.targets] == list(fuzz_decoders.TARGETS)
    assert report.findings == 0, out.getvalue()
    for stats in report.targets:
        # Both outcomes are exercised on every target.
        assert stats.ok > 0 and stats.protocol_errors > 0, stats.line()
    # With the compiled codec the Spark sink's path is reached (bodies kept undecoded, their
    # rows read from the bytes and compared); without it nothing is kept.
    record = report.targets[fuzz_decoders.TARGETS.index("record")]
    assert (record.sink_kept > 0) == (message.scan_records is not None), record.line()


def test_replay_one_input_is_deterministic() -> None:
    first = fuzz_decoders.gen_record_case(fuzz_decoders.case_rng(3, "record", 42))
    again = fuzz_decoders.gen_record_case(fuzz_decoders.case_rng(3, "record", 42))
    assert first.data == again.data
    report = fuzz_decoders.run(0, 3, ("record",), out=io.StringIO(), only_index=42)
    assert report.inputs == 1 and report.findings == 0

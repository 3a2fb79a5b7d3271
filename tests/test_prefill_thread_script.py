"""`benchmarks/prefill_thread.py` on the real model code (synthetic:tiny, CPU): passes on a second
thread beside a pipelined decode, whose last pass equals the same pass made alone, and the work
count that says how much the two threads overlapped."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from tests.scripts import load_script

SCRIPT = Path(__file__).resolve().parent.parent / "benchmarks" / "prefill_thread.py"


def test_each_variant_decodes_every_step_and_the_threads_pass_equals_one_made_alone(tiny_model: Any) -> None:
    bench = load_script(SCRIPT, "prefill_thread_script")
    args = argparse.Namespace(rows=4, held=32, chunk="2x48", steps=24, every=6, vocab=200)
    none = bench.run(tiny_model, args, "none", 1)
    same = bench.run(tiny_model, args, "same", 1)
    thread = bench.run(tiny_model, args, "thread", 1)
    assert none["steps"] == same["steps"] == thread["steps"] == 24
    assert (none["passes"], same["passes"]) == (0, 24 // 6)  # a pass every 6 steps
    assert thread["passes"] >= 1 and thread["equal"] == 1.0  # the same logits and keys as alone
    assert none["gap_p50_ms"] <= none["gap_p99_ms"] <= none["gap_max_ms"]
    assert bench.alone(tiny_model, args) > 0

"""`benchmarks/kernel_trace.py`'s view of the steps from each prefilling one on: with a pipelined
decode a stall spreads over the step that prefills and the ones after it."""

from __future__ import annotations

from pathlib import Path

from tests.scripts import load_script

SCRIPT = Path(__file__).resolve().parent.parent / "benchmarks" / "kernel_trace.py"


def test_the_steps_after_each_prefilling_one_are_taken_at_their_offsets() -> None:
    trace = load_script(SCRIPT, "kernel_trace_script")
    # Steps 1 and 5 prefill; each is followed by a step that carries its chunk (busy 20 ms).
    tokens = [0, 800, 0, 0, 0, 600, 0, 0, 0, 0, 400]
    steps = [{"wall_ms": 8.0 + (t > 0) * 10, "prefill_tokens": t} for t in tokens]
    busy = {i: 20.0 if i in (2, 6) else 7.0 for i in range(len(tokens))}
    kernels = {i: 700 if i in (2, 6) else 400 for i in range(len(tokens))}
    names = {i: {"gemm": 12.0 if i in (2, 6) else 1.0, "copy": 0.5} for i in range(len(tokens))}
    rows = trace.around(steps, busy, kernels, names, top=1, after=2)
    # Step 10 prefills too, but too close to the end to be followed: it is left out.
    assert [r["offset"] for r in rows] == [0, 1, 2]
    assert rows[0]["prefill_tokens"] == 700 and rows[0]["wall_ms"] == 18.0
    assert rows[1]["busy_ms"] == 20.0 and rows[1]["kernels"] == 700 and rows[1]["prefill_tokens"] == 0
    assert rows[1]["top"] == [["gemm", 12.0]]
    assert rows[2]["busy_ms"] == 7.0 and rows[2]["wall_ms"] == 8.0


def test_the_step_after_a_plan_is_classed_as_carrying_not_as_decode_only() -> None:
    trace = load_script(SCRIPT, "kernel_trace_script")
    steps = [{"prefill_tokens": t} for t in (0, 800, 0, 0, 600, 300, 0)]
    assert trace.step_classes(steps) == {
        "decode only": [0, 3], "prefilling": [1, 4, 5], "carrying": [2, 6]}

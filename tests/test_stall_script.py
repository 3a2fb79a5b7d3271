"""`benchmarks/stall.py`'s ramp: a closed loop starts as a burst (every stream sends at once), so
with `--ramp` only the steady window after it counts, and without one everything does. Its heap
frozen per run, as `serve` freezes it; and its side-by-side JSON written after every run, so that
a process killed at a GPU machine's time limit leaves the runs it finished."""

from __future__ import annotations

import argparse
import gc
import json
from pathlib import Path

import anyio
import pytest

from tests.scripts import load_script

SCRIPT = Path(__file__).resolve().parent.parent / "benchmarks" / "stall.py"


def _args(**kw: float) -> argparse.Namespace:
    base = dict(model="synthetic:tiny", concurrency=4, prefill_batch=2, prefill_step=64, prompt_min=8,
                prompt_max=40, prompt_tokens=0, max_tokens=12, max_tokens_min=0, seed=0, seconds=1.0,
                ramp=0.0, freeze_heap=True)
    return argparse.Namespace(**{**base, **kw})


def test_a_window_counts_only_the_requests_sent_and_the_tokens_that_came_in_it() -> None:
    stall = load_script(SCRIPT, "stall_script")
    trace = stall.window(_args(ramp=2.0, seconds=3.0))
    trace.first(0.5, 4.0, 1)  # sent in the burst: its TTFT is not counted, its first token is
    trace.first(2.5, 0.1, 1)  # sent in the window: both count
    trace.first(4.9, 0.3, 2)  # sent in it, first tokens after it: only its TTFT counts
    trace.gap(1.9, 0.2, 1)
    trace.gap(3.0, 0.2, 1)
    trace.gap(5.0, 0.2, 1)
    assert trace.ttft == [0.1, 0.3]
    assert trace.itl == [(3.0, 0.2)]
    assert trace.tokens == 1 + 1 + 1


def test_without_a_ramp_everything_from_the_start_counts() -> None:
    stall = load_script(SCRIPT, "stall_script")
    trace = stall.window(_args())
    trace.first(0.0, 4.0, 1)
    trace.gap(100.0, 0.2, 3)
    assert (trace.ttft, trace.itl, trace.tokens) == ([4.0], [(100.0, 0.2)], 4)


def test_a_ramped_run_reports_only_its_window(model_cache: Path) -> None:
    stall = load_script(SCRIPT, "stall_script")
    args = _args(ramp=1.0, seconds=1.5)
    config = stall.make_config(args, '"auto"')
    result = anyio.run(lambda: stall.run(config, args, rate=None))
    times = [at for at, _ in result["itl_trace"]]
    assert times and min(times) >= 1.0 and max(times) < 2.5
    assert result["requests"] > 0
    # Tokens over the window's length, not over the run with its ramp and drain.
    assert result["tok_s"] >= len(times) / 1.5


def test_each_run_freezes_its_heap_as_serve_does_and_thaws_it_after(model_cache: Path) -> None:
    stall = load_script(SCRIPT, "stall_script")
    for freeze in (True, False):
        args = _args(seconds=0.5, freeze_heap=freeze)
        result = anyio.run(lambda a=args: stall.run(stall.make_config(a, "0"), a, rate=None))
        # Frozen: the scheduler's startup heap (imports, model objects) out of full collections.
        assert (result["heap_frozen"] > 10_000) is freeze and (result["heap_frozen"] == 0) is not freeze
        assert gc.get_freeze_count() == 0  # the next variant starts from an unfrozen heap
        assert result["requests"] > 0


def test_a_run_cut_short_leaves_the_runs_it_finished(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    stall = load_script(SCRIPT, "stall_script")
    out = tmp_path / "stall.json"
    args = _args(variants=["0", "auto"], repeat=3, out=str(out))
    made: list[float] = []

    async def fake_run(config: object, a: argparse.Namespace, *, rate: float | None,
                       collect: bool = True) -> dict[str, object]:
        if len(made) == 3:  # the machine's time limit, mid-run
            raise KeyboardInterrupt
        made.append(100.0 * (len(made) + 1))
        return {"tok_s": made[-1], "itl_p50_ms": 5.0, "itl_p99_ms": 10.0 + len(made),
                "itl_max_ms": 20.0, "ttft_p99_ms": 50.0 * len(made), "itl_trace": []}

    monkeypatch.setattr(stall, "run", fake_run)
    with pytest.raises(KeyboardInterrupt):
        stall.compare(args)
    written = json.loads(out.read_text())
    assert written["complete"] is False
    # Rounds rotate: "0", "auto", then "auto" first in the second round.
    assert [r["tok_s"] for r in written["runs"]["0"]] == [100.0]
    assert [r["tok_s"] for r in written["runs"]["auto"]] == [200.0, 300.0]
    assert written["medians"]["auto"]["tok_s"] == 250.0
    assert written["medians"]["auto"]["tok_s_x"] == 2.5
    assert written["medians"]["auto"]["ttft_p99_x"] == 2.5  # (100 + 150) / 2 over 50
    assert len(written["load"]) == 3


def test_medians_leave_out_variants_without_runs_and_ratios_without_a_base() -> None:
    stall = load_script(SCRIPT, "stall_script")
    run = {"tok_s": 10.0, "itl_p50_ms": 2.0, "itl_p99_ms": 6.0, "ttft_p99_ms": 40.0}
    table = stall.medians({"0": [], "auto": [run], "256": []}, "0")
    assert list(table) == ["auto"]
    assert table["auto"]["p99_over_p50"] == 3.0
    assert "tok_s_x" not in table["auto"] and "ttft_p99_x" not in table["auto"]

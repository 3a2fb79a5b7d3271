"""`benchmarks/stall.py`'s ramp: a closed loop starts as a burst (every stream sends at once), so
with `--ramp` only the steady window after it counts, and without one everything does."""

from __future__ import annotations

import argparse
import gc
from pathlib import Path

import anyio

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

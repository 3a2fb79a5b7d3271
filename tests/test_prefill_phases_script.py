"""`benchmarks/prefill_phases.py` (and `kernel_trace.py`, which takes its variants): a variant's
flag switches what it names, and one it does not know is an error, not a silent default."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import pytest

from tests.scripts import load_script
from workers.batching import hostpad, padded_attention, sparerows

SCRIPT = Path(__file__).resolve().parent.parent / "benchmarks" / "prefill_phases.py"


def _args() -> argparse.Namespace:
    return argparse.Namespace(vocab=256, concurrency=4, prefill_batch=2, prefill_step=64)


@pytest.mark.parametrize(("variant", "shared", "once", "spare"), [
    ("64", True, True, None), ("64:apart", False, True, None), ("auto:padjoin", True, False, None),
    ("64:copyrows", True, True, False)])
def test_a_variants_flag_switches_what_it_names(variant: str, shared: bool, once: bool, spare: bool | None,
                                                tiny_model: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    phases = load_script(SCRIPT, "prefill_phases_script")
    for name in ("SHARE_POSITIONS", "JOIN_ONCE", "SHARE_HOST_ARRAYS"):
        monkeypatch.setattr(hostpad, name, getattr(hostpad, name))  # restored after the test
    monkeypatch.setattr(sparerows, "ENABLED", sparerows.ENABLED)
    engine = phases.engine_for(tiny_model, _args(), variant)
    engine.close()
    assert (hostpad.SHARE_POSITIONS, hostpad.JOIN_ONCE, hostpad.SHARE_HOST_ARRAYS) == (shared, once, True)
    assert sparerows.ENABLED is spare


def test_an_unknown_or_second_flag_is_an_error(tiny_model: Any) -> None:
    phases = load_script(SCRIPT, "prefill_phases_script")
    for variant in ("512:apart:padjoin", "512:nosuch"):
        with pytest.raises(SystemExit, match="unknown variant flag"):
            phases.engine_for(tiny_model, _args(), variant)


def test_a_budget_of_448x4_plans_one_step_in_four_and_mlxchunk_keeps_mlxs_chunk_products(
    tiny_model: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    phases = load_script(SCRIPT, "prefill_phases_script")
    monkeypatch.setattr(padded_attention, "GROUPED", True)  # restored after the test
    args = _args()
    args.prefill_pad = "64"  # the CPU replaying CUDA's padded passes
    engine = phases.engine_for(tiny_model, args, "448x4:mlxchunk")
    engine.close()
    assert (engine.prefill_every, engine._budget.tokens(), engine.prefill_pad) == (4, 448, 64)
    assert padded_attention.GROUPED is False
    engine = phases.engine_for(tiny_model, _args(), "auto")
    engine.close()
    assert engine.prefill_every == 1 and padded_attention.GROUPED is True  # "auto" on the CPU


def test_padded_runs_chunks_with_their_padding_and_the_counter_sees_real_and_padded_tokens(
    tiny_model: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    from workers.batching import fused
    from workers.batching.prefill import PipelinedPrefill

    phases = load_script(SCRIPT, "prefill_phases_script")
    monkeypatch.setattr(fused, "RAGGED", True)  # restored after the test
    phases.engine_for(tiny_model, _args(), "64:padded").close()
    assert fused.RAGGED is False
    phases.engine_for(tiny_model, _args(), "64").close()
    assert fused.RAGGED is True
    counts = {"real": 0, "padded": 0}
    counted = phases.count_padding(counts)
    batch: Any = PipelinedPrefill.empty(tiny_model, None, prefill_step_size=64)  # an empty batch's
    batch.tokens, batch.prompt_cache = [[], []], []  # two prompts, caches not needed to pad
    tokens, _ = counted(batch, [[1, 2, 3], [4]])
    assert tokens.shape == (2, 3) and counts == {"real": 4, "padded": 6}


def test_first_token_steps_count_each_request_inserted_after_the_warm_up_and_grow_under_a_tight_budget(
    tiny_model: Any,
) -> None:
    phases = load_script(SCRIPT, "prefill_phases_script")
    args = _args()
    vars(args).update(prefill_pad="0", prompt_min=64, prompt_max=64, max_tokens=4, warmup=8, steps=40, seed=0,
                      sync=False, eval_caches=False)
    whole = phases.run(tiny_model, args, "0")["first_token_steps"]
    tight = phases.run(tiny_model, args, "16")["first_token_steps"]
    assert whole is not None and tight is not None
    assert 1 <= whole["p50"] <= whole["p99"] and tight["p50"] <= tight["p99"]
    assert whole["n"] >= 10 and tight["n"] >= 2
    # 64-token prompts at 16 tokens a step take at least four steps to prefill, and wait longer
    # than the same prompts prefilled whole.
    assert tight["p50"] >= 4 and tight["p50"] > whole["p50"], (whole, tight)
    assert phases.step_quantiles([]) is None
    assert phases.step_quantiles([3, 1, 2]) == {"p50": 2.0, "p99": 3.0, "n": 3.0}

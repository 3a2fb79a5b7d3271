"""Plans spread over the decode steps until the next (`[worker] prefill_spread`), on the real mlx-lm
BatchGenerator (synthetic:tiny): each step carries a share of a chunk's layers, the tokens are those
of chunks carried whole, and a row that leaves or a plan cut short midway leaves nothing behind."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import pytest

from scheduler import SchedulerConfig
from tests.test_prefill_path import run, workload
from workers.batching import fused
from workers.batching.budget import PrefillBudget
from workers.batching.choices import cadence, spreads, token_budget
from workers.batching.engine import MLXEngine
from workers.batching.mlxlm import queue_sizes
from workers.messages import Admit, SamplingSpec

if TYPE_CHECKING:
    from pathlib import Path

LAYERS = 2  # synthetic:tiny's


def planned(model: Any, spread: bool, *, every: int = 4, budget: int = 48) -> MLXEngine:
    return MLXEngine(model, vocab_size=256, max_batch=6, prefill_batch=4, prefill_step=64,
                     step_token_budget=budget, prefill_every=every, prefill_spread=spread)


def test_a_spread_plan_rests_from_planning_until_the_next_whatever_its_tokens() -> None:
    b = PrefillBudget(128, max_chunk=512, max_prompts=8, every=3, spread=True)
    assert b.plan(decoding=10, in_prefill=0, waiting=1, room=50, chunks=[60]) == (512, 1)
    assert b.passes == 3  # 60 tokens: one step's budget, but the chunk's cost is spread over three
    assert [b.rests(decoding=10) for _ in range(3)] == [True, True, False]
    b.plan(decoding=10, in_prefill=1, waiting=0, room=50, chunks=[1])  # only a join: no chunk
    assert b.passes == 1 and not b.rests(decoding=10)
    b.plan(decoding=0, in_prefill=0, waiting=2, room=50, chunks=[60, 60])  # nothing decodes: full speed
    assert b.passes == 1 and not b.rests(decoding=0)
    whole = PrefillBudget(128, max_chunk=512, max_prompts=8, every=3)
    whole.plan(decoding=10, in_prefill=0, waiting=1, room=50, chunks=[300])
    assert whole.passes == 1 and [whole.rests(decoding=10) for _ in range(3)] == [True, True, False]


@pytest.mark.integration
def test_spread_plans_give_the_tokens_of_whole_ones_a_share_of_layers_a_step(
    tiny_model: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    passes: list[tuple[bool, int, int]] = []  # (with decode rows, layers done before, after)
    call = fused.carry

    def seen(model: Any, inputs: Any, caches: Any, state: fused.Carry, *args: Any) -> Any:
        before = state.done
        out = call(model, inputs, caches, state, *args)
        passes.append((inputs is not None, before, state.done))
        return out

    monkeypatch.setattr(fused, "carry", seen)
    admits = workload(24, seed=4)
    whole = run(planned(tiny_model, False), admits)
    assert passes and set(passes) == {(True, 0, LAYERS)}
    passes.clear()
    spread = run(planned(tiny_model, True), admits)
    assert spread == whole
    assert [len(spread[a.rid]) for a in admits] == [a.max_tokens for a in admits]
    shares = [(before, after) for rows, before, after in passes if rows]
    assert shares.count((0, 1)) >= 3 and shares.count((1, 2)) >= 3  # one layer a step
    # Every chunk goes through its layers in order, once: a share starts where the last ended.
    ends = [after for _, _, after in passes]
    assert all(before in (0, ends[i - 1]) for i, (_, before, _) in enumerate(passes))


@pytest.mark.integration
def test_a_row_removed_midway_through_a_spread_chunk_leaves_nothing_behind(tiny_model: Any) -> None:
    admits = workload(12, seed=6)
    want = run(planned(tiny_model, False), admits)
    removed: list[int] = []

    def remove_midway(e: MLXEngine) -> None:
        batch = e._prefill
        if not removed and batch is not None and batch.carry is not None and batch.carry.done:
            removed.append(e._rid_of[batch.uids[0]])  # its prompt went through some layers, not all
            e.remove(removed)
            assert batch.carry is None  # what was left of the chunk ran before the row left

    e = planned(tiny_model, True)
    out = run(e, admits, after=remove_midway, close=False)
    assert removed and out[removed[0]] == []
    assert {rid: t for rid, t in out.items() if rid not in removed} == {
        rid: t for rid, t in want.items() if rid not in removed}
    assert e.held() == 0 and e.rids() == [] and sum(queue_sizes(e._gen)) == 0
    e.close()


def cut_short(e: MLXEngine) -> dict[int, list[int]]:
    """One row decodes its last tokens while three prompts of 20-60 tokens are planned."""
    out: dict[int, list[int]] = {}
    e.insert([Admit(rid=100, prompt=list(range(5, 21)), max_tokens=2, sampling=SamplingSpec(),
                    stop_token_ids=())])
    while not queue_sizes(e._gen).decoding:
        e.step()
    e.insert([Admit(rid=i, prompt=[(7 * i + j) % 200 + 3 for j in range(20 + 20 * i)], max_tokens=5,
                    sampling=SamplingSpec(), stop_token_ids=()) for i in range(3)])
    while e.has_work():
        r = e.step()
        for rid, tok in zip(r.rids, r.tokens, strict=True):
            out.setdefault(rid, []).append(tok)
    e.close()
    return out


@pytest.mark.integration
def test_a_spread_chunk_is_finished_alone_when_its_steps_are_cut_short(
    tiny_model: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The last decoding row finishes while a chunk is midway: no decode pass is left to carry
    the rest, which goes through a pass of its own, and its prompts start decoding all the same."""
    alone: list[tuple[int, int]] = []  # (layers done before, after) of passes without decode rows
    call = fused.carry

    def seen(model: Any, inputs: Any, caches: Any, state: fused.Carry, *args: Any) -> Any:
        before = state.done
        out = call(model, inputs, caches, state, *args)
        if inputs is None:
            alone.append((before, state.done))
        return out

    monkeypatch.setattr(fused, "carry", seen)
    whole = cut_short(planned(tiny_model, False, budget=64))
    assert alone == []
    spread = cut_short(planned(tiny_model, True, budget=64))
    assert alone == [(1, LAYERS)]
    assert spread == whole and [len(spread[i]) for i in (100, 0, 1, 2)] == [2, 5, 5, 5]


@pytest.mark.parametrize(("worker", "spread"), [
    ("prefill_spread = true\nprefill_every = 3", True),
    ("prefill_spread = true", False),  # every step plans on the CPU: nothing to spread over
    ("prefill_spread = true\nprefill_every = 3\nfuse_prefill = false", False),  # chunks run alone
    ("prefill_every = 3", False),  # "auto": spread on CUDA only
    ("prefill_spread = true\nprefill_every = 3\nstep_token_budget = 0", False),  # no plans to spread
])
def test_the_prefill_spread_setting_reaches_the_engine_where_it_can_act(
    model_cache: Path, worker: str, spread: bool
) -> None:
    from scheduler.assembly import real_engine_factory

    cfg = SchedulerConfig.from_toml(
        f'[model]\npath = "synthetic:tiny"\ncache_dir = "{model_cache}"\n[worker]\n{worker}')
    built, loaded = real_engine_factory(cfg)()
    try:
        assert built.prefill_spread == spread == loaded.prefill_spread
    finally:
        built.close()


def test_a_bad_prefill_spread_setting_is_named() -> None:
    with pytest.raises(ValueError, match="prefill_spread"):
        SchedulerConfig.from_toml('[worker]\nprefill_spread = "sometimes"')


def test_auto_spreads_plans_of_1024_tokens_a_step_on_cuda_only() -> None:
    # CUDA: 1,024 tokens a step, planned one step in four, each plan spread over its four steps.
    assert (token_budget("auto", gpu=True, cuda=True), cadence("auto", cuda=True),
            spreads("auto", cuda=True)) == (1024, 4, True)
    assert token_budget("auto", gpu=True, cuda=False) == 0  # Metal: not measured, off
    assert token_budget("auto", gpu=False) == "auto"  # the CPU's demand-sized budget
    assert not spreads("auto", cuda=False)
    for gpu, cuda in ((True, True), (True, False), (False, False)):
        assert token_budget(0, gpu=gpu, cuda=cuda) == 0 and token_budget(300, gpu=gpu, cuda=cuda) == 300
    assert spreads(True, cuda=False) and not spreads(False, cuda=True)
    with pytest.raises(ValueError, match="prefill_spread"):
        spreads("sometimes", cuda=True)

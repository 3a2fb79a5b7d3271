"""Stall-free prefill: the per-step token budget, pure and through the actors."""

from __future__ import annotations

import random
from typing import TYPE_CHECKING, Any

import anyio
import pytest

from scheduler import SamplingParams, Scheduler, SchedulerConfig
from scheduler.assembly import real_engine_factory
from tests.fakes import FakeEngine, fake_factory, fake_token
from tests.test_integration import prompts
from tests.test_metrics import parse, value
from workers.batching.budget import AUTO_MAX_DEMANDS, AUTO_MIN_TOKENS, AUTO_START, PrefillBudget
from workers.batching.choices import cadence
from workers.batching.engine import MLXEngine
from workers.batching.mlxlm import queue_sizes
from workers.messages import Admit, SamplingSpec

if TYPE_CHECKING:
    from pathlib import Path


def test_off_or_nothing_decoding_means_full_chunks() -> None:
    off = PrefillBudget(0, max_chunk=512, max_prompts=8)
    assert off.tokens() is None
    assert off.plan(decoding=40, in_prefill=3, waiting=9, room=10) == (512, 8)
    fixed = PrefillBudget(128, max_chunk=512, max_prompts=8)
    assert fixed.plan(decoding=0, in_prefill=0, waiting=9, room=64) == (512, 8)


def test_fixed_budget_splits_among_prompts_and_caps_how_many() -> None:
    b = PrefillBudget(128, max_chunk=512, max_prompts=8)
    assert b.plan(decoding=10, in_prefill=0, waiting=1, room=50) == (128, 4)  # 128 // 32 prompts
    assert b.plan(decoding=10, in_prefill=2, waiting=9, room=50) == (32, 4)
    assert b.plan(decoding=10, in_prefill=6, waiting=0, room=50) == (21, 4)  # joined when larger
    small = PrefillBudget(40, max_chunk=512, max_prompts=8)
    assert small.plan(decoding=10, in_prefill=0, waiting=9, room=50) == (40, 1)


def test_a_granule_rounds_bounded_chunks_down_to_whole_multiples() -> None:
    b = PrefillBudget(480, max_chunk=512, max_prompts=8, granule=64)
    assert b.plan(decoding=10, in_prefill=0, waiting=1, room=50) == (448, 8)  # 480 -> 7 x 64
    assert b.plan(decoding=10, in_prefill=3, waiting=0, room=50) == (128, 8)  # 160 -> 2 x 64
    assert b.plan(decoding=10, in_prefill=8, waiting=0, room=50) == (60, 8)  # under one: as it is
    assert b.plan(decoding=0, in_prefill=8, waiting=0, room=50) == (512, 8)  # nothing to stall


def test_auto_budget_keeps_a_full_batch_fed_and_fills_free_slots() -> None:
    b = PrefillBudget("auto", max_chunk=512, max_prompts=8, max_batch=64)
    assert b.tokens() == AUTO_START  # before any prompt was seen
    for _ in range(30):
        b.inserted(prompt_tokens=40, max_tokens=64)  # each of 64 slots frees a slot every 64 steps
    assert b.tokens() == 50  # 1.25 x 40 prompt tokens a step keeps up
    assert b.tokens(room=4, waiting=10) == 50 + 4 * 40 // 16  # and free slots fill in ~16 steps
    assert b.tokens(room=4, waiting=0) == 50
    for _ in range(30):
        b.inserted(prompt_tokens=10, max_tokens=400)
    # 1.25 x 10 x 64 / 400 = 2 tokens a step: the floor still lets a short prompt join in one step.
    assert b.tokens() == AUTO_MIN_TOKENS


def test_auto_budget_follows_the_demand_and_fills_a_burst_at_most_one_more_demand_a_step() -> None:
    # Prompts much longer than outputs: keeping the batch full takes 1.25 x 800 x slots / 64
    # tokens a step, however long that step is; below it prompts would queue for good.
    for slots in (8, 64, 256):
        b = PrefillBudget("auto", max_chunk=512, max_prompts=8, max_batch=slots)
        b.inserted(prompt_tokens=800, max_tokens=64)
        demand = int(1.25 * 800 * slots / 64)
        assert b.tokens() == max(AUTO_MIN_TOKENS, demand)
        assert b.tokens(room=slots, waiting=slots) == max(AUTO_MIN_TOKENS, AUTO_MAX_DEMANDS * demand)
        assert b.tokens(room=1, waiting=1) == max(AUTO_MIN_TOKENS, demand + 800 // 16)


@pytest.mark.parametrize("limit", [0, -1, "fast", 1.5])
def test_bad_limits_are_rejected_except_zero(limit: object) -> None:
    if limit == 0:
        assert PrefillBudget(0, max_chunk=8, max_prompts=1).tokens() is None
        return
    with pytest.raises(ValueError, match="step_token_budget"):
        PrefillBudget(limit, max_chunk=8, max_prompts=1)  # type: ignore[arg-type]


@pytest.mark.anyio
async def test_no_step_prefills_more_than_the_budget_while_others_decode() -> None:
    budget = PrefillBudget(64, max_chunk=512, max_prompts=8)
    engine = FakeEngine(budget=budget, max_batch=16, step_delay=0.001)
    cfg = SchedulerConfig.from_toml("[worker]\nmax_batch = 16")
    ps = [[(i * 7 + j) % 60 + 1 for j in range(10 + 23 * (i % 9))] for i in range(40)]
    with anyio.fail_after(60):
        async with Scheduler(cfg, engine_factory=fake_factory(engine)) as s:
            results = {}

            async def one(i: int) -> None:
                results[i] = await s.complete(ps[i], SamplingParams(max_tokens=12))

            async with anyio.create_task_group() as tg:
                for i in range(40):
                    tg.start_soon(one, i)
                    await anyio.sleep(0.003)  # a steady stream of arrivals
    busy = [work for decoding, work in engine.prefill_log if decoding > 0]
    assert busy and max(busy) <= 64
    assert sum(1 for d, w in engine.prefill_log if d > 0 and w > 0) > 10  # prefill did overlap decode
    for i, done in results.items():
        admit = Admit(i, ps[i], 12, SamplingSpec(), ())
        assert done.token_ids == [fake_token(admit, k) for k in range(12)]


@pytest.mark.anyio
@pytest.mark.integration
async def test_budget_keeps_greedy_output_identical_on_the_real_engine(model_cache: Path) -> None:
    ps = prompts(24, seed=31, vocab=900)
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    outputs: dict[str, list[list[int]]] = {}
    # The last: plans of three steps' budget, each spread over three steps (`prefill_spread`).
    for budget in ("0", "24", '"auto"', "32\nprefill_every = 3\nprefill_spread = true"):
        cfg = SchedulerConfig.from_toml(
            f'[model]\npath = "synthetic:tiny"\ncache_dir = "{model_cache}"\n'
            f"[worker]\nmax_batch = 8\nprefill_step = 64\nstep_token_budget = {budget}"
        )
        with anyio.fail_after(120):
            async with Scheduler(cfg) as s:
                got: dict[int, list[int]] = {}

                async def one(i: int) -> None:
                    got[i] = (await s.complete(ps[i], params)).token_ids  # noqa: B023

                async with anyio.create_task_group() as tg:
                    for i in range(len(ps)):
                        tg.start_soon(one, i)
                        await anyio.sleep(0.002)
                stats, gauge = s.stats(), value(parse(s.metrics_text()), "prefill_spread")
        assert stats.prefill_spread == ("prefill_spread" in budget) == (gauge == 1)
        assert stats.running == stats.waiting == stats.engine_batch == stats.blocks_used == 0
        outputs[budget] = [got[i] for i in range(len(ps))]
    assert len({str(o) for o in outputs.values()}) == 1, "every budget gives the same tokens"


def test_full_speed_prefill_packs_short_prompts_into_one_pass() -> None:
    # A pass holds up to prefill_batch prompts of prefill_step tokens: 8 x 512 = 4096 tokens.
    b = PrefillBudget(0, max_chunk=512, max_prompts=8, max_batch=128, pack=True)
    assert b.plan(decoding=40, in_prefill=0, waiting=100, room=88, chunks=[127] * 100) == (512, 32)
    # Padded to the longest prompt in the pass: a long one limits how many share it.
    chunks = [100, 400] + [100] * 50
    assert b.plan(decoding=0, in_prefill=0, waiting=52, room=128, chunks=chunks) == (512, 8)
    # Whole multiples of prefill_batch (20 of 200 tokens fit: 16 go), unless the free slots stop it.
    assert b.plan(decoding=0, in_prefill=0, waiting=50, room=128, chunks=[200] * 50) == (512, 16)
    assert b.plan(decoding=0, in_prefill=0, waiting=50, room=13, chunks=[100] * 50) == (512, 13)
    # Prompts already part-way through count first, and longer than a chunk count as a chunk.
    assert b.plan(decoding=0, in_prefill=2, waiting=99, room=126, chunks=[3000, 60] + [10] * 99) == (512, 8)
    # Never more than the free slots (or max_batch), never fewer than prefill_batch.
    assert b.plan(decoding=0, in_prefill=0, waiting=100, room=20, chunks=[10] * 100) == (512, 20)
    assert b.plan(decoding=0, in_prefill=0, waiting=300, room=300, chunks=[1] * 300) == (512, 128)
    assert b.plan(decoding=0, in_prefill=0, waiting=3, room=64, chunks=[10] * 3) == (512, 8)
    # Without packing, prefill_batch prompts a pass whatever their length, as mlx-lm does.
    plain = PrefillBudget(0, max_chunk=512, max_prompts=8, max_batch=128)
    assert plain.plan(decoding=0, in_prefill=0, waiting=100, room=128, chunks=[10] * 100) == (512, 8)
    # While others decode under a budget, the budget decides, packing or not.
    fixed = PrefillBudget(128, max_chunk=512, max_prompts=8, max_batch=128, pack=True)
    assert fixed.plan(decoding=10, in_prefill=0, waiting=50, room=50, chunks=[10] * 50) == (32, 4)
    assert fixed.plan(decoding=0, in_prefill=0, waiting=50, room=50, chunks=[10] * 50) == (512, 50)


def test_prefill_every_plans_whole_prompts_then_rests_as_long_as_their_tokens_take() -> None:
    b = PrefillBudget(128, max_chunk=512, max_prompts=8, every=3)
    assert not b.rests(decoding=10)  # this step plans
    # 3 x 128 tokens a plan, in whole prompts: one that has only its last token left (it joins
    # and costs nothing), then as many as fit padded to the longest: 3 x 100, not a fourth of 130
    chunks = [1, 60, 100, 90, 130, 20]
    assert b.plan(decoding=10, in_prefill=2, waiting=4, room=50, chunks=chunks) == (512, 1 + 3)
    # 300 tokens at 128 a step: the two steps after rest, then the next one plans
    assert [b.rests(decoding=10) for _ in range(3)] == [True, True, False]
    # a short plan rests less: 60 tokens take less than a step's budget
    assert b.plan(decoding=10, in_prefill=0, waiting=1, room=50, chunks=[60]) == (512, 1)
    assert not b.rests(decoding=10)
    # a prompt longer than the plan's budget still goes, alone, `max_chunk` at most, and the
    # steps after rest at most `every - 1`
    assert b.plan(decoding=10, in_prefill=0, waiting=2, room=50, chunks=[900, 10]) == (512, 1)
    assert [b.rests(decoding=10) for _ in range(3)] == [True, True, False]
    b.plan(decoding=10, in_prefill=0, waiting=2, room=50, chunks=[300])
    assert not b.rests(decoding=0)  # nothing decoding: nothing to stall, and the rest is over
    assert not b.rests(decoding=10)
    off = PrefillBudget(0, max_chunk=512, max_prompts=8, every=3)  # no bound: nothing rests
    assert off.plan(decoding=10, in_prefill=0, waiting=9, room=50) == (512, 8)
    assert not any(off.rests(decoding=10) for _ in range(6))
    for every in (0, -2, 1.5, True):
        with pytest.raises(ValueError, match="prefill_every"):
            PrefillBudget(128, max_chunk=8, max_prompts=1, every=every)  # type: ignore[arg-type]


def _prefill_steps(model: Any, every: int) -> tuple[dict[int, list[int]], list[tuple[int, int]]]:
    """Greedy outputs by request, and (rows decoding before the step, prompt tokens it
    prefilled) for each step, of a stream of prompts arriving while rows decode."""
    e = MLXEngine(model, vocab_size=256, max_batch=6, prefill_batch=3, prefill_step=32,
                  step_token_budget=16, prefill_every=every)
    rng = random.Random(5)
    admits = [Admit(rid=i, prompt=[rng.randrange(3, 200) for _ in range(rng.randint(5, 60))],
                    max_tokens=rng.randint(4, 14), sampling=SamplingSpec(), stop_token_ids=())
              for i in range(16)]
    e.insert(admits[:6])
    later = iter(admits[6:])
    out: dict[int, list[int]] = {a.rid: [] for a in admits}
    steps: list[tuple[int, int]] = []
    while e.has_work():
        decoding = queue_sizes(e._gen).decoding
        r = e.step()
        steps.append((decoding, r.prefill_tokens))
        for rid, token in zip(r.rids, r.tokens, strict=True):
            out[rid].append(token)
        e.insert([a for a in (next(later, None) for _ in r.finished) if a is not None])
    e.close()
    return out, steps


@pytest.mark.integration
def test_prefill_every_n_steps_keeps_greedy_output_and_rests_between(tiny_model: Any) -> None:
    every_step, _ = _prefill_steps(tiny_model, 1)
    third, steps = _prefill_steps(tiny_model, 3)
    assert third == every_step
    # While rows decode, a step that prefilled more than a step's budget (16) is followed by one
    # that prefills nothing; no plan takes more than three steps' budget (whole prompts of at
    # most `prefill_step` = 32 tokens, as many as fit in 48).
    busy = [(i, prefilled) for i, (decoding, prefilled) in enumerate(steps) if decoding and prefilled]
    assert len(busy) > 3 and max(p for _, p in busy) <= 3 * 16
    after_large = [steps[i + 1] for i, p in busy if p > 16 and i + 1 < len(steps) and steps[i + 1][0]]
    assert after_large and all(prefilled == 0 for _, prefilled in after_large)


def test_prefill_every_auto_is_four_steps_on_cuda_and_every_step_elsewhere() -> None:
    assert cadence("auto", cuda=True) == 4 and cadence("auto", cuda=False) == 1
    assert cadence(3, cuda=True) == cadence(3, cuda=False) == 3
    for bad in (0, True, "often"):
        with pytest.raises(ValueError, match="prefill_every"):
            cadence(bad, cuda=True)


@pytest.mark.parametrize(("value", "every"), [('"auto"', 1), ("3", 3)])
def test_the_prefill_every_setting_reaches_the_engine_and_what_it_loaded(
    model_cache: Path, value: str, every: int
) -> None:
    cfg = SchedulerConfig.from_toml(
        f'[model]\npath = "synthetic:tiny"\ncache_dir = "{model_cache}"\n[worker]\nprefill_every = {value}'
    )
    built, loaded = real_engine_factory(cfg)()
    try:  # "auto" on this CPU backend: every step
        assert built.prefill_every == every == loaded.prefill_every
        assert built._budget._every == every
    finally:
        built.close()

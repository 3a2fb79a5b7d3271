"""Stall-free prefill: the per-step token budget, pure and through the actors."""

from __future__ import annotations

from typing import TYPE_CHECKING

import anyio
import pytest

from scheduler import SamplingParams, Scheduler, SchedulerConfig
from tests.fakes import FakeEngine, fake_factory, fake_token
from tests.test_integration import prompts
from workers.batching.budget import AUTO_MIN_CAP, AUTO_MIN_TOKENS, AUTO_TOKENS_PER_SLOT, PrefillBudget
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
    assert b.tokens() == max(AUTO_MIN_CAP, AUTO_TOKENS_PER_SLOT * 64)  # before any prompt was seen
    for _ in range(30):
        b.inserted(prompt_tokens=40, max_tokens=64)  # each of 64 slots frees a slot every 64 steps
    assert b.tokens() == 50  # 1.25 x 40 prompt tokens a step keeps up
    assert b.tokens(room=4, waiting=10) == 50 + 4 * 40 // 16  # and free slots fill in ~16 steps
    assert b.tokens(room=4, waiting=0) == 50
    for _ in range(30):
        b.inserted(prompt_tokens=10, max_tokens=400)
    # 1.25 x 10 x 64 / 400 = 2 tokens a step: the floor still lets a short prompt join in one step.
    assert b.tokens() == AUTO_MIN_TOKENS


def test_auto_budget_is_capped_per_batch_slot() -> None:
    # Prompts much longer than outputs: keeping the batch full would take 1.25 x 800 tokens a
    # step, a step several decode steps long; the cap keeps every step about alike instead.
    for slots in (8, 64, 256):
        b = PrefillBudget("auto", max_chunk=512, max_prompts=8, max_batch=slots)
        b.inserted(prompt_tokens=800, max_tokens=64)
        cap = max(AUTO_MIN_CAP, AUTO_TOKENS_PER_SLOT * slots)
        assert b.tokens() == b.tokens(room=30, waiting=30) == cap
        assert cap < 1.25 * 800 * slots / 64


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
    for budget in ("0", "24", '"auto"'):
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
        outputs[budget] = [got[i] for i in range(len(ps))]
    assert outputs["0"] == outputs["24"] == outputs['"auto"']


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

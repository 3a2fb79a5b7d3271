"""`[worker] prefill_order = "length"`: the shortest waiting prompts start prefilling first, so
that prompts of like length share a pass and pad less, and a prompt passed over for `PATIENCE`
steps goes ahead of every later one; every request's tokens stay what they are in arrival order
(the real mlx-lm BatchGenerator on synthetic:tiny)."""

from __future__ import annotations

import random
from typing import TYPE_CHECKING, Any

import pytest

from scheduler import SchedulerConfig
from scheduler.assembly import real_engine_factory
from scheduler.errors import ConfigError
from workers.batching.engine import MLXEngine
from workers.batching.order import PATIENCE
from workers.batching.prefill import PipelinedPrefill
from workers.messages import Admit, SamplingSpec

if TYPE_CHECKING:
    from pathlib import Path

pytestmark = pytest.mark.integration


def admit(rid: int, length: int, max_tokens: int = 3) -> Admit:
    rng = random.Random(rid)
    return Admit(rid=rid, prompt=[rng.randrange(3, 200) for _ in range(length)], max_tokens=max_tokens,
                 sampling=SamplingSpec(), stop_token_ids=())


def engine(model: Any, shortest_first: bool, budget: int, pack: bool = True) -> MLXEngine:
    return MLXEngine(model, vocab_size=256, max_batch=8, prefill_batch=4, prefill_step=128,
                     step_token_budget=budget, pack_prompts=pack, shortest_first=shortest_first)


def run(e: MLXEngine, admits: list[Admit]) -> dict[int, list[int]]:
    """All at once, then each finished request's place taken by the next one."""
    out: dict[int, list[int]] = {a.rid: [] for a in admits}
    e.insert(admits[:8])
    later = admits[8:]
    while e.has_work():
        r = e.step()
        for rid, tok in zip(r.rids, r.tokens, strict=True):
            out[rid].append(tok)
        e.insert(later[: len(r.finished)])
        later = later[len(r.finished):]
    e.close()
    return out


@pytest.fixture
def passes(monkeypatch: pytest.MonkeyPatch) -> list[tuple[list[int], int]]:
    """Each prefill pass: its prompts' lengths and its padded length."""
    seen: list[tuple[list[int], int]] = []
    prepared = PipelinedPrefill._prepared

    def recorded(self: PipelinedPrefill, tokens: list[list[int]]) -> Any:
        batch, padded = prepared(self, tokens)
        seen.append(([len(t) for t in tokens], batch.shape[1]))
        return batch, padded

    monkeypatch.setattr(PipelinedPrefill, "_prepared", recorded)
    return seen


@pytest.mark.parametrize("budget", [0, 24])
def test_shortest_first_gives_every_request_the_tokens_it_gets_in_arrival_order(
    tiny_model: Any, budget: int
) -> None:
    rng = random.Random(5)
    admits = [admit(i, rng.randint(3, 120), max_tokens=rng.randint(1, 12)) for i in range(24)]
    shortest = run(engine(tiny_model, True, budget), admits)
    arrival = run(engine(tiny_model, False, budget), admits)
    assert shortest == arrival
    assert [len(shortest[a.rid]) for a in admits] == [a.max_tokens for a in admits]


def test_a_pass_takes_the_shortest_waiting_prompts_and_pads_less(
    tiny_model: Any, passes: list[tuple[list[int], int]]
) -> None:
    lengths = [90, 11, 80, 21, 70, 31, 60, 41]
    admits = [admit(i, n) for i, n in enumerate(lengths)]
    run(engine(tiny_model, True, budget=0, pack=False), admits)
    # mlx-lm keeps each prompt's last token for the first decode step: a pass sees n - 1.
    assert [sorted(p) for p, _ in passes] == [[10, 20, 30, 40], [59, 69, 79, 89]]
    by_length = sum(len(p) * width for p, width in passes)
    passes.clear()
    run(engine(tiny_model, False, budget=0, pack=False), admits)
    assert [sorted(p) for p, _ in passes] == [[10, 20, 79, 89], [30, 40, 59, 69]]
    assert by_length == 4 * 40 + 4 * 89 < sum(len(p) * width for p, width in passes) == 4 * 89 + 4 * 69


@pytest.mark.parametrize("shortest", [True, False])
def test_a_long_prompt_waits_at_most_patience_steps_behind_shorter_later_ones(
    tiny_model: Any, passes: list[tuple[list[int], int]], shortest: bool
) -> None:
    e = MLXEngine(tiny_model, vocab_size=256, max_batch=16, prefill_batch=1, prefill_step=128,
                  step_token_budget=0, pack_prompts=False, shortest_first=shortest)
    e.insert([admit(0, 91)])
    started = 0  # the step whose pass took the long prompt
    for step in range(1, 9):  # a shorter prompt arrives before every step
        e.insert([admit(step, 11, max_tokens=20)])
        e.step()
        if not started and any(90 in p for p, _ in passes):
            started = step
    while e.has_work():
        e.step()
    e.close()
    assert sorted(p[0] for p, _ in passes) == [10] * 8 + [90]
    if shortest:
        assert passes[0][0] == [10]  # passed over at first
        # At the head of the queue from step PATIENCE on; a step in which prefilled prompts join
        # runs no pass, so the first pass from then on may be a step later.
        assert PATIENCE <= started <= PATIENCE + 1
    else:
        assert started == 1


@pytest.mark.parametrize(("order", "first_pass"), [("length", 2 + 4), ("arrival", 8 + 2)])
def test_the_prefill_order_setting_reaches_the_engine(model_cache: Path, order: str, first_pass: int) -> None:
    cfg = SchedulerConfig.from_toml(
        f'[model]\npath = "synthetic:tiny"\ncache_dir = "{model_cache}"\n[worker]\n'
        f'prefill_order = "{order}"\nprefill_pack = false\nprefill_batch = 2\nstep_token_budget = 0\n'
    )
    built, _ = real_engine_factory(cfg)()
    try:
        built.insert([admit(i, n) for i, n in enumerate([9, 3, 7, 5])])
        assert built.step().prefill_tokens == first_pass  # the pass's prompts, less each last token
    finally:
        built.close()


def test_a_bad_prefill_order_setting_is_named() -> None:
    with pytest.raises(ConfigError, match=r"worker\.prefill_order"):
        SchedulerConfig.from_toml('[worker]\nprefill_order = "random"')

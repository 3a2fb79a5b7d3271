"""A lone decoding row's step (`JoiningBatch.next_alone`) on the real mlx-lm BatchGenerator
(synthetic:tiny): it is taken exactly when one row decodes and nothing else is held, and every
request gets what the batch path gives it (tokens, finish reasons, log-probabilities, the KV a
session keeps), through rows joining, leaving and finishing alone."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import mlx.core as mx
import pytest

import workers.batching.engine as engine_mod
from workers.batching.engine import MLXEngine
from workers.batching.mlxlm import queue_sizes
from workers.batching.prefill import JoiningBatch
from workers.messages import Admit, Processing, SamplingSpec

if TYPE_CHECKING:
    from collections.abc import Sequence

pytestmark = pytest.mark.integration
GREEDY = SamplingSpec()
SAMPLED = SamplingSpec(temperature=0.9, top_p=0.95, seed=7)


def prompt(n: int, seed: int) -> list[int]:
    return [3 + (seed * 31 + i * 17) % 250 for i in range(n)]


class Run:
    """Steps an engine through a script of inserts (step number -> admits), recording each
    request's tokens, finish reason and log-probabilities, and which steps took the lone row's
    path."""

    def __init__(self, model: Any, lone: bool, monkeypatch: pytest.MonkeyPatch) -> None:
        self.lone_steps: list[tuple[bool, bool]] = []
        """Per step: whether the generator held one decoding row and nothing prefilling or
        waiting; whether the step went alone."""
        taken = [False]
        real = JoiningBatch.next_alone

        def spy(batch: JoiningBatch) -> list[Any]:
            taken[0] = True
            return real(batch)

        monkeypatch.setattr(JoiningBatch, "next_alone", spy)
        if not lone:
            monkeypatch.setattr(engine_mod, "lone_row", lambda gen: None)
        self.taken = taken
        self.engine = MLXEngine(model, vocab_size=256, max_batch=4, prefill_batch=4, prefill_step=64,
                                block_tokens=16)

    def __call__(self, script: dict[int, Sequence[Admit]]) -> dict[int, Any]:
        e = self.engine
        out: dict[int, Any] = {}
        step = 0
        while e.has_work() or any(k >= step for k in script):
            admits = list(script.get(step, ()))
            for a in admits:
                out[a.rid] = {"tokens": [], "reason": None, "logprobs": []}
            e.insert(admits)
            held = queue_sizes(e._gen)
            self.taken[0] = False
            r = e.step()
            self.lone_steps.append((held == (1, 0, 0), self.taken[0]))
            for rid, token in zip(r.rids, r.tokens, strict=True):
                out[rid]["tokens"].append(token)
            for lp in r.logprobs:
                out[r.rids[lp.at]]["logprobs"].append((round(lp.logprob, 4), lp.top_ids))
            for rid, reason in zip(r.finished, r.reasons, strict=True):
                out[rid]["reason"] = reason
            step += 1
        return out


def script(stop: int) -> dict[int, list[Admit]]:
    """A alone, then B joins while A decodes and leaves first, then A alone again to its
    length; C alone until it samples `stop`; D sampled alone, asking for log-probabilities."""
    return {
        0: [Admit(1, prompt(40, 1), 30, GREEDY, ())],
        6: [Admit(2, prompt(20, 2), 5, GREEDY, ())],
        40: [Admit(3, prompt(33, 3), 40, GREEDY, (stop,))],
        80: [Admit(4, prompt(50, 4), 12, SAMPLED, (), logprobs=2)],
    }


def test_a_lone_row_gets_what_the_batch_path_gives(tiny_model: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    with monkeypatch.context() as m:
        first = Run(tiny_model, False, m)(script(stop=-1))
    stop = first[3]["tokens"][5]  # a token C really samples, so that it stops
    with monkeypatch.context() as m:
        batch = Run(tiny_model, False, m)(script(stop))
    with monkeypatch.context() as m:
        run = Run(tiny_model, True, m)
        alone = run(script(stop))
    assert alone == batch
    assert batch[1]["reason"] == "length" and len(batch[1]["tokens"]) == 30
    assert batch[3]["reason"] == "stop" and stop not in batch[3]["tokens"]
    assert len(batch[4]["logprobs"]) == 12 and all(len(ids) == 2 for _, ids in batch[4]["logprobs"])
    # Taken exactly when one row was decoding and nothing else was held before the step.
    assert [held_one for held_one, _ in run.lone_steps] == [taken for _, taken in run.lone_steps]
    assert sum(taken for _, taken in run.lone_steps) >= 40


def test_a_row_with_logits_processors_takes_the_batch_path(tiny_model: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    penalised = Admit(1, prompt(30, 5), 16, GREEDY, (), processing=Processing(repetition_penalty=1.5))
    with monkeypatch.context() as m:
        run = Run(tiny_model, True, m)
        alone = run({0: [penalised]})
    with monkeypatch.context() as m:
        batch = Run(tiny_model, False, m)({0: [penalised]})
    assert alone == batch and len(alone[1]["tokens"]) == 16
    assert any(held_one for held_one, _ in run.lone_steps)
    assert not any(taken for _, taken in run.lone_steps)


def test_a_session_keeps_the_same_kv_after_a_lone_row_finishes(tiny_model: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    kept = []
    for lone in (True, False):
        with monkeypatch.context() as m:
            run = Run(tiny_model, lone, m)
            run({0: [Admit(1, prompt(40, 6), 20, GREEDY, (), session="s")]})
            assert run.engine._store is not None
            taken = run.engine._store.take_session("s")
            assert taken is not None
            kept.append(taken)
    (cache_a, tokens_a), (cache_b, tokens_b) = kept
    assert tokens_a == tokens_b and len(tokens_a) == 40 + 20  # the prompt and every output token
    assert [c.offset for c in cache_a] == [c.offset for c in cache_b]
    for a, b in zip(cache_a, cache_b, strict=True):
        n = a.offset
        assert mx.array_equal(a.keys[..., :n, :], b.keys[..., :n, :]).item()
        assert mx.array_equal(a.values[..., :n, :], b.values[..., :n, :]).item()

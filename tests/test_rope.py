"""One table of cosines and sines a step for rotary positions on the CPU (`workers/batching/rope.py`):
the same results as MLX's own rope to the bit, for the calls it serves, and MLX's own path for the
others; through our engine, the same tokens and log-probabilities with it as without it."""

from __future__ import annotations

import itertools
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import pytest
from mlx_lm.models.cache import BatchKVCache
from mlx_lm.models.rope_utils import Llama3RoPE

from workers.batching import rope
from workers.batching.engine import MLXEngine
from workers.loading.dtypes import on_cpu
from workers.loading.models import load_model
from workers.messages import Admit, SamplingSpec

pytestmark = pytest.mark.skipif(not on_cpu(), reason="the table serves MLX's CPU backend only")

LLAMA3 = {"factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 8192}


def module(kind: str, dims: int, base: float, scale: float) -> Any:
    if kind == "llama3":
        return Llama3RoPE(dims, base=base, scaling_config=LLAMA3)
    return nn.RoPE(dims, base=base, scale=scale)


def cache(per_row: bool) -> BatchKVCache:
    c = BatchKVCache([2, 0, 5])
    c.offset = mx.array([37, 1000, 131000]) if per_row else mx.array([123])
    return c


CASES = list(itertools.product(("rope", "llama3"), (mx.float32, mx.bfloat16), (1, 5), (True, False),
                               ((32, 10000.0, 1.0), (64, 500000.0, 1.0), (64, 1e6, 0.25))))


@pytest.mark.parametrize(("kind", "dtype", "length", "per_row", "rope_args"), CASES)
def test_the_tables_rotation_is_mlxs_to_the_bit(kind: str, dtype: Any, length: int, per_row: bool,
                                                 rope_args: tuple[int, float, float]) -> None:
    dims = rope_args[0]
    m, c = module(kind, *rope_args), cache(per_row)
    q = mx.random.normal((3, 4, length, dims), key=mx.random.key(1)).astype(dtype)
    k = mx.random.normal((3, 2, length, dims), key=mx.random.key(2)).astype(dtype)
    want = [m(q, offset=c.offset), m(k, offset=c.offset)]
    with rope.positions([m], [c]):
        served = [rope.rotate(m, x, c.offset) for x in (q, k)]
        got = [m(q, offset=c.offset), m(k, offset=c.offset)]
    assert all(s is not None for s in served)  # the table's path, not MLX's
    for g, w in zip(got, want, strict=True):
        assert g.dtype == w.dtype and mx.array_equal(g, w).item()


def test_without_the_c_logarithm_a_probe_gives_the_same_table(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(rope, "_logf", lambda: None)
    monkeypatch.setattr(rope, "_formula", {})
    m, c = nn.RoPE(64, base=1e6), cache(True)
    x = mx.random.normal((3, 4, 1, 64)).astype(mx.bfloat16)
    want = m(x, offset=c.offset)
    with rope.positions([m], [c]):
        got = m(x, offset=c.offset)
    assert rope._formula == {(64, 1e6, 1.0, None): (None, None)}  # checked: no formula, the probe serves
    assert mx.array_equal(got, want).item()


def test_what_the_table_does_not_serve_keeps_mlxs_path() -> None:
    c = cache(True)
    x = mx.random.normal((3, 4, 1, 64))
    partial, traditional = nn.RoPE(32), nn.RoPE(64, traditional=True)
    with rope.positions([partial, traditional], [c]):
        assert rope.rotate(partial, x, c.offset) is None  # part of each head rotated
        assert rope.rotate(traditional, x, c.offset) is None
        assert rope.rotate(nn.RoPE(64), x, mx.array([1, 2, 3])) is None  # not a step's batch
        assert mx.array_equal(partial(x, offset=c.offset),
                              mx.fast.rope(x, 32, traditional=False, base=10000.0, scale=1.0,
                                           offset=c.offset)).item()
    assert rope.rotate(nn.RoPE(64), x, c.offset) is None  # outside a step


def test_layers_that_hold_unlike_lengths_are_not_one_batch() -> None:
    a, b = cache(True), cache(True)
    a._idx, b._idx = 5, 6
    m = nn.RoPE(64)
    with rope.positions([m], [a, b]):
        assert rope.rotate(m, mx.zeros((3, 4, 1, 64)), a.offset) is None


def test_the_modules_get_their_own_classes_back_after_a_step() -> None:
    m, c = nn.RoPE(64), cache(True)
    with rope.positions([m], [c]):
        assert type(m) is not nn.RoPE
        with rope.positions([m], [c]):  # nested: the outer one restores
            pass
        assert type(m) is not nn.RoPE
    assert type(m) is nn.RoPE


def _closed_loop(model: Any, budget: int | str, enabled: bool, monkeypatch: pytest.MonkeyPatch) -> tuple[Any, ...]:
    """Eight requests over four rows (prompts of 5-150 tokens): every request's tokens and
    log-probabilities, and the layers' offsets after the last step."""
    monkeypatch.setattr(rope, "ENABLED", enabled)
    engine = MLXEngine(model, vocab_size=256, max_batch=4, prefill_batch=2, prefill_step=64,
                       step_token_budget=budget)
    admits = [Admit(r, [3 + (r * 31 + i * 17) % 250 for i in range(5 + 20 * r)], 12, SamplingSpec(), (),
                    logprobs=2) for r in range(8)]
    engine.insert(admits[:4])
    tokens: dict[int, list[int]] = {}
    logprobs: dict[int, list[Any]] = {}
    offsets_shared = []
    waiting = admits[4:]
    while engine.has_work() or waiting:
        result = engine.step()
        for rid, tok in zip(result.rids, result.tokens, strict=True):
            tokens.setdefault(rid, []).append(tok)
        for lp in result.logprobs:
            logprobs.setdefault(result.rids[lp.at], []).append((lp.logprob, lp.top_ids, lp.top_logprobs))
        caches = engine._gen._generation_batch.prompt_cache
        if caches:
            offsets_shared.append(all(mx.array_equal(c.offset, caches[0].offset).item() for c in caches))
        if result.finished and waiting:
            engine.insert([waiting.pop(0) for _ in result.finished if waiting])
    engine.close()
    return tokens, logprobs, offsets_shared


@pytest.mark.integration
@pytest.mark.parametrize("budget", ["auto", 0])
@pytest.mark.parametrize("name", ["synthetic:tiny", "synthetic:small"])
def test_our_engine_gives_the_same_tokens_and_log_probabilities_with_the_table(
        name: str, budget: int | str, model_cache: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    model, _ = load_model(name, model_cache)
    assert len(rope.modules(model)) == len(model.model.layers)
    with_table = _closed_loop(model, budget, True, monkeypatch)
    without = _closed_loop(model, budget, False, monkeypatch)
    assert with_table[0] == without[0] and len(with_table[0]) == 8
    assert with_table[1] == without[1] and with_table[1]
    assert all(with_table[2]) and with_table[2]  # every layer's positions stay the first's


def test_off_the_cpu_or_switched_off_no_module_is_served(tiny_model: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    assert len(rope.modules(tiny_model)) == len(tiny_model.model.layers)
    monkeypatch.setattr(rope, "ENABLED", False)
    assert rope.modules(tiny_model) == []
    monkeypatch.setattr(rope, "ENABLED", True)
    monkeypatch.setattr(rope, "on_cpu", lambda: False)  # a GPU backend has a rope kernel
    assert rope.modules(tiny_model) == []

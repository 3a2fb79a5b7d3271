"""Model facts from the model's own caches: layer kinds, nested text_config, unbatchable caches."""

from __future__ import annotations

import random
from typing import TYPE_CHECKING

import anyio
import mlx.core as mx
import mlx.nn as nn
import mlx_lm
import pytest
from mlx_lm.generate import generate_step
from mlx_lm.models.cache import QuantizedKVCache

from scheduler import SamplingParams, Scheduler, SchedulerConfig
from tests import layered_models
from workers.loading.models import LayerCache, ModelSourceError, model_info

if TYPE_CHECKING:
    from pathlib import Path

SLIDING = LayerCache("sliding", "RotatingKVCache", kv_heads=2, head_dim=32, window=64)
FULL = LayerCache("full", "KVCache", kv_heads=2, head_dim=32)


@pytest.mark.parametrize("kind", ["gemma3_text", "gemma3"])
def test_gemma3_layers_and_shape_with_or_without_text_config(model_cache: Path, kind: str) -> None:
    path = layered_models.build(kind, model_cache)
    model, tokenizer = mlx_lm.load(str(path))
    info = model_info(model, tokenizer, path)
    assert info.layers == (SLIDING, SLIDING, FULL) * 2
    assert (info.model_type, info.num_layers, info.num_kv_heads, info.head_dim) == (kind, 6, 2, 32)
    assert (info.vocab_size, info.context_length, info.dtype) == (1024, 4096, "float32")
    # The unit of the books is the full-attention layers' token: 2 layers x 2 heads x 32 x K,V x 4.
    assert info.kv_bytes_per_token == 2 * 2 * 32 * 2 * 4


def test_a_quantized_model_books_its_kv_in_the_activation_dtype(model_cache: Path) -> None:
    path = layered_models.build("gemma3", model_cache, dtype="bfloat16")
    model, tokenizer = mlx_lm.load(str(path))
    nn.quantize(model, group_size=32, bits=4)  # as mlx_lm.convert -q does
    info = model_info(model, tokenizer, path)
    assert info.dtype == "bfloat16" and info.kv_bytes_per_token == 2 * 2 * 32 * 2 * 2
    assert [c.kind for c in info.layers] == ["sliding", "sliding", "full"] * 2


def test_recurrent_layers_carry_their_state_size(model_cache: Path) -> None:
    path = layered_models.build("qwen3_next", model_cache)
    model, tokenizer = mlx_lm.load(str(path))
    info = model_info(model, tokenizer, path)
    # Gated delta net: conv state [1, kernel-1, 2*key_heads*key_dim + value_heads*value_dim] and
    # recurrent state [1, value_heads, value_dim, key_dim], float32 here.
    state = (3 * (2 * 2 * 16 + 4 * 16) + 4 * 16 * 16) * 4
    recurrent = LayerCache("recurrent", "ArraysCache", state_bytes=state)
    assert info.layers == (recurrent, recurrent, recurrent, FULL)
    assert info.kv_bytes_per_token == 2 * 32 * 2 * 4

    path = layered_models.build("lfm2", model_cache)
    model, tokenizer = mlx_lm.load(str(path))
    kinds = [c.kind for c in model_info(model, tokenizer, path).layers]
    assert kinds == ["recurrent", "full", "recurrent", "full"]


def test_a_cache_batchgenerator_cannot_batch_fails_at_load_naming_it(model_cache: Path) -> None:
    # What mlx-lm builds for kv_bits: QuantizedKVCache has no merge(), so no batch can hold it.
    path = layered_models.build("gemma3_text", model_cache)
    model, tokenizer = mlx_lm.load(str(path))
    model.make_cache = lambda: [QuantizedKVCache() for _ in model.layers]
    with pytest.raises(ModelSourceError, match=r"QuantizedKVCache caches, which mlx-lm's BatchGenerator"):
        model_info(model, tokenizer, path)


@pytest.mark.anyio
@pytest.mark.integration
async def test_a_text_config_model_starts_and_matches_mlx_lm(model_cache: Path) -> None:
    path = layered_models.build("gemma3", model_cache)
    model, tokenizer = mlx_lm.load(str(path))
    prompt = tokenizer.encode("the quick brown fox jumps over the lazy dog")
    # mlx-lm alone, greedy (generate_step's default sampler is argmax).
    expected = [int(t) for t, _ in generate_step(mx.array(prompt), model, max_tokens=20)]
    cfg = SchedulerConfig.from_toml(f'[model]\npath = "{path}"\n[kvpool]\nmemory = "64MiB"')
    with anyio.fail_after(120):
        async with Scheduler(cfg) as s:
            got = await s.complete(prompt, SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True))
    assert got.token_ids == expected and got.finish_reason == "length"


@pytest.mark.anyio
@pytest.mark.integration
async def test_float32_sliding_window_model_is_bit_identical_under_budget_and_joins(model_cache: Path) -> None:
    """The documented setting for identical greedy output with sliding-window layers: float32.
    (bf16 and 4-bit gemma3 differ under the same pattern on the bare BatchGenerator too; see
    benchmarks/batch_numerics.py.)"""
    path = layered_models.build("gemma3_text", model_cache)
    model, _ = mlx_lm.load(str(path))
    rng = random.Random(5)
    prompts = [[rng.randrange(3, 1000) for _ in range(rng.randint(20, 300))] for _ in range(5)]
    expected = [[int(t) for t, _ in generate_step(mx.array(p), model, max_tokens=30)] for p in prompts]
    cfg = SchedulerConfig.from_toml(
        f'[model]\npath = "{path}"\n[worker]\nstep_token_budget = 48\n[kvpool]\nmemory = "64MiB"'
    )
    got: dict[int, list[int]] = {}
    with anyio.fail_after(120):
        async with Scheduler(cfg) as s:

            async def one(i: int) -> None:
                await anyio.sleep(0.05 * i)  # rows join a decoding batch, prompts in 48-token chunks
                c = await s.complete(prompts[i], SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True))
                got[i] = c.token_ids

            async with anyio.create_task_group() as tg:
                for i in range(len(prompts)):
                    tg.start_soon(one, i)
    assert [got[i] for i in range(len(prompts))] == expected

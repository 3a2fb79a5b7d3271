"""The one-pass step (`workers/batching/fused.py`) on mlx-lm's own model classes, random weights:
a decode step and a prefill chunk in one pass give what the two passes apart give, with the batch
caches a running engine has (decode rows left-padded, a chunk right-padded over earlier chunks)."""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import pytest
from mlx_lm.models import llama, phi3, qwen2, qwen3
from mlx_lm.models.cache import BatchKVCache

from workers.batching.fused import forward, unfusable

SHAPE: dict[str, Any] = dict(hidden_size=64, num_hidden_layers=2, intermediate_size=128,
                             num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-5,
                             vocab_size=256)


def build(kind: str) -> Any:
    if kind == "llama":
        model = llama.Model(llama.ModelArgs(model_type="llama", **SHAPE))
    elif kind == "llama, untied":
        model = llama.Model(llama.ModelArgs(model_type="llama", tie_word_embeddings=False, **SHAPE))
    elif kind == "qwen2":
        model = qwen2.Model(qwen2.ModelArgs(model_type="qwen2", **SHAPE))
    else:
        model = qwen3.Model(qwen3.ModelArgs(model_type="qwen3", head_dim=16, max_position_embeddings=512,
                                            tie_word_embeddings=True, rope_theta=1e6, **SHAPE))
    mx.eval(model.parameters())
    return model


def decode_caches(model: Any) -> list[Any]:
    """Three rows of 8 positions, two of them left-padded (3 and 5)."""
    caches = [BatchKVCache([3, 0, 5]) for _ in model.model.layers]
    model(mx.array([[0, 0, 0, 7, 8, 9, 10, 11], [1, 2, 3, 4, 5, 6, 7, 8], [0, 0, 0, 0, 0, 9, 9, 9]]),
          cache=caches)
    return caches


def chunk_caches(model: Any) -> list[Any]:
    """Two prompts with a first chunk of 3 tokens in, the next chunk's second prompt 2 tokens short."""
    caches = [BatchKVCache([0, 0]) for _ in model.model.layers]
    model(mx.array([[5, 6, 7], [8, 9, 10]]), cache=caches)
    for c in caches:
        c.prepare(lengths=[4, 2], right_padding=[0, 2])
    return caches


@pytest.mark.parametrize("kind", ["llama", "llama, untied", "qwen2", "qwen3"])
def test_one_pass_gives_what_the_two_passes_give(kind: str) -> None:
    model = build(kind)
    assert unfusable(model) == ""
    inputs, chunk = mx.array([[12], [13], [14]]), mx.array([[20, 21, 22, 23], [24, 25, 0, 0]])
    apart, apart_chunk = decode_caches(model), chunk_caches(model)
    logits = model(inputs, cache=apart)
    model(chunk, cache=apart_chunk)
    together, together_chunk = decode_caches(model), chunk_caches(model)
    fused = forward(model, inputs, together, chunk, together_chunk)
    assert fused.shape == logits.shape == (3, 1, 256)
    assert mx.allclose(fused, logits, atol=1e-4).item()
    for a, b in zip(apart_chunk, together_chunk, strict=True):
        a.finalize()
        b.finalize()
    for a, b in zip(apart_chunk + apart, together_chunk + together, strict=True):
        assert a._idx == b._idx
        assert a.offset.tolist() == b.offset.tolist()
        assert mx.allclose(a.keys[..., : a._idx, :], b.keys[..., : b._idx, :], atol=1e-4).item()
        assert mx.allclose(a.values[..., : a._idx, :], b.values[..., : b._idx, :], atol=1e-4).item()


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_rows_padded_to_a_multiple_change_nothing(kind: str) -> None:
    model = build(kind)
    inputs, chunk = mx.array([[12], [13], [14]]), mx.array([[20, 21, 22, 23], [24, 25, 0, 0]])
    plain, plain_chunk = decode_caches(model), chunk_caches(model)
    padded, padded_chunk = decode_caches(model), chunk_caches(model)
    want = forward(model, inputs, plain, chunk, plain_chunk)
    got = forward(model, inputs, padded, chunk, padded_chunk, pad_rows=16)  # 11 rows -> 16
    assert got.shape == want.shape == (3, 1, 256)
    assert mx.allclose(got, want, atol=1e-5).item()
    for a, b in zip(plain_chunk + plain, padded_chunk + padded, strict=True):
        assert a._idx == b._idx
        assert mx.allclose(a.keys[..., : a._idx, :], b.keys[..., : b._idx, :], atol=1e-5).item()


def test_blocks_it_does_not_restate_are_named() -> None:
    other = phi3.Model(phi3.ModelArgs(model_type="phi3", **SHAPE))  # one fused qkv projection
    assert "mlx_lm.models.phi3.TransformerBlock" in unfusable(other)
    assert "no list of layers" in unfusable(object())

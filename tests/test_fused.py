"""The one-pass step (`workers/batching/fused.py`) on mlx-lm's own model classes, random weights:
a decode step and a prefill chunk in one pass give what the two passes apart give, with the batch
caches a running engine has (decode rows left-padded, a chunk right-padded over earlier chunks)."""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import pytest
from mlx_lm.models import llama, phi3, qwen2, qwen3
from mlx_lm.models.cache import BatchKVCache

from workers.batching import fused
from workers.batching.fused import forward, ragged, unfusable

SHAPE: dict[str, Any] = dict(hidden_size=64, num_hidden_layers=2, intermediate_size=128,
                             num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-5,
                             vocab_size=256)


def build(kind: str, layers: int = 2) -> Any:
    shape = {**SHAPE, "num_hidden_layers": layers}
    if kind == "llama":
        model = llama.Model(llama.ModelArgs(model_type="llama", **shape))
    elif kind == "llama, untied":
        model = llama.Model(llama.ModelArgs(model_type="llama", tie_word_embeddings=False, **shape))
    elif kind == "qwen2":
        model = qwen2.Model(qwen2.ModelArgs(model_type="qwen2", **shape))
    else:
        model = qwen3.Model(qwen3.ModelArgs(model_type="qwen3", head_dim=16, max_position_embeddings=512,
                                            tie_word_embeddings=True, rope_theta=1e6, **shape))
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
@pytest.mark.parametrize("fresh", [False, True])
def test_one_pass_gives_what_the_two_passes_give(kind: str, fresh: bool) -> None:
    """Over an earlier chunk (right-padded), or into caches that hold nothing yet (left-padded,
    the chunk then all they hold, with no buffer grown for it)."""
    model = build(kind)
    assert unfusable(model) == ""
    inputs = mx.array([[12], [13], [14]])
    chunk = mx.array([[20, 21, 22, 23], [0, 0, 24, 25] if fresh else [24, 25, 0, 0]])
    start = fresh_caches if fresh else chunk_caches
    apart, apart_chunk = decode_caches(model), start(model)
    logits = model(inputs, cache=apart)
    model(chunk, cache=apart_chunk)
    together, together_chunk = decode_caches(model), start(model)
    fused = forward(model, inputs, together, chunk, together_chunk)
    assert fused.shape == logits.shape == (3, 1, 256)
    assert mx.allclose(fused, logits, atol=1e-4).item()
    for a, b in zip(apart_chunk, together_chunk, strict=True):
        if fresh:
            assert b.keys.shape[2] == 4 and a.keys.shape[2] == 256  # mlx-lm's grows a step
            kv = mx.ones((2, 2, 1, 16))  # two kv heads of 16 in every kind here
            a.update_and_fetch(kv, kv)  # and either takes the next token alike
            b.update_and_fetch(kv, kv)
        else:
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


def fresh_caches(model: Any) -> list[Any]:
    """Two prompts' caches that hold nothing yet, told of the second prompt's left padding."""
    caches = [BatchKVCache([0, 0]) for _ in model.model.layers]
    for c in caches:
        c.prepare(left_padding=[0, 2])
    return caches


def same_real_positions(a: Any, b: Any) -> bool:
    """Whether two prompt caches agree where they are not padding (each row from its padding on)."""
    if a._idx != b._idx or a.offset.tolist() != b.offset.tolist():
        return False
    pads = a.left_padding.tolist()
    if pads != b.left_padding.tolist():
        return False
    return all(
        mx.allclose(x[r, :, pad : a._idx], y[r, :, pad : b._idx], atol=1e-4).item()
        for r, pad in enumerate(pads) for x, y in ((a.keys, b.keys), (a.values, b.values)))


@pytest.mark.parametrize("kind", ["llama", "qwen2", "qwen3"])
@pytest.mark.parametrize("left", [True, False])
def test_a_ragged_chunk_gives_what_the_padded_one_gives_where_it_is_not_padding(kind: str, left: bool) -> None:
    model = build(kind)
    inputs = mx.array([[12], [13], [14]])
    prompts = [[20, 21, 22, 23], [24, 25]]
    chunk = mx.array([[20, 21, 22, 23], [0, 0, 24, 25]] if left else [[20, 21, 22, 23], [24, 25, 0, 0]])
    start = fresh_caches if left else chunk_caches
    layout = ragged(prompts, 4, left=left)
    assert layout is not None and layout.tokens.tolist() == [20, 21, 22, 23, 24, 25]
    plain, plain_chunk = decode_caches(model), start(model)
    ours, ours_chunk = decode_caches(model), start(model)
    want = forward(model, inputs, plain, chunk, plain_chunk, pad_rows=8)
    got = forward(model, inputs, ours, chunk, ours_chunk, pad_rows=8, layout=layout)
    assert got.shape == want.shape == (3, 1, 256)
    assert mx.allclose(got, want, atol=1e-4).item()
    for a, b in zip(plain, ours, strict=True):
        assert same_real_positions(a, b)
    for a, b in zip(plain_chunk, ours_chunk, strict=True):
        if not left:
            a.finalize()
            b.finalize()
        assert same_real_positions(a, b)
        assert b.left_padding.tolist() == [0, 2]


def test_the_ragged_layout_fills_padding_with_its_prompts_first_token() -> None:
    layout = ragged([[5, 6], [7, 8, 9]], 4, left=True)
    assert layout is not None
    assert layout.tokens.tolist() == [5, 6, 7, 8, 9]
    assert layout.spread.tolist() == [0, 0, 0, 1, 2, 2, 3, 4]  # [pad pad 5 6], [pad 7 8 9]
    assert (layout.rows, layout.cols) == ([0, 0, 1, 1, 1], [2, 3, 1, 2, 3])
    rows, cols = layout.outputs(2)  # two rows round the pass up: any position, here the first
    assert (rows.tolist(), cols.tolist()) == ([0, 0, 1, 1, 1, 0, 0], [2, 3, 1, 2, 3, 0, 0])
    right = ragged([[5, 6], [7, 8, 9]], 4, left=False)
    assert right is not None and right.spread.tolist() == [0, 1, 0, 0, 2, 3, 4, 2]
    assert right.cols == [0, 1, 0, 1, 2]


def test_a_chunk_with_little_padding_or_the_switch_off_stays_padded(monkeypatch: pytest.MonkeyPatch) -> None:
    assert ragged([[1] * 8, [1] * 8], 8, left=True) is None  # no padding
    assert ragged([[1] * 15, [1] * 16], 16, left=False) is None  # 1 of 32 positions
    assert ragged([[1] * 12, [1] * 16], 16, left=False) is not None  # 4 of 32: 12.5%
    monkeypatch.setattr(fused, "RAGGED", False)
    assert ragged([[1] * 2, [1] * 16], 16, left=False) is None


STEPS = ([[12], [13], [14]], [[15], [16], [17]], [[18], [19], [20]])
"""Three decode steps' tokens for `decode_caches`' three rows."""


def spread_chunk(ragged_layout: bool) -> fused.Chunk:
    """Two prompts of 4 and 2 tokens, padded on the left, into `fresh_caches`."""
    layout = ragged([[20, 21, 22, 23], [24, 25]], 4, left=True) if ragged_layout else None
    return fused.Chunk(mx.array([[20, 21, 22, 23], [0, 0, 24, 25]]), False, layout)


@pytest.mark.parametrize("kind", ["llama", "qwen2", "qwen3"])
@pytest.mark.parametrize("ragged_layout", [False, True])
def test_a_chunk_spread_over_decode_steps_gives_what_one_pass_and_plain_steps_give(
    kind: str, ragged_layout: bool
) -> None:
    """Three decode steps carry a chunk through four layers, 2, 1 and 1 of them: each step's
    logits are the plain decode step's, and the chunk's caches end as its own pass leaves them,
    layer by layer as it goes."""
    model = build(kind, layers=4)
    chunk = spread_chunk(ragged_layout)
    plain, alone = decode_caches(model), fresh_caches(model)
    want = [model(mx.array(tokens), cache=plain) for tokens in STEPS]
    model(chunk.tokens, cache=alone)
    ours, carried = decode_caches(model), fresh_caches(model)
    state = fused.Carry(chunk, passes=3)
    spans, got = [], []
    for tokens in STEPS:
        spans.append(state.span(4))
        got.append(fused.carry(model, mx.array(tokens), ours, state, carried, pad_rows=8))
        done = spans[-1][1]
        assert [c._idx for c in carried] == [4] * done + [0] * (4 - done)  # the layers it went through
        assert (state.hidden is None) == (done == 4)
    assert spans == [(0, 2), (2, 3), (3, 4)] and state.through(4) and state.passes == 0
    for g, w in zip(got, want, strict=True):
        assert g is not None and g.shape == w.shape == (3, 1, 256)
        assert mx.allclose(g, w, atol=1e-4).item()
    for a, b in zip(plain + alone, ours + carried, strict=True):
        assert same_real_positions(a, b)


@pytest.mark.parametrize("ragged_layout", [False, True])
def test_what_the_steps_left_of_a_chunk_goes_through_a_pass_of_its_own(ragged_layout: bool) -> None:
    """A chunk taken through the first of four layers, then the rest without decode rows (a row
    removed, a join: anything that reads the prompt caches before the steps are done)."""
    model = build("llama", layers=4)
    chunk = spread_chunk(ragged_layout)
    alone = fresh_caches(model)
    model(chunk.tokens, cache=alone)
    carried = fresh_caches(model)
    state = fused.Carry(chunk, passes=4)
    assert fused.carry(model, mx.array(STEPS[0]), decode_caches(model), state, carried) is not None
    assert state.done == 1 and not state.through(4)
    assert state.span(4) == (1, 2)  # the next step would take one more
    assert fused.carry(model, None, [], state, carried) is None  # all three layers left, at once
    assert state.through(4) and state.hidden is None
    for a, b in zip(alone, carried, strict=True):
        assert same_real_positions(a, b)


def test_blocks_it_does_not_restate_are_named() -> None:
    other = phi3.Model(phi3.ModelArgs(model_type="phi3", **SHAPE))  # one fused qkv projection
    assert "mlx_lm.models.phi3.TransformerBlock" in unfusable(other)
    assert "no list of layers" in unfusable(object())

"""One forward pass for a decode step and a prefill chunk (the mixed batch of vLLM and Sarathi-Serve).

mlx-lm runs a step that prefills as two forward passes: the decode rows' single tokens, then the
prompt chunk. The second pass builds a whole graph on the host and reads every weight again
(docs/stalls.md measures what one pass saves on the CPU and on a GPU). Here the decode rows' tokens and the
chunk's tokens go through the projections and MLPs as one matrix; only the attention is split,
each part against its own caches (the decode batch's, the prompt batch's), with the masks mlx-lm's
own passes would use. The chunk's logits are never computed: in the last layer only its keys and
values are stored. A chunk that is largely padding goes through the projections and MLPs without
it (`Ragged`), and prompt caches that hold nothing yet take the chunk as their arrays.

Only blocks written as llama's, qwen2's and qwen3's are fused (`unfusable` says why a model is
not), since the pass re-states their forward: RMSNorm, attention with rotary positions, RMSNorm,
MLP, each with a residual. A test checks the fused pass against the two passes apart for each.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import mlx.core as mx
from mlx_lm.models.base import create_attention_mask
from mlx_lm.models.cache import BatchKVCache

from workers.batching.padded_attention import attention

BLOCKS = ("mlx_lm.models.llama", "mlx_lm.models.qwen2", "mlx_lm.models.qwen3")
"""mlx-lm's modules whose `TransformerBlock` and `Attention` the fused pass re-states (qwen3's
attention normalizes each head's queries and keys, `q_norm` and `k_norm`, before the rotation)."""


def unfusable(model: Any) -> str:
    """Why `model`'s decode steps cannot carry a prefill chunk ("" when they can)."""
    inner = getattr(model, "model", None)
    layers = getattr(inner, "layers", None)
    if not isinstance(layers, list) or not layers:
        return "the model has no list of layers at `model.layers`"
    if getattr(inner, "pipeline_size", 1) != 1:
        return "the model's layers are split over processes (pipeline parallel)"
    if not all(hasattr(inner, name) for name in ("embed_tokens", "norm")):
        return "the model has no `embed_tokens` and `norm` beside its layers"
    for layer in layers:
        attn = getattr(layer, "self_attn", None)
        where = type(layer).__module__
        if (where not in BLOCKS or type(layer).__name__ != "TransformerBlock"
                or type(attn).__module__ != where or type(attn).__name__ != "Attention"):
            return (f"its layers ({where}.{type(layer).__name__}) are not llama's, qwen2's or "
                    "qwen3's blocks, the ones the one-pass step re-states")
        if getattr(layer, "use_sliding", False):
            return "it has sliding-window layers"
    return ""


RAGGED = True
"""False runs a padded chunk's padding through the projections and MLPs as well (a switch for
benchmarks; see `Ragged`)."""
RAGGED_MIN_SHARE = 0.125
"""A chunk goes ragged when at least this share of its padded tokens is padding: each layer
then gathers its queries, keys and values into the padded layout and its output back out, three
launches more than the padded pass."""


class Ragged(NamedTuple):
    """A padded chunk's real tokens, for a pass whose projections and MLPs skip its padding.

    The prompts of a chunk are padded to the longest (and on CUDA to a multiple of 64), and the
    padding went through every projection and MLP like a real token: in a closed loop of prompts
    of 64-512 tokens a carried chunk was about 40% padding (`prefill_phases.py`, `real`). Here the
    pass holds only the real tokens; each layer's attention alone sees the padded layout, which
    it needs for the prompt caches, through a gather whose padding positions repeat a real
    token of their prompt (finite, and masked like any padding)."""

    tokens: mx.array
    """`(R,)`: the real tokens, prompt after prompt."""
    spread: mx.array
    """`(prompts * length,)`: for each position of the padded chunk, the real token that fills it."""
    rows: list[int]
    """Each real token's prompt."""
    cols: list[int]
    """Each real token's position in its prompt's padded row."""

    def outputs(self, extra: int) -> tuple[mx.array, mx.array]:
        """Where the attention's outputs for the real tokens lie in the padded layout, then
        `extra` more (any: they fill the rows that round the pass up, which nothing reads), so
        that one gather makes every row before the decode rows'."""
        tail = [0] * extra
        return mx.array(self.rows + tail, dtype=mx.int32), mx.array(self.cols + tail, dtype=mx.int32)


def ragged(tokens: list[list[int]], length: int, *, left: bool) -> Ragged | None:
    """The layout of `tokens` padded to `length` (on the left, else the right), or None when
    too little of it is padding to be worth the gathers (`RAGGED_MIN_SHARE`)."""
    real = sum(len(t) for t in tokens)
    if not RAGGED or (len(tokens) * length - real) < RAGGED_MIN_SHARE * len(tokens) * length:
        return None
    flat: list[int] = []
    spread: list[int] = []
    rows: list[int] = []
    cols: list[int] = []
    for p, prompt in enumerate(tokens):
        n, first = len(prompt), len(flat)
        start = length - n if left else 0
        spread += [first] * start + list(range(first, first + n)) + [first] * (length - start - n)
        flat += prompt
        rows += [p] * n
        cols += range(start, start + n)
    return Ragged(mx.array(flat, dtype=mx.int32), mx.array(spread, dtype=mx.int32), rows, cols)


def _heads(t: mx.array, rows: int, length: int, n: int, norm: Any = None) -> mx.array:
    t = t.reshape(rows, length, n, -1)
    return (t if norm is None else norm(t)).transpose(0, 2, 1, 3)


def _store(attn: Any, k: mx.array, v: mx.array, rows: int, length: int, cache: Any) -> tuple[Any, Any]:
    """Rotary positions on `k`; both into `cache`; what it now holds."""
    k = _heads(k, rows, length, attn.n_kv_heads, getattr(attn, "k_norm", None))
    k = attn.rope(k, offset=cache.offset)
    v = _heads(v, rows, length, attn.n_kv_heads)
    if isinstance(cache, BatchKVCache) and cache.keys is None:
        # A prompt cache that holds nothing yet holds the chunk: mlx-lm's update would zero a
        # buffer of 256-position steps and copy the chunk in, two more launches each.
        fresh: Any = cache  # mlx-lm types its arrays as None
        fresh.keys, fresh.values = k, mx.contiguous(v)
        fresh.offset = fresh.offset + length
        fresh._idx = length
        return k, fresh.values
    keys, values = cache.update_and_fetch(k, v)
    return keys, values


def _attend(attn: Any, q: mx.array, k: mx.array, v: mx.array, rows: int, length: int,
            cache: Any, mask: Any) -> mx.array:
    """The attention's output, `(rows, length, heads, dim)` (a view)."""
    q = _heads(q, rows, length, attn.n_heads, getattr(attn, "q_norm", None))
    q = attn.rope(q, offset=cache.offset)
    keys, values = _store(attn, k, v, rows, length, cache)
    out: mx.array = attention(q, keys, values, cache=cache, scale=attn.scale, mask=mask)
    return out.transpose(0, 2, 1, 3)


def forward(model: Any, inputs: mx.array, caches: list[Any], chunk: mx.array,
            chunk_caches: list[Any], pad_rows: int = 0, layout: Ragged | None = None) -> mx.array:
    """The decode rows' logits, `(rows, 1, vocab)`, as `model(inputs, cache=caches)` gives them;
    the chunk's keys and values land in `chunk_caches`, as `model(chunk, cache=chunk_caches)`
    would leave them (where `layout` is given, its padding positions hold other values: they
    are masked). `inputs`: `(rows, 1)` tokens; `chunk`: `(prompts, length)` tokens, padded as
    `layout` says. `pad_rows`: the projections and MLPs run on a multiple of this many rows (zero
    rows added, read by nothing), so that their matrix products repeat a few shapes."""
    logits = carry(model, inputs, caches, Carry(Chunk(chunk, False, layout)), chunk_caches, pad_rows)
    assert logits is not None
    return logits


class Carry:
    """A chunk on its way through the model, a share of its layers a pass (`carry`): the passes
    left to take it, the layers it went through, its rows after them and its attention mask."""

    def __init__(self, chunk: Chunk, passes: int = 1) -> None:
        self.chunk = chunk
        self.passes = max(1, passes)
        self.done = 0
        """Layers the chunk went through (their caches hold its keys and values)."""
        self.hidden: mx.array | None = None
        """The chunk's rows after `done` layers (its real tokens' where it is `Ragged`)."""
        self.mask: Any = None
        """The chunk's attention mask, made before any layer stored it."""
        self._outputs: dict[int, tuple[mx.array, mx.array]] = {}

    def outputs(self, extra: int) -> tuple[mx.array, mx.array]:
        """Its `Ragged` layout's `outputs(extra)`, made once for each `extra` (arrays from host
        values cost an allocation and a copy each time), as each pass asks."""
        layout = self.chunk.layout
        assert layout is not None
        if extra not in self._outputs:
            self._outputs[extra] = layout.outputs(extra)
        return self._outputs[extra]

    def span(self, layers: int) -> tuple[int, int]:
        """The layers the next pass takes it through: an equal share of those left over the
        passes left (all of them on the last)."""
        share = -(-(layers - self.done) // max(1, self.passes))
        return self.done, min(layers, self.done + share)

    def through(self, layers: int) -> bool:
        """Whether it went through all `layers`."""
        return self.done >= layers


def decode_layer(layer: Any, x: mx.array, rows: int, cache: Any, mask: Any) -> mx.array:
    """One layer for the decode rows alone, as a fused layer computes their part."""
    attn = layer.self_attn
    h = layer.input_layernorm(x)
    out = _attend(attn, attn.q_proj(h), attn.k_proj(h), attn.v_proj(h), rows, 1, cache, mask)
    x = x + attn.o_proj(out.reshape(rows, -1))
    mixed: mx.array = x + layer.mlp(layer.post_attention_layernorm(x))
    return mixed


def carry(model: Any, inputs: mx.array | None, caches: list[Any], state: Carry,
          chunk_caches: list[Any], pad_rows: int = 0) -> mx.array | None:
    """`forward` for the layers `state.span` gives: the decode rows (`inputs`) go through every
    layer and the chunk through those, beside them; its rows after them are kept in `state` for
    the next pass. With `inputs` None, the chunk goes alone through every layer left. A chunk
    spread so over the decode steps between two plans costs each a share of what one step
    carrying it whole would (its launches and its arithmetic). The decode rows' logits, None
    without them."""
    inner = model.model
    layers = inner.layers
    chunk, layout = state.chunk.tokens, state.chunk.layout
    prompts, length = chunk.shape
    # Without decode rows, it is what the steps left of it, as a pass of its own: all of it.
    first, end = state.span(len(layers)) if inputs is not None else (state.done, len(layers))
    if first == 0:  # before any layer stores the chunk's keys, as the model's own pass asks
        state.mask = create_attention_mask(chunk, chunk_caches[0])
        state.hidden = (inner.embed_tokens(chunk).reshape(prompts * length, -1) if layout is None
                        else inner.embed_tokens(layout.tokens))
    assert state.hidden is not None
    rows = 0 if inputs is None else inputs.shape[0]
    decode_mask, x = None, state.hidden[:0]
    if inputs is not None:
        hd = inner.embed_tokens(inputs)
        decode_mask = create_attention_mask(hd, caches[0])
        x = hd.reshape(rows, -1)
    real = state.hidden.shape[0]
    extra = (-(rows + real)) % pad_rows if pad_rows > 1 and rows else 0
    # Decode rows, the padded chunk, the rows that round the pass up; or, ragged: the chunk's
    # real tokens, the rows that round the pass up, the decode rows.
    d0, c0 = (0, rows) if layout is None else (real + extra, 0)
    d = slice(d0, d0 + rows)
    if layout is not None:
        out_rows, out_cols = state.outputs(extra)

    def padded(t: mx.array) -> mx.array:
        """The chunk's part of `t`, in the padded layout."""
        return t[c0:c0 + real] if layout is None else mx.take(t, layout.spread, axis=0)

    last = len(layers) - 1
    blank: mx.array | None = None  # every layer's padding rows of its attention output: one array
    for i in range(len(layers)) if inputs is not None else range(first, end):
        layer, cc = layers[i], chunk_caches[i]
        dc = caches[i] if inputs is not None else None
        if not first <= i < end:
            x = decode_layer(layer, x, rows, dc, decode_mask)
            continue
        if i == first:
            pad = [mx.zeros((extra, x.shape[-1]), x.dtype)] if extra else []
            parts = [x, state.hidden, *pad] if layout is None else [state.hidden, *pad, x]
            parts = [p for p in parts if p.shape[0]]
            x = mx.concatenate(parts) if len(parts) > 1 else parts[0]
        attn = layer.self_attn
        h = layer.input_layernorm(x)
        k, v = attn.k_proj(h), attn.v_proj(h)
        if i < last:
            q = attn.q_proj(h)
            decoded = (_attend(attn, q[d], k[d], v[d], rows, 1, dc, decode_mask).reshape(rows, -1)
                       if rows else None)
            out = _attend(attn, padded(q), padded(k), padded(v), prompts, length, cc, state.mask)
            if layout is not None:
                gathered = out[out_rows, out_cols].reshape(real + extra, -1)
                out = gathered if decoded is None else mx.concatenate([gathered, decoded])
            else:
                parts = [out.reshape(prompts * length, -1)]
                if decoded is not None:
                    parts.insert(0, decoded)
                if extra:
                    if blank is None:
                        blank = mx.zeros((extra, parts[0].shape[-1]), parts[0].dtype)
                    parts.append(blank)
                out = mx.concatenate(parts) if len(parts) > 1 else parts[0]
        else:  # nothing reads the chunk's outputs past its last keys and values
            _store(attn, padded(k), padded(v), prompts, length, cc)
            if not rows:
                break
            x, h = x[d], h[d]
            out = _attend(attn, attn.q_proj(h), k[d], v[d], rows, 1, dc, decode_mask).reshape(rows, -1)
        x = x + attn.o_proj(out)
        x = x + layer.mlp(layer.post_attention_layernorm(x))
        if i == end - 1 and end < len(layers):  # the chunk waits here for the next pass
            state.hidden = x[c0:c0 + real]
            x = x[d]
    state.done, state.passes = end, state.passes - 1
    if end == len(layers):
        state.hidden = state.mask = None
    if inputs is None:
        return None
    return logits_of(model, x)


def logits_of(model: Any, x: mx.array) -> mx.array:
    """The logits, `(rows, 1, vocab)`, of the decode rows' last hidden state `x` (`(rows, hidden)`)."""
    out = model.model.norm(x)[:, None]
    logits: mx.array
    if model.args.tie_word_embeddings:
        logits = model.model.embed_tokens.as_linear(out)
    else:
        logits = model.lm_head(out)
    return logits


class Chunk(NamedTuple):
    """A chunk left for the next decode step's pass."""

    tokens: mx.array
    """`(prompts, length)`, padded."""
    padded: bool
    """Right-padded: the caches' padding moves to the left after it (`finalize_chunk`)."""
    layout: Ragged | None
    """Its real tokens, for a pass that skips its padding (None: the pass takes it padded)."""


class Carrying:
    """The model as a decode step calls it, with a prefill chunk's share of layers in the same
    pass (`carry`)."""

    def __init__(self, model: Any, state: Carry, caches: list[Any], pad_rows: int) -> None:
        self.model, self._state, self._caches, self._pad = model, state, caches, pad_rows

    def __call__(self, inputs: mx.array, cache: list[Any]) -> mx.array:
        logits = carry(self.model, inputs, cache, self._state, self._caches, self._pad)
        assert logits is not None
        return logits

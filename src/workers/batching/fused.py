"""One forward pass for a decode step and a prefill chunk (the mixed batch of vLLM and Sarathi-Serve).

mlx-lm runs a step that prefills as two forward passes: the decode rows' single tokens, then the
prompt chunk. The second pass builds a whole graph on the host and reads every weight again
(docs/stalls.md measures what one pass saves on the CPU and on a GPU). Here the decode rows' tokens and the
chunk's tokens go through the projections and MLPs as one matrix; only the attention is split,
each part against its own caches (the decode batch's, the prompt batch's), with the masks mlx-lm's
own passes would use. The chunk's logits are never computed: in the last layer only its keys and
values are stored.

Only blocks written as llama's, qwen2's and qwen3's are fused (`unfusable` says why a model is
not), since the pass re-states their forward: RMSNorm, attention with rotary positions, RMSNorm,
MLP, each with a residual. A test checks the fused pass against the two passes apart for each.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
from mlx_lm.models.base import create_attention_mask

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


def _heads(t: mx.array, rows: int, length: int, n: int, norm: Any = None) -> mx.array:
    t = t.reshape(rows, length, n, -1)
    return (t if norm is None else norm(t)).transpose(0, 2, 1, 3)


def _store(attn: Any, k: mx.array, v: mx.array, rows: int, length: int, cache: Any) -> tuple[Any, Any]:
    """Rotary positions on `k`; both into `cache`; what it now holds."""
    k = _heads(k, rows, length, attn.n_kv_heads, getattr(attn, "k_norm", None))
    k = attn.rope(k, offset=cache.offset)
    keys, values = cache.update_and_fetch(k, _heads(v, rows, length, attn.n_kv_heads))
    return keys, values


def _attend(attn: Any, q: mx.array, k: mx.array, v: mx.array, rows: int, length: int,
            cache: Any, mask: Any) -> mx.array:
    q = _heads(q, rows, length, attn.n_heads, getattr(attn, "q_norm", None))
    q = attn.rope(q, offset=cache.offset)
    keys, values = _store(attn, k, v, rows, length, cache)
    out = attention(q, keys, values, cache=cache, scale=attn.scale, mask=mask)
    return out.transpose(0, 2, 1, 3).reshape(rows * length, -1)


def forward(model: Any, inputs: mx.array, caches: list[Any], chunk: mx.array,
            chunk_caches: list[Any], pad_rows: int = 0) -> mx.array:
    """The decode rows' logits, `(rows, 1, vocab)`, as `model(inputs, cache=caches)` gives them;
    the chunk's keys and values land in `chunk_caches`, as `model(chunk, cache=chunk_caches)`
    would leave them. `inputs`: `(rows, 1)` tokens; `chunk`: `(prompts, length)` tokens.
    `pad_rows`: the projections and MLPs run on a multiple of this many rows (zero rows added, read
    by nothing), so that their matrix products repeat a few shapes."""
    inner = model.model
    rows, (prompts, length) = inputs.shape[0], chunk.shape
    hd, hc = inner.embed_tokens(inputs), inner.embed_tokens(chunk)
    # Before any layer stores this step's keys, as the model's own pass asks.
    decode_mask = create_attention_mask(hd, caches[0])
    chunk_mask = create_attention_mask(hc, chunk_caches[0])
    flat = rows + prompts * length
    extra = (-flat) % pad_rows if pad_rows > 1 else 0
    parts = [hd.reshape(rows, -1), hc.reshape(prompts * length, -1)]
    x = mx.concatenate(parts + [mx.zeros((extra, hd.shape[-1]), hd.dtype)] if extra else parts)
    last = len(inner.layers) - 1
    blank: mx.array | None = None  # every layer's padding rows of its attention output: one array
    for i, (layer, dc, cc) in enumerate(zip(inner.layers, caches, chunk_caches, strict=True)):
        attn = layer.self_attn
        h = layer.input_layernorm(x)
        k, v = attn.k_proj(h), attn.v_proj(h)
        if i < last:
            q = attn.q_proj(h)
            parts = [
                _attend(attn, q[:rows], k[:rows], v[:rows], rows, 1, dc, decode_mask),
                _attend(attn, q[rows:flat], k[rows:flat], v[rows:flat], prompts, length, cc, chunk_mask),
            ]
            if extra:
                if blank is None:
                    blank = mx.zeros((extra, parts[0].shape[-1]), parts[0].dtype)
                parts.append(blank)
            out = mx.concatenate(parts)
        else:  # nothing reads the chunk's outputs past its last keys and values
            _store(attn, k[rows:flat], v[rows:flat], prompts, length, cc)
            x, h = x[:rows], h[:rows]
            out = _attend(attn, attn.q_proj(h), k[:rows], v[:rows], rows, 1, dc, decode_mask)
        x = x + attn.o_proj(out)
        x = x + layer.mlp(layer.post_attention_layernorm(x))
    out = inner.norm(x)[:, None]
    logits: mx.array
    if model.args.tie_word_embeddings:
        logits = inner.embed_tokens.as_linear(out)
    else:
        logits = model.lm_head(out)
    return logits

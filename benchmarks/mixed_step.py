"""A prefill chunk inside the decode step's forward pass: what it would save, measured.

On a GPU a step that prefills runs a second forward pass, and for host-bound models that pass
costs the host about as much as the decode step (docs/stalls.md). Here one pass carries both:
the decode rows' single tokens and the chunk's tokens go through the shared projections and MLPs
as one matrix, and only the attention is split (each part with its own cache). Llama-style blocks
(llama, qwen2: `self_attn.{q,k,v,o}_proj`, `mlp`, two RMSNorms) only.

Each configuration first checks the fused pass against the two separate ones (the decode logits
and the chunk's cache within float tolerance), then times, repeated in rotating order:

- `decode`: the decode step alone;
- `separate`: the decode step, then the chunk's own pass;
- `fused`: one pass carrying both;

each as host time to build the graph (Python and MLX's op construction, before eval) and wall
time to the evaluated result. Nothing here runs in the scheduler yet.

    python benchmarks/mixed_step.py --model synthetic:small --rows 32 --chunks 4x64 8x128
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any

# First: OpenBLAS (workers/blas.py) binds only if it is loaded before MLX.
import workers  # noqa: F401

# isort: split
import mlx.core as mx
from mlx_lm.models.base import create_attention_mask, scaled_dot_product_attention
from mlx_lm.models.cache import make_prompt_cache

from workers.cuda import apply_cuda_defaults
from workers.loading.models import load_model


def _heads(t: mx.array, rows: int, length: int, n: int) -> mx.array:
    return t.reshape(rows, length, n, -1).transpose(0, 2, 1, 3)


def _attend(attn: Any, q: mx.array, k: mx.array, v: mx.array, rows: int, length: int,
            cache: Any, mask: Any) -> mx.array:
    q = _heads(q, rows, length, attn.n_heads)
    k = _heads(k, rows, length, attn.n_kv_heads)
    v = _heads(v, rows, length, attn.n_kv_heads)
    q = attn.rope(q, offset=cache.offset)
    k = attn.rope(k, offset=cache.offset)
    k, v = cache.update_and_fetch(k, v)
    out = scaled_dot_product_attention(q, k, v, cache=cache, scale=attn.scale, mask=mask)
    return out.transpose(0, 2, 1, 3).reshape(rows * length, -1)


def fused(model: Any, decode: mx.array, decode_cache: list[Any], chunk: mx.array,
          chunk_cache: list[Any]) -> mx.array:
    """The decode rows' logits; the chunk's keys and values land in `chunk_cache`."""
    inner = model.model
    rows, (prompts, length) = decode.shape[0], chunk.shape
    hd, hc = inner.embed_tokens(decode), inner.embed_tokens(chunk)
    chunk_mask = create_attention_mask(hc, chunk_cache[0])
    width = hd.shape[-1]
    x = mx.concatenate([hd.reshape(rows, width), hc.reshape(prompts * length, width)])
    for layer, dc, cc in zip(inner.layers, decode_cache, chunk_cache, strict=True):
        attn = layer.self_attn
        h = layer.input_layernorm(x)
        q, k, v = attn.q_proj(h), attn.k_proj(h), attn.v_proj(h)
        out = mx.concatenate([
            _attend(attn, q[:rows], k[:rows], v[:rows], rows, 1, dc, None),
            _attend(attn, q[rows:], k[rows:], v[rows:], prompts, length, cc, chunk_mask),
        ])
        x = x + attn.o_proj(out)
        x = x + layer.mlp(layer.post_attention_layernorm(x))
    last = inner.norm(x[:rows])[:, None]
    if getattr(model.args, "tie_word_embeddings", False):
        return inner.embed_tokens.as_linear(last)
    return model.lm_head(last)


def caches(model: Any, rows: int, held: int, vocab: int, seed: int) -> list[Any]:
    """Caches of `rows` rows holding `held` tokens each (one prefill)."""
    cache = make_prompt_cache(model)
    if held:
        ids = mx.random.randint(3, vocab, (rows, held), key=mx.random.key(seed))
        model(ids, cache=cache)
        mx.eval([c.state for c in cache])
    return cache


def check(model: Any, args: argparse.Namespace, prompts: int, length: int) -> float:
    """The largest difference between the fused and separate passes (logits and chunk keys)."""
    decode = mx.random.randint(3, args.vocab, (args.rows, 1), key=mx.random.key(1))
    chunk = mx.random.randint(3, args.vocab, (prompts, length), key=mx.random.key(2))
    dc, cc = caches(model, args.rows, args.held, args.vocab, 0), caches(model, prompts, 0, args.vocab, 0)
    apart = model(decode, cache=dc)
    model(chunk, cache=cc)
    dc2, cc2 = caches(model, args.rows, args.held, args.vocab, 0), caches(model, prompts, 0, args.vocab, 0)
    together = fused(model, decode, dc2, chunk, cc2)
    diffs = [mx.abs(apart.astype(mx.float32) - together.astype(mx.float32)).max()]
    diffs += [mx.abs(a.state[0][..., : a.offset, :].astype(mx.float32)
                     - b.state[0][..., : b.offset, :].astype(mx.float32)).max()
              for a, b in zip(cc, cc2, strict=True)]
    return max(float(d.item()) for d in diffs)


def timed(model: Any, args: argparse.Namespace, variant: str, prompts: int, length: int) -> tuple[float, float]:
    """(host ms to build the graph, wall ms to the evaluated result), medians over the steps."""
    build, wall = [], []
    for step in range(args.steps):
        decode = mx.random.randint(3, args.vocab, (args.rows, 1), key=mx.random.key(10 + step))
        n = length - (step * 37 % max(1, length // 2) if args.vary else 0)  # a new shape each step
        chunk = mx.random.randint(3, args.vocab, (prompts, n), key=mx.random.key(20 + step))
        dc = caches(model, args.rows, args.held, args.vocab, 0)
        cc = caches(model, prompts, 0, args.vocab, 0)
        mx.eval(decode, chunk)
        start = time.perf_counter()
        if variant == "decode":
            out = [model(decode, cache=dc)]
        elif variant == "separate":
            out = [model(decode, cache=dc)]
            model(chunk, cache=cc)
            out += [c.state for c in cc]
        else:
            out = [fused(model, decode, dc, chunk, cc)] + [c.state for c in cc]
        built = time.perf_counter()
        mx.eval(out)
        done = time.perf_counter()
        build.append((built - start) * 1e3)
        wall.append((done - start) * 1e3)
    return statistics.median(build), statistics.median(wall)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="synthetic:small")
    ap.add_argument("--rows", type=int, default=32, help="decode rows")
    ap.add_argument("--held", type=int, default=256, help="tokens each decode row's cache holds")
    ap.add_argument("--chunks", nargs="+", default=["4x64", "8x128"], help="prompts x tokens a chunk")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--vary", action="store_true", help="each step's chunk a different length (up to the given)")
    ap.add_argument("--out", default="benchmarks/results/mixed_step.json")
    args = ap.parse_args()
    apply_cuda_defaults()
    model, _ = load_model(args.model)
    args.vocab = min(2000, int(model.args.vocab_size))
    results: dict[str, Any] = {}
    print(f"{args.model} on {mx.default_device()}, {args.rows} decode rows of {args.held} tokens, "
          f"medians of {args.steps} steps x {args.repeat} rounds")
    print(f"{'chunk':>8} {'max diff':>9} {'variant':>9} {'build ms':>9} {'wall ms':>9} {'x separate':>11}")
    for spec in args.chunks:
        prompts, length = (int(n) for n in spec.split("x"))
        diff = check(model, args, prompts, length)
        runs: dict[str, list[tuple[float, float]]] = {v: [] for v in ("decode", "separate", "fused")}
        names = list(runs)
        for rep in range(args.repeat):
            for v in names[rep % 3:] + names[: rep % 3]:
                runs[v].append(timed(model, args, v, prompts, length))
        row = {v: {"build_ms": statistics.median(b for b, _ in r), "wall_ms": statistics.median(w for _, w in r)}
               for v, r in runs.items()}
        results[spec] = {"max_diff": diff, **row}
        for v in names:
            ratio = row[v]["wall_ms"] / row["separate"]["wall_ms"]
            print(f"{spec:>8} {diff:>9.2g} {v:>9} {row[v]['build_ms']:>9.2f} {row[v]['wall_ms']:>9.2f} {ratio:>11.3f}")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"args": vars(args), "results": results, "device": str(mx.default_device()),
                               "date": time.strftime("%Y-%m-%d")}, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()

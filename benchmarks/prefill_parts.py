"""What one batched prefill pass costs, part by part, each part synchronized.

A GPU step that prefills a group of prompts is the stall at budget 0 (docs/stalls.md): about 30
ms for eight prompts of 64-512 tokens on the 0.5B shape, where the same tokens as one plain
forward pass cost about a third of that. This times, for `--prompts` random prompts of
`--min`-`--max` tokens (seeded), each alone, evaluated and synchronized, medians of `--repeat`:

- `plain`: the longest prompt's length for every row, mlx-lm's plain `KVCache`s ("causal" mask);
- `batch cache`: the same tokens into a `BatchKVCache` with no padding (an array mask);
- `right-padded`: the real lengths, right-padded as mlx-lm's prompt batch does (`prepare`),
  then the forward pass;
- `+ finalize`: and the cache's `finalize` (the roll that turns right padding into left);
- `+ join`: and merging those rows into a decode batch of `--rows` rows holding `--held` tokens
  (`BatchKVCache.extend`, the copy of every layer's keys and values).

    python benchmarks/prefill_parts.py --model synthetic:qwen2.5-0.5b --prompts 8 --rows 64
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from pathlib import Path
from typing import Any

# First: OpenBLAS (workers/blas.py) binds only if it is loaded before MLX.
import workers  # noqa: F401

# isort: split
import mlx.core as mx
from mlx_lm.models.cache import BatchKVCache, make_prompt_cache

from workers.cuda import apply_cuda_defaults
from workers.loading.models import load_model

PARTS = ["plain", "batch cache", "right-padded", "+ finalize", "+ join"]


def timed(fn: Any) -> float:
    mx.synchronize()
    start = time.perf_counter()
    mx.eval(fn())
    mx.synchronize()
    return 1e3 * (time.perf_counter() - start)


def batch_caches(model: Any, rows: int) -> list[Any]:
    return [BatchKVCache([0] * rows) for _ in model.layers]


def decode_batch(model: Any, rows: int, held: int, vocab: int) -> list[Any]:
    cache = batch_caches(model, rows)
    model(mx.random.randint(3, vocab, (rows, held), key=mx.random.key(9)), cache=cache)
    mx.eval([c.state for c in cache])
    return cache


def run(model: Any, args: argparse.Namespace, part: str, lengths: list[int], seed: int) -> float:
    longest = max(lengths)
    rows = len(lengths)
    tokens = mx.random.randint(3, args.vocab, (rows, longest), key=mx.random.key(seed))
    mx.eval(tokens)
    if part == "plain":
        cache = make_prompt_cache(model)
        return timed(lambda: [model(tokens, cache=cache)] + [c.state for c in cache])
    cache = batch_caches(model, rows)
    if part == "batch cache":
        return timed(lambda: [model(tokens, cache=cache)] + [c.state for c in cache])
    padding = [longest - n for n in lengths]
    decode = decode_batch(model, args.rows, args.held, args.vocab) if part == "+ join" else None

    def padded() -> list[Any]:
        for c in cache:
            c.prepare(lengths=lengths, right_padding=padding)
        out = [model(tokens, cache=cache)]
        if part != "right-padded":
            for c in cache:
                c.finalize()
        if decode is not None:
            for d, c in zip(decode, cache, strict=True):
                d.extend(c)
            return out + [d.state[:2] for d in decode]
        return out + [c.state[:2] for c in cache]

    return timed(padded)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="synthetic:small")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--min", type=int, default=64)
    ap.add_argument("--max", type=int, default=512)
    ap.add_argument("--rows", type=int, default=64, help="decode rows the prompts join")
    ap.add_argument("--held", type=int, default=256, help="tokens each decode row holds")
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--out", default="benchmarks/results/prefill_parts.json")
    args = ap.parse_args()
    apply_cuda_defaults()
    model, _ = load_model(args.model)
    args.vocab = min(2000, int(model.args.vocab_size))
    rnd = random.Random(7)
    groups = [[rnd.randint(args.min, args.max) for _ in range(args.prompts)] for _ in range(args.repeat + 1)]
    times: dict[str, list[float]] = {p: [] for p in PARTS}
    for i, lengths in enumerate(groups):
        for part in PARTS[i % len(PARTS):] + PARTS[: i % len(PARTS)]:
            ms = run(model, args, part, lengths, i)
            if i:  # the first group builds kernels
                times[part].append(ms)
    rows = {p: statistics.median(t) for p, t in times.items()}
    print(f"{args.model} on {mx.default_device()}: {args.prompts} prompts of {args.min}-{args.max} tokens, "
          f"joining {args.rows} rows of {args.held}; ms, synchronized, medians of {args.repeat}")
    for p, ms in rows.items():
        print(f"{p:>14} {ms:8.2f}")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"args": vars(args), "ms": rows, "device": str(mx.default_device()),
                               "date": time.strftime("%Y-%m-%d %H:%M")}, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()

"""What an op costs the first time MLX sees its shapes, against the same op on shapes it has seen.

A decode step repeats its shapes from step to step, but a step that prefills a chunk does not: the
chunk's length, the prompt cache's length and the pass's row count change every time. This times
each op evaluated alone, `--calls` times after a warm-up, once with the same shapes every call and
once with new shapes every call (each call's shapes never seen before in the process):

- `linear`: `(rows, hidden) @ (hidden, ffn)`, new `rows` each call (a projection of the pass);
- `batched matmul`: `(prompts, heads, length, head_dim) @ (..., head_dim, keys)` (attention scores);
- `sdpa, array mask`: `mx.fast.scaled_dot_product_attention` with a boolean mask, as a prompt
  batch's cache makes it;
- `sdpa, causal`: the same with `mask="causal"`;
- `rope, array offsets`: `mx.fast.rope` with one offset per row, as a batch cache gives it.

    python benchmarks/shape_cost.py --calls 30

In bfloat16, as a GPU serves these models: a probe for GPUs (MLX's CPU backend has no fast
bfloat16 matmul).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

# First: OpenBLAS (workers/blas.py) binds only if it is loaded before MLX.
import workers  # noqa: F401

# isort: split
import mlx.core as mx

from workers.cuda import apply_cuda_defaults

Op = Callable[[int], Any]
"""Builds the op for call `i` (its shapes a function of `i` when they are to be new)."""


def ops(args: argparse.Namespace, new: bool) -> dict[str, Op]:
    h, f, heads, kv, d, dt = args.hidden, args.ffn, args.heads, args.kv_heads, args.head_dim, mx.bfloat16
    w = mx.ones((h, f), dt)

    def length(i: int) -> int:
        return args.length + (i if new else 0)

    def keys(i: int) -> int:
        return args.keys + (3 * i if new else 0)

    def sdpa(mask: str) -> Op:
        def op(i: int) -> Any:
            q = mx.ones((args.prompts, heads, length(i), d), dt)
            k = mx.ones((args.prompts, kv, keys(i), d), dt)
            m: Any = mx.ones((args.prompts, 1, length(i), keys(i)), mx.bool_) if mask == "array" else "causal"
            return mx.fast.scaled_dot_product_attention(q, k, k, scale=d**-0.5, mask=m)
        return op

    return {
        "linear": lambda i: mx.ones((args.rows + (7 * i if new else 0), h), dt) @ w,
        "batched matmul": lambda i: (mx.ones((args.prompts, heads, length(i), d), dt)
                                     @ mx.ones((args.prompts, heads, d, keys(i)), dt)),
        "sdpa, array mask": sdpa("array"),
        "sdpa, causal": sdpa("causal"),
        "rope, array offsets": lambda i: mx.fast.rope(
            mx.ones((args.prompts, heads, length(i), d), dt), d, traditional=False, base=1e6,
            scale=1.0, offset=mx.arange(args.prompts)),
    }


def timed(op: Op, calls: int, start: int) -> float:
    """ms a call, each evaluated alone."""
    mx.synchronize()
    t0 = time.perf_counter()
    for i in range(start, start + calls):
        mx.eval(op(i))
    mx.synchronize()
    return (time.perf_counter() - t0) / calls * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--calls", type=int, default=30)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--rows", type=int, default=500, help="rows of the pass (linear)")
    ap.add_argument("--hidden", type=int, default=896)
    ap.add_argument("--ffn", type=int, default=4864)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--heads", type=int, default=14)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--length", type=int, default=40, help="chunk tokens a prompt")
    ap.add_argument("--keys", type=int, default=260, help="keys a prompt's cache holds")
    ap.add_argument("--out", default="benchmarks/results/shape_cost.json")
    args = ap.parse_args()
    apply_cuda_defaults()
    seen, fresh = ops(args, new=False), ops(args, new=True)
    for op in seen.values():  # the same shapes' first calls, out of the timing
        timed(op, 3, 0)
    results: dict[str, dict[str, float]] = {}
    start = 1
    print(f"{mx.default_device()}, {args.calls} calls, medians of {args.repeat} rounds; ms a call")
    print(f"{'op':>20} {'same shapes':>12} {'new shapes':>11} {'extra':>7}")
    for name in seen:
        same, new = [], []
        for _ in range(args.repeat):
            same.append(timed(seen[name], args.calls, 0))
            new.append(timed(fresh[name], args.calls, start))
            start += args.calls  # never the same shapes twice
        row = {"same_ms": statistics.median(same), "new_ms": statistics.median(new)}
        results[name] = row
        print(f"{name:>20} {row['same_ms']:>12.3f} {row['new_ms']:>11.3f} {row['new_ms'] - row['same_ms']:>7.3f}")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"args": vars(args), "results": results, "device": str(mx.default_device()),
                               "date": time.strftime("%Y-%m-%d")}, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()

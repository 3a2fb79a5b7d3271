"""A decode step's attention over left-padded rows: our CUDA kernel against MLX's masked path.

For each head layout (`--shapes`, query heads x key-value heads x head size), `--rows` rows whose
caches hold `--length` positions, each row left-padded by a random amount (up to
`--max-padding`), one query a row: the kernel (`workers/batching/padded_attention.py`) is checked
against `mx.fast.scaled_dot_product_attention` with the boolean mask mlx-lm's batch cache makes,
then both are timed, `--layers` calls a synchronized step, medians of `--steps` steps. Needs
MLX's CUDA backend.

    python benchmarks/padded_attention.py --rows 64 --length 600
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

import workers  # noqa: F401  (OpenBLAS before MLX)

# isort: split
import mlx.core as mx

from workers.batching import padded_attention
from workers.loading.dtypes import on_cuda


def case(rows: int, heads: int, kv_heads: int, dim: int, length: int, max_padding: int,
         seed: int) -> tuple[mx.array, mx.array, mx.array, mx.array, mx.array]:
    """Queries, the cache's key and value buffers (room for 256 more positions, as mlx-lm's
    grow), each row's padding and the mask for the first `length` positions."""
    mx.random.seed(seed)
    q = mx.random.normal((rows, heads, 1, dim)).astype(mx.bfloat16)
    keys = mx.random.normal((rows, kv_heads, length + 256, dim)).astype(mx.bfloat16)
    values = mx.random.normal((rows, kv_heads, length + 256, dim)).astype(mx.bfloat16)
    start = mx.random.randint(0, max_padding + 1, (rows,)).astype(mx.int32)
    mask = padded_attention.padding_mask(start, length)
    mx.eval(q, keys, values, start, mask)
    return q, keys, values, start, mask


def timed(fn: object, layers: int, steps: int) -> float:
    """Median ms of `layers` calls, evaluated and synchronized together."""
    times = []
    for i in range(steps + 3):
        t0 = time.perf_counter()
        mx.eval([fn() for _ in range(layers)])  # type: ignore[operator]
        mx.synchronize()
        if i >= 3:
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", nargs="+", default=["32x8x64", "14x2x64", "9x3x64", "16x8x128"],
                    help="query heads x key-value heads x head size (1B, 0.5B, SmolLM2, Qwen3-0.6B)")
    ap.add_argument("--rows", type=int, default=64)
    ap.add_argument("--length", type=int, default=600)
    ap.add_argument("--max-padding", type=int, default=450)
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="benchmarks/results/padded_attention.json")
    args = ap.parse_args()
    if not on_cuda():
        raise SystemExit("padded_attention.py compares a CUDA kernel: it needs MLX's CUDA backend")
    results = []
    print(f"{args.rows} rows of {args.length} positions, padding 0-{args.max_padding}; "
          f"{args.layers} calls a step, medians of {args.steps}; load {os.getloadavg()[0]:.2f}")
    print(f"{'shape':>10} {'max error':>10} {'MLX ms':>8} {'ours ms':>8} {'x':>6}")
    for shape in args.shapes:
        heads, kv_heads, dim = (int(x) for x in shape.split("x"))
        q, keys, values, start, mask = case(args.rows, heads, kv_heads, dim, args.length,
                                            args.max_padding, args.seed)
        k, v, scale = keys[..., : args.length, :], values[..., : args.length, :], dim ** -0.5
        error = padded_attention.difference(q, k, v, start, scale)
        if not error < padded_attention.TOLERANCE:
            raise SystemExit(f"{shape}: the kernel differs from MLX's attention by {error}")
        mlx_ms = timed(lambda q=q, k=k, v=v, m=mask, s=scale:
                       mx.fast.scaled_dot_product_attention(q, k, v, scale=s, mask=m), args.layers, args.steps)
        ours_ms = timed(lambda q=q, k=k, v=v, st=start, s=scale:
                        padded_attention.padded_decode(q, k, v, st, s), args.layers, args.steps)
        print(f"{shape:>10} {error:10.4f} {mlx_ms:8.3f} {ours_ms:8.3f} {mlx_ms / ours_ms:6.2f}")
        results.append({"shape": shape, "max_error": error, "mlx_ms": mlx_ms, "ours_ms": ours_ms})
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"args": vars(args), "results": results, "load": os.getloadavg()[0],
                               "device": mx.device_info().get("device_name"),
                               "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()

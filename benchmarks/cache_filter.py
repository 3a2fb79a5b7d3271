"""What it costs when rows leave a batch: the batch cache's filter, by gather or by runs.

mlx-lm's `BatchKVCache.filter` copies the rows that stay with `keys[keep]`, MLX's generic gather;
`HostPaddedKVCache` (ours) copies them as contiguous runs instead (`hostpad.COPY_RUNS`). For a
model's shape (layers, KV heads, head size) and a batch of `--rows` rows holding `--length`
positions, each pattern of leaving rows is timed both ways: the filter of every layer's keys and
values plus the next decode step's write into them, evaluated and synchronized, medians of
`--repeat` rounds.

    python benchmarks/cache_filter.py --model synthetic:qwen2.5-0.5b --rows 64 --length 560
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import time
from pathlib import Path
from typing import Any

# First: OpenBLAS (workers/blas.py) binds only if it is loaded before MLX.
import workers  # noqa: F401

# isort: split
import mlx.core as mx

from workers.batching import hostpad
from workers.batching.hostpad import HostPaddedKVCache
from workers.loading.models import load_model


def patterns(rows: int, rng: random.Random) -> dict[str, list[int]]:
    gone_tail = set(range(rows - 8, rows))
    gone_spread = set(rng.sample(range(rows), 8))
    gone_block = set(range(rows // 2, rows // 2 + 8))
    return {
        "1 row": [i for i in range(rows) if i != rows // 3],
        "8 at the end": [i for i in range(rows) if i not in gone_tail],
        "8 together": [i for i in range(rows) if i not in gone_block],
        "8 spread": [i for i in range(rows) if i not in gone_spread],
    }


def caches(layers: int, heads: int, dim: int, rows: int, length: int, dtype: Any) -> list[HostPaddedKVCache]:
    out = []
    for _ in range(layers):
        c = HostPaddedKVCache([0] * rows)
        c.keys = mx.random.normal((rows, heads, length + 256, dim)).astype(dtype)
        c.values = mx.random.normal((rows, heads, length + 256, dim)).astype(dtype)
        c.offset = mx.full((rows,), length, dtype=mx.int32)
        c._idx = length
        c._host = (c.left_padding, [0] * rows)
        out.append(c)
    mx.eval([(c.keys, c.values) for c in out])
    return out


def timed(layers: int, heads: int, dim: int, rows: int, length: int, dtype: Any, keep: list[int]) -> float:
    cs = caches(layers, heads, dim, rows, length, dtype)
    kv = mx.zeros((len(keep), heads, 1, dim), dtype=dtype)
    mx.synchronize()
    t0 = time.perf_counter()
    for c in cs:
        c.filter(keep)
        c.update_and_fetch(kv, kv)
    mx.eval([(c.keys, c.values) for c in cs])
    mx.synchronize()
    return (time.perf_counter() - t0) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="synthetic:qwen2.5-0.5b")
    ap.add_argument("--rows", type=int, nargs="+", default=[64, 256])
    ap.add_argument("--length", type=int, default=560)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--out", default="benchmarks/results/cache_filter.json")
    args = ap.parse_args()
    model, _ = load_model(args.model)
    a = model.args
    heads = getattr(a, "num_key_value_heads", None) or a.num_attention_heads
    dim = getattr(a, "head_dim", None) or a.hidden_size // a.num_attention_heads
    layers, dtype = a.num_hidden_layers, model.parameters()["model"]["embed_tokens"]["weight"].dtype
    del model
    rng = random.Random(0)
    table = []
    print(f"{args.model}: {layers} layers x {heads} KV heads x {dim}, {dtype}, {args.length} positions, "
          f"{mx.default_device()}; ms for the filter and the next write, every layer, medians of {args.repeat}")
    print(f"{'rows':>5} {'leaving':<14} {'gather':>8} {'runs':>8} {'x':>6}")
    for rows in args.rows:
        for name, keep in patterns(rows, rng).items():
            times: dict[bool, list[float]] = {True: [], False: []}
            for rep in range(args.repeat + 1):
                for copy_runs in ((True, False) if rep % 2 else (False, True)):
                    hostpad.COPY_RUNS = copy_runs
                    t = timed(layers, heads, dim, rows, args.length, dtype, keep)
                    if rep:  # the first round compiles and allocates
                        times[copy_runs].append(t)
            hostpad.COPY_RUNS = True
            g, r = statistics.median(times[False]), statistics.median(times[True])
            table.append({"rows": rows, "leaving": name, "runs": len(hostpad.runs(keep)), "gather_ms": g, "runs_ms": r})
            print(f"{rows:>5} {name:<14} {g:>8.2f} {r:>8.2f} {r / g:>6.2f}")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"args": vars(args), "rows": table, "device": str(mx.default_device()),
                               "load": os.getloadavg()[0], "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())},
                              indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()

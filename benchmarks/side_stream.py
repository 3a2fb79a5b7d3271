"""A prompt's prefill on a stream of its own, beside a pipelined decode loop: does it stall?

Today a prefill pass goes on the decode's stream, so every decode step queued after it waits for
the whole pass: that step is the stall (docs/stalls.md). MLX can run work on several streams; on a
GPU each has its own queue, so a prefill there could run beside the decode steps rather than
ahead of them. This measures it, outside the engine: a decode loop of `--rows` rows pipelined as
mlx-lm's (build step n+1, queue it, read step n's tokens), with a chunk of `--chunk` (prompts x
tokens) queued at step `--at` on

- `none`: no chunk (the decode alone);
- `same`: the decode's stream (what the engine does now);
- `side`: a stream of its own, which the decode never waits for;

and prints each variant's gap between tokens (median, and the largest in the steps after the
chunk), the loop's total time over `--steps` steps, and how long after the loop the chunk was
still running. Medians over `--repeat` rotating rounds.

    python benchmarks/side_stream.py --model synthetic:qwen2.5-0.5b --rows 64 --chunk 8x512
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
from mlx_lm.models.cache import make_prompt_cache

from workers.cuda import apply_cuda_defaults
from workers.loading.models import load_model


def run(model: Any, args: argparse.Namespace, variant: str, side: Any, seed: int) -> dict[str, float]:
    prompts, length = (int(n) for n in args.chunk.split("x"))
    cache = make_prompt_cache(model)
    ids = mx.random.randint(3, args.vocab, (args.rows, args.held), key=mx.random.key(seed))
    mx.eval(model(ids, cache=cache), [c.state for c in cache])
    chunk = mx.random.randint(3, args.vocab, (prompts, length), key=mx.random.key(seed + 1))
    chunk_cache = make_prompt_cache(model)
    mx.eval(chunk)

    def step(y: mx.array) -> mx.array:
        return mx.argmax(model(y[:, None], cache=cache)[:, -1, :], axis=-1)

    y = ids[:, -1]
    y = step(y)
    mx.async_eval(y)
    gaps: list[float] = []
    last = time.perf_counter()
    start = last
    for n in range(args.steps):
        if n == args.at and variant != "none":
            with mx.stream(side if variant == "side" else mx.default_stream(mx.default_device())):
                model(chunk, cache=chunk_cache)
                mx.async_eval([c.state for c in chunk_cache])
        nxt = step(y)
        mx.async_eval(nxt)
        y.tolist()  # step n's tokens: waits for it
        now = time.perf_counter()
        gaps.append(now - last)
        last = now
        y = nxt
    y.tolist()
    loop = time.perf_counter() - start
    if variant != "none":
        mx.eval([c.state for c in chunk_cache])
    tail = time.perf_counter() - start - loop
    after = gaps[args.at:]
    return {"gap_p50_ms": 1e3 * statistics.median(gaps[2:]), "gap_max_after_ms": 1e3 * max(after),
            "loop_ms": 1e3 * loop, "chunk_left_ms": 1e3 * tail}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="synthetic:small")
    ap.add_argument("--rows", type=int, default=32)
    ap.add_argument("--held", type=int, default=256)
    ap.add_argument("--chunk", default="8x512", help="prompts x tokens")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--at", type=int, default=10, help="the step that queues the chunk")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--out", default="benchmarks/results/side_stream.json")
    args = ap.parse_args()
    apply_cuda_defaults()
    model, _ = load_model(args.model)
    args.vocab = min(2000, int(model.args.vocab_size))
    side = mx.new_stream(mx.default_device())
    variants = ["none", "same", "side"]
    runs: dict[str, list[dict[str, float]]] = {v: [] for v in variants}
    for v in variants:
        run(model, args, v, side, 0)  # warm-up: kernels and shapes
    for rep in range(args.repeat):
        for v in variants[rep % 3:] + variants[: rep % 3]:
            runs[v].append(run(model, args, v, side, rep))
    print(f"{args.model} on {mx.default_device()}: {args.rows} rows of {args.held} tokens, chunk {args.chunk} "
          f"at step {args.at} of {args.steps}, medians of {args.repeat}")
    print(f"{'variant':>8} {'gap p50 ms':>11} {'gap max after':>14} {'loop ms':>9} {'x none':>7} {'chunk left ms':>14}")
    rows = {}
    for v in variants:
        row = {k: statistics.median(r[k] for r in runs[v]) for k in runs[v][0]}
        rows[v] = row
    for v, row in rows.items():
        print(f"{v:>8} {row['gap_p50_ms']:>11.2f} {row['gap_max_after_ms']:>14.2f} {row['loop_ms']:>9.1f} "
              f"{row['loop_ms'] / rows['none']['loop_ms']:>7.3f} {row['chunk_left_ms']:>14.1f}")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"args": vars(args), "rows": rows, "device": str(mx.default_device()),
                               "date": time.strftime("%Y-%m-%d %H:%M")}, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()

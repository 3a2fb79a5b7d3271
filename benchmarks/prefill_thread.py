"""Prefill on a second host thread, beside a pipelined decode loop: does it stall, and what does
the pair get done?

On a GPU a decode step is mostly the host's (Python building the graph, MLX launching kernels):
the device is busy about 3 of a step's 8 ms (1B shape, 64 rows, docs/host-cost.md). A prefill
pass queued from the same thread adds its host time to the step that queues it, whatever stream
it goes on (`side_stream.py`). Here a second thread, with a stream of its own, runs the passes,
so their host work runs on another core and their kernels fill the device's idle time. Variants:

- `none`: the decode alone (`--rows` rows of `--held` tokens, pipelined as mlx-lm's);
- `same`: the decode thread queues a pass of `--chunk` (prompts x tokens) every `--every` steps
  on its own stream (what the engine does at budget 0);
- `thread`: a second thread runs passes back to back for as long as the decode runs.

It prints the gap between tokens (median, 99th percentile, largest), the passes done, and the
work done over the time taken: decode steps times the decode's step alone plus passes times a
pass alone, over the elapsed time (1.0: no overlap; above it, the two threads overlapped). A
pass made on the second thread is checked against the same pass made alone (equal logits), and
its cache is read on the decode thread. Medians over `--repeat` rotating rounds.

    python benchmarks/prefill_thread.py --model synthetic:llama-3.2-1b --rows 64 --chunk 8x512
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
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


def pct(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, int(q * len(s)))]


class Prefiller:
    """Runs passes of `chunk` on a thread and stream of its own until told to stop."""

    def __init__(self, model: Any, chunk: mx.array) -> None:
        self.model, self.chunk = model, chunk
        self.passes = 0
        self.stop = threading.Event()
        self.started = threading.Event()
        self.error: BaseException | None = None
        self.logits: mx.array | None = None
        self.cache: list[Any] = []

    def one(self) -> tuple[mx.array, list[Any]]:
        cache = make_prompt_cache(self.model)
        logits = self.model(self.chunk, cache=cache)[:, -1, :]
        mx.eval(logits, [c.state for c in cache])
        return logits, cache

    def run(self) -> None:
        try:
            with mx.stream(mx.new_stream(mx.default_device())):
                self.started.set()
                while not self.stop.is_set():
                    self.logits, self.cache = self.one()
                    self.passes += 1
        except BaseException as exc:  # reported by the caller
            self.error = exc
            self.started.set()


def run(model: Any, args: argparse.Namespace, variant: str, seed: int) -> dict[str, float]:
    prompts, length = (int(n) for n in args.chunk.split("x"))
    cache = make_prompt_cache(model)
    ids = mx.random.randint(3, args.vocab, (args.rows, args.held), key=mx.random.key(seed))
    mx.eval(model(ids, cache=cache), [c.state for c in cache])
    chunk = mx.random.randint(3, args.vocab, (prompts, length), key=mx.random.key(seed + 1))
    mx.eval(chunk)
    side = Prefiller(model, chunk)
    thread = None
    if variant == "thread":
        thread = threading.Thread(target=side.run, daemon=True)
        thread.start()
        side.started.wait()
    same_stream = mx.new_stream(mx.default_device())
    queued: list[Any] = []

    def step(y: mx.array) -> mx.array:
        return mx.argmax(model(y[:, None], cache=cache)[:, -1, :], axis=-1)

    y = step(ids[:, -1])
    mx.async_eval(y)
    gaps: list[float] = []
    start = last = time.perf_counter()
    same_passes = 0
    for n in range(args.steps):
        if variant == "same" and n % args.every == args.every - 1:
            with mx.stream(same_stream):
                c = make_prompt_cache(model)
                out = model(chunk, cache=c)[:, -1, :]
                mx.async_eval(out, [x.state for x in c])
                queued.append(out)
                same_passes += 1
        nxt = step(y)
        mx.async_eval(nxt)
        y.tolist()  # step n's tokens: waits for it
        now = time.perf_counter()
        gaps.append(now - last)
        last = now
        y = nxt
    y.tolist()
    if queued:
        mx.eval(queued)
    elapsed = time.perf_counter() - start
    passes = same_passes
    ok = 1.0
    if thread is not None:
        side.stop.set()
        thread.join()
        if side.error is not None:
            raise side.error
        passes = side.passes
        # The second thread's last pass, read here: its logits against the same pass made on
        # this thread alone, and its cache used in this thread's graph.
        ref, ref_cache = side.one()
        assert side.logits is not None
        ok = float(mx.array_equal(side.logits, ref).item())
        keys = mx.sum(side.cache[0].state[0].astype(mx.float32)).item()
        ok *= float(keys == mx.sum(ref_cache[0].state[0].astype(mx.float32)).item())
    g = gaps[2:]
    return {"gap_p50_ms": 1e3 * statistics.median(g), "gap_p99_ms": 1e3 * pct(g, 0.99),
            "gap_max_ms": 1e3 * max(g), "elapsed_s": elapsed, "steps": float(args.steps),
            "passes": float(passes), "equal": ok}


def alone(model: Any, args: argparse.Namespace) -> float:
    """One pass of the chunk, alone, synchronized: median seconds."""
    prompts, length = (int(n) for n in args.chunk.split("x"))
    chunk = mx.random.randint(3, args.vocab, (prompts, length), key=mx.random.key(7))
    side = Prefiller(model, chunk)
    side.one()
    times = []
    for _ in range(5):
        t = time.perf_counter()
        side.one()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="synthetic:small")
    ap.add_argument("--rows", type=int, default=32)
    ap.add_argument("--held", type=int, default=256)
    ap.add_argument("--chunk", default="8x512", help="prompts x tokens")
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--every", type=int, default=6, help="`same`: a pass every this many steps")
    ap.add_argument("--switch-interval", type=float, default=0.0, help="sys.setswitchinterval (0: Python's)")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--out", default="benchmarks/results/prefill_thread.json")
    args = ap.parse_args()
    apply_cuda_defaults()
    if args.switch_interval:
        sys.setswitchinterval(args.switch_interval)
    model, _ = load_model(args.model)
    args.vocab = min(2000, int(model.args.vocab_size))
    variants = ["none", "same", "thread"]
    for v in variants:
        run(model, args, v, 0)  # warm-up: kernels and shapes
    pass_s = alone(model, args)
    runs: dict[str, list[dict[str, float]]] = {v: [] for v in variants}
    for rep in range(args.repeat):
        for v in variants[rep % 3:] + variants[: rep % 3]:
            runs[v].append(run(model, args, v, rep + 1))
    rows = {v: {k: statistics.median(r[k] for r in runs[v]) for k in runs[v][0]} for v in variants}
    step_s = rows["none"]["elapsed_s"] / args.steps
    for row in rows.values():
        work = row["steps"] * step_s + row["passes"] * pass_s
        row["work_over_time"] = work / row["elapsed_s"]
        row["steps_per_s"] = row["steps"] / row["elapsed_s"]
        row["prefill_tok_per_s"] = row["passes"] * int(args.chunk.split("x")[0]) * int(
            args.chunk.split("x")[1]) / row["elapsed_s"]
    print(f"{args.model} on {mx.default_device()}: {args.rows} rows of {args.held} tokens, chunk {args.chunk}; "
          f"decode step alone {1e3 * step_s:.2f} ms, a pass alone {1e3 * pass_s:.1f} ms; medians of {args.repeat}")
    print(f"{'variant':>8} {'gap p50':>8} {'p99':>7} {'max':>7} {'p99/p50':>8} {'steps/s':>8} {'passes':>7} "
          f"{'prefill tok/s':>14} {'work/time':>10} {'equal':>6}")
    for v, r in rows.items():
        print(f"{v:>8} {r['gap_p50_ms']:>8.2f} {r['gap_p99_ms']:>7.2f} {r['gap_max_ms']:>7.2f} "
              f"{r['gap_p99_ms'] / r['gap_p50_ms']:>8.2f} {r['steps_per_s']:>8.1f} {r['passes']:>7.0f} "
              f"{r['prefill_tok_per_s']:>14.0f} {r['work_over_time']:>10.2f} {r['equal']:>6.0f}")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"args": vars(args), "rows": rows, "device": str(mx.default_device()),
                               "pass_alone_s": pass_s, "date": time.strftime("%Y-%m-%d %H:%M")}, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()

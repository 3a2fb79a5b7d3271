"""One decode step of a bare BatchGenerator: ms/step with and without `install_fast_decode`.

For each batch size, both variants decode the same prompts side by side in one run (interleaved,
the best of --repeat runs each): B prompts are prefilled, --warmup-steps decode steps run untimed,
then --steps decode steps are timed (pure decode: nothing waits to be prefilled). The first run of
each variant then goes on for --check-steps untimed steps (across a KV buffer boundary), and the
greedy tokens of every row must match token for token. With --profile, one more run per variant
times the parts of `GenerationBatch._step` (a copy of mlx-lm 0.32.2's, with clocks) and counts
the primitives of one step's graph.

    python benchmarks/decode_step.py [--model synthetic:llama-3.2-1b] [--batches 1 8 64] [--profile]
"""

from __future__ import annotations

import argparse
import collections
import gc
import json
import platform
import random
import re
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

# First: OpenBLAS (workers/blas.py) binds only if it is loaded before MLX.
import workers  # noqa: F401

# isort: split
import mlx.core as mx

from workers.loading.models import load_model

# The compiled-decode experiment lives beside this script (also when run with `python -P`).
sys.path.insert(0, str(Path(__file__).resolve().parent))
from fast_decode import FastDecodeModel, install_fast_decode  # noqa: E402

VARIANTS = ("base", "fast")
BANDWIDTH = 3.35e12  # H100 SXM HBM3, bytes/s
VIEWS = {"Broadcast", "Reshape", "Slice", "Transpose", "ExpandDims", "Squeeze", "Flatten", "Unflatten",
         "AsStrided", "Depends"}


def f(x: float | None, fmt: str) -> str:
    return "-" if x is None else format(x, fmt)


def weight_bytes(model: Any) -> int:
    from mlx.utils import tree_flatten

    return sum(v.nbytes for _, v in tree_flatten(model.parameters()))


def profiled_step(self: Any, clock: dict[str, float]) -> tuple[list[int], list[mx.array]]:
    """mlx-lm 0.32.2's GenerationBatch._step for a batch without logits processors, with clocks."""
    t0 = time.perf_counter()
    self._current_tokens = self._next_tokens
    self._current_logprobs = self._next_logprobs
    inputs = self._current_tokens
    logits = self.model(inputs[:, None], cache=self.prompt_cache)
    logits = logits[:, -1, :]
    t1 = time.perf_counter()
    logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    samplers = [self.fallback_sampler if s is None else s for s in (self.samplers or [None] * len(self.uids))]
    assert all(s is samplers[0] for s in samplers)
    sampled = (samplers[0] if samplers else self.fallback_sampler)(logprobs)
    self._next_tokens = sampled
    self._next_logprobs = list(logprobs)
    t2 = time.perf_counter()
    mx.async_eval(self._next_tokens, self._next_logprobs, [])
    t3 = time.perf_counter()
    mx.eval(inputs, self._current_logprobs)
    t4 = time.perf_counter()
    out = inputs.tolist()
    for sti, ti in zip(self.tokens, out, strict=True):
        sti.append(ti)
    t5 = time.perf_counter()
    for key, dt in (("forward_build", t1 - t0), ("sampler_build", t2 - t1), ("async_eval", t3 - t2),
                    ("wait", t4 - t3), ("tolist", t5 - t4)):
        clock[key] = clock.get(key, 0.0) + dt
    return out, self._current_logprobs


def count_primitives(gen: Any) -> dict[str, int]:
    """Primitives in one decode step's graph (forward, log-softmax, argmax), by kind."""
    batch = gen._generation_batch
    mx.synchronize()
    inputs = batch._next_tokens
    logits = batch.model(inputs[:, None], cache=batch.prompt_cache)[:, -1, :]
    logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    sampled = mx.argmax(logprobs, axis=-1)
    with tempfile.NamedTemporaryFile("r", suffix=".dot") as f:
        mx.export_to_dot(f.name, sampled, *(c.keys for c in batch.prompt_cache))
        labels = re.findall(r'label ="([A-Za-z0-9_]+)"', Path(f.name).read_text())
    return dict(collections.Counter(labels).most_common())


def run(model: Any, prompts: list[list[int]], variant: str, args: argparse.Namespace, *,
        check: bool, profile: bool) -> dict[str, Any]:
    from mlx_lm.generate import BatchGenerator

    b = len(prompts)
    gen = BatchGenerator(model, completion_batch_size=b, prefill_batch_size=min(8, b), prefill_step_size=2048)
    applied = install_fast_decode(gen, force=True) if variant == "fast" else False
    if variant == "fast" and not applied:
        gen.close()
        return {"applied": False}
    total = args.warmup_steps + args.steps + (args.check_steps if check else 0) + 64
    uids = gen.insert([list(p) for p in prompts], max_tokens=[total] * b)
    tokens: dict[int, list[int]] = {u: [] for u in uids}

    def step() -> None:
        for r in gen.next()[1]:
            tokens[r.uid].append(r.token)

    batch = gen._generation_batch
    while len(batch) < b or gen._unprocessed_sequences or len(gen._prompt_batch):
        step()
    for _ in range(args.warmup_steps):
        step()
    clock: dict[str, float] = {}
    if profile:
        stock = batch._step
        batch._step = lambda: profiled_step(batch, clock)
    mx.synchronize()
    start = time.perf_counter()
    for _ in range(args.steps):
        step()
    mx.synchronize()
    elapsed = time.perf_counter() - start
    result: dict[str, Any] = {"applied": applied, "ms_per_step": elapsed / args.steps * 1e3}
    if profile:
        batch._step = stock
        result["parts_ms"] = {k: v / args.steps * 1e3 for k, v in clock.items()}
        result["parts_ms"]["rest_of_next"] = result["ms_per_step"] - sum(result["parts_ms"].values())
        result["primitives"] = count_primitives(gen)
    for _ in range(args.check_steps if check else 0):
        step()
    if check:
        result["tokens"] = [tokens[u] for u in uids]
    if isinstance(batch.model, FastDecodeModel):
        result["compiled_steps"] = batch.model.compiled_steps
        result["fallback_steps"] = batch.model.fallback_steps
    gen.close()
    gc.collect()
    mx.clear_cache()
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="synthetic:llama-3.2-1b")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 64])
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--steps", type=int, default=100, help="timed decode steps per run")
    ap.add_argument("--warmup-steps", type=int, default=20)
    ap.add_argument("--check-steps", type=int, default=160,
                    help="untimed steps after the first run of each variant, for the token check")
    ap.add_argument("--repeat", type=int, default=2, help="interleaved runs per variant; the best counts")
    ap.add_argument("--profile", action="store_true", help="time the parts of a step, count primitives")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="benchmarks/results/decode_step.json")
    args = ap.parse_args()

    model, _ = load_model(args.model)
    wbytes = weight_bytes(model)
    limit_ms = wbytes / BANDWIDTH * 1e3
    vocab = model.args.vocab_size
    rows = []
    all_identical = True
    for b in args.batches:
        rng = random.Random(args.seed + b)
        prompts = [[rng.randrange(3, min(vocab, 4000)) for _ in range(args.prompt_tokens)] for _ in range(b)]
        runs: dict[str, list[dict[str, Any]]] = {v: [] for v in VARIANTS}
        for rep in range(args.repeat):
            for v in VARIANTS:
                runs[v].append(run(model, prompts, v, args, check=rep == 0, profile=False))
        if args.profile:
            for v in VARIANTS:
                runs[v].append(run(model, prompts, v, args, check=False, profile=True))
        applied = all(r["applied"] for r in runs["fast"])
        base_ms = min(r["ms_per_step"] for r in runs["base"])
        fast_ms = min(r["ms_per_step"] for r in runs["fast"]) if applied else None
        identical = None
        if applied:
            a, c = runs["base"][0]["tokens"], runs["fast"][0]["tokens"]
            identical = a == c
            all_identical &= identical
            if not identical:
                first = min((j for j in range(b) if a[j] != c[j]), default=0)
                k = next((i for i, (x, y) in enumerate(zip(a[first], c[first], strict=False)) if x != y), None)
                print(f"  ! B={b}: row {first} differs from token {k} on", flush=True)
        row: dict[str, Any] = {
            "batch": b, "base_ms": base_ms, "fast_ms": fast_ms,
            "speedup": base_ms / fast_ms if fast_ms else None,
            "base_tok_s": b / base_ms * 1e3, "fast_tok_s": b / fast_ms * 1e3 if fast_ms else None,
            "limit_ms": limit_ms, "base_x_limit": base_ms / limit_ms,
            "fast_x_limit": fast_ms / limit_ms if fast_ms else None,
            "identical": identical, "tokens_checked": sum(len(t) for t in runs["base"][0]["tokens"]),
            "runs": {v: [{k: x for k, x in r.items() if k != "tokens"} for r in rs] for v, rs in runs.items()},
        }
        rows.append(row)
        print(f"  B={b:<3d} base {base_ms:7.2f} ms  fast {f(fast_ms, '7.2f')} ms  identical {identical}", flush=True)
        if args.profile:
            for v in VARIANTS:
                p = runs[v][-1]
                if "parts_ms" in p:
                    parts = "  ".join(f"{k} {x:.2f}" for k, x in p["parts_ms"].items())
                    kernels = sum(n for k, n in p["primitives"].items() if k not in VIEWS)
                    print(f"      {v}: {p['ms_per_step']:.2f} ms = {parts}; "
                          f"{sum(p['primitives'].values())} primitives, {kernels} not views", flush=True)

    print(f"\nweights {wbytes / 1e9:.3f} GB: bandwidth limit {limit_ms:.3f} ms/step at {BANDWIDTH / 1e12:.2f} TB/s")
    print(f"{'batch':>5} {'base ms':>8} {'fast ms':>8} {'speedup':>8} {'base tok/s':>11} {'fast tok/s':>11} "
          f"{'base/limit':>11} {'fast/limit':>11} {'identical':>9}")
    for r in rows:
        print(f"{r['batch']:>5} {r['base_ms']:>8.2f} {f(r['fast_ms'], '.2f'):>8} {f(r['speedup'], '.2f'):>8} "
              f"{r['base_tok_s']:>11.0f} {f(r['fast_tok_s'], '.0f'):>11} {r['base_x_limit']:>11.1f} "
              f"{f(r['fast_x_limit'], '.1f'):>11} {str(r['identical']):>9}")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    import mlx_lm

    meta = {
        "model": args.model, "prompt_tokens": args.prompt_tokens, "steps": args.steps,
        "warmup_steps": args.warmup_steps, "check_steps": args.check_steps, "repeat": args.repeat,
        "weight_bytes": wbytes, "bandwidth_bytes_s": BANDWIDTH, "device": str(mx.default_device()),
        "device_name": mx.device_info().get("device_name"), "mlx": mx.__version__, "mlx_lm": mlx_lm.__version__,
        "python": sys.version.split()[0], "machine": platform.machine(), "date": time.strftime("%Y-%m-%d"),
    }
    out.write_text(json.dumps({"meta": meta, "rows": rows}, indent=2))
    print(f"\nwrote {out}")
    if not all_identical:
        sys.exit(1)


if __name__ == "__main__":
    main()

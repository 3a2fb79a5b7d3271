"""MLX's CUDA settings, measured: CUDA graphs on/off and ops per graph, side by side.

For each model and setting, one process (MLX reads `MLX_USE_CUDA_GRAPHS` and
`MLX_MAX_OPS_PER_BUFFER` once, at first use) measures:
- the bare `BatchGenerator` decode step (ms/step, pure decode, prompts of equal length) at each
  batch size, with mlx-lm's mask ("masked") and with our mask-free decode ("maskfree");
- tokens/s of a bare tight loop and of our `Scheduler` at each number of streams (closed loop,
  one wave of requests, greedy, `ignore_eos`), as in `overhead.py`.
With `--quant`, it also times one transformer layer's matmuls of an 8B llama shape in bf16 and
4-bit (`mx.quantized_matmul`) at each batch size: where a 4-bit decode step's time goes. With
`--quant-step`, the whole mask-free decode step of each model, quantized in stages in memory
(bf16; the transformer layers 4-bit; then the embedding and `lm_head` too), plus `lm_head` alone:
which part of a 4-bit step costs what.

    python benchmarks/cuda_settings.py --models synthetic:qwen2.5-0.5b synthetic:llama-3.2-1b \\
        --settings default graphs_off ops60 ops250 --streams 1 8 64 256 --out results.json

Prints a table per model and writes all cells to one JSON file (rewritten after every cell, so a
run cut short keeps what it measured).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

# Before the functions below import MLX: OpenBLAS (workers/blas.py) binds only if loaded first.
import workers  # noqa: F401

SETTINGS: dict[str, dict[str, str]] = {
    "default": {},
    "graphs_off": {"MLX_USE_CUDA_GRAPHS": "0"},
    "ops60": {"MLX_MAX_OPS_PER_BUFFER": "60"},
    "ops250": {"MLX_MAX_OPS_PER_BUFFER": "250"},
    "graphs_off_ops60": {"MLX_USE_CUDA_GRAPHS": "0", "MLX_MAX_OPS_PER_BUFFER": "60"},
}
VARS = ("MLX_USE_CUDA_GRAPHS", "MLX_MAX_OPS_PER_BUFFER")
HERE = Path(__file__).resolve().parent


def llama_8b(cache: str | None = None) -> str:
    """A random-weight llama-3.1-8B shape in bf16 (16 GB; ~105 s to write on the GPU machine),
    the same directory as `shapes.py llama-3.1-8b` (the served-8b stage)."""
    sys.path.insert(0, str(HERE))
    from shapes import build

    return str(build("llama-3.1-8b", cache))


def decode_ms(model: Any, b: int, prompt_tokens: int, mask_free: bool, warmup: int, steps: int,
              seed: int) -> float:
    """ms per pure decode step of a bare BatchGenerator holding `b` rows of equal length."""
    import mlx.core as mx
    from mlx_lm.generate import BatchGenerator

    from workers.batching.maskfree import MaskFreeDecode

    rng = random.Random(seed)
    vocab = model.args.vocab_size
    prompts = [[rng.randrange(3, min(vocab, 4000)) for _ in range(prompt_tokens)] for _ in range(b)]
    # All rows prefilled together, so they have equal lengths (no left padding).
    gen = BatchGenerator(model, completion_batch_size=b, prefill_batch_size=b, prefill_step_size=2048)
    gen.insert(prompts, max_tokens=[warmup + steps + 64] * b)
    decode = MaskFreeDecode(mask_free)

    def step() -> None:
        decode.before_step(gen)
        gen.next()

    while len(gen._generation_batch) < b or gen._unprocessed_sequences or len(gen._prompt_batch):
        step()
    for _ in range(warmup):
        step()
    mx.synchronize()
    start = time.perf_counter()
    for _ in range(steps):
        step()
    mx.synchronize()
    elapsed = time.perf_counter() - start
    if mask_free and decode.mask_free_steps < steps:
        raise RuntimeError(f"mask-free decode took {decode.mask_free_steps} of {steps} steps")
    gen.close()
    mx.clear_cache()
    return elapsed / steps * 1e3


def quant_layer_ms(batches: list[int], iters: int = 30) -> list[dict[str, Any]]:
    """One llama-3.1-8B layer's seven matmuls (q, k, v, o, gate, up, down) in bf16 and 4-bit."""
    import mlx.core as mx

    shapes = [(4096, 4096), (1024, 4096), (1024, 4096), (4096, 4096), (14336, 4096), (14336, 4096),
              (4096, 14336)]  # (out, in)
    w_bf16 = [mx.random.normal(s).astype(mx.bfloat16) * 0.02 for s in shapes]
    w_q = [mx.quantize(w, group_size=64, bits=4) for w in w_bf16]
    mx.eval(w_bf16, w_q)
    rows = []
    for b in batches:
        xs = [mx.random.normal((b, s[1])).astype(mx.bfloat16) for s in shapes]
        mx.eval(xs)

        def bf16(xs: list[Any] = xs) -> list[Any]:
            return [x @ w.T for x, w in zip(xs, w_bf16, strict=True)]

        def q4(xs: list[Any] = xs) -> list[Any]:
            return [mx.quantized_matmul(x, *wq, transpose=True, group_size=64, bits=4)
                    for x, wq in zip(xs, w_q, strict=True)]

        def q4_3d(xs: list[Any] = xs) -> list[Any]:
            """As a model's decode step calls it: (batch, 1, in)."""
            return [mx.quantized_matmul(x[:, None], *wq, transpose=True, group_size=64, bits=4)
                    for x, wq in zip(xs, w_q, strict=True)]

        row: dict[str, Any] = {"batch": b}
        for name, fn in (("bf16", bf16), ("q4", q4), ("q4_3d", q4_3d)):
            for _ in range(3):
                mx.eval(fn())
            mx.synchronize()
            t = time.perf_counter()
            for _ in range(iters):
                mx.eval(fn())
            mx.synchronize()
            row[f"{name}_layer_ms"] = (time.perf_counter() - t) / iters * 1e3
        row["q4_over_bf16"] = row["q4_layer_ms"] / row["bf16_layer_ms"]
        rows.append(row)
    return rows


async def scheduler_level(config: Any, warm: list[list[int]], prompts: list[list[int]], n: int,
                          max_tokens: int) -> tuple[int, float]:
    """Our side in one Scheduler (one model load): an untimed wave, then the timed one."""
    import anyio

    from scheduler import SamplingParams, Scheduler

    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    async with Scheduler(config) as sched:
        elapsed, tokens = 0.0, 0
        for todo in (list(warm), list(prompts)):
            tokens = 0

            async def client(todo: list[list[int]] = todo) -> None:
                nonlocal tokens
                while todo:
                    done = await sched.complete(todo.pop(), params)
                    tokens += done.completion_tokens  # after the await: clients interleave

            start = time.perf_counter()
            async with anyio.create_task_group() as tg:
                for _ in range(n):
                    tg.start_soon(client)
            elapsed = time.perf_counter() - start
    return tokens, elapsed


def quant_step_ms(model: Any, args: argparse.Namespace) -> list[dict[str, Any]]:
    """The mask-free decode step with the model quantized (4-bit, group 64) in stages."""
    import mlx.core as mx
    import mlx.nn as nn

    def head_ms(b: int) -> float:
        """`lm_head` (or the tied embedding) alone on `b` rows."""
        inner = model.model if hasattr(model, "model") else model
        x = mx.random.normal((b, 1, model.args.hidden_size)).astype(mx.bfloat16)
        head = model.lm_head if hasattr(model, "lm_head") else inner.embed_tokens.as_linear
        for _ in range(3):
            mx.eval(head(x))
        mx.synchronize()
        t = time.perf_counter()
        for _ in range(20):
            mx.eval(head(x))
        mx.synchronize()
        return (time.perf_counter() - t) / 20 * 1e3

    def layers_only(path: str, module: Any) -> bool:
        return isinstance(module, nn.Linear) and "lm_head" not in path

    from workers.batching.quantfold import fold_decode_batch

    stages = [("bf16", None), ("layers 4-bit", layers_only), ("all 4-bit", lambda p, m: hasattr(m, "to_quantized")),
              ("all 4-bit, folded", "fold")]
    rows = []
    for name, predicate in stages:
        if predicate == "fold":
            fold_decode_batch(model)
        elif predicate is not None:
            nn.quantize(model, group_size=64, bits=4, class_predicate=predicate)
            mx.eval(model.parameters())
            mx.clear_cache()
        for b in args.batches:
            row = {"stage": name, "batch": b,
                   "step_ms": decode_ms(model, b, args.prompt_tokens, True, args.warmup_steps, args.steps,
                                        args.seed + b),
                   "lm_head_ms": head_ms(b)}
            rows.append(row)
            print(f"    quant-step {row}", file=sys.stderr, flush=True)
    return rows


def child(args: argparse.Namespace) -> dict[str, Any]:
    import anyio
    import mlx.core as mx

    from scheduler import SchedulerConfig
    from workers.loading.models import load_model

    sys.path.insert(0, str(HERE))
    from overhead import bare_loop, make_prompts

    cell: dict[str, Any] = {"model": args.model, "setting": args.setting,
                            "env": {k: os.environ.get(k) for k in VARS}, "device": str(mx.default_device())}
    if args.quant:
        cell["quant"] = quant_layer_ms(args.batches)
    if not args.model:
        return cell
    t = time.perf_counter()
    model, _ = load_model(args.model)
    cell["load_s"] = time.perf_counter() - t
    if args.quant_step:
        cell["quant_step"] = quant_step_ms(model, args)
        return cell
    decode = []
    for b in args.batches:
        row = {"batch": b}
        for variant in ("masked", "maskfree"):
            row[f"{variant}_ms"] = decode_ms(model, b, args.prompt_tokens, variant == "maskfree",
                                             args.warmup_steps, args.steps, args.seed + b)
        decode.append(row)
        print(f"    decode B={b}: {row}", file=sys.stderr, flush=True)
    cell["decode"] = decode
    streams = []
    vocab = model.args.vocab_size
    for n in args.streams:
        prompts = make_prompts(n, args.prompt_tokens, vocab, args.seed + n)
        warm = make_prompts(min(n, 8), args.prompt_tokens, vocab, args.seed + n + 10**6)
        config = SchedulerConfig.from_toml(
            f'[model]\npath = "{args.model}"\n[worker]\nmax_batch = {n}\nstep_token_budget = 0\n[kvpool]\nmemory = "{args.memory}"\n'
            '[logging]\nlevel = "warning"\n')
        w = config.worker
        bare_loop(model, warm, n, args.max_tokens, w.prefill_batch, w.prefill_step)
        bt, bs = bare_loop(model, prompts, n, args.max_tokens, w.prefill_batch, w.prefill_step)
        st, ss = anyio.run(scheduler_level, config, warm, prompts, n, args.max_tokens)
        assert st == bt == n * args.max_tokens, (st, bt)
        row = {"streams": n, "bare_tok_s": bt / bs, "sched_tok_s": st / ss, "ratio": (st / ss) / (bt / bs)}
        streams.append(row)
        print(f"    streams {n}: {row}", file=sys.stderr, flush=True)
    cell["streams"] = streams
    return cell


def print_tables(cells: list[dict[str, Any]]) -> None:
    for model in dict.fromkeys(c["model"] for c in cells if c.get("model")):
        mine = [c for c in cells if c.get("model") == model and "decode" in c]
        if not mine:
            continue
        print(f"\n{model}: decode ms/step, masked / mask-free (bare BatchGenerator)")
        batches = [r["batch"] for r in mine[0]["decode"]]
        print(f"{'setting':<18}" + "".join(f"{'B=' + str(b):>16}" for b in batches))
        for c in mine:
            print(f"{c['setting']:<18}" + "".join(
                f"{r['masked_ms']:>8.2f}/{r['maskfree_ms']:<7.2f}" for r in c["decode"]))
        withs = [c for c in mine if c.get("streams")]
        if withs:
            print(f"{model}: tok/s, bare / scheduler")
            levels = [r["streams"] for r in withs[0]["streams"]]
            print(f"{'setting':<18}" + "".join(f"{'n=' + str(n):>18}" for n in levels))
            for c in withs:
                print(f"{c['setting']:<18}" + "".join(
                    f"{r['bare_tok_s']:>9.0f}/{r['sched_tok_s']:<8.0f}" for r in c["streams"]))
    for c in cells:
        if "quant_step" in c:
            print(f"\n{c['model']} ({c['setting']}): mask-free decode step, ms (lm_head alone, ms)")
            rows = c["quant_step"]
            batches = list(dict.fromkeys(r["batch"] for r in rows))
            print(f"{'stage':<16}" + "".join(f"{'B=' + str(b):>18}" for b in batches))
            for stage in dict.fromkeys(r["stage"] for r in rows):
                print(f"{stage:<16}" + "".join(
                    f"{r['step_ms']:>10.2f} ({r['lm_head_ms']:.2f})" for r in rows if r["stage"] == stage))
        if "quant" in c:
            print(f"\n8B layer matmuls ({c['setting']}): " + "; ".join(
                f"B={r['batch']} bf16 {r['bf16_layer_ms']:.3f} ms, 4-bit {r['q4_layer_ms']:.3f} ms "
                f"(x{r['q4_over_bf16']:.1f}), 4-bit on (B, 1, in) {r.get('q4_3d_layer_ms', 0):.3f} ms"
                for r in c["quant"]))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="*", default=["synthetic:qwen2.5-0.5b", "synthetic:llama-3.2-1b"],
                    help='"llama-3.1-8b": a random 8B bf16 llama shape, built on first use')
    ap.add_argument("--settings", nargs="+", default=list(SETTINGS), choices=list(SETTINGS))
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 64, 256])
    ap.add_argument("--streams", type=int, nargs="*", default=[1, 8, 64, 256])
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--steps", type=int, default=40, help="timed decode steps")
    ap.add_argument("--warmup-steps", type=int, default=10)
    ap.add_argument("--quant", action="store_true", help="also time an 8B layer's matmuls, bf16 and 4-bit")
    ap.add_argument("--memory", default="16GiB",
                    help="our [kvpool] memory, weights included (an 8B bf16 model's weights are 16 GB)")
    ap.add_argument("--quant-step", action="store_true",
                    help="instead of the settings cells: each model's decode step quantized in stages")
    ap.add_argument("--timeout", type=float, default=300, help="seconds per cell")
    ap.add_argument("--deadline", type=float, default=0, help="seconds for the whole run; 0: none")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="benchmarks/results/cuda_settings.json")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--model", default="", help=argparse.SUPPRESS)
    ap.add_argument("--setting", default="default", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(child(args)))
        return

    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    prior = json.loads(out.read_text()) if out.is_file() else {"cells": []}
    cells: list[dict[str, Any]] = prior["cells"]
    t0 = time.monotonic()
    models = [llama_8b() if m == "llama-3.1-8b" else m for m in args.models]
    jobs = [(m, s) for m in models for s in args.settings]
    if args.quant:
        jobs += [("", s) for s in args.settings]
    for model, setting in jobs:
        left = args.deadline - (time.monotonic() - t0) if args.deadline else args.timeout
        if left < 20:
            print(f"  ! deadline: skipped {model or 'matmuls'} {setting}", flush=True)
            continue
        env = {k: v for k, v in os.environ.items() if k not in VARS} | SETTINGS[setting]
        cmd = [sys.executable, "-P", __file__, "--child", "--model", model, "--setting", setting,
               "--batches", *map(str, args.batches), "--streams", *map(str, args.streams),
               "--prompt-tokens", str(args.prompt_tokens), "--max-tokens", str(args.max_tokens),
               "--steps", str(args.steps), "--warmup-steps", str(args.warmup_steps), "--seed", str(args.seed),
               "--memory", args.memory]
        if not model:
            cmd.append("--quant")
        if args.quant_step:
            cmd.append("--quant-step")
        print(f"=== {time.strftime('%H:%M:%S')} {model or '8B layer matmuls'} {setting}", flush=True)
        try:
            done = subprocess.run(cmd, env=env, stdout=subprocess.PIPE, timeout=min(args.timeout, left), check=False)
        except subprocess.TimeoutExpired:
            print(f"  ! timed out after {min(args.timeout, left):.0f} s", flush=True)
            continue
        if done.returncode != 0:
            print(f"  ! exit {done.returncode}", flush=True)
            continue
        cells.append(json.loads(done.stdout.decode().strip().splitlines()[-1]))
        out.write_text(json.dumps({"cells": cells}, indent=1))
    print_tables(cells)
    print(f"\nwrote {out}")


if __name__ == "__main__":
    main()

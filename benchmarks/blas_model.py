"""BLAS under MLX's CPU backend, from a matmul to SmolLM2: float32 matmul GFLOP/s and SmolLM2-135M
prefill/decode tok/s through `mlx_lm.stream_generate`, each configuration in a fresh process
(OpenBLAS binds only when it is loaded before `mlx.core`, so a process cannot switch).

Matmuls (float32, best of a few timed runs after one warm-up): 1024x1024x1024, decode-sized
[64,576]x[576,1536] and prefill-sized [512,576]x[576,1536], on the bundled reference BLAS
(MLX_SCHEDULER_BLAS=bundled), OpenBLAS 1 thread and OpenBLAS 2 threads.
SmolLM2 (`workers.loading.models.load`, one greedy stream, the figures `stream_generate` reports):
float32 dequantized on OpenBLAS, the same on the bundled BLAS, 4-bit kept quantized with float32
scales (dequantize="no") on OpenBLAS, and float16 on OpenBLAS (MLX's CPU backend has no fast
float16 path: capped at --f16-tokens tokens and a short prompt). The load average (as `uptime`
prints it) is read before and after each child.

    python benchmarks/blas_model.py [--seed 0] [--prompt-tokens 128] [--max-tokens 64]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

MATMUL_CONFIGS: dict[str, dict[str, str]] = {
    "bundled": {"MLX_SCHEDULER_BLAS": "bundled"},
    "openblas 1 thread": {"MLX_SCHEDULER_BLAS_THREADS": "1"},
    "openblas 2 threads": {"MLX_SCHEDULER_BLAS_THREADS": "2"},
}
SHAPES: dict[str, tuple[int, int, int]] = {  # (M, K, N)
    "1024x1024x1024": (1024, 1024, 1024),
    "decode [64,576]x[576,1536]": (64, 576, 1536),
    "prefill [512,576]x[576,1536]": (512, 576, 1536),
}
# name -> (environment, workers.loading.models.load keyword arguments)
MODEL_CONFIGS: dict[str, tuple[dict[str, str], dict[str, str]]] = {
    "float32 dequantized, openblas": ({}, {"dtype": "float32", "dequantize": "yes"}),
    "float32 dequantized, bundled": ({"MLX_SCHEDULER_BLAS": "bundled"}, {"dtype": "float32", "dequantize": "yes"}),
    "4-bit + float32 scales, openblas": ({}, {"dtype": "float32", "dequantize": "no"}),
    "float16, openblas": ({}, {"dtype": "float16", "dequantize": "no"}),
}


def uptime() -> str:
    try:
        out = subprocess.run(["uptime"], capture_output=True, text=True, timeout=5).stdout
        return out.split("load average:")[1].strip()
    except (OSError, IndexError, subprocess.SubprocessError):
        return " ".join(f"{x:.2f}" for x in os.getloadavg())


def child_matmul(seed: int) -> dict[str, Any]:
    import mlx.core as mx

    import workers  # noqa: F401  (OpenBLAS before MLX, unless MLX_SCHEDULER_BLAS=bundled)
    from workers.blas import blas_state

    mx.random.seed(seed)
    out: dict[str, Any] = {"blas": blas_state().library, "threads": blas_state().threads}
    for name, (m, k, n) in SHAPES.items():
        a, b = mx.random.normal((m, k)), mx.random.normal((k, n))
        mx.eval(a, b, a @ b)
        flops = 2 * m * k * n
        reps = max(1, int(2e9 / flops))  # about 2 GFLOP a timed run
        best = float("inf")
        for _ in range(3):
            t = time.perf_counter()
            for _ in range(reps):
                mx.eval(a @ b)
            best = min(best, (time.perf_counter() - t) / reps)
        out[name] = flops / best / 1e9
    return out


def child_model(seed: int, model: str, load_kwargs: dict[str, str], prompt_tokens: int,
                max_tokens: int) -> dict[str, Any]:
    import mlx.core as mx
    from mlx_lm import stream_generate

    import workers  # noqa: F401
    from workers.blas import blas_state
    from workers.loading.models import load

    mx.random.seed(seed)
    loaded = load(model, **load_kwargs)  # type: ignore[arg-type]
    tok = loaded.tokenizer
    text = ("The history of the printing press begins in the fifteenth century, when movable type "
            "changed how books were made, sold and read across Europe. ") * 16
    prompt = tok.encode(text)[:prompt_tokens]
    # Warm-up: one short generation, untimed.
    for _ in stream_generate(loaded.model, tok, mx.array(prompt[:16]), max_tokens=2):
        pass
    last = None
    t = time.perf_counter()
    for resp in stream_generate(loaded.model, tok, mx.array(prompt), max_tokens=max_tokens):
        last = resp
    assert last is not None
    return {"blas": blas_state().library, "threads": blas_state().threads,
            "precision": str(loaded.precision), "prompt_tokens": last.prompt_tokens,
            "prefill_tok_s": last.prompt_tps, "generation_tokens": last.generation_tokens,
            "decode_tok_s": last.generation_tps, "wall_s": time.perf_counter() - t}


def spawn(args: list[str], env: dict[str, str], timeout: float) -> tuple[dict[str, Any], str, str]:
    before = uptime()
    proc = subprocess.run([sys.executable, __file__, *args], env={**os.environ, **env},
                          capture_output=True, text=True, timeout=timeout)
    after = uptime()
    if proc.returncode != 0:
        return {"error": proc.stderr[-800:]}, before, after
    return json.loads(proc.stdout.strip().splitlines()[-1]), before, after


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--f16-prompt-tokens", type=int, default=16)
    ap.add_argument("--f16-tokens", type=int, default=16)
    ap.add_argument("--skip", nargs="*", default=[], help="configuration names to leave out")
    ap.add_argument("--out", default="benchmarks/results/blas_model.json")
    ap.add_argument("--child", choices=("matmul", "model"), help=argparse.SUPPRESS)
    ap.add_argument("--config", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child == "matmul":
        print(json.dumps(child_matmul(args.seed)))
        return
    if args.child == "model":
        f16 = "float16" in args.config
        print(json.dumps(child_model(args.seed, args.model, MODEL_CONFIGS[args.config][1],
                                     args.f16_prompt_tokens if f16 else args.prompt_tokens,
                                     args.f16_tokens if f16 else args.max_tokens)))
        return

    meta = {"time": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "host": platform.node(), "nproc": os.cpu_count(),
            "machine": platform.machine(), "seed": args.seed, "model": args.model,
            "prompt_tokens": args.prompt_tokens, "max_tokens": args.max_tokens,
            "f16_prompt_tokens": args.f16_prompt_tokens, "f16_tokens": args.f16_tokens}
    matmul: list[dict[str, Any]] = []
    print(f"{meta['time']}  {platform.machine()}, nproc {os.cpu_count()}\n")
    print(f"{'config':<20} " + " ".join(f"{s:>29}" for s in SHAPES) + "   load before -> after (GFLOP/s)")
    for name, env in MATMUL_CONFIGS.items():
        if name in args.skip:
            continue
        res, before, after = spawn(["--child", "matmul", "--seed", str(args.seed)], env, 600)
        matmul.append({"config": name, **res, "load_before": before, "load_after": after})
        figures = " ".join(f"{res.get(s, float('nan')):>29.1f}" for s in SHAPES)
        print(f"{name:<20} {figures}   {before} -> {after}  [{res.get('blas', res.get('error', ''))}]", flush=True)
    models: list[dict[str, Any]] = []
    print(f"\n{args.model} through mlx_lm.stream_generate (one stream, greedy)")
    print(f"{'config':<34} {'prompt':>6} {'prefill tok/s':>13} {'tokens':>6} {'decode tok/s':>12}   load before -> after")
    for name, (env, _) in MODEL_CONFIGS.items():
        if name in args.skip:
            continue
        cmd = ["--child", "model", "--config", name, "--seed", str(args.seed), "--model", args.model,
               "--prompt-tokens", str(args.prompt_tokens), "--max-tokens", str(args.max_tokens),
               "--f16-prompt-tokens", str(args.f16_prompt_tokens), "--f16-tokens", str(args.f16_tokens)]
        res, before, after = spawn(cmd, env, 900)
        models.append({"config": name, **res, "load_before": before, "load_after": after})
        if "error" in res:
            print(f"{name:<34} error: {res['error'][-300:]}", flush=True)
            continue
        print(f"{name:<34} {res['prompt_tokens']:>6} {res['prefill_tok_s']:>13.1f} {res['generation_tokens']:>6} "
              f"{res['decode_tok_s']:>12.1f}   {before} -> {after}  [{res['blas']}]", flush=True)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"meta": meta, "matmul": matmul, "model": models}, indent=2))
    print(f"\nwrote {out}")


if __name__ == "__main__":
    main()

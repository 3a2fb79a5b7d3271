"""Float32 matmul GFLOP/s under MLX's CPU backend: the mlx wheel's bundled reference BLAS against
OpenBLAS (loaded by workers/blas.py) at 1 and 2 threads, OpenBLAS's own default, and ours.

OpenBLAS binds only if it is loaded before `mlx.core`, so every configuration runs in a fresh
process of its own (this script with --child), in rounds, each configuration once a round; the
table keeps each figure's median over the rounds. Cases: a 1024^3 matmul, the MLP projections of
SmolLM2-135M (hidden 576, intermediate 1536) at decode (64 rows) and prefill (512 rows) sizes, and
that whole gated MLP (`silu(x Wg) * (x Wu) Wd`), whose elementwise ops run on MLX's own kernels
between the BLAS calls. Each product is checked against numpy's. The load average (as `uptime`
prints it) is read before and after every child; --busy N adds N spinning processes, as the
event loop, a tokenizer or a neighbour's job would compete for the same cores.

    python benchmarks/blas.py [--rounds 3] [--seconds 0.5] [--busy 0]
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

# name -> environment of the child (workers/blas.py reads these; "default": OpenBLAS's own choice,
# OPENBLAS_NUM_THREADS or every CPU; "ours": whatever workers/blas.py picks when nothing is set).
CONFIGS: dict[str, dict[str, str]] = {
    "bundled": {"MLX_SCHEDULER_BLAS": "bundled"},
    "openblas:1": {"MLX_SCHEDULER_BLAS_THREADS": "1"},
    "openblas:2": {"MLX_SCHEDULER_BLAS_THREADS": "2"},
    "openblas:default": {"MLX_SCHEDULER_BLAS_THREADS": "default"},
    "openblas:ours": {},
}
HIDDEN, INTER = 576, 1536  # SmolLM2-135M
CASES: dict[str, tuple[int, int, int]] = {  # name -> (M, K, N) of one product
    "1024^3": (1024, 1024, 1024),
    "decode 64x576x1536": (64, HIDDEN, INTER),
    "prefill 512x576x1536": (512, HIDDEN, INTER),
    "mlp 64 rows": (64, HIDDEN, INTER),
    "mlp 512 rows": (512, HIDDEN, INTER),
}
THREAD_VARS = ("MLX_SCHEDULER_BLAS", "MLX_SCHEDULER_BLAS_THREADS", "OPENBLAS_NUM_THREADS",
               "OMP_NUM_THREADS", "GOTO_NUM_THREADS")


def product(x: Any, w: list[Any]) -> Any:
    """One product, or SmolLM2's gated MLP when given its three weights."""
    if len(w) == 1:
        return x @ w[0]
    import mlx.nn as nn

    return (nn.silu(x @ w[0]) * (x @ w[1])) @ w[2]


def child(seconds: float, seed: int, model: str = "", requests: int = 16, prompt_tokens: int = 128,
          max_tokens: int = 64) -> dict[str, Any]:
    """Runs in a fresh process: load (or not) OpenBLAS, then time every case through MLX."""
    import ctypes

    from workers.blas import blas_state

    state = blas_state()  # before MLX below: that is the point
    import mlx.core as mx
    import numpy as np

    mx.set_default_device(mx.cpu)
    corename = ""
    if state.library == "openblas":
        lib = ctypes.CDLL(state.path)
        lib.openblas_get_corename.restype = ctypes.c_char_p
        corename = lib.openblas_get_corename().decode()
    rng = np.random.default_rng(seed)
    out: dict[str, Any] = {"blas": state.library, "threads": state.threads, "corename": corename,
                           "reason": state.reason, "cases": {}}
    for name, (m, k, n) in CASES.items():
        x = rng.standard_normal((m, k), dtype=np.float32)
        ws = [rng.standard_normal(shape, dtype=np.float32) / np.sqrt(shape[0])
              for shape in ([(k, n)] if not name.startswith("mlp") else [(k, n), (k, n), (n, k)])]
        xa, wa = mx.array(x), [mx.array(w) for w in ws]
        flops = 2 * m * k * n * len(ws)
        if name.startswith("mlp"):
            g = x @ ws[0]
            want = (g / (1 + np.exp(-g)) * (x @ ws[1])) @ ws[2]
        else:
            want = x @ ws[0]
        got = np.array(product(xa, wa))
        err = float(np.abs(got - want).max() / np.abs(want).max())
        for _ in range(2):
            mx.eval(product(xa, wa))
        times: list[float] = []
        start = time.perf_counter()
        while len(times) < 3 or time.perf_counter() - start < seconds:
            t0 = time.perf_counter()
            mx.eval(product(xa, wa))
            times.append(time.perf_counter() - t0)
        med = statistics.median(times)
        out["cases"][name] = {"gflops": flops / med / 1e9, "ms": med * 1e3, "calls": len(times),
                              "rel_err": err}
    if model:
        import anyio

        out["model"] = anyio.run(serve_load, model, requests, prompt_tokens, max_tokens, seed)
        gc.collect()  # MLX work in joined threads can abort the interpreter at exit otherwise
    return out


async def serve_load(model: str, requests: int, prompt_tokens: int, max_tokens: int, seed: int) -> dict[str, Any]:
    """`requests` concurrent streamed requests through a Scheduler (after one untimed wave):
    output tokens/s over the wall time, prefill included, with the event loop as busy as in a
    server that streams every token."""
    import random

    import anyio

    from scheduler import SamplingParams, Scheduler, SchedulerConfig

    toml = (f'[model]\npath = "{model}"\n[worker]\nmax_batch = {requests}\n'
            '[logging]\nlevel = "warning"\n')
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    rng = random.Random(seed)
    tokens = 0

    async with Scheduler(SchedulerConfig.from_toml(toml)) as sched:
        vocab = sched.model.info.vocab_size

        async def one(prompt: list[int]) -> None:
            nonlocal tokens
            async for chunk in sched.generate(prompt, params):
                tokens += len(chunk.token_ids)

        for _wave in ("warm-up, untimed", "timed"):  # the second overwrites the first's figures
            tokens = 0
            start = time.perf_counter()
            async with anyio.create_task_group() as tg:
                for _ in range(requests):
                    tg.start_soon(one, [rng.randrange(vocab) for _ in range(prompt_tokens)])
            wall = time.perf_counter() - start
        stats = sched.stats()
    assert tokens == requests * max_tokens, (tokens, requests * max_tokens)
    return {"tok_s": tokens / wall, "wall_s": wall, "blas": stats.blas, "dtype": sched.model.info.dtype}


def run_child(config: str, seconds: float, seed: int, model_args: list[str]) -> dict[str, Any]:
    env = {k: v for k, v in os.environ.items() if k not in THREAD_VARS}
    env.update(CONFIGS[config])
    src = str(Path(__file__).resolve().parents[1] / "src")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (src, env.get("PYTHONPATH", "")) if p)
    load_before = os.getloadavg()
    done = subprocess.run([sys.executable, __file__, "--child", "--seconds", str(seconds), "--seed", str(seed),
                           *model_args],
                          env=env, capture_output=True, text=True, timeout=600, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"{config}: child exited with {done.returncode}:\n{done.stderr[-2000:]}")
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    result["loadavg"] = [load_before, os.getloadavg()]
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=list(CONFIGS))
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--seconds", type=float, default=0.5, help="timed calls per case: at least this long")
    ap.add_argument("--busy", type=int, default=0, help="spinning processes while measuring")
    ap.add_argument("--model", default="",
                    help="also run --requests concurrent streamed requests through a Scheduler on this model "
                         "(e.g. smollm2-135m: float32 on the CPU)")
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="benchmarks/results/blas.json")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(child(args.seconds, args.seed, args.model, args.requests, args.prompt_tokens,
                               args.max_tokens)))
        return

    model_args = (["--model", args.model, "--requests", str(args.requests), "--prompt-tokens",
                   str(args.prompt_tokens), "--max-tokens", str(args.max_tokens)] if args.model else [])
    load_start = os.getloadavg()
    print(f"load average (as uptime prints it): {' '.join(f'{x:.2f}' for x in load_start)}", flush=True)
    spinners = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(args.busy)]
    runs: dict[str, list[dict[str, Any]]] = {c: [] for c in args.configs}
    try:
        for r in range(args.rounds):
            for config in args.configs:
                res = run_child(config, args.seconds, args.seed, model_args)
                runs[config].append(res)
                one = "  ".join(f"{v['gflops']:6.1f}" for v in res["cases"].values())
                tok = f"  {res['model']['tok_s']:6.1f} tok/s" if "model" in res else ""
                print(f"  round {r} {config:<17} {one}{tok}  load {res['loadavg'][1][0]:.2f}", flush=True)
    finally:
        for p in spinners:
            p.kill()
            p.wait()

    rows: list[dict[str, Any]] = []
    for config, results in runs.items():
        first = results[0]
        row: dict[str, Any] = {
            "config": config, "blas": first["blas"], "threads": first["threads"], "corename": first["corename"],
            "reason": first["reason"],
            "gflops": {c: statistics.median(x["cases"][c]["gflops"] for x in results) for c in CASES},
            "ms": {c: statistics.median(x["cases"][c]["ms"] for x in results) for c in CASES},
            "max_rel_err": max(x["cases"][c]["rel_err"] for x in results for c in CASES),
            "loadavg_1min": [x["loadavg"][1][0] for x in results],
        }
        if args.model:
            row["model_tok_s"] = statistics.median(x["model"]["tok_s"] for x in results)
            row["model_dtype"] = first["model"]["dtype"]
        rows.append(row)
    print(f"\nfloat32 GFLOP/s through MLX, median of {args.rounds} rounds; {os.cpu_count()} CPUs, "
          f"{args.busy} spinning process(es)" + (f"; {args.model}: {args.requests} streamed requests of "
                                                 f"{args.prompt_tokens}+{args.max_tokens} tokens" if args.model else ""))
    names = {c: c.split()[0] + (" " + c.split()[1] if c.startswith("mlp") else "") for c in CASES}
    head = "  ".join(f"{names[c]:>10}" for c in CASES) + ("  model tok/s" if args.model else "")
    print(f"{'config':<17} {'blas':<8} {'thr':>3}  {head}  load avg (1 min), each round")
    for row in rows:
        figs = "  ".join(f"{row['gflops'][c]:10.1f}" for c in CASES)
        tok = f"  {row['model_tok_s']:11.1f}" if args.model else ""
        loads = " ".join(f"{x:.2f}" for x in row["loadavg_1min"])
        print(f"{row['config']:<17} {row['blas']:<8} {row['threads']:>3}  {figs}{tok}  {loads}")
    print("cases: " + "; ".join(f"{names[c]} = {c} ({'gated MLP, ' if c.startswith('mlp') else ''}"
                                f"M,K,N = {','.join(map(str, CASES[c]))})" for c in CASES))
    bad = [row["config"] for row in rows if row["max_rel_err"] > 1e-4]
    if bad:
        print(f"! products differ from numpy's by more than 1e-4 (relative): {', '.join(bad)}")
    meta = {"rounds": args.rounds, "seconds": args.seconds, "busy": args.busy, "seed": args.seed,
            "model": args.model, "requests": args.requests, "prompt_tokens": args.prompt_tokens,
            "max_tokens": args.max_tokens, "machine": platform.machine(), "cpus": os.cpu_count(),
            "python": sys.version.split()[0], "loadavg_start": load_start, "loadavg_end": os.getloadavg(),
            "date": time.strftime("%Y-%m-%d %H:%M")}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"meta": meta, "rows": rows, "runs": runs}, indent=2))
    print(f"load average at the end: {' '.join(f'{x:.2f}' for x in os.getloadavg())}\nwrote {out}")


if __name__ == "__main__":
    main()

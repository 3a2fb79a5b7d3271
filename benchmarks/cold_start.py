"""A fresh process's first requests: what MLX's kernel compilation costs them, with and without
the scheduler building kernels while it loads (`workers.cuda.warm_kernels` for a quantized model's
matmuls, `workers.cuda.warm_engine`'s few short requests for every model).

Each variant runs in a process of its own with an empty kernel directory (`MLX_PTX_CACHE_DIR`),
so every kernel MLX compiles is compiled there: `warm` is the scheduler as it ships, `cold` the
same with the load-time build skipped, `cached` a second process on `warm`'s directory (what
every later start pays). Each runs `--rounds` rounds of `--requests` requests at once (random
prompts of `--prompt-tokens`, `--max-tokens` tokens each, ignore_eos) and reports the start
(model load and build), then each round's seconds and TTFT p50 / max. Only MLX's CUDA backend
compiles kernels at run time; elsewhere the variants should agree.

    python benchmarks/cold_start.py --model smollm2-135m --requests 256 --max-batch 128
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

VARIANTS = ("warm", "cold", "cached")


def child(args: argparse.Namespace) -> dict[str, Any]:
    """One variant, in this process: its start and its rounds."""
    import anyio

    import workers.factory
    from scheduler import SamplingParams, Scheduler
    from scheduler.config import SchedulerConfig

    if args.child == "cold":
        workers.factory.warm_kernels = lambda model: 0.0
        workers.factory.warm_engine = lambda engine, vocab_size: 0.0
    config = SchedulerConfig.from_toml(
        f'[model]\npath = "{args.model}"\n[worker]\nmax_batch = {args.max_batch}\n'
        f'[kvpool]\nmemory = "{args.memory}"\n'.encode())
    rng = random.Random(0)
    out: dict[str, Any] = {"variant": args.child, "rounds": []}

    async def main() -> None:
        t = time.perf_counter()
        async with Scheduler(config) as s:
            out["start_s"] = time.perf_counter() - t
            vocab = s.model.info.vocab_size
            for _ in range(args.rounds):
                ttfts: list[float] = []

                async def one(ttfts: list[float]) -> None:
                    prompt = [rng.randrange(16, vocab) for _ in range(args.prompt_tokens)]
                    t1, first = time.perf_counter(), None
                    params = SamplingParams(max_tokens=args.max_tokens, ignore_eos=True)
                    async for chunk in s.generate(prompt, params):
                        if first is None and chunk.token_ids:
                            first = time.perf_counter() - t1
                    ttfts.append(first if first is not None else float("nan"))

                t0 = time.perf_counter()
                async with anyio.create_task_group() as tg:
                    for _ in range(args.requests):
                        tg.start_soon(one, ttfts)
                ttfts.sort()
                out["rounds"].append({"seconds": time.perf_counter() - t0, "ttft_p50_s": ttfts[len(ttfts) // 2],
                                      "ttft_max_s": ttfts[-1]})

    anyio.run(main)
    return out


def run_variant(args: argparse.Namespace, variant: str, kernels: Path) -> dict[str, Any]:
    env = {**os.environ, "MLX_PTX_CACHE_DIR": str(kernels), "PYTHONUNBUFFERED": "1"}
    cmd = [sys.executable, "-P", __file__, "--child", "warm" if variant == "cached" else variant, *sys.argv[1:]]
    try:
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=args.timeout)
    except subprocess.TimeoutExpired:
        return {"variant": variant, "error": f"not done in {args.timeout:g} s (--timeout)",
                "kernels_built": len({p.stem for p in kernels.glob("*.ptx")})}
    line = next((x for x in reversed(proc.stdout.splitlines()) if x.startswith("{")), None)
    if proc.returncode != 0 or line is None:
        return {"variant": variant, "error": f"rc {proc.returncode}: {proc.stderr[-600:]}"}
    result: dict[str, Any] = json.loads(line)
    result["variant"] = variant
    result["kernels_built"] = len({p.stem for p in kernels.glob("*.ptx")})
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--requests", type=int, default=256)
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--max-batch", type=int, default=128)
    ap.add_argument("--memory", default="16GiB")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--variants", nargs="+", choices=VARIANTS, default=list(VARIANTS))
    ap.add_argument("--timeout", type=float, default=400, help="seconds a variant may take")
    ap.add_argument("--out", default="benchmarks/results/cold_start.json")
    ap.add_argument("--child", choices=("warm", "cold"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(child(args)), flush=True)
        return
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="mlx-kernels-") as tmp:
        for variant in args.variants:
            # `cached` reuses `warm`'s directory; the others start from an empty one.
            kernels = Path(tmp) / ("warm" if variant == "cached" else variant)
            rows.append(run_variant(args, variant, kernels))
            r = rows[-1]
            if "error" in r:
                print(f"{variant:7s} failed: {r['error']}", flush=True)
                continue
            rounds = "  ".join(f"{x['seconds']:.1f} s (TTFT p50 {x['ttft_p50_s']:.2f}, max {x['ttft_max_s']:.2f})"
                               for x in r["rounds"])
            print(f"{variant:7s} start {r['start_s']:6.1f} s  kernels {r['kernels_built']:3d}  rounds: {rounds}",
                  flush=True)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    meta = {"argv": sys.argv[1:], "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
            "load": os.getloadavg()}
    out.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()

"""A burst: `--requests` requests sent at once to an idle scheduler, as a load test or a replica
behind a router sees them. How long until every stream has its first token, and until all end.

Each variant is a set of `[worker]` settings (`key=value,key=value`; `default` for none), run
side by side in one process, `--repeat` times in rotating order after one untimed burst each;
the table has the medians and each one's ratios to the first variant:

    python benchmarks/burst.py --model synthetic:small --requests 128 --prompt-tokens 128 \
        --max-tokens 32 --variants default prefill_pack=false --repeat 3
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import time
from contextlib import AsyncExitStack
from pathlib import Path
from typing import Any

import anyio

from metrics import configure_logging, summarize
from scheduler import SamplingParams, Scheduler, SchedulerConfig


def prompts(n: int, lo: int, hi: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)  # ids below 1000: in every model's vocabulary
    return [[rng.randrange(3, 1000) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


def config(args: argparse.Namespace, variant: str) -> SchedulerConfig:
    worker = [f"max_batch = {args.max_batch}"]
    for item in ([] if variant == "default" else variant.split(",")):
        key, _, value = item.partition("=")
        worker.append(f"{key} = {value if value.lstrip('-').isdigit() or value in ('true', 'false') else repr(value)}")
    return SchedulerConfig.from_toml(
        f'[model]\npath = "{args.model}"\n[worker]\n' + "\n".join(worker)
        + f'\n[kvpool]\nmemory = "{args.memory}"\n'
    )


async def burst(sched: Scheduler, batch: list[list[int]], max_tokens: int) -> dict[str, float]:
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    ttft: list[float] = []
    tokens = 0
    start = time.perf_counter()

    async def one(prompt: list[int]) -> None:
        nonlocal tokens
        first = True
        async for chunk in sched.generate(prompt, params):
            if chunk.token_ids and first:
                ttft.append(time.perf_counter() - start)
                first = False
            tokens += len(chunk.token_ids)

    async with anyio.create_task_group() as tg:
        for p in batch:
            tg.start_soon(one, p)
    wall = time.perf_counter() - start
    t = summarize(ttft)
    return {"tok_s": tokens / wall, "wall_s": wall, "ttft_p50_ms": t.p50 * 1e3,
            "ttft_p99_ms": t.p99 * 1e3, "last_first_ms": max(ttft) * 1e3, "steps": 0.0}


async def run(args: argparse.Namespace) -> list[dict[str, Any]]:
    runs: dict[str, list[dict[str, float]]] = {v: [] for v in args.variants}
    async with AsyncExitStack() as stack:
        scheds = {v: await stack.enter_async_context(Scheduler(config(args, v))) for v in args.variants}
        for r in range(args.repeat + 1):
            order = args.variants[r % len(args.variants):] + args.variants[: r % len(args.variants)]
            for v in order:
                batch = prompts(args.requests, args.prompt_tokens, args.prompt_max or args.prompt_tokens,
                                args.seed + r)
                before = scheds[v].stats().steps
                res = await burst(scheds[v], batch, args.max_tokens)
                res["steps"] = float(scheds[v].stats().steps - before)
                if r:  # the first burst of each is untimed (compiles, allocates)
                    runs[v].append(res)
                print(f"round {r} {v}: " + ", ".join(f"{k} {x:.1f}" for k, x in res.items()), flush=True)
    rows = []
    for v in args.variants:
        med = {k: statistics.median(x[k] for x in runs[v]) for k in runs[v][0]}
        rows.append({"variant": v, **med, "runs": runs[v]})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="synthetic:small")
    ap.add_argument("--requests", type=int, default=128)
    ap.add_argument("--max-batch", type=int, default=128)
    ap.add_argument("--prompt-tokens", type=int, default=128, help="prompt length (the least, with --prompt-max)")
    ap.add_argument("--prompt-max", type=int, default=0, help="lengths drawn from prompt-tokens..this")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--memory", default="8GiB")
    ap.add_argument("--variants", nargs="+", default=["default"])
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="benchmarks/results/burst.json")
    args = ap.parse_args()
    configure_logging("console", "warning")
    load = os.getloadavg()[0]
    rows = anyio.run(run, args)
    base = rows[0]
    print(f"\n{args.model}, {args.requests} requests at once, prompts {args.prompt_tokens}"
          f"{'-' + str(args.prompt_max) if args.prompt_max else ''} tokens, {args.max_tokens} out, "
          f"max_batch {args.max_batch}; medians of {args.repeat}; load {load:.2f} -> {os.getloadavg()[0]:.2f}")
    print("| variant | tok/s | x | TTFT p50 ms | x | TTFT p99 ms | x | last first token ms | steps |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for r in rows:
        print(f"| {r['variant']} | {r['tok_s']:,.0f} | {r['tok_s'] / base['tok_s']:.2f} | {r['ttft_p50_ms']:,.0f} | "
              f"{r['ttft_p50_ms'] / base['ttft_p50_ms']:.2f} | {r['ttft_p99_ms']:,.0f} | "
              f"{r['ttft_p99_ms'] / base['ttft_p99_ms']:.2f} | {r['last_first_ms']:,.0f} | {r['steps']:.0f} |")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"args": vars(args), "load": load, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()

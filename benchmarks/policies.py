"""What each scheduling policy buys, measured end to end in one run (open-loop Poisson arrivals).

(a) two tenants, one sending 10x the other's rate, overloading the batch: each tenant's share of
    the output tokens served while requests arrive, and p99 TTFT, under fcfs and fair;
(b) two priority classes: p50/p99 latency per class under fcfs and priority;
(c) mixed short and long requests: mean and p99 latency under fcfs and sjf.
Arrival rates are set from a measured capacity (tokens/s of a full batch), so the offered load is
the same multiple of capacity on any machine. Prints a table, writes JSON and a PNG plot.

    python benchmarks/policies.py [--model synthetic:small] [--duration 12] [--load 2.0] [--seed 0]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import anyio

from metrics import percentile
from scheduler import SamplingParams, Scheduler, SchedulerConfig

PROMPT_TOKENS = 32


@dataclass(frozen=True)
class Arrival:
    at: float
    group: str
    max_tokens: int
    tenant: str = "default"
    priority: int = 0


@dataclass
class Result:
    group: str
    ttft_s: float
    e2e_s: float
    tokens: int
    token_times: list[tuple[float, int]] = field(default_factory=list)  # (seconds from start, n)


@dataclass
class Run:
    elapsed_s: float
    window_s: float
    groups: dict[str, dict[str, float]]


def config(model: str, policy: str, max_batch: int) -> SchedulerConfig:
    return SchedulerConfig.from_toml(
        f'[model]\npath = "{model}"\n[worker]\nmax_batch = {max_batch}\n'
        f'[scheduler]\npolicy = "{policy}"\nmax_queue = 100000\n[kvpool]\nmemory = "4GiB"\n'
        '[logging]\nlevel = "warning"\n'
    )


def prompt(rng: random.Random) -> list[int]:
    return [rng.randrange(3, 1000) for _ in range(PROMPT_TOKENS)]


async def serve(cfg: SchedulerConfig, arrivals: list[Arrival], seed: int) -> tuple[list[Result], float]:
    """Submit each arrival at its time; return every request's result and the run's length."""
    rng = random.Random(seed)
    prompts = [prompt(rng) for _ in arrivals]
    results: list[Result] = []
    async with Scheduler(cfg) as sched:
        start = time.perf_counter()

        async def one(a: Arrival, p: list[int]) -> None:
            params = SamplingParams(max_tokens=a.max_tokens, temperature=0.0, ignore_eos=True)
            times: list[tuple[float, int]] = []
            async for chunk in sched.generate(p, params, tenant=a.tenant, priority=a.priority):
                if chunk.token_ids:
                    times.append((time.perf_counter() - start, len(chunk.token_ids)))
                if chunk.finish_reason is not None:
                    assert chunk.finish_reason == "length" and chunk.timings is not None
                    assert chunk.timings.ttft_s is not None
                    results.append(Result(a.group, chunk.timings.ttft_s, chunk.timings.e2e_s,
                                          chunk.completion_tokens, times))

        async with anyio.create_task_group() as tg:
            for a, p in zip(arrivals, prompts, strict=True):
                delay = start + a.at - time.perf_counter()
                if delay > 0:
                    await anyio.sleep(delay)
                tg.start_soon(one, a, p)
        elapsed = time.perf_counter() - start
    assert len(results) == len(arrivals)
    return results, elapsed


def capacity(model: str, max_batch: int, max_tokens: int, seed: int) -> float:
    """Output tokens/s with the batch kept full (closed loop), which also warms everything up."""
    arrivals = [Arrival(0.0, "cal", max_tokens) for _ in range(3 * max_batch)]
    results, elapsed = anyio.run(serve, config(model, "fcfs", max_batch), arrivals, seed)
    return sum(r.tokens for r in results) / elapsed


def poisson(rng: random.Random, rate: float, duration: float) -> list[float]:
    times, t = [], rng.expovariate(rate)
    while t < duration:
        times.append(t)
        t += rng.expovariate(rate)
    return times


def tenants_workload(rng: random.Random, req_rate: float, duration: float, out: int) -> list[Arrival]:
    heavy = [Arrival(t, "heavy", out, tenant="heavy") for t in poisson(rng, req_rate * 10 / 11, duration)]
    light = [Arrival(t, "light", out, tenant="light") for t in poisson(rng, req_rate * 1 / 11, duration)]
    return sorted(heavy + light, key=lambda a: a.at)


def classes_workload(rng: random.Random, req_rate: float, duration: float, out: int) -> list[Arrival]:
    high = [Arrival(t, "high", out, priority=0) for t in poisson(rng, req_rate * 0.2, duration)]
    low = [Arrival(t, "low", out, priority=1) for t in poisson(rng, req_rate * 0.8, duration)]
    return sorted(high + low, key=lambda a: a.at)


def mixed_workload(rng: random.Random, req_rate: float, duration: float, short: int, long: int) -> list[Arrival]:
    return [Arrival(t, "long", long) if rng.random() < 0.2 else Arrival(t, "short", short)
            for t in poisson(rng, req_rate, duration)]


def summarize(results: list[Result], window: float) -> dict[str, dict[str, float]]:
    """Per group and over "all": latency figures, and the share of the output tokens served
    within `window` (while requests still arrive)."""
    groups: dict[str, list[Result]] = {"all": results}
    for r in results:
        groups.setdefault(r.group, []).append(r)
    served = {g: sum(n for r in rs for t, n in r.token_times if t <= window) for g, rs in groups.items()}
    out = {}
    for g, rs in sorted(groups.items()):
        ttft, e2e = [r.ttft_s for r in rs], [r.e2e_s for r in rs]
        out[g] = {
            "requests": len(rs), "share_of_output": served[g] / max(served["all"], 1),
            "ttft_p50_s": percentile(ttft, 50), "ttft_p99_s": percentile(ttft, 99),
            "e2e_mean_s": sum(e2e) / len(e2e), "e2e_p50_s": percentile(e2e, 50),
            "e2e_p99_s": percentile(e2e, 99),
        }
    return out


def plot(runs: dict[str, dict[str, Run]], title: str, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4.5))
    panels = [
        ("tenants", "(a) heavy 10x light: p99 TTFT (s)", ["heavy", "light"], "ttft_p99_s", ["fcfs", "fair"]),
        ("classes", "(b) priority classes: p99 latency (s)", ["high", "low"], "e2e_p99_s", ["fcfs", "priority"]),
        ("mixed", "(c) short + long: mean latency (s)", ["short", "long", "all"], "e2e_mean_s", ["fcfs", "sjf"]),
    ]
    for ax, (scenario, title, groups, metric, policies) in zip(axes, panels, strict=True):
        width = 0.38
        for i, policy in enumerate(policies):
            stats = runs[scenario][policy].groups
            values = [stats[g][metric] for g in groups]
            xs = [x + (i - 0.5) * width for x in range(len(groups))]
            bars = ax.bar(xs, values, width, label=policy)
            ax.bar_label(bars, fmt="%.2f", fontsize=8)
        ax.set_xticks(range(len(groups)), groups)
        ax.set_title(title, fontsize=10)
        ax.set_yscale("log")
        ax.legend()
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="synthetic:small")
    ap.add_argument("--max-batch", type=int, default=8)
    ap.add_argument("--duration", type=float, default=12.0, help="seconds of arrivals per run")
    ap.add_argument("--load", type=float, default=2.0, help="offered load as a multiple of capacity")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="benchmarks/results/policies.json")
    args = ap.parse_args()

    out_tokens, short, long = 32, 8, 96
    tok_s = capacity(args.model, args.max_batch, out_tokens, args.seed)
    print(f"capacity: {tok_s:.0f} output tokens/s at batch {args.max_batch}")
    rate = args.load * tok_s / out_tokens
    mixed_rate = args.load * tok_s / (0.8 * short + 0.2 * long)
    scenarios = {
        "tenants": (["fcfs", "fair"], tenants_workload(random.Random(args.seed), rate, args.duration, out_tokens)),
        "classes": (["fcfs", "priority"], classes_workload(random.Random(args.seed + 1), rate, args.duration, out_tokens)),
        "mixed": (["fcfs", "sjf"], mixed_workload(random.Random(args.seed + 2), mixed_rate, args.duration, short, long)),
    }
    runs: dict[str, dict[str, Run]] = {}
    report: dict[str, object] = {
        "model": args.model, "max_batch": args.max_batch, "duration_s": args.duration, "load": args.load,
        "seed": args.seed, "capacity_tokens_per_s": tok_s, "prompt_tokens": PROMPT_TOKENS,
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "python": platform.python_version()},
        "note": "one run on one machine; CPU shared with other work, so absolute times are noisy",
    }
    header = f"{'scenario':<9} {'policy':<9} {'group':<6} {'reqs':>5} {'share':>6} {'ttft p50':>9} " \
             f"{'ttft p99':>9} {'lat mean':>9} {'lat p50':>8} {'lat p99':>8}"
    print(header)
    for name, (policies, arrivals) in scenarios.items():
        window = max(a.at for a in arrivals)
        runs[name] = {}
        for policy in policies:
            results, elapsed = anyio.run(serve, config(args.model, policy, args.max_batch), arrivals, args.seed)
            groups = summarize(results, window)
            runs[name][policy] = Run(elapsed, window, groups)
            for g, s in groups.items():
                print(f"{name:<9} {policy:<9} {g:<6} {s['requests']:>5} {s['share_of_output']:>6.1%} "
                      f"{s['ttft_p50_s']:>9.3f} {s['ttft_p99_s']:>9.3f} {s['e2e_mean_s']:>9.3f} "
                      f"{s['e2e_p50_s']:>8.3f} {s['e2e_p99_s']:>8.3f}")
    t, c, m = runs["tenants"], runs["classes"], runs["mixed"]
    ratios = {
        "light_ttft_p99_fcfs_over_fair": t["fcfs"].groups["light"]["ttft_p99_s"] / t["fair"].groups["light"]["ttft_p99_s"],
        "high_latency_p99_fcfs_over_priority": c["fcfs"].groups["high"]["e2e_p99_s"] / c["priority"].groups["high"]["e2e_p99_s"],
        "mean_latency_fcfs_over_sjf": m["fcfs"].groups["all"]["e2e_mean_s"] / m["sjf"].groups["all"]["e2e_mean_s"],
        "p99_latency_fcfs_over_sjf": m["fcfs"].groups["all"]["e2e_p99_s"] / m["sjf"].groups["all"]["e2e_p99_s"],
    }
    print("\n".join(f"{k}: {v:.2f}x" for k, v in ratios.items()))
    report["scenarios"] = {name: {p: asdict(r) for p, r in by_policy.items()} for name, by_policy in runs.items()}
    report["ratios"] = ratios
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2))
    title = (f"mlx-scheduler policies, {args.model}, max_batch {args.max_batch}, "
             f"offered load {args.load}x capacity")
    plot(runs, title, out.with_suffix(".png"))
    print(f"wrote {out} and {out.with_suffix('.png')}")


if __name__ == "__main__":
    main()

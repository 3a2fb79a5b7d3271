"""Soak: minutes of mixed load with cancels and timeouts; memory and latency must stay flat.

Records, every window: process RSS, MLX active memory, KV pool usage, finished requests and p99
end-to-end latency. Passes when, after a warm-up, RSS and MLX active memory in the last window
are within the tolerance of the first one (default: +10% and +32 MiB).

    python benchmarks/soak.py --minutes 10 [--model synthetic:small]
"""

from __future__ import annotations

import argparse
import json
import random
import resource
import sys
import time
from pathlib import Path

import anyio

from metrics import configure_logging, percentile
from scheduler import SamplingParams, Scheduler, SchedulerConfig
from scheduler.errors import QueueFull


def rss_bytes() -> int:
    """Current resident set size (Linux /proc); peak RSS elsewhere."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024


async def soak(args: argparse.Namespace) -> dict[str, object]:
    import mlx.core as mx

    rng = random.Random(args.seed)
    config = SchedulerConfig.from_toml(
        f'[model]\npath = "{args.model}"\n[worker]\nmax_batch = {args.max_batch}\n'
        f"[scheduler]\nmax_queue = {args.max_batch * 4}\n"
    )
    windows: list[dict[str, float]] = []
    e2e: list[float] = []
    counts = {"done": 0, "cancelled": 0, "timeout": 0, "rejected": 0}
    end_at = time.perf_counter() + args.minutes * 60
    async with Scheduler(config) as sched:

        async def client() -> None:
            while time.perf_counter() < end_at:
                prompt = [rng.randrange(3, 1000) for _ in range(rng.randint(8, 200))]
                params = SamplingParams(max_tokens=rng.randint(4, 96), temperature=0.8, ignore_eos=True)
                kind = rng.random()
                t0 = time.perf_counter()
                try:
                    with anyio.move_on_after(rng.uniform(0.05, 2.0) if kind < 0.15 else None):
                        done = await sched.complete(prompt, params, timeout=1.5 if kind > 0.9 else None)
                        if done.finish_reason == "timeout":
                            counts["timeout"] += 1
                        else:
                            counts["done"] += 1
                            e2e.append(time.perf_counter() - t0)
                        continue
                    counts["cancelled"] += 1
                except QueueFull:
                    counts["rejected"] += 1
                    await anyio.sleep(0.05)

        async def sampler() -> None:
            start = time.perf_counter()
            while True:
                await anyio.sleep(args.window_s)
                s = sched.stats()
                lat = e2e[:]
                e2e.clear()
                row = {
                    "t_s": time.perf_counter() - start,
                    "rss_mib": rss_bytes() / 2**20,
                    "mlx_active_mib": mx.get_active_memory() / 2**20,
                    "kv_used_frac": s.blocks_used / s.blocks_total,
                    "running": s.running,
                    "finished": s.finished,
                    "e2e_p99_s": percentile(lat, 99) if lat else float("nan"),
                }
                windows.append(row)
                print(f"  t={row['t_s']:6.0f}s rss {row['rss_mib']:7.1f} MiB  mlx {row['mlx_active_mib']:7.1f} MiB"
                      f"  kv {row['kv_used_frac']:.3f}  finished {s.finished:6d}  p99 {row['e2e_p99_s']:.2f}s",
                      flush=True)

        async with anyio.create_task_group() as tg:
            tg.start_soon(sampler)
            async with anyio.create_task_group() as clients:
                for _ in range(args.clients):
                    clients.start_soon(client)
            tg.cancel_scope.cancel()
        final = sched.stats()
    warm = [w for w in windows if w["t_s"] >= args.warmup_s] or windows
    first, last = warm[0], warm[-1]

    def flat(key: str) -> bool:
        return last[key] <= first[key] * (1 + args.tolerance) + args.slack_mib

    return {
        "meta": {"model": args.model, "minutes": args.minutes, "clients": args.clients,
                 "max_batch": args.max_batch, "tolerance": args.tolerance, "slack_mib": args.slack_mib,
                 "date": time.strftime("%Y-%m-%d")},
        "counts": counts,
        "idle_after": final.running == final.waiting == final.blocks_used == 0,
        "rss_flat": flat("rss_mib"),
        "mlx_flat": flat("mlx_active_mib"),
        "first": first,
        "last": last,
        "windows": windows,
    }


def plot(result: dict[str, object], path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("(matplotlib not installed: no PNG)")
        return
    rows = result["windows"]
    assert isinstance(rows, list)
    t = [r["t_s"] / 60 for r in rows]
    fig, axes = plt.subplots(4, 1, figsize=(8, 9), sharex=True)
    for ax, key, label in zip(
        axes, ["rss_mib", "mlx_active_mib", "kv_used_frac", "e2e_p99_s"],
        ["process RSS (MiB)", "MLX active (MiB)", "KV pool used", "e2e p99 (s)"], strict=True,
    ):
        ax.plot(t, [r[key] for r in rows])
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
    axes[-1].set_xlabel("minutes")
    fig.suptitle("soak: mixed load with cancels and timeouts")
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    print(f"wrote {path}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="synthetic:small")
    ap.add_argument("--minutes", type=float, default=10.0)
    ap.add_argument("--clients", type=int, default=96)
    ap.add_argument("--max-batch", type=int, default=32)
    ap.add_argument("--window-s", type=float, default=15.0)
    ap.add_argument("--warmup-s", type=float, default=60.0)
    ap.add_argument("--tolerance", type=float, default=0.10)
    ap.add_argument("--slack-mib", type=float, default=32.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="benchmarks/results/soak.json")
    args = ap.parse_args()
    configure_logging(level="warning")
    result = anyio.run(soak, args)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    plot(result, out.with_suffix(".png"))
    first, last = result["first"], result["last"]
    assert isinstance(first, dict) and isinstance(last, dict)
    print(f"\ncounts {result['counts']}")
    print(f"rss {first['rss_mib']:.1f} -> {last['rss_mib']:.1f} MiB  flat={result['rss_flat']}")
    print(f"mlx {first['mlx_active_mib']:.1f} -> {last['mlx_active_mib']:.1f} MiB  flat={result['mlx_flat']}")
    print(f"idle after: {result['idle_after']}")
    ok = result["rss_flat"] and result["mlx_flat"] and result["idle_after"]
    print("PASS" if ok else "FAIL")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()

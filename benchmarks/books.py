"""What one Reserve costs the pool's books, with 0 and with 10,000 cached entries.

Admission cost must not grow with the cache: the books keep their free and evictable counts up
to date instead of scanning the entries. Each sample applies a Reserve (the pool's own `handle`,
no event loop) for a request with a cold 8-block prompt and releases it again.

    python benchmarks/books.py [--entries 0 10000] [--reps 20000]
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

from kvpool.books import BlockBooks
from kvpool.messages import Release, Reserve
from kvpool.pool import handle


def reserve_cost(entries: int, reps: int, seed: int) -> dict[str, float]:
    """Median and mean µs of Reserve + Release on books holding `entries` unpinned cache entries."""
    books = BlockBooks(entries + 4096, block_tokens=16, bytes_per_block=1)
    for k in range(entries):
        assert books.cache(seed * 10**9 + k, 1, 16)
    prompt = [-(k + 1) for k in range(8)]  # keys not in the cache: a miss, as most admissions
    samples: list[float] = []
    for rep in range(reps):
        t0 = time.perf_counter_ns()
        handle(books, Reserve(rep, 10, prompt, None, 2, 64))
        samples.append((time.perf_counter_ns() - t0) / 1e3)
        handle(books, Release(rep, 0))
    books.check()
    assert books.cached == entries
    samples.sort()
    return {"entries": entries, "median_us": samples[len(samples) // 2],
            "mean_us": sum(samples) / len(samples), "p99_us": samples[int(len(samples) * 0.99)]}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--entries", type=int, nargs="+", default=[0, 10_000])
    ap.add_argument("--reps", type=int, default=20_000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="benchmarks/results/books.json")
    args = ap.parse_args(argv)
    rows = [reserve_cost(n, args.reps, args.seed) for n in args.entries]
    base = rows[0]["median_us"]
    print(f"{'entries':>8} {'median µs':>10} {'mean µs':>9} {'p99 µs':>8} {'x first':>8}")
    for r in rows:
        print(f"{r['entries']:>8} {r['median_us']:>10.2f} {r['mean_us']:>9.2f} {r['p99_us']:>8.2f} "
              f"{r['median_us'] / base:>8.2f}")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    meta = {"reps": args.reps, "python": sys.version.split()[0], "machine": platform.machine(),
            "date": time.strftime("%Y-%m-%d")}
    out.write_text(json.dumps({"meta": meta, "rows": rows}, indent=2))
    print(f"\nwrote {out}")


if __name__ == "__main__":
    main()

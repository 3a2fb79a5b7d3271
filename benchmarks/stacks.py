"""Where a process's time went, from py-spy's collapsed stacks (`py-spy record --format raw
--threads`, as `cluster.py --py-spy` writes them): per file, the share of a core each thread
held, then the functions holding the most samples, by their own frames and with their callees.

    python benchmarks/stacks.py benchmarks/results/cluster2-*-2rep-*.txt [--rate 200] [--top 12]
"""

from __future__ import annotations

import argparse
from collections import Counter
from pathlib import Path

PLUMBING = ("Thread.", "_bootstrap", "_run_module", "<module>")  # on every stack: says nothing


def read(path: Path) -> tuple[int, Counter[str], Counter[str], Counter[str]]:
    """(samples, samples per thread, per function as the leaf, per function anywhere on the stack)."""
    total, threads, own, within = 0, Counter[str](), Counter[str](), Counter[str]()
    for line in path.read_text().splitlines():
        stack, _, count = line.rstrip().rpartition(" ")
        if not stack or not count.isdigit():
            continue
        n = int(count)
        frames = stack.split(";")
        total += n
        threads[frames[0]] += n
        if len(frames) > 1:
            own[frames[-1]] += n
        for name in {f.split(" (")[0] for f in frames[1:]}:
            within[name] += n
    return total, threads, own, within


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("files", nargs="+", type=Path)
    p.add_argument("--rate", type=float, default=200.0, help="py-spy's samples a second (cluster.py: 200)")
    p.add_argument("--seconds", type=float, default=5.0, help="how long it sampled (cluster.py: --py-spy-seconds)")
    p.add_argument("--top", type=int, default=12)
    args = p.parse_args()
    whole = args.rate * args.seconds
    for path in args.files:
        total, threads, own, within = read(path)
        print(f"{path.name}: {total / whole:.2f} of a core")
        for name, n in threads.most_common(args.top):
            print(f"  {n / whole:5.2f}  {name[:100]}")
        print("  own frames (share of the file's samples):")
        for name, n in own.most_common(args.top):
            print(f"  {n / max(total, 1):5.1%}  {name[:100]}")
        print("  with callees:")
        callers = [(name, n) for name, n in within.most_common() if not name.startswith(PLUMBING)]
        for name, n in callers[:args.top]:
            print(f"  {n / max(total, 1):5.1%}  {name[:100]}")


if __name__ == "__main__":
    main()

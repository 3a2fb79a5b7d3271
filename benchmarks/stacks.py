"""Where a process's time went, from py-spy's collapsed stacks (`py-spy record --format raw
--threads`, as `cluster.py --py-spy` and `host_cost.py --py-spy` write them): per file, the share
of a core each thread held, then the functions holding the most samples, by their own frames and
with their callees. `--thread` keeps one thread's stacks; `--outside` drops the stacks that pass
through a frame (e.g. the worker thread between two decode steps: `--thread mlx-worker --outside
"next (mlx_lm" "next_alone ("`).

    python benchmarks/stacks.py benchmarks/results/cluster2-*-2rep-*.txt [--rate 200] [--top 12]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import subprocess
import time
from collections import Counter
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from collections.abc import Iterator

PLUMBING = ("Thread.", "_bootstrap", "_run_module", "<module>")  # on every stack: says nothing


def read(path: Path, thread: str = "", outside: tuple[str, ...] = ()
         ) -> tuple[int, Counter[str], Counter[str], Counter[str]]:
    """(samples, samples per thread, per function as the leaf, per function anywhere on the
    stack), of the threads whose label contains `thread`, leaving out every stack with a frame
    that contains one of `outside`."""
    total, threads, own, within = 0, Counter[str](), Counter[str](), Counter[str]()
    for line in path.read_text().splitlines():
        stack, _, count = line.rstrip().rpartition(" ")
        if not stack or not count.isdigit():
            continue
        n = int(count)
        frames = stack.split(";")
        if thread not in frames[0] or any(o in f for f in frames[1:] for o in outside):
            continue
        total += n
        threads[frames[0]] += n
        if len(frames) > 1:
            own[frames[-1]] += n
        for name in {f.split(" (")[0] for f in frames[1:]}:
            within[name] += n
    return total, threads, own, within


@contextlib.contextmanager
def recorded(py_spy: str, path: Path, rate: int = 100, settle: float = 1.0) -> Iterator[None]:
    """py-spy samples this process (native frames too, every thread) while the block runs, into
    `path` (collapsed stacks). py-spy needs the right to trace it: root, or ptrace_scope 0.
    `settle`: seconds to wait for it to attach before the block (what runs before is not sampled;
    0 where the block runs long past the attach, entered from an event loop)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    proc = subprocess.Popen(
        [py_spy, "record", "--pid", str(os.getpid()), "--threads", "--native", "--format", "raw",
         "--rate", str(rate), "--output", str(path)],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
    )
    time.sleep(settle)
    try:
        yield
    finally:
        proc.send_signal(signal.SIGINT)  # py-spy writes what it has, then exits
        try:
            _, err = proc.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            _, err = proc.communicate()
        if not path.exists():
            raise RuntimeError(f"py-spy wrote no {path}: {err.strip()[-400:]}")


def ranked(total: int, own: Counter[str], within: Counter[str], top: int,
           width: int = 100) -> tuple[list[str], list[str]]:
    """Lines of the `top` functions by their share of `total` samples: as the own frame, then
    with callees (the plumbing on every stack left out)."""
    def line(name: str, n: int) -> str:
        return f"  {n / max(total, 1):5.1%}  {name[:width]}"

    callers = [(name, n) for name, n in within.most_common() if not name.startswith(PLUMBING)]
    return [line(name, n) for name, n in own.most_common(top)], [line(name, n) for name, n in callers[:top]]


def report(path: Path, thread: str = "", outside: tuple[str, ...] = (), top: int = 8) -> list[str]:
    """Lines: the samples of `thread` outside `outside` against all of that thread's, then the
    functions holding the most of them, by own frame and with callees."""
    every, _, _, _ = read(path, thread)
    total, _, own, within = read(path, thread, outside)
    mine, callees = ranked(total, own, within, top, width=110)
    return [f"{total} of the thread's {every} samples ({total / max(every, 1):.1%}); own frames:",
            *mine, "with callees:", *callees]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("files", nargs="+", type=Path)
    p.add_argument("--rate", type=float, default=200.0, help="py-spy's samples a second (cluster.py: 200)")
    p.add_argument("--seconds", type=float, default=5.0, help="how long it sampled (cluster.py: --py-spy-seconds)")
    p.add_argument("--top", type=int, default=12)
    p.add_argument("--thread", default="", help="only the threads whose label contains this")
    p.add_argument("--outside", nargs="*", default=[], help="leave out stacks with a frame containing any of these")
    args = p.parse_args()
    whole = args.rate * args.seconds
    for path in args.files:
        total, threads, own, within = read(path, args.thread, tuple(args.outside))
        print(f"{path.name}: {total / whole:.2f} of a core")
        for name, n in threads.most_common(args.top):
            print(f"  {n / whole:5.2f}  {name[:100]}")
        mine, callees = ranked(total, own, within, args.top)
        print("\n".join(["  own frames (share of the file's samples):", *mine, "  with callees:", *callees]))


if __name__ == "__main__":
    main()

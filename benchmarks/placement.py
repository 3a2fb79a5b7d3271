"""Where the replicas' busiest threads run: the CPU each replica's busiest thread last ran on,
sampled through a run, and how often two replicas' shared one physical core (SMT siblings).

Two replicas' worker threads on the two hyperthreads of one core each get well under a core's
throughput, as a host-bound decode step shows in tokens a second; Ray's `num_cpus` is accounting,
not placement. Linux only (it reads /proc and /sys); elsewhere it reports nothing.
"""

from __future__ import annotations

import asyncio
import collections
from pathlib import Path

from procstat import read_stat

from scheduler.serving.cluster.pinning import siblings


def busiest_cpu(pid: int) -> int | None:
    """The CPU that the thread of `pid` with the most CPU time so far last ran on."""
    best: tuple[int, int] | None = None
    for stat in Path(f"/proc/{pid}/task").glob("*/stat"):
        try:
            user, system, cpu = read_stat(stat)
        except (OSError, ValueError, IndexError):
            continue  # the thread ended meanwhile
        if best is None or user + system > best[0]:
            best = (user + system, cpu)
    return None if best is None else best[1]


class Placement:
    """Samples every `every_s` seconds while running (`start`, `stop`); `summary()` says where
    each process's busiest thread ran and how often two of them shared a core."""

    def __init__(self, pids: dict[str, int], every_s: float = 0.5) -> None:
        self._pids, self._every = pids, every_s
        self._cpus: dict[str, collections.Counter[int]] = {name: collections.Counter() for name in pids}
        self._samples = self._shared = 0
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        self._sample()  # the last, so that a run shorter than `every_s` has two

    async def _run(self) -> None:
        while True:
            self._sample()
            await asyncio.sleep(self._every)

    def _sample(self) -> None:
        cores = []
        for name, pid in self._pids.items():
            cpu = busiest_cpu(pid)
            if cpu is not None:
                self._cpus[name][cpu] += 1
                cores.append(siblings(cpu))
        self._samples += 1
        self._shared += len(cores) != len(set(cores))

    def summary(self) -> dict[str, object]:
        """Per process its CPUs (most samples first), and the share of samples in which two
        processes' busiest threads were on one physical core."""
        out: dict[str, object] = {name: dict(c.most_common(4)) for name, c in self._cpus.items()}
        out["same_core_share"] = round(self._shared / self._samples, 3) if self._samples else None
        return out

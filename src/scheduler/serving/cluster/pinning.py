"""Each replica's threads on physical cores of their own (`[cluster] pin_cpus`).

Ray's `num_cpus` is accounting: the kernel places a replica's threads anywhere, and two replicas'
worker threads (each near a core, building decode steps) can land on the two hyperthreads of one
physical core, where each gets well under a core's work. With `pin_cpus`, the replica holding GPU
g of a node's G takes the g-th of G equal runs of the node's physical cores (with their
hyperthreads) for every thread of its process; threads and processes it starts later inherit
them. Linux only: a replica elsewhere, without a whole GPU, or short of cores is left where the
kernel puts it, and says why.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

SYSFS = Path("/sys/devices/system/cpu")


def siblings(cpu: int, sysfs: Path = SYSFS) -> str:
    """The CPUs sharing `cpu`'s physical core, as Linux lists them ("5,21"); a CPU whose topology
    the system does not tell is a core of its own."""
    try:
        return (sysfs / f"cpu{cpu}" / "topology" / "thread_siblings_list").read_text().strip()
    except OSError:
        return str(cpu)


def physical_cores(allowed: set[int], sysfs: Path = SYSFS) -> list[list[int]]:
    """`allowed` CPUs grouped by physical core (hyperthreads together), in CPU order."""
    cores: dict[str, list[int]] = {}
    for cpu in sorted(allowed):
        cores.setdefault(siblings(cpu, sysfs), []).append(cpu)
    return sorted(cores.values())


def cpus_for(cores: list[list[int]], slot: int, slots: int) -> list[int]:
    """The CPUs of run `slot` of `slots` equal runs of `cores` (the first runs take a core more
    where they do not divide)."""
    if not 0 <= slot < slots <= len(cores):
        raise ValueError(f"run {slot} of {slots} of {len(cores)} cores")
    per, extra = divmod(len(cores), slots)
    start = slot * per + min(slot, extra)
    return sorted(cpu for core in cores[start:start + per + (slot < extra)] for cpu in core)


def pin_process(cpus: list[int]) -> None:
    """Every thread of this process onto `cpus` (a thread started later inherits its creator's)."""
    for task in Path("/proc/self/task").iterdir():
        try:
            os.sched_setaffinity(int(task.name), cpus)
        except (OSError, ValueError):  # the thread ended meanwhile
            continue


def pin_replica(gpus_per_replica: float) -> tuple[list[int] | None, str]:
    """Pin this Ray actor's process by the GPU Ray gave it: (its CPUs, "") or (None, why not)."""
    if not hasattr(os, "sched_setaffinity"):
        return None, f"pinning threads to CPUs needs Linux (this is {sys.platform})"
    if gpus_per_replica < 1 or gpus_per_replica != int(gpus_per_replica):
        return None, f"replicas share GPUs (gpus_per_replica = {gpus_per_replica}): no GPU tells them apart"
    import ray

    gpus = sorted(int(g) for g in ray.get_gpu_ids())
    if not gpus:
        return None, "the replica holds no GPU to place its cores by"
    node = ray.get_runtime_context().get_node_id()
    total = next((n["Resources"].get("GPU", 0.0) for n in ray.nodes() if n["NodeID"] == node), 0.0)
    slots, slot = int(total // gpus_per_replica), int(gpus[0] // gpus_per_replica)
    cores = physical_cores(os.sched_getaffinity(0))
    if not 0 <= slot < slots <= len(cores):
        return None, f"{len(cores)} physical cores for {slots} replicas on this node"
    cpus = cpus_for(cores, slot, slots)
    pin_process(cpus)
    return cpus, ""

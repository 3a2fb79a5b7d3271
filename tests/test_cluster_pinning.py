"""`[cluster] pin_cpus`: the cores a replica takes, from the system's topology, and its threads
moved onto them (`cluster.pinning`). Ray's part is `test_cluster.py`'s."""

from __future__ import annotations

import os
import subprocess
import sys
from typing import TYPE_CHECKING

import pytest

from scheduler.serving.cluster.pinning import cpus_for, physical_cores, pin_replica

if TYPE_CHECKING:
    from pathlib import Path


def _topology(root: Path, siblings: dict[int, str]) -> Path:
    for cpu, listed in siblings.items():
        (root / f"cpu{cpu}" / "topology").mkdir(parents=True)
        (root / f"cpu{cpu}" / "topology" / "thread_siblings_list").write_text(listed + "\n")
    return root


def test_cpus_group_by_physical_core_and_replicas_take_equal_runs(tmp_path: Path) -> None:
    # Eight CPUs, four cores, hyperthreads numbered as Linux does on x86 (cpu n and n + 4).
    sysfs = _topology(tmp_path, {n: f"{n % 4},{n % 4 + 4}" for n in range(8)})
    cores = physical_cores(set(range(8)), sysfs)
    assert cores == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert [cpus_for(cores, g, 2) for g in range(2)] == [[0, 1, 4, 5], [2, 3, 6, 7]]  # no core shared
    assert [cpus_for(cores, g, 3) for g in range(3)] == [[0, 1, 4, 5], [2, 6], [3, 7]]
    # Only the CPUs this process may use count; one the system says nothing of is a core alone.
    assert physical_cores({1, 5, 9}, sysfs) == [[1, 5], [9]]
    with pytest.raises(ValueError, match="run 4 of 4 of 4 cores"):
        cpus_for(cores, 4, 4)
    with pytest.raises(ValueError, match="of 5 of 4 cores"):
        cpus_for(cores, 0, 5)


def test_replicas_that_share_a_gpu_are_not_pinned_and_say_why() -> None:
    cpus, why = pin_replica(0.5)
    assert cpus is None and "replicas share GPUs (gpus_per_replica = 0.5)" in why


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="CPU affinity is Linux's")
def test_every_thread_of_the_process_moves_and_later_ones_inherit() -> None:
    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("one usable CPU: every thread is on it already")
    code = """
import os, threading
from pathlib import Path
from scheduler.serving.cluster.pinning import pin_process
wait = threading.Event()
early = threading.Thread(target=wait.wait); early.start()
cpu = min(os.sched_getaffinity(0))
pin_process([cpu])
seen = {}
late = threading.Thread(target=lambda: seen.update(late=os.sched_getaffinity(0))); late.start(); late.join()
tasks = {int(t.name): os.sched_getaffinity(int(t.name)) for t in Path("/proc/self/task").iterdir()}
wait.set(); early.join()
assert all(a == {cpu} for a in tasks.values()) and len(tasks) >= 2, tasks
assert seen["late"] == {cpu}, seen
print("pinned", cpu, len(tasks))
"""
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("pinned")

"""CUDA runtime and driver calls made while a block runs, counted with PyTorch's profiler (CUPTI).

MLX's CUDA backend allocates through its own buffer cache, and a miss costs a `cudaMallocAsync`
(device buffers) or a `cudaMallocManaged` (arrays made on the host); the cache evicts, when full,
with `cudaFreeAsync` or `cudaFree`, which for managed memory waits for the device. So the calls
a step makes say whether its time is launches, allocations or waits. Needs PyTorch beside MLX's
CUDA build (the device machines' image has it).

    with api_calls() as calls:
        run()
    calls.per(steps)  # {"cudaFree": (calls a step, ms a step), ...}
"""

from __future__ import annotations

import json
import tempfile
from collections import defaultdict
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from collections.abc import Iterator

WATCHED = ("cudaLaunchKernelExC", "cuLaunchKernelEx", "cudaLaunchKernel", "cudaMallocAsync", "cudaFreeAsync",
           "cudaMallocManaged", "cudaFree", "cudaEventSynchronize", "cudaStreamSynchronize",
           "cudaDeviceSynchronize", "cudaMemcpy", "cudaMemcpyAsync")


class Calls:
    def __init__(self) -> None:
        self.count: dict[str, int] = defaultdict(int)
        self.us: dict[str, float] = defaultdict(float)

    def per(self, steps: int) -> dict[str, tuple[float, float]]:
        steps = max(steps, 1)
        return {n: (self.count[n] / steps, self.us[n] / 1e3 / steps) for n in WATCHED if self.count.get(n)}


def trace_events(prof: Any) -> list[dict[str, Any]]:
    """The events of a finished PyTorch profile, as its Chrome trace holds them."""
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "trace.json"
        prof.export_chrome_trace(str(path))
        events: list[dict[str, Any]] = json.loads(path.read_text())["traceEvents"]
    return events


@contextmanager
def api_calls() -> Iterator[Calls]:
    from torch.profiler import ProfilerActivity, profile  # the device image's PyTorch

    calls = Calls()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        yield calls
    for e in trace_events(prof):
        if e.get("cat") in ("cuda_runtime", "cuda_driver"):
            calls.count[e["name"]] += 1
            calls.us[e["name"]] += e.get("dur", 0.0)

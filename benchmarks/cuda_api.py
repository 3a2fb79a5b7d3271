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


SITE_CALLS = ("cudaMallocManaged", "cudaFree", "cudaMemcpy", "cudaMallocAsync", "cudaFreeAsync",
              "cudaEventSynchronize", "cudaStreamSynchronize")
"""The calls `call_sites` places: where memory comes and goes, and where the host waits."""


def call_sites(events: list[dict[str, Any]], frames: int = 3) -> list[tuple[str, float, float, str]]:
    """Each runtime call of `SITE_CALLS` in a profile taken with `with_stack=True`, as (name,
    start us, duration us, site): the innermost `frames` Python frames around it, innermost first
    (Python's frames nest, so one sweep a thread finds them)."""
    spans: dict[Any, list[tuple[float, float, str]]] = defaultdict(list)
    calls: dict[Any, list[dict[str, Any]]] = defaultdict(list)
    for e in events:
        if e.get("cat") == "python_function" and "dur" in e:
            spans[e.get("tid")].append((e["ts"], e["ts"] + e["dur"], _frame(e.get("name", "?"))))
        elif e.get("cat") in ("cuda_runtime", "cuda_driver") and e.get("name") in SITE_CALLS:
            calls[e.get("tid")].append(e)
    out: list[tuple[str, float, float, str]] = []
    for tid, mine in calls.items():
        opened = sorted(spans.get(tid, []), key=lambda s: (s[0], -s[1]))
        stack: list[tuple[float, float, str]] = []
        i = 0
        for e in sorted(mine, key=lambda c: c["ts"]):
            ts = e["ts"]
            while i < len(opened) and opened[i][0] <= ts:
                while stack and stack[-1][1] < opened[i][0]:
                    stack.pop()
                stack.append(opened[i])
                i += 1
            while stack and stack[-1][1] < ts:
                stack.pop()
            site = " < ".join(s[2] for s in reversed(stack[-frames:])) or "(no Python frame)"
            out.append((e["name"], ts, e.get("dur", 0.0), site))
    return out


def _frame(name: str) -> str:
    """`.../mlx_lm/models/cache.py(941): prepare` as `cache.py:941 prepare`."""
    where, _, func = name.partition(": ")
    path, _, line = where.rstrip(")").partition("(")
    return f"{path.rsplit('/', 1)[-1]}:{line} {func}" if func else name

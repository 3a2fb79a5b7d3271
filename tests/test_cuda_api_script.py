"""`benchmarks/cuda_api.py`: each CUDA call placed in the Python frames around it, from a profile's
Chrome trace (the frames and the calls as PyTorch's profiler records them, per thread)."""

from __future__ import annotations

from pathlib import Path

from tests.scripts import load_script

SCRIPT = Path(__file__).resolve().parent.parent / "benchmarks" / "cuda_api.py"


def frame(name: str, ts: float, dur: float, tid: int = 1) -> dict[str, object]:
    return {"cat": "python_function", "name": name, "ts": ts, "dur": dur, "tid": tid}


def call(name: str, ts: float, tid: int = 1) -> dict[str, object]:
    return {"cat": "cuda_runtime", "name": name, "ts": ts, "dur": 2.0, "tid": tid}


def test_each_call_is_placed_in_its_innermost_frames_on_its_own_thread() -> None:
    api = load_script(SCRIPT, "cuda_api_script")
    events = [
        frame("/w/src/workers/batching/engine.py(10): step", 0, 100),
        frame("/w/src/workers/batching/hostpad.py(98): _set_padding", 20, 10),
        frame("/w/src/workers/batching/hostpad.py(102): filter", 15, 30),
        frame("/w/src/workers/batching/prefill.py(88): _prepared", 60, 20),
        call("cudaMallocManaged", 25),  # inside _set_padding, inside filter, inside step
        call("cudaMallocManaged", 70),  # inside _prepared: filter had ended
        call("cudaFree", 50),  # between the two: only step around it
        call("cudaFree", 25, tid=2),  # another thread (MLX's own) has no Python frame
        call("cudaLaunchKernel", 26),  # not one of the calls placed
    ]
    placed = sorted((name, ts, site) for name, ts, _, site in api.call_sites(events))
    assert placed == [
        ("cudaFree", 25, "(no Python frame)"),
        ("cudaFree", 50, "engine.py:10 step"),
        ("cudaMallocManaged", 25, "hostpad.py:98 _set_padding < hostpad.py:102 filter < engine.py:10 step"),
        ("cudaMallocManaged", 70, "prefill.py:88 _prepared < engine.py:10 step"),
    ]
    inner = api.call_sites(events, frames=1)
    assert {site for name, ts, _, site in inner if ts == 25 and name == "cudaMallocManaged"} == {"hostpad.py:98 _set_padding"}

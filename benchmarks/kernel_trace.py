"""What the device runs in a step, kernel by kernel: our engine's closed loop under a CUDA trace.

On a GPU a step that carries a bounded prefill chunk lasts about three decode steps, where the
chunk's arithmetic is a fraction of one (docs/stalls.md). This says where that time is: the
engine runs the closed loop of `prefill_phases.py` (`--concurrency` rows, prompts of
`--prompt-min`..`--prompt-max` tokens, `--max-tokens` greedy tokens each) for each variant (a
budget: `0`, `512`; with `prefill_phases.py`'s flags, e.g. `:nofuse` for a chunk in a pass of
its own), and after `--warmup` steps traces `--steps` steps with PyTorch's profiler (CUPTI),
which records every kernel, copy and set launched in the process, MLX's among them. Each kernel is charged to the step that launched
it (CUPTI's correlation of a launch to its kernel), so a step's device time is the work it
queued, wherever it ran. Per variant, split into steps that decode only, steps whose plan
prefills, and the steps after those, whose decode pass carries the chunk the plan left
(`carrying`):

- wall ms a step, the device's busy ms a step (kernels + copies + sets) and kernels a step;
- the device's busy share of the traced wall time (near 1: the device is the limit; low: the
  host, launching);
- the kernels that take the most device time a step, by name;
- in the JSON (`sequence`), the kernels of the class's median step in the order they were
  launched: a step's graph runs layer by layer, so each layer's pattern shows.

With `--api-sites`, also each step's CUDA allocations, frees, copies and waits (`cudaMallocAsync`,
`cudaMallocManaged`, `cudaFree`, ...) and the Python frames around each one in unified memory,
whose `cudaFree` waits for the whole device; `--cache-gb` bounds MLX's buffer cache as the
scheduler does (MLX's own limit is most of the device, which a short trace never fills).

Needs CUDA and PyTorch in the same environment as MLX's CUDA build (the device machines' image
has it); writes the table and JSON (`--out`), and with `--trace DIR` each variant's Chrome trace.

    python benchmarks/kernel_trace.py --model synthetic:qwen2.5-0.5b --variants 0 512 --concurrency 64
    python benchmarks/kernel_trace.py --variants 512 512:perlayer --api-sites --cache-gb 8
    python benchmarks/kernel_trace.py --model synthetic:llama-3.2-1b --variants 512 512:apart --launches

(Variants as `prefill_phases.py` takes them: `:apart` moves each layer's positions on its own,
`:padjoin` joins rows as mlx-lm does.)
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

# First: OpenBLAS (workers/blas.py) binds only if it is loaded before MLX.
import workers  # noqa: F401

# isort: split
import mlx.core as mx

from workers.cuda import apply_cuda_defaults
from workers.loading.models import load_model

sys.path.insert(0, str(Path(__file__).resolve().parent))
from cuda_api import SITE_CALLS, call_sites, trace_events  # noqa: E402  (scripts beside this one)
from prefill_phases import admitter, engine_for  # noqa: E402

DEVICE_KINDS = ("kernel", "gpu_memcpy", "gpu_memset")
LAUNCH_KINDS = ("cuda_runtime", "cuda_driver")


def traced_loop(model: Any, args: argparse.Namespace, variant: str, trace_dir: Path | None) -> dict[str, Any]:
    import torch  # the device image's; imported late so --help works without it
    from torch.profiler import ProfilerActivity, profile, record_function

    engine = engine_for(model, args, variant)
    admit = admitter(args)

    engine.insert([admit() for _ in range(args.concurrency)])
    for _ in range(args.warmup):
        result = engine.step()
        if result.finished:
            engine.insert([admit() for _ in result.finished])
    mx.synchronize()
    memory = {"cache_mb": mx.get_cache_memory() / 2**20, "active_mb": mx.get_active_memory() / 2**20}
    steps: list[dict[str, Any]] = []
    torch.cuda.init()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], with_stack=args.api_sites) as prof:
        start = time.perf_counter()
        for i in range(args.steps):
            with record_function(f"engine_step_{i}"):
                t0 = time.perf_counter()
                result = engine.step()
                steps.append({"wall_ms": (time.perf_counter() - t0) * 1e3, "tokens": len(result.tokens),
                              "prefill_tokens": result.prefill_tokens})
            if result.finished:
                engine.insert([admit() for _ in result.finished])
        mx.synchronize()
        wall = time.perf_counter() - start
    engine.close()
    events = trace_events(prof)
    if trace_dir is not None:
        trace_dir.mkdir(parents=True, exist_ok=True)
        name = variant.replace(":", "_")
        with gzip.open(trace_dir / f"trace-{name}.json.gz", "wt") as f:
            json.dump(events, f)
    out = charge(events, steps, wall, args.top)
    out["memory_after_warmup"] = memory
    if args.api_sites:
        out["api"] = by_site(events, steps, args.top)
    return out


def by_site(events: list[dict[str, Any]], steps: list[dict[str, Any]], top: int) -> dict[str, Any]:
    """Per class of step: each of `SITE_CALLS` a step (calls, ms) and, for those that allocate
    unified memory, copy or free it, the Python sites that made them (calls a step)."""
    windows = _windows(events)
    out: dict[str, Any] = {}
    for cls, idx in step_classes(steps).items():
        n, members = len(idx), set(idx)
        if not n:
            continue
        calls: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0])
        sites: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
        for name, ts, dur, site in call_sites(events):
            step = _window(windows, ts)
            if step is None or step not in members:
                continue
            calls[name][0] += 1 / n
            calls[name][1] += dur / 1e3 / n
            if name in ("cudaMallocManaged", "cudaFree", "cudaMemcpy"):
                sites[name][site] += 1 / n
        out[cls] = {"calls": {k: calls[k] for k in SITE_CALLS if k in calls},
                    "sites": {k: sorted(v.items(), key=lambda x: -x[1])[:top] for k, v in sites.items()}}
    return out


def charge(events: list[dict[str, Any]], steps: list[dict[str, Any]], wall: float, top: int) -> dict[str, Any]:
    """Charges each device event to the step whose host range holds its launch."""
    windows = _windows(events)
    launch_step: dict[int, int] = {}
    for e in events:
        if e.get("cat") in LAUNCH_KINDS and "correlation" in e.get("args", {}):
            step = _window(windows, e["ts"])
            if step is not None:
                launch_step[e["args"]["correlation"]] = step
    device = [e for e in events if e.get("cat") in DEVICE_KINDS and "dur" in e]
    per_step_busy: dict[int, float] = defaultdict(float)
    per_step_kernels: dict[int, int] = defaultdict(int)
    per_step_names: dict[int, dict[str, float]] = defaultdict(lambda: defaultdict(float))
    per_step_launches: dict[int, dict[str, int]] = defaultdict(lambda: defaultdict(int))
    per_step_order: dict[int, list[tuple[int, str]]] = defaultdict(list)
    uncharged = 0
    for e in device:
        step = launch_step.get(e.get("args", {}).get("correlation", -1))
        if step is None:
            step = _window(windows, e["ts"])  # no launch record: charge it where it ran
            uncharged += 1
        if step is None:
            continue
        per_step_busy[step] += e["dur"] / 1e3
        per_step_kernels[step] += 1
        per_step_names[step][_short(e)] += e["dur"] / 1e3
        per_step_launches[step][_short(e)] += 1
        per_step_order[step].append((e.get("args", {}).get("correlation", 0), _short(e)))
    busy_total = sum(e["dur"] for e in device) / 1e6
    out: dict[str, Any] = {"wall_s": wall, "steps": len(steps), "device_busy_share": busy_total / wall,
                           "device_events": len(device), "charged_by_time": uncharged, "classes": {}}
    for cls, idx in step_classes(steps).items():
        if not idx:
            continue
        out["classes"][cls] = {
            "steps": len(idx),
            "wall_ms": statistics.median(steps[i]["wall_ms"] for i in idx),
            "busy_ms": statistics.median(per_step_busy[i] for i in idx),
            "kernels": statistics.median(per_step_kernels[i] for i in idx),
            "prefill_tokens": statistics.mean(steps[i]["prefill_tokens"] for i in idx),
            "top": means(per_step_names, idx, top),
            "most_launched": means(per_step_launches, idx, top),
            "sequence": sequence(per_step_order, per_step_kernels, idx),
        }
    out["around"] = around(steps, per_step_busy, per_step_kernels, per_step_names, top)
    return out


def step_classes(steps: list[dict[str, Any]]) -> dict[str, list[int]]:
    """The steps' indices by class: "prefilling" (a plan's prompt tokens were counted in it),
    "carrying" (the step after one, whose decode pass runs the chunk the plan left, unless it
    prefills itself) and "decode only" (the rest)."""
    after = {i + 1 for i, s in enumerate(steps) if s["prefill_tokens"] > 0}
    out: dict[str, list[int]] = {"decode only": [], "prefilling": [], "carrying": []}
    for i, s in enumerate(steps):
        cls = "prefilling" if s["prefill_tokens"] > 0 else "carrying" if i in after else "decode only"
        out[cls].append(i)
    return out


def means(per_step: dict[int, dict[str, Any]], idx: list[int], top: int) -> list[list[Any]]:
    """The `top` names by their mean over the steps `idx` of a per-step figure (device ms,
    launches), largest first."""
    total: dict[str, float] = defaultdict(float)
    for i in idx:
        for n, x in per_step[i].items():
            total[n] += x / len(idx)
    return sorted(([n, x] for n, x in total.items()), key=lambda p: -p[1])[:top]


def sequence(order: dict[int, list[tuple[int, str]]], kernels: dict[int, int], idx: list[int]) -> list[str]:
    """The kernels of the step among `idx` with the median count, in the order they were launched
    (a step's graph runs layer by layer, so each layer's pattern shows)."""
    median = sorted(idx, key=lambda i: kernels[i])[len(idx) // 2]
    return [name for _, name in sorted(order[median])]


def around(steps: list[dict[str, Any]], busy: dict[int, float], kernels: dict[int, int],
           names: dict[int, dict[str, float]], top: int, after: int = 4) -> list[dict[str, Any]]:
    """The steps from each prefilling one to `after` steps later (medians over the prefilling
    steps; each offset's kernels that took the most device time, means): with a pipelined decode
    a step's wall time holds its wait for the step before, and a chunk carried by a decode pass
    is the next step's work, so a stall spreads over a few steps."""
    starts = [i for i, s in enumerate(steps) if s["prefill_tokens"] > 0 and i + after < len(steps)]
    rows = []
    for k in range(after + 1):
        if not starts:
            break
        rows.append({"offset": k,
                     "wall_ms": statistics.median(steps[i + k]["wall_ms"] for i in starts),
                     "busy_ms": statistics.median(busy[i + k] for i in starts),
                     "kernels": statistics.median(kernels[i + k] for i in starts),
                     "prefill_tokens": statistics.median(steps[i + k]["prefill_tokens"] for i in starts),
                     "top": means(names, [i + k for i in starts], top)})
    return rows


def _windows(events: list[dict[str, Any]]) -> list[tuple[float, float, int]]:
    """Each traced step's host range (start us, end us, step)."""
    return sorted((e["ts"], e["ts"] + e["dur"], int(e["name"].rsplit("_", 1)[1]))
                  for e in events if e.get("cat") == "user_annotation" and e.get("name", "").startswith("engine_step_"))


def _window(windows: list[tuple[float, float, int]], ts: float) -> int | None:
    lo, hi = 0, len(windows)
    while lo < hi:  # the last window starting at or before ts
        mid = (lo + hi) // 2
        if windows[mid][0] <= ts:
            lo = mid + 1
        else:
            hi = mid
    if lo and windows[lo - 1][0] <= ts <= windows[lo - 1][1]:
        return windows[lo - 1][2]
    return None


def _short(e: dict[str, Any]) -> str:
    name = e.get("name", "?")
    if e.get("cat") != "kernel":
        return f"[{e.get('cat')}] {name}"[:70]
    return name.split("(")[0].replace("void ", "")[:70]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="synthetic:qwen2.5-0.5b")
    ap.add_argument("--variants", nargs="+", default=["0", "512"])
    ap.add_argument("--concurrency", type=int, default=64)
    ap.add_argument("--prompt-min", type=int, default=64)
    ap.add_argument("--prompt-max", type=int, default=512)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--prefill-batch", type=int, default=8)
    ap.add_argument("--prefill-step", type=int, default=512)
    ap.add_argument("--warmup", type=int, default=150)
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--top", type=int, default=12)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--api-sites", action="store_true",
                    help="also count MLX's allocations, frees, copies and waits a step, with the Python sites "
                         "of the unified-memory ones (the profiler records Python's frames: slower still)")
    ap.add_argument("--launches", action="store_true", help="also print the kernels launched most often a step")
    ap.add_argument("--cache-gb", type=float, default=None,
                    help="MLX's buffer cache limit (default: MLX's own; the scheduler bounds it, workers.factory)")
    ap.add_argument("--trace", help="a folder for each variant's Chrome trace (gzipped)")
    ap.add_argument("--out", default="benchmarks/results/kernel_trace.json")
    args = ap.parse_args()
    if not mx.is_available(mx.gpu) or mx.default_device().type != mx.DeviceType.gpu:
        raise SystemExit("kernel_trace.py traces CUDA kernels: it needs MLX's CUDA build on a GPU")
    apply_cuda_defaults()
    if args.cache_gb is not None:
        mx.set_cache_limit(int(args.cache_gb * 2**30))
    model, _ = load_model(args.model)
    args.vocab = min(2000, int(model.args.vocab_size))
    results = {}
    for variant in args.variants:
        results[variant] = traced_loop(model, args, variant, Path(args.trace) if args.trace else None)
    print(f"\n{args.model} on {mx.device_info().get('device_name')}, {args.concurrency} rows, prompts "
          f"{args.prompt_min}-{args.prompt_max}, {args.max_tokens} tokens, {args.steps} traced steps after "
          f"{args.warmup}; load {os.getloadavg()[0]:.2f}")
    for variant, r in results.items():
        print(f"\n== {variant}: device busy {r['device_busy_share']:.2f} of {r['wall_s'] * 1e3:.0f} ms traced, "
              f"{r['device_events']} device events ({r['charged_by_time']} charged by time)")
        for cls, c in r["classes"].items():
            print(f"  {cls}: {c['steps']} steps, wall {c['wall_ms']:.2f} ms, device busy {c['busy_ms']:.2f} ms, "
                  f"{c['kernels']:.0f} kernels, {c['prefill_tokens']:.0f} prompt tokens a step (medians)")
            for name, ms in c["top"]:
                print(f"      {ms:7.3f} ms  {name}")
            if args.launches:
                print("    most launched, a step:")
                for name, k in c["most_launched"]:
                    print(f"      {k:7.1f}  {name}")
            api = r.get("api", {}).get(cls)
            if api:
                print("    calls a step: " + ", ".join(f"{k} {v[0]:.1f} ({v[1]:.2f} ms)" for k, v in api["calls"].items()))
                for name, sites in api["sites"].items():
                    print(f"    {name} by site, a step:")
                    for site, count in sites:
                        print(f"      {count:6.1f}  {site}")
        if r.get("around"):
            print("  from a prefilling step on (medians over them): " + "; ".join(
                f"+{a['offset']}: wall {a['wall_ms']:.1f}, busy {a['busy_ms']:.1f} ms, {a['kernels']:.0f} kernels"
                for a in r["around"]))
            print("    the step after it, its kernels that took the most device time (means):")
            for name, ms in r["around"][1]["top"] if len(r["around"]) > 1 else []:
                print(f"      {ms:7.3f} ms  {name}")
        print(f"  after warm-up: MLX's cache {r['memory_after_warmup']['cache_mb']:.0f} MiB, "
              f"active {r['memory_after_warmup']['active_mb']:.0f} MiB")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"args": vars(args), "results": results, "load": os.getloadavg()[0],
                               "device": mx.device_info().get("device_name"), "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())},
                              indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()

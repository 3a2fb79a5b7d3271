"""Where the host's time per step goes: the bare `BatchGenerator` loop against the scheduler, by phase.

Same model, prompts and concurrency on both sides (a closed loop, as `overhead.py`), each side run
with clocks around its phases, interleaved and repeated; every figure is a median over repeats of
the per-step mean (ms per decode step):

worker thread (both sides)
- forward graph: building the model's graph (`model(...)`): Python, under the GIL;
- async_eval: handing the step to MLX (on CUDA: encoding and launching its kernels); its "off
  CPU" part is the wall time the thread was not running in it (waiting for the GIL on the way
  back, or for the device);
- device wait: `mx.eval`, waiting for the previous step's results;
- sampling + rows: the rest of `BatchGenerator.next` (sampler graph, `tolist`, responses);
- engine: ours around `BatchGenerator.next` (budget, request ids, step result);
- post + commands: building the step's message, waking the event loop, taking commands (the
  worker's CPU time between two steps); lines of their own follow for parts of it: taking
  commands (the engine's inserts and removals among it), handing a step over (its post to the
  loop, then after a first token the wait for the loop's delivery, CPU and wall), the CPU of
  every post to the loop (one from inside a step included);
- between steps, off CPU: the wall time between two steps the worker was not running (waiting
  for the GIL, or for the loop's handoff after a first token);
- GIL wait: wall minus CPU time of the Python-only phases (forward graph, sampling, engine).

event loop (ours)
- handoff: from the end of a step to the loop applying it (message, wake-up, queue);
- detokenize, stop strings, other on_step: the admission actor's per-row work;
- delivery: chunks to each request's channel;
- other loop CPU: asyncio/anyio wake-ups of the actor and the callers, and the callers' code.

The clocks cost both sides alike (a few µs a phase), so tok/s here are below `overhead.py`'s.

    python benchmarks/host_cost.py --model synthetic:tiny --concurrency 1
    python benchmarks/host_cost.py --model synthetic:llama-3.2-1b --concurrency 64   # on a GPU

Prints a table per concurrency and writes JSON (`--out`). `--py-spy PATH` also runs the
scheduler side once more at each concurrency (after its table is printed and written), sampled
by py-spy from its first timed request on (native frames included; the sampling slows it, so
that run counts in no figure), into `<out>-py-spy-<N>.txt`, and prints where the worker
thread's samples between two decode steps went (`benchmarks/stacks.py` reads the file further).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import os
import platform
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path
from typing import TYPE_CHECKING, Any

import anyio

sys.path.insert(0, str(Path(__file__).resolve().parent))
from cuda_api import api_calls  # noqa: E402
from overhead import bare_loop, engine_loop, load_served, make_prompts, scheduler_run  # noqa: E402
from stacks import recorded, report  # noqa: E402

if TYPE_CHECKING:
    from collections.abc import Callable

BETWEEN_STEPS = ("next (mlx_lm", "next_alone (")
"""Frames of a decode step: the worker's stacks without them are its time between two steps."""

WORKER = ["forward graph", "async_eval", "async_eval, off CPU", "device wait", "sampling + rows", "engine", "post + commands",
          "commands, CPU", "insert, CPU", "remove, CPU", "hand over, CPU", "hand over, wall", "post, CPU",
          "between steps, off CPU", "GIL wait"]
LOOP = ["handoff", "detokenize", "stop strings", "other on_step", "admission take", "pool", "delivery",
        "other loop CPU"]


class Clocks:
    """Wall and CPU seconds per phase, summed; `steps` decode steps were counted. The worker's
    MLX phases count only inside a step of the generator (`inside`), the rest of its evals being
    the engine's."""

    def __init__(self) -> None:
        self.inside = False
        self.wall: dict[str, float] = defaultdict(float)
        self.cpu: dict[str, float] = defaultdict(float)
        self.steps = 0
        self.loop_cpu = 0.0
        self.last: tuple[float, float] | None = None
        """Wall and CPU clocks at the end of the last step."""

    def per_step(self) -> dict[str, float]:
        """ms per step of each phase (the derived ones included)."""
        s, w, c = max(1, self.steps), self.wall, self.cpu
        engine = w["step"] - w["next"] if w["step"] else 0.0  # 0: the bare loop has no engine
        engine_cpu = c["step"] - c["next"] if c["step"] else 0.0
        python = ("forward graph", "sampling + rows", "engine")
        out = {
            "forward graph": w["forward"],
            "async_eval": w["async_eval"],
            # MLX encodes and launches on this thread's CPU; what is left is waiting: for the GIL
            # on the way back (MLX lets it go while it works) or for the device (a free that syncs).
            "async_eval, off CPU": max(0.0, w["async_eval"] - c["async_eval"]),
            "device wait": w["eval"],
            "sampling + rows": w["next"] - w["forward"] - w["async_eval"] - w["eval"],
            "engine": engine,
            "post + commands": c["gap"] - engine_cpu,
            # CPU time of the engine's inserts and removals and of the worker's posts to the loop,
            # mostly within "post + commands" (a post from inside a step is not): on CUDA their MLX
            # calls may cost far more than their Python.
            "commands, CPU": c["intake"],
            "hand over, CPU": c["handover"],
            "hand over, wall": w["handover"],
            "insert, CPU": c["insert"],
            "remove, CPU": c["remove"],
            "post, CPU": c["post"],
            "handoff": w["handoff"],
            "detokenize": w["text"] - w["stop"],
            "stop strings": w["stop"],
            "other on_step": w["on_step"] - w["text"],
            "admission take": w["take"],
            "pool": w["pool"],
            "delivery": w["apply"],
        }
        cpu = {"forward graph": c["forward"], "sampling + rows": c["next"] - c["forward"] - c["async_eval"]
               - c["eval"], "engine": c["step"] - c["next"] if c["step"] else 0.0}
        out["GIL wait"] = max(0.0, sum(out[k] for k in python) - sum(cpu.values()))
        # Between two steps: wall time the worker spent off the CPU (waiting for the GIL, or for
        # the event loop's handoff after a first token).
        out["between steps, off CPU"] = max(0.0, (w["gap"] - engine) - (c["gap"] - engine_cpu))
        if self.loop_cpu:
            out["other loop CPU"] = max(0.0, self.loop_cpu - w["on_step"] - w["take"] - w["pool"] - w["apply"])
        return {k: 1e3 * v / s for k, v in out.items()}


CLOCKS: Clocks | None = None
"""The side being measured; None: the clocks are off."""


def timed(name: str, fn: Any, inside: bool = False) -> Any:
    """`fn` with its wall and CPU time added to CLOCKS[name] (`inside`: only within
    `BatchGenerator.next`)."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        clocks = CLOCKS
        if clocks is None or (inside and not clocks.inside):
            return fn(*args, **kwargs)
        t, c = time.perf_counter(), time.thread_time()
        try:
            return fn(*args, **kwargs)
        finally:
            clocks.wall[name] += time.perf_counter() - t
            clocks.cpu[name] += time.thread_time() - c

    return wrapper


def install(model: Any) -> None:
    """Clocks around each phase: patched classes and functions, for this process only."""
    import mlx.core as mx
    from mlx_lm.generate import BatchGenerator

    import kvpool.pool as pool
    import scheduler.admission.actor as actor
    import scheduler.admission.core as core
    import scheduler.streaming.detokenize as detok
    import workers.batching.engine as engine
    import workers.worker as worker
    from workers.batching.prefill import JoiningBatch

    cls = type(model)
    cls.__call__ = timed("forward", cls.__call__, inside=True)
    mx.async_eval = timed("async_eval", mx.async_eval, inside=True)
    mx.eval = timed("eval", mx.eval, inside=True)
    engine.MLXEngine.step = timed("step", engine.MLXEngine.step)
    engine.MLXEngine.insert = timed("insert", engine.MLXEngine.insert)
    engine.MLXEngine.remove = timed("remove", engine.MLXEngine.remove)
    worker.GPUWorker._post = timed("post", worker.GPUWorker._post)
    worker.GPUWorker._intake = timed("intake", worker.GPUWorker._intake)
    worker.GPUWorker._hand_over = timed("handover", worker.GPUWorker._hand_over)
    core.AdmissionCore.on_step = timed("on_step", core.AdmissionCore.on_step)
    detok.TextStream.add = timed("text", detok.TextStream.add)
    detok.StopText.feed = timed("stop", detok.StopText.feed)
    actor.Admission._apply = timed("apply", actor.Admission._apply)
    core.AdmissionCore.take = timed("take", core.AdmissionCore.take)
    pool.apply_batch = timed("pool", pool.apply_batch)

    # Decode steps (a step that output tokens), and the worker's time between two: on the bare
    # side its loop's own Python, on ours the engine's and the worker's (message, commands). A
    # lone row's step (`JoiningBatch.next_alone`) is the generator's step taken without it.
    def counted(step: Any, outputs: Any) -> Any:
        def counted_step(self: Any) -> Any:
            clocks = CLOCKS
            if clocks is None:
                return step(self)
            t, c = time.perf_counter(), time.thread_time()
            if clocks.last is not None:
                clocks.wall["gap"] += t - clocks.last[0]
                clocks.cpu["gap"] += c - clocks.last[1]
            clocks.inside = True
            try:
                result = step(self)
            finally:
                clocks.inside = False
                end = time.perf_counter()
                clocks.last = (end, time.thread_time())
                clocks.wall["next"] += end - t
                clocks.cpu["next"] += clocks.last[1] - c
            if outputs(result):
                clocks.steps += 1
            return result

        return counted_step

    BatchGenerator.next = counted(BatchGenerator.next, lambda result: result[1])
    JoiningBatch.next_alone = counted(JoiningBatch.next_alone, bool)
    post = actor.Admission.post

    def handoff(self: Any, event: Any) -> None:
        clocks, end = CLOCKS, getattr(event, "t_end", None)
        if clocks is not None and end is not None:
            clocks.wall["handoff"] += time.perf_counter() - end
        post(self, event)

    actor.Admission.post = handoff


def bare_counted(model: Any, prompts: list[list[int]], n: int, max_tokens: int, w: Any) -> tuple[float, Clocks]:
    global CLOCKS
    clocks = CLOCKS = Clocks()
    try:
        tokens, seconds = bare_loop(model, prompts, n, max_tokens, w.prefill_batch, w.prefill_step)
    finally:
        CLOCKS = None
    return tokens / seconds, clocks


def engine_counted(model: Any, prompts: list[list[int]], n: int, max_tokens: int, w: Any,
                   vocab: int) -> tuple[float, Clocks]:
    """Our engine alone, stepped on this thread in the bare loop's closed loop: what the engine
    adds, apart from the threads and the event loop."""
    global CLOCKS
    clocks = CLOCKS = Clocks()
    try:
        tokens, seconds = engine_loop(model, vocab, prompts, n, max_tokens, w.prefill_batch,
                                      w.prefill_step, 0)
    finally:
        CLOCKS = None
    return tokens / seconds, clocks


def ours_counted(config: Any, prompts: list[list[int]], n: int, max_tokens: int, stream: bool,
                 also: Callable[[], None] | None = None) -> tuple[float, Clocks]:
    """The scheduler, its clocks started once it is up: on CUDA its start steps the engine
    (`warm_engine`) and then builds the tokenizer's codec on the worker thread, and counted,
    that startup came to 2-2.6 ms a step of "post + commands" and part of `async_eval`.
    `also` runs then too, on the event loop (before the first timed request)."""
    global CLOCKS
    clocks = Clocks()
    where: dict[str, float] = {}

    def start() -> None:
        global CLOCKS
        CLOCKS = clocks
        if also is not None:
            also()

    try:
        tokens, seconds, _ = anyio.run(scheduler_run, config, prompts, n, max_tokens, False, where, stream, start)
    finally:
        CLOCKS = None
    clocks.loop_cpu = where["loop_cpu_ms"] * where["steps"] / 1e3
    return tokens / seconds, clocks


def sampled_run(py_spy: str, path: Path, config: Any, prompts: list[list[int]], n: int, max_tokens: int,
                stream: bool) -> None:
    """One scheduler run sampled by py-spy from its first timed request to its end. Sampled from
    the process's start, a run on a fresh GPU host was mostly the model's load, the kernels'
    builds and the tokenizer's tables (2026-11-27)."""
    with contextlib.ExitStack() as stack:
        ours_counted(config, prompts, n, max_tokens, stream,
                     also=lambda: stack.enter_context(recorded(py_spy, path, settle=0.0)))


def median_phases(runs: list[dict[str, float]]) -> dict[str, float]:
    return {k: round(statistics.median(r.get(k, 0.0) for r in runs), 4) for k in WORKER + LOOP}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="synthetic:tiny")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1])
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--waves", type=int, default=2, help="requests per level = waves x concurrency")
    ap.add_argument("--repeat", type=int, default=3, help="interleaved runs per side; medians count")
    ap.add_argument("--stream", action="store_true", help="our clients stream with generate()")
    ap.add_argument("--switch-interval", type=float, default=None,
                    help="sys.setswitchinterval for the whole run (CPython's default: 0.005 s)")
    ap.add_argument("--cache-share", type=float, default=None,
                    help="the scheduler's bound on MLX's buffer cache, as a share of the model's memory "
                         "budget (workers.factory.BUFFER_CACHE_SHARE, 0.25); the bound is process-wide, "
                         "so every side after the first scheduler run has it")
    ap.add_argument("--cuda-api", action="store_true",
                    help="count each side's CUDA runtime calls a step (launches, allocations, frees, "
                         "waits) with PyTorch's profiler (cuda_api.py); needs PyTorch beside MLX")
    ap.add_argument("--py-spy", default="", metavar="PATH",
                    help="py-spy's path: sample one more run of the scheduler side at each concurrency")
    ap.add_argument("--out", default="benchmarks/results/host_cost.json")
    args = ap.parse_args()
    if args.switch_interval is not None:
        sys.setswitchinterval(args.switch_interval)

    import mlx.core as mx

    from metrics import configure_logging
    from scheduler import SchedulerConfig
    from workers.loading.models import model_info

    configure_logging(level="warning")
    if args.cache_share is not None:
        import workers.factory

        workers.factory.BUFFER_CACHE_SHARE = args.cache_share
    model, tokenizer = load_served(args.model)
    info = model_info(model, tokenizer, args.model)
    install(model)
    rows = []
    for n in args.concurrency:
        prompts = make_prompts(max(n * args.waves, 8), args.prompt_tokens, info.vocab_size, n)
        config = SchedulerConfig.from_toml(
            f'[model]\npath = "{args.model}"\n[worker]\nmax_batch = {n}\nstep_token_budget = 0\n'
            '[kvpool]\nmemory = "8GiB"\n'
        )
        w = config.worker
        warm = make_prompts(max(n, 8), args.prompt_tokens, info.vocab_size, n + 10**6)
        bare_loop(model, warm, n, args.max_tokens, w.prefill_batch, w.prefill_step)
        ours_counted(config, warm, n, args.max_tokens, args.stream)
        engine_counted(model, warm, n, args.max_tokens, w, info.vocab_size)
        bare: list[tuple[float, Clocks]] = []
        alone: list[tuple[float, Clocks]] = []
        ours: list[tuple[float, Clocks]] = []
        api: dict[str, list[dict[str, tuple[float, float]]]] = defaultdict(list)
        sides = (("bare", bare, functools.partial(bare_counted, model, prompts, n, args.max_tokens, w)),
                 ("engine", alone, functools.partial(engine_counted, model, prompts, n, args.max_tokens, w,
                                                     info.vocab_size)),
                 ("sched", ours, functools.partial(ours_counted, config, prompts, n, args.max_tokens, args.stream)))
        spy = Path(args.out).with_suffix("").as_posix() + f"-py-spy-{n}.txt"
        for _ in range(args.repeat):
            for side, runs, run in sides:
                if args.cuda_api:
                    with api_calls() as calls:
                        runs.append(run())
                    api[side].append(calls.per(runs[-1][1].steps))
                else:
                    runs.append(run())
        row = {
            "concurrency": n,
            "bare_tok_s": statistics.median(t for t, _ in bare),
            "engine_tok_s": statistics.median(t for t, _ in alone),
            "sched_tok_s": statistics.median(t for t, _ in ours),
            "bare": median_phases([c.per_step() for _, c in bare]),
            "engine": median_phases([c.per_step() for _, c in alone]),
            "sched": median_phases([c.per_step() for _, c in ours]),
            "sched_steps": statistics.median(c.steps for _, c in ours),
            "bare_steps": statistics.median(c.steps for _, c in bare),
            "engine_steps": statistics.median(c.steps for _, c in alone),
        }
        row["cache_limit_bytes"] = mx.set_cache_limit(0)
        mx.set_cache_limit(row["cache_limit_bytes"])
        if api:
            row["cuda_api"] = {side: {k: [statistics.median(r.get(k, (0.0, 0.0))[i] for r in rs) for i in (0, 1)]
                                      for k in {k for r in rs for k in r}} for side, rs in api.items()}
        row["ratio"] = row["sched_tok_s"] / row["bare_tok_s"]
        row["engine_ratio"] = row["engine_tok_s"] / row["bare_tok_s"]
        rows.append(row)
        print(f"\nconcurrency {n} (tok/s with the clocks on): bare {row['bare_tok_s']:.1f} "
              f"({row['bare_steps']:.0f} steps); engine alone {row['engine_tok_s']:.1f} "
              f"({row['engine_steps']:.0f} steps, {row['engine_ratio']:.3f}x); scheduler "
              f"{row['sched_tok_s']:.1f} ({row['sched_steps']:.0f} steps, {row['ratio']:.3f}x)")
        print(f"  {'ms per step':<20} {'bare':>8} {'engine':>8} {'scheduler':>10} {'sched - bare':>13}")
        for k in WORKER:
            b, e, o = row["bare"][k], row["engine"][k], row["sched"][k]
            print(f"  {k:<20} {b:>8.3f} {e:>8.3f} {o:>10.3f} {o - b:>+13.3f}")
        for k in LOOP:
            print(f"  loop: {k:<14} {'':>8} {'':>8} {row['sched'][k]:>10.3f}")
        print(f"  MLX buffer cache limit: {row['cache_limit_bytes'] / 2**30:.2f} GiB")
        if api:
            print(f"  CUDA calls a step (calls, ms)  {'bare':>16} {'engine':>16} {'scheduler':>16}")
            for k in sorted({k for side in row["cuda_api"].values() for k in side}):
                cells = [row["cuda_api"].get(side, {}).get(k, [0.0, 0.0]) for side in ("bare", "engine", "sched")]
                print(f"  {k:<30} " + " ".join(f"{c:>8.1f} {ms:>7.2f}" for c, ms in cells))
        save(args, rows)  # before the sampled run, which may be slow: native sampling of every thread
        if args.py_spy:  # a run of its own: sampling slows the process, so it counts in no median
            sampled_run(args.py_spy, Path(spy), config, prompts, n, args.max_tokens, args.stream)
            print(f"  py-spy, one more scheduler run ({spy}): the worker thread between two decode steps:")
            print("\n".join("    " + line for line in report(Path(spy), "mlx-worker", BETWEEN_STEPS)))
    print(f"\nwrote {args.out}")


def save(args: argparse.Namespace, rows: list[dict[str, Any]]) -> None:
    import mlx.core as mx

    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    meta = {
        "model": args.model, "prompt_tokens": args.prompt_tokens, "max_tokens": args.max_tokens,
        "waves": args.waves, "repeat": args.repeat, "stream": args.stream,
        "device": str(mx.default_device()), "mlx": mx.__version__, "python": sys.version.split()[0],
        "machine": platform.machine(), "date": time.strftime("%Y-%m-%d"),
        "load_avg": list(os.getloadavg()), "switch_interval": sys.getswitchinterval(),
    }
    out.write_text(json.dumps({"meta": meta, "rows": rows}, indent=2))


if __name__ == "__main__":
    main()

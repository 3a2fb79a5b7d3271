"""Stall-free admission: inter-token latency with the per-step prefill budget off and on.

Closed loop: `--concurrency` streams (prompt `--prompt-tokens`, output `--max-tokens`), each
starting a new request as soon as one ends, so new prompts are admitted all the time; plus an
open-loop run at `--load` x the measured closed-loop throughput. One run, side by side; a table,
JSON and a PNG of ITL over time.

    python benchmarks/stall.py [--model synthetic:small] [--concurrency 64]

`--variants` instead runs the closed loop for each budget setting side by side, `--repeat` times
in rotating order, with prompt lengths drawn from `--prompt-min`..`--prompt-max`, and prints the
medians with each one's ratios to budget 0. Flags after a colon change one thing each:
`:keepcache` makes MLX's `clear_cache` a no-op (mlx-lm clears the allocator cache after every
prefill chunk), `:queued` / `:blocking` set `[worker] prefill_chunks`, and `:mlxpad` uses mlx-lm's
own batch-cache filter, which waits for the device to read the rows' padding, `:gatherfilter`
copies the rows that stay by MLX's gather (as mlx-lm's filter) rather than by runs, `:rollpad`
right-pads every prefill pass and rolls its caches (as mlx-lm does), even a first one, `:perlayer`
makes each layer's cache its own arrays from host values (as mlx-lm does), `:apart` moves each
layer's positions on its own (as mlx-lm does, `hostpad.SHARE_POSITIONS`), `:padjoin` joins rows by
padding each side and concatenating (as mlx-lm does, `hostpad.JOIN_ONCE`), `:copyrows` copies the
decoding rows' arrays whenever rows join or leave (as mlx-lm does, `sparerows.ENABLED`), `:mlxattn` keeps MLX's
masked attention for padded decode rows on CUDA (`padded_attention.ENABLED`), `:mlxchunk` MLX's
own products for prompt chunks' attention (`padded_attention.GROUPED`), `:padded` runs a carried
chunk's padding through the projections and MLPs (`fused.RAGGED`), `:nogc` turns
Python's garbage collector off for the timed run (every run reports the collector's pauses);
`:key=value` sets any `[worker]` setting (`0:prefill_batch=4:prefill_pack=false`):

    python benchmarks/stall.py --variants 0 auto 256 auto:keepcache --prompt-min 64 --prompt-max 512 \
        --concurrency 32 --max-tokens 48 --seconds 20 --repeat 3

A closed loop starts as a burst (every stream sends at once), and in a run of 20 s on the CPU
each stream sends only one or two requests, so the TTFT p99 is mostly the burst's. `--ramp`
lets the loop run that long before anything counts, and then counts only the next `--seconds`:
the steady state (tokens/s over that window, without the drain after it).

The JSON is rewritten after every run (`"complete": false` until the last), so a process killed
at a time limit leaves the runs it finished and their medians.

The variant `mlx_lm.server` runs the same closed loop against mlx-lm's server (started here with
the same batch sizes, on this process's OpenBLAS, on a copy of the model that never samples EOS),
over HTTP with text prompts of the same token lengths. The side-by-side mode also plots each
variant's ITL over time (its first run) into a PNG beside the JSON.
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import statistics
import time
from pathlib import Path

import anyio

from metrics import configure_logging, summarize
from scheduler import SamplingParams, Scheduler, SchedulerConfig
from scheduler.serving.heap import freeze_startup_heap
from workers.batching import fused, hostpad, padded_attention, sparerows
from workers.batching.prefill import PipelinedPrefill

PEER = "mlx_lm.server"
FLAGS = ("keepcache", "queued", "blocking", "mlxpad", "gatherfilter", "rollpad", "perlayer", "apart",
         "padjoin", "copyrows", "mlxattn", "mlxchunk", "padded", "nogc")
"""Variant flags: MLX's clear_cache a no-op; prefill chunks queued or blocking; mlx-lm's own
batch-cache filter (it reads the rows' padding from the device) instead of ours; ours copying the
rows that stay by gather rather than by runs; every pass right-padded and rolled; an array from
host values per layer rather than one per call; each layer's positions moved on its own; joins
padded side by side and concatenated; MLX's masked attention for padded decode rows; MLX's own
products for prompt chunks' attention; Python's cyclic garbage collector off during the timed run."""


class GCPauses:
    """The garbage collector's pauses during a run (each one stops every thread: the worker's
    graph building and the event loop alike)."""

    def __init__(self) -> None:
        self.pauses: list[tuple[int, float]] = []  # (generation, seconds)
        self._start = 0.0

    def __enter__(self) -> GCPauses:
        gc.callbacks.append(self._callback)
        return self

    def __exit__(self, *exc: object) -> None:
        gc.callbacks.remove(self._callback)

    def _callback(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self._start = time.perf_counter()
        else:
            self.pauses.append((info["generation"], time.perf_counter() - self._start))

    def result(self) -> dict[str, float]:
        out: dict[str, float] = {}
        for gen in (0, 1, 2):
            times = [t for g, t in self.pauses if g == gen]
            out[f"gc{gen}_count"] = len(times)
            out[f"gc{gen}_max_ms"] = max(times, default=0.0) * 1e3
        out["gc_total_ms"] = sum(t for _, t in self.pauses) * 1e3
        return out


class Trace:
    """What a run measured. With a ramp, only the window from `since` to `until` (seconds after
    the start) counts: TTFT of the requests sent in it, gaps and tokens that come in it."""

    def __init__(self, since: float = 0.0, until: float = float("inf")) -> None:
        self.since, self.until = since, until
        self.itl: list[tuple[float, float]] = []  # (time since start, gap)
        self.ttft: list[float] = []
        self.tokens = 0

    def first(self, sent: float, ttft: float, tokens: int) -> None:
        """A request sent `sent` s after the start had its first `tokens` after `ttft` s."""
        if self.since <= sent < self.until:
            self.ttft.append(ttft)
        if self.since <= sent + ttft < self.until:
            self.tokens += tokens

    def gap(self, at: float, gap: float, tokens: int) -> None:
        """`tokens` came `at` s after the start, `gap` s after the ones before them."""
        if self.since <= at < self.until:
            self.itl.append((at, gap))
            self.tokens += tokens

    def result(self, elapsed: float) -> dict[str, object]:
        """The figures; tok/s over the window, or over `elapsed` (the whole run) without one."""
        wall = self.until - self.since if self.until < float("inf") else elapsed
        itl = summarize([g for _, g in self.itl])
        ttft = summarize(self.ttft)
        return {
            "tok_s": self.tokens / wall,
            "itl_p50_ms": itl.p50 * 1e3, "itl_p99_ms": itl.p99 * 1e3, "itl_max_ms": itl.max * 1e3,
            "ttft_p50_ms": ttft.p50 * 1e3, "ttft_p99_ms": ttft.p99 * 1e3,
            "requests": len(self.ttft), "itl_trace": self.itl,
        }


def window(args: argparse.Namespace) -> Trace:
    """Without a ramp a run counts from its start (a burst: every stream sends at once) until its
    last request ends; with one, only the steady `--seconds` after it."""
    if not args.ramp:
        return Trace()
    return Trace(args.ramp, args.ramp + args.seconds)


async def one_request(sched: Scheduler, prompt: list[int], params: SamplingParams, trace: Trace,
                      start: float) -> None:
    t0 = last = time.perf_counter()
    first = True
    async for chunk in sched.generate(prompt, params):
        if not chunk.token_ids:
            continue
        now = time.perf_counter()
        if first:
            trace.first(t0 - start, now - t0, len(chunk.token_ids))
            first = False
        else:
            trace.gap(now - start, now - last, len(chunk.token_ids))
        last = now


async def run(config: SchedulerConfig, args: argparse.Namespace, *, rate: float | None,
              collect: bool = True) -> dict[str, object]:
    rng = random.Random(args.seed)
    fixed = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)

    def params() -> SamplingParams:
        if not args.max_tokens_min:
            return fixed
        return SamplingParams(max_tokens=rng.randint(args.max_tokens_min, args.max_tokens),
                              temperature=0.0, ignore_eos=True)

    def prompt() -> list[int]:
        n = rng.randint(args.prompt_min, args.prompt_max) if args.prompt_min else args.prompt_tokens
        return [rng.randrange(3, 1000) for _ in range(n)]

    trace = window(args)
    async with Scheduler(config) as sched:
        # Warm up with a batch of prompts across the length range: a GPU compiles kernels for
        # the shapes it first meets, and that must not land inside the timed run.
        lo, hi = (args.prompt_min, args.prompt_max) if args.prompt_min else (args.prompt_tokens,) * 2
        warm = random.Random(args.seed + 1)
        async with anyio.create_task_group() as tg:
            for k in range(args.prefill_batch):
                n = lo + (hi - lo) * k // max(1, args.prefill_batch - 1)
                tg.start_soon(sched.complete, [warm.randrange(3, 1000) for _ in range(n)],
                              SamplingParams(max_tokens=4))
        # As `serve` does once its scheduler has started ([server] freeze_heap, on by default).
        frozen = freeze_startup_heap() if args.freeze_heap else 0
        if not collect:
            gc.disable()
        start = time.perf_counter()
        end_at = start + args.ramp + args.seconds
        try:
            with GCPauses() as pauses:
                async with anyio.create_task_group() as tg:
                    if rate is None:
                        async def stream() -> None:
                            while time.perf_counter() < end_at:
                                await one_request(sched, prompt(), params(), trace, start)

                        for _ in range(args.concurrency):
                            tg.start_soon(stream)
                    else:
                        while time.perf_counter() < end_at:
                            tg.start_soon(one_request, sched, prompt(), params(), trace, start)
                            await anyio.sleep(rng.expovariate(rate))
                wall = time.perf_counter() - start
        finally:
            gc.enable()
            gc.unfreeze()  # the next variant freezes its own heap
    return {**trace.result(wall), **pauses.result(), "heap_frozen": frozen}


def make_config(args: argparse.Namespace, budget: str, chunks: str = "auto",
                settings: dict[str, str] | None = None) -> SchedulerConfig:
    worker = {"max_batch": str(args.concurrency), "prefill_batch": str(args.prefill_batch),
              "prefill_step": str(args.prefill_step), "step_token_budget": budget,
              "prefill_chunks": f'"{chunks}"', **(settings or {})}
    return SchedulerConfig.from_toml(
        f'[model]\npath = "{args.model}"\n[worker]\n' + "".join(f"{k} = {v}\n" for k, v in worker.items())
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="synthetic:small")
    ap.add_argument("--concurrency", type=int, default=64)
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--max-tokens-min", type=int, default=0,
                    help="output lengths drawn from this..--max-tokens (0: all --max-tokens); with "
                         "equal lengths, rows that start together finish together")
    ap.add_argument("--prefill-batch", type=int, default=8)
    ap.add_argument("--prefill-step", type=int, default=512)
    ap.add_argument("--seconds", type=float, default=30.0)
    ap.add_argument("--ramp", type=float, default=0.0,
                    help="seconds the closed loop runs before anything counts (its start is a burst: "
                         "every stream sends at once); then only the next --seconds count (tokens, "
                         "gaps, and the TTFT of requests sent in them), not the drain after them")
    ap.add_argument("--load", type=float, default=0.8, help="open-loop rate as a share of capacity")
    ap.add_argument("--budget", default='"auto"', help='the "on" setting: "auto" or tokens')
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="benchmarks/results/stall.json")
    ap.add_argument("--prompt-min", type=int, default=0, help="with --prompt-max: random prompt lengths")
    ap.add_argument("--prompt-max", type=int, default=0)
    ap.add_argument("--variants", nargs="+", default=None, help='budget settings: 0, "auto", tokens; flags :keepcache :queued :blocking :mlxpad, '
                    "and :key=value for any [worker] setting (:prefill_batch=4)")
    ap.add_argument("--repeat", type=int, default=1)
    ap.add_argument("--no-freeze-heap", dest="freeze_heap", action="store_false",
                    help="leave the heap unfrozen (serve freezes it once its scheduler has started: "
                         "full collections of 200-290 ms came inside half the timed runs on an H100 without)")
    args = ap.parse_args()
    configure_logging(level="warning")
    if args.variants:
        compare(args)
        return

    results: dict[str, dict[str, object]] = {}
    for name, budget in (("closed/off", "0"), ("closed/on", args.budget)):
        results[name] = anyio.run(lambda b=budget: run(make_config(args, b), args, rate=None))
        print(f"  {name}: {results[name]['tok_s']:.0f} tok/s", flush=True)
    capacity = float(results["closed/off"]["tok_s"]) / args.max_tokens  # requests per second
    rate = args.load * capacity
    for name, budget in (("open/off", "0"), ("open/on", args.budget)):
        results[name] = anyio.run(lambda b=budget: run(make_config(args, b), args, rate=rate))
        print(f"  {name}: {results[name]['tok_s']:.0f} tok/s", flush=True)

    print(f"\n{args.model}, {args.concurrency} streams, prompt {args.prompt_tokens}, output "
          f"{args.max_tokens}; open loop at {rate:.2f} req/s ({args.load:.0%} of capacity)")
    header = f"{'run':<12} {'tok/s':>7} {'ITL p50':>8} {'ITL p99':>8} {'ITL max':>8} {'p99/p50':>8} {'TTFT p50':>9} {'TTFT p99':>9}"
    print(header)
    for name, r in results.items():
        print(f"{name:<12} {r['tok_s']:>7.0f} {r['itl_p50_ms']:>8.1f} {r['itl_p99_ms']:>8.1f} "
              f"{r['itl_max_ms']:>8.1f} {float(r['itl_p99_ms']) / float(r['itl_p50_ms']):>8.2f} "
              f"{r['ttft_p50_ms']:>9.0f} {r['ttft_p99_ms']:>9.0f}")
    off, on = results["closed/off"], results["closed/on"]
    ratios = {
        "itl_p99_over_p50_on": float(on["itl_p99_ms"]) / float(on["itl_p50_ms"]),
        "itl_p99_over_p50_off": float(off["itl_p99_ms"]) / float(off["itl_p50_ms"]),
        "throughput_on_over_off": float(on["tok_s"]) / float(off["tok_s"]),
        "ttft_p99_on_over_off": float(on["ttft_p99_ms"]) / float(off["ttft_p99_ms"]),
    }
    print("ratios (closed loop):", {k: round(v, 3) for k, v in ratios.items()})
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    traces = {k: v.pop("itl_trace") for k, v in results.items()}
    out.write_text(json.dumps({"args": vars(args), "results": results, "ratios": ratios,
                               "date": time.strftime("%Y-%m-%d")}, indent=2))
    print(f"wrote {out}")
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("(matplotlib not installed: no PNG)")
        return
    fig, axes = plt.subplots(2, 1, figsize=(9, 6), sharex=True)
    for ax, loop in zip(axes, ("closed", "open"), strict=True):
        for setting in ("off", "on"):
            pts = traces[f"{loop}/{setting}"]
            ax.scatter([t for t, _ in pts], [g * 1e3 for _, g in pts], s=2, alpha=0.4,
                       label=f"budget {setting}")
        ax.set_ylabel(f"ITL ms ({loop} loop)")
        ax.set_yscale("log")
        ax.legend(markerscale=5)
    axes[-1].set_xlabel("seconds")
    fig.tight_layout()
    fig.savefig(out.with_suffix(".png"), dpi=90)
    print(f"wrote {out.with_suffix('.png')}")


def compare(args: argparse.Namespace) -> None:
    """The closed loop for each of `args.variants`, repeated in rotating order; medians."""
    import os

    import mlx.core as mx

    runs: dict[str, list[dict[str, object]]] = {v: [] for v in args.variants}
    traces: dict[str, object] = {}
    loads: list[float] = []
    clear = mx.clear_cache
    fresh = PipelinedPrefill._fresh

    def rollpad(self: PipelinedPrefill) -> bool:
        return False
    for rep in range(args.repeat):
        order = args.variants[rep % len(args.variants):] + args.variants[:rep % len(args.variants)]
        for variant in order:
            budget, *flags = variant.split(":")
            settings = dict(f.split("=", 1) for f in flags if "=" in f)
            unknown = {f for f in flags if "=" not in f} - set(FLAGS)
            if unknown:
                raise SystemExit(f"unknown variant flag(s) {sorted(unknown)} in {variant!r}; known: {FLAGS}")
            budget = f'"{budget}"' if budget == "auto" else budget
            chunks = next((f for f in flags if f in ("queued", "blocking")), "auto")
            mx.clear_cache = (lambda: None) if "keepcache" in flags else clear  # type: ignore[assignment]
            hostpad.ENABLED = "mlxpad" not in flags
            hostpad.COPY_RUNS = "gatherfilter" not in flags
            hostpad.SHARE_HOST_ARRAYS = "perlayer" not in flags
            hostpad.SHARE_POSITIONS = "apart" not in flags
            hostpad.JOIN_ONCE = "padjoin" not in flags
            sparerows.ENABLED = False if "copyrows" in flags else None
            padded_attention.ENABLED = "mlxattn" not in flags
            padded_attention.GROUPED = "mlxchunk" not in flags
            fused.RAGGED = "padded" not in flags
            PipelinedPrefill._fresh = rollpad if "rollpad" in flags else fresh  # type: ignore[method-assign]
            try:
                if variant == PEER:
                    result = run_peer(args)
                else:
                    config = make_config(args, budget, chunks, settings)
                    result = anyio.run(lambda c=config, g="nogc" not in flags: run(c, args, rate=None, collect=g))
            finally:
                mx.clear_cache = clear  # type: ignore[assignment]
                hostpad.ENABLED = True
                hostpad.COPY_RUNS = True
                hostpad.SHARE_HOST_ARRAYS = hostpad.SHARE_POSITIONS = hostpad.JOIN_ONCE = True
                sparerows.ENABLED = None
                padded_attention.ENABLED = padded_attention.GROUPED = fused.RAGGED = True
                PipelinedPrefill._fresh = fresh  # type: ignore[method-assign]
            traces.setdefault(variant, result.pop("itl_trace"))
            runs[variant].append(result)
            loads.append(os.getloadavg()[0])
            write_results(args, runs, loads, complete=False)
            print(f"  {variant}: {result['tok_s']:.0f} tok/s, ITL p99/p50 "
                  f"{float(result['itl_p99_ms']) / float(result['itl_p50_ms']):.2f}, ITL max "
                  f"{float(result['itl_max_ms']):.0f} ms; GC pauses (gen 0/1/2) "
                  f"{result.get('gc0_count', 0):.0f}/{result.get('gc1_count', 0):.0f}/"
                  f"{result.get('gc2_count', 0):.0f}, longest {result.get('gc2_max_ms', 0):.1f} ms (gen 2), "
                  f"{max(float(result.get(f'gc{g}_max_ms', 0)) for g in (0, 1)):.1f} ms (gen 0-1)",
                  flush=True)

    table = write_results(args, runs, loads, complete=True)
    base = args.variants[0]
    prompts = f"{args.prompt_min}-{args.prompt_max}" if args.prompt_min else str(args.prompt_tokens)
    output = f"{args.max_tokens_min}-{args.max_tokens}" if args.max_tokens_min else args.max_tokens
    print(f"\n{args.model}, {args.concurrency} streams, prompts {prompts}, output {output}, "
          f"{args.seconds:.0f} s a run{f' after a {args.ramp:.0f} s ramp' if args.ramp else ''}, "
          f"medians of {args.repeat}; load {min(loads):.2f}-{max(loads):.2f}")
    print(f"{'budget':<16} {'tok/s':>7} {'x ' + base:>8} {'ITL p50':>8} {'ITL p99':>8} {'p99/p50':>8} "
          f"{'TTFT p99':>9} {'x ' + base:>8}")
    for v, row in table.items():
        print(f"{v:<16} {row['tok_s']:>7.0f} {row['tok_s_x']:>8.3f} {row['itl_p50_ms']:>8.1f} "
              f"{row['itl_p99_ms']:>8.1f} {row['p99_over_p50']:>8.2f} {row['ttft_p99_ms']:>9.0f} "
              f"{row['ttft_p99_x']:>8.2f}")
    print(f"wrote {args.out}")
    plot_over_time(traces, args, Path(args.out).with_suffix(".png"))


def medians(runs: dict[str, list[dict[str, object]]], base: str) -> dict[str, dict[str, float]]:
    """Each variant's medians over the runs it has (none: left out), with its ratios to `base`'s
    (left out while `base` has none)."""
    table: dict[str, dict[str, float]] = {}
    for v, done in runs.items():
        if not done:
            continue
        row = {k: statistics.median(float(r[k]) for r in done)  # type: ignore[arg-type]
               for k in ("tok_s", "itl_p50_ms", "itl_p99_ms", "ttft_p99_ms")}
        row["p99_over_p50"] = statistics.median(
            float(r["itl_p99_ms"]) / float(r["itl_p50_ms"]) for r in done)  # type: ignore[arg-type]
        table[v] = row
    if base in table:
        for row in table.values():
            row["tok_s_x"] = row["tok_s"] / table[base]["tok_s"]
            row["ttft_p99_x"] = row["ttft_p99_ms"] / table[base]["ttft_p99_ms"]
    return table


def write_results(args: argparse.Namespace, runs: dict[str, list[dict[str, object]]], loads: list[float],
                  *, complete: bool) -> dict[str, dict[str, float]]:
    """The JSON of what ran so far, rewritten after every run: a process killed at its time
    limit (a GPU machine's call) still leaves the runs it finished, marked incomplete."""
    table = medians(runs, args.variants[0])
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    part = out.with_suffix(".json.part")  # replaced whole: a kill mid-write leaves the last one
    part.write_text(json.dumps({"args": vars(args), "runs": runs, "medians": table, "load": loads,
                                "complete": complete, "date": time.strftime("%Y-%m-%d")}, indent=2))
    part.replace(out)
    return table


def plot_over_time(traces: dict[str, object], args: argparse.Namespace, path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("(matplotlib not installed: no PNG)")
        return
    fig, axes = plt.subplots(len(traces), 1, figsize=(9, 1.8 * len(traces) + 0.6), sharex=True, sharey=True)
    for ax, (variant, pts) in zip(axes if len(traces) > 1 else [axes], traces.items(), strict=True):
        points = list(pts)  # type: ignore[call-overload]
        ax.scatter([t for t, _ in points], [g * 1e3 for _, g in points], s=2, alpha=0.4)
        name = variant if variant == PEER else f"budget {variant}"
        ax.set_ylabel("ITL ms")
        ax.set_yscale("log")
        ax.set_title(name, fontsize=9, loc="left")
    (axes[-1] if len(traces) > 1 else axes).set_xlabel("seconds")
    fig.suptitle(f"{args.model}, {args.concurrency} streams, prompts {args.prompt_min}-{args.prompt_max}, "
                 f"{args.max_tokens} tokens", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    print(f"wrote {path}")


def run_peer(args: argparse.Namespace) -> dict[str, object]:
    """The closed loop against mlx_lm.server, started for this run."""
    import sys

    import httpx

    from scheduler.cli.bench import datasets
    from scheduler.cli.bench.mlxlm import MlxLmServer
    from scheduler.cli.bench.targets import OpenAITarget, Record, Sampling

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from peers import no_eos_model, peer_env

    model_dir = no_eos_model(args.model, None)
    maker = datasets.PromptMaker(datasets.load_codec(model_dir))
    rng = random.Random(args.seed)
    sampling = Sampling(temperature=0.0, ignore_eos=True)
    trace = window(args)

    async def loop(url: str) -> float:
        limits = httpx.Limits(max_connections=None)
        async with httpx.AsyncClient(limits=limits, timeout=httpx.Timeout(600, connect=10), trust_env=False) as c:
            target = OpenAITarget(c, url)

            async def one(n: int) -> Record:
                text, got = maker.make(n, rng)
                out = rng.randint(args.max_tokens_min, args.max_tokens) if args.max_tokens_min else args.max_tokens
                rec = Record(got, out)
                await target.send(datasets.RequestSpec(text, got, out), sampling, rec)
                return rec

            await one(args.prompt_min)  # warm up
            start = time.perf_counter()
            end_at = start + args.ramp + args.seconds

            async def stream() -> None:
                while time.perf_counter() < end_at:
                    sent = time.perf_counter()
                    rec = await one(rng.randint(args.prompt_min, args.prompt_max))
                    if rec.ttft is None:
                        continue
                    trace.first(sent - start, rec.ttft, rec.output_tokens - len(rec.itl))
                    at = sent + rec.ttft
                    for gap in rec.itl:
                        at += gap
                        trace.gap(at - start, gap, 1)

            async with anyio.create_task_group() as tg:
                for _ in range(args.concurrency):
                    tg.start_soon(stream)
            return time.perf_counter() - start

    with MlxLmServer(model_dir, decode_concurrency=args.concurrency, prompt_concurrency=args.prefill_batch,
                     env=peer_env(PEER)) as server:
        wall = anyio.run(loop, server.url)
    return trace.result(wall)


if __name__ == "__main__":
    main()

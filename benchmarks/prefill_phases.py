"""What a step that prefills costs, by phase: our engine on mlx-lm's BatchGenerator, closed loop.

`--concurrency` rows decode while new prompts (`--prompt-min`..`--prompt-max` tokens, random)
replace the ones that finish (`--max-tokens` greedy tokens each), for `--steps` engine steps after
a warm-up. Each variant (a budget; `:mlx` for mlx-lm's own prefill and joining instead of ours,
`:blocking` for ours with mlx-lm's blocking chunks, `[worker] prefill_chunks = "blocking"`;
`:nofuse` for a chunk in a forward pass of its own, `[worker] fuse_prefill = false`; `:perlayer`
for an array from host values made per layer, not once per call, `hostpad.SHARE_HOST_ARRAYS`;
`:apart` for each layer's positions moved on their own, as mlx-lm does, `hostpad.SHARE_POSITIONS`;
`:padjoin` for joins that pad each side and concatenate, as mlx-lm's do, `hostpad.JOIN_ONCE`;
`:copyrows` for decoding rows' arrays copied whenever rows join or leave, as mlx-lm's are,
`sparerows.ENABLED`;
`:mlxchunk` for MLX's own products in prompt chunks' attention, `padded_attention.GROUPED`;
`:padded` for a carried chunk's padding through the projections and MLPs, `fused.RAGGED`;
`:thread` for prompts prefilled on a thread of their own, `[worker] prefill_thread`;
`:spread` for a plan's chunk spread over the steps until the next, `[worker] prefill_spread`;
a budget `448x4` plans up to 4 steps' budget at once, `[worker] prefill_every`)
runs side by side, `--repeat` times in rotating order. Clocks wrap mlx-lm's phases:

- decode: `GenerationBatch.next` (the decode step, with its wait for the previous one);
- prefill: `PromptProcessingBatch.prompt` (one chunk);
- enter: `BatchGenerator._make_batch` (waiting rows enter the prompt batch, their caches merged:
  fresh ones hold nothing, those the prefill thread made hold their prompts);
- join: `split` + `generate` + `GenerationBatch.extend` (prefilled prompts join the decode rows);
- finish: `GenerationBatch.filter` (finished rows leave; inside decode, counted here alone);
- clear_cache: `mx.clear_cache`;
- engine: the rest of `MLXEngine.step` (the budget's plan, responses, ...).

A phase another thread runs (the prefill thread's passes, `:thread`) is clocked apart, as time
beside the steps, not inside them.

Where MLX computes asynchronously, a phase's clock holds what the host waited for in it. With
`--sync` every phase starts and ends with `mx.synchronize()`, so each clock holds its own
compute (the pipeline is broken: compare phases, not totals). A phase's lazy arrays are still
computed by whichever later phase evaluates them: the batch cache's compaction when rows leave
(finish) and its merge when rows join (join) land in the next decode step unless
`--eval-caches` evaluates the cache at the end of those two phases. Also: steps/s, decode
tokens/s, tokens a step (how many rows decode, on average: the rows that wait for their prompts
leave slots idle), the steps that prefilled, `real`, the share of our chunks' tokens (padding
included) that are prompt tokens, and `first`, the steps from a request's insertion to its first
token (its TTFT in steps); the JSON keeps each step's time, rows and prompt tokens. Which steps
prefill, and so tokens a step and `first`, do not depend on the backend: `--model synthetic:tiny
--prefill-pad 64` on the CPU replays the steps of CUDA's padded passes in a minute (checked
against an H200: 60.2, 55.6 and 37.7 tokens a step at budgets 0, 512 and 512x4 before
whole-prompt plans, against 60.4, 55.8 and 37.5 there).

    python benchmarks/prefill_phases.py --variants 0 128 128:mlx --concurrency 32 [--sync]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import threading
import time
from collections import defaultdict
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

# First: OpenBLAS (workers/blas.py) binds only if it is loaded before MLX.
import workers  # noqa: F401

# isort: split
import mlx.core as mx
from mlx_lm.generate import BatchGenerator, GenerationBatch, PromptProcessingBatch

from workers.batching import fused, hostpad, padded_attention, sparerows
from workers.batching.engine import MLXEngine
from workers.batching.prefill import JoiningBatch, PipelinedPrefill
from workers.cuda import apply_cuda_defaults
from workers.loading.models import load_model
from workers.messages import Admit, SamplingSpec

if TYPE_CHECKING:
    from collections.abc import Callable

PHASES = {
    (BatchGenerator, "_make_batch"): "enter",
    (GenerationBatch, "next"): "decode",
    (GenerationBatch, "filter"): "finish",
    (GenerationBatch, "extend"): "join",
    (PromptProcessingBatch, "prompt"): "prefill",
    (PipelinedPrefill, "prompt"): "prefill",
    (PipelinedPrefill, "generate"): "join",
    (JoiningBatch, "next"): "decode",
    (JoiningBatch, "filter"): "finish",
    (JoiningBatch, "extend"): "join",
    (PromptProcessingBatch, "split"): "join",
    (PromptProcessingBatch, "generate"): "join",
}


class Clocks:
    """Exclusive time per phase (a phase inside another is taken out of the outer one's)."""

    def __init__(self, sync: bool, eval_caches: bool = False) -> None:
        self.sync = sync
        self.eval_caches = eval_caches
        self.total: dict[str, float] = defaultdict(float)
        self.calls: dict[str, int] = defaultdict(int)
        self._stack: list[list[float]] = []  # [start, time spent in nested phases]
        self._owner = threading.current_thread()
        self.beside: dict[str, float] = defaultdict(float)
        """Time another thread (the prefill thread) spent in a phase, beside the steps."""

    def wrap(self, name: str, fn: Any) -> Any:
        def timed(*args: Any, **kwargs: Any) -> Any:
            if threading.current_thread() is not self._owner:
                began = time.perf_counter()
                try:
                    return fn(*args, **kwargs)
                finally:
                    self.beside[name] += time.perf_counter() - began
            if self.sync:
                mx.synchronize()
            self._stack.append([time.perf_counter(), 0.0])
            out = None
            try:
                out = fn(*args, **kwargs)
                return out
            finally:
                if self.eval_caches and name in ("finish", "join", "enter") and args:
                    # The batch cache's compaction (finish) and merges (join, enter) are built
                    # lazily and would otherwise run, and be clocked, in the next decode step.
                    caches = getattr(out if name == "enter" else args[0], "prompt_cache", None) or []
                    mx.eval([a for c in caches for a in (getattr(c, "keys", None), getattr(c, "values", None))
                             if a is not None])
                if self.sync:
                    mx.synchronize()
                start, nested = self._stack.pop()
                spent = time.perf_counter() - start
                self.total[name] += spent - nested
                self.calls[name] += 1
                if self._stack:
                    self._stack[-1][1] += spent

        return timed


def install_clocks(clocks: Clocks) -> list[tuple[Any, str, Any]]:
    saved = []
    for (cls, attr), name in PHASES.items():
        original = cls.__dict__[attr]
        saved.append((cls, attr, original))
        setattr(cls, attr, clocks.wrap(name, original))
    saved.append((mx, "clear_cache", mx.clear_cache))
    mx.clear_cache = clocks.wrap("clear_cache", mx.clear_cache)  # type: ignore[assignment]
    return saved


def admitter(args: argparse.Namespace) -> Callable[[], Admit]:
    """The closed loop's next request: a prompt of `--prompt-min`..`--prompt-max` random tokens,
    `--max-tokens` greedy tokens (the same sequence for a seed)."""
    rng = random.Random(args.seed)
    next_rid = 0

    def admit() -> Admit:
        nonlocal next_rid
        next_rid += 1
        n = rng.randint(args.prompt_min, args.prompt_max)
        return Admit(next_rid, [rng.randrange(3, args.vocab) for _ in range(n)], args.max_tokens,
                     SamplingSpec(), ())

    return admit


FLAGS = ("", "mlx", "blocking", "nofuse", "perlayer", "apart", "padjoin", "copyrows", "mlxchunk", "padded",
         "thread", "spread")
"""A variant's one flag after its budget (none, or the header's)."""


def engine_for(model: Any, args: argparse.Namespace, variant: str) -> MLXEngine:
    """Our engine for a variant: a budget (`448x4`: with `prefill_every`), with `:mlx`,
    `:blocking`, `:nofuse`, `:perlayer`, `:apart`, `:padjoin`, `:copyrows`, `:mlxchunk`, `:padded`,
    `:thread` or `:spread` (the header). `:perlayer` to `:padded` are process-wide: they hold until
    the next variant's engine."""
    budget_text, _, flag = variant.partition(":")
    if flag not in FLAGS:
        raise SystemExit(f"unknown variant flag {flag!r} in {variant!r} (one a variant): known {FLAGS[1:]}")
    budget_text, _, every = budget_text.partition("x")
    budget: int | str = budget_text if budget_text == "auto" else int(budget_text)
    hostpad.SHARE_HOST_ARRAYS = flag != "perlayer"
    hostpad.SHARE_POSITIONS = flag != "apart"
    hostpad.JOIN_ONCE = flag != "padjoin"
    sparerows.ENABLED = False if flag == "copyrows" else None
    padded_attention.GROUPED = flag != "mlxchunk"
    fused.RAGGED = flag != "padded"
    pad = getattr(args, "prefill_pad", "auto")  # kernel_trace.py's arguments have none
    return MLXEngine(
        model, vocab_size=args.vocab, max_batch=args.concurrency, prefill_batch=args.prefill_batch,
        prefill_step=args.prefill_step, step_token_budget=budget, pipelined_prefill=flag != "mlx",
        queue_chunks=flag != "blocking", fuse_prefill=flag != "nofuse", prefill_every=int(every) if every else "auto",
        prefill_pad=pad if pad == "auto" else int(pad), prefill_thread=flag == "thread",
        prefill_spread=flag == "spread",
    )


def count_padding(counts: dict[str, int]) -> Any:
    """`PipelinedPrefill._prepared`, adding each chunk's real and padded tokens to `counts`."""
    prepared = PipelinedPrefill.__dict__["_prepared"]

    def counted(self: PipelinedPrefill, tokens: list[list[int]]) -> Any:
        out = prepared(self, tokens)
        counts["real"] += sum(len(t) for t in tokens)
        counts["padded"] += out[0].size
        return out

    return counted


def run(model: Any, args: argparse.Namespace, variant: str) -> dict[str, Any]:
    engine = engine_for(model, args, variant)
    admit = admitter(args)
    counts = {"real": 0, "padded": 0}

    first = [admit() for _ in range(args.concurrency)]
    engine.insert(first)
    inserted = {a.rid: 0 for a in first}  # rid -> the step it was inserted before
    waits: list[int] = []  # steps from insertion to first token, for rids inserted after the warm-up
    clocks = Clocks(args.sync, args.eval_caches)
    for i in range(args.warmup + args.steps):
        if i == args.warmup:
            saved = install_clocks(clocks)
            saved.append((PipelinedPrefill, "_prepared", PipelinedPrefill.__dict__["_prepared"]))
            PipelinedPrefill._prepared = count_padding(counts)  # type: ignore[method-assign]
            start = time.perf_counter()
            tokens = prefill_steps = 0
            step_clock = 0.0
            per_step: list[Step] = []
        before = dict(clocks.total)
        t0 = time.perf_counter()
        result = engine.step()
        if i >= args.warmup:
            spent = time.perf_counter() - t0
            step_clock += spent
            per_step.append(Step(spent, {k: v - before.get(k, 0.0) for k, v in clocks.total.items()},
                                 len(result.tokens), result.prefill_tokens))
            tokens += len(result.tokens)
            prefill_steps += result.prefill_tokens > 0
        for rid in result.rids:
            at = inserted.pop(rid, None)
            if at is not None and at >= args.warmup:
                waits.append(i + 1 - at)
        if result.finished:  # they already left the engine
            more = [admit() for _ in result.finished]
            engine.insert(more)
            inserted.update((a.rid, i + 1) for a in more)
    mx.synchronize()
    wall = time.perf_counter() - start
    for cls, attr, original in saved:
        setattr(cls, attr, original)
    engine.close()
    phases = dict(clocks.total)
    phases["engine"] = step_clock - sum(phases.values())
    return {"tok_s": tokens / wall, "ms_per_step": wall / args.steps * 1e3, "tokens_per_step": tokens / args.steps,
            "prefill_steps": prefill_steps, "first_token_steps": step_quantiles(waits),
            "real_share": counts["real"] / counts["padded"] if counts["padded"] else None,
            "slow_steps": slow_steps(per_step), "phase_ms_per_step": {k: v / args.steps * 1e3 for k, v in phases.items()},
            "calls": dict(clocks.calls),
            "steps": [[round(s.spent * 1e3, 2), s.rows, s.prompt_tokens] for s in per_step],
            "beside_ms_per_step": {k: v / args.steps * 1e3 for k, v in clocks.beside.items()}}


def step_quantiles(waits: list[int]) -> dict[str, float] | None:
    """The steps from a request's insertion to its first token (its TTFT in steps, which
    does not depend on the backend): median, 99th percentile and the count."""
    if not waits:
        return None
    ordered = sorted(waits)
    return {"p50": float(statistics.median(ordered)), "p99": float(ordered[int(len(ordered) * 0.99)]),
            "n": float(len(ordered))}


class Step(NamedTuple):
    """One timed step: its wall time (s), each phase's, the rows that emitted a token and the
    prompt tokens it prefilled (`StepResult.prefill_tokens`)."""

    spent: float
    phases: dict[str, float]
    rows: int
    prompt_tokens: int


def slow_steps(per_step: list[Step]) -> dict[str, Any]:
    """Where the slowest steps' time goes: the steps at or above the 95th percentile of step
    time against the median half, each phase's mean ms a step (engine: the rest), with their
    mean rows and prompt tokens."""
    times = sorted(s.spent for s in per_step)
    p50, p95 = times[len(times) // 2], times[int(len(times) * 0.95)]

    def mean(steps: list[Step]) -> dict[str, float]:
        out: dict[str, float] = defaultdict(float)
        for step in steps:
            for k, v in step.phases.items():
                out[k] += v * 1e3 / len(steps)
            out["engine"] += (step.spent - sum(step.phases.values())) * 1e3 / len(steps)
            out["step"] += step.spent * 1e3 / len(steps)
            out["rows"] += step.rows / len(steps)
            out["prompt_tokens"] += step.prompt_tokens / len(steps)
        return dict(out)

    return {"p50_ms": p50 * 1e3, "p95_ms": p95 * 1e3, "p99_ms": times[int(len(times) * 0.99)] * 1e3,
            "max_ms": times[-1] * 1e3,
            "slow": mean([s for s in per_step if s.spent >= p95]),
            "median_half": mean([s for s in per_step if s.spent <= p50])}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="synthetic:small")
    ap.add_argument("--variants", nargs="+", default=["0", "128", "128:mlx"])
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--prompt-min", type=int, default=64)
    ap.add_argument("--prompt-max", type=int, default=512)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--prefill-batch", type=int, default=8)
    ap.add_argument("--prefill-step", type=int, default=512)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--warmup", type=int, default=60)
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--sync", action="store_true", help="synchronize around every phase")
    ap.add_argument("--eval-caches", action="store_true",
                    help="evaluate the batch cache after a finish or a join, so the copy each builds "
                         "lazily is clocked there, not in the next decode step")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--prefill-pad", default="auto",
                    help="[worker] prefill_pad (64 replays CUDA's passes on the CPU: the same steps)")
    ap.add_argument("--out", default="benchmarks/results/prefill_phases.json")
    args = ap.parse_args()
    apply_cuda_defaults()  # as the worker does: CUDA graphs off for an unquantized model
    model, _ = load_model(args.model)
    args.vocab = min(2000, int(model.args.vocab_size))
    runs: dict[str, list[dict[str, Any]]] = {v: [] for v in args.variants}
    loads = []
    for rep in range(args.repeat):
        k = rep % len(args.variants)
        for variant in args.variants[k:] + args.variants[:k]:
            runs[variant].append(run(model, args, variant))
            loads.append(os.getloadavg()[0])
            print(f"  {variant}: {runs[variant][-1]['tok_s']:.0f} tok/s", flush=True)
    names = ["decode", "prefill", "enter", "join", "finish", "clear_cache", "engine"]
    print(f"\n{args.model} on {mx.default_device()}, {args.concurrency} rows, prompts {args.prompt_min}-"
          f"{args.prompt_max}, {args.max_tokens} tokens, {args.steps} steps, medians of {args.repeat}"
          f"{', synchronized phases' if args.sync else ''}; load {min(loads):.2f}-{max(loads):.2f}")
    print(f"{'variant':<12} {'tok/s':>7} {'ms/step':>8} {'tok/step':>8} {'prefilled':>9} {'real':>5} "
          f"{'first p50':>9} {'first p99':>9} " + " ".join(f"{n:>11}" for n in names))
    table = {}
    for v, rs in runs.items():
        row = {"tok_s": statistics.median(r["tok_s"] for r in rs),
               "ms_per_step": statistics.median(r["ms_per_step"] for r in rs),
               "tokens_per_step": statistics.median(r["tokens_per_step"] for r in rs),
               "prefill_steps": statistics.median(r["prefill_steps"] for r in rs),
               "real_share": statistics.median(r["real_share"] or 0.0 for r in rs)}
        firsts = [r["first_token_steps"] for r in rs if r["first_token_steps"]]
        for q in ("p50", "p99"):
            row[f"first_token_steps_{q}"] = statistics.median(f[q] for f in firsts) if firsts else float("nan")
        row.update({n: statistics.median(r["phase_ms_per_step"].get(n, 0.0) for r in rs) for n in names})
        table[v] = row
        print(f"{v:<12} {row['tok_s']:>7.0f} {row['ms_per_step']:>8.2f} {row['tokens_per_step']:>8.1f} "
              f"{row['prefill_steps']:>9.0f} {row['real_share']:>5.2f} "
              f"{row['first_token_steps_p50']:>9.0f} {row['first_token_steps_p99']:>9.0f} "
              + " ".join(f"{row[n]:>11.2f}" for n in names))
    print("(real: the share of our chunks' tokens, padding included, that are prompt tokens; first: the "
          "steps from a request's insertion to its first token, TTFT in steps; "
          "phases: ms per step, averaged over all steps)")
    for v, rs in runs.items():
        beside = {n: statistics.median(r["beside_ms_per_step"].get(n, 0.0) for r in rs)
                  for n in rs[0]["beside_ms_per_step"]}
        if beside:
            print(f"{v:<12} beside the steps, on the prefill thread: "
                  + ", ".join(f"{n} {ms:.2f} ms a step" for n, ms in beside.items()))
    print("\nThe slowest steps (>= p95 of step time) against the median half, first run, ms a step:")
    print(f"{'variant':<12} {'steps':<12} {'step':>7} " + " ".join(f"{n:>11}" for n in names)
          + f" {'rows':>6} {'prompt':>7}")
    for v, rs in runs.items():
        slow = rs[0]["slow_steps"]
        print(f"{v:<12} p50 {slow['p50_ms']:.1f}, p99 {slow['p99_ms']:.1f}, max {slow['max_ms']:.1f}")
        for which in ("slow", "median_half"):
            ph = slow[which]
            print(f"{'':<12} {which:<12} {ph['step']:>7.2f} " + " ".join(f"{ph.get(n, 0.0):>11.2f}" for n in names)
                  + f" {ph.get('rows', 0.0):>6.1f} {ph.get('prompt_tokens', 0.0):>7.0f}")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"args": vars(args), "runs": runs, "medians": table, "load": loads,
                               "device": str(mx.default_device()), "date": time.strftime("%Y-%m-%d")}, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()

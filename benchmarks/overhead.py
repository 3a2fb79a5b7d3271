"""Overhead of the actor stack: tokens/s through `Scheduler` / tokens/s of a bare BatchGenerator loop.

Same model, same prompts, same concurrency (closed loop: N requests always in flight), measured
side by side in one run. A third loop drives our engine (`MLXEngine`, what the worker steps)
without the actors: the scheduler over it is the actor stack's own cost, and it over the bare
loop is what the engine changes in mlx-lm's step (joins without a pass of their own, rows that
leave without waiting for the device, queued prefill chunks, mask-free decode). All (the best of `--repeat` interleaved runs a side); then, in a run of its own, the
p99 lag of a 1 ms ticker on the event loop and our tokens/s while it ticks.

    python benchmarks/overhead.py [--model synthetic:small] [--concurrency 1 8 32 64]
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import anyio

from metrics import configure_logging, percentile
from scheduler import SamplingParams, Scheduler, SchedulerConfig

if TYPE_CHECKING:
    from collections.abc import Callable


def make_prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, min(vocab, 4000)) for _ in range(length)] for _ in range(n)]


def bare_loop(model: object, prompts: list[list[int]], concurrency: int, max_tokens: int,
              prefill_batch: int, prefill_step: int, steps: list[int] | None = None) -> tuple[int, float]:
    """A tight loop over BatchGenerator keeping `concurrency` sequences in flight."""
    from mlx_lm.generate import BatchGenerator

    gen = BatchGenerator(model, completion_batch_size=concurrency,
                         prefill_batch_size=min(prefill_batch, concurrency),
                         prefill_step_size=prefill_step)
    todo = list(prompts)
    active = 0
    tokens = 0
    start = time.perf_counter()
    while todo and active < concurrency:
        gen.insert([todo.pop()], max_tokens=[max_tokens])
        active += 1
    n_steps = 0
    while active:
        _, responses = gen.next()
        n_steps += 1
        tokens += len(responses)
        for r in responses:
            if r.finish_reason is not None:
                active -= 1
                if todo:
                    gen.insert([todo.pop()], max_tokens=[max_tokens])
                    active += 1
    elapsed = time.perf_counter() - start
    gen.close()
    if steps is not None:
        steps.append(n_steps)
    return tokens, elapsed


def engine_loop(model: object, vocab: int, prompts: list[list[int]], concurrency: int, max_tokens: int,
                prefill_batch: int, prefill_step: int, budget: int | str,
                fuse_prefill: bool | str = "auto", prefill_pad: int | str = "auto") -> tuple[int, float]:
    """A tight loop over our engine keeping `concurrency` sequences in flight (no actors). On
    CUDA its quantized layers fold a decode batch into one product, as the worker's do (`[worker]
    fold_quantized`), for this loop only: the bare loop on the same model stays mlx-lm's."""
    from workers.batching.quantfold import fold_decode_batch, unfold_decode_batch
    from workers.loading.dtypes import on_cuda

    if on_cuda():
        fold_decode_batch(model)
    try:
        return _engine_loop(model, vocab, prompts, concurrency, max_tokens, prefill_batch, prefill_step,
                            budget, fuse_prefill, prefill_pad)
    finally:
        unfold_decode_batch(model)


def _engine_loop(model: object, vocab: int, prompts: list[list[int]], concurrency: int, max_tokens: int,
                 prefill_batch: int, prefill_step: int, budget: int | str,
                 fuse_prefill: bool | str, prefill_pad: int | str) -> tuple[int, float]:
    from workers.batching.engine import MLXEngine
    from workers.messages import Admit, SamplingSpec

    engine = MLXEngine(model, vocab_size=vocab, max_batch=concurrency, prefill_batch=prefill_batch,
                       prefill_step=prefill_step, step_token_budget=budget, fuse_prefill=fuse_prefill,
                       prefill_pad=prefill_pad)
    todo = list(prompts)
    made = 0

    def admits(k: int) -> list[Admit]:
        nonlocal made
        out = [Admit(made + i, todo.pop(), max_tokens, SamplingSpec(), ()) for i in range(min(k, len(todo)))]
        made += len(out)
        return out

    tokens = 0
    start = time.perf_counter()
    engine.insert(admits(concurrency))
    while engine.has_work():
        result = engine.step()
        tokens += len(result.tokens)
        if result.finished:
            engine.insert(admits(len(result.finished)))
    elapsed = time.perf_counter() - start
    engine.close()
    return tokens, elapsed


async def scheduler_run(config: SchedulerConfig, prompts: list[list[int]], concurrency: int,
                        max_tokens: int, ticker: bool = True,
                        where: dict[str, float] | None = None,
                        stream: bool = False,
                        on_start: Callable[[], None] | None = None) -> tuple[int, float, list[float]]:
    """Our side. `where`, if given, receives the time per step: steps, the worker's step (ms),
    and the event loop's CPU time (ms), to attribute a gap to the bare loop. `stream`: clients
    iterate `generate` (a chunk per step each) instead of awaiting `complete`. `on_start` is
    called once the scheduler is up, right before the timed requests."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    lags: list[float] = []
    async with Scheduler(config) as sched:
        cpu0 = time.thread_time()  # this coroutine runs on the event loop's thread
        todo = list(prompts)
        tokens = 0

        async def client() -> None:
            nonlocal tokens
            while todo:
                if stream:
                    async for chunk in sched.generate(todo.pop(), params):
                        tokens += len(chunk.token_ids)
                else:
                    done = await sched.complete(todo.pop(), params)
                    tokens += done.completion_tokens

        async def tick() -> None:
            while True:
                t = time.perf_counter()
                await anyio.sleep(0.001)
                lags.append(time.perf_counter() - t - 0.001)

        if on_start is not None:
            on_start()
        start = time.perf_counter()
        async with anyio.create_task_group() as tg:
            if ticker:
                tg.start_soon(tick)
            async with anyio.create_task_group() as clients:
                for _ in range(concurrency):
                    clients.start_soon(client)
            elapsed = time.perf_counter() - start
            tg.cancel_scope.cancel()
        if where is not None:
            steps = max(1, sched.stats().steps)
            hist = sched.metrics.step_seconds
            where.update(steps=steps, step_ms=elapsed / steps * 1e3,
                         worker_step_ms=hist.total / max(1, hist.count) * 1e3,
                         loop_cpu_ms=(time.thread_time() - cpu0) / steps * 1e3)
    return tokens, elapsed, lags


def load_served(spec: str, dequantize: Any = "auto") -> tuple[Any, Any]:
    """`load` after the CUDA settings the scheduler's worker applies for this model
    (`workers.cuda`: CUDA graphs off unless it stays quantized). MLX reads them once, at its first
    GPU use, so a model loaded here before any Scheduler starts would run every side, the
    scheduler's too, with MLX's own (graphs on)."""
    from workers.cuda import apply_cuda_defaults
    from workers.loading.models import load, resolve_model

    directory = resolve_model(spec)
    apply_cuda_defaults("auto", directory, dequantize=dequantize)
    loaded = load(str(directory), dequantize=dequantize)
    return loaded.model, loaded.tokenizer


def throughput(run: tuple[int, float]) -> float:
    tokens, seconds = run
    return tokens / seconds


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="synthetic:small")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32, 64])
    ap.add_argument("--prompt-tokens", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--waves", type=int, default=3, help="requests per level = waves x concurrency")
    ap.add_argument("--min-requests", type=int, default=0,
                    help="at least this many requests per level: at low concurrency two waves are a run "
                         "of about a second on a GPU, too short for a 5%% margin")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--repeat", type=int, default=2, help="interleaved runs per side; the best counts")
    ap.add_argument("--warmup", type=int, default=1,
                    help="untimed runs per side and level first (one wave of other prompts): kernel "
                         "compilation and warm-up must not land on whichever side runs first")
    ap.add_argument("--budget", default="0",
                    help='[worker] step_token_budget for our side: 0 (as the bare loop), "auto" or tokens')
    ap.add_argument("--attribute", action="store_true",
                    help="also time steps: bare ms/step against ours (worker step, event-loop CPU "
                         "per step), and a run of ours without the 1 ms lag ticker")
    ap.add_argument("--prefix-cache", choices=["on", "off"], default="on",
                    help="[kvpool] prefix_cache for our side (the bare loop keeps nothing): off "
                         "shows what keeping each prompt's blocks for reuse costs")
    ap.add_argument("--block-tokens", type=int, default=256,
                    help="[kvpool] block_tokens (256, the default, keeps no block of a prompt under "
                         "257 tokens; 16 keeps every 16 tokens, as vLLM's blocks)")
    ap.add_argument("--stream", action="store_true",
                    help="our clients stream with generate() (a chunk per step) instead of complete()")
    ap.add_argument("--worker", action="append", default=[], metavar="KEY=VALUE",
                    help='a [worker] setting for our side (engine and scheduler), as TOML: '
                         '--worker prefill_pad=0 --worker fuse_prefill=false (the GPU defaults before 2026-11-27)')
    ap.add_argument("--kept-logprobs", action="store_true",
                    help="also run our engine and scheduler keeping every row's log-probabilities every "
                         "step, as mlx-lm does (the code before 2026-11-28), interleaved with the rest")
    ap.add_argument("--mlx-attention", action="store_true",
                    help="our side keeps MLX's masked attention for padded decode rows on CUDA, as the "
                         "bare loop does (our kernel is device work, not host cost)")
    ap.add_argument("--dequantize", choices=["auto", "yes", "no"], default="auto",
                    help='[model] dequantize for every side: "no" keeps a quantized model quantized '
                         '(on CUDA "auto" dequantizes small ones), to measure the 4-bit path')
    ap.add_argument("--out", default="benchmarks/results/overhead.json")
    args = ap.parse_args()
    configure_logging(level="warning")

    import mlx.core as mx

    from workers.batching import padded_attention, prefill
    from workers.loading.models import model_info

    padded_attention.ENABLED = not args.mlx_attention

    model, tokenizer = load_served(args.model, args.dequantize)
    info = model_info(model, tokenizer, args.model)
    budget = args.budget if args.budget.isdigit() else f'"{args.budget}"'
    rows = []
    for n in args.concurrency:
        prompts = make_prompts(max(n * args.waves, args.min_requests, 8), args.prompt_tokens, info.vocab_size,
                               args.seed + n)
        config = SchedulerConfig.from_toml(
            f'[model]\npath = "{args.model}"\ndequantize = "{args.dequantize}"\n[worker]\nmax_batch = {n}\n'
            f"step_token_budget = {budget}\n" + "".join(f"{kv}\n" for kv in args.worker) +
            f'[kvpool]\nmemory = "8GiB"\nblock_tokens = {args.block_tokens}\n'
            f'prefix_cache = {str(args.prefix_cache == "on").lower()}\n'
        )
        w = config.worker
        warm = make_prompts(max(n, 8), args.prompt_tokens, info.vocab_size, args.seed + n + 10**6)

        def engine(p: list[list[int]], n: int = n, w: Any = w) -> tuple[int, float]:
            return engine_loop(model, info.vocab_size, p, n, args.max_tokens, w.prefill_batch,
                               w.prefill_step, w.step_token_budget, w.fuse_prefill, w.prefill_pad)

        for _ in range(args.warmup):
            bare_loop(model, warm, n, args.max_tokens, w.prefill_batch, w.prefill_step)
            engine(warm)
            anyio.run(scheduler_run, config, warm, n, args.max_tokens, True, None, args.stream)
        bare_runs, engine_runs, ours_runs, lags = [], [], [], []
        kept_runs: dict[str, list[float]] = {"engine": [], "sched": []}
        for _ in range(args.repeat):  # interleaved, best of each: drift and warm-up hit every side
            bare_tokens, bare_s = bare_loop(model, prompts, n, args.max_tokens, w.prefill_batch, w.prefill_step)
            engine_tokens, engine_s = engine(prompts)
            ours_tokens, ours_s, _ = anyio.run(scheduler_run, config, prompts, n, args.max_tokens,
                                               False, None, args.stream)
            assert bare_tokens == engine_tokens == ours_tokens == len(prompts) * args.max_tokens
            bare_runs.append(bare_tokens / bare_s)
            engine_runs.append(engine_tokens / engine_s)
            ours_runs.append(ours_tokens / ours_s)
            if args.kept_logprobs:
                prefill.DROP_UNASKED_LOGPROBS = False
                try:
                    kept_runs["engine"].append(throughput(engine(prompts)))
                    kept = anyio.run(scheduler_run, config, prompts, n, args.max_tokens, False, None, args.stream)
                    kept_runs["sched"].append(throughput(kept[:2]))
                finally:
                    prefill.DROP_UNASKED_LOGPROBS = True
        # The lag ticker wakes the event loop every millisecond, and each wake-up needs the GIL
        # that the worker's graph building holds: it costs our side alone (about a tenth of the
        # tokens at 64 streams on an H100), so the ratio comes from runs without it and the lag
        # from a run of its own.
        ticked_tokens, ticked_s, lags = anyio.run(scheduler_run, config, prompts, n, args.max_tokens,
                                                  True, None, args.stream)
        row = {
            "concurrency": n,
            "requests": len(prompts),
            "bare_tok_s": max(bare_runs),
            "sched_tok_s": max(ours_runs),
            "ratio": max(ours_runs) / max(bare_runs),
            "engine_tok_s": max(engine_runs),
            "sched_over_engine": max(ours_runs) / max(engine_runs),
            "bare_runs": bare_runs,
            "engine_runs": engine_runs,
            "sched_runs": ours_runs,
            "sched_tok_s_with_ticker": ticked_tokens / ticked_s,
            "loop_lag_p50_ms": percentile(lags, 50) * 1e3,
            "loop_lag_p99_ms": percentile(lags, 99) * 1e3,
        }
        if args.kept_logprobs:
            row |= {
                "engine_kept_tok_s": max(kept_runs["engine"]), "sched_kept_tok_s": max(kept_runs["sched"]),
                "engine_kept_runs": kept_runs["engine"], "sched_kept_runs": kept_runs["sched"],
                "engine_over_kept": row["engine_tok_s"] / max(kept_runs["engine"]),
                "sched_over_kept": row["sched_tok_s"] / max(kept_runs["sched"]),
            }
            print(f"  c={n:<4d} every row's logprobs kept: engine {row['engine_kept_tok_s']:8.1f} tok/s "
                  f"(dropped / kept {row['engine_over_kept']:.3f}), sched {row['sched_kept_tok_s']:8.1f} "
                  f"({row['sched_over_kept']:.3f})", flush=True)
        if args.attribute:
            bare_steps: list[int] = []
            _, bare_s = bare_loop(model, prompts, n, args.max_tokens, w.prefill_batch, w.prefill_step,
                                  bare_steps)
            where: dict[str, float] = {}
            quiet_tokens, quiet_s, _ = anyio.run(scheduler_run, config, prompts, n, args.max_tokens,
                                                 False, where, args.stream)
            row["attribution"] = {
                "bare_steps": bare_steps[0], "bare_step_ms": bare_s / bare_steps[0] * 1e3,
                **{f"sched_{k}": v for k, v in where.items()},
            }
            print(f"  c={n:<4d} attribution: {row['attribution']}", flush=True)
        rows.append(row)
        print(f"  c={n:<4d} bare {row['bare_tok_s']:8.1f} tok/s  engine {row['engine_tok_s']:8.1f}  "
              f"sched {row['sched_tok_s']:8.1f}  ratio {row['ratio']:.3f}  sched/engine "
              f"{row['sched_over_engine']:.3f}  loop lag p99 {row['loop_lag_p99_ms']:.2f} ms (a run of its own)",
              flush=True)

    print()
    print(f"{'concurrency':>11} {'bare tok/s':>11} {'engine tok/s':>13} {'sched tok/s':>12} {'ratio':>7} "
          f"{'sched/engine':>13} {'lag p50 ms':>11} {'lag p99 ms':>11} {'tok/s, ticker on':>17}")
    for r in rows:
        print(f"{r['concurrency']:>11} {r['bare_tok_s']:>11.1f} {r['engine_tok_s']:>13.1f} {r['sched_tok_s']:>12.1f} "
              f"{r['ratio']:>7.3f} {r['sched_over_engine']:>13.3f} {r['loop_lag_p50_ms']:>11.2f} "
              f"{r['loop_lag_p99_ms']:>11.2f} {r['sched_tok_s_with_ticker']:>17.1f}")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    meta = {
        "model": args.model, "step_token_budget": args.budget, "stream": args.stream, "prefix_cache": args.prefix_cache, "block_tokens": args.block_tokens, "worker": args.worker, "dequantize": args.dequantize, "repeat": args.repeat, "warmup": args.warmup, "waves": args.waves, "min_requests": args.min_requests, "prompt_tokens": args.prompt_tokens, "max_tokens": args.max_tokens,
        "kept_logprobs": args.kept_logprobs, "device": str(mx.default_device()), "mlx": mx.__version__, "python": sys.version.split()[0],
        "machine": platform.machine(), "date": time.strftime("%Y-%m-%d"),
    }
    out.write_text(json.dumps({"meta": meta, "rows": rows}, indent=2))
    print(f"\nwrote {out}")


if __name__ == "__main__":
    main()

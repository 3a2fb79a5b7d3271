"""Books per layer kind against MLX's memory: part (d) of `benchmarks/kv_pool.py`.

On a gemma3_text-style model (two sliding-window layers, window 64, to each full-attention one)
and a qwen3_next-style one (three recurrent gated-delta-net layers to each full-attention one),
small random-weight models built from mlx-lm's own classes (`tests/layered_models.py`), the same
workload runs twice on fresh schedulers, on demand, with a KV budget that binds: with the books
per layer kind, and with the books as they were before (every layer charged as a full-attention
layer). Reported: MLX's active memory less the weights over the books' kv_bytes while requests
wait for memory (p50 / p90 / max), peak rows, tokens/s, and whether the outputs are identical.

    python benchmarks/kv_layers.py [--quick]      (or: python benchmarks/kv_pool.py --parts d)
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import random
import sys
import time
from pathlib import Path
from typing import Any

import anyio
import msgspec

from scheduler import SamplingParams, Scheduler, SchedulerConfig

ROOT = Path(__file__).resolve().parent.parent
KINDS = ("gemma3_text", "qwen3_next")


def _layered() -> Any:
    """tests/layered_models, which builds the models (the repository root need not be on the path)."""
    spec = importlib.util.spec_from_file_location("layered_models", ROOT / "tests" / "layered_models.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault(spec.name, module)
    spec.loader.exec_module(module)
    return module


def _as_before(info: Any) -> Any:
    """`info` as the books saw it before: every layer full attention with the first one's shape."""
    size = info.kv_bytes_per_token // max(1, sum(
        c.kv_heads * c.head_dim * 2 for c in info.layers if c.kind == "full")) or 4
    unit = info.num_layers * info.num_kv_heads * info.head_dim * 2 * size
    return msgspec.structs.replace(info, kv_bytes_per_token=unit, layers=())


async def _run(config: SchedulerConfig, work: list[tuple[list[int], SamplingParams]],
               poll_s: float) -> dict[str, Any]:
    samples: list[tuple[float, int, int]] = []
    outputs: dict[int, list[int]] = {}
    peak = 0
    async with Scheduler(config) as sched:
        await sched.complete([5] * 64, SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
        start = time.perf_counter()

        async def poll() -> None:
            nonlocal peak
            while True:
                s = sched.stats()
                peak = max(peak, s.running)
                if s.waiting and s.kv_bytes and s.active_bytes > s.weights_bytes:
                    samples.append(((s.active_bytes - s.weights_bytes) / s.kv_bytes, s.kv_bytes,
                                    s.active_bytes - s.weights_bytes))
                await anyio.sleep(poll_s)

        async def one(i: int) -> None:
            c = await sched.complete(*work[i])
            assert c.finish_reason in ("stop", "length"), c
            outputs[i] = c.token_ids

        async with anyio.create_task_group() as tg:
            tg.start_soon(poll)
            async with anyio.create_task_group() as clients:
                for i in range(len(work)):
                    clients.start_soon(one, i)
            tg.cancel_scope.cancel()
        wall = time.perf_counter() - start
        st = sched.stats()
    ratios = sorted(r for r, _, _ in samples)

    def q(p: float) -> float:
        return ratios[int(p * (len(ratios) - 1))] if ratios else float("nan")

    return {"samples": len(ratios), "p50": q(0.5), "p90": q(0.9), "max": q(1.0), "peak_running": peak,
            "tok_s": sum(map(len, outputs.values())) / wall, "preemptions": st.preemptions,
            "blocks_total": st.blocks_total, "kv_budget_bytes": st.kv_budget_bytes,
            "lost": len(work) - len(outputs), "idle_blocks_used": st.blocks_used,
            "outputs": [outputs.get(i) for i in range(len(work))]}


def part_d(cache_dir: str | None, requests: int, budget_mib: float, seed: int,
           poll_ms: float = 5.0) -> dict[str, Any]:
    from workers import factory
    from workers.loading import synthetic
    from workers.loading.models import load_model, model_info

    layered = _layered()
    real = factory.model_info

    def as_before(*a: Any, **k: Any) -> Any:
        return _as_before(real(*a, **k))

    root = synthetic.cache_root(cache_dir)
    out: dict[str, Any] = {}
    for kind in KINDS:
        path = layered.build(kind, root)
        model, tokenizer = load_model(str(path))
        info = model_info(model, tokenizer, path)
        del model, tokenizer
        rng = random.Random(seed)
        work = [([rng.randrange(3, 1000) for _ in range(rng.randint(50, 400))],
                 SamplingParams(max_tokens=rng.randint(20, 120), temperature=0.0, ignore_eos=True))
                for _ in range(requests)]
        config = SchedulerConfig.from_toml(
            f'[model]\npath = "{path}"\n[worker]\nmax_batch = 32\n[kvpool]\nmode = "on-demand"\n'
            f"memory = {info.weights_bytes + int(budget_mib * 2**20)}\nblock_tokens = 32\n"
            'prefix_cache = false\n[logging]\nlevel = "warning"\n')
        runs: dict[str, Any] = {}
        for books in ("per layer kind", "all full"):
            if books == "all full":
                factory.model_info = as_before  # type: ignore[assignment]
            try:
                runs[books] = anyio.run(_run, config, work, poll_ms / 1e3)
            finally:
                factory.model_info = real  # type: ignore[assignment]
            r = runs[books]
            print(f"  (d) {kind}, {books}: p50 {r['p50']:.2f}, p90 {r['p90']:.2f}, peak running "
                  f"{r['peak_running']}", flush=True)
        identical = runs["per layer kind"].pop("outputs") == runs["all full"].pop("outputs")
        out[kind] = {"runs": runs, "outputs_identical": identical,
                     "layers": [c.kind for c in info.layers],
                     "target_met": runs["per layer kind"]["p50"] <= 1.1 and runs["per layer kind"]["p90"] <= 1.2}
    return out


def print_d(out: dict[str, Any], requests: int, budget_mib: float) -> None:
    print(f"\n(d) books per layer kind: {requests} requests, prompts 50-400, on demand, KV budget "
          f"{budget_mib} MiB, block_tokens 32; MLX active - weights over books while requests wait")
    print(f"{'model':<12} {'books':<15} {'p50':>5} {'p90':>5} {'max':>5} {'peak run':>8} {'tok/s':>6} "
          f"{'preempt':>7} {'lost':>4}")
    for kind, d in out.items():
        for books, r in d["runs"].items():
            print(f"{kind:<12} {books:<15} {r['p50']:>5.2f} {r['p90']:>5.2f} {r['max']:>5.2f} "
                  f"{r['peak_running']:>8} {r['tok_s']:>6.0f} {r['preemptions']:>7} {r['lost']:>4}")
        print(f"{kind}: layers {'/'.join(d['layers'])}; outputs identical: {d['outputs_identical']}; "
              f"p50 <= 1.1 and p90 <= 1.2: {'MET' if d['target_met'] else 'NOT MET'}")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cache-dir", default=None)
    ap.add_argument("--requests", type=int, default=48)
    ap.add_argument("--budget-mib", type=float, default=3.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--out", default="benchmarks/results/kv_layers.json")
    args = ap.parse_args(argv)
    if args.quick:
        args.requests = 16
    out = part_d(args.cache_dir, args.requests, args.budget_mib, args.seed)
    print_d(out, args.requests, args.budget_mib)
    path = Path(args.out)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"args": vars(args), "results": out, "date": time.strftime("%Y-%m-%d")},
                               indent=1))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()

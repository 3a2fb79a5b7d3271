"""The KV pool: prefix reuse, reserve against on-demand memory, and session caches.

One run, three parts, each side by side on fresh `Scheduler`s with the same config but the one
setting under test; a table, JSON (`--out`) and a PNG with a panel per part (`--png`).

(a) Prefix reuse: `--users` users share a `--system-tokens` system prompt (token ids), each adding
    a unique ~`--suffix-tokens` suffix; greedy, `--a-max-tokens` tokens; all submitted at once (a
    burst; `--poisson-rate R` adds an open-loop run at R requests/s). `prefix_cache = true`
    against `false`: TTFT p50/p99, their ratio, prefix hit tokens, and whether the outputs match.
(b) Memory modes: a KV budget that binds (`[kvpool] memory` = weights + `--budget-mib`), max_batch
    `--max-batch`; `--requests` requests of mixed prompt length that declare `--b-max-tokens`
    but mostly stop earlier (temperature 1 with a per-request seed, and `--stop-tokens` random
    stop token ids), all submitted at once. `mode = "reserve"` against `"on-demand"`: peak
    concurrency (stats() polled every `--poll-ms`), tokens/s, preemptions, exactly one final
    chunk per request, identical token ids in both modes; and MLX's active memory less the
    weights against the books' kv_bytes while requests wait for memory.
(d) Books per layer kind (`benchmarks/kv_layers.py`): a gemma3_text-style (sliding window) and a
    qwen3_next-style (recurrent) model, on demand with a binding budget: MLX's memory over the
    books with the books per layer kind against every layer charged as full attention.
(c) Sessions: a `--turns`-turn conversation (turn k = turn k-1's prompt + its output + ~64 new
    tokens; greedy, `--c-max-tokens`) with `session=` on every turn, without it, and without it
    and without the prefix cache: per-turn TTFT, identical outputs, session hits.

    python benchmarks/kv_pool.py [--model synthetic:small] [--parts a,b,c,d] [--quick]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import random
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anyio

from metrics import configure_logging, summarize
from scheduler import SamplingParams, Scheduler, SchedulerConfig


# ---- one request, seen from the client -------------------------------------------------------
@dataclass
class Result:
    key: int
    sent: float = 0.0
    first: float | None = None
    end: float = 0.0
    token_ids: list[int] = field(default_factory=list)
    finals: int = 0
    chunks_after_final: int = 0
    finish_reason: str | None = None
    completion_tokens: int = 0
    prompt_tokens: int = 0
    error: str | None = None

    @property
    def ttft(self) -> float:
        return float("nan") if self.first is None else self.first - self.sent


async def one_request(sched: Scheduler, key: int, prompt: list[int], params: SamplingParams,
                      session: str | None = None) -> Result:
    r = Result(key)
    r.sent = time.perf_counter()
    async for chunk in sched.generate(prompt, params, session=session):
        now = time.perf_counter()
        if r.finals:
            r.chunks_after_final += 1
        if chunk.token_ids:
            if r.first is None:
                r.first = now
            r.token_ids.extend(chunk.token_ids)
        if chunk.finish_reason is not None:
            r.finals += 1
            r.finish_reason = chunk.finish_reason
            r.completion_tokens = chunk.completion_tokens
            r.prompt_tokens = chunk.prompt_tokens
            r.error = chunk.error
    r.end = time.perf_counter()
    return r


def check_results(results: list[Result], expected: int) -> dict[str, Any]:
    """Every request ends with exactly one final chunk (the last), none lost, none failed."""
    bad = [r.key for r in results if r.finals != 1 or r.chunks_after_final
           or r.finish_reason not in ("stop", "length") or r.completion_tokens != len(r.token_ids)]
    return {"requests": expected, "returned": len(results), "lost": expected - len(results),
            "bad": bad[:20], "bad_count": len(bad),
            "reasons": {k: sum(r.finish_reason == k for r in results)
                        for k in sorted({str(r.finish_reason) for r in results})},
            "ok": len(results) == expected and not bad}


class Poller:
    """Samples `stats()` every `period` seconds while it runs."""

    def __init__(self, sched: Scheduler, period: float) -> None:
        self.sched, self.period = sched, period
        self.samples: list[dict[str, float]] = []
        self.t0 = time.perf_counter()

    async def run(self) -> None:
        while True:
            s = self.sched.stats()
            self.samples.append({
                "t": time.perf_counter() - self.t0, "running": s.running, "waiting": s.waiting,
                "engine_batch": s.engine_batch, "kv_bytes": s.kv_bytes,
                "real_kv_bytes": max(0, s.active_bytes - s.weights_bytes) if s.active_bytes else 0,
                "blocks_used": s.blocks_used, "blocks_free": s.blocks_free,
                "blocks_padding": s.blocks_padding,
            })
            await anyio.sleep(self.period)


def make_config(args: argparse.Namespace, *, max_batch: int, memory: str = "2GiB",
                mode: str = "reserve", prefix_cache: bool = True) -> SchedulerConfig:
    cache = f"cache_dir = {json.dumps(args.cache_dir)}\n" if args.cache_dir else ""
    return SchedulerConfig.from_toml(
        f'[model]\npath = "{args.model}"\n{cache}'
        f"[worker]\nmax_batch = {max_batch}\n"
        f'[kvpool]\nblock_tokens = {args.block_tokens}\nmemory = "{memory}"\nmode = "{mode}"\n'
        f"prefix_cache = {'true' if prefix_cache else 'false'}\n"
        f'[logging]\nlevel = "warning"\n'
    )


async def warm_up(sched: Scheduler, rng: random.Random, vocab: int, length: int) -> None:
    """One untimed request of unrelated tokens: kernel compilation lands on nobody's figures."""
    prompt = [rng.randrange(3, vocab) for _ in range(length)]
    await sched.complete(prompt, SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))


# ---- (a) prefix reuse ------------------------------------------------------------------------
async def prefix_run(config: SchedulerConfig, args: argparse.Namespace, vocab: int,
                     prompts: list[list[int]], rate: float | None) -> dict[str, Any]:
    params = SamplingParams(max_tokens=args.a_max_tokens, temperature=0.0, ignore_eos=True)
    arrivals = random.Random(args.seed + 7)
    results: list[Result] = []
    async with Scheduler(config) as sched:
        await warm_up(sched, random.Random(args.seed + 99), vocab, len(prompts[0]))
        before = sched.stats()

        async def one(i: int) -> None:
            results.append(await one_request(sched, i, prompts[i], params))

        start = time.perf_counter()
        async with anyio.create_task_group() as tg:
            for i in range(len(prompts)):
                tg.start_soon(one, i)
                if rate is not None:
                    await anyio.sleep(arrivals.expovariate(rate))
        wall = time.perf_counter() - start
        after = sched.stats()
    ttft = summarize([r.ttft for r in results])
    return {
        "ttft_p50_ms": ttft.p50 * 1e3, "ttft_p99_ms": ttft.p99 * 1e3, "ttft_mean_ms": ttft.mean * 1e3,
        "wall_s": wall, "prefix_hit_tokens": after.prefix_hit_tokens - before.prefix_hit_tokens,
        "prefix_query_tokens": after.prefix_query_tokens - before.prefix_query_tokens,
        "check": check_results(results, len(prompts)),
        "ttfts_ms": sorted(r.ttft * 1e3 for r in results),
        "outputs": {r.key: r.token_ids for r in results},
    }


def part_a(args: argparse.Namespace, vocab: int) -> dict[str, Any]:
    rng = random.Random(args.seed)
    system = [rng.randrange(3, vocab) for _ in range(args.system_tokens)]
    prompts = [system + [rng.randrange(3, vocab) for _ in range(args.suffix_tokens + rng.randrange(-4, 5))]
               for _ in range(args.users)]
    runs: dict[str, dict[str, Any]] = {}
    variants: list[tuple[str, float | None]] = [("burst", None)]
    if args.poisson_rate > 0:
        variants.append(("poisson", args.poisson_rate))
    for arrival, rate in variants:
        for name, on in (("no-reuse", False), ("reuse", True)):
            config = make_config(args, max_batch=args.users, prefix_cache=on)
            r = anyio.run(prefix_run, config, args, vocab, prompts, rate)
            runs[f"{arrival}/{name}"] = r
            print(f"  (a) {arrival}/{name}: TTFT p50 {r['ttft_p50_ms']:.0f} ms, p99 "
                  f"{r['ttft_p99_ms']:.0f} ms, prefix hit tokens {r['prefix_hit_tokens']}", flush=True)
    summary: dict[str, Any] = {}
    for arrival, _ in variants:
        off, on = runs[f"{arrival}/no-reuse"], runs[f"{arrival}/reuse"]
        summary[arrival] = {
            "p50_ratio": on["ttft_p50_ms"] / off["ttft_p50_ms"],
            "p99_ratio": on["ttft_p99_ms"] / off["ttft_p99_ms"],
            "outputs_identical": on["outputs"] == off["outputs"],
            "outputs_differing": sum(on["outputs"][k] != off["outputs"].get(k) for k in on["outputs"]),
        }
    for r in runs.values():
        r.pop("outputs")
    return {"runs": runs, "summary": summary, "target_p50_ratio": 0.3,
            "target_met": summary["burst"]["p50_ratio"] <= 0.3}


# ---- (b) memory modes ------------------------------------------------------------------------
async def modes_run(config: SchedulerConfig, args: argparse.Namespace, vocab: int,
                    work: list[tuple[list[int], SamplingParams]]) -> dict[str, Any]:
    results: list[Result] = []
    async with Scheduler(config) as sched:
        await warm_up(sched, random.Random(args.seed + 99), vocab, 64)
        before = sched.stats()
        poller = Poller(sched, args.poll_ms / 1e3)
        start = time.perf_counter()
        async with anyio.create_task_group() as tg:
            tg.start_soon(poller.run)

            async def one(i: int) -> None:
                prompt, params = work[i]
                results.append(await one_request(sched, i, prompt, params))

            async with anyio.create_task_group() as clients:
                for i in range(len(work)):
                    clients.start_soon(one, i)
            wall = time.perf_counter() - start
            tg.cancel_scope.cancel()
        after = sched.stats()
    samples = poller.samples
    tokens = sum(len(r.token_ids) for r in results)
    # The books against MLX: while requests wait for memory, the batch is as full as the pool allows.
    full = [s for s in samples if s["waiting"] > 0 and s["kv_bytes"] > 0 and s["real_kv_bytes"] > 0]
    ratios = [s["real_kv_bytes"] / s["kv_bytes"] for s in full]
    # ... and apart from admissions in flight (a new row's prefill holds its own cache until merged)
    steady = [s["real_kv_bytes"] / s["kv_bytes"] for s in full if s["engine_batch"] == s["running"]]
    budget = after.kv_budget_bytes
    ttft = summarize([r.ttft for r in results])
    e2e = summarize([r.end - r.sent for r in results])
    return {
        "peak_running": max((s["running"] for s in samples), default=0),
        "peak_engine_batch": max((s["engine_batch"] for s in samples), default=0),
        "mean_running_while_waiting": (sum(s["running"] for s in full) / len(full)) if full else 0.0,
        "tok_s": tokens / wall, "output_tokens": tokens, "wall_s": wall,
        "preemptions": after.preemptions - before.preemptions,
        "evictions": after.evictions - before.evictions,
        "blocks_total": after.blocks_total, "kv_budget_bytes": after.kv_budget_bytes,
        "ttft_p50_ms": ttft.p50 * 1e3, "ttft_p99_ms": ttft.p99 * 1e3,
        "e2e_p50_s": e2e.p50, "e2e_p99_s": e2e.p99,
        "mem_samples": len(full),
        "mem_ratio_max": max(ratios, default=float("nan")),
        "mem_ratio_p50": summarize(ratios).p50, "mem_ratio_p90": summarize(ratios).p90,
        "mem_ratio_steady_p50": summarize(steady).p50, "mem_ratio_steady_max": summarize(steady).max,
        "mem_share_over_budget": sum(s["real_kv_bytes"] > budget for s in full) / max(1, len(full)),
        "mem_real_max_bytes": max((s["real_kv_bytes"] for s in full), default=0),
        "mem_books_max_bytes": max((s["kv_bytes"] for s in full), default=0),
        "idle_after": {"running": after.running, "waiting": after.waiting,
                       "engine_batch": after.engine_batch, "blocks_used": after.blocks_used},
        "check": check_results(results, len(work)),
        "outputs": {r.key: r.token_ids for r in results},
        "lengths": sorted(len(r.token_ids) for r in results),
        "trace": samples[:: max(1, len(samples) // 2000)],  # the JSON's copy: at most ~2000
    }


def part_b(args: argparse.Namespace, vocab: int, weights_bytes: int) -> dict[str, Any]:
    rng = random.Random(args.seed + 1)
    stops = tuple(sorted(rng.sample(range(3, vocab), args.stop_tokens)))
    stop_strings = tuple(x for x in args.stop_strings.split(",") if x)
    work = []
    for i in range(args.requests):
        length = rng.randint(args.prompt_min, args.prompt_max)
        prompt = [rng.randrange(3, vocab) for _ in range(length)]
        params = SamplingParams(max_tokens=args.b_max_tokens, temperature=1.0, seed=args.seed * 1000 + i,
                                stop_token_ids=stops, stop=stop_strings)
        work.append((prompt, params))
    memory = str(weights_bytes + int(args.budget_mib * 2**20))
    runs: dict[str, dict[str, Any]] = {}
    for mode in ("reserve", "on-demand"):
        config = make_config(args, max_batch=args.max_batch, memory=memory, mode=mode)
        r = anyio.run(modes_run, config, args, vocab, work)
        runs[mode] = r
        print(f"  (b) {mode}: peak running {r['peak_running']}, {r['tok_s']:.0f} tok/s, "
              f"preemptions {r['preemptions']}, ok {r['check']['ok']}", flush=True)
    res, ond = runs["reserve"], runs["on-demand"]
    differing = sorted(k for k in res["outputs"] if res["outputs"][k] != ond["outputs"].get(k))
    first_diff = []
    for k in differing[:5]:
        a, b = res["outputs"][k], ond["outputs"].get(k, [])
        at = next((j for j, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))
        first_diff.append({"request": k, "len_reserve": len(a), "len_on_demand": len(b), "first_diff_at": at})
    for r in runs.values():
        r.pop("outputs")
    ratio = ond["peak_running"] / max(1, res["peak_running"])
    return {
        "runs": runs, "memory": memory, "budget_bytes": int(args.budget_mib * 2**20),
        "stop_token_ids": list(stops),
        "summary": {"peak_ratio": ratio, "throughput_ratio": ond["tok_s"] / res["tok_s"],
                    "mean_running_while_waiting_ratio":
                        ond["mean_running_while_waiting"] / max(1e-9, res["mean_running_while_waiting"]),
                    "outputs_identical": not differing, "outputs_differing": len(differing),
                    "first_differences": first_diff,
                    "mem_ratio_max": max(res["mem_ratio_max"], ond["mem_ratio_max"])},
        "target_peak_ratio": 1.5, "target_met": ratio >= 1.5,
    }


# ---- (c) sessions ----------------------------------------------------------------------------
async def session_run(config: SchedulerConfig, args: argparse.Namespace, vocab: int,
                      user_turns: list[list[int]], use_session: bool) -> dict[str, Any]:
    params = SamplingParams(max_tokens=args.c_max_tokens, temperature=0.0, ignore_eos=True)
    turns: list[dict[str, Any]] = []
    async with Scheduler(config) as sched:
        await warm_up(sched, random.Random(args.seed + 99), vocab, 64)
        before = sched.stats()
        prompt: list[int] = []
        for k, user in enumerate(user_turns):
            prompt = prompt + user
            r = await one_request(sched, k, prompt, params, session="chat-0" if use_session else None)
            turns.append({"turn": k + 1, "prompt_tokens": len(prompt), "ttft_ms": r.ttft * 1e3,
                          "e2e_ms": (r.end - r.sent) * 1e3, "ok": r.finals == 1 and r.finish_reason == "length",
                          "output": r.token_ids})
            prompt = prompt + r.token_ids
        after = sched.stats()
        dropped = await sched.drop_session("chat-0") if use_session else None
        idle = sched.stats()
    return {"turns": turns, "session_hits": after.session_hits - before.session_hits,
            "prefix_hit_tokens": after.prefix_hit_tokens - before.prefix_hit_tokens,
            "dropped": dropped, "blocks_cached_after_drop": idle.blocks_cached,
            "blocks_used_after": idle.blocks_used}


def part_c(args: argparse.Namespace, vocab: int) -> dict[str, Any]:
    rng = random.Random(args.seed + 2)
    user_turns = [[rng.randrange(3, vocab) for _ in range(args.user_tokens + rng.randrange(-8, 9))]
                  for _ in range(args.turns)]
    runs: dict[str, dict[str, Any]] = {}
    for name, session, prefix in (("session", True, True), ("no-session", False, True),
                                  ("no-session, no prefix cache", False, False)):
        config = make_config(args, max_batch=8, prefix_cache=prefix)
        runs[name] = anyio.run(session_run, config, args, vocab, user_turns, session)
        ttfts = [t["ttft_ms"] for t in runs[name]["turns"]]
        print(f"  (c) {name}: TTFT per turn (ms) {' '.join(f'{t:.0f}' for t in ttfts)}; "
              f"session hits {runs[name]['session_hits']}", flush=True)
    outs = {name: [t.pop("output") for t in r["turns"]] for name, r in runs.items()}
    base = outs["no-session"]
    later = slice(1, None)  # turn 1 has nothing to reuse
    ttft = {name: [t["ttft_ms"] for t in r["turns"]] for name, r in runs.items()}
    return {
        "runs": runs,
        "summary": {
            "outputs_identical": all(o == base for o in outs.values()),
            "turns_differing": {n: sum(a != b for a, b in zip(o, base, strict=True)) for n, o in outs.items()},
            "ttft_mean_turns_2_on_ms": {n: sum(v[later]) / len(v[later]) for n, v in ttft.items()},
            "last_turn_ratio_session_over_no_session": ttft["session"][-1] / ttft["no-session"][-1],
            "last_turn_ratio_session_over_no_cache":
                ttft["session"][-1] / ttft["no-session, no prefix cache"][-1],
        },
    }


# ---- table, JSON, PNG ------------------------------------------------------------------------
def print_table(args: argparse.Namespace, out: dict[str, Any]) -> None:
    print(f"\n{args.model}, block_tokens {args.block_tokens}")
    if "a" in out:
        a = out["a"]
        print(f"\n(a) prefix reuse: {args.users} users, {args.system_tokens}-token shared prompt + "
              f"~{args.suffix_tokens} own, {args.a_max_tokens} tokens greedy")
        print(f"{'run':<18} {'TTFT p50':>9} {'TTFT p99':>9} {'hit tokens':>11} {'hit rate':>9} {'wall s':>7}")
        for name, r in a["runs"].items():
            rate = r["prefix_hit_tokens"] / r["prefix_query_tokens"] if r["prefix_query_tokens"] else 0.0
            print(f"{name:<18} {r['ttft_p50_ms']:>7.0f}ms {r['ttft_p99_ms']:>7.0f}ms "
                  f"{r['prefix_hit_tokens']:>11} {rate:>9.1%} {r['wall_s']:>7.2f}")
        for arrival, s in a["summary"].items():
            print(f"{arrival}: reuse/no-reuse TTFT p50 {s['p50_ratio']:.3f}, p99 {s['p99_ratio']:.3f}; "
                  f"outputs identical: {s['outputs_identical']}")
        print(f"target p50 ratio <= 0.3: {'MET' if a['target_met'] else 'NOT MET'}")
    if "b" in out:
        b = out["b"]
        print(f"\n(b) memory modes: KV budget {args.budget_mib} MiB ({b['runs']['reserve']['blocks_total']} "
              f"blocks), max_batch {args.max_batch}, {args.requests} requests, prompts "
              f"{args.prompt_min}-{args.prompt_max}, max_tokens {args.b_max_tokens}, T=1 seeded, "
              f"{args.stop_tokens} stop ids")
        print(f"{'mode':<10} {'peak run':>8} {'peak eng':>8} {'tok/s':>7} {'preempt':>7} {'wall s':>7} "
              f"{'mean run':>8} {'TTFT p50':>9} {'e2e p99':>8} {'real/books p50/p90/max':>22} {'lost':>5} "
              f"{'1 final':>7}")
        for mode, r in b["runs"].items():
            c = r["check"]
            print(f"{mode:<10} {r['peak_running']:>8} {r['peak_engine_batch']:>8} {r['tok_s']:>7.0f} "
                  f"{r['preemptions']:>7} {r['wall_s']:>7.1f} {r['mean_running_while_waiting']:>8.1f} "
                  f"{r['ttft_p50_ms']:>7.0f}ms {r['e2e_p99_s']:>7.1f}s "
                  f"{r['mem_ratio_p50']:>8.2f}/{r['mem_ratio_p90']:.2f}/{r['mem_ratio_max']:.2f} {c['lost']:>5} "
                  f"{'yes' if c['ok'] else 'NO':>7}")
        s = b["summary"]
        lengths = b["runs"]["reserve"]["lengths"]
        print(f"output lengths: median {lengths[len(lengths) // 2]}, max {lengths[-1]}; "
              f"on-demand/reserve peak {s['peak_ratio']:.2f}x, mean while requests wait "
              f"{s['mean_running_while_waiting_ratio']:.2f}x, tok/s {s['throughput_ratio']:.2f}x; "
              f"token ids identical in both modes: {s['outputs_identical']} ({s['outputs_differing']} differ)")
        for mode, r in b["runs"].items():
            print(f"{mode}: MLX active - weights over books kv_bytes while requests wait: p50 "
                  f"{r['mem_ratio_p50']:.2f}, max {r['mem_ratio_max']:.2f}; without an admission in flight "
                  f"p50 {r['mem_ratio_steady_p50']:.2f}, max {r['mem_ratio_steady_max']:.2f}; above the "
                  f"KV budget in {r['mem_share_over_budget']:.0%} of samples (max "
                  f"{r['mem_real_max_bytes'] / 2**20:.1f} MiB against {r['kv_budget_bytes'] / 2**20:.1f})")
        print(f"target peak ratio >= 1.5: {'MET' if b['target_met'] else 'NOT MET'}")
    if "c" in out:
        c = out["c"]
        print(f"\n(c) sessions: {args.turns} turns, ~{args.user_tokens} new tokens a turn, "
              f"{args.c_max_tokens} tokens greedy; TTFT ms per turn")
        names = list(c["runs"])
        print(f"{'turn':>4} {'prompt':>6} " + " ".join(f"{n:>27}" for n in names))
        for k in range(args.turns):
            row = [c["runs"][n]["turns"][k] for n in names]
            print(f"{k + 1:>4} {row[0]['prompt_tokens']:>6} " + " ".join(f"{t['ttft_ms']:>27.1f}" for t in row))
        s = c["summary"]
        print("session hits: " + ", ".join(f"{n} {c['runs'][n]['session_hits']}" for n in names)
              + f"; outputs identical: {s['outputs_identical']}; last turn session/no-session "
              f"{s['last_turn_ratio_session_over_no_session']:.2f}, session/no-cache "
              f"{s['last_turn_ratio_session_over_no_cache']:.2f}")


def plot(out: dict[str, Any], path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        import matplotlib.ticker
    except ImportError:
        print("(matplotlib not installed: no PNG)")
        return
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    ax = axes[0]
    if "a" in out:
        for name, r in out["a"]["runs"].items():
            ys = r["ttfts_ms"]
            ax.plot(ys, [(i + 1) / len(ys) for i in range(len(ys))], label=name, drawstyle="steps-post")
        ax.set_xscale("log")
        ax.xaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda v, _: f"{v:g}"))
        ax.set_xlabel("TTFT ms (log)")
        ax.set_ylabel("share of requests")
        ax.legend(fontsize=8)
    ax.set_title("(a) prefix reuse: TTFT CDF")
    ax = axes[1]
    if "b" in out:
        for mode, r in out["b"]["runs"].items():
            tr = r["trace"]
            ax.plot([s["t"] for s in tr], [s["running"] for s in tr], label=f"{mode} running")
        ax.set_xlabel("seconds")
        ax.set_ylabel("concurrent sequences (running)")
        ax.legend(fontsize=8, loc="upper left")
        mem = ax.twinx()  # MLX's memory against the books, thin
        for i, (mode, r) in enumerate(out["b"]["runs"].items()):
            tr = r["trace"]
            color = f"C{i}"
            mem.plot([s["t"] for s in tr], [s["real_kv_bytes"] / 2**20 for s in tr], color=color,
                     lw=0.6, alpha=0.5, label=f"{mode}: MLX active - weights")
            mem.plot([s["t"] for s in tr], [s["kv_bytes"] / 2**20 for s in tr], color=color, lw=0.6,
                     ls="--", alpha=0.7, label=f"{mode}: books kv_bytes")
        budget = out["b"]["budget_bytes"] / 2**20
        mem.axhline(budget, color="black", lw=0.8, ls=":", label="KV budget")
        mem.set_ylabel("MiB")
        mem.set_ylim(0, None)
        mem.legend(fontsize=6, loc="lower center", ncol=2)
    ax.set_title("(b) same KV budget: reserve vs on-demand")
    ax = axes[2]
    if "c" in out:
        for name, r in out["c"]["runs"].items():
            ax.plot([t["turn"] for t in r["turns"]], [t["ttft_ms"] for t in r["turns"]], marker="o", label=name)
        ax.set_xlabel("turn")
        ax.set_ylabel("TTFT ms")
        ax.legend(fontsize=8)
    ax.set_title("(c) sessions: TTFT per turn")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=90)
    print(f"wrote {path}")


def _kv_layers() -> Any:
    """benchmarks/kv_layers.py, beside this script (run as a file, not a package)."""
    spec = importlib.util.spec_from_file_location("kv_layers", Path(__file__).with_name("kv_layers.py"))
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="synthetic:small")
    ap.add_argument("--cache-dir", default=None, help="where synthetic models are built")
    ap.add_argument("--parts", default="a,b,c,d", help="comma list of a, b, c, d")
    ap.add_argument("--quick", action="store_true", help="small counts: a smoke run well under a minute")
    ap.add_argument("--block-tokens", type=int, default=64)
    ap.add_argument("--seed", type=int, default=0)
    g = ap.add_argument_group("(a) prefix reuse")
    g.add_argument("--users", type=int, default=64)
    g.add_argument("--system-tokens", type=int, default=1024)
    g.add_argument("--suffix-tokens", type=int, default=32)
    g.add_argument("--a-max-tokens", type=int, default=16)
    g.add_argument("--poisson-rate", type=float, default=0.0, help="also an open-loop run (requests/s)")
    g = ap.add_argument_group("(b) memory modes")
    g.add_argument("--budget-mib", type=float, default=12.0, help="KV budget: [kvpool] memory less the weights")
    g.add_argument("--max-batch", type=int, default=128)
    g.add_argument("--requests", type=int, default=192)
    g.add_argument("--prompt-min", type=int, default=16)
    g.add_argument("--prompt-max", type=int, default=160)
    g.add_argument("--b-max-tokens", type=int, default=512)
    g.add_argument("--stop-tokens", type=int, default=16,
                   help="random stop token ids, at most 16 (with EOS they set the mean output length)")
    g.add_argument("--stop-strings", default="", help="comma list of stop strings (shorter outputs)")
    g.add_argument("--poll-ms", type=float, default=5.0)
    g = ap.add_argument_group("(d) books per layer kind")
    g.add_argument("--d-requests", type=int, default=48)
    g.add_argument("--d-budget-mib", type=float, default=3.0)
    g = ap.add_argument_group("(c) sessions")
    g.add_argument("--turns", type=int, default=10)
    g.add_argument("--user-tokens", type=int, default=64)
    g.add_argument("--c-max-tokens", type=int, default=32)
    ap.add_argument("--out", default="benchmarks/results/kvpool.json")
    ap.add_argument("--png", default="docs/kvpool.png")
    args = ap.parse_args(argv)
    if args.quick:
        args.users, args.system_tokens, args.a_max_tokens = 16, 512, 8
        args.requests, args.budget_mib, args.max_batch, args.b_max_tokens = 32, 3.0, 64, 256
        args.turns, args.d_requests = 4, 12
    parts = [p.strip() for p in args.parts.split(",") if p.strip()]
    if not parts or any(p not in ("a", "b", "c", "d") for p in parts):
        ap.error(f"--parts: a comma list of a, b, c, d; got {args.parts!r}")
    configure_logging(level="warning")

    from workers.loading.models import load_model, model_info

    model, tokenizer = load_model(args.model, args.cache_dir)
    info = model_info(model, tokenizer, args.model)
    del model, tokenizer
    vocab = min(info.vocab_size, 32000)
    print(f"{args.model}: weights {info.weights_bytes} bytes, KV {info.kv_bytes_per_token} bytes/token",
          flush=True)

    started = time.perf_counter()
    out: dict[str, Any] = {}
    if "a" in parts:
        out["a"] = part_a(args, vocab)
    if "b" in parts:
        out["b"] = part_b(args, vocab, info.weights_bytes)
    if "c" in parts:
        out["c"] = part_c(args, vocab)
    layers = _kv_layers() if "d" in parts else None
    if layers is not None:
        out["d"] = layers.part_d(args.cache_dir, args.d_requests, args.d_budget_mib, args.seed)
    print_table(args, out)
    if layers is not None:
        layers.print_d(out["d"], args.d_requests, args.d_budget_mib)
    print(f"\ntotal {time.perf_counter() - started:.0f} s")
    path = Path(args.out)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"args": vars(args), "model": {
        "weights_bytes": info.weights_bytes, "kv_bytes_per_token": info.kv_bytes_per_token},
        "results": out, "date": time.strftime("%Y-%m-%d")}, indent=1))
    print(f"wrote {path}")
    if args.png:
        plot(out, Path(args.png))


if __name__ == "__main__":
    main()

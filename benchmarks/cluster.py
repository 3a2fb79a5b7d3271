"""Scale-out: N scheduler replicas on Ray Serve behind one port, through HTTP.

(a) Prefix routing: `--prefixes` distinct prefixes of `--prefix-tokens` tokens, each request one
    of them (uniform) plus a unique suffix; greedy, `--max-tokens` tokens, `--concurrency` in
    flight. Each replica's pool holds `--pool-blocks` blocks, so the working set (prefixes x
    blocks each) is 0.5, 1 and 2 pools (`--ratios`). Our router (2 replicas) against Serve-style
    power-of-two choices (2 replicas) and one replica: prefix hit rate (hit / queried prompt
    tokens, from every replica's stats) and TTFT p50/p99. Each ratio uses fresh prefixes and
    first warms them up once (not measured).
(b) Throughput: `--tp-requests` requests of `--tp-prompt-tokens` random tokens, `--tp-max-tokens`
    generated (ignore_eos), all at once, on 1 and on 2 replicas (each with every `--frontends`
    setting, "auto" by default: 1 and 2 processes on a host of 16 cores or more): generated
    tokens/s, the median of `--tp-repeat` rounds after an untimed one, and each Serve process's
    share of a core meanwhile. `--tp-pairs K` deploys one replica, then two, K times in turn, and
    prints each pair's ratio and their median.
(c) A replica killed mid-run: `--kill-requests` such requests at `--kill-concurrency` on 2
    replicas; `--kill-after` seconds in, SIGKILL to the replica holding the most. Every request's
    outcome (completed, an error event and its code, a broken stream, an HTTP status), which
    replica it was on, how long Serve takes to bring a replacement into the routing, and a
    check afterwards that both replicas serve.

One local Ray for the whole run (127.0.0.1, no dashboard); each variant is a fresh Serve app.
A table on stdout and JSON (`--out`).

    python benchmarks/cluster.py [--model synthetic:tiny] [--parts a,b] [--quick]
    python benchmarks/cluster.py --parts b --model synthetic:qwen2.5-0.5b --device cuda \\
        --gpus-per-replica 0.5        # 2 replicas sharing one GPU
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import multiprocessing
import os
import random
import signal
import statistics
import subprocess
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any

import anyio
import httpx
import msgspec

from scheduler import Scheduler, SchedulerConfig
from scheduler.cli.bench.mlxlm import free_port
from scheduler.serving.cluster.app import APP_NAME, deploy, pick_device, start_ray

sys.path.insert(0, str(Path(__file__).resolve().parent))
from placement import Placement  # noqa: E402
from procstat import TICK, read_stat  # noqa: E402

if TYPE_CHECKING:
    from collections.abc import Iterable

BASE = """
[model]
path = "{model}"
{model_keys}[kvpool]
memory = {memory}
block_tokens = {block_tokens}
[worker]
max_batch = {max_batch}
{worker_keys}[cluster]
num_cpus = {cpus}
device = "{device}"
gpus_per_replica = {gpus}
routing = "{routing}"
stats_period_s = 0.2
frontends = {frontends}
"""


def config(args: argparse.Namespace, memory: int | str, routing: str = "cache-aware",
           frontends: int | str = 1) -> SchedulerConfig:
    mem = f'"{memory}"' if isinstance(memory, str) else str(memory)
    text = BASE.format(model=args.model, memory=mem, block_tokens=args.block_tokens,
                       max_batch=args.max_batch, cpus=args.cpus_per_replica, device=args.device,
                       gpus=args.gpus_per_replica, routing=routing,
                       frontends=f'"{frontends}"' if isinstance(frontends, str) else frontends,
                       model_keys="".join(f"{item}\n" for item in args.model_key),
                       worker_keys="".join(f"{item}\n" for item in args.worker_key))
    text += "".join(f"{item}\n" for item in args.cluster)  # more [cluster] keys, TOML values
    return SchedulerConfig.from_toml(text)


async def model_facts(args: argparse.Namespace) -> tuple[int, int, int]:
    """(weights bytes, bytes per block, vocab size), from a scheduler in this process."""
    async with Scheduler(config(args, "4GiB")) as s:  # the weights of the shapes it runs, and room
        st = s.stats()
        return st.weights_bytes, st.kv_budget_bytes // st.blocks_total, s.model.info.vocab_size


def random_prompts(rng: random.Random, n: int, tokens: int, vocab: int) -> list[list[int]]:
    """`n` prompts of `tokens` random ids (above the special ids at the bottom of a vocabulary)."""
    return [[rng.randrange(10, vocab) for _ in range(tokens)] for _ in range(n)]


def http_client(url: str, timeout: float, connections: int | None = None) -> httpx.AsyncClient:
    """At most `connections` streams open at once (None: no cap). httpx's own default, 100, held
    every stream past the 100th back, whatever the replicas could take."""
    return httpx.AsyncClient(base_url=url, timeout=timeout, limits=httpx.Limits(max_connections=connections),
                             trust_env=False)


async def health(client: httpx.AsyncClient) -> dict[str, Any]:
    return dict((await client.get("/health")).json())


def percentile(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


async def outcome(client: httpx.AsyncClient, prompt: list[int], max_tokens: int,
                  ignore_eos: bool = True) -> tuple[str, float, int, str]:
    """(how it ended, TTFT, tokens generated, replica) of one streamed completion. It ended "ok",
    with an error event's code, "broken" (the stream stopped with neither [DONE] nor an error, or
    the connection failed), or "http <status>: <body>"."""
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "ignore_eos": ignore_eos, "stream_options": {"include_usage": True}}
    t0 = time.perf_counter()
    ended, ttft, tokens, replica = "broken", float("nan"), 0, "?"
    try:
        async with client.stream("POST", "/v1/completions", json=body) as reply:
            if reply.status_code != 200:
                return f"http {reply.status_code}: {(await reply.aread())[:200]!r}", ttft, 0, "?"
            replica = reply.headers.get("x-replica", "?")
            error = None
            async for line in reply.aiter_lines():
                if line == "data: [DONE]":
                    ended = error or "ok"
                elif line.startswith("data:"):
                    if ttft != ttft:
                        ttft = time.perf_counter() - t0
                    event = msgspec.json.decode(line[5:])
                    if "error" in event:
                        error = str(event["error"].get("code", "error"))
                    elif event.get("usage"):
                        tokens = int(event["usage"]["completion_tokens"])
    except httpx.HTTPError as exc:
        ended = f"broken: {exc!r}"
    return ended, ttft, tokens, replica


async def one(client: httpx.AsyncClient, prompt: list[int], max_tokens: int,
              ignore_eos: bool = False) -> tuple[float, int, str]:
    """(TTFT, generated tokens, replica) of one streamed completion; a refusal or a failed
    connection raises."""
    ended, ttft, tokens, replica = await outcome(client, prompt, max_tokens, ignore_eos)
    if ended.startswith(("http ", "broken: ")):
        raise RuntimeError(ended)
    return ttft, tokens, replica


async def run_all(client: httpx.AsyncClient, prompts: list[list[int]], max_tokens: int,
                  concurrency: int, ignore_eos: bool = False,
                  spans: list[tuple[float, float, str]] | None = None) -> list[tuple[float, int, str]]:
    """Each prompt's (TTFT, tokens, replica), `concurrency` at a time; `spans` receives each
    request's (start, end, replica) on the monotonic clock."""
    sem = asyncio.Semaphore(concurrency)

    async def go(p: list[int]) -> tuple[float, int, str]:
        async with sem:
            t0 = time.perf_counter()
            out = await one(client, p, max_tokens, ignore_eos)
            if spans is not None:
                spans.append((t0, time.perf_counter(), out[2]))
            return out

    return list(await asyncio.gather(*(go(p) for p in prompts)))


def imbalance(spans: list[tuple[float, float, str]], replicas: int) -> tuple[float, int]:
    """How unevenly the requests in flight were spread over `replicas` replicas while they ran:
    the time-weighted mean, and the largest, difference between the most and the fewest in
    flight on one (a replica that served none counts, with none). A router that keeps each
    prefix on one replica can pile the requests of a few hot prefixes on it while another
    idles; this shows it from the client."""
    if replicas < 2 or not spans:
        return 0.0, 0
    events = sorted([(t0, 1, r) for t0, _, r in spans] + [(t1, -1, r) for _, t1, r in spans])
    now = dict.fromkeys(sorted({r for _, _, r in spans}), 0)
    idle = len(now) < replicas  # a replica that served nothing: the fewest is always 0
    weighted = total = 0.0
    worst = 0
    for (t, step, r), nxt in zip(events, events[1:] + [events[-1]], strict=True):
        now[r] += step
        gap = max(now.values()) - (0 if idle else min(now.values()))
        worst = max(worst, gap)
        weighted += gap * (nxt[0] - t)
        total += nxt[0] - t
    return (weighted / total if total else 0.0), worst


def _client_round(url: str, prompts: list[list[int]], max_tokens: int,
                  connections: int | None) -> list[tuple[float, int, str]]:
    """One client process's share of a round (run in a pool of processes)."""
    async def go() -> list[tuple[float, int, str]]:
        async with http_client(url, 600, connections) as client:
            return await run_all(client, prompts, max_tokens, len(prompts), ignore_eos=True)
    return asyncio.run(go())


async def spread_round(pool: Any, url: str, prompts: list[list[int]], max_tokens: int,
                       connections: int | None, clients: int) -> list[tuple[float, int, str]]:
    """A round's requests sent by `clients` processes at once: one Python client process
    parsing every stream caps the tokens/s it can see (one core busy at ~2,000 tok/s)."""
    loop = asyncio.get_running_loop()
    share = None if not connections else max(1, connections // clients)
    outs = await asyncio.gather(*(
        loop.run_in_executor(pool, _client_round, url, prompts[i::clients], max_tokens, share)
        for i in range(clients)))
    return [o for out in outs for o in out]


async def counters(client: httpx.AsyncClient) -> tuple[int, int]:
    """(prompt tokens queried, prompt tokens hit) summed over the replicas."""
    body = await health(client)
    return (sum(r["stats"]["prefix_query_tokens"] for r in body["replicas"]),
            sum(r["stats"]["prefix_hit_tokens"] for r in body["replicas"]))


async def part_a(args: argparse.Namespace, url: str, facts: tuple[int, int, int]) -> list[dict[str, Any]]:
    from ray import serve

    weights, per_block, vocab = facts
    memory = weights + args.pool_blocks * per_block
    blocks_per_prefix = args.prefix_tokens // args.block_tokens
    rows: list[dict[str, Any]] = []
    variants = [("ours", 2, "cache-aware"), ("power-of-two", 2, "power-of-two"), ("one replica", 1, "cache-aware")]
    for name, replicas, routing in variants:
        cfg = config(args, memory, routing)
        await asyncio.to_thread(deploy, cfg, replicas, device=pick_device(cfg.cluster), listen=args.listen)
        async with http_client(url, 300) as client:
            for ratio in args.ratios:
                rng = random.Random(hash((ratio, 7)))  # the same prompts for every variant
                k = max(1, round(ratio * args.pool_blocks / blocks_per_prefix))
                prefixes = random_prompts(rng, k, args.prefix_tokens, vocab)

                def prompt(p: list[int], rng: random.Random = rng) -> list[int]:
                    return p + random_prompts(rng, 1, args.suffix_tokens, vocab)[0]

                await run_all(client, [prompt(p) for p in prefixes], args.max_tokens, args.concurrency)
                q0, h0 = await counters(client)
                picks = [prefixes[rng.randrange(k)] for _ in range(args.requests)]
                t0 = time.perf_counter()
                spans: list[tuple[float, float, str]] = []
                out = await run_all(client, [prompt(p) for p in picks], args.max_tokens, args.concurrency,
                                    spans=spans)
                wall = time.perf_counter() - t0
                gap_mean, gap_max = imbalance(spans, replicas)
                q1, h1 = await counters(client)
                ttfts = [o[0] * 1000 for o in out]
                spread: dict[str, int] = {}
                for o in out:
                    spread[o[2]] = spread.get(o[2], 0) + 1
                rows.append({"part": "a", "variant": name, "replicas": replicas, "ratio": ratio,
                             "prefixes": k, "requests": len(out), "hit_rate": (h1 - h0) / max(1, q1 - q0),
                             "ttft_p50_ms": statistics.median(ttfts), "ttft_p99_ms": percentile(ttfts, 0.99),
                             "wall_s": wall, "per_replica": sorted(spread.values()),
                             "in_flight_gap_mean": gap_mean, "in_flight_gap_max": gap_max})
                print_row(rows[-1])
        serve.delete(APP_NAME)
    return rows


# Which process caps the replicas: CPU seconds of each of Serve's processes on this host, from
# /proc (Linux; elsewhere only the client's own).
ROLES = {"ray::ProxyActor": "proxy", ":Frontend": "frontend", ":SchedulerReplica": "replica"}


def cpu_seconds() -> dict[str, float]:
    out = {"client": sum(os.times()[:2])}
    for proc in Path("/proc").glob("[0-9]*"):
        try:
            cmd = (proc / "cmdline").read_bytes().split(b"\0")[0].decode(errors="replace")
            role = next((r for k, r in ROLES.items() if k in cmd), None)
            if role is not None:
                user, system, _ = read_stat(proc / "stat")
                out[f"{role} {proc.name}"] = (user + system) / TICK
        except (OSError, ValueError, IndexError):
            continue  # gone meanwhile
    return out


async def record(args: argparse.Namespace, tag: str, processes: Iterable[str]) -> list[asyncio.subprocess.Process]:
    """With `--py-spy`: sample each Serve process and the client for `--py-spy-seconds`, as
    collapsed stacks beside `--out` (where the Ray path's time goes, process by process)."""
    if not args.py_spy:
        return []
    stem = Path(args.out).with_suffix("")
    spies = []
    for name in processes:  # "role pid", as `cpu_seconds` names them; the client has no pid
        role, _, pid = name.partition(" ")
        pid = pid or str(os.getpid())
        spies.append(await asyncio.create_subprocess_exec(
            args.py_spy, "record", "--pid", pid, "--duration", str(args.py_spy_seconds), "--rate", "200",
            "--format", "raw", "--nonblocking", "--threads", "--output", f"{stem}-{tag}-{role}-{pid}.txt",
            stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.DEVNULL))
    return spies


def gpus_of(names: dict[str, float]) -> dict[str, list[int]]:
    """Which GPUs hold a CUDA context of each Serve process (from `nvidia-smi`; {} without one):
    each replica should hold only its own."""
    try:
        smi = ["nvidia-smi", "--format=csv,noheader"]
        index = dict(line.split(", ") for line in subprocess.run(
            [*smi, "--query-gpu=uuid,index"], capture_output=True, text=True, timeout=10).stdout.splitlines())
        apps = subprocess.run([*smi, "--query-compute-apps=pid,gpu_uuid"], capture_output=True, text=True,
                              timeout=10).stdout.splitlines()
    except (OSError, subprocess.SubprocessError, ValueError):
        return {}
    held: dict[str, list[int]] = {}
    for line in apps:
        pid, _, uuid = line.partition(", ")
        for name in names:
            if name.endswith(f" {pid}") and uuid in index:
                held.setdefault(name, []).append(int(index[uuid]))
    return held


def busy(before: dict[str, float], after: dict[str, float], wall: float) -> dict[str, float]:
    """Each process's share of one core over `wall` seconds, busiest first."""
    shares = {k: (after[k] - before.get(k, 0.0)) / wall for k in after}
    return dict(sorted(shares.items(), key=lambda kv: -kv[1]))


def frontends_arg(text: str) -> int | str:
    if text == "auto":
        return text
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: a count of frontends (1 or more) or \"auto\"")
    return int(text)


def pairs_arg(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: a count of pairs (1 or more)")
    return int(text)


async def part_b(args: argparse.Namespace, url: str, vocab: int) -> list[dict[str, Any]]:
    from ray import serve

    rows: list[dict[str, Any]] = []
    rng = random.Random(3)

    def batch() -> list[list[int]]:  # fresh prompts each round: no prefix hits between rounds
        return random_prompts(rng, args.tp_requests, args.tp_prompt_tokens, vocab)

    conns: list[int] = args.connections
    for pair, replicas, frontends in [(k, r, f) for k in range(args.tp_pairs) for r in (1, 2) for f in args.frontends]:
        cfg = config(args, args.tp_memory, frontends=frontends)
        await asyncio.to_thread(deploy, cfg, replicas, device=pick_device(cfg.cluster), listen=args.listen)
        rounds: dict[int, list[float]] = {c: [] for c in conns}
        ttfts: dict[int, list[float]] = {c: [] for c in conns}
        split: collections.Counter[str] = collections.Counter()
        clients = [http_client(url, 600, c or None) for c in conns]
        pool = (ProcessPoolExecutor(args.clients, mp_context=multiprocessing.get_context("spawn"))
                if args.clients > 1 else None)
        try:
            # A whole untimed round first, as long as the timed ones: their shapes are then
            # compiled already (on CUDA, a first use of a shape costs seconds). With 8 tokens a
            # request it left every KV length past 136 to the first timed round, which on a fresh
            # host ran at 0.55-0.69x the next two (SmolLM2, 2026-11-27, twice; not yet run since).
            if pool is None:
                await run_all(clients[0], batch(), args.tp_max_tokens, args.tp_requests, ignore_eos=True)
            else:
                await spread_round(pool, url, batch(), args.tp_max_tokens, None, args.clients)
            cpu0, start = cpu_seconds(), time.perf_counter()
            where = Placement({k: int(k.split()[1]) for k in cpu0 if k.startswith("replica ")})
            where.start()
            for i in range(args.tp_repeat):
                for j, (c, client) in enumerate(zip(conns, clients, strict=True)):  # interleaved
                    t0 = time.perf_counter()
                    spies = await record(args, f"{replicas}rep{frontends}fe", cpu0) if (i, j) == (1, 0) else []
                    if pool is None:
                        out = await run_all(client, batch(), args.tp_max_tokens, args.tp_requests, ignore_eos=True)
                    else:
                        out = await spread_round(pool, url, batch(), args.tp_max_tokens, c or None, args.clients)
                    rounds[c].append(sum(o[1] for o in out) / (time.perf_counter() - t0))
                    ttfts[c] += [o[0] for o in out]
                    for spy in spies:
                        await spy.wait()
                    split.update(o[2] for o in out)
            cores = busy(cpu0, cpu_seconds(), time.perf_counter() - start)
            await where.stop()
            routing = (await health(clients[0])).get("routing", {})
            gpus = gpus_of(cores) if args.device == "cuda" else {}
        finally:
            for client in clients:
                await client.aclose()
            if pool is not None:
                pool.shutdown()
        for c in conns:
            open_at_once = f", at most {c} open" if c else ", all open"
            rows.append({"part": "b", "variant": f"{replicas} replica(s)"
                         + (f", {cfg.cluster.frontend_count(replicas)} frontend(s)"
                            + (" (auto)" if frontends == "auto" else "")
                            if len(args.frontends) > 1 or frontends == "auto" else "")
                         + (open_at_once if len(conns) > 1 else ""),
                         "replicas": replicas, "frontends": frontends, "connections": c or None, "pair": pair,
                         "frontend_processes": cfg.cluster.frontend_count(replicas),
                         "requests": args.tp_requests, "tokens": args.tp_requests * args.tp_max_tokens,
                         "rounds_tokens_per_s": rounds[c], "tokens_per_s": statistics.median(rounds[c]),
                         "ttft_p50_ms": 1e3 * percentile(ttfts[c], 0.5),
                         "ttft_p99_ms": 1e3 * percentile(ttfts[c], 0.99),
                         "cores_busy": cores, "requests_per_replica": sorted(split.values(), reverse=True),
                         "routing": routing, "gpus": gpus, "placement": where.summary()})
            print_row(rows[-1])
        serve.delete(APP_NAME)
    for line in speedups(rows, args.tp_pairs):
        print(line)
    return rows


def speedups(rows: list[dict[str, Any]], pairs: int) -> list[str]:
    """Each two-replica row's ratio to the one-replica row of its pair with the same frontends
    and connections (`speedup`), and to the one with the fewest frontends; the lines to print,
    with each setting's median over the pairs."""
    # Each pair on its own: one replica's speed drifts between deployments (SmolLM2 on an H200:
    # 6,440-9,829 tok/s on two machines) by more than two replicas' did, so a ratio of two
    # deployments apart says little; several pairs, and the median of their ratios, say more.
    lines = []
    ones = {(r["pair"], r["frontends"], r["connections"]): r for r in rows if r["replicas"] == 1}
    for two in (r for r in rows if r["replicas"] == 2):
        one = ones[two["pair"], two["frontends"], two["connections"]]
        two["speedup"] = two["tokens_per_s"] / one["tokens_per_s"]
        base = min((r for (k, _, c), r in ones.items() if k == two["pair"] and c == two["connections"]),
                   key=lambda r: r["frontend_processes"], default=one)
        two["speedup_vs_fewest_frontends"] = two["tokens_per_s"] / base["tokens_per_s"]
        which = f", pair {two['pair'] + 1} of {pairs}" if pairs > 1 else ""
        lines.append(f"  {two['variant']} / {one['variant']} tokens/s (medians){which}: "
                     f"{two['speedup']:.2f}x; / {base['variant']}: {two['speedup_vs_fewest_frontends']:.2f}x")
    if pairs > 1:
        for key in sorted({(r["frontends"], r["connections"]) for r in rows if r["replicas"] == 2}, key=str):
            ratios = [r["speedup"] for r in rows if r["replicas"] == 2 and (r["frontends"], r["connections"]) == key]
            lines.append(f"  pairs, frontends {key[0]}, connections {key[1] or 'all'}: "
                         f"{', '.join(f'{x:.2f}' for x in ratios)}x; median {statistics.median(ratios):.2f}x")
    return lines


async def replacement(client: httpx.AsyncClient, before: set[str], victim: str, limit_s: float) -> float:
    """Seconds until two replicas answer /health again, the victim not among them (nan: not within `limit_s`)."""
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < limit_s:
        now = {r["replica"] for r in (await health(client))["replicas"]}
        if len(now) == len(before) and victim not in now:
            return time.perf_counter() - t0
        await asyncio.sleep(0.5)
    return float("nan")


async def part_c(args: argparse.Namespace, url: str, vocab: int) -> list[dict[str, Any]]:
    from ray import serve

    rng = random.Random(5)
    prompts = random_prompts(rng, args.kill_requests + 32, args.tp_prompt_tokens, vocab)
    prompts, checks = prompts[:-32], prompts[-32:]
    cfg = config(args, args.tp_memory)
    await asyncio.to_thread(deploy, cfg, 2, device=pick_device(cfg.cluster), listen=args.listen)
    async with http_client(url, 600) as client:
        await run_all(client, prompts[:4], 4, 4)  # warm-up
        before = {r["replica"]: r["pid"] for r in (await health(client))["replicas"]}
        sem = asyncio.Semaphore(args.kill_concurrency)

        async def go(p: list[int]) -> tuple[str, int, str, float]:
            async with sem:
                ended, _, tokens, replica = await outcome(client, p, args.tp_max_tokens)
                return ended, tokens, replica, time.perf_counter()

        t0 = time.perf_counter()
        tasks = [asyncio.create_task(go(p)) for p in prompts]
        await asyncio.sleep(args.kill_after)
        in_flight = (await health(client))["in_flight"]
        victim = max(before, key=lambda r: in_flight.get(r, 0))
        os.kill(before[victim], signal.SIGKILL)
        killed = time.perf_counter()
        back = asyncio.create_task(replacement(client, set(before), victim, 300))
        out = await asyncio.gather(*tasks)
        wall = time.perf_counter() - t0
        back_s = await back
        after = await run_all(client, checks, 8, len(checks))
    ends = collections.Counter(f"{o[0]} ({'killed' if o[2] == victim else 'other'} replica)" for o in out)
    ok_after = [o for o in out if o[0] == "ok" and o[3] > killed]
    row = {"part": "c", "variant": "2 replicas, one killed", "replicas": 2, "requests": len(out),
           "kill_after_s": args.kill_after, "in_flight_at_kill": in_flight, "outcomes": dict(ends),
           # anything but a completion, or the killed replica's own error event
           "lost": sum(1 for o in out if o[0] != "ok" and (o[0], o[2]) != ("replica_failed", victim)),
           "replacement_s": back_s, "wall_s": wall,
           "tokens_per_s": sum(o[1] for o in out if o[0] == "ok") / wall,
           "tokens_per_s_after_kill": sum(o[1] for o in ok_after) / max(1e-9, max(o[3] for o in out) - killed),
           "check_per_replica": dict(collections.Counter(o[2] for o in after)),
           "check_tokens": sum(o[1] for o in after)}
    print_row(row)
    serve.delete(APP_NAME)
    return [row]


def print_row(r: dict[str, Any]) -> None:
    if r["part"] == "c":
        print(f"  {r['variant']}: {r['requests']} requests, in flight at the kill {r['in_flight_at_kill']}, "
              f"outcomes {r['outcomes']}, lost {r['lost']}; replacement in {r['replacement_s']:.1f} s; "
              f"{r['tokens_per_s']:.0f} tok/s overall, {r['tokens_per_s_after_kill']:.0f} after the kill; "
              f"afterwards {r['check_per_replica']}", flush=True)
    elif r["part"] == "a":
        print(f"  ratio {r['ratio']:<4} {r['variant']:<13} prefixes {r['prefixes']:>3}  hit {r['hit_rate']:6.1%}  "
              f"TTFT p50 {r['ttft_p50_ms']:7.1f} ms  p99 {r['ttft_p99_ms']:7.1f} ms  per replica {r['per_replica']}"
              f"  in flight, most - fewest: mean {r['in_flight_gap_mean']:.1f}, max {r['in_flight_gap_max']}",
              flush=True)
    else:
        each = ", ".join(f"{x:.0f}" for x in r["rounds_tokens_per_s"])
        print(f"  {r['variant']:<13} {r['requests']} requests x {r['tokens'] // r['requests']} tokens: "
              f"median {r['tokens_per_s']:.0f} tok/s (rounds: {each}); a round "
              f"{r['tokens'] / r['tokens_per_s']:.1f} s, TTFT p50 / p99 {r['ttft_p50_ms']:.0f} / "
              f"{r['ttft_p99_ms']:.0f} ms", flush=True)
        print("    cores busy: " + ", ".join(f"{k} {v:.2f}" for k, v in r["cores_busy"].items())
              + f"; requests per replica {r['requests_per_replica']}, routing {r['routing']}"
              + (f"; GPUs held {r['gpus']}" if r.get("gpus") else ""), flush=True)
        if r.get("placement"):
            print(f"    busiest threads' CPUs (samples): {r['placement']}", flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="synthetic:tiny")
    p.add_argument("--parts", default="a,b")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda", "mlx", "auto"])
    p.add_argument("--gpus-per-replica", type=float, default=1.0)
    p.add_argument("--cpus-per-replica", type=float, default=0.5)
    p.add_argument("--block-tokens", type=int, default=16)
    p.add_argument("--max-batch", type=int, default=16)
    p.add_argument("--pool-blocks", type=int, default=256, help="(a) each replica's pool, in blocks")
    p.add_argument("--prefix-tokens", type=int, default=128)
    p.add_argument("--suffix-tokens", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=4)
    p.add_argument("--ratios", type=float, nargs="+", default=[0.5, 1.0, 2.0])
    p.add_argument("--requests", type=int, default=160)
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument("--tp-requests", type=int, default=32)
    p.add_argument("--tp-prompt-tokens", type=int, default=64)
    p.add_argument("--tp-max-tokens", type=int, default=64)
    p.add_argument("--tp-memory", default="1GiB")
    p.add_argument("--connections", type=int, nargs="+", default=[0],
                   help="(b) the client's cap on open streams (0: none; httpx's default was 100); "
                        "several: each deployment's rounds interleave them")
    p.add_argument("--clients", type=int, default=1,
                   help="(b) client processes sending each round (one process's parsing caps what it sees)")
    p.add_argument("--tp-repeat", type=int, default=3, help="(b) timed rounds per deployment (the median)")
    p.add_argument("--tp-pairs", type=pairs_arg, default=1,
                   help="(b) deploy one replica, then two, this many times in turn: a ratio per pair")
    p.add_argument("--frontends", type=frontends_arg, nargs="+", default=["auto"],
                   help="(b) [cluster] frontends, counts or \"auto\" (the default: one per replica on "
                        "16 cores or more): each a deployment of its own, for 1 and 2 replicas")
    p.add_argument("--cluster", action="append", default=[], metavar="KEY=VALUE",
                   help="a [cluster] key for every deployment, its value in TOML (e.g. stream_feed=false, "
                        "scheduler_process=true); repeatable")
    p.add_argument("--model-key", action="append", default=[], metavar="KEY=VALUE",
                   help='a [model] key for every deployment, its value in TOML (e.g. dequantize="no": '
                        "a quantized model kept so); repeatable")
    p.add_argument("--worker-key", action="append", default=[], metavar="KEY=VALUE",
                   help='a [worker] key for every deployment, its value in TOML (e.g. cuda_graphs="on"); '
                        "repeatable")
    p.add_argument("--kill-requests", type=int, default=256)
    p.add_argument("--kill-concurrency", type=int, default=64)
    p.add_argument("--kill-after", type=float, default=3.0)
    p.add_argument("--quick", action="store_true", help="fewer requests (a smoke run)")
    p.add_argument("--py-spy", default="", help="(b) py-spy's path: sample every process in the second round")
    p.add_argument("--py-spy-seconds", type=int, default=5)
    p.add_argument("--out", default="benchmarks/results/cluster.json")
    args = p.parse_args()
    if args.quick:
        args.requests, args.tp_requests, args.tp_max_tokens, args.kill_requests, args.tp_repeat = 48, 8, 16, 16, 1
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    import ray
    from ray import serve

    facts = anyio.run(model_facts, args)
    port, own = free_port(), free_port()
    args.listen = ("127.0.0.1", own)  # the frontends' own port (`[cluster] ingress = "direct"`)
    start_ray(config(args, "1GiB"), 2, log_to_driver=False)
    rows: list[dict[str, Any]] = []
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        # With `--cluster ingress=direct` the frontends serve a port of their own (Serve's proxy
        # serves the application too): the clients go there.
        url = f"http://127.0.0.1:{own if config(args, '1GiB').cluster.ingress == 'direct' else port}"
        if "a" in args.parts:
            print(f"(a) prefix routing: {args.pool_blocks}-block pools, {args.prefix_tokens}-token prefixes, "
                  f"{args.requests} requests at concurrency {args.concurrency}", flush=True)
            rows += asyncio.run(part_a(args, url, facts))
        if "b" in args.parts:
            print(f"(b) throughput: {args.tp_requests} requests x {args.tp_max_tokens} tokens, all at once", flush=True)
            rows += asyncio.run(part_b(args, url, facts[2]))
        if "c" in args.parts:
            print(f"(c) a replica killed {args.kill_after} s into {args.kill_requests} requests at concurrency "
                  f"{args.kill_concurrency}", flush=True)
            rows += asyncio.run(part_c(args, url, facts[2]))
    finally:
        serve.shutdown()
        ray.shutdown()
    meta = {"model": args.model, "device": args.device, "cpus": os.cpu_count(), "python": sys.version.split()[0],
            "argv": sys.argv[1:], "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_bytes(msgspec.json.format(msgspec.json.encode({"meta": meta, "rows": rows})))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()

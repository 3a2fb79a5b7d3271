"""Peers: one closed-loop workload through several backends, side by side in one run.

(a) `bare`: a `BatchGenerator` tight loop (the ceiling), (b) `scheduler`: our `Scheduler`
in-process (the embedding API, no HTTP), (c) `served`: `mlx-scheduler serve` in a process of its
own, (d) `mlx_lm.server` and (e) `vllm-mlx` (with --vllm-mlx, the `vllm-mlx` executable of a
separate venv), each started here on 127.0.0.1 and driven over HTTP by one and the same streaming
client, (f) `sequential`: `mlx_lm.stream_generate`, one request at a time (FIFO). (c) runs with
the same [worker]/[kvpool] settings as (b), so `served / scheduler` is what HTTP costs.
`ray`: the same settings as one replica on Ray Serve (`ray_one.py`, the path of `serve
--replicas N`; needs the cluster extra), so `ray / served` is what the Ray path costs.

(g) `mlx_lm.server-installed`: mlx_lm.server on the BLAS its wheel bundles (no LD_PRELOAD),
(h) `llama.cpp` (with --llama-cpp PYTHON, a venv holding `llama-cpp-python[server]`): its
OpenAI-compatible server on the model's GGUF file (named models and .gguf paths only).

BLAS: this process imports `scheduler` before MLX, so ours run on OpenBLAS (`workers.blas`;
MLX_SCHEDULER_BLAS=bundled opts out, and `served` inherits the same environment). Every peer
server is started with `LD_PRELOAD=workers.blas.preload()` and the same thread count, so it runs
on the same OpenBLAS; `mlx_lm.server-installed` is the peer as installed. Each row records its BLAS.

CUDA: this process applies our worker's MLX settings (graphs and cuDNN's attention off for an
unquantized model) before it loads anything, so the in-process rows (`bare`, `scheduler`,
`sequential`) and `served` run as we serve; the peer servers start with MLX's own settings (or
the user's, if set before this script).

Every backend gets the same prompts and greedy sampling. --eos ignore (the default): prompts of
exactly --prompt-tokens tokens run to --max-tokens. A synthetic model is copied with the EOS rows
of its (tied) embedding zeroed, so it never stops early anywhere; a real model is left as it is
and `ignore_eos` is sent instead (mlx_lm.server and llama-cpp-python have no such option: their
requests may stop at EOS, and the row's `stops` counts them). --eos natural: chat prompts
(the tokenizer's chat template over a passage and a question) that end at the model's EOS or
--max-tokens, whichever is first. A real model runs as one float32, dequantized mlx-lm directory
for every MLX backend (written once into the model cache), so all run the same weights.

    python benchmarks/peers.py [--model synthetic:small] [--concurrency 1 8 32 64]
    python benchmarks/peers.py --model smollm2-135m --eos natural --backends scheduler served \
        mlx_lm.server mlx_lm.server-installed
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import random
import shutil
import sys
import time
from pathlib import Path

import anyio

from scheduler import Scheduler, SchedulerConfig
from scheduler.cli.bench import datasets
from scheduler.cli.bench.mlxlm import MlxLmServer
from scheduler.cli.bench.report import Report, build_report
from scheduler.cli.bench.runner import Load, RunResult, run_load
from scheduler.cli.bench.spread import run_spread
from scheduler.cli.bench.targets import OpenAITarget, Record, Sampling, SchedulerTarget, http_client
from workers.blas import blas_state, preload
from workers.cuda import CUDA_DEFAULTS
from workers.loading.models import parse_synthetic, resolve_model

sys.path.insert(0, str(Path(__file__).resolve().parent))
from overhead import load_served  # noqa: E402

BACKENDS = ("bare", "scheduler", "served", "ray", "mlx_lm.server", "mlx_lm.server-installed",
            "vllm-mlx", "llama.cpp", "sequential")
DEFAULT_BACKENDS = ("bare", "scheduler", "served", "mlx_lm.server", "sequential")
HTTP_BACKENDS = ("served", "ray", "mlx_lm.server", "mlx_lm.server-installed", "vllm-mlx",
                 "llama.cpp")
SERVED = ("served", "ray")
"""Ours over HTTP: `mlx-scheduler serve` in a process of its own."""
NO_IGNORE_EOS = ("mlx_lm.server", "mlx_lm.server-installed", "llama.cpp")
"""Peers whose API has no `ignore_eos`: with --eos ignore their requests may still stop at EOS."""
GREEDY = Sampling(temperature=0.0, ignore_eos=True)
NATURAL = Sampling(temperature=0.0, ignore_eos=False)
QUESTIONS = (
    "Summarize the passage above in one sentence.",
    "What is the main topic of this text?",
    "List three key words from the passage.",
    "Explain the passage to a ten-year-old.",
    "Is the passage formal or informal? Answer briefly.",
    "Give the passage a short title.",
    "What question does this text answer?",
    "Rewrite the first sentence in plain English.",
    "Who might have written this, and why?",
    "What happens next? Continue in one sentence.",
    "Name one fact stated in the passage.",
    "Translate the first sentence into French.",
    "What is the tone of this passage?",
    "Write a one-line headline for this text.",
    "Which word in the passage is the most unusual?",
    "Does the passage mention a place? Which one?",
)
"""Questions after a passage, for --eos natural: answers of natural length that end at EOS."""


USER_MLX = {k: os.environ[k] for k in CUDA_DEFAULTS if k in os.environ}
"""The MLX settings our worker changes on CUDA, as the user set them before any of ours ran."""


def peer_env(backend: str) -> dict[str, str]:
    """The environment added for a peer server: MLX's own CUDA settings (graphs and cuDNN's
    attention on, both MLX's defaults) or the user's, never those our worker put into this
    process; this process's OpenBLAS through LD_PRELOAD and its thread count; the `-installed`
    peer gets an empty LD_PRELOAD (its wheel's own BLAS)."""
    mlx = {k: USER_MLX.get(k, "1") for k in CUDA_DEFAULTS}
    if backend.endswith("-installed") or backend == "llama.cpp":
        return {**mlx, "LD_PRELOAD": ""}
    libs = preload()
    if not libs:
        return {**mlx, "LD_PRELOAD": ""}
    return {**mlx, "LD_PRELOAD": libs, "OPENBLAS_NUM_THREADS": str(blas_state().threads)}


def blas_of(backend: str) -> str:
    """What the row's process runs its float32 matmuls on."""
    name = backend.partition(":")[0]
    state = blas_state()
    ours = f"{state.library} ({state.threads} threads)" if state.library == "openblas" else state.library
    if name == "llama.cpp":
        return "ggml (llama.cpp's own kernels, GGUF weights)"
    if name in HTTP_BACKENDS and name not in SERVED:
        return f"openblas (LD_PRELOAD, {state.threads} threads)" if peer_env(name).get("LD_PRELOAD") else "bundled"
    return ours


def f32_model(name: str, cache_dir: str | None) -> Path:
    """A float32, dequantized copy of a real model, written once beside the source in the model
    cache: every MLX backend then runs the same weights (mlx_lm.server would otherwise run
    whatever dtype the directory holds)."""
    import mlx.core as mx
    from mlx.utils import tree_flatten

    from workers.loading.models import load

    src = resolve_model(name, cache_dir)
    dst = src.with_name(src.name + "-f32")
    if (dst / "config.json").is_file():
        return dst
    loaded = load(name, cache_dir, dtype="float32", dequantize="yes")
    tmp = dst.with_name(dst.name + f".tmp{os.getpid()}")
    tmp.mkdir(parents=True)
    weights = dict(tree_flatten(loaded.model.parameters()))
    assert all(v.dtype == mx.float32 for v in weights.values()), "not all float32"
    mx.save_safetensors(str(tmp / "model.safetensors"), weights, metadata={"format": "mlx"})
    config = json.loads((src / "config.json").read_text())
    config.pop("quantization", None)
    config.pop("quantization_config", None)
    config["torch_dtype"] = "float32"
    (tmp / "config.json").write_text(json.dumps(config, indent=2))
    for f in src.iterdir():
        if f.name.startswith("tokenizer") or f.suffix in (".jinja", ".txt") or f.name == "special_tokens_map.json":
            shutil.copy(f, tmp / f.name)
    tmp.rename(dst)
    return dst


def natural_specs(model_dir: Path, maker: datasets.PromptMaker, count: int, passage_tokens: int,
                  max_tokens: int, seed: int) -> list[datasets.RequestSpec]:
    """Chat prompts: the tokenizer's chat template over a passage of `passage_tokens` tokens
    and a question, with the generation prompt; sent as completion text to every backend."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model_dir))
    rng = random.Random(seed)
    specs = []
    for _ in range(count):
        passage, _ = maker.make(passage_tokens, rng)
        messages = [{"role": "user", "content": f"{passage.strip()}\n\n{rng.choice(QUESTIONS)}"}]
        text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        specs.append(datasets.RequestSpec(text, maker.length(text), max_tokens))
    return specs


def no_eos_model(name: str, cache_dir: str | None) -> Path:
    """A copy of `name` whose EOS embedding rows are zero: its logit is 0 while the argmax over
    thousands of random rows is positive, so greedy decoding never ends a request early."""
    import mlx.core as mx

    src = resolve_model(name, cache_dir)
    dst = src.with_name(src.name + "-noeos")
    if (dst / "config.json").is_file():
        return dst
    tmp = dst.with_name(dst.name + f".tmp{os.getpid()}")
    shutil.copytree(src, tmp)
    config = json.loads((tmp / "config.json").read_text())
    eos = config["eos_token_id"]
    eos = eos if isinstance(eos, list) else [eos]
    for f in tmp.glob("*.safetensors"):
        weights = mx.load(str(f))
        for key in ("model.embed_tokens.weight", "lm_head.weight"):
            if key in weights:
                w = weights[key]
                for t in eos:
                    w[t] = mx.zeros_like(w[t])
                weights[key] = w
        mx.save_safetensors(str(f), weights, metadata={"format": "mlx"})
    tmp.rename(dst)
    return dst


def bare(model: object, prompts: list[list[int]], n: int, max_tokens: int,
         stop_tokens: list[list[int]] | None = None) -> RunResult:
    """A tight loop over BatchGenerator keeping `n` sequences in flight; stamps every token.
    `stop_tokens`: None runs every request to max_tokens."""
    from mlx_lm.generate import BatchGenerator

    gen = BatchGenerator(model, completion_batch_size=n, prefill_batch_size=min(8, n), prefill_step_size=512,
                         stop_tokens=stop_tokens)
    records = [Record(len(p), max_tokens) for p in prompts]
    todo = list(range(len(prompts)))[::-1]
    uid_of: dict[int, int] = {}
    last: dict[int, float] = {}
    start = time.perf_counter()

    def insert() -> None:
        i = todo.pop()
        (uid,) = gen.insert([prompts[i]], max_tokens=[max_tokens])
        uid_of[uid] = i
        records[i].sent_at = time.perf_counter() - start

    while todo and len(uid_of) < n:
        insert()
    while uid_of:
        _, responses = gen.next()
        now = time.perf_counter() - start
        for r in responses:
            rec = records[uid_of[r.uid]]
            if rec.ttft is None:
                rec.ttft = now - rec.sent_at
            else:
                rec.itl.append(now - last[r.uid])
            last[r.uid] = now
            rec.output_tokens += 1
            if r.finish_reason is not None:
                rec.e2e, rec.done, rec.ok, rec.finish_reason = now - rec.sent_at, True, True, r.finish_reason
                del uid_of[r.uid]
                if todo:
                    insert()
    gen.close()
    return RunResult(Load(concurrency=n), records, time.perf_counter() - start, False)


def sequential(model: object, tokenizer: object, prompts: list[list[int]], n: int, max_tokens: int,
               ignore_eos: bool = True) -> RunResult:
    """`mlx_lm.stream_generate` one request at a time; `n` closed-loop users queue FIFO, so a
    request arrives when its user's previous one ended and its TTFT includes the wait."""
    import mlx.core as mx
    from mlx_lm import stream_generate

    eos = set(tokenizer.eos_token_ids)  # type: ignore[attr-defined]
    if ignore_eos:
        tokenizer.eos_token_ids = []  # type: ignore[attr-defined]
    records = [Record(len(p), max_tokens) for p in prompts]
    ends: list[float] = []
    start = time.perf_counter()
    for i, prompt in enumerate(prompts):
        arrival = 0.0 if i < n else ends[i - n]  # user of request i-n sends request i
        rec, last = records[i], 0.0
        rec.sent_at = arrival
        reason = "length"
        for resp in stream_generate(model, tokenizer, mx.array(prompt), max_tokens=max_tokens):
            reason = resp.finish_reason or reason
            now = time.perf_counter() - start
            if rec.ttft is None:
                rec.ttft = now - arrival
            else:
                rec.itl.append(now - last)
            last = now
            rec.output_tokens += 1
        ends.append(time.perf_counter() - start)
        rec.e2e, rec.done, rec.ok, rec.finish_reason = ends[-1] - arrival, True, True, reason
    tokenizer.eos_token_ids = eos  # type: ignore[attr-defined]
    return RunResult(Load(concurrency=n), records, time.perf_counter() - start, False)


KV_MEMORY = os.environ.get("PEERS_KV_MEMORY", "8GiB")
"""Our `[kvpool] memory` (weights included): 8GiB, unless the environment says otherwise."""


def our_toml(model_dir: Path, n: int, worker: str) -> str:
    """Our settings, the same in-process and served: defaults plus the batch sizes of the peers."""
    return (f'[model]\npath = "{model_dir}"\n[worker]\nmax_batch = {n}\nprefill_batch = 8\n{worker}\n'
            f'[kvpool]\nmemory = "{KV_MEMORY}"\n[logging]\nlevel = "warning"\n')


def http_server(backend: str, model_dir: Path, n: int, worker: str, vllm_mlx: str | None,
                tmp: Path, llama_cpp: tuple[str, Path] | None = None) -> MlxLmServer:
    """The server process of an HTTP backend, not started yet. `llama_cpp`: (its venv's
    python, the GGUF file)."""
    env = peer_env(backend)
    if backend in ("mlx_lm.server", "mlx_lm.server-installed"):
        return MlxLmServer(model_dir, decode_concurrency=n, prompt_concurrency=8, env=env,
                           log_path=tmp / f"{backend}-{n}.log")
    if backend == "llama.cpp":
        assert llama_cpp is not None
        python, gguf = llama_cpp
        threads = blas_state().threads or (os.cpu_count() or 1)
        cmd = [python, "-m", "llama_cpp.server", "--model", str(gguf), "--host", "127.0.0.1", "--port", "{port}",
               "--n_threads", str(threads), "--n_threads_batch", str(threads), "--n_ctx", "4096",
               "--interrupt_requests", "False"]  # its default cancels a running stream when another request arrives
        return MlxLmServer(model_dir, command=cmd, log_path=tmp / f"llama.cpp-{n}.log", start_timeout_s=300,
                           env=env, health_path="/v1/models")
    if backend in SERVED:
        toml = tmp / f"{backend}-{n}.toml"
        # "ray:key=value,..." sets [cluster] keys instead, e.g. stream_interval_s=0
        toml.write_text(our_toml(model_dir, n, worker) if backend == "served"
                        else f"{our_toml(model_dir, n, '')}[cluster]\n{worker}\n")
        # "ray": the same settings, one replica on Ray Serve
        entry = ["-m", "scheduler.cli", "serve"] if backend == "served" else [str(Path(__file__).with_name("ray_one.py"))]
        cmd = [sys.executable, *entry, "--config", str(toml), "--host", "127.0.0.1", "--port", "{port}"]
        return MlxLmServer(model_dir, command=cmd, log_path=tmp / f"{backend}-{n}.log", start_timeout_s=300)
    assert backend == "vllm-mlx" and vllm_mlx is not None
    cmd = [vllm_mlx, "serve", str(model_dir), "--host", "127.0.0.1", "--port", "{port}",
           "--continuous-batching", "--max-num-seqs", str(n), "--completion-batch-size", str(n),
           "--prefill-batch-size", "8", "--offline"]
    return MlxLmServer(model_dir, command=cmd, log_path=tmp / f"vllm-mlx-{n}.log", start_timeout_s=300, env=env)


async def through_scheduler(
    model_dir: Path, specs: list[datasets.RequestSpec], n: int, worker: str,
    warm: list[datasets.RequestSpec] | None = None, sampling: Sampling = GREEDY,
) -> RunResult:
    """A timed run; `warm` first, untimed, through the same Scheduler (as a server process and
    the bare loop keep theirs), so that its first steps are not timed."""
    config = SchedulerConfig.from_toml(our_toml(model_dir, n, worker))
    async with Scheduler(config) as sched:
        target = SchedulerTarget(sched)
        if warm:
            await run_load(target, warm, Load(concurrency=n), sampling, progress=None)
        return await run_load(target, specs, Load(concurrency=n), sampling, progress=None)


def through_http(url: str, specs: list[datasets.RequestSpec], n: int, model: str | None = None,
                 sampling: Sampling = GREEDY, clients: int = 1) -> RunResult:
    """`model`: the request's "model" field, for servers that require it (vllm-mlx); `clients`:
    client processes sending it (one reads at most about 10,000 streamed tokens a second)."""
    if clients > 1:
        return run_spread(url, model, 30.0, specs, Load(concurrency=n), sampling, clients)[0]

    async def one_client() -> RunResult:
        async with http_client(600) as c:
            return await run_load(OpenAITarget(c, url, model=model), specs, Load(concurrency=n), sampling,
                                  progress=None)

    return anyio.run(one_client)


def run_backend(backend: str, model: object, tokenizer: object, model_dir: Path,
                specs: list[datasets.RequestSpec], ids: list[list[int]], n: int, max_tokens: int,
                warm: tuple[list[datasets.RequestSpec], list[list[int]]] | None = None,
                vllm_mlx: str | None = None, tmp: Path = Path("."), sampling: Sampling = GREEDY,
                llama_cpp: tuple[str, Path] | None = None, clients: int = 1) -> tuple[Report, RunResult]:
    """One timed run; `warm` (other prompts) first runs untimed through the same backend (for
    a server, in the same server process), so that kernel compilation is not timed."""
    name, _, keys = backend.partition(":")
    # "scheduler:key=value,..." (or "served:...") sets [worker] keys, e.g. step_token_budget=0;
    # "ray:..." sets [cluster] keys
    worker = "\n".join(kv.replace("=", " = ") for kv in keys.split(",") if kv)
    if name in HTTP_BACKENDS:
        with http_server(name, model_dir, n, worker, vllm_mlx, tmp, llama_cpp) as server:
            model_field = str(model_dir) if name == "vllm-mlx" else None
            if warm:
                through_http(server.url, warm[0], n, model_field, sampling, clients)
            run = through_http(server.url, specs, n, model_field, sampling, clients)
    elif backend == "bare":
        stops = None if sampling.ignore_eos else [[t] for t in tokenizer.eos_token_ids]  # type: ignore[attr-defined]
        if warm:
            bare(model, warm[1], n, max_tokens, stops)
        run = bare(model, ids, n, max_tokens, stops)
    elif name == "scheduler":
        run = anyio.run(through_scheduler, model_dir, specs, n, worker, warm[0] if warm else None, sampling)
    else:
        if warm:  # one request at a time: two warm it up
            sequential(model, tokenizer, warm[1][:2], n, max_tokens, sampling.ignore_eos)
        run = sequential(model, tokenizer, ids, n, max_tokens, sampling.ignore_eos)
    return build_report(run, label=backend, target=backend, slos_ms={}), run


def row(backend: str, n: int, report: Report, ceiling: float | None, run: RunResult) -> dict[str, object]:
    done = [r for r in run.records if r.ok]
    return {
        "backend": backend, "blas": blas_of(backend), "concurrency": n, "requests": report.completed,
        "failed": report.failed, "stops": sum(r.finish_reason == "stop" for r in done),
        "prompt_tokens_mean": report.total_input_tokens / max(1, report.completed),
        "output_tokens_mean": report.total_output_tokens / max(1, report.completed),
        "duration_s": report.duration_s,
        "output_tokens": report.total_output_tokens, "tok_s": report.output_throughput,
        "ratio_to_bare": report.output_throughput / ceiling if ceiling else None,
        "ttft_p50_ms": report.ttft_ms.median, "ttft_p99_ms": report.ttft_ms.p99,
        "itl_p50_ms": report.itl_ms.median, "itl_p99_ms": report.itl_ms.p99,
        "connect_retries": report.connect_retries,
    }


def print_table(rows: list[dict[str, object]]) -> None:
    w = max(14, *(len(str(r["backend"])) for r in rows))
    b = max(8, *(len(str(r["blas"])) for r in rows))
    print(f"\n{'conc':>4} {'backend':<{w}} {'BLAS':<{b}} {'tok/s':>8} {'x bare':>7} {'TTFT p50':>9} {'TTFT p99':>9} "
          f"{'ITL p50':>8} {'ITL p99':>8} {'tokens':>7} {'stops':>5} {'load':>9}")
    for r in rows:
        ratio = "-" if r["ratio_to_bare"] is None else f"{r['ratio_to_bare']:.2f}"
        load = f"{r['load_before']:.1f}/{r['load_after']:.1f}"
        print(f"{r['concurrency']:>4} {r['backend']:<{w}} {r['blas']:<{b}} {r['tok_s']:>8.1f} {ratio:>7} "
              f"{r['ttft_p50_ms']:>9.1f} {r['ttft_p99_ms']:>9.1f} {r['itl_p50_ms']:>8.1f} "
              f"{r['itl_p99_ms']:>8.1f} {r['output_tokens']:>7} {r['stops']:>5} {load:>9}")
    print()
    for r in rows:
        ratios = ratios_of(r, rows)
        if ratios:
            print(f"c={r['concurrency']}: {r['backend']}: " + ", ".join(f"{k} x{v:.2f}" for k, v in ratios.items()))


def ratios_of(ours: dict[str, object], rows: list[dict[str, object]]) -> dict[str, float]:
    """For our rows: throughput against the in-process scheduler (served rows only) and against
    each HTTP peer, and p99 TTFT against mlx_lm.server's (lower is better)."""
    name = str(ours["backend"]).partition(":")[0]
    if name not in ("scheduler", *SERVED):
        return {}
    same = {str(r["backend"]): r for r in rows if r["concurrency"] == ours["concurrency"]}
    out: dict[str, float] = {}
    tok = float(ours["tok_s"])  # type: ignore[arg-type]
    inproc = same.get("scheduler" + str(ours["backend"])[len(name):])
    if name in SERVED and inproc is not None and float(inproc["tok_s"]) > 0:  # type: ignore[arg-type]
        out["tok/s / in-process"] = tok / float(inproc["tok_s"])  # type: ignore[arg-type]
    served = same.get("served")
    if name == "ray" and served is not None and float(served["tok_s"]) > 0:  # type: ignore[arg-type]
        out["tok/s / served"] = tok / float(served["tok_s"])  # type: ignore[arg-type]
        out["TTFT p99 / served"] = float(ours["ttft_p99_ms"]) / float(served["ttft_p99_ms"])  # type: ignore[arg-type]
    for peer in ("mlx_lm.server", "mlx_lm.server-installed", "vllm-mlx", "llama.cpp"):
        other = same.get(peer)
        if other is not None and float(other["tok_s"]) > 0:  # type: ignore[arg-type]
            out[f"tok/s / {peer}"] = tok / float(other["tok_s"])  # type: ignore[arg-type]
    one = same.get("sequential")  # one user: mlx-lm's own speed is the bar (goals >= 0.95, <= 1.10)
    if ours["concurrency"] == 1 and one is not None and float(one["tok_s"]) > 0:  # type: ignore[arg-type]
        out["tok/s / stream_generate"] = tok / float(one["tok_s"])  # type: ignore[arg-type]
        out["TTFT p50 / stream_generate"] = float(ours["ttft_p50_ms"]) / float(one["ttft_p50_ms"])  # type: ignore[arg-type]
    other = same.get("mlx_lm.server")
    if other is not None and float(other["ttft_p99_ms"]) > 0:  # type: ignore[arg-type]
        out["TTFT p99 / mlx_lm.server"] = float(ours["ttft_p99_ms"]) / float(other["ttft_p99_ms"])  # type: ignore[arg-type]
    return out


def plot(rows: list[dict[str, object]], levels: list[int], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    backends = list(dict.fromkeys(str(r["backend"]) for r in rows))
    width = 0.8 / len(backends)
    for k, backend in enumerate(backends):
        mine = {r["concurrency"]: r for r in rows if r["backend"] == backend}
        xs = [i + (k - (len(backends) - 1) / 2) * width for i in range(len(levels))]
        for ax, key in zip(axes, ("tok_s", "ttft_p99_ms", "itl_p99_ms"), strict=True):
            ax.bar(xs, [float(mine[n][key]) if n in mine else 0.0 for n in levels],
                   width, label=backend)
    for ax, title in zip(axes, ("output tokens/s", "p99 TTFT (ms, log)", "p99 ITL (ms, log)"), strict=True):
        ax.set_xticks(range(len(levels)), [str(n) for n in levels])
        ax.set_xlabel("concurrent requests (closed loop)")
        ax.set_title(title)
        ax.grid(axis="y", alpha=0.3)
    axes[1].set_yscale("log")
    axes[2].set_yscale("log")
    handles, labels = axes[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="upper center", ncol=len(backends), fontsize=9)
    fig.tight_layout(rect=(0, 0, 1, 0.9))
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="synthetic:small")
    ap.add_argument("--cache-dir", default=None)
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32, 64])
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--waves", type=int, default=2,
                    help="requests per level = max(--min-requests, waves x concurrency)")
    ap.add_argument("--min-requests", type=int, default=8)
    ap.add_argument("--warm-requests", type=int, default=0,
                    help="requests of the untimed warm-up wave (0: max(8, concurrency))")
    ap.add_argument("--eos", choices=("ignore", "natural"), default="ignore",
                    help="ignore: every request runs to --max-tokens (where the backend can); natural: "
                         "chat prompts that end at EOS (--prompt-tokens sizes the passage in them)")
    ap.add_argument("--llama-cpp", metavar="PYTHON",
                    help="the python of a venv with llama-cpp-python[server]; adds the llama.cpp backend")
    ap.add_argument("--repeat", type=int, default=1,
                    help="runs of each backend, interleaved; the table keeps each one's best (noisy hosts)")
    ap.add_argument("--backends", nargs="+", default=list(DEFAULT_BACKENDS),
                    help=f"of {', '.join(BACKENDS)}; 'scheduler:KEY=VALUE,...' and 'served:...' set "
                         "[worker] keys, 'ray:...' [cluster] keys (default: all but vllm-mlx)")
    ap.add_argument("--vllm-mlx", metavar="EXE",
                    help="the vllm-mlx executable of its own venv; adds the vllm-mlx backend")
    ap.add_argument("--warmup", type=int, default=1, choices=(0, 1),
                    help="1: before a level's first timed run of each backend (and before every "
                         "server run, a fresh process), one untimed wave of other prompts")
    ap.add_argument("--clients", type=int, default=1,
                    help="client processes for the HTTP backends (one reads at most about 10,000 streamed "
                         "tokens a second: at 256 streams on a GPU it may be the limit)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="benchmarks/results/peers.json")
    args = ap.parse_args()
    if args.vllm_mlx and "vllm-mlx" not in args.backends:
        args.backends.append("vllm-mlx")
    if args.llama_cpp and "llama.cpp" not in args.backends:
        args.backends.append("llama.cpp")
    for b in args.backends:
        if b.partition(":")[0] not in BACKENDS:
            ap.error(f"unknown backend {b!r}; known: {', '.join(BACKENDS)}")
    if "vllm-mlx" in args.backends and not args.vllm_mlx:
        ap.error("the vllm-mlx backend needs --vllm-mlx PATH (its executable, in a venv of its own)")
    if "llama.cpp" in args.backends and not args.llama_cpp:
        ap.error("the llama.cpp backend needs --llama-cpp PYTHON (of a venv with llama-cpp-python[server])")

    import mlx.core as mx

    synthetic = parse_synthetic(args.model) is not None
    natural = args.eos == "natural"
    sampling = NATURAL if natural else GREEDY
    # A synthetic model never stops when its EOS rows are zero; a real one keeps its weights
    # (float32, dequantized) and gets ignore_eos instead.
    if synthetic:
        model_dir = resolve_model(args.model, args.cache_dir) if natural else no_eos_model(args.model, args.cache_dir)
    else:
        model_dir = f32_model(args.model, args.cache_dir)
    llama_cpp = None
    if args.llama_cpp:
        from workers.loading.named import NAMED_MODELS, named_gguf

        gguf = named_gguf(args.model, args.cache_dir) if args.model in NAMED_MODELS else Path(args.model)
        if gguf.suffix != ".gguf":
            ap.error("the llama.cpp backend needs a named model or a .gguf file")
        llama_cpp = (args.llama_cpp, gguf)
    codec = datasets.load_codec(model_dir)
    maker = datasets.PromptMaker(codec)

    def workload(num: int, seed: int) -> list[datasets.RequestSpec]:
        if natural:
            return natural_specs(model_dir, maker, num, args.prompt_tokens, args.max_tokens, seed)
        return datasets.build("random", maker, num_prompts=num, input_len=args.prompt_tokens,
                              output_len=args.max_tokens, seed=seed)

    in_process = {"bare", "sequential"} & {b.partition(":")[0] for b in args.backends}
    # Only the bare loop and stream_generate use a model in this process (an 8B one is 16 GB).
    # Loaded after our worker's CUDA settings, which MLX reads at its first GPU use, so that our
    # in-process scheduler runs with them (these two then do too); peer servers keep MLX's own
    # (`peer_env`).
    model, tokenizer = load_served(str(model_dir)) if in_process else (None, None)
    load_before = os.getloadavg()
    rows: list[dict[str, object]] = []
    runs: list[dict[str, object]] = []
    out = Path(args.out)
    tmp = out.parent / (out.stem + "-logs")  # server configs and logs
    tmp.mkdir(parents=True, exist_ok=True)
    for n in args.concurrency:
        count = max(args.min_requests, args.waves * n)
        best: dict[str, dict[str, object]] = {}
        warm_specs = workload(args.warm_requests or max(8, n), args.seed + n + 10**6)
        warm = (warm_specs, [codec.encode(s.prompt) for s in warm_specs])
        for rep in range(args.repeat):
            # Fresh prompts each repetition, so no server-side prompt cache can help a repeat.
            specs = workload(count, args.seed + n + 1000 * rep)
            assert natural or all(s.prompt_tokens == args.prompt_tokens for s in specs), "prompt lengths differ"
            ids = [codec.encode(s.prompt) for s in specs]
            for backend in args.backends:
                # Every HTTP run is a fresh server process and every scheduler run a fresh
                # Scheduler: each gets its warm-up.
                fresh = backend.partition(":")[0] in (*HTTP_BACKENDS, "scheduler")
                cold = args.warmup and (rep == 0 or fresh)
                load_before_run = os.getloadavg()[0]
                report, run = run_backend(backend, model, tokenizer, model_dir, specs, ids, n, args.max_tokens,
                                          warm if cold else None, args.vllm_mlx, tmp, sampling, llama_cpp,
                                          args.clients)
                ceiling = best["bare"]["tok_s"] if "bare" in best else None
                r = row(backend, n, report, ceiling, run)
                r["repeat"] = rep
                r["load_before"], r["load_after"] = load_before_run, os.getloadavg()[0]
                runs.append(r)
                if backend not in best or r["tok_s"] > best[backend]["tok_s"]:
                    best[backend] = r
                print(f"  c={n:<3d} {backend:<16} {r['tok_s']:8.1f} tok/s  TTFT p99 {r['ttft_p99_ms']:8.1f} ms  "
                      f"ITL p99 {r['itl_p99_ms']:7.1f} ms  tokens {r['output_tokens']}  stops {r['stops']}  "
                      f"load {os.getloadavg()[0]:.1f}", flush=True)
                expected = count * args.max_tokens
                may_stop = natural or (not synthetic and backend.partition(":")[0] in NO_IGNORE_EOS)
                if (report.total_output_tokens != expected and not may_stop) or report.failed:
                    print(f"    ! {backend}: {report.total_output_tokens} of {expected} tokens, "
                          f"{report.failed} failed: {report.errors}", flush=True)
        ceiling = float(best["bare"]["tok_s"]) if "bare" in best else None
        for backend in args.backends:
            r = dict(best[backend])
            r["ratio_to_bare"] = float(r["tok_s"]) / ceiling if ceiling else None
            rows.append(r)
    for r in rows:
        r["ratios"] = ratios_of(r, rows)
    print_table(rows)
    state = blas_state()
    meta = {
        "model": args.model, "model_dir": str(model_dir), "eos": args.eos,
        "ignore_eos_unsupported": [b for b in args.backends if b in NO_IGNORE_EOS] if not natural else [],
        "blas": {"library": state.library, "path": state.path, "threads": state.threads, "reason": state.reason,
                 "peer_ld_preload": preload()},
        "time": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "host": platform.node(), "cpu": _cpu_model(),
        "nproc": len(os.sched_getaffinity(0)),
        "min_requests": args.min_requests, "warm_requests": args.warm_requests,
        "prompt_tokens": args.prompt_tokens, "max_tokens": args.max_tokens,
        "waves": args.waves, "repeat": args.repeat, "warmup": args.warmup, "device": str(mx.default_device()), "mlx": mx.__version__,
        "python": sys.version.split()[0], "machine": platform.machine(), "cpus": os.cpu_count(),
        "ld_preload": os.environ.get("LD_PRELOAD", ""), "loadavg_before": load_before, "loadavg_after": os.getloadavg(), "date": time.strftime("%Y-%m-%d"),
    }
    print(f"{meta['time']}  {meta['cpu']}, nproc {meta['nproc']}, {meta['machine']}  ours: {state.library} "
          f"({state.threads} threads)  load avg before {load_before[0]:.2f} {load_before[1]:.2f} "
          f"{load_before[2]:.2f}, after {meta['loadavg_after'][0]:.2f} {meta['loadavg_after'][1]:.2f} "
          f"{meta['loadavg_after'][2]:.2f}")
    out.write_text(json.dumps({"meta": meta, "rows": rows, "runs": runs}, indent=2))
    png = out.with_suffix(".png")
    try:
        plot(rows, args.concurrency, png)
        print(f"\nwrote {out} and {png}")
    except ImportError:
        print(f"\nwrote {out} (no PNG: matplotlib is not installed)")
    del model
    gc.collect()  # MLX work in joined threads can abort the interpreter at exit otherwise


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


if __name__ == "__main__":
    main()

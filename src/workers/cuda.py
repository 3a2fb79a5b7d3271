"""MLX settings the scheduler applies by default on the CUDA backend.

MLX reads its `MLX_*` variables once, when it first uses the GPU, so these go into the process
environment before the worker loads the model; a variable the user has set is left alone. Measured
on an H100 with `benchmarks/cuda_settings.py` (README, "On a GPU"): through our scheduler, CUDA
graphs off gave more tokens/s at 8 to 256 streams on the qwen2.5-0.5b and llama-3.2-1b shapes
(host-bound: the KV length changes every step, so captured graphs do not replay) and at 64 and
256 streams on an 8B bf16 shape (1.71x, 1.48x; the bare decode step of equal rows was faster with
graphs at batch 1 and 256 there, but not the served mix of prefill and decode); 4-bit matmuls
were 1.7-3x slower with graphs off. So `[worker] cuda_graphs = "auto"` turns graphs off for
unquantized models and keeps MLX's default for quantized ones.

cuDNN's attention is off for every model: MLX keys its cache of cuDNN attention graphs by the
exact shapes, and a prefill chunk of a batch of prompts has new ones (its length and its KV
length) almost every time, so nearly every chunk built a cuDNN graph first. Measured on an H100
(`benchmarks/stall.py`, 64 streams, prompts of 64-512 tokens, qwen2.5-0.5b shape, bf16): 1,999
tokens/s with it off against 1,362 on, ITL p99 97 against 166 ms, TTFT p99 0.9 against 4.0 s.
Without it MLX attends with its own kernels (the decode step's vector kernel, matmuls for
prefill).

MLX compiles some CUDA kernels at their first use (NVRTC): its 4-bit and 8-bit matmuls for each
tile size, gathers, fused element-wise ops. It keeps them in `/tmp/mlx/<version>/ptx`, which a
reboot or a fresh container empties. They are slow to build: on an H200 (2026-11-26, SmolLM2's
Q4_1 GGUF, 256 requests at once) the first round took 45 s with every TTFT above 44 s, and over
140 s with the quantized decode fold off, where the same round took 3.4 s once the kernels were
on disk. The scheduler points `MLX_PTX_CACHE_DIR` into its own cache (one directory per MLX
version), so the build is paid once per machine and cache, as the models are, and it builds a
quantized model's kernels while the model loads (`warm_kernels`), before any request waits;
replicas on one host take turns (`kernels_locked`). Every model's engine then serves a few short
requests before any user does (`warm_engine`), for the kernels every model needs: on a fresh
H100, the first round of 256 requests took 7.2 s instead of 13.1 s, for 8 s more at start, paid
once per machine (a process on the built directory started in 1.7 s). Small quantized models no
longer need the quantized kernels: on CUDA they are dequantized at load
(`workers.loading.dtypes`), since on a fresh H200 SmolLM2's Q4_1 GGUF had not served its first
round after 200 s, build or no build.
"""

from __future__ import annotations

import contextlib
import os
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import mlx.core as mx
import structlog

from workers.loading.cachedir import cache_root
from workers.loading.dtypes import Dequantize, cuda_dequantizes, model_config, on_cuda
from workers.messages import Admit, SamplingSpec

if TYPE_CHECKING:
    from collections.abc import Iterator, Mapping, MutableMapping

    from workers.batching.contract import Engine

log = structlog.get_logger(__name__)

CUDA_DEFAULTS: dict[str, str] = {"MLX_USE_CUDA_GRAPHS": "0", "MLX_CUDA_USE_CUDNN_SDPA": "0"}
"""What "auto" sets for an unquantized model (a quantized one keeps MLX's CUDA graphs)."""
GRAPHS = "MLX_USE_CUDA_GRAPHS"
KERNELS = "MLX_PTX_CACHE_DIR"


def kernel_dir(cache_dir: str | None = None) -> Path:
    """Where MLX keeps the CUDA kernels it compiles: under the cache root, per MLX version (MLX
    itself adds no version to a directory it is given)."""
    version: str = getattr(mx, "__version__", "unknown")  # not in MLX's type stubs
    return cache_root(cache_dir) / "mlx-kernels" / version


def graphs_wanted(choice: str, model_dir: Path | None, dequantize: Dequantize = "auto") -> bool:
    """Whether CUDA graphs should stay on for `[worker] cuda_graphs = choice`: "on"/"off" as
    said; "auto": on for models that stay quantized (`[model] dequantize`)."""
    if choice != "auto":
        return choice == "on"
    if model_dir is None:
        return False
    config = model_config(model_dir)
    quantized = "quantization" in config or "quantization_config" in config
    return quantized and not cuda_dequantizes(model_dir, dequantize)


def cuda_defaults(env: MutableMapping[str, str], cuda: bool, graphs: bool = False,
                  kernels: Path | None = None) -> dict[str, str]:
    """Put each of the CUDA settings the user has not set into `env` (only on CUDA); return them.
    `graphs`: leave MLX's CUDA graphs on (its own default). `kernels`: where MLX keeps the
    kernels it compiles."""
    if not cuda:
        return {}
    wanted = {k: v for k, v in CUDA_DEFAULTS.items() if not (graphs and k == GRAPHS)}
    if kernels is not None:
        wanted[KERNELS] = str(kernels)
    applied = {k: v for k, v in wanted.items() if k not in env}
    env.update(applied)
    return applied


def apply_cuda_defaults(choice: str = "auto", model_dir: Path | None = None,
                        cache_dir: str | None = None, dequantize: Dequantize = "auto",
                        used_before: bool | None = None) -> dict[str, str]:
    """`cuda_defaults` on the process environment, logged once when it sets anything.
    `used_before`: whether MLX had run in this process before the caller began (`mlx_used()`
    then; default: now)."""
    cuda = on_cuda()
    applied = cuda_defaults(os.environ, cuda, cuda and graphs_wanted(choice, model_dir, dequantize),
                            kernel_dir(cache_dir) if cuda else None)
    if applied:
        log.info("cuda_defaults_applied", **applied,
                 note="set the variable yourself to override; read once, at MLX's first GPU use")
        late = came_late(applied, mlx_used() if used_before is None else used_before)
        if late:
            log.warning("cuda_defaults_late", **applied, reason=late)
    return applied


USED_BYTES = 64 * 2**10
"""More than this allocated at once is MLX having done real work. Importing mlx-lm allocates a
few bytes (its sampler's random key, made from host values) and launches nothing on the GPU, so
MLX reads no setting then: on an H200 every process that imported mlx-lm held 8 bytes before its
first GPU use."""


def mlx_used() -> bool:
    """Whether MLX has done real work in this process yet (`USED_BYTES`): on CUDA, a sign that it
    ran on the GPU and read its settings (it allocates through the device's allocator on either
    stream, so this can also be CPU work; a few small GPU operations go unnoticed)."""
    return mx.get_peak_memory() > USED_BYTES


def came_late(applied: Mapping[str, str], used_before: bool) -> str:
    """Why settings just put into the environment do not apply ("" when they do): something in
    this process ran MLX before (`used_before`: a model loaded before the scheduler started), and
    MLX reads its settings once, at its first GPU use."""
    if applied and used_before:
        return ("MLX ran in this process before the scheduler set these, and reads them only once: "
                "they do not apply (set them in the environment before anything uses MLX)")
    return ""


WARM_ROWS = (1, 8)
WARM_TOKENS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 256, 512)
"""The shapes `warm_kernels` runs: MLX picks a quantized matmul's kernel (and its tile) by the
product's rows, a decode step's batch (folded into rows) or a prefill chunk's tokens."""


WARM_STEPS_LIMIT = 200
"""More engine steps than the warm-up's requests can need; a guard, never reached."""


def warm_engine(engine: Engine, vocab_size: int) -> float:
    """Serve a few short greedy requests through `engine` before any user does, so that MLX
    compiles the kernels of the paths every server takes at once (prompts of two lengths
    prefilled together, a prompt joining rows that decode, masked and mask-free decode steps, a
    lone row's step) while the model loads, not under the first requests; its seconds. The
    requests keep no KV (no prefix blocks, no session), so the pool's books stay as they are.

    Greedy only: on an H100 (2026-11-26, qwen2.5-0.5b shape, `benchmarks/cold_start.py`) adding a
    sampled request and log-probabilities built 11 kernels (30 s more at start) where greedy
    requests built 6 (8 s), and the first round of 256 greedy requests was about as fast after
    either (6.5 s, 7.2 s). A first sampled request builds its own."""
    start = time.perf_counter()
    top = max(3, min(vocab_size, 200))
    greedy = SamplingSpec()
    engine.insert([
        Admit(-1, [1 + i % (top - 1) for i in range(24)], 6, greedy, ()),
        Admit(-2, [1 + i % (top - 1) for i in range(9)], 4, greedy, ()),
    ])
    steps = 0
    while engine.has_work() and steps < WARM_STEPS_LIMIT:
        engine.step()
        steps += 1
        if steps == 2:
            engine.insert([Admit(-3, [2, 3, 4], 3, greedy, ())])  # joins rows that decode
    engine.insert([Admit(-4, [5, 6, 7, 8], 3, greedy, ())])  # alone
    while engine.has_work() and steps < 2 * WARM_STEPS_LIMIT:
        engine.step()
        steps += 1
    engine.remove(engine.rids())
    return time.perf_counter() - start


def warm_kernels(model: Any) -> float:
    """Run `model` once at each of the shapes above, each with ids of both integer types (a
    prompt's and a sampled token's), so that MLX compiles the kernels they need now rather than
    under the first requests; its seconds. Leaves the model as it was (a throwaway cache)."""
    from mlx_lm.models.cache import make_prompt_cache

    start = time.perf_counter()
    for rows in WARM_ROWS:
        for tokens in WARM_TOKENS:
            for dtype in (mx.int32, mx.uint32):
                mx.eval(model(mx.zeros((rows, tokens), dtype=dtype), cache=make_prompt_cache(model)))
    return time.perf_counter() - start


@contextlib.contextmanager
def kernels_locked(directory: str | None) -> Iterator[None]:
    """Hold `directory`'s build lock: replicas that start together on one host take turns, so
    the second reads what the first compiled instead of compiling it again, and never reads a
    kernel file while the first is still writing it (MLX writes them in place)."""
    try:
        import fcntl
    except ImportError:  # no flock (Windows, where MLX has no CUDA backend): nothing to share
        yield
        return
    lock = None
    if directory:
        try:
            Path(directory).mkdir(parents=True, exist_ok=True)
            lock = open(Path(directory) / ".build.lock", "a")  # noqa: SIM115 (closed below)
        except OSError as exc:  # MLX then keeps no kernels there either: build without the lock
            log.warning("cuda_kernel_dir_unusable", where=directory, error=str(exc))
    if lock is None:
        yield
        return
    with lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)

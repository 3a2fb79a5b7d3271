"""Builds the real engine on the worker thread: load the model, wrap its tokenizer, make an
`MLXEngine`. The result's `Loaded` half goes back to the event loop."""

from __future__ import annotations

import os
import time
from typing import TYPE_CHECKING, Any

import mlx.core as mx
import msgspec
import structlog
from mlx_lm.models.cache import KVCache

from workers.batching.engine import MLXEngine
from workers.batching.grammar import grammar_tokenizer
from workers.batching.hostpad import unavailable as host_padding_unavailable
from workers.batching.mlxlm import hf_tokenizer, keep_leading_space
from workers.batching.quantfold import fold_decode_batch
from workers.blas import BlasState, blas_state
from workers.cuda import (
    KERNELS,
    apply_cuda_defaults,
    came_late,
    kernels_locked,
    mlx_used,
    warm_engine,
    warm_kernels,
)
from workers.loading.dtypes import Dequantize, DTypeName, Precision, on_cuda, quantized_layers
from workers.loading.models import ModelInfo, load, model_info, resolve_model
from workers.loading.streamdetok import RustDetokenizer, rust_detokenizer, whole_tokens

if TYPE_CHECKING:
    from collections.abc import Callable

    from workers.batching.contract import Engine

log = structlog.get_logger("workers")


class TokenizerCodec:
    """Text in and out through an mlx-lm `TokenizerWrapper` (used on the event loop only).
    Streaming detokenizers are the Rust `DecodeStream` where it gives mlx-lm's text
    (`streamdetok.py`), else mlx-lm's; `detokenizer_note` says which, and why."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        hf = hf_tokenizer(tokenizer)
        why = rust_detokenizer(hf, keep_leading_space(tokenizer.detokenizer))
        self._rust: Any = None if why else hf.backend_tokenizer
        self._whole = None if why else whole_tokens(self._rust)
        self.detokenizer_note = why or "rust"

    def encode(self, text: str) -> list[int]:
        # As mlx_lm.generate does: special tokens (BOS) unless the text already starts with BOS.
        bos = self.tokenizer.bos_token
        add_special = bos is None or not text.startswith(bos)
        return list(self.tokenizer.encode(text, add_special_tokens=add_special))

    def detokenizer(self) -> Any:
        if self._rust is not None:
            return RustDetokenizer(self._rust, self._whole)
        return keep_leading_space(self.tokenizer.detokenizer)


class Loaded(msgspec.Struct, frozen=True):
    """What the scheduler needs to know about the model the worker loaded."""

    info: ModelInfo
    codec: Any
    device_memory: int | None = None
    """Bytes of memory the MLX device offers (`device_memory`; None on the CPU backend)."""
    dense_step: int = 1
    """The engine's batch cache grows its buffer by this many tokens at a time (mlx-lm: 256)."""
    kv_reuse: bool = False
    """Whether the engine can keep and reuse prefix blocks."""
    sessions: bool = False
    """Whether the engine can keep a session's caches and continue from them."""
    prefix_unavailable: str = ""
    """Why prefix blocks cannot work with this model's caches ("" when they can)."""
    mask_free_unavailable: str = ""
    """Why decode steps cannot skip mlx-lm's attention mask ("" when they can)."""
    padded_attention: bool = False
    """On CUDA: padded decode rows' attention runs `padded_attention`'s kernel."""
    padded_attention_unavailable: str = ""
    """On CUDA, why it does not ("" when it does, or off CUDA)."""
    fuse_unavailable: str = ""
    """Why decode steps cannot carry prefill chunks as `fuse_prefill` asks ("" when they can)."""
    fused_prefill: bool = False
    """Whether each decode step's forward pass carries the next prefill chunk."""
    prefill_pad: int = 0
    """Prefill passes' prompts are right-padded to a multiple of this many tokens (0: not)."""
    prefill_every: int = 1
    """Under a step token budget, while others decode, prefill plans up to this many steps' budget."""
    prefill_thread: bool = False
    """Whether prompts prefill on a thread of their own (`prefill_thread.py`)."""
    prefill_spread: bool = False
    """Whether a plan's chunk is spread over the steps until the next, a share of the layers each."""
    prefill_thread_unavailable: str = ""
    """Why they cannot as `[worker] prefill_thread` asks ("" when they can, or it does not ask)."""
    host_padding_unavailable: str = ""
    """Why rows leaving the batch wait for the device, as in mlx-lm ("" when they do not)."""
    precision: Precision = Precision(dtype="")
    """The compute dtype the weights were given on this device, and any dequantization."""
    blas: BlasState = BlasState("")
    """The BLAS under MLX's CPU backend in the worker's process."""
    grammar_unavailable: str = ""
    """Why this model cannot do structured output ("" when it can)."""
    cuda_settings_late: str = ""
    """Why the CUDA settings the worker applies (`workers.cuda`) do not take effect ("" when they do)."""


def mlx_engine_factory(
    path: str,
    *,
    cache_dir: str | None,
    max_batch: int,
    prefill_batch: int,
    prefill_step: int,
    step_token_budget: int | str = "auto",
    prefill_every: int | str = "auto",
    prefill_thread: bool = False,
    prefill_spread: bool | str = "auto",
    prefill_chunks: str = "auto",
    prefill_pack: bool = True,
    prefill_order: str = "arrival",
    fuse_prefill: bool | str = "auto",
    prefill_pad: int | str = "auto",
    block_tokens: int = 256,
    cuda_graphs: str = "auto",
    fold_quantized: bool = True,
    dtype: DTypeName = "auto",
    dequantize: Dequantize = "auto",
) -> Callable[[], tuple[Engine, Loaded]]:
    """A factory to call on the worker thread (MLX streams are thread-local)."""

    def build() -> tuple[Engine, Loaded]:
        used = mlx_used()  # by the embedding process, before the scheduler began
        directory = resolve_model(path, cache_dir)
        # Before the model's first GPU use: MLX reads them once.
        cuda_late = came_late(apply_cuda_defaults(cuda_graphs, directory, cache_dir, dequantize, used), used)
        loaded_model = load(str(directory), cache_dir, dtype=dtype, dequantize=dequantize)
        model, tokenizer = loaded_model.model, loaded_model.tokenizer
        if fold_quantized and on_cuda():
            folded = fold_decode_batch(model)
            if folded:
                log.info("quantized_decode_folded", layers=folded,
                         note="[worker] fold_quantized = false turns it off")
        if on_cuda() and quantized_layers(model):  # their matmuls use kernels MLX compiles
            kernels = os.environ.get(KERNELS)
            log.info("cuda_kernels_warming", where=kernels,
                     note="compiled once per machine and MLX version (minutes), then read from there")
            start = time.perf_counter()
            with kernels_locked(kernels):  # replicas on one host take turns
                waited = time.perf_counter() - start
                seconds = round(warm_kernels(model), 1)
            log.info("cuda_kernels_warmed", seconds=seconds, waited_s=round(waited, 1))
        info = model_info(model, tokenizer, directory, name=path)  # path: the directory it loaded
        grammar, grammar_unavailable = grammar_tokenizer(hf_tokenizer(tokenizer), info.vocab_size)
        engine = MLXEngine(
            model,
            vocab_size=info.vocab_size,
            max_batch=max_batch,
            prefill_batch=prefill_batch,
            prefill_step=prefill_step,
            step_token_budget=step_token_budget,
            prefill_every=prefill_every,
            prefill_thread=prefill_thread,
            prefill_spread=prefill_spread,
            queue_chunks=prefill_chunks != "blocking",  # "auto": queued on every backend
            pack_prompts=prefill_pack,
            shortest_first=prefill_order == "length",
            fuse_prefill=fuse_prefill,
            prefill_pad=prefill_pad,
            block_tokens=block_tokens,
            grammar=grammar,
        )
        if on_cuda():
            with kernels_locked(os.environ.get(KERNELS)):
                seconds = round(warm_engine(engine, info.vocab_size), 1)
            log.info("cuda_engine_warmed", seconds=seconds,
                     note="a few short requests compiled the kernels of the first requests' paths")
        loaded = Loaded(
            info, TokenizerCodec(tokenizer), device_memory(), dense_step=KVCache.step,
            kv_reuse=engine.reuses_kv, sessions=engine.support.sessions,
            prefix_unavailable=engine.support.reason,
            mask_free_unavailable=engine.mask_free_unavailable,
            fuse_unavailable=engine.fuse_unavailable, fused_prefill=engine.fused,
            padded_attention=engine.padded_attention,
            padded_attention_unavailable=engine.padded_attention_unavailable,
            prefill_pad=engine.prefill_pad, prefill_every=engine.prefill_every,
            prefill_thread=engine.prefill_threaded,
            prefill_spread=engine.prefill_spread,
            prefill_thread_unavailable=engine.prefill_thread_unavailable,
            host_padding_unavailable=host_padding_unavailable(),
            precision=loaded_model.precision, blas=blas_state(),
            grammar_unavailable=grammar_unavailable, cuda_settings_late=cuda_late,
        )
        return engine, loaded

    return build


BUFFER_CACHE_SHARE = 0.25
"""MLX keeps freed buffers for reuse up to its cache limit, by default about the device's whole
memory, and on CUDA our prefill path never empties that cache (`prefill.py`): a long run at many
streams can hold much of a GPU in cached buffers that another process on it (a second replica, a
peer) then cannot get. Measured on an H200: a server started beside a process that had run 256
streams failed requests with "cudaMallocAsync ... out of memory". So the cache is bounded by a
share of the model's memory budget (`[kvpool] memory`), which the rest of the device can spare.
It never rises above MLX's own cap: on its CPU backend that is 32 MiB, and raising it to the share
(5 GiB on a 2-core machine) let the cache grow past 1 GiB and made one step in about a hundred
take 3-8x as long, in bursts (`synthetic:small`, 32 streams)."""
MIN_BUFFER_CACHE = 256 * 2**20
_mlx_cap: list[int] = []  # MLX's own cache limit, read at the first bound


def bound_buffer_cache(budget_bytes: int) -> int:
    """Cap MLX's buffer cache for a model whose weights and KV are given `budget_bytes`: the cap."""
    limit = max(MIN_BUFFER_CACHE, int(budget_bytes * BUFFER_CACHE_SHARE))
    previous = mx.set_cache_limit(limit)
    if not _mlx_cap:
        _mlx_cap.append(previous)
    if _mlx_cap[0] < limit:
        limit = _mlx_cap[0]
        mx.set_cache_limit(limit)
    return limit


def mlx_cache_cap() -> int | None:
    """MLX's own buffer cache limit, as the first `bound_buffer_cache` found it (None before)."""
    return _mlx_cap[0] if _mlx_cap else None


def release_mlx_thread() -> None:
    """The last call of a thread that used MLX, on that thread: its streams go while the
    interpreter and the device runtime are still up. Left to thread-local destructors at exit,
    MLX's teardown aborts the process now and then ("terminate called without an active
    exception", rc -6, after a clean run); MLX's maintainers ask for `clear_streams` at the end
    of every such thread. The thread can use MLX no more after it."""
    mx.synchronize()
    mx.clear_streams()


def device_memory() -> int | None:
    """The memory a model may use on MLX's device, where the backend says: on Metal the
    recommended working set (what mlx-lm wires), on CUDA the device's total memory."""
    info = mx.device_info()
    for key in ("max_recommended_working_set_size", "total_memory", "memory_size"):
        value = info.get(key)
        if isinstance(value, int) and value > 0:
            return value
    return None

"""How a `Scheduler` is put together: the engine its config names, what the loaded model can
do (logged once at start), the stats snapshot, and the cancel scopes of its actors."""

from __future__ import annotations

from typing import TYPE_CHECKING

import anyio
import structlog

from scheduler.types import SchedulerStats
from workers.factory import BUFFER_CACHE_SHARE, Loaded, bound_buffer_cache, mlx_cache_cap, mlx_engine_factory

if TYPE_CHECKING:
    from kvpool.pool import Pool
    from scheduler.admission.actor import Admission
    from scheduler.config import SchedulerConfig
    from workers.worker import EngineFactory

log = structlog.get_logger("scheduler")


def real_engine_factory(c: SchedulerConfig) -> EngineFactory[Loaded]:
    """The mlx-lm engine that `c` describes (what a Scheduler runs unless told otherwise)."""
    return mlx_engine_factory(
        c.model.path,
        cache_dir=c.model.cache_dir,
        max_batch=c.worker.max_batch,
        prefill_batch=c.worker.prefill_batch,
        prefill_step=c.worker.prefill_step,
        step_token_budget=c.worker.step_token_budget,
        prefill_every=c.worker.prefill_every,
        prefill_thread=c.worker.prefill_thread,
        prefill_spread=c.worker.prefill_spread,
        prefill_chunks=c.worker.prefill_chunks,
        prefill_pack=c.worker.prefill_pack,
        prefill_order=c.worker.prefill_order,
        fuse_prefill=c.worker.fuse_prefill,
        prefill_pad=c.worker.prefill_pad,
        block_tokens=c.kvpool.block_tokens,
        cuda_graphs=c.worker.cuda_graphs,
        fold_quantized=c.worker.fold_quantized,
        dtype=c.model.dtype,
        dequantize=c.model.dequantize,
    )


def log_model_facts(loaded: Loaded) -> None:
    """What the model and the machine can and cannot do, said once: BLAS, precision, and each
    optimisation a model's layers rule out."""
    info = loaded.info
    if loaded.blas.library == "openblas":
        log.info("cpu_blas", library="openblas", threads=loaded.blas.threads, path=loaded.blas.path)
    elif loaded.blas.library:
        log.warning("cpu_blas_bundled", library=loaded.blas.library, reason=loaded.blas.reason)
    if loaded.precision.dtype:
        log.info("model_precision", model=info.name, dtype=loaded.precision.dtype,
                 dequantized_layers=loaded.precision.dequantized, note=loaded.precision.note)
    note = getattr(loaded.codec, "detokenizer_note", "")
    if note:
        log.info("detokenizer", model=info.name, kind="rust" if note == "rust" else "mlx-lm",
                 reason="" if note == "rust" else note)
    if loaded.prefix_unavailable:
        log.warning("prefix_cache_unavailable", model=info.name, reason=loaded.prefix_unavailable)
    if loaded.mask_free_unavailable:
        log.warning("mask_free_decode_unavailable", model=info.name,
                    reason=loaded.mask_free_unavailable)
    if loaded.fuse_unavailable:
        log.warning("fused_prefill_unavailable", model=info.name, reason=loaded.fuse_unavailable,
                    note="a step that prefills while others decode runs a forward pass of its own")
    if loaded.prefill_thread_unavailable:
        log.warning("prefill_thread_unavailable", model=info.name, reason=loaded.prefill_thread_unavailable,
                    note="prompts prefill inside the decode steps")
    if loaded.padded_attention_unavailable:
        log.warning("padded_attention_unavailable", model=info.name,
                    reason=loaded.padded_attention_unavailable,
                    note="padded decode rows keep MLX's masked attention (unfused on CUDA)")
    if loaded.host_padding_unavailable:
        log.warning("host_padding_unavailable", model=info.name, reason=loaded.host_padding_unavailable,
                    note="rows that leave the batch wait for the device, as in mlx-lm's loop")
    if loaded.grammar_unavailable:
        log.warning("structured_output_unavailable", model=info.name, reason=loaded.grammar_unavailable)
    if not loaded.sessions:
        log.warning("session_cache_unavailable", model=info.name,
                    reason="a layer's cache class cannot be extracted from a batch")


def bound_cache(loaded: Loaded, blocks: int, block_tokens: int) -> None:
    """MLX's buffer cache within a share of what the model was given (weights and KV books)."""
    budget = loaded.info.weights_bytes + blocks * block_tokens * loaded.info.kv_bytes_per_token
    limit = bound_buffer_cache(budget)
    log.info("mlx_cache_limit", bytes=limit, share=BUFFER_CACHE_SHARE, of_bytes=budget,
             mlx_cap=mlx_cache_cap())


def build_stats(a: Admission, p: Pool, loaded: Loaded | None) -> SchedulerStats:
    """A snapshot of queue, batch and pool."""
    c, s = a.counters, p.snapshot
    weights = loaded.info.weights_bytes if loaded is not None else 0
    return SchedulerStats(
        running=a.running, waiting=a.waiting, engine_batch=c.engine_batch,
        blocks_total=s.blocks_total, blocks_used=s.blocks_used, blocks_cached=s.blocks_cached,
        blocks_free=s.blocks_free, finished=c.finished, rejected=c.rejected, steps=c.steps,
        generated_tokens=c.generated_tokens,
        blocks_padding=s.blocks_padding, block_tokens=s.block_tokens,
        kv_budget_bytes=s.blocks_total * s.bytes_per_block,
        kv_bytes=(s.blocks_used + s.blocks_cached) * s.bytes_per_block,
        weights_bytes=weights, active_bytes=c.active_bytes,
        preemptions=c.preemptions, evictions=s.evictions, cache_entries=s.cache_entries,
        prefix_queries=c.prefix_queries, prefix_query_tokens=c.prefix_query_tokens,
        prefix_hit_tokens=c.prefix_hit_tokens, session_hits=c.session_hits,
        session_fallbacks=c.session_fallbacks,
        prefix_cache_available=loaded is None or not loaded.prefix_unavailable,
        mask_free_decode=loaded is None or not loaded.mask_free_unavailable,
        host_padding=loaded is None or not loaded.host_padding_unavailable,
        fused_prefill=loaded is not None and loaded.fused_prefill,
        padded_attention=loaded is not None and loaded.padded_attention,
        prefill_pad=loaded.prefill_pad if loaded else 0,
        prefill_every=loaded.prefill_every if loaded else 1,
        prefill_thread=loaded is not None and loaded.prefill_thread,
        prefill_spread=loaded is not None and loaded.prefill_spread,
        structured_output=loaded is None or not loaded.grammar_unavailable,
        cuda_settings_applied=loaded is None or not loaded.cuda_settings_late,
        blas=loaded.blas.library if loaded else "",
        blas_note=loaded.blas.reason if loaded else "",
    )


class Scopes:
    """A cancel scope per actor task, all cancelled together."""

    def __init__(self) -> None:
        self._scopes: list[anyio.CancelScope] = []
        self._cancelled = False

    def new(self) -> anyio.CancelScope:
        scope = anyio.CancelScope()
        if self._cancelled:
            scope.cancel()
        self._scopes.append(scope)
        return scope

    def cancel(self) -> None:
        self._cancelled = True
        for scope in self._scopes:
            scope.cancel()


def is_wrapping(group: BaseException, exc: BaseException) -> bool:
    if group is exc:
        return True
    if isinstance(group, BaseExceptionGroup):
        return all(is_wrapping(e, exc) for e in group.exceptions)
    return False




"""The values the public API hands back: chunks, completions, timings and stats."""

from __future__ import annotations

from typing import Literal

import msgspec

FinishReason = Literal["stop", "length", "cancelled", "timeout", "error"]


class Timings(msgspec.Struct, frozen=True):
    """Seconds since submission. `ttft_s` is None when no token was produced."""

    queue_s: float
    ttft_s: float | None
    e2e_s: float


class TokenLogprob(msgspec.Struct, frozen=True, array_like=True):
    """One generated token's log-probability and the likeliest tokens at its place, best first,
    as (token_id, logprob). Log-probabilities are of the distribution the sampler drew from
    before temperature, top-p, top-k and min-p: after penalties and `logit_bias`."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]] = []


class Chunk(msgspec.Struct, frozen=True):
    """New text of one request. Exactly one chunk per request has a `finish_reason`: the last,
    which also carries the token counts, timings and (for "error") the error message."""

    request_id: int
    text: str
    token_ids: list[int]
    finish_reason: FinishReason | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    timings: Timings | None = None
    error: str | None = None
    cached_tokens: int = 0
    """Prompt tokens whose KV came from prefix blocks or a session instead of prefill."""
    logprobs: list[TokenLogprob] | None = None
    """With `SamplingParams(logprobs=True)`: one per token of `token_ids`, in order."""
    index: int = 0
    """Which choice this chunk belongs to, with `SamplingParams(n=...)`; each has its own final."""
    stop: str | None = None
    """On a final chunk that ended with "stop": the stop string that ended it (None: EOS or a
    stop token)."""


class Completion(msgspec.Struct, frozen=True):
    """A whole request, as `complete()` returns it."""

    request_id: int
    text: str
    token_ids: list[int]
    finish_reason: FinishReason
    prompt_tokens: int
    completion_tokens: int
    timings: Timings
    error: str | None = None
    cached_tokens: int = 0
    """Prompt tokens whose KV came from prefix blocks or a session instead of prefill."""
    logprobs: list[TokenLogprob] | None = None
    """With `SamplingParams(logprobs=True)`: one per token of `token_ids`, in order."""
    index: int = 0
    choices: list[Completion] = []
    """With `SamplingParams(n=...)` above 1: every choice, by index (this one is the first)."""


class SchedulerStats(msgspec.Struct, frozen=True):
    """A snapshot. Idle means running == waiting == engine_batch == blocks_used == 0."""

    running: int
    waiting: int
    engine_batch: int
    blocks_total: int
    blocks_used: int
    blocks_cached: int
    blocks_free: int
    finished: int
    rejected: int
    steps: int
    generated_tokens: int
    blocks_padding: int = 0
    """Blocks (of `blocks_used`) the dense batch cache spends on padding shorter rows."""
    block_tokens: int = 0
    kv_budget_bytes: int = 0
    """The pool: `[kvpool] memory` less the weights, in whole blocks."""
    kv_bytes: int = 0
    """What the books hold: (blocks_used + blocks_cached) x bytes per block."""
    weights_bytes: int = 0
    active_bytes: int = 0
    """MLX's active memory after the last step (weights, KV and scratch; 0 before any step)."""
    preemptions: int = 0
    evictions: int = 0
    """Cache entries (prefix blocks, sessions) evicted to make room."""
    cache_entries: int = 0
    prefix_queries: int = 0
    prefix_query_tokens: int = 0
    prefix_hit_tokens: int = 0
    """Prompt tokens whose KV came from the prefix cache instead of prefill."""
    session_hits: int = 0
    """Turns whose session's KV was kept (a turn that diverged from it still counts here)."""
    session_fallbacks: int = 0
    """Session turns that could not continue their kept KV and prefilled cold: the prompt diverged
    from a cache that cannot be trimmed (a rotated sliding window, a recurrent state) or shares
    nothing with it, or the last turn's KV could not be kept."""
    prefix_cache_available: bool = True
    """False when the model's caches cannot share prefix blocks (see the Models section)."""
    mask_free_decode: bool = True
    """False when no decode step can skip mlx-lm's attention mask (sliding-window or recurrent
    layers, or an mlx-lm whose internals changed; the log says which)."""
    fused_prefill: bool = False
    """True when a decode step's forward pass carries the next prefill chunk (`fuse_prefill`, on by
    default on the CPU and CUDA backends); false when the chunk runs a pass of its own: off by
    setting or on Metal by default, or the model's blocks are not llama's, qwen2's or qwen3's, or chunks block
    (the log says which)."""
    padded_attention: bool = False
    """True on CUDA when the decode rows' attention, with rows left-padded to a common length, runs
    one kernel of ours rather than MLX's unfused masked path (heads 64 or 128 wide; else the log says
    why). Always false off CUDA, where MLX's own path serves."""
    prefill_pad: int = 0
    """Prefill passes' prompts are right-padded to a multiple of this many tokens (`[worker]
    prefill_pad`; "auto": 64 on CUDA, else 0), so that their shapes repeat."""
    prefill_every: int = 1
    """Under a step token budget, while others decode, prefill plans up to this many steps' budget
    at once, and rests while its tokens take (`[worker] prefill_every`; "auto": 4 on CUDA, else 1)."""
    prefill_spread: bool = False
    """True when each plan's prefill chunk is spread over the steps until the next plan, a share of
    the model's layers each (`[worker] prefill_spread`, "auto": on CUDA; with a step token budget,
    `prefill_every` above 1 and the one-pass step); false otherwise."""
    prefill_thread: bool = False
    """True when prompts prefill on a thread of their own beside the decode steps (`[worker]
    prefill_thread`, off by default); false when off, or when the model's caches cannot leave
    and rejoin a batch (the log says so)."""
    host_padding: bool = True
    """False when rows that leave the batch wait for the device, as in mlx-lm's own loop (an
    mlx-lm whose batch cache changed; the log says what differs)."""
    structured_output: bool = True
    """False when the grammar engine cannot read this model's tokenizer (`json_schema` and
    `grammar` are then refused; the log says why)."""
    cuda_settings_applied: bool = True
    """False when the CUDA settings the scheduler applies (graphs and cuDNN's attention off for
    unquantized models) came after something in the process had run MLX on the GPU, so MLX kept
    its own (logged once as `cuda_defaults_late`). Always true off CUDA."""
    blas: str = ""
    """The BLAS under MLX's CPU backend: "openblas", "accelerate" (macOS) or "bundled" (the mlx
    wheel's reference BLAS, 20-50x slower for float32 matmuls)."""
    blas_note: str = ""
    """Why not OpenBLAS, when it is not (also logged once at start as `cpu_blas_bundled`)."""

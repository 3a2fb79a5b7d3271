"""Messages the GPU worker receives (commands) and emits (one event per engine step)."""

from __future__ import annotations

import msgspec


class SamplingSpec(msgspec.Struct, frozen=True, array_like=True):
    """How one sequence samples. Equal specs share one sampler (one batched sampling call)."""

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None


class Processing(msgspec.Struct, frozen=True, array_like=True):
    """A row's logits processors (mlx-lm's): penalties over its last `context` tokens, and
    additive biases; `grammar` (the grammar engine's text) holds its tokens to a grammar. Rows
    without them cost the step nothing."""

    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    context: int = 20
    logit_bias: tuple[tuple[int, float], ...] = ()
    grammar: str | None = None


class Logprobs(msgspec.Struct, frozen=True, array_like=True, gc=False):
    """The log-probability of a step's token `tokens[at]`, and the `top` likeliest tokens."""

    at: int
    logprob: float
    top_ids: list[int] = []
    top_logprobs: list[float] = []


Key = int | str
"""A stored KV entry: a prefix block's chained hash (int) or a session name (str); the same
meaning as `kvpool.books.Key` (the two packages do not import each other)."""


class Admit(msgspec.Struct, frozen=True, tag=True):
    """Insert a request into the batch. `prompt` is final: the worker never tokenizes.

    `prefix`: keys of stored prefix blocks that hold the KV of the prompt's first
    `len(prefix) * block_tokens` tokens; insert with that KV and prefill only the rest.
    `store`: keys of the prompt's next full blocks; once prefilled, keep their KV under them
    (skipping keys already stored) and report them in `StepOutput.stored`.
    `session`: keep the finished sequence's KV under this name; `resume`: start from it."""

    rid: int
    prompt: list[int]
    max_tokens: int
    sampling: SamplingSpec
    stop_token_ids: tuple[int, ...]
    prefix: list[int] = []
    store: list[int] = []
    session: str | None = None
    resume: bool = False
    sampled: int = 0
    """Tokens this request generated before (it was preempted): a seeded sampler skips as many."""
    processing: Processing | None = None
    logprobs: int = -1
    """-1: none; 0: each token's log-probability; k: and the k likeliest tokens'."""


class Abort(msgspec.Struct, frozen=True, tag=True):
    """Remove requests from the batch; the worker confirms each in `StepOutput.aborted`.
    `keep_sessions`: they ended (a stop string): a request with a session keeps its KV first."""

    rids: list[int]
    keep_sessions: bool = False


class Evict(msgspec.Struct, frozen=True, tag=True):
    """Drop the stored KV of these prefix blocks or sessions (the pool evicted them)."""

    keys: list[Key]


class Shutdown(msgspec.Struct, frozen=True, tag=True):
    """Stop stepping, close the engine and end the thread."""


WorkerCommand = Admit | Abort | Evict | Shutdown


class StepOutput(msgspec.Struct, frozen=True, array_like=True, gc=False, tag=True):
    """Everything one engine step produced. `rids[i]` emitted `tokens[i]`.

    A finished request's last token (if it counts as output) is in `tokens`; stop tokens are not.
    """

    step: int
    rids: list[int]
    tokens: list[int]
    finished: list[int]
    reasons: list[str]
    aborted: list[int]
    held: int
    t_start: float
    t_end: float
    prefill_tokens: int = 0
    stored: list[tuple[Key, int]] = []
    """KV newly stored this step, as (key, tokens): prefix blocks and finished sessions."""
    active_bytes: int = 0
    """MLX's active memory after the step."""
    session_fallbacks: int = 0
    """Session turns that could not continue their kept KV and prefilled cold."""
    handoff: bool = False
    """The worker waits for `GPUWorker.release` before building its next step (a first token)."""
    logprobs: list[Logprobs] = []
    """For the tokens of rows that asked for them."""


class WorkerFailed(msgspec.Struct, frozen=True, tag=True):
    """The engine raised; the requests it held (`rids`) are lost and end with `error`. If
    `restarted`, a fresh engine (`held` sequences) takes commands again; else the thread is gone."""

    message: str
    rids: list[int]
    restarted: bool
    held: int = 0


WorkerEvent = StepOutput | WorkerFailed

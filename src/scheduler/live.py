"""The admission core's record of one request and its counters (state it alone owns)."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from scheduler.chunks import ChunkOut
    from scheduler.detokenize import TextStream
    from scheduler.messages import Submit
    from scheduler.policy import QueueItem
    from scheduler.types import FinishReason


class State(enum.Enum):
    """Where a request is. WAITING -> ADMITTING -> PREFILLING -> RUNNING, then STOPPING (its end
    is decided, the worker still holds its row) or PREEMPTING (back to WAITING), and FINISHED."""

    WAITING = "waiting"
    """In the policy's queue."""
    ADMITTING = "admitting"
    """Taken from the queue; its Reserve is in the pool batch in flight."""
    PREFILLING = "prefilling"
    """Granted and sent to the worker; no token yet."""
    RUNNING = "running"
    PREEMPTING = "preempting"
    """Asked to leave the batch to free memory; requeued once the worker confirms."""
    STOPPING = "stopping"
    """Ended (cancel, timeout, stop string); the worker has yet to confirm it dropped the row."""
    FINISHED = "finished"


HOLDS_ROW = frozenset({State.PREFILLING, State.RUNNING, State.PREEMPTING, State.STOPPING})
"""States in which the worker holds (or is about to hold) the request's row and its blocks."""


@dataclass(eq=False, slots=True)
class Live:
    """One request from submission to its final chunk (and, if it held a row, the release)."""

    item: QueueItem
    submit: Submit
    out: ChunkOut
    text: TextStream
    state: State = State.WAITING
    sent_final: bool = False
    """The final chunk went out (a STOPPING request may still hold its row)."""
    ending: tuple[FinishReason, str, list[int], str | None] | None = None
    """A final chunk that waits: for the worker to keep a session (stop string), or for the
    pool to confirm the release, so a caller who sees the end also sees the blocks back."""
    admitted_at: float | None = None
    first_token_at: float | None = None
    last_token_at: float = 0.0
    completion_tokens: int = 0
    blocks: int = 0
    prompt: list[int] = field(default_factory=list)
    """What its row is (re)admitted with: the prompt, plus what it generated before a preemption."""
    keys: list[int] | None = None
    """Chained keys of `prompt`'s full blocks (computed once per `prompt`)."""
    tokens: list[int] = field(default_factory=list)
    """Every token generated so far."""
    length: int = 0
    """Tokens in its row now (while it holds one)."""
    final: int = 0
    """Tokens in its row when it reaches max_tokens."""
    pinned: bool = False
    preemptions: int = 0
    cached_tokens: int = 0
    """Prompt tokens its first admission found cached (prefix blocks or a session)."""
    parts: list[str] | None = None
    """Text so far of a request that is not streamed (it gets one chunk); None when streamed."""

    @property
    def rid(self) -> int:
        return self.item.rid


@dataclass
class Counters:
    finished: int = 0
    rejected: int = 0
    steps: int = 0
    generated_tokens: int = 0
    engine_batch: int = 0
    preemptions: int = 0
    prefix_queries: int = 0
    prefix_query_tokens: int = 0
    prefix_hit_tokens: int = 0
    session_hits: int = 0
    session_fallbacks: int = 0
    active_bytes: int = 0

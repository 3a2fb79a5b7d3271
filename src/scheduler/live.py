"""The admission actor's record of one request and its counters (state it alone owns)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from anyio.streams.memory import MemoryObjectSendStream

    from scheduler.dispatcher import TextStream
    from scheduler.messages import Submit
    from scheduler.policy import QueueItem
    from scheduler.types import Chunk


@dataclass(eq=False)
class Live:
    """One request from submission to its final chunk (and, if running, the worker's release)."""

    item: QueueItem
    submit: Submit
    out: MemoryObjectSendStream[Chunk]
    text: TextStream
    admitted_at: float | None = None
    first_token_at: float | None = None
    last_token_at: float = 0.0
    completion_tokens: int = 0
    running: bool = False
    ended: bool = False
    """The final chunk has been sent; a running request still waits for the worker to drop it."""
    blocks: int = 0
    pending: list[int] = field(default_factory=list)
    prompt: list[int] = field(default_factory=list)
    """What its row is (re)admitted with: the prompt, plus what it generated before a preemption."""
    keys: list[int] | None = None
    """Chained keys of `prompt`'s full blocks (computed once per `prompt`)."""
    tokens: list[int] = field(default_factory=list)
    """Every token generated so far."""
    length: int = 0
    """Tokens in its row now (while running)."""
    final: int = 0
    """Tokens in its row when it reaches max_tokens."""
    pinned: bool = False
    stopping: tuple[str, list[int]] | None = None
    """A stop string ended it; its final text and tokens wait for the worker to keep its session."""
    preempting: bool = False
    preemptions: int = 0
    cached_tokens: int = 0
    """Prompt tokens its first admission found cached (prefix blocks or a session)."""


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

"""The admission core's record of one request and its counters (state it alone owns)."""

from __future__ import annotations

import enum
import heapq
import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from scheduler.types import Chunk, Timings, TokenLogprob

if TYPE_CHECKING:
    from collections.abc import Container

    from scheduler.admission.messages import Submit
    from scheduler.policy import QueueItem
    from scheduler.streaming.chunks import ChunkOut
    from scheduler.streaming.detokenize import TextStream
    from scheduler.types import FinishReason
    from workers.messages import StepOutput


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
    index: int = 0
    """Which choice of its request this is (its chunks carry it)."""
    logprobs: list[TokenLogprob] | None = None
    """Log-probabilities not yet delivered (None: not asked for): those of the tokens since the
    last chunk when streamed, all of them when not."""

    @property
    def rid(self) -> int:
        return self.item.rid

    def took(self, tokens: list[int], now: float) -> tuple[int, float | None, float | None]:
        """Count a step's tokens for it, arrived at `now` (it is running from its first): how
        many, and either the time to its first token (these are its first) or the gap since its
        last ones."""
        n = len(tokens)
        self.completion_tokens += n
        self.tokens.extend(tokens)
        self.length += n
        if self.state is State.PREFILLING:
            self.state = State.RUNNING
        if self.first_token_at is None:
            self.first_token_at = self.last_token_at = now
            return n, now - self.submit.submitted_at, None
        gap, self.last_token_at = now - self.last_token_at, now
        return n, None, gap

    def take_logprobs(self) -> list[TokenLogprob] | None:
        """What the next chunk carries: the pending log-probabilities, aligned with its tokens."""
        lps = self.logprobs
        if lps is not None and self.parts is None:
            self.logprobs = []
        return lps

    def final_chunk(
        self, reason: FinishReason, text: str, tokens: list[int], error: str | None, now: float
    ) -> Chunk:
        """Its last chunk: the finish reason, token counts and timings (a request that is not
        streamed gets everything in it)."""
        if self.parts is not None:
            text, tokens = "".join(self.parts) + text, list(self.tokens)
        t0 = self.submit.submitted_at
        queue_s = (self.admitted_at if self.admitted_at is not None else now) - t0
        ttft_s = None if self.first_token_at is None else self.first_token_at - t0
        return Chunk(
            self.rid, text, tokens, reason, len(self.submit.tokens), self.completion_tokens,
            Timings(queue_s=queue_s, ttft_s=ttft_s, e2e_s=now - t0), error, self.cached_tokens,
            self.take_logprobs(), self.index, self.text.matched if reason == "stop" else None,
        )


class Deadlines:
    """Requests' deadlines, soonest first; an entry of a request that ended is skipped."""

    def __init__(self) -> None:
        self._heap: list[tuple[float, int]] = []

    def add(self, deadline: float, rid: int) -> None:
        heapq.heappush(self._heap, (deadline, rid))

    def next(self, live: Container[int]) -> float:
        """The soonest deadline of a request still in `live` (inf: none)."""
        heap = self._heap
        while heap and heap[0][1] not in live:
            heapq.heappop(heap)
        return heap[0][0] if heap else math.inf

    def due(self, now: float) -> list[int]:
        """The requests whose deadline has passed, taken out."""
        out = []
        while self._heap and self._heap[0][0] <= now:
            out.append(heapq.heappop(self._heap)[1])
        return out

    def clear(self) -> None:
        self._heap.clear()


def logprobs_by_row(out: StepOutput) -> dict[int, list[TokenLogprob]]:
    """A step's log-probabilities grouped by request, in token order."""
    per_row: dict[int, list[TokenLogprob]] = {}
    for lp in out.logprobs:
        top = list(zip(lp.top_ids, lp.top_logprobs, strict=True))
        entry = TokenLogprob(out.tokens[lp.at], lp.logprob, top)
        per_row.setdefault(out.rids[lp.at], []).append(entry)
    return per_row


def by_row(rids: list[int], tokens: list[int]) -> dict[int, list[int]]:
    """A step's tokens grouped by request, in order."""
    per_row: dict[int, list[int]] = {}
    for rid, token in zip(rids, tokens, strict=True):
        got = per_row.get(rid)
        if got is None:
            per_row[rid] = [token]
        else:
            got.append(token)
    return per_row


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

"""What the worker steps: the `Engine` protocol and the `StepResult` of one step. No MLX here:
`engine.MLXEngine` implements it over mlx-lm's BatchGenerator; tests of actor logic substitute a
fake."""

from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple, Protocol

if TYPE_CHECKING:
    from collections.abc import Callable, Sequence

    from workers.messages import Admit, Key, Logprobs


class StepResult(NamedTuple):
    """One step: `rids[i]` emitted `tokens[i]`; `finished` ended with `reasons`; and how many
    prompt tokens were prefilled in it."""

    rids: list[int]
    tokens: list[int]
    finished: list[int]
    reasons: list[str]
    prefill_tokens: int = 0
    stored: list[tuple[Key, int]] = []
    """KV newly kept this step: prefix blocks and finished sessions, as (key, tokens)."""
    active_bytes: int = 0
    """The backend's active memory after the step (0: not measured)."""
    session_fallbacks: int = 0
    """Session turns inserted since the last step that could not continue their kept KV (see
    `SchedulerStats.session_fallbacks`) and prefill cold."""
    first: bool = False
    """Some request emitted its first token in this step (the worker hands the loop its turn)."""
    logprobs: list[Logprobs] = []
    """For the tokens of rows that asked for them (`at` indexes `tokens`)."""


class Engine(Protocol):
    """A continuous-batching engine keyed by our request ids."""

    def insert(self, admits: Sequence[Admit]) -> None: ...

    def remove(self, rids: Sequence[int]) -> None: ...

    def step(self) -> StepResult: ...

    def evict(self, keys: Sequence[Key]) -> None:
        """Drop stored prefix blocks or sessions."""
        ...

    def keep_sessions(self, rids: Sequence[int]) -> list[tuple[Key, int]]:
        """Keep the KV of those of `rids` that have a session (before they are removed)."""
        ...

    def has_work(self) -> bool: ...

    def held(self) -> int:
        """Sequences the underlying engine holds right now."""
        ...

    def rids(self) -> list[int]:
        """The requests the engine holds."""
        ...

    def reset(self) -> None:
        """Drop every sequence and start afresh (after a failed step)."""
        ...

    def close(self) -> None: ...

    on_queue: Callable[[], None] | None
    """Called on the engine's thread inside `step`, once the step's decode is built and right
    before it is handed to the device (None: not called)."""

    @property
    def calls_on_queue(self) -> bool:
        """Whether a `step` that decodes calls `on_queue`."""
        ...

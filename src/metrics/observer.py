"""What the admission actor reports as requests move along. The decode loop reports nothing:
the actor derives every figure from the worker's per-step message, off the worker thread."""

from __future__ import annotations

from typing import Protocol


class Observer(Protocol):
    """Receives lifecycle facts; implementations aggregate them (counters, histograms)."""

    def submitted(self, tenant: str, prompt_tokens: int) -> None: ...

    def rejected(self, reason: str) -> None: ...

    def admitted(self, queue_s: float) -> None: ...

    def tokens(self, n: int, ttft_s: float | None, itl_s: float | None) -> None:
        """`n` new tokens of one request; `ttft_s` on its first, else the gap since its last."""
        ...

    def finished(
        self, reason: str, prompt_tokens: int, completion_tokens: int, queue_s: float, e2e_s: float
    ) -> None: ...

    def step(self, batch: int, step_s: float, tokens: int) -> None: ...

    def preempted(self) -> None:
        """A running request was preempted (its blocks freed, the request requeued)."""
        ...

    def prefix_query(self, hit_tokens: int, total_tokens: int) -> None:
        """A prompt of `total_tokens` was looked up in the prefix cache; `hit_tokens` were found."""
        ...


class NullObserver:
    """Observes nothing."""

    def submitted(self, tenant: str, prompt_tokens: int) -> None:
        pass

    def rejected(self, reason: str) -> None:
        pass

    def admitted(self, queue_s: float) -> None:
        pass

    def tokens(self, n: int, ttft_s: float | None, itl_s: float | None) -> None:
        pass

    def finished(
        self, reason: str, prompt_tokens: int, completion_tokens: int, queue_s: float, e2e_s: float
    ) -> None:
        pass

    def step(self, batch: int, step_s: float, tokens: int) -> None:
        pass

    def preempted(self) -> None:
        pass

    def prefix_query(self, hit_tokens: int, total_tokens: int) -> None:
        pass

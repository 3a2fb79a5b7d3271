"""`EngineClient`: the one protocol the HTTP server, a cluster replica and the tests talk to.

`Scheduler` implements it. Code that serves requests (rather than owning a scheduler's lifetime)
takes an `EngineClient`, so it depends on these few methods and nothing else of the scheduler."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

if TYPE_CHECKING:
    from scheduler.config import SchedulerConfig
    from scheduler.request import Request
    from scheduler.streaming.stream import RequestStream
    from scheduler.types import SchedulerStats
    from workers.loading.models import ModelInfo


class LoadedModel(Protocol):
    """The model as a client sees it: its facts and its tokenizer."""

    @property
    def info(self) -> ModelInfo: ...

    @property
    def codec(self) -> Any: ...


@runtime_checkable
class EngineClient(Protocol):
    """A running engine: submit requests, read its model, stats and metrics, close it."""

    config: SchedulerConfig

    @property
    def model(self) -> LoadedModel: ...

    def submit(self, request: Request, *, stream: bool = True) -> RequestStream:
        """The request's chunks, submitted when iteration starts; the last has a finish_reason."""
        ...

    def chat_prompt(self, messages: list[dict[str, str]]) -> list[int]:
        """Token ids of `messages` under the model's chat template."""
        ...

    def stats(self) -> SchedulerStats: ...

    def metrics_text(self) -> str: ...

    async def aclose(self) -> None:
        """End every request and stop; idempotent."""
        ...

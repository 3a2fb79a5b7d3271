"""A test-only fault hook: wrap an engine factory so the engine fails, stalls or never loads."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, TypeVar

import msgspec

if TYPE_CHECKING:
    from collections.abc import Callable, Sequence

    from workers.batching.contract import Engine, StepResult
    from workers.messages import Admit, Key
    from workers.worker import EngineFactory

InfoT = TypeVar("InfoT")


class InjectedFault(RuntimeError):
    """Raised by a `FaultPlan`; never by real code."""


class FaultPlan(msgspec.Struct, frozen=True, kw_only=True):
    """Which engine steps (counted from 1 over the worker's life) fail or stall."""

    fail_at_steps: tuple[int, ...] = ()
    stall_at_steps: tuple[int, ...] = ()
    stall_s: float = 0.0
    fail_load: bool = False


class FaultyEngine:
    """Delegates to `inner`, injecting the plan's faults into `step`."""

    def __init__(self, inner: Engine, plan: FaultPlan) -> None:
        self._inner = inner
        self._plan = plan
        self.steps = 0

    def insert(self, admits: Sequence[Admit]) -> None:
        self._inner.insert(admits)

    def remove(self, rids: Sequence[int]) -> None:
        self._inner.remove(rids)

    def evict(self, keys: Sequence[Key]) -> None:
        self._inner.evict(keys)

    def keep_sessions(self, rids: Sequence[int]) -> list[tuple[Key, int]]:
        return self._inner.keep_sessions(rids)

    def step(self) -> StepResult:
        self.steps += 1
        if self.steps in self._plan.stall_at_steps:
            time.sleep(self._plan.stall_s)
        if self.steps in self._plan.fail_at_steps:
            raise InjectedFault(f"injected failure at step {self.steps}")
        return self._inner.step()

    def has_work(self) -> bool:
        return self._inner.has_work()

    @property
    def on_queue(self) -> Callable[[], None] | None:
        return self._inner.on_queue

    @on_queue.setter
    def on_queue(self, hook: Callable[[], None] | None) -> None:
        self._inner.on_queue = hook

    @property
    def calls_on_queue(self) -> bool:
        return self._inner.calls_on_queue

    def held(self) -> int:
        return self._inner.held()

    def rids(self) -> list[int]:
        return self._inner.rids()

    def reset(self) -> None:
        self._inner.reset()

    def close(self) -> None:
        self._inner.close()


def with_faults(factory: EngineFactory[InfoT], plan: FaultPlan) -> EngineFactory[InfoT]:
    def build() -> tuple[Engine, InfoT]:
        if plan.fail_load:
            raise InjectedFault("injected model-load failure")
        engine, info = factory()
        return FaultyEngine(engine, plan), info

    return build

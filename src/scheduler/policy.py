"""Scheduling policies: a small pure protocol and a registry of named implementations.

A policy orders the waiting queue. It does no I/O and reads no clock: the admission actor passes
`now`. The implementations live in `scheduler.policies`; `make_policy` builds one from config.
"""

from __future__ import annotations

import importlib
import re
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Protocol, runtime_checkable

import msgspec

from scheduler.policies import EDF, FCFS, SJF, Fair, Priority

if TYPE_CHECKING:
    from scheduler.config import SchedulingSection

__all__ = [
    "EDF", "FCFS", "POLICIES", "SJF", "Fair", "Policy", "PolicyFactory", "Priority", "QueueItem",
    "is_dotted_path", "known_policies", "make_policy",
]


class QueueItem(msgspec.Struct, frozen=True, kw_only=True):
    """What a policy knows about a waiting request."""

    rid: int
    seq: int
    """Arrival order, unique and increasing."""
    arrival: float
    prompt_tokens: int
    max_tokens: int
    priority: int = 0
    tenant: str = ""
    deadline: float | None = None


@runtime_checkable
class Policy(Protocol):
    """Orders waiting requests. Pure: no I/O, no clock reads; every `now` comes from the caller.

    Queue (push, pop, remove O(log n) or lazy):
    - `push(item, now)`: a request joins the queue (a preempted one joins again).
    - `peek(now)`: the request to admit next, None when there is none; `pop(now)` right after, at
      the same `now`, takes out and returns that same object.
    - `remove(rid)`: take a queued request out (cancel, timeout); None when it is not queued.
    - `len()`: queued requests, counting any the policy holds back (edf: past their deadline).
    Accounting, called by the admission actor:
    - `on_admitted(item, now)`: it entered the batch; `on_tokens(item, n)`: it was served n output
      tokens; `on_finished(item, now)`: it left the batch, for any reason.
    Preemption: `victim(running, now)`: the running request to preempt when memory must be freed;
    None: preempt nothing."""

    def push(self, item: QueueItem, now: float) -> None: ...

    def peek(self, now: float) -> QueueItem | None: ...

    def pop(self, now: float) -> QueueItem | None: ...

    def remove(self, rid: int) -> QueueItem | None: ...

    def __len__(self) -> int: ...

    def on_admitted(self, item: QueueItem, now: float) -> None: ...

    def on_tokens(self, item: QueueItem, n: int) -> None: ...

    def on_finished(self, item: QueueItem, now: float) -> None: ...

    def victim(self, running: Sequence[QueueItem], now: float) -> QueueItem | None: ...


PolicyFactory = Callable[["SchedulingSection"], Policy]
"""Builds a policy from the `[scheduler]` section (its per-policy option tables)."""


def _fair(section: SchedulingSection) -> Policy:
    o = section.fair
    return Fair(
        input_weight=o.input_weight, output_weight=o.output_weight, default_weight=o.default_weight,
        weights={tenant: t.weight for tenant, t in o.tenants.items()},
    )


POLICIES: dict[str, PolicyFactory] = {
    "fcfs": lambda section: FCFS(),
    "priority": lambda section: Priority(),
    "sjf": lambda section: SJF(max_wait_s=section.sjf.max_wait_s),
    "fair": _fair,
    "edf": lambda section: EDF(default_deadline_s=section.edf.default_deadline_s),
}
_PROTOCOL_METHODS = (
    "push", "peek", "pop", "remove", "__len__", "on_admitted", "on_tokens", "on_finished", "victim",
)
_DOTTED = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$")


def is_dotted_path(name: str) -> bool:
    return bool(_DOTTED.match(name))


def known_policies() -> str:
    """The registry's names in registry order, for error messages."""
    return ", ".join(POLICIES)


def make_policy(config: str | SchedulingSection) -> Policy:
    """A policy from the `[scheduler]` section (or a bare name, with default options): a registry
    name or `package.module:Class`, built with `[scheduler.custom]` as keyword arguments."""
    if isinstance(config, str):
        from scheduler.config import SchedulingSection  # config imports this module

        config = SchedulingSection(policy=config)
    name = config.policy
    if name in POLICIES:
        return POLICIES[name](config)
    if not is_dotted_path(name):
        raise ValueError(
            f"unknown policy {name!r}; known policies: {known_policies()}, or 'package.module:Class'"
        )
    module_name, _, class_name = name.partition(":")
    try:
        cls = getattr(importlib.import_module(module_name), class_name)
    except (ImportError, AttributeError) as exc:
        raise ValueError(f"cannot load policy {name!r}: {exc}") from exc
    if not callable(cls):
        raise ValueError(f"policy {name!r} is not a class, got {type(cls).__name__}")
    try:
        policy = cls(**config.custom)
    except TypeError as exc:
        options = ", ".join(config.custom) or "none"
        raise ValueError(
            f"policy {name!r} cannot be built with the options of [scheduler.custom] ({options}): {exc}"
        ) from exc
    if not isinstance(policy, Policy):
        missing = [m for m in _PROTOCOL_METHODS if not callable(getattr(policy, m, None))]
        raise ValueError(f"policy {name!r} does not implement the Policy protocol; missing: {missing}")
    return policy

"""Scheduling policies: a small pure protocol and a registry of named implementations.

A policy orders the waiting queue. It does no I/O and reads no clock: the admission actor passes
`now`. The policies issue adds priority, sjf, fair and edf behind the same protocol.
"""

from __future__ import annotations

import importlib
import re
from collections import deque
from collections.abc import Callable, Sequence
from typing import Protocol, runtime_checkable

import msgspec


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
    """Orders waiting requests.

    Queue: `push`, `peek`, `pop` (None when empty; `pop` returns what `peek` returned at the same
    `now`), `remove` (None for an unknown rid), `len`. Accounting, called by the admission actor:
    `on_admitted` when a request enters the batch, `on_tokens` as it is served output tokens,
    `on_finished` when it leaves the batch for any reason. `victim` picks a running request to
    preempt when memory must be freed (None: preempt nothing)."""

    def push(self, item: QueueItem, now: float) -> None: ...

    def peek(self, now: float) -> QueueItem | None: ...

    def pop(self, now: float) -> QueueItem | None: ...

    def remove(self, rid: int) -> QueueItem | None: ...

    def __len__(self) -> int: ...

    def on_admitted(self, item: QueueItem, now: float) -> None: ...

    def on_tokens(self, item: QueueItem, n: int) -> None: ...

    def on_finished(self, item: QueueItem, now: float) -> None: ...

    def victim(self, running: Sequence[QueueItem], now: float) -> QueueItem | None: ...


class FCFS:
    """First come, first served. O(1) push/pop; removal is lazy (skipped at the head)."""

    def __init__(self) -> None:
        self._order: deque[int] = deque()
        self._items: dict[int, QueueItem] = {}

    def push(self, item: QueueItem, now: float) -> None:
        self._order.append(item.rid)
        self._items[item.rid] = item

    def _head(self) -> int | None:
        while self._order and self._order[0] not in self._items:
            self._order.popleft()
        return self._order[0] if self._order else None

    def peek(self, now: float) -> QueueItem | None:
        rid = self._head()
        return None if rid is None else self._items[rid]

    def pop(self, now: float) -> QueueItem | None:
        rid = self._head()
        if rid is None:
            return None
        self._order.popleft()
        return self._items.pop(rid)

    def remove(self, rid: int) -> QueueItem | None:
        return self._items.pop(rid, None)

    def __len__(self) -> int:
        return len(self._items)

    def on_admitted(self, item: QueueItem, now: float) -> None:
        pass

    def on_tokens(self, item: QueueItem, n: int) -> None:
        pass

    def on_finished(self, item: QueueItem, now: float) -> None:
        pass

    def victim(self, running: Sequence[QueueItem], now: float) -> QueueItem | None:
        return max(running, key=lambda r: r.seq, default=None)  # the newest loses the least work


PolicyFactory = Callable[[], Policy]
POLICIES: dict[str, PolicyFactory] = {"fcfs": FCFS}
_PROTOCOL_METHODS = (
    "push", "peek", "pop", "remove", "__len__", "on_admitted", "on_tokens", "on_finished", "victim",
)
_DOTTED = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$")


def is_dotted_path(name: str) -> bool:
    return bool(_DOTTED.match(name))


def make_policy(name: str) -> Policy:
    """A policy by registry name or `package.module:Class`; errors say what is wrong."""
    if name in POLICIES:
        return POLICIES[name]()
    if not is_dotted_path(name):
        known = ", ".join(sorted(POLICIES))
        raise ValueError(f"unknown policy {name!r}; known policies: {known}, or 'package.module:Class'")
    module_name, _, class_name = name.partition(":")
    try:
        cls = getattr(importlib.import_module(module_name), class_name)
    except (ImportError, AttributeError) as exc:
        raise ValueError(f"cannot load policy {name!r}: {exc}") from exc
    policy = cls()
    if not isinstance(policy, Policy):
        missing = [m for m in _PROTOCOL_METHODS
                   if not callable(getattr(policy, m, None))]
        raise ValueError(f"policy {name!r} does not implement the Policy protocol; missing: {missing}")
    return policy

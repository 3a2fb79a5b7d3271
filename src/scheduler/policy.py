"""What a scheduling policy is: the `Policy` protocol and the `QueueItem` it orders (a leaf module).

A policy orders the waiting queue. It does no I/O and reads no clock: the admission core passes
`now`. The implementations and the registry of names live in `scheduler.policies`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol, runtime_checkable

import msgspec

if TYPE_CHECKING:
    from collections.abc import Sequence


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

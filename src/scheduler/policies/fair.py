"""`fair`: the Virtual Token Counter policy, fair sharing of tokens between tenants."""

from __future__ import annotations

import heapq
from collections import deque
from typing import TYPE_CHECKING

from scheduler.policies.queues import Hooks

if TYPE_CHECKING:
    from collections.abc import Mapping, Sequence

    from scheduler.policy import QueueItem


class Fair(Hooks):
    """Virtual Token Counter (Sheng et al., OSDI'24): each tenant's counter sums its weighted input
    tokens (charged at admission) and output tokens (as generated), divided by its weight. The
    backlogged tenant with the smallest counter is served next, its requests in arrival order. A
    tenant that becomes backlogged is lifted to the smallest counter among the other backlogged
    tenants, or, when there are none, to the counter of the tenant admitted last; so idling banks
    no credit."""

    def __init__(
        self,
        *,
        input_weight: float = 1.0,
        output_weight: float = 2.0,
        weights: Mapping[str, float] | None = None,
        default_weight: float = 1.0,
    ) -> None:
        weights = dict(weights or {})
        if not (input_weight >= 0 and output_weight >= 0 and input_weight + output_weight > 0):
            raise ValueError("fair: input_weight and output_weight must be >= 0, not both 0")
        if not all(w > 0 for w in [default_weight, *weights.values()]):
            raise ValueError("fair: every tenant weight must be > 0")
        self.input_weight, self.output_weight = input_weight, output_weight
        self._weights, self._default_weight = weights, default_weight
        self.counters: dict[str, float] = {}
        self._last = 0.0
        self._queues: dict[str, deque[int]] = {}  # rids in arrival order; removal is lazy
        self._items: dict[int, QueueItem] = {}
        self._waiting: dict[str, int] = {}  # queued requests per tenant: backlogged iff > 0
        # One valid entry (counter, head seq, version, tenant) per backlogged tenant; counters only
        # grow, so stale entries surface first and are dropped. Changes are batched in `_dirty`.
        self._heap: list[tuple[float, int, int, str]] = []
        self._version: dict[str, int] = {}
        self._dirty: set[str] = set()

    def weight(self, tenant: str) -> float:
        return self._weights.get(tenant, self._default_weight)

    def push(self, item: QueueItem, now: float) -> None:
        t = item.tenant
        if not self._waiting.get(t):
            top = self._top()
            floor = self._last if top is None else self.counters[top]
            self.counters[t] = max(self.counters.get(t, 0.0), floor)
        self._queues.setdefault(t, deque()).append(item.rid)
        self._items[item.rid] = item
        self._waiting[t] = self._waiting.get(t, 0) + 1
        self._dirty.add(t)

    def _head(self, tenant: str) -> QueueItem:
        queue = self._queues[tenant]
        while queue[0] not in self._items:
            queue.popleft()
        return self._items[queue[0]]

    def _top(self) -> str | None:
        """The backlogged tenant with the smallest counter (ties: the earliest head request)."""
        heap = self._heap
        for t in self._dirty:  # one valid entry per tenant: the order of pushes does not matter
            if self._waiting.get(t):
                self._version[t] = version = self._version.get(t, 0) + 1
                heapq.heappush(heap, (self.counters[t], self._head(t).seq, version, t))
        self._dirty.clear()
        while heap:
            _, _, version, t = heap[0]
            if self._waiting.get(t) and self._version[t] == version:
                return t
            heapq.heappop(heap)
        return None

    def peek(self, now: float) -> QueueItem | None:
        t = self._top()
        return None if t is None else self._head(t)

    def pop(self, now: float) -> QueueItem | None:
        item = self.peek(now)
        if item is not None:
            self._queues[item.tenant].popleft()
            self._forget(item)
        return item

    def remove(self, rid: int) -> QueueItem | None:
        item = self._items.get(rid)
        if item is not None:
            self._forget(item)
        return item

    def _forget(self, item: QueueItem) -> None:
        t = item.tenant
        del self._items[item.rid]
        self._waiting[t] -= 1
        if not self._waiting[t]:
            self._queues[t].clear()  # drop lazily removed rids with the last waiting one
        self._dirty.add(t)

    def __len__(self) -> int:
        return len(self._items)

    def on_admitted(self, item: QueueItem, now: float) -> None:
        self._charge(item.tenant, self.input_weight * item.prompt_tokens)
        self._last = self.counters[item.tenant]

    def on_tokens(self, item: QueueItem, n: int) -> None:
        self._charge(item.tenant, self.output_weight * n)

    def _charge(self, tenant: str, cost: float) -> None:
        self.counters[tenant] = self.counters.get(tenant, 0.0) + cost / self.weight(tenant)
        if self._waiting.get(tenant):
            self._dirty.add(tenant)

    def victim(self, running: Sequence[QueueItem], now: float) -> QueueItem | None:
        return max(running, key=lambda r: (self.counters.get(r.tenant, 0.0), r.seq), default=None)

"""A custom scheduling policy: tenants on a VIP list first, arrival order within each tier.

    [scheduler]
    policy = "examples.my_policy:VipFirst"   # any importable "package.module:Class"
    [scheduler.custom]                       # keyword arguments for the class
    vip = ["alice"]
"""

from __future__ import annotations

import heapq
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from collections.abc import Sequence

    from scheduler.policy import QueueItem


class VipFirst:
    """Implements `scheduler.policy.Policy`; pure: the caller passes `now`."""

    def __init__(self, vip: Sequence[str] = ()) -> None:
        self._vip = frozenset(vip)
        self._heap: list[tuple[int, int, int]] = []  # (tier, arrival order, rid)
        self._items: dict[int, QueueItem] = {}

    def _tier(self, item: QueueItem) -> int:
        return 0 if item.tenant in self._vip else 1

    def push(self, item: QueueItem, now: float) -> None:
        heapq.heappush(self._heap, (self._tier(item), item.seq, item.rid))
        self._items[item.rid] = item

    def peek(self, now: float) -> QueueItem | None:
        while self._heap and self._heap[0][2] not in self._items:
            heapq.heappop(self._heap)  # removed earlier: dropped lazily, so remove() is O(1)
        return self._items[self._heap[0][2]] if self._heap else None

    def pop(self, now: float) -> QueueItem | None:
        item = self.peek(now)
        if item is not None:
            heapq.heappop(self._heap)
            del self._items[item.rid]
        return item

    def remove(self, rid: int) -> QueueItem | None:
        return self._items.pop(rid, None)

    def __len__(self) -> int:
        return len(self._items)

    def on_admitted(self, item: QueueItem, now: float) -> None:
        pass  # no accounting: the order depends on the tier and arrival alone

    def on_tokens(self, item: QueueItem, n: int) -> None:
        pass

    def on_finished(self, item: QueueItem, now: float) -> None:
        pass

    def victim(self, running: Sequence[QueueItem], now: float) -> QueueItem | None:
        # Free memory from the lower tier first, and there from the newest request.
        return max(running, key=lambda r: (self._tier(r), r.seq), default=None)

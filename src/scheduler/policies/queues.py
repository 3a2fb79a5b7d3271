"""The queue policies: fcfs, priority, sjf and edf, and the hooks every policy shares.

Each is a pure object: no I/O, no clock reads (the admission actor passes `now`). Queues are heaps
or deques with lazy removal, so push, pop and remove stay O(log n) with 10k waiting requests."""

from __future__ import annotations

import heapq
import math
from collections import deque
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from collections.abc import Callable, Sequence

    from scheduler.policy import QueueItem

SortKey = tuple[float, ...]


class Hooks:
    """No-op accounting, and the default victim: the newest running request loses the least work."""

    def on_admitted(self, item: QueueItem, now: float) -> None:
        pass

    def on_tokens(self, item: QueueItem, n: int) -> None:
        pass

    def on_finished(self, item: QueueItem, now: float) -> None:
        pass

    def victim(self, running: Sequence[QueueItem], now: float) -> QueueItem | None:
        return max(running, key=lambda r: r.seq, default=None)


class FCFS(Hooks):
    """First come, first served. O(1) push/pop; removal is lazy (skipped at the head). A request
    older than the head (a preempted one coming back) goes first."""

    def __init__(self) -> None:
        self._order: deque[int] = deque()
        self._items: dict[int, QueueItem] = {}

    def push(self, item: QueueItem, now: float) -> None:
        head = self._head()
        if head is not None and item.seq < self._items[head].seq:
            self._order.appendleft(item.rid)
        else:
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


class _Heap:
    """Heap entries (key, stamp, rid) over a shared `live` map rid -> (stamp, item). An entry whose
    stamp is not its item's current one (removed, popped, pushed again) is dropped at the top."""

    def __init__(self, key: Callable[[QueueItem], SortKey], live: dict[int, tuple[int, QueueItem]]) -> None:
        self._key = key
        self._live = live
        self._entries: list[tuple[SortKey, int, int]] = []

    def push(self, item: QueueItem, stamp: int) -> None:
        heapq.heappush(self._entries, (self._key(item), stamp, item.rid))

    def top(self) -> QueueItem | None:
        entries, live = self._entries, self._live
        while entries:
            _, stamp, rid = entries[0]
            entry = live.get(rid)
            if entry is not None and entry[0] == stamp:
                return entry[1]
            heapq.heappop(entries)
        return None

    def compact(self) -> None:
        # Removals deep in the heap leave garbage; rebuilding at 2x keeps memory O(n), amortized O(1).
        if len(self._entries) > 2 * len(self._live) + 64:
            self._entries = [(self._key(it), s, rid) for rid, (s, it) in self._live.items()]
            heapq.heapify(self._entries)


class _HeapQueue(Hooks):
    """Waiting items in one heap per sort key, all sharing one map of the live items."""

    def __init__(self, *keys: Callable[[QueueItem], SortKey]) -> None:
        self._live: dict[int, tuple[int, QueueItem]] = {}
        self._heaps = [_Heap(key, self._live) for key in keys]
        self._stamp = 0

    def push(self, item: QueueItem, now: float) -> None:
        self._stamp += 1
        self._live[item.rid] = (self._stamp, item)
        for heap in self._heaps:
            heap.push(item, self._stamp)
            heap.compact()

    def peek(self, now: float) -> QueueItem | None:
        return self._heaps[0].top()

    def pop(self, now: float) -> QueueItem | None:
        item = self.peek(now)
        if item is not None:
            del self._live[item.rid]
        return item

    def remove(self, rid: int) -> QueueItem | None:
        entry = self._live.pop(rid, None)
        for heap in self._heaps:
            heap.compact()
        return None if entry is None else entry[1]

    def __len__(self) -> int:
        return len(self._live)


class Priority(_HeapQueue):
    """Lower `priority` first, ties by arrival (vLLM's semantics). Victim: the lowest class, newest."""

    def __init__(self) -> None:
        super().__init__(lambda r: (r.priority, r.arrival, r.seq))

    def victim(self, running: Sequence[QueueItem], now: float) -> QueueItem | None:
        return max(running, key=lambda r: (r.priority, r.seq), default=None)


def expected_work(item: QueueItem) -> int:
    """What SJF sorts by: the tokens a request will occupy, prompt plus its output budget."""
    return item.prompt_tokens + item.max_tokens


class SJF(_HeapQueue):
    """Shortest expected work first; a request waiting `max_wait_s` or longer has aged and goes
    before every younger one (aged requests in arrival order), so nothing waits unboundedly."""

    def __init__(self, max_wait_s: float = 30.0) -> None:
        if not max_wait_s >= 0:
            raise ValueError(f"sjf: max_wait_s must be >= 0, got {max_wait_s!r}")
        super().__init__(lambda r: (expected_work(r), r.arrival, r.seq), lambda r: (r.arrival, r.seq))
        self.max_wait_s = max_wait_s

    def peek(self, now: float) -> QueueItem | None:
        oldest = self._heaps[1].top()
        if oldest is not None and now - oldest.arrival >= self.max_wait_s:
            return oldest
        return self._heaps[0].top()

    def victim(self, running: Sequence[QueueItem], now: float) -> QueueItem | None:
        return max(running, key=lambda r: (expected_work(r), r.seq), default=None)


class EDF(_HeapQueue):
    """Earliest deadline first. A request without one is ordered at `arrival + default_deadline_s`
    (after every deadline when None). A request past its deadline is never returned: it stays
    counted and removable until the caller ends it as a timeout."""

    def __init__(self, default_deadline_s: float | None = None) -> None:
        if default_deadline_s is not None and not default_deadline_s > 0:
            raise ValueError(f"edf: default_deadline_s must be > 0, got {default_deadline_s!r}")
        self.default_deadline_s = default_deadline_s
        super().__init__(lambda r: (self.effective_deadline(r), r.arrival, r.seq))
        self._expired: dict[int, QueueItem] = {}

    def effective_deadline(self, item: QueueItem) -> float:
        if item.deadline is not None:
            return item.deadline
        return math.inf if self.default_deadline_s is None else item.arrival + self.default_deadline_s

    def peek(self, now: float) -> QueueItem | None:
        heap = self._heaps[0]
        while (item := heap.top()) is not None and item.deadline is not None and item.deadline <= now:
            # Expired ones sort first; set them aside so that admission never runs them.
            del self._live[item.rid]
            self._expired[item.rid] = item
        return item

    def remove(self, rid: int) -> QueueItem | None:
        expired = self._expired.pop(rid, None)
        return expired if expired is not None else super().remove(rid)

    def __len__(self) -> int:
        return len(self._live) + len(self._expired)

    def victim(self, running: Sequence[QueueItem], now: float) -> QueueItem | None:
        return max(running, key=lambda r: (self.effective_deadline(r), r.seq), default=None)

"""The built-in scheduling policies (fcfs, priority, sjf, fair (VTC), edf) and the registry of names.

Each is a pure object: no I/O, no clock reads (the admission actor passes `now`). Queues are heaps or
deques with lazy removal, so push, pop and remove stay O(log n) with 10k waiting requests.
"""

from __future__ import annotations

import heapq
import importlib
import math
import re
from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol

from scheduler.policy import Policy

if TYPE_CHECKING:
    from collections.abc import Mapping, Sequence

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


# ---- the registry ----------------------------------------------------------------------------
# What the factories read of `[scheduler]`, as protocols, so this module needs no import of config.
class _SJFOptions(Protocol):
    @property
    def max_wait_s(self) -> float: ...


class _TenantOptions(Protocol):
    @property
    def weight(self) -> float: ...


class _FairOptions(Protocol):
    @property
    def input_weight(self) -> float: ...
    @property
    def output_weight(self) -> float: ...
    @property
    def default_weight(self) -> float: ...
    @property
    def tenants(self) -> Mapping[str, _TenantOptions]: ...


class _EDFOptions(Protocol):
    @property
    def default_deadline_s(self) -> float | None: ...


class PolicyOptions(Protocol):
    """The `[scheduler]` section as the registry reads it (`SchedulingSection` is one)."""

    @property
    def policy(self) -> str: ...
    @property
    def sjf(self) -> _SJFOptions: ...
    @property
    def fair(self) -> _FairOptions: ...
    @property
    def edf(self) -> _EDFOptions: ...
    @property
    def custom(self) -> Mapping[str, object]: ...


PolicyFactory = Callable[["PolicyOptions | None"], "Policy"]
"""Builds a policy from the `[scheduler]` section's option tables; None: the class defaults."""


def _fair(o: PolicyOptions | None) -> Policy:
    if o is None:
        return Fair()
    f = o.fair
    return Fair(
        input_weight=f.input_weight, output_weight=f.output_weight, default_weight=f.default_weight,
        weights={tenant: t.weight for tenant, t in f.tenants.items()},
    )


POLICIES: dict[str, PolicyFactory] = {
    "fcfs": lambda o: FCFS(),
    "priority": lambda o: Priority(),
    "sjf": lambda o: SJF() if o is None else SJF(max_wait_s=o.sjf.max_wait_s),
    "fair": _fair,
    "edf": lambda o: EDF() if o is None else EDF(default_deadline_s=o.edf.default_deadline_s),
}
_DOTTED = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$")
_PROTOCOL_METHODS = (
    "push", "peek", "pop", "remove", "__len__", "on_admitted", "on_tokens", "on_finished", "victim",
)


def check_name(name: str) -> None:
    """The one policy-name check: a registry name or `package.module:Class`, else ValueError."""
    if name not in POLICIES and not _DOTTED.match(name):
        raise ValueError(
            f"unknown policy {name!r}; known policies: {', '.join(POLICIES)}, "
            "or a dotted path 'package.module:Class'"
        )


def make_policy(config: str | PolicyOptions) -> Policy:
    """A policy from the `[scheduler]` section (or a bare name, with default options): a registry
    name or `package.module:Class`, built with `[scheduler.custom]` as keyword arguments."""
    name = config if isinstance(config, str) else config.policy
    options = None if isinstance(config, str) else config
    check_name(name)
    if name in POLICIES:
        return POLICIES[name](options)
    module_name, _, class_name = name.partition(":")
    try:
        cls = getattr(importlib.import_module(module_name), class_name)
    except (ImportError, AttributeError) as exc:
        raise ValueError(f"cannot load policy {name!r}: {exc}") from exc
    if not callable(cls):
        raise ValueError(f"policy {name!r} is not a class, got {type(cls).__name__}")
    custom = dict(options.custom) if options is not None else {}
    try:
        policy = cls(**custom)
    except TypeError as exc:
        given = ", ".join(custom) or "none"
        raise ValueError(
            f"policy {name!r} cannot be built with the options of [scheduler.custom] ({given}): {exc}"
        ) from exc
    if not isinstance(policy, Policy):
        missing = [m for m in _PROTOCOL_METHODS if not callable(getattr(policy, m, None))]
        raise ValueError(f"policy {name!r} does not implement the Policy protocol; missing: {missing}")
    return policy

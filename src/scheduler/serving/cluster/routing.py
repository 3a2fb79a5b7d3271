"""Which replica serves a request: the routing decision as a pure function, and the memory it
reads (which sessions and prompt blocks each replica holds). No Ray here: the Serve
`RequestRouter` in `cluster.router` is a thin adapter over `choose`.

Order of preference: an explicit target (health and metrics fan-out); the replica holding the
request's session; the replica holding the longest run of its leading block keys, unless the
load guard says that replica is too busy; else power-of-two choices on load."""

from __future__ import annotations

import random
import time
from collections import OrderedDict
from typing import TYPE_CHECKING, Any, Literal

import msgspec

if TYPE_CHECKING:
    from collections.abc import Iterable, Mapping, Sequence

    from scheduler.config import ClusterSection

# The routers of this process (`router.SchedulerRouter`), one per deployment it calls: the
# frontend reads the live replicas from them for its fan-outs, the driver the live frontends.
ROUTERS: list[Any] = []


def newest_router(deployment: str) -> Any:
    """This process's newest router for `deployment`, or None before its first call."""
    return next((r for r in reversed(ROUTERS) if r.deployment == deployment), None)


Reason = Literal["target", "session", "prefix", "guard", "p2c", "only"]


class Load(msgspec.Struct, frozen=True):
    """One live replica as the router sees it."""

    id: str
    load: int
    """Requests it holds: what this router sent and has not seen end."""
    capacity: int = 1 << 30
    """Requests it can hold before its queue answers 429."""


class Route(msgspec.Struct, frozen=True):
    """What the router knows of one request."""

    session: str | None = None
    keys: tuple[int, ...] = ()
    """`kvplan.prompt_keys` of its prompt: chained, so key i stands for blocks 0..i."""
    target: str | None = None


class Decision(msgspec.Struct, frozen=True):
    ranked: list[list[str]]
    """Ranks of replica ids, best first; Serve tries each rank in turn."""
    reason: Reason
    matched_blocks: int = 0


class Thresholds(msgspec.Struct, frozen=True):
    balance_abs: int = 16
    balance_rel: float = 1.5
    prefix_min_blocks: int = 1

    @classmethod
    def of(cls, section: ClusterSection) -> Thresholds:
        return cls(section.balance_abs_threshold, section.balance_rel_threshold,
                   section.prefix_min_blocks)


class Affinity:
    """What each replica holds, as far as this router knows: the replica each session last went
    to (and when, on the wall clock: with several frontends, the newest turn of a session, routed
    here or reported by its replica, names its owner), and per replica an LRU of block keys it
    served (bounded, as its pool evicts)."""

    def __init__(self, remembered_blocks: int = 65536, sessions: int = 65536) -> None:
        self._cap = remembered_blocks
        self._session_cap = sessions
        self._sessions: OrderedDict[str, tuple[str, float]] = OrderedDict()
        self._keys: dict[str, OrderedDict[int, None]] = {}
        self._caps: dict[str, int] = {}

    def owner(self, session: str) -> str | None:
        held = self._sessions.get(session)
        return held[0] if held else None

    def matched(self, replica: str, keys: Sequence[int]) -> int:
        """How many of `keys`, from the first, `replica` holds."""
        held = self._keys.get(replica)
        if not held:
            return 0
        n = 0
        for key in keys:
            if key not in held:
                break
            n += 1
        return n

    def served(self, replica: str, route: Route, when: float | None = None) -> None:
        """`replica` took this request: it now holds its session and its prompt's blocks."""
        if route.session is not None:
            self._own(route.session, replica, time.time() if when is None else when)
        self.holds(replica, route.keys)

    def learn_sessions(self, replica: str, sessions: Mapping[str, float]) -> None:
        """`replica` reports the sessions it served lately, each with the wall-clock time of its
        last turn there: a turn newer than this router knows of (another frontend routed it)
        moves the session."""
        for session, when in sessions.items():
            held = self._sessions.get(session)
            if held is None or held[1] < when:
                self._own(session, replica, when)

    def _own(self, session: str, replica: str, when: float) -> None:
        self._sessions[session] = (replica, when)
        self._sessions.move_to_end(session)
        while len(self._sessions) > self._session_cap:
            self._sessions.popitem(last=False)

    def holds(self, replica: str, keys: Iterable[int]) -> None:
        held = self._keys.setdefault(replica, OrderedDict())
        for key in keys:
            held[key] = None
            held.move_to_end(key)
        cap = min(self._cap, self._caps.get(replica, self._cap))
        while len(held) > cap:
            held.popitem(last=False)

    def capacity(self, replica: str, blocks: int) -> None:
        """The replica's pool holds `blocks` blocks: remember no more keys than that for it."""
        if blocks > 0:
            self._caps[replica] = blocks

    def forget(self, replica: str) -> None:
        """A replica died: its sessions and blocks are gone with it."""
        self._keys.pop(replica, None)
        self._caps.pop(replica, None)
        for session in [s for s, (r, _) in self._sessions.items() if r == replica]:
            del self._sessions[session]


def choose(
    replicas: Sequence[Load], route: Route, affinity: Affinity, limits: Thresholds,
    rng: random.Random | None = None,
) -> Decision:
    """Rank `replicas` for `route`. Pure but for `rng` (power-of-two's draw); reads `affinity`."""
    if not replicas:
        return Decision([], "only")
    by_id = {r.id: r for r in replicas}
    if route.target is not None:
        return Decision([[route.target]] if route.target in by_id else [], "target")
    if len(replicas) == 1:
        return Decision([[replicas[0].id]], "only")
    least = min(replicas, key=lambda r: (r.load, r.id))

    def ranked(first: Load, reason: Reason, matched: int = 0, alone: bool = False) -> Decision:
        # A session's owner goes alone: Serve then waits for it rather than trying another.
        rest = sorted((r for r in replicas if r.id != first.id), key=lambda r: (r.load, r.id))
        ranks = [[first.id]] if alone else [[first.id], [r.id for r in rest]]
        return Decision(ranks, reason, matched)

    if route.session is not None:
        owner = by_id.get(affinity.owner(route.session) or "")
        if owner is not None and owner.load < owner.capacity:
            return ranked(owner, "session", alone=True)
    if route.keys:
        best, matched = max(((r, affinity.matched(r.id, route.keys)) for r in replicas),
                            key=lambda rm: (rm[1], -rm[0].load))
        if matched >= limits.prefix_min_blocks:
            if overloaded(best, least, limits):
                return ranked(least, "guard", matched)
            return ranked(best, "prefix", matched)
    a, b = (rng or random.Random()).sample(list(replicas), 2)
    return ranked(a if a.load <= b.load else b, "p2c")  # a tie goes to the random first draw


def overloaded(chosen: Load, least: Load, limits: Thresholds) -> bool:
    """SGLang's cache-aware guard, per request: the chosen replica is both `abs` requests and
    `rel` times over the least-loaded one (or its queue is full)."""
    if chosen.load >= chosen.capacity:
        return True
    return (chosen.load - least.load > limits.balance_abs
            and chosen.load > limits.balance_rel * least.load)

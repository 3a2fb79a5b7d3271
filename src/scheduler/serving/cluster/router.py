"""`SchedulerRouter`: our Serve `RequestRouter`, a thin adapter from Serve's replicas and
pending requests to `routing.choose`. It runs in the frontend's process (the handle's side)."""

from __future__ import annotations

import random
import time
from collections import deque
from typing import TYPE_CHECKING, Any

import structlog
from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

from scheduler.serving.cluster import routing
from scheduler.serving.cluster.routing import Affinity, Load, Route, Thresholds, choose

if TYPE_CHECKING:
    from ray.serve._private.replica_result import ReplicaResult

log = structlog.get_logger("scheduler.cluster")

# How long a choice counts as load before Serve reports the request routed (its replica's
# acceptance takes a round trip); a choice never reported (refused, given up) stops counting then.
CHOSEN_S = 1.0


class SchedulerRouter(RequestRouter):  # type: ignore[misc]  # Ray is untyped here
    def initialize_state(self, **kwargs: Any) -> None:
        self.limits = Thresholds(kwargs.get("balance_abs", 16), kwargs.get("balance_rel", 1.5),
                                 kwargs.get("prefix_min_blocks", 1))
        self.affinity = Affinity(kwargs.get("remembered_blocks", 65536))
        # Serve's 0.1 s default let a slow probe send session turns to a second choice.
        self.queue_len_response_deadline_s = float(kwargs.get("probe_deadline_s", 1.0))
        self.max_queue_len_response_deadline_s = max(self.queue_len_response_deadline_s, 4.0)
        self.inflight: dict[str, int] = {}
        self.chosen: dict[str, deque[float]] = {}  # per replica: when it was chosen, not yet routed
        self.request_replica: dict[str, str] = {}
        self.reasons: dict[str, int] = {}
        self.reported: dict[str, dict[str, Any]] = {}
        self.rng = random.Random()
        self.load_only = kwargs.get("policy") == "power-of-two"
        self.deployment = str(self._deployment_id.name)
        # Serve pickles this module by value: the registry lives in `routing`, shared by import.
        routing.ROUTERS.append(self)

    def live(self) -> list[str]:
        return sorted(r.replica_id.unique_id for r in self.curr_replicas.values())

    async def choose_replicas(
        self, candidate_replicas: list[RunningReplica], pending_request: PendingRequest | None = None,
    ) -> list[list[RunningReplica]]:
        if pending_request is not None:
            # Without it Serve asks again at once when no rank takes the request (a target that
            # died, a session's owner at capacity): a loop that never yields, freezing every
            # request this process routes.
            pending_request.routing_context.should_backoff = True
            if pending_request.future.done():  # given up by its caller: any rank lets Serve drop it
                return [candidate_replicas] if candidate_replicas else []
        by_id = {r.replica_id.unique_id: r for r in candidate_replicas}
        loads = [self._load(rid, r) for rid, r in by_id.items()]
        route = _route(pending_request)
        if self.load_only:
            route = Route(target=route.target)
        decision = choose(loads, route, self.affinity, self.limits, self.rng)
        self.reasons[decision.reason] = self.reasons.get(decision.reason, 0) + 1
        if decision.ranked and route.target is None:
            self.chosen.setdefault(decision.ranked[0][0], deque()).append(time.monotonic())
        return [[by_id[i] for i in rank if i in by_id] for rank in decision.ranked]

    def _load(self, rid: str, replica: RunningReplica) -> Load:
        stats = replica.routing_stats or {}
        if self.reported.get(rid) is not stats:  # a new report: learn its keys once, not per request
            self.reported[rid] = stats
            self.affinity.capacity(rid, int(stats.get("blocks", 0)))
            self.affinity.holds(rid, stats.get("keys") or ())
            self.affinity.learn_sessions(rid, stats.get("sessions") or {})
        # The load is this router's own count: exact and current for what it sends (with one
        # frontend, everything). A replica's report lags by up to `stats_period_s`; taken as a
        # floor, one made mid-burst steered the whole next burst to the other replica. The
        # choices not yet routed count too: in a burst Serve makes many before it reports one.
        return Load(rid, self.inflight.get(rid, 0) + self._chosen(rid), int(stats.get("capacity", 1 << 30)))

    def _chosen(self, rid: str) -> int:
        times = self.chosen.get(rid)
        if not times:
            return 0
        stale = time.monotonic() - CHOSEN_S
        while times and times[0] < stale:
            times.popleft()
        return len(times)

    def on_request_routed(
        self, pending_request: PendingRequest, replica_id: ReplicaID, result: ReplicaResult,
    ) -> None:
        rid = replica_id.unique_id
        route = _route(pending_request)
        if route.target is not None:
            return  # a call to a named replica (a feed, a fan-out) is not a request it holds
        self.affinity.served(rid, route)
        self.inflight[rid] = self.inflight.get(rid, 0) + 1
        self.request_replica[pending_request.metadata.internal_request_id] = rid
        if self.chosen.get(rid):
            self.chosen[rid].popleft()  # counted as in flight now

    def on_request_completed(self, replica_id: ReplicaID, internal_request_id: str) -> None:
        rid = self.request_replica.pop(internal_request_id, None)
        if rid is not None:
            self.inflight[rid] = max(0, self.inflight.get(rid, 0) - 1)

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        rid = replica_id.unique_id
        self.affinity.forget(rid)
        self.inflight.pop(rid, None)
        self.chosen.pop(rid, None)
        self.reported.pop(rid, None)
        log.warning("replica_died", replica=rid)


def _route(pending: PendingRequest | None) -> Route:
    if pending is None:
        return Route()
    target = pending.kwargs.get("target")
    # A `replica.Job`, read by its fields rather than its class: importing `replica` loads the
    # scheduler and MLX, and Serve's proxy imports this module to pick a frontend.
    job = pending.args[0] if pending.args else None
    keys, request = getattr(job, "keys", None), getattr(job, "request", None)
    if isinstance(keys, tuple) and request is not None:
        return Route(getattr(request, "session", None), keys, target)
    return Route(target=target)

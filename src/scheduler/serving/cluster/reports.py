"""What the frontend tells operators about the replicas: /health and /metrics, each a fan-out to
every live replica that names the ones that did not answer."""

from __future__ import annotations

import asyncio
import os
from typing import TYPE_CHECKING, Any

import msgspec
import structlog
from starlette.responses import Response

from scheduler.serving.cluster import REPLICAS
from scheduler.serving.cluster.prom import merge
from scheduler.serving.cluster.routing import newest_router
from scheduler.serving.http.app import PROMETHEUS

if TYPE_CHECKING:
    from ray.serve.handle import DeploymentHandle

log = structlog.get_logger("scheduler.cluster")
FAN_OUT_TIMEOUT_S = 2.0
"""How long /health and /metrics wait for each replica. A stuck or dying one is named in
/health's "unreachable" rather than waited for: a load balancer's health check gives up within
seconds, and a dying replica held /health for 10 s."""


class ReplicaReports:
    def __init__(self, backend: DeploymentHandle, frontend: str) -> None:
        self._backend = backend
        self._frontend = frontend

    @staticmethod
    def _router() -> Any:
        return newest_router(REPLICAS)

    async def fan_out(self, method: str) -> tuple[list[Any], list[str]]:
        """`method` of every live replica, each reached by naming it to our router, and the
        replicas that did not answer within `FAN_OUT_TIMEOUT_S`. One at a time: Serve gives calls
        made inside one request the same internal id, and two of them pending at once leave one
        unrouted."""
        router = self._router()
        ids = router.live() if router else []
        out: list[Any] = []
        unreachable: list[str] = []
        for i in ids:
            try:
                async with asyncio.timeout(FAN_OUT_TIMEOUT_S):  # wait_for can swallow a cancel on 3.11
                    out.append(await getattr(self._backend, method).remote(target=i))
            except Exception as exc:  # a dead or stuck replica is reported, and logged
                log.warning("replica_unreachable", replica=i, method=method, error=repr(exc))
                unreachable.append(i)
        return out, unreachable

    async def health(self, model_name: str, feeds: dict[str, Any] | None = None,
                     ingress: str = "proxy") -> Response:
        """`feeds`: the answering frontend's streams (`Feeds.stats`), when it reads feeds;
        `ingress`: "direct" where the frontends serve the port themselves, else "proxy"."""
        answers, unreachable = await self.fan_out("replica_stats")
        replicas = [r for r in answers if isinstance(r, dict)]
        router = self._router()
        # With several frontends, the routing counts are those of the one that answers.
        body = {"status": "ok" if replicas else "starting", "model": model_name,
                "replicas": replicas, "unreachable": unreachable, "frontend": self._frontend,
                "frontend_pid": os.getpid(), "ingress": ingress,
                "routing": dict(router.reasons) if router else {},
                "in_flight": dict(router.inflight) if router else {}, "feeds": feeds}
        return Response(msgspec.json.encode(body), 200 if replicas else 503,
                        media_type="application/json")

    async def metrics(self) -> Response:
        texts = [t for t in (await self.fan_out("prometheus"))[0] if isinstance(t, str)]
        return Response(merge(texts), media_type=PROMETHEUS)

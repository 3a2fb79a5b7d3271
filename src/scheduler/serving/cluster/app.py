"""Building and running the Serve application: N `SchedulerReplica`s behind our router, and
`[cluster] frontends` `Frontend`s behind Serve's proxy on one port. `mlx-scheduler serve
--replicas N` calls `run`."""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from typing import TYPE_CHECKING, Any

import msgspec
import structlog

from scheduler.serving.cluster import FRONTENDS, GRPC_ENV, REPLICAS

if TYPE_CHECKING:
    from ray.serve import Application

    from scheduler.config import ClusterSection, SchedulerConfig

log = structlog.get_logger("scheduler.cluster")
APP_NAME = "mlx-scheduler"


def actor_options(section: ClusterSection, device: str) -> dict[str, Any]:
    """What one replica reserves: the device it owns, and CPUs."""
    opts: dict[str, Any] = {"num_cpus": section.num_cpus}
    if device == "cuda":
        opts["num_gpus"] = section.gpus_per_replica
    elif device == "mlx":
        opts["resources"] = {"mlx": 1}
    return opts


def pick_device(section: ClusterSection) -> str:
    """"auto": CUDA when Ray sees GPUs, the `mlx` custom resource on macOS, else CPUs only."""
    if section.device != "auto":
        return section.device
    import ray

    if ray.cluster_resources().get("GPU", 0) > 0:
        return "cuda"
    return "mlx" if sys.platform == "darwin" else "cpu"


def build(config: SchedulerConfig, replicas: int, model_name: str | None = None,
          device: str = "cpu", listen: tuple[str, int] | None = None) -> Application:
    """The application; with `[cluster] ingress = "direct"` its frontends serve HTTP on `listen`."""
    from ray import serve
    from ray.serve.config import RequestRouterConfig

    from scheduler.serving.cluster.frontend import Frontend
    from scheduler.serving.cluster.replica import SchedulerReplica
    from scheduler.serving.cluster.router import SchedulerRouter

    c = config.cluster
    router = RequestRouterConfig(
        request_router_class=SchedulerRouter,
        request_router_kwargs={
            "balance_abs": c.balance_abs_threshold, "balance_rel": c.balance_rel_threshold,
            "prefix_min_blocks": c.prefix_min_blocks, "remembered_blocks": c.remembered_blocks,
            "probe_deadline_s": c.probe_deadline_s, "policy": c.routing,
        },
        request_routing_stats_period_s=c.stats_period_s,
        request_routing_stats_timeout_s=max(c.stats_period_s, 1.0),
    )
    # The proxy picks a frontend by its own count of their requests (it is their only router);
    # our router also lets the driver name each frontend (`frontend_ids`, `drain`).
    frontends = RequestRouterConfig(
        request_router_class=SchedulerRouter,
        request_router_kwargs={"policy": "power-of-two", "probe_deadline_s": c.probe_deadline_s},
    )
    backend = serve.deployment(SchedulerReplica).options(
        name=REPLICAS, num_replicas=replicas, max_ongoing_requests=c.max_ongoing_requests,
        ray_actor_options=actor_options(c, device), request_router_config=router,
        health_check_period_s=2, health_check_timeout_s=30, graceful_shutdown_timeout_s=5,
        logging_config=QUIET,
    ).bind(config)
    count = c.frontend_count(replicas)
    direct = c.ingress == "direct"
    if direct and listen is None:
        raise ValueError('[cluster] ingress = "direct": the frontends need the host and port to listen on')
    frontend = serve.deployment(Frontend).options(
        name=FRONTENDS, num_replicas=count,
        max_ongoing_requests=c.max_ongoing_requests * replicas,
        ray_actor_options={"num_cpus": 0, **({"resources": here()} if direct else {})},
        request_router_config=frontends, logging_config=QUIET,
    )
    # A frontend streams for its share of the replicas: their budget of messages comes with them.
    return frontend.bind(backend, config, model_name, c.stream_messages_per_s * max(1.0, replicas / count),
                         listen if direct else None)


# Serve logs a line per call a deployment takes: on a replica every request, feed and router
# probe (tens a second per frontend), into its log files, at a share of the replica's CPU. A line
# per request is the scheduler's to give (`request_finished`, at `[logging] level = "debug"`), as
# `serve` gives it.
QUIET = {"enable_access_log": False}


def here() -> dict[str, float]:
    """A sliver of this node's own resource: the frontends that serve the port run on this node."""
    import ray

    node = ray.get_runtime_context().get_node_id()
    address = next(n["NodeManagerAddress"] for n in ray.nodes() if n["NodeID"] == node)
    return {f"node:{address}": 0.001}


def start_serve(config: SchedulerConfig, host: str, port: int) -> None:
    """Serve, with its HTTP proxy on `host:port`, or no proxy where the frontends serve the port."""
    from ray import serve

    # Without a proxy Serve binds nothing, but it still names `http_options` as the application's
    # address when it is ready: ours, where the frontends listen, not its default port 8000.
    serve.start(proxy_location="Disabled" if config.cluster.ingress == "direct" else None,
                http_options={"host": host, "port": port})


def deploy(config: SchedulerConfig, replicas: int, model_name: str | None = None,
           device: str = "cpu", timeout: float = 300, listen: tuple[str, int] | None = None) -> Any:
    """Run the application and wait until its frontend serves: its handle. `listen`: the port
    the frontends serve with `[cluster] ingress = "direct"` (Serve's proxy's is `start_serve`'s)."""
    from ray import serve

    app = build(config, replicas, model_name, device, listen)
    handle = serve.run(app, name=APP_NAME, route_prefix="/")
    deadline = time.monotonic() + timeout
    for frontend in frontend_ids(handle, config.cluster.frontend_count(replicas), timeout):
        handle.ready.remote(target=frontend).result(timeout_s=max(1.0, deadline - time.monotonic()))
    return handle


def frontend_ids(handle: Any, count: int, timeout: float) -> list[str]:
    """The ids of the application's frontends, once this process's router for them knows
    `count` (Serve tells a new router its replicas soon after its first call), or at `timeout`
    those it knows."""
    from scheduler.serving.cluster.routing import newest_router

    deadline = time.monotonic() + timeout
    handle.ready.remote().result(timeout_s=timeout)
    while True:
        router = newest_router(FRONTENDS)
        ids: list[str] = router.live() if router else []
        if len(ids) >= count or time.monotonic() > deadline:
            return ids
        time.sleep(0.05)


def drain(handle: Any, frontends: int, timeout: float) -> int:
    """503 from every frontend for new requests, then up to `timeout` for those in flight: how
    many were still running when it gave up. Each frontend is told by name, one at a time."""
    deadline = time.monotonic() + timeout
    ids = frontend_ids(handle, frontends, min(timeout, 10.0))
    for frontend in ids:
        handle.close.remote(target=frontend).result(timeout_s=10)
    return sum(handle.drain.remote(max(0.0, deadline - time.monotonic()), target=frontend)
               .result(timeout_s=max(0.0, deadline - time.monotonic()) + 10) for frontend in ids)


def start_ray(config: SchedulerConfig, replicas: int, *, log_to_driver: bool = True) -> None:
    """Join `[cluster] address`, or start a local Ray on 127.0.0.1 with no dashboard."""
    import ray

    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")  # no network
    if config.cluster.address:
        ray.init(address=config.cluster.address, namespace=APP_NAME, log_to_driver=True)
        return
    # The processes a local Ray starts inherit this environment: gRPC between Serve's proxy and
    # the replicas (part of Serve's throughput-optimized mode). With the frontend's streams by
    # value (`Frontend`), measured 1.5x the tokens/s of one replica at 64 streams.
    os.environ.setdefault(GRPC_ENV, "1")
    cpus = max(os.cpu_count() or 1, int(replicas * config.cluster.num_cpus + 0.999))
    resources = {"mlx": float(replicas)} if sys.platform == "darwin" else {}
    ray.init(num_cpus=cpus, resources=resources, include_dashboard=False, namespace=APP_NAME,
             _node_ip_address="127.0.0.1", configure_logging=False, log_to_driver=log_to_driver)


def run(config: SchedulerConfig, replicas: int, host: str, port: int, model_name: str | None,
        shutdown_timeout: float) -> None:
    """Serve until SIGINT or SIGTERM, then drain: 503 for new requests, in-flight ones get
    `shutdown_timeout` seconds, then the replicas and Ray stop."""
    import ray
    from ray import serve

    from workers.loading.models import resolve_model

    if config.cluster.ingress == "direct":
        from scheduler.serving.cluster.ingress import shared_socket

        try:  # before Ray's half a minute of starting: a port held by another program is named now
            shared_socket(host, port).close()
        except OSError as exc:
            raise SystemExit(f"mlx-scheduler serve --replicas {replicas}: {exc.strerror}") from exc
    resolve_model(config.model.path, config.model.cache_dir)  # built once, not raced by replicas
    start_ray(config, replicas)
    stop = threading.Event()
    previous = {s: signal.signal(s, lambda *_: stop.set()) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        start_serve(config, host, port)
        wanted = msgspec.structs.replace(config.cluster, ingress="proxy").frontend_count(replicas)
        if wanted > config.cluster.frontend_count(replicas):
            log.warning("cluster_one_frontend", wanted=wanted, platform=sys.platform,
                        reason="several processes share one port's connections only on Linux")
        device = pick_device(config.cluster)
        handle = deploy(config, replicas, model_name, device, listen=(host, port))
        log.info("cluster_serving", replicas=replicas, frontends=config.cluster.frontend_count(replicas),
                 device=device, url=f"http://{host}:{port}", ingress=config.cluster.ingress)
        stop.wait()
        left = drain(handle, config.cluster.frontend_count(replicas), shutdown_timeout)
        log.info("cluster_drained", unfinished=left)
    finally:
        for s, h in previous.items():
            signal.signal(s, h)
        serve.shutdown()
        ray.shutdown()

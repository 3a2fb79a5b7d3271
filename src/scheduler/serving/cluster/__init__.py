"""Scale-out: N `Scheduler` replicas on Ray Serve behind one OpenAI-compatible port, routed by
session and prompt prefix (`routing`), with a thin Serve `RequestRouter` over it (`router`).

Importing this package needs no Ray; running it needs the `cluster` extra (`ray[serve]`)."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import argparse

    from scheduler.config import SchedulerConfig

REPLICAS = "SchedulerReplica"
FRONTENDS = "Frontend"
"""The Serve deployments' names: each deployment's router is found by them (`routing.newest_router`)."""
REPLICA_FAILED = -1
"""The request id of the error chunk that stands for a dead replica (or its scheduler process)."""
GRPC_ENV = "RAY_SERVE_USE_GRPC_BY_DEFAULT"
"""Serve's switch for gRPC between its proxy and the replicas; a local Ray starts with it on."""


def grpc_by_default() -> bool:
    """Whether Serve in this process sends handle calls over gRPC (`GRPC_ENV`)."""
    return os.environ.get(GRPC_ENV, "0") == "1"


def serve_replicas(args: argparse.Namespace, config: SchedulerConfig, replicas: int) -> None:
    """`mlx-scheduler serve --replicas N` with N > 1."""
    if getattr(args, "trio", False):
        raise SystemExit("mlx-scheduler serve: --trio serves one process; --replicas runs on Ray Serve")
    try:
        import ray.serve  # noqa: F401
        import starlette  # noqa: F401
    except ImportError as exc:
        raise SystemExit(
            f"mlx-scheduler serve --replicas {replicas} needs the cluster extra: "
            f"pip install 'mlx-scheduler[cluster]' ({exc})"
        ) from None
    from scheduler.serving.cluster.app import run

    grace = config.server.shutdown_timeout_s if args.shutdown_timeout is None else args.shutdown_timeout
    run(config, replicas, args.host, args.port, args.model_name, grace)

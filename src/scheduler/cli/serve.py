"""`mlx-scheduler serve`: its arguments, and which server runs (one process, or replicas on
Ray Serve). Importing it needs neither Starlette nor Ray."""

from __future__ import annotations

from typing import TYPE_CHECKING

import msgspec
import structlog

from scheduler.cli.argtypes import port, positive_int, seconds
from scheduler.errors import ConfigError
from scheduler.serving.cluster import serve_replicas
from scheduler.serving.http.serve import serve

if TYPE_CHECKING:
    import argparse

    from scheduler.config import SchedulerConfig

log = structlog.get_logger("scheduler.http")

ENGINE_PROCESS_REMOVED = ("--engine-process and [server] engine_process are deprecated and ignored: "
                          "the scheduler runs in this process (a child process for it measured no "
                          "faster, 0.13-0.60x at 8 streams on the H100)")


def add_serve_command(
    sub: argparse._SubParsersAction[argparse.ArgumentParser],
) -> argparse.ArgumentParser:
    """Register `serve`; the caller adds --config and --model."""
    p = sub.add_parser(
        "serve", help="an OpenAI-compatible HTTP server (needs the [server] extra)",
        description="Serve /v1/completions, /v1/chat/completions, /v1/models, /health and /metrics.",
    )
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default: 127.0.0.1)")
    p.add_argument("--port", type=port, default=8000, help="port to bind (default: 8000)")
    p.add_argument("--model-name", metavar="ID",
                   help="the model id clients see in /v1/models and responses (default: the model path)")
    p.add_argument("--trio", action="store_true",
                   help="run on trio, served by hypercorn (default: asyncio, served by uvicorn)")
    p.add_argument("--shutdown-timeout", type=seconds, default=None, metavar="S",
                   help="on SIGINT/SIGTERM, seconds in-flight requests get to finish; then each "
                        "gets a 503 or an error event (default: [server] shutdown_timeout_s, 10)")
    p.add_argument("--api-key", metavar="KEY",
                   help="require this key (Authorization: Bearer KEY, or x-api-key) on every path but "
                        "[server] open_paths; added to [server] api_keys and $MLX_SCHEDULER_API_KEY")
    p.add_argument("--engine-process", action="store_true", default=None,
                   help="deprecated and ignored: the scheduler runs in this process")
    p.add_argument("--replicas", type=positive_int, metavar="N",
                   help="N scheduler replicas on Ray Serve behind this port (needs the [cluster] extra; "
                   "default: [cluster] replicas, 1: this process)")
    p.add_argument("--frontends", type=positive_int, metavar="N",
                   help="with --replicas: N frontend processes behind Ray Serve's proxy (default: "
                        "[cluster] frontends, \"auto\": one per replica on hosts of 16 cores or more)")
    return p


def run_serve(args: argparse.Namespace, config: SchedulerConfig) -> None:
    """Run `serve` until SIGINT or SIGTERM."""
    if getattr(args, "engine_process", None) or config.server.engine_process:
        log.warning("engine_process_removed", reason=ENGINE_PROCESS_REMOVED)
    key = getattr(args, "api_key", None)
    if key is not None:
        if not key.strip():
            raise ConfigError("--api-key: the key is empty")
        config = msgspec.structs.replace(config, server=msgspec.structs.replace(
            config.server, api_keys=[*config.server.api_keys, key]))
    frontends = getattr(args, "frontends", None)
    if frontends is not None:
        config = msgspec.structs.replace(config, cluster=msgspec.structs.replace(
            config.cluster, frontends=frontends))
    replicas = getattr(args, "replicas", None) or config.cluster.replicas
    if replicas > 1:
        serve_replicas(args, config, replicas)
    else:
        if config.cluster.frontends != "auto" and config.cluster.frontends > 1:  # one process: its own
            log.warning("frontends_unused", frontends=config.cluster.frontends,
                        reason="frontends apply to --replicas N with N > 1; this is one process")
        serve(args, config)

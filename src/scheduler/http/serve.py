"""`mlx-scheduler serve`: the OpenAI-compatible app on uvicorn (asyncio) or hypercorn (trio).

Importing this module needs neither Starlette nor a server: the CLI registers the command always
and the `[server]` extra is only needed to run it."""

from __future__ import annotations

import signal
from typing import TYPE_CHECKING

import anyio

from scheduler.argtypes import port, positive_int, seconds

if TYPE_CHECKING:
    import argparse

    from starlette.applications import Starlette

    from scheduler.config import SchedulerConfig


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
    p.add_argument("--shutdown-timeout", type=seconds, default=10.0, metavar="S",
                   help="on SIGINT/SIGTERM, seconds in-flight requests get to finish (default: 10)")
    p.add_argument("--replicas", type=positive_int, metavar="N",
                   help="N scheduler replicas on Ray Serve behind this port (needs the [cluster] extra; "
                   "default: [cluster] replicas, 1: this process)")
    return p


def serve(args: argparse.Namespace, config: SchedulerConfig) -> None:
    """Run the server until SIGINT or SIGTERM."""
    replicas = getattr(args, "replicas", None) or config.cluster.replicas
    if replicas > 1:
        from scheduler.cluster import serve_replicas

        serve_replicas(args, config, replicas)
        return
    try:
        from scheduler.http.app import create_app
    except ImportError as exc:
        raise SystemExit(
            f"mlx-scheduler serve needs the server extra: pip install 'mlx-scheduler[server]' ({exc})"
        ) from None
    app = create_app(config, model_name=args.model_name)
    if args.trio:
        anyio.run(_hypercorn, app, args, backend="trio")
    else:
        _uvicorn(app, args, config.logging.level)


def _uvicorn(app: Starlette, args: argparse.Namespace, level: str) -> None:
    import uvicorn

    server = uvicorn.Server(uvicorn.Config(
        app, host=args.host, port=args.port, log_level=level, lifespan="on",
        timeout_graceful_shutdown=args.shutdown_timeout,
    ))
    server.run()


async def _hypercorn(app: Starlette, args: argparse.Namespace) -> None:
    from hypercorn.config import Config
    from hypercorn.trio import serve as hypercorn_serve

    config = Config()
    host = f"[{args.host}]" if ":" in args.host else args.host
    config.bind = [f"{host}:{args.port}"]
    config.graceful_timeout = args.shutdown_timeout
    config.accesslog = "-"
    with anyio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:

        async def stop() -> None:
            async for _ in signals:
                return

        await hypercorn_serve(app, config, shutdown_trigger=stop)  # type: ignore[arg-type]

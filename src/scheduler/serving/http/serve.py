"""`mlx-scheduler serve`: the OpenAI-compatible app on uvicorn (asyncio) or hypercorn (trio).

Importing this module needs neither Starlette nor a server: the CLI registers the command always
and the `[server]` extra is only needed to run it."""

from __future__ import annotations

import math
import signal
from typing import TYPE_CHECKING

import anyio
import msgspec
import structlog

from scheduler.cli.argtypes import port, positive_int, seconds

if TYPE_CHECKING:
    import argparse

    from starlette.applications import Starlette

    from scheduler.config import SchedulerConfig, ServerSection
    from scheduler.serving.http.shutdown import Gate

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
    p.add_argument("--engine-process", action="store_true", default=None,
                   help="deprecated and ignored: the scheduler runs in this process")
    p.add_argument("--replicas", type=positive_int, metavar="N",
                   help="N scheduler replicas on Ray Serve behind this port (needs the [cluster] extra; "
                   "default: [cluster] replicas, 1: this process)")
    return p


def serve(args: argparse.Namespace, config: SchedulerConfig) -> None:
    """Run one process's server until SIGINT or SIGTERM (`--replicas` above 1 is the cluster's)."""
    try:
        from scheduler.serving.http.app import create_app
    except ImportError as exc:
        raise SystemExit(
            f"mlx-scheduler serve needs the server extra: pip install 'mlx-scheduler[server]' ({exc})"
        ) from None
    grace = config.server.shutdown_timeout_s if args.shutdown_timeout is None else args.shutdown_timeout
    if config.scheduler.shutdown == "drain":  # the grace period is serve's drain; then it aborts
        log.info("scheduler_shutdown_replaced", configured="drain", by="--shutdown-timeout",
                 grace_s=grace)
        config = msgspec.structs.replace(
            config, scheduler=msgspec.structs.replace(config.scheduler, shutdown="abort"))
    app = create_app(config, model_name=args.model_name)
    if args.trio:
        anyio.run(_hypercorn, app, args, config.server, grace, backend="trio")
    else:
        _uvicorn(app, args, config, grace)


def _uvicorn(app: Starlette, args: argparse.Namespace, config: SchedulerConfig, grace: float) -> None:
    import uvicorn

    from scheduler.serving.http.limits import SERVER_MARGIN_S, GracefulServer, protocol_for

    limits = config.server
    server = GracefulServer(uvicorn.Config(
        app, host=args.host, port=args.port, log_level=config.logging.level, lifespan="on",
        http=protocol_for(limits), timeout_keep_alive=limits.keep_alive_s,  # type: ignore[arg-type]
        timeout_graceful_shutdown=math.ceil(grace + SERVER_MARGIN_S),
    ), app.state.gate, grace)
    server.run()


async def _hypercorn(app: Starlette, args: argparse.Namespace, limits: ServerSection, grace: float) -> None:
    from hypercorn.config import Config
    from hypercorn.trio import serve as hypercorn_serve

    gate: Gate = app.state.gate
    config = Config()
    host = f"[{args.host}]" if ":" in args.host else args.host
    config.bind = [f"{host}:{args.port}"]
    config.graceful_timeout = grace + 3.0  # after the app's own end of the grace period
    config.keep_alive_timeout = limits.keep_alive_s
    config.accesslog = "-"
    # hypercorn's read_timeout would also cut long streams, whose clients send nothing.
    log.warning("server_limits_off", limits="header_timeout_s, max_connections",
                reason="hypercorn (--trio) has neither; use uvicorn or a proxy in front")
    async with anyio.create_task_group() as tg:
        with anyio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:

            async def deadline() -> None:
                await anyio.sleep(grace)
                await gate.expire()

            async def stop() -> None:
                async for _ in signals:
                    gate.begin()
                    tg.start_soon(deadline)
                    return

            await hypercorn_serve(app, config, shutdown_trigger=stop)  # type: ignore[arg-type]
        tg.cancel_scope.cancel()

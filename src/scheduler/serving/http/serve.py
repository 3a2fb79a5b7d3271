"""`mlx-scheduler serve`: the OpenAI-compatible app on uvicorn (asyncio) or hypercorn (trio).

Importing this module needs neither Starlette nor a server: the CLI (`scheduler.cli.serve`)
registers the command always, and the `[server]` extra is only needed to run it."""

from __future__ import annotations

import math
import signal
from typing import TYPE_CHECKING

import anyio
import msgspec
import structlog

if TYPE_CHECKING:
    import argparse

    from starlette.applications import Starlette

    from scheduler.config import SchedulerConfig, ServerSection
    from scheduler.serving.http.shutdown import Gate

log = structlog.get_logger("scheduler.http")

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
    app = create_app(config, model_name=args.model_name, freeze_heap=config.server.freeze_heap)
    if args.trio:
        from scheduler.serving.http.shutdown import raise_again

        raise_again(anyio.run(_hypercorn, app, args, config.server, grace, backend="trio"))
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


async def _hypercorn(app: Starlette, args: argparse.Namespace, limits: ServerSection,
                     grace: float) -> list[int]:
    """Serve until SIGINT or SIGTERM and the grace period; the signals that stopped it."""
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
    caught: list[int] = []
    async with anyio.create_task_group() as tg:
        with anyio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:

            async def deadline() -> None:
                await anyio.sleep(grace)
                await gate.expire()

            async def stop() -> None:
                async for sig in signals:
                    caught.append(sig)
                    gate.begin()
                    tg.start_soon(deadline)
                    return

            await hypercorn_serve(app, config, shutdown_trigger=stop)  # type: ignore[arg-type]
        tg.cancel_scope.cancel()
    return caught

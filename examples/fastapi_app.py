"""Embedding in FastAPI: one `Scheduler` for the app's whole life (its lifespan), tokens streamed
to the app's own clients, and a client that hangs up cancels its request.

    pip install 'mlx-scheduler[server]' fastapi
    python examples/fastapi_app.py --port 8000              # or: uvicorn fastapi_app:app --app-dir examples
    curl -N localhost:8000/generate -H 'content-type: application/json' \\
         -d '{"prompt": "Once upon a time", "max_tokens": 32}'
"""

from __future__ import annotations

import argparse
import os
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING

import msgspec
from fastapi import FastAPI, HTTPException, Request
from fastapi.responses import StreamingResponse
from pydantic import BaseModel, Field

from scheduler import SamplingParams, Scheduler, SchedulerConfig
from scheduler.errors import InvalidRequest, QueueFull, SchedulerClosed

if TYPE_CHECKING:
    from collections.abc import AsyncIterator


class GenerateBody(BaseModel):
    prompt: str
    max_tokens: int = Field(64, ge=1)
    temperature: float = Field(0.7, ge=0)
    tenant: str = "default"


def create_app(config: SchedulerConfig) -> FastAPI:
    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[dict[str, Scheduler]]:
        async with Scheduler(config) as sched:  # loads the model; leaving ends every request
            yield {"sched": sched}  # lifespan state: `request.state.sched` in every handler

    app = FastAPI(title="mlx-scheduler embedded", lifespan=lifespan)

    @app.post("/generate")
    async def generate(body: GenerateBody, request: Request) -> StreamingResponse:
        sched: Scheduler = request.state.sched
        try:
            params = SamplingParams(max_tokens=body.max_tokens, temperature=body.temperature)
            stream = sched.generate(body.prompt, params, tenant=body.tenant)  # checks the arguments
            first = await anext(stream)  # submits: the rest surfaces here, before the 200 goes out
        except InvalidRequest as exc:
            raise HTTPException(400, str(exc)) from None
        except QueueFull as exc:
            raise HTTPException(429, str(exc)) from None
        except SchedulerClosed as exc:
            raise HTTPException(503, str(exc)) from None

        async def text() -> AsyncIterator[str]:
            # Starlette cancels this generator when the client disconnects; leaving `async with`
            # then aborts the request, and its batch slot is free within one engine step.
            async with stream:
                yield first.text
                async for chunk in stream:
                    yield chunk.text

        return StreamingResponse(text(), media_type="text/plain; charset=utf-8")

    @app.get("/stats")
    async def stats(request: Request) -> dict[str, int | bool | str]:
        return msgspec.structs.asdict(request.state.sched.stats())

    return app


def config_from_env() -> SchedulerConfig:
    path = os.environ.get("MLX_SCHEDULER_CONFIG")
    return SchedulerConfig.load(path) if path else SchedulerConfig()


app = create_app(config_from_env())  # for `uvicorn fastapi_app:app`; nothing starts until served

if __name__ == "__main__":
    import uvicorn

    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", help="a scheduler.toml (default: $MLX_SCHEDULER_CONFIG or defaults)")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    args = parser.parse_args()
    uvicorn.run(create_app(SchedulerConfig.load(args.config)) if args.config else app,
                host=args.host, port=args.port)

"""A frontend's own HTTP port (`[cluster] ingress = "direct"`, `cluster.ingress`): a real uvicorn
on a real socket, without Ray. The frontend behind it is `test_cluster.py`'s."""

from __future__ import annotations

import asyncio
import socket
import sys
from typing import TYPE_CHECKING

import httpx
import pytest

pytest.importorskip("uvicorn", reason="the server extra")

from starlette.responses import JSONResponse, Response, StreamingResponse  # noqa: E402

from scheduler.cli.bench.mlxlm import free_port  # noqa: E402
from scheduler.config import SchedulerConfig, ServerSection  # noqa: E402
from scheduler.errors import ConfigError  # noqa: E402
from scheduler.serving.cluster.ingress import DirectIngress, shared_socket  # noqa: E402

if TYPE_CHECKING:
    from starlette.requests import Request


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="SO_REUSEPORT spreads connections on Linux")
def test_the_frontends_of_a_host_bind_one_port_and_a_port_taken_otherwise_is_named() -> None:
    port = free_port()
    first, second = shared_socket("127.0.0.1", port), shared_socket("127.0.0.1", port)
    try:
        assert first.getsockname() == second.getsockname() == ("127.0.0.1", port)
    finally:
        first.close()
        second.close()
    with socket.socket() as taken:  # a process that did not ask to share it
        taken.bind(("127.0.0.1", port))
        taken.listen()
        with pytest.raises(OSError, match=f"the frontend cannot listen on 127.0.0.1:{port}"):
            shared_socket("127.0.0.1", port)


def test_the_port_answers_with_the_frontends_handler_streams_and_stops() -> None:
    seen: list[tuple[str, str, bytes]] = []

    async def handler(request: Request) -> Response:
        body = await request.body()
        seen.append((request.method, request.url.path, body))
        if request.url.path == "/stream":
            async def events() -> object:
                for i in range(3):
                    yield f"data: {i}\n\n".encode()
                    await asyncio.sleep(0)
            return StreamingResponse(events(), media_type="text/event-stream")
        return JSONResponse({"path": request.url.path, "n": len(body)}, status_code=201)

    async def main() -> str:
        port = free_port()
        ingress = DirectIngress(handler, ServerSection(), "127.0.0.1", port)
        async with httpx.AsyncClient(base_url=ingress.address, timeout=10) as client:
            for _ in range(100):  # uvicorn starts in the background
                try:
                    reply = await client.post("/v1/x", content=b"12345")
                    break
                except httpx.ConnectError:
                    await asyncio.sleep(0.05)
            assert (reply.status_code, reply.json()) == (201, {"path": "/v1/x", "n": 5})
            async with client.stream("GET", "/stream") as streamed:
                lines = [line async for line in streamed.aiter_lines() if line]
            assert lines == ["data: 0", "data: 1", "data: 2"]
        assert seen == [("POST", "/v1/x", b"12345"), ("GET", "/stream", b"")]
        ingress.close()
        for _ in range(100):
            if ingress._task.done():
                break
            await asyncio.sleep(0.05)
        assert ingress._task.done() and ingress.failure is None
        return ingress.address

    address = asyncio.run(main())
    with pytest.raises(httpx.ConnectError):  # closed: its socket too
        httpx.get(f"{address}/after", timeout=2)


def test_the_port_keeps_the_servers_limits_on_slow_and_surplus_connections() -> None:
    """The single-process server's header timeout and connection cap hold on a frontend's port."""
    limits = SchedulerConfig.from_toml(b"[server]\nheader_timeout_s = 0.3\nmax_connections = 2\n").server

    async def handler(request: Request) -> Response:
        return JSONResponse({})

    async def main() -> tuple[bytes, bytes]:
        ingress = DirectIngress(handler, limits, "127.0.0.1", port := free_port())
        await asyncio.sleep(0.3)  # uvicorn starts in the background
        silent = await asyncio.open_connection("127.0.0.1", port)
        other = await asyncio.open_connection("127.0.0.1", port)
        surplus = await asyncio.open_connection("127.0.0.1", port)
        refused = await asyncio.wait_for(surplus[0].read(), 5)
        timed_out = await asyncio.wait_for(silent[0].read(), 5)  # nothing sent: 408, then closed
        for _, writer in (silent, other, surplus):
            writer.close()
        ingress.close()
        return refused, timed_out

    refused, timed_out = asyncio.run(main())
    assert refused.startswith(b"HTTP/1.1 503") and b"too_many_connections" in refused, refused
    assert timed_out.startswith(b"HTTP/1.1 408") and b"header_timeout" in timed_out, timed_out


def test_direct_ingress_is_one_frontend_where_a_port_is_not_shared(monkeypatch: pytest.MonkeyPatch) -> None:
    direct = SchedulerConfig.from_toml(b"[cluster]\nfrontends = 3\n").cluster
    assert direct.ingress == "direct"  # the default
    assert direct.frontend_count(2) == (3 if sys.platform.startswith("linux") else 1)
    monkeypatch.setattr(sys, "platform", "darwin")
    assert direct.frontend_count(2) == 1
    proxied = SchedulerConfig.from_toml(b"[cluster]\ningress = 'proxy'\nfrontends = 3\n").cluster
    assert proxied.frontend_count(2) == 3  # Serve's proxy spreads the requests anywhere
    with pytest.raises(ConfigError, match="cluster.ingress"):
        SchedulerConfig.from_toml(b"[cluster]\ningress = 'sideways'\n")


def test_serving_on_a_port_another_program_holds_stops_before_starting_ray() -> None:
    pytest.importorskip("ray.serve", reason="the cluster extra")
    from scheduler.serving.cluster.app import run

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(SystemExit, match=f"cannot listen on 127.0.0.1:{port}: Address already in use"):
            run(SchedulerConfig(), 2, "127.0.0.1", port, None, 1.0)

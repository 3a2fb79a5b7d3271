"""Hostile and faulty clients against the real server: `mlx-scheduler serve --model synthetic:tiny`
in a subprocess on 127.0.0.1, short limits so each case takes a second or two. The long versions,
with figures, are `benchmarks/hostile.py`."""

from __future__ import annotations

import json
import signal
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

import httpx
import pytest

from tests.serve_process import Server, serve

if TYPE_CHECKING:
    from collections.abc import Iterator
    from pathlib import Path

SECRET = "SECRET-PROMPT-7f3a"  # sent in every bad body; must never reach the log
LIMITS = "[server]\nheader_timeout_s = 1.0\nbody_timeout_s = 1.0\nkeep_alive_s = 1.0\nmax_connections = 16\n"


@pytest.fixture(scope="module")
def server(model_cache: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    with serve(model_cache, tmp_path_factory.mktemp("hostile"), LIMITS) as s:
        yield s


def raw(port: int) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port), timeout=5)
    return sock


def read_all(sock: socket.socket, limit_s: float = 5.0) -> bytes:
    """Everything until the server closes the connection (at most `limit_s`)."""
    sock.settimeout(limit_s)
    out = b""
    try:
        while chunk := sock.recv(65536):
            out += chunk
    except TimeoutError:
        raise AssertionError(f"the server kept the connection open past {limit_s} s: {out!r}") from None
    return out


def body_of(response: bytes) -> Any:
    return json.loads(response.split(b"\r\n\r\n", 1)[1])


# ---- 1 and 6: every malformed or extreme body is a 400 naming the problem, never logged ------
BAD: list[tuple[str, bytes, dict[str, str], str]] = [
    ("nested unknown field", b'{"prompt": "' + SECRET.encode() + b'", "x": ' + b"[" * 100_000
     + b"]" * 100_000 + b"}", {}, "nested too deeply"),
    ("invalid UTF-8", b'{"prompt": "' + SECRET.encode() + b'\xff\xfe"}', {}, "invalid UTF-8"),
    ("JSON as text/plain", json.dumps({"prompt": SECRET}).encode(), {"content-type": "text/plain"},
     "content-type must be application/json"),
    ("temperature 1e300", json.dumps({"prompt": SECRET, "temperature": 1e300}).encode(), {},
     "temperature must be between 0 and 2"),
    ("priority 2**63", json.dumps({"prompt": SECRET, "priority": 2**63}).encode(), {}, "priority"),
    ("truncated JSON", b'{"prompt": "' + SECRET.encode(), {}, "not valid JSON"),
]


def test_malformed_bodies_are_400s_and_no_body_reaches_the_log(server: Server) -> None:
    with httpx.Client(base_url=server.url, timeout=30) as c:
        for what, body, headers, message in BAD:
            r = c.post("/v1/completions", content=body,
                       headers={"content-type": "application/json", **headers})
            assert r.status_code == 400, (what, r.text)
            error = r.json()["error"]
            assert error["type"] == "invalid_request_error" and message in error["message"], (what, error)
            assert SECRET not in r.text
        chat = {"messages": [{"role": "wizard", "content": SECRET}]}
        r = c.post("/v1/chat/completions", json=chat)
        assert r.status_code == 400 and "messages[0].role must be one of" in r.json()["error"]["message"]
        # Clamped, as vLLM: a tiny temperature is 0.01, a top_k past the vocabulary is off.
        ok = c.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 4, "temperature": 1e-300,
                                              "top_k": 10**15, "ignore_eos": True})
        assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 4, ok.text
    log = server.log(wait=0.5)
    assert SECRET not in log and "Traceback" not in log, log


# ---- 2: an oversized prompt is refused before it is tokenized --------------------------------
def test_a_prompt_too_long_for_the_context_is_refused_by_its_length(server: Server) -> None:
    huge = "word " * 2_000_000  # 10 MB: 26,624 characters is the bound on tiny (2048 x 13)
    with httpx.Client(base_url=server.url, timeout=60) as c:
        r = c.post("/v1/completions", json={"prompt": huge, "max_tokens": 4})
        chat = c.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": huge}]})
        fits = c.post("/v1/completions", json={"prompt": "word " * 300, "max_tokens": 2})
    assert r.status_code == 400 and chat.status_code == 400, (r.text, chat.text)
    assert "10000000 characters, more than the model's context of 2048 tokens can hold" in r.json()["error"]["message"]
    assert chat.json()["error"]["param"] == "messages"
    assert fits.status_code == 200, fits.text
    stats = server.health()["stats"]
    assert stats["running"] == 0 and stats["waiting"] == 0


# ---- 4: slow and idle connections are closed; the connection cap answers 503 -----------------
def test_slowloris_silent_and_slow_body_connections_are_closed(server: Server) -> None:
    half_head = raw(server.port)
    half_head.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")  # and never the rest
    silent = raw(server.port)
    slow_body = raw(server.port)
    slow_body.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\ncontent-type: application/json\r\n"
                      b"content-length: 1000\r\n\r\n{\"prompt\": ")
    start = time.monotonic()
    for sock, code in ((half_head, "header_timeout"), (silent, "header_timeout"), (slow_body, "body_timeout")):
        with sock:
            answer = read_all(sock)
        assert answer.startswith(b"HTTP/1.1 408"), answer
        assert body_of(answer)["error"]["code"] == code
    assert time.monotonic() - start < 5  # 1 s limits; without them each stays open for ever


def test_an_idle_keep_alive_connection_is_closed(server: Server) -> None:
    with raw(server.port) as sock:
        sock.sendall(b"GET /v1/models HTTP/1.1\r\nHost: x\r\n\r\n")
        answer = read_all(sock)  # the response, then the close after keep_alive_s = 1
    assert answer.startswith(b"HTTP/1.1 200") and b'"object":"list"' in answer


def test_connections_past_the_cap_get_a_clear_503(server: Server) -> None:
    held = [raw(server.port) for _ in range(16)]
    try:
        time.sleep(0.2)
        with raw(server.port) as extra:
            answer = read_all(extra)
        assert answer.startswith(b"HTTP/1.1 503"), answer
        error = body_of(answer)["error"]
        assert error["code"] == "too_many_connections" and "limit of 16" in error["message"]
    finally:
        for sock in held:
            sock.close()
    time.sleep(0.3)
    assert server.health()["status"] == "ok"  # room again once they close


# ---- 5: a client that does not read holds no one else up -------------------------------------
def test_streams_nobody_reads_finish_in_the_scheduler(server: Server) -> None:
    body = json.dumps({"prompt": "Once upon a time", "max_tokens": 400, "ignore_eos": True,
                       "stream": True}).encode()
    request = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\ncontent-type: application/json\r\n"
               b"content-length: %d\r\n\r\n%s" % (len(body), body))
    stalled = []
    for _ in range(8):
        sock = raw(server.port)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        sock.sendall(request)
        stalled.append(sock)  # and never read
    try:
        with httpx.Client(base_url=server.url, timeout=60) as c:
            r = c.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 8, "ignore_eos": True})
            assert r.status_code == 200
            deadline = time.monotonic() + 30
            while (stats := server.health()["stats"])["running"] or stats["waiting"]:
                assert time.monotonic() < deadline, stats  # generation never waits on a reader
                time.sleep(0.2)
    finally:
        for sock in stalled:
            sock.close()


# ---- 3: SIGTERM under load, at a short grace period ------------------------------------------
def test_sigterm_under_load_ends_every_request_with_its_promised_answer(model_cache: Path, tmp_path: Path) -> None:
    extra = "[worker]\nmax_batch = 8\n"  # 14 streams + 6 whole requests: some run, some queue
    with serve(model_cache, tmp_path, extra, "--shutdown-timeout", "1") as s:
        long = {"prompt": "Once upon a time", "max_tokens": 1500, "ignore_eos": True}

        def stream() -> list[Any]:
            with httpx.Client(timeout=60) as c, c.stream("POST", f"{s.url}/v1/completions",
                                                         json={**long, "stream": True}) as r:
                assert r.status_code == 200
                out: list[Any] = []
                for line in r.iter_lines():
                    if line.startswith("data: "):
                        data = line[6:]
                        out.append(data if data == "[DONE]" else json.loads(data))
                return out

        def whole() -> httpx.Response:
            with httpx.Client(timeout=60) as c:
                return c.post(f"{s.url}/v1/completions", json=long)

        stuck = []  # two more streams nobody reads: their sockets fill up
        for _ in range(2):
            sock = socket.socket()
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            sock.connect(("127.0.0.1", s.port))
            data = json.dumps({**long, "stream": True}).encode()
            sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\ncontent-type: application/json\r\n"
                         b"content-length: %d\r\n\r\n%s" % (len(data), data))
            stuck.append(sock)
        with ThreadPoolExecutor(18) as pool:
            streams = [pool.submit(stream) for _ in range(12)]
            wholes = [pool.submit(whole) for _ in range(6)]
            deadline = time.monotonic() + 60
            while (stats := s.health()["stats"])["running"] + stats["waiting"] < 20:
                assert time.monotonic() < deadline, stats
                time.sleep(0.1)
            s.proc.send_signal(signal.SIGTERM)
            time.sleep(0.5)
            with pytest.raises(httpx.ConnectError):  # the listening socket is closed at once
                httpx.get(f"{s.url}/health", timeout=5)
            ends = [f.result(timeout=30) for f in streams]
            answers = [f.result(timeout=30) for f in wholes]
        assert s.proc.wait(timeout=30) == -signal.SIGTERM  # uvicorn re-raises it once shut down
        log = s.log(wait=1.0)
        for sock in stuck:
            with sock:
                assert b"HTTP/1.1 200" in read_all(sock, 10)  # then closed by the server
    for events in ends:
        assert events[-1] == "[DONE]" and events[-2]["error"]["code"] == "shutting_down", events[-3:]
    for r in answers:
        assert r.status_code == 503 and r.json()["error"]["code"] == "shutting_down", r.text
    assert "Traceback" not in log and "Exception in ASGI" not in log and "Cancel" not in log, log
    assert "shutdown_grace_over" in log and "scheduler_closed" in log


# ---- 1: a logged exception shows no frame's locals -------------------------------------------
def test_logged_tracebacks_show_no_locals() -> None:
    import io

    import structlog

    from metrics import configure_logging

    out = io.StringIO()
    configure_logging("console", "info", stream=out)
    try:
        body = {"prompt": SECRET}  # a local of the failing frame, as a request body would be
        try:
            raise ValueError(f"bad request of {len(body)} fields")
        except ValueError:
            structlog.get_logger("test").exception("request_failed", request_id="r1")
    finally:
        structlog.reset_defaults()
    text = out.getvalue()
    assert "request_failed" in text and "ValueError" in text and "Traceback" in text, text
    assert SECRET not in text, text


# ---- 3: a client that cannot take its final events is disconnected, not cancelled ------------
def test_the_grace_period_ends_by_closing_the_scheduler_then_disconnecting_stuck_clients(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import asyncio

    import uvicorn

    from scheduler.serving.http import limits
    from scheduler.serving.http.shutdown import Gate

    class Transport:
        aborted = False

        def abort(self) -> None:
            self.aborted = True

    class Stuck:  # a connection whose socket is full: its task waits in uvicorn's drain()
        transport = Transport()

    class Sched:
        closed = False

        async def aclose(self) -> None:
            self.closed = True

    monkeypatch.setattr(limits, "FLUSH_S", 0.05)
    gate, sched, stuck = Gate(), Sched(), Stuck()
    gate.scheduler = sched  # type: ignore[assignment]
    server = limits.GracefulServer(uvicorn.Config(lambda *a: None), gate, grace_s=0.05)
    server.server_state.connections.add(stuck)  # type: ignore[arg-type]
    asyncio.run(server._deadline())
    assert gate.closing and sched.closed and stuck.transport.aborted


# ---- 2: long prompts are tokenized on at most `tokenize_threads` threads, off the loop --------
def test_long_prompts_tokenize_off_the_loop_on_bounded_threads() -> None:
    from types import SimpleNamespace

    import anyio

    from scheduler.serving.http.prompts import INLINE_CHARS, Tokenizing

    loop_thread = threading.get_ident()
    lock = threading.Lock()
    seen = {"now": 0, "peak": 0, "on_loop": 0}

    def encode(text: str) -> list[int]:
        with lock:
            seen["now"] += 1
            seen["peak"] = max(seen["peak"], seen["now"])
            seen["on_loop"] += threading.get_ident() == loop_thread
        time.sleep(0.05)
        with lock:
            seen["now"] -= 1
        return [1] * (len(text) // 4)

    tokenizer = SimpleNamespace(get_vocab=lambda: {"abcd": 0, "e": 1})
    model = SimpleNamespace(encode=encode, tokenizer=tokenizer, context_length=4096)
    tokens = Tokenizing(threads=2)

    async def main() -> None:
        async with anyio.create_task_group() as tg:
            for _ in range(6):
                tg.start_soon(tokens.encode, model, "x" * (INLINE_CHARS + 1))  # type: ignore[arg-type]

    anyio.run(main)
    assert seen["peak"] == 2 and seen["on_loop"] == 0, seen
    assert tokens.max_chars(model) == 4096 * 4  # type: ignore[arg-type]

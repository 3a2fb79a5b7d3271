"""Hostile clients against `mlx-scheduler serve`, the long versions of tests/test_hostile.py.

Starts the server (synthetic:tiny by default) on 127.0.0.1 and runs, each bounded in count and
time: streams dropped at random, slow readers beside fast clients, slowloris, oversized prompts
and SIGTERM under load. After each it checks the server is idle with every block free, and it
samples the server's RSS and CPU time. Prints a table and writes JSON.

    python benchmarks/hostile.py [--model synthetic:tiny] [--only slow,oversized] [--json PATH]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from procstat import TICK, read_stat  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
HOST = "127.0.0.1"  # every byte of this benchmark stays on the loopback


# ---- the server --------------------------------------------------------------------------------
class Server:
    def __init__(self, model: str, extra: str = "", grace: float = 10.0) -> None:
        self.dir = tempfile.TemporaryDirectory()
        toml = Path(self.dir.name) / "scheduler.toml"
        toml.write_text(f'[model]\npath = "{model}"\n{extra}')
        self.log_path = Path(self.dir.name) / "server.log"
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")])}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "scheduler.cli", "serve", "--config", str(toml), "--port", "0",
             "--shutdown-timeout", str(grace)],
            stdout=subprocess.DEVNULL, stderr=self.log_path.open("w"), env=env)
        deadline = time.monotonic() + 120
        while not (m := re.search(r"Uvicorn running on http://127\.0\.0\.1:(\d+)", self.log())):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"the server did not start:\n{self.log()}")
            time.sleep(0.1)
        self.port = int(m.group(1))

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def rss_mib(self) -> float:
        for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
        return float("nan")

    def cpu_s(self) -> tuple[float, float]:
        """(user, system) CPU seconds of the server process so far."""
        user, system, _ = read_stat(Path(f"/proc/{self.proc.pid}/stat"))
        return user / TICK, system / TICK

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.dir.cleanup()


# ---- raw HTTP/1.1 over asyncio streams ---------------------------------------------------------
def request(path: str, body: dict[str, Any] | None = None) -> bytes:
    if body is None:
        return f"GET {path} HTTP/1.1\r\nHost: {HOST}\r\nConnection: close\r\n\r\n".encode()
    data = json.dumps(body).encode()
    return (f"POST {path} HTTP/1.1\r\nHost: {HOST}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(data)}\r\nConnection: close\r\n\r\n").encode() + data


async def fetch(port: int, raw: bytes, *, read: int = 65536, every: float = 0.0,
                stop_after: int | None = None) -> bytes:
    """Send `raw`, read the answer `read` bytes at a time (`every` s apart) until the server
    closes, or drop the connection after `stop_after` bytes."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    if every:  # a small receive window: the server's own buffers fill, not just the kernel's
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.setblocking(False)
    await asyncio.get_running_loop().sock_connect(sock, (HOST, port))
    reader, writer = await asyncio.open_connection(sock=sock, limit=max(read, 1024))
    out = b""
    try:
        writer.write(raw)
        await writer.drain()
        while chunk := await reader.read(read):
            out += chunk
            if stop_after is not None and len(out) >= stop_after:
                break
            if every:
                await asyncio.sleep(every)
    finally:
        writer.transport.abort()
    return out


async def health(port: int) -> dict[str, Any]:
    answer = await fetch(port, request("/health"))
    out: dict[str, Any] = json.loads(answer.split(b"\r\n\r\n", 1)[1])
    return out


async def wait_idle(port: int, limit_s: float = 60.0) -> float:
    """Seconds until running, waiting, the engine's batch and used blocks are all 0."""
    start = time.monotonic()
    while time.monotonic() - start < limit_s:
        s = (await health(port))["stats"]
        if s["running"] == s["waiting"] == s["engine_batch"] == s["blocks_used"] == 0:
            return time.monotonic() - start
        await asyncio.sleep(0.05)
    return float("inf")


def stream_body(max_tokens: int) -> dict[str, Any]:
    return {"prompt": "Once upon a time", "max_tokens": max_tokens, "ignore_eos": True, "stream": True}


# ---- scenarios ---------------------------------------------------------------------------------
async def drops(srv: Server, rounds: int = 3, streams: int = 200) -> dict[str, Any]:
    """Streams that disconnect after a random number of bytes, `rounds` times."""
    rng = random.Random(0)
    idle = []
    for _ in range(rounds):
        await asyncio.gather(*(
            fetch(srv.port, request("/v1/completions", stream_body(256)), stop_after=rng.randint(1, 40_000))
            for _ in range(streams)), return_exceptions=True)
        idle.append(await wait_idle(srv.port))
    return {"streams": rounds * streams, "idle_after_s_max": max(idle)}


async def slow_readers(srv: Server, n: int = 50, tokens: int = 256) -> dict[str, Any]:
    """`n` fast clients beside `n` fast readers, then beside `n` slow readers (256 B every 2 s);
    the fast clients' end-to-end latency and the server's CPU time, side by side."""
    out: dict[str, Any] = {}
    # Twice each, interleaved: on a shared machine e2e follows the load; CPU and steps do not.
    for label, read, every in (("beside_fast", 65536, 0.0), ("beside_slow", 256, 2.0),
                               ("beside_fast_2", 65536, 0.0), ("beside_slow_2", 256, 2.0)):
        user0, sys0 = srv.cpu_s()
        steps0 = (await health(srv.port))["stats"]["steps"]
        others = [asyncio.ensure_future(fetch(srv.port, request("/v1/completions", stream_body(tokens)),
                                              read=read, every=every)) for _ in range(n)]

        async def timed() -> float:
            t0 = time.perf_counter()
            answer = await fetch(srv.port, request("/v1/completions", stream_body(tokens)))
            assert b"data: [DONE]" in answer, answer[-200:]
            return time.perf_counter() - t0

        e2e = sorted(await asyncio.gather(*(timed() for _ in range(n))))
        user1, sys1 = srv.cpu_s()
        for task in others:
            task.cancel()
        await asyncio.gather(*others, return_exceptions=True)
        out[label] = {"e2e_p50_s": statistics.median(e2e), "e2e_p99_s": e2e[int(0.99 * (len(e2e) - 1))],
                      "cpu_user_s": user1 - user0, "cpu_sys_s": sys1 - sys0,
                      "engine_steps": (await health(srv.port))["stats"]["steps"] - steps0,
                      "load_avg_1m": os.getloadavg()[0]}
        out[label]["idle_after_s"] = await wait_idle(srv.port)
    fast = out["beside_fast"]["e2e_p50_s"] + out["beside_fast_2"]["e2e_p50_s"]
    out["p50_ratio_slow_to_fast"] = (out["beside_slow"]["e2e_p50_s"] + out["beside_slow_2"]["e2e_p50_s"]) / fast
    return out


async def slowloris(srv: Server, n: int = 200, hold_s: float = 30.0) -> dict[str, Any]:
    """`n` connections: a third trickle their head 1 byte every 3 s, a third send a head and part
    of a body, a third stay silent. How long the server holds them, and a normal client's latency."""
    head = request("/v1/completions", {"prompt": "hi", "max_tokens": 4})
    held: dict[str, list[float]] = {"trickled_head": [], "partial_body": [], "silent": []}

    async def one(kind: int) -> None:
        reader, writer = await asyncio.open_connection(HOST, srv.port)
        t0 = time.monotonic()
        try:
            if kind == 1:
                writer.write(head[: head.index(b"\r\n\r\n") + 4] + b'{"prompt": ')
            for i in range(int(hold_s / 3)):
                if kind == 0:
                    writer.write(head[i : i + 1])
                try:
                    if await asyncio.wait_for(reader.read(65536), 3.0) == b"":
                        break
                except TimeoutError:
                    continue
                break  # the server answered (408) and will close
        except (ConnectionError, OSError):
            pass
        finally:
            held[list(held)[kind]].append(time.monotonic() - t0)
            writer.transport.abort()

    tasks = [asyncio.ensure_future(one(i % 3)) for i in range(n)]
    await asyncio.sleep(1.0)
    t0 = time.perf_counter()
    normal = await fetch(srv.port, head)
    normal_s = time.perf_counter() - t0
    await asyncio.gather(*tasks)
    return {"connections": n, **{f"held_s_max_{k}": max(v) for k, v in held.items()},
            "normal_request_ok": normal.startswith(b"HTTP/1.1 200"), "normal_request_s": normal_s}


async def oversized(srv: Server, n: int = 4, rounds: int = 3, mb: int = 10) -> dict[str, Any]:
    """`n` concurrent text prompts of `mb` MB, `rounds` times, beside a normal client."""
    rss0 = srv.rss_mib()
    peak = rss0
    huge = request("/v1/completions", {"prompt": "word " * (mb * 200_000), "max_tokens": 4})
    refused, answer_s, normal_s, after = 0, [], [], []

    async def sample() -> None:
        nonlocal peak
        while True:
            peak = max(peak, srv.rss_mib())
            await asyncio.sleep(0.05)

    sampler = asyncio.ensure_future(sample())
    for _ in range(rounds):
        async def big() -> None:
            nonlocal refused
            t0 = time.perf_counter()
            answer = await fetch(srv.port, huge)
            answer_s.append(time.perf_counter() - t0)
            refused += answer.startswith(b"HTTP/1.1 400")

        async def normal() -> None:
            t0 = time.perf_counter()
            await fetch(srv.port, request("/v1/completions", {"prompt": "hi", "max_tokens": 8}))
            normal_s.append(time.perf_counter() - t0)

        await asyncio.gather(*(big() for _ in range(n)), normal())
        after.append(srv.rss_mib())
    sampler.cancel()
    await asyncio.sleep(1.0)
    return {"prompts": n * rounds, "refused_400": refused, "answer_s_max": max(answer_s),
            "normal_request_s_max": max(normal_s), "rss_before_mib": rss0, "rss_peak_mib": peak,
            "rss_after_each_round_mib": after, "rss_after_mib": srv.rss_mib()}


async def sigterm(srv: Server, streams: int = 100, whole: int = 20, tokens: int = 512,
                  stuck: int = 10) -> dict[str, Any]:
    """SIGTERM once every request is in (and `stuck` streams nobody reads have filled their
    sockets); count what each client got."""
    body = stream_body(tokens)
    stalled = [asyncio.ensure_future(fetch(srv.port, request("/v1/completions", stream_body(2000)),
                                           read=1, every=3600.0)) for _ in range(stuck)]
    await asyncio.sleep(8.0)  # the unread streams fill their sockets and the server's buffers
    tasks = [asyncio.ensure_future(fetch(srv.port, request("/v1/completions", body))) for _ in range(streams)]
    tasks += [asyncio.ensure_future(fetch(srv.port, request("/v1/completions", {**body, "stream": False})))
              for _ in range(whole)]
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        s = (await health(srv.port))["stats"]
        if s["running"] + s["waiting"] >= streams + whole + stuck:
            break
        await asyncio.sleep(0.1)
    t0 = time.monotonic()
    srv.proc.send_signal(signal.SIGTERM)
    answers = await asyncio.gather(*tasks, return_exceptions=True)
    await asyncio.to_thread(srv.proc.wait, 120)
    exit_s = time.monotonic() - t0
    for task in stalled:  # these clients never read, so they cannot tell; the server's log can
        task.cancel()
    await asyncio.gather(*stalled, return_exceptions=True)
    kinds: dict[str, int] = {}
    for a in answers:
        if isinstance(a, BaseException):
            k = type(a).__name__
        elif a.startswith(b"HTTP/1.1 200") and a.endswith(b"data: [DONE]\n\n\r\n0\r\n\r\n"):
            k = "error_event_then_done" if b'"shutting_down"' in a else "completed"
        elif a.startswith(b"HTTP/1.1 503") and b'"shutting_down"' in a:
            k = "503_shutting_down"
        else:
            k = a[:40].decode(errors="replace")
        kinds[k] = kinds.get(k, 0) + 1
    log = srv.log()
    kinds["unread_streams_disconnected"] = int(
        re.search(r"shutdown_disconnecting\S*\s+\S*connections\S*=\S*?(\d+)", log).group(1)  # type: ignore[union-attr]
        if "shutdown_disconnecting" in log else 0)
    return {"outcomes": kinds, "exit_s": exit_s, "exit_code": srv.proc.returncode,
            "tracebacks": log.count("Traceback"), "asgi_exceptions": log.count("Exception in ASGI")}


SCENARIOS = ("drops", "slow", "slowloris", "oversized", "sigterm")


async def run(args: argparse.Namespace) -> dict[str, Any]:
    results: dict[str, Any] = {}
    only = set(args.only.split(",")) if args.only else set(SCENARIOS)
    limits = "[server]\nheader_timeout_s = 10.0\nbody_timeout_s = 30.0\n"
    srv = Server(args.model, limits + "[worker]\nmax_batch = 64\n")
    try:
        base_rss = srv.rss_mib()
        for name, fn in (("drops", drops), ("slow", slow_readers), ("slowloris", slowloris),
                         ("oversized", oversized)):
            if name in only:
                t0 = time.monotonic()
                results[name] = await (oversized(srv, rounds=args.rounds) if name == "oversized" else fn(srv))
                results[name]["idle_after_s"] = await wait_idle(srv.port)
                results[name]["wall_s"] = time.monotonic() - t0
                print(name, json.dumps(results[name]), flush=True)
        s = (await health(srv.port))["stats"]
        results["after"] = {"rss_start_mib": base_rss, "rss_end_mib": srv.rss_mib(),
                            "blocks_used": s["blocks_used"], "running": s["running"], "waiting": s["waiting"],
                            "tracebacks": srv.log().count("Traceback")}
    finally:
        srv.stop()
    if "sigterm" in only:
        srv = Server(args.model, limits, grace=args.grace)
        try:
            results["sigterm"] = await sigterm(srv)
            results["sigterm"]["grace_s"] = args.grace
        finally:
            srv.stop()
    return results


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="synthetic:tiny")
    p.add_argument("--only", help=f"comma-separated subset of {','.join(SCENARIOS)}")
    p.add_argument("--rounds", type=int, default=3, help="rounds of oversized prompts")
    p.add_argument("--grace", type=float, default=10.0, help="--shutdown-timeout for the SIGTERM run")
    p.add_argument("--json", default=str(ROOT / "benchmarks" / "results" / "hostile.json"))
    args = p.parse_args()
    results = asyncio.run(run(args))
    print(f"\n{'scenario':<11} figures")
    for name, r in results.items():
        print(f"{name:<11} {json.dumps(r)}")
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps({"model": args.model, "results": results}, indent=2))


if __name__ == "__main__":
    main()

"""A run sent by several client processes (`bench --url ... --clients N`).

One Python client reads a streamed event in about 60 µs of CPU (httpx and JSON, the 2-core CPU),
so from some ten thousand tokens a second the client, not the server, sets what a run shows:
two GPUs' replicas stream more than that. Each process sends a share of the requests over its
own connections; all start together, and their records make one run, in the requests' order.

Shares: requests round-robin; a closed loop's users, and an open loop's cap on requests in
flight, as evenly as they divide; an open loop's send times are the whole run's, drawn once, so
the offered load is the one a single client would offer. A closed loop differs in one way: each
process's users take the next request of its own share, so one process may run out while
another still has requests queued.
"""

from __future__ import annotations

import multiprocessing
import os
from typing import TYPE_CHECKING, Any

import anyio
import msgspec

from scheduler.cli.bench.datasets import RequestSpec  # noqa: TC001 - msgspec decodes it at run time
from scheduler.cli.bench.runner import Load, RunResult, run_arrivals, run_load
from scheduler.cli.bench.targets import OpenAITarget, Record, Sampling, http_client

if TYPE_CHECKING:
    from multiprocessing.connection import Connection

START_TIMEOUT_S = 120.0
"""How long the processes wait for one another to be ready (each imports httpx and its share)."""


class Share(msgspec.Struct, frozen=True):
    """What one client process sends, and how."""

    url: str
    model: str | None
    connect_retry_s: float
    specs: list[RequestSpec]
    load: Load
    sampling: Sampling
    arrivals: list[float] | None = None
    """An open loop's send times, seconds from the common start, one per spec."""


class Done(msgspec.Struct):
    records: list[Record]
    duration_s: float
    cut_off: bool
    pid: int
    error: str = ""


class SpreadError(RuntimeError):
    """A client process failed: its share of the run is lost, so the run is."""


Part = tuple[list[int], Load, "list[float] | None"]
"""A process's requests (indices into the run's), its load, and an open loop's send times."""


def split(specs: list[RequestSpec], load: Load, clients: int) -> list[Part]:
    """Each process's requests (indices into `specs`), load and send times. Fewer processes
    than asked where there are fewer requests, users or requests allowed in flight."""
    n = len(specs)
    k = max(1, min(clients, n, load.concurrency or n, load.max_concurrency or n))
    times = None if load.concurrency is not None else run_arrivals(n, load)
    out: list[Part] = []
    for j in range(k):
        ids = list(range(j, n, k))
        if load.concurrency is not None:
            part = msgspec.structs.replace(load, concurrency=_even(load.concurrency, k, j))
        elif load.max_concurrency is not None:
            part = msgspec.structs.replace(load, max_concurrency=_even(load.max_concurrency, k, j))
        else:
            part = load
        out.append((ids, part, None if times is None else [times[i] for i in ids]))
    return out


def _even(total: int, parts: int, j: int) -> int:
    return total // parts + (1 if j < total % parts else 0)


def run_spread(url: str, model: str | None, connect_retry_s: float, specs: list[RequestSpec], load: Load,
               sampling: Sampling, clients: int) -> tuple[RunResult, list[int]]:
    """The run, sent by up to `clients` processes: its result and the processes' ids. Blocks."""
    ctx = multiprocessing.get_context("spawn")  # no fork of a process that may hold MLX's threads
    parts = split(specs, load, clients)
    barrier = ctx.Barrier(len(parts))
    running: list[tuple[Any, Connection, list[int]]] = []
    for ids, part, times in parts:
        share = Share(url, model, connect_retry_s, [specs[i] for i in ids], part, sampling, times)
        receive, send = ctx.Pipe(duplex=False)
        proc = ctx.Process(target=_child, args=(msgspec.msgpack.encode(share), barrier, send), daemon=True)
        proc.start()
        send.close()  # the child's end: EOF here if the child dies
        running.append((proc, receive, ids))
    records = [Record(s.prompt_tokens, s.max_tokens) for s in specs]
    duration, cut_off, pids, errors = 0.0, False, [], []
    for proc, receive, ids in running:
        try:
            done = msgspec.msgpack.decode(receive.recv_bytes(), type=Done)
        except EOFError:
            proc.join()
            done = Done([], 0.0, True, proc.pid or 0, f"it ended with exit code {proc.exitcode}")
        proc.join()
        if done.error:
            errors.append(f"client process {done.pid}: {done.error}")
            continue
        for i, rec in zip(ids, done.records, strict=True):
            records[i] = rec
        duration, cut_off = max(duration, done.duration_s), cut_off or done.cut_off
        pids.append(done.pid)
    if errors:
        raise SpreadError("; ".join(errors))
    return RunResult(load, records, duration, cut_off), pids


def _child(share_bytes: bytes, barrier: Any, conn: Connection) -> None:
    try:
        share = msgspec.msgpack.decode(share_bytes, type=Share)
        done = anyio.run(_send, share, barrier)
    except BaseException as exc:  # told to the parent, which names it: nothing else would
        barrier.abort()  # the others stop waiting for this one
        done = Done([], 0.0, True, os.getpid(), f"{type(exc).__name__}: {exc}")
    conn.send_bytes(msgspec.msgpack.encode(done))
    conn.close()


async def _send(share: Share, barrier: Any) -> Done:
    async with http_client(share.load.max_duration_s) as client:
        target = OpenAITarget(client, share.url, model=share.model, connect_retry_s=share.connect_retry_s)
        await anyio.to_thread.run_sync(barrier.wait, START_TIMEOUT_S)  # everyone ready: go together
        run = await run_load(target, share.specs, share.load, share.sampling, progress=None,
                             arrivals=share.arrivals)
    return Done(run.records, run.duration_s, run.cut_off, os.getpid())

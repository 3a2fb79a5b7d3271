"""A run sent by several client processes (`bench --url ... --clients N`).

One Python client spends about 100 µs of CPU on each streamed token (httpx and JSON; the 2-core
CPU, measured as the extra CPU of a run 4x as long: 4.8 s for 49,152 more tokens), so from some
ten thousand tokens a second the client, not the server, sets what a run shows: two GPUs'
replicas stream twice that. Each process sends a share of the requests over its
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
import time
from multiprocessing.connection import wait
from typing import TYPE_CHECKING, Any, TextIO, cast

import anyio
import msgspec

from scheduler.cli.bench.datasets import RequestSpec  # noqa: TC001 - msgspec decodes it at run time
from scheduler.cli.bench.runner import Counts, Load, RunResult, print_progress, run_arrivals, run_load
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


class Done(msgspec.Struct, tag=True):
    records: list[Record]
    duration_s: float
    cut_off: bool
    pid: int
    error: str = ""


PROGRESS_EVERY_S = 1.0
_message = msgspec.msgpack.Decoder(Counts | Done)
"""A process's `Counts` every `PROGRESS_EVERY_S`, then its `Done`."""


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
               sampling: Sampling, clients: int,
               progress: TextIO | None = None) -> tuple[RunResult, list[int]]:
    """The run, sent by up to `clients` processes: its result and the processes' ids. Blocks;
    prints the processes' counts together to `progress` every second."""
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
    duration, cut_off = 0.0, False
    pids: list[int] = []
    errors: list[str] = []
    counts: dict[Connection, Counts] = {}
    ending = {receive: (proc, ids) for proc, receive, ids in running}
    start = shown = time.monotonic()
    while ending:
        for ready in wait(list(ending), timeout=PROGRESS_EVERY_S):
            conn = cast("Connection", ready)
            proc, ids = ending[conn]
            try:
                msg = _message.decode(conn.recv_bytes())
            except EOFError:
                proc.join()
                msg = Done([], 0.0, True, proc.pid or 0, f"it ended with exit code {proc.exitcode}")
            if isinstance(msg, Counts):
                counts[conn] = msg
                continue
            del ending[conn]
            counts.pop(conn, None)
            proc.join()
            if msg.error:
                if not errors:  # the first: the others are stopped, their run being lost anyway
                    errors.append(f"client process {msg.pid}: {msg.error}")
                    for other, _ in ending.values():
                        other.terminate()
                continue
            for i, rec in zip(ids, msg.records, strict=True):
                records[i] = rec
            duration, cut_off = max(duration, msg.duration_s), cut_off or msg.cut_off
            pids.append(msg.pid)
        if progress is not None and (not ending or time.monotonic() - shown >= PROGRESS_EVERY_S):
            # Those still sending by their last counts, the ended ones by their records (the
            # others' records are still unsent placeholders: zeros).
            shown = time.monotonic()
            now = sum(counts.values(), Counts.of(records))
            print_progress(now, len(specs), shown - start, progress, final=not ending)
    if errors:
        raise SpreadError("; ".join(errors))
    return RunResult(load, records, duration, cut_off), pids


def _child(share_bytes: bytes, barrier: Any, conn: Connection) -> None:
    try:
        share = msgspec.msgpack.decode(share_bytes, type=Share)
        done = anyio.run(_send, share, barrier, conn)
    except BaseException as exc:  # told to the parent, which names it: nothing else would
        barrier.abort()  # the others stop waiting for this one
        done = Done([], 0.0, True, os.getpid(), f"{type(exc).__name__}: {exc}")
    conn.send_bytes(msgspec.msgpack.encode(done))
    conn.close()


async def _send(share: Share, barrier: Any, conn: Connection) -> Done:
    records = [Record(s.prompt_tokens, s.max_tokens) for s in share.specs]

    async def report() -> None:
        while True:
            await anyio.sleep(PROGRESS_EVERY_S)
            conn.send_bytes(msgspec.msgpack.encode(Counts.of(records)))

    async with http_client(share.load.max_duration_s) as client, anyio.create_task_group() as tg:
        target = OpenAITarget(client, share.url, model=share.model, connect_retry_s=share.connect_retry_s)
        await anyio.to_thread.run_sync(barrier.wait, START_TIMEOUT_S)  # everyone ready: go together
        tg.start_soon(report)
        run = await run_load(target, share.specs, share.load, share.sampling, progress=None,
                             arrivals=share.arrivals, records=records)
        tg.cancel_scope.cancel()
    return Done(run.records, run.duration_s, run.cut_off, os.getpid())

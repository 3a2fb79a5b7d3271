"""Driving a target: open loop (Poisson or gamma arrivals at a rate, optionally capped in
concurrency) or closed loop (N users, each sending its next request when the last one ends),
optionally ramped up. Every run is bounded in requests and in time, and stops by itself."""

from __future__ import annotations

import math
import random
import sys
import time
from typing import TYPE_CHECKING, Any, TextIO

import anyio
import msgspec

from scheduler.cli.bench.targets import Record

if TYPE_CHECKING:
    from collections.abc import Callable, Coroutine

    from scheduler.cli.bench.datasets import RequestSpec
    from scheduler.cli.bench.targets import Sampling, Target

    _Send = Callable[[int], Coroutine[Any, Any, None]]


class Load(msgspec.Struct, frozen=True):
    """How requests are offered. `concurrency` set: closed loop; else open loop at `request_rate`
    (inf: all at once) with gamma inter-arrival times of shape `burstiness` (1: Poisson)."""

    request_rate: float = math.inf
    burstiness: float = 1.0
    concurrency: int | None = None
    max_concurrency: int | None = None
    ramp_up_s: float = 0.0
    max_duration_s: float = 600.0
    seed: int = 0

    @property
    def offered(self) -> float:
        """The load's size on a sweep plot's x axis: users (closed loop) or requests/s."""
        return float(self.concurrency) if self.concurrency is not None else self.request_rate

    def describe(self) -> str:
        if self.concurrency is not None:
            return f"closed loop, {self.concurrency} users"
        rate = "inf" if math.isinf(self.request_rate) else f"{self.request_rate:g}/s"
        cap = f", at most {self.max_concurrency} in flight" if self.max_concurrency else ""
        return f"open loop, {rate}, burstiness {self.burstiness:g}{cap}"


class RunResult(msgspec.Struct):
    load: Load
    records: list[Record]
    duration_s: float
    cut_off: bool


def arrival_times(
    n: int, rate: float, burstiness: float, ramp_up_s: float, rng: random.Random
) -> list[float]:
    """Seconds from the start at which each of `n` requests is sent. With a ramp-up the rate
    rises linearly from 0 to `rate` over `ramp_up_s` (a time change of a unit-rate process)."""
    if math.isinf(rate):
        return [0.0] * n
    shape = burstiness
    out, ops = [], 0.0
    for _ in range(n):
        ops += rng.gammavariate(shape, 1.0 / shape)  # mean 1: "operational" time at rate 1
        out.append(_warp(ops, rate, ramp_up_s))
    return out


def _warp(ops: float, rate: float, ramp: float) -> float:
    # Inverse of the cumulative rate L(t) = rate*t^2/(2*ramp) for t < ramp, then linear.
    if ramp <= 0:
        return ops / rate
    if ops < rate * ramp / 2:
        return math.sqrt(2 * ramp * ops / rate)
    return ramp + ops / rate - ramp / 2


async def run_load(
    target: Target,
    specs: list[RequestSpec],
    load: Load,
    sampling: Sampling,
    *,
    progress: TextIO | None = sys.stderr,
    progress_every_s: float = 1.0,
    arrivals: list[float] | None = None,
    records: list[Record] | None = None,
) -> RunResult:
    """Send `specs` as `load` says. For a share of a run spread over processes: `arrivals`, an
    open loop's send times (seconds from the start, one per spec) drawn elsewhere; `records`,
    one per spec, filled here as requests go (its caller reports progress from them)."""
    if records is None:
        records = [Record(s.prompt_tokens, s.max_tokens) for s in specs]
    start = time.perf_counter()

    async def one(i: int) -> None:
        records[i].sent_at = time.perf_counter() - start
        await target.send(specs[i], sampling, records[i])

    cut_off = True
    async with anyio.create_task_group() as outer:
        if progress is not None:
            outer.start_soon(_progress, records, start, progress, progress_every_s)
        with anyio.move_on_after(load.max_duration_s):
            if load.concurrency is not None:
                await _closed(one, len(specs), load)
            else:
                await _open(one, len(specs), load, arrivals)
            cut_off = False
        outer.cancel_scope.cancel()
    duration = time.perf_counter() - start
    for r in records:
        # A cancelled target may have marked its record done, but without an error of its own.
        if cut_off and r.sent_at >= 0 and not r.ok and not (r.done and r.error):
            r.error = f"cut off by the {load.max_duration_s:g} s limit"
            r.e2e = r.e2e if r.done else duration - r.sent_at
            r.done = True
    if progress is not None:
        _print_progress(records, start, progress, final=True)
    return RunResult(load, records, duration, cut_off)


def run_arrivals(n: int, load: Load) -> list[float]:
    """An open loop's send times for `n` requests, as `run_load` draws them."""
    return arrival_times(n, load.request_rate, load.burstiness, load.ramp_up_s, random.Random(load.seed))


async def _open(one: _Send, n: int, load: Load, arrivals: list[float] | None) -> None:
    times = run_arrivals(n, load) if arrivals is None else arrivals
    limiter = anyio.CapacityLimiter(load.max_concurrency) if load.max_concurrency else None
    t0 = anyio.current_time()

    async def limited(i: int) -> None:
        assert limiter is not None
        async with limiter:
            await one(i)

    async with anyio.create_task_group() as tg:
        for i, at in enumerate(times):
            await anyio.sleep_until(t0 + at)
            tg.start_soon(limited if limiter else one, i)


async def _closed(one: _Send, n: int, load: Load) -> None:
    assert load.concurrency is not None
    users = load.concurrency
    order = iter(range(n))

    async def user(k: int) -> None:
        await anyio.sleep(load.ramp_up_s * k / users)  # users join evenly over the ramp-up
        for i in order:  # one shared iterator: each index goes to exactly one user
            await one(i)

    async with anyio.create_task_group() as tg:
        for k in range(min(users, n)):
            tg.start_soon(user, k)


async def _progress(records: list[Record], start: float, out: TextIO, every: float) -> None:
    while True:
        await anyio.sleep(every)
        _print_progress(records, start, out)


class Counts(msgspec.Struct, tag=True):
    """A run's requests sent, done and failed, and its output tokens, so far."""

    sent: int = 0
    done: int = 0
    failed: int = 0
    tokens: int = 0

    @classmethod
    def of(cls, records: list[Record]) -> Counts:
        return cls(sent=sum(1 for r in records if r.sent_at >= 0), done=sum(1 for r in records if r.done),
                   failed=sum(1 for r in records if r.done and not r.ok),
                   tokens=sum(r.output_tokens for r in records))

    def __add__(self, other: Counts) -> Counts:
        return Counts(self.sent + other.sent, self.done + other.done, self.failed + other.failed,
                      self.tokens + other.tokens)


def print_progress(counts: Counts, total: int, elapsed: float, out: TextIO, final: bool = False) -> None:
    """One progress line: rewritten in place on a terminal, else a line each time."""
    c = counts
    line = (f"[{elapsed:7.1f}s] sent {c.sent}/{total}  done {c.done}  failed {c.failed}  "
            f"in flight {c.sent - c.done}  output {c.tokens / max(elapsed, 1e-9):8.1f} tok/s")
    out.write(("\r" + line + ("\n" if final else "")) if out.isatty() else line + "\n")
    out.flush()


def _print_progress(records: list[Record], start: float, out: TextIO, final: bool = False) -> None:
    print_progress(Counts.of(records), len(records), time.perf_counter() - start, out, final)

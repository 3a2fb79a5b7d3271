"""The demo: a few hundred concurrent requests, live progress, then a latency table."""

from __future__ import annotations

import random
import sys
import time
from typing import TYPE_CHECKING, TextIO

import anyio
import msgspec

from metrics import summarize
from scheduler.api import Scheduler
from scheduler.bench.targets import Record
from scheduler.params import SamplingParams

if TYPE_CHECKING:
    from scheduler.config import SchedulerConfig

WORDS = (
    "the scheduler batches many requests on one model while each stream keeps its own pace "
    "tokens arrive in order memory is kept in blocks and every request ends exactly once"
).split()


class DemoResult(msgspec.Struct):
    requests: int
    output_tokens: int
    wall_s: float
    tokens_per_s: float
    ttft_p50_ms: float
    ttft_p99_ms: float
    itl_p50_ms: float
    itl_p99_ms: float
    e2e_p50_s: float
    finish_reasons: dict[str, int]


def make_prompts(n: int, words: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(words // 2, words))) for _ in range(n)]


async def run_demo(
    config: SchedulerConfig,
    *,
    requests: int,
    max_tokens: int,
    prompt_words: int,
    seed: int,
    out: TextIO = sys.stdout,
) -> DemoResult:
    prompts = make_prompts(requests, prompt_words, seed)
    records = [Record(prompt_tokens=0, max_tokens=max_tokens) for _ in prompts]
    out.write(f"loading {config.model.path} ...\n")
    async with Scheduler(config) as sched:
        out.write(f"sending {requests} concurrent requests (max_tokens={max_tokens})\n")
        start = time.perf_counter()

        async def one(i: int) -> None:
            rec, t0 = records[i], time.perf_counter()
            last = t0
            params = SamplingParams(max_tokens=max_tokens, temperature=0.7, seed=seed + i, ignore_eos=True)
            async for chunk in sched.generate(prompts[i], params):
                if chunk.token_ids:
                    last = rec.arrived(len(chunk.token_ids), t0, last)
                if chunk.finish_reason is not None:
                    rec.finish_reason = chunk.finish_reason
            rec.e2e = time.perf_counter() - t0

        async def progress() -> None:
            tty = out.isatty()
            start_of_line, end_of_line = ("\r", "") if tty else ("", "\n")
            while True:
                await anyio.sleep(0.5 if tty else 2.0)
                s = sched.stats()
                elapsed = time.perf_counter() - start
                done = sum(1 for r in records if r.finish_reason)
                out.write(
                    f"{start_of_line}  {elapsed:5.1f}s  done {done:4d}/{requests}  running {s.running:3d}  "
                    f"waiting {s.waiting:4d}  tokens {s.generated_tokens:6d}  "
                    f"{s.generated_tokens / elapsed:7.1f} tok/s{end_of_line}"
                )
                out.flush()

        async with anyio.create_task_group() as tg:
            tg.start_soon(progress)
            async with anyio.create_task_group() as clients:
                for i in range(requests):
                    clients.start_soon(one, i)
            tg.cancel_scope.cancel()
        wall = time.perf_counter() - start
        out.write("\n")
    ttft = summarize([r.ttft for r in records if r.ttft is not None])
    itl = summarize([x for r in records for x in r.itl])
    reasons: dict[str, int] = {}
    for r in records:
        reasons[r.finish_reason] = reasons.get(r.finish_reason, 0) + 1
    tokens = sum(r.output_tokens for r in records)
    return DemoResult(
        requests=requests, output_tokens=tokens, wall_s=wall, tokens_per_s=tokens / wall,
        ttft_p50_ms=ttft.p50 * 1e3, ttft_p99_ms=ttft.p99 * 1e3, itl_p50_ms=itl.p50 * 1e3,
        itl_p99_ms=itl.p99 * 1e3, e2e_p50_s=summarize([r.e2e for r in records]).p50,
        finish_reasons=reasons,
    )


def format_table(result: DemoResult) -> str:
    rows = [
        ("requests", f"{result.requests}"),
        ("finish reasons", ", ".join(f"{k}={v}" for k, v in sorted(result.finish_reasons.items()))),
        ("output tokens", f"{result.output_tokens}"),
        ("wall time", f"{result.wall_s:.1f} s"),
        ("throughput", f"{result.tokens_per_s:.1f} tok/s"),
        ("TTFT p50 / p99", f"{result.ttft_p50_ms:.0f} / {result.ttft_p99_ms:.0f} ms"),
        ("ITL p50 / p99", f"{result.itl_p50_ms:.1f} / {result.itl_p99_ms:.1f} ms"),
        ("e2e p50", f"{result.e2e_p50_s:.2f} s"),
    ]
    width = max(len(k) for k, _ in rows)
    line = "-" * (width + 24)
    return "\n".join([line, *(f"{k:<{width}}  {v}" for k, v in rows), line])

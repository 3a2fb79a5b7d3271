"""The demo: a few chat answers streamed as they come, then many concurrent chats with live
progress and a latency table."""

from __future__ import annotations

import random
import sys
import time
from typing import TYPE_CHECKING, TextIO

import anyio
import msgspec

from metrics import summarize
from scheduler.api import Scheduler
from scheduler.cli.bench.targets import Record
from scheduler.params import SamplingParams

if TYPE_CHECKING:
    from collections.abc import Sequence

    from scheduler.config import SchedulerConfig

SHOWN = (
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Give me three tips for staying focused.",
)
"""Streamed one after another, visibly, before the load."""
QUESTIONS = (
    "What is the capital of {}?",
    "Write a short poem about {}.",
    "Tell me one fact about {}.",
    "Describe {} in one sentence.",
)
TOPICS = (
    "France", "Japan", "Peru", "Kenya", "the moon", "autumn", "the ocean", "coffee", "trains",
    "bees", "mountains", "libraries", "rain", "chess", "bread", "music",
)


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


def make_questions(n: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    return [rng.choice(QUESTIONS).format(rng.choice(TOPICS)) for _ in range(n)]


async def show_answers(sched: Scheduler, questions: Sequence[str], max_tokens: int, out: TextIO) -> None:
    """Stream each answer to ``out`` as its tokens arrive (greedy, so the text is reproducible)."""
    for question in questions:
        out.write(f"\n> {question}\n")
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
        async for chunk in sched.generate(sched.chat_prompt([{"role": "user", "content": question}]), params):
            out.write(chunk.text)
            out.flush()
            if chunk.finish_reason is not None:
                out.write(f"\n  [{chunk.finish_reason}, {chunk.completion_tokens} tokens]\n")


async def run_demo(
    config: SchedulerConfig,
    *,
    requests: int,
    max_tokens: int,
    seed: int,
    show: Sequence[str] = SHOWN,
    out: TextIO = sys.stdout,
) -> DemoResult:
    questions = make_questions(requests, seed)
    records = [Record(prompt_tokens=0, max_tokens=max_tokens) for _ in questions]
    out.write(f"loading {config.model.path} ...\n")
    async with Scheduler(config) as sched:
        await show_answers(sched, show, max_tokens, out)
        prompts = [sched.chat_prompt([{"role": "user", "content": q}]) for q in questions]
        out.write(f"\nsending {requests} concurrent chats (temperature 0.7, max_tokens={max_tokens})\n")
        start = time.perf_counter()

        async def one(i: int) -> None:
            rec, t0 = records[i], time.perf_counter()
            last = t0
            params = SamplingParams(max_tokens=max_tokens, temperature=0.7, seed=seed + i)
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
                line = progress_line(time.perf_counter() - start, records, s.running, s.waiting)
                out.write(f"{start_of_line}{line}{end_of_line}")
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


def progress_line(elapsed: float, records: Sequence[Record], running: int, waiting: int) -> str:
    """The burst so far: its requests done, those with a first token (until then a request's
    prompt is being prefilled, which for a whole burst can take seconds on a small CPU), and
    its own tokens (not the answers shown before it)."""
    done = sum(1 for r in records if r.finish_reason)
    first = sum(1 for r in records if r.ttft is not None)
    tokens = sum(r.output_tokens for r in records)
    return (f"  {elapsed:5.1f}s  done {done:4d}/{len(records)}  first tokens {first:4d}  "
            f"running {running:3d}  waiting {waiting:4d}  tokens {tokens:6d}  "
            f"{tokens / max(elapsed, 1e-9):7.1f} tok/s")


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

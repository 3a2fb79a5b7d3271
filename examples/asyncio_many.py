"""1,000 concurrent requests from a plain asyncio program, with latency figures and a check that
the event loop stayed responsive while the batch was full.

    python examples/asyncio_many.py                          # 1,000 requests on synthetic:tiny
    python examples/asyncio_many.py --requests 200 --max-tokens 32 --model synthetic:small
"""

from __future__ import annotations

import argparse
import asyncio
import random
import time
from collections import Counter

from scheduler import Completion, SamplingParams, Scheduler, SchedulerConfig

WORDS = "the a model token batch queue request stream tenant prompt step block cache".split()


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else float("nan")


async def loop_lag(stop: asyncio.Event, lags: list[float]) -> None:
    """How late a 1 ms ticker wakes up: the scheduler must never block the loop."""
    while not stop.is_set():
        start = time.perf_counter()
        await asyncio.sleep(0.001)
        lags.append(time.perf_counter() - start - 0.001)


async def main(requests: int, max_tokens: int, model: str) -> list[Completion]:
    config = SchedulerConfig.from_toml(
        f'[model]\npath = "{model}"\n[worker]\nmax_batch = 64\n[logging]\nlevel = "warning"\n'
    )
    rng = random.Random(0)
    prompts = [" ".join(rng.choices(WORDS, k=rng.randint(2, 12))) for _ in range(requests)]
    async with Scheduler(config) as sched:
        stop, lags = asyncio.Event(), []
        ticker = asyncio.create_task(loop_lag(stop, lags))
        start = time.perf_counter()
        async with asyncio.TaskGroup() as tg:
            tasks = [
                tg.create_task(sched.complete(p, SamplingParams(
                    max_tokens=max_tokens, temperature=0.8, seed=i, ignore_eos=True)))
                for i, p in enumerate(prompts)
            ]
        elapsed = time.perf_counter() - start
        stop.set()
        await ticker
    done = [t.result() for t in tasks]
    tokens = sum(d.completion_tokens for d in done)
    ttft = [d.timings.ttft_s for d in done if d.timings.ttft_s is not None]
    e2e = [d.timings.e2e_s for d in done]
    print(f"{len(done)} requests, {tokens} tokens in {elapsed:.2f} s: {tokens / elapsed:.0f} tokens/s")
    print(f"finish reasons: {dict(Counter(d.finish_reason for d in done))}")
    print(f"TTFT p50 {percentile(ttft, 0.5) * 1e3:.0f} ms, p99 {percentile(ttft, 0.99) * 1e3:.0f} ms; "
          f"e2e p99 {percentile(e2e, 0.99) * 1e3:.0f} ms")
    print(f"event-loop lag p99 {percentile(lags, 0.99) * 1e3:.1f} ms over {len(lags)} ticks")
    return done


if __name__ == "__main__":
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=1000)
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--model", default="synthetic:tiny")
    args = parser.parse_args()
    asyncio.run(main(args.requests, args.max_tokens, args.model))

"""Embedding in a plain trio program: a nursery of concurrent requests, one streamed to stdout,
and a trio cancel scope that aborts a request mid-generation.

    python examples/trio_program.py [--requests 32] [--model synthetic:tiny]
"""

from __future__ import annotations

import argparse

import trio

from scheduler import Completion, SamplingParams, Scheduler, SchedulerConfig


async def main(requests: int, model: str) -> dict[int, Completion]:
    config = SchedulerConfig.from_toml(f'[model]\npath = "{model}"\n[logging]\nlevel = "warning"\n')
    results: dict[int, Completion] = {}
    async with Scheduler(config) as sched:

        async def one(i: int) -> None:
            params = SamplingParams(max_tokens=16, seed=i)
            results[i] = await sched.complete(f"Request number {i} says", params)

        async with trio.open_nursery() as nursery:
            for i in range(requests):
                nursery.start_soon(one, i)
            # Meanwhile, stream one more to stdout as its tokens come (the others share its batch).
            greedy = SamplingParams(max_tokens=24, temperature=0.0)
            async for chunk in sched.generate("Once upon a time", greedy):
                print(chunk.text, end="", flush=True)
            print()

        # Cancelling the scope around `async for` aborts the request: no `finally`, no cleanup call.
        # Its batch slot and KV blocks are free again within one engine step.
        seen = 0
        endless = SamplingParams(max_tokens=2000, ignore_eos=True)
        with trio.move_on_after(0.2):
            async for chunk in sched.generate("Tell me everything", endless):
                seen += len(chunk.token_ids)

        tokens = sum(r.completion_tokens for r in results.values())
        print(f"{len(results)} requests finished with {tokens} tokens; "
              f"the aborted one got {seen} tokens before its scope was cancelled")
    return results


if __name__ == "__main__":
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--model", default="synthetic:tiny")
    args = parser.parse_args()
    trio.run(main, args.requests, args.model)

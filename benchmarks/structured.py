"""The cost of structured output: decode tok/s with and without a JSON schema, at 1 and 32
streams, side by side in one process, repeated.

Both sides generate exactly `--max-tokens` per request so their batches stay full the same
time (each level runs both once, unrecorded, first): the schema side holds a string that must be longer than the budget (`minLength`), so the
grammar mask runs at every step and the row can only end at `max_tokens`; the free side sets
`ignore_eos`. Each run submits `streams` requests at once and times them to the last token.

    python benchmarks/structured.py [--model smollm2-135m] [--streams 1 32] [--repeats 3] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from typing import Any

import anyio

from scheduler import SamplingParams, Scheduler, SchedulerConfig

SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {"title": {"type": "string", "maxLength": 40},
                   "story": {"type": "string", "minLength": 4000}},
    "required": ["title", "story"],
    "additionalProperties": False,
}


async def run(s: Scheduler, prompts: list[list[int]], params: SamplingParams) -> tuple[float, int]:
    """(seconds, completion tokens) for all prompts at once."""
    tokens = 0

    async def one(prompt: list[int]) -> None:
        nonlocal tokens
        c = await s.complete(prompt, params)
        tokens += c.completion_tokens

    t0 = time.perf_counter()
    async with anyio.create_task_group() as tg:
        for p in prompts:
            tg.start_soon(one, p)
    return time.perf_counter() - t0, tokens


async def main(args: argparse.Namespace) -> None:
    config = SchedulerConfig.from_toml(
        f'[model]\npath = "{args.model}"\n[worker]\nmax_batch = {max(args.streams)}\n')
    results: dict[str, Any] = {"model": args.model, "max_tokens": args.max_tokens, "runs": []}
    async with Scheduler(config) as s:
        free = SamplingParams(max_tokens=args.max_tokens, temperature=0.7, seed=1, ignore_eos=True)
        held = SamplingParams(max_tokens=args.max_tokens, temperature=0.7, seed=1, json_schema=SCHEMA)
        warm = s.chat_prompt([{"role": "user", "content": "Warm up."}])
        await run(s, [warm], held)  # builds the grammar tokenizer once
        print(f"{args.model}, {args.max_tokens} tokens per request; device {s.stats().blas or 'gpu'}")
        print(f"{'streams':>7} {'free tok/s':>11} {'schema tok/s':>13} {'ratio':>6} {'load':>5}")
        for streams in args.streams:
            prompts = [s.chat_prompt([{"role": "user", "content": f"Tell story number {i} as JSON."}])
                       for i in range(streams)]
            await run(s, prompts, free)  # this batch size's first steps (kernels, buffers)
            await run(s, prompts, held)
            ratios = []
            for rep in range(args.repeats):
                order = [("free", free), ("schema", held)] if rep % 2 == 0 else [("schema", held), ("free", free)]
                got = {}
                for name, params in order:
                    seconds, tokens = await run(s, prompts, params)
                    assert tokens == streams * args.max_tokens, (name, tokens)
                    got[name] = tokens / seconds
                ratios.append(got["schema"] / got["free"])
                load = os.getloadavg()[0]
                print(f"{streams:>7} {got['free']:>11.1f} {got['schema']:>13.1f} {ratios[-1]:>6.3f} {load:>5.2f}")
                results["runs"].append({"streams": streams, "free_tok_s": got["free"], "schema_tok_s": got["schema"],
                                        "ratio": ratios[-1], "load_avg_1m": load})
            print(f"{streams:>7} median ratio {statistics.median(ratios):.3f}")
    if args.json:
        await anyio.Path(args.json).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--streams", type=int, nargs="+", default=[1, 32])
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json", default=None)
    anyio.run(main, ap.parse_args())

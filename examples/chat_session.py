"""A multi-turn chat that keeps its KV between turns: `session=` on each turn, so a turn prefills
only the new message, not the whole conversation again. Then the same chat without a session.

    python examples/chat_session.py [--turns 6] [--model synthetic:tiny]
"""

from __future__ import annotations

import argparse

import anyio

from scheduler import SamplingParams, Scheduler, SchedulerConfig


async def chat(sched: Scheduler, turns: int, session: str | None) -> list[tuple[int, float, str]]:
    """(prompt tokens, time to first token, reply) per turn."""
    messages: list[dict[str, str]] = [{"role": "system", "content": "You are a terse assistant. " * 20}]
    out = []
    for turn in range(turns):
        messages.append({"role": "user", "content": f"Question {turn}: what comes next? " * 8})
        prompt = sched.chat_prompt(messages)
        done = await sched.complete(prompt, SamplingParams(max_tokens=24, temperature=0.0), session=session)
        assert done.timings.ttft_s is not None
        out.append((len(prompt), done.timings.ttft_s, done.text))
        messages.append({"role": "assistant", "content": done.text})
    return out


async def main(turns: int, model: str) -> None:
    config = SchedulerConfig.from_toml(
        f'[model]\npath = "{model}"\n[kvpool]\nblock_tokens = 32\nprefix_cache = false\n'
        '[logging]\nlevel = "warning"\n'
    )
    async with Scheduler(config) as sched:
        kept = await chat(sched, turns, session="chat-1")
        hits = sched.stats().session_hits
        print(f"session kept, dropped: {await sched.drop_session('chat-1')}")
        cold = await chat(sched, turns, session=None)
    print("turn  prompt tokens  ttft with session  ttft without  same reply")
    for k, ((n, ttft, text), (_, ttft0, text0)) in enumerate(zip(kept, cold, strict=True)):
        print(f"{k:>4}  {n:>13}  {ttft * 1000:>14.1f} ms  {ttft0 * 1000:>9.1f} ms  {text == text0}")
    print(f"session hits: {hits} of {turns - 1} follow-up turns")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--turns", type=int, default=6)
    parser.add_argument("--model", default="synthetic:tiny")
    args = parser.parse_args()
    anyio.run(main, args.turns, args.model)

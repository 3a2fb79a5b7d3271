"""End to end on the real mlx-lm BatchGenerator with the synthetic:tiny model."""

from __future__ import annotations

import os
import random
import subprocess
import sys
from pathlib import Path

import anyio
import pytest

from scheduler import SamplingParams, Scheduler, SchedulerConfig
from scheduler.errors import InvalidRequest, QueueFull
from tests.test_actors import wait_idle

pytestmark = [pytest.mark.anyio, pytest.mark.integration]


def tiny(cache: Path, **worker: int) -> SchedulerConfig:
    lines = [f'[model]\npath = "synthetic:tiny"\ncache_dir = "{cache}"', "[worker]"]
    lines += [f"{k} = {v}" for k, v in worker.items()]
    return SchedulerConfig.from_toml("\n".join(lines))


def prompts(n: int, seed: int, vocab: int = 200) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(rng.randint(4, 60))] for _ in range(n)]


async def test_32_concurrent_requests_complete_with_correct_counts(model_cache: Path) -> None:
    with anyio.fail_after(120):
        async with Scheduler(tiny(model_cache, max_batch=16)) as s:
            results = {}

            async def one(i: int, prompt: list[int]) -> None:
                params = SamplingParams(max_tokens=4 + i % 13, temperature=0.8, seed=i, ignore_eos=True)
                results[i] = await s.complete(prompt, params)

            async with anyio.create_task_group() as tg:
                for i, p in enumerate(prompts(32, seed=1)):
                    tg.start_soon(one, i, p)
            assert len(results) == 32
            for i, done in results.items():
                assert done.finish_reason == "length"
                assert done.completion_tokens == len(done.token_ids) == 4 + i % 13
            await wait_idle(s)
            assert s.stats().blocks_free == s.stats().blocks_total


def reference_tokens(cache: Path, prompt: list[int], max_tokens: int) -> list[int]:
    """What mlx_lm.stream_generate gives (greedy), on this thread."""
    import mlx.core as mx
    from mlx_lm import stream_generate

    from workers.loading.models import load_model

    model, tokenizer = load_model("synthetic:tiny", cache)
    out = [r.token for r in stream_generate(model, tokenizer, mx.array(prompt), max_tokens=max_tokens)]
    del model
    return out


async def test_greedy_alone_equals_in_a_batch_equals_mlx_lm(model_cache: Path) -> None:
    target = prompts(1, seed=7)[0]
    others = prompts(31, seed=8)
    greedy = SamplingParams(max_tokens=24, temperature=0.0)
    with anyio.fail_after(180):
        async with Scheduler(tiny(model_cache, max_batch=32)) as s:
            alone = await s.complete(target, greedy)
            batch: dict[int, list[int]] = {}

            async def one(i: int, p: list[int]) -> None:
                params = SamplingParams(max_tokens=40 + i, temperature=0.0)
                batch[i] = (await s.complete(p, params)).token_ids

            async with anyio.create_task_group() as tg:
                for i, p in enumerate(others):
                    tg.start_soon(one, i, p)
                while s.stats().steps < 3:  # join a batch that is already decoding
                    await anyio.sleep(0.001)
                inside = await s.complete(target, greedy)
    reference = await anyio.to_thread.run_sync(reference_tokens, model_cache, target, 24)
    assert alone.token_ids == inside.token_ids == reference
    assert len(reference) > 0


async def test_seed_reproduces_sampling_whatever_the_batch(model_cache: Path) -> None:
    prompt = prompts(1, seed=3)[0]
    seeded = SamplingParams(max_tokens=16, temperature=1.0, seed=1234, ignore_eos=True)
    with anyio.fail_after(120):
        async with Scheduler(tiny(model_cache)) as s:
            first = await s.complete(prompt, seeded)
            results = {}

            async def one(i: int, p: list[int]) -> None:
                results[i] = await s.complete(p, SamplingParams(max_tokens=20, temperature=0.9))

            async with anyio.create_task_group() as tg:
                for i, p in enumerate(prompts(8, seed=4)):
                    tg.start_soon(one, i, p)
                second = await s.complete(prompt, seeded)
            other_seed = await s.complete(prompt, SamplingParams(max_tokens=16, seed=99, ignore_eos=True))
    assert first.token_ids == second.token_ids
    assert other_seed.token_ids != first.token_ids


async def test_abort_mid_stream_frees_slot_and_blocks_within_one_step(model_cache: Path) -> None:
    with anyio.fail_after(60):
        async with Scheduler(tiny(model_cache)) as s:
            seen = 0
            async for chunk in s.generate(prompts(1, 5)[0], SamplingParams(max_tokens=500, ignore_eos=True)):
                seen += len(chunk.token_ids)
                if seen >= 3:
                    steps = s.stats().steps
                    assert s.stats().blocks_used > 0 and s.stats().engine_batch == 1
                    break
            await wait_idle(s)
            assert s.stats().steps - steps <= 2


async def test_timeout_ends_a_running_request(model_cache: Path) -> None:
    with anyio.fail_after(60):
        async with Scheduler(tiny(model_cache)) as s:
            done = await s.complete([5, 6, 7], SamplingParams(max_tokens=2000, ignore_eos=True), timeout=0.3)
            assert done.finish_reason == "timeout"
            assert 0 < done.completion_tokens < 2000
            assert done.timings.e2e_s >= 0.3
            await wait_idle(s)


async def test_stop_string_cuts_the_text(model_cache: Path) -> None:
    prompt = prompts(1, seed=11)[0]
    greedy = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    with anyio.fail_after(60):
        async with Scheduler(tiny(model_cache)) as s:
            full = await s.complete(prompt, greedy)
            stop = full.text[len(full.text) // 2 : len(full.text) // 2 + 3]
            assert len(stop) == 3
            cut = await s.complete(prompt, SamplingParams(
                max_tokens=40, temperature=0.0, ignore_eos=True, stop=(stop,)))
            await wait_idle(s)
    assert cut.finish_reason == "stop"
    assert cut.text == full.text[: full.text.find(stop)]


async def test_queue_full_and_bad_input_while_serving_others(model_cache: Path) -> None:
    cfg = SchedulerConfig.from_toml(
        f'[model]\npath = "synthetic:tiny"\ncache_dir = "{model_cache}"\n'
        "[worker]\nmax_batch = 2\n[scheduler]\nmax_queue = 2\n"
    )
    bad = [
        ("", SamplingParams(max_tokens=4), "prompt is empty"),
        ([1] * 5000, SamplingParams(max_tokens=4), "longer than the model's context"),
        ([1, -1], SamplingParams(max_tokens=4), "is not a token id"),
    ]
    with anyio.fail_after(120):
        async with Scheduler(cfg) as s:
            outcomes: list[str] = []

            async def one(p: list[int]) -> None:
                params = SamplingParams(max_tokens=300, temperature=0.0, ignore_eos=True)
                outcomes.append((await s.complete(p, params)).finish_reason)

            async with anyio.create_task_group() as tg:
                for p in prompts(4, seed=12):
                    tg.start_soon(one, p)
                while s.stats().waiting < 2:
                    await anyio.sleep(0.002)
                with pytest.raises(QueueFull):
                    await s.complete([1, 2, 3], SamplingParams(max_tokens=4))
                for prompt, params, message in bad:
                    with pytest.raises(InvalidRequest, match=message):
                        await s.complete(prompt, params)
            assert outcomes == ["length"] * 4
            text = await s.complete("Hello there", SamplingParams(max_tokens=5, temperature=0.0))
            assert text.prompt_tokens > 0 and text.finish_reason in ("length", "stop")
            await wait_idle(s)


async def test_chat_prompt_uses_the_template(model_cache: Path) -> None:
    with anyio.fail_after(60):
        async with Scheduler(tiny(model_cache)) as s:
            ids = s.chat_prompt([{"role": "user", "content": "hi"}])
            text = s.model.codec.tokenizer.decode(ids)
            assert "<|im_start|>user" in text and text.endswith("<|im_start|>assistant\n")
            done = await s.complete(ids, SamplingParams(max_tokens=4, temperature=0.0))
            assert done.prompt_tokens == len(ids)
            with pytest.raises(InvalidRequest, match="messages"):
                s.chat_prompt([{"role": "user"}])


async def test_ready_by_gathers_until_its_deadline_or_the_end_and_loses_nothing(model_cache: Path) -> None:
    prompt = prompts(1, seed=21)[0]
    greedy = SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True)
    with anyio.fail_after(60):
        async with Scheduler(tiny(model_cache)) as s:
            whole = await s.complete(prompt, greedy)
            tokens: list[int] = []
            batches: list[int] = []
            async with s.generate(prompt, greedy) as stream:
                async for chunk in stream:
                    if not tokens:  # a deadline already past: what is there, no wait, no cancel
                        more = await stream.ready_by(anyio.current_time() - 1)
                    else:  # a far deadline: the final chunk ends the wait, not the deadline
                        started = anyio.current_time()
                        more = await stream.ready_by(started + 30)
                        assert anyio.current_time() - started < 10
                        assert more and more[-1].finish_reason == "length"
                    batch = [chunk, *more]
                    batches.append(len(batch))
                    tokens += [t for c in batch for t in c.token_ids]
            assert tokens == whole.token_ids  # every token once, in order
            assert len(batches) == 2 and stream.request_id is not None
            await wait_idle(s)
            assert s.stats().running == 0 and s.stats().blocks_free == s.stats().blocks_total


# A caller that fails inside `async for` over a stream it named: the traceback keeps the
# stream alive until the interpreter shuts down.
FAILS_MID_STREAM = """
import sys
import anyio
from scheduler import SamplingParams, Scheduler, SchedulerConfig

async def main() -> None:
    config = SchedulerConfig.from_toml(f'[model]\\npath = "synthetic:tiny"\\ncache_dir = "{sys.argv[1]}"')
    async with Scheduler(config) as s:
        stream = s.generate([1, 2, 3], SamplingParams(max_tokens=64))
        async for _ in stream:
            raise RuntimeError("the caller fails mid-stream")

anyio.run(main)
"""


def test_a_caller_failing_mid_stream_sees_its_own_error_alone(model_cache: Path) -> None:
    root = Path(__file__).resolve().parent.parent
    done = subprocess.run([sys.executable, "-P", "-c", FAILS_MID_STREAM, str(model_cache)], cwd=root,
                          env={**os.environ, "PYTHONPATH": str(root / "src")}, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 1
    assert "RuntimeError: the caller fails mid-stream" in done.stderr
    # The stream, dropped as the interpreter shuts down, adds no traceback of its own.
    assert "Exception ignored" not in done.stderr
    assert done.stderr.count("Traceback (most recent call last)") == 1

"""`ChildScheduler`: a replica's scheduler in a child process (`[cluster] scheduler_process`), on
the real engine (synthetic:tiny), without Ray: the same tokens as in process, refusals by name,
cancels that free the row, and a child that dies or closes ends every stream. `test_cluster.py`
runs it inside real Ray Serve replicas."""

from __future__ import annotations

import asyncio
import os
import signal
from typing import TYPE_CHECKING

import pytest

from scheduler.api import Scheduler
from scheduler.config import SchedulerConfig
from scheduler.errors import InvalidRequest, ModelLoadError, QueueFull, SchedulerClosed
from scheduler.params import SamplingParams
from scheduler.request import Request
from scheduler.serving.cluster import REPLICA_FAILED
from scheduler.serving.cluster.remote import ChildScheduler

if TYPE_CHECKING:
    from pathlib import Path

    from scheduler.types import Chunk

pytestmark = [pytest.mark.integration, pytest.mark.anyio, pytest.mark.parametrize("anyio_backend", ["asyncio"])]


def _config(model_cache: Path, max_queue: int = 64) -> SchedulerConfig:
    return SchedulerConfig.from_toml(f"""
[model]
path = "synthetic:tiny"
cache_dir = "{model_cache}"
[kvpool]
memory = "64MiB"
block_tokens = 16
[worker]
max_batch = 4
[scheduler]
max_queue = {max_queue}
[logging]
level = "warning"
""")


def _greedy(prompt: list[int], max_tokens: int = 12, n: int = 1) -> Request:
    return Request(prompt=prompt, params=SamplingParams(max_tokens=max_tokens, temperature=0.0, n=n))


async def _run(sched: Scheduler | ChildScheduler, request: Request) -> list[Chunk]:
    async with sched.submit(request) as stream:
        return [chunk async for chunk in stream]


def _tokens(chunks: list[Chunk], index: int = 0) -> list[int]:
    return [t for c in chunks if c.index == index for t in c.token_ids]


async def test_the_same_tokens_as_in_process_for_requests_at_once(model_cache: Path) -> None:
    prompts = [[1, 2, 3, 4 + i] for i in range(6)]
    async with Scheduler(_config(model_cache)) as sched:
        here = [_tokens(await _run(sched, _greedy(p))) for p in prompts]
        two_here = await _run(sched, _greedy(prompts[0], n=2))
    async with ChildScheduler(_config(model_cache)) as child:
        assert child.pid is not None and child.pid != os.getpid()
        assert child.model.info.name == "synthetic:tiny"
        runs = await asyncio.gather(*[_run(child, _greedy(p)) for p in prompts])
        two = await _run(child, _greedy(prompts[0], n=2))
        stats = await child.fetch_stats()
    assert [_tokens(r) for r in runs] == here  # six at once there, one at a time here: greedy either way
    assert all(len(t) == 12 for t in here)
    assert all(r[-1].finish_reason == "length" for r in runs)
    # Both choices, each with its own final chunk.
    assert sorted(c.index for c in two if c.finish_reason) == [0, 1]
    assert [_tokens(two, i) for i in (0, 1)] == [_tokens(two_here, i) for i in (0, 1)]
    assert stats.finished == 8 and stats.running == 0  # each choice counts
    assert stats.generated_tokens == 6 * 12 + 2 * 12


async def test_refusals_come_by_name_and_the_rest_are_served(model_cache: Path) -> None:
    async with ChildScheduler(_config(model_cache, max_queue=1)) as child:
        with pytest.raises(InvalidRequest, match="exceeds the model's context"):
            await _run(child, _greedy([1, 2, 3], max_tokens=10**7))
        with pytest.raises(InvalidRequest, match="not a token id"):
            await _run(child, _greedy([10**9]))
        # Four rows run, one waits; the rest of a burst of 12 find the queue full.
        results = await asyncio.gather(*[_run(child, _greedy([5, 6, i + 1], max_tokens=24)) for i in range(12)],
                                       return_exceptions=True)
        full = [r for r in results if isinstance(r, QueueFull)]
        served = [r for r in results if isinstance(r, list)]
        assert full and served and len(full) + len(served) == 12
        assert all(len(_tokens(r)) == 24 for r in served)
        after = await _run(child, _greedy([7, 8, 9]))  # and it still serves
        assert len(_tokens(after)) == 12
        stats = await child.fetch_stats()
    assert stats.running == 0 and stats.blocks_used == 0


async def test_a_stream_left_mid_way_frees_its_row(model_cache: Path) -> None:
    async with ChildScheduler(_config(model_cache)) as child:
        stream = child.submit(_greedy([1, 2, 3], max_tokens=2000))
        async with stream:
            async for _ in stream:
                break
        for _ in range(100):
            stats = await child.fetch_stats()
            if stats.running == 0:
                break
            await asyncio.sleep(0.02)
        assert stats.running == 0 and stats.blocks_used == 0
        assert stats.generated_tokens < 2000


async def test_a_child_that_dies_ends_every_stream_and_says_why(model_cache: Path) -> None:
    async with ChildScheduler(_config(model_cache)) as child:
        stream = child.submit(_greedy([1, 2, 3], max_tokens=2000))
        got: list[Chunk] = []
        async with stream:
            async for chunk in stream:
                if not got:
                    assert child.pid is not None
                    os.kill(child.pid, signal.SIGKILL)
                got.append(chunk)
        assert got[-1].finish_reason == "error"
        assert got[-1].request_id == REPLICA_FAILED  # what a frontend shows as its replica failing
        assert "scheduler process exited (code -9)" in (got[-1].error or "")
        assert "exited" in child.failure
        with pytest.raises(SchedulerClosed, match="scheduler process exited"):
            await _run(child, _greedy([1, 2]))


async def test_closing_ends_running_streams_and_the_child_exits(model_cache: Path) -> None:
    child = ChildScheduler(_config(model_cache))
    await child.__aenter__()
    stream = child.submit(_greedy([1, 2, 3], max_tokens=2000))
    first = await stream.__anext__()
    await child.__aexit__(None, None, None)
    rest = [first] + [chunk async for chunk in stream]
    assert rest[-1].finish_reason == "cancelled"  # as in process: the close cancels what runs
    assert len(_tokens(rest)) < 2000
    assert child._proc is not None and child._proc.returncode == 0  # noqa: SLF001
    with pytest.raises(SchedulerClosed):
        child.submit(_greedy([1]))


async def test_a_model_it_cannot_load_is_named(tmp_path: Path) -> None:
    config = SchedulerConfig.from_toml(f'[model]\npath = "{tmp_path / "nothing-here"}"\n')
    with pytest.raises(ModelLoadError, match="nothing-here"):
        async with ChildScheduler(config):
            pass


"""Reliability on the real engine (synthetic:tiny): faults, shutdown, overload, cancellation storms,
isolation. Every submitted request must end exactly once and every block must come back."""

from __future__ import annotations

import random
import resource
import threading
from typing import TYPE_CHECKING

import anyio
import pytest

from scheduler import SamplingParams, Scheduler, SchedulerConfig
from scheduler.api import real_engine_factory
from scheduler.errors import ModelLoadError, QueueFull, SchedulerClosed
from tests.faults import FaultPlan, InjectedFault, with_faults
from tests.test_actors import wait_idle
from tests.test_integration import prompts

if TYPE_CHECKING:
    from pathlib import Path

pytestmark = [pytest.mark.anyio, pytest.mark.integration]


def cfg(cache: Path, extra: str = "") -> SchedulerConfig:
    return SchedulerConfig.from_toml(f'[model]\npath = "synthetic:tiny"\ncache_dir = "{cache}"\n{extra}')


def faulty(config: SchedulerConfig, plan: FaultPlan) -> Scheduler:
    """The real engine, with the plan's faults injected through `engine_factory=`."""
    return Scheduler(config, engine_factory=with_faults(real_engine_factory(config), plan))


def full_length(n: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)


async def test_failed_step_ends_in_flight_with_error_then_a_fresh_engine_serves_the_queue(
    model_cache: Path,
) -> None:
    plan = FaultPlan(fail_at_steps=(5,))
    with anyio.fail_after(60):
        async with faulty(cfg(model_cache, "[worker]\nmax_batch = 2"), plan) as s:
            results = {}

            async def one(i: int, p: list[int]) -> None:
                results[i] = await s.complete(p, full_length(12))

            async with anyio.create_task_group() as tg:
                for i, p in enumerate(prompts(6, seed=21)):
                    tg.start_soon(one, i, p)
            reasons = sorted(r.finish_reason for r in results.values())
            assert reasons == ["error", "error", "length", "length", "length", "length"]
            errors = [r for r in results.values() if r.finish_reason == "error"]
            assert all("injected failure at step 5" in (r.error or "") for r in errors)
            await wait_idle(s)
            after = await s.complete([4, 5, 6], full_length(3))
            assert after.finish_reason == "length"
            await wait_idle(s)
            assert s.stats().blocks_free == s.stats().blocks_total


async def test_failed_step_with_close_policy_closes_cleanly(model_cache: Path) -> None:
    plan = FaultPlan(fail_at_steps=(3,))
    config = cfg(model_cache, '[worker]\non_failure = "close"')
    with anyio.fail_after(60):
        async with faulty(config, plan) as s:
            outcomes = []

            async def one(p: list[int]) -> None:
                outcomes.append(await s.complete(p, full_length(30)))

            async with anyio.create_task_group() as tg:
                for p in prompts(3, seed=22):
                    tg.start_soon(one, p)
            assert [o.finish_reason for o in outcomes] == ["error"] * 3
            with pytest.raises(SchedulerClosed, match="worker failed"):
                await s.complete([1, 2], full_length(2))
    assert not any(t.name == "mlx-worker" for t in threading.enumerate())


async def test_a_stalled_step_does_not_stall_the_event_loop_or_deadlines(model_cache: Path) -> None:
    plan = FaultPlan(stall_at_steps=(4,), stall_s=1.0)
    with anyio.fail_after(60):
        async with faulty(cfg(model_cache), plan) as s:
            lags: list[float] = []

            async def ticker() -> None:
                while True:
                    t = anyio.current_time()
                    await anyio.sleep(0.01)
                    lags.append(anyio.current_time() - t - 0.01)

            async with anyio.create_task_group() as tg:
                tg.start_soon(ticker)
                t0 = anyio.current_time()
                done = await s.complete([7, 8, 9], full_length(50), timeout=0.4)
                elapsed = anyio.current_time() - t0
                tg.cancel_scope.cancel()
            assert done.finish_reason == "timeout"
            assert elapsed < 0.9  # delivered at its deadline, inside the 1 s stall
            assert max(lags) < 0.25
            await wait_idle(s)


async def test_model_load_failure_surfaces_from_start_with_its_cause(model_cache: Path) -> None:
    with anyio.fail_after(30), pytest.raises(ModelLoadError, match="injected model-load failure") as info:
        async with faulty(cfg(model_cache), FaultPlan(fail_load=True)):
            pass
    assert isinstance(info.value.__cause__, InjectedFault)


@pytest.mark.parametrize("mode", ["drain", "abort"])
async def test_shutdown_drains_or_aborts_and_everyone_gets_an_outcome(model_cache: Path, mode: str) -> None:
    config = cfg(model_cache, f'[worker]\nmax_batch = 2\n[scheduler]\nshutdown = "{mode}"')
    outcomes: list[str] = []
    with anyio.fail_after(60):
        async with anyio.create_task_group() as tg:
            async with Scheduler(config) as s:

                async def one(p: list[int]) -> None:
                    outcomes.append((await s.complete(p, full_length(40))).finish_reason)

                for p in prompts(5, seed=23):
                    tg.start_soon(one, p)
                while s.stats().running < 2 or s.stats().waiting < 3:
                    await anyio.sleep(0.002)
    expected = ["length"] * 2 if mode == "drain" else ["cancelled"] * 2
    assert sorted(outcomes) == sorted(expected + ["cancelled"] * 3)
    assert not any(t.name == "mlx-worker" for t in threading.enumerate())


async def test_drain_timeout_cancels_what_has_not_finished(model_cache: Path) -> None:
    config = cfg(model_cache, '[scheduler]\nshutdown = "drain"\ndrain_timeout_s = 0.2')
    outcomes: list[str] = []
    with anyio.fail_after(60):
        async with anyio.create_task_group() as tg:
            async with Scheduler(config) as s:

                async def one() -> None:
                    outcomes.append((await s.complete([3, 4], full_length(1900))).finish_reason)

                tg.start_soon(one)
                while s.stats().running < 1:
                    await anyio.sleep(0.002)
                t0 = anyio.current_time()
            assert anyio.current_time() - t0 < 5
    assert outcomes == ["cancelled"]


async def test_overload_rejects_at_once_bounds_memory_and_completes_admitted_work(
    model_cache: Path,
) -> None:
    config = cfg(model_cache, "[worker]\nmax_batch = 4\n[scheduler]\nmax_queue = 16")
    rss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    accepted: list[str] = []
    rejected = 0
    with anyio.fail_after(120):
        async with Scheduler(config) as s:

            async def one(p: list[int]) -> None:
                nonlocal rejected
                try:
                    accepted.append((await s.complete(p, full_length(8))).finish_reason)
                except QueueFull:
                    rejected += 1

            async def watch() -> None:
                while True:
                    st = s.stats()
                    assert st.waiting <= 16 and st.running <= 4 and st.blocks_used <= st.blocks_total
                    await anyio.sleep(0.001)

            async with anyio.create_task_group() as tg:
                tg.start_soon(watch)
                async with anyio.create_task_group() as clients:
                    for p in prompts(400, seed=24):  # 20x what fits in the batch and the queue
                        clients.start_soon(one, p)
                tg.cancel_scope.cancel()
            assert rejected > 0 and accepted == ["length"] * (400 - rejected)
            assert s.stats().rejected == rejected and s.stats().finished == 400 - rejected
            await wait_idle(s)
    growth_mb = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss_before) / 1024
    assert growth_mb < 200


async def test_cancellation_storm_leaves_nothing_behind(model_cache: Path) -> None:
    rng = random.Random(25)
    config = cfg(model_cache, "[worker]\nmax_batch = 32\nprefill_batch = 8")
    ends: dict[int, int] = {}
    reasons: dict[str, int] = {}
    submitted = 0
    with anyio.fail_after(240):
        async with Scheduler(config) as s:

            async def one(i: int, p: list[int]) -> None:
                nonlocal submitted
                kind = rng.choice(["finish", "break", "cancel", "timeout"])
                params = SamplingParams(max_tokens=rng.randint(1, 24), temperature=0.0)
                timeout = rng.uniform(0.001, 0.3) if kind == "timeout" else None
                after = rng.randint(0, 6)
                with anyio.CancelScope() as scope:
                    if kind == "cancel":  # before admission, during prefill, or mid-decode
                        scope.deadline = anyio.current_time() + rng.uniform(0, 0.2)
                    async with s.generate(p, params, timeout=timeout) as stream:
                        seen = 0
                        submitted += 1
                        async for chunk in stream:
                            seen += 1
                            if chunk.finish_reason is not None:
                                ends[i] = ends.get(i, 0) + 1
                                reasons[chunk.finish_reason] = reasons.get(chunk.finish_reason, 0) + 1
                            if kind == "break" and seen > after:
                                break

            async with anyio.create_task_group() as tg:
                for i, p in enumerate(prompts(2000, seed=26)):
                    tg.start_soon(one, i, p)
                    if i % 50 == 0:
                        await anyio.sleep(0.005)
            await wait_idle(s)
            st = s.stats()
            assert all(n == 1 for n in ends.values())
            assert reasons.get("timeout", 0) > 50 and reasons.get("length", 0) > 200
            assert submitted == 2000
            assert st.finished == 2000 - st.rejected  # every accepted request ended exactly once
            assert (st.running, st.waiting, st.engine_batch, st.blocks_used) == (0, 0, 0, 0)
            assert st.blocks_free == st.blocks_total


async def test_64_concurrent_greedy_prompts_match_each_run_alone(model_cache: Path) -> None:
    ps = prompts(64, seed=27)
    params = SamplingParams(max_tokens=12, temperature=0.0)
    with anyio.fail_after(180):
        async with Scheduler(cfg(model_cache, "[worker]\nmax_batch = 64")) as s:
            alone = [(await s.complete(p, params)).token_ids for p in ps]
            together: dict[int, list[int]] = {}

            async def one(i: int) -> None:
                together[i] = (await s.complete(ps[i], params)).token_ids

            async with anyio.create_task_group() as tg:
                for i in range(64):
                    tg.start_soon(one, i)
    assert [together[i] for i in range(64)] == alone
    assert len({tuple(t) for t in alone}) > 32  # distinct prompts, distinct outputs

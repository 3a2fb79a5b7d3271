"""Each policy's effect end to end: the real BatchGenerator on synthetic:tiny, a saturated batch.

Every test fills the one batch slot with a long "blocker" request, queues requests one by one,
then ends the blocker: with `max_batch = 1` the queue drains one request at a time, so the order
in which requests complete is the order in which the policy admitted them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import anyio
import pytest

from scheduler import SamplingParams, Scheduler, SchedulerConfig
from scheduler.errors import ConfigError

if TYPE_CHECKING:
    from pathlib import Path

    from scheduler.types import Completion

pytestmark = [pytest.mark.anyio, pytest.mark.integration]

PROMPT = [11, 12, 13, 14, 15, 16, 17, 18]  # one length for all: sjf and fair compare like with like
Request = tuple[str, dict[str, object]]  # a name, and generate()'s keyword arguments


def config(cache: Path, policy: str, options: str = "") -> SchedulerConfig:
    return SchedulerConfig.from_toml(
        f'[model]\npath = "synthetic:tiny"\ncache_dir = "{cache}"\n[worker]\nmax_batch = 1\n'
        f'[scheduler]\npolicy = "{policy}"\n{options}'
    )


async def drain_order(
    s: Scheduler, requests: list[Request], *, blocker: dict[str, object] | None = None,
    before_release: float = 0.0,
) -> tuple[list[str], dict[str, Completion]]:
    """Queue `requests` in order behind a blocker, release it, and return the completion order
    (requests that ended without running are left out of it)."""
    order: list[str] = []
    done: dict[str, Completion] = {}
    release = anyio.Event()

    async def block() -> None:
        params = SamplingParams(max_tokens=1900, temperature=0.0, ignore_eos=True)
        async for _ in s.generate([3, 4, 5], params, **(blocker or {})):  # type: ignore[arg-type]
            if release.is_set():
                break  # leaving the stream aborts it and frees the slot

    async def one(name: str, kwargs: dict[str, object]) -> None:
        params = SamplingParams(max_tokens=int(kwargs.pop("max_tokens", 8)), temperature=0.0, ignore_eos=True)
        done[name] = await s.complete(PROMPT, params, **kwargs)  # type: ignore[arg-type]
        if done[name].completion_tokens:
            order.append(name)

    async with anyio.create_task_group() as tg:
        tg.start_soon(block)
        while s.stats().running < 1:
            await anyio.sleep(0.002)
        for i, (name, kwargs) in enumerate(requests):
            tg.start_soon(one, name, dict(kwargs))
            while s.stats().waiting + len(done) < i + 1:  # queued, in this order
                await anyio.sleep(0.002)
        await anyio.sleep(before_release)
        assert s.stats().running == 1  # the blocker still holds the batch
        release.set()
    return order, done


@pytest.mark.parametrize(("policy", "expected"), [
    ("fcfs", ["low1", "low2", "low3", "high"]),
    ("priority", ["high", "low1", "low2", "low3"]),
])
async def test_a_late_high_priority_request_is_admitted_before_earlier_low_ones(
    model_cache: Path, policy: str, expected: list[str]
) -> None:
    requests: list[Request] = [(f"low{i}", {"priority": 5}) for i in (1, 2, 3)]
    requests.append(("high", {"priority": 0}))
    with anyio.fail_after(60):
        async with Scheduler(config(model_cache, policy)) as s:
            order, _ = await drain_order(s, requests, blocker={"priority": 5})
    assert order == expected


@pytest.mark.parametrize("policy", ["fcfs", "fair"])
async def test_a_flooding_tenant_starves_a_light_one_under_fcfs_but_not_under_fair(
    model_cache: Path, policy: str
) -> None:
    requests: list[Request] = [(f"heavy{i}", {"tenant": "heavy"}) for i in range(8)]
    requests += [(f"light{i}", {"tenant": "light"}) for i in range(2)]
    with anyio.fail_after(60):
        async with Scheduler(config(model_cache, policy)) as s:
            order, _ = await drain_order(s, requests, blocker={"tenant": "heavy"})
    light = [i for i, name in enumerate(order) if name.startswith("light")]
    assert len(order) == 10
    if policy == "fcfs":
        assert light == [8, 9]  # behind the whole flood
    else:
        assert max(light) <= 3  # served in turn with the flood


@pytest.mark.parametrize(("policy", "options", "expected"), [
    ("fcfs", "", ["long1", "short1", "long2", "short2", "long3", "short3"]),
    ("sjf", "", ["short1", "short2", "short3", "long1", "long2", "long3"]),
    ("sjf", "[scheduler.sjf]\nmax_wait_s = 0.05", ["long1", "short1", "long2", "short2", "long3", "short3"]),
], ids=["fcfs", "sjf", "sjf-aged"])
async def test_sjf_runs_short_requests_first_until_long_ones_have_waited_max_wait(
    model_cache: Path, policy: str, options: str, expected: list[str]
) -> None:
    requests: list[Request] = []
    for i in (1, 2, 3):
        requests += [(f"long{i}", {"max_tokens": 40}), (f"short{i}", {"max_tokens": 2})]
    with anyio.fail_after(60):
        async with Scheduler(config(model_cache, policy, options)) as s:
            # Holding the queue 0.1 s: with max_wait_s = 0.05 everything has aged (arrival order).
            order, done = await drain_order(s, requests, before_release=0.1)
    assert order == expected
    assert all(done[n].completion_tokens == (40 if n.startswith("long") else 2) for n in order)


@pytest.mark.parametrize(("policy", "expected"), [
    ("fcfs", ["due60", "due20", "none"]),
    ("edf", ["due20", "due60", "none"]),
])
async def test_edf_serves_the_earliest_deadline_and_times_out_a_late_request_unrun(
    model_cache: Path, policy: str, expected: list[str]
) -> None:
    requests: list[Request] = [
        ("due60", {"timeout": 60.0}), ("due20", {"timeout": 20.0}), ("none", {}), ("late", {"timeout": 0.3}),
    ]
    with anyio.fail_after(60):
        async with Scheduler(config(model_cache, policy)) as s:
            order, done = await drain_order(s, requests, before_release=0.5)
            late = done["late"]
            assert s.stats().waiting == 0
    assert order == expected
    assert late.finish_reason == "timeout" and late.completion_tokens == 0 and late.token_ids == []
    assert late.timings.ttft_s is None and late.timings.queue_s >= 0.29


async def test_a_custom_policy_by_dotted_path_with_its_options(model_cache: Path) -> None:
    options = '[scheduler.custom]\nvip = ["alice"]'
    requests: list[Request] = [("bob1", {"tenant": "bob"}), ("bob2", {"tenant": "bob"}), ("alice", {"tenant": "alice"})]
    with anyio.fail_after(60):
        async with Scheduler(config(model_cache, "examples.my_policy:VipFirst", options)) as s:
            order, _ = await drain_order(s, requests, blocker={"tenant": "bob"})
    assert order == ["alice", "bob1", "bob2"]


async def test_a_custom_policy_that_is_not_one_fails_the_start(model_cache: Path) -> None:
    with anyio.fail_after(30):
        with pytest.raises(ConfigError, match="scheduler.policy: .*does not implement the Policy protocol"):
            async with Scheduler(config(model_cache, "collections:OrderedDict")):
                pass

"""The admission actor's memory logic on a fake engine: on-demand growth, the policy's victim,
reserve mode's waiting, the budget less the weights, bad session arguments."""

from __future__ import annotations

import anyio
import msgspec
import pytest
from structlog.testing import capture_logs

from scheduler import SamplingParams, Scheduler
from scheduler.errors import ConfigError, InvalidRequest
from tests.fakes import FakeEngine, fake_factory, fake_info
from tests.test_actors import config, expected, wait_idle
from workers.factory import Loaded

pytestmark = pytest.mark.anyio

# The fake model: 32 bytes a token; 16-token blocks of 512 bytes; 4096 bytes = 8 blocks. Each
# request grows to 10 + 40 = 50 tokens (4 blocks): three at once need 12.
POOL = {"block_tokens": 16, "memory": 4096, "watermark": 0.0}
PARAMS = SamplingParams(max_tokens=40)


async def run_three(mode: str, engine: FakeEngine) -> tuple[list[list[int]], int, set[str]]:
    """Three requests at once (the second of priority 5); their outputs, the preemptions and
    the tenants of the preempted."""
    cfg = config(scheduler={"policy": "priority"}, kvpool={**POOL, "mode": mode})
    results: dict[int, list[int]] = {}
    with anyio.fail_after(20), capture_logs() as logs:
        async with Scheduler(cfg, engine_factory=fake_factory(engine)) as s:

            async def one(i: int, priority: int) -> None:
                done = await s.complete([i + 1] * 10, PARAMS, priority=priority, tenant=f"t{i}")
                assert done.finish_reason == "length"
                results[i] = done.token_ids

            async with anyio.create_task_group() as tg:
                for i, priority in enumerate((0, 5, 0)):  # the middle one matters least
                    tg.start_soon(one, i, priority)
            await wait_idle(s)
            st = s.stats()
            assert (st.blocks_used, st.blocks_padding) == (0, 0)
    victims = {str(e["tenant"]) for e in logs if e["event"] == "request_preempted"}
    return [results[i] for i in range(3)], st.preemptions, victims


async def test_on_demand_preempts_the_policys_victim_and_loses_nothing() -> None:
    engine = FakeEngine(step_delay=0.002)
    outputs, preemptions, victims = await run_three("on-demand", engine)
    assert engine.max_held == 3  # all three ran at once, on 2 blocks each at first
    assert preemptions >= 1
    assert victims == {"t1"}  # priority 5: the policy's victim
    assert outputs == [expected([i + 1] * 10, 40) for i in range(3)]  # carried on where it was


async def test_reserve_mode_waits_and_never_preempts() -> None:
    engine = FakeEngine(step_delay=0.002)
    outputs, preemptions, _ = await run_three("reserve", engine)
    assert engine.max_held == 2 and preemptions == 0
    assert outputs == [expected([i + 1] * 10, 40) for i in range(3)]


async def test_the_budget_is_memory_less_the_weights() -> None:
    info = msgspec.structs.replace(fake_info(), weights_bytes=3072)

    def heavy():  # type: ignore[no-untyped-def]
        return FakeEngine(), Loaded(info, fake_factory(FakeEngine())()[1].codec)

    async with Scheduler(config(kvpool=POOL), engine_factory=heavy) as s:
        st = s.stats()
        assert st.blocks_total == 2 and st.kv_budget_bytes == 1024 and st.weights_bytes == 3072
    too_small = {**POOL, "memory": 3000}
    with pytest.raises(ConfigError, match=r"kvpool.memory: 3000 bytes less the model's weights \(3072 bytes\)"):
        async with Scheduler(config(kvpool=too_small), engine_factory=heavy):
            pass


async def test_bad_session_names_are_invalid_and_others_are_served() -> None:
    async with Scheduler(engine_factory=fake_factory(FakeEngine())) as s:
        with pytest.raises(InvalidRequest, match="session must be None or a non-empty string"):
            await s.drop_session("")
        with pytest.raises(InvalidRequest, match="session must be None or a non-empty string"):
            await s.drop_session(5)  # type: ignore[arg-type]
        # The fake engine keeps no KV: a session is accepted and there is nothing to drop.
        done = await s.complete([3, 4], SamplingParams(max_tokens=4), session="chat")
        assert done.token_ids == expected([3, 4], 4)
        assert await s.drop_session("chat") is False

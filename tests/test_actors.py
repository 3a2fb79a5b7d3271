"""The actors through real anyio streams, with a fake engine on the real worker thread."""

from __future__ import annotations

import threading
import time
from typing import TYPE_CHECKING

import anyio
import pytest
from structlog.testing import capture_logs

from scheduler import SamplingParams, Scheduler, SchedulerConfig
from scheduler.admission.core import AdmissionCore
from scheduler.errors import InvalidRequest, ModelLoadError, QueueFull, SchedulerClosed
from tests.fakes import EOS, FakeEngine, fake_factory, fake_token
from workers import worker as worker_module
from workers.messages import Admit, SamplingSpec, StepOutput
from workers.worker import GPUWorker, WorkerStartError

if TYPE_CHECKING:
    from scheduler.types import Chunk
    from workers.batching.contract import StepResult
    from workers.factory import Loaded

pytestmark = pytest.mark.anyio

GREEDY = dict(temperature=0.0)


def config(**sections: dict[str, object]) -> SchedulerConfig:
    text = "\n".join(
        f"[{name}]\n" + "\n".join(f"{k} = {v!r}" for k, v in values.items())
        for name, values in sections.items()
    )
    return SchedulerConfig.from_toml(text.replace("'", '"'))


def expected(prompt: list[int], max_tokens: int) -> list[int]:
    admit = Admit(0, prompt, max_tokens, SamplingSpec(), ())
    return [fake_token(admit, k) for k in range(max_tokens)]


async def wait_idle(sched: Scheduler) -> None:
    while True:
        s = sched.stats()
        if s.running == s.waiting == s.engine_batch == s.blocks_used == 0:
            return
        await anyio.sleep(0.005)


async def wait_actors_waiting(sched: Scheduler) -> None:
    """Until the admission actor and the pool both wait on empty inboxes: a message of the last
    request still on its way to one of them (its last step, its blocks' release) would otherwise
    have the next request queued by the actor rather than within its caller's task."""
    admission, pool = sched._admission, sched._pool
    assert admission is not None and pool is not None
    while True:
        inbox = pool._inbox.statistics()
        if admission._waiting() and inbox.tasks_waiting_receive > 0 and inbox.current_buffer_used == 0:
            return
        await anyio.sleep(0.005)


async def test_concurrent_requests_complete_with_their_own_tokens() -> None:
    engine = FakeEngine()
    with anyio.fail_after(20):
        async with Scheduler(config(worker={"max_batch": 8}), engine_factory=fake_factory(engine)) as s:
            results = {}

            async def one(i: int) -> None:
                prompt = [i + 1, i + 2, i + 3]
                results[i] = (prompt, await s.complete(prompt, SamplingParams(max_tokens=5 + i, **GREEDY)))

            async with anyio.create_task_group() as tg:
                for i in range(20):
                    tg.start_soon(one, i)
            for i, (prompt, done) in results.items():
                assert done.token_ids == expected(prompt, 5 + i)
                assert done.finish_reason == "length"
                assert done.completion_tokens == 5 + i and done.prompt_tokens == 3
                t = done.timings
                assert t.ttft_s is not None and 0 <= t.queue_s <= t.ttft_s <= t.e2e_s
            await wait_idle(s)
            st = s.stats()
            assert st.finished == 20 and st.blocks_free == st.blocks_total
            assert engine.max_held <= 8


async def test_exactly_one_final_chunk_and_it_is_last() -> None:
    with anyio.fail_after(10):
        async with Scheduler(engine_factory=fake_factory(FakeEngine())) as s:
            chunks: list[Chunk] = [c async for c in s.generate([5, 6], SamplingParams(max_tokens=7))]
            assert [c.finish_reason for c in chunks[:-1]] == [None] * (len(chunks) - 1)
            assert chunks[-1].finish_reason == "length"
            assert sum(len(c.token_ids) for c in chunks) == 7
            assert "".join(c.text for c in chunks) == "".join(
                chr(ord("a") + t % 26) for t in expected([5, 6], 7)
            )


async def test_queue_full_is_raised_at_once_and_others_still_served() -> None:
    engine = FakeEngine()
    engine.gate.clear()  # hold the first request in the batch
    cfg = config(worker={"max_batch": 1}, scheduler={"max_queue": 2})
    with anyio.fail_after(10):
        async with Scheduler(cfg, engine_factory=fake_factory(engine)) as s:
            done: list[str] = []

            async def one(p: int) -> None:
                done.append((await s.complete([p], SamplingParams(max_tokens=3))).finish_reason)

            async with anyio.create_task_group() as tg:
                for p in range(3):
                    tg.start_soon(one, p + 1)
                while s.stats().waiting < 2 or s.stats().running < 1:
                    await anyio.sleep(0.005)
                with pytest.raises(QueueFull, match="queue is full"):
                    await s.complete([9], SamplingParams(max_tokens=3))
                assert s.stats().rejected == 1
                engine.gate.set()
            assert done == ["length"] * 3


async def test_break_aborts_running_request_and_frees_slot_and_blocks() -> None:
    engine = FakeEngine(step_delay=0.02)
    with anyio.fail_after(10):
        async with Scheduler(engine_factory=fake_factory(engine)) as s:
            async for chunk in s.generate([1, 2], SamplingParams(max_tokens=200)):
                assert chunk.finish_reason is None
                steps_at_break = s.stats().steps
                break
            await wait_idle(s)
            assert s.stats().steps - steps_at_break <= 2  # freed within one engine step
            assert engine.seqs == {}
            assert s.stats().finished == 1


async def test_cancelled_task_while_queued_never_reaches_the_engine() -> None:
    engine = FakeEngine()
    engine.gate.clear()
    with anyio.fail_after(10):
        async with Scheduler(config(worker={"max_batch": 1}), engine_factory=fake_factory(engine)) as s:
            async with anyio.create_task_group() as tg:
                tg.start_soon(s.complete, [1], SamplingParams(max_tokens=4))
                while s.stats().running < 1:
                    await anyio.sleep(0.005)
                try:
                    with anyio.move_on_after(0.05):
                        await s.complete([2], SamplingParams(max_tokens=4))
                    while s.stats().waiting:  # the Cancel reaches the actor
                        await anyio.sleep(0.005)
                finally:
                    engine.gate.set()
            await wait_idle(s)
            assert len(engine.inserted) == 1


async def test_timeouts_end_queued_and_running_requests() -> None:
    engine = FakeEngine()
    engine.gate.clear()
    with anyio.fail_after(10):
        async with Scheduler(config(worker={"max_batch": 1}), engine_factory=fake_factory(engine)) as s:
            results = {}

            async def one(name: str, timeout: float) -> None:
                results[name] = await s.complete([3], SamplingParams(max_tokens=50), timeout=timeout)

            async with anyio.create_task_group() as tg:
                tg.start_soon(one, "running", 0.2)
                while s.stats().running < 1:
                    await anyio.sleep(0.005)
                tg.start_soon(one, "queued", 0.1)
            assert results["queued"].finish_reason == "timeout"
            assert results["queued"].timings.ttft_s is None
            assert results["running"].finish_reason == "timeout"
            engine.gate.set()
            await wait_idle(s)
            assert engine.seqs == {}


async def test_stop_string_ends_text_before_it() -> None:
    prompt = [1, 2, 3]
    full = "".join(chr(ord("a") + t % 26) for t in expected(prompt, 30))
    stop = full[10:12]
    cut = full.find(stop)
    with anyio.fail_after(10):
        async with Scheduler(engine_factory=fake_factory(engine := FakeEngine())) as s:
            done = await s.complete(prompt, SamplingParams(max_tokens=30, stop=(stop,)))
            assert done.finish_reason == "stop"
            assert done.text == full[:cut]
            await wait_idle(s)
            assert engine.seqs == {}


async def test_eos_stops_unless_ignored() -> None:
    engine = FakeEngine(eos_after=3)
    with anyio.fail_after(10):
        async with Scheduler(engine_factory=fake_factory(engine)) as s:
            stopped = await s.complete([4], SamplingParams(max_tokens=10))
            assert stopped.finish_reason == "stop" and stopped.completion_tokens == 3
            assert EOS not in stopped.token_ids
            ignored = await s.complete([4], SamplingParams(max_tokens=10, ignore_eos=True))
            assert ignored.finish_reason == "length" and ignored.completion_tokens == 10


async def test_pool_budget_limits_how_many_run_at_once() -> None:
    engine = FakeEngine(step_delay=0.005)
    # 32 bytes/token x 16 tokens = 512-byte blocks; 2048 bytes = 4 blocks; each request needs 2.
    cfg = config(kvpool={"block_tokens": 16, "memory": 2048})
    with anyio.fail_after(20):
        async with Scheduler(cfg, engine_factory=fake_factory(engine)) as s:
            assert s.stats().blocks_total == 4
            async with anyio.create_task_group() as tg:
                for i in range(6):
                    tg.start_soon(s.complete, [i + 1] * 10, SamplingParams(max_tokens=20))
            assert engine.max_held == 2
            with pytest.raises(InvalidRequest, match="KV blocks"):
                await s.complete([1] * 10, SamplingParams(max_tokens=100))
            await wait_idle(s)
            assert s.stats().finished == 6


async def test_worker_failure_ends_everyone_with_error_then_closes() -> None:
    engine = FakeEngine(fail_at_step=3)
    cfg = config(worker={"max_batch": 2, "on_failure": "close"})
    with anyio.fail_after(10), capture_logs() as logs:
        async with Scheduler(cfg, engine_factory=fake_factory(engine)) as s:
            async with anyio.create_task_group() as tg:
                outcomes = []

                async def one() -> None:
                    outcomes.append(await s.complete([1], SamplingParams(max_tokens=50)))

                for _ in range(4):
                    tg.start_soon(one)
            assert [o.finish_reason for o in outcomes] == ["error"] * 4
            assert all("injected failure" in (o.error or "") for o in outcomes)
            with pytest.raises(SchedulerClosed, match="worker failed"):
                await s.complete([1], SamplingParams(max_tokens=2))
    assert any(e["event"] == "worker_failed" for e in logs)
    assert engine.closed


async def test_leaving_the_scheduler_cancels_what_is_in_flight() -> None:
    engine = FakeEngine(step_delay=0.01)
    outcomes: list[str] = []
    with anyio.fail_after(10):
        async with Scheduler(config(worker={"max_batch": 1}), engine_factory=fake_factory(engine)) as s:

            async def one() -> None:
                outcomes.append((await s.complete([1], SamplingParams(max_tokens=500))).finish_reason)

            async with anyio.create_task_group() as tg:
                tg.start_soon(one)
                tg.start_soon(one)
                while s.stats().running + s.stats().waiting < 2:
                    await anyio.sleep(0.005)
                await s.aclose()  # from inside a nested task group: allowed
            assert outcomes == ["cancelled", "cancelled"]
            with pytest.raises(SchedulerClosed):
                s.generate([1])
            assert engine.closed  # the worker thread closed its engine and was joined
            assert not any(t.name == "mlx-worker" for t in threading.enumerate())


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(prompt=""), "prompt is empty"),
        (dict(prompt=[]), "prompt is empty"),
        (dict(prompt=123), "prompt must be a str or a list"),
        (dict(prompt=[1, "x"]), r"prompt\[1\]"),
        (dict(prompt=[1, 10_000]), r"prompt\[1\] = 10000 is not a token id"),
        (dict(prompt=[1], priority="high"), "priority must be an integer"),
        (dict(prompt=[1], tenant=5), "tenant must be"),
        (dict(prompt=[1], timeout=-1), "timeout must be"),
        (dict(prompt=[1], params={"max_tokens": 3}), "params must be SamplingParams"),
    ],
)
async def test_bad_requests_raise_invalid_request_and_service_goes_on(
    kwargs: dict[str, object], message: str
) -> None:
    with anyio.fail_after(10):
        async with Scheduler(engine_factory=fake_factory(FakeEngine())) as s:
            rest = dict(kwargs)
            prompt = rest.pop("prompt")
            with pytest.raises(InvalidRequest, match=message):
                await s.complete(prompt, **rest)  # type: ignore[arg-type]
            done = await s.complete([1, 2], SamplingParams(max_tokens=2))
            assert done.finish_reason == "length"


async def test_prompt_longer_than_context_is_invalid() -> None:
    with anyio.fail_after(10):
        async with Scheduler(engine_factory=fake_factory(FakeEngine(), context_length=32)) as s:
            with pytest.raises(InvalidRequest, match="longer than the model's context of 32"):
                await s.complete([1] * 33, SamplingParams(max_tokens=1))
            with pytest.raises(InvalidRequest, match="max_tokens"):
                await s.complete([1] * 30, SamplingParams(max_tokens=5))
            assert (await s.complete([1] * 30, SamplingParams(max_tokens=2))).completion_tokens == 2


async def test_model_load_failure_fails_startup_with_its_cause() -> None:
    def broken():  # type: ignore[no-untyped-def]
        raise FileNotFoundError("no weights here")

    with anyio.fail_after(10):
        with pytest.raises(ModelLoadError, match="no weights here") as info:
            async with Scheduler(engine_factory=broken):
                pass
    assert isinstance(info.value.__cause__, FileNotFoundError)


async def test_worker_thread_is_joined_on_exit() -> None:
    with anyio.fail_after(10):
        async with Scheduler(engine_factory=fake_factory(FakeEngine())) as s:
            await s.complete([1], SamplingParams(max_tokens=2))
            assert any(t.name == "mlx-worker" for t in threading.enumerate())
    assert not any(t.name == "mlx-worker" for t in threading.enumerate())


async def test_aclose_inside_the_block_does_not_cancel_the_caller() -> None:
    with anyio.fail_after(10):
        async with Scheduler(engine_factory=fake_factory(FakeEngine())) as s:
            await s.complete([1], SamplingParams(max_tokens=2))
            await s.aclose()
            await anyio.sleep(0.01)  # the caller's own code goes on after an early close
            async with anyio.create_task_group() as tg:
                tg.start_soon(anyio.sleep, 0.01)
            with pytest.raises(SchedulerClosed):
                await s.complete([1], SamplingParams(max_tokens=2))


async def test_when_the_caller_sees_the_end_the_blocks_are_back() -> None:
    with anyio.fail_after(10):
        async with Scheduler(engine_factory=fake_factory(FakeEngine(step_delay=0.002))) as s:
            for n in (1, 3, 7):
                done = await s.complete([n, 2], SamplingParams(max_tokens=n))
                st = s.stats()
                assert done.finish_reason == "length"
                assert (st.running, st.blocks_used) == (0, 0)


class _LoggedEngine(FakeEngine):
    """Logs each step's start, from the worker thread, into a list shared with the loop."""

    def __init__(self, events: list[tuple[str, int]], **kwargs: object) -> None:
        super().__init__(**kwargs)  # type: ignore[arg-type]
        self.events = events

    def step(self) -> StepResult:
        self.events.append(("step", self.steps + 1))
        return super().step()


async def test_a_first_token_is_applied_before_the_worker_builds_the_next_step(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The worker hands the loop its turn after a step that produced a first token (TTFT): the
    loop applies that step before the next one starts. A long HANDOFF_S makes the order certain,
    and the run ending in time shows the loop does release the worker."""
    monkeypatch.setattr(worker_module, "HANDOFF_S", 30.0)
    events: list[tuple[str, int]] = []
    on_step = AdmissionCore.on_step

    def logged(core: AdmissionCore, out: StepOutput, now: float) -> None:
        on_step(core, out, now)
        events.append(("applied", out.step))

    monkeypatch.setattr(AdmissionCore, "on_step", logged)
    engine = _LoggedEngine(events)
    with anyio.fail_after(10):
        async with Scheduler(config(worker={"max_batch": 4}), engine_factory=fake_factory(engine)) as s:
            for n in (1, 2, 3):  # one after another: each one's first token is its own step
                done = await s.complete([n, 5], SamplingParams(max_tokens=4))
                assert done.token_ids == expected([n, 5], 4)
    firsts = [k for k, first in engine.step_log if first]
    assert len(firsts) == 3
    for k in firsts:
        if ("step", k + 1) in events:
            assert events.index(("applied", k)) < events.index(("step", k + 1)), events


async def test_the_worker_goes_on_when_the_loop_never_releases_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Without a release the worker waits at most HANDOFF_S after a first token, then steps on."""
    monkeypatch.setattr(worker_module, "HANDOFF_S", 0.2)
    outputs: list[StepOutput] = []
    starts: list[float] = []
    engine = FakeEngine()
    step = engine.step

    def timed_step() -> StepResult:
        starts.append(time.perf_counter())
        return step()

    engine.step = timed_step  # type: ignore[method-assign]
    worker = GPUWorker(fake_factory(engine), lambda e: outputs.append(e) if isinstance(e, StepOutput) else None)
    with anyio.fail_after(10):
        async with anyio.create_task_group() as tg:
            await tg.start(worker.run)
            worker.send(Admit(1, [1, 2], 3, SamplingSpec(), ()))
            while sum(len(o.tokens) for o in outputs) < 3:
                await anyio.sleep(0.01)
            tg.cancel_scope.cancel()
    assert [t for o in outputs for t in o.tokens] == expected([1, 2], 3)
    assert len(starts) == 3 and starts[1] - starts[0] >= 0.2  # it waited after the first token


async def test_the_worker_thread_ends_with_its_exit_call_after_the_engine_closes() -> None:
    """MLX asks every thread that used it to clear its streams at its end: the worker makes that
    call on its own thread, last, also when the engine never started."""
    calls: list[tuple[str, bool | None]] = []
    engine = FakeEngine()

    def at_exit() -> None:
        calls.append((threading.current_thread().name, engine.closed))

    worker = GPUWorker(fake_factory(engine), lambda e: None, at_thread_exit=at_exit)
    with anyio.fail_after(10):
        async with anyio.create_task_group() as tg:
            await tg.start(worker.run)
            tg.cancel_scope.cancel()
    assert calls == [("mlx-worker", True)]

    def broken() -> tuple[FakeEngine, Loaded]:
        raise RuntimeError("no model")

    failing = GPUWorker(broken, lambda e: None,
                        at_thread_exit=lambda: calls.append((threading.current_thread().name, None)))
    with anyio.fail_after(10), pytest.raises(WorkerStartError, match="no model"):
        await failing.run()
    assert calls[1:] == [("mlx-worker", None)]


async def test_a_step_that_fails_to_apply_fails_the_actor_and_no_caller_waits(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Steps are applied in the bridge's callback when the actor waits on an empty inbox: a
    # failure there must end the actor as a failure in its own loop would, never hang a caller.
    on_step = AdmissionCore.on_step
    applied = [0]

    def failing(self: AdmissionCore, out: StepOutput, now: float) -> None:
        applied[0] += 1
        if applied[0] == 3:
            raise RuntimeError("injected failure applying a step")
        on_step(self, out, now)

    monkeypatch.setattr(AdmissionCore, "on_step", failing)
    errors: list[BaseException] = []
    with anyio.fail_after(10):
        with pytest.raises(ExceptionGroup) as info:  # noqa: PT012  (the scheduler's block raises)
            async with Scheduler(engine_factory=fake_factory(FakeEngine(step_delay=0.001))) as s:
                try:
                    await s.complete([1, 2], SamplingParams(max_tokens=50))
                except SchedulerClosed as exc:
                    errors.append(exc)
    assert applied[0] == 3
    assert len(errors) == 1 and "stopped" in str(errors[0])
    assert isinstance(info.value, ExceptionGroup)
    assert [str(e) for e in info.value.exceptions] == ["injected failure applying a step"]


@pytest.mark.parametrize("posted", ["step", "grants"])
async def test_a_post_never_overtakes_a_message_already_handed_to_the_waiting_actor(
    monkeypatch: pytest.MonkeyPatch, posted: str,
) -> None:
    # A message sent to an actor suspended in its receive goes straight to it, not to the
    # buffer; a step or the pool's replies posted (and applied in the poster's callback) before
    # the actor resumes must wait behind it, not be applied first.
    from kvpool.messages import PoolReplies
    from scheduler.admission.messages import Cancel

    order: list[str] = []
    on_step, cancel = AdmissionCore.on_step, AdmissionCore.cancel
    on_pool = AdmissionCore.on_pool
    probe = PoolReplies([], -1, -1)

    def record_step(self: AdmissionCore, out: StepOutput, now: float) -> None:
        order.append(f"step {out.step}")
        on_step(self, out, now)

    def record_pool(self: AdmissionCore, msg: PoolReplies, now: float) -> None:
        if msg is probe:  # answers no batch: recorded, not applied
            order.append("grants")
        else:
            on_pool(self, msg, now)

    def record_cancel(self: AdmissionCore, rid: int, now: float) -> None:
        order.append(f"cancel {rid}")
        cancel(self, rid, now)

    monkeypatch.setattr(AdmissionCore, "on_step", record_step)
    monkeypatch.setattr(AdmissionCore, "on_pool", record_pool)
    monkeypatch.setattr(AdmissionCore, "cancel", record_cancel)
    message = StepOutput(10**6, [], [], [], [], [], 0, 0.0, 0.0) if posted == "step" else probe
    with anyio.fail_after(10):
        async with Scheduler(engine_factory=fake_factory(FakeEngine())) as s:
            await s.complete([1, 2], SamplingParams(max_tokens=3))
            await wait_idle(s)
            order.clear()
            actor = s._admission
            assert actor is not None
            while actor._inbox.statistics().tasks_waiting_receive == 0:  # suspended in receive
                await anyio.sleep(0.01)
            actor.send.send_nowait(Cancel(12345))  # handed to the waiting actor at once
            actor.post(message)
            while len(order) < 2:
                await anyio.sleep(0.01)
            behind = list(order)
            # Once the actor waits again, applied at once, in the poster's callback.
            order.clear()
            while actor._inbox.statistics().tasks_waiting_receive == 0:
                await anyio.sleep(0.01)
            actor.post(message)
            applied_at_once = list(order)
    label = f"step {10**6}" if posted == "step" else "grants"
    assert behind == ["cancel 12345", label]
    assert applied_at_once == [label]


async def test_a_request_reaches_the_worker_from_its_callers_task_unless_it_has_a_deadline(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # While the admission actor and the pool wait on empty inboxes, a request is queued, granted
    # its blocks and handed to the worker within its caller's task (no actor wake-up on its way);
    # a request with a deadline goes through the actor, whose timer must learn of it. Both run.
    sent_from: dict[int, object] = {}
    send = GPUWorker.send

    def record(self: GPUWorker[Loaded], command: object) -> None:
        if isinstance(command, Admit):
            sent_from[command.rid] = anyio.get_current_task().id
        send(self, command)  # type: ignore[arg-type]

    monkeypatch.setattr(GPUWorker, "send", record)
    with anyio.fail_after(10):
        async with Scheduler(engine_factory=fake_factory(FakeEngine())) as s:
            await s.complete([3], SamplingParams(max_tokens=1))  # the actors are in their loops
            sent_from.clear()
            outputs, callers = [], []
            for timeout in (None, 30.0, None):
                await wait_idle(s)
                await wait_actors_waiting(s)
                callers.append(anyio.get_current_task().id)
                outputs.append((await s.complete([1, 2], SamplingParams(max_tokens=4), timeout=timeout)).token_ids)
            await wait_idle(s)
    assert outputs == [expected([1, 2], 4)] * 3
    assert [sent_from[rid] == caller for rid, caller in zip(sorted(sent_from), callers, strict=True)] == [
        True, False, True]


async def test_the_pool_answers_within_send_while_it_waits_and_queues_otherwise() -> None:
    from kvpool.books import BlockBooks
    from kvpool.messages import Granted, PoolBatch, PoolReplies, Reserve
    from kvpool.pool import Pool

    pool = Pool(BlockBooks(8, 16, 512))
    got: list[tuple[int, PoolReplies]] = []
    batch = PoolBatch([Reserve(7, 2, [], None, None, 0)])
    pool.send(batch)  # not running yet: queued, answered once it runs
    assert got == []
    async with anyio.create_task_group() as tg:
        await tg.start(pool.run, lambda r: got.append((len(got), r)))
        with anyio.fail_after(5):  # answered, and the pool's task back in its receive
            while not got or pool._inbox.statistics().tasks_waiting_receive == 0:
                await anyio.sleep(0.001)
        pool.send(PoolBatch([Reserve(8, 3, [], None, None, 0)]))
        answered_within_send = len(got) == 2
        tg.cancel_scope.cancel()
    assert answered_within_send
    assert [(r.replies[0].rid, r.replies[0].blocks, r.free) for _, r in got] == [(7, 2, 6), (8, 3, 3)]
    assert all(isinstance(r.replies[0], Granted) for _, r in got)

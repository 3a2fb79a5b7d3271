"""Prompts prefilled on a thread of their own (`[worker] prefill_thread`), on the real mlx-lm
BatchGenerator (synthetic:tiny): the tokens of prefill inside the steps, nothing left behind by
a request that leaves mid-prefill, kept KV (prefix blocks, sessions) as a starting point, passes
packed as documented, and a failed pass that ends its requests while the scheduler goes on."""

from __future__ import annotations

import dataclasses
import random
import threading
import time
from collections import defaultdict
from typing import TYPE_CHECKING, Any

import anyio
import pytest
from structlog.testing import capture_logs

from scheduler import SamplingParams, Scheduler, SchedulerConfig
from tests.test_kvpool import assert_idle, run_all, tokens
from tests.test_metrics import parse, value
from tests.test_prefill_path import workload
from workers.batching.engine import MLXEngine
from workers.batching.prefill_thread import Job, PrefillFailed, PrefillThread

if TYPE_CHECKING:
    from pathlib import Path

    from workers.messages import Admit

pytestmark = pytest.mark.integration

GREEDY = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)


def engine(model: Any, threaded: bool) -> MLXEngine:
    return MLXEngine(model, vocab_size=256, max_batch=6, prefill_batch=4, prefill_step=64,
                     step_token_budget=24, prefill_thread=threaded)


def drive(e: MLXEngine, admits: list[Admit], *, close: bool = True) -> dict[int, list[int]]:
    """Half the requests at once, the rest two a step; every step's tokens by request (those
    inserted before too)."""
    out: dict[int, list[int]] = defaultdict(list)
    for a in admits:
        out[a.rid] = []
    half = len(admits) // 2
    e.insert(admits[:half])
    later = admits[half:]
    while e.has_work() or later:
        e.insert(later[:2])
        later = later[2:]
        r = e.step()
        for rid, tok in zip(r.rids, r.tokens, strict=True):
            out[rid].append(tok)
    if close:
        e.close()
    return dict(out)


def test_threaded_prefill_gives_the_tokens_of_prefill_in_the_step(tiny_model: Any) -> None:
    admits = workload(16)  # greedy and seeded rows, prompts of 3-90 tokens in chunks of 64
    threaded = engine(tiny_model, True)
    assert threaded.prefill_threaded and not threaded.prefill_thread_unavailable
    assert threaded._ahead is not None
    thread = threaded._ahead.thread
    got = drive(threaded, admits, close=False)
    passes = thread.passes
    threaded.close()
    assert got == drive(engine(tiny_model, False), admits)
    assert [len(got[a.rid]) for a in admits] == [a.max_tokens for a in admits]
    assert 0 < passes < len(admits)  # the waiting prompts shared passes
    assert not thread._thread.is_alive()  # closing the engine ends its thread


def test_a_request_removed_mid_prefill_leaves_nothing_behind(tiny_model: Any) -> None:
    admits = workload(8, seed=3)
    e = engine(tiny_model, True)
    assert e._ahead is not None
    thread = e._ahead.thread
    real = thread._prefill
    running, release = threading.Event(), threading.Event()

    def gated(jobs: list[Job]) -> list[list[Any]]:
        running.set()
        assert release.wait(30)
        return real(jobs)

    thread._prefill = gated  # type: ignore[method-assign]
    e.insert(admits[:4])
    assert running.wait(30)  # the first pass is held with some of these
    e.insert(admits[4:])
    held = sorted(thread._running)
    waiting = [j.rid for j in thread._jobs]
    assert held and waiting
    gone = [held[0], waiting[0]]  # one in the running pass, one still waiting
    e.remove(gone)
    assert sorted(e.rids()) == sorted(a.rid for a in admits if a.rid not in gone)
    release.set()
    out = drive(e, [], close=False)
    assert (e.held(), e.rids(), e.has_work()) == (0, [], False)
    assert (thread._ready, list(thread._jobs), thread._running, thread._dropped) == ([], [], set(), set())
    e.close()
    kept = [a for a in admits if a.rid not in gone]
    assert out == drive(engine(tiny_model, False), kept)  # each kept one ran to its end, as before
    assert [len(out[a.rid]) for a in kept] == [a.max_tokens for a in kept]


def test_a_pass_takes_jobs_in_order_while_their_padded_tokens_fit(tiny_model: Any) -> None:
    passes: list[list[int]] = []

    def record(jobs: list[Job]) -> list[list[Any]]:
        passes.append([len(j.tokens) for j in jobs])
        return [[] for _ in jobs]

    def run(lengths: list[int], **kwargs: int) -> list[list[int]]:
        passes.clear()
        thread = PrefillThread(tiny_model, chunk=64, **kwargs)
        thread._prefill = record  # type: ignore[method-assign]
        thread.submit([Job(i, [1] * n, None, []) for i, n in enumerate(lengths)])
        taken: list[int] = []
        while len(taken) < len(lengths):
            taken += [p.rid for p in thread.take(wait=True)]
        thread.close()
        assert taken == list(range(len(lengths)))  # handed back in order, each once
        return list(passes)

    # 2 x 100 fits 256; 30 then 200 would be 2 x 200; a job longer than the pass goes alone.
    assert run([100, 100, 30, 200, 10, 300], pass_tokens=256, max_prompts=8) == [
        [100, 100], [30], [200], [10], [300]]
    assert run([10] * 5, pass_tokens=256, max_prompts=2) == [[10, 10], [10, 10], [10]]
    # Padded to 64: 40 counts as 64, so four fit 256 and a fifth does not.
    assert run([40] * 5, pass_tokens=256, max_prompts=8, pad_to=64) == [[40] * 4, [40]]


def test_a_failed_pass_is_raised_once_taken_and_stops_the_thread(tiny_model: Any) -> None:
    thread = PrefillThread(tiny_model, chunk=64, pass_tokens=256, max_prompts=8)

    def fail(jobs: list[Job]) -> list[list[Any]]:
        raise RuntimeError("injected: the device is gone")

    thread._prefill = fail  # type: ignore[method-assign]
    thread.submit([Job(0, [1, 2, 3], None, [])])
    with pytest.raises(PrefillFailed, match="injected: the device is gone") as caught:
        thread.take(wait=True)
    assert isinstance(caught.value.__cause__, RuntimeError)
    with pytest.raises(PrefillFailed):
        thread.take()  # it stays failed: no pass runs after it
    thread.close()


def threaded_config(cache: Path, *, threaded: bool = True, **kvpool: object) -> SchedulerConfig:
    lines = [f'[model]\npath = "synthetic:tiny"\ncache_dir = "{cache}"',
             f"[worker]\nmax_batch = 16\nprefill_thread = {str(threaded).lower()}", "[kvpool]"]
    lines += [f"{k} = {str(v).lower() if isinstance(v, bool) else repr(v)}".replace("'", '"')
              for k, v in kvpool.items()]
    return SchedulerConfig.from_toml("\n".join(lines))


@pytest.mark.anyio
async def test_the_scheduler_serves_from_the_thread_with_kept_kv(model_cache: Path) -> None:
    rng = random.Random(31)
    shared = tokens(48, rng)
    prefixed = [(shared + tokens(10 + i, rng), GREEDY) for i in range(3)]
    burst = [(tokens(rng.randint(5, 150), rng), GREEDY) for _ in range(20)]
    first = tokens(40, rng)
    with anyio.fail_after(240):
        async with Scheduler(threaded_config(model_cache, block_tokens=16)) as s:
            st0 = s.stats()
            hits = [await s.complete(*job) for job in prefixed]  # one after another: 2 prefix hits
            got = await run_all(s, burst)  # at once: passes of several prompts
            turn1 = await s.complete(first, GREEDY, session="t")
            second = first + turn1.token_ids + tokens(12, rng)
            turn2 = await s.complete(second, GREEDY, session="t")
            st = s.stats()
            gauge = value(parse(s.metrics_text()), "prefill_thread")
            await assert_idle(s)
        async with Scheduler(threaded_config(model_cache, threaded=False, prefix_cache=False)) as ref:
            want = await run_all(ref, [*prefixed, *burst, (second, GREEDY)])
    assert st0.prefill_thread is True and gauge == 1
    assert [c.token_ids for c in [*hits, *got, turn2]] == [c.token_ids for c in want]
    assert [c.cached_tokens for c in hits] == [0, 48, 48]
    assert st.session_hits == 1 and len(first) <= turn2.cached_tokens < len(second)
    assert all(c.finish_reason == "length" and c.completion_tokens == 20 for c in [*hits, *got, turn2])


@pytest.mark.anyio
async def test_a_failed_pass_ends_its_requests_and_the_scheduler_goes_on(
    model_cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    real = PrefillThread._prefill
    calls = 0

    def once(self: PrefillThread, jobs: list[Job]) -> list[list[Any]]:
        nonlocal calls
        calls += 1
        if calls == 1:
            raise RuntimeError("injected: this pass fails")
        return real(self, jobs)

    monkeypatch.setattr(PrefillThread, "_prefill", once)
    prompt = tokens(30, random.Random(32))
    with anyio.fail_after(120):
        with capture_logs() as logs:
            async with Scheduler(threaded_config(model_cache)) as s:
                failed = await s.complete(prompt, GREEDY)
                ok = await s.complete(prompt, GREEDY)  # a restarted engine, with a new thread
                await assert_idle(s)
    assert failed.finish_reason == "error" and "injected: this pass fails" in (failed.error or "")
    assert ok.finish_reason == "length" and ok.completion_tokens == 20
    assert any(e["event"] == "worker_failed" for e in logs)


@pytest.mark.anyio
async def test_off_by_default_and_said_once_where_it_cannot_work(
    model_cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    async with Scheduler(threaded_config(model_cache, threaded=False)) as s:
        assert s.stats().prefill_thread is False
    import workers.batching.engine as engine_module

    real = engine_module.cache_support

    def no_sessions(caches: Any) -> Any:
        return dataclasses.replace(real(caches), sessions=False)

    monkeypatch.setattr(engine_module, "cache_support", no_sessions)
    with capture_logs() as logs:
        async with Scheduler(threaded_config(model_cache)) as s:
            st = s.stats()
            done = await s.complete(tokens(20, random.Random(33)), GREEDY)
    said = [e for e in logs if e["event"] == "prefill_thread_unavailable"]
    assert st.prefill_thread is False
    assert len(said) == 1 and "cannot be extracted" in said[0]["reason"]
    assert done.completion_tokens == 20  # served, with prefill in the steps


@pytest.mark.anyio
async def test_requests_that_time_out_mid_prefill_end_once_and_free_their_blocks(
    model_cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    real = PrefillThread._prefill

    def slow(self: PrefillThread, jobs: list[Job]) -> list[list[Any]]:
        time.sleep(0.3)  # on the prefill thread: the timeouts below come while it holds them
        return real(self, jobs)

    monkeypatch.setattr(PrefillThread, "_prefill", slow)
    rng = random.Random(34)
    prompts = [tokens(rng.randint(20, 120), rng) for _ in range(8)]
    done: dict[int, Any] = {}
    with anyio.fail_after(120):
        async with Scheduler(threaded_config(model_cache)) as s:
            async def one(i: int) -> None:
                done[i] = await s.complete(prompts[i], GREEDY, timeout=0.1 if i % 2 else None)

            async with anyio.create_task_group() as tg:
                for i in range(len(prompts)):
                    tg.start_soon(one, i)
            await assert_idle(s)
            st = s.stats()
    assert [done[i].finish_reason for i in range(8)] == ["length", "timeout"] * 4
    assert all(done[i].completion_tokens == 20 for i in range(0, 8, 2))
    assert st.finished == 8 and st.engine_batch == 0

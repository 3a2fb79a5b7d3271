"""Prometheus metrics: exact counts against what the test sent, parsed with prometheus_client."""

from __future__ import annotations

import inspect
import threading
from typing import TYPE_CHECKING, Any

import anyio
import pytest
from prometheus_client import CollectorRegistry, Histogram, generate_latest
from prometheus_client.parser import text_string_to_metric_families
from structlog.testing import capture_logs

from metrics import NullObserver, Observer, SchedulerMetrics
from metrics.prometheus import ITL_BUCKETS, TTFT_BUCKETS
from metrics.prometheus import Histogram as FastHistogram
from scheduler import SamplingParams, Scheduler, SchedulerConfig
from scheduler.errors import QueueFull
from tests.fakes import FakeEngine, fake_factory
from tests.test_actors import config, wait_idle

if TYPE_CHECKING:
    from pathlib import Path

    from scheduler.types import SchedulerStats

P = "mlx_scheduler_"
Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


def parse(text: str) -> Samples:
    """Every sample of a Prometheus text exposition, keyed by (name, labels)."""
    out: Samples = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            key = (s.name, frozenset(s.labels.items()))
            assert key not in out, f"duplicate sample {key}"
            out[key] = s.value
    return out


def value(samples: Samples, name: str, **labels: str) -> float:
    return samples[(P + name, frozenset(labels.items()))]


async def served_once(model_cache: Path) -> tuple[int, SchedulerStats, Samples, list[dict[str, Any]]]:
    """One short request through a scheduler on `synthetic:tiny`: the tokens it got, then
    `stats()`, the metrics' samples and the log events of the scheduler's whole life."""
    cfg = SchedulerConfig.from_toml(f'[model]\npath = "synthetic:tiny"\ncache_dir = "{model_cache}"')
    with anyio.fail_after(60), capture_logs() as logs:
        async with Scheduler(cfg) as s:
            done = await s.complete([5, 6, 7], SamplingParams(max_tokens=4, ignore_eos=True))
            stats = s.stats()
            samples = parse(s.metrics_text())
    return len(done.token_ids), stats, samples, logs


def check_histogram(samples: Samples, name: str) -> tuple[float, float]:
    """Buckets are cumulative and end in +Inf == _count; returns (count, sum)."""
    buckets = sorted(
        (float(dict(k[1])["le"]), v) for k, v in samples.items() if k[0] == f"{P}{name}_bucket"
    )
    assert buckets, name
    counts = [v for _, v in buckets]
    assert counts == sorted(counts) and buckets[-1][0] == float("inf")
    count = value(samples, f"{name}_count")
    assert buckets[-1][1] == count
    return count, value(samples, f"{name}_sum")


def test_observers_implement_the_whole_protocol() -> None:
    wanted = {n for n, _ in inspect.getmembers(Observer, inspect.isfunction) if not n.startswith("_")}
    assert {"preempted", "prefix_query", "tokens", "finished", "step"} <= wanted
    for cls in (NullObserver, SchedulerMetrics):
        for name in wanted:
            assert inspect.signature(getattr(cls, name)) == inspect.signature(getattr(Observer, name))


def test_histogram_buckets_match_prometheus_client() -> None:
    values = [0.0, 0.001, 0.0010001, 0.04, 0.1, 0.25, 3.0, 2560.0, 1e6]
    reference = CollectorRegistry()
    ref = Histogram("ref_ttft_seconds", "reference", buckets=TTFT_BUCKETS, registry=reference)
    ours = FastHistogram(TTFT_BUCKETS)
    for v in values:
        ref.observe(v)
        ours.observe(v)
    theirs = parse(generate_latest(reference).decode())
    mine = parse(generate_latest(_single(ours)).decode())
    for (name, labels), v in theirs.items():
        if name.startswith("ref_ttft_seconds_") and not name.endswith("_created"):
            assert mine[(name, labels)] == v, (name, labels)


def _single(h: FastHistogram) -> CollectorRegistry:
    class One:
        def collect(self):  # type: ignore[no-untyped-def]
            yield h.family("ref_ttft_seconds", "reference")

    registry = CollectorRegistry(auto_describe=False)
    registry.register(One())  # type: ignore[arg-type]
    return registry


def test_observer_calls_aggregate_and_new_counters_start_at_zero() -> None:
    m = SchedulerMetrics()
    s = parse(m.text())
    assert value(s, "num_preemptions_total") == value(s, "prefix_cache_hits_total") == 0
    assert value(s, "prefix_cache_queries_total") == 0
    assert (P + "num_requests_running", frozenset()) not in s  # no gauges before start
    m.submitted("a", 10)
    m.tokens(1, 0.05, None)
    m.tokens(1, None, 0.02)
    m.tokens(2, None, 0.5)
    m.finished("length", 10, 4, 0.01, 1.2)
    m.rejected("QueueFull")
    m.preempted()
    m.prefix_query(256, 300)
    m.step(3, 0.004, 3)
    s = parse(m.text())
    assert value(s, "generation_tokens_total") == 4
    assert value(s, "request_success_total", finished_reason="length") == 1
    assert value(s, "request_rejected_total", reason="QueueFull") == 1
    assert value(s, "num_preemptions_total") == 1
    assert value(s, "prefix_cache_hits_total") == 256 and value(s, "prefix_cache_queries_total") == 300
    assert check_histogram(s, "inter_token_latency_seconds") == (2, pytest.approx(0.52))
    assert value(s, "inter_token_latency_seconds_bucket", le="0.025") == 1
    assert check_histogram(s, "e2e_request_latency_seconds") == (1, 1.2)
    assert check_histogram(s, "engine_step_seconds") == (1, 0.004)
    assert ITL_BUCKETS[0] == 0.01 and TTFT_BUCKETS[0] == 0.001




@pytest.mark.anyio
async def test_counts_agree_exactly_with_what_was_sent() -> None:
    engine = FakeEngine()
    lengths = [3 + i for i in range(12)]
    prompts = [[i + 1] * (2 + i % 5) for i in range(12)]
    with anyio.fail_after(20):
        async with Scheduler(config(worker={"max_batch": 4}), engine_factory=fake_factory(engine)) as s:
            async with anyio.create_task_group() as tg:
                for p, n in zip(prompts, lengths, strict=True):
                    tg.start_soon(s.complete, p, SamplingParams(max_tokens=n))
            await wait_idle(s)
            samples = parse(s.metrics_text())
            stats = s.stats()
    assert value(samples, "requests_submitted_total") == 12
    assert value(samples, "request_success_total", finished_reason="length") == 12
    assert value(samples, "generation_tokens_total") == sum(lengths)
    assert value(samples, "prompt_tokens_total") == sum(map(len, prompts))
    assert check_histogram(samples, "time_to_first_token_seconds")[0] == 12
    assert check_histogram(samples, "inter_token_latency_seconds")[0] == sum(n - 1 for n in lengths)
    assert check_histogram(samples, "e2e_request_latency_seconds")[0] == 12
    assert check_histogram(samples, "request_queue_time_seconds")[0] == 12
    assert check_histogram(samples, "request_prompt_tokens") == (12, sum(map(len, prompts)))
    assert check_histogram(samples, "request_generation_tokens") == (12, sum(lengths))
    assert check_histogram(samples, "engine_step_seconds")[0] == value(samples, "engine_steps_total")
    assert value(samples, "engine_steps_total") == stats.steps
    for gauge in ("num_requests_running", "num_requests_waiting", "num_requests_in_engine",
                  "kv_cache_usage_perc", "num_preemptions_total", "prefix_cache_hits_total"):
        assert value(samples, gauge) == 0, gauge
    assert value(samples, "kv_cache_blocks_total") == stats.blocks_total > 0


@pytest.mark.anyio
async def test_gauges_rejections_and_other_endings() -> None:
    engine = FakeEngine()
    engine.gate.clear()  # the first request holds the batch until the gate opens
    cfg = config(worker={"max_batch": 1}, scheduler={"max_queue": 2})
    with anyio.fail_after(20):
        async with Scheduler(cfg, engine_factory=fake_factory(engine)) as s:
            async with anyio.create_task_group() as tg:
                tg.start_soon(s.complete, [1], SamplingParams(max_tokens=3))
                while s.stats().running < 1:
                    await anyio.sleep(0.005)
                tg.start_soon(s.complete, [2], SamplingParams(max_tokens=3))
                tg.start_soon(lambda: s.complete([3], SamplingParams(max_tokens=3), timeout=0.2))
                while s.stats().waiting < 2:
                    await anyio.sleep(0.005)
                busy = parse(s.metrics_text())
                for _ in range(2):
                    with pytest.raises(QueueFull):
                        await s.complete([4], SamplingParams(max_tokens=3))
                while s.stats().waiting > 1:  # the timeout ends the third one while queued
                    await anyio.sleep(0.005)
                engine.gate.set()
            await wait_idle(s)
            done = parse(s.metrics_text())
    assert value(busy, "num_requests_running") == 1 and value(busy, "num_requests_waiting") == 2
    assert 0 < value(busy, "kv_cache_usage_perc") <= 1
    assert value(done, "request_rejected_total", reason="QueueFull") == 2
    assert value(done, "request_success_total", finished_reason="length") == 2
    assert value(done, "request_success_total", finished_reason="timeout") == 1
    assert value(done, "requests_submitted_total") == 3
    assert check_histogram(done, "time_to_first_token_seconds")[0] == 2  # the timed-out one had none
    assert value(done, "generation_tokens_total") == 6


@pytest.mark.anyio
async def test_two_schedulers_in_one_process_keep_their_own_registries() -> None:
    with anyio.fail_after(20):
        async with Scheduler(engine_factory=fake_factory(FakeEngine())) as a, \
                Scheduler(engine_factory=fake_factory(FakeEngine())) as b:
            await a.complete([1], SamplingParams(max_tokens=5))
            for _ in range(3):
                await b.complete([1], SamplingParams(max_tokens=2))
            sa, sb = parse(a.metrics_text()), parse(b.metrics_text())
    assert a.metrics.registry is not b.metrics.registry
    assert value(sa, "generation_tokens_total") == 5 and value(sb, "generation_tokens_total") == 6
    assert value(sa, "requests_submitted_total") == 1 and value(sb, "requests_submitted_total") == 3


@pytest.mark.anyio
async def test_observer_runs_on_the_event_loop_thread_only() -> None:
    threads: set[str] = set()
    with anyio.fail_after(20):
        s = Scheduler(engine_factory=fake_factory(FakeEngine()))
        for name in ("submitted", "admitted", "tokens", "finished", "step"):
            original = getattr(s.metrics, name)

            def spy(*args: object, _f=original) -> None:  # type: ignore[no-untyped-def]
                threads.add(threading.current_thread().name)
                _f(*args)

            setattr(s.metrics, name, spy)
        async with s:
            await s.complete([1, 2], SamplingParams(max_tokens=4))
    assert threads == {threading.current_thread().name}


@pytest.mark.integration
@pytest.mark.anyio
async def test_real_engine_counts_agree(model_cache: Path) -> None:
    cfg = SchedulerConfig.from_toml(
        f'[model]\npath = "synthetic:tiny"\ncache_dir = "{model_cache}"\n[worker]\nmax_batch = 8\n'
    )
    lengths = [5 + i for i in range(10)]
    with anyio.fail_after(120):
        async with Scheduler(cfg) as s:
            async with anyio.create_task_group() as tg:
                for i, n in enumerate(lengths):
                    params = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
                    tg.start_soon(s.complete, [3 + i, 4, 5, 6], params)
            await wait_idle(s)
            samples = parse(s.metrics_text())
    assert value(samples, "generation_tokens_total") == sum(lengths)
    assert value(samples, "request_success_total", finished_reason="length") == 10
    assert check_histogram(samples, "time_to_first_token_seconds")[0] == 10
    assert check_histogram(samples, "inter_token_latency_seconds")[0] == sum(n - 1 for n in lengths)
    assert value(samples, "prompt_tokens_total") == 40

"""Prometheus metrics of one scheduler, with vLLM's names and buckets under `mlx_scheduler_`.

`SchedulerMetrics` is an `Observer`: the admission actor calls it on the event loop (never the
worker thread) and it only bumps plain ints and bucket counts (~0.2 us a call, against ~1.3 us for
a `prometheus_client.Histogram`, which takes locks). It is also the collector of a registry of its
own, so two schedulers in one process never collide; gauges are read from the scheduler's stats
when the registry is scraped.
"""

from __future__ import annotations

from bisect import bisect_left
from typing import TYPE_CHECKING, Protocol

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

if TYPE_CHECKING:
    from collections.abc import Callable, Iterator, Sequence

    from prometheus_client.metrics_core import Metric

# vLLM's buckets (vllm/v1/metrics/loggers.py), so dashboards and alerts carry over.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
               10.0, 20.0, 40.0, 80.0)
REQUEST_LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0,
                           50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
TOKEN_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000, 100000)
STEP_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 1.0, 2.5)
DEFAULT_PREFIX = "mlx_scheduler"


class Histogram:
    """Bucket counts and a sum, observed from one thread. Not a registered metric itself."""

    __slots__ = ("bounds", "counts", "total")

    def __init__(self, bounds: Sequence[float]) -> None:
        self.bounds = tuple(float(b) for b in bounds)
        self.counts = [0] * (len(self.bounds) + 1)  # the last one is +Inf
        self.total = 0.0

    def observe(self, value: float) -> None:
        # bisect_left: a value equal to a bound belongs to that bucket (le is inclusive).
        self.counts[bisect_left(self.bounds, value)] += 1
        self.total += value

    @property
    def count(self) -> int:
        return sum(self.counts)

    def family(self, name: str, documentation: str) -> HistogramMetricFamily:
        counts = list(self.counts)  # a copy: a scrape may run on another thread
        buckets: list[tuple[str, float]] = []
        running = 0
        for bound, n in zip((*self.bounds, float("inf")), counts, strict=True):
            running += n
            buckets.append((_le(bound), running))
        return HistogramMetricFamily(name, documentation, buckets=buckets, sum_value=self.total)


def _le(bound: float) -> str:
    return "+Inf" if bound == float("inf") else repr(float(bound))


class GaugeSource(Protocol):
    """What the gauges read at scrape time (`scheduler.SchedulerStats` has all of it)."""

    @property
    def running(self) -> int: ...

    @property
    def waiting(self) -> int: ...

    @property
    def engine_batch(self) -> int: ...

    @property
    def blocks_total(self) -> int: ...

    @property
    def blocks_used(self) -> int: ...

    @property
    def blocks_cached(self) -> int: ...

    @property
    def blocks_padding(self) -> int: ...

    @property
    def kv_bytes(self) -> int: ...

    @property
    def kv_budget_bytes(self) -> int: ...

    @property
    def active_bytes(self) -> int: ...

    @property
    def evictions(self) -> int: ...

    @property
    def session_hits(self) -> int: ...

    @property
    def session_fallbacks(self) -> int: ...

    @property
    def prefix_cache_available(self) -> bool: ...

    @property
    def mask_free_decode(self) -> bool: ...

    @property
    def fused_prefill(self) -> bool: ...

    @property
    def padded_attention(self) -> bool: ...

    @property
    def prefill_thread(self) -> bool: ...

    @property
    def prefill_spread(self) -> bool: ...

    @property
    def host_padding(self) -> bool: ...

    @property
    def cuda_settings_applied(self) -> bool: ...

    @property
    def blas(self) -> str: ...


class SchedulerMetrics:
    """Observer + collector. Call the observer methods from one thread (the event loop); scrape
    (`text()`, or `registry` with any prometheus_client exposition) from any thread."""

    def __init__(
        self,
        gauges: Callable[[], GaugeSource | None] | None = None,
        *,
        prefix: str = DEFAULT_PREFIX,
    ) -> None:
        self._gauges = gauges
        self._p = prefix
        self.submitted_total = 0
        self.rejected_total: dict[str, int] = {}
        self.finished_total: dict[str, int] = {}
        self.prompt_tokens_total = 0
        self.generation_tokens_total = 0
        self.preemptions_total = 0
        self.prefix_queries_total = 0
        self.prefix_hits_total = 0
        self.steps_total = 0
        self.ttft = Histogram(TTFT_BUCKETS)
        self.itl = Histogram(ITL_BUCKETS)
        self.e2e = Histogram(REQUEST_LATENCY_BUCKETS)
        self.queue = Histogram(REQUEST_LATENCY_BUCKETS)
        self.request_prompt_tokens = Histogram(TOKEN_BUCKETS)
        self.request_generation_tokens = Histogram(TOKEN_BUCKETS)
        self.step_seconds = Histogram(STEP_BUCKETS)
        self.iteration_tokens = Histogram(TOKEN_BUCKETS)
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(self)

    # ---- Observer --------------------------------------------------------------------------
    def submitted(self, tenant: str, prompt_tokens: int) -> None:
        self.submitted_total += 1  # no tenant label: tenants are caller-chosen, unbounded

    def rejected(self, reason: str) -> None:
        self.rejected_total[reason] = self.rejected_total.get(reason, 0) + 1

    def admitted(self, queue_s: float) -> None:
        pass  # queue time is observed at the end, as vLLM does, so every request counts once

    def tokens(self, n: int, ttft_s: float | None, itl_s: float | None) -> None:
        self.generation_tokens_total += n
        if ttft_s is not None:
            self.ttft.observe(ttft_s)
        elif itl_s is not None:
            self.itl.observe(itl_s)

    def finished(
        self, reason: str, prompt_tokens: int, completion_tokens: int, queue_s: float, e2e_s: float
    ) -> None:
        self.finished_total[reason] = self.finished_total.get(reason, 0) + 1
        self.prompt_tokens_total += prompt_tokens
        self.e2e.observe(e2e_s)
        self.queue.observe(queue_s)
        self.request_prompt_tokens.observe(prompt_tokens)
        self.request_generation_tokens.observe(completion_tokens)

    def step(self, batch: int, step_s: float, tokens: int) -> None:
        self.steps_total += 1
        self.step_seconds.observe(step_s)
        self.iteration_tokens.observe(tokens)

    def preempted(self) -> None:
        self.preemptions_total += 1

    def prefix_query(self, hit_tokens: int, total_tokens: int) -> None:
        self.prefix_queries_total += total_tokens
        self.prefix_hits_total += hit_tokens

    # ---- exposition ------------------------------------------------------------------------
    def text(self) -> str:
        """The Prometheus text format (version 0.0.4) of this registry."""
        return generate_latest(self.registry).decode("utf-8")

    def collect(self) -> Iterator[Metric]:
        yield from self._gauge_families()
        yield from self._counter_families()
        p = self._p
        yield self.ttft.family(f"{p}_time_to_first_token_seconds",
                               "Time from submission to the first output token.")
        yield self.itl.family(f"{p}_inter_token_latency_seconds",
                              "Time between successive deliveries of output tokens of a request.")
        yield self.e2e.family(f"{p}_e2e_request_latency_seconds",
                              "Time from submission to the end of a request, whatever the reason.")
        yield self.queue.family(f"{p}_request_queue_time_seconds",
                                "Time a request waited before entering the batch.")
        yield self.request_prompt_tokens.family(f"{p}_request_prompt_tokens",
                                                "Prompt tokens per finished request.")
        yield self.request_generation_tokens.family(f"{p}_request_generation_tokens",
                                                    "Output tokens per finished request.")
        yield self.step_seconds.family(f"{p}_engine_step_seconds",
                                       "Duration of one engine step on the worker thread.")
        yield self.iteration_tokens.family(f"{p}_iteration_tokens_total",
                                           "Tokens produced by one engine step.")

    def _counter_families(self) -> Iterator[Metric]:
        p = self._p
        for name, doc, value in (
            ("requests_submitted", "Requests accepted into the queue.", self.submitted_total),
            ("prompt_tokens", "Prompt tokens of finished requests.", self.prompt_tokens_total),
            ("generation_tokens", "Output tokens delivered.", self.generation_tokens_total),
            ("num_preemptions", "Requests preempted to free KV blocks.", self.preemptions_total),
            ("prefix_cache_queries", "Prompt tokens looked up in the prefix cache.",
             self.prefix_queries_total),
            ("prefix_cache_hits", "Prompt tokens found in the prefix cache.", self.prefix_hits_total),
            ("engine_steps", "Engine steps.", self.steps_total),
        ):
            yield CounterMetricFamily(f"{p}_{name}", doc, value=value)
        yield _labelled(f"{p}_request_success", "Finished requests by finish reason "
                        "(stop, length, cancelled, timeout, error).", "finished_reason",
                        self.finished_total)
        yield _labelled(f"{p}_request_rejected", "Requests refused at submission, by error.",
                        "reason", self.rejected_total)

    def _gauge_families(self) -> Iterator[Metric]:
        stats = self._gauges() if self._gauges is not None else None
        if stats is None:
            return  # not started: no gauge rather than a misleading zero
        p = self._p
        usage = stats.blocks_used / stats.blocks_total if stats.blocks_total else 0.0
        for name, doc, value in (
            ("num_requests_running", "Requests admitted and not finished.", stats.running),
            ("num_requests_waiting", "Requests in the waiting queue.", stats.waiting),
            ("num_requests_in_engine", "Sequences the BatchGenerator holds.", stats.engine_batch),
            ("kv_cache_usage_perc", "Fraction of KV blocks in use (1 = full).", usage),
            ("kv_cache_blocks_total", "KV blocks in the pool.", stats.blocks_total),
            ("kv_cache_blocks_cached", "KV blocks held by prefix blocks and session caches.",
             stats.blocks_cached),
            ("kv_cache_blocks_padding", "KV blocks the dense batch cache spends on padding.",
             stats.blocks_padding),
            ("kv_cache_bytes", "Bytes of KV the books hold (used + cached blocks).", stats.kv_bytes),
            ("kv_cache_budget_bytes", "The KV budget: [kvpool] memory less the weights.",
             stats.kv_budget_bytes),
            ("mlx_active_bytes", "MLX's active memory after the last step.", stats.active_bytes),
            ("prefix_cache_available", "1 when the model's caches can share prefix blocks, 0 when "
             "they cannot (sliding-window or recurrent layers).", int(stats.prefix_cache_available)),
            ("mask_free_decode", "1 when decode steps without left padding skip the attention mask "
             "(fused attention), 0 when the model's caches need it.", int(stats.mask_free_decode)),
            ("fused_prefill", "1 when a decode step's forward pass carries the next prefill chunk, "
             "0 when the chunk runs a pass of its own.", int(stats.fused_prefill)),
            ("prefill_thread", "1 when prompts prefill on a thread of their own beside the decode "
             "steps ([worker] prefill_thread), 0 when they prefill inside them.", int(stats.prefill_thread)),
            ("prefill_spread", "1 when each plan's prefill chunk is spread over the decode steps until "
             "the next, a share of the layers each ([worker] prefill_spread), else 0.",
             int(stats.prefill_spread)),
            ("padded_attention", "1 on CUDA when padded decode rows' attention runs one kernel of "
             "ours rather than MLX's unfused masked path, else 0.", int(stats.padded_attention)),
            ("host_padding", "1 when rows that leave the batch do not wait for the device, 0 when "
             "they do, as in mlx-lm's loop (see the host_padding_unavailable log line).",
             int(stats.host_padding)),
            ("cuda_settings_applied", "0 when the scheduler's CUDA settings came after MLX had used the "
             "GPU in this process and do not apply (see the cuda_defaults_late log line), else 1.",
             int(stats.cuda_settings_applied)),
            ("cpu_blas_openblas", "1 when MLX's CPU backend runs float32 matmuls on OpenBLAS, 0 on "
             "the mlx wheel's reference BLAS or Accelerate (see stats().blas_note).",
             int(stats.blas == "openblas")),
        ):
            yield GaugeMetricFamily(f"{p}_{name}", doc, value=value)
        for name, doc, value in (
            ("kv_cache_evictions", "Prefix blocks and session caches evicted to make room.",
             stats.evictions),
            ("session_cache_hits", "Requests that continued a session's cached KV.", stats.session_hits),
            ("session_cache_fallbacks", "Session turns that diverged from a cache that cannot be "
             "trimmed (or whose KV was not kept) and prefilled cold.", stats.session_fallbacks),
        ):
            yield CounterMetricFamily(f"{p}_{name}", doc, value=value)


def _labelled(name: str, doc: str, label: str, values: dict[str, int]) -> CounterMetricFamily:
    family = CounterMetricFamily(name, doc, labels=[label])
    for key, value in sorted(values.items()):  # a copy: the event loop may add a key meanwhile
        family.add_metric([key], value)
    return family

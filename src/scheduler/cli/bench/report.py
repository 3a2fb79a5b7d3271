"""From a run's records to the figures `vllm bench serve` reports: throughput, TTFT, TPOT, ITL,
end-to-end latency and goodput; as its table and as JSON."""

from __future__ import annotations

import math
import statistics

import msgspec

from metrics.summary import percentile
from scheduler.cli.bench.runner import RunResult  # noqa: TC001 - msgspec decodes it at run time

SLO_KEYS = ("ttft", "tpot", "e2e")


class Stat(msgspec.Struct, frozen=True):
    """Milliseconds; NaN when there is no sample."""

    mean: float
    median: float
    p90: float
    p99: float
    std: float
    max: float


def stat(values_s: list[float]) -> Stat:
    if not values_s:
        nan = math.nan
        return Stat(nan, nan, nan, nan, nan, nan)
    ms = [v * 1e3 for v in values_s]
    return Stat(
        mean=statistics.fmean(ms), median=percentile(ms, 50), p90=percentile(ms, 90),
        p99=percentile(ms, 99), std=statistics.pstdev(ms), max=max(ms),
    )


class Details(msgspec.Struct):
    """Per-request figures in seconds (completed requests only), for plots and later analysis."""

    input_lens: list[int]
    output_lens: list[int]
    ttfts: list[float]
    tpots: list[float]
    itls: list[float]
    e2els: list[float]
    sent_at: list[float]


class Report(msgspec.Struct):
    label: str
    target: str
    load: str
    offered: float | None
    """Users (closed loop) or requests/s (open loop); None for an unbounded rate."""
    num_prompts: int
    completed: int
    failed: int
    unsent: int
    cut_off: bool
    duration_s: float
    total_input_tokens: int
    total_output_tokens: int
    request_throughput: float
    output_throughput: float
    total_token_throughput: float
    request_goodput: float | None
    goodput_slos_ms: dict[str, float]
    ttft_ms: Stat
    tpot_ms: Stat
    itl_ms: Stat
    e2el_ms: Stat
    errors: dict[str, int]
    connect_retries: int
    """Connections the target dropped or refused before answering, retried (HTTP only)."""
    details: Details


def parse_goodput(text: str) -> dict[str, float]:
    """`ttft:500,tpot:50,e2e:10000` (milliseconds; commas or spaces) as a dict."""
    slos: dict[str, float] = {}
    for part in text.replace(",", " ").split():
        key, sep, value = part.partition(":")
        key = key.strip().lower()
        if not sep or key not in SLO_KEYS:
            keys = ", ".join(SLO_KEYS)
            raise ValueError(f"bad goodput SLO {part!r}: expected KEY:MS with KEY one of {keys}")
        try:
            ms = float(value)
        except ValueError:
            raise ValueError(f"bad goodput SLO {part!r}: {value!r} is not a number of ms") from None
        if not ms > 0:
            raise ValueError(f"bad goodput SLO {part!r}: must be > 0 ms")
        slos[key] = ms
    if not slos:
        raise ValueError("empty goodput SLOs; e.g. ttft:500,tpot:50")
    return slos


def build_report(run: RunResult, *, label: str, target: str, slos_ms: dict[str, float]) -> Report:
    ok = [r for r in run.records if r.ok]
    failed = [r for r in run.records if r.sent_at >= 0 and not r.ok]
    d = Details(
        input_lens=[r.prompt_tokens for r in ok], output_lens=[r.output_tokens for r in ok],
        ttfts=[r.ttft for r in ok if r.ttft is not None],
        tpots=[(r.e2e - r.ttft) / (r.output_tokens - 1) for r in ok
               if r.ttft is not None and r.output_tokens > 1],
        itls=[x for r in ok for x in r.itl], e2els=[r.e2e for r in ok],
        sent_at=[r.sent_at for r in ok],
    )
    good = None
    if slos_ms:
        good = sum(1 for r in ok if _meets(r.ttft, r.e2e, r.output_tokens, slos_ms)) / run.duration_s
    errors: dict[str, int] = {}
    for r in failed:
        key = (r.error or "failed")[:160]
        errors[key] = errors.get(key, 0) + 1
    n_in, n_out, dur = sum(d.input_lens), sum(d.output_lens), run.duration_s
    offered = run.load.offered
    return Report(
        label=label, target=target, load=run.load.describe(),
        offered=None if math.isinf(offered) else offered, num_prompts=len(run.records),
        completed=len(ok), failed=len(failed), unsent=sum(1 for r in run.records if r.sent_at < 0),
        cut_off=run.cut_off, duration_s=dur, total_input_tokens=n_in, total_output_tokens=n_out,
        request_throughput=len(ok) / dur, output_throughput=n_out / dur,
        total_token_throughput=(n_in + n_out) / dur, request_goodput=good, goodput_slos_ms=slos_ms,
        ttft_ms=stat(d.ttfts), tpot_ms=stat(d.tpots), itl_ms=stat(d.itls), e2el_ms=stat(d.e2els),
        errors=errors, connect_retries=sum(r.retries for r in run.records), details=d,
    )


def _meets(ttft: float | None, e2e: float, out: int, slos: dict[str, float]) -> bool:
    if ttft is None:
        return False
    tpot = (e2e - ttft) / (out - 1) if out > 1 else 0.0
    got = {"ttft": ttft * 1e3, "tpot": tpot * 1e3, "e2e": e2e * 1e3}
    return all(got[k] <= v for k, v in slos.items())


def format_table(r: Report) -> str:
    """The table `vllm bench serve` prints, with the same labels."""
    rows: list[str] = [f"{' Serving Benchmark Result ':=^50}"]

    def row(name: str, value: object) -> None:
        text = f"{value:.2f}" if isinstance(value, float) else str(value)
        rows.append(f"{name:<40} {text:<10}")

    row("Target:", r.target)
    row("Load:", r.load)
    row("Successful requests:", r.completed)
    row("Failed requests:", r.failed)
    if r.connect_retries:
        row("Connect retries:", r.connect_retries)
    if r.unsent:
        row("Requests not sent (time limit):", r.unsent)
    row("Benchmark duration (s):", r.duration_s)
    row("Total input tokens:", r.total_input_tokens)
    row("Total generated tokens:", r.total_output_tokens)
    row("Request throughput (req/s):", r.request_throughput)
    if r.request_goodput is not None:
        row("Request goodput (req/s):", r.request_goodput)
    row("Output token throughput (tok/s):", r.output_throughput)
    row("Total Token throughput (tok/s):", r.total_token_throughput)
    for title, key, s in (("Time to First Token", "TTFT", r.ttft_ms),
                          ("Time per Output Token (excl. 1st token)", "TPOT", r.tpot_ms),
                          ("Inter-token Latency", "ITL", r.itl_ms),
                          ("End-to-end Latency", "E2EL", r.e2el_ms)):
        rows.append(f"{title:-^50}")
        row(f"Mean {key} (ms):", s.mean)
        row(f"Median {key} (ms):", s.median)
        row(f"P99 {key} (ms):", s.p99)
    rows.append("=" * 50)
    for error, count in sorted(r.errors.items(), key=lambda kv: -kv[1])[:5]:
        rows.append(f"  {count} x {error}")
    return "\n".join(rows)


def format_sweep(reports: list[Report]) -> str:
    """One line per load level."""
    head = (f"{'load':<34} {'ok':>5} {'fail':>5} {'req/s':>7} {'out tok/s':>10} {'TTFT p50':>9} "
            f"{'TTFT p99':>9} {'ITL p50':>8} {'ITL p99':>8} {'goodput':>8}")
    lines = [head, "-" * len(head)]
    for r in reports:
        good = "" if r.request_goodput is None else f"{r.request_goodput:.2f}"
        lines.append(
            f"{r.load[:34]:<34} {r.completed:>5} {r.failed:>5} {r.request_throughput:>7.2f} "
            f"{r.output_throughput:>10.1f} {r.ttft_ms.median:>9.1f} {r.ttft_ms.p99:>9.1f} "
            f"{r.itl_ms.median:>8.1f} {r.itl_ms.p99:>8.1f} {good:>8}"
        )
    return "\n".join(lines)

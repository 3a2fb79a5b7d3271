"""The load generator: arrivals, datasets, the report's figures, bounds, and `mlx-scheduler bench`
against our scheduler in-process and against a real `mlx_lm.server` on 127.0.0.1."""

from __future__ import annotations

import math
import os
import random
import statistics
import sys
import time
from typing import TYPE_CHECKING, Any

import anyio
import msgspec
import pytest
import structlog

from scheduler.cli.bench import datasets
from scheduler.cli.bench.mlxlm import MlxLmServer, free_port
from scheduler.cli.bench.report import Report, build_report, format_table, parse_goodput
from scheduler.cli.bench.runner import Load, RunResult, arrival_times, run_arrivals, run_load
from scheduler.cli.bench.spread import run_spread, split
from scheduler.cli.bench.targets import Record, Sampling
from scheduler.cli.main import main
from workers.loading.models import resolve_model

if TYPE_CHECKING:
    from collections.abc import Iterator
    from pathlib import Path

    from scheduler.cli.bench.datasets import RequestSpec


@pytest.fixture
def restore_structlog() -> Iterator[None]:
    saved = structlog.get_config()  # the CLI configures logging for the whole process
    yield
    structlog.configure(**saved)


@pytest.fixture(scope="module")
def maker(model_cache: Path) -> datasets.PromptMaker:
    return datasets.PromptMaker(datasets.load_codec(resolve_model("synthetic:tiny", model_cache)))


def cv(xs: list[float]) -> float:
    gaps = [b - a for a, b in zip([0.0, *xs], xs, strict=False)]
    return statistics.pstdev(gaps) / statistics.fmean(gaps)


def test_arrivals_poisson_gamma_ramp_and_unbounded() -> None:
    poisson = arrival_times(4000, 10.0, 1.0, 0.0, random.Random(1))
    assert poisson == sorted(poisson)
    assert poisson[-1] / 4000 == pytest.approx(0.1, rel=0.05)
    assert cv(poisson) == pytest.approx(1.0, abs=0.08)
    bursty = arrival_times(4000, 10.0, 0.25, 0.0, random.Random(1))  # CV^2 = 1/shape
    assert cv(bursty) == pytest.approx(2.0, rel=0.12)
    assert bursty[-1] / 4000 == pytest.approx(0.1, rel=0.12)
    ramp = arrival_times(4000, 10.0, 1.0, 10.0, random.Random(1))
    early = sum(1 for t in ramp if t < 5.0)  # expected 10 * 5^2 / (2 * 10) = 12.5
    assert 4 <= early <= 25 and sum(1 for t in ramp if 20 <= t < 30) == pytest.approx(100, abs=35)
    assert arrival_times(5, math.inf, 1.0, 0.0, random.Random(0)) == [0.0] * 5


def test_datasets_have_the_asked_lengths_and_are_reproducible(maker: datasets.PromptMaker) -> None:
    fixed = datasets.build("random", maker, num_prompts=30, input_len=50, output_len=7, seed=3)
    assert [s.prompt_tokens for s in fixed] == [50] * 30 and {s.max_tokens for s in fixed} == {7}
    assert all(maker.length(s.prompt) == 50 for s in fixed)
    assert fixed == datasets.build("random", maker, num_prompts=30, input_len=50, output_len=7, seed=3)
    spread = datasets.build("random", maker, num_prompts=200, input_len=100, output_len=20,
                            range_ratio=0.5, seed=1)
    assert all(50 <= s.prompt_tokens <= 150 and 10 <= s.max_tokens <= 30 for s in spread)
    assert len({s.prompt_tokens for s in spread}) > 20
    shared = datasets.build("shared-prefix", maker, num_prompts=12, input_len=10, output_len=5,
                            prefix_len=40, num_prefixes=3, seed=2)
    starts = {s.prompt[:30] for s in shared}
    assert len(starts) == 3 and all(45 <= s.prompt_tokens <= 55 for s in shared)
    chat = datasets.build("chat", maker, num_prompts=400, input_len=100, output_len=50, context=512, seed=4)
    ins = sorted(s.prompt_tokens for s in chat)
    assert 70 <= ins[200] <= 140 and ins[-1] > 2 * ins[200]  # around the median, heavy-tailed
    assert all(s.prompt_tokens + s.max_tokens <= 512 for s in chat)


def test_a_cut_that_re_encodes_longer_is_replaced_by_another(model_cache: Path) -> None:
    # At this seed one cut of synthetic:small's corpus kept merging across its ends: 130 tokens.
    small = datasets.PromptMaker(datasets.load_codec(resolve_model("synthetic:small", model_cache)))
    specs = datasets.build("random", small, num_prompts=512, input_len=128, output_len=4, seed=256)
    assert [s.prompt_tokens for s in specs] == [128] * 512
    assert {small.length(s.prompt) for s in specs} == {128}


def test_goodput_slos_parse_and_reject_nonsense() -> None:
    assert parse_goodput("ttft:500,tpot:50 e2e:1e4") == {"ttft": 500.0, "tpot": 50.0, "e2e": 10000.0}
    for bad in ("ttft", "itl:5", "ttft:x", "ttft:-1", ""):
        with pytest.raises(ValueError):
            parse_goodput(bad)


def test_report_figures_from_known_records() -> None:
    recs = [
        Record(10, 5, sent_at=0.0, done=True, ok=True, output_tokens=5, ttft=0.1, itl=[0.1] * 4, e2e=0.5),
        Record(20, 3, sent_at=0.1, done=True, ok=True, output_tokens=3, ttft=0.3, itl=[0.2, 0.2], e2e=0.7),
        Record(30, 3, sent_at=0.2, done=True, ok=False, error="boom", e2e=0.1),
        Record(40, 3),  # never sent
    ]
    run = RunResult(Load(concurrency=2), recs, 2.0, False)
    r = build_report(run, label="x", target="t", slos_ms={"ttft": 200.0})
    assert (r.completed, r.failed, r.unsent) == (2, 1, 1) and r.errors == {"boom": 1}
    assert (r.total_input_tokens, r.total_output_tokens) == (30, 8)
    assert r.request_throughput == 1.0 and r.output_throughput == 4.0 and r.total_token_throughput == 19.0
    assert r.ttft_ms.mean == pytest.approx(200.0) and r.ttft_ms.p99 == pytest.approx(298.0)
    assert r.tpot_ms.mean == pytest.approx(150.0)  # (0.4/4 + 0.4/2) / 2
    assert r.itl_ms.median == pytest.approx(100.0) and r.e2el_ms.max == pytest.approx(700.0)
    assert r.request_goodput == 0.5  # one of two meets TTFT <= 200 ms, over 2 s
    table = format_table(r)
    for label in ("Successful requests:", "Output token throughput (tok/s):", "Mean TTFT (ms):",
                  "P99 TPOT (ms):", "Median ITL (ms):", "P99 E2EL (ms):", "Request goodput (req/s):"):
        assert label in table


class SleepTarget:
    """Answers after `delay`, one token; tracks how many requests were in flight at once."""

    label = "sleep"

    def __init__(self, delay: float) -> None:
        self.delay, self.now, self.peak = delay, 0, 0

    async def send(self, spec: RequestSpec, sampling: Sampling, rec: Record) -> None:
        self.now += 1
        self.peak = max(self.peak, self.now)
        try:
            await anyio.sleep(self.delay)
            rec.ttft, rec.e2e, rec.output_tokens, rec.ok = self.delay, self.delay, 1, True
        finally:  # as the real targets do, also when cancelled
            rec.done = True
            self.now -= 1


@pytest.mark.anyio
async def test_closed_loop_keeps_n_in_flight_and_runs_stop_at_their_time_limit() -> None:
    specs = [datasets.RequestSpec("p", 1, 1)] * 20
    target = SleepTarget(0.01)
    with anyio.fail_after(10):
        run = await run_load(target, specs, Load(concurrency=3), Sampling(), progress=None)
    assert target.peak == 3 and all(r.ok for r in run.records) and not run.cut_off
    capped = SleepTarget(0.01)
    with anyio.fail_after(10):
        run = await run_load(capped, specs, Load(max_concurrency=4), Sampling(), progress=None)
    assert capped.peak == 4 and all(r.ok for r in run.records)
    slow = SleepTarget(5.0)
    with anyio.fail_after(10):
        run = await run_load(slow, specs, Load(request_rate=20.0, max_duration_s=0.3), Sampling(), progress=None)
    assert run.cut_off and run.duration_s < 1.0
    report = build_report(run, label="x", target="t", slos_ms={})
    assert report.completed == 0 and report.failed >= 1 and report.unsent >= 10
    assert all("cut off" in r.error for r in run.records if r.sent_at >= 0)


def write_config(tmp_path: Path, model_cache: Path) -> str:
    cfg = tmp_path / "tiny.toml"
    cfg.write_text(f'[model]\npath = "synthetic:tiny"\ncache_dir = "{model_cache}"\n[worker]\nmax_batch = 8\n')
    return str(cfg)


FLAGS = ["--num-prompts", "12", "--concurrency", "4", "--input-len", "16", "--output-len", "8",
         "--ignore-eos", "--goodput", "ttft:60000", "--quiet"]


@pytest.mark.integration
def test_bench_in_process_prints_the_table_and_writes_json_and_plots(
    tmp_path: Path, model_cache: Path, capsys: pytest.CaptureFixture[str], restore_structlog: None
) -> None:
    pytest.importorskip("matplotlib")  # the `bench` extra (in `dev` too)
    out = tmp_path / "r.json"
    rc = main(["bench", "--config", write_config(tmp_path, model_cache), *FLAGS, "--json", str(out),
               "--plot", str(tmp_path / "plots")])
    assert rc == 0
    printed = capsys.readouterr().out
    assert "Serving Benchmark Result" in printed and "P99 ITL (ms):" in printed
    (report,) = msgspec.json.decode(out.read_bytes(), type=list[Report])
    assert (report.completed, report.failed, report.total_output_tokens) == (12, 0, 96)
    assert report.total_input_tokens == 12 * 16 and report.request_goodput is not None
    assert len(report.details.itls) == 12 * 7
    assert (tmp_path / "plots" / "latency_cdf.png").stat().st_size > 10_000


@pytest.mark.integration
def test_bench_drives_mlx_lm_server_with_the_same_flags(
    tmp_path: Path, model_cache: Path, capsys: pytest.CaptureFixture[str], restore_structlog: None
) -> None:
    pytest.importorskip("httpx")  # the `bench` extra (in `dev` too)
    out = tmp_path / "r.json"
    model_dir = resolve_model("synthetic:tiny", model_cache)
    with MlxLmServer(model_dir, decode_concurrency=4, log_path=tmp_path / "server.log",
                     start_timeout_s=60) as server:
        rc = main(["bench", "--url", server.url, "--config", write_config(tmp_path, model_cache),
                   "--model", "synthetic:tiny", *FLAGS, "--json", str(out), "--max-duration", "60"])
    assert rc == 0
    assert "Serving Benchmark Result" in capsys.readouterr().out
    (report,) = msgspec.json.decode(out.read_bytes(), type=list[Report])
    assert report.target == server.url + "/v1/completions"
    assert (report.completed, report.failed, report.total_input_tokens) == (12, 0, 12 * 16)
    assert 0 < report.total_output_tokens <= 96  # mlx_lm.server has no ignore_eos: EOS may stop one
    assert report.ttft_ms.p99 > 0 and report.itl_ms.median > 0


def test_a_run_splits_over_client_processes_as_one_client_would_send_it() -> None:
    specs = [datasets.RequestSpec(f"p{i}", 4, 8) for i in range(10)]
    closed = split(specs, Load(concurrency=5), 3)
    assert [ids for ids, _, _ in closed] == [[0, 3, 6, 9], [1, 4, 7], [2, 5, 8]]
    assert [part.concurrency for _, part, _ in closed] == [2, 2, 1] and all(t is None for _, _, t in closed)
    whole = run_arrivals(10, (opened := Load(request_rate=20.0, burstiness=0.5, max_concurrency=4, seed=3)))
    parts = split(specs, opened, 3)
    assert sorted(i for ids, _, _ in parts for i in ids) == list(range(10))
    for ids, part, times in parts:  # the one schedule of the whole run, shared out
        assert times == [whole[i] for i in ids] and part.request_rate == 20.0
    assert sum(part.max_concurrency or 0 for _, part, _ in parts) == 4
    # Never more processes than requests, users, or requests allowed in flight.
    assert len(split(specs[:2], Load(concurrency=8), 4)) == 2
    assert len(split(specs, Load(concurrency=1), 4)) == 1
    assert len(split(specs, Load(max_concurrency=2), 4)) == 2


@pytest.mark.integration
def test_bench_sends_from_several_client_processes(
    tmp_path: Path, model_cache: Path, capsys: pytest.CaptureFixture[str], restore_structlog: None
) -> None:
    pytest.importorskip("httpx")
    import subprocess

    import httpx

    port = free_port()
    cfg = write_config(tmp_path, model_cache)
    server = subprocess.Popen([sys.executable, "-m", "scheduler.cli.main", "serve", "--config", cfg, "--port",
                               str(port)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        for _ in range(240):
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.25)
        out = tmp_path / "r.json"
        flags = [f for f in FLAGS if f != "--quiet"]
        rc = main(["bench", "--url", url, "--config", cfg, "--model", "synthetic:tiny", *flags, "--clients", "2",
                   "--json", str(out)])
        assert rc == 0
        assert "2 client processes: 12/12 done" in capsys.readouterr().err
        (report,) = msgspec.json.decode(out.read_bytes(), type=list[Report])
        assert (report.completed, report.failed, report.total_output_tokens) == (12, 0, 96)
        assert 0 < len(report.details.itls) <= 12 * 7  # a gap per event; an event may carry several tokens

        # The processes are others than this one, and an open loop keeps its one schedule.
        specs = [datasets.RequestSpec("hello there", 3, 4) for _ in range(6)]
        load = Load(request_rate=40.0, seed=1)
        run, pids = run_spread(url, None, 5.0, specs, load, Sampling(ignore_eos=True), 3)
        assert len(set(pids)) == 3 and os.getpid() not in pids
        assert all(r.ok and r.output_tokens == 4 for r in run.records)
        for rec, at in zip(run.records, run_arrivals(6, load), strict=True):
            assert at <= rec.sent_at < at + 1.0, (rec.sent_at, at)
    finally:
        server.terminate()
        server.wait(timeout=30)


@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["asyncio"])  # uvicorn runs on asyncio only
async def test_a_malformed_event_fails_its_request_and_the_run_goes_on() -> None:
    pytest.importorskip("httpx")
    from starlette.applications import Starlette
    from starlette.responses import StreamingResponse
    from starlette.routing import Route

    from scheduler.cli.bench.targets import OpenAITarget, http_client
    from tests.test_server import uvicorn_serving

    async def completions(request: Any) -> StreamingResponse:
        body = await request.json()
        good = b'data: {"choices": [{"text": "hi", "finish_reason": "length"}]}\n\ndata: [DONE]\n\n'
        events = {"[1]": b"data: [1]\n\n", "{oops": b"data: {oops\n\n"}.get(body["prompt"], good)
        return StreamingResponse(iter([events]), media_type="text/event-stream")

    app = Starlette(routes=[Route("/v1/completions", completions, methods=["POST"])])
    specs = [datasets.RequestSpec(p, 1, 2) for p in ("fine", "{oops", "[1]", "fine too")]
    async with uvicorn_serving(app) as url, http_client(30) as client:
        run = await run_load(OpenAITarget(client, url), specs, Load(concurrency=2), Sampling(), progress=None)
    assert [r.ok for r in run.records] == [True, False, False, True] and all(r.done for r in run.records)
    assert "malformed event '{oops'" in run.records[1].error and "JSONDecodeError" in run.records[1].error
    assert "malformed event '[1]'" in run.records[2].error and "AttributeError" in run.records[2].error


def test_bad_invocations_fail_fast_with_one_clear_line(
    tmp_path: Path, model_cache: Path, capsys: pytest.CaptureFixture[str], restore_structlog: None,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    cfg = write_config(tmp_path, model_cache)
    assert main(["bench", "--url", "http://127.0.0.1:9", "--quiet"]) == 2
    assert "needs --model or --tokenizer" in capsys.readouterr().err
    assert main(["bench", "--config", cfg, "--concurrency", "2", "--request-rate", "3"]) == 2
    assert "not both" in capsys.readouterr().err
    assert main(["bench", "--config", cfg, "--goodput", "itl:3"]) == 2
    assert "goodput" in capsys.readouterr().err
    assert main(["bench", "--config", cfg, "--clients", "2", "--num-prompts", "2", "--quiet"]) == 2
    assert "--clients needs --url" in capsys.readouterr().err
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # as if it were not installed
    assert main(["bench", "--config", cfg, "--plot", str(tmp_path)]) == 2
    assert "pip install 'mlx-scheduler[bench]'" in capsys.readouterr().err
    port = free_port()  # nothing listens there: the warm-up request fails after --connect-retry
    rc = main(["bench", "--config", cfg, "--url", f"http://127.0.0.1:{port}", "--model", "synthetic:tiny",
               "--connect-retry", "0.5", "--num-prompts", "2", "--quiet"])
    assert rc == 2 and "warm-up request" in capsys.readouterr().err

"""`mlx-scheduler bench`: the arguments and the thin driver around the bench library."""

from __future__ import annotations

import argparse
import importlib.util
import math
import sys
from pathlib import Path
from typing import TYPE_CHECKING

import anyio
import msgspec

from scheduler.cli.bench import datasets, plots
from scheduler.cli.bench.report import Report, build_report, format_sweep, format_table, parse_goodput
from scheduler.cli.bench.runner import Load, RunResult, run_load
from scheduler.cli.bench.spread import SpreadError, run_spread
from scheduler.cli.bench.targets import OpenAITarget, Record, Sampling, SchedulerTarget, Target, http_client

if TYPE_CHECKING:
    from typing import TextIO

    from scheduler.config import SchedulerConfig


class BenchError(Exception):
    """A bad argument or an unreachable target: printed as one line, exit status 2."""


def _rates(text: str) -> list[float]:
    try:
        rates = [math.inf if p.strip() == "inf" else float(p) for p in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected rates like 2,4,inf; got {text!r}") from None
    if not rates or any(not r > 0 for r in rates):
        raise argparse.ArgumentTypeError(f"request rates must be > 0, got {text!r}")
    return rates


def _positive(text: str) -> int:
    (value,) = _ints(text) if "," not in text else (0,)
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {text!r}")
    return value


def _ints(text: str) -> list[int]:
    try:
        values = [int(p) for p in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected integers like 1,8,32; got {text!r}") from None
    if any(v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"expected integers >= 1, got {text!r}")
    return values


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The bench flags (`--config`/`--model` are added by the caller, as for every command)."""
    t = p.add_argument_group("target (default: our scheduler in this process, from --config/--model)")
    t.add_argument("--url", help="an OpenAI-compatible server, e.g. http://127.0.0.1:8080 "
                   "(streaming /v1/completions); --model or --tokenizer then only sizes the prompts")
    t.add_argument("--served-model-name", metavar="NAME", help="the 'model' field sent to --url")
    t.add_argument("--connect-retry", type=float, default=30.0, metavar="S",
                   help="--url: retry refused or dropped connections for up to S seconds")
    t.add_argument("--clients", type=_positive, default=1, metavar="N",
                   help="with --url: send from N client processes, each with a share of the requests "
                        "(one Python client reads at most about 10,000 streamed tokens a second)")
    t.add_argument("--tokenizer", metavar="PATH", help="model dir or synthetic:NAME whose tokenizer "
                   "sizes the prompts (default: --model)")
    d = p.add_argument_group("workload")
    d.add_argument("--dataset", choices=datasets.DATASETS, default="random")
    d.add_argument("--num-prompts", type=_positive, default=100, metavar="N", help="requests per run")
    d.add_argument("--input-len", "--random-input-len", type=_positive, default=128, metavar="N",
                   help="prompt tokens (mean; median for chat)")
    d.add_argument("--output-len", "--random-output-len", type=_positive, default=64, metavar="N",
                   help="max_tokens (mean; median for chat)")
    d.add_argument("--range-ratio", "--random-range-ratio", type=float, default=0.0, metavar="R",
                   help="lengths uniform in len*(1-R)..len*(1+R)")
    d.add_argument("--prefix-len", type=_positive, default=256, metavar="N", help="shared-prefix: its tokens")
    d.add_argument("--num-prefixes", type=_positive, default=4, metavar="N", help="shared-prefix: how many")
    d.add_argument("--temperature", type=float, default=0.0)
    d.add_argument("--ignore-eos", action="store_true", help="generate max_tokens whatever the model says")
    d.add_argument("--seed", type=int, default=0)
    lo = p.add_argument_group("load (a comma list of rates or concurrencies runs a sweep)")
    lo.add_argument("--request-rate", type=_rates, default=[math.inf], metavar="R",
                    help="open loop: requests/s, Poisson arrivals (default inf: all at once)")
    lo.add_argument("--burstiness", type=float, default=1.0, help="gamma shape of arrivals (1 = Poisson)")
    lo.add_argument("--concurrency", type=_ints, metavar="N", help="closed loop: N users back to back")
    lo.add_argument("--max-concurrency", type=_positive, metavar="N", help="open loop: most in flight")
    lo.add_argument("--ramp-up", type=float, default=0.0, metavar="S", help="seconds to reach the full load")
    lo.add_argument("--max-duration", type=float, default=600.0, metavar="S", help="hard limit per run")
    lo.add_argument("--warmup", type=int, default=1, metavar="N", help="untimed requests sent first")
    o = p.add_argument_group("output")
    o.add_argument("--goodput", metavar="SLOS", help="e.g. ttft:500,tpot:50,e2e:10000 (ms)")
    o.add_argument("--json", metavar="FILE", help="write the report(s) as JSON")
    o.add_argument("--plot", metavar="DIR", help="write PNG plots (needs matplotlib)")
    o.add_argument("--label", help="a name for the run in tables and plots")
    o.add_argument("--quiet", action="store_true", help="no live progress")


async def _spread(target: OpenAITarget, args: argparse.Namespace, specs: list[datasets.RequestSpec],
                  load: Load, sampling: Sampling, progress: TextIO | None) -> RunResult:
    try:
        run, pids = await anyio.to_thread.run_sync(run_spread, target.url, args.served_model_name,
                                                   args.connect_retry, specs, load, sampling, args.clients,
                                                   progress)
    except SpreadError as exc:
        raise BenchError(str(exc)) from None
    if progress is not None:
        done = sum(1 for r in run.records if r.done)
        print(f"{len(pids)} client processes: {done}/{len(specs)} done in {run.duration_s:.1f} s",
              file=progress)
    return run


def loads(args: argparse.Namespace) -> list[Load]:
    if args.concurrency and args.request_rate != [math.inf]:
        raise BenchError("choose --concurrency (closed loop) or --request-rate (open loop), not both")
    if not args.burstiness > 0 or args.ramp_up < 0 or not args.max_duration > 0:
        raise BenchError("--burstiness and --max-duration must be > 0 and --ramp-up >= 0")
    if not 0 <= args.range_ratio < 1 or args.temperature < 0 or args.warmup < 0:
        raise BenchError("--range-ratio must be in [0, 1), --temperature and --warmup >= 0")
    common = dict(burstiness=args.burstiness, max_concurrency=args.max_concurrency,
                  ramp_up_s=args.ramp_up, max_duration_s=args.max_duration, seed=args.seed)
    if args.concurrency:
        return [Load(concurrency=n, **common) for n in args.concurrency]
    return [Load(request_rate=r, **common) for r in args.request_rate]


def main(args: argparse.Namespace, config: SchedulerConfig) -> int:
    try:
        reports = _main(args, config)
    except BenchError as exc:
        print(f"mlx-scheduler bench: error: {exc}", file=sys.stderr)
        return 2
    return 0 if all(r.completed for r in reports) else 1


def _main(args: argparse.Namespace, config: SchedulerConfig) -> list[Report]:
    if args.plot:
        try:
            plots.require_matplotlib()
        except RuntimeError as exc:
            raise BenchError(str(exc)) from None
    try:
        slos = parse_goodput(args.goodput) if args.goodput else {}
    except ValueError as exc:
        raise BenchError(str(exc)) from None
    levels = loads(args)
    specs = _dataset(args, config)
    reports = anyio.run(_run_all, args, config, specs, levels, slos)
    for r in reports:
        print(format_table(r))
    if len(reports) > 1:
        print(format_sweep(reports))
    if args.json:
        Path(args.json).write_bytes(msgspec.json.format(msgspec.json.encode(reports)))
        print(f"wrote {args.json}")
    if args.plot:
        out = Path(args.plot)
        out.mkdir(parents=True, exist_ok=True)
        written = [plots.latency_cdfs(reports, out / "latency_cdf.png")]
        if len(reports) > 1:
            x = "concurrent users" if args.concurrency else "offered load (requests/s)"
            written.append(plots.load_sweep(reports, out / "load_sweep.png", x_label=x))
        print("wrote " + ", ".join(str(p) for p in written))
    return reports


def _dataset(args: argparse.Namespace, config: SchedulerConfig) -> list[datasets.RequestSpec]:
    from workers.loading.cachedir import ModelSourceError
    from workers.loading.models import resolve_model

    source = args.tokenizer or args.model or (None if args.url else config.model.path)
    if source is None:
        raise BenchError("bench --url needs --model or --tokenizer (a model dir or synthetic:NAME) "
                         "to build prompts of the right token lengths")
    try:
        model_dir = resolve_model(source, config.model.cache_dir)
        maker = datasets.PromptMaker(datasets.load_codec(model_dir))
    except (ModelSourceError, OSError) as exc:
        raise BenchError(f"cannot load a tokenizer from {source!r}: {exc}") from None
    return datasets.build(
        args.dataset, maker, num_prompts=args.num_prompts, input_len=args.input_len,
        output_len=args.output_len, range_ratio=args.range_ratio, prefix_len=args.prefix_len,
        num_prefixes=args.num_prefixes, context=datasets.model_context(model_dir), seed=args.seed,
    )


async def _run_all(
    args: argparse.Namespace, config: SchedulerConfig, specs: list[datasets.RequestSpec],
    levels: list[Load], slos: dict[str, float],
) -> list[Report]:
    sampling = Sampling(temperature=args.temperature, ignore_eos=args.ignore_eos)
    if args.url:
        if importlib.util.find_spec("httpx") is None:
            raise BenchError("--url needs httpx: pip install 'mlx-scheduler[bench]'")
        async with http_client(args.max_duration) as client:
            target = OpenAITarget(client, args.url, model=args.served_model_name,
                                  connect_retry_s=args.connect_retry)
            return await _levels(target, args, specs, levels, sampling, slos)
    if args.clients > 1:
        raise BenchError("--clients needs --url: the scheduler in this process is driven without a "
                         "network client")
    from scheduler.api import Scheduler

    async with Scheduler(config) as sched:
        return await _levels(SchedulerTarget(sched), args, specs, levels, sampling, slos)


async def _levels(
    target: Target, args: argparse.Namespace, specs: list[datasets.RequestSpec], levels: list[Load],
    sampling: Sampling, slos: dict[str, float],
) -> list[Report]:
    for spec in specs[: args.warmup]:
        rec = Record(spec.prompt_tokens, spec.max_tokens)
        await target.send(datasets.RequestSpec(spec.prompt, spec.prompt_tokens, min(8, spec.max_tokens)),
                          sampling, rec)
        if not rec.ok:
            raise BenchError(f"the warm-up request to {target.label} failed: {rec.error}")
    reports = []
    for load in levels:
        progress = None if args.quiet else sys.stderr
        if progress is not None:
            print(f"{target.label}: {len(specs)} requests, {load.describe()}", file=progress)
        if args.clients > 1 and isinstance(target, OpenAITarget):
            run = await _spread(target, args, specs, load, sampling, progress)
        else:
            run = await run_load(target, specs, load, sampling, progress=progress)
        label = load.describe() if not args.label else (
            args.label if len(levels) == 1 else f"{args.label} {load.describe()}")
        reports.append(build_report(run, label=label, target=target.label, slos_ms=slos))
    return reports

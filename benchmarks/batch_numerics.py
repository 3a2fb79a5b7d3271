"""Greedy output of mlx-lm's bare `BatchGenerator` against mlx-lm alone, by batching pattern.

We once saw 2 of 12 greedy 150-token outputs of a 4-bit gemma3 model differ from mlx-lm alone
under the scheduler's default `step_token_budget = "auto"`. This script takes the scheduler out:
each prompt alone (`generate_step`) is the reference, then the bare `BatchGenerator` runs the same
prompts (a) one at a time, (b) six of one length together, (c) six of mixed lengths together,
(d) the mixed ones joining a decoding batch one every 5 steps, (e) all together in prefill chunks of
64 tokens (what a step budget does). Models: gemma3 (text_config layout; sliding-window layers)
in float32, bfloat16 and 4-bit, the bfloat16 and 4-bit ones again with a window wider than any
sequence (same weights), and `synthetic:small` (qwen2, bfloat16, full attention only).

    python benchmarks/batch_numerics.py [--tokens 40] [--prompts 6]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import random
import shutil
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
PATTERNS = ("alone in a batch", "same length", "mixed lengths", "joining", "prefill chunks of 64")


def _layered() -> Any:
    spec = importlib.util.spec_from_file_location("layered_models", ROOT / "tests" / "layered_models.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault(spec.name, module)
    spec.loader.exec_module(module)
    return module


def models(cache: Path) -> dict[str, Path]:
    from mlx_lm import convert

    from workers.loading.models import resolve_model

    layered = _layered()
    out = {f"gemma3 {d}": layered.build("gemma3", cache, dtype=d) for d in ("float32", "bfloat16")}
    q4 = cache / "layered" / "gemma3-bfloat16-s0-q4"
    if not q4.is_dir():
        convert(str(out["gemma3 bfloat16"]), mlx_path=str(q4), quantize=True, q_bits=4, q_group_size=32)
    out["gemma3 4-bit"] = q4
    # The same weights with a window wider than any sequence: the sliding layers never slide.
    for name in ("gemma3 bfloat16", "gemma3 4-bit"):
        out[f"{name}, window 4096"] = _wide(out[name])
    out["qwen2 bfloat16"] = resolve_model("synthetic:small", cache)
    return out


def _wide(path: Path) -> Path:
    wide = path.with_name(path.name + "-wide")
    if not wide.is_dir():
        shutil.copytree(path, wide)
        config = json.loads((wide / "config.json").read_text())
        config["text_config"]["sliding_window"] = 4096
        (wide / "config.json").write_text(json.dumps(config))
    return wide


def generate(model: Any, prompts: list[list[int]], n: int, *, join_every: int = 0,
             prefill_step: int = 2048) -> list[list[int]]:
    """Greedy tokens of each prompt from one bare BatchGenerator; all inserted at once, or one
    every `join_every` steps."""
    from mlx_lm.generate import BatchGenerator

    gen = BatchGenerator(model, max_tokens=n, stop_tokens=None, prefill_step_size=prefill_step)
    out: dict[int, list[int]] = {}
    uids: dict[int, int] = {}
    pending = list(range(len(prompts)))
    step = 0
    while pending or any(len(v) < n for v in out.values()):
        if pending and (join_every == 0 or step % join_every == 0):
            take = pending if join_every == 0 else pending[:1]
            pending = pending[len(take):]
            for i, uid in zip(take, gen.insert([prompts[i] for i in take], max_tokens=[n] * len(take)),
                              strict=True):
                uids[uid], out[i] = i, []
        step += 1
        for r in gen.next()[1]:
            out[uids[r.uid]].append(int(r.token))
    gen.close()
    return [out[i][:n] for i in range(len(prompts))]


def first_differences(got: list[list[int]], want: list[list[int]]) -> list[tuple[int, int]]:
    return [(i, next(j for j, (x, y) in enumerate(zip(a, b, strict=True)) if x != y))
            for i, (a, b) in enumerate(zip(got, want, strict=True)) if a != b]


def run(path: Path, n: int, count: int, seed: int) -> dict[str, Any]:
    import mlx.core as mx
    import mlx_lm
    from mlx_lm.generate import generate_step

    model, _ = mlx_lm.load(str(path))
    rng = random.Random(seed)
    mixed = [[rng.randrange(3, 1000) for _ in range(rng.randint(20, 300))] for _ in range(count)]
    same = [[rng.randrange(3, 1000) for _ in range(100)] for _ in range(count)]

    def alone(prompts: list[list[int]]) -> list[list[int]]:
        return [[int(t) for t, _ in generate_step(mx.array(p), model, max_tokens=n)] for p in prompts]

    want_mixed, want_same = alone(mixed), alone(same)
    got = {
        "alone in a batch": [generate(model, [p], n)[0] for p in mixed],
        "same length": generate(model, same, n),
        "mixed lengths": generate(model, mixed, n),
        "joining": generate(model, mixed, n, join_every=5),
        "prefill chunks of 64": generate(model, mixed, n, prefill_step=64),
    }
    return {k: first_differences(v, want_same if k == "same length" else want_mixed) for k, v in got.items()}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=40)
    ap.add_argument("--prompts", type=int, default=6)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--cache-dir", default=None)
    ap.add_argument("--out", default="benchmarks/results/batch_numerics.json")
    args = ap.parse_args(argv)
    from workers.loading import synthetic

    cache = synthetic.cache_root(args.cache_dir)
    results: dict[str, Any] = {}
    for name, path in models(cache).items():
        started = time.perf_counter()
        results[name] = run(path, args.tokens, args.prompts, args.seed)
        print(f"  {name}: {time.perf_counter() - started:.0f} s", flush=True)
    print(f"\nrows of {args.prompts} whose {args.tokens} greedy tokens differ from mlx-lm alone "
          "(row: first differing token)")
    print(f"{'model':<28} " + " ".join(f"{p:>21}" for p in PATTERNS))
    for name, r in results.items():
        cells = [", ".join(f"{i}:{j}" for i, j in r[p]) or "identical" for p in PATTERNS]
        print(f"{name:<28} " + " ".join(f"{c:>21}" for c in cells))
    path = Path(args.out)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"args": vars(args), "results": results, "date": time.strftime("%Y-%m-%d")},
                               indent=1))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()

"""How much a prefill chunk adds to a decode step's graph, carried whole or spread over steps.

On a GPU a step that carries a chunk costs the host what it hands MLX to evaluate: every graph
node, views included, costs the host in `mx.async_eval` (docs/stalls.md), and that, more than the
arithmetic, is what a carrying step adds to a decode step there. `[worker] prefill_spread` spreads
a plan's chunk over the steps until the next plan, a share of the layers each (`fused.carry`).
This counts the primitives each graph holds, on this backend:

- `mlx-lm decode`: a decode step as mlx-lm's model runs it (`model(inputs, cache=...)`);
- `decode`: the decode rows alone through `fused.carry`'s layers (a 2-D pass: no reshapes around
  each projection), as a spread step runs the layers it carries no chunk through;
- `whole`: a step carrying a chunk through every layer, as `prefill_spread = false` does;
- `spread N`: each of N steps carrying a share of the layers.

A graph's size depends on the layers, their kinds and the backend, not on their widths, so the
models are narrow copies of real layouts, 256 wide in heads of 64 (`--layout`): `llama-1b`
(Llama-3.2-1B's 16 llama blocks) and `qwen-0.5b` (Qwen2.5-0.5B's 24 qwen2 blocks); on CUDA in
bfloat16, with our padded decode attention, as the engine serves them. The chunk: `--prompts`
prompts of 64-512 tokens (seeded), padded on the left to the longest and ragged where that pays,
as a whole-prompt plan is; `--rows` decode rows of mixed left padding.

    python benchmarks/carry_graph.py --layout llama-1b qwen-0.5b --spread 2 4
"""

from __future__ import annotations

import argparse
import collections
import json
import random
import re
import tempfile
from pathlib import Path
from typing import Any

# First: OpenBLAS (workers/blas.py) binds only if it is loaded before MLX.
import workers  # noqa: F401

# isort: split
import mlx.core as mx
from mlx_lm.models import llama, qwen2
from mlx_lm.models.base import create_attention_mask
from mlx_lm.models.cache import BatchKVCache

from workers.batching import fused
from workers.batching.hostpad import host_padded
from workers.batching.padded_attention import install as install_padded_attention
from workers.loading.dtypes import on_cuda

LAYOUTS = {"llama-1b": ("llama", 16), "qwen-0.5b": ("qwen2", 24), "llama-4": ("llama", 4)}
"""(block kind, layers) of the real layouts counted, and a small one for tests."""


def narrow(layout: str) -> Any:
    """A model of `layout`'s blocks, 128 wide (heads of 64, as the real ones'), random weights.
    On CUDA in bfloat16 with our padded decode attention installed, as the engine serves it."""
    kind, layers = LAYOUTS[layout]
    shape: dict[str, Any] = dict(hidden_size=256, num_hidden_layers=layers, intermediate_size=256,
                                 num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-5,
                                 vocab_size=512)
    module = llama if kind == "llama" else qwen2
    model = module.Model(module.ModelArgs(model_type=kind, **shape))
    if on_cuda():
        model.set_dtype(mx.bfloat16)
        unavailable = install_padded_attention(model)
        if unavailable:
            print(f"our padded decode attention is not installed: {unavailable}")
    mx.eval(model.parameters())
    return model


def primitives(arrays: list[mx.array]) -> collections.Counter[str]:
    """The primitives MLX would evaluate for `arrays` (what is computed already is not counted)."""
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "graph.dot"
        mx.export_to_dot(str(path), *arrays)
        return collections.Counter(re.findall(r'label ?="([A-Za-z0-9_]+)"', path.read_text()))


def decoding(model: Any, rows: int) -> list[Any]:
    """Batch caches of `rows` rows that hold 20 positions, left-padded by 0-4, computed."""
    padding = [r % 5 for r in range(rows)]
    caches = [BatchKVCache(padding) for _ in model.model.layers]
    model(mx.array([[1] * 20] * rows), cache=caches)
    mx.eval([c.state for c in caches])
    return host_padded(caches, padding)  # as the engine's decode rows hold them


def plan(prompts: int, seed: int = 0) -> tuple[fused.Chunk, list[int]]:
    """A whole-prompt plan's chunk, padded on the left, and each prompt's padding."""
    rng = random.Random(seed)
    tokens = [[rng.randrange(3, 500) for _ in range(rng.randint(64, 512))] for _ in range(prompts)]
    length = max(len(t) for t in tokens)
    chunk = mx.array([[0] * (length - len(t)) + t for t in tokens])
    return fused.Chunk(chunk, False, fused.ragged(tokens, length, left=True)), [length - len(t) for t in tokens]


def flat_decode(model: Any, inputs: mx.array, caches: list[Any]) -> mx.array:
    """The decode rows' logits through `fused.decode_layer`, every layer (no chunk anywhere)."""
    inner = model.model
    rows = inputs.shape[0]
    hidden = inner.embed_tokens(inputs)
    mask = create_attention_mask(hidden, caches[0])
    x = hidden.reshape(rows, -1)
    for layer, cache in zip(inner.layers, caches, strict=True):
        x = fused.decode_layer(layer, x, rows, cache, mask)
    return fused.logits_of(model, x)


def carried(model: Any, rows: int, prompts: int, passes: int, pad_rows: int) -> list[collections.Counter[str]]:
    """The primitives of each step that carries one plan's chunk over `passes` steps."""
    chunk, padding = plan(prompts)
    caches = decoding(model, rows)
    chunk_caches = [BatchKVCache([0] * len(padding)) for _ in model.model.layers]
    for c in chunk_caches:
        c.prepare(left_padding=padding)
    state = fused.Carry(chunk, passes)
    inputs = mx.array([[3]] * rows)
    out = []
    while not state.through(len(chunk_caches)):
        logits = fused.carry(model, inputs, caches, state, chunk_caches, pad_rows)
        assert logits is not None
        held = [a for c in chunk_caches if c.keys is not None for a in (c.keys, c.values)]
        kept = [] if state.hidden is None else [state.hidden]
        out.append(primitives([logits, *[c.keys for c in caches], *held, *kept]))
        mx.eval(logits, held, kept)
    return out


def counts(model: Any, rows: int, prompts: int, spreads: list[int], pad_rows: int) -> dict[str, list[int]]:
    """Primitives a step, per graph (`mlx-lm decode`, `decode`, `whole`, `spread N`: one a step)."""
    caches = decoding(model, rows)
    logits = model(mx.array([[3]] * rows), cache=caches)
    out = {"mlx-lm decode": [sum(primitives([logits, *[c.keys for c in caches]]).values())]}
    mx.eval(logits)
    caches = decoding(model, rows)
    logits = flat_decode(model, mx.array([[3]] * rows), caches)
    out["decode"] = [sum(primitives([logits, *[c.keys for c in caches]]).values())]
    mx.eval(logits)
    for passes in [1, *spreads]:
        out["whole" if passes == 1 else f"spread {passes}"] = [
            sum(c.values()) for c in carried(model, rows, prompts, passes, pad_rows)]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layout", nargs="+", default=["llama-1b", "qwen-0.5b"], choices=sorted(LAYOUTS))
    ap.add_argument("--rows", type=int, default=64)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--spread", type=int, nargs="+", default=[2, 3, 4])
    ap.add_argument("--pad-rows", type=int, default=64, help="as prefill_pad = 64 (CUDA's) rounds a pass's rows")
    ap.add_argument("--out", default="benchmarks/results/carry_graph.json")
    args = ap.parse_args()
    results: dict[str, Any] = {"backend": str(mx.default_device()), "rows": args.rows, "prompts": args.prompts}
    for layout in args.layout:
        got = counts(narrow(layout), args.rows, args.prompts, args.spread, args.pad_rows)
        results[layout] = got
        base = got["mlx-lm decode"][0]
        print(f"\n{layout} ({LAYOUTS[layout][1]} {LAYOUTS[layout][0]} blocks), {args.rows} decode rows, "
              f"a plan of {args.prompts} prompts, on {mx.default_device()}: primitives a step (x mlx-lm's decode step)")
        for name, steps in got.items():
            cells = ", ".join(f"{n} ({n / base:.2f}x)" for n in steps)
            print(f"  {name:<14} {cells}")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(results, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()

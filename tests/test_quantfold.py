"""Folding a decode batch into one quantized product changes the kernel, not the results."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.generate import BatchGenerator

from workers.batching.quantfold import fold_decode_batch, unfold_decode_batch
from workers.cuda import WARM_ROWS, WARM_TOKENS, warm_kernels
from workers.loading.dtypes import quantized_layers
from workers.loading.models import load_model, resolve_model

if TYPE_CHECKING:
    from pathlib import Path


def _greedy(model: Any, prompts: list[list[int]], max_tokens: int) -> dict[int, list[int]]:
    gen = BatchGenerator(model, completion_batch_size=len(prompts), prefill_batch_size=len(prompts))
    uids = gen.insert(prompts, max_tokens=[max_tokens] * len(prompts))
    out: dict[int, list[int]] = {u: [] for u in uids}
    while any(len(t) < max_tokens for t in out.values()):
        for r in gen.next()[1]:
            out[r.uid].append(r.token)
    gen.close()
    return {i: out[u] for i, u in enumerate(uids)}


def test_a_folded_quantized_model_decodes_the_same_tokens(model_cache: Path) -> None:
    model, _ = load_model(str(resolve_model("synthetic:tiny", model_cache)))
    nn.quantize(model, group_size=32, bits=4)
    mx.eval(model.parameters())
    prompts = [[5, 9, 13, 2], [7, 7, 7, 7, 7, 7], [100, 3]]  # unequal: padded rows too
    plain = _greedy(model, prompts, 12)
    layers = sum(1 for _, m in model.named_modules() if type(m).__name__ == "QuantizedLinear")
    assert fold_decode_batch(model) == layers > 0
    assert not any(type(m).__name__ == "QuantizedLinear" for _, m in model.named_modules())
    assert _greedy(model, prompts, 12) == plain
    x = mx.random.normal((4, 1, 64))
    linear = next(m for _, m in model.named_modules() if type(m).__name__ == "_FoldedQuantizedLinear")
    folded = linear(x)
    linear.__class__ = type(linear).__mro__[1]  # back to the plain QuantizedLinear
    assert mx.array_equal(folded, linear(x)).item()
    # The rest go back to MLX's class too (what a benchmark does before mlx-lm's own loop).
    assert unfold_decode_batch(model) == layers - 1
    assert sum(1 for _, m in model.named_modules() if type(m).__name__ == "QuantizedLinear") == layers
    assert unfold_decode_batch(model) == 0


class _Recording:
    """A model that notes the shape and type of every input it runs."""

    def __init__(self, model: Any) -> None:
        self.model = model
        self.inputs: list[tuple[tuple[int, ...], mx.Dtype]] = []

    def __call__(self, x: mx.array, cache: Any = None) -> mx.array:
        self.inputs.append((tuple(x.shape), x.dtype))
        out: mx.array = self.model(x, cache=cache)
        return out

    def __getattr__(self, name: str) -> Any:
        return getattr(self.model, name)


def test_warming_a_quantized_models_kernels_runs_every_shape_and_changes_nothing(model_cache: Path) -> None:
    """On CUDA the factory runs this before the first request so that MLX compiles a quantized
    model's kernels at load; here it runs on any backend, for its shapes and its side effects."""
    model, _ = load_model(str(resolve_model("synthetic:tiny", model_cache)))
    assert not quantized_layers(model)
    nn.quantize(model, group_size=32, bits=4)
    mx.eval(model.parameters())
    assert quantized_layers(model)
    fold_decode_batch(model)
    prompts = [[5, 9, 13, 2], [100, 3]]
    before = _greedy(model, prompts, 8)
    recording = _Recording(model)
    assert warm_kernels(recording) > 0
    assert recording.inputs == [((rows, tokens), dtype) for rows in WARM_ROWS for tokens in WARM_TOKENS
                                for dtype in (mx.int32, mx.uint32)]
    assert max(t for (_, t), _ in recording.inputs) >= 512 and max(r for (r, _), _ in recording.inputs) > 1
    assert _greedy(model, prompts, 8) == before

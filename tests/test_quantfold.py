"""Folding a decode batch into one quantized product changes the kernel, not the results."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.generate import BatchGenerator

from workers.batching.quantfold import fold_decode_batch
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

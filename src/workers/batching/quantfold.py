"""Quantized decode on MLX's CUDA backend: one matrix product for the batch, not one per row.

A decode step feeds each linear layer a `(batch, 1, features)` input. MLX's `quantized_matmul`
takes the second-to-last dimension as the rows of one product, so a batch of single-token rows
may run as `batch` matrix-vector products, each reading the whole weight (see README, "On a GPU",
4-bit). Folding the batch into the rows, `(1, batch, features)`, computes the same products in
one matrix-matrix kernel.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import mlx.nn as nn

_QuantizedLinear: Any = getattr(nn, "QuantizedLinear")  # noqa: B009 (absent from MLX's stubs)


class _FoldedQuantizedLinear(_QuantizedLinear):  # type: ignore[misc]
    def __call__(self, x: mx.array) -> mx.array:
        if x.ndim == 3 and x.shape[1] == 1 and x.shape[0] > 1:
            b = x.shape[0]
            y: mx.array = super().__call__(x.reshape(1, b, x.shape[2]))
            return y.reshape(b, 1, y.shape[-1])
        out: mx.array = super().__call__(x)
        return out


def fold_decode_batch(model: Any) -> int:
    """Make each of `model`'s quantized linear layers fold a decode batch into one product;
    returns how many it changed. Same results: each output row is the same dot products."""
    return _reclass(model, _QuantizedLinear, _FoldedQuantizedLinear)


def unfold_decode_batch(model: Any) -> int:
    """Undo `fold_decode_batch`: each folded layer back to MLX's own class; returns how many.
    For comparisons that run mlx-lm's own loop on the same model after ours."""
    return _reclass(model, _FoldedQuantizedLinear, _QuantizedLinear)


def _reclass(model: Any, old: type, new: type) -> int:
    n = 0
    for _, module in model.named_modules():
        if type(module) is old:
            module.__class__ = new
            n += 1
    return n

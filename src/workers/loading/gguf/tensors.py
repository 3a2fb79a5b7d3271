"""A GGUF file's tensors as MLX arrays, kept quantized where MLX can keep them."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import TYPE_CHECKING

import mlx.core as mx
import numpy as np
from gguf import quants
from gguf.constants import GGMLQuantizationType as Q

from workers.loading.cachedir import ModelSourceError

if TYPE_CHECKING:
    from pathlib import Path

    from workers.loading.gguf.header import Header, TensorInfo

MLX_NATIVE = frozenset({Q.F32, Q.F16, Q.Q4_0, Q.Q4_1, Q.Q8_0})
"""Types `mx.load` reads as they are: Q4_0/Q4_1/Q8_0 become MLX affine quantization (group 32)."""
QUANT_GROUP = 32


@dataclass(frozen=True)
class Tensors:
    arrays: dict[str, mx.array]
    """GGUF names; a quantized tensor `x.weight` comes with `x.scales` and `x.biases`."""
    dequantized: dict[str, int]
    """Tensor type -> how many tensors of it were dequantized (MLX cannot keep them quantized)."""


def load_tensors(path: Path, header: Header) -> Tensors:
    """Every tensor of ``path``. With only MLX-native types, `mx.load` reads the file in C++;
    otherwise each tensor is read here and the quantized ones are dequantized to float16."""
    kinds = {t.kind for t in header.tensors.values()}
    if kinds <= MLX_NATIVE:
        try:
            arrays = mx.load(str(path))
        except Exception as e:
            raise ModelSourceError(f"MLX could not read GGUF file {str(path)!r}: {e}") from e
        assert isinstance(arrays, dict)
        return Tensors(arrays, {})
    dequantized: Counter[str] = Counter()
    arrays = {}
    data = np.memmap(path, dtype=np.uint8, mode="r")
    for info in header.tensors.values():
        raw = data[info.offset : info.offset + info.nbytes]
        arrays[info.name] = _array(info, raw)
        if info.kind not in (Q.F32, Q.F16, Q.BF16):
            dequantized[info.kind.name] += 1
    return Tensors(arrays, dict(dequantized))


def _array(info: TensorInfo, raw: np.ndarray) -> mx.array:
    if info.kind == Q.F32:
        return mx.array(raw.view(np.float32).reshape(info.shape))
    if info.kind == Q.F16:
        return mx.array(raw.view(np.float16).reshape(info.shape))
    if info.kind == Q.BF16:
        return mx.array(raw.view(np.uint16).reshape(info.shape)).view(mx.bfloat16)
    try:
        rows = raw.reshape(*info.shape[:-1], -1)
        values = quants.dequantize(rows, info.kind)
    except NotImplementedError:
        raise ModelSourceError(
            f"tensor {info.name!r} has type {info.kind.name}, which this loader cannot read"
        ) from None
    return mx.array(values.astype(np.float16))


def quant_bits(weight: mx.array, scales: mx.array) -> int:
    """Bits per value of an MLX affine-quantized weight with groups of `QUANT_GROUP`."""
    return 32 * int(weight.shape[-1]) // (int(scales.shape[-1]) * QUANT_GROUP)

"""The compute dtype follows the device: float32 on MLX's CPU backend, half precision elsewhere.

MLX's CPU backend has no fast half-precision kernels (float16 measured 47x slower than float32
on SmolLM2, and it degenerated into repetition), while its float32 matmuls run on BLAS. Its
quantized kernels are slower than a float32 matmul on BLAS too, so small quantized models are
dequantized there.

On CUDA small quantized models are dequantized too. A small model's decode step is bound by the
host, not by reading its weights, so 4 bits buy it no speed: on an H100 the llama-3.2-1b shape
gave 4,072 tok/s at 64 streams in bfloat16 against 2,363 in 4 bits. And MLX compiles its quantized
matmul kernels at their first use (NVRTC, seconds each): on a fresh H200 SmolLM2's Q4_1 GGUF had
not served its first 256 requests after 200 s, with or without building them while it loaded.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any, Literal

import mlx.core as mx
import mlx.nn as nn
import msgspec

if TYPE_CHECKING:
    from pathlib import Path

DTypeName = Literal["auto", "float32", "float16", "bfloat16"]
Dequantize = Literal["auto", "yes", "no"]
DTYPES = {"float32": mx.float32, "float16": mx.float16, "bfloat16": mx.bfloat16}
DEQUANTIZE_LIMIT = 4 << 30
"""On the CPU, "auto" dequantizes a quantized model whose float32 weights fit in this many bytes;
a larger one stays quantized, trading speed for memory."""
CUDA_DEQUANTIZE_LIMIT = 4 << 30
"""On CUDA, "auto" dequantizes a quantized model whose half-precision weights would fit in this
many bytes (about 2B parameters), estimated from its files before it loads (the CUDA graph
setting is chosen then)."""


class Precision(msgspec.Struct, frozen=True):
    """What `adapt_precision` did to a model, for the log and `stats()`."""

    dtype: str
    """The floating-point type of the weights, norms and quantization scales."""
    dequantized: int = 0
    """Quantized layers turned into dense ones."""
    note: str = ""


def on_cpu() -> bool:
    return bool(mx.default_device() == mx.cpu)


def on_cuda() -> bool:
    """Whether this MLX runs on its CUDA backend."""
    cuda = getattr(mx, "cuda", None)
    return bool(cuda is not None and cuda.is_available())


def cuda_dequantizes(directory: Path | None, dequantize: Dequantize = "auto") -> bool:
    """Whether a model in `directory` loaded on CUDA is dequantized: "yes", or "auto" for a
    quantized model whose half-precision weights stay within `CUDA_DEQUANTIZE_LIMIT`."""
    if dequantize != "auto":
        return dequantize == "yes"
    if directory is None:
        return False
    config = model_config(directory)
    quantization = config.get("quantization") or config.get("quantization_config")
    bits = quantization.get("bits") if isinstance(quantization, dict) else None
    if not isinstance(bits, int) or bits <= 0:
        return False
    stored = sum(f.stat().st_size for f in directory.glob("*.safetensors"))
    return 0 < stored * 16 // bits <= CUDA_DEQUANTIZE_LIMIT


def quantized_layers(model: Any) -> list[Any]:
    """`model`'s quantized layers (linear and embedding)."""
    kinds = (nn.QuantizedLinear, nn.QuantizedEmbedding)  # type: ignore[attr-defined]
    return [m for _, m in model.named_modules() if isinstance(m, kinds)]


def adapt_precision(
    model: Any, directory: Path, dtype: DTypeName = "auto", dequantize: Dequantize = "auto"
) -> Precision:
    """Cast ``model`` (loaded from ``directory``) to the compute dtype for this device and,
    where it pays, dequantize its quantized layers. Call on the model's thread."""
    cpu = on_cpu()
    target = _target(directory, dtype, cpu)
    quantized = quantized_layers(model)
    if target is not None:
        model.set_dtype(DTYPES[target])
    done = 0
    note = ""
    cuda = not cpu and on_cuda()
    if quantized and (
        _should_dequantize(model, quantized, dequantize, cpu)
        or (cuda and cuda_dequantizes(directory, dequantize))
    ):
        from mlx_lm.utils import dequantize_model

        dequantize_model(model)
        done = len(quantized)
        why = ('[model] dequantize = "yes"' if dequantize == "yes" else
               "MLX's CPU backend runs float32 matmuls faster" if cpu else
               "a small model runs faster in half precision on CUDA, without kernels to compile"
               " first")
        note = f"dequantized {done} quantized layers: {why}"
    elif quantized and dequantize == "auto" and cpu:
        note = (f"kept {len(quantized)} layers quantized: dequantized, the weights would pass "
                f"{DEQUANTIZE_LIMIT} bytes")
    mx.eval(model.parameters())
    return Precision(dtype=_weights_dtype(model), dequantized=done, note=note)


def _target(directory: Path, dtype: DTypeName, cpu: bool) -> str | None:
    if dtype != "auto":
        return dtype
    if cpu:
        return "float32"
    # On a GPU the model's own half precision; a converted GGUF keeps float32 norms beside
    # float16 weights, and one float32 operand would make every activation float32.
    declared = _declared_dtype(directory)
    return declared if declared in ("float16", "bfloat16") else None


def model_config(directory: Path) -> dict[str, Any]:
    """The model's `config.json` ({} when it is missing or not a JSON object)."""
    try:
        config = json.loads((directory / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return config if isinstance(config, dict) else {}


def _declared_dtype(directory: Path) -> str | None:
    config = model_config(directory)
    value = config.get("torch_dtype") or config.get("dtype")
    return value if isinstance(value, str) else None


def _should_dequantize(model: Any, quantized: list[Any], dequantize: Dequantize, cpu: bool) -> bool:
    if dequantize != "auto":
        return dequantize == "yes"
    if not cpu:
        return False
    dense = sum(_dense_count(m) for m in quantized) * 4
    return dense <= DEQUANTIZE_LIMIT


def _dense_count(layer: Any) -> int:
    return int(layer.weight.size) * 32 // int(layer.bits)


def _weights_dtype(model: Any) -> str:
    from mlx.utils import tree_flatten

    params: list[tuple[str, Any]] = tree_flatten(model.parameters())  # type: ignore[assignment]
    for _, value in params:
        if mx.issubdtype(value.dtype, mx.floating):
            return str(value.dtype).rsplit(".", 1)[-1]
    return "unknown"

"""MLX settings the scheduler applies by default on the CUDA backend.

MLX reads its `MLX_*` variables once, when it first uses the GPU, so these go into the process
environment before the worker loads the model; a variable the user has set is left alone. Measured
on an H100 with `benchmarks/cuda_settings.py` (README, "On a GPU"): through our scheduler, CUDA
graphs off gave more tokens/s at 8 to 256 streams on the qwen2.5-0.5b and llama-3.2-1b shapes
(host-bound: the KV length changes every step, so captured graphs do not replay) and at 64 and
256 streams on an 8B bf16 shape (1.71x, 1.48x; the bare decode step of equal rows was faster with
graphs at batch 1 and 256 there, but not the served mix of prefill and decode); 4-bit matmuls
were 1.7-3x slower with graphs off. So `[worker] cuda_graphs = "auto"` turns graphs off for
unquantized models and keeps MLX's default for quantized ones.

cuDNN's attention is off for every model: MLX keys its cache of cuDNN attention graphs by the
exact shapes, and a prefill chunk of a batch of prompts has new ones (its length and its KV
length) almost every time, so nearly every chunk built a cuDNN graph first. Measured on an H100
(`benchmarks/stall.py`, 64 streams, prompts of 64-512 tokens, qwen2.5-0.5b shape, bf16): 1,999
tokens/s with it off against 1,362 on, ITL p99 97 against 166 ms, TTFT p99 0.9 against 4.0 s.
Without it MLX attends with its own kernels (the decode step's vector kernel, matmuls for
prefill).
"""

from __future__ import annotations

import json
import os
from typing import TYPE_CHECKING

import mlx.core as mx
import structlog

if TYPE_CHECKING:
    from collections.abc import MutableMapping
    from pathlib import Path

log = structlog.get_logger(__name__)

CUDA_DEFAULTS: dict[str, str] = {"MLX_USE_CUDA_GRAPHS": "0", "MLX_CUDA_USE_CUDNN_SDPA": "0"}
"""What "auto" sets for an unquantized model (a quantized one keeps MLX's CUDA graphs)."""
GRAPHS = "MLX_USE_CUDA_GRAPHS"


def on_cuda() -> bool:
    """Whether this MLX runs on its CUDA backend."""
    cuda = getattr(mx, "cuda", None)
    return bool(cuda is not None and cuda.is_available())


def graphs_wanted(choice: str, model_dir: Path | None) -> bool:
    """Whether CUDA graphs should stay on for `[worker] cuda_graphs = choice`: "on"/"off" as
    said; "auto": on for quantized models only."""
    if choice != "auto":
        return choice == "on"
    if model_dir is None:
        return False
    try:
        config = json.loads((model_dir / "config.json").read_text())
    except (OSError, ValueError):
        config = {}
    return isinstance(config, dict) and ("quantization" in config or "quantization_config" in config)


def cuda_defaults(env: MutableMapping[str, str], cuda: bool, graphs: bool = False) -> dict[str, str]:
    """Put each of the CUDA settings the user has not set into `env` (only on CUDA); return them.
    `graphs`: leave MLX's CUDA graphs on (its own default)."""
    if not cuda:
        return {}
    wanted = {k: v for k, v in CUDA_DEFAULTS.items() if not (graphs and k == GRAPHS)}
    applied = {k: v for k, v in wanted.items() if k not in env}
    env.update(applied)
    return applied


def apply_cuda_defaults(choice: str = "auto", model_dir: Path | None = None) -> dict[str, str]:
    """`cuda_defaults` on the process environment, logged once when it sets anything."""
    cuda = on_cuda()
    applied = cuda_defaults(os.environ, cuda, cuda and graphs_wanted(choice, model_dir))
    if applied:
        log.info("cuda_defaults_applied", **applied,
                 note="set the variable yourself to override; read once, at MLX's first GPU use")
    return applied

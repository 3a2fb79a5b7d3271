"""MLX settings the scheduler applies by default on the CUDA backend.

MLX reads its `MLX_*` variables once, when it first uses the GPU, so these go into the process
environment before the worker loads the model; a variable the user has set is left alone. Measured
on an H100 with `benchmarks/cuda_settings.py` (README, "On a GPU"): with CUDA graphs off the
decode step was faster at batch 1 to 256 on the qwen2.5-0.5b and llama-3.2-1b shapes (the KV
length changes every step, so captured graphs do not replay).
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

import mlx.core as mx
import structlog

if TYPE_CHECKING:
    from collections.abc import MutableMapping

log = structlog.get_logger(__name__)

CUDA_DEFAULTS: dict[str, str] = {"MLX_USE_CUDA_GRAPHS": "0"}


def on_cuda() -> bool:
    """Whether this MLX runs on its CUDA backend."""
    cuda = getattr(mx, "cuda", None)
    return bool(cuda is not None and cuda.is_available())


def cuda_defaults(env: MutableMapping[str, str], cuda: bool) -> dict[str, str]:
    """Put each of `CUDA_DEFAULTS` the user has not set into `env` (only on CUDA); return them."""
    if not cuda:
        return {}
    applied = {k: v for k, v in CUDA_DEFAULTS.items() if k not in env}
    env.update(applied)
    return applied


def apply_cuda_defaults() -> dict[str, str]:
    """`cuda_defaults` on the process environment, logged once when it sets anything."""
    applied = cuda_defaults(os.environ, on_cuda())
    if applied:
        log.info("cuda_defaults_applied", **applied,
                 note="set the variable yourself to override; read once, at MLX's first GPU use")
    return applied

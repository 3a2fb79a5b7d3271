"""Rotary positions on MLX's CPU backend: one table of cosines and sines a step, not one a call.

MLX's CPU backend has no kernel for `mx.fast.rope`: each call builds MLX's own fallback, about
thirty graph nodes (the positions, the inverse frequencies, their product, its cosine and sine,
then the rotation), and a decode step calls it twice a layer with the same positions. On a 2-core
CPU, a one-stream decode step of `synthetic:small` without any rotation took 0.62 of the time
(`tiny` 0.59): that is what the fallback cost.

While our engine steps a batch (`positions`), the first call for that batch's positions computes
the cosines and sines by the fallback's own formula (checked once, at first use, against a
fallback call on a probe of ones and zeros, whose rotation is the table itself; where they differ,
or no C `logf` is found, the probe gives the table each step), and every call rotates with them
in six nodes: the same results, to the bit. Every layer's cache of one batch holds the same
positions (each is written with the same tokens), so a batch's caches share one table. Anything
the table cannot serve (traditional rotation, part of each head, other rope classes, a call
outside a step) takes MLX's own path. With it our engine alone stepped one stream of `small` in
0.83 of the time (`tiny` 0.89; MLX 0.32.4, which has no CPU rope kernel: one would call for a new
measurement).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import threading
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, cast

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx_lm.models.cache import BatchKVCache
from mlx_lm.models.rope_utils import Llama3RoPE

from workers.batching.hostpad import share
from workers.loading.dtypes import on_cpu

if TYPE_CHECKING:
    from collections.abc import Callable, Iterator, Sequence

_RoPE: Any = getattr(nn, "RoPE")  # noqa: B009 (absent from MLX's stubs)
ENABLED = True
"""False leaves every rotation to MLX (a switch for benchmarks)."""
_local = threading.local()


class _Step:
    """What a step's calls share: which offset arrays belong to which batch, and their tables."""

    def __init__(self, batches: Sequence[Sequence[Any]]) -> None:
        self.batch_of: dict[int, int] = {}
        self.held: list[mx.array] = []  # the offsets stay alive, so their ids stay theirs
        self.tables: dict[tuple[Any, ...], tuple[mx.array, mx.array]] = {}
        for batch, caches in enumerate(batches):
            # Other kinds of cache may count positions otherwise, and layers that hold unlike
            # lengths do not share positions: MLX's own path for those.
            if (not caches or not all(isinstance(c, BatchKVCache) for c in caches)
                    or len({c._idx for c in caches}) != 1):
                continue
            for c in caches:
                self.batch_of[id(c.offset)] = batch
                self.held.append(c.offset)


def _served(module: Any) -> tuple[int, float | None, float, mx.array | None] | None:
    """(dims, base, scale, freqs) of a rope module the table can serve; None for others."""
    if getattr(module, "traditional", True):
        return None
    if isinstance(module, Llama3RoPE):
        return module.dims, None, 1.0, module._freqs
    if isinstance(module, _RoPE):
        return module.dims, module.base, module.scale, None
    return None


def _probed(offset: mx.array, length: int, dims: int, base: float | None, scale: float,
            freqs: mx.array | None) -> tuple[mx.array, mx.array]:
    """The fallback's own cosines and sines (float32) for these positions: its rotation of
    (1, 0) pairs, which is the table itself."""
    rows = offset.size if offset.size > 1 else 1
    half = (rows, 1, length, dims // 2)
    probe = mx.concatenate([mx.ones(half), mx.zeros(half)], axis=-1)
    out = mx.fast.rope(probe, dims, traditional=False, base=base, scale=scale, offset=offset, freqs=freqs)
    return out[..., : dims // 2], out[..., dims // 2 :]


@functools.cache
def _logf() -> Callable[[float], float] | None:
    """The C library's single-precision logarithm, which MLX's fallback takes of the base."""
    try:
        libm = ctypes.CDLL(ctypes.util.find_library("m") or "libm.so.6")
        f = libm.logf
    except (OSError, AttributeError):
        return None
    f.restype, f.argtypes = ctypes.c_float, [ctypes.c_float]
    return cast("Callable[[float], float]", f)


def _inverse(dims: int, base: float | None, freqs: mx.array | None) -> mx.array | None:
    """The fallback's inverse frequencies, by its own operations (None: no C logarithm here)."""
    if freqs is not None:
        return mx.reciprocal(freqs.astype(mx.float32))
    logf, half = _logf(), dims // 2
    if logf is None or base is None:
        return None
    step = np.float32(logf(base)) / np.float32(half)  # in single precision, as MLX's C++
    return mx.exp(mx.arange(0, -half, -1, dtype=mx.float32) * mx.array(float(step), dtype=mx.float32))


def _angles(offset: mx.array, length: int, inverse: mx.array, scale: float) -> tuple[mx.array, mx.array]:
    """Cosines and sines (float32) of the positions by the fallback's formula."""
    at = mx.expand_dims(offset, (-1, -2)) if offset.size > 1 else offset
    positions = (mx.arange(length, dtype=mx.float32) + at) * mx.array(scale, dtype=mx.float32)
    theta = mx.expand_dims(positions, -1) * inverse
    return mx.cos(theta), mx.sin(theta)


_formula: dict[tuple[Any, ...], tuple[mx.array | None, mx.array | None]] = {}
"""Per rope's parameters (and its frequencies, held so that their id stays theirs): the inverse
frequencies where the formula was checked to give the fallback's table to the bit (None: the
table comes from a probe each step)."""


def _checked(dims: int, base: float | None, scale: float, freqs: mx.array | None) -> mx.array | None:
    key = (dims, base, scale, None if freqs is None else id(freqs))
    held = _formula.get(key)
    if held is None or held[0] is not freqs:
        inverse = _inverse(dims, base, freqs)
        if inverse is not None:
            offset = mx.array([0, 1, 7, 4093, 131071], dtype=mx.int32)
            got, want = _angles(offset, 3, inverse, scale), _probed(offset, 3, dims, base, scale, freqs)
            if not all(mx.array_equal(g, w).item() for g, w in zip(got, want, strict=True)):
                inverse = None
        held = _formula[key] = (freqs, inverse)
    return held[1]


def _table(offset: mx.array, shape: tuple[int, ...], dtype: mx.Dtype, dims: int, base: float | None,
           scale: float, freqs: mx.array | None) -> tuple[mx.array, mx.array]:
    """For inputs of `shape`: the cosines twice and the sines negated then as they are, in
    `dtype`, broadcast to `shape` (so that each call's products need no broadcast of their own)."""
    inverse = _checked(dims, base, scale, freqs)
    cos, sin = (_angles(offset, shape[2], inverse, scale) if inverse is not None
                else _probed(offset, shape[2], dims, base, scale, freqs))
    cos, sin = cos.astype(dtype), sin.astype(dtype)
    both = mx.concatenate([cos, cos], axis=-1)
    signed = mx.concatenate([-sin, sin], axis=-1)
    return mx.broadcast_to(both, shape), mx.broadcast_to(signed, shape)


def rotate(module: Any, x: mx.array, offset: Any) -> mx.array | None:
    """`module(x, offset)` through the step's table; None where the table does not serve it."""
    step: _Step | None = getattr(_local, "step", None)
    if step is None or not isinstance(offset, mx.array) or x.ndim != 4:
        return None
    batch = step.batch_of.get(id(offset))
    served = _served(module) if batch is not None else None
    if served is None or served[0] != x.shape[-1]:
        return None  # a module it does not serve, or one that rotates part of each head
    dims, base, scale, freqs = served
    key = (batch, x.shape, x.dtype, dims, base, scale, None if freqs is None else id(freqs))
    table = step.tables.get(key)
    if table is None:
        table = step.tables[key] = _table(offset, x.shape, x.dtype, dims, base, scale, freqs)
    both, signed = table
    half = dims // 2
    # The fallback's x1*cos - x2*sin and x1*sin + x2*cos, the same to the bit: a product by a
    # negated sine is the negated product, and a sum does not depend on its order.
    return x * both + mx.concatenate([x[..., half:], x[..., :half]], axis=-1) * signed


class _Tabled:
    """A rope module's calls through the step's table where it serves them, else its own."""

    def __call__(self, x: mx.array, offset: Any = 0) -> mx.array:
        out = rotate(self, x, offset)
        return out if out is not None else super().__call__(x, offset)  # type: ignore[misc]


class _TabledRoPE(_Tabled, _RoPE):  # type: ignore[misc]
    pass


class _TabledLlama3RoPE(_Tabled, Llama3RoPE):
    pass


_TABLED: dict[type, type] = {_RoPE: _TabledRoPE, Llama3RoPE: _TabledLlama3RoPE}
_OWN = {tabled: own for own, tabled in _TABLED.items()}


def modules(model: Any) -> list[Any]:
    """The rope modules of `model` a step's table would serve (none off the CPU backend, where
    `mx.fast.rope` is one kernel, or with `ENABLED` off)."""
    if not (ENABLED and on_cpu()):
        return []
    found = [m for _, m in model.named_modules() if type(m) in _TABLED and _served(m) is not None]
    return found


@contextmanager
def positions(ropes: Sequence[Any], *batches: Sequence[Any]) -> Iterator[None]:
    """Within it, on this thread, the `ropes` (from `modules`) rotate every layer of each batch
    (a list of caches, one a layer) with one table of that batch's positions. The modules get
    their own classes back after, so that anything else using the model meets mlx-lm's own.
    After the block every layer of a batch takes the first one's new offsets (`hostpad.share`).
    With `ropes` that holds whatever `hostpad.SHARE_POSITIONS` says: the table reads only the
    first layer's, so each other layer's own would grow a graph of additions, one a step, that
    nothing evaluates."""
    if not ropes:  # MLX rotates each layer by its own offsets
        yield
    else:
        outer: _Step | None = getattr(_local, "step", None)
        classes = [_OWN.get(type(m), type(m)) for m in ropes]
        _local.step = _Step(batches)
        for m, cls in zip(ropes, classes, strict=True):
            m.__class__ = _TABLED[cls]
        try:
            yield
        finally:
            _local.step = outer
            if outer is None:
                for m, cls in zip(ropes, classes, strict=True):
                    m.__class__ = cls
    for caches in batches:
        share(caches, always=bool(ropes))

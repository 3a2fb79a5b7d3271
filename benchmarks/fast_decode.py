"""An experiment, not part of the scheduler: mlx-lm's `BatchGenerator` decoding through a compiled forward pass.

Not output-identical on CUDA and not faster at batch 64 (see `install_fast_decode`); kept so that
`benchmarks/decode_step.py` can reproduce the measurement.

A decode step of a small model on a GPU is bound by the host, not by the GPU: mlx-lm builds the
forward graph in Python (hundreds of array operations a step) and MLX then encodes every one of
them. `install_fast_decode` replaces the model the generator's decode batch calls with a wrapper
that runs `mx.compile`d forward passes: the graph is traced once per (batch size, KV buffer length)
and replayed from C++ afterwards, with element-wise chains fused.

The KV cache's shape changes every step, which a compiled function cannot follow, so the wrapper
hands the compiled function the cache's whole preallocated buffers (mlx-lm grows them 256 positions
at a time) with the write position as an array: the new keys and values go in with
`mx.slice_update`, and the attention mask covers the buffer, hiding the positions not yet written
and the left padding. The `BatchKVCache` objects stay the generator's own (filter, extend, extract
and remove work as before); the wrapper swaps their arrays and advances their counters. Any step it
cannot take (a buffer that must grow, another cache type, a prefill) runs the original forward.

Everything after the forward (logits processors, log-probabilities, samplers, stop sequences) is
mlx-lm's own code, unchanged.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx

SUPPORTED_MODEL_TYPES = frozenset({"llama", "qwen2"})
"""Architectures whose attention uses only `offset`, `update_and_fetch` and `make_mask` of the
cache (checked against mlx-lm 0.32.2's sources). Others keep the original forward."""


class _BufferCache:
    """Stands in for one layer's `BatchKVCache` inside the compiled forward."""

    def __init__(self, keys: mx.array, values: mx.array, offset: mx.array, left_padding: mx.array,
                 idx: mx.array) -> None:
        self.keys = keys
        self.values = values
        self.offset = offset  # read by the rotary embedding before the update, as in BatchKVCache
        self.left_padding = left_padding
        self.idx = idx

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        self.keys = mx.slice_update(self.keys, keys, self.idx, axes=(2,))
        self.values = mx.slice_update(self.values, values, self.idx, axes=(2,))
        return self.keys, self.values

    def make_mask(self, n: int, return_array: bool = False, window_size: int | None = None,
                  **_: Any) -> mx.array:
        if n != 1 or window_size is not None:
            raise ValueError("the compiled decode forward handles one token per row, no window")
        # BatchKVCache's mask for one new token at position idx: key j is visible when
        # left_padding <= j <= idx; here also over the unwritten tail of the buffer (hidden).
        r = mx.arange(self.keys.shape[2])
        visible = (r <= self.idx) & (mx.expand_dims(self.left_padding, (1, 2, 3)) <= r)
        return visible


class FastDecodeModel:
    """Calls `model` as the decode batch does, through compiled forward passes where it can."""

    def __init__(self, model: Any) -> None:
        self.model = model
        self.compiled_steps = 0
        self.fallback_steps = 0
        self._forward = mx.compile(self._trace)

    def _trace(self, tokens: mx.array, idx: mx.array, offset: mx.array, left_padding: mx.array,
               *kv: mx.array) -> list[mx.array]:
        n = len(kv) // 2
        caches = [_BufferCache(kv[2 * i], kv[2 * i + 1], offset, left_padding, idx) for i in range(n)]
        logits = self.model(tokens, cache=caches)
        return [logits, offset + 1, *(c.keys for c in caches), *(c.values for c in caches)]

    def _fits(self, inputs: mx.array, cache: Any) -> bool:
        if inputs.ndim != 2 or inputs.shape[1] != 1 or not cache:
            return False
        from mlx_lm.models.cache import BatchKVCache

        first = cache[0]
        for c in cache:
            if type(c) is not BatchKVCache or c.keys is None or c._right_padding is not None:
                return False
            if c._idx != first._idx or c._idx + 1 > c.keys.shape[2] or c.keys.shape != first.keys.shape:
                return False
        return bool(first.keys.shape[0] == inputs.shape[0])

    def __call__(self, inputs: mx.array, cache: Any = None, **kwargs: Any) -> mx.array:
        if kwargs or not self._fits(inputs, cache):
            self.fallback_steps += 1
            return self.model(inputs, cache=cache, **kwargs)  # type: ignore[no-any-return]
        first = cache[0]
        kv: list[mx.array] = []
        for c in cache:
            kv += (c.keys, c.values)
        out = self._forward(inputs, mx.array([first._idx]), first.offset, first.left_padding, *kv)
        n = len(cache)
        logits, offset = out[0], out[1]
        for i, c in enumerate(cache):
            # One offset array for all layers: BatchKVCache replaces it, never updates in place.
            c.keys, c.values, c.offset = out[2 + i], out[2 + n + i], offset
            c._idx += 1
        self.compiled_steps += 1
        return logits


def install_fast_decode(gen: Any, *, force: bool = False) -> bool:
    """Make `gen` (an mlx-lm `BatchGenerator`) decode through compiled forward passes.

    EXPERIMENTAL, OFF: it returns False and changes nothing unless `force=True`. Measured on an
    H100 (benchmarks/decode_step.py, llama-3.2-1b shape), greedy output is NOT identical to the
    stock step (first difference after 45-127 tokens: on CUDA an attention with a mask array runs
    as matmul + softmax + matmul, and over the whole buffer these reduce in another order), and the
    step is only 1.1x faster at batch 1 and 8, 0.9x at 64. `force=True` installs it, for that
    benchmark, on any backend. Also False for an architecture not in `SUPPORTED_MODEL_TYPES` or a
    generator without the decode batch of mlx-lm 0.32.
    """
    if not force:
        return False
    batch = getattr(gen, "_generation_batch", None)
    model = getattr(gen, "model", None)
    if batch is None or model is None or not hasattr(batch, "model"):
        return False
    if getattr(model, "model_type", None) not in SUPPORTED_MODEL_TYPES:
        return False
    if getattr(getattr(model, "args", None), "sliding_window", None) is not None:
        return False
    if isinstance(batch.model, FastDecodeModel):
        return True
    batch.model = FastDecodeModel(model)
    return True

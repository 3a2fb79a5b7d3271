"""A decode step's attention over left-padded rows, in one CUDA kernel.

A batch's rows are left-padded to a common length, so a decode step's attention needs an array
mask. MLX 0.32's CUDA kernel for one query (`sdpa_vector`) takes none, and with a mask MLX falls
back to separate kernels: the scores as a batched matrix product, the mask applied (`Select`),
a softmax and a second product. On an H200 that was 5 of a decode step's 7 ms of device time for
a 1B model at 64 rows (docs/stalls.md), where the keys and values the step reads take a few
tenths of a millisecond. This kernel reads each row's keys and values from its first real
position on, with an online softmax (one block a row and query head, a warp per 32 positions).

It serves the decode batches of our engine only (`HostPaddedKVCache`, whose mask is exactly its
left padding): a plain mlx-lm batch, as a benchmark's bare loop runs it, keeps MLX's own path.
"""

from __future__ import annotations

import functools
import sys
from typing import Any, cast

import mlx.core as mx
from mlx_lm.models import base

from workers.batching.hostpad import HostPaddedKVCache
from workers.batching.hostpad import unavailable as host_padding_unavailable
from workers.loading.dtypes import on_cuda

ENABLED = True
"""False keeps MLX's own masked attention everywhere (a switch for benchmarks)."""
_installed = False  # `install` ran on the CUDA backend
MLX_ATTENTION = base.scaled_dot_product_attention
WARPS = 4
HEAD_DIMS = (64,)
"""Head sizes it serves: measured faster than MLX's masked path at 64 (1.55-1.83x on an H200),
slower at 128 (0.88x; benchmarks/padded_attention.py)."""

SOURCE = """
    constexpr int PER = D / 32;
    const int hq = blockIdx.x, b = blockIdx.y;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int heads = q_shape[1], length = keys_shape[2];
    const int hk = hq / (heads / keys_shape[1]);
    __shared__ float qs[D];
    __shared__ float wm[WARPS], wl[WARPS], wacc[WARPS][D];
    const T* qp = q + b * q_strides[0] + hq * q_strides[1];
    for (int d = threadIdx.x; d < D; d += blockDim.x) {
        qs[d] = static_cast<float>(qp[d * q_strides[3]]) * static_cast<float>(scale[0]);
    }
    __syncthreads();
    const T* kb = keys + b * keys_strides[0] + hk * keys_strides[1];
    const T* vb = values + b * values_strides[0] + hk * values_strides[1];
    float m = -1e30f, l = 0.0f, acc[PER];
    for (int i = 0; i < PER; i++) acc[i] = 0.0f;
    for (int first = max(start[b], 0) + warp * 32; first < length; first += WARPS * 32) {
        const int j = first + lane;
        float s = -1e30f;
        if (j < length) {
            const T* kr = kb + j * keys_strides[2];
            float dot = 0.0f;
            #pragma unroll
            for (int d = 0; d < D; d++) dot += qs[d] * static_cast<float>(kr[d * keys_strides[3]]);
            s = dot;
        }
        float top = s;
        for (int o = 16; o > 0; o >>= 1) top = fmaxf(top, __shfl_xor_sync(0xffffffff, top, o));
        const float m_new = fmaxf(m, top);
        const float p = j < length ? __expf(s - m_new) : 0.0f;
        float sum = p;
        for (int o = 16; o > 0; o >>= 1) sum += __shfl_xor_sync(0xffffffff, sum, o);
        const float keep = __expf(m - m_new);
        l = l * keep + sum;
        for (int i = 0; i < PER; i++) acc[i] *= keep;
        const int n = min(32, length - first);
        for (int r = 0; r < n; r++) {
            const float pr = __shfl_sync(0xffffffff, p, r);
            const T* vr = vb + (first + r) * values_strides[2];
            for (int i = 0; i < PER; i++) {
                acc[i] += pr * static_cast<float>(vr[(lane * PER + i) * values_strides[3]]);
            }
        }
        m = m_new;
    }
    if (lane == 0) { wm[warp] = m; wl[warp] = l; }
    for (int i = 0; i < PER; i++) wacc[warp][lane * PER + i] = acc[i];
    __syncthreads();
    if (warp == 0) {
        float top = -1e30f;
        for (int w = 0; w < WARPS; w++) top = fmaxf(top, wm[w]);
        float total = 0.0f, o[PER];
        for (int i = 0; i < PER; i++) o[i] = 0.0f;
        for (int w = 0; w < WARPS; w++) {
            const float c = __expf(wm[w] - top);
            total += wl[w] * c;
            for (int i = 0; i < PER; i++) o[i] += wacc[w][lane * PER + i] * c;
        }
        T* op = out + (b * heads + hq) * D;
        for (int i = 0; i < PER; i++) op[lane * PER + i] = static_cast<T>(o[i] / total);
    }
"""


@functools.cache
def _kernel() -> Any:
    return mx.fast.cuda_kernel(
        name="padded_decode_attention", input_names=["q", "keys", "values", "start", "scale"],
        output_names=["out"], source=SOURCE, ensure_row_contiguous=False)


@functools.cache
def _scale(value: float) -> mx.array:
    """One array a scale, made once (an array from a host value costs an allocation a call)."""
    return mx.array([value], dtype=mx.float32)


def padded_decode(q: mx.array, keys: mx.array, values: mx.array, start: mx.array,
                  scale: float) -> mx.array:
    """Attention of one query a row (`q`: `(rows, heads, 1, D)`) over `keys` and `values`
    (`(rows, kv_heads, length, D)`) from each row's position `start[row]` on."""
    rows, heads, _, dim = q.shape
    out: mx.array = _kernel()(
        inputs=[q, keys, values, start.astype(mx.int32), _scale(float(scale))],
        template=[("T", q.dtype), ("D", dim), ("WARPS", WARPS)],
        grid=(heads * WARPS * 32, rows, 1), threadgroup=(WARPS * 32, 1, 1),
        output_shapes=[(rows, heads, 1, dim)], output_dtypes=[q.dtype])[0]
    return out


def usable(q: mx.array, keys: mx.array, cache_: Any, mask: Any) -> bool:
    """Whether `padded_decode` computes what MLX's attention with `mask` would."""
    return (ENABLED and _installed and q.shape[2] == 1 and isinstance(mask, mx.array)
            and type(cache_) is HostPaddedKVCache and q.dtype in (mx.bfloat16, mx.float16)
            and keys.dtype == q.dtype and q.shape[-1] in HEAD_DIMS and keys.shape[-1] == q.shape[-1]
            and q.shape[1] % keys.shape[1] == 0)


def attention(queries: mx.array, keys: mx.array, values: mx.array, cache: Any, scale: float,
              mask: Any, sinks: Any = None) -> mx.array:
    """mlx-lm's `scaled_dot_product_attention`, through `padded_decode` where it is `usable`."""
    if sinks is None and usable(queries, keys, cache, mask):
        return padded_decode(queries, keys, values, cache.left_padding, scale)
    out: mx.array = MLX_ATTENTION(queries, keys, values, cache, scale, mask, sinks)
    return out


TOLERANCE = 0.02
"""The largest difference from MLX's masked attention allowed in half precision (measured
0.006-0.008 in bfloat16 over 600 positions)."""


def padding_mask(start: mx.array, length: int) -> mx.array:
    """The mask mlx-lm's batch cache gives one query a row over `length` positions: each row's
    positions from `start[row]` on."""
    return mx.expand_dims(start, (1, 2, 3)) <= mx.arange(length)


def difference(q: mx.array, keys: mx.array, values: mx.array, start: mx.array, scale: float) -> float:
    """The largest difference between `padded_decode` and MLX's attention with `padding_mask`."""
    want = mx.fast.scaled_dot_product_attention(
        q, keys, values, scale=scale, mask=padding_mask(start, keys.shape[2]))
    got = padded_decode(q, keys, values, start, scale)
    return cast("float", mx.max(mx.abs(got.astype(mx.float32) - want.astype(mx.float32))).item())


def check() -> str:
    """The kernel against MLX's masked attention on a small case ("" when they agree): it is
    compiled at run time, so a toolkit or an MLX that cannot build or run it shows here, once, and
    not in a decode step."""
    keys = mx.random.split(mx.random.key(0), 3)
    try:
        q, k, v = (mx.random.normal(shape, key=keys[i]).astype(mx.bfloat16)
                   for i, shape in enumerate(((2, 4, 1, 64), (2, 2, 9, 64), (2, 2, 9, 64))))
        error = difference(q, k, v, mx.array([3, 0], dtype=mx.int32), 0.125)
    except Exception as exc:  # noqa: BLE001 - any failure to build or run it means MLX's path
        return f"the kernel did not run here ({type(exc).__name__}: {exc})"
    if not error < TOLERANCE:
        return f"the kernel's check differed from MLX's attention by {error:.3g}"
    return ""


def install(model: Any) -> str:
    """Route the attention of `model`'s layers through `attention` ("" when it is; else why not).
    It replaces the name in the modules of the model's attention classes, so it holds for every
    model of those classes in the process; `usable` keeps it to our engine's decode batches."""
    global _installed
    if not on_cuda():
        return "not on MLX's CUDA backend"
    args = getattr(model, "args", None)
    heads = getattr(args, "num_attention_heads", None)
    width = getattr(args, "head_dim", None) or (getattr(args, "hidden_size", 0) // heads if heads else None)
    if width not in HEAD_DIMS:
        return f"its attention heads are {width} wide; the kernel serves {list(HEAD_DIMS)}"
    if host_padding_unavailable():
        return "the batch caches are mlx-lm's own here (see host_padding_unavailable)"
    failed = check()
    if failed:
        return failed
    patched = 0
    for name in sorted({type(m).__module__ for _, m in model.named_modules()}):
        module: Any = sys.modules.get(name)
        if getattr(module, "scaled_dot_product_attention", None) is MLX_ATTENTION:
            module.scaled_dot_product_attention = attention
        if getattr(module, "scaled_dot_product_attention", None) is attention:
            patched += 1
    if not patched:
        return "the model's attention does not call mlx-lm's scaled_dot_product_attention"
    _installed = True
    return ""

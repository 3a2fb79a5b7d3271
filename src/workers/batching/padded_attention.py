"""A decode step's attention over left-padded rows, in one CUDA kernel.

A batch's rows are left-padded to a common length, so a decode step's attention needs an array
mask. MLX 0.32's CUDA kernel for one query (`sdpa_vector`) takes none, and with a mask MLX falls
back to separate kernels: the scores as a batched matrix product, the mask applied (`Select`),
a softmax and a second product. On an H200 that was 5 of a decode step's 7 ms of device time for
a 1B model at 64 rows (docs/stalls.md), where the keys and values the step reads take a few
tenths of a millisecond. This kernel reads each row's keys and values from its first real
position on, once for all the query heads that share them, with an online softmax: one block a
row and key-value head, a warp per 32 positions at a time, a lane per position for the scores
(its key read 16 bytes at a time) and per output dimensions for the weighted sum.

It serves the decode batches of our engine only (`HostPaddedKVCache`, whose mask is exactly its
left padding): a plain mlx-lm batch, as a benchmark's bare loop runs it, keeps MLX's own path.

A prompt chunk's attention (several queries a row) keeps MLX's masked path, with its products
arranged so that neither broadcasts the keys and values over the query heads that share them
(`grouped_chunk`): on CUDA a product over a broadcast batch first builds an array of pointers.
"""

from __future__ import annotations

import functools
import sys
from typing import Any, cast

import mlx.core as mx
import structlog
from mlx_lm.models import base

from workers.batching.hostpad import HostPaddedKVCache
from workers.batching.hostpad import unavailable as host_padding_unavailable
from workers.loading.dtypes import on_cuda

log = structlog.get_logger("workers")
ENABLED = True
"""False keeps MLX's own masked attention everywhere (a switch for benchmarks)."""
GROUPED = True
"""False keeps MLX's masked attention for prompt chunks (a switch for benchmarks; see `grouped_chunk`)."""
_installed = False  # `install` ran on the CUDA backend
MLX_ATTENTION = base.scaled_dot_product_attention
HEAD_DIMS = (64, 128)
"""Head sizes it serves (`D / 32` output dimensions a lane), both measured 2.6-7.5x faster than
MLX's masked path on an H200 (benchmarks/padded_attention.py)."""
SHARED_FLOATS = 8192
"""The per-warp partial outputs kept in shared memory (32 KiB of float32) bound warps x query
heads a key-value head x head size."""

SOURCE = """
    constexpr int PER = D / 32;  // output dims a lane keeps
    constexpr int VEC = 16 / sizeof(T);  // elements of one 16-byte load
    struct alignas(sizeof(T) * PER) Slice { T x[PER]; };
    const int hk = blockIdx.x, b = blockIdx.y;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int heads = q_shape[1], length = keys_shape[2], h0 = hk * G;
    __shared__ float qs[G][D];
    __shared__ float wm[WARPS][G], wl[WARPS][G], wacc[WARPS][G][D];
    const float sc = static_cast<float>(scale[0]) * 1.4426950408889634f;  // softmax in base 2
    for (int i = threadIdx.x; i < G * D; i += blockDim.x) {
        const int g = i / D, d = i % D;
        qs[g][d] = static_cast<float>(q[b * q_strides[0] + (h0 + g) * q_strides[1] + d * q_strides[3]]) * sc;
    }
    __syncthreads();
    const T* kb = keys + b * keys_strides[0] + hk * keys_strides[1];
    const T* vb = values + b * values_strides[0] + hk * values_strides[1];
    // Keys are read 16 bytes at a time and values a lane's slice at a time where the views
    // allow it (mlx-lm's caches always do); else element by element.
    const bool kvec = keys_strides[3] == 1 && keys_strides[2] % VEC == 0
        && reinterpret_cast<size_t>(kb) % 16 == 0;
    const bool vvec = values_strides[3] == 1 && values_strides[2] % PER == 0
        && reinterpret_cast<size_t>(vb) % sizeof(Slice) == 0;
    float m[G], l[G], acc[G][PER];
    #pragma unroll
    for (int g = 0; g < G; g++) {
        m[g] = -1e30f; l[g] = 0.0f;
        #pragma unroll
        for (int i = 0; i < PER; i++) acc[g][i] = 0.0f;
    }
    for (int first = max(start[b], 0) + warp * 32; first < length; first += WARPS * 32) {
        const int j = first + lane;
        float s[G];
        #pragma unroll
        for (int g = 0; g < G; g++) s[g] = 0.0f;
        if (j < length) {
            const T* kr = kb + static_cast<size_t>(j) * keys_strides[2];
            if (kvec) {
                #pragma unroll
                for (int c = 0; c < D / VEC; c++) {
                    const uint4 u = reinterpret_cast<const uint4*>(kr)[c];
                    const T* e = reinterpret_cast<const T*>(&u);
                    #pragma unroll
                    for (int x = 0; x < VEC; x++) {
                        const float k = static_cast<float>(e[x]);
                        #pragma unroll
                        for (int g = 0; g < G; g++) s[g] += qs[g][c * VEC + x] * k;
                    }
                }
            } else {
                for (int d = 0; d < D; d++) {
                    const float k = static_cast<float>(kr[d * keys_strides[3]]);
                    #pragma unroll
                    for (int g = 0; g < G; g++) s[g] += qs[g][d] * k;
                }
            }
        }
        float p[G];
        #pragma unroll
        for (int g = 0; g < G; g++) {
            float top = j < length ? s[g] : -1e30f;
            for (int o = 16; o > 0; o >>= 1) top = fmaxf(top, __shfl_xor_sync(0xffffffff, top, o));
            const float m_new = fmaxf(m[g], top);
            p[g] = j < length ? exp2f(s[g] - m_new) : 0.0f;
            float sum = p[g];
            for (int o = 16; o > 0; o >>= 1) sum += __shfl_xor_sync(0xffffffff, sum, o);
            const float keep = exp2f(m[g] - m_new);
            l[g] = l[g] * keep + sum;
            #pragma unroll
            for (int i = 0; i < PER; i++) acc[g][i] *= keep;
            m[g] = m_new;
        }
        const int n = min(32, length - first);
        for (int r = 0; r < n; r++) {
            const T* vr = vb + static_cast<size_t>(first + r) * values_strides[2];
            float v[PER];
            if (vvec) {
                const Slice piece = reinterpret_cast<const Slice*>(vr)[lane];
                #pragma unroll
                for (int i = 0; i < PER; i++) v[i] = static_cast<float>(piece.x[i]);
            } else {
                #pragma unroll
                for (int i = 0; i < PER; i++) {
                    v[i] = static_cast<float>(vr[(lane * PER + i) * values_strides[3]]);
                }
            }
            #pragma unroll
            for (int g = 0; g < G; g++) {
                const float pr = __shfl_sync(0xffffffff, p[g], r);
                #pragma unroll
                for (int i = 0; i < PER; i++) acc[g][i] += pr * v[i];
            }
        }
    }
    #pragma unroll
    for (int g = 0; g < G; g++) {
        if (lane == 0) { wm[warp][g] = m[g]; wl[warp][g] = l[g]; }
        #pragma unroll
        for (int i = 0; i < PER; i++) wacc[warp][g][lane * PER + i] = acc[g][i];
    }
    __syncthreads();
    for (int g = warp; g < G; g += WARPS) {
        float top = -1e30f;
        for (int w = 0; w < WARPS; w++) top = fmaxf(top, wm[w][g]);
        float total = 0.0f, o[PER];
        for (int i = 0; i < PER; i++) o[i] = 0.0f;
        for (int w = 0; w < WARPS; w++) {
            const float c = exp2f(wm[w][g] - top);
            total += wl[w][g] * c;
            for (int i = 0; i < PER; i++) o[i] += wacc[w][g][lane * PER + i] * c;
        }
        T* op = out + (static_cast<size_t>(b) * heads + h0 + g) * D;
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


def warps_for(rows: int, kv_heads: int, group: int, dim: int) -> int:
    """Warps a block (one row's key-value head): 8 where blocks are too few to fill the device
    (about two a multiprocessor), else 4; fewer where their partial outputs would not fit."""
    warps = 8 if rows * kv_heads < 256 else 4
    while warps > 1 and warps * group * dim > SHARED_FLOATS:
        warps //= 2
    return warps


def padded_decode(q: mx.array, keys: mx.array, values: mx.array, start: mx.array,
                  scale: float, warps: int | None = None) -> mx.array:
    """Attention of one query a row (`q`: `(rows, heads, 1, D)`) over `keys` and `values`
    (`(rows, kv_heads, length, D)`) from each row's position `start[row]` on. A block reads one
    row's key-value head once for all the query heads that share it."""
    rows, heads, _, dim = q.shape
    kv_heads = keys.shape[1]
    group = heads // kv_heads
    if warps is None:
        warps = warps_for(rows, kv_heads, group, dim)
    out: mx.array = _kernel()(
        inputs=[q, keys, values, start.astype(mx.int32), _scale(float(scale))],
        template=[("T", q.dtype), ("D", dim), ("G", group), ("WARPS", warps)],
        grid=(kv_heads * warps * 32, rows, 1), threadgroup=(warps * 32, 1, 1),
        output_shapes=[(rows, heads, 1, dim)], output_dtypes=[q.dtype])[0]
    return out


def usable(q: mx.array, keys: mx.array, cache_: Any, mask: Any) -> bool:
    """Whether `padded_decode` computes what MLX's attention with `mask` would."""
    return (ENABLED and _installed and q.shape[2] == 1 and isinstance(mask, mx.array)
            and type(cache_) is HostPaddedKVCache and q.dtype in (mx.bfloat16, mx.float16)
            and keys.dtype == q.dtype and q.shape[-1] in HEAD_DIMS and keys.shape[-1] == q.shape[-1]
            and grouped(q.shape[1], keys.shape[1], q.shape[-1]))


def grouped(heads: int, kv_heads: int, dim: int) -> bool:
    """Whether the kernel takes this head layout: whole groups of query heads a key-value head,
    whose partial outputs fit in its shared memory with one warp."""
    return heads > 0 and kv_heads > 0 and heads % kv_heads == 0 and heads // kv_heads * dim <= SHARED_FLOATS


def attention(queries: mx.array, keys: mx.array, values: mx.array, cache: Any, scale: float,
              mask: Any, sinks: Any = None) -> mx.array:
    """mlx-lm's `scaled_dot_product_attention`, through `padded_decode` where it is `usable` and
    `grouped_chunk` where that is (`chunk_usable`)."""
    if sinks is None and usable(queries, keys, cache, mask):
        return padded_decode(queries, keys, values, cache.left_padding, scale)
    if sinks is None and _installed and chunk_usable(queries, keys, mask):
        return grouped_chunk(queries, keys, values, scale, mask)
    out: mx.array = MLX_ATTENTION(queries, keys, values, cache, scale, mask, sinks)
    return out


def chunk_usable(q: mx.array, keys: mx.array, mask: Any) -> bool:
    """Whether `grouped_chunk` computes what MLX's attention with `mask` would: several queries a
    row, a boolean mask of one head, whole groups of query heads a key-value head."""
    return (GROUPED and q.ndim == 4 and q.shape[2] > 1 and isinstance(mask, mx.array)
            and mask.dtype == mx.bool_ and mask.ndim == 4 and mask.shape[1] == 1
            and keys.shape[1] > 0 and q.shape[1] % keys.shape[1] == 0 and keys.shape[-1] == q.shape[-1])


def grouped_chunk(q: mx.array, keys: mx.array, values: mx.array, scale: float, mask: mx.array) -> mx.array:
    """A prompt chunk's attention (`q`: `(rows, heads, length, D)`; `keys`, `values`: `(rows,
    kv_heads, positions, D)`; `mask`: `(rows, 1, length, positions)`, True where a query may look)
    as MLX's masked path on CUDA computes it: the scaled queries' scores, the lowest value where
    masked, a softmax in float32, the weighted sum. MLX broadcasts each key-value head over the
    query heads that share it, and a product over a broadcast batch first sets up an array of
    pointers on the device (a launch for each product, and a set of managed memory). Here a
    key-value head's query heads are one matrix of `heads / kv_heads x length` rows, so both
    products are plain batched ones."""
    rows, heads, length, dim = q.shape
    kv_heads = keys.shape[1]
    group = heads // kv_heads
    scaled = (q * mx.array(scale, dtype=q.dtype)).reshape(rows, kv_heads, group * length, dim)
    scores = (scaled @ keys.swapaxes(-1, -2)).reshape(rows, kv_heads, group, length, -1)
    lowest = mx.array(mx.finfo(scores.dtype).min, dtype=scores.dtype)
    scores = mx.where(mx.expand_dims(mask, 2), scores, lowest)
    weights = mx.softmax(scores, axis=-1, precise=True).reshape(rows, kv_heads, group * length, -1)
    out: mx.array = (weights @ values).reshape(rows, heads, length, dim)
    return out


TOLERANCE = 0.02
"""The largest difference from MLX's masked attention allowed in half precision (measured
0.006-0.008 in bfloat16 over 600 positions)."""


def padding_mask(start: mx.array, length: int) -> mx.array:
    """The mask mlx-lm's batch cache gives one query a row over `length` positions: each row's
    positions from `start[row]` on."""
    return mx.expand_dims(start, (1, 2, 3)) <= mx.arange(length)


def difference(q: mx.array, keys: mx.array, values: mx.array, start: mx.array, scale: float,
               warps: int | None = None) -> float:
    """The largest difference between `padded_decode` and MLX's attention with `padding_mask`."""
    want = mx.fast.scaled_dot_product_attention(
        q, keys, values, scale=scale, mask=padding_mask(start, keys.shape[2]))
    got = padded_decode(q, keys, values, start, scale, warps)
    return cast("float", mx.max(mx.abs(got.astype(mx.float32) - want.astype(mx.float32))).item())


def check(heads: int = 4, kv_heads: int = 2, dim: int = 64) -> str:
    """The kernel against MLX's masked attention for one head layout ("" when they agree), with
    each block size that layout can take: it is compiled at run time, for each layout, so a
    toolkit or an MLX that cannot build or run it shows here, once, and not in a decode step.
    Three rows over 300 positions, padded by 3, 0 and 200, so that warps meet several tiles."""
    keys = mx.random.split(mx.random.key(0), 3)
    group = heads // kv_heads
    try:
        q, k, v = (mx.random.normal(shape, key=keys[i]).astype(mx.bfloat16) for i, shape in
                   enumerate(((3, heads, 1, dim), (3, kv_heads, 300, dim), (3, kv_heads, 300, dim))))
        start = mx.array([3, 0, 200], dtype=mx.int32)
        error = max(difference(q, k, v, start, dim ** -0.5, warps)
                    for warps in {warps_for(rows, kv_heads, group, dim) for rows in (1, 256)})
    except Exception as exc:  # noqa: BLE001 - any failure to build or run it means MLX's path
        return f"the kernel did not run here ({type(exc).__name__}: {exc})"
    if not error < TOLERANCE:
        return f"the kernel's check differed from MLX's attention by {error:.3g}"
    return ""


def chunk_mask(start: list[int], length: int, positions: int) -> mx.array:
    """The mask mlx-lm's batch cache gives a chunk of `length` queries at the end of `positions`:
    each row's positions from `start[row]` on, and none after the query's own."""
    position = mx.arange(positions)
    first = mx.array(start)[:, None, None, None]
    last = (mx.arange(length) + positions - length)[:, None]
    return (position >= first) & (position <= last)


def chunk_check(heads: int, kv_heads: int, dim: int) -> str:
    """`grouped_chunk` against MLX's masked attention for one head layout ("" when they agree):
    two rows of a 5-token chunk over 9 positions, one left-padded by 3."""
    keys = mx.random.split(mx.random.key(1), 3)
    q, k, v = (mx.random.normal(shape, key=keys[i]).astype(mx.bfloat16) for i, shape in
               enumerate(((2, heads, 5, dim), (2, kv_heads, 9, dim), (2, kv_heads, 9, dim))))
    mask = chunk_mask([3, 0], 5, 9)
    try:
        want = mx.fast.scaled_dot_product_attention(q, k, v, scale=dim ** -0.5, mask=mask)
        got = grouped_chunk(q, k, v, dim ** -0.5, mask)
        error = cast("float", mx.max(mx.abs(got.astype(mx.float32) - want.astype(mx.float32))).item())
    except Exception as exc:  # noqa: BLE001 - any failure here means MLX's path
        return f"the grouped chunk attention did not run here ({type(exc).__name__}: {exc})"
    if not error < TOLERANCE:
        return f"the grouped chunk attention differed from MLX's attention by {error:.3g}"
    return ""


def install(model: Any) -> str:
    """Route the attention of `model`'s layers through `attention` ("" when it is; else why not).
    It replaces the name in the modules of the model's attention classes, so it holds for every
    model of those classes in the process; `usable` keeps it to our engine's decode batches."""
    global _installed
    if not on_cuda():
        return "not on MLX's CUDA backend"
    args = getattr(model, "args", None)
    heads: int = getattr(args, "num_attention_heads", None) or 0
    width = getattr(args, "head_dim", None) or (getattr(args, "hidden_size", 0) // heads if heads else None)
    if width not in HEAD_DIMS:
        return f"its attention heads are {width} wide; the kernel serves {list(HEAD_DIMS)}"
    kv_heads: int = getattr(args, "num_key_value_heads", None) or heads
    if not grouped(heads, kv_heads, width):
        return f"its {heads} query heads over {kv_heads} key-value heads do not suit the kernel"
    if host_padding_unavailable():
        return "the batch caches are mlx-lm's own here (see host_padding_unavailable)"
    failed = check(heads, kv_heads, width)
    if failed:
        return failed
    global GROUPED
    chunks_failed = chunk_check(heads, kv_heads, width)
    if chunks_failed:  # the decode kernel still serves; chunks keep MLX's path
        GROUPED = False
        log.warning("grouped_chunk_attention_unavailable", reason=chunks_failed)
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

"""Which decode steps `workers/batching/padded_attention.py` takes from MLX's masked attention.

The kernel itself runs only on MLX's CUDA backend (`benchmarks/padded_attention.py` checks it
against MLX's masked attention there); here, on any backend: what it is installed on, which calls
it would serve, and that every other call gets MLX's own attention unchanged."""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import pytest
from mlx_lm.models import llama
from mlx_lm.models.cache import BatchKVCache

from workers.batching import padded_attention
from workers.batching.engine import MLXEngine
from workers.batching.hostpad import HostPaddedKVCache
from workers.loading.dtypes import on_cuda

SHAPE: dict[str, Any] = dict(model_type="llama", num_hidden_layers=1, intermediate_size=64,
                             num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-5,
                             vocab_size=64)


def model(head: int) -> Any:
    return llama.Model(llama.ModelArgs(hidden_size=4 * head, **SHAPE))


@pytest.fixture
def cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    """As on the CUDA backend, where the kernel passes its check; whatever `install` patches is
    put back after the test."""
    monkeypatch.setattr(padded_attention, "on_cuda", lambda: True)
    monkeypatch.setattr(padded_attention, "check", lambda *layout: "")
    monkeypatch.setattr(padded_attention, "_installed", False)
    monkeypatch.setattr(llama, "scaled_dot_product_attention", llama.scaled_dot_product_attention)


def decode(cache_class: type, length: int = 1, dtype: Any = mx.bfloat16) -> tuple[Any, ...]:
    """A step's queries, keys and values over two rows left-padded by 2 and 0, with the cache and
    the mask the model's own pass would give the attention."""
    c = cache_class([2, 0])
    c.update_and_fetch(mx.ones((2, 2, 5, 64), dtype), mx.ones((2, 2, 5, 64), dtype))
    mask = c.make_mask(length)
    keys, values = c.update_and_fetch(mx.ones((2, 2, length, 64), dtype), mx.ones((2, 2, length, 64), dtype))
    return mx.ones((2, 4, length, 64), dtype), keys, values, c, mask


def test_off_cuda_nothing_is_installed() -> None:
    before = llama.scaled_dot_product_attention
    assert padded_attention.install(model(64)) == "not on MLX's CUDA backend"
    assert llama.scaled_dot_product_attention is before is padded_attention.MLX_ATTENTION
    q, keys, values, c, mask = decode(HostPaddedKVCache)
    assert not padded_attention.usable(q, keys, c, mask)


@pytest.mark.usefixtures("cuda")
def test_on_cuda_the_model_modules_attention_goes_through_ours() -> None:
    assert padded_attention.install(model(64)) == ""
    assert llama.scaled_dot_product_attention is padded_attention.attention
    assert padded_attention.install(model(64)) == ""  # a second engine: already routed


def test_a_kernel_that_cannot_run_is_named_and_nothing_is_routed(monkeypatch: pytest.MonkeyPatch) -> None:
    # Told it is on CUDA, on a backend that is not: the check's own call of the kernel fails.
    if on_cuda():
        pytest.skip("on CUDA the kernel runs")
    monkeypatch.setattr(padded_attention, "on_cuda", lambda: True)
    monkeypatch.setattr(padded_attention, "_installed", False)
    monkeypatch.setattr(llama, "scaled_dot_product_attention", llama.scaled_dot_product_attention)
    reason = padded_attention.install(model(64))
    assert reason.startswith("the kernel did not run here")
    assert llama.scaled_dot_product_attention is padded_attention.MLX_ATTENTION
    assert not padded_attention._installed


@pytest.mark.usefixtures("cuda")
def test_without_our_batch_caches_nothing_is_routed(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(padded_attention, "host_padding_unavailable", lambda: "filter differs")
    assert "mlx-lm's own" in padded_attention.install(model(64))
    assert llama.scaled_dot_product_attention is padded_attention.MLX_ATTENTION


@pytest.mark.usefixtures("cuda")
def test_heads_64_and_128_wide_are_served_and_others_named(monkeypatch: pytest.MonkeyPatch) -> None:
    assert padded_attention.install(model(128)) == ""
    monkeypatch.setattr(llama, "scaled_dot_product_attention", padded_attention.MLX_ATTENTION)
    reason = padded_attention.install(model(96))
    assert "96 wide" in reason and "[64, 128]" in reason
    assert llama.scaled_dot_product_attention is padded_attention.MLX_ATTENTION


@pytest.mark.usefixtures("cuda")
def test_the_check_runs_the_models_own_head_layout(monkeypatch: pytest.MonkeyPatch) -> None:
    # Each layout compiles a kernel of its own: the one checked must be the one decode steps run.
    checked: list[tuple[int, ...]] = []
    monkeypatch.setattr(padded_attention, "check", lambda *layout: checked.append(layout) or "")
    assert padded_attention.install(model(64)) == ""
    assert checked == [(4, 2, 64)]


@pytest.mark.usefixtures("cuda")
def test_more_query_heads_a_key_value_head_than_its_memory_holds_are_named() -> None:
    args = dict(SHAPE, num_attention_heads=72, num_key_value_heads=1)
    wide = llama.Model(llama.ModelArgs(hidden_size=64, head_dim=128, **args))
    assert "72 query heads over 1 key-value heads" in padded_attention.install(wide)
    assert llama.scaled_dot_product_attention is padded_attention.MLX_ATTENTION
    q = mx.zeros((1, 72, 1, 128), mx.bfloat16)
    keys = mx.zeros((1, 1, 4, 128), mx.bfloat16)
    padded_attention._installed = True  # as after another model's install
    cache, mask = HostPaddedKVCache([0]), mx.ones((1, 1, 1, 4), mx.bool_)
    assert not padded_attention.usable(q, keys, cache, mask)
    assert padded_attention.usable(q[:, :8], keys, cache, mask)  # 8 x 128 fits


def test_blocks_take_more_warps_where_they_are_few_and_fewer_where_memory_is_short() -> None:
    assert padded_attention.warps_for(64, 8, 4, 64) == 4  # 512 blocks: the 1B shape
    assert padded_attention.warps_for(64, 2, 7, 64) == 8  # 128 blocks: the 0.5B shape
    assert padded_attention.warps_for(1, 1, 32, 128) == 2  # 32 x 128 partial outputs a warp
    for rows, kv, group, dim in ((1, 1, 1, 64), (64, 2, 7, 64), (8, 4, 16, 128)):
        warps = padded_attention.warps_for(rows, kv, group, dim)
        assert warps * group * dim <= padded_attention.SHARED_FLOATS


@pytest.mark.usefixtures("cuda")
def test_only_our_engines_padded_decode_rows_are_served(monkeypatch: pytest.MonkeyPatch) -> None:
    assert padded_attention.install(model(64)) == ""
    q, keys, values, c, mask = decode(HostPaddedKVCache)
    assert isinstance(mask, mx.array) and padded_attention.usable(q, keys, c, mask)
    assert not padded_attention.usable(q, keys, c, None)  # no row padded: MLX's own kernel
    assert not padded_attention.usable(*_pick(decode(BatchKVCache)))  # a bare mlx-lm batch
    assert not padded_attention.usable(*_pick(decode(HostPaddedKVCache, length=3)))  # a chunk
    assert not padded_attention.usable(*_pick(decode(HostPaddedKVCache, dtype=mx.float32)))
    monkeypatch.setattr(padded_attention, "ENABLED", False)
    assert not padded_attention.usable(q, keys, c, mask)


def _pick(case: tuple[Any, ...]) -> tuple[Any, ...]:
    q, keys, _values, c, mask = case
    return q, keys, c, mask


def test_what_it_does_not_serve_gets_mlxs_attention_unchanged() -> None:
    q, keys, values, c, mask = decode(BatchKVCache, length=3, dtype=mx.float32)
    q = mx.random.normal(q.shape)
    got = padded_attention.attention(q, keys, values, cache=c, scale=0.125, mask=mask)
    want = mx.fast.scaled_dot_product_attention(q, keys, values, scale=0.125, mask=mask)
    assert mx.array_equal(got, want).item()


def test_off_cuda_the_engine_says_nothing_is_missing(tiny_model: Any) -> None:
    e = MLXEngine(tiny_model, vocab_size=256, max_batch=2, prefill_batch=2, prefill_step=64)
    assert e.padded_attention is False and e.padded_attention_unavailable == ""
    e.close()


def test_the_padding_mask_is_the_one_mlx_lms_batch_cache_makes() -> None:
    _q, keys, _values, c, mask = decode(HostPaddedKVCache)
    mine = padded_attention.padding_mask(c.left_padding, keys.shape[2])
    assert mine.shape == mask.shape and mx.array_equal(mine, mask).item()


@pytest.mark.parametrize(("heads", "kv_heads"), [(4, 2), (14, 2), (32, 8), (4, 4)])
def test_a_chunks_grouped_attention_is_mlxs_masked_attention(heads: int, kv_heads: int) -> None:
    """A chunk of 5 queries a row after 4 held positions, rows left-padded by 3 and 0, the keys
    a view of a cache buffer with room to spare, the mask mlx-lm's batch cache makes."""
    rng = mx.random.split(mx.random.key(heads * 10 + kv_heads), 5)
    c: Any = BatchKVCache([3, 0])
    c.update_and_fetch(mx.random.normal((2, kv_heads, 4, 64), key=rng[0]),
                       mx.random.normal((2, kv_heads, 4, 64), key=rng[1]))
    mask = c.make_mask(5)
    keys, values = c.update_and_fetch(mx.random.normal((2, kv_heads, 5, 64), key=rng[2]),
                                      mx.random.normal((2, kv_heads, 5, 64), key=rng[3]))
    assert keys.shape[2] == 9 and c.keys.shape[2] > 9  # a view of a longer buffer
    assert mx.array_equal(mask, padded_attention.chunk_mask([3, 0], 5, 9)).item()
    q = mx.random.normal((2, heads, 5, 64), key=rng[4])
    assert padded_attention.chunk_usable(q, keys, mask)
    for dtype, tolerance in ((mx.float32, 1e-5), (mx.bfloat16, padded_attention.TOLERANCE)):
        args = (q.astype(dtype), keys.astype(dtype), values.astype(dtype))
        want = mx.fast.scaled_dot_product_attention(*args, scale=0.125, mask=mask)
        got = padded_attention.grouped_chunk(*args, 0.125, mask)
        assert got.shape == want.shape and got.dtype == dtype
        assert mx.max(mx.abs(got.astype(mx.float32) - want.astype(mx.float32))).item() < tolerance
    assert padded_attention.chunk_check(heads, kv_heads, 64) == ""


def test_once_installed_a_chunks_attention_takes_the_grouped_products(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(padded_attention, "_installed", True)  # as after `install` on CUDA
    q, keys, values, c, mask = decode(HostPaddedKVCache, length=3, dtype=mx.float32)
    q = mx.random.normal(q.shape, key=mx.random.key(3))
    got = padded_attention.attention(q, keys, values, cache=c, scale=0.125, mask=mask)
    assert mx.array_equal(got, padded_attention.grouped_chunk(q, keys, values, 0.125, mask)).item()
    mlx = mx.fast.scaled_dot_product_attention(q, keys, values, scale=0.125, mask=mask)
    assert mx.allclose(got, mlx, atol=1e-5).item()  # the same values, by other products
    monkeypatch.setattr(padded_attention, "GROUPED", False)  # the benchmarks' switch: MLX's path
    off = padded_attention.attention(q, keys, values, cache=c, scale=0.125, mask=mask)
    assert mx.array_equal(off, mlx).item()
    monkeypatch.setattr(padded_attention, "GROUPED", True)
    # not a chunk, or a mask it does not read: MLX's path
    assert not padded_attention.chunk_usable(q[:, :, :1], keys, mask[:, :, :1])
    assert not padded_attention.chunk_usable(q, keys, "causal")
    assert not padded_attention.chunk_usable(q, keys, mask.astype(mx.float32))
    assert not padded_attention.chunk_usable(q[:, :3], keys, mask)  # 3 heads over 2: not whole groups


@pytest.mark.usefixtures("cuda")
def test_a_chunk_check_that_fails_leaves_chunks_to_mlx_and_the_decode_kernel_installed(
    monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(padded_attention, "GROUPED", True)
    monkeypatch.setattr(padded_attention, "chunk_check", lambda *layout: "differed by 0.5")
    assert padded_attention.install(model(64)) == ""
    assert padded_attention._installed and not padded_attention.GROUPED
    q, keys, values, c, mask = decode(HostPaddedKVCache, length=3, dtype=mx.float32)
    assert not padded_attention.chunk_usable(q, keys, mask)

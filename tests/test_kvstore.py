"""The worker's store of prefix blocks, on real MLX arrays: what it gives back is the stored
tokens' KV, and what the pool evicts is freed."""

from __future__ import annotations

import mlx.core as mx

from workers.batching.kvstore import KVStore

LAYERS, HEADS, DIM, BT = 3, 2, 4, 4


def row(tokens: int, seed: int) -> list[tuple[mx.array, mx.array]]:
    """A sequence's KV per layer; every value distinct, so a wrong index shows."""
    base = seed * 1_000_000
    shape = (1, HEADS, tokens, DIM)
    size = HEADS * tokens * DIM
    return [(mx.arange(base + 2 * layer * size, base + (2 * layer + 1) * size).reshape(shape),
             mx.arange(base + (2 * layer + 1) * size, base + (2 * layer + 2) * size).reshape(shape))
            for layer in range(LAYERS)]


def tokens_of(kv: list[tuple[mx.array, mx.array]], start: int, end: int) -> list[tuple[mx.array, mx.array]]:
    return [(k[:, :, start:end], v[:, :, start:end]) for k, v in kv]


def assert_holds(store: KVStore, keys: list[int], expected: list[tuple[mx.array, mx.array]]) -> None:
    blocks, caches = store.prefix_cache(keys)
    assert caches is not None and blocks * BT == expected[0][0].shape[2]
    for c, (k, v) in zip(caches, expected, strict=True):
        assert c.offset == blocks * BT
        assert mx.array_equal(c.keys, k).item() and mx.array_equal(c.values, v).item()


def test_a_chain_over_several_stores_gives_back_its_tokens() -> None:
    store = KVStore(BT)
    a = row(3 * BT + 1, seed=1)
    assert store.store_blocks([10, 11], 0, a, 0) == [(10, BT), (11, BT)]
    # Block 1 is stored already: only 2 is new, from a second sequence sharing the prefix.
    b = row(3 * BT, seed=2)
    assert store.store_blocks([11, 12], 1, b, 0) == [(12, BT)]
    store.settle()
    assert len(store) == 3
    expected = [(mx.concatenate([ka[:, :, : 2 * BT], kb[:, :, 2 * BT :]], axis=2),
                 mx.concatenate([va[:, :, : 2 * BT], vb[:, :, 2 * BT :]], axis=2))
                for (ka, va), (kb, vb) in zip(a, b, strict=True)]
    assert_holds(store, [10, 11, 12, 13], expected)  # 13 is not stored: the chain stops there
    assert store.prefix_cache([11, 10])[0] == 2  # any stored keys, in the order asked
    assert store.prefix_cache([99, 10]) == (0, None)


def test_blocks_start_at_the_rows_padding_even_while_it_is_an_array() -> None:
    store = KVStore(BT)
    padded = row(3 + 2 * BT, seed=3)
    store.store_blocks([1, 2], 0, padded, mx.array(3))  # a batch row's left padding
    store.settle()
    assert_holds(store, [1, 2], tokens_of(padded, 3, 3 + 2 * BT))


def test_evicting_part_of_a_store_frees_that_part_and_keeps_the_rest() -> None:
    store = KVStore(BT)
    kv = row(4 * BT, seed=4)
    store.store_blocks([1, 2, 3, 4], 0, kv, 0)
    store.settle()
    whole = store.nbytes()
    assert whole == sum(k.nbytes + v.nbytes for k, v in kv)

    store.evict([4, 2])  # a gap: the rest are copied down to blocks 1 and 3
    assert store.nbytes() == whole // 2
    assert_holds(store, [1], tokens_of(kv, 0, BT))
    assert store.prefix_cache([1, 2])[0] == 1
    _, caches = store.prefix_cache([3])
    assert caches is not None and mx.array_equal(caches[0].keys, kv[0][0][:, :, 2 * BT : 3 * BT]).item()

    store.evict([1, 3, "no-such-session"])
    assert (len(store), store.nbytes()) == (0, 0)

"""Stored KV on the worker thread: prefix blocks and finished sessions, as MLX arrays.

The pool keeps the books (which keys exist, how many blocks they cost, when to evict); this
store keeps the arrays under the same keys and does what the worker is told.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import mlx.core as mx
from mlx_lm.models.cache import KVCache

from workers.batching.cachekinds import cache_arrays

if TYPE_CHECKING:
    from collections.abc import Sequence

    from workers.messages import Key

LayerKV = tuple[mx.array, mx.array]


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


class KVStore:
    """Prefix blocks of `block_tokens` tokens (per layer: keys, values `[1, heads, block, dim]`)
    and session caches (one per layer, of any class mlx-lm can batch, and the tokens they hold)."""

    def __init__(self, block_tokens: int) -> None:
        self.block_tokens = block_tokens
        self._blocks: dict[int, list[LayerKV]] = {}
        self._sessions: dict[str, tuple[list[Any], list[int]]] = {}
        self._unsettled: list[mx.array] = []

    def __len__(self) -> int:
        return len(self._blocks) + len(self._sessions)

    def prefix_cache(self, keys: Sequence[int]) -> tuple[int, list[Any] | None]:
        """A fresh `KVCache` per layer holding the longest stored chain of `keys` (and how many
        blocks it holds); (0, None) when the first is not stored."""
        blocks: list[list[LayerKV]] = []
        for key in keys:
            block = self._blocks.get(key)
            if block is None:
                break
            blocks.append(block)
        if not blocks:
            return 0, None
        caches = []
        for layer in range(len(blocks[0])):
            c = KVCache()  # type: ignore[no-untyped-call]
            c.keys = mx.concatenate([b[layer][0] for b in blocks], axis=2)
            c.values = mx.concatenate([b[layer][1] for b in blocks], axis=2)
            c.offset = len(blocks) * self.block_tokens
            caches.append(c)
        return len(blocks), caches

    def store_blocks(
        self, keys: Sequence[int], first: int, row: Sequence[LayerKV], start: int | mx.array
    ) -> list[tuple[Key, int]]:
        """Keep blocks `first, first + 1, ...` of a sequence whose KV per layer is `row`, its
        token 0 at index `start` of axis 2, under `keys`. Returns what was newly stored; the
        copies run at the next `settle()`. `start` may be a scalar array still being computed
        (a batch row's left padding): the copies gather at it, as reading it would wait for the
        GPU."""
        bt = self.block_tokens
        new: list[tuple[Key, int]] = []
        at = start + mx.arange(bt)  # a gather copies: no block is a view of `row`'s buffer
        for i, key in enumerate(keys):
            if key in self._blocks:
                continue
            pos = at + (first + i) * bt
            block = [(mx.take(k, pos, axis=2), mx.take(v, pos, axis=2)) for k, v in row]
            self._blocks[key] = block
            self._unsettled.extend(a for kv in block for a in kv)
            new.append((key, bt))
        return new

    def settle(self) -> None:
        """Start the copies `store_blocks` asked for, all of a step's at once, without waiting:
        once they run, no block is a view of the batch's buffer. Waiting for each prompt's
        copies broke MLX's pipelined decode: on an H200, while 256 requests were admitted, the
        worker thread spent a quarter of its time in that wait."""
        if self._unsettled:
            mx.async_eval(self._unsettled)  # type: ignore[no-untyped-call]
            self._unsettled = []

    def keep_session(self, name: str, cache: list[Any], tokens: list[int]) -> tuple[Key, int]:
        mx.eval(cache_arrays(cache))  # detach from the batch's buffer
        self._sessions[name] = (cache, list(tokens))
        return name, len(tokens)

    def take_session(self, name: str) -> tuple[list[Any], list[int]] | None:
        return self._sessions.pop(name, None)

    def evict(self, keys: Sequence[Key]) -> None:
        for key in keys:
            if isinstance(key, str):
                self._sessions.pop(key, None)
            else:
                self._blocks.pop(key, None)

    def clear(self) -> None:
        self._blocks.clear()
        self._sessions.clear()

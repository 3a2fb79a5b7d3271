"""What a model's cache objects allow: sessions (keep a finished sequence's caches and continue
from them) and block-level prefix reuse (slice a sequence's KV into blocks of tokens).

Decided from the cache objects `make_prompt_cache(model)` returns, not from a list of model
families, so a new mlx-lm architecture is judged by what its caches can do.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import mlx.core as mx
from mlx_lm.models.cache import KVCache

if TYPE_CHECKING:
    from collections.abc import Sequence


@dataclass(frozen=True)
class CacheSupport:
    """`sessions`: every layer's cache can be extracted from a batch and inserted again (mlx-lm
    batches through `merge()`, and the batched caches have `extract()`). `prefix_blocks`: every
    layer is a plain `KVCache`, whose keys and values can be cut into blocks of tokens.
    `reason`: why prefix blocks are unavailable ("" when they are)."""

    sessions: bool
    prefix_blocks: bool
    reason: str
    classes: tuple[str, ...]


def cache_support(cache: Sequence[Any]) -> CacheSupport:
    classes = tuple(sorted({type(c).__name__ for c in cache}))
    sessions = bool(cache) and all(callable(getattr(type(c), "merge", None)) for c in cache)
    prefix = bool(cache) and all(type(c) is KVCache for c in cache)
    reason = ""
    if not prefix:
        others = ", ".join(n for n in classes if n != "KVCache") or "no cache"
        reason = (
            f"layers with {others} hold no per-token KV that blocks of tokens can be cut from "
            "(a sliding window rotates, a recurrent state sums the whole prefix); "
            "only plain KVCache layers can share prefix blocks"
        )
    return CacheSupport(sessions, prefix, reason, classes)


def cache_arrays(obj: Any) -> list[mx.array]:
    """Every array a cache (or a list of them) holds, to evaluate them."""
    if isinstance(obj, mx.array):
        return [obj]
    if isinstance(obj, (list, tuple)):
        return [a for x in obj for a in cache_arrays(x)]
    fields = getattr(obj, "__dict__", None)
    return cache_arrays(list(fields.values())) if fields else []


def trimmable(cache: Sequence[Any], n: int) -> bool:
    """Whether `n` tokens can be trimmed from the end of every layer's cache."""
    return n == 0 or all(c.is_trimmable() for c in cache)

"""What mlx-lm's dense, left-padded batch cache really costs.

`BatchGenerator` keeps one `BatchKVCache` of shape `[rows, kv_heads, T, head_dim]` per layer.
Rows are right-aligned to the longest (shorter ones left-padded), and the buffer grows by
`DENSE_STEP` tokens when the longest row reaches its end; it shrinks only by the padding every
row shares. So `T` is at most the longest row plus `DENSE_STEP` (measured: buffers 248 tokens
past a 510-token row), and the batch costs rows x T, not the sum of the rows' lengths; the books
charge the difference to the `PADDING` holder.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvpool.books import blocks_for

if TYPE_CHECKING:
    from collections.abc import Iterable

DENSE_STEP = 256
"""mlx-lm's `KVCache.step`: the batch cache's buffer grows by this many tokens at a time."""


def dense_tokens(rows: int, longest: int, step: int = DENSE_STEP) -> int:
    """Token slots a dense batch cache of `rows` rows, the longest `longest` tokens, may hold:
    the longest row plus the slack of one growth step, for every row."""
    if rows <= 0 or longest <= 0:
        return 0
    return rows * (longest + step) if step > 1 else rows * longest


def padding_blocks(lengths: Iterable[int], held: int, block_tokens: int, step: int = DENSE_STEP) -> int:
    """Blocks the dense cache needs beyond the `held` blocks its rows hold themselves."""
    rows = 0
    longest = 0
    for n in lengths:
        rows += 1
        longest = max(longest, n)
    return max(0, blocks_for(dense_tokens(rows, longest, step), block_tokens) - held)

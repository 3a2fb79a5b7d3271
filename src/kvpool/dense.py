"""What mlx-lm's dense, left-padded batch cache really costs, layer kind by layer kind.

Full attention: `BatchGenerator` keeps one `BatchKVCache` of shape `[rows, kv_heads, T, head_dim]`
per layer. Rows are right-aligned to the longest (shorter ones left-padded), and the buffer grows
by `DENSE_STEP` tokens when the longest row reaches its end; it shrinks only by the padding every
row shares. So `T` is at most the longest row plus `DENSE_STEP` (measured: buffers 248 tokens
past a 510-token row), and the batch costs rows x T, not the sum of the rows' lengths; the books
charge the difference to the `PADDING` holder.

Sliding window: a `BatchRotatingKVCache` grows the same way but never past its window while
decoding (measured on gemma3_text, window 64: `T` = min(longest + 256, 64) for every row). While
a prompt is prefilled its own batch briefly holds window + chunk - 1 tokens; that transient is not
booked, like the full layers' concatenation when a row joins.

Recurrent (`ArraysCache`): a fixed state per row, whatever its length.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import msgspec

from kvpool.books import blocks_for

if TYPE_CHECKING:
    from collections.abc import Iterable

DENSE_STEP = 256
"""mlx-lm's `KVCache.step`: the batch cache's buffer grows by this many tokens at a time."""


class LayerBytes(msgspec.Struct, frozen=True):
    """A model's cache layers as the books see them: bytes per token of the full-attention
    layers, (window, bytes per token) of each group of sliding layers, bytes per row of the
    recurrent ones, and `unit`, the bytes per token of one block's token (the pool's unit)."""

    unit: int
    full: int
    sliding: tuple[tuple[int, int], ...] = ()
    row: int = 0


def dense_tokens(rows: int, longest: int, step: int = DENSE_STEP) -> int:
    """Token slots a dense batch cache of `rows` rows, the longest `longest` tokens, may hold:
    the longest row plus the slack of one growth step, for every row."""
    if rows <= 0 or longest <= 0:
        return 0
    return rows * (longest + step) if step > 1 else rows * longest


def dense_bytes(rows: int, longest: int, layers: LayerBytes, step: int = DENSE_STEP) -> int:
    """Bytes the batch caches of all layers may hold for `rows` rows, the longest `longest`."""
    if rows <= 0 or longest <= 0:
        return 0
    slots = longest + step if step > 1 else longest
    per_row = slots * layers.full + layers.row
    per_row += sum(min(slots, window) * size for window, size in layers.sliding)
    return rows * per_row


def padding_blocks(
    lengths: Iterable[int],
    held: int,
    block_tokens: int,
    step: int = DENSE_STEP,
    layers: LayerBytes | None = None,
) -> int:
    """Blocks the dense cache needs beyond the `held` blocks its rows hold themselves (every
    layer full attention unless `layers` says otherwise)."""
    rows = 0
    longest = 0
    for n in lengths:
        rows += 1
        longest = max(longest, n)
    return padding_of(rows, longest, held, block_tokens, step, layers)


def padding_of(
    rows: int,
    longest: int,
    held: int,
    block_tokens: int,
    step: int = DENSE_STEP,
    layers: LayerBytes | None = None,
) -> int:
    """`padding_blocks` of `rows` rows, the longest `longest` tokens: all the dense cache's size
    depends on, so callers that keep both need not walk the rows."""
    if layers is None:
        return max(0, blocks_for(dense_tokens(rows, longest, step), block_tokens) - held)
    block_bytes = block_tokens * layers.unit
    need = -(-dense_bytes(rows, longest, layers, step) // block_bytes)
    return max(0, need - held)

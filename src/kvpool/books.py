"""KV block books: a pure, synchronous state machine (no event loop, no MLX)."""

from __future__ import annotations

from collections import deque

import msgspec


class PoolSnapshot(msgspec.Struct, frozen=True):
    """The books at one moment, for `stats()`."""

    blocks_total: int
    blocks_used: int
    blocks_cached: int
    blocks_free: int
    block_tokens: int
    bytes_per_block: int


def blocks_for(tokens: int, block_tokens: int) -> int:
    """Blocks needed to hold `tokens` tokens of KV."""
    return -(-tokens // block_tokens)


class BlockBooks:
    """Which block belongs to which request. Invariant: used + free (+ cached) == total."""

    def __init__(self, total: int, block_tokens: int, bytes_per_block: int) -> None:
        if total < 1:
            raise ValueError(f"the pool needs at least one block, got {total}")
        self.total = total
        self.block_tokens = block_tokens
        self.bytes_per_block = bytes_per_block
        self._free: deque[int] = deque(range(total))
        self._tables: dict[int, list[int]] = {}

    @property
    def free(self) -> int:
        return len(self._free)

    @property
    def used(self) -> int:
        return self.total - len(self._free)

    def table(self, rid: int) -> list[int]:
        return list(self._tables.get(rid, ()))

    def holders(self) -> list[int]:
        return list(self._tables)

    def reserve(self, rid: int, blocks: int) -> list[int] | None:
        """Hand `blocks` more blocks to `rid`, or None (and change nothing) if too few are free."""
        if blocks < 0:
            raise ValueError(f"cannot reserve {blocks} blocks")
        if blocks > len(self._free):
            return None
        got = [self._free.popleft() for _ in range(blocks)]
        self._tables.setdefault(rid, []).extend(got)
        return got

    def release(self, rid: int) -> int:
        """Return every block `rid` holds; releasing an unknown rid is a no-op returning 0."""
        blocks = self._tables.pop(rid, [])
        self._free.extend(blocks)
        assert len(self._free) <= self.total, "a block was returned twice"
        return len(blocks)

    def snapshot(self) -> PoolSnapshot:
        return PoolSnapshot(
            blocks_total=self.total,
            blocks_used=self.used,
            blocks_cached=0,
            blocks_free=self.free,
            block_tokens=self.block_tokens,
            bytes_per_block=self.bytes_per_block,
        )

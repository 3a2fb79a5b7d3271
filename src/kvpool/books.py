"""KV block books: a pure, synchronous state machine (no event loop, no MLX).

Every block is in exactly one place: free, held by a holder (a request, or `PADDING` for the dense
batch cache's padding), or held by a cache entry (a prefix block or a session's sequence). So
`used + cached + free == total` always. Cache entries are reference-counted by the requests that
pin them and evicted least recently used first, only when unpinned.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import msgspec

if TYPE_CHECKING:
    from collections.abc import Iterable, Sequence

Key = int | str
"""A cache entry's key: a prefix block's chained hash (int) or a session name (str)."""

PADDING = -1
"""The holder of the blocks the dense, left-padded batch cache spends on padding."""


class PoolSnapshot(msgspec.Struct, frozen=True):
    """The books at one moment, for `stats()`."""

    blocks_total: int
    blocks_used: int
    blocks_cached: int
    blocks_free: int
    block_tokens: int
    bytes_per_block: int
    blocks_padding: int = 0
    cache_entries: int = 0
    evictions: int = 0


def blocks_for(tokens: int, block_tokens: int) -> int:
    """Blocks needed to hold `tokens` tokens of KV."""
    return -(-tokens // block_tokens)


@dataclass(eq=False)
class _Entry:
    blocks: list[int]
    tokens: int
    pins: set[int] = field(default_factory=set)


class BlockBooks:
    """Which block belongs to which holder or cache entry. Invariant: used + cached + free == total."""

    def __init__(self, total: int, block_tokens: int, bytes_per_block: int) -> None:
        if total < 1:
            raise ValueError(f"the pool needs at least one block, got {total}")
        if block_tokens < 1:
            raise ValueError(f"block_tokens must be at least 1, got {block_tokens}")
        self.total = total
        self.block_tokens = block_tokens
        self.bytes_per_block = bytes_per_block
        self.evictions = 0
        self._free: deque[int] = deque(range(total))
        self._tables: dict[int, list[int]] = {}
        self._entries: OrderedDict[Key, _Entry] = OrderedDict()  # least recently used first
        self._cached = 0
        self._evictable = 0
        """Blocks in unpinned entries, kept up to date so a Reserve never scans the cache."""
        self._pins: dict[int, list[Key]] = {}
        self._pending: dict[Key, int] = {}
        self._pending_of: dict[int, list[Key]] = {}

    # ---- views ---------------------------------------------------------------------------
    @property
    def free(self) -> int:
        return len(self._free)

    @property
    def cached(self) -> int:
        return self._cached

    @property
    def used(self) -> int:
        return self.total - len(self._free) - self._cached

    @property
    def evictable(self) -> int:
        """Blocks in cache entries no request pins (O(1))."""
        return self._evictable

    def held(self, rid: int) -> int:
        return len(self._tables.get(rid, ()))

    def table(self, rid: int) -> list[int]:
        return list(self._tables.get(rid, ()))

    def holders(self) -> list[int]:
        return list(self._tables)

    def entry_size(self, key: Key) -> tuple[int, int] | None:
        """(blocks, tokens) of a cache entry; None when absent."""
        entry = self._entries.get(key)
        return None if entry is None else (len(entry.blocks), entry.tokens)

    def pinned(self, key: Key) -> bool:
        entry = self._entries.get(key)
        return entry is not None and bool(entry.pins)

    def keys(self) -> list[Key]:
        """Cache keys, least recently used first."""
        return list(self._entries)

    # ---- holders -------------------------------------------------------------------------
    def reserve(self, rid: int, blocks: int) -> list[int] | None:
        """Hand `blocks` more blocks to `rid`, or None (and change nothing) if too few are free."""
        if blocks < 0:
            raise ValueError(f"cannot reserve {blocks} blocks")
        if blocks > len(self._free):
            return None
        got = [self._free.popleft() for _ in range(blocks)]
        self._tables.setdefault(rid, []).extend(got)
        return got

    def resize(self, rid: int, blocks: int) -> bool:
        """Make `rid` hold exactly `blocks` blocks: grow from the free list (False, and nothing
        changes, if too few are free) or give the surplus back."""
        if blocks < 0:
            raise ValueError(f"cannot hold {blocks} blocks")
        have = self.held(rid)
        if blocks > have:
            return self.reserve(rid, blocks - have) is not None
        if blocks < have:
            table = self._tables[rid]
            self._free.extend(table[blocks:])
            del table[blocks:]
        if blocks == 0:
            self._tables.pop(rid, None)
        return True

    def release(self, rid: int) -> int:
        """Return every block `rid` holds, drop its pins and pending marks; releasing an unknown
        rid is a no-op returning 0."""
        blocks = self._tables.pop(rid, [])
        self._free.extend(blocks)
        self.unpin(rid)
        for key in self._pending_of.pop(rid, ()):
            if self._pending.get(key) == rid:
                del self._pending[key]
        return len(blocks)

    # ---- cache entries -------------------------------------------------------------------
    def lookup(self, keys: Sequence[Key]) -> int:
        """How many of `keys`, from the first, are cached (a chain stops at its first miss)."""
        n = 0
        for key in keys:
            if key not in self._entries:
                break
            n += 1
        return n

    def pin(self, rid: int, keys: Iterable[Key]) -> None:
        """`rid` uses these cached entries: they cannot be evicted until `unpin(rid)`."""
        pinned = self._pins.setdefault(rid, [])
        for key in keys:
            entry = self._entries[key]
            if rid not in entry.pins:
                if not entry.pins:
                    self._evictable -= len(entry.blocks)
                entry.pins.add(rid)
                pinned.append(key)
        self.touch(pinned)
        if not pinned:
            del self._pins[rid]

    def unpin(self, rid: int) -> None:
        for key in self._pins.pop(rid, ()):
            entry = self._entries.get(key)
            if entry is not None and rid in entry.pins:
                entry.pins.discard(rid)
                if not entry.pins:
                    self._evictable += len(entry.blocks)

    def touch(self, keys: Iterable[Key]) -> None:
        """Mark entries as just used. Keys later in `keys` end up most recent; pass a prefix chain
        leaf first so its root, which every longer chain needs, is evicted last."""
        for key in keys:
            if key in self._entries:
                self._entries.move_to_end(key)

    def cache(self, key: Key, blocks: int, tokens: int) -> bool:
        """Add an entry of `blocks` blocks from the free list. An existing key is only touched
        (True). False, and nothing changes, if too few blocks are free."""
        if key in self._entries:
            self._entries.move_to_end(key)
            return True
        if blocks < 1 or blocks > len(self._free):
            return False
        self._entries[key] = _Entry([self._free.popleft() for _ in range(blocks)], tokens)
        self._cached += blocks
        self._evictable += blocks
        self._pending.pop(key, None)  # computed: no longer pending
        return True

    def drop(self, key: Key) -> bool:
        """Remove an unpinned entry and free its blocks; False if absent or pinned."""
        entry = self._entries.get(key)
        if entry is None or entry.pins:
            return False
        del self._entries[key]
        self._free.extend(entry.blocks)
        self._cached -= len(entry.blocks)
        self._evictable -= len(entry.blocks)
        return True

    def make_room(self, blocks: int, keep: Iterable[Key] = ()) -> list[Key] | None:
        """Evict unpinned entries, least recently used first, until `blocks` blocks are free.
        None (and nothing evicted) if even evicting every unpinned entry (but `keep`) is not enough."""
        short = blocks - len(self._free)
        if short <= 0:
            return []
        spare = set(keep)
        victims: list[Key] = []
        for key, entry in self._entries.items():
            if short <= 0:
                break
            if entry.pins or key in spare:
                continue
            victims.append(key)
            short -= len(entry.blocks)
        if short > 0:
            return None
        for key in victims:
            self.drop(key)
        self.evictions += len(victims)
        return victims

    # ---- prefix blocks being computed ------------------------------------------------------
    def mark_pending(self, rid: int, keys: Iterable[Key]) -> None:
        """`rid` is computing these prefix blocks (until they are cached or `rid` is released)."""
        mine = self._pending_of.setdefault(rid, [])
        for key in keys:
            if key not in self._entries and key not in self._pending:
                self._pending[key] = rid
                mine.append(key)

    def pending_owner(self, key: Key) -> int | None:
        return self._pending.get(key)

    # ---- checks --------------------------------------------------------------------------
    def snapshot(self) -> PoolSnapshot:
        return PoolSnapshot(
            blocks_total=self.total,
            blocks_used=self.used,
            blocks_cached=self._cached,
            blocks_free=self.free,
            block_tokens=self.block_tokens,
            bytes_per_block=self.bytes_per_block,
            blocks_padding=self.held(PADDING),
            cache_entries=len(self._entries),
            evictions=self.evictions,
        )

    def check(self) -> None:
        """Assert the invariants (tests call it after every operation)."""
        everywhere = list(self._free)
        for table in self._tables.values():
            everywhere.extend(table)
        for entry in self._entries.values():
            everywhere.extend(entry.blocks)
        assert sorted(everywhere) == list(range(self.total)), "a block is lost or handed out twice"
        assert self._cached == sum(len(e.blocks) for e in self._entries.values())
        assert self._evictable == sum(len(e.blocks) for e in self._entries.values() if not e.pins)
        assert self.used + self.cached + self.free == self.total
        for rid, keys in self._pins.items():
            for key in keys:
                pinned = self._entries.get(key)
                assert pinned is None or rid in pinned.pins

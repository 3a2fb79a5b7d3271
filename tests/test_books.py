"""Block books and the pool's command handler: stateful property tests against simple models, plus
example-based tests for LRU eviction, pins and the dense batch cache's padding arithmetic."""

from __future__ import annotations

from collections import OrderedDict

from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvpool.books import PADDING, BlockBooks, Key, blocks_for
from kvpool.dense import DENSE_STEP, dense_tokens, padding_blocks
from kvpool.messages import Cache, Cached, Denied, Drop, Granted, Release, Released, Reserve, Resize, Unpin
from kvpool.pool import handle

STATEFUL = settings(
    max_examples=150, stateful_step_count=40, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)


def state(books: BlockBooks, keys: list[Key] | None = None) -> tuple[object, ...]:
    """Everything observable about the books (LRU order included), to prove a denial changed nothing."""
    universe = books.keys() if keys is None else keys
    return (
        books.free,
        books.used,
        books.cached,
        books.evictions,
        tuple(sorted((rid, tuple(books.table(rid))) for rid in books.holders())),
        tuple(books.keys()),
        tuple(books.entry_size(k) for k in books.keys()),
        tuple(books.pending_owner(k) for k in universe),
        books.evictable,
    )


def unordered(snap: tuple[object, ...]) -> tuple[object, ...]:
    """`state` without the LRU order of the cache keys."""
    keys = snap[5]
    sizes = snap[6]
    assert isinstance(keys, tuple) and isinstance(sizes, tuple)
    entries = tuple(sorted(zip(keys, sizes, strict=True), key=repr))
    return (*snap[:5], entries, *snap[7:])


def assert_no_block_twice(books: BlockBooks) -> None:
    held = [b for rid in books.holders() for b in books.table(rid)]
    assert len(held) == len(set(held)) == books.used
    assert all(0 <= b < books.total for b in held)
    assert books.used + books.cached + books.free == books.total


# ---- BlockBooks against a model ---------------------------------------------------------------
TOTAL = 12
RIDS = st.sampled_from([0, 1, 2, 3, PADDING])
KEY_UNIVERSE: list[Key] = [0, 1, 2, 3, 4, 5, "a", "b"]
KEYS = st.sampled_from(KEY_UNIVERSE)


class BooksMachine(RuleBasedStateMachine):
    """Every BlockBooks operation, mirrored in dicts; the two must agree after every step."""

    def __init__(self) -> None:
        super().__init__()
        self.books = BlockBooks(total=TOTAL, block_tokens=16, bytes_per_block=64)
        self.held: dict[int, int] = {}
        self.entries: OrderedDict[Key, tuple[int, int]] = OrderedDict()  # least recently used first
        self.pins: dict[int, list[Key]] = {}  # rid -> keys it pins, in the order it pinned them
        self.pending: dict[Key, int] = {}
        self.pending_of: dict[int, list[Key]] = {}
        self.evictions = 0

    # -- model helpers
    def model_free(self) -> int:
        return TOTAL - sum(self.held.values()) - sum(b for b, _ in self.entries.values())

    def pinned(self, key: Key) -> bool:
        return any(key in keys for keys in self.pins.values())

    def model_unpin(self, rid: int) -> None:
        self.pins.pop(rid, None)

    # -- holders
    @rule(rid=RIDS, n=st.integers(0, 7))
    def reserve(self, rid: int, n: int) -> None:
        before = state(self.books, KEY_UNIVERSE)
        others = {b for r in self.books.holders() if r != rid for b in self.books.table(r)}
        mine = self.books.table(rid)
        got = self.books.reserve(rid, n)
        if n > self.model_free():
            assert got is None
            assert state(self.books, KEY_UNIVERSE) == before
            return
        assert got is not None and len(got) == n
        assert not set(got) & others and not set(got) & set(mine)
        assert self.books.table(rid) == mine + got
        self.held[rid] = self.held.get(rid, 0) + n

    @rule(rid=RIDS, n=st.integers(0, 9))
    def resize(self, rid: int, n: int) -> None:
        before = state(self.books, KEY_UNIVERSE)
        have = self.held.get(rid, 0)
        table = self.books.table(rid)
        ok = self.books.resize(rid, n)
        if n - have > self.model_free():
            assert not ok
            assert state(self.books, KEY_UNIVERSE) == before
            return
        assert ok
        assert self.books.held(rid) == n
        if n <= have:
            assert self.books.table(rid) == table[:n]  # shrinking keeps the leading blocks
        else:
            assert self.books.table(rid)[:have] == table
        if n:
            self.held[rid] = n
        else:
            self.held.pop(rid, None)
            assert rid not in self.books.holders()

    @rule(rid=RIDS)
    def release(self, rid: int) -> None:
        assert self.books.release(rid) == self.held.pop(rid, 0)
        assert self.books.held(rid) == 0 and rid not in self.books.holders()
        self.model_unpin(rid)
        for key in self.pending_of.pop(rid, ()):
            if self.pending.get(key) == rid:
                del self.pending[key]

    # -- cache entries
    @rule(key=KEYS, blocks=st.integers(1, 4), tokens=st.integers(1, 64))
    def cache(self, key: Key, blocks: int, tokens: int) -> None:
        before = state(self.books, KEY_UNIVERSE)
        ok = self.books.cache(key, blocks, tokens)
        if key in self.entries:
            assert ok
            self.entries.move_to_end(key)
        elif blocks > self.model_free():
            assert not ok
            assert state(self.books, KEY_UNIVERSE) == before
        else:
            assert ok
            self.entries[key] = (blocks, tokens)
            self.pending.pop(key, None)
            assert self.books.pending_owner(key) is None

    @precondition(lambda self: bool(self.entries))
    @rule(rid=RIDS, data=st.data())
    def pin(self, rid: int, data: st.DataObject) -> None:
        keys = data.draw(st.lists(st.sampled_from(list(self.entries)), max_size=4))
        self.books.pin(rid, keys)
        mine = self.pins.setdefault(rid, [])
        for key in keys:
            if key not in mine:
                mine.append(key)
        for key in mine:  # pin touches every entry `rid` pins, in the order it pinned them
            self.entries.move_to_end(key)
        if not mine:
            del self.pins[rid]

    @rule(rid=RIDS)
    def unpin(self, rid: int) -> None:
        self.books.unpin(rid)
        self.model_unpin(rid)

    @rule(keys=st.lists(KEYS, max_size=4))
    def touch(self, keys: list[Key]) -> None:
        self.books.touch(keys)
        for key in keys:
            if key in self.entries:
                self.entries.move_to_end(key)

    @rule(key=KEYS)
    def drop(self, key: Key) -> None:
        before = state(self.books, KEY_UNIVERSE)
        ok = self.books.drop(key)
        if key not in self.entries or self.pinned(key):
            assert not ok
            assert state(self.books, KEY_UNIVERSE) == before
            if key in self.entries:
                assert key in self.books.keys()  # a pinned entry is never dropped
            return
        assert ok
        assert key not in self.books.keys() and self.books.entry_size(key) is None
        del self.entries[key]

    @rule(n=st.integers(0, TOTAL + 2), keep=st.lists(KEYS, max_size=3))
    def make_room(self, n: int, keep: list[Key]) -> None:
        before = state(self.books, KEY_UNIVERSE)
        victims = self.books.make_room(n, keep=keep)
        short = n - self.model_free()
        if short <= 0:
            assert victims == []
            assert state(self.books, KEY_UNIVERSE) == before
            return
        expected: list[Key] = []
        for key, (blocks, _) in self.entries.items():  # least recently used first
            if short <= 0:
                break
            if self.pinned(key) or key in keep:
                continue
            expected.append(key)
            short -= blocks
        if short > 0:
            assert victims is None
            assert state(self.books, KEY_UNIVERSE) == before
            return
        assert victims == expected
        assert not any(self.pinned(k) or k in keep for k in victims)
        assert self.books.free >= n
        for key in victims:
            del self.entries[key]
        self.evictions += len(victims)

    # -- pending prefix blocks
    @rule(rid=RIDS, keys=st.lists(KEYS, max_size=4))
    def mark_pending(self, rid: int, keys: list[Key]) -> None:
        self.books.mark_pending(rid, keys)
        mine = self.pending_of.setdefault(rid, [])
        for key in keys:
            if key not in self.entries and key not in self.pending:
                self.pending[key] = rid
                mine.append(key)
        for key in keys:
            assert key in self.entries or self.books.pending_owner(key) is not None

    # -- idle
    @rule()
    def go_idle(self) -> None:
        self.return_everything()

    def return_everything(self) -> None:
        for rid in {0, 1, 2, 3, PADDING, *self.books.holders()}:
            self.books.release(rid)
        for rid in list(self.pins):
            self.books.unpin(rid)
        for key in self.books.keys():
            assert self.books.drop(key)
        assert self.books.free == self.books.total
        assert (self.books.used, self.books.cached, self.books.keys()) == (0, 0, [])
        self.books.check()
        self.held.clear()
        self.entries.clear()
        self.pins.clear()
        self.pending.clear()
        self.pending_of.clear()

    # -- invariants
    @invariant()
    def books_check(self) -> None:
        self.books.check()
        assert_no_block_twice(self.books)

    @invariant()
    def agrees_with_model(self) -> None:
        books = self.books
        assert books.free == self.model_free()
        assert books.cached == sum(b for b, _ in self.entries.values())
        assert books.used == sum(self.held.values())
        for rid in [0, 1, 2, 3, PADDING]:
            assert books.held(rid) == self.held.get(rid, 0)
        assert books.keys() == list(self.entries)
        for key in KEY_UNIVERSE:
            assert books.entry_size(key) == self.entries.get(key)
            assert books.pending_owner(key) == self.pending.get(key)
        assert books.evictable == sum(b for k, (b, _) in self.entries.items() if not self.pinned(k))
        assert books.evictions == self.evictions
        assert books.snapshot().blocks_padding == self.held.get(PADDING, 0)

    @invariant()
    def pinned_entries_stay(self) -> None:
        for keys in self.pins.values():
            for key in keys:
                assert key in self.books.keys()

    def teardown(self) -> None:
        self.return_everything()  # returns all when idle


TestBooksMachine = BooksMachine.TestCase
TestBooksMachine.settings = STATEFUL


# ---- pool.handle against a model ----------------------------------------------------------------
POOL_TOTAL = 24
POOL_RIDS = [0, 1, 2, 3, 4]
SESSIONS = ["s0", "s1"]
TOKENS = st.lists(st.integers(1, 2), max_size=4)  # prompt blocks from a 2-letter alphabet


def chain(tokens: list[int]) -> list[int]:
    """Chained prefix keys: equal leading blocks give equal keys, so chains overlap."""
    keys, h = [], 0
    for t in tokens:
        h = h * 4 + t
        keys.append(h)
    return keys


class PoolMachine(RuleBasedStateMachine):
    """Random commands through `handle`; replies must agree with the books before and after."""

    def __init__(self) -> None:
        super().__init__()
        self.books = BlockBooks(total=POOL_TOTAL, block_tokens=16, bytes_per_block=64)
        self.pins: dict[int, set[Key]] = {}  # what the grants pinned, per rid
        self.seen: set[Key] = set(SESSIONS)  # every key a command named

    def pinned(self, key: Key) -> bool:
        return any(key in keys for keys in self.pins.values())

    def available(self, keep: set[Key]) -> int:
        """Free blocks plus those make_room may evict (unpinned entries not in `keep`)."""
        return self.books.free + sum(
            self.books.entry_size(k)[0]  # type: ignore[index]
            for k in self.books.keys()
            if not self.pinned(k) and k not in keep
        )

    def need(self, rid: int, blocks: int, padding: int | None) -> tuple[int, int]:
        pad = self.books.held(PADDING) if padding is None else padding
        return blocks - self.books.held(rid), pad - self.books.held(PADDING)

    def check_evicted(self, evicted: list[Key], keys_before: list[Key]) -> None:
        now = set(self.books.keys())
        for key in evicted:
            assert key in keys_before and key not in now
            assert not self.pinned(key)
        assert len(set(evicted)) == len(evicted)

    def check_grant(self, reply: Granted, rid: int, blocks: int, padding: int | None, pad0: int) -> None:
        assert reply.rid == rid and reply.blocks == self.books.held(rid) == blocks
        assert self.books.held(PADDING) == (pad0 if padding is None else padding)

    @precondition(lambda self: any(not self.pins.get(r) for r in POOL_RIDS))
    @rule(
        data=st.data(),
        blocks=st.integers(0, 8),
        tokens=TOKENS,
        session=st.none() | st.sampled_from(SESSIONS),
        padding=st.none() | st.integers(0, 6),
        keep_free=st.integers(0, 4),
    )
    def reserve(
        self,
        data: st.DataObject,
        blocks: int,
        tokens: list[int],
        session: str | None,
        padding: int | None,
        keep_free: int,
    ) -> None:
        # A rid reserves once per admission: only rids whose earlier grant pins nothing.
        rid = data.draw(st.sampled_from([r for r in POOL_RIDS if not self.pins.get(r)]))
        self.do_reserve(rid, blocks, tokens, session, padding, keep_free)

    @precondition(lambda self: any(not self.pins.get(r) for r in POOL_RIDS))
    @rule(data=st.data(), blocks=st.integers(0, 6), tokens=TOKENS, padding=st.none() | st.integers(0, 4))
    def reserve_prefix(self, data: st.DataObject, blocks: int, tokens: list[int], padding: int | None) -> None:
        rid = data.draw(st.sampled_from([r for r in POOL_RIDS if not self.pins.get(r)]))
        self.do_reserve(rid, blocks, tokens, None, padding, 0)

    @precondition(lambda self: any(not self.pins.get(r) for r in POOL_RIDS))
    @rule(
        data=st.data(),
        blocks=st.integers(0, 10),
        session=st.sampled_from(SESSIONS),
        padding=st.none() | st.integers(0, 4),
    )
    def reserve_session(self, data: st.DataObject, blocks: int, session: str, padding: int | None) -> None:
        rid = data.draw(st.sampled_from([r for r in POOL_RIDS if not self.pins.get(r)]))
        self.do_reserve(rid, blocks, [], session, padding, 0)

    @rule(tokens=TOKENS.filter(bool), tokens_per_block=st.integers(1, 16))
    def cache_chain(self, tokens: list[int], tokens_per_block: int) -> None:
        """The worker stores a prompt's full blocks, root first, one block each."""
        for key in chain(tokens):
            self.cache(key, 1, tokens_per_block)

    def do_reserve(
        self, rid: int, blocks: int, tokens: list[int], session: str | None, padding: int | None, keep_free: int
    ) -> None:
        books = self.books
        prefix = chain(tokens)
        self.seen.update(prefix)
        universe = sorted(self.seen, key=repr)
        before = state(books, universe)
        keys_before = books.keys()
        pad0 = books.held(PADDING)
        hits = 0
        while hits < len(prefix) and prefix[hits] in keys_before:
            hits += 1
        owner = books.pending_owner(prefix[hits]) if hits < len(prefix) else None
        size = books.entry_size(session) if session is not None else None
        takeover = size is not None
        d_rid, d_pad = self.need(rid, blocks, padding)
        avail = self.available(set() if takeover else set(prefix[:hits]))

        def fits(reply: Granted | Denied) -> None:
            """Granted iff the net growth, plus `keep_free`, fits in free + evictable blocks (a
            taken-over session's blocks count as free; a hit prefix as pinned): what a shrink
            returns serves the growth."""
            assert isinstance(reply, Granted) == (d_rid + d_pad + keep_free <= avail)
            if isinstance(reply, Granted):
                assert books.free + books.evictable >= keep_free

        reply = handle(books, Reserve(rid, blocks, prefix, session, padding, keep_free))
        event(f"reserve: {type(reply).__name__}, takeover={takeover}, hits={min(hits, 3)}, "
              f"pending={getattr(reply, 'pending', None)}, evicted={bool(getattr(reply, 'evicted', ()))}")

        if takeover:
            assert size is not None and session is not None
            if isinstance(reply, Granted):
                assert reply.session_tokens == size[1] and reply.prefix_hits == 0
                assert session not in books.keys() and books.entry_size(session) is None
                self.check_grant(reply, rid, blocks, padding, pad0)
                self.check_evicted(reply.evicted, keys_before)
            else:
                assert isinstance(reply, Denied) and not reply.pending
                assert books.entry_size(session) == size  # the session is still there
                assert unordered(state(books, universe)) == unordered(before)
            fits(reply)
            return

        if owner is not None and owner != rid:
            assert isinstance(reply, Denied) and reply.pending
            assert reply.free == books.free
            assert state(books, universe) == before
            return
        if isinstance(reply, Denied):
            assert not reply.pending
            assert reply.free == books.free
            assert unordered(state(books, universe)) == unordered(before)
            fits(reply)
            return
        assert isinstance(reply, Granted)
        assert reply.prefix_hits == hits and reply.session_tokens == 0
        self.check_evicted(reply.evicted, keys_before)
        for key in prefix[:hits]:
            assert key in books.keys()
        if hits < len(prefix):
            assert books.pending_owner(prefix[hits]) == rid
        for key in prefix[hits:]:
            assert key in books.keys() or books.pending_owner(key) is not None
        if hits:
            self.pins.setdefault(rid, set()).update(prefix[:hits])
        self.check_grant(reply, rid, blocks, padding, pad0)
        fits(reply)

    @rule(rid=st.sampled_from(POOL_RIDS), blocks=st.integers(0, 8), padding=st.none() | st.integers(0, 6))
    def resize(self, rid: int, blocks: int, padding: int | None) -> None:
        books = self.books
        universe = sorted(self.seen, key=repr)
        before = state(books, universe)
        keys_before = books.keys()
        pad0 = books.held(PADDING)
        d_rid, d_pad = self.need(rid, blocks, padding)
        avail = self.available(set())
        reply = handle(books, Resize(rid, blocks, padding))
        event(f"resize: {type(reply).__name__}, evicted={bool(getattr(reply, 'evicted', ()))}")
        if isinstance(reply, Granted):
            self.check_grant(reply, rid, blocks, padding, pad0)
            self.check_evicted(reply.evicted, keys_before)
            assert reply.prefix_hits == 0 and reply.session_tokens == 0
        else:
            assert isinstance(reply, Denied) and not reply.pending
            assert reply.free == books.free
            assert state(books, universe) == before
        if d_rid >= 0 and d_pad >= 0 or d_rid <= 0 and d_pad <= 0:
            assert isinstance(reply, Granted) == (max(0, d_rid) + max(0, d_pad) <= avail)

    @rule(rid=st.sampled_from(POOL_RIDS), padding=st.none() | st.integers(0, 6))
    def release(self, rid: int, padding: int | None) -> None:
        held = self.books.held(rid)
        pad0 = self.books.held(PADDING)
        reply = handle(self.books, Release(rid, padding))
        assert reply == Released(rid, held)
        assert self.books.held(rid) == 0
        # Release only ever shrinks the padding (it cannot be denied).
        assert self.books.held(PADDING) == (pad0 if padding is None else min(padding, pad0))
        for key in self.seen:
            assert self.books.pending_owner(key) != rid
        self.pins.pop(rid, None)

    @rule(rid=st.sampled_from(POOL_RIDS))
    def unpin(self, rid: int) -> None:
        before = self.books.held(rid)
        assert handle(self.books, Unpin(rid)) == Released(rid, 0)
        assert self.books.held(rid) == before
        self.pins.pop(rid, None)

    @rule(
        key=st.sampled_from(SESSIONS) | TOKENS.filter(bool).map(lambda t: chain(t)[-1]),
        blocks=st.integers(1, 5),
        tokens=st.integers(1, 80),
    )
    def cache_one(self, key: Key, blocks: int, tokens: int) -> None:
        self.cache(key, blocks, tokens)

    @rule(session=st.sampled_from(SESSIONS), blocks=st.integers(1, 8), tokens=st.integers(1, 128))
    def cache_session(self, session: str, blocks: int, tokens: int) -> None:
        """A finished turn's KV kept for the session's next request."""
        self.cache(session, blocks, tokens)

    def cache(self, key: Key, blocks: int, tokens: int) -> None:
        books = self.books
        self.seen.add(key)
        universe = sorted(self.seen, key=repr)
        before = state(books, universe)
        keys_before = books.keys()
        existed = key in keys_before
        size = books.entry_size(key)
        # A session's new turn replaces its last: the old entry's blocks are free first.
        replaced = isinstance(key, str) and size is not None
        free0 = books.free + (size[0] if replaced and size is not None else 0)
        avail = self.available({key}) + (free0 - books.free)
        # make_room's victims: unpinned entries (but `key`), least recently used first.
        victims: list[Key] = []
        short = blocks - free0
        for k in keys_before:
            if short <= 0:
                break
            if self.pinned(k) or k == key:
                continue
            victims.append(k)
            short -= books.entry_size(k)[0]  # type: ignore[index]
        reply = handle(books, Cache(key, blocks, tokens))
        event(f"cache: ok={reply.ok}, existed={existed}, evicted={bool(reply.evicted)}")
        assert isinstance(reply, Cached) and reply.key == key
        assert reply.ok == (existed and not replaced or blocks <= avail)
        self.check_evicted(reply.evicted, keys_before)
        assert key not in reply.evicted
        if not reply.ok:
            assert reply.evicted == []
            if replaced:
                assert books.entry_size(key) is None  # the worker drops the new turn too
                assert books.keys() == [k for k in keys_before if k != key]
                assert books.free == free0
            else:
                assert state(books, universe) == before
            return
        assert books.keys()[-1] == key  # just used
        if replaced or not existed:
            assert reply.evicted == victims  # least recently used first, and no more than needed
            assert books.entry_size(key) == (blocks, tokens)
            assert books.pending_owner(key) is None

    @rule(key=st.sampled_from(SESSIONS) | TOKENS.filter(bool).map(lambda t: chain(t)[-1]))
    def drop(self, key: Key) -> None:
        books = self.books
        self.seen.add(key)
        universe = sorted(self.seen, key=repr)
        before = state(books, universe)
        droppable = key in books.keys() and not self.pinned(key)
        assert handle(books, Drop(key)) == Cached(key, droppable)
        if droppable:
            assert key not in books.keys()
        else:
            assert state(books, universe) == before

    @invariant()
    def books_check(self) -> None:
        self.books.check()
        assert_no_block_twice(self.books)

    @invariant()
    def pins_hold(self) -> None:
        keys = self.books.keys()
        for pinned in self.pins.values():
            assert pinned <= set(keys)  # pinned entries are never evicted
        assert self.books.evictable == sum(
            self.books.entry_size(k)[0] for k in keys if not self.pinned(k)  # type: ignore[index]
        )

    def teardown(self) -> None:
        for rid in [*POOL_RIDS, PADDING]:
            handle(self.books, Release(rid))
        for key in self.books.keys():
            assert handle(self.books, Drop(key)) == Cached(key, True)
        assert self.books.free == self.books.total
        self.books.check()


TestPoolMachine = PoolMachine.TestCase
TestPoolMachine.settings = STATEFUL


# ---- dense batch cache arithmetic ----------------------------------------------------------------
def test_dense_tokens_is_the_longest_row_plus_one_growth_step_for_every_row() -> None:
    assert DENSE_STEP == 256
    assert dense_tokens(1, 1) == 257
    assert dense_tokens(3, 256) == 3 * 512
    assert dense_tokens(2, 510) == 2 * 766  # measured: a 758-token buffer behind a 510-token row
    assert dense_tokens(4, 1000, step=1) == 4 * 1000  # an engine without growth steps
    assert dense_tokens(0, 500) == dense_tokens(3, 0) == dense_tokens(-1, 5) == 0


@settings(max_examples=300, deadline=None)
@given(st.integers(1, 64), st.integers(1, 10_000), st.integers(2, 512))
def test_dense_tokens_bounds_any_buffer_the_growth_rule_makes(rows: int, longest: int, step: int) -> None:
    """mlx-lm's rule: when a write of one token passes the buffer's end, the buffer becomes
    (tokens so far) + step. Whatever the history, the buffer is below longest + step."""
    total = dense_tokens(rows, longest, step)
    assert total % rows == 0
    per_row = total // rows
    buffer = 0
    for written in range(1, longest + 1):
        if written > buffer:
            buffer = written - 1 + step
    assert longest <= buffer < per_row


def test_padding_blocks_charges_the_dense_cache_beyond_the_rows_own_blocks() -> None:
    lengths = [10, 300]
    own = blocks_for(10, 16) + blocks_for(300, 16)  # 1 + 19
    assert padding_blocks(lengths, own, 16) == blocks_for(2 * 556, 16) - own == 50
    assert padding_blocks([], 0, 16) == 0
    assert padding_blocks([256, 256], 64, 16) == 0  # no padding when the rows hold it all
    assert padding_blocks(iter([100]), 0, 16) == 23  # any iterable, consumed once


@settings(max_examples=300, deadline=None)
@given(st.lists(st.integers(0, 3000), max_size=8), st.integers(0, 1000), st.integers(1, 64))
def test_padding_blocks_is_never_negative(lengths: list[int], held: int, block_tokens: int) -> None:
    pad = padding_blocks(lengths, held, block_tokens)
    assert pad >= 0
    dense = blocks_for(dense_tokens(len(lengths), max(lengths, default=0)), block_tokens)
    assert pad == max(0, dense - held)
    own = sum(blocks_for(n, block_tokens) for n in lengths)
    assert own + padding_blocks(lengths, own, block_tokens) >= dense  # rows + padding cover the cache


# ---- examples: LRU eviction and pins ----------------------------------------------------------
def lru_books() -> BlockBooks:
    books = BlockBooks(total=6, block_tokens=16, bytes_per_block=1)
    for key in (1, 2, "s", 3):
        assert books.cache(key, 1, 16)
    return books


def test_make_room_evicts_least_recently_used_first() -> None:
    books = lru_books()
    books.touch([1])  # 2, "s", 3, 1
    assert books.keys() == [2, "s", 3, 1]
    assert books.make_room(2) == []  # already free
    assert books.make_room(4) == [2, "s"]
    assert books.keys() == [3, 1] and books.free == 4 and books.evictions == 2
    assert books.make_room(5, keep=[3]) == [1]
    assert books.keys() == [3]
    books.check()


def test_pinned_entries_survive_eviction_and_drop() -> None:
    books = lru_books()
    books.pin(7, [1, "s"])
    assert books.evictable == 2
    assert books.drop(1) is False and books.drop("s") is False
    assert books.make_room(6) is None  # would need the pinned entries: nothing evicted
    assert books.keys() == [2, 3, 1, "s"] and books.evictions == 0
    assert books.make_room(4) == [2, 3]
    assert books.keys() == [1, "s"]
    books.release(7)  # releasing drops its pins
    assert books.evictable == 2
    assert books.make_room(6) == [1, "s"]
    assert books.free == books.total
    books.check()


def test_pool_reserve_hits_pins_and_marks_pending() -> None:
    books = BlockBooks(total=8, block_tokens=16, bytes_per_block=1)
    for key in (11, 12):
        assert handle(books, Cache(key, 1, 16)) == Cached(key, True)
    assert handle(books, Reserve(1, 2, [11, 12, 13, 14])) == Granted(1, 2, prefix_hits=2)
    assert books.pending_owner(13) == books.pending_owner(14) == 1
    assert handle(books, Reserve(2, 1, [11, 12, 13])) == Denied(2, books.free, pending=True)
    assert handle(books, Drop(11)) == Cached(11, False)  # pinned by rid 1
    assert handle(books, Cache(13, 1, 16)) == Cached(13, True)
    assert books.pending_owner(13) is None
    assert handle(books, Reserve(2, 1, [11, 12, 13])) == Granted(2, 1, prefix_hits=3)
    assert handle(books, Release(1)) == Released(1, 2)
    assert books.pending_owner(14) is None
    books.check()


def test_pool_session_takeover() -> None:
    books = BlockBooks(total=4, block_tokens=16, bytes_per_block=1)
    assert handle(books, Cache("chat", 3, 40)).ok
    assert handle(books, Reserve(1, 4, session="chat")) == Granted(1, 4, session_tokens=40)
    assert books.keys() == [] and books.free == 0
    books.check()


# ---- regressions: each was a bug these machines found in the first version of the pool -----------
def session_denial() -> tuple[BlockBooks, Denied, list[Key]]:
    """A session of 2 blocks is the LRU entry; a Reserve taking it over asks for more than exists."""
    books = BlockBooks(total=4, block_tokens=16, bytes_per_block=1)
    assert handle(books, Cache("s", 2, 20)).ok
    assert handle(books, Cache(7, 1, 16)).ok
    order = books.keys()
    assert order == ["s", 7] and books.free == 1
    reply = handle(books, Reserve(1, 5, session="s"))
    assert isinstance(reply, Denied)
    assert books.entry_size("s") == (2, 20) and books.free == 1  # the session came back
    return books, reply, order


def test_denied_session_reserve_reports_the_free_blocks_after_the_call() -> None:
    books, reply, _ = session_denial()
    assert reply.free == books.free


def test_denied_session_reserve_keeps_the_lru_order() -> None:
    books, _, order = session_denial()
    assert books.keys() == order


def test_denied_prefix_reserve_keeps_the_lru_order() -> None:
    books = BlockBooks(total=4, block_tokens=16, bytes_per_block=1)
    for key in (1, 2):
        assert handle(books, Cache(key, 1, 16)).ok
    assert isinstance(handle(books, Reserve(1, 9, [1])), Denied)
    assert books.keys() == [1, 2]


def test_caching_a_cached_key_evicts_nothing() -> None:
    books = BlockBooks(total=4, block_tokens=16, bytes_per_block=1)
    assert handle(books, Cache(1, 2, 32)).ok
    assert handle(books, Cache(2, 2, 32)).ok
    assert books.free == 0
    reply = handle(books, Cache(1, 2, 32))
    assert reply.ok
    assert reply.evicted == [] and books.keys() == [2, 1]


def test_a_shrink_serves_a_growth_in_the_same_command() -> None:
    books = BlockBooks(total=4, block_tokens=16, bytes_per_block=1)
    assert handle(books, Reserve(1, 4)) == Granted(1, 4)
    # rid 1 gives back 4 blocks and the padding takes 4: the net change is zero.
    reply = handle(books, Resize(1, 0, padding=4))
    assert isinstance(reply, Granted) and books.held(PADDING) == 4


def test_an_unpinned_chain_loses_its_leaf_before_its_root() -> None:
    # touch(): "pass a prefix chain leaf first so its root, which every longer chain needs, is
    # evicted last". pin() touches keys in the order given, and _reserve passes the chain root first.
    books = BlockBooks(total=3, block_tokens=16, bytes_per_block=1)
    for key in (3, 2, 1):  # cached leaf first, so touch()'s rule holds before the Reserve
        assert handle(books, Cache(key, 1, 16)).ok
    assert handle(books, Reserve(5, 0, [1, 2, 3])) == Granted(5, 0, prefix_hits=3)
    handle(books, Release(5))
    reply = handle(books, Reserve(6, 1))
    assert isinstance(reply, Granted) and reply.evicted == [3]
    assert books.lookup([1, 2, 3]) == 2


def test_a_denied_reserve_keeps_the_rids_earlier_pins() -> None:
    books = BlockBooks(total=4, block_tokens=16, bytes_per_block=1)
    assert handle(books, Cache(1, 1, 16)).ok
    assert handle(books, Reserve(1, 1, [1])) == Granted(1, 1, prefix_hits=1)
    assert isinstance(handle(books, Reserve(1, 9, [1])), Denied)
    assert books.evictable == 0 and handle(books, Drop(1)) == Cached(1, False)


def test_keep_free_does_not_evict_what_may_stay_evictable() -> None:
    books = BlockBooks(total=4, block_tokens=16, bytes_per_block=1)
    assert handle(books, Cache(9, 2, 32)).ok
    reply = handle(books, Reserve(1, 2, keep_free=2))
    assert reply == Granted(1, 2)
    assert books.keys() == [9] and books.free + books.evictable == 2

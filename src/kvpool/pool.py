"""The pool actor: a thin loop that feeds `BlockBooks` the batches in its inbox."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import anyio

from kvpool.books import PADDING
from kvpool.messages import (
    Cache,
    Cached,
    Denied,
    Drop,
    Granted,
    PoolBatch,
    PoolCommand,
    PoolReplies,
    PoolReply,
    Release,
    Released,
    Reserve,
    Resize,
    Unpin,
)

if TYPE_CHECKING:
    from collections.abc import Callable, Sequence

    from anyio.abc import TaskStatus

    from kvpool.books import BlockBooks, Key, PoolSnapshot


class Pool:
    """KV block books. Owns: the books. Receives: PoolBatch (Reserve, Resize, Release, Unpin,
    Cache, Drop). Emits: one PoolReplies per batch (Granted, Denied, Released, Cached) to the
    `reply` callback given to `run`. `snapshot` is republished after every batch."""

    def __init__(self, books: BlockBooks) -> None:
        self._books = books
        # Its one client keeps at most one batch in flight (it waits for the replies before the
        # next), so a buffer of one never blocks.
        self._send, self._inbox = anyio.create_memory_object_stream[PoolBatch](1)
        self.snapshot: PoolSnapshot = books.snapshot()
        self._reply: Callable[[PoolReplies], None] | None = None

    def send(self, batch: PoolBatch) -> None:
        """Queue a batch; its replies come back through `run`'s callback. While the actor waits
        on an empty inbox (with one client and one batch in flight: whenever it runs) the batch
        is applied, and the callback called, within this call, as the actor would next: a task
        wake-up less in every request's way to the worker. The client must expect the callback
        before `send` returns."""
        stats = self._inbox.statistics()
        if self._reply is not None and stats.tasks_waiting_receive > 0 and stats.current_buffer_used == 0:
            self._reply(self._apply(batch))
            return
        self._send.send_nowait(batch)

    async def run(
        self, reply: Callable[[PoolReplies], None], *,
        task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED,
    ) -> None:
        self._reply = reply
        task_status.started()
        try:
            async with self._inbox:
                async for batch in self._inbox:
                    reply(self._apply(batch))
        finally:
            self._reply = None

    def _apply(self, batch: PoolBatch) -> PoolReplies:
        books = self._books
        replies = apply_batch(books, batch.commands)
        self.snapshot = books.snapshot()
        return PoolReplies(replies, books.free, books.evictable)


def apply_batch(books: BlockBooks, commands: Sequence[PoolCommand]) -> list[PoolReply]:
    """Apply a batch in order; after one denied Reserve, the later Reserves are denied unseen."""
    replies: list[PoolReply] = []
    denied = False
    for msg in commands:
        if denied and isinstance(msg, Reserve):
            replies.append(Denied(msg.rid, books.free))
            continue
        reply = handle(books, msg)
        denied = denied or (isinstance(reply, Denied) and isinstance(msg, Reserve))
        replies.append(reply)
    return replies


def handle(books: BlockBooks, msg: PoolCommand) -> PoolReply:
    """Apply one command to the books (pure; the actor only adds the mailbox)."""
    match msg:
        case Reserve(rid, blocks, prefix, session, padding, keep_free):
            return _reserve(books, rid, blocks, prefix, session, padding, keep_free)
        case Resize(rid, blocks, padding):
            return _resize(books, rid, blocks, padding)
        case Release(rid, padding):
            released = books.release(rid)
            if padding is not None:  # only ever shrinks here, which always fits
                books.resize(PADDING, min(padding, books.held(PADDING)))
            return Released(rid, released)
        case Unpin(rid):
            books.unpin(rid)
            return Released(rid, 0)
        case Cache(key, blocks, tokens):
            if isinstance(key, str):
                books.drop(key)  # a session's new turn replaces its last
            elif books.entry_size(key) is not None:
                books.touch([key])
                return Cached(key, True)
            evicted = books.make_room(blocks, keep=(key,)) or []
            return Cached(key, books.cache(key, blocks, tokens), evicted)
        case Drop(key):
            return Cached(key, books.drop(key))


def _grow(
    books: BlockBooks, rid: int, blocks: int, padding: int | None, keep_free: int = 0,
    keep: Sequence[Key] = (), credit: int = 0,
) -> Granted | Denied:
    """Set `rid` to `blocks` (and the padding to `padding`), evicting cache entries (never those
    in `keep`) if needed. `credit`: blocks the caller frees right after a grant (a session taken
    over). Grants only if `keep_free` blocks stay free or evictable afterwards."""
    targets = _targets(rid, blocks, padding)
    net = sum(n - books.held(h) for h, n in targets.items())
    spare = books.evictable - sum(_evictable_blocks(books, k) for k in set(keep))
    if net + keep_free > books.free + spare + credit:
        return Denied(rid, books.free)
    evicted = books.make_room(net - credit, keep=keep)
    assert evicted is not None, "the spare blocks were counted"
    return Granted(rid, books.held(rid), evicted=evicted)


def _targets(rid: int, blocks: int, padding: int | None) -> dict[int, int]:
    """Holder -> blocks it must hold: `rid`, and the padding when given."""
    targets = {rid: blocks}
    if padding is not None and rid != PADDING:
        targets[PADDING] = padding
    return targets


def _evictable_blocks(books: BlockBooks, key: Key) -> int:
    size = books.entry_size(key)
    return 0 if size is None or books.pinned(key) else size[0]


def _apply(books: BlockBooks, rid: int, blocks: int, padding: int | None) -> None:
    """Resize after a grant: shrinks first, so their blocks serve the growth."""
    targets = _targets(rid, blocks, padding)
    for holder, n in sorted(targets.items(), key=lambda hn: hn[1] - books.held(hn[0])):
        grew = books.resize(holder, n)
        assert grew, "the grant left too few blocks free"


def _resize(books: BlockBooks, rid: int, blocks: int, padding: int | None) -> Granted | Denied:
    reply = _grow(books, rid, blocks, padding)
    if isinstance(reply, Granted):
        _apply(books, rid, blocks, padding)
        reply = Granted(rid, books.held(rid), evicted=reply.evicted)
    return reply


def _reserve(
    books: BlockBooks, rid: int, blocks: int, prefix: list[int], session: str | None,
    padding: int | None, keep_free: int,
) -> Granted | Denied:
    size = books.entry_size(session) if session is not None else None
    if session is not None and size is not None and not books.pinned(session):
        # Taking a session over frees its blocks: the request's own blocks hold that KV once it
        # runs. They count as room, and the entry goes only if the grant succeeds.
        reply = _grow(books, rid, blocks, padding, keep_free, keep=(session,), credit=size[0])
        if isinstance(reply, Denied):
            return reply
        books.drop(session)
        _apply(books, rid, blocks, padding)
        return Granted(rid, books.held(rid), 0, size[1], reply.evicted)
    hits = books.lookup(prefix)
    if hits < len(prefix):
        owner = books.pending_owner(prefix[hits])
        if owner is not None and owner != rid:
            return Denied(rid, books.free, pending=True)
    reply = _grow(books, rid, blocks, padding, keep_free, keep=prefix[:hits])
    if isinstance(reply, Denied):
        return reply
    _apply(books, rid, blocks, padding)
    books.pin(rid, reversed(prefix[:hits]))  # leaf first: a chain's root is evicted last
    books.mark_pending(rid, prefix[hits:])
    return Granted(rid, books.held(rid), hits, 0, reply.evicted)


def pool_blocks(memory_bytes: int, block_tokens: int, kv_bytes_per_token: int) -> int:
    """How many blocks of `block_tokens` tokens a budget of `memory_bytes` holds."""
    return max(0, math.floor(memory_bytes / (block_tokens * kv_bytes_per_token)))

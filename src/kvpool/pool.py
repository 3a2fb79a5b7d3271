"""The pool actor: a thin loop that feeds `BlockBooks` the messages in its inbox."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, NamedTuple

import anyio

from kvpool.books import PADDING
from kvpool.messages import (
    Cache,
    Cached,
    Denied,
    Drop,
    Granted,
    PoolCommand,
    PoolReply,
    Release,
    Released,
    Reserve,
    Resize,
    Unpin,
)

if TYPE_CHECKING:
    from anyio.abc import TaskStatus
    from anyio.streams.memory import MemoryObjectSendStream

    from kvpool.books import BlockBooks, PoolSnapshot


class PoolEnvelope(NamedTuple):
    msg: PoolCommand
    reply: MemoryObjectSendStream[PoolReply]


class Pool:
    """KV block books. Owns: the books. Receives: Reserve, Resize, Release, Unpin, Cache, Drop.
    Emits: Granted, Denied, Released, Cached (to the envelope's reply stream). `snapshot` is
    republished after every message."""

    def __init__(self, books: BlockBooks) -> None:
        self._books = books
        # Callers wait for a reply to every message, so the inbox never holds more than one
        # message per caller; a small buffer is enough.
        self._send, self._inbox = anyio.create_memory_object_stream[PoolEnvelope](16)
        self.snapshot: PoolSnapshot = books.snapshot()

    async def call(self, msg: PoolCommand) -> PoolReply:
        """Send `msg` and wait for the pool's answer."""
        reply_send, reply_recv = anyio.create_memory_object_stream[PoolReply](1)
        with reply_recv:
            await self._send.send(PoolEnvelope(msg, reply_send))
            return await reply_recv.receive()

    def close(self) -> None:
        self._send.close()

    async def run(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        task_status.started()
        async with self._inbox:
            async for env in self._inbox:
                reply = handle(self._books, env.msg)
                self.snapshot = self._books.snapshot()
                with env.reply:
                    env.reply.send_nowait(reply)


def handle(books: BlockBooks, msg: PoolCommand) -> PoolReply:
    """Apply one command to the books (pure; the actor only adds the mailbox)."""
    match msg:
        case Reserve(rid, blocks, prefix, session, padding, keep_free):
            return _reserve(books, rid, blocks, prefix, session, padding, keep_free)
        case Resize(rid, blocks, padding):
            return _grow(books, rid, blocks, padding)
        case Release(rid, padding):
            released = books.release(rid)
            if padding is not None:
                books.resize(PADDING, min(padding, books.held(PADDING)))  # shrinking always fits
            return Released(rid, released)
        case Unpin(rid):
            books.unpin(rid)
            return Released(rid, 0)
        case Cache(key, blocks, tokens):
            if isinstance(key, str):
                books.drop(key)  # a session's new turn replaces its last
            evicted = books.make_room(blocks, keep=(key,)) or []
            return Cached(key, books.cache(key, blocks, tokens), evicted)
        case Drop(key):
            return Cached(key, books.drop(key))


def _grow(
    books: BlockBooks, rid: int, blocks: int, padding: int | None, keep_free: int = 0
) -> Granted | Denied:
    """Set `rid` to `blocks` (and the padding to `padding`), evicting cache entries if needed."""
    targets = {rid: blocks}
    if padding is not None and rid != PADDING:
        targets[PADDING] = padding
    extra = sum(max(0, n - books.held(h)) for h, n in targets.items())
    evicted = books.make_room(extra + keep_free)
    if evicted is None:
        return Denied(rid, books.free)
    # Shrinks first, so their blocks serve the growth.
    for holder, n in sorted(targets.items(), key=lambda hn: hn[1] - books.held(hn[0])):
        grew = books.resize(holder, n)
        assert grew, "make_room left too few blocks free"
    return Granted(rid, books.held(rid), evicted=evicted)


def _reserve(
    books: BlockBooks, rid: int, blocks: int, prefix: list[int], session: str | None,
    padding: int | None, keep_free: int,
) -> Granted | Denied:
    size = books.entry_size(session) if session is not None else None
    if session is not None and size is not None and books.drop(session):
        # Taking a session over frees its blocks (the request's own blocks hold that KV once
        # it runs); if the grant still fails, the entry comes back as it was.
        reply = _grow(books, rid, blocks, padding, keep_free)
        if isinstance(reply, Denied):
            restored = books.cache(session, *size)
            assert restored, "a session's own blocks were free again"
            return reply
        return Granted(rid, reply.blocks, 0, size[1], reply.evicted)
    hits = books.lookup(prefix)
    if hits < len(prefix):
        owner = books.pending_owner(prefix[hits])
        if owner is not None and owner != rid:
            return Denied(rid, books.free, pending=True)
    books.pin(rid, prefix[:hits])
    reply = _grow(books, rid, blocks, padding, keep_free)
    if isinstance(reply, Denied):
        books.unpin(rid)
        return reply
    books.mark_pending(rid, prefix[hits:])
    return Granted(rid, reply.blocks, hits, 0, reply.evicted)


def pool_blocks(memory_bytes: int, block_tokens: int, kv_bytes_per_token: int) -> int:
    """How many blocks of `block_tokens` tokens a budget of `memory_bytes` holds."""
    return max(0, math.floor(memory_bytes / (block_tokens * kv_bytes_per_token)))

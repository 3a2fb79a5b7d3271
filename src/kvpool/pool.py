"""The pool actor: a thin loop that feeds `BlockBooks` the messages in its inbox."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, NamedTuple

import anyio

from kvpool.messages import Denied, Granted, PoolCommand, PoolReply, Release, Released, Reserve

if TYPE_CHECKING:
    from anyio.abc import TaskStatus
    from anyio.streams.memory import MemoryObjectSendStream

    from kvpool.books import BlockBooks, PoolSnapshot


class PoolEnvelope(NamedTuple):
    msg: PoolCommand
    reply: MemoryObjectSendStream[PoolReply]


class Pool:
    """KV block books. Owns: the books. Receives: Reserve, Release. Emits: Granted, Denied,
    Released (to the envelope's reply stream). `snapshot` is republished after every message."""

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
        books = self._books
        async with self._inbox:
            async for env in self._inbox:
                reply: PoolReply
                match env.msg:
                    case Reserve(rid, blocks):
                        got = books.reserve(rid, blocks)
                        reply = Denied(rid, books.free) if got is None else Granted(rid, got)
                    case Release(rid):
                        reply = Released(rid, books.release(rid))
                self.snapshot = books.snapshot()
                with env.reply:
                    env.reply.send_nowait(reply)


def pool_blocks(memory_bytes: int, block_tokens: int, kv_bytes_per_token: int) -> int:
    """How many blocks of `block_tokens` tokens a budget of `memory_bytes` holds."""
    return max(0, math.floor(memory_bytes / (block_tokens * kv_bytes_per_token)))

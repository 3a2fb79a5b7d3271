"""The admission actor's side of the KV books: the rows the worker holds, the blocks they hold,
the padding the dense batch cache needs, and the pool calls that change them.

Owned and called by the admission actor alone (one task), so nothing here is shared. Which
request to preempt, and what happens to it, stays with the actor: this module only says when
memory is short.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvpool.books import PADDING
from kvpool.messages import Cache, Cached, Denied, Drop, Granted, Release, Reserve, Resize, Unpin
from scheduler.kvplan import KVPlan, prompt_keys
from workers.messages import Evict, Key

if TYPE_CHECKING:
    from collections.abc import Callable

    from kvpool.pool import Pool
    from metrics.observer import Observer
    from scheduler.live import Counters, Live


class Memory:
    """Rows and their blocks. `rows`: requests the worker holds (admitted, not yet confirmed
    dropped), by id."""

    def __init__(
        self,
        *,
        pool: Pool,
        plan: KVPlan,
        prefix_cache: bool,
        evict: Callable[[Evict], None],
        counters: Counters,
        observer: Observer,
    ) -> None:
        self.plan = plan
        self.rows: dict[int, Live] = {}
        self._pool = pool
        self._prefix_cache = prefix_cache
        self._evict = evict
        self._counters = counters
        self._obs = observer
        self._held = 0
        """Blocks the rows hold (the padding is separate)."""
        self._padding = 0
        self.freeing = 0
        """Blocks that preempted rows will return once the worker confirms."""

    def _target_padding(self, held: int, extra_row: int | None = None) -> int:
        plan = self.plan
        rows = [plan.row(r.length, r.final) for r in self.rows.values()]
        if extra_row is not None:
            rows.append(extra_row)
        return plan.padding(rows, held)

    def _evicted(self, keys: list[Key]) -> None:
        if keys:
            self._evict(Evict(keys))

    async def reserve(self, live: Live) -> Granted | None:
        """Blocks for `live` to enter the batch (and the padding its row adds), as a row from now
        on; None (nothing changes) if the pool has too few or its prefix is being computed."""
        plan = self.plan
        prompt = live.prompt
        remaining = live.submit.params.max_tokens - live.completion_tokens
        blocks = plan.at_admission(len(prompt), remaining)
        length, final = len(prompt), len(prompt) + remaining
        padding = self._target_padding(self._held + blocks, plan.row(length, final))
        if live.keys is None:
            live.keys = prompt_keys(prompt, plan.block_tokens) if self._prefix_cache else []
        session = live.submit.session if live.preemptions == 0 else None
        keep_free = plan.keep_free if self.rows else 0  # room for the others to grow into
        reply = await self._pool.call(
            Reserve(live.item.rid, blocks, live.keys, session, padding, keep_free)
        )
        if isinstance(reply, Denied):
            return None
        assert isinstance(reply, Granted)
        self._evicted(reply.evicted)
        live.blocks, live.length, live.final = reply.blocks, length, final
        live.pinned = reply.prefix_hits > 0
        self.rows[live.item.rid] = live
        self._held += reply.blocks
        self._padding = padding
        if live.preemptions == 0:  # a recompute after preemption reuses its own blocks: not the client's
            hit = reply.session_tokens or reply.prefix_hits * plan.block_tokens
            live.cached_tokens = min(hit, len(live.submit.prompt))
        c = self._counters
        if reply.session_tokens:
            c.session_hits += 1
        elif self._prefix_cache:
            hit = reply.prefix_hits * plan.block_tokens
            c.prefix_queries += 1
            c.prefix_query_tokens += len(prompt)
            c.prefix_hit_tokens += hit
            self._obs.prefix_query(hit, len(prompt))
        return reply

    async def unpin(self, rids: list[int]) -> None:
        """These rows' prompts are in the batch: their cached prefix blocks may go."""
        for rid in rids:
            await self._pool.call(Unpin(rid))

    async def grow(self, touched: list[Live]) -> Live | None:
        """On demand: give each row that crossed a block boundary its next block, and the dense
        cache the padding it now needs. The row the pool could not serve, or None."""
        plan = self.plan
        for live in touched:
            need = plan.blocks(live.length)
            rid = live.item.rid
            if need <= live.blocks or rid not in self.rows or live.preempting or live.ended \
                    or live.stopping is not None:
                continue
            padding = self._target_padding(self._held + need - live.blocks)
            reply = await self._pool.call(Resize(rid, need, padding))
            if isinstance(reply, Denied):
                return live
            assert isinstance(reply, Granted)
            self._evicted(reply.evicted)
            self._held += need - live.blocks
            live.blocks, self._padding = need, padding
        padding = self._target_padding(self._held)
        if padding != self._padding:
            reply = await self._pool.call(Resize(PADDING, padding))
            if isinstance(reply, Denied):
                return touched[0]
            assert isinstance(reply, Granted)
            self._evicted(reply.evicted)
            self._padding = padding
        return None

    def preempting(self, live: Live) -> None:
        """`live` was asked to leave the batch to free memory."""
        live.preempting = True
        self.freeing += live.blocks

    async def release(self, live: Live) -> None:
        """`live`'s row is gone from the batch: return its blocks and shrink the padding."""
        rid = live.item.rid
        live.running = False
        del self.rows[rid]
        self._held -= live.blocks
        if live.preempting:
            self.freeing -= live.blocks
            live.preempting = False
        live.blocks = 0
        self._padding = min(self._padding, self._target_padding(self._held))
        await self._pool.call(Release(rid, self._padding))

    async def cache(self, key: Key, tokens: int) -> None:
        """The worker stored KV under `key`: put it in the books, or tell the worker to drop it."""
        reply = await self._pool.call(Cache(key, self.plan.blocks(tokens), tokens))
        assert isinstance(reply, Cached)
        self._evicted(list(reply.evicted) + ([] if reply.ok else [key]))

    async def drop(self, key: Key) -> bool:
        """Forget a cache entry (a session); False when there was none."""
        reply = await self._pool.call(Drop(key))
        assert isinstance(reply, Cached)
        self._evicted([key] if reply.ok else [])
        return reply.ok

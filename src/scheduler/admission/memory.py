"""The admission core's side of the KV books: the rows the worker holds, the blocks they hold,
the padding the dense batch cache needs, and the pool commands that change them.

Synchronous: commands collect in `pending` and go to the pool as one batch; `on_replies` applies
the answers. The core's view moves first (as if every command were granted) and a denial rolls
its row back. Which request to preempt, and what happens to it, stays with the core.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, cast

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
    Release,
    Reserve,
    Resize,
    Unpin,
)
from scheduler.admission.kvplan import KVPlan, Longest, prompt_keys
from scheduler.admission.live import State
from workers.messages import Admit, Processing, SamplingSpec

if TYPE_CHECKING:
    from anyio.streams.memory import MemoryObjectSendStream

    from metrics.observer import Observer
    from scheduler.admission.live import Counters, Live
    from scheduler.params import SamplingParams
    from scheduler.policy import Policy
    from workers.messages import Key

class Memory:
    """Rows and their blocks. `rows`: requests the worker holds or is about to (reserved, not yet
    confirmed dropped), by id. `in_flight`: the batch the pool is applying, with each command's
    context; `pending`: commands for the next batch."""

    def __init__(self, *, plan: KVPlan, prefix_cache: bool, counters: Counters, observer: Observer) -> None:
        self.plan = plan
        self.rows: dict[int, Live] = {}
        self._finals = Longest()
        """The rows' final lengths: what the dense cache plans for in reserve mode."""
        self._prefix_cache = prefix_cache
        self._counters = counters
        self._obs = observer
        self._held = 0
        """Blocks the rows hold (the padding is separate)."""
        self._padding = 0
        self._pool_padding = 0
        """The padding the pool holds, as its replies confirm."""
        self._freeing: dict[int, int] = {}
        """Blocks that preempted rows will return once the worker confirms, by row."""
        self.pending: list[tuple[PoolCommand, object]] = []
        self.in_flight: list[tuple[PoolCommand, object]] | None = None
        self._room_base = (plan.blocks_total, 0)
        """(free + evictable blocks at the last reply, what the core's rows held then)."""

    # ---- the batch -------------------------------------------------------------------------
    def take_batch(self) -> PoolBatch | None:
        """The pending commands as one batch, unless one is in flight or none are pending."""
        if self.in_flight is not None or not self.pending:
            return None
        self.in_flight, self.pending = self.pending, []
        return PoolBatch([cmd for cmd, _ in self.in_flight])

    def estimate(self) -> int:
        """Blocks the pool could still hand out (free or evictable), as the core last knew it."""
        base, committed = self._room_base
        return base - (self._held + self._padding - committed)

    def _shape(self) -> tuple[int, int]:
        """(rows, the longest length the dense cache plans for)."""
        if self.plan.mode == "reserve":
            return self._finals.rows, self._finals.longest
        # On demand a row plans for its current length, which grows with every token.
        return len(self.rows), max((r.length for r in self.rows.values()), default=0)

    def _target_padding(self, held: int, extra_row: int | None = None) -> int:
        rows, longest = self._shape()
        if extra_row is not None:
            rows, longest = rows + 1, max(longest, extra_row)
        return self.plan.padding(rows, longest, held)

    # ---- commands --------------------------------------------------------------------------
    def need(self, live: Live) -> int:
        """Blocks `live` takes on entering the batch (its own and the padding it adds)."""
        plan = self.plan
        remaining = live.submit.request.params.max_tokens - live.completion_tokens
        blocks = plan.at_admission(len(live.prompt), remaining)
        length = len(live.prompt)
        padding = self._target_padding(self._held + blocks, plan.row(length, length + remaining))
        return blocks + max(0, padding - self._padding)

    def reserve(self, live: Live) -> None:
        """Ask for `live`'s blocks; it counts as a row from now on (rolled back if denied)."""
        plan = self.plan
        prompt = live.prompt
        remaining = live.submit.request.params.max_tokens - live.completion_tokens
        blocks = plan.at_admission(len(prompt), remaining)
        length, final = len(prompt), len(prompt) + remaining
        padding = self._target_padding(self._held + blocks, plan.row(length, final))
        if live.keys is None:
            live.keys = prompt_keys(prompt, plan.block_tokens) if self._prefix_cache else []
        session = live.submit.request.session if live.preemptions == 0 else None
        keep_free = plan.keep_free if self.rows else 0  # room for the others to grow into
        live.blocks, live.length, live.final = blocks, length, final
        self.rows[live.rid] = live
        self._finals.add(final)
        self._held += blocks
        self._padding = padding
        self.pending.append((Reserve(live.rid, blocks, live.keys, session, padding, keep_free), live))

    def grow(self, touched: list[Live]) -> None:
        """On demand: the next block for each row that crossed a block boundary, and the padding
        the dense cache now needs."""
        plan = self.plan
        rows, longest = self._shape()  # the lengths have all moved already: one walk a step
        for live in touched:
            need = plan.blocks(live.length)
            if need <= live.blocks or live.state not in (State.RUNNING, State.PREFILLING):
                continue
            padding = plan.padding(rows, longest, self._held + need - live.blocks)
            self.pending.append((Resize(live.rid, need, padding), (live, live.blocks)))
            self._held += need - live.blocks
            live.blocks, self._padding = need, padding
        padding = plan.padding(rows, longest, self._held)
        if padding != self._padding:
            self.pending.append((Resize(PADDING, padding), None))
            self._padding = padding

    def unpin(self, rid: int) -> None:
        self.pending.append((Unpin(rid), None))

    def victim(self, policy: Policy, short: Live, now: float) -> Live | None:
        """The row to drop so that `short` can grow: the policy's pick among the rows still
        growing, else `short` itself if it grows; None while blocks are already on their way
        back (wait for them) or nothing grows."""
        if self.freeing > 0:
            return None
        growing = (State.PREFILLING, State.RUNNING)
        picked = policy.victim([r.item for r in self.rows.values() if r.state in growing], now)
        victim = self.rows.get(picked.rid) if picked is not None else None
        if victim is None or victim.state not in growing:
            victim = short if short.state in growing else None
        return victim

    def preempting(self, live: Live) -> None:
        """`live` was asked to leave the batch to free memory."""
        live.state = State.PREEMPTING
        self._freeing[live.rid] = live.blocks

    @property
    def freeing(self) -> int:
        return sum(self._freeing.values())

    def release(self, live: Live) -> None:
        """`live`'s row is gone from the batch: return its blocks and shrink the padding. The
        Released reply carries `live` back (its final chunk may wait for it)."""
        del self.rows[live.rid]
        self._finals.remove(live.final)
        self._held -= live.blocks
        self._freeing.pop(live.rid, None)
        live.blocks = 0
        self._padding = min(self._padding, self._target_padding(self._held))
        self.pending.append((Release(live.rid, self._padding), live))

    def cache(self, key: Key, tokens: int) -> None:
        """The worker stored KV under `key`: put it in the books (or have the worker drop it)."""
        self.pending.append((Cache(key, self.plan.blocks(tokens), tokens), None))

    def drop(self, key: Key, reply: MemoryObjectSendStream[bool]) -> None:
        """Forget a cache entry (a session); the reply says whether there was one."""
        self.pending.append((Drop(key), reply))

    # ---- replies ---------------------------------------------------------------------------
    def on_replies(self, msg: PoolReplies) -> Outcome:
        """Apply the pool's answers to the batch in flight."""
        assert self.in_flight is not None, "replies without a batch"
        batch, self.in_flight = self.in_flight, None
        out = Outcome()
        any_denied = False
        for (cmd, ctx), reply in zip(batch, msg.replies, strict=True):
            if isinstance(reply, Denied):
                any_denied = True
            match cmd:
                case Reserve():
                    live = cast("Live", ctx)
                    if isinstance(reply, Granted):
                        self._pool_padding = cmd.padding if cmd.padding is not None else self._pool_padding
                        out.evicted.extend(reply.evicted)
                        out.granted.append((live, reply))
                        self._count_hits(live, reply)
                    else:
                        assert isinstance(reply, Denied)
                        self._unrow(live)
                        out.denied.append((live, reply.pending))
                case Resize():
                    if isinstance(reply, Granted):
                        out.evicted.extend(reply.evicted)
                        if cmd.rid == PADDING:
                            self._pool_padding = cmd.blocks
                        elif cmd.padding is not None:
                            self._pool_padding = cmd.padding
                    elif ctx is not None:
                        row, before = cast("tuple[Live, int]", ctx)
                        if self.rows.get(row.rid) is row and row.blocks > before:
                            self._held -= row.blocks - before
                            row.blocks = before
                        out.short = out.short or row
                    else:
                        out.short = out.short or next(iter(self.rows.values()), None)
                case Release():
                    if cmd.padding is not None:
                        self._pool_padding = min(self._pool_padding, cmd.padding)
                    out.released.append(cast("Live", ctx))
                case Cache():
                    assert isinstance(reply, Cached)
                    out.evicted.extend(reply.evicted)
                    if not reply.ok:
                        out.evicted.append(cmd.key)
                case Drop():
                    assert isinstance(reply, Cached)
                    if reply.ok:
                        out.evicted.append(cmd.key)
                    out.dropped.append((cast("MemoryObjectSendStream[bool]", ctx), reply.ok))
        if any_denied and not self.pending:
            # The view moved as if all were granted: back to what the pool holds, then shrink.
            self._padding = self._pool_padding
            target = self._target_padding(self._held)
            if target < self._padding:
                self.pending.append((Resize(PADDING, target), None))
                self._padding = target
        self._room_base = (msg.free + msg.evictable, self._held + self._padding)
        return out

    def _unrow(self, live: Live) -> None:
        """A denied Reserve: `live` is no row after all."""
        if self.rows.get(live.rid) is live:
            del self.rows[live.rid]
            self._finals.remove(live.final)
            self._held -= live.blocks
        live.blocks = 0

    def _count_hits(self, live: Live, reply: Granted) -> None:
        c = self._counters
        live.pinned = reply.prefix_hits > 0
        if live.preemptions == 0:  # a recompute after preemption reuses its own blocks: not the client's
            hit = reply.session_tokens or reply.prefix_hits * self.plan.block_tokens
            live.cached_tokens = min(hit, len(live.submit.tokens))
        if reply.session_tokens:
            c.session_hits += 1
        elif self._prefix_cache:
            hit = reply.prefix_hits * self.plan.block_tokens
            c.prefix_queries += 1
            c.prefix_query_tokens += len(live.prompt)
            c.prefix_hit_tokens += hit
            self._obs.prefix_query(hit, len(live.prompt))


def admit_message(live: Live, granted: Granted, eos: tuple[int, ...]) -> Admit:
    """What the worker needs to run `live`, as its row holds now (after a preemption: the prompt
    with what it generated, and the tokens still to come): the prefix blocks the grant found
    cached, and the keys of the rest to store."""
    params = live.submit.request.params
    stops = tuple(params.stop_token_ids) + (() if params.ignore_eos else eos)
    keys, hits = live.keys or [], granted.prefix_hits
    return Admit(
        rid=live.rid, prompt=live.prompt, max_tokens=params.max_tokens - live.completion_tokens,
        sampling=SamplingSpec(params.temperature, params.top_p, params.top_k, params.min_p, params.seed),
        stop_token_ids=tuple(dict.fromkeys(stops)), prefix=keys[:hits], store=keys[hits:],
        session=live.submit.request.session, resume=granted.session_tokens > 0,
        sampled=live.completion_tokens, processing=processing(params),
        logprobs=params.top_logprobs if params.logprobs else -1,
    )


def processing(p: SamplingParams) -> Processing | None:
    """The row's logits processors, or None when it asks for none (the common case: free)."""
    if (p.repetition_penalty == 1.0 and not p.presence_penalty and not p.frequency_penalty
            and not p.logit_bias and p.json_schema is None and p.grammar is None):
        return None
    return Processing(p.repetition_penalty, p.presence_penalty, p.frequency_penalty,
                      p.penalty_context, p.bias, p.grammar_text)


class Outcome:
    """What a batch's replies mean for the core."""

    __slots__ = ("denied", "dropped", "evicted", "granted", "released", "short")

    def __init__(self) -> None:
        self.granted: list[tuple[Live, Granted]] = []
        self.denied: list[tuple[Live, bool]] = []
        """Requests to put back in the queue; True: their prefix is being computed."""
        self.released: list[Live] = []
        self.evicted: list[Key] = []
        self.dropped: list[tuple[MemoryObjectSendStream[bool], bool]] = []
        self.short: Live | None = None
        """A row that could not grow: memory must be freed for it."""

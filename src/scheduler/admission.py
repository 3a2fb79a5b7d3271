"""The admission actor: the waiting queue, the running table and delivery of every chunk.

One task owns all request state, so every request ends exactly once: a final chunk is sent from
one place (`_end`) and a request's blocks are released only when the worker no longer holds it.
"""

from __future__ import annotations

import heapq
import math
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import anyio
import msgspec
import structlog

from scheduler.dispatcher import Codec, TextStream
from scheduler.errors import InvalidRequest, QueueFull, SchedulerClosed, SchedulerError
from scheduler.live import Counters, Live
from scheduler.memory import Memory
from scheduler.messages import Cancel, Close, DropSession, SubmitEnvelope
from scheduler.policy import Policy, QueueItem
from scheduler.types import Chunk, FinishReason, Timings
from workers.messages import (
    Abort,
    Admit,
    Evict,
    SamplingSpec,
    StepOutput,
    WorkerEvent,
    WorkerFailed,
)

if TYPE_CHECKING:
    from anyio.abc import TaskStatus
    from anyio.streams.memory import MemoryObjectReceiveStream

    from kvpool.messages import Granted
    from kvpool.pool import Pool
    from scheduler.kvplan import KVPlan
from metrics.observer import NullObserver, Observer

log = structlog.get_logger("scheduler")

Inbox = SubmitEnvelope | Cancel | Close | DropSession | WorkerEvent
WorkerSend = Callable[[Admit | Abort | Evict], None]


class Admission:
    """Owns: the policy queue, live requests, deadlines. Receives: Submit, Cancel, Close, and the
    worker's StepOutput/WorkerFailed. Emits: Admit/Abort/Evict to the worker, Reserve/Resize/
    Release/Unpin/Cache/Drop to the pool, Chunks to each request's stream."""

    def __init__(
        self,
        *,
        policy: Policy,
        pool: Pool,
        send_to_worker: WorkerSend,
        codec: Codec,
        eos_token_ids: tuple[int, ...],
        plan: KVPlan,
        prefix_cache: bool,
        max_batch: int,
        max_queue: int,
        observer: Observer | None = None,
    ) -> None:
        self._policy = policy
        self._obs: Observer = observer or NullObserver()
        self._to_worker = send_to_worker
        self._codec = codec
        self._eos = eos_token_ids
        self._plan = plan
        self._max_batch = max_batch
        self._max_queue = max_queue
        # Unbounded on purpose: every Submit is answered at once (so at most one per caller waits
        # here), the worker posts one message per step and must never block, and a Cancel sent
        # from a finalizer cannot wait.
        self.send, self._inbox = anyio.create_memory_object_stream[Inbox](math.inf)
        self._live: dict[int, Live] = {}
        self._deadlines: list[tuple[float, int]] = []
        self._next_rid = 0
        self._closed: str | None = None
        self._drain_until: float | None = None
        self.counters = Counters()
        self._memory = Memory(
            pool=pool, plan=plan, prefix_cache=prefix_cache, evict=send_to_worker,
            counters=self.counters, observer=self._obs,
        )
        self._rows = self._memory.rows

    # ---- views ---------------------------------------------------------------------------
    @property
    def running(self) -> int:
        return len(self._rows)

    @property
    def waiting(self) -> int:
        return len(self._policy)

    def on_worker_event(self, event: WorkerEvent) -> None:
        """Called on the event loop thread by the worker bridge."""
        try:
            self.send.send_nowait(event)
        except (anyio.ClosedResourceError, anyio.BrokenResourceError):
            pass  # the actor has finished: nothing is live any more

    # ---- the loop ------------------------------------------------------------------------
    async def run(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        task_status.started()
        inbox = self._inbox
        try:
            await self._loop(inbox)
        finally:
            # Also on a crash: closing every stream wakes each caller, so none waits forever.
            for live in self._live.values():
                live.out.close()

    async def _loop(self, inbox: MemoryObjectReceiveStream[Inbox]) -> None:
        with inbox:
            while True:
                batch: list[Inbox] = []
                with anyio.move_on_after(self._until_next_deadline()):
                    batch.append(await inbox.receive())
                while True:  # take everything already queued in one go
                    try:
                        batch.append(inbox.receive_nowait())
                    except anyio.WouldBlock:
                        break
                for msg in batch:
                    await self._handle(msg)
                    await self._admit()  # so the queue bound counts only what really waits
                await self._expire()
                await self._admit()
                if self._drain_until is not None and (
                    not self._rows or anyio.current_time() >= self._drain_until
                ):
                    await self._close("cancelled", None)
                    return

    async def _handle(self, msg: Inbox) -> None:
        match msg:
            case SubmitEnvelope():
                self._submit(msg)
            case Cancel(rid):
                await self._cancel(rid, "cancelled")
            case DropSession(session, reply):
                dropped = await self._memory.drop(session)
                with reply:
                    reply.send_nowait(dropped)
            case StepOutput():
                await self._on_step(msg)
            case WorkerFailed(message, lost, restarted, held):
                log.error("worker_failed", error=message, lost=len(lost), restarted=restarted)
                if restarted:
                    self.counters.engine_batch = held
                    for rid in lost:
                        await self._dropped_by_worker(rid, error=message)
                else:
                    self._closed = f"the worker failed: {message}"
                    await self._close("error", message)
            case Close(drain_s):
                self._closed = "the scheduler is shutting down"
                for live in [v for v in self._live.values() if not v.running]:
                    await self._cancel(live.item.rid, "cancelled")
                self._drain_until = anyio.current_time() + drain_s

    def _until_next_deadline(self) -> float:
        while self._deadlines and self._deadlines[0][1] not in self._live:
            heapq.heappop(self._deadlines)
        until = self._deadlines[0][0] if self._deadlines else math.inf
        if self._drain_until is not None:
            until = min(until, self._drain_until)
        return max(0.0, until - anyio.current_time())

    # ---- submission and admission ----------------------------------------------------------
    def _submit(self, env: SubmitEnvelope) -> None:
        msg = env.msg
        error: SchedulerError | None = None
        plan = self._plan
        need = plan.alone(len(msg.prompt) + msg.params.max_tokens)
        if self._closed is not None:
            error = SchedulerClosed(self._closed)
        elif need > plan.blocks_total:
            error = InvalidRequest(
                f"prompt ({len(msg.prompt)} tokens) + max_tokens ({msg.params.max_tokens}) needs "
                f"{need} KV blocks of {plan.block_tokens} tokens, but the pool has only "
                f"{plan.blocks_total}; lower max_tokens or raise [kvpool] memory"
            )
        elif len(self._policy) >= self._max_queue:
            error = QueueFull(f"the waiting queue is full ({self._max_queue} requests)")
        if error is not None:
            self.counters.rejected += 1
            self._obs.rejected(type(error).__name__)
            log.debug("request_rejected", reason=type(error).__name__, tenant=msg.tenant)
            with env.reply:
                env.reply.send_nowait(error)
            env.out.close()
            return
        rid = self._next_rid
        self._next_rid += 1
        now = anyio.current_time()
        deadline = None if msg.timeout is None else now + msg.timeout
        item = QueueItem(
            rid=rid, seq=rid, arrival=now, prompt_tokens=len(msg.prompt),
            max_tokens=msg.params.max_tokens, priority=msg.priority, tenant=msg.tenant,
            deadline=deadline,
        )
        self._live[rid] = Live(
            item, msg, env.out, TextStream(self._codec, msg.params.stop), prompt=msg.prompt
        )
        self._policy.push(item, now)
        if deadline is not None:
            heapq.heappush(self._deadlines, (deadline, rid))
        self._obs.submitted(msg.tenant, len(msg.prompt))
        log.debug("request_submitted", request_id=rid, tenant=msg.tenant)
        with env.reply:
            env.reply.send_nowait(rid)

    async def _admit(self) -> None:
        await self._expire()  # a request past its deadline is never admitted
        policy = self._policy
        while len(self._rows) < self._max_batch and self._closed is None:
            now = anyio.current_time()
            item = policy.peek(now)
            if item is None:
                return
            live = self._live[item.rid]
            granted = await self._memory.reserve(live)
            if granted is None:
                return  # head-of-line waits for memory (or for its prefix being computed)
            popped = policy.pop(now)
            assert popped is item, "policy.pop() must return what peek() returned"
            live.running = True
            policy.on_admitted(item, now)
            if live.admitted_at is None:
                live.admitted_at = time.perf_counter()
                self._obs.admitted(live.admitted_at - live.submit.submitted_at)
            admit = self._admit_message(live, granted)
            self._to_worker(admit)
            log.debug("request_admitted", request_id=item.rid, tenant=item.tenant, blocks=live.blocks,
                      prefix_blocks=len(admit.prefix), session=admit.resume or None)

    def _admit_message(self, live: Live, granted: Granted) -> Admit:
        """What the worker needs to run `live`, as its row holds now (after a preemption: the
        prompt with what it generated, and the tokens still to come)."""
        params = live.submit.params
        stops = tuple(params.stop_token_ids) + (() if params.ignore_eos else self._eos)
        keys, hits = live.keys or [], granted.prefix_hits
        return Admit(
            rid=live.item.rid,
            prompt=live.prompt,
            max_tokens=params.max_tokens - live.completion_tokens,
            sampling=SamplingSpec(
                params.temperature, params.top_p, params.top_k, params.min_p, params.seed
            ),
            stop_token_ids=tuple(dict.fromkeys(stops)),
            prefix=keys[:hits],
            store=keys[hits:],
            session=live.submit.session,
            resume=granted.session_tokens > 0,
            sampled=live.completion_tokens,
        )

    # ---- worker events ----------------------------------------------------------------------
    async def _on_step(self, out: StepOutput) -> None:
        c = self.counters
        c.steps, c.engine_batch = max(c.steps, out.step), out.held
        if out.active_bytes:
            c.active_bytes = out.active_bytes
        c.session_fallbacks += out.session_fallbacks
        for rid in out.aborted:
            await self._dropped_by_worker(rid)
        for key, size in reversed(out.stored):  # a chain leaf first: its root stays longest
            await self._memory.cache(key, size)
        live_map = self._live
        touched: list[Live] = []
        for rid, token in zip(out.rids, out.tokens, strict=True):
            live = live_map.get(rid)
            if live is None or live.ended or live.stopping is not None:
                continue
            if not live.pending:
                touched.append(live)
            live.pending.append(token)
        c.generated_tokens += len(out.tokens)
        if out.t_end > out.t_start:  # not a message that only confirms aborts
            self._obs.step(out.held, out.t_end - out.t_start, len(out.tokens))
        now = time.perf_counter()
        unpin: list[int] = []
        for live in touched:
            tokens, live.pending = live.pending, []
            text, hit = live.text.add(tokens)
            live.completion_tokens += len(tokens)
            live.tokens.extend(tokens)
            live.length += len(tokens)
            if live.pinned:  # its prompt is in the batch: the cached blocks may go
                live.pinned = False
                unpin.append(live.item.rid)
            self._policy.on_tokens(live.item, len(tokens))
            if live.first_token_at is None:
                live.first_token_at = now
                self._obs.tokens(len(tokens), now - live.submit.submitted_at, None)
                log.debug("first_token", request_id=live.item.rid, tenant=live.item.tenant)
            else:
                self._obs.tokens(len(tokens), None, now - live.last_token_at)
            live.last_token_at = now
            if hit and live.submit.session is not None:
                # The end waits for the worker to keep the session's KV, so that a next turn sent
                # as soon as this one ends finds it.
                live.stopping = (text, tokens)
                self._to_worker(Abort([live.item.rid], keep_sessions=True))
            elif hit:
                self._end(live, "stop", text, tokens)
                self._to_worker(Abort([live.item.rid]))
            else:
                self._send(live, Chunk(live.item.rid, text, tokens))
        for rid, reason in zip(out.finished, out.reasons, strict=True):
            live = live_map.get(rid)
            if live is None:
                continue
            ending: FinishReason = "length" if reason == "length" else "stop"
            await self._dropped_by_worker(rid, ending=ending)
        await self._memory.unpin(unpin)
        if touched and self._plan.mode == "on-demand":
            short = await self._memory.grow(touched)
            if short is not None:
                self._preempt(short)

    # ---- preemption ---------------------------------------------------------------------------
    def _preempt(self, short: Live) -> None:
        """Free memory for `short`: ask the worker to drop the policy's victim, unless blocks are
        already on their way back (then wait for them and try again)."""
        if self._memory.freeing > 0:
            return
        candidates = [
            r.item for r in self._rows.values()
            if not r.preempting and not r.ended and r.stopping is None
        ]
        victim_item = self._policy.victim(candidates, anyio.current_time())
        victim = self._rows.get(victim_item.rid) if victim_item is not None else None
        if victim is None or victim.preempting or victim.ended:
            victim = short
        self._memory.preempting(victim)
        self._to_worker(Abort([victim.item.rid]))
        log.info("request_preempted", request_id=victim.item.rid, tenant=victim.item.tenant,
                 blocks=victim.blocks, generated=victim.completion_tokens)

    def _requeue(self, live: Live) -> None:
        """A preempted request waits again, with what it generated appended to its prompt, to be
        recomputed; its stream carries on."""
        now = anyio.current_time()
        live.preemptions += 1
        live.prompt = live.submit.prompt + live.tokens
        live.keys = None
        self._policy.on_finished(live.item, now)
        live.item = msgspec.structs.replace(
            live.item, prompt_tokens=len(live.prompt),
            max_tokens=live.submit.params.max_tokens - live.completion_tokens,
        )
        self._policy.push(live.item, now)
        self.counters.preemptions += 1
        self._obs.preempted()

    async def _dropped_by_worker(
        self, rid: int, *, ending: FinishReason | None = None, error: str | None = None
    ) -> None:
        """The worker no longer holds `rid`: free its slot and blocks, then (if it has not ended
        yet) send its final chunk, so a caller who sees the end also sees the blocks back."""
        live = self._live.get(rid)
        if live is None or not live.running:
            return
        preempted = live.preempting
        await self._memory.release(live)
        if preempted and not live.ended and live.stopping is None and ending is None and error is None:
            self._requeue(live)
            return
        if not live.ended and live.stopping is not None:  # a stop string ended it
            self._end(live, "stop", *live.stopping)
        elif not live.ended and ending is not None:
            self._end(live, ending, live.text.finish(), [])
        elif not live.ended:  # lost in a failed step (or dropped unasked, which must not happen)
            self._end(live, "error", "", [], error=error or "the worker dropped the request")
        self._live.pop(rid, None)
        self._policy.on_finished(live.item, anyio.current_time())

    # ---- endings ----------------------------------------------------------------------------
    def _send(self, live: Live, chunk: Chunk) -> None:
        try:
            live.out.send_nowait(chunk)
        except (anyio.BrokenResourceError, anyio.ClosedResourceError):
            # The caller is gone without a Cancel reaching us yet: end the request now.
            if not live.ended:
                self._end(live, "cancelled", "", [])
                if live.running:
                    self._to_worker(Abort([live.item.rid]))

    def _end(
        self,
        live: Live,
        reason: FinishReason,
        text: str,
        tokens: list[int],
        *,
        error: str | None = None,
    ) -> None:
        """Send the one final chunk. A queued request is forgotten at once; a running one stays
        until the worker confirms it no longer holds it."""
        assert not live.ended
        live.ended = True
        now = time.perf_counter()
        t0 = live.submit.submitted_at
        queue_s = (live.admitted_at if live.admitted_at is not None else now) - t0
        ttft_s = None if live.first_token_at is None else live.first_token_at - t0
        timings = Timings(queue_s=queue_s, ttft_s=ttft_s, e2e_s=now - t0)
        rid = live.item.rid
        prompt_tokens = len(live.submit.prompt)
        final = Chunk(
            rid, text, tokens, reason, prompt_tokens, live.completion_tokens, timings, error,
            live.cached_tokens,
        )
        try:
            live.out.send_nowait(final)
        except (anyio.BrokenResourceError, anyio.ClosedResourceError):
            pass  # nobody is listening any more; the ending still counts
        live.out.close()
        self.counters.finished += 1
        self._obs.finished(reason, prompt_tokens, live.completion_tokens, queue_s, now - t0)
        log.debug("request_finished", request_id=rid, tenant=live.item.tenant, reason=reason,
                  completion_tokens=live.completion_tokens)
        if not live.running:
            del self._live[rid]

    async def _cancel(self, rid: int, reason: FinishReason) -> None:
        live = self._live.get(rid)
        if live is None or live.ended:
            return
        if not live.running:
            self._policy.remove(rid)
        self._end(live, reason, "", [])
        if live.running:
            self._to_worker(Abort([rid]))

    async def _expire(self) -> None:
        now = anyio.current_time()
        while self._deadlines and self._deadlines[0][0] <= now:
            _, rid = heapq.heappop(self._deadlines)
            await self._cancel(rid, "timeout")

    async def _close(self, reason: FinishReason, error: str | None) -> None:
        """End every live request (the worker is going away or has gone)."""
        self._closed = self._closed or "the scheduler is closed"
        for live in list(self._live.values()):
            if not live.ended:
                if not live.running:
                    self._policy.remove(live.item.rid)
                self._end(live, reason, "", [], error=error)
            if live.running:
                await self._memory.release(live)
                self._live.pop(live.item.rid, None)
                self._policy.on_finished(live.item, anyio.current_time())
        self._deadlines.clear()



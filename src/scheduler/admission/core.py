"""The admission core: the waiting queue, the running table, and every request's one ending.

A plain synchronous object in the shape of vLLM v1's `Scheduler` and nano-vllm's `Scheduler`:
inputs (`submit`, `cancel`, `on_step`, `on_pool`, ...) change its state and collect outputs;
`take(now)` admits what fits and hands back the commands for the worker, the one batch for the
pool and the chunks to deliver. No awaits, no clock reads (`now` comes in), no I/O.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import msgspec
import structlog

from scheduler.admission.live import HOLDS_ROW, Counters, Deadlines, Live, State, by_row, logprobs_by_row
from scheduler.admission.memory import Memory, admit_message
from scheduler.admission.plan import Plan
from scheduler.errors import InvalidRequest, QueueFull, SchedulerClosed, SchedulerError
from scheduler.policy import QueueItem
from scheduler.streaming.detokenize import TextStream
from scheduler.types import Chunk, FinishReason
from workers.messages import Abort, Evict

if TYPE_CHECKING:
    from anyio.streams.memory import MemoryObjectSendStream

    from kvpool.messages import PoolReplies
    from metrics.observer import Observer
    from scheduler.admission.kvplan import KVPlan
    from scheduler.admission.messages import Submit, WorkerCmd
    from scheduler.policy import Policy
    from scheduler.streaming.chunks import ChunkOut
    from scheduler.streaming.detokenize import Codec
    from workers.messages import StepOutput, WorkerFailed

log = structlog.get_logger("scheduler")

TAKES_TOKENS = frozenset({State.PREFILLING, State.RUNNING, State.PREEMPTING})


class AdmissionCore:
    """Owns: the policy queue, live requests, deadlines, the KV rows (`Memory`), counters."""

    def __init__(
        self, *, policy: Policy, codec: Codec, eos_token_ids: tuple[int, ...], plan: KVPlan,
        prefix_cache: bool, max_batch: int, max_queue: int, observer: Observer,
    ) -> None:
        self._policy = policy
        self._obs = observer
        self._codec = codec
        self._eos = eos_token_ids
        self._plan = plan
        self._max_batch = max_batch
        self._max_queue = max_queue
        self.counters = Counters()
        self.memory = Memory(plan=plan, prefix_cache=prefix_cache, counters=self.counters, observer=observer)
        self._live: dict[int, Live] = {}
        self._deadlines = Deadlines()
        self._next_rid = 0
        self.closed: str | None = None
        self._drain_until: float | None = None
        self._ended_all = False
        self._blocked: int | None = None
        """The head whose Reserve was denied: not asked again until something changes."""
        self._worker: list[WorkerCmd] = []
        self._aborts: list[int] = []
        self._aborts_keep: list[int] = []
        self._deliver: list[tuple[Live, Chunk]] = []
        self._replies: list[tuple[MemoryObjectSendStream[bool], bool]] = []

    # ---- views -------------------------------------------------------------------------------
    @property
    def running(self) -> int:
        return len(self.memory.rows)

    @property
    def waiting(self) -> int:
        return len(self._policy)

    @property
    def done(self) -> bool:
        """Asked to close, every request ended, and the pool has answered everything."""
        m = self.memory
        return self._drain_until is not None and self._ended_all and m.in_flight is None and not m.pending

    def next_wakeup(self) -> float:
        """When `take` must run even if no message comes (a deadline, the end of a drain)."""
        until = self._deadlines.next(self._live)
        if self._drain_until is not None and not self._ended_all:
            until = min(until, self._drain_until)
        return until

    # ---- inputs ------------------------------------------------------------------------------
    def submit(self, msg: Submit, out: ChunkOut, now: float) -> int | SchedulerError:
        """Queue a request: its id, or the error to raise in the caller (nothing is kept)."""
        req, prompt = msg.request, len(msg.tokens)
        too_big = self._plan.too_big(prompt, req.params.max_tokens)
        error: SchedulerError | None = None
        if self.closed is not None:
            error = SchedulerClosed(self.closed)
        elif too_big is not None:
            error = InvalidRequest(too_big)
        elif len(self._policy) - max(0, self._max_batch - len(self.memory.rows)) >= self._max_queue:
            # Only what really waits counts: the next `take` admits into free slots.
            error = QueueFull(f"the waiting queue is full ({self._max_queue} requests)")
        if error is not None:
            self.counters.rejected += 1
            self._obs.rejected(type(error).__name__)
            log.debug("request_rejected", reason=type(error).__name__, tenant=req.tenant)
            return error
        rid = self._next_rid
        self._next_rid += 1
        deadline = None if req.timeout is None else now + req.timeout
        item = QueueItem(
            rid=rid, seq=rid, arrival=now, prompt_tokens=prompt,
            max_tokens=req.params.max_tokens, priority=req.priority, tenant=req.tenant,
            deadline=deadline,
        )
        self._live[rid] = Live(
            item, msg, out, TextStream(self._codec, req.params.stop), prompt=msg.tokens,
            parts=None if msg.stream else [], logprobs=[] if req.params.logprobs else None,
            index=msg.index,
        )
        self._policy.push(item, now)
        if deadline is not None:
            self._deadlines.add(deadline, rid)
        self._obs.submitted(req.tenant, prompt)
        log.debug("request_submitted", request_id=rid, tenant=req.tenant)
        return rid

    def cancel(self, rid: int, now: float, reason: FinishReason = "cancelled") -> None:
        """End a request now (the caller left, or its deadline passed)."""
        live = self._live.get(rid)
        if live is None or live.sent_final:
            return
        if live.state is State.WAITING:
            self._policy.remove(rid)
        live.ending = None  # a stop string's final chunk that waited: the caller is gone
        self._finish(live, reason, "", [], None, now)
        if live.state in HOLDS_ROW:
            self._aborts.append(rid)

    def expire(self, now: float) -> None:
        for rid in self._deadlines.due(now):
            self.cancel(rid, now, "timeout")

    def drop_session(self, session: str, reply: MemoryObjectSendStream[bool]) -> None:
        self.memory.drop(session, reply)

    def close(self, drain_s: float, now: float) -> None:
        """Stop admitting; end the queued; running ones end now or after `drain_s` seconds."""
        self.closed = "the scheduler is shutting down"
        for live in list(self._live.values()):
            if live.state is State.WAITING:  # one being admitted runs (and drains) if granted
                self.cancel(live.rid, now)
        self._drain_until = now + drain_s

    def on_worker_failed(self, failed: WorkerFailed, now: float) -> None:
        log.error("worker_failed", error=failed.message, lost=len(failed.rids), restarted=failed.restarted)
        if failed.restarted:
            self.counters.engine_batch = failed.held
            for rid in failed.rids:
                self._dropped(rid, now, error=failed.message)
        else:
            self.closed = f"the worker failed: {failed.message}"
            self._end_all("error", failed.message, now)

    def on_step(self, out: StepOutput, now: float) -> None:
        """One engine step: the tokens each row emitted, the rows it finished or dropped."""
        c = self.counters
        c.steps, c.engine_batch = max(c.steps, out.step), out.held
        if out.active_bytes:
            c.active_bytes = out.active_bytes
        c.session_fallbacks += out.session_fallbacks
        self._blocked = None  # blocks may have come back, or a prefix been stored
        memory = self.memory
        for rid in out.aborted:
            self._dropped(rid, now)
        for key, size in reversed(out.stored):  # a chain leaf first: its root stays longest
            memory.cache(key, size)
        per_row = by_row(out.rids, out.tokens)
        lps = logprobs_by_row(out) if out.logprobs else None
        c.generated_tokens += len(out.tokens)
        if out.t_end > out.t_start:  # not a message that only confirms aborts
            self._obs.step(out.held, out.t_end - out.t_start, len(out.tokens))
        touched: list[Live] = []
        live_map, deliver, policy, obs = self._live, self._deliver, self._policy, self._obs
        for rid, tokens in per_row.items():
            live = live_map.get(rid)
            if live is None or live.state not in TAKES_TOKENS:
                continue
            text, hit = live.text.add(tokens)
            n, ttft, gap = live.took(tokens, now)
            if lps is not None and live.logprobs is not None:
                live.logprobs.extend(lps.get(rid, ()))
            if live.pinned:  # its prompt is in the batch: the cached blocks may go
                live.pinned = False
                memory.unpin(rid)
            policy.on_tokens(live.item, n)
            obs.tokens(n, ttft, gap)
            if ttft is not None:
                log.debug("first_token", request_id=rid, tenant=live.item.tenant)
            if hit and live.submit.request.session is not None:
                # The end waits for the worker to keep the session's KV, so that a next turn sent
                # as soon as this one ends finds it.
                live.ending = ("stop", text, tokens, None)
                live.state = State.STOPPING
                self._aborts_keep.append(rid)
            elif hit:
                self._finish(live, "stop", text, tokens, None, now)
                self._aborts.append(rid)
            else:
                if live.parts is None:
                    pending = live.take_logprobs()
                    deliver.append((live, Chunk(rid, text, tokens, logprobs=pending, index=live.index)))
                else:
                    live.parts.append(text)
                touched.append(live)
        for rid, reason in zip(out.finished, out.reasons, strict=True):
            self._dropped(rid, now, ending="length" if reason == "length" else "stop")
        if touched and self._plan.mode == "on-demand":
            memory.grow(touched)

    def on_pool(self, msg: PoolReplies, now: float) -> None:
        """The pool answered the batch in flight."""
        out = self.memory.on_replies(msg)
        if out.evicted:
            self._worker.append(Evict(out.evicted))
        for live, granted in out.granted:
            if live.sent_final or self._ended_all:  # ended while its Reserve was in flight
                self.memory.release(live)
                continue
            live.state = State.PREFILLING
            self._policy.on_admitted(live.item, now)
            if live.admitted_at is None:
                live.admitted_at = now
                self._obs.admitted(now - live.submit.submitted_at)
            admit = admit_message(live, granted, self._eos)
            self._worker.append(admit)
            log.debug("request_admitted", request_id=live.rid, tenant=live.item.tenant, blocks=live.blocks,
                      prefix_blocks=len(admit.prefix), session=admit.resume or None)
        for live, _ in reversed(out.denied):  # the head last, so it is first again
            if live.state is State.ADMITTING and not live.sent_final:
                live.state = State.WAITING
                if self.closed is None:
                    self._policy.push(live.item, now)
                else:
                    self.cancel(live.rid, now)
        if out.denied:
            self._blocked = out.denied[0][0].rid
        if out.released or out.dropped:
            self._blocked = None
        for live in out.released:
            if live.ending is not None and not live.sent_final:
                self._finish(live, *live.ending, now)
        self._replies.extend(out.dropped)
        if out.short is not None:
            self._preempt(out.short, now)

    # ---- the output --------------------------------------------------------------------------
    def take(self, now: float) -> Plan:
        """Expire, admit what fits, and hand over everything collected since the last call."""
        self.expire(now)  # a request past its deadline is never admitted
        if self._drain_until is not None and not self._ended_all and (
            not self.memory.rows or now >= self._drain_until
        ):
            self._end_all("cancelled", None, now)
        if self.closed is None:
            self._admit(now)
        if self._aborts:
            self._worker.append(Abort(self._aborts))
            self._aborts = []
        if self._aborts_keep:
            self._worker.append(Abort(self._aborts_keep, keep_sessions=True))
            self._aborts_keep = []
        plan = Plan(self._worker, self.memory.take_batch(), self._deliver, self._replies)
        self._worker, self._deliver, self._replies = [], [], []
        return plan

    def _admit(self, now: float) -> None:
        """Reserve for the queue's head, and for those after it that the pool should have room
        for, in one batch (only while no batch is in flight: the grants decide)."""
        memory, policy = self.memory, self._policy
        if memory.in_flight is not None:
            return
        room = memory.estimate() - (self._plan.keep_free if memory.rows else 0)
        first = True
        while len(memory.rows) < self._max_batch:
            item = policy.peek(now)
            if item is None or (first and item.rid == self._blocked):
                return
            live = self._live[item.rid]
            need = memory.need(live) + len(live.keys or ())  # its prefix hits may be pinned
            if not first and need > room:
                return
            popped = policy.pop(now)
            assert popped is item, "policy.pop() must return what peek() returned"
            live.state = State.ADMITTING
            memory.reserve(live)
            room -= need
            first = False

    # ---- preemption --------------------------------------------------------------------------
    def _preempt(self, short: Live, now: float) -> None:
        """Free memory for `short`: ask the worker to drop the victim `Memory.victim` names."""
        victim = self.memory.victim(self._policy, short, now)
        if victim is None:
            return
        self.memory.preempting(victim)
        self._aborts.append(victim.rid)
        log.info("request_preempted", request_id=victim.rid, tenant=victim.item.tenant,
                 blocks=victim.blocks, generated=victim.completion_tokens)

    def _requeue(self, live: Live, now: float) -> None:
        """A preempted request waits again, with what it generated appended to its prompt, to be
        recomputed; its stream carries on."""
        live.preemptions += 1
        live.prompt = live.submit.tokens + live.tokens
        live.keys = None
        live.state = State.WAITING
        self._policy.on_finished(live.item, now)
        live.item = msgspec.structs.replace(
            live.item, prompt_tokens=len(live.prompt),
            max_tokens=live.submit.request.params.max_tokens - live.completion_tokens,
        )
        self._policy.push(live.item, now)
        self.counters.preemptions += 1
        self._obs.preempted()

    # ---- endings -----------------------------------------------------------------------------
    def _dropped(
        self, rid: int, now: float, *, ending: FinishReason | None = None, error: str | None = None
    ) -> None:
        """The worker no longer holds `rid`: release its row; then requeue it (preempted) or end
        it, its final chunk going out once the pool confirms the release."""
        live = self._live.get(rid)
        if live is None or live.state not in HOLDS_ROW:
            return
        preempted = live.state is State.PREEMPTING
        self.memory.release(live)
        if preempted and ending is None and error is None:
            self._requeue(live, now)
            return
        if not live.sent_final and live.ending is None:
            if ending is not None:
                live.ending = (ending, live.text.finish(), [], None)
            else:  # lost in a failed step (or dropped unasked, which must not happen)
                live.ending = ("error", "", [], error or "the worker dropped the request")
        live.state = State.STOPPING if not live.sent_final else State.FINISHED
        del self._live[rid]
        self._policy.on_finished(live.item, now)

    def _finish(
        self, live: Live, reason: FinishReason, text: str, tokens: list[int], error: str | None,
        now: float,
    ) -> None:
        """The one place a request ends: its final chunk. One that holds no row is forgotten at
        once; one that does stays until the worker confirms it dropped the row."""
        assert not live.sent_final
        live.sent_final, live.ending = True, None
        chunk = live.final_chunk(reason, text, tokens, error, now)
        self._deliver.append((live, chunk))
        self.counters.finished += 1
        assert chunk.timings is not None
        self._obs.finished(reason, chunk.prompt_tokens, live.completion_tokens,
                           chunk.timings.queue_s, chunk.timings.e2e_s)
        log.debug("request_finished", request_id=live.rid, tenant=live.item.tenant, reason=reason,
                  completion_tokens=live.completion_tokens)
        if live.state in HOLDS_ROW:
            live.state = State.STOPPING
        else:
            live.state = State.FINISHED
            self._live.pop(live.rid, None)

    def _end_all(self, reason: FinishReason, error: str | None, now: float) -> None:
        """End every live request (the worker is going away or has gone) and release the rows."""
        self.closed = self.closed or "the scheduler is closed"
        for live in list(self._live.values()):
            if not live.sent_final:
                if live.state is State.WAITING:
                    self._policy.remove(live.rid)
                live.ending = None
                self._finish(live, reason, "", [], error, now)
            if live.state in HOLDS_ROW:
                self.memory.release(live)
                live.state = State.FINISHED
                self._live.pop(live.rid, None)
                self._policy.on_finished(live.item, now)
        self._deadlines.clear()
        self._ended_all = True

    def outs(self) -> list[ChunkOut]:
        """Every live request's stream (closed by the actor if it stops abnormally)."""
        return [live.out for live in self._live.values()]

"""The admission actor: a thin loop that feeds the `AdmissionCore` its inbox and applies what it
returns (worker commands, the one pool batch, every request's chunks).

One task owns all request state, so every request ends exactly once (`AdmissionCore._finish`),
and a request's blocks are released only when the worker no longer holds it.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, NamedTuple

import anyio
import anyio.lowlevel

from kvpool.messages import PoolReplies
from scheduler.admission.core import AdmissionCore
from scheduler.admission.messages import Cancel, Close, DropSession, Submit, SubmitEnvelope, WorkerCmd
from scheduler.errors import SchedulerClosed, SchedulerError
from workers.bridge import LoopCaller
from workers.messages import Admit, StepOutput, WorkerEvent, WorkerFailed

if TYPE_CHECKING:
    from anyio.abc import TaskStatus

    from kvpool.pool import Pool
    from metrics.observer import Observer
    from scheduler.admission.kvplan import KVPlan
    from scheduler.admission.live import Counters
    from scheduler.admission.plan import Plan
    from scheduler.policy import Policy
    from scheduler.streaming.chunks import ChunkOut
    from scheduler.streaming.detokenize import Codec


class _Failed(NamedTuple):
    """Applying a step outside the actor's task raised: the task raises it."""

    error: Exception


Inbox = SubmitEnvelope | Cancel | Close | DropSession | WorkerEvent | PoolReplies | _Failed
WorkerSend = Callable[[WorkerCmd], None]


class Admission:
    """Owns: the core (queue, live requests, deadlines, KV rows). Receives: Submit, Cancel, Close,
    DropSession, the worker's StepOutput/WorkerFailed and the pool's PoolReplies. Emits: Admit/
    Abort/Evict to the worker, at most one PoolBatch in flight to the pool, Chunks to each
    request's stream."""

    def __init__(
        self, *, policy: Policy, pool: Pool, send_to_worker: WorkerSend, codec: Codec,
        eos_token_ids: tuple[int, ...], plan: KVPlan, prefix_cache: bool, max_batch: int,
        max_queue: int, observer: Observer, release_worker: Callable[[], None] | None = None,
    ) -> None:
        self._pool = pool
        self._to_worker = send_to_worker
        self._release_worker = release_worker
        self.core = AdmissionCore(
            policy=policy, codec=codec, eos_token_ids=eos_token_ids, plan=plan,
            prefix_cache=prefix_cache, max_batch=max_batch, max_queue=max_queue, observer=observer,
        )
        # Unbounded on purpose: every Submit is answered at once (so at most one per caller waits
        # here), the worker posts one message per step and must never block, the pool one per
        # batch, and a Cancel sent from a finalizer cannot wait.
        self.send, self._inbox = anyio.create_memory_object_stream[Inbox](math.inf)
        self._soon: LoopCaller | None = None

    # ---- views -------------------------------------------------------------------------------
    @property
    def running(self) -> int:
        return self.core.running

    @property
    def waiting(self) -> int:
        return self.core.waiting

    @property
    def counters(self) -> Counters:
        return self.core.counters

    def post(self, event: WorkerEvent | PoolReplies) -> None:
        """Called on the event loop thread by the worker bridge and by the pool."""
        if isinstance(event, StepOutput | PoolReplies) and self._waiting():
            # The actor waits on an empty inbox: apply the step (or the pool's grants) here, as
            # the actor would next, and spare a task wake-up (for steps, a third of the loop's
            # work per token at one stream; for grants, part of every request's TTFT).
            now = time.perf_counter()
            try:
                handoff = self._handle(event, now)
                self._apply(self.core.take(now))
            except Exception as exc:  # the actor's task fails with it, as in its own loop
                self.send.send_nowait(_Failed(exc))
                return
            if handoff and self._release_worker is not None and self._soon is not None:
                self._soon(self._release_worker)  # after the callers this step woke
            return
        try:
            self.send.send_nowait(event)
        except (anyio.ClosedResourceError, anyio.BrokenResourceError):
            pass  # the actor has finished: nothing is live any more

    async def submit(self, msg: Submit, out: ChunkOut) -> int | SchedulerError:
        """Queue a request: its id, or the error to raise in its caller; `out` takes its chunks."""
        now = self.submit_now(msg, out)
        if now is not None:
            return now
        reply_send, reply_recv = anyio.create_memory_object_stream[int | SchedulerError](1)
        self.send.send_nowait(SubmitEnvelope(msg, reply_send, out))
        with reply_recv, anyio.CancelScope(shield=True):
            # Shielded: once submitted, the caller must learn the id to be able to cancel it.
            result = await reply_recv.receive()
        return result

    def submit_now(self, msg: Submit, out: ChunkOut) -> int | SchedulerError | None:
        """Queue a request within the caller's task, as the actor would next: its id, or the
        error to raise in the caller; None when the actor must take it (`SubmitEnvelope`): it is
        busy, or the request has a deadline, which its timer must learn of. Spares the request
        two task wake-ups (the actor's and the caller's) on its way to the worker."""
        if msg.request.timeout is not None or not self._waiting():
            return None
        now = time.perf_counter()
        result: int | SchedulerError = SchedulerClosed("the scheduler failed")
        try:
            result = self.core.submit(msg, out, now)
            if isinstance(result, int):
                self._apply(self.core.take(now))
        except Exception as exc:  # the actor's task fails with it, and ends the request too
            self.send.send_nowait(_Failed(exc))
        if not isinstance(result, int):
            out.close()
        return result

    def _waiting(self) -> bool:
        """The actor's task is suspended in `_receive` (the inbox's only receiver) and no message
        has been handed to it since (a message sent to a waiting receiver skips the buffer: work
        applied here before the actor resumes would overtake it), and it is not closing
        (closing ends its loop once every request has ended, which a message must wake)."""
        return self.core.closed is None and self._inbox.statistics().tasks_waiting_receive > 0

    # ---- the loop ----------------------------------------------------------------------------
    async def run(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        self._soon = LoopCaller()
        task_status.started()
        core = self.core
        try:
            with self._inbox:
                while not core.done:
                    wait = core.next_wakeup() - time.perf_counter()
                    if wait == math.inf:  # no deadline: no cancel scope (one per message)
                        handoff = await self._receive()
                    else:
                        handoff = False
                        with anyio.move_on_after(max(0.0, wait)):
                            handoff = await self._receive()
                    plan = core.take(time.perf_counter())
                    self._apply(plan)
                    if handoff and self._release_worker is not None:
                        # Let the callers woken by this step's chunks run first (see
                        # GPUWorker.release), then hand the worker its turn.
                        await anyio.lowlevel.checkpoint()
                        self._release_worker()
                    elif core.counters.engine_batch == 0 and any(
                        isinstance(cmd, Admit) for cmd in plan.worker
                    ):
                        # The worker sat idle: yield, so that it can take the GIL and start the
                        # prefill now rather than when this loop next waits (TTFT at low load).
                        await anyio.lowlevel.checkpoint()
        finally:
            # Also on a crash: closing every stream wakes each caller, so none waits forever.
            for out in core.outs():
                out.close()

    async def _receive(self) -> bool:
        """Wait for a message, then apply it and everything already queued in one go; True when
        the worker waits for its turn after them."""
        inbox = self._inbox
        try:
            msg = inbox.receive_nowait()
        except anyio.WouldBlock:
            msg = await inbox.receive()
        now = time.perf_counter()
        handoff = self._handle(msg, now)
        while True:
            try:
                msg = inbox.receive_nowait()
            except anyio.WouldBlock:
                return handoff
            handoff = self._handle(msg, now) or handoff

    def _handle(self, msg: Inbox, now: float) -> bool:
        """Apply one message to the core; True when the worker waits for its turn after it."""
        core = self.core
        match msg:
            case StepOutput():
                core.on_step(msg, now)
                return msg.handoff
            case PoolReplies():
                core.on_pool(msg, now)
            case SubmitEnvelope(submit, reply, out):
                result = core.submit(submit, out, now)
                with reply:
                    reply.send_nowait(result)
                if not isinstance(result, int):
                    out.close()
            case Cancel(rid):
                core.cancel(rid, now)
            case DropSession(session, reply):
                core.drop_session(session, reply)
            case WorkerFailed():
                core.on_worker_failed(msg, now)
            case Close(drain_s):
                core.close(drain_s, now)
            case _Failed(error):
                raise error
        return False

    def _apply(self, plan: Plan) -> None:
        """Worker commands first (an Admit before the Abort of the same request), then every
        chunk of the step in one pass, then the pool batch: the pool may answer within `send`,
        and the answer's own chunks must come after these."""
        for cmd in plan.worker:
            self._to_worker(cmd)
        gone: list[int] = []
        for live, chunk in plan.deliver:
            try:
                live.out.send_nowait(chunk)
            except (anyio.BrokenResourceError, anyio.ClosedResourceError):
                if chunk.finish_reason is None:
                    gone.append(chunk.request_id)  # the caller left before its Cancel arrived
            if chunk.finish_reason is not None:
                live.out.close()
        for reply, dropped in plan.replies:
            with reply:
                reply.send_nowait(dropped)
        if plan.pool is not None:
            self._pool.send(plan.pool)
        if gone:
            now = time.perf_counter()
            for rid in gone:
                self.core.cancel(rid, now)
            self._apply(self.core.take(now))

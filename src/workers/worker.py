"""The GPU-worker actor: one dedicated thread owns the engine for its whole life and steps it.

MLX streams are thread-local, so the model and `BatchGenerator` are built, stepped and closed on
that thread. Commands cross in through a thread-safe queue; one `StepOutput` per step crosses back
to the event loop without the thread ever waiting on the loop.
"""

from __future__ import annotations

import gc
import queue
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Generic, TypeVar

import anyio
import structlog

from workers.batching.contract import Engine, StepResult
from workers.bridge import LoopCaller, LoopClosed
from workers.messages import (
    Abort,
    Admit,
    Evict,
    Key,
    Shutdown,
    StepOutput,
    WorkerCommand,
    WorkerEvent,
    WorkerFailed,
)

if TYPE_CHECKING:
    from anyio.abc import TaskStatus

log = structlog.get_logger("workers")
InfoT = TypeVar("InfoT")
EngineFactory = Callable[[], tuple[Engine, InfoT]]


_NOTHING = StepResult([], [], [], [], 0)
HANDOFF_S = 0.002
"""How long the worker waits, after a step that produced a first token, for the event loop to
deliver it before building the next step (see `GPUWorker.release`)."""
COALESCE_S = 0.002
"""Steps that end sooner than this after the last message to the event loop go with the next one
(unless one ends or starts a request). Each message costs the loop a wake-up and the GIL; below a
couple of milliseconds a step (one stream on a small model: 0.7 ms on a 2-core CPU) would spend a
tenth of its time on it, and a stream's reader cannot tell 2 ms apart."""


class WorkerStartError(RuntimeError):
    """The engine could not be built; the cause is chained."""


class GPUWorker(Generic[InfoT]):
    """Owns: the worker thread and, through it, the engine. Receives: `WorkerCommand` via `send`.
    Emits: `WorkerEvent`s through `emit`, called on the event loop thread."""

    def __init__(
        self,
        factory: EngineFactory[InfoT],
        emit: Callable[[WorkerEvent], object],
        *,
        restart: bool = True,
        join_timeout: float = 60.0,
        at_thread_exit: Callable[[], object] | None = None,
    ) -> None:
        self._restart = restart
        self._at_thread_exit = at_thread_exit
        self._join_timeout = join_timeout
        self._step = 0
        self._factory = factory
        self._emit = emit
        self._commands: queue.SimpleQueue[WorkerCommand] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._loop_caller: LoopCaller | None = None
        self._started = anyio.Event()
        self._inserting: list[int] = []
        """Requests being inserted: a failed insert loses them before the engine holds them."""
        self._start_result: tuple[InfoT | None, BaseException | None] = (None, None)
        self._handoff = threading.Event()
        self._held_back: list[StepOutput] = []
        """Outputs of quiet steps (prefill only), posted with the next step's: one wake-up."""
        self._last_post = 0.0
        self._ahead: StepOutput | None = None
        """A step's output, posted once the next step is queued on the device (see `_queued`)."""

    def send(self, command: WorkerCommand) -> None:
        """Hand a command to the worker thread; never blocks."""
        self._commands.put_nowait(command)

    def release(self) -> None:
        """The loop has applied the last step's output: the worker may build the next step.

        The worker's Python (building the next step's graph) and the loop's both need the GIL.
        Right after a step, the device is already computing the next one (mlx-lm pipelines
        decode), so the worker can afford to let the loop go first: after a step that produced a
        first token it waits for this call, at most `HANDOFF_S`, rather than making that token
        wait for the GIL until its next step's graph is built (one whole step on host-bound
        models: measured 3-5 ms of TTFT)."""
        self._handoff.set()

    async def run(self, *, task_status: TaskStatus[InfoT] = anyio.TASK_STATUS_IGNORED) -> None:
        self._loop_caller = LoopCaller()
        self._thread = threading.Thread(target=self._main, name="mlx-worker", daemon=True)
        self._thread.start()
        try:
            await self._started.wait()
            info, error = self._start_result
            if error is not None:
                log.error("worker_failed", error=f"{type(error).__name__}: {error}", phase="start")
                raise WorkerStartError(f"the model engine failed to start: {error}") from error
            assert info is not None
            log.info("worker_started", thread=self._thread.name)
            task_status.started(info)
            await anyio.sleep_forever()
        finally:
            with anyio.CancelScope(shield=True):
                self._commands.put_nowait(Shutdown())
                await anyio.to_thread.run_sync(self._thread.join, self._join_timeout)
                if self._thread.is_alive():
                    log.error("worker_stuck", timeout_s=self._join_timeout)
                # MLX work in a joined thread can abort the interpreter at exit; collecting here,
                # on the loop's thread, prevents it (see MLX-NOTES).
                gc.collect()

    def _post(self, event: WorkerEvent) -> None:
        assert self._loop_caller is not None
        self._last_post = time.perf_counter()
        held, self._held_back = self._held_back, []
        try:
            if held:
                self._loop_caller(self._emit_all, [*held, event])
            else:
                self._loop_caller(self._emit, event)
        except LoopClosed:  # the loop is gone: nobody is left to tell
            pass

    def _queued(self) -> None:
        """The engine has built the next step and is about to hand it to MLX, which releases
        the GIL while it encodes and runs it: post the last step's output now, so that the event
        loop applies it in that window rather than while the next graph is being built (both
        need the GIL: measured, the loop's share of a step then lengthened the worker's step by
        about twice as much)."""
        out, self._ahead = self._ahead, None
        if out is not None:
            self._post(out)

    def _emit_all(self, events: list[WorkerEvent]) -> None:
        for event in events:
            self._emit(event)

    def _post_started(self, info: InfoT | None, error: BaseException | None) -> None:
        def done() -> None:
            self._start_result = (info, error)
            self._started.set()

        assert self._loop_caller is not None
        self._loop_caller(done)

    def _main(self) -> None:
        try:
            self._own_engine()
        finally:
            if self._at_thread_exit is not None:
                try:
                    self._at_thread_exit()
                except Exception as exc:  # the thread ends either way: said, not raised
                    log.warning("worker_thread_exit_failed", error=f"{type(exc).__name__}: {exc}")

    def _own_engine(self) -> None:
        try:
            engine, info = self._factory()
        except BaseException as exc:  # reported to run(), which raises it with its cause
            self._post_started(None, exc)
            return
        self._post_started(info, None)
        engine.on_queue = self._queued
        try:
            while not self._serve(engine):
                pass
        finally:
            engine.close()

    def _serve(self, engine: Engine) -> bool:
        """Step until Shutdown (True). A failed step ends the requests the engine held; then a
        fresh engine carries on (False) or, without restart, the thread ends (True)."""
        try:
            self._loop(engine)
            return True
        except Exception as exc:
            self._queued()  # the last good step's output first
            message = f"{type(exc).__name__}: {exc}"
            lost = engine.rids()
            lost += [rid for rid in self._inserting if rid not in lost]
            self._inserting = []
        if self._restart:
            try:
                engine.reset()
            except Exception as exc:
                message += f"; restarting the engine failed too: {type(exc).__name__}: {exc}"
            else:
                self._post(WorkerFailed(message, lost, restarted=True, held=engine.held()))
                return False
        self._post(WorkerFailed(message, lost, restarted=False))
        return True

    def _loop(self, engine: Engine) -> None:
        while True:
            idle = not engine.has_work()
            if idle:
                self._flush()
            aborted, kept, stop = self._intake(engine, block=idle)
            if stop:
                self._flush()
                return
            if engine.has_work():
                t_start = time.perf_counter()
                r = engine.step()
                self._step += 1
                t_end = time.perf_counter()
            elif aborted or kept:
                t_start = t_end = time.perf_counter()
                r = _NOTHING
            else:
                continue
            self._queued()  # a step without a decode: the last output goes now
            handoff = r.first and engine.has_work()
            out = StepOutput(
                self._step, r.rids, r.tokens, r.finished, r.reasons, aborted, engine.held(),
                t_start, t_end, r.prefill_tokens, kept + r.stored, r.active_bytes,
                r.session_fallbacks, handoff, r.logprobs,
            )
            if not (r.rids or r.finished or aborted or out.stored or r.session_fallbacks):
                # Prefill only: nothing the loop must act on now. Waking it would take the GIL
                # from the next step's graph building; it learns of this step with the next.
                self._held_back.append(out)
                continue
            if (
                not (handoff or r.finished or aborted or out.stored or r.session_fallbacks)
                and t_end - self._last_post < COALESCE_S and engine.has_work()
            ):
                self._held_back.append(out)  # its tokens go with a later step's
                continue
            if not handoff and not self._held_back and engine.calls_on_queue and engine.has_work():
                self._ahead = out  # posted from inside the next step (`_queued`)
                continue
            self._hand_over(out, handoff)

    def _flush(self) -> None:
        """Post what is waiting: the output kept for the next step, then the held-back ones."""
        self._queued()
        if self._held_back:
            self._post(self._held_back.pop())

    def _intake(self, engine: Engine, block: bool) -> tuple[list[int], list[tuple[Key, int]], bool]:
        """Apply the queued commands to the engine (`block`: wait for one first, as when idle):
        evictions, then inserts, then aborts. Returns the aborted requests, the sessions kept for
        them, and whether a Shutdown came."""
        pending: list[WorkerCommand] = [self._commands.get()] if block else []
        while True:
            try:
                pending.append(self._commands.get_nowait())
            except queue.Empty:
                break
        admits: list[Admit] = []
        aborted: list[int] = []
        kept: list[tuple[Key, int]] = []
        stop = False
        for command in pending:
            match command:
                case Admit():
                    admits.append(command)
                case Abort(rids, keep_sessions):
                    if keep_sessions:
                        kept.extend(engine.keep_sessions(rids))
                    aborted.extend(rids)
                case Evict(keys):
                    engine.evict(keys)  # before inserts: the pool evicted them first
                case Shutdown():
                    stop = True
        self._inserting = [a.rid for a in admits]
        engine.insert(admits)
        self._inserting = []
        engine.remove(aborted)
        return aborted, kept, stop

    def _hand_over(self, out: StepOutput, handoff: bool) -> None:
        """Post a step's output; after a first token (`handoff`), give the loop up to
        `HANDOFF_S` to deliver it before the next step's graph is built (see `release`)."""
        self._handoff.clear()
        self._post(out)
        if handoff:
            self._handoff.wait(HANDOFF_S)

"""The public `Scheduler`: starts the actors, validates requests and streams their chunks."""

from __future__ import annotations

import functools
import time
import warnings
from contextlib import AsyncExitStack
from typing import TYPE_CHECKING, Any

import anyio
import structlog

from kvpool.books import BlockBooks
from kvpool.pool import Pool
from metrics.logging import configure_logging
from metrics.prometheus import SchedulerMetrics
from scheduler import assembly
from scheduler.admission.actor import Admission
from scheduler.admission.kvplan import KVPlan, layer_bytes, pool_size
from scheduler.admission.messages import Cancel, Close, DropSession, Submit
from scheduler.assembly import Scopes, build_stats, is_wrapping, log_model_facts, real_engine_factory
from scheduler.chat.tools import ToolCalling, shown_to
from scheduler.config import SchedulerConfig
from scheduler.errors import (
    ConfigError,
    ModelLoadError,
    SchedulerClosed,
    SchedulerError,
)
from scheduler.policies import make_policy
from scheduler.request import (
    Request,
    chat_template_ids,
    check_for_model,
    check_length,
    check_session,
    check_token_ids,
    make_request,
    sibling_requests,
)
from scheduler.streaming.chunks import ChunkOut, SharedSender, SiblingReceiver, chunk_channel
from scheduler.streaming.gather import Gather
from scheduler.streaming.stream import Receiver, RequestStream, prompt_tokens
from workers.factory import release_mlx_thread
from workers.worker import EngineFactory, GPUWorker, WorkerStartError

if TYPE_CHECKING:
    from collections.abc import Callable
    from types import TracebackType

    from kvpool.messages import PoolReplies
    from scheduler.params import SamplingParams
    from scheduler.types import Completion, SchedulerStats
    from workers.factory import Loaded
    from workers.messages import WorkerEvent

log = structlog.get_logger("scheduler")


class Scheduler:
    """Serves many concurrent generation requests on one model with continuous batching.

    Use as `async with Scheduler(config) as sched:`; works under asyncio and trio."""

    def __init__(
        self,
        config: SchedulerConfig | None = None,
        *,
        engine_factory: EngineFactory[Loaded] | None = None,
    ) -> None:
        """`engine_factory` replaces the real engine (tests: a fake one, or the real one wrapped
        by `tests.faults.with_faults`)."""
        self.config = config if config is not None else SchedulerConfig()
        c = self.config
        if not structlog.is_configured():
            # Unconfigured structlog prints every level to stdout; apply [logging] instead.
            configure_logging(c.logging.format, c.logging.level)
        self._factory = engine_factory or real_engine_factory(c)
        self._stack: AsyncExitStack | None = None
        self._tg: anyio.abc.TaskGroup | None = None
        self._actors = Scopes()
        self._admission: Admission | None = None
        self._pool: Pool | None = None
        self._loaded: Loaded | None = None
        self._state = "new"
        self._done = anyio.Event()
        self._worker_done = anyio.Event()
        # A registry per scheduler, so two in one process never collide; gauges read at scrape.
        self.metrics = SchedulerMetrics(lambda: self.stats() if self._admission is not None else None)

    # ---- lifecycle ----------------------------------------------------------------------------
    async def __aenter__(self) -> Scheduler:
        if self._state != "new":
            raise SchedulerError("a Scheduler can be started only once; create a new one")
        self._state = "starting"
        c = self.config
        try:
            policy = make_policy(c.scheduler)
        except ValueError as exc:
            raise ConfigError(f"scheduler.policy: {exc}") from None
        stack = AsyncExitStack()
        tg = await stack.enter_async_context(anyio.create_task_group())
        try:
            worker: GPUWorker[Loaded] = GPUWorker(
                self._factory, self._on_worker_event, restart=c.worker.on_failure == "restart",
                at_thread_exit=release_mlx_thread,
            )
            try:
                loaded: Loaded = await tg.start(self._run_worker, worker)
            except WorkerStartError as exc:
                raise ModelLoadError(str(exc)) from exc.__cause__
            self._loaded = loaded
            info = loaded.info
            log_model_facts(loaded)
            blocks = pool_size(c.kvpool, info, loaded.device_memory)
            assembly.bound_cache(loaded, blocks, c.kvpool.block_tokens)
            self._pool = Pool(BlockBooks(blocks, c.kvpool.block_tokens,
                                         c.kvpool.block_tokens * info.kv_bytes_per_token))
            plan = KVPlan(
                mode=c.kvpool.mode, block_tokens=c.kvpool.block_tokens, blocks_total=blocks,
                watermark=c.kvpool.watermark, dense_step=loaded.dense_step,
                layers=layer_bytes(info),
            )
            self._admission = Admission(
                policy=policy,
                pool=self._pool,
                send_to_worker=worker.send,
                codec=loaded.codec,
                eos_token_ids=tuple(info.eos_token_ids),
                plan=plan,
                prefix_cache=c.kvpool.prefix_cache and loaded.kv_reuse,
                max_batch=c.worker.max_batch,
                max_queue=c.scheduler.max_queue,
                observer=self.metrics,
                release_worker=worker.release,
            )
            await tg.start(self._run_pool, self._pool, self._admission.post)
            await tg.start(self._run_admission)
        except BaseException as exc:
            tg.cancel_scope.cancel()
            try:
                await stack.aclose()
            except BaseException as group:  # the same failure, wrapped by the task group
                if not is_wrapping(group, exc):
                    raise
            self._state = "closed"
            raise
        self._stack, self._tg = stack, tg
        self._state = "running"
        log.info("scheduler_started", model=info.name, blocks=blocks, policy=c.scheduler.policy)
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.aclose()
        stack, self._stack = self._stack, None
        if stack is not None:
            await stack.aclose()

    async def aclose(self) -> None:
        """Stop: queued requests end as cancelled; running ones too (`shutdown = "abort"`) or they
        finish within `drain_timeout_s` (`"drain"`). Then the worker thread is joined. Leaving the
        `async with` block calls it; calling it earlier (from any task) is fine too."""
        if self._state != "running":
            return
        self._state = "closing"
        assert self._admission is not None and self._tg is not None
        s = self.config.scheduler
        try:
            self._admission.send.send_nowait(Close(s.drain_timeout_s if s.shutdown == "drain" else 0.0))
        except anyio.BrokenResourceError:
            pass  # the actor has already stopped (its failure surfaces from the task group)
        with anyio.CancelScope(shield=True):
            await self._done.wait()
            # Every request has ended; the pool and the worker have nothing left to do. Their
            # own scopes, not the task group's: that one also holds the caller's `async with` body.
            self._actors.cancel()
            await self._worker_done.wait()
        self._state = "closed"
        log.info("scheduler_closed")

    async def _run_worker(
        self,
        worker: GPUWorker[Loaded],
        *,
        task_status: anyio.abc.TaskStatus[Loaded] = anyio.TASK_STATUS_IGNORED,
    ) -> None:
        try:
            with self._actors.new():
                await worker.run(task_status=task_status)
        finally:
            self._worker_done.set()

    async def _run_pool(
        self, pool: Pool, reply: Callable[[PoolReplies], None], *,
        task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED,
    ) -> None:
        with self._actors.new():
            await pool.run(reply, task_status=task_status)

    async def _run_admission(
        self, *, task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED
    ) -> None:
        assert self._admission is not None
        try:
            await self._admission.run(task_status=task_status)
        finally:
            self._done.set()

    def _on_worker_event(self, event: WorkerEvent) -> None:
        if self._admission is not None:
            self._admission.post(event)

    # ---- requests -----------------------------------------------------------------------------
    @property
    def model(self) -> Loaded:
        if self._loaded is None:
            raise SchedulerClosed("the scheduler has not been started")
        return self._loaded

    def generate(
        self,
        prompt: str | list[int],
        params: SamplingParams | None = None,
        *,
        priority: int = 0,
        tenant: str = "default",
        timeout: float | None = None,
        session: str | None = None,
    ) -> RequestStream:
        """Stream a request's chunks: `async for chunk in sched.generate(...)`.

        `session`: keep this conversation's KV when the request finishes, and start from the
        session's KV if it has some, so the next turn (whose prompt continues this one's prompt
        and output) prefills only what is new. `drop_session` frees it.

        Arguments are checked here (`InvalidRequest`); the prompt's length, the queue
        (`QueueFull`) and the scheduler's state (`SchedulerClosed`) when iteration starts."""
        self._check_running()
        return self.submit(make_request(prompt, params, priority, tenant, timeout, session))

    def submit(self, request: Request, *, stream: bool = True) -> RequestStream:
        """`generate` for a `Request` built already (the HTTP server, a cluster replica).
        `stream=False`: only the final chunk comes, with the whole text (what `complete` uses)."""
        self._check_running()
        check_for_model(request, self.model.info.vocab_size, self.model.grammar_unavailable)
        send = self._submit if stream else functools.partial(self._submit, stream=False)
        return RequestStream(send, self.cancel, request)

    async def complete(
        self,
        prompt: str | list[int] | Request,
        params: SamplingParams | None = None,
        *,
        priority: int = 0,
        tenant: str = "default",
        timeout: float | None = None,
        session: str | None = None,
    ) -> Completion:
        """Run a request to its end and return it whole (`prompt` may be a whole `Request`)."""
        self._check_running()
        if isinstance(prompt, Request):
            request = prompt
        else:
            request = make_request(prompt, params, priority, tenant, timeout, session)
        gather = Gather()
        # Not streamed: one chunk at the end, so this task is not woken once per step.
        async with self.submit(request, stream=False) as stream:
            async for chunk in stream:
                gather.add(chunk)
        return gather.completion()

    def stats(self) -> SchedulerStats:
        """A snapshot of queue, batch and pool."""
        a, p = self._admission, self._pool
        if a is None or p is None:
            raise SchedulerClosed("the scheduler has not been started")
        return build_stats(a, p, self._loaded)

    async def drop_session(self, session: str) -> bool:
        """Free the KV a session keeps; False when it had none (never kept, evicted, dropped,
        or taken by a turn still running)."""
        check_session(session)
        self._check_running()
        assert self._admission is not None
        reply_send, reply_recv = anyio.create_memory_object_stream[bool](1)
        self._admission.send.send_nowait(DropSession(session, reply_send))
        with reply_recv, anyio.CancelScope(shield=True):
            try:
                dropped = await reply_recv.receive()
            except anyio.EndOfStream:
                raise SchedulerClosed("the scheduler closed before dropping the session") from None
        return dropped

    def metrics_text(self) -> str:
        """This scheduler's metrics in the Prometheus text format (`mlx_scheduler_*`)."""
        return self.metrics.text()

    def chat_prompt(self, messages: list[dict[str, Any]], *, tools: ToolCalling | None = None) -> list[int]:
        """Token ids of `messages` under the model's chat template, ready for `generate`; with
        `tools` (from `tool_calling`), the tools are shown to the model and earlier calls and
        results in `messages` written as it expects them."""
        shown, template = shown_to(tools, messages)
        return chat_template_ids(self.model.codec.tokenizer, shown, **template)

    def tool_calling(self, tools: list[Any], tool_choice: object = None) -> ToolCalling:
        """Tools (OpenAI's shape) and `tool_choice` ("auto", "none", "required" or
        `{"type": "function", "function": {"name": ...}}`) for this model: pass it to
        `chat_prompt`, give its `grammar()` to `SamplingParams`, and read the answer with its
        `reply(text)`. `InvalidRequest` names a bad tool or choice."""
        return ToolCalling(self.model.codec.tokenizer, tools, tool_choice)

    # ---- internals used by RequestStream --------------------------------------------------------
    def _check_running(self) -> None:
        if self._state != "running":
            raise SchedulerClosed(f"the scheduler is {self._state}; requests need a running one")

    async def _submit(self, request: Request, stream: bool = True) -> tuple[int, Receiver]:
        submitted_at = time.perf_counter()
        self._check_running()
        tokens = await prompt_tokens(request.prompt, self.model.codec.encode)
        out_send, out_recv = chunk_channel()  # the actor sends at most max_tokens + 2 chunks
        choices = sibling_requests(request)
        shared = SharedSender(out_send, len(choices))
        try:
            # Choice 0 streams, whatever was asked: its first chunk tells when its prompt is in.
            rid = await self._send(choices[0], tokens, shared.part(), stream or len(choices) > 1,
                                   submitted_at)
        except SchedulerError:
            out_recv.close()
            raise
        if len(choices) == 1:
            return rid, out_recv

        async def submit_rest() -> list[int]:
            rids: list[int] = []
            parts = [shared.part() for _ in choices[1:]]
            try:
                for i, (choice, part) in enumerate(zip(choices[1:], parts, strict=True), 1):
                    rids.append(await self._send(choice, tokens, part, stream, submitted_at, i))
            except SchedulerError:
                for part in parts[len(rids):]:
                    part.close()  # never submitted: the channel must not wait for them
                for r in rids:
                    self.cancel(r)
                raise
            return rids

        return rid, SiblingReceiver(out_recv, submit_rest)

    async def _send(
        self, request: Request, tokens: list[int], out: ChunkOut, stream: bool, submitted_at: float,
        index: int = 0,
    ) -> int:
        """Hand the request to the admission actor: its id (for `cancel`), or its refusal raised;
        `out` takes the chunks as the actor sends them."""
        check_length(len(tokens), request.params.max_tokens, self.model.info.context_length)
        self._check_running()
        assert self._admission is not None
        result = await self._admission.submit(Submit(request, tokens, submitted_at, stream, index), out)
        if isinstance(result, SchedulerError):
            raise result
        return result

    async def submit_tokens(
        self, tokens: list[int], params: SamplingParams, out: ChunkOut, *, priority: int = 0,
        tenant: str = "default", timeout: float | None = None, session: str | None = None,
        stream: bool = True, submitted_at: float | None = None,
    ) -> int:
        """Deprecated (removed in 0.3): use `submit(Request(...))`. Checked token ids in, the
        request's id out; `out` takes its chunks."""
        warnings.warn("Scheduler.submit_tokens is deprecated; use Scheduler.submit(Request(...))",
                      DeprecationWarning, stacklevel=2)
        request = Request(prompt=tokens, params=params, priority=priority, tenant=tenant,
                          timeout=timeout, session=session)
        check_token_ids(tokens, self.model.info.vocab_size)
        at = time.perf_counter() if submitted_at is None else submitted_at
        return await self._send(request, list(tokens), out, stream, at)

    def cancel(self, rid: int) -> None:
        """Cancel request `rid` (its chunks end with "cancelled" within a step, unless it has
        ended already)."""
        admission = self._admission
        if admission is not None:
            try:
                admission.send.send_nowait(Cancel(rid))
            except (anyio.ClosedResourceError, anyio.BrokenResourceError):
                pass  # the actor is gone and has ended every request already



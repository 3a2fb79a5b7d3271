"""`EngineProcess`: what the app needs of a `Scheduler`, served by one in a child process."""

from __future__ import annotations

import itertools
import os
import shutil
import subprocess
import sys
import tempfile
from collections import deque
from contextlib import AsyncExitStack
from pathlib import Path
from typing import TYPE_CHECKING, Any

import anyio
import msgspec
import structlog

from scheduler import errors
from scheduler.chunks import ChunkSender, chunk_channel
from scheduler.remote import wire
from scheduler.stream import RequestStream, prompt_tokens
from scheduler.types import Chunk
from scheduler.validation import chat_template_ids, check_arguments, check_session

if TYPE_CHECKING:
    from anyio.abc import Process, TaskGroup
    from anyio.streams.memory import MemoryObjectSendStream

    from scheduler.chunks import ChunkReceiver
    from scheduler.config import SchedulerConfig
    from scheduler.params import SamplingParams
    from scheduler.types import SchedulerStats
    from workers.models import ModelInfo

log = structlog.get_logger("scheduler.remote")

CLOSE_S = 30.0
"""How long the engine gets to end its requests and exit after `Close`; then it is killed."""


class RemoteModel(msgspec.Struct, frozen=True):
    """`Scheduler.model` as the app reads it: the engine's facts and this process's tokenizer."""

    info: ModelInfo
    codec: Any


class EngineProcess:
    """A `Scheduler` in a child process, for `serve` (`[server] engine_process`, `--engine-process`): the same
    `generate`, `chat_prompt`, `model` and `aclose`, with `fetch_stats` and `fetch_metrics` in
    place of `stats` and `metrics_text`. Use as `async with EngineProcess(config) as sched:`."""

    def __init__(self, config: SchedulerConfig) -> None:
        self.config = config
        self._state = "new"
        self._model: RemoteModel | None = None
        self._proc: Process | None = None
        self._link: wire.Framed | None = None
        self._stack = AsyncExitStack()
        self._tg: TaskGroup | None = None
        self._outs: dict[int, ChunkSender] = {}
        self._ids = itertools.count(1)
        self._outbox: list[msgspec.Struct] = []
        self._pending = anyio.Event()
        self._queries: deque[MemoryObjectSendStream[Any]] = deque()
        self._gone = anyio.Event()  # the engine closed the connection

    # ---- lifecycle ----------------------------------------------------------------------------
    async def __aenter__(self) -> EngineProcess:
        if self._state != "new":
            raise errors.SchedulerError("an EngineProcess can be started only once")
        self._state = "starting"
        try:
            await self._start()
        except BaseException:
            await self._stop_process()
            await self._stack.aclose()
            self._state = "closed"
            raise
        self._state = "running"
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()
        if self._tg is not None:
            self._tg.cancel_scope.cancel()  # the writer waits for frames that no longer come
        await self._stack.aclose()

    async def _start(self) -> None:
        folder = tempfile.mkdtemp(prefix="mlx-scheduler-")
        self._stack.callback(shutil.rmtree, folder, ignore_errors=True)
        path = os.path.join(folder, "engine.sock")
        listener = await anyio.create_unix_listener(path)
        async with listener:
            self._proc = await anyio.open_process(
                [sys.executable, "-m", "scheduler.remote", path],
                stdin=subprocess.DEVNULL, stdout=None, stderr=None,  # its logs go where ours do
            )
            log.info("engine_process_started", pid=self._proc.pid)
            reply = await self._unless_exited(self._handshake(listener))
        if isinstance(reply, wire.Failed):
            raise errors.ModelLoadError(f"the engine process could not start: {reply.error}")
        assert isinstance(reply, wire.Ready)
        codec = await anyio.to_thread.run_sync(_codec, reply.info.path)
        self._model = RemoteModel(reply.info, codec)
        self._tg = await self._stack.enter_async_context(anyio.create_task_group())
        self._stack.push_async_callback(self._stop_process)
        self._tg.start_soon(self._read)
        self._tg.start_soon(self._write)

    async def _handshake(self, listener: anyio.abc.Listener[Any]) -> object:
        stream = await listener.accept()  # type: ignore[attr-defined]
        self._link = wire.Framed(stream, wire.FromEngine)
        self._stack.push_async_callback(stream.aclose)
        await self._link.send(wire.Hello(self.config))
        return await self._link.receive()

    async def _unless_exited(self, work: Any) -> object:
        """`await work`, or ModelLoadError if the engine process exits first."""
        assert self._proc is not None
        proc, out = self._proc, []
        async with anyio.create_task_group() as tg:

            async def watch() -> None:
                await proc.wait()
                tg.cancel_scope.cancel()

            tg.start_soon(watch)
            out.append(await work)
            tg.cancel_scope.cancel()
        if not out:
            raise errors.ModelLoadError(
                f"the engine process exited with code {proc.returncode} before it was ready "
                "(its log above says why)")
        return out[0]

    async def aclose(self) -> None:
        """Stop as `Scheduler.aclose` does: every request ends (its stream gets "cancelled"), then
        the engine process exits. Idempotent."""
        if self._state != "running":
            return
        self._state = "closing"
        self._post(wire.Close())
        with anyio.move_on_after(CLOSE_S):
            await self._gone.wait()
        await self._stop_process()
        self._end_all(errors.SchedulerClosed("the scheduler closed before this request ended"))
        self._state = "closed"

    async def _stop_process(self) -> None:
        proc = self._proc
        if proc is None or proc.returncode is not None:
            return
        with anyio.move_on_after(CLOSE_S), anyio.CancelScope(shield=True):
            await proc.wait()
            return
        log.error("engine_process_killed", pid=proc.pid, reason=f"still running {CLOSE_S} s after Close")
        proc.kill()
        with anyio.CancelScope(shield=True):
            await proc.wait()

    @property
    def pid(self) -> int | None:
        """The engine process's id, once started."""
        return self._proc.pid if self._proc is not None else None

    @property
    def returncode(self) -> int | None:
        """The engine process's exit code, once it has exited."""
        return self._proc.returncode if self._proc is not None else None

    # ---- the Scheduler face -------------------------------------------------------------------
    @property
    def model(self) -> RemoteModel:
        if self._model is None:
            raise errors.SchedulerClosed("the scheduler has not been started")
        return self._model

    def generate(
        self, prompt: str | list[int], params: SamplingParams | None = None, *, priority: int = 0,
        tenant: str = "default", timeout: float | None = None, session: str | None = None,
    ) -> RequestStream:
        """As `Scheduler.generate`."""
        self._check_running()
        params = check_arguments(prompt, params, priority, tenant, timeout, self.model.info.vocab_size)
        check_session(session)
        return RequestStream(self._submit, self._cancel, prompt, params, priority, tenant, timeout, session)

    def chat_prompt(self, messages: list[dict[str, str]]) -> list[int]:
        return chat_template_ids(self.model.codec.tokenizer, messages)

    async def fetch_stats(self) -> SchedulerStats:
        reply = await self._query("stats")
        assert isinstance(reply, wire.Stats)
        return reply.stats

    async def fetch_metrics(self) -> str:
        reply = await self._query("metrics")
        assert isinstance(reply, wire.Metrics)
        return reply.text

    def _check_running(self) -> None:
        if self._state != "running":
            raise errors.SchedulerClosed(f"the scheduler is {self._state}; requests need a running one")

    async def _submit(
        self, prompt: str | list[int], params: SamplingParams, priority: int, tenant: str,
        timeout: float | None, session: str | None,
    ) -> tuple[int, ChunkReceiver]:
        self._check_running()
        tokens = await prompt_tokens(prompt, self.model.codec.encode)
        self._check_running()
        cid = next(self._ids)
        send, recv = chunk_channel()  # refusals come as its error (ChunkSender.fail)
        self._outs[cid] = send
        self._post(wire.Submit(cid, tokens, params, priority, tenant, timeout, session))
        return cid, recv

    def _cancel(self, cid: int) -> None:
        if self._outs.pop(cid, None) is not None and self._state == "running":
            self._post(wire.Cancel(cid))

    async def _query(self, what: str) -> object:
        self._check_running()
        send, recv = anyio.create_memory_object_stream[Any](1)
        self._queries.append(send)
        self._post(wire.Query(what))
        with recv:
            try:
                return await recv.receive()
            except anyio.EndOfStream:
                raise errors.SchedulerClosed("the engine process closed before answering") from None

    # ---- the connection -----------------------------------------------------------------------
    def _post(self, msg: msgspec.Struct) -> None:
        self._outbox.append(msg)
        self._pending.set()

    async def _write(self) -> None:
        assert self._link is not None
        while True:
            await self._pending.wait()
            self._pending = anyio.Event()
            frames, self._outbox = self._outbox, []
            try:
                await self._link.send_many(frames)
            except (anyio.BrokenResourceError, anyio.ClosedResourceError):
                return  # the reader says why

    async def _read(self) -> None:
        assert self._link is not None
        try:
            while True:
                msg = await self._link.receive()
                if isinstance(msg, wire.Chunks):
                    self._deliver(msg.items)
                elif isinstance(msg, wire.Rejected):
                    out = self._outs.pop(msg.cid, None)
                    if out is not None:
                        out.fail(errors.by_name(msg.kind, msg.message))
                elif isinstance(msg, wire.Stats | wire.Metrics):
                    with self._queries.popleft() as reply:
                        reply.send_nowait(msg)
        except (anyio.EndOfStream, anyio.BrokenResourceError, anyio.ClosedResourceError):
            pass
        finally:
            self._gone.set()
            if self._state == "running":  # not our Close: the engine died
                self._state = "failed"
                code = self._proc.returncode if self._proc is not None else None
                log.error("engine_process_exited", code=code)
                self._end_all(None, f"the engine process exited (code {code})")
            for q in self._queries:
                q.close()

    def _deliver(self, items: list[tuple[int, Chunk]]) -> None:
        outs = self._outs
        for cid, chunk in items:
            out = outs.get(cid)
            if out is None:
                continue  # cancelled here already
            try:
                out.send_nowait(chunk)
            except (anyio.BrokenResourceError, anyio.ClosedResourceError):
                outs.pop(cid, None)
                continue
            if chunk.finish_reason is not None:
                del outs[cid]

    def _end_all(self, error: Exception | None, why: str = "") -> None:
        """End every open stream: with `error`, or else with an "error" chunk saying `why`."""
        outs, self._outs = self._outs, {}
        for cid, out in outs.items():
            if error is not None:
                out.fail(error)
                continue
            try:
                out.send_nowait(Chunk(cid, "", [], "error", error=why))
            except (anyio.BrokenResourceError, anyio.ClosedResourceError):
                pass
            out.close()


def _codec(path: str) -> Any:
    from mlx_lm.utils import load_tokenizer

    from workers.factory import TokenizerCodec

    return TokenizerCodec(load_tokenizer(Path(path)))  # type: ignore[no-untyped-call]


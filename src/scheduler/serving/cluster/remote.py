"""`ChildScheduler`: what a replica needs of a `Scheduler`, served by one in a child process of
the replica's Ray actor (`[cluster] scheduler_process`; the child is `cluster.child`)."""

from __future__ import annotations

import asyncio
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
from scheduler.serving.cluster import REPLICA_FAILED, wire
from scheduler.streaming.chunks import ChunkSender, chunk_channel
from scheduler.streaming.stream import RequestStream
from scheduler.types import Chunk

if TYPE_CHECKING:
    from collections.abc import Callable

    from anyio.abc import Process, TaskGroup

    from scheduler.config import SchedulerConfig
    from scheduler.request import Request
    from scheduler.streaming.chunks import ChunkReceiver
    from scheduler.types import SchedulerStats
    from workers.loading.models import ModelInfo

log = structlog.get_logger("scheduler.cluster")
_PACKAGES = str(Path(__file__).resolve().parents[3])
"""The folder that holds `scheduler`, `workers`, `kvpool` and `metrics`."""
CLOSE_S = 30.0
"""How long the child gets to end its requests and exit after `Close`; then it is killed."""


class RemoteModel(msgspec.Struct, frozen=True):
    """`Scheduler.model` as a replica reads it."""

    info: ModelInfo


class _Out:
    __slots__ = ("accepted", "send")

    def __init__(self, send: ChunkSender, accepted: asyncio.Future[None]) -> None:
        self.send = send
        self.accepted = accepted
        """Done at the request's first chunk, or with its refusal."""


class ChildScheduler:
    """A `Scheduler` in a child process: the same `submit` and `model`, with `fetch_stats` and
    `fetch_metrics` beside `stats` (the last snapshot fetched). Use as `async with
    ChildScheduler(config) as sched:` on asyncio (a Serve replica's loop)."""

    def __init__(self, config: SchedulerConfig, on_exit: Callable[[str], None] | None = None) -> None:
        """`on_exit(why)` is called if the child exits while it should serve, after every open
        stream has ended."""
        self.config = config
        self._on_exit = on_exit
        self._state = "new"
        self._model: RemoteModel | None = None
        self._stats: SchedulerStats | None = None
        self._proc: Process | None = None
        self._link: wire.Framed | None = None
        self._stack = AsyncExitStack()
        self._tg: TaskGroup | None = None
        self._outs: dict[int, _Out] = {}
        self._ids = itertools.count(1)
        self._outbox: list[msgspec.Struct] = []
        self._pending = asyncio.Event()
        self._queries: deque[asyncio.Future[Any]] = deque()
        self._gone = asyncio.Event()  # the child closed the connection
        self.failure = ""
        """Why the child is gone while it should serve ("" while it serves)."""

    # ---- lifecycle ----------------------------------------------------------------------------
    async def __aenter__(self) -> ChildScheduler:
        if self._state != "new":
            raise errors.SchedulerError("a ChildScheduler can be started only once")
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
        path = os.path.join(folder, "s.sock")
        listener = await anyio.create_unix_listener(path)
        # The child imports this package from where this process did, whatever Ray did to sys.path.
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(x for x in (_PACKAGES, env.get("PYTHONPATH", "")) if x)
        async with listener:
            self._proc = await anyio.open_process(
                [sys.executable, "-m", "scheduler.serving.cluster.child", path],
                stdin=subprocess.DEVNULL, stdout=None, stderr=None, env=env,  # its logs go where ours do
            )
            log.info("scheduler_process_started", pid=self._proc.pid)
            reply = await self._unless_exited(self._handshake(listener))
        if isinstance(reply, wire.Failed):
            raise errors.ModelLoadError(f"the scheduler process could not start: {reply.error}")
        assert isinstance(reply, wire.Ready)
        self._model = RemoteModel(reply.info)
        self._stats = reply.stats
        self._tg = await self._stack.enter_async_context(anyio.create_task_group())
        self._stack.push_async_callback(self._stop_process)
        self._tg.start_soon(self._read)
        self._tg.start_soon(self._write)

    async def _handshake(self, listener: Any) -> object:
        stream = await listener.accept()
        self._link = wire.Framed(stream, wire.FromChild)
        self._stack.push_async_callback(stream.aclose)
        await self._link.send(wire.Hello(self.config))
        return await self._link.receive()

    async def _unless_exited(self, work: Any) -> object:
        """`await work`, or ModelLoadError if the child exits first."""
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
                f"the scheduler process exited with code {proc.returncode} before it was ready "
                "(its log above says why)")
        return out[0]

    async def aclose(self) -> None:
        """Stop as `Scheduler.aclose` does: every request ends (its stream gets "cancelled"), then
        the child exits. Idempotent."""
        if self._state != "running":
            return
        self._state = "closing"
        self._post(wire.Close())
        with anyio.move_on_after(CLOSE_S):
            await self._gone.wait()
        await self._stop_process()
        self._end_all("the scheduler closed before this request ended")
        self._state = "closed"

    async def _stop_process(self) -> None:
        proc = self._proc
        if proc is None or proc.returncode is not None:
            return
        with anyio.move_on_after(CLOSE_S), anyio.CancelScope(shield=True):
            await proc.wait()
            return
        log.error("scheduler_process_killed", pid=proc.pid, reason=f"still running {CLOSE_S} s after Close")
        proc.kill()
        with anyio.CancelScope(shield=True):
            await proc.wait()

    @property
    def pid(self) -> int | None:
        """The child's process id, once started."""
        return self._proc.pid if self._proc is not None else None

    # ---- the Scheduler face -------------------------------------------------------------------
    @property
    def model(self) -> RemoteModel:
        if self._model is None:
            raise errors.SchedulerClosed("the scheduler has not been started")
        return self._model

    def submit(self, request: Request) -> RequestStream:
        """As `Scheduler.submit`: the child checks the request, and refuses it through the stream."""
        self._check_running()
        return RequestStream(self._submit, self._cancel, request)

    def stats(self) -> SchedulerStats:
        """The last snapshot fetched (`fetch_stats`), or the one from the child's start."""
        assert self._stats is not None
        return self._stats

    async def fetch_stats(self) -> SchedulerStats:
        reply = await self._query("stats")
        assert isinstance(reply, wire.Stats)
        self._stats = reply.stats
        return reply.stats

    async def fetch_metrics(self) -> str:
        reply = await self._query("metrics")
        assert isinstance(reply, wire.Metrics)
        return reply.text

    def _check_running(self) -> None:
        if self._state != "running":
            why = f": {self.failure}" if self.failure else ""
            raise errors.SchedulerClosed(f"the scheduler is {self._state}{why}; requests need a running one")

    async def _submit(self, request: Request) -> tuple[int, ChunkReceiver]:
        self._check_running()
        cid = next(self._ids)
        send, recv = chunk_channel()
        out = self._outs[cid] = _Out(send, asyncio.get_running_loop().create_future())
        self._post(wire.Submit(cid, request))
        try:
            await out.accepted  # its first chunk is in `recv` then; a refusal raises
        except asyncio.CancelledError:
            self._cancel(cid)
            raise
        return cid, recv

    def _cancel(self, cid: int) -> None:
        out = self._outs.pop(cid, None)
        if out is not None:
            out.accepted.cancel()
            if self._state == "running":
                self._post(wire.Cancel(cid))

    async def _query(self, what: str) -> object:
        self._check_running()
        reply = asyncio.get_running_loop().create_future()
        self._queries.append(reply)
        self._post(wire.Query(what))
        return await reply

    # ---- the connection -----------------------------------------------------------------------
    def _post(self, msg: msgspec.Struct) -> None:
        self._outbox.append(msg)
        self._pending.set()

    async def _write(self) -> None:
        assert self._link is not None
        while True:
            await self._pending.wait()
            self._pending.clear()
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
                if isinstance(msg, wire.Step):
                    self._step(msg)
                elif isinstance(msg, wire.Stats | wire.Metrics):
                    reply = self._queries.popleft()
                    if not reply.done():
                        reply.set_result(msg)
        except (anyio.EndOfStream, anyio.BrokenResourceError, anyio.ClosedResourceError):
            if self._state == "running" and self._proc is not None:
                with anyio.move_on_after(2):  # for its exit status
                    await self._proc.wait()
        finally:
            self._gone.set()
            if self._state == "running":  # not our Close: the child died
                self._state = "failed"
                code = self._proc.returncode if self._proc is not None else None
                self.failure = f"its scheduler process exited (code {code})"
                log.error("scheduler_process_exited", code=code)
                self._end_all(self.failure)
                if self._on_exit is not None:
                    self._on_exit(self.failure)
            closed = errors.SchedulerClosed("the scheduler process closed before answering")
            for q in self._queries:
                if not q.done():
                    q.set_exception(closed)

    def _step(self, msg: wire.Step) -> None:
        outs = self._outs
        for cid, chunks in msg.chunks.items():
            out = outs.get(cid)
            if out is None:
                continue  # cancelled here already
            if not out.accepted.done():
                out.accepted.set_result(None)
            try:
                for chunk in chunks:
                    out.send.send_nowait(chunk)
            except (anyio.BrokenResourceError, anyio.ClosedResourceError):
                del outs[cid]  # its reader left; the Cancel is on its way
        for cid in msg.ended:
            out = outs.pop(cid, None)
            if out is not None:
                out.send.close()
        for cid, (kind, message) in msg.errors.items():
            out = outs.pop(cid, None)
            if out is None:
                continue
            if out.accepted.done():
                out.send.close()  # cut short: the stream ends with SchedulerClosed
            else:
                out.accepted.set_exception(errors.by_name(kind, message))

    def _end_all(self, why: str) -> None:
        """End every open stream: a started one with an "error" chunk saying `why`, under the id
        that tells a frontend its replica failed."""
        outs, self._outs = self._outs, {}
        for out in outs.values():
            if not out.accepted.done():
                out.accepted.set_exception(errors.SchedulerClosed(why))
                continue
            try:
                out.send.send_nowait(Chunk(REPLICA_FAILED, "", [], "error", error=why))
            except (anyio.BrokenResourceError, anyio.ClosedResourceError):
                pass
            out.send.close()

"""The engine process: one `Scheduler`, serving the HTTP process that started it over a local
socket. Run as `python -m scheduler.remote SOCKET`; the HTTP process sends the config first.

The admission actor sends each request's chunks straight into the next frame (`_Sink`): no task
per request here, and what every request produced in one step leaves in one write. The process ignores
SIGINT and SIGTERM: the HTTP process orders the shutdown (`Close`), and its disappearance (the
socket's end) closes the scheduler too, so no engine outlives its server."""

from __future__ import annotations

import signal
import sys
from typing import TYPE_CHECKING

import anyio
import structlog

from metrics.logging import configure_logging
from scheduler.api import Scheduler
from scheduler.errors import SchedulerError
from scheduler.remote import wire

if TYPE_CHECKING:
    import msgspec
    from anyio.abc import TaskGroup

    from scheduler.types import Chunk

log = structlog.get_logger("scheduler.remote")


class _Sink:
    """One request's `ChunkOut`: its chunks go straight into the next frame, with no task per
    request and no wake-up per chunk in this process."""

    __slots__ = ("cid", "closed", "ended", "engine", "gone", "rid")

    def __init__(self, engine: _Engine, cid: int) -> None:
        self.engine, self.cid = engine, cid
        self.rid: int | None = None
        """The scheduler's id, once the admission actor has accepted the request."""
        self.ended = False
        """Its final chunk went out."""
        self.closed = False
        self.gone = False
        """The HTTP side cancelled it: what still comes is dropped (the Cancel is on its way)."""

    def send_nowait(self, chunk: Chunk) -> None:
        if self.gone:
            return
        if chunk.finish_reason is not None:
            self.ended = True
        self.engine.chunks.append((self.cid, chunk))
        self.engine.pending.set()

    def close(self) -> None:
        self.closed = True
        self.engine.sinks.pop(self.cid, None)
        if self.rid is not None:  # else `_Engine._submit` learns whether it was refused
            self.stopped()

    def stopped(self) -> None:
        """Tell the HTTP side if the scheduler stopped before this request's final chunk."""
        if not (self.ended or self.gone):
            self.engine.reply(wire.Rejected(self.cid, "SchedulerClosed",
                                            "the scheduler stopped before this request ended"))


class _Engine:
    """The requests of one HTTP process and the frames going back: chunks from the admission
    actor (`_Sink`), refusals and query answers, flushed once per turn of this loop."""

    def __init__(self, sched: Scheduler, link: wire.Framed) -> None:
        self.sched = sched
        self.link = link
        self.sinks: dict[int, _Sink] = {}
        """The live requests by the HTTP side's id."""
        self.chunks: list[tuple[int, Chunk]] = []
        self.replies: list[msgspec.Struct] = []
        self.pending = anyio.Event()
        self.closing = False

    async def run(self) -> None:
        async with anyio.create_task_group() as outer:
            outer.start_soon(self._write)
            async with anyio.create_task_group() as submits:
                await self._read(submits)
            await self.sched.aclose()  # every live request ends with its "cancelled" chunk
            self.closing = True
            self.pending.set()  # the last frame, then the writer's end
            outer.cancel_scope.deadline = anyio.current_time() + 5  # a peer that reads nothing

    async def _read(self, submits: TaskGroup) -> None:
        while True:
            try:
                msg = await self.link.receive()
            except (anyio.EndOfStream, anyio.BrokenResourceError, anyio.ClosedResourceError):
                log.warning("engine_orphaned", reason="the HTTP process closed the connection")
                return
            match msg:
                case wire.Submit():
                    self.sinks[msg.cid] = _Sink(self, msg.cid)
                    submits.start_soon(self._submit, msg)
                case wire.Cancel(cid):
                    self._cancel(cid)
                case wire.Query(what="stats"):
                    self.reply(wire.Stats(self.sched.stats()))
                case wire.Query(what="metrics"):
                    self.reply(wire.Metrics(self.sched.metrics_text()))
                case wire.Close():
                    return
                case _:
                    raise TypeError(f"unexpected frame {type(msg).__name__}")

    async def _submit(self, m: wire.Submit) -> None:
        sink = self.sinks[m.cid]
        try:
            sink.rid = await self.sched.submit_tokens(
                m.prompt, m.params, sink, priority=m.priority, tenant=m.tenant, timeout=m.timeout,
                session=m.session)
        except SchedulerError as exc:
            self.sinks.pop(m.cid, None)
            if not sink.gone:
                self.reply(wire.Rejected(m.cid, type(exc).__name__, str(exc)))
            return
        if sink.gone:  # its Cancel came while the admission actor was answering
            self.sched.cancel(sink.rid)
        elif sink.closed:
            sink.stopped()

    def _cancel(self, cid: int) -> None:
        sink = self.sinks.pop(cid, None)
        if sink is not None:
            sink.gone = True
            if sink.rid is not None:
                self.sched.cancel(sink.rid)

    def reply(self, msg: msgspec.Struct) -> None:
        self.replies.append(msg)
        self.pending.set()

    async def _write(self) -> None:
        while True:
            await self.pending.wait()
            self.pending = anyio.Event()
            # Chunks first: a refusal of a stream that has begun comes after its chunks.
            frames: list[msgspec.Struct] = [wire.Chunks(self.chunks)] if self.chunks else []
            frames += self.replies
            self.chunks, self.replies = [], []
            try:
                await self.link.send_many(frames)
            except (anyio.BrokenResourceError, anyio.ClosedResourceError):
                return  # the HTTP process is gone; the reader ends the rest
            if self.closing and not (self.chunks or self.replies):
                return


async def serve_engine(path: str) -> None:
    """Connect to the HTTP process at `path`, start the scheduler it configures, serve it."""
    link = wire.Framed(await anyio.connect_unix(path), wire.ToEngine)
    async with link.stream:
        hello = await link.receive()
        if not isinstance(hello, wire.Hello):
            raise TypeError(f"expected Hello, got {type(hello).__name__}")
        config = hello.config
        configure_logging(config.logging.format, config.logging.level)
        sched = Scheduler(config)
        try:
            await sched.__aenter__()
        except Exception as exc:  # the HTTP process reports it and exits
            await link.send(wire.Failed(f"{type(exc).__name__}: {exc}"))
            return
        try:
            await link.send(wire.Ready(sched.model.info))
            await _Engine(sched, link).run()
        finally:
            await sched.__aexit__(None, None, None)


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: python -m scheduler.remote SOCKET", file=sys.stderr)
        return 2
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_IGN)
    anyio.run(serve_engine, argv[0])
    return 0

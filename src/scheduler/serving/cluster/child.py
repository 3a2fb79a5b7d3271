"""A replica's scheduler process (`[cluster] scheduler_process`): one `Scheduler`, serving the Ray
actor that started it over a local socket. Run as `python -m scheduler.serving.cluster.child
SOCKET`; the actor sends the config first.

Here the worker thread that builds each step shares its GIL with the scheduler's event loop
alone, not with Serve's machinery, which stays in the actor's process. A request's task lives
until its first chunk; after that it is followed (`RequestStream.listen`), and what every
request produced in one step leaves in one frame. The process ignores SIGINT and SIGTERM: the
actor orders the shutdown (`Close`), and its disappearance (the socket's end) closes the
scheduler too, so no scheduler outlives its replica."""

from __future__ import annotations

import signal
import sys
from typing import TYPE_CHECKING

import anyio
import structlog

from metrics.logging import configure_logging
from scheduler.api import Scheduler
from scheduler.errors import SchedulerError
from scheduler.serving.cluster import wire
from scheduler.serving.heap import freeze_startup_heap

if TYPE_CHECKING:
    import msgspec
    from anyio.abc import TaskGroup

    from scheduler.streaming.stream import RequestStream
    from scheduler.types import Chunk

log = structlog.get_logger("scheduler.cluster")
CLOSING_S = 5.0
"""How long the last frames may take to leave once the scheduler has closed."""
STOPPED = ("SchedulerClosed", "the scheduler stopped before this request ended")


class _Child:
    """The actor's requests and the frames going back, flushed once per wake-up of the writer:
    once per step while requests run."""

    def __init__(self, sched: Scheduler, link: wire.Framed) -> None:
        self.sched = sched
        self.link = link
        self.starting: dict[int, anyio.CancelScope] = {}
        """Requests waiting for their first chunk, each in a task of its own."""
        self.following: dict[int, RequestStream] = {}
        """Requests past their first chunk."""
        self.chunks: dict[int, list[Chunk]] = {}
        self.ended: list[int] = []
        self.errors: dict[int, tuple[str, str]] = {}
        self.replies: list[msgspec.Struct] = []
        self.pending = anyio.Event()
        self.closing = False

    async def run(self) -> None:
        async with anyio.create_task_group() as outer:
            outer.start_soon(self._write)
            async with anyio.create_task_group() as starts:
                await self._read(starts)
                starts.cancel_scope.cancel()
            await self.sched.aclose()  # every live request ends with its "cancelled" chunk
            self.closing = True
            self._wake()  # the last frame, then the writer's end
            outer.cancel_scope.deadline = anyio.current_time() + CLOSING_S  # a peer that reads nothing

    async def _read(self, starts: TaskGroup) -> None:
        while True:
            try:
                msg = await self.link.receive()
            except (anyio.EndOfStream, anyio.BrokenResourceError, anyio.ClosedResourceError):
                log.warning("scheduler_process_orphaned", reason="its replica closed the connection")
                return
            match msg:
                case wire.Submit():
                    starts.start_soon(self._start, msg)
                case wire.Cancel(cid):
                    await self._cancel(cid)
                case wire.Query(what="stats"):
                    self._reply(wire.Stats(self.sched.stats()))
                case wire.Query(what="metrics"):
                    self._reply(wire.Metrics(self.sched.metrics_text()))
                case wire.Close():
                    return
                case _:
                    raise TypeError(f"unexpected frame {type(msg).__name__}")

    async def _start(self, m: wire.Submit) -> None:
        """Submit one request and wait for its first chunk (a refusal raises there)."""
        with anyio.CancelScope() as scope:
            self.starting[m.cid] = scope
            try:
                stream = self.sched.submit(m.request)
                first = await stream.__anext__()
            except SchedulerError as exc:
                self.errors[m.cid] = (type(exc).__name__, str(exc))
                self._wake()
                return
            finally:
                self.starting.pop(m.cid, None)
            self.following[m.cid] = stream
            wire.add_chunks(self.chunks, m.cid, [first])
            stream.listen(self._wake)
            self._wake()

    async def _cancel(self, cid: int) -> None:
        scope = self.starting.pop(cid, None)
        if scope is not None:
            scope.cancel()  # the stream cancels the request as its task leaves
        stream = self.following.pop(cid, None)
        if stream is not None:
            await stream.aclose()
        self.chunks.pop(cid, None)

    def _reply(self, msg: msgspec.Struct) -> None:
        self.replies.append(msg)
        self._wake()

    def _wake(self) -> None:
        self.pending.set()

    def _collect(self) -> list[msgspec.Struct]:
        done: list[int] = []
        for cid, stream in self.following.items():
            if got := stream.ready():
                wire.add_chunks(self.chunks, cid, got)
            if stream.ended:
                done.append(cid)
        for cid in done:
            if self.following.pop(cid).complete:
                self.ended.append(cid)
            else:  # its channel closed before every final chunk: the scheduler stopped
                self.errors[cid] = STOPPED
        # Chunks first: a stream cut short ends after the chunks it had.
        frames: list[msgspec.Struct] = []
        if self.chunks or self.ended or self.errors:
            frames.append(wire.Step(self.chunks, self.ended, self.errors))
            self.chunks, self.ended, self.errors = {}, [], {}
        frames += self.replies
        self.replies = []
        return frames

    async def _write(self) -> None:
        while True:
            await self.pending.wait()
            self.pending = anyio.Event()
            frames = self._collect()
            try:
                await self.link.send_many(frames)
            except (anyio.BrokenResourceError, anyio.ClosedResourceError):
                return  # the actor is gone; the reader ends the rest
            if self.closing and not self.following and not self.pending.is_set():
                return


async def serve_child(path: str) -> None:
    """Connect to the actor at `path`, start the scheduler it configures, serve it."""
    link = wire.Framed(await anyio.connect_unix(path), wire.ToChild)
    async with link.stream:
        hello = await link.receive()
        if not isinstance(hello, wire.Hello):
            raise TypeError(f"expected Hello, got {type(hello).__name__}")
        config = hello.config
        configure_logging(config.logging.format, config.logging.level)
        sched = Scheduler(config)
        try:
            await sched.__aenter__()
        except Exception as exc:  # the actor reports it
            await link.send(wire.Failed(f"{type(exc).__name__}: {exc}"))
            return
        try:
            if config.server.freeze_heap:  # this process is the scheduler's alone
                freeze_startup_heap()
            await link.send(wire.Ready(sched.model.info, sched.stats()))
            await _Child(sched, link).run()
        finally:
            await sched.__aexit__(None, None, None)


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: python -m scheduler.serving.cluster.child SOCKET", file=sys.stderr)
        return 2
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_IGN)
    anyio.run(serve_child, argv[0])
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

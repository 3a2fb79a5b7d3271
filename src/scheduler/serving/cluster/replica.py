"""One scheduler replica: the body of the Serve deployment that owns one `Scheduler` in its own
Ray actor process, or with `[cluster] scheduler_process` in a child process of it
(`ChildScheduler`). Imports no Ray at module level; `cluster.app` wraps it with `serve.deployment`.

`generate` streams tuples, so the frontend learns which replica serves before the first token:
("replica", id) first. Then, by default (`[cluster] stream_feed`), nothing more: the request's
chunks go into its frontend's `Outbox`, and `feed`, one stream per frontend, carries every
request's chunks in one item per step (a `FeedItem`). Each item crosses Ray at a cost of its own
whatever it carries, and this process pays its share of that cost (Serve's per-item machinery)
under the GIL the worker thread needs to build the next step: once per step, not once per window
of every request's stream.

Without the feed, `generate` goes on with ("chunks", packed)..., or ("error", kind, message) when
the scheduler refuses the request (bad input, full queue, closing). Each item carries every
chunk that had arrived by then, msgpack-encoded (`pack_chunks`: Serve pickles each item with
cloudpickle, which walks a list of structs class by class; bytes it copies); under load, a
stream's chunks wait for one another (`[cluster] stream_messages_per_s`, `stream_interval_s`)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from collections import OrderedDict
from typing import TYPE_CHECKING, Any

import anyio
import msgspec
import structlog

from scheduler.errors import SchedulerError
from scheduler.request import Request  # noqa: TC001 - msgspec needs it at runtime
from scheduler.serving.cluster.pinning import pin_replica
from scheduler.serving.cluster.prom import label_replica
from scheduler.serving.cluster.remote import ChildScheduler
from scheduler.serving.cluster.wire import add_chunks
from scheduler.serving.heap import freeze_startup_heap
from scheduler.types import Chunk

if TYPE_CHECKING:
    from collections.abc import AsyncIterator

    from scheduler.api import Scheduler
    from scheduler.config import SchedulerConfig
    from scheduler.streaming.stream import RequestStream

log = structlog.get_logger("scheduler.cluster")
REPLICA_EXIT_CODE = 70
"""The exit status of a replica whose scheduler process died (EX_SOFTWARE)."""
REPORTED_KEYS = 512  # block keys a replica reports per stats period: the newest it served
REPORTED_SESSIONS = 512  # and sessions: routers learn the owners of sessions other frontends routed


class Job(msgspec.Struct, frozen=True):
    """One request as the frontend sends it (its prompt tokenized), and the block keys of that
    prompt; the router reads the request's session and the keys."""

    request: Request
    keys: tuple[int, ...] = ()
    feed: tuple[str, int] | None = None
    """(frontend id, key): its chunks go to that frontend's feed under the key. None: they are
    `generate`'s own items."""


class FeedItem(msgspec.Struct, frozen=True, array_like=True):
    """One item of a frontend's feed: each request's new chunks by its key, and the requests the
    scheduler refused, by key, as (error class name, message)."""

    chunks: dict[int, list[Chunk]] = {}
    errors: dict[int, tuple[str, str]] = {}


pack_chunks = msgspec.msgpack.Encoder().encode
"""A streamed item's chunks (or a `FeedItem`) as bytes (`unpack_chunks`, `unpack_feed`)."""
unpack_chunks = msgspec.msgpack.Decoder(list[Chunk]).decode
unpack_feed = msgspec.msgpack.Decoder(FeedItem).decode


class Outbox:
    """What waits for one frontend's feed: the chunks of its requests on this replica, by key.
    A request past its first chunk is followed rather than pushed: its stream calls back on each
    chunk, and `take` reads every followed stream's `ready()`, so a step wakes one task (the
    feed), not one per request."""

    def __init__(self) -> None:
        self._chunks: dict[int, list[Chunk]] = {}
        self._errors: dict[int, tuple[str, str]] = {}
        self._following: dict[int, tuple[RequestStream, asyncio.Future[None]]] = {}
        self._ready = asyncio.Event()
        self.readers = 0

    def put(self, key: int, chunks: list[Chunk]) -> None:
        add_chunks(self._chunks, key, chunks)
        self._ready.set()

    def refuse(self, key: int, error: SchedulerError) -> None:
        self._errors[key] = (type(error).__name__, str(error))
        self._ready.set()

    async def follow(self, key: int, stream: RequestStream) -> None:
        """Carry `stream`'s chunks under `key` until it has ended and `take` has them all."""
        done = asyncio.get_running_loop().create_future()
        self._following[key] = (stream, done)
        stream.listen(self._ready.set)
        self._ready.set()  # what came before it listened
        try:
            await done
        finally:
            self._following.pop(key, None)
            stream.listen(None)

    async def take(self) -> tuple[bytes, int]:
        """Everything put since the last take, once there is something, and for how many requests."""
        await self._ready.wait()
        for key, (stream, done) in self._following.items():
            if got := stream.ready():
                self.put(key, got)
            if stream.ended and not done.done():
                done.set_result(None)
        self._ready.clear()  # after the puts above: nothing else puts until this returns
        item = FeedItem(self._chunks, self._errors)
        self._chunks, self._errors = {}, {}
        return pack_chunks(item), len(item.chunks) + len(item.errors)


def replica_id() -> str:
    from ray import serve

    return str(serve.get_replica_context().replica_id.unique_id)


class SchedulerReplica:
    """Owns one `Scheduler` for the life of its actor, in a task of its own (anyio cancel
    scopes must be left by the task that entered them)."""

    async def __init__(self, config: SchedulerConfig) -> None:  # type: ignore[misc]  # Serve awaits it
        self._config = config
        self._id = replica_id()
        self._sched: Scheduler | ChildScheduler | None = None
        self._ready = asyncio.Event()
        self._stop = asyncio.Event()
        self._failure: BaseException | None = None
        self._served: OrderedDict[int, None] = OrderedDict()
        self._sessions: OrderedDict[str, float] = OrderedDict()  # the wall-clock time of each one's last turn
        self._open = 0  # open `generate` streams
        self._sending = 0  # of those, the ones past their first chunk: they share `stream_messages_per_s`
        self._boxes: dict[str, Outbox] = {}  # by frontend id
        self._feeds = 0  # open `feed` streams: they share `stream_messages_per_s`
        self._fed = [0, 0]  # feed items sent, and the requests they carried (one count per item each)
        self._cpus: list[int] | None = None
        self._cpus_note = ""
        if config.cluster.pin_cpus:  # before the scheduler's threads and child start: they inherit it
            self._cpus, self._cpus_note = pin_replica(config.cluster.gpus_per_replica)
            if self._cpus is None:
                log.warning("replica_not_pinned", replica=self._id, reason=self._cpus_note)
            else:
                log.info("replica_pinned", replica=self._id, cpus=self._cpus)
        self._owner = asyncio.get_running_loop().create_task(self._own())
        await self._ready.wait()
        if self._failure is not None:
            raise self._failure
        log.info("replica_started", replica=self._id, pid=os.getpid())

    async def _own(self) -> None:
        try:
            config, in_child = self._config, self._config.cluster.scheduler_process
            if in_child:  # this process then loads no MLX (on CUDA, a context on its GPU)
                opened: Scheduler | ChildScheduler = ChildScheduler(config, self._scheduler_died)
            else:
                from scheduler.api import Scheduler

                opened = Scheduler(config)
            async with opened as sched:
                self._sched = sched
                if config.server.freeze_heap and not in_child:  # a replica's process is ours alone
                    freeze_startup_heap()
                self._ready.set()
                await self._stop.wait()
        except BaseException as exc:  # reported by __init__ when it happens while starting
            self._failure = exc
            raise
        finally:
            self._ready.set()

    def __del__(self) -> None:
        # Serve calls no async hook on shutdown; stopping the task lets the scheduler drain.
        self._stop.set()

    @property
    def sched(self) -> Scheduler | ChildScheduler:
        assert self._sched is not None
        return self._sched

    def _scheduler_died(self, why: str) -> None:
        """Its scheduler process died: this replica can serve nothing more, so its process ends
        as if it had died with it. Serve then treats it as any dead replica (the frontends fail
        its requests with `replica_failed` as their feeds break, and Serve starts another)."""
        log.error("replica_exiting", replica=self._id, reason=why)
        os._exit(REPLICA_EXIT_CODE)

    async def info(self, target: str | None = None) -> dict[str, Any]:
        info = self.sched.model.info
        return {"name": info.name, "context_length": info.context_length, "replica": self._id,
                "vocab_size": info.vocab_size,
                "block_tokens": self._config.kvpool.block_tokens}

    async def generate(self, job: Job) -> AsyncIterator[tuple[Any, ...]]:
        yield ("replica", self._id)
        if job.feed is not None:
            await self._to_feed(job, job.feed)
            return
        c = self._config.cluster
        self._open += 1
        sending = False
        try:
            stream = self.sched.submit(job.request)
            async with stream:
                sent, shown = None, False
                async for chunk in stream:
                    if not sending:  # a request still queued sends nothing: it takes no budget
                        self._remember(job)
                        self._sending, sending = self._sending + 1, True
                    chunks = [chunk, *stream.ready()]
                    # Until some text has gone (TTFT), and at the end, nothing waits.
                    if shown and sent is not None and all(x.finish_reason is None for x in chunks):
                        wait = min(c.stream_interval_s, self._sending / c.stream_messages_per_s)
                        chunks += await stream.ready_by(sent + wait)
                    yield ("chunks", pack_chunks(chunks))
                    sent, shown = anyio.current_time(), shown or any(x.text for x in chunks)
        except SchedulerError as exc:
            yield ("error", type(exc).__name__, str(exc))
        finally:
            self._open -= 1
            if sending:
                self._sending -= 1

    async def _to_feed(self, job: Job, feed: tuple[str, int]) -> None:
        frontend, key = feed
        box = self._box(frontend)
        self._open += 1
        sending = False
        try:
            stream = self.sched.submit(job.request)
            async with stream:
                first = await stream.__anext__()  # a refusal raises here
                self._remember(job)
                self._sending, sending = self._sending + 1, True
                box.put(key, [first, *stream.ready()])
                await box.follow(key, stream)
                with contextlib.suppress(StopAsyncIteration):  # it ended with its final chunks
                    await stream.__anext__()  # else the scheduler closed first: this raises why
        except SchedulerError as exc:
            box.refuse(key, exc)
        finally:
            self._open -= 1
            if sending:
                self._sending -= 1

    async def feed(self, frontend: str, target: str | None = None) -> AsyncIterator[bytes]:
        """The chunks of `frontend`'s requests here, one item per step or less: an empty item
        first, so that the frontend knows the feed reached this replica. The replica's items
        share `[cluster] stream_messages_per_s` (steps are usually slower than that)."""
        box = self._box(frontend)
        box.readers += 1
        self._feeds += 1
        try:
            yield b""
            budget = self._config.cluster.stream_messages_per_s
            sent = 0.0
            while True:
                gap = sent + self._feeds / budget - time.monotonic()
                if gap > 0:
                    await asyncio.sleep(gap)
                data, requests = await box.take()
                sent = time.monotonic()
                self._fed[0] += 1
                self._fed[1] += requests
                yield data
        finally:
            self._feeds -= 1
            box.readers -= 1
            if not box.readers and self._boxes.get(frontend) is box:
                # Its frontend is gone or starts another feed; requests still running here put
                # into this box, which nobody reads: the frontend failed them with the feed.
                del self._boxes[frontend]

    def _box(self, frontend: str) -> Outbox:
        box = self._boxes.get(frontend)
        if box is None:
            box = self._boxes[frontend] = Outbox()
        return box

    def _remember(self, job: Job) -> None:
        for key in job.keys:
            self._served[key] = None
            self._served.move_to_end(key)
        while len(self._served) > REPORTED_KEYS:
            self._served.popitem(last=False)
        if (session := job.request.session) is not None:
            self._sessions[session] = time.time()
            self._sessions.move_to_end(session)
            while len(self._sessions) > REPORTED_SESSIONS:
                self._sessions.popitem(last=False)

    async def replica_stats(self, target: str | None = None) -> dict[str, Any]:
        sched = self.sched
        stats = await sched.fetch_stats() if isinstance(sched, ChildScheduler) else sched.stats()
        return {"replica": self._id, "pid": os.getpid(),
                "scheduler_pid": sched.pid if isinstance(sched, ChildScheduler) else os.getpid(),
                "cpus": self._cpus, "cpus_note": self._cpus_note,
                "streams": {"open": self._open, "sending": self._sending, "feeds": self._feeds,
                            "feed_items": self._fed[0], "feed_requests": self._fed[1]},
                "stats": msgspec.to_builtins(stats)}

    async def prometheus(self, target: str | None = None) -> str:
        sched = self.sched
        text = await sched.fetch_metrics() if isinstance(sched, ChildScheduler) else sched.metrics_text()
        return label_replica(text, self._id)

    def record_routing_stats(self) -> dict[str, Any]:
        """What Serve hands our router every `[cluster] stats_period_s`."""
        if self._sched is None:
            return {}
        s = self._sched.stats()
        cfg = self._config
        return {"blocks": s.blocks_total,
                "capacity": cfg.scheduler.max_queue + cfg.worker.max_batch,
                "keys": list(self._served), "sessions": dict(self._sessions)}

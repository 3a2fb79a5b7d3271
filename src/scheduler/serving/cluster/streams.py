"""A request's chunks as the frontend receives them from its replica, read by `EventStream` as
it reads a `RequestStream`. By default (`[cluster] stream_feed`) from `Feeds`: one `feed` stream
from each replica the frontend sends requests to, which carries every request's chunks in one
item per step, split here into a `FeedStream` per request. Without the feeds, a `RemoteStream`
reads the request's own `generate` stream.

The replica sends as its steps come; the pacing for the hop to Serve's proxy, where each streamed
event of each request is an item of its own, happens here: past its first text, a stream's
chunks wait for one another up to `min(stream_interval_s, sending / messages_per_s)`, the
frontend's budget shared by its streams that are sending."""

from __future__ import annotations

import asyncio
import itertools
from collections import deque
from typing import TYPE_CHECKING, Any

import structlog

from scheduler import errors
from scheduler.serving.cluster import REPLICA_FAILED
from scheduler.serving.cluster.replica import unpack_chunks, unpack_feed
from scheduler.types import Chunk

if TYPE_CHECKING:
    from ray.serve.handle import DeploymentHandle, DeploymentResponseGenerator

log = structlog.get_logger("scheduler.cluster")
FEED_OPEN_TIMEOUT_S = 10.0
"""How long a new feed may take to reach its replica before that replica's requests fail."""
STOPPING = "its frontend is stopping"
GEN_END_TIMEOUT_S = 30.0
"""How long an ended request's `generate` call may take to end before it is cancelled."""


def failed_chunk(replica: str, why: str) -> Chunk:
    return Chunk(REPLICA_FAILED, "", [], "error", error=f"replica {replica} failed: {why}")


def _settle(fut: asyncio.Future[None]) -> None:
    if not fut.done():
        fut.set_result(None)


class RemoteStream:
    """A replica's `generate` stream as the `RequestStream` that `EventStream` reads, without the
    feeds (`[cluster] stream_feed = false`). A replica that dies mid-stream ends it with an
    "error" chunk naming the replica: no hang."""

    def __init__(self, gen: DeploymentResponseGenerator, replica: str, choices: int = 1) -> None:
        self._gen = gen
        self.replica = replica
        self._ended = False
        self._finals_left = choices
        self._here: deque[Chunk] = deque()

    async def __aenter__(self) -> RemoteStream:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        if not self._ended:
            self._ended = True
            self._gen.cancel()

    def __aiter__(self) -> RemoteStream:
        return self

    def ready(self) -> list[Chunk]:
        """The rest of the chunks that came in the replica's last item, without waiting: they go
        out with the first as one event (`EventStream` coalesces them)."""
        out = list(self._here)
        self._here.clear()
        return out

    async def __anext__(self) -> Chunk:
        if self._here:
            return self._here.popleft()
        if self._ended:
            raise StopAsyncIteration
        try:
            item = await self._gen.__anext__()
        except StopAsyncIteration:
            self._ended = True
            raise
        except Exception as exc:  # the replica's process died or its actor failed
            self._ended = True
            log.error("replica_failed", replica=self.replica, error=repr(exc))
            return failed_chunk(self.replica, repr(exc))
        if item[0] == "error":
            self._ended = True
            raise errors.by_name(item[1], item[2])
        chunks = unpack_chunks(item[1])
        self._finals_left -= sum(c.finish_reason is not None for c in chunks)
        self._ended = self._finals_left <= 0
        self._here.extend(chunks[1:])
        return chunks[0]


class FeedStream:
    """One request's chunks as its replica's feed delivers them. A replica that dies, or whose
    feed breaks, ends it with an "error" chunk naming the replica: no hang."""

    def __init__(self, feeds: Feeds, key: int, choices: int, paced: bool) -> None:
        self._feeds = feeds
        self.key = key
        self.replica = ""
        self._gen: DeploymentResponseGenerator | None = None
        self._here: deque[Chunk] = deque()
        self._finals_left = choices
        self._refusal: errors.SchedulerError | None = None
        self._waiter: asyncio.Future[None] | None = None
        self._wake_on_any = True
        self._paced = paced
        self._sent: float | None = None
        self._shown = False
        self._sending = False
        self._ended = False

    # ---- from the feed ------------------------------------------------------------------------
    def push(self, chunks: list[Chunk]) -> None:
        self._here.extend(chunks)
        final = any(c.finish_reason is not None for c in chunks)
        if not self._sending:
            self._sending = True
            self._feeds.sending += 1
        self._wake(final)

    def refuse(self, error: errors.SchedulerError) -> None:
        self._refusal = error
        self._wake(True)

    def _wake(self, final: bool) -> None:
        w = self._waiter
        if w is not None and (final or self._wake_on_any):
            _settle(w)

    async def _wait(self, any_chunk: bool, timeout: float | None = None) -> None:
        loop = asyncio.get_running_loop()
        self._waiter = fut = loop.create_future()
        self._wake_on_any = any_chunk
        timer = None if timeout is None else loop.call_later(timeout, _settle, fut)
        try:
            await fut
        finally:
            self._waiter = None
            if timer is not None:
                timer.cancel()

    # ---- what `EventStream` reads ---------------------------------------------------------------
    async def __aenter__(self) -> FeedStream:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    def __aiter__(self) -> FeedStream:
        return self

    async def __anext__(self) -> Chunk:
        if not self._here and self._ended:
            raise StopAsyncIteration
        while not self._here and self._refusal is None:
            await self._wait(True)
        if self._refusal is not None and not self._here:
            refusal, self._refusal = self._refusal, None
            self._end()
            raise refusal
        if (self._paced and self._sent is not None and self._shown
                and all(c.finish_reason is None for c in self._here)):
            # One wait for the window: chunks that are not final do not wake it.
            loop = asyncio.get_running_loop()
            c = self._feeds
            delay = self._sent + min(c.interval_s, c.sending / c.messages_per_s) - loop.time()
            if delay > 0:
                await self._wait(False, delay)
        self._shown = self._shown or any(c.text for c in self._here)
        self._sent = asyncio.get_running_loop().time()
        return self._took(self._here.popleft())

    def ready(self) -> list[Chunk]:
        """The rest of the chunks that have come, without waiting: they go out with the one
        `__anext__` returned as one event (`EventStream` coalesces them)."""
        out = [self._took(c) for c in self._here]
        self._here.clear()
        return out

    def _took(self, chunk: Chunk) -> Chunk:
        if chunk.request_id == REPLICA_FAILED:
            self._end(cancel=True)  # were the replica alive with a broken feed, it stops there too
        elif chunk.finish_reason is not None:
            self._finals_left -= 1
            if self._finals_left <= 0:
                self._end()
        return chunk

    def _end(self, cancel: bool = False) -> None:
        if self._ended:
            return
        self._ended = True
        self._feeds.release(self)
        if self._gen is not None and cancel:
            self._gen.cancel()
        elif self._gen is not None:
            # Serve counts the request as the replica's until its `generate` call ends, which it
            # does right after the last chunk: read that end, off this stream's path.
            self._feeds.finish(self._gen)

    async def aclose(self) -> None:
        """Cancel the request on its replica if it has not ended. Safe to call more than once."""
        self._end(cancel=True)

    def fail(self, why: str) -> None:
        if not self._ended:
            self.push([failed_chunk(self.replica or "unknown", why)])


class Feeds:
    """This frontend's feeds, one per replica it sent requests to, and its open streams by key."""

    def __init__(self, handle: DeploymentHandle, frontend: str, messages_per_s: float,
                 interval_s: float) -> None:
        self._handle = handle
        self._frontend = frontend
        self.messages_per_s = messages_per_s
        self.interval_s = interval_s
        self.sending = 0  # open streams past their first chunk: they share `messages_per_s`
        self._keys = itertools.count()
        self._streams: dict[int, FeedStream] = {}
        self._readers: dict[str, asyncio.Task[None]] = {}
        self._ending: set[asyncio.Task[None]] = set()

    def open(self, choices: int, paced: bool) -> FeedStream:
        """A stream for a request about to be sent: the key its chunks will come under."""
        stream = FeedStream(self, next(self._keys), choices, paced)
        self._streams[stream.key] = stream
        return stream

    def attach(self, stream: FeedStream, replica: str, gen: DeploymentResponseGenerator) -> None:
        """`replica` took the request: read its feed if this frontend does not yet."""
        stream.replica, stream._gen = replica, gen
        if replica not in self._readers:
            feed = self._handle.feed.remote(self._frontend, target=replica)
            self._readers[replica] = asyncio.get_running_loop().create_task(self._read(replica, feed))

    def release(self, stream: FeedStream) -> None:
        self._streams.pop(stream.key, None)
        if stream._sending:
            stream._sending = False
            self.sending -= 1

    def finish(self, gen: DeploymentResponseGenerator) -> None:
        task = asyncio.get_running_loop().create_task(_end_of(gen))
        self._ending.add(task)
        task.add_done_callback(self._ending.discard)

    def stats(self) -> dict[str, Any]:
        return {"feeds": sorted(self._readers), "open": len(self._streams), "sending": self.sending}

    async def _read(self, replica: str, gen: DeploymentResponseGenerator) -> None:
        why = "its feed ended"
        try:
            # The first item is empty: the feed reached the replica. A replica that died since
            # it took the request never sends it.
            async with asyncio.timeout(FEED_OPEN_TIMEOUT_S):  # wait_for can swallow a cancel on 3.11
                await gen.__anext__()
            async for data in gen:
                item = unpack_feed(data)
                streams = self._streams
                for key, chunks in item.chunks.items():
                    stream = streams.get(key)
                    if stream is not None:  # else it ended here (its client left)
                        stream.push(chunks)
                for key, (kind, message) in item.errors.items():
                    stream = streams.get(key)
                    if stream is not None:
                        stream.refuse(errors.by_name(kind, message))
        except asyncio.CancelledError:
            why = STOPPING
            raise
        except Exception as exc:  # the replica's process died, or its actor failed
            why = repr(exc)
        finally:
            gen.cancel()
            del self._readers[replica]
            lost = [s for s in self._streams.values() if s.replica == replica]
            if lost and why != STOPPING:
                log.error("replica_failed", replica=replica, requests=len(lost), error=why)
            for stream in lost:
                stream.fail(why)


async def _end_of(gen: DeploymentResponseGenerator) -> None:
    try:
        async with asyncio.timeout(GEN_END_TIMEOUT_S):
            await gen.__anext__()
    except StopAsyncIteration:
        return
    except TimeoutError:
        log.warning("generate_did_not_end", timeout_s=GEN_END_TIMEOUT_S)
    except Exception as exc:  # the replica died after the request ended: nothing is lost
        log.debug("generate_end", error=repr(exc))
        return
    gen.cancel()

"""The frontend's side of a replica's streams, without Ray: `RemoteStream` (a stream per
request) and `Feeds`/`FeedStream` (one feed per replica, split by request), over fakes of the
generators Serve hands the frontend; and the replica's `Outbox`. `test_cluster.py` runs both
through a real Ray Serve."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from scheduler.errors import QueueFull, SchedulerClosed
from scheduler.serving.cluster import REPLICA_FAILED
from scheduler.serving.cluster.replica import FeedItem, Outbox, pack_chunks, unpack_feed
from scheduler.serving.cluster.streams import Feeds, FeedStream, RemoteStream
from scheduler.serving.http.errors import from_scheduler
from scheduler.types import Chunk

pytestmark = [pytest.mark.anyio, pytest.mark.parametrize("anyio_backend", ["asyncio"])]


class FakeGenerator:
    """A replica's `generate` stream as Serve hands it to the frontend (for RemoteStream)."""

    def __init__(self, items: list[object], then: Exception | None = None) -> None:
        self.items, self.then, self.cancelled = list(items), then, False

    async def __anext__(self) -> object:
        if self.items:
            return self.items.pop(0)
        if self.then is not None:
            raise self.then
        raise StopAsyncIteration

    def __aiter__(self) -> FakeGenerator:
        return self

    def cancel(self) -> None:
        self.cancelled = True


async def test_a_full_replica_queue_is_429_and_a_dead_replica_an_error_chunk() -> None:
    full = RemoteStream(FakeGenerator([("error", "QueueFull", "the queue holds 8 requests")]), "r1")
    with pytest.raises(QueueFull) as caught:
        await full.__anext__()
    answer = from_scheduler(caught.value, "req-1")
    assert (answer.status, answer.body.code) == (429, "queue_full")

    gen = FakeGenerator([("chunks", pack_chunks([Chunk(1, "hi", [5])]))], then=RuntimeError("ActorDiedError"))
    async with RemoteStream(gen, "r2") as dying:
        assert (await dying.__anext__()).text == "hi"
        last = await dying.__anext__()
        assert (last.request_id, last.finish_reason) == (REPLICA_FAILED, "error")
        assert last.error is not None and "r2" in last.error
        with pytest.raises(StopAsyncIteration):
            await dying.__anext__()
    assert not gen.cancelled  # it ended on its own: nothing left to cancel

    live = FakeGenerator([("chunks", pack_chunks([Chunk(1, "a", [5])]))])
    async with RemoteStream(live, "r3") as stream:
        await stream.__anext__()
    assert live.cancelled  # left before its end (a client gone): the replica's request is cancelled


async def test_chunks_that_came_in_one_item_are_ready_at_once_and_the_last_final_ends_the_stream() -> None:
    gen = FakeGenerator([("chunks", pack_chunks([Chunk(1, "a", [5]), Chunk(1, "b", [6])])),
                         ("chunks", pack_chunks([Chunk(1, "c", [7]), Chunk(1, "", [], "length")]))])
    async with RemoteStream(gen, "r4") as stream:
        assert (await stream.__anext__()).text == "a"
        assert [c.text for c in stream.ready()] == ["b"]  # came with "a": no wait for it
        assert stream.ready() == []
        assert (await stream.__anext__()).text == "c"
        assert [c.finish_reason for c in stream.ready()] == ["length"]
        with pytest.raises(StopAsyncIteration):
            await stream.__anext__()
    assert not gen.cancelled and gen.items == []  # it ended with its final chunk




class LiveFeed:
    """A replica's `feed` stream that stays open: the test hands it items, or its end."""

    def __init__(self) -> None:
        self.queue: asyncio.Queue[object] = asyncio.Queue()
        self.cancelled = False
        self.queue.put_nowait(b"")  # the replica's first item: the feed reached it

    def send(self, by_key: dict[int, list[Chunk]]) -> None:
        self.queue.put_nowait(pack_chunks(FeedItem(by_key)))

    def __aiter__(self) -> LiveFeed:
        return self

    async def __anext__(self) -> object:
        item = await self.queue.get()
        if isinstance(item, Exception):
            raise item
        return item

    def cancel(self) -> None:
        self.cancelled = True


class FakeHandle:
    """The replicas' handle as `Feeds` calls it: `feed.remote(frontend, target=replica)`."""

    def __init__(self) -> None:
        self.feeds: dict[str, list[LiveFeed]] = {}

    @property
    def feed(self) -> FakeHandle:
        return self

    def remote(self, frontend: str, target: str) -> LiveFeed:
        live = LiveFeed()
        self.feeds.setdefault(target, []).append(live)
        return live


def feeds(messages_per_s: float = 640.0, interval_s: float = 0.25) -> tuple[Feeds, FakeHandle]:
    handle = FakeHandle()
    return Feeds(handle, "front-1", messages_per_s, interval_s), handle


def sent(fd: Feeds, replica: str = "r1", choices: int = 1, paced: bool = True) -> tuple[FeedStream, FakeGenerator]:
    """A stream opened and attached to `replica`, as the frontend does once the replica took its
    request; and that request's `generate` call."""
    stream, gen = fd.open(choices, paced), FakeGenerator([])
    fd.attach(stream, replica, gen)
    return stream, gen


async def settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


async def test_an_outbox_carries_every_request_put_since_the_last_item_in_one() -> None:
    box = Outbox()
    box.put(7, [Chunk(1, "a", [5])])
    box.put(9, [Chunk(2, "x", [8])])
    box.put(7, [Chunk(1, "b", [6]), Chunk(1, "", [], "length")])
    box.refuse(11, QueueFull("the queue holds 8 requests"))
    data, requests = await box.take()
    item = unpack_feed(data)
    assert requests == 3
    assert {k: [c.text for c in v] for k, v in item.chunks.items()} == {7: ["a", "b", ""], 9: ["x"]}
    assert item.chunks[7][-1].finish_reason == "length"
    assert item.errors == {11: ("QueueFull", "the queue holds 8 requests")}
    with pytest.raises(TimeoutError):  # nothing new: the next item waits for a put
        await asyncio.wait_for(box.take(), 0.05)
    box.put(9, [Chunk(2, "y", [9])])
    data, requests = await box.take()
    assert requests == 1 and [c.text for c in unpack_feed(data).chunks[9]] == ["y"]


async def test_a_feed_splits_its_items_by_request_and_each_stream_ends_at_its_final() -> None:
    fd, handle = feeds()
    (one, gen_one), (two, gen_two) = sent(fd, paced=False), sent(fd, choices=2, paced=False)
    gens = [gen_one, gen_two]
    assert len(handle.feeds["r1"]) == 1  # one feed per replica, whatever the requests
    live = handle.feeds["r1"][0]
    live.send({one.key: [Chunk(1, "a", [5])], two.key: [Chunk(2, "p", [3], index=0)]})
    assert (await one.__anext__()).text == "a"
    assert (await two.__anext__()).text == "p"
    assert fd.stats() == {"feeds": ["r1"], "open": 2, "sending": 2}
    live.send({one.key: [Chunk(1, "b", [6]), Chunk(1, "", [], "stop")],
               two.key: [Chunk(2, "", [], "length", index=0), Chunk(3, "q", [4], index=1)]})
    assert (await one.__anext__()).text == "b"
    assert [c.finish_reason for c in one.ready()] == ["stop"]
    with pytest.raises(StopAsyncIteration):
        await one.__anext__()
    # Two choices: the first one's final does not end the stream.
    assert [(c.index, c.finish_reason) for c in [await two.__anext__(), *two.ready()]] == [(0, "length"), (1, None)]
    live.send({two.key: [Chunk(3, "", [], "length", index=1)]})
    assert (await two.__anext__()).finish_reason == "length"
    await settle()
    assert fd.stats() == {"feeds": ["r1"], "open": 0, "sending": 0}
    assert not any(g.cancelled for g in gens)  # both ended on their own: their calls were read to the end
    assert not live.cancelled  # the feed stays for the next requests


async def test_a_refused_request_raises_its_error_before_any_chunk() -> None:
    fd, handle = feeds()
    stream, _ = sent(fd)
    live = handle.feeds["r1"][0]
    live.queue.put_nowait(pack_chunks(FeedItem(errors={stream.key: ("QueueFull", "the queue holds 8")})))
    with pytest.raises(QueueFull) as caught:
        await stream.__anext__()
    assert from_scheduler(caught.value, "req-1").status == 429
    assert fd.stats()["open"] == 0


async def test_a_dead_replica_ends_its_streams_with_an_error_naming_it_and_the_next_request_reopens() -> None:
    fd, handle = feeds()
    (here, gen), _ = sent(fd), sent(fd, "r2")
    handle.feeds["r1"][0].send({here.key: [Chunk(1, "hi", [5])]})
    assert (await here.__anext__()).text == "hi"
    handle.feeds["r1"][0].queue.put_nowait(RuntimeError("ActorDiedError"))
    last = await here.__anext__()
    assert (last.request_id, last.finish_reason) == (REPLICA_FAILED, "error")
    assert last.error is not None and "r1" in last.error and "ActorDiedError" in last.error
    with pytest.raises(StopAsyncIteration):
        await here.__anext__()
    assert gen.cancelled  # were its replica alive behind a broken feed, its request stops there
    await settle()
    assert fd.stats() == {"feeds": ["r2"], "open": 1, "sending": 0}  # the other replica's stream goes on
    assert handle.feeds["r1"][0].cancelled
    sent(fd, paced=False)
    assert len(handle.feeds["r1"]) == 2  # a new feed to it (Serve's replacement, were it replaced)


async def test_a_client_that_leaves_cancels_its_request_and_its_late_chunks_are_dropped() -> None:
    fd, handle = feeds()
    (stream, gen), (other, _) = sent(fd, paced=False), sent(fd, paced=False)
    live = handle.feeds["r1"][0]
    live.send({stream.key: [Chunk(1, "a", [5])]})
    async with stream:
        assert (await stream.__anext__()).text == "a"
    assert gen.cancelled
    live.send({stream.key: [Chunk(1, "b", [6])], other.key: [Chunk(2, "z", [1])]})
    assert (await other.__anext__()).text == "z"
    assert fd.stats()["open"] == 1 and fd.stats()["sending"] == 1


async def test_paced_chunks_wait_for_one_another_up_to_the_budget_and_a_final_goes_at_once() -> None:
    fd, handle = feeds(messages_per_s=10.0)  # one stream sending: a window of 0.1 s
    (stream, _), (loose, _) = sent(fd), sent(fd, paced=False)
    live = handle.feeds["r1"][0]
    loop = asyncio.get_running_loop()
    live.send({stream.key: [Chunk(1, "a", [5])]})
    started = loop.time()
    assert (await stream.__anext__()).text == "a"  # the first text goes at once
    assert loop.time() - started < 0.05
    live.send({stream.key: [Chunk(1, "b", [6])]})
    loop.call_later(0.03, live.send, {stream.key: [Chunk(1, "c", [7])]})
    assert (await stream.__anext__()).text == "b"
    waited = loop.time() - started
    assert [c.text for c in stream.ready()] == ["c"]  # went with "b", one event
    assert 0.09 < waited < 0.25, waited
    mark = loop.time()
    live.send({stream.key: [Chunk(1, "d", [8])]})
    loop.call_later(0.02, live.send, {stream.key: [Chunk(1, "", [], "length")]})
    assert (await stream.__anext__()).text == "d"
    assert loop.time() - mark < 0.08  # the final cut the window short
    assert [c.finish_reason for c in stream.ready()] == ["length"]
    # An unpaced stream (a whole answer, not streamed) never waits.
    live.send({loose.key: [Chunk(2, "x", [1])]})
    assert (await loose.__anext__()).text == "x"
    live.send({loose.key: [Chunk(2, "y", [2])]})
    mark = loop.time()
    assert (await loose.__anext__()).text == "y"
    assert loop.time() - mark < 0.05
    fd.release(loose)


async def test_the_window_is_the_budget_shared_by_the_streams_sending() -> None:
    fd, handle = feeds(messages_per_s=40.0, interval_s=10.0)
    streams = [sent(fd)[0] for _ in range(4)]
    live = handle.feeds["r1"][0]
    live.send({s.key: [Chunk(1, "a", [5])] for s in streams})
    for s in streams:
        await s.__anext__()
    assert fd.sending == 4  # 4 / 40 = 0.1 s each
    loop = asyncio.get_running_loop()
    live.send({streams[0].key: [Chunk(1, "b", [6])]})
    mark = loop.time()
    await streams[0].__anext__()
    assert 0.07 < loop.time() - mark < 0.2


async def test_an_outbox_reads_the_streams_it_follows_once_a_step_and_lets_each_go_at_its_end() -> None:
    from scheduler.request import Request
    from scheduler.streaming.chunks import chunk_channel
    from scheduler.streaming.stream import RequestStream

    senders = []
    cancelled: list[int] = []

    def stream_of(rid: int) -> RequestStream:
        send, recv = chunk_channel()
        senders.append(send)

        async def submit(request: Request) -> tuple[int, Any]:
            return rid, recv

        return RequestStream(submit, cancelled.append, Request(prompt=[1, 2]))

    box = Outbox()
    a, b = stream_of(1), stream_of(2)
    senders[0].send_nowait(Chunk(1, "a0", [1]))
    senders[1].send_nowait(Chunk(2, "b0", [1]))
    assert (await a.__anext__()).text == "a0" and (await b.__anext__()).text == "b0"
    followers = [asyncio.ensure_future(box.follow(7, a)), asyncio.ensure_future(box.follow(8, b))]
    await settle()
    data, requests = await box.take()
    assert requests == 0 and unpack_feed(data).chunks == {}  # followed, nothing new yet
    for step in range(1, 3):  # each step: one chunk per stream, one item for both
        senders[0].send_nowait(Chunk(1, f"a{step}", [step]))
        senders[1].send_nowait(Chunk(2, f"b{step}", [step]))
        item = unpack_feed((await asyncio.wait_for(box.take(), 1))[0])
        assert {k: [c.text for c in v] for k, v in item.chunks.items()} == {7: [f"a{step}"], 8: [f"b{step}"]}
    senders[0].send_nowait(Chunk(1, "", [], "length"))
    senders[1].close()  # the scheduler closing: no final chunk
    item = unpack_feed((await asyncio.wait_for(box.take(), 1))[0])
    assert [c.finish_reason for c in item.chunks[7]] == ["length"] and 8 not in item.chunks
    await asyncio.wait_for(asyncio.gather(*followers), 1)  # both let go: ended, and all taken
    assert a.ended and b.ended and cancelled == []
    assert a.complete and not b.complete  # ran to its end; cut short (what the scheduler process reports)
    with pytest.raises(StopAsyncIteration):
        await a.__anext__()
    with pytest.raises(SchedulerClosed):  # what the replica then refuses the request with
        await b.__anext__()


async def test_after_one_choice_ends_the_others_are_still_paced() -> None:
    fd, handle = feeds(messages_per_s=10.0)  # a window of 0.1 s
    stream, _ = sent(fd, choices=2)
    live = handle.feeds["r1"][0]
    loop = asyncio.get_running_loop()
    live.send({stream.key: [Chunk(1, "a", [5], index=0), Chunk(2, "x", [6], index=1)]})
    assert [(await stream.__anext__()).text, *(c.text for c in stream.ready())] == ["a", "x"]
    mark = loop.time()
    live.send({stream.key: [Chunk(1, "", [], "length", index=0)]})
    assert (await stream.__anext__()).finish_reason == "length"
    assert loop.time() - mark < 0.05  # a final goes at once
    live.send({stream.key: [Chunk(2, "y", [7], index=1)]})
    mark = loop.time()
    assert (await stream.__anext__()).text == "y"
    assert 0.07 < loop.time() - mark < 0.2  # the other choice's chunks wait for their window again

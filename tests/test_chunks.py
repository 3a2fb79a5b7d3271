"""One request's chunk channel: what wakes a caller that waits for a chunk or for the final one, on
asyncio (a bare future of the loop) and trio (an anyio Event) alike."""

from __future__ import annotations

import asyncio

import anyio
import pytest

from scheduler.streaming.chunks import chunk_channel
from scheduler.types import Chunk

pytestmark = pytest.mark.anyio


async def test_only_a_final_chunk_or_the_end_wakes_a_wait_for_the_final() -> None:
    send, recv = chunk_channel()
    woke: list[float] = []

    async def wait() -> None:
        await recv.wait_final()
        woke.append(anyio.current_time())

    async with anyio.create_task_group() as tg:
        tg.start_soon(wait)
        await anyio.wait_all_tasks_blocked()
        for n in range(3):
            send.send_nowait(Chunk(1, "x", [n]))
            await anyio.wait_all_tasks_blocked()
        assert woke == []  # chunks that are not final leave it waiting
        send.send_nowait(Chunk(1, "", [], "length"))
    assert len(woke) == 1
    # Nothing was taken: every chunk is still there, in order, and taking the final counts it off.
    taken = [recv.receive_nowait() for _ in range(4)]
    assert [c.token_ids for c in taken[:3]] == [[0], [1], [2]] and taken[3].finish_reason == "length"

    with anyio.fail_after(1):
        send.send_nowait(Chunk(2, "", [], "stop"))
        await recv.wait_final()  # a final already there: no wait
        recv.receive_nowait()
        ended = chunk_channel()
        ended[0].close()
        await ended[1].wait_final()  # the sender closed without a final: it ends the wait too
    with anyio.move_on_after(0.05) as scope:
        await recv.wait_final()  # the final was taken: it waits again
    assert scope.cancelled_caught


async def test_a_wait_is_woken_by_a_chunk_survives_a_cancelled_one_and_ends_at_the_close(anyio_backend: str) -> None:
    send, recv = chunk_channel()
    got: list[Chunk] = []

    async def take() -> None:
        got.append(await recv.receive())

    async with anyio.create_task_group() as tg:
        tg.start_soon(take)
        await anyio.wait_all_tasks_blocked()
        assert got == []  # nothing sent yet: it waits
        # asyncio: a future of the running loop; trio: an anyio Event
        assert isinstance(recv._s.waiter, asyncio.Future) == (anyio_backend == "asyncio")
        send.send_nowait(Chunk(1, "a", [5]))
    assert [c.token_ids for c in got] == [[5]]

    with anyio.move_on_after(0.05) as scope:
        await recv.receive()  # cancelled while it waits
    assert scope.cancelled_caught
    send.send_nowait(Chunk(1, "b", [6]))  # waking the cancelled wait is harmless
    with anyio.fail_after(1):
        assert (await recv.receive()).token_ids == [6]

    async def until_end() -> None:
        with pytest.raises(anyio.EndOfStream):
            await recv.receive()
        got.append(Chunk(1, "end", []))

    async with anyio.create_task_group() as tg:
        tg.start_soon(until_end)
        await anyio.wait_all_tasks_blocked()
        send.close()
    assert got[-1].text == "end"

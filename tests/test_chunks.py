"""One request's chunk channel: what wakes a caller that waits for the final chunk."""

from __future__ import annotations

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

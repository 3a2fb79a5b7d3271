"""Messages the admission actor receives from callers. Worker events arrive in the same inbox."""

from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple

import msgspec

from workers.messages import Abort, Admit, Evict

if TYPE_CHECKING:
    from anyio.streams.memory import MemoryObjectSendStream

    from scheduler.errors import SchedulerError
    from scheduler.request import Request
    from scheduler.streaming.chunks import ChunkOut


class Submit(msgspec.Struct, frozen=True, tag=True):
    """Queue `request`, whose prompt is `tokens` (checked against the model already)."""

    request: Request
    tokens: list[int]
    submitted_at: float
    stream: bool = True
    """False: only the final chunk is delivered, carrying the whole text and every token (all
    that `complete` needs: no wake-up of its caller per step)."""
    index: int = 0
    """Which of its request's choices this is (`SamplingParams.n`); its chunks say so."""


class Cancel(msgspec.Struct, frozen=True, tag=True):
    """The caller left: end the request (queued or running) as cancelled."""

    rid: int


class Close(msgspec.Struct, frozen=True, tag=True):
    """Stop admitting and end queued requests as cancelled. Running ones are cancelled too, or,
    when `drain_s` > 0, may finish within that many seconds. Then the actor returns."""

    drain_s: float = 0.0


WorkerCmd = Abort | Admit | Evict


class SubmitEnvelope(NamedTuple):
    msg: Submit
    reply: MemoryObjectSendStream[int | SchedulerError]
    """The request id, or the error to raise in the caller."""
    out: ChunkOut
    """The request's chunks; sized so that sending never blocks."""


class DropSession(NamedTuple):
    """Free a session's cached KV; the reply says whether there was one."""

    session: str
    reply: MemoryObjectSendStream[bool]

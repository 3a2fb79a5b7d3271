"""Frames between a replica's Ray actor and its scheduler process (`[cluster] scheduler_process`):
msgpack, each behind its length, over a local socket."""

from __future__ import annotations

import struct
from collections import deque
from typing import TYPE_CHECKING, Any

import msgspec

# msgspec resolves the frames' annotations at run time: these imports stay outside TYPE_CHECKING.
from scheduler.config import SchedulerConfig  # noqa: TC001
from scheduler.request import Request  # noqa: TC001
from scheduler.types import Chunk, SchedulerStats  # noqa: TC001
from workers.loading.models import ModelInfo  # noqa: TC001

if TYPE_CHECKING:
    from anyio.abc import ByteStream

MAX_FRAME = 1 << 30
"""A prompt of a million tokens is under 10 MB: a bigger length means a broken stream."""


# ---- the actor -> its scheduler process -------------------------------------------------------
class Hello(msgspec.Struct, tag=True, array_like=True):
    config: SchedulerConfig


class Submit(msgspec.Struct, tag=True, array_like=True):
    cid: int
    """The actor's id of the request; every frame about it names it."""
    request: Request


class Cancel(msgspec.Struct, tag=True, array_like=True):
    cid: int


class Query(msgspec.Struct, tag=True, array_like=True):
    what: str
    """"stats" or "metrics"."""


class Close(msgspec.Struct, tag=True, array_like=True):
    pass


# ---- the scheduler process -> the actor -------------------------------------------------------
class Ready(msgspec.Struct, tag=True, array_like=True):
    info: ModelInfo
    stats: SchedulerStats


class Failed(msgspec.Struct, tag=True, array_like=True):
    error: str
    """Why the scheduler could not start (its exception, as the log would name it)."""


class Step(msgspec.Struct, tag=True, array_like=True):
    """What the requests produced since the last frame, by the actor's id; the requests that
    ended (every choice's final chunk is in this frame or an earlier one); and the requests
    refused or cut short by the scheduler, as (error class name, message)."""

    chunks: dict[int, list[Chunk]]
    ended: list[int]
    errors: dict[int, tuple[str, str]]


class Stats(msgspec.Struct, tag=True, array_like=True):
    stats: SchedulerStats


class Metrics(msgspec.Struct, tag=True, array_like=True):
    text: str


ToChild = Hello | Submit | Cancel | Query | Close
FromChild = Ready | Failed | Step | Stats | Metrics

_HEADER = struct.Struct("<I")


def add_chunks(held: dict[int, list[Chunk]], key: int, chunks: list[Chunk]) -> None:
    """Append `chunks` to what `held` keeps for `key` until the next frame or item takes it."""
    kept = held.get(key)
    if kept is None:
        held[key] = chunks
    else:
        kept += chunks


class Framed:
    """Frames of one type union over a byte stream: `send_many` writes some, `receive` reads one."""

    def __init__(self, stream: ByteStream, incoming: Any) -> None:
        self.stream = stream
        self._enc = msgspec.msgpack.Encoder()
        self._dec: msgspec.msgpack.Decoder[Any] = msgspec.msgpack.Decoder(incoming)
        self._buf = bytearray()
        self._frames: deque[object] = deque()

    async def send(self, msg: msgspec.Struct) -> None:
        await self.send_many([msg])

    async def send_many(self, msgs: list[msgspec.Struct]) -> None:
        """The frames in one write."""
        out = bytearray()
        for msg in msgs:
            body = self._enc.encode(msg)
            out += _HEADER.pack(len(body))
            out += body
        if out:
            await self.stream.send(bytes(out))

    async def receive(self) -> object:
        """The next frame; `anyio.EndOfStream` when the other side closed between frames."""
        while not self._frames:
            self._buf += await self.stream.receive(1 << 16)
            self._split()
        return self._frames.popleft()

    def _split(self) -> None:
        buf, view, at = self._buf, memoryview(self._buf), 0
        while len(buf) - at >= _HEADER.size:
            (n,) = _HEADER.unpack_from(buf, at)
            if n > MAX_FRAME:
                raise ValueError(f"frame of {n} bytes: the stream is corrupt")
            if len(buf) - at - _HEADER.size < n:
                break
            start = at + _HEADER.size
            self._frames.append(self._dec.decode(view[start:start + n]))
            at = start + n
        view.release()
        del buf[:at]

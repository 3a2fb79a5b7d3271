"""Frames between the HTTP process and the engine process: msgpack, each behind its length."""

from __future__ import annotations

import struct
from collections import deque
from typing import TYPE_CHECKING, Any

import msgspec

# msgspec resolves the frames' annotations at run time: these imports stay outside TYPE_CHECKING.
from scheduler.config import SchedulerConfig  # noqa: TC001
from scheduler.params import SamplingParams  # noqa: TC001
from scheduler.types import Chunk, SchedulerStats  # noqa: TC001
from workers.models import ModelInfo  # noqa: TC001

if TYPE_CHECKING:
    from anyio.abc import ByteStream

MAX_FRAME = 1 << 30
"""A prompt of a million tokens is under 10 MB: a bigger length means a broken stream."""


# ---- HTTP process -> engine ------------------------------------------------------------------
class Hello(msgspec.Struct, tag=True, array_like=True):
    config: SchedulerConfig


class Submit(msgspec.Struct, tag=True, array_like=True):
    cid: int
    """The HTTP side's id of the request; every reply about it names it."""
    prompt: list[int]
    params: SamplingParams
    priority: int
    tenant: str
    timeout: float | None
    session: str | None


class Cancel(msgspec.Struct, tag=True, array_like=True):
    cid: int


class Query(msgspec.Struct, tag=True, array_like=True):
    what: str
    """"stats" or "metrics"."""


class Close(msgspec.Struct, tag=True, array_like=True):
    pass


# ---- engine -> HTTP process ------------------------------------------------------------------
class Ready(msgspec.Struct, tag=True, array_like=True):
    info: ModelInfo
    """`info.path` is the directory the engine loaded: the HTTP process loads its tokenizer there."""


class Failed(msgspec.Struct, tag=True, array_like=True):
    error: str
    """Why the engine could not start (its exception, as the log would name it)."""


class Rejected(msgspec.Struct, tag=True, array_like=True):
    cid: int
    kind: str
    """The `SchedulerError` subclass's name."""
    message: str


class Chunks(msgspec.Struct, tag=True, array_like=True):
    """What the requests produced since the last frame, in order, as (cid, chunk) pairs."""

    items: list[tuple[int, Chunk]]


class Stats(msgspec.Struct, tag=True, array_like=True):
    stats: SchedulerStats


class Metrics(msgspec.Struct, tag=True, array_like=True):
    text: str


ToEngine = Hello | Submit | Cancel | Query | Close
FromEngine = Ready | Failed | Rejected | Chunks | Stats | Metrics

_HEADER = struct.Struct("<I")


class Framed:
    """Frames of one type union over a byte stream: `send` writes one, `receive` reads one."""

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

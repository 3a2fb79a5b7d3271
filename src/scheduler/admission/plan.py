"""`Plan`: what the admission core hands its actor after each `take`."""

from __future__ import annotations

from typing import TYPE_CHECKING

import msgspec

if TYPE_CHECKING:
    from anyio.streams.memory import MemoryObjectSendStream

    from kvpool.messages import PoolBatch
    from scheduler.admission.live import Live
    from scheduler.admission.messages import WorkerCmd
    from scheduler.types import Chunk


class Plan(msgspec.Struct):
    """What the admission actor must do after the core's `take`: in this order, worker
    commands, deliveries, the pool batch."""

    worker: list[WorkerCmd]
    pool: PoolBatch | None
    deliver: list[tuple[Live, Chunk]]
    """Chunks in order; a chunk with a finish_reason is its stream's last (close it after)."""
    replies: list[tuple[MemoryObjectSendStream[bool], bool]]

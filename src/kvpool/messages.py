"""Messages the pool actor receives and emits.

The admission actor sends at most one `PoolBatch` at a time (one per engine step, or one when
idle) and the pool answers it with one `PoolReplies`, a reply per command in order.

Reserve and Resize may carry `padding`: the blocks the dense batch cache spends on padding after
they take effect; the pool sets the `PADDING` holder to it in the same step, so a grant covers
both. Release's `padding` only ever shrinks it.
"""

from __future__ import annotations

import msgspec

from kvpool.books import Key  # noqa: TC001 (msgspec resolves it at run time)


class Reserve(msgspec.Struct, frozen=True, tag=True):
    """Blocks for request `rid` to enter the batch; answered with Granted or Denied.

    `prefix`: the chained hashes of its full prompt blocks; the cached leading ones are pinned
    for `rid` and the rest marked as being computed by it. `session`: a session cache to take
    over (its blocks are freed: the request's own blocks cover that KV once it runs)."""

    rid: int
    blocks: int
    prefix: list[int] = []
    session: str | None = None
    padding: int | None = None
    keep_free: int = 0
    """Grant only if this many blocks stay free (or evictable) afterwards: room to grow."""


class Resize(msgspec.Struct, frozen=True, tag=True):
    """Make `rid` hold exactly `blocks` blocks (a sequence grew, or the padding changed)."""

    rid: int
    blocks: int
    padding: int | None = None


class Release(msgspec.Struct, frozen=True, tag=True):
    """Return every block of `rid` and its pins; answered with Released."""

    rid: int
    padding: int | None = None


class Unpin(msgspec.Struct, frozen=True, tag=True):
    """`rid` no longer needs its cached prefix blocks kept (its prompt is in the batch)."""

    rid: int


class Cache(msgspec.Struct, frozen=True, tag=True):
    """The worker stored KV under `key` (`tokens` tokens in `blocks` blocks); answered with
    Cached. Not `ok`: no room even after evictions, so the worker must drop it."""

    key: Key
    blocks: int
    tokens: int


class Drop(msgspec.Struct, frozen=True, tag=True):
    """Forget the cache entry `key`; answered with Cached (`ok`: it existed and was dropped)."""

    key: Key


class Granted(msgspec.Struct, frozen=True, tag=True):
    rid: int
    blocks: int
    """Blocks `rid` holds now."""
    prefix_hits: int = 0
    """Leading prefix blocks found cached (and pinned)."""
    session_tokens: int = 0
    """Tokens of the session cache taken over (0: none)."""
    evicted: list[Key] = []
    """Cache entries evicted to make room: the worker must drop their KV."""


class Denied(msgspec.Struct, frozen=True, tag=True):
    rid: int
    free: int
    pending: bool = False
    """The next prefix block is being computed by another request: wait for it, then hit."""


class Released(msgspec.Struct, frozen=True, tag=True):
    rid: int
    blocks: int


class Cached(msgspec.Struct, frozen=True, tag=True):
    key: Key
    ok: bool
    evicted: list[Key] = []


PoolCommand = Reserve | Resize | Release | Unpin | Cache | Drop
PoolReply = Granted | Denied | Released | Cached


class PoolBatch(msgspec.Struct, frozen=True, tag=True):
    """Commands applied in order. Reserves are head-of-line: once one is denied, every later
    Reserve of the batch is denied too, so admission keeps the policy's order."""

    commands: list[PoolCommand]


class PoolReplies(msgspec.Struct, frozen=True, tag=True):
    """`replies[i]` answers `commands[i]`; `free` and `evictable` are the books afterwards."""

    replies: list[PoolReply]
    free: int
    evictable: int

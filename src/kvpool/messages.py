"""Messages the pool actor receives and emits."""

from __future__ import annotations

import msgspec


class Reserve(msgspec.Struct, frozen=True, tag=True):
    """Ask for `blocks` blocks for request `rid`; answered with Granted or Denied."""

    rid: int
    blocks: int


class Release(msgspec.Struct, frozen=True, tag=True):
    """Return every block of `rid`; answered with Released."""

    rid: int


class Granted(msgspec.Struct, frozen=True, tag=True):
    rid: int
    blocks: list[int]


class Denied(msgspec.Struct, frozen=True, tag=True):
    rid: int
    free: int


class Released(msgspec.Struct, frozen=True, tag=True):
    rid: int
    blocks: int


PoolCommand = Reserve | Release
PoolReply = Granted | Denied | Released

"""A GGUF file's header, read and checked in Python before any tensor is touched.

MLX's own GGUF reader trusts the file: on a corrupt header it can crash the process, so every
field, every tensor's type and every tensor's extent is checked here first.
"""

from __future__ import annotations

import math
import mmap
import struct
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

from workers.loading.cachedir import ModelSourceError

if TYPE_CHECKING:
    from pathlib import Path

MAGIC = b"GGUF"
DEFAULT_ALIGNMENT = 32
MAX_DIMS = 4

# GGUF value types: struct format, or None for strings (8) and arrays (9).
_SCALARS: dict[int, str] = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?",
                            10: "<Q", 11: "<q", 12: "<d"}
_NUMPY: dict[int, str] = {0: "<u1", 1: "<i1", 2: "<u2", 3: "<i2", 4: "<u4", 5: "<i4", 6: "<f4", 7: "<u1",
                          10: "<u8", 11: "<i8", 12: "<f8"}
_STRING, _ARRAY = 8, 9


@dataclass(frozen=True)
class TensorInfo:
    """Where one tensor's bytes are, and what they hold. `shape` is numpy's order (rows first)."""

    name: str
    kind: GGMLQuantizationType
    shape: tuple[int, ...]
    offset: int
    """From the start of the file."""
    nbytes: int


@dataclass(frozen=True)
class Header:
    version: int
    metadata: dict[str, Any]
    """Scalars as Python values, lists as Python lists (numeric ones as lists of numbers)."""
    tensors: dict[str, TensorInfo]


class _Cursor:
    def __init__(self, buf: mmap.mmap, path: Path) -> None:
        self.buf, self.pos, self.path = buf, 0, path

    def fail(self, what: str) -> ModelSourceError:
        return ModelSourceError(f"{str(self.path)!r} is not a valid GGUF file: {what} (at byte {self.pos})")

    def take(self, n: int) -> bytes:
        if n < 0 or self.pos + n > len(self.buf):
            raise self.fail("it ends early; an incomplete download or a truncated file?")
        out = self.buf[self.pos : self.pos + n]
        self.pos += n
        return out

    def scalar(self, fmt: str) -> Any:
        return struct.unpack(fmt, self.take(struct.calcsize(fmt)))[0]

    def string(self) -> str:
        raw = self.take(self.scalar("<Q"))
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            raise self.fail("a string that is not UTF-8") from None

    def value(self, kind: int) -> Any:
        if kind in _SCALARS:
            return self.scalar(_SCALARS[kind])
        if kind == _STRING:
            return self.string()
        if kind == _ARRAY:
            inner, count = self.scalar("<I"), self.scalar("<Q")
            if inner in _NUMPY:
                dtype = np.dtype(_NUMPY[inner])
                data = np.frombuffer(self.take(count * dtype.itemsize), dtype=dtype)
                return (data.astype(bool) if inner == 7 else data).tolist()
            if inner == _STRING:
                return [self.string() for _ in range(count)]
            raise self.fail(f"an array of value type {inner}")
        raise self.fail(f"unknown value type {kind}")


def read_header(path: Path) -> Header:
    """Parse and check ``path``'s header: a `ModelSourceError` names whatever is wrong."""
    try:
        f = open(path, "rb")  # noqa: SIM115 - closed below, after the map
    except OSError as e:
        raise ModelSourceError(f"cannot read GGUF file {str(path)!r}: {e}") from e
    with f:
        size = path.stat().st_size
        if size < 24:
            raise ModelSourceError(f"{str(path)!r} is not a valid GGUF file: only {size} bytes")
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
            return _parse(_Cursor(buf, path), size)


def _parse(cur: _Cursor, size: int) -> Header:
    if cur.take(4) != MAGIC:
        raise cur.fail("it does not start with 'GGUF'")
    version = cur.scalar("<I")
    if version not in (2, 3):
        hint = " (a big-endian file?)" if version > 0xFFFF else ""
        raise cur.fail(f"version {version}{hint}; this loader reads versions 2 and 3")
    n_tensors, n_kv = cur.scalar("<Q"), cur.scalar("<Q")
    if n_tensors > size or n_kv > size:
        raise cur.fail(f"{n_tensors} tensors and {n_kv} metadata entries in a {size}-byte file")
    metadata: dict[str, Any] = {}
    for _ in range(n_kv):
        key = cur.string()
        metadata[key] = cur.value(cur.scalar("<I"))
    raw: list[tuple[str, GGMLQuantizationType, tuple[int, ...], int]] = []
    for _ in range(n_tensors):
        name = cur.string()
        n_dims = cur.scalar("<I")
        if not 1 <= n_dims <= MAX_DIMS:
            raise cur.fail(f"tensor {name!r} has {n_dims} dimensions")
        dims = tuple(cur.scalar("<Q") for _ in range(n_dims))
        if 0 in dims:
            raise cur.fail(f"tensor {name!r} has an empty dimension: {list(dims)}")
        code = cur.scalar("<I")
        try:
            kind = GGMLQuantizationType(code)
        except ValueError:
            raise cur.fail(f"tensor {name!r} has unknown tensor type {code}") from None
        raw.append((name, kind, dims[::-1], cur.scalar("<Q")))
    alignment = metadata.get("general.alignment", DEFAULT_ALIGNMENT)
    if not isinstance(alignment, int) or alignment <= 0:
        raise cur.fail(f"general.alignment is {alignment!r}")
    data_start = -(-cur.pos // alignment) * alignment
    tensors: dict[str, TensorInfo] = {}
    for name, kind, shape, offset in raw:
        block, type_size = GGML_QUANT_SIZES[kind]
        count = math.prod(shape)  # Python ints: numpy's int64 would overflow on corrupt dims
        if shape[-1] % block:
            raise cur.fail(f"tensor {name!r} rows of {shape[-1]} do not fill {kind.name} blocks of {block}")
        nbytes = count // block * type_size
        start = data_start + offset
        if start + nbytes > size:
            raise ModelSourceError(
                f"{str(cur.path)!r} is truncated: tensor {name!r} ends at byte {start + nbytes} of a "
                f"{size}-byte file; an incomplete download?"
            )
        tensors[name] = TensorInfo(name, kind, shape, start, nbytes)
    return Header(version, metadata, tensors)

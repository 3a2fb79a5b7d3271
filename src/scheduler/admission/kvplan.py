"""How many KV blocks the pool holds and a request needs, and the keys of its prompt blocks
(pure; no actors).

The admission actor asks this module what to reserve; the pool keeps the books.
"""

from __future__ import annotations

import hashlib
import math
import os
from array import array
from typing import TYPE_CHECKING, Literal

from kvpool.books import blocks_for
from kvpool.dense import LayerBytes, padding_of
from kvpool.pool import pool_blocks
from scheduler.config import memory_spec
from scheduler.errors import ConfigError

if TYPE_CHECKING:
    from scheduler.config import KVPoolSection
    from workers.loading.models import ModelInfo

Mode = Literal["reserve", "on-demand"]


def pool_size(section: KVPoolSection, info: ModelInfo, device_memory: int | None) -> int:
    """Blocks in the pool: `[kvpool] memory` (bytes, or a fraction of the device's memory, else
    of the machine's) less the weights. `ConfigError` naming `kvpool.memory`, and how much memory
    the model needs, if not one block fits."""
    size, fraction = memory_spec(section.memory)
    source = ""
    if size is None:
        assert fraction is not None
        total = device_memory or _system_memory()
        size = int(total * fraction)
        where = "the device's memory" if device_memory else "the machine's RAM"
        source = f" ({fraction:g} of {where}, {_human(total)})"
    block = section.block_tokens * info.kv_bytes_per_token
    blocks = pool_blocks(size - info.weights_bytes, section.block_tokens, info.kv_bytes_per_token)
    if blocks < 1:
        need = info.weights_bytes + block
        hint = f"kvpool.memory = {need}" if fraction is None else (
            f"kvpool.memory = {math.ceil(need / total * 100) / 100:g}" if need <= total
            else "a device with more memory, or a smaller (quantized) model")
        raise ConfigError(
            f"kvpool.memory: {size} bytes{source} less the model's weights ({info.weights_bytes} "
            f"bytes) holds no block of {section.block_tokens} tokens at {info.kv_bytes_per_token} "
            f"bytes per token; the model needs at least {need} bytes ({_human(need)}: its weights "
            f"and one block); use {hint}"
        )
    return blocks


def _human(n: int) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


def layer_bytes(info: ModelInfo) -> LayerBytes:
    """`info`'s layers as the books charge them: full attention per token, sliding layers per
    token up to their window, recurrent state per row."""
    size = _DTYPE_BYTES.get(info.dtype, 4)
    full = 0
    sliding: dict[int, int] = {}
    row = 0
    for layer in info.layers:
        per_token = layer.kv_heads * layer.head_dim * 2 * size
        if layer.kind == "full":
            full += per_token
        elif layer.kind == "sliding":
            sliding[layer.window] = sliding.get(layer.window, 0) + per_token
        else:
            row += layer.state_bytes
    if not info.layers:  # a model described without its caches: every layer full attention
        full = info.kv_bytes_per_token
    return LayerBytes(info.kv_bytes_per_token, full, tuple(sorted(sliding.items())), row)


_DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2, "float64": 8}


def _system_memory() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 8 * 2**30


def prompt_keys(prompt: list[int], block_tokens: int) -> list[int]:
    """Chained keys of the prompt's full blocks: each hashes its parent's key and its tokens, so
    equal keys mean equal prompts up to the end of that block. The last prompt token is never in
    a block: a hit must leave at least one token to prefill."""
    keys: list[int] = []
    parent = b""
    for i in range((len(prompt) - 1) // block_tokens):
        block = array("q", prompt[i * block_tokens : (i + 1) * block_tokens]).tobytes()
        parent = hashlib.blake2b(parent + block, digest_size=16).digest()
        keys.append(int.from_bytes(parent[:8], "little", signed=True))
    return keys


class KVPlan:
    """The rules of one pool: block size, mode and the dense batch cache's rounding."""

    def __init__(
        self,
        *,
        mode: Mode,
        block_tokens: int,
        blocks_total: int,
        watermark: float,
        dense_step: int,
        layers: LayerBytes | None = None,
    ) -> None:
        self.mode = mode
        self.layers = layers
        """The model's layers by kind (`layer_bytes`); None books every layer as full attention."""
        self.block_tokens = block_tokens
        self.blocks_total = blocks_total
        self.dense_step = dense_step
        self.keep_free = int(watermark * blocks_total) if mode == "on-demand" else 0

    def blocks(self, tokens: int) -> int:
        return blocks_for(tokens, self.block_tokens)

    def at_admission(self, prompt_tokens: int, max_tokens: int) -> int:
        """Blocks to hold on entering the batch: everything it may need (reserve), or its prompt
        and one block to grow into (on-demand)."""
        final = self.blocks(prompt_tokens + max_tokens)
        if self.mode == "reserve":
            return final
        return min(final, self.blocks(prompt_tokens) + 1)

    def row(self, length: int, final: int) -> int:
        """The length the dense cache must plan for a row: its final length in reserve mode (the
        books then hold for the worst case), its current one on demand."""
        return final if self.mode == "reserve" else length

    def padding(self, rows: int, longest: int, held: int) -> int:
        """Padding blocks of a dense cache of `rows` rows planned up to `longest` tokens."""
        return padding_of(rows, longest, held, self.block_tokens, self.dense_step, self.layers)

    def alone(self, tokens: int) -> int:
        """Blocks a lone row of `tokens` tokens costs (what must fit in the pool at all)."""
        return max(self.blocks(tokens), self.padding(1, tokens, 0))

    def too_big(self, prompt: int, max_tokens: int) -> str | None:
        """Why a request of this size can never run in this pool, or None when it can."""
        need = self.alone(prompt + max_tokens)
        if need <= self.blocks_total:
            return None
        return (f"prompt ({prompt} tokens) + max_tokens ({max_tokens}) needs {need} KV blocks of "
                f"{self.block_tokens} tokens, but the pool has only {self.blocks_total}; lower "
                "max_tokens or raise [kvpool] memory")


class Longest:
    """The rows' planned lengths as counts, so that the longest is known without walking every
    row: the books ask on every admission and release, and a batch may hold hundreds of rows."""

    def __init__(self) -> None:
        self._count: dict[int, int] = {}
        self._longest = 0
        self.rows = 0

    def add(self, length: int) -> None:
        self._count[length] = self._count.get(length, 0) + 1
        self._longest = max(self._longest, length)
        self.rows += 1

    def remove(self, length: int) -> None:
        left = self._count[length] - 1
        self.rows -= 1
        if left:
            self._count[length] = left
            return
        del self._count[length]
        if length == self._longest:  # walks the distinct lengths, not the rows
            self._longest = max(self._count, default=0)

    @property
    def longest(self) -> int:
        return self._longest

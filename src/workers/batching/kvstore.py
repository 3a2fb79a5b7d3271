"""Stored KV on the worker thread: prefix blocks and finished sessions, as MLX arrays.

The pool keeps the books (which keys exist, how many blocks they cost, when to evict); this
store keeps the arrays under the same keys and does what the worker is told.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import mlx.core as mx
import structlog
from mlx_lm.models.cache import KVCache

from workers.batching.cachekinds import cache_arrays, trimmable

if TYPE_CHECKING:
    from collections.abc import Sequence

    from workers.messages import Admit, Key

    Start = tuple[Admit, list[int], Any, list[int]]
    """Where a request starts: its admit, the prompt left to prefill, a starting cache (one a
    layer) or None, and the tokens that cache holds."""

log = structlog.get_logger("workers")
LayerKV = tuple[mx.array, mx.array]


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


class _Segment:
    """The blocks one `store_blocks` call copied out, side by side on axis 2 of one array per
    layer and kind: a copy per layer, not per block and layer (each is a kernel launch and a
    graph node; at 16-token blocks and 24 layers, a 128-token prompt took 384 of them)."""

    __slots__ = ("keys", "layers", "live")

    def __init__(self, keys: list[int], layers: list[LayerKV]) -> None:
        self.keys = keys
        """Block `i` of the segment is stored under `keys[i]`."""
        self.layers = layers
        self.live = set(range(len(keys)))


def _positions(blocks: Sequence[int], bt: int) -> mx.array:
    """Indices on axis 2 of blocks `blocks` (in order) of `bt` tokens each."""
    if blocks[-1] - blocks[0] == len(blocks) - 1:  # a run: the usual case
        return mx.arange(blocks[0] * bt, (blocks[-1] + 1) * bt)
    return mx.array([b * bt + t for b in blocks for t in range(bt)])


def _gather(layers: Sequence[LayerKV], pos: mx.array) -> list[LayerKV]:
    return [(mx.take(k, pos, axis=2), mx.take(v, pos, axis=2)) for k, v in layers]


class KVStore:
    """Prefix blocks of `block_tokens` tokens (per layer: keys, values `[1, heads, block, dim]`)
    and session caches (one per layer, of any class mlx-lm can batch, and the tokens they hold)."""

    def __init__(self, block_tokens: int) -> None:
        self.block_tokens = block_tokens
        self._blocks: dict[int, tuple[_Segment, int]] = {}
        self._sessions: dict[str, tuple[list[Any], list[int]]] = {}
        self._unsettled: list[mx.array] = []

    def __len__(self) -> int:
        return len(self._blocks) + len(self._sessions)

    def start(self, admit: Admit, *, prefix_blocks: bool) -> tuple[list[int], Any, list[int], bool]:
        """Where `admit` starts: (prompt left to prefill, starting cache or None, tokens that
        cache holds, whether a session turn had to prefill cold). A resumed session continues
        its kept KV where the new prompt shares it; else cached prefix blocks (`prefix_blocks`:
        the model's caches can take them) serve what they hold."""
        prompt = list(admit.prompt)
        cold = False
        if admit.resume and admit.session is not None:
            kept = self.take_session(admit.session)
            if kept is not None:
                cache, tokens = kept
                # Keep what the new prompt shares with the session; at least one token to feed.
                n = min(common_prefix(tokens, prompt), len(prompt) - 1)
                cut = len(tokens) - n
                if n > 0 and trimmable(cache, cut):
                    for c in cache if cut else ():  # recurrent caches have no trim() at all
                        c.trim(cut)
                    return prompt[n:], cache, prompt[:n], False
            # A rotated window or a recurrent state cannot forget tokens, the prompt shares none,
            # or the last turn's KV was not kept: this turn prefills cold.
            cold = True
        if admit.prefix and prefix_blocks:
            blocks, built = self.prefix_cache(admit.prefix)
            n = blocks * self.block_tokens
            if built is not None and n < len(prompt):
                return prompt[n:], built, prompt[:n], cold
        return prompt, None, [], cold

    def prefix_cache(self, keys: Sequence[int]) -> tuple[int, list[Any] | None]:
        """A fresh `KVCache` per layer holding the longest stored chain of `keys` (and how many
        blocks it holds); (0, None) when the first is not stored."""
        runs: list[tuple[_Segment, int, int]] = []  # consecutive blocks of a segment: one slice
        for key in keys:
            entry = self._blocks.get(key)
            if entry is None:
                break
            seg, i = entry
            if runs and runs[-1][0] is seg and runs[-1][2] == i:
                runs[-1] = (seg, runs[-1][1], i + 1)
            else:
                runs.append((seg, i, i + 1))
        if not runs:
            return 0, None
        bt = self.block_tokens
        blocks = sum(end - begin for _, begin, end in runs)
        caches = []
        for layer in range(len(runs[0][0].layers)):
            c = KVCache()  # type: ignore[no-untyped-call]
            # A slice is a view of the segment; the cache never writes into it (its next update
            # outgrows it and concatenates, and MLX does not donate a buffer a view shares).
            parts = [[seg.layers[layer][kind][:, :, a * bt : b * bt] for seg, a, b in runs]
                     for kind in (0, 1)]
            c.keys, c.values = (p[0] if len(p) == 1 else mx.concatenate(p, axis=2) for p in parts)
            c.offset = blocks * bt
            caches.append(c)
        return blocks, caches

    def store_prompt(
        self, keys: Sequence[int], first: int, caches: Sequence[Any], row: int | None = None
    ) -> list[tuple[Key, int]]:
        """`store_blocks` from a sequence's caches (one a layer): a finished one's own (`row`
        None), or row `row` of a batch's, whose left padding says where its token 0 is."""
        if row is None:
            return self.store_blocks(keys, first, [(c.keys, c.values) for c in caches], 0)
        kv = [(c.keys[row : row + 1], c.values[row : row + 1]) for c in caches]
        return self.store_blocks(keys, first, kv, caches[0].left_padding[row])

    def store_blocks(
        self, keys: Sequence[int], first: int, row: Sequence[LayerKV], start: int | mx.array
    ) -> list[tuple[Key, int]]:
        """Keep blocks `first, first + 1, ...` of a sequence whose KV per layer is `row`, its
        token 0 at index `start` of axis 2, under `keys`. Returns what was newly stored; the
        copies run at the next `settle()`. `start` may be a scalar array still being computed
        (a batch row's left padding): the copies gather at it, as reading it would wait for the
        GPU."""
        fresh = [(first + i, key) for i, key in enumerate(keys) if key not in self._blocks]
        if not fresh:
            return []
        pos = start + _positions([b for b, _ in fresh], self.block_tokens)
        # A gather copies: no block is a view of `row`'s buffer, which the batch goes on using.
        self._add(_Segment([key for _, key in fresh], _gather(row, pos)))
        return [(key, self.block_tokens) for _, key in fresh]

    def _add(self, seg: _Segment) -> None:
        for i, key in enumerate(seg.keys):
            self._blocks[key] = (seg, i)
        self._unsettled.extend(a for kv in seg.layers for a in kv)

    def settle(self) -> None:
        """Start the copies `store_blocks` asked for, all of a step's at once, without waiting:
        once they run, no block is a view of the batch's buffer. Waiting for each prompt's
        copies broke MLX's pipelined decode: on an H200, while 256 requests were admitted, the
        worker thread spent a quarter of its time in that wait."""
        if self._unsettled:
            mx.async_eval(self._unsettled)  # type: ignore[no-untyped-call]
            self._unsettled = []

    def nbytes(self) -> int:
        """Bytes the stored blocks hold (sessions aside)."""
        segments = {id(seg): seg for seg, _ in self._blocks.values()}.values()
        return sum(a.nbytes for seg in segments for kv in seg.layers for a in kv)

    def keep_session(self, name: str, cache: list[Any], tokens: list[int]) -> tuple[Key, int]:
        mx.eval(cache_arrays(cache))  # detach from the batch's buffer
        self._sessions[name] = (cache, list(tokens))
        return name, len(tokens)

    def keep_turn(self, name: str, cache: list[Any], tokens: list[int]) -> tuple[Key, int] | None:
        """`keep_session` for a finished turn; a failure drops the session (the next turn
        prefills cold) rather than failing the step, so the turn still ends normally."""
        try:
            return self.keep_session(name, cache, tokens)
        except Exception as exc:
            self.evict([name])
            log.warning("session_keep_failed", session=name, error=f"{type(exc).__name__}: {exc}")
            return None

    def take_session(self, name: str) -> tuple[list[Any], list[int]] | None:
        return self._sessions.pop(name, None)

    def evict(self, keys: Sequence[Key]) -> None:
        """Forget `keys`. A segment left with some blocks gone is copied down to the rest, so
        that what the pool's books free is freed: its memory goes once the copy has run."""
        cut: dict[int, _Segment] = {}
        for key in keys:
            if isinstance(key, str):
                self._sessions.pop(key, None)
            elif (entry := self._blocks.pop(key, None)) is not None:
                seg, i = entry
                seg.live.discard(i)
                cut[id(seg)] = seg
        for seg in cut.values():
            if seg.live:
                kept = sorted(seg.live)
                pos = _positions(kept, self.block_tokens)
                self._add(_Segment([seg.keys[i] for i in kept], _gather(seg.layers, pos)))
        self.settle()

    def clear(self) -> None:
        self._blocks.clear()
        self._sessions.clear()

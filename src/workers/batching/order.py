"""The order in which waiting prompts start prefilling: shortest first, with patience.

A prefill pass pads its prompts to the longest among them, so prompts of like length in one pass
pad less. Ordering every waiting prompt by length would let a stream of short prompts keep a long
one waiting forever; so one that has waited `patience` steps goes ahead of every later arrival,
in the order they came.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from workers.batching.mlxlm import set_waiting, waiting_rows

if TYPE_CHECKING:
    from collections.abc import Iterable

PATIENCE = 4
"""Steps a waiting prompt may be passed over by shorter ones admitted after it. At full speed a
pass starts every step, so a burst of prompts is regrouped by length within a few steps."""


class ShortestFirst:
    """One generator's waiting rows, reordered before each step that has any."""

    def __init__(self, patience: int = PATIENCE) -> None:
        self._patience = patience
        self._since: dict[int, int] = {}
        """Waiting prompts' generator uids, and the step each was inserted at."""
        self._step = 0

    def inserted(self, uids: Iterable[int]) -> None:
        for uid in uids:
            self._since[uid] = self._step

    def reorder(self, gen: Any) -> None:
        """Before a step plans its prefill: the waiting rows in the order to start them."""
        self._step += 1
        rows = waiting_rows(gen)
        since = self._since
        if len(since) > len(rows):  # forget the ones that started
            waiting = {row[0] for row in rows}
            self._since = since = {uid: at for uid, at in since.items() if uid in waiting}
        if len(rows) < 2:
            return
        now, patience = self._step, self._patience

        def key(row: Any) -> tuple[int, int]:
            at = since.get(row[0], now)
            if now - at >= patience:
                return (0, at)
            return (1, sum(len(segment) for segment in row[1]))

        set_waiting(gen, sorted(rows, key=key))

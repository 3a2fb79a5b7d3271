"""Turning token ids into text chunks: streaming detokenization and stop strings.

Plain state per request, owned and driven by the admission actor; no I/O here.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from collections.abc import Sequence


class Detokenizer(Protocol):
    """mlx-lm's streaming detokenizer interface."""

    def add_token(self, token: int) -> None: ...

    def finalize(self) -> None: ...

    @property
    def last_segment(self) -> str: ...


class Codec(Protocol):
    """Text in and out for one model."""

    def encode(self, text: str) -> list[int]: ...

    def detokenizer(self) -> Detokenizer: ...


class StopText:
    """Finds stop strings in streamed text. Text that could be the start of a stop string is held
    back until it is known not to be one, so a stop string never reaches the caller."""

    def __init__(self, stops: Sequence[str]) -> None:
        self._stops = tuple(stops)
        self._longest = max((len(s) for s in stops), default=0)
        self._held = ""
        self.matched: str | None = None
        """The stop string that ended the text (the earliest in it), once one has."""

    def feed(self, text: str) -> tuple[str, bool]:
        """(text safe to emit, whether a stop string completed)."""
        buf = self._held + text
        hits = [(i, s) for s in self._stops if (i := buf.find(s)) >= 0]
        if hits:
            self._held = ""
            at, self.matched = min(hits)
            return buf[:at], True
        keep = 0
        for k in range(min(len(buf), self._longest - 1), 0, -1):
            tail = buf[-k:]
            if any(s.startswith(tail) for s in self._stops):
                keep = k
                break
        self._held = buf[len(buf) - keep :]
        return buf[: len(buf) - keep], False

    def flush(self) -> str:
        held, self._held = self._held, ""
        return held


class TextStream:
    """One request's text: detokenizer plus optional stop strings."""

    def __init__(self, codec: Codec, stops: Sequence[str]) -> None:
        self._detok = codec.detokenizer()
        self._stop = StopText(stops) if stops else None

    def add(self, tokens: Sequence[int]) -> tuple[str, bool]:
        """Text for `tokens` and whether a stop string was hit (text then ends before it)."""
        for token in tokens:
            self._detok.add_token(token)
        text = self._detok.last_segment
        if self._stop is None:
            return text, False
        return self._stop.feed(text)

    @property
    def matched(self) -> str | None:
        """The stop string that ended the text, if one did."""
        return None if self._stop is None else self._stop.matched

    def finish(self) -> str:
        """Whatever text is still held back, at the natural end of the sequence."""
        self._detok.finalize()
        text = self._detok.last_segment
        if self._stop is None:
            return text
        emitted, hit = self._stop.feed(text)
        return emitted if hit else emitted + self._stop.flush()

"""Generated chat text split as it streams: content, reasoning (`<think>...</think>`) and tool
calls (between the model's tool-call markers), with markers cut across chunks held back until
it is clear what they are."""

from __future__ import annotations

from typing import Literal

Kind = Literal["content", "reasoning", "tool_call"]
Part = tuple[Kind, str]


class Markers:
    """The markers one model writes (None: it has no such section)."""

    def __init__(self, tool: tuple[str, str] | None = None, think: tuple[str, str] | None = None) -> None:
        self.tool = tool
        self.think = think


class Splitter:
    """Feed it text as it comes; it returns what is now known: pieces of content and reasoning,
    and each tool call's whole text (markers stripped) once its end marker arrives. `close()`
    flushes the rest: a tool call cut off by `max_tokens` comes out as it stands."""

    def __init__(self, markers: Markers, *, reasoning_first: bool = False) -> None:
        self._m = markers
        self._state: Kind = "reasoning" if reasoning_first and markers.think else "content"
        self._buf = ""

    @property
    def in_tool_call(self) -> bool:
        return self._state == "tool_call"

    def feed(self, text: str) -> list[Part]:
        self._buf += text
        out: list[Part] = []
        while self._buf:
            if not self._advance(out):
                break
        return [(k, t) for k, t in out if t]

    def close(self) -> list[Part]:
        rest, self._buf = self._buf, ""
        return [(self._state, rest)] if rest.strip() or (rest and self._state != "tool_call") else []

    def _advance(self, out: list[Part]) -> bool:
        """Consume what can be decided from the buffer; False when the rest must wait."""
        if self._state == "content":
            opens = [(m[0], kind) for m, kind in ((self._m.tool, "tool_call"), (self._m.think, "reasoning"))
                     if m is not None]
            found = [(self._buf.find(s), s, kind) for s, kind in opens if s in self._buf]
            if found:
                at, marker, kind = min(found)
                out.append(("content", self._buf[:at]))
                self._buf = self._buf[at + len(marker):]
                self._state = kind  # type: ignore[assignment]
                return True
            keep = max((_partial(self._buf, s) for s, _ in opens), default=0)
            out.append(("content", self._buf[:len(self._buf) - keep]))
            self._buf = self._buf[len(self._buf) - keep:]
            return False
        end = (self._m.tool if self._state == "tool_call" else self._m.think)[1]  # type: ignore[index]
        at = self._buf.find(end)
        if at >= 0:
            out.append((self._state, self._buf[:at]))
            self._buf = self._buf[at + len(end):]
            self._state = "content"
            return True
        if self._state == "reasoning":  # reasoning streams; a tool call is sent whole
            keep = _partial(self._buf, end)
            out.append(("reasoning", self._buf[:len(self._buf) - keep]))
            self._buf = self._buf[len(self._buf) - keep:]
        return False


def _partial(text: str, marker: str) -> int:
    """The length of the longest end of `text` that begins `marker` (a marker cut in two)."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


def split_all(text: str, markers: Markers, *, reasoning_first: bool = False) -> list[Part]:
    """The parts of a whole text, adjacent pieces of one kind joined."""
    s = Splitter(markers, reasoning_first=reasoning_first)
    parts = s.feed(text) + s.close()
    joined: list[Part] = []
    for kind, piece in parts:
        if joined and joined[-1][0] == kind and kind != "tool_call":
            joined[-1] = (kind, joined[-1][1] + piece)
        else:
            joined.append((kind, piece))
    return joined

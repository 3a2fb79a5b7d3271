"""`Gather`: a request's chunks put together into whole answers, one per choice."""

from __future__ import annotations

from typing import TYPE_CHECKING

from scheduler.types import Completion

if TYPE_CHECKING:
    from scheduler.types import Chunk, TokenLogprob


class _Choice:
    __slots__ = ("last", "logprobs", "text", "tokens")

    def __init__(self) -> None:
        self.text: list[str] = []
        self.tokens: list[int] = []
        self.logprobs: list[TokenLogprob] | None = None
        self.last: Chunk | None = None


class Gather:
    """Chunks in, by `Chunk.index`: each choice's text, tokens, log-probabilities and final chunk."""

    def __init__(self) -> None:
        self._choices: dict[int, _Choice] = {}

    def add(self, chunk: Chunk) -> None:
        c = self._choices.get(chunk.index)
        if c is None:
            c = self._choices[chunk.index] = _Choice()
        c.text.append(chunk.text)
        c.tokens.extend(chunk.token_ids)
        if chunk.logprobs is not None:
            c.logprobs = (c.logprobs or []) + chunk.logprobs
        c.last = chunk

    def finals(self) -> list[Chunk]:
        """Each choice's final chunk, by index (a choice still running has none)."""
        return [c.last for _, c in sorted(self._choices.items())
                if c.last is not None and c.last.finish_reason is not None]

    def text(self, index: int = 0) -> str:
        return "".join(self._choices[index].text)

    def logprobs(self, index: int = 0) -> list[TokenLogprob] | None:
        return self._choices[index].logprobs

    def completion(self) -> Completion:
        """The first choice's `Completion`, with every choice's in `choices` when there are more."""
        done = [self._completion(i) for i in sorted(self._choices)]
        if len(done) == 1:
            return done[0]
        first = done[0]
        return Completion(
            first.request_id, first.text, first.token_ids, first.finish_reason, first.prompt_tokens,
            first.completion_tokens, first.timings, first.error, first.cached_tokens, first.logprobs,
            0, done,
        )

    def _completion(self, index: int) -> Completion:
        c = self._choices[index]
        last = c.last
        assert last is not None and last.finish_reason is not None and last.timings is not None
        return Completion(
            request_id=last.request_id, text="".join(c.text), token_ids=c.tokens,
            finish_reason=last.finish_reason, prompt_tokens=last.prompt_tokens,
            completion_tokens=last.completion_tokens, timings=last.timings, error=last.error,
            cached_tokens=last.cached_tokens, logprobs=c.logprobs, index=index,
        )

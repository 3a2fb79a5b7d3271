"""Per-row logits processing and log-probabilities, for rows that ask: the others pay nothing.

Processors are mlx-lm's own (`make_logits_processors`), handed to `BatchGenerator.insert` per row,
so a batch mixes rows with and without them in one step. Log-probabilities come from the
normalized logits the generator already computes for every row: the chosen token's value and,
when asked, the k largest, taken with one `argpartition` per row and evaluated together."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, cast

import mlx.core as mx
from mlx_lm.sample_utils import make_logits_processors

from workers.messages import Logprobs

if TYPE_CHECKING:
    from workers.batching.grammar import GrammarRow, GrammarRows
    from workers.messages import Admit


def processors(admit: Admit, grammar: GrammarRows | None) -> tuple[list[Any] | None, GrammarRow | None]:
    """mlx-lm logits processors for one row (None: the row has none), and its grammar's
    processor if it has one (to bind to the row's uid). The grammar's mask comes last, so no
    bias or penalty can bring back a token it rules out."""
    spec = admit.processing
    if spec is None:
        return None, None
    made = make_logits_processors(
        logit_bias=dict(spec.logit_bias) or None,
        repetition_penalty=None if spec.repetition_penalty == 1.0 else spec.repetition_penalty,
        repetition_context_size=spec.context,
        presence_penalty=spec.presence_penalty or None,
        presence_context_size=spec.context,
        frequency_penalty=spec.frequency_penalty or None,
        frequency_context_size=spec.context,
    )
    row = None
    if spec.grammar is not None:
        if grammar is None:  # the scheduler refuses such requests; this is a second line
            raise ValueError("a row asks for a grammar, but this model has no grammar tokenizer")
        replay = admit.prompt[len(admit.prompt) - admit.sampled:] if admit.sampled else []
        row = grammar.row(spec.grammar, replay)
        made.append(row)
    return made or None, row


class Wanted:
    """A step's rows that asked for log-probabilities: collected while reading the step's
    responses, evaluated in one go."""

    def __init__(self) -> None:
        self._rows: list[tuple[int, int, mx.array, int]] = []

    def add(self, at: int, token: int, logprobs: mx.array, top: int) -> None:
        """`logprobs`: the row's normalized log-probabilities over the vocabulary."""
        self._rows.append((at, token, logprobs, top))

    def __bool__(self) -> bool:
        return bool(self._rows)

    def take(self) -> list[Logprobs]:
        if not self._rows:
            return []
        chosen, tops = [], []
        for _, token, lp, k in self._rows:
            chosen.append(lp[token])
            if k:
                ids = mx.argpartition(-lp, kth=k - 1)[:k]
                tops.append((ids, lp[ids]))
        mx.eval(chosen, tops)
        out, it = [], iter(tops)
        for (at, _, _, k), value in zip(self._rows, chosen, strict=True):
            if k:
                ids, vals = next(it)
                listed = zip(cast("list[int]", ids.tolist()), cast("list[float]", vals.tolist()), strict=True)
                pairs = sorted(listed, key=lambda p: -p[1])
                top_ids, top_values = [i for i, _ in pairs], [v for _, v in pairs]
                out.append(Logprobs(at, cast("float", value.item()), top_ids, top_values))
            else:
                out.append(Logprobs(at, cast("float", value.item())))
        self._rows = []
        return out

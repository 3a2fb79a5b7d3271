"""A fake engine and codec for unit tests of actor logic (never the proof that a feature works:
the integration tests drive the real BatchGenerator)."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from workers.batching.contract import StepResult
from workers.factory import Loaded
from workers.loading.models import ModelInfo

if TYPE_CHECKING:
    from collections.abc import Callable, Sequence

    from workers.batching.budget import PrefillBudget
    from workers.messages import Admit, Key

VOCAB = 64
EOS = 63


def fake_token(admit: Admit, k: int) -> int:
    """The k-th token (0-based) the fake engine emits for `admit`: deterministic, never EOS. A
    preempted request comes back with its output appended to the prompt (`sampled` tokens) and
    carries on where it was, like a recompute on the real engine."""
    original = admit.prompt[: len(admit.prompt) - admit.sampled]
    return (sum(original) + 7 * (k + admit.sampled)) % (VOCAB - 1)


class FakeDetokenizer:
    def __init__(self) -> None:
        self._text = ""
        self._offset = 0

    def add_token(self, token: int) -> None:
        self._text += chr(ord("a") + token % 26)

    def finalize(self) -> None:
        pass

    @property
    def last_segment(self) -> str:
        segment = self._text[self._offset :]
        self._offset = len(self._text)
        return segment


class FakeCodec:
    def encode(self, text: str) -> list[int]:
        return [ord(c) % (VOCAB - 1) for c in text]

    def detokenizer(self) -> FakeDetokenizer:
        return FakeDetokenizer()


@dataclass
class _Seq:
    admit: Admit
    emitted: int = 0
    prefilled: int = 0


@dataclass
class FakeEngine:
    """One token per held sequence per step. `gate`, when cleared, blocks each step until set;
    `step_delay` makes each step take that long;
    `fail_at_step` raises inside that step; `eos_after` makes a sequence emit EOS as token k."""

    gate: threading.Event = field(default_factory=threading.Event)
    fail_at_step: int | None = None
    step_delay: float = 0.0
    eos_after: int | None = None
    steps: int = 0
    closed: bool = False
    seqs: dict[int, _Seq] = field(default_factory=dict)
    inserted: list[int] = field(default_factory=list)
    max_held: int = 0
    resets: int = 0
    budget: PrefillBudget | None = None
    """When set, prompts are prefilled in chunks the budget plans, before they decode."""
    max_batch: int = 64
    prefill_log: list[tuple[int, int]] = field(default_factory=list)
    evicted: list[Key] = field(default_factory=list)
    step_log: list[tuple[int, bool]] = field(default_factory=list)
    """(step, whether some request emitted its first token in it), in order."""
    on_queue: Callable[[], None] | None = None
    calls_on_queue: bool = True
    """As the real engine: `on_queue` is called in each step, before its (fake) device work."""

    def __post_init__(self) -> None:
        self.gate.set()

    def insert(self, admits: Sequence[Admit]) -> None:
        for a in admits:
            self.seqs[a.rid] = _Seq(a, prefilled=0 if self.budget is not None else len(a.prompt))
            self.inserted.append(a.rid)
        self.max_held = max(self.max_held, len(self.seqs))

    def remove(self, rids: Sequence[int]) -> None:
        for rid in rids:
            self.seqs.pop(rid, None)

    def evict(self, keys: Sequence[Key]) -> None:
        self.evicted.extend(keys)

    def keep_sessions(self, rids: Sequence[int]) -> list[tuple[Key, int]]:
        return []  # the fake keeps no KV

    def step(self) -> StepResult:
        self.gate.wait()
        if self.calls_on_queue and self.on_queue is not None and any(
            q.prefilled >= len(q.admit.prompt) for q in self.seqs.values()
        ):
            self.on_queue()  # a step that decodes
        if self.step_delay:
            time.sleep(self.step_delay)  # on the worker thread, like a real forward pass
        self.steps += 1
        if self.fail_at_step is not None and self.steps == self.fail_at_step:
            raise RuntimeError(f"injected failure at step {self.steps}")
        decoding = [q for q in self.seqs.values() if q.prefilled >= len(q.admit.prompt)]
        prefill_tokens = self._prefill(len(decoding)) if self.budget is not None else 0
        rids, tokens, finished, reasons = [], [], [], []
        first = False
        for seq in decoding:
            rid, k = seq.admit.rid, seq.emitted
            first = first or k == 0
            seq.emitted += 1
            if self.eos_after is not None and k == self.eos_after and EOS in seq.admit.stop_token_ids:
                finished.append(rid)
                reasons.append("stop")
                del self.seqs[rid]
                continue
            rids.append(rid)
            tokens.append(fake_token(seq.admit, k))
            if seq.emitted >= seq.admit.max_tokens:
                finished.append(rid)
                reasons.append("length")
                del self.seqs[rid]
        self.step_log.append((self.steps, first))
        return StepResult(rids, tokens, finished, reasons, prefill_tokens, first=first)

    def _prefill(self, decoding: int) -> int:
        """Like BatchGenerator: one chunk for each prompt in prefill; padded to the longest piece."""
        assert self.budget is not None
        started = [q for q in self.seqs.values() if 0 < q.prefilled < len(q.admit.prompt)]
        waiting = [q for q in self.seqs.values() if q.prefilled == 0]
        chunk, cap = self.budget.plan(
            decoding=decoding, in_prefill=len(started), waiting=len(waiting),
            room=self.max_batch - decoding,
        )
        batch = started + waiting[: max(0, min(cap - len(started), self.max_batch - decoding))]
        pieces = [min(chunk, len(q.admit.prompt) - q.prefilled) for q in batch]
        for q, n in zip(batch, pieces, strict=True):
            q.prefilled += n
        work = len(pieces) * max(pieces, default=0)
        self.prefill_log.append((decoding, work))
        return work

    def has_work(self) -> bool:
        return bool(self.seqs)

    def held(self) -> int:
        return len(self.seqs)

    def rids(self) -> list[int]:
        return list(self.seqs)

    def reset(self) -> None:
        self.seqs.clear()
        self.resets += 1

    def close(self) -> None:
        self.closed = True


def fake_info(context_length: int = 512) -> ModelInfo:
    return ModelInfo(
        name="fake", path="fake", model_type="fake", num_layers=1, num_kv_heads=1, head_dim=4,
        vocab_size=VOCAB, context_length=context_length, dtype="float32",
        kv_bytes_per_token=32, weights_bytes=0, eos_token_ids=(EOS,),
    )


def fake_factory(engine: FakeEngine, context_length: int = 512):  # type: ignore[no-untyped-def]
    def build() -> tuple[FakeEngine, Loaded]:
        return engine, Loaded(fake_info(context_length), FakeCodec())

    return build

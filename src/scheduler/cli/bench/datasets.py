"""Benchmark workloads: prompts of known token lengths, from the text the synthetic tokenizer was
trained on, so the same prompts read naturally to a real model's tokenizer too.

- `random`: input and output lengths uniform in `len * (1 +- range_ratio)` (vLLM's random set).
- `shared-prefix`: `num_prefixes` long common prefixes, each request adding its own suffix.
- `chat`: heavy-tailed lognormal lengths around the given medians, like conversation logs.
"""

from __future__ import annotations

import json
import math
import random
from importlib import resources
from typing import TYPE_CHECKING, Literal

import msgspec

if TYPE_CHECKING:
    from collections.abc import Sequence
    from pathlib import Path

DatasetName = Literal["random", "shared-prefix", "chat"]
DATASETS: tuple[DatasetName, ...] = ("random", "shared-prefix", "chat")
# Lognormal spreads of the chat mix: most turns are short, a few are several times the median.
CHAT_SIGMA_IN, CHAT_SIGMA_OUT = 0.9, 0.7


class RequestSpec(msgspec.Struct, frozen=True):
    """One request to send: text, its length under the benchmark's tokenizer, and max_tokens."""

    prompt: str
    prompt_tokens: int
    max_tokens: int


class TextCodec:
    """A Hugging Face `tokenizers` tokenizer without special tokens: enough to size prompts."""

    def __init__(self, tokenizer_json: Path) -> None:
        from tokenizers import Tokenizer

        self._tok = Tokenizer.from_file(str(tokenizer_json))

    def encode(self, text: str) -> list[int]:
        return list(self._tok.encode(text, add_special_tokens=False).ids)

    def decode(self, ids: Sequence[int]) -> str:
        return str(self._tok.decode(list(ids), skip_special_tokens=True))


class PromptMaker:
    """Cuts prompts of an exact token length out of a tokenized corpus."""

    def __init__(self, codec: TextCodec, corpus: str | None = None) -> None:
        self._codec = codec
        text = corpus if corpus is not None else _default_corpus()
        self._ids = codec.encode(text)
        if len(self._ids) < 16:
            raise ValueError("the corpus is too short to cut prompts from")

    def length(self, text: str) -> int:
        return len(self._codec.encode(text))

    def make(self, tokens: int, rng: random.Random) -> tuple[str, int]:
        """Text of `tokens` tokens (re-encoding can merge across a cut: then another cut, and
        after a few, the nearest found)."""
        text, got = "", 0
        for _ in range(8):
            text, got = self._cut(rng.randrange(len(self._ids)), tokens)
            if got == tokens:
                break
        return text, got

    def _cut(self, start: int, tokens: int) -> tuple[str, int]:
        ids = self._take(start, tokens)
        text, got = "", 0
        for _ in range(4):
            text = self._codec.decode(ids)
            again = self._codec.encode(text)
            got = len(again)
            if got == tokens:
                break
            ids = again[:tokens] if got > tokens else again + self._take(start + len(ids), tokens - got)
        return text, got

    def _take(self, start: int, n: int) -> list[int]:
        ids = self._ids
        out: list[int] = []
        while len(out) < n:
            i = start % len(ids)
            out.extend(ids[i : i + n - len(out)])
            start = 0
        return out


def _default_corpus() -> str:
    return (resources.files("workers.loading") / "corpus.txt").read_text(encoding="utf-8")


def load_codec(model_dir: Path) -> TextCodec:
    path = model_dir / "tokenizer.json"
    if not path.is_file():
        raise FileNotFoundError(f"{model_dir} has no tokenizer.json; the benchmark needs one to size prompts")
    return TextCodec(path)


def model_context(model_dir: Path) -> int:
    """max_position_embeddings from config.json (0 when it does not say)."""
    try:
        config = json.loads((model_dir / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return 0
    value = config.get("max_position_embeddings", 0)
    return value if isinstance(value, int) else 0


def _spread(rng: random.Random, mean: int, ratio: float) -> int:
    lo, hi = math.floor(mean * (1 - ratio)), math.ceil(mean * (1 + ratio))
    return max(1, rng.randint(max(1, lo), max(1, hi)) if ratio > 0 else mean)


def _lognormal(rng: random.Random, median: int, sigma: float) -> int:
    return max(4, min(8 * median, round(rng.lognormvariate(math.log(median), sigma))))


def build(
    name: DatasetName,
    maker: PromptMaker,
    *,
    num_prompts: int,
    input_len: int,
    output_len: int,
    range_ratio: float = 0.0,
    prefix_len: int = 256,
    num_prefixes: int = 4,
    context: int = 0,
    seed: int = 0,
) -> list[RequestSpec]:
    """`num_prompts` requests of dataset `name`; the same arguments give the same prompts.
    With `context`, prompt + max_tokens is kept within it."""
    rng = random.Random(seed)
    specs: list[RequestSpec] = []
    shared = name == "shared-prefix"
    prefixes = [maker.make(prefix_len, rng)[0] for _ in range(num_prefixes)] if shared else []
    for i in range(num_prompts):
        if name == "chat":
            n_in = _lognormal(rng, input_len, CHAT_SIGMA_IN)
            n_out = _lognormal(rng, output_len, CHAT_SIGMA_OUT)
        else:
            n_in, n_out = _spread(rng, input_len, range_ratio), _spread(rng, output_len, range_ratio)
        if context:
            n_in = min(n_in, max(1, context // 2))
            n_out = max(1, min(n_out, context - n_in - 8))  # a few tokens of slack for BOS/templates
        if shared:
            suffix, _ = maker.make(n_in, rng)
            text = prefixes[i % num_prefixes] + suffix
            specs.append(RequestSpec(text, maker.length(text), n_out))
        else:
            text, got = maker.make(n_in, rng)
            specs.append(RequestSpec(text, got, n_out))
    if shared:
        rng.shuffle(specs)  # so requests of one prefix do not all arrive together
    return specs

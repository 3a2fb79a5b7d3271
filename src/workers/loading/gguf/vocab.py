"""A Hugging Face `tokenizers` tokenizer from a GGUF file's `tokenizer.ggml.*` metadata.

Two vocabulary kinds, as llama.cpp names them: "gpt2" (byte-level BPE with merges; the
pre-tokenizer is named by `tokenizer.ggml.pre`) and "llama" (SentencePiece pieces with scores and
byte fallback; the merges are rebuilt from the scores, as Hugging Face's converters do).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors

from workers.loading.cachedir import ModelSourceError

if TYPE_CHECKING:
    from collections.abc import Callable

# llama.cpp's token types.
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6

_LLAMA3 = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2 = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)


def _gpt2() -> pre_tokenizers.PreTokenizer:
    return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)


def _digits_then_gpt2() -> pre_tokenizers.PreTokenizer:
    return pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
    )


def _split(pattern: str) -> pre_tokenizers.PreTokenizer:
    return pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(pattern), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )


PRE_TOKENIZERS: dict[str, Callable[[], pre_tokenizers.PreTokenizer]] = {
    "default": _gpt2,
    "gpt-2": _gpt2,
    "smollm": _digits_then_gpt2,
    "starcoder": _digits_then_gpt2,
    "qwen2": lambda: _split(_QWEN2),
    "llama-bpe": lambda: _split(_LLAMA3),
}
"""`tokenizer.ggml.pre` -> the byte-level pre-tokenizer llama.cpp applies for it."""


@dataclass(frozen=True)
class Vocab:
    tokenizer: Tokenizer
    config: dict[str, Any]
    """tokenizer_config.json: special tokens, chat template, BOS handling."""
    eos_token_ids: list[int]


def build_vocab(metadata: dict[str, Any]) -> Vocab:
    kind = metadata.get("tokenizer.ggml.model")
    tokens = metadata.get("tokenizer.ggml.tokens")
    if kind is None or not isinstance(tokens, list) or not tokens:
        raise ModelSourceError("the GGUF metadata has no tokenizer (tokenizer.ggml.model and .tokens)")
    types = metadata.get("tokenizer.ggml.token_type") or [NORMAL] * len(tokens)
    if len(types) != len(tokens):
        raise ModelSourceError(f"the GGUF tokenizer has {len(tokens)} tokens but {len(types)} token types")
    if kind == "gpt2":
        tokenizer, add_bos_default = _byte_level_bpe(metadata, tokens), False
    elif kind == "llama":
        tokenizer, add_bos_default = _sentencepiece_bpe(metadata, tokens, types), True
    else:
        raise ModelSourceError(
            f"GGUF tokenizer model {kind!r} is not supported; supported: gpt2 (byte-level BPE), "
            "llama (SentencePiece BPE)"
        )
    tokenizer.add_special_tokens(
        [AddedToken(tokens[i], special=True, normalized=False) for i, t in enumerate(types) if t == CONTROL]
    )
    tokenizer.add_tokens(
        [AddedToken(tokens[i], special=False, normalized=False)
         for i, t in enumerate(types) if t == USER_DEFINED]
    )

    def special(key: str) -> str | None:
        index = metadata.get(f"tokenizer.ggml.{key}_token_id")
        if index is None:
            return None
        if not 0 <= int(index) < len(tokens):
            raise ModelSourceError(f"tokenizer.ggml.{key}_token_id {index} is outside the vocabulary")
        return str(tokens[int(index)])

    bos, eos = special("bos"), special("eos")
    if eos is None:
        raise ModelSourceError("the GGUF metadata has no tokenizer.ggml.eos_token_id")
    add_bos = bool(metadata.get("tokenizer.ggml.add_bos_token", add_bos_default)) and bos is not None
    add_eos = bool(metadata.get("tokenizer.ggml.add_eos_token", False))
    _post_process(tokenizer, bos if add_bos else None, eos if add_eos else None)
    eos_ids = [int(metadata["tokenizer.ggml.eos_token_id"])]
    for key in ("eot", "eom"):
        extra = metadata.get(f"tokenizer.ggml.{key}_token_id")
        if extra is not None and int(extra) not in eos_ids:
            eos_ids.append(int(extra))
    config: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": bos,
        "eos_token": eos,
        "unk_token": special("unknown"),
        "pad_token": special("padding"),
        "add_bos_token": add_bos,
        "add_eos_token": add_eos,
        "clean_up_tokenization_spaces": False,
        "model_max_length": 1 << 30,
    }
    template = metadata.get("tokenizer.chat_template")
    if isinstance(template, str) and template:
        config["chat_template"] = template
    return Vocab(tokenizer, {k: v for k, v in config.items() if v is not None}, eos_ids)


def _byte_level_bpe(metadata: dict[str, Any], tokens: list[str]) -> Tokenizer:
    pre = str(metadata.get("tokenizer.ggml.pre", "default"))
    make_pre = PRE_TOKENIZERS.get(pre)
    if make_pre is None:
        raise ModelSourceError(
            f"GGUF pre-tokenizer {pre!r} is not supported; supported: {', '.join(PRE_TOKENIZERS)}"
        )
    merges = metadata.get("tokenizer.ggml.merges")
    if not isinstance(merges, list):
        raise ModelSourceError("the GGUF byte-level BPE tokenizer has no tokenizer.ggml.merges")
    pairs = []
    for m in merges:
        left, sep, right = str(m).partition(" ")
        if not sep:
            raise ModelSourceError(f"a GGUF merge {m!r} is not two tokens separated by a space")
        pairs.append((left, right))
    vocab = {t: i for i, t in enumerate(tokens)}
    # tokenizers' BPE refuses these with a bare Exception: name the problem instead.
    bad = next((p for p in pairs if p[0] not in vocab or p[1] not in vocab or p[0] + p[1] not in vocab), None)
    if bad is not None:
        raise ModelSourceError(
            f"the GGUF merge {' '.join(bad)!r} does not join two tokens of the vocabulary into a third"
        )
    tokenizer = Tokenizer(models.BPE(vocab, pairs, fuse_unk=False, byte_fallback=False))
    tokenizer.pre_tokenizer = make_pre()
    tokenizer.decoder = decoders.ByteLevel()
    return tokenizer


def _sentencepiece_bpe(metadata: dict[str, Any], tokens: list[str], types: list[int]) -> Tokenizer:
    scores = metadata.get("tokenizer.ggml.scores")
    if not isinstance(scores, list) or len(scores) != len(tokens):
        raise ModelSourceError("the GGUF SentencePiece tokenizer needs tokenizer.ggml.scores, one per token")
    vocab = {t: i for i, t in enumerate(tokens)}
    unk = next((tokens[i] for i, t in enumerate(types) if t == UNKNOWN), None)
    tokenizer = Tokenizer(
        models.BPE(vocab, _merges_by_score(tokens, scores, types), unk_token=unk, fuse_unk=True,
                   byte_fallback=True)
    )
    if metadata.get("tokenizer.ggml.add_space_prefix", True):
        tokenizer.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
        strip = [decoders.Strip(" ", 1, 0)]
    else:
        tokenizer.normalizer = normalizers.Replace(" ", "▁")
        strip = []
    tokenizer.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), *strip]
    )
    return tokenizer


def _merges_by_score(tokens: list[str], scores: list[float], types: list[int]) -> list[tuple[str, str]]:
    """Every split of a normal piece into two pieces of the vocabulary, best-scored piece first:
    SentencePiece merges the pair whose result scores highest."""
    known = {t for t, kind in zip(tokens, types, strict=True) if kind == NORMAL}
    ranked: list[tuple[float, int, str, str]] = []
    for index, (piece, score) in enumerate(zip(tokens, scores, strict=True)):
        if types[index] != NORMAL or len(piece) < 2:
            continue
        for cut in range(1, len(piece)):
            left, right = piece[:cut], piece[cut:]
            if left in known and right in known:
                ranked.append((-float(score), index, left, right))
    ranked.sort()
    return [(left, right) for _, _, left, right in ranked]


def _post_process(tokenizer: Tokenizer, bos: str | None, eos: str | None) -> None:
    if bos is None and eos is None:
        return
    ids = {t: tokenizer.token_to_id(t) for t in (bos, eos) if t is not None}

    def part(token: str | None, seq: int) -> list[str]:
        return [f"{token}:{seq}"] if token else []

    single = [*part(bos, 0), "$A:0", *part(eos, 0)]
    pair = [*single, *part(bos, 1), "$B:1", *part(eos, 1)]
    tokenizer.post_processor = processors.TemplateProcessing(
        single=" ".join(single),
        pair=" ".join(pair),
        special_tokens=[(t, i) for t, i in ids.items() if i is not None],
    )

"""Random-weight models of real mlx-lm architectures, built once into an mlx-lm model directory."""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import mlx.core as mx
from mlx.utils import tree_flatten
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from workers.loading.cachedir import build_atomically, cache_root

if TYPE_CHECKING:
    import os
    from collections.abc import Iterator

BUILD_VERSION = 1
"""Bump whenever the build output changes, so that old cache entries are not reused."""

EOS_TOKEN = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
SPECIAL_TOKENS = (EOS_TOKEN, IM_START, IM_END)
TOKENIZER_TRAIN_CAP = 8192
"""Most entries trained on the corpus; larger vocabularies are padded with unreachable fillers."""
EMBED_STD = 0.02
FILLER_PREFIX = "<|fill_"
FILLER_SCALE = 0.25
"""Embedding rows of padding fillers are scaled down so that real tokens win most argmaxes."""
SHARD_BYTES = 2 << 30
CORPUS_PATH = Path(__file__).with_name("corpus.txt")

CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

_ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM"}


@dataclass(frozen=True)
class SyntheticSpec:
    """The shape of a synthetic model; field names follow Hugging Face config.json."""

    model_type: str
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    intermediate_size: int
    vocab_size: int
    max_position_embeddings: int
    dtype: str
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-5
    tie_word_embeddings: bool = True
    rope_scaling: tuple[tuple[str, float | str], ...] | None = None
    head_dim: int | None = None
    extra: tuple[tuple[str, Any], ...] = ()
    """Further config.json keys the architecture needs (sliding windows, experts, layer types)."""
    text_config: bool = False
    """Nest the text model's keys under `text_config`, as multimodal checkpoints do (gemma3)."""

    def config(self, eos_token_ids: list[int], pad_token_id: int) -> dict[str, Any]:
        """The config.json contents."""
        cfg = {k: v for k, v in dataclasses.asdict(self).items() if v is not None}
        del cfg["extra"], cfg["text_config"]
        cfg.update(dict(self.extra))
        cfg.update(
            architectures=[_ARCHITECTURES.get(self.model_type, "ForCausalLM")],
            rope_scaling=dict(self.rope_scaling) if self.rope_scaling else None,
            torch_dtype=cfg.pop("dtype"),
            hidden_act="silu",
            bos_token_id=None,
            eos_token_id=eos_token_ids,
            pad_token_id=pad_token_id,
        )
        if self.model_type == "llama":
            cfg.update(attention_bias=False, mlp_bias=False)
        if self.text_config:
            outer = ("architectures", "torch_dtype", "eos_token_id", "pad_token_id", "bos_token_id")
            text = {k: v for k, v in cfg.items() if k not in outer}
            text["model_type"] = f"{self.model_type}_text"
            cfg = {k: cfg[k] for k in outer} | {
                "model_type": self.model_type, "vocab_size": self.vocab_size, "text_config": text,
            }
        return cfg


# fmt: off
SIZES: dict[str, SyntheticSpec] = {
    # Tests: builds and loads in ~0.2 s; a batch-1 decode step ~1 ms on CPU.
    "tiny": SyntheticSpec(
        model_type="llama", hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, intermediate_size=128, vocab_size=1024,
        max_position_embeddings=2048, dtype="float32",
    ),
    # CPU demo and benchmarks: a batch-1 step is mostly fixed cost (~3 ms), batch 64 ~40-50 ms
    # on 2 slow cores. bfloat16 because the mlx-cpu wheel's bf16 matmul is 2x its float32 one.
    "small": SyntheticSpec(
        model_type="qwen2", hidden_size=128, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, intermediate_size=128, vocab_size=2048,
        max_position_embeddings=4096, dtype="bfloat16", rope_theta=1e6, rms_norm_eps=1e-6,
    ),
    # GPU benchmarks: the real shapes of Qwen2.5-0.5B and Llama-3.2-1B.
    "qwen2.5-0.5b": SyntheticSpec(
        model_type="qwen2", hidden_size=896, num_hidden_layers=24, num_attention_heads=14,
        num_key_value_heads=2, intermediate_size=4864, vocab_size=151936,
        max_position_embeddings=32768, dtype="bfloat16", rope_theta=1e6, rms_norm_eps=1e-6,
    ),
    "llama-3.2-1b": SyntheticSpec(
        model_type="llama", hidden_size=2048, num_hidden_layers=16, num_attention_heads=32,
        num_key_value_heads=8, intermediate_size=8192, vocab_size=128256,
        max_position_embeddings=131072, dtype="bfloat16", rope_theta=500000.0, head_dim=64,
        rope_scaling=(
            ("factor", 32.0), ("high_freq_factor", 4.0), ("low_freq_factor", 1.0),
            ("original_max_position_embeddings", 8192), ("rope_type", "llama3"),
        ),
    ),
    # The real shapes of Qwen3-0.6B (every layer full attention) and Gemma-3-1B (5 of every 6
    # layers a 512-token sliding window), random weights: about 1.2 and 2.0 GB to build.
    "qwen3-0.6b": SyntheticSpec(
        model_type="qwen3", hidden_size=1024, num_hidden_layers=28, num_attention_heads=16,
        num_key_value_heads=8, intermediate_size=3072, vocab_size=151936,
        max_position_embeddings=40960, dtype="bfloat16", rope_theta=1e6, rms_norm_eps=1e-6,
        head_dim=128,
    ),
    "gemma-3-1b": SyntheticSpec(
        model_type="gemma3_text", hidden_size=1152, num_hidden_layers=26, num_attention_heads=4,
        num_key_value_heads=1, intermediate_size=6912, vocab_size=262144,
        max_position_embeddings=32768, dtype="bfloat16", rope_theta=1e6, rms_norm_eps=1e-6,
        head_dim=256, extra=(
            ("sliding_window", 512), ("sliding_window_pattern", 6),
            ("query_pre_attn_scalar", 256), ("rope_local_base_freq", 10000.0),
        ),
    ),
    # A small Qwen3-Next-style hybrid: 3 of every 4 layers linear attention (a fixed recurrent
    # state per row, mlx-lm's ArraysCache), the 4th full attention. Dense MLPs in every layer:
    # MLX's CPU backend has no bfloat16 expert matmul (GatherMM). ~19 MB.
    "qwen3-next-small": SyntheticSpec(
        model_type="qwen3_next", hidden_size=256, num_hidden_layers=8, num_attention_heads=8,
        num_key_value_heads=2, intermediate_size=512, vocab_size=4096,
        max_position_embeddings=32768, dtype="bfloat16", rope_theta=1e7, rms_norm_eps=1e-6,
        head_dim=64, tie_word_embeddings=False, extra=(
            ("linear_num_value_heads", 8), ("linear_num_key_heads", 4),
            ("linear_key_head_dim", 64), ("linear_value_head_dim", 64),
            ("linear_conv_kernel_dim", 4), ("full_attention_interval", 4),
            ("num_experts", 8), ("num_experts_per_tok", 2), ("decoder_sparse_step", 1),
            ("mlp_only_layers", tuple(range(8))), ("moe_intermediate_size", 128),
            ("shared_expert_intermediate_size", 256), ("norm_topk_prob", True),
            ("partial_rotary_factor", 0.25),
        ),
    ),
}
# fmt: on


def model_dir(size: str, seed: int = 0, cache_dir: str | os.PathLike[str] | None = None) -> Path:
    """Where ``synthetic:<size>`` built from ``seed`` lives (it may not exist yet)."""
    return cache_root(cache_dir) / "models" / f"{size}-s{seed}-v{BUILD_VERSION}"


def build(size: str, seed: int = 0, cache_dir: str | os.PathLike[str] | None = None) -> Path:
    """Build ``synthetic:<size>`` unless already cached; return its directory.

    The model is written to a temporary directory beside the final one and renamed into
    place, so a concurrent or interrupted build never leaves a partial model behind.
    """
    if size not in SIZES:
        raise KeyError(f"unknown synthetic model size {size!r}; known: {', '.join(SIZES)}")
    return build_atomically(
        model_dir(size, seed, cache_dir), lambda out: write_model(SIZES[size], seed, out, name=size)
    )


def write_model(spec: SyntheticSpec, seed: int, out: Path, name: str = "") -> None:
    """Write config, tokenizer and random weights of ``spec`` into the directory ``out``."""
    tokenizer = train_tokenizer(spec.vocab_size)
    special = [_token_id(tokenizer, t) for t in SPECIAL_TOKENS]
    eos_ids = [special[0], special[2]]
    config = spec.config(eos_ids, pad_token_id=special[0])
    config["synthetic"] = {"name": name, "seed": seed, "build_version": BUILD_VERSION}
    _write_json(out / "config.json", config)
    write_tokenizer(tokenizer, out, spec.max_position_embeddings)
    real_vocab = sum(1 for t in tokenizer.get_vocab() if not t.startswith(FILLER_PREFIX))
    shapes = _parameter_shapes(spec)
    shards = list(_plan_shards(shapes, getattr(mx, spec.dtype).size))
    for i, names in enumerate(shards):
        fname = "model.safetensors"
        if len(shards) > 1:
            fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        with mx.stream(mx.cpu):  # the same bytes on every device
            weights = dict(_init_weights(spec, seed, shapes, names, real_vocab))
            mx.eval(weights)
        mx.save_safetensors(str(out / fname), weights, metadata={"format": "mlx"})
        del weights
    if len(shards) > 1:
        weight_map = {
            n: f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
            for i, names in enumerate(shards)
            for n in names
        }
        index = {"metadata": {}, "weight_map": weight_map}
        _write_json(out / "model.safetensors.index.json", index)


def _parameter_shapes(spec: SyntheticSpec) -> dict[str, tuple[int, ...]]:
    """Parameter names and shapes, from mlx-lm's own class for the architecture."""
    from workers.batching.mlxlm import model_classes

    config = spec.config([0], 0)
    model_class, args_class = model_classes(config)
    model = model_class(args_class.from_dict(config))  # lazily initialised: nothing is computed here
    flat: list[tuple[str, Any]] = tree_flatten(model.parameters())  # type: ignore[assignment]
    # Tied checkpoints carry no lm_head; classes such as gemma3's make one and drop it on load.
    tied = spec.tie_word_embeddings
    return {k: tuple(v.shape) for k, v in flat if not (tied and k.endswith("lm_head.weight"))}


def _plan_shards(shapes: dict[str, tuple[int, ...]], dtype_size: int) -> Iterator[list[str]]:
    """Group parameter names into shards of at most ``SHARD_BYTES`` (unless one is larger)."""
    shard: list[str] = []
    nbytes = 0
    for name, shape in shapes.items():
        size = dtype_size * math.prod(shape)
        if shard and nbytes + size > SHARD_BYTES:
            yield shard
            shard, nbytes = [], 0
        shard.append(name)
        nbytes += size
    if shard:
        yield shard


def _init_weights(
    spec: SyntheticSpec,
    seed: int,
    shapes: dict[str, tuple[int, ...]],
    names: list[str],
    real_vocab: int,
) -> Iterator[tuple[str, mx.array]]:
    """Random weights that keep activations O(1) and make the output depend on the context.

    Norms are 1 and biases 0; the rest is uniform (3x faster to draw than normal) with std
    0.02 for embeddings and 1/sqrt(fan_in) for projections, so each layer's output dominates
    the small embedding in the residual stream (with 0.02 everywhere a tied model just repeats
    its last input token). Projections into the residual stream get another 1/sqrt(2*layers).
    Vocabulary rows from ``real_vocab`` on (padding fillers) are scaled by ``FILLER_SCALE``.
    Each tensor has its own key split from ``seed``, so it does not depend on sharding.
    """
    dtype = getattr(mx, spec.dtype)
    order = {n: i for i, n in enumerate(shapes)}
    keys = mx.random.split(mx.random.key(seed), len(shapes))
    depth_scale = (2 * spec.num_hidden_layers) ** -0.5
    for name in names:
        shape = shapes[name]
        if name.endswith("norm.weight"):
            yield name, mx.ones(shape, dtype=dtype)
        elif name.endswith(".bias"):
            yield name, mx.zeros(shape, dtype=dtype)
        else:
            vocab_rows = name.endswith(("embed_tokens.weight", "lm_head.weight"))
            if vocab_rows:
                std = EMBED_STD
            else:
                std = shape[-1] ** -0.5
                if name.endswith(("o_proj.weight", "down_proj.weight")):
                    std *= depth_scale
            bound = std * 3**0.5
            w = mx.random.uniform(-bound, bound, shape, dtype=dtype, key=keys[order[name]])
            if vocab_rows and real_vocab < shape[0]:
                w = mx.concatenate([w[:real_vocab], w[real_vocab:] * FILLER_SCALE])
            yield name, w


def train_tokenizer(vocab_size: int, corpus: str | None = None) -> Tokenizer:
    """A byte-level BPE trained on ``corpus`` (default: the shipped corpus.txt).

    Trained to at most ``TOKENIZER_TRAIN_CAP`` entries, then padded to exactly ``vocab_size``.
    """
    if corpus is None:
        corpus = CORPUS_PATH.read_text(encoding="utf-8")
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=min(vocab_size, TOKENIZER_TRAIN_CAP),
        min_frequency=1,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    paragraphs = [p for p in corpus.split("\n\n") if p.strip()]
    tokenizer.train_from_iterator(paragraphs, trainer=trainer)
    return pad_vocab(tokenizer, vocab_size)


def pad_vocab(tokenizer: Tokenizer, size: int) -> Tokenizer:
    """Pad the BPE vocabulary to ``size`` entries with unreachable ASCII fillers.

    The fillers have no merges, so no text ever encodes to them, but every id below ``size``
    decodes (as ``<|fill_N|>``), including through mlx-lm's BPE streaming detokenizer.
    """
    data = json.loads(tokenizer.to_str())
    vocab: dict[str, int] = data["model"]["vocab"]
    n = tokenizer.get_vocab_size(with_added_tokens=True)
    if n > size:
        raise ValueError(f"tokenizer already has {n} entries, more than {size}")
    if len(vocab) != n:
        raise ValueError("added tokens outside the BPE vocabulary are not supported")
    for token_id in range(n, size):
        filler = f"{FILLER_PREFIX}{token_id}|>"
        if vocab.setdefault(filler, token_id) != token_id:  # cannot happen: see ByteLevel
            raise ValueError(f"{filler!r} is already in the vocabulary")
    return Tokenizer.from_str(json.dumps(data))


def write_tokenizer(tokenizer: Tokenizer, out: Path, max_length: int) -> None:
    """Save tokenizer.json, tokenizer_config.json and special_tokens_map.json into ``out``."""
    tokenizer.save(str(out / "tokenizer.json"), pretty=True)
    special = {
        "eos_token": EOS_TOKEN,
        "pad_token": EOS_TOKEN,
        "additional_special_tokens": [IM_START, IM_END],
    }
    _write_json(out / "special_tokens_map.json", special)
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": None,
        "add_bos_token": False,
        "unk_token": None,
        "model_max_length": max_length,
        "clean_up_tokenization_spaces": False,
        "chat_template": CHAT_TEMPLATE,
    }
    _write_json(out / "tokenizer_config.json", {**special, **config})


def _token_id(tokenizer: Tokenizer, token: str) -> int:
    token_id = tokenizer.token_to_id(token)
    if token_id is None:
        raise ValueError(f"tokenizer has no {token!r}")
    return int(token_id)


def _write_json(path: Path, obj: object) -> None:
    path.write_text(json.dumps(obj, indent=2, sort_keys=True) + "\n", encoding="utf-8")

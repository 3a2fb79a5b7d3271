"""GGUF files for tests, written from mlx-lm model directories the way llama.cpp's
convert_hf_to_gguf.py writes them (its LlamaModel / Qwen2Model and vocabulary handling).

- Metadata: `{arch}.*` hyperparameters and `tokenizer.ggml.*` (a byte-level "gpt2" vocabulary from
  tokenizer.json, or a SentencePiece "llama" one from a .model file).
- Tensors under GGUF names; llama's Q and K rows permuted for llama.cpp's interleaved RoPE (qwen2
  is written unpermuted); 1-d tensors (norms, biases) F32, 2-d weights in the requested type.
- No `output.weight` when the embeddings are tied.
"""

from __future__ import annotations

import importlib
import json
import re
import sys
import types
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal

import gguf
import mlx.core as mx
import numpy as np
from gguf import GGMLQuantizationType as Q
from gguf import GGUFValueType as V
from gguf import quants

if TYPE_CHECKING:
    from collections.abc import Mapping
    from pathlib import Path

    from transformers import PreTrainedTokenizerBase

TensorType = Literal["F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0"]
MetaValue = bool | int | float | str | list[str] | list[int] | list[float]

# llama.cpp's token types.
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6

MLX_NATIVE: frozenset[TensorType] = frozenset({"F32", "F16", "Q8_0", "Q4_0", "Q4_1"})
"""Types MLX reads itself; the loader dequantizes the other quantized ones to float16."""

_FILE_TYPES: dict[TensorType, int] = {  # general.file_type: llama.cpp's LlamaFileType
    "F32": gguf.LlamaFileType.ALL_F32,
    "F16": gguf.LlamaFileType.MOSTLY_F16,
    "BF16": gguf.LlamaFileType.MOSTLY_BF16,
    "Q8_0": gguf.LlamaFileType.MOSTLY_Q8_0,
    "Q4_0": gguf.LlamaFileType.MOSTLY_Q4_0,
    "Q4_1": gguf.LlamaFileType.MOSTLY_Q4_1,
    "Q5_0": gguf.LlamaFileType.MOSTLY_Q5_0,
}
_TOP = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output"}
_LAYER = {
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}
_HF_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")


@dataclass(frozen=True)
class Vocab:
    """The `tokenizer.ggml.*` metadata of one vocabulary."""

    model: str
    tokens: list[str]
    token_types: list[int]
    pre: str = "default"
    merges: list[str] = field(default_factory=list)
    scores: list[float] = field(default_factory=list)
    special_ids: dict[str, int] = field(default_factory=dict)
    """"bos", "eos", "unknown", "padding" -> token id."""
    add_bos: bool | None = None
    chat_template: str | None = None

    def metadata(self) -> dict[str, MetaValue]:
        meta: dict[str, MetaValue] = {
            "tokenizer.ggml.model": self.model,
            "tokenizer.ggml.pre": self.pre,
            "tokenizer.ggml.tokens": self.tokens,
            "tokenizer.ggml.token_type": self.token_types,
        }
        if self.scores:
            meta["tokenizer.ggml.scores"] = self.scores
        if self.merges:
            meta["tokenizer.ggml.merges"] = self.merges
        for kind, token_id in self.special_ids.items():
            meta[f"tokenizer.ggml.{kind}_token_id"] = token_id
        if self.add_bos is not None:
            meta["tokenizer.ggml.add_bos_token"] = self.add_bos
        if self.chat_template is not None:
            meta["tokenizer.chat_template"] = self.chat_template
        return meta


def byte_level_vocab(model_dir: Path, pre: str = "gpt-2") -> Vocab:
    """A "gpt2" vocabulary from tokenizer.json, as convert_hf_to_gguf's `get_vocab_base` and
    gguf's `SpecialVocab` read it: added special tokens are CONTROL, other added ones
    USER_DEFINED, the rest NORMAL; merges, special ids, add_bos and the chat template from the
    tokenizer files. ``pre`` names the pre-tokenizer (llama.cpp picks it by a hash of the
    tokenizer's output; the synthetic models use GPT-2's)."""
    data = json.loads((model_dir / "tokenizer.json").read_text(encoding="utf-8"))
    by_id: dict[int, str] = {i: t for t, i in data["model"]["vocab"].items()}
    kinds: dict[int, int] = {}
    for added in data["added_tokens"]:
        by_id[added["id"]] = added["content"]
        kinds[added["id"]] = CONTROL if added["special"] else USER_DEFINED
    size = max(by_id) + 1
    if sorted(by_id) != list(range(size)):
        raise ValueError(f"{model_dir}: token ids are not 0..{size - 1}")
    special = gguf.SpecialVocab(model_dir, load_merges=True, n_vocab=size)
    return Vocab(
        model="gpt2",
        pre=pre,
        tokens=[by_id[i] for i in range(size)],
        token_types=[kinds.get(i, NORMAL) for i in range(size)],
        merges=list(special.merges),
        special_ids=dict(special.special_token_ids),
        add_bos=special.add_special_token.get("bos"),
        chat_template=special.chat_template if isinstance(special.chat_template, str) else None,
    )


def sentencepiece_vocab(model_file: Path) -> Vocab:
    """A "llama" vocabulary from a SentencePiece model, as convert_hf_to_gguf's
    `_create_vocab_sentencepiece` writes it: pieces, scores, and types from the model's own flags."""
    from sentencepiece import SentencePieceProcessor

    sp = SentencePieceProcessor(model_file=str(model_file))
    tokens: list[str] = []
    scores: list[float] = []
    types: list[int] = []
    for i in range(sp.vocab_size()):
        tokens.append(sp.id_to_piece(i))
        scores.append(float(sp.get_score(i)))
        if sp.is_unknown(i):
            types.append(UNKNOWN)
        elif sp.is_control(i):
            types.append(CONTROL)
        elif sp.is_unused(i):
            types.append(UNUSED)
        elif sp.is_byte(i):
            types.append(BYTE)
        else:
            types.append(NORMAL)
    special = {"bos": sp.bos_id(), "eos": sp.eos_id(), "unknown": sp.unk_id()}
    return Vocab(
        model="llama",
        tokens=tokens,
        token_types=types,
        scores=scores,
        special_ids={k: v for k, v in special.items() if v >= 0},
        add_bos=True,
    )


def hf_weights(model_dir: Path) -> dict[str, np.ndarray]:
    """Every tensor of the model directory, under mlx-lm's names, as float32."""
    out: dict[str, np.ndarray] = {}
    for path in sorted(model_dir.glob("*.safetensors")):
        loaded = mx.load(str(path))
        assert isinstance(loaded, dict)
        out.update({k: np.array(v.astype(mx.float32)) for k, v in loaded.items()})
    return out


def gguf_name(hf_name: str) -> str:
    base, _, suffix = hf_name.rpartition(".")
    if base in _TOP:
        return f"{_TOP[base]}.{suffix}"
    m = _HF_LAYER.match(base)
    if m is None or m.group(2) not in _LAYER:
        raise KeyError(f"no GGUF name for {hf_name!r}")
    return f"blk.{m.group(1)}.{_LAYER[m.group(2)]}.{suffix}"


def permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """convert_hf_to_gguf's `LlamaModel.permute`: each head's rotary halves interleaved."""
    rows = w.shape[0]
    return w.reshape(n_head, 2, rows // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def gguf_tensors(config: Mapping[str, object], weights: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The weights under GGUF names, with llama's Q and K (weights and biases) permuted."""
    heads = int(str(config["num_attention_heads"]))
    kv_heads = int(str(config.get("num_key_value_heads", heads)))
    out: dict[str, np.ndarray] = {}
    for hf_name, w in weights.items():
        name = gguf_name(hf_name)
        if config["model_type"] == "llama":
            if ".attn_q." in name:
                w = permute(w, heads)
            elif ".attn_k." in name:
                w = permute(w, kv_heads)
        out[name] = w
    return out


def model_metadata(config: Mapping[str, object], arch: str) -> dict[str, MetaValue]:
    """`{arch}.*` hyperparameters as convert_hf_to_gguf's `set_gguf_parameters` writes them."""

    def num(key: str) -> int:
        return int(str(config[key]))

    heads = num("num_attention_heads")
    head_dim = int(str(config.get("head_dim") or num("hidden_size") // heads))
    meta: dict[str, MetaValue] = {
        f"{arch}.vocab_size": num("vocab_size"),
        f"{arch}.context_length": num("max_position_embeddings"),
        f"{arch}.embedding_length": num("hidden_size"),
        f"{arch}.block_count": num("num_hidden_layers"),
        f"{arch}.feed_forward_length": num("intermediate_size"),
        f"{arch}.attention.head_count": heads,
        f"{arch}.attention.head_count_kv": int(str(config.get("num_key_value_heads", heads))),
        f"{arch}.attention.layer_norm_rms_epsilon": float(str(config["rms_norm_eps"])),
        f"{arch}.rope.freq_base": float(str(config.get("rope_theta", 10000.0))),
        f"{arch}.rope.dimension_count": head_dim,
    }
    if head_dim != num("hidden_size") // heads:
        meta[f"{arch}.attention.key_length"] = head_dim
        meta[f"{arch}.attention.value_length"] = head_dim
    return meta


def encode(w: np.ndarray, tensor_type: TensorType) -> np.ndarray:
    """``w`` as the GGUF stores it (bytes of blocks for quantized types)."""
    return quants.quantize(w.astype(np.float32), Q[tensor_type])


def stored_values(w: np.ndarray, tensor_type: TensorType) -> np.ndarray:
    """What a loader reads back from ``encode(w, tensor_type)``, as float32. Types MLX cannot
    keep quantized (Q5_0) are dequantized to float16 by our loader, so they are rounded to it."""
    if tensor_type == "F32":
        return w.astype(np.float32)
    out = quants.dequantize(encode(w, tensor_type), Q[tensor_type]).astype(np.float32).reshape(w.shape)
    if tensor_type not in MLX_NATIVE and tensor_type != "BF16":
        out = out.astype(np.float16).astype(np.float32)
    return out


def reference_weights(model_dir: Path, tensor_type: TensorType) -> dict[str, mx.array]:
    """The model directory's weights (mlx-lm names) with each 2-d weight rounded through
    ``tensor_type`` as a GGUF file stores it; 1-d tensors stay as they are, as llama.cpp keeps
    them F32. Per-row quantization commutes with the Q/K row permutation, so no permutation."""
    return {
        name: mx.array(stored_values(w, tensor_type) if w.ndim == 2 else w)
        for name, w in hf_weights(model_dir).items()
    }


def write_gguf(
    out: Path,
    model_dir: Path,
    tensor_type: TensorType = "F32",
    *,
    vocab: Vocab | None = None,
    arch: str | None = None,
    metadata: Mapping[str, MetaValue | None] | None = None,
    extra_tensors: Mapping[str, np.ndarray] | None = None,
    weights: Mapping[str, np.ndarray] | None = None,
) -> Path:
    """Write the model in ``model_dir`` (or ``weights``, mlx-lm names, with its config) as the
    GGUF file ``out``. ``arch`` sets general.architecture (default: the config's model_type);
    ``metadata`` overrides keys (None removes one); ``extra_tensors`` are added under their
    GGUF names as they are."""
    config = json.loads((model_dir / "config.json").read_text(encoding="utf-8"))
    name = str(config["model_type"])
    meta: dict[str, MetaValue] = {
        "general.name": model_dir.name,
        "general.file_type": int(_FILE_TYPES[tensor_type]),
        "general.quantization_version": gguf.GGML_QUANT_VERSION,
        **model_metadata(config, name),
        **(vocab or byte_level_vocab(model_dir)).metadata(),
    }
    for key, value in (metadata or {}).items():
        if value is None:
            meta.pop(key, None)
        else:
            meta[key] = value
    tensors = gguf_tensors(config, weights if weights is not None else hf_weights(model_dir))
    tensors.update(extra_tensors or {})

    writer = gguf.GGUFWriter(out, arch or name)
    for key, value in meta.items():
        writer.add_key_value(key, value, *_value_type(value))
    for tensor_name, w in tensors.items():
        kind: TensorType = tensor_type if w.ndim == 2 else "F32"
        writer.add_tensor(tensor_name, encode(w, kind), raw_dtype=Q[kind])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


def _value_type(value: MetaValue) -> tuple[V, V | None]:
    """GGUF value types as llama.cpp writes these keys: ids and counts UINT32, floats FLOAT32,
    token types INT32."""
    if isinstance(value, bool):
        return V.BOOL, None
    if isinstance(value, int):
        return V.UINT32, None
    if isinstance(value, float):
        return V.FLOAT32, None
    if isinstance(value, str):
        return V.STRING, None
    first = value[0] if value else ""
    if isinstance(first, str):
        return V.ARRAY, V.STRING
    if isinstance(first, float):
        return V.ARRAY, V.FLOAT32
    return V.ARRAY, V.INT32


_TRANSFORMERS_READER = "transformers.integrations.gguf.reader"


def transformers_gguf_tokenizer(path: Path) -> PreTrainedTokenizerBase:
    """transformers' own GGUF tokenizer converter (`gguf_tokenizer_mapping`) on the file ``path``.

    transformers 5 reads GGUF metadata in a module that imports torch at the top (for tensors),
    and `AutoTokenizer` builds a model config through torch for llama files. Without torch, the
    tokenizer class is used directly and the metadata reader is swapped, for this call only, for
    one on our header parser (whose output the other tests check against the writer's input)."""
    from transformers import PreTrainedTokenizerFast

    stub: types.ModuleType | None = None
    saved = sys.modules.get(_TRANSFORMERS_READER)
    try:
        importlib.import_module(_TRANSFORMERS_READER)
    except ImportError:
        stub = types.ModuleType(_TRANSFORMERS_READER)
        stub.read_gguf_metadata = _read_gguf_metadata  # type: ignore[attr-defined]
        sys.modules[_TRANSFORMERS_READER] = stub
    try:
        tokenizer: PreTrainedTokenizerBase = PreTrainedTokenizerFast.from_pretrained(
            str(path.parent), gguf_file=path.name
        )
        return tokenizer
    finally:
        if stub is not None:
            if saved is None:
                sys.modules.pop(_TRANSFORMERS_READER, None)
            else:
                sys.modules[_TRANSFORMERS_READER] = saved


def _read_gguf_metadata(path: str, string_arrays: object = ()) -> tuple[dict[str, object], tuple[str, ...]]:
    from pathlib import Path

    from workers.loading.gguf.header import read_header

    header = read_header(Path(path))
    return dict(header.metadata), tuple(header.tensors)

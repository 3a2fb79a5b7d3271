"""Resolve and load models: local mlx-lm directories, Hugging Face ids and ``synthetic:<size>``."""

from __future__ import annotations

import re
from pathlib import Path
from typing import TYPE_CHECKING, Any

import msgspec

from workers import synthetic

if TYPE_CHECKING:
    import os

    from mlx_lm.tokenizer_utils import TokenizerWrapper

SYNTHETIC_PREFIX = "synthetic:"
HUB_TIMEOUT_S = 5.0
"""Connect/read timeout for the Hugging Face hub, so that a missing network fails fast."""

_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[A-Za-z0-9][\w.-]*)?$")
_HUB_PATTERNS = [
    "*.json",
    "model*.safetensors",
    "*.py",
    "tokenizer.model",
    "*.tiktoken",
    "tiktoken.model",
    "*.txt",
    "*.jsonl",
    "*.jinja",
]
_HINT = "use a local model directory or a synthetic model such as synthetic:tiny"


class ModelSourceError(RuntimeError):
    """A model could not be resolved or loaded; the message says which and why. The public API
    raises it as the cause of `scheduler.errors.ModelLoadError`."""


class ModelInfo(msgspec.Struct, frozen=True):
    """Facts about a loaded model that scheduling and KV accounting need."""

    name: str
    path: str
    model_type: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    context_length: int
    """max_position_embeddings; 0 when the config does not say."""
    dtype: str
    kv_bytes_per_token: int
    """Keys and values of one token over all layers: layers * kv_heads * head_dim * 2 * dtype size."""
    weights_bytes: int
    eos_token_ids: tuple[int, ...]


def parse_synthetic(name: str) -> tuple[str, int] | None:
    """``synthetic:<size>`` or ``synthetic:<size>@<seed>`` as (size, seed); None for other names."""
    if not name.startswith(SYNTHETIC_PREFIX):
        return None
    size, _, seed = name[len(SYNTHETIC_PREFIX) :].partition("@")
    if not seed:
        return size, 0
    try:
        return size, int(seed)
    except ValueError:
        raise ModelSourceError(f"bad seed {seed!r} in {name!r}: expected synthetic:<size>@<int>") from None


def resolve_model(path: str, cache_dir: str | os.PathLike[str] | None = None) -> Path:
    """The local model directory for ``path``, building or downloading it when needed.

    ``synthetic:<size>[@<seed>]`` is built into the cache (see ``workers.synthetic``) unless
    already there. An existing directory must contain config.json. A path-like string that does
    not exist is an error; anything else is a Hugging Face hub id.
    """
    parsed = parse_synthetic(path)
    if parsed is not None:
        size, seed = parsed
        if size not in synthetic.SIZES:
            known = ", ".join(SYNTHETIC_PREFIX + s for s in synthetic.SIZES)
            raise ModelSourceError(f"unknown synthetic model {path!r}; known sizes: {known}")
        try:
            return synthetic.build(size, seed, cache_dir)
        except OSError as e:
            raise ModelSourceError(f"could not build {path!r}: {e}") from e
    local = Path(path).expanduser()
    if local.exists():
        if not local.is_dir():
            raise ModelSourceError(f"model path {path!r} is not a directory")
        if not (local / "config.json").is_file():
            raise ModelSourceError(
                f"model directory {path!r} has no config.json, so it is not an mlx-lm model"
            )
        return local
    if path.startswith(("/", ".", "~")) or not _HUB_ID.match(path):
        raise ModelSourceError(f"model directory {path!r} does not exist; {_HINT}")
    return _download(path)


def _download(repo_id: str) -> Path:
    from huggingface_hub import snapshot_download

    try:
        return Path(snapshot_download(repo_id, allow_patterns=_HUB_PATTERNS, etag_timeout=HUB_TIMEOUT_S))
    except Exception as e:
        raise ModelSourceError(
            f"could not load {repo_id!r} from the Hugging Face hub (no network?) and it is not "
            f"a local directory: {type(e).__name__}: {e}; {_HINT}"
        ) from e


def load_model(path: str, cache_dir: str | os.PathLike[str] | None = None) -> tuple[Any, TokenizerWrapper]:
    """Load ``path`` (see ``resolve_model``) with ``mlx_lm.load``: (model, tokenizer).

    MLX streams are per thread: call this on the thread that will run the model.
    """
    directory = resolve_model(path, cache_dir)
    import mlx_lm

    try:
        loaded = mlx_lm.load(str(directory))
    except Exception as e:
        raise ModelSourceError(
            f"could not load the model in {str(directory)!r}: {type(e).__name__}: {e}"
        ) from e
    return loaded[0], loaded[1]


def model_info(
    model: Any,
    tokenizer: TokenizerWrapper,
    path: str | os.PathLike[str],
    name: str | None = None,
) -> ModelInfo:
    """Describe a model loaded by ``load_model`` from ``path`` (``name`` defaults to it)."""
    import mlx.core as mx
    from mlx.utils import tree_flatten

    args = getattr(model, "args", None)
    if args is None:
        raise ValueError(f"{type(model).__name__} has no args, so its shape is unknown")
    model_type = str(getattr(args, "model_type", type(model).__module__.rsplit(".", 1)[-1]))
    layers = _arg(args, "num_hidden_layers", "num_layers", "n_layer") or len(model.layers)
    heads = _arg(args, "num_attention_heads", "n_heads", "n_head")
    kv_heads = _arg(args, "num_key_value_heads", "n_kv_heads") or heads
    head_dim = _arg(args, "head_dim")
    if head_dim is None:
        hidden = _arg(args, "hidden_size", "dim", "n_embd")
        if hidden is None or heads is None:
            raise ValueError(f"cannot tell the head size of a {model_type!r} model")
        head_dim = hidden // heads
    vocab = _arg(args, "vocab_size")
    if kv_heads is None or vocab is None:
        raise ValueError(f"cannot tell the KV heads or vocabulary of a {model_type!r} model")

    params: list[tuple[str, Any]] = tree_flatten(model.parameters())  # type: ignore[assignment]
    weights_bytes = sum(int(v.nbytes) for _, v in params)
    floats = [v.dtype for _, v in params if mx.issubdtype(v.dtype, mx.floating)]
    if not floats:
        raise ValueError(f"a {model_type!r} model without floating-point parameters")
    dtype = floats[0]
    return ModelInfo(
        name=str(path) if name is None else name,
        path=str(path),
        model_type=model_type,
        num_layers=layers,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        vocab_size=vocab,
        context_length=_arg(args, "max_position_embeddings", "context_length") or 0,
        dtype=str(dtype).rsplit(".", 1)[-1],
        kv_bytes_per_token=layers * kv_heads * head_dim * 2 * int(dtype.size),
        weights_bytes=weights_bytes,
        eos_token_ids=tuple(sorted(int(t) for t in tokenizer.eos_token_ids)),
    )


def _arg(args: Any, *names: str) -> int | None:
    """The first of ``names`` that ``args`` has as a positive int."""
    for n in names:
        value = getattr(args, n, None)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return None

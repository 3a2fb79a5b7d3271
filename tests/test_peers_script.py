"""`benchmarks/peers.py`'s peer servers run with MLX's own CUDA settings (or the user's), never
those our worker puts into the benchmark's process for its own rows."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from tests.scripts import load_script

if TYPE_CHECKING:
    import pytest

SCRIPT = Path(__file__).resolve().parent.parent / "benchmarks" / "peers.py"


def test_a_peer_server_gets_mlxs_own_cuda_settings_or_the_users(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MLX_USE_CUDA_GRAPHS", "")
    monkeypatch.delenv("MLX_USE_CUDA_GRAPHS")  # the user set none...
    monkeypatch.setenv("MLX_CUDA_USE_CUDNN_SDPA", "0")  # ...but this one
    peers = load_script(SCRIPT, "peers_script")
    # Then our worker turns graphs off in this process (as `apply_cuda_defaults` does on CUDA).
    monkeypatch.setenv("MLX_USE_CUDA_GRAPHS", "0")
    for backend in ("mlx_lm.server", "mlx_lm.server-installed", "llama.cpp"):
        env = peers.peer_env(backend)
        assert env["MLX_USE_CUDA_GRAPHS"] == "1", backend  # MLX's default, not ours
        assert env["MLX_CUDA_USE_CUDNN_SDPA"] == "0", backend  # the user's own

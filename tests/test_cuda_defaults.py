"""The CUDA defaults: set only on CUDA, never over the user's own value."""

from __future__ import annotations

from typing import TYPE_CHECKING

from structlog.testing import capture_logs

from workers.cuda import CUDA_DEFAULTS, apply_cuda_defaults, cuda_defaults, on_cuda

if TYPE_CHECKING:
    import pytest


def test_cuda_gets_graphs_off_when_unset() -> None:
    env: dict[str, str] = {"OTHER": "1"}
    assert cuda_defaults(env, cuda=True) == {"MLX_USE_CUDA_GRAPHS": "0"}
    assert env == {"OTHER": "1", "MLX_USE_CUDA_GRAPHS": "0"}


def test_the_users_setting_wins() -> None:
    env = {"MLX_USE_CUDA_GRAPHS": "1"}
    assert cuda_defaults(env, cuda=True) == {}
    assert env == {"MLX_USE_CUDA_GRAPHS": "1"}


def test_other_backends_are_left_alone() -> None:
    env: dict[str, str] = {}
    assert cuda_defaults(env, cuda=False) == {}
    assert env == {}


def test_apply_on_this_machine_logs_what_it_set(monkeypatch: pytest.MonkeyPatch) -> None:
    for key in CUDA_DEFAULTS:
        monkeypatch.delenv(key, raising=False)
    with capture_logs() as logs:
        applied = apply_cuda_defaults()
    if on_cuda():
        assert applied == CUDA_DEFAULTS
        assert [e["event"] for e in logs] == ["cuda_defaults_applied"]
    else:  # CI and Apple Silicon: nothing changes, nothing is logged
        assert applied == {} and logs == []

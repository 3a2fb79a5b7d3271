"""The CUDA defaults: set only on CUDA, never over the user's own value."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import pytest
from structlog.testing import capture_logs

from workers.cuda import (
    CUDA_DEFAULTS,
    KERNELS,
    apply_cuda_defaults,
    came_late,
    cuda_defaults,
    graphs_wanted,
    kernel_dir,
    kernels_locked,
    mlx_used,
)
from workers.loading.dtypes import CUDA_DEQUANTIZE_LIMIT, cuda_dequantizes, on_cuda

SRC = Path(__file__).resolve().parents[1] / "src"


def test_cuda_gets_graphs_and_cudnn_attention_off_when_unset() -> None:
    env: dict[str, str] = {"OTHER": "1"}
    off = {"MLX_USE_CUDA_GRAPHS": "0", "MLX_CUDA_USE_CUDNN_SDPA": "0"}
    assert cuda_defaults(env, cuda=True) == off
    assert env == {"OTHER": "1", **off}


def test_the_users_setting_wins() -> None:
    env = {"MLX_USE_CUDA_GRAPHS": "1", "MLX_CUDA_USE_CUDNN_SDPA": "1"}
    assert cuda_defaults(env, cuda=True) == {}
    assert env == {"MLX_USE_CUDA_GRAPHS": "1", "MLX_CUDA_USE_CUDNN_SDPA": "1"}


def test_other_backends_are_left_alone() -> None:
    env: dict[str, str] = {}
    assert cuda_defaults(env, cuda=False) == {}
    assert env == {}


def test_compiled_kernels_go_to_our_cache_per_mlx_version(tmp_path: Path,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """MLX's own place for the kernels it compiles is /tmp, emptied by a reboot or a new
    container: ours is under the model cache, one directory per MLX version."""
    assert kernel_dir(str(tmp_path)) == tmp_path / "mlx-kernels" / mx.__version__
    monkeypatch.setenv("MLX_SCHEDULER_CACHE", str(tmp_path / "env"))
    assert kernel_dir() == tmp_path / "env" / "mlx-kernels" / mx.__version__
    env: dict[str, str] = {}
    assert cuda_defaults(env, cuda=True, kernels=tmp_path / "k")[KERNELS] == str(tmp_path / "k")
    assert env[KERNELS] == str(tmp_path / "k")
    mine = {KERNELS: "/srv/kernels"}  # the user's place wins
    assert KERNELS not in cuda_defaults(mine, cuda=True, kernels=tmp_path / "k")
    assert mine[KERNELS] == "/srv/kernels"
    assert cuda_defaults({}, cuda=False, kernels=tmp_path / "k") == {}


def test_apply_on_this_machine_logs_what_it_set(monkeypatch: pytest.MonkeyPatch) -> None:
    for key in [*CUDA_DEFAULTS, KERNELS]:
        monkeypatch.delenv(key, raising=False)
    with capture_logs() as logs:
        applied = apply_cuda_defaults()
    if on_cuda():
        assert applied == {**CUDA_DEFAULTS, KERNELS: str(kernel_dir())}
        assert [e["event"] for e in logs][0] == "cuda_defaults_applied"
    else:  # CI and Apple Silicon: nothing changes, nothing is logged
        assert applied == {} and logs == []


def _unset(monkeypatch: pytest.MonkeyPatch) -> None:
    """Our settings out of the environment, and back as they were after the test."""
    for key in [*CUDA_DEFAULTS, KERNELS]:
        monkeypatch.setenv(key, "")  # records the value before the test, restored after it
        monkeypatch.delenv(key)


def test_settings_made_after_mlx_used_the_gpu_are_said_not_to_apply(monkeypatch: pytest.MonkeyPatch) -> None:
    """MLX reads its settings once, at its first GPU use: an embedder (or a benchmark) that ran
    a model before starting the scheduler gets MLX's own, and is told so."""
    import workers.cuda

    monkeypatch.setattr(workers.cuda, "on_cuda", lambda: True)  # the decision, not the device
    _unset(monkeypatch)
    mx.reset_peak_memory()
    with capture_logs() as logs:
        applied = apply_cuda_defaults()
    assert not came_late(applied, mlx_used())
    assert [e["event"] for e in logs] == ["cuda_defaults_applied"]  # nothing ran MLX before
    mx.eval(mx.ones((256, 256)) * 2)
    _unset(monkeypatch)
    with capture_logs() as logs:
        applied = apply_cuda_defaults()
    late = [e for e in logs if e["event"] == "cuda_defaults_late"]
    assert len(late) == 1 and late[0]["log_level"] == "warning"
    assert late[0]["MLX_USE_CUDA_GRAPHS"] == "0" and "do not apply" in late[0]["reason"]
    assert applied["MLX_USE_CUDA_GRAPHS"] == "0" and came_late(applied, mlx_used()) == late[0]["reason"]
    assert came_late({}, True) == ""  # nothing set, nothing late (the user's own values, or not CUDA)
    _unset(monkeypatch)
    with capture_logs() as logs:  # the caller's own reading, taken before it used MLX itself
        apply_cuda_defaults(used_before=False)
    assert [e["event"] for e in logs] == ["cuda_defaults_applied"]


def test_importing_the_scheduler_and_mlx_lm_is_not_a_use_of_mlx() -> None:
    """mlx-lm's import makes its random key (8 bytes, from the host): no setting is read then, and
    a scheduler started next must not be told its settings came too late."""
    code = (
        "import mlx.core as mx, scheduler, workers.batching.engine, mlx_lm.generate\n"
        "from workers.cuda import mlx_used\n"
        "before = (mx.get_peak_memory(), mlx_used())\n"
        "mx.eval(mx.ones((256, 256)) * 2)\n"
        "print(before[0], before[1], mlx_used())\n"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(SRC), os.environ.get("PYTHONPATH")) if p)}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120, check=True)
    peak, used_then, used_after = out.stdout.split()
    assert int(peak) > 0  # the import did allocate: the check must see past it
    assert (used_then, used_after) == ("False", "True")


@pytest.mark.anyio
@pytest.mark.integration
async def test_a_scheduler_started_after_mlx_used_the_gpu_says_so_in_stats(
    monkeypatch: pytest.MonkeyPatch, model_cache: Path
) -> None:
    import workers.cuda
    from tests.test_metrics import served_once, value

    monkeypatch.setattr(workers.cuda, "on_cuda", lambda: True)
    _unset(monkeypatch)
    mx.eval(mx.ones((256, 256)) + 1)  # this process has run MLX before the scheduler starts
    tokens, stats, samples, logs = await served_once(model_cache)
    assert tokens == 4  # served all the same
    assert stats.cuda_settings_applied is False
    assert value(samples, "cuda_settings_applied") == 0
    assert len([e for e in logs if e["event"] == "cuda_defaults_late"]) == 1


def test_graphs_stay_on_when_wanted() -> None:
    env: dict[str, str] = {}
    assert cuda_defaults(env, cuda=True, graphs=True) == {"MLX_CUDA_USE_CUDNN_SDPA": "0"}
    assert env == {"MLX_CUDA_USE_CUDNN_SDPA": "0"}


def _model_dir(directory: Path, config: str, weights: int) -> Path:
    directory.mkdir()
    (directory / "config.json").write_text(config)
    with open(directory / "model.safetensors", "wb") as f:
        f.truncate(weights)  # sparse: only the size counts
    return directory


def test_auto_keeps_graphs_for_models_that_stay_quantized_only(tmp_path: Path) -> None:
    four_bits = '{"quantization": {"bits": 4, "group_size": 64}}'
    small = _model_dir(tmp_path / "small", "{}", 2 * 2**30)
    large = _model_dir(tmp_path / "large", "{}", 16 * 2**30)
    quant = _model_dir(tmp_path / "quant", four_bits, 4 * 2**30)  # 16 GiB in half precision
    tiny_quant = _model_dir(tmp_path / "tiny-quant", four_bits, 100 * 2**20)  # dequantized
    assert graphs_wanted("auto", small) is False
    assert graphs_wanted("auto", large) is False
    assert graphs_wanted("auto", quant) is True
    assert graphs_wanted("auto", tiny_quant) is False
    assert graphs_wanted("auto", tiny_quant, dequantize="no") is True
    assert graphs_wanted("auto", quant, dequantize="yes") is False
    assert graphs_wanted("on", small) is True
    assert graphs_wanted("off", large) is False
    assert graphs_wanted("auto", None) is False


def test_on_cuda_auto_dequantizes_what_fits_the_limit_in_half_precision(tmp_path: Path) -> None:
    limit = CUDA_DEQUANTIZE_LIMIT
    four = _model_dir(tmp_path / "four", '{"quantization": {"bits": 4}}', limit // 4)
    over = _model_dir(tmp_path / "over", '{"quantization": {"bits": 4}}', limit // 4 + 1)
    eight = _model_dir(tmp_path / "eight", '{"quantization_config": {"bits": 8}}', limit // 2)
    dense = _model_dir(tmp_path / "dense", "{}", 2**20)
    broken = _model_dir(tmp_path / "broken", "not json", 2**20)
    assert cuda_dequantizes(four) and cuda_dequantizes(eight)
    assert not cuda_dequantizes(over)
    assert not cuda_dequantizes(dense) and not cuda_dequantizes(broken) and not cuda_dequantizes(None)
    assert cuda_dequantizes(over, "yes") and not cuda_dequantizes(four, "no")


def test_replicas_on_one_host_build_kernels_in_turn(tmp_path: Path) -> None:
    """The second holder waits until the first lets go (flock: separate opens conflict, in one
    process as across processes); an unusable directory builds without the lock."""
    import threading
    import time

    order: list[str] = []
    with kernels_locked(str(tmp_path / "k")):
        second = threading.Thread(target=lambda: _hold(str(tmp_path / "k"), order))
        second.start()
        time.sleep(0.2)
        order.append("first done")
    second.join(5)
    assert order == ["first done", "second in"]
    blocker = tmp_path / "file"
    blocker.write_text("")
    with capture_logs() as logs, kernels_locked(str(blocker / "k")):  # a file where a directory must be
        order.append("built anyway")
    assert order[-1] == "built anyway" and [e["event"] for e in logs] == ["cuda_kernel_dir_unusable"]
    with kernels_locked(None):
        order.append("no directory")
    assert order[-1] == "no directory"


def _hold(directory: str, order: list[str]) -> None:
    with kernels_locked(directory):
        order.append("second in")

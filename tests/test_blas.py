"""OpenBLAS under MLX: loaded before MLX by our packages, recorded (never raised) when it cannot
be, and reported by `stats()` and `/metrics`. Import order matters, so most checks run in a fresh
interpreter."""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import TYPE_CHECKING, Any

import anyio
import pytest
import structlog

from scheduler import Scheduler, SchedulerConfig
from workers import blas

if TYPE_CHECKING:
    from collections.abc import Mapping

ROOT = Path(__file__).resolve().parents[1]
LINUX_X86 = sys.platform.startswith("linux") and platform.machine() == "x86_64"
linux_x86 = pytest.mark.skipif(not LINUX_X86, reason="OpenBLAS comes from a Linux x86-64 wheel")

# Prints the state, whether libopenblas is mapped into the process, and a float32 matmul's
# largest difference from numpy's.
PROBE = """
import json, sys
{first}
from workers.blas import blas_state
import mlx.core as mx, numpy as np
a = np.random.default_rng(0).standard_normal((256, 384)).astype(np.float32)
b = np.random.default_rng(1).standard_normal((384, 128)).astype(np.float32)
got = np.array(mx.array(a) @ mx.array(b))
maps = open("/proc/self/maps").read() if sys.platform.startswith("linux") else ""
s = blas_state()
print(json.dumps({{"library": s.library, "reason": s.reason, "threads": s.threads,
                  "mapped": "libopenblas" in maps, "error": float(np.abs(got - a @ b).max())}}))
"""


def probe(first: str = "import scheduler", env: Mapping[str, str] | None = None, cache: Path | None = None) -> Any:
    code = PROBE.format(first=textwrap.dedent(first))
    extra = {"MLX_SCHEDULER_CACHE": str(cache)} if cache else {}
    full = {**os.environ, "PYTHONPATH": str(ROOT / "src"), **extra, **(env or {})}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=full, timeout=120)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


@linux_x86
def test_import_scheduler_puts_mlx_on_openblas(tmp_path: Path) -> None:
    out = probe(cache=tmp_path)
    assert out["library"] == "openblas" and out["reason"] == "" and out["threads"] >= 1
    assert out["mapped"]
    assert out["error"] < 1e-3  # the same product as numpy's


@linux_x86
def test_the_opt_out_leaves_the_bundled_blas(tmp_path: Path) -> None:
    out = probe(env={blas.BLAS_ENV: "bundled"}, cache=tmp_path)
    assert out["library"] == "bundled" and out["reason"] == f"{blas.BLAS_ENV}=bundled"
    assert not out["mapped"] and out["error"] < 1e-3


@linux_x86
def test_mlx_imported_first_is_reported_not_fixed(tmp_path: Path) -> None:
    out = probe(first="import mlx.core\nimport scheduler", cache=tmp_path)
    assert out["library"] == "bundled" and "mlx.core was imported before" in out["reason"]
    assert not out["mapped"] and out["error"] < 1e-3


@linux_x86
def test_a_library_that_cannot_load_is_recorded_and_mlx_runs_on(tmp_path: Path) -> None:
    broken = tmp_path / "libopenblas.so.0"
    broken.write_bytes(b"not a shared library")
    # Imported with the opt-out, so that the broken library is the first one tried.
    first = f"""
    import os, pathlib, workers.blas as b
    del os.environ[b.BLAS_ENV]
    b._state = None
    b._find_library = lambda: pathlib.Path({str(broken)!r})
    b.load_openblas()
    """
    out = probe(first=first, env={blas.BLAS_ENV: "bundled"}, cache=tmp_path)
    assert out["library"] == "bundled" and "OpenBLAS did not load" in out["reason"]
    assert out["error"] < 1e-3


@linux_x86
def test_numpys_libgfortran_answers_to_the_soname_openblas_needs(tmp_path: Path) -> None:
    first = """
    import ctypes, workers.blas as b
    b._load_gfortran()
    ctypes.CDLL("libgfortran.so.5")  # found among the loaded libraries by its SONAME
    """
    assert probe(first=first, cache=tmp_path)["error"] < 1e-3
    copies = list((tmp_path / "blas").glob("libgfortran.so.5-*"))
    assert len(copies) == 1 and not list((tmp_path / "blas").glob(".*"))  # nothing half-written


def test_set_soname_refuses_what_it_cannot_do() -> None:
    with pytest.raises(OSError, match="not a 64-bit little-endian ELF"):
        blas.set_soname(bytearray(b"MZ" + bytes(100)), b"x")
    numpy_libs = Path(__import__("numpy").__file__).parent.parent / "numpy.libs"
    found = sorted(numpy_libs.glob("libgfortran-*.so*"))
    if not found:
        return  # a numpy without a bundled libgfortran: nothing more to check here
    data = bytearray(found[0].read_bytes())
    with pytest.raises(OSError, match="longer than the old one"):
        blas.set_soname(data, b"x" * 200)
    blas.set_soname(data, b"libgfortran.so.5")
    assert b"libgfortran.so.5\0" in data


@pytest.mark.anyio
async def test_stats_and_metrics_say_which_blas_mlx_runs_on(model_cache: Path) -> None:
    config = SchedulerConfig.from_toml(f'[model]\npath = "synthetic:tiny"\ncache_dir = "{model_cache}"\n')
    with structlog.testing.capture_logs() as logs, anyio.fail_after(60):
        async with Scheduler(config) as s:
            stats = s.stats()
            text = s.metrics_text()
    state = blas.blas_state()
    assert (stats.blas, stats.blas_note) == (state.library, state.reason)
    expected = "1.0" if state.library == "openblas" else "0.0"
    assert f"mlx_scheduler_cpu_blas_openblas {expected}" in text
    events = [e["event"] for e in logs if e["event"].startswith("cpu_blas")]
    assert events == (["cpu_blas"] if state.library == "openblas" else ["cpu_blas_bundled"])
    if LINUX_X86:
        assert state.library == "openblas", state.reason

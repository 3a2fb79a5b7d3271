"""OpenBLAS under MLX: loaded before MLX by our packages, recorded (never raised) when it cannot
be, and reported by `stats()` and `/metrics`. Import order matters, so most checks run in a fresh
interpreter. Which library did a product is told by its bits, not its speed: the bundled
reference BLAS sums each dot product in order, one float32 rounding a step, and OpenBLAS's
blocked kernels do not."""

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
from tests.fakes import FakeCodec, FakeEngine, fake_info
from workers import blas
from workers.factory import Loaded

if TYPE_CHECKING:
    from collections.abc import Mapping

ROOT = Path(__file__).resolve().parents[1]
LINUX_X86 = sys.platform.startswith("linux") and platform.machine() == "x86_64"
linux_x86 = pytest.mark.skipif(not LINUX_X86, reason="OpenBLAS comes from a Linux x86-64 wheel")

# Runs `first`, then MLX's float32 matmul; prints our state (if workers.blas was imported),
# whether libopenblas is mapped, the product's largest difference from numpy's, and whose bits
# the product has: "reference" (netlib's order of sums), "openblas" (the same as calling the
# mapped libopenblas's cblas_sgemm here) or "other".
PROBE = """
import ctypes, json, sys
{first}
import mlx.core as mx, numpy as np
m, k, n = 96, 384, 80
a = np.random.default_rng(0).standard_normal((m, k)).astype(np.float32)
b = np.random.default_rng(1).standard_normal((k, n)).astype(np.float32)
got = np.array(mx.array(a) @ mx.array(b))
maps = open("/proc/self/maps").read() if sys.platform.startswith("linux") else ""
reference = np.zeros((m, n), np.float32)
for l in range(k):
    reference = reference + np.outer(a[:, l], b[l, :])
bits = "reference" if (got == reference).all() else "other"
lib = next((line.split()[-1] for line in maps.splitlines() if "libopenblas" in line), None)
if lib is not None:
    direct = np.zeros((m, n), np.float32)
    ptr = ctypes.c_void_p
    ctypes.CDLL(lib).cblas_sgemm(101, 111, 111, m, n, k, ctypes.c_float(1.0), ptr(a.ctypes.data), k,
                                 ptr(b.ctypes.data), n, ctypes.c_float(0.0), ptr(direct.ctypes.data), n)
    bits = "openblas" if (got == direct).all() and (got != reference).any() else bits
s = sys.modules["workers.blas"].blas_state() if "workers.blas" in sys.modules else None
print(json.dumps({{"library": s and s.library, "reason": s and s.reason, "threads": s and s.threads,
                  "mapped": lib is not None, "bits": bits, "error": float(np.abs(got - a @ b).max())}}))
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
    assert out["mapped"] and out["bits"] == "openblas"
    assert out["error"] < 1e-3  # the same product as numpy's, to float32 rounding


@linux_x86
def test_the_opt_out_leaves_the_bundled_blas(tmp_path: Path) -> None:
    for value in ("bundled", "off"):
        out = probe(env={blas.BLAS_ENV: value}, cache=tmp_path)
        assert out["library"] == "bundled" and out["reason"] == f"{blas.BLAS_ENV}={value}"
        assert not out["mapped"] and out["bits"] == "reference" and out["error"] < 1e-3


@linux_x86
def test_mlx_imported_first_is_reported_not_fixed(tmp_path: Path) -> None:
    out = probe(first="import mlx.core\nimport scheduler", cache=tmp_path)
    assert out["library"] == "bundled" and "mlx.core was imported before" in out["reason"]
    assert not out["mapped"] and out["bits"] == "reference" and out["error"] < 1e-3


@linux_x86
def test_the_thread_count_is_set_from_the_environment(tmp_path: Path) -> None:
    two = min(2, len(os.sched_getaffinity(0)))  # OpenBLAS caps it at the CPUs
    assert probe(env={blas.THREADS_ENV: str(two)}, cache=tmp_path)["threads"] == two
    # "default" leaves OpenBLAS's own choice, which follows OPENBLAS_NUM_THREADS.
    out = probe(env={blas.THREADS_ENV: "default", "OPENBLAS_NUM_THREADS": "1"}, cache=tmp_path)
    assert out["threads"] == 1 and out["bits"] == "openblas"


@linux_x86
def test_preload_gives_a_peer_process_the_same_openblas(tmp_path: Path) -> None:
    # A peer server (mlx_lm.server) imports MLX without our packages: LD_PRELOAD is its way in.
    libs = blas.preload()
    assert blas.blas_state().library == "openblas", blas.blas_state().reason  # conftest loaded it
    assert libs.split()[-1] == blas.blas_state().path
    out = probe(first="", env={"LD_PRELOAD": libs, "OPENBLAS_NUM_THREADS": "1"}, cache=tmp_path)
    assert out["library"] is None and out["mapped"] and out["bits"] == "openblas"


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
    assert f"{broken}: file too short" in out["reason"]  # dlopen's own words
    assert out["bits"] == "reference" and out["error"] < 1e-3


@pytest.fixture
def before_mlx(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    """`_load` as if MLX were not imported yet and the wheel installed; nothing real is loaded."""
    monkeypatch.setattr(sys, "platform", "linux")
    monkeypatch.delitem(sys.modules, "mlx.core", raising=False)
    monkeypatch.delenv(blas.BLAS_ENV, raising=False)
    monkeypatch.setattr(blas, "_find_library", lambda: Path("/wheel/libopenblas.so.0"))
    return monkeypatch


def test_a_missing_libgfortran_is_recorded_with_both_errors(before_mlx: pytest.MonkeyPatch) -> None:
    tried: list[str] = []

    def dlopen(path: Path) -> Any:
        tried.append(str(path))
        raise OSError("libgfortran.so.5: cannot open shared object file: No such file or directory")

    def no_fallback() -> None:
        raise OSError("libgfortran.so.5 is not installed, and numpy's wheel carries no copy of it")

    before_mlx.setattr(blas, "_dlopen", dlopen)
    before_mlx.setattr(blas, "_load_gfortran", no_fallback)
    state = blas._load()
    assert state.library == "bundled" and state.path == "/wheel/libopenblas.so.0"
    assert state.reason.startswith("OpenBLAS did not load: libgfortran.so.5: cannot open")
    assert "numpy's wheel carries no copy" in state.reason
    assert tried == ["/wheel/libopenblas.so.0"]


def test_other_load_errors_skip_the_libgfortran_fallback(before_mlx: pytest.MonkeyPatch) -> None:
    def dlopen(path: Path) -> Any:
        raise OSError(f"{path}: wrong ELF class: ELFCLASS32")

    def fallback() -> None:
        raise AssertionError("not a libgfortran problem: no fallback")

    before_mlx.setattr(blas, "_dlopen", dlopen)
    before_mlx.setattr(blas, "_load_gfortran", fallback)
    assert blas._load().reason == "OpenBLAS did not load: /wheel/libopenblas.so.0: wrong ELF class: ELFCLASS32"


def test_why_not_openblas(before_mlx: pytest.MonkeyPatch) -> None:
    before_mlx.setattr(blas, "_find_library", lambda: None)
    assert "wheel is not installed" in blas._load().reason
    before_mlx.setenv(blas.BLAS_ENV, "off")
    assert blas._load() == blas.BlasState("bundled", reason=f"{blas.BLAS_ENV}=off")
    before_mlx.setattr(sys, "platform", "darwin")
    assert blas._load().library == "accelerate"


@pytest.mark.parametrize(("value", "openblas_env", "want"), [
    ("3", "", 3), ("default", "", 0), ("0", "", 0), ("", "4", 0), ("many", "", None), ("", "", None),
])
def test_thread_count_choice(monkeypatch: pytest.MonkeyPatch, value: str, openblas_env: str,
                             want: int | None) -> None:
    """0: leave OpenBLAS's own count; None: our default."""
    monkeypatch.setenv(blas.THREADS_ENV, value)
    monkeypatch.setenv("OPENBLAS_NUM_THREADS", openblas_env)
    assert blas._threads() == (blas.default_threads() if want is None else want)


def test_the_default_leaves_a_core_to_the_rest_of_the_process(monkeypatch: pytest.MonkeyPatch) -> None:
    for cpus, want in ((1, 1), (2, 1), (3, 2), (8, 4), (64, 4)):
        monkeypatch.setattr(blas, "_usable_cpus", lambda cpus=cpus: cpus)
        assert blas.default_threads() == want


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
    events = [e for e in logs if e["event"].startswith("cpu_blas")]
    assert [e["event"] for e in events] == (["cpu_blas"] if state.library == "openblas" else ["cpu_blas_bundled"])
    if LINUX_X86:
        assert state.library == "openblas", state.reason
        assert events[0]["threads"] == state.threads and events[0]["path"] == state.path


@pytest.mark.anyio
async def test_the_bundled_blas_is_a_warning_with_its_reason() -> None:
    # The state comes from the engine's process (here a fake one), not from this one.
    state = blas.BlasState("bundled", reason="mlx.core was imported before the scheduler's packages")

    def build() -> tuple[FakeEngine, Loaded]:
        return FakeEngine(), Loaded(fake_info(), FakeCodec(), blas=state)

    with structlog.testing.capture_logs() as logs, anyio.fail_after(30):
        async with Scheduler(engine_factory=build) as s:
            stats = s.stats()
            text = s.metrics_text()
    assert (stats.blas, stats.blas_note) == ("bundled", state.reason)
    assert "mlx_scheduler_cpu_blas_openblas 0.0" in text
    warned = [e for e in logs if e["event"] == "cpu_blas_bundled"]
    assert len(warned) == 1 and warned[0]["reason"] == state.reason and warned[0]["log_level"] == "warning"

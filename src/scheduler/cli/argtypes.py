"""argparse value types that say what they expected, shared by every subcommand."""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING, TypeVar

if TYPE_CHECKING:
    from collections.abc import Callable

N = TypeVar("N", int, float)


def bounded(
    convert: Callable[[str], N], what: str, *, low: float | None = None, high: float | None = None
) -> Callable[[str], N]:
    """A type that converts with `convert` and accepts `low <= value <= high`; errors read
    "expected <what>, got <text>"."""

    def parse(text: str) -> N:
        try:
            value = convert(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}") from None
        if not ((low is None or value >= low) and (high is None or value <= high)):
            raise argparse.ArgumentTypeError(f"expected {what}, got {text}")
        return value

    return parse


positive_int = bounded(int, "a positive integer", low=1)
non_negative_float = bounded(float, "a number >= 0", low=0)
port = bounded(int, "a port in [0, 65535]", low=0, high=65535)
seconds = bounded(float, "seconds >= 0", low=0)

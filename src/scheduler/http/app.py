"""Deprecated: use `scheduler.serving.http.app`. This path will be removed in 0.3."""

import warnings

from scheduler.serving.http.app import create_app

warnings.warn(
    "scheduler.http.app moved to scheduler.serving.http.app; the old path will be removed in 0.3",
    DeprecationWarning,
    stacklevel=2,
)

__all__ = ["create_app"]

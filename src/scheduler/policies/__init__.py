"""The built-in scheduling policies (fcfs, priority, sjf, fair (VTC), edf) and the registry of
names that `[scheduler] policy` picks from, custom `package.module:Class` policies included."""

from __future__ import annotations

import importlib
import re
from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol

from scheduler.policies.fair import Fair
from scheduler.policies.queues import EDF, FCFS, SJF, Hooks, Priority, expected_work
from scheduler.policy import Policy

if TYPE_CHECKING:
    from collections.abc import Mapping

__all__ = [
    "EDF", "FCFS", "POLICIES", "SJF", "Fair", "Hooks", "Priority", "check_name", "expected_work",
    "make_policy",
]


# ---- the registry ----------------------------------------------------------------------------
# What the factories read of `[scheduler]`, as protocols, so this module needs no import of config.
class _SJFOptions(Protocol):
    @property
    def max_wait_s(self) -> float: ...


class _TenantOptions(Protocol):
    @property
    def weight(self) -> float: ...


class _FairOptions(Protocol):
    @property
    def input_weight(self) -> float: ...
    @property
    def output_weight(self) -> float: ...
    @property
    def default_weight(self) -> float: ...
    @property
    def tenants(self) -> Mapping[str, _TenantOptions]: ...


class _EDFOptions(Protocol):
    @property
    def default_deadline_s(self) -> float | None: ...


class PolicyOptions(Protocol):
    """The `[scheduler]` section as the registry reads it (`SchedulingSection` is one)."""

    @property
    def policy(self) -> str: ...
    @property
    def sjf(self) -> _SJFOptions: ...
    @property
    def fair(self) -> _FairOptions: ...
    @property
    def edf(self) -> _EDFOptions: ...
    @property
    def custom(self) -> Mapping[str, object]: ...


PolicyFactory = Callable[["PolicyOptions | None"], "Policy"]
"""Builds a policy from the `[scheduler]` section's option tables; None: the class defaults."""


def _fair(o: PolicyOptions | None) -> Policy:
    if o is None:
        return Fair()
    f = o.fair
    return Fair(
        input_weight=f.input_weight, output_weight=f.output_weight, default_weight=f.default_weight,
        weights={tenant: t.weight for tenant, t in f.tenants.items()},
    )


POLICIES: dict[str, PolicyFactory] = {
    "fcfs": lambda o: FCFS(),
    "priority": lambda o: Priority(),
    "sjf": lambda o: SJF() if o is None else SJF(max_wait_s=o.sjf.max_wait_s),
    "fair": _fair,
    "edf": lambda o: EDF() if o is None else EDF(default_deadline_s=o.edf.default_deadline_s),
}
_DOTTED = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$")
_PROTOCOL_METHODS = (
    "push", "peek", "pop", "remove", "__len__", "on_admitted", "on_tokens", "on_finished", "victim",
)


def check_name(name: str) -> None:
    """The one policy-name check: a registry name or `package.module:Class`, else ValueError."""
    if name not in POLICIES and not _DOTTED.match(name):
        raise ValueError(
            f"unknown policy {name!r}; known policies: {', '.join(POLICIES)}, "
            "or a dotted path 'package.module:Class'"
        )


def make_policy(config: str | PolicyOptions) -> Policy:
    """A policy from the `[scheduler]` section (or a bare name, with default options): a registry
    name or `package.module:Class`, built with `[scheduler.custom]` as keyword arguments."""
    name = config if isinstance(config, str) else config.policy
    options = None if isinstance(config, str) else config
    check_name(name)
    if name in POLICIES:
        return POLICIES[name](options)
    module_name, _, class_name = name.partition(":")
    try:
        cls = getattr(importlib.import_module(module_name), class_name)
    except (ImportError, AttributeError) as exc:
        raise ValueError(f"cannot load policy {name!r}: {exc}") from exc
    if not callable(cls):
        raise ValueError(f"policy {name!r} is not a class, got {type(cls).__name__}")
    custom = dict(options.custom) if options is not None else {}
    try:
        policy = cls(**custom)
    except TypeError as exc:
        given = ", ".join(custom) or "none"
        raise ValueError(
            f"policy {name!r} cannot be built with the options of [scheduler.custom] ({given}): {exc}"
        ) from exc
    if not isinstance(policy, Policy):
        missing = [m for m in _PROTOCOL_METHODS if not callable(getattr(policy, m, None))]
        raise ValueError(f"policy {name!r} does not implement the Policy protocol; missing: {missing}")
    return policy

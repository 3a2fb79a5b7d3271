"""Prometheus text from several replicas merged into one exposition, each sample labelled with
its replica (one HELP and TYPE per family, as the format requires)."""

from __future__ import annotations

import re

_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{)?(.*)$")


def label_replica(text: str, replica: str) -> str:
    """Every sample of `text` with `replica="<replica>"` as its first label."""
    label = f'replica="{_escape(replica)}"'
    out: list[str] = []
    for line in text.splitlines():
        m = _SAMPLE.match(line)
        if line.startswith("#") or m is None:
            out.append(line)
        elif m.group(2):
            rest = m.group(3)
            out.append(f"{m.group(1)}{{{label}{'' if rest.startswith('}') else ','}{rest}")
        else:
            out.append(f"{m.group(1)}{{{label}}}{m.group(3)}")
    return "\n".join(out) + "\n"


def merge(texts: list[str]) -> str:
    """One exposition from several: each family's HELP and TYPE once, then its samples from all."""
    order: list[str] = []
    heads: dict[str, list[str]] = {}
    samples: dict[str, list[str]] = {}
    for text in texts:
        family = ""
        for line in text.splitlines():
            if not line.strip():
                continue
            if line.startswith(("# HELP ", "# TYPE ")):
                family = line.split()[2]
                if family not in heads:
                    order.append(family)
                    heads[family], samples[family] = [], []
                if len(heads[family]) < 2 and line not in heads[family]:
                    heads[family].append(line)
                continue
            if family not in heads:
                order.append(family)
                heads[family], samples[family] = [], []
            samples[family].append(line)
    lines = [line for f in order for line in heads[f] + samples[f]]
    return "\n".join(lines) + "\n"


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")

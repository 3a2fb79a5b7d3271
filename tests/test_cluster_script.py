"""`benchmarks/cluster.py`'s ratios of two replicas to one: each pair of deployments on its own."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tests.scripts import load_script

SCRIPT = Path(__file__).resolve().parent.parent / "benchmarks" / "cluster.py"


def row(pair: int, replicas: int, tok_s: float, frontends: str | int = "auto", processes: int = 1) -> dict[str, Any]:
    return {"pair": pair, "replicas": replicas, "frontends": frontends, "connections": None,
            "frontend_processes": processes, "tokens_per_s": tok_s, "variant": f"{replicas} replica(s)"}


def test_each_pair_is_its_own_ratio_and_the_median_is_printed() -> None:
    cluster = load_script(SCRIPT, "cluster_script")
    # One replica drifts (6,000 then 9,000 tok/s); two replicas hold at 12,000.
    rows = [row(0, 1, 6000), row(0, 2, 12000), row(1, 1, 9000), row(1, 2, 12000), row(2, 1, 8000), row(2, 2, 12000)]
    lines = cluster.speedups(rows, 3)
    assert [r["speedup"] for r in rows if r["replicas"] == 2] == [2.0, 12000 / 9000, 1.5]
    assert "pair 1 of 3: 2.00x" in lines[0] and "pair 2 of 3: 1.33x" in lines[1]
    assert lines[-1].endswith("2.00, 1.33, 1.50x; median 1.50x")


def test_one_pair_prints_no_pair_count_and_compares_with_the_fewest_frontends() -> None:
    cluster = load_script(SCRIPT, "cluster_script")
    rows = [row(0, 1, 5000, 1, 1), row(0, 1, 6000, 2, 2), row(0, 2, 11000, 1, 1), row(0, 2, 12000, 2, 2)]
    lines = cluster.speedups(rows, 1)
    assert [r["speedup"] for r in rows if r["replicas"] == 2] == [11000 / 5000, 2.0]
    assert rows[3]["speedup_vs_fewest_frontends"] == 12000 / 5000
    assert len(lines) == 2 and "pair" not in " ".join(lines)


def test_in_flight_imbalance_is_time_weighted_and_counts_an_idle_replica() -> None:
    cluster = load_script(SCRIPT, "cluster_script")
    # 0-10 s: one request on each replica; 10-20 s: three on a, none on b.
    spans = [(0.0, 10.0, "a"), (0.0, 10.0, "b"), (10.0, 20.0, "a"), (10.0, 20.0, "a"), (10.0, 20.0, "a")]
    mean, worst = cluster.imbalance(spans, 2)
    assert worst == 3 and abs(mean - 1.5) < 1e-9  # 0 for 10 s, 3 for 10 s
    # Every request on one replica of two: the other, with none, counts.
    mean, worst = cluster.imbalance([(0.0, 4.0, "a"), (0.0, 4.0, "a")], 2)
    assert (mean, worst) == (2.0, 2)
    assert cluster.imbalance([(0.0, 4.0, "a")], 1) == (0.0, 0)  # one replica: nothing to spread

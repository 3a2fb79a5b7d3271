"""Smoke test of `benchmarks/kv_pool.py --quick`: it runs, and its checks hold (no figures)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

from tests import scripts

if TYPE_CHECKING:
    from types import ModuleType

SCRIPT = Path(__file__).resolve().parent.parent / "benchmarks" / "kv_pool.py"


def load_script() -> ModuleType:
    # Not as `kvpool`: that name is the package the script measures.
    return scripts.load_script(SCRIPT, "kvpool_benchmark")


@pytest.mark.integration
def test_quick_run(tmp_path: Path, model_cache: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bench = load_script()
    out = tmp_path / "kvpool.json"
    png = tmp_path / "kvpool.png"
    bench.main(["--quick", "--model", "synthetic:small", "--cache-dir", str(model_cache),
                "--out", str(out), "--png", str(png)])
    printed = capsys.readouterr().out
    assert "(a) prefix reuse" in printed and "(b) memory modes" in printed and "(c) sessions" in printed
    assert "(d) books per layer kind" in printed
    results: dict[str, Any] = json.loads(out.read_text())["results"]
    a, b, c = results["a"], results["b"], results["c"]
    for run in a["runs"].values():
        assert run["check"]["ok"], run["check"]
    assert a["summary"]["burst"]["outputs_identical"]
    assert a["runs"]["burst/reuse"]["prefix_hit_tokens"] > 0
    assert a["runs"]["burst/no-reuse"]["prefix_hit_tokens"] == 0
    for run in b["runs"].values():
        assert run["check"]["ok"], run["check"]  # one final chunk each, none lost
        assert run["idle_after"] == {"running": 0, "waiting": 0, "engine_batch": 0, "blocks_used": 0}
    assert b["summary"]["outputs_identical"]
    assert b["runs"]["reserve"]["preemptions"] == 0
    assert c["summary"]["outputs_identical"]
    assert c["runs"]["session"]["session_hits"] == len(c["runs"]["session"]["turns"]) - 1
    assert c["runs"]["session"]["dropped"] is True
    for model in results["d"].values():
        assert model["outputs_identical"]
        for run in model["runs"].values():
            assert (run["lost"], run["idle_blocks_used"]) == (0, 0)
    if png.exists():  # matplotlib is optional
        assert png.stat().st_size > 0


def test_books_benchmark_runs_on_full_caches(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`benchmarks/books.py` runs: Reserve/Release on books with 0 and 500 cached entries leaves
    every entry in place and the invariants whole (it checks both); no figures asserted."""
    bench = scripts.load_script(SCRIPT.parent / "books.py", "books_benchmark")
    out = tmp_path / "books.json"
    bench.main(["--reps", "50", "--entries", "0", "500", "--out", str(out)])
    rows = json.loads(out.read_text())["rows"]
    assert [r["entries"] for r in rows] == [0, 500]
    assert all(r["median_us"] > 0 for r in rows)
    assert "median µs" in capsys.readouterr().out

"""`mlx-scheduler demo`'s live line: what a user watching a burst on a small CPU is told."""

from __future__ import annotations

from scheduler.cli.bench.targets import Record
from scheduler.cli.demo import progress_line


def test_the_progress_line_counts_the_bursts_own_first_tokens_and_tokens() -> None:
    records = [Record(prompt_tokens=0, max_tokens=48) for _ in range(4)]
    # Every prompt still prefilling: nothing started, no tokens, whatever came before the burst.
    line = progress_line(6.0, records, running=4, waiting=0)
    assert "done    0/4" in line and "first tokens    0" in line and "tokens      0" in line
    records[0].arrived(1, 0.0, 0.0)
    records[0].arrived(1, 0.0, 0.0)
    records[1].arrived(1, 0.0, 0.0)
    records[1].finish_reason = "stop"
    line = progress_line(8.0, records, running=3, waiting=0)
    assert "done    1/4" in line and "first tokens    2" in line and "tokens      3" in line
    assert line.endswith("0.4 tok/s")

"""PNG plots of benchmark reports (needs matplotlib: `pip install 'mlx-scheduler[bench]'`)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pathlib import Path

    from scheduler.cli.bench.report import Report

INSTALL_HINT = "--plot needs matplotlib; install it with: pip install 'mlx-scheduler[bench]'"


def require_matplotlib() -> None:
    """Raise `RuntimeError` with an install hint when matplotlib is missing (check before a run)."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise RuntimeError(INSTALL_HINT) from None


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")  # files only; never a window
    import matplotlib.pyplot as plt

    return plt


def latency_cdfs(reports: list[Report], path: Path) -> Path:
    """TTFT, TPOT, ITL and end-to-end latency CDFs, one line per report."""
    plt = _pyplot()
    fig, axes = plt.subplots(2, 2, figsize=(11, 7.5))
    series = (("TTFT", "ttfts"), ("TPOT", "tpots"), ("ITL", "itls"), ("End-to-end latency", "e2els"))
    for ax, (title, field) in zip(axes.flat, series, strict=True):
        for r in reports:
            values = sorted(v * 1e3 for v in getattr(r.details, field))
            if values:
                ys = [(i + 1) / len(values) for i in range(len(values))]
                ax.step(values, ys, where="post", label=r.label)
        ax.set_title(title)
        ax.set_xlabel("ms")
        ax.set_ylabel("fraction of samples")
        ax.grid(alpha=0.3)
    axes.flat[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def load_sweep(reports: list[Report], path: Path, *, x_label: str) -> Path:
    """Output throughput and p99 TTFT against offered load (unbounded rates are left out)."""
    plt = _pyplot()
    points = sorted((r.offered, r) for r in reports if r.offered is not None)
    xs = [x for x, _ in points]
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    left.plot(xs, [r.output_throughput for _, r in points], marker="o")
    left.set_title("Output token throughput")
    left.set_ylabel("tokens/s")
    right.plot(xs, [r.ttft_ms.p99 for _, r in points], marker="o", color="tab:red")
    right.set_title("p99 TTFT")
    right.set_ylabel("ms")
    for r in reports:
        if r.offered is None:  # an unbounded rate has no x: a dashed level instead
            left.axhline(r.output_throughput, ls="--", color="gray", label="all at once")
            right.axhline(r.ttft_ms.p99, ls="--", color="gray", label="all at once")
            left.legend(fontsize=8)
    for ax in (left, right):
        ax.set_xlabel(x_label)
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path

"""Whether MLX still takes the scheduler's CUDA settings after a first start converted its model.

MLX reads its `MLX_*` settings once, at its first GPU use, and the worker sets them (CUDA graphs
and cuDNN's attention off for models that do not stay quantized) only once it knows the model's
directory. On a machine's first start that directory is made by converting a GGUF file (the
default model is one), so the conversion runs before the settings. It runs on MLX's CPU stream;
this checks that it leaves the settings unread: in a fresh process for each way, it converts
`--model` (a named model or a .gguf path) into a temporary cache, applies the settings as the
worker does, runs a few matrix products on the GPU and counts MLX's CUDA graph calls with
PyTorch's profiler (none when graphs are off, as the settings ask for this model):

- `cpu`: the conversion as it runs;
- `gpu`: its operations moved to the GPU's stream, as they ran before 2026-11-28.

Needs MLX's CUDA build with PyTorch beside it (the device machines' image).

    python benchmarks/settings_read.py --model smollm2-135m
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

WAYS = ("cpu", "gpu")


def one(model: str, way: str, cache: str) -> dict[str, object]:
    # First: OpenBLAS (workers/blas.py) binds only if it is loaded before MLX.
    import workers  # noqa: F401

    # isort: split
    import mlx.core as mx

    from workers.cuda import apply_cuda_defaults, mlx_used
    from workers.loading.models import resolve_model
    from workers.loading.named import NAMED_MODELS, named_gguf

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from cuda_api import api_calls

    source = str(named_gguf(model)) if model in NAMED_MODELS else model  # the download: no MLX
    used_before = mlx_used()
    if way == "gpu":
        plain = mx.stream
        mx.stream = lambda s: plain(mx.gpu)  # type: ignore[assignment,misc]
    directory = resolve_model(source, cache)
    applied = apply_cuda_defaults("auto", directory, cache, used_before=used_before)
    with api_calls() as calls:
        x = mx.ones((256, 256))
        for _ in range(20):
            x = (x @ x) * 0.001
            mx.eval(x)
    graph_calls = {k: v for k, v in calls.count.items() if "Graph" in k}
    return {"way": way, "applied": applied, "graph_launches": graph_calls.get("cudaGraphLaunch", 0),
            "graph_calls": sum(graph_calls.values())}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m", help="a named model or a .gguf path")
    ap.add_argument("--way", choices=WAYS, help=argparse.SUPPRESS)  # one fresh process's run
    ap.add_argument("--cache", help=argparse.SUPPRESS)
    ap.add_argument("--out", default="benchmarks/results/settings_read.json")
    args = ap.parse_args()
    if args.way:
        print(json.dumps(one(args.model, args.way, args.cache)))
        return
    import workers  # noqa: F401  (OpenBLAS before MLX)
    from workers.loading.dtypes import on_cuda

    if not on_cuda():
        raise SystemExit("settings_read.py checks MLX's CUDA settings: it needs MLX's CUDA build on a GPU")
    rows = []
    for way in WAYS:
        with tempfile.TemporaryDirectory() as cache:
            done = subprocess.run([sys.executable, "-P", __file__, "--model", args.model, "--way", way, "--cache", cache],
                                  capture_output=True, text=True, check=True)
        rows.append(json.loads(done.stdout.strip().splitlines()[-1]))
    print(f"\n{args.model}: the conversion, then the settings, then 20 products on the GPU")
    print(f"{'conversion on':<14} {'graphs off asked':>16} {'graph launches':>15} {'graph calls':>12}")
    for r in rows:
        asked = r["applied"].get("MLX_USE_CUDA_GRAPHS") == "0"  # type: ignore[union-attr]
        print(f"{r['way']:<14} {str(asked):>16} {r['graph_launches']:>15} {r['graph_calls']:>12}")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"model": args.model, "rows": rows}, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()

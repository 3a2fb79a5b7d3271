"""`benchmarks/carry_graph.py` on a narrow four-layer llama (CPU): a chunk spread over steps adds a
share of what carrying it whole adds to a decode step's graph, and its attention runs once a layer
either way."""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx

from tests.scripts import load_script

SCRIPT = Path(__file__).resolve().parent.parent / "benchmarks" / "carry_graph.py"


def test_each_share_adds_a_share_of_the_whole_carry_and_the_chunk_is_attended_once_a_layer() -> None:
    bench = load_script(SCRIPT, "carry_graph_script")
    model = bench.narrow("llama-4")
    got = bench.counts(model, 8, 3, [2, 4], 16)
    (mlx_lm,), (decode,), (whole,) = got["mlx-lm decode"], got["decode"], got["whole"]
    assert decode < mlx_lm < whole  # the 2-D pass drops the reshapes around each projection
    for passes in (2, 4):
        shares = got[f"spread {passes}"]
        assert len(shares) == passes
        assert all(decode < share < whole for share in shares)
        assert sum(shares) - passes * decode >= whole - decode  # nothing of the chunk left out
    caches = bench.decoding(model, 8)
    per_step = bench.primitives([bench.flat_decode(model, mx.array([[3]] * 8), caches)])["Softmax"]
    alone = bench.carried(model, 8, 3, 1, 16)[0]["Softmax"] - per_step
    spread = sum(c["Softmax"] for c in bench.carried(model, 8, 3, 4, 16)) - 4 * per_step
    # The chunk's attention, a softmax in each layer but the last (which only stores its keys).
    assert per_step == 4 and alone == spread == 3

"""The benchmark's pieces: NumPy twins, byte counts, and one tiny run."""

from __future__ import annotations

import json

import numpy as np
import pytest

from kpool_cases import F32, TOLERANCE
from mla_kpool import bench
from mla_kpool import reference as ref
from mla_kpool.__main__ import main

CASES = [
    bench.Case(op, dtype, batch, kpool, 16, "cpu")
    for op in bench.OPS
    for dtype in ("float32", "bfloat16")
    for batch, kpool in ((1, 4), (5, 16), (3, 1))
]


@pytest.mark.parametrize(
    "case", CASES, ids=lambda c: f"{c.op}-{c.dtype}-b{c.batch}-k{c.kpool}"
)
def test_numpy_twin_matches_the_oracle(case):
    """The NumPy time is only meaningful if the twin computes the op."""
    w = bench.make_workload(case, seed=3)
    args = (w.input_row_offsets, w.cache_lengths)
    scale = float(np.abs(w.k.astype(F32)).max(initial=1.0))
    tol = TOLERANCE[np.dtype(w.k.dtype)] * scale
    # Both step paths (fused and three-op) share one workload and twin.
    op = "step" if case.op == "step3" else case.op
    if op in ("ring_close", "step"):
        pooled, closed = bench.numpy_ring_close(w, case.kpool)
        want, want_closed = ref.ring_close(
            w.ring, w.k, w.gate, w.ape, *args, w.slot_idx, case.kpool
        )
        np.testing.assert_array_equal(closed, want_closed)
        np.testing.assert_allclose(pooled.astype(np.float64), want, atol=tol)
    if op in ("compress", "step"):
        pooled = bench.numpy_compress(w, case.kpool)
        want = ref.compress(
            w.k,
            w.gate,
            w.ape,
            w.input_row_offsets,
            w.pool_row_offsets,
            w.cache_lengths,
            case.kpool,
        )
        np.testing.assert_allclose(pooled.astype(np.float64), want, atol=tol)
    if op in ("seed_tail", "step"):
        ring = w.ring.copy()
        bench.numpy_seed_tail(w, case.kpool, ring)
        want = ref.seed_tail(w.ring, w.k, w.gate, *args, w.slot_idx, case.kpool)
        np.testing.assert_array_equal(ring.view(np.uint8), want.view(np.uint8))


@pytest.mark.parametrize("op", bench.OPS)
def test_workload_does_what_the_docstring_says(op):
    """Every request closes / builds / stashes exactly what the byte count
    assumes (checked with the oracle's own pool arithmetic)."""
    kpool, batch = 16, 6
    w = bench.make_workload(bench.Case(op, "float32", batch, kpool, 8, "cpu"))
    pools = ref.pool_row_offsets(w.input_row_offsets, w.cache_lengths, kpool)
    _, closed = ref.ring_close(
        w.ring,
        w.k,
        w.gate,
        w.ape,
        w.input_row_offsets,
        w.cache_lengths,
        w.slot_idx,
        kpool,
    )
    n = np.diff(w.input_row_offsets.astype(np.int64))
    pending = w.cache_lengths.astype(np.int64) % kpool
    step = {"step": 1, "step3": 1}
    closes = {"ring_close": 1, "compress": 0, "seed_tail": 0, **step}[op]
    builds = {"ring_close": 0, "compress": 1, "seed_tail": 0, **step}[op]
    assert ((closed >= 0) == bool(closes)).all()
    np.testing.assert_array_equal(np.diff(pools), builds)
    assert sorted(w.slot_idx.tolist()) == list(range(batch))
    # Stashed tokens: what is left after the last complete pool.
    left = (w.cache_lengths.astype(np.int64) + n) % kpool
    want_left = {"ring_close": 0, "compress": 0, "seed_tail": kpool - 1}
    assert (left == want_left.get(op, kpool // 2)).all()
    assert (pending == (kpool // 2 if closes else 0)).all()


def test_op_bytes_ring_close_by_hand():
    # batch 2, kpool 4, head_dim 8, float32: r = 2 ring members and 2 new
    # tokens per request, keys and gates: 2 * (2 + 2) rows of 32 bytes read,
    # one 32-byte pooled row and a 4-byte id written; ape 4 * 8 * 4 bytes.
    case = bench.Case("ring_close", "float32", 2, 4, 8, "cpu")
    assert bench.op_bytes(case) == 2 * (2 * 4 * 32 + 32 + 4) + 128


def test_tiny_bench_run_writes_its_json(tmp_path):
    """End to end through the CLI on the smallest configuration."""
    out = tmp_path / "bench.json"
    status = main(
        [
            "bench",
            "--ops",
            "ring_close",
            "--dtypes",
            "float32",
            "--batches",
            "3",
            "--kpools",
            "4",
            "--min-seconds",
            "0.01",
            "--json",
            str(out),
        ]
    )
    assert status == 0
    (record,) = json.loads(out.read_text())
    for key in (
        "op",
        "device",
        "dtype",
        "batch",
        "kpool",
        "head_dim",
        "median_us",
        "bytes",
        "gbps",
        "numpy_median_us",
        "floor_median_us",
        "memcpy_gbps",
    ):
        assert key in record
    assert record["op"] == "ring_close" and record["batch"] == 3
    assert record["bytes"] == bench.op_bytes(
        bench.Case("ring_close", "float32", 3, 4, 128, "cpu")
    )
    assert record["median_us"] > 0 and record["floor_median_us"] > 0
    assert record["gbps"] == pytest.approx(
        record["bytes"] / record["median_us"] / 1e3
    )

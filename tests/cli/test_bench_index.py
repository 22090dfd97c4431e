"""The bench's index_top_k: workloads, NumPy and BLAS peers, GPU peaks,
a tiny run; and NumPy's BLAS environment."""

from __future__ import annotations

import json
import sys

import ml_dtypes
import numpy as np
import pytest
from max import driver

from mla_kpool import bench
from mla_kpool import reference as ref
from mla_kpool.__main__ import main
from mla_kpool.bench import blas, index
from mla_kpool.index_cache import PagedIndexCache
from support.bench_helpers import cases, head_commit, legend_lines, table_cells


def test_bench_restarts_without_the_slow_blas_variables(monkeypatch):
    """The command line re-executes itself without OPENBLAS_CORETYPE and
    OPENBLAS_L2_SIZE, marking what it unset; with neither set it goes on."""
    calls = []

    def execve(path, argv, env):
        calls.append((path, argv, env))

    env = {"OPENBLAS_CORETYPE": "Prescott", "OPENBLAS_L2_SIZE": "1", "A": "1"}
    argv = ["python", "-m", "mla_kpool", "bench", "--ops", "index_top_k"]
    blas.reexec_without_slow_blas(env, argv, execve)
    ((path, new_argv, new_env),) = calls
    assert path == sys.executable
    assert new_argv == [sys.executable, *argv[1:]]
    assert "OPENBLAS_CORETYPE" not in new_env and new_env["A"] == "1"
    assert "OPENBLAS_L2_SIZE" not in new_env
    assert new_env[blas.UNSET_MARKER] == (
        "OPENBLAS_CORETYPE=Prescott;OPENBLAS_L2_SIZE=1"
    )
    calls.clear()
    blas.reexec_without_slow_blas({"A": "1"}, argv, execve)
    assert calls == []
    # Tests call main(argv): never re-executed, whatever the environment.
    monkeypatch.setenv("OPENBLAS_L2_SIZE", "1")
    monkeypatch.setattr(blas, "reexec_without_slow_blas", execve)
    with pytest.raises(SystemExit):
        main(["bench", "--help"])
    assert calls == []


def test_blas_info_names_the_kernel(monkeypatch):
    """NumPy's BLAS library, kernel and threads, from threadpoolctl or
    OpenBLAS itself; and what the command line unset."""
    monkeypatch.setenv(blas.UNSET_MARKER, "OPENBLAS_CORETYPE=Prescott")
    # Whatever the machine sets, this test's environment is the one below.
    monkeypatch.delenv("OPENBLAS_CORETYPE", raising=False)
    monkeypatch.setenv("OPENBLAS_L2_SIZE", "1")
    info = blas.blas_info()
    assert info["blas_unset"] == "OPENBLAS_CORETYPE=Prescott"
    assert info["blas_env"] == {"OPENBLAS_L2_SIZE": "1"}
    config = np.show_config(mode="dicts")["Build Dependencies"]["blas"]
    if "openblas" in config["name"]:
        found = info["blas"]
        assert found["internal_api"] == "openblas"
        assert found["architecture"] and found["num_threads"] >= 1
        assert found["version"] == config["version"]


# --------------------------------------------------------------------------
# index_top_k: the workloads, the NumPy peers, a run
# --------------------------------------------------------------------------


def _tiny_index(
    shape: index.IndexShape, offsets, lengths, seed: int = 0
) -> index.IndexWorkload:
    """A small index workload: every request's visible pools stored (and
    one pool past them holding other bytes), pages shuffled."""
    rng = np.random.default_rng(seed)
    offsets = np.asarray(offsets, np.uint32)
    lengths = np.asarray(lengths, np.uint32)
    n = np.diff(offsets.astype(np.int64))
    pools = (lengths + n) // shape.kpool + 1
    per_pool = shape.depth // shape.width
    pages = int(-(-pools.max() * per_pool // shape.page_size))
    cache = PagedIndexCache(
        num_blocks=len(lengths) * pages,
        num_layers=2,
        page_size=shape.page_size,
        head_dim=shape.depth,
        kpool=shape.kpool,
        width=shape.width,
        batch=len(lengths),
        max_pages=pages,
        fill=0x7F,
    )
    cache.map_pages(rng, separate=True)
    cache.cache_lengths[:] = lengths
    for b, count in enumerate(pools):
        keys = rng.standard_normal((int(count), shape.depth), np.float32)
        keys[rng.random(int(count)) < 0.1] *= 0  # zero keys: scale 0
        cache.store_keys(b, 1, 0, keys)
    q = rng.standard_normal((int(offsets[-1]), shape.heads, shape.depth))
    qs = rng.standard_normal((int(offsets[-1]), shape.heads))
    return index.IndexWorkload(
        shape=shape,
        q=q.astype(ml_dtypes.float8_e4m3fn).view(np.uint8),
        qs=qs.astype(np.float32),
        input_row_offsets=offsets,
        cache=cache,
        layer=1,
    )


def _index_oracle_check(w: index.IndexWorkload, got: np.ndarray):
    ops = w.cache.oracle_operands()
    return ref.check_selection(
        got,
        w.q,
        w.qs,
        w.input_row_offsets,
        ops["k_blocks"],
        ops["k_cache_lengths"],
        ops["k_lookup_table"],
        ops["k_scales"],
        ops["k_scales_lookup_table"],
        w.layer,
        top_k=w.shape.top_k,
        kpool=w.shape.kpool,
        mask=w.mask,
    )


@pytest.mark.parametrize(
    "shape",
    [
        index.IndexShape(4, 16, 4, 6, 4, 8, True),  # spread, causal
        index.IndexShape(4, 16, 4, 6, 4, 8, False),  # spread, null
        index.IndexShape(3, 16, 2, 5, 16, 4, True),  # whole
        index.IndexShape(2, 8, 1, 3, 8, 4, False),  # kpool 1
    ],
    ids=["spread-causal", "spread-null", "whole", "kpool1"],
)
def test_numpy_index_twin_matches_the_oracle(shape):
    """The twin's rows are the oracle's selection (sets at the k-th score),
    chunked or not: decode rows, a prefill from zero, bound < k, bound 0,
    an empty request."""
    w = _tiny_index(shape, [0, 1, 1, 40, 41, 45], [50, 9, 0, 3, 0])
    for chunk in (256, 7):
        cache = w.cache
        got = index.numpy_index_top_k(
            w.q,
            w.qs,
            w.input_row_offsets,
            cache.cache_lengths,
            cache.blocks(),
            cache.scales(),
            cache.lookup_table,
            cache.scales_lookup_table,
            layer=1,
            top_k=shape.top_k,
            kpool=shape.kpool,
            causal=shape.causal,
            chunk=chunk,
        )
        report = _index_oracle_check(w, got)
        assert report.rows == 45 and report.cut_rows > 0


def test_index_workloads_are_glm5_next_decode_and_prefill():
    decode = index.make_index_workload("decode")
    assert decode.shape == index.GLM5_NEXT
    assert decode.q.shape == (16, 32, 128) and decode.q.dtype == np.uint8
    assert decode.qs.shape == (16, 32)
    assert decode.input_row_offsets.tolist() == list(range(17))
    assert set(decode.cache.cache_lengths.tolist()) == {32767}
    assert decode.candidates == 16 * 8192
    assert (
        index.score_flops(
            decode.input_row_offsets, decode.cache.cache_lengths, decode.shape
        )
        == 2 * 16 * 8192 * 32 * 128
    )
    # Every request's pages are its own blocks.
    assert len(set(decode.cache.lookup_table.ravel().tolist())) == 16 * 256
    prefill = index.make_index_workload("prefill")
    assert prefill.input_row_offsets.tolist() == [0, 4096]
    assert prefill.cache.cache_lengths.tolist() == [0]
    assert prefill.candidates == sum((i + 1) // 4 for i in range(4096))
    # The stored keys are the producer's: the oracle reads them back.
    head = index.IndexWorkload(
        prefill.shape,
        prefill.q[:600],
        prefill.qs[:600],
        np.array([0, 600], np.uint32),
        prefill.cache,
    )
    assert _index_oracle_check(head, index.numpy_twin(head)()).rows == 600


def test_the_long_prefill_phase_counts_its_triangle():
    # 16,384 causal tokens from an empty cache: token i sees (i + 1) // 4
    # of 4,096 pools, 33,550,336 candidates in all.
    assert index.INDEX_PHASES["prefill-16k"] == (1, 0, 16384)
    offsets = np.array([0, 16384], np.uint32)
    lengths = np.array([0], np.uint32)
    seen = index.bounds(offsets, lengths, 4, True)
    assert seen[0] == 0 and seen[3] == 1 and seen[-1] == 4096
    assert int(seen.sum()) == 33_550_336
    shape = index.GLM5_NEXT
    assert index.score_flops(offsets, lengths, shape) == (
        2 * 33_550_336 * 32 * 128
    )
    # The last row's 4,096 keys and scales, the queries, the output.
    assert index.index_bytes(offsets, lengths, shape) == (
        4096 * 132 + 16384 * 32 * 132 + 16384 * 512 * 4
    )


def test_blas_peer_makes_the_twins_matmuls():
    shape = index.GLM5_NEXT
    call, flops = index.blas_matmul(
        np.array([0, 1, 2], np.uint32), np.array([399, 99], np.uint32), shape
    )
    assert flops == 2 * 32 * 128 * (100 + 25)
    call()
    _, flops = index.blas_matmul(
        np.array([0, 300], np.uint32), np.array([0], np.uint32), shape
    )
    # Chunks of 256 rows: up to bound 64, then 44 rows up to bound 75.
    assert flops == 2 * 128 * (256 * 32 * 64 + 44 * 32 * 75)


def test_index_top_k_cases_and_graphs():
    """--ops index_top_k: the three phases, one graph, whatever the grid."""
    todo = cases("--ops", "index_top_k", "--batches", "3")
    assert [(c.op, c.phase, c.batch, c.kpool, c.head_dim) for c in todo] == [
        ("index_top_k", "decode", 16, 4, 128),
        ("index_top_k", "prefill", 1, 4, 128),
        ("index_top_k", "prefill-16k", 1, 4, 128),
    ]
    assert bench.graphs_to_compile(todo) == 1
    both = cases("--ops", "step", "index_top_k", "--batches", "3")
    assert [c.op for c in both] == ["step"] + ["index_top_k"] * 3
    assert bench.graphs_to_compile(both) == 3
    assert "index_top_k" not in {c.op for c in cases("--sweep")}


def test_index_bytes_counts_each_requests_keys_once():
    # Two requests: 5 cached + 3 new and 0 cached + 4 new, kpool 2, causal.
    # Bounds: (5+3-2)//2 3, 3, (5+3-0)//2 4; (0+4-3)//2 0, 1, 1, 2. The
    # last rows see 4 and 2 pools: (4 + 2) * (D + 4) key and scale bytes.
    shape = index.IndexShape(
        heads=2, depth=8, kpool=2, top_k=3, width=4, page_size=4, causal=True
    )
    offsets = np.array([0, 3, 7])
    lengths = np.array([5, 0])
    assert index.index_bytes(offsets, lengths, shape) == (
        6 * 12 + 7 * 2 * 12 + 7 * 3 * 4
    )


def test_gpu_fractions_use_the_published_peaks():
    # 1e12 flops and 4.8e9 bytes in 1 ms on an H200: 1000 TFLOP/s of its 67
    # FP32 and 1979 FP8, 4.8 TB/s of its 4.8.
    got = bench.gpu_fractions(10**12, 48 * 10**8, 1000.0, "NVIDIA H200")
    assert got["pct_fp32_peak"] == pytest.approx(100 * 1000 / 67)
    assert got["pct_fp8_peak"] == pytest.approx(100 * 1000 / 1979)
    assert got["pct_hbm"] == pytest.approx(100.0)
    assert got["gpu_peak"]["hbm_tbps"] == 4.8
    assert bench.gpu_fractions(1, 1, 1.0, "Some GPU") == {}
    assert bench.gpu_fractions(1, 1, 1.0, None) == {}


@pytest.mark.gpu
@pytest.mark.skipif(
    driver.accelerator_count() == 0,
    reason="no accelerator (max.driver.accelerator_count() == 0)",
)
def test_tiny_index_bench_run_on_gpu(tmp_path, monkeypatch):
    """This package's GPU path timed, with the GPU's peak fractions."""
    monkeypatch.setitem(index.INDEX_PHASES, "decode", (2, 1023, 1))
    monkeypatch.setitem(index.INDEX_PHASES, "prefill", (1, 0, 300))
    monkeypatch.setitem(index.INDEX_PHASES, "prefill-16k", (1, 0, 520))
    out = tmp_path / "index.json"
    argv = ["bench", "--ops", "index_top_k", "--device", "gpu"]
    assert main([*argv, "--min-seconds", "0", "--json", str(out)]) == 0
    for r in json.loads(out.read_text()):
        assert r["device"] == "gpu" and r["median_us"] > 0
        assert r["bytes"] > 0
        if index.gpu_peak(r.get("device_name")) is not None:
            assert r["pct_fp32_peak"] > 0 and r["pct_hbm"] > 0


def test_tiny_index_bench_run(tmp_path, capsys, monkeypatch):
    """End to end on GLM-5-Next's compiled indexer, smaller calls."""
    monkeypatch.setitem(index.INDEX_PHASES, "decode", (2, 1023, 1))
    monkeypatch.setitem(index.INDEX_PHASES, "prefill", (1, 0, 300))
    # The long prefill's row, at a size a test can afford: 520 tokens,
    # more than one of the twin's and BLAS's 256-token chunks.
    monkeypatch.setitem(index.INDEX_PHASES, "prefill-16k", (1, 0, 520))
    out = tmp_path / "index.json"
    argv = ["bench", "--ops", "index_top_k", "--min-seconds", "0"]
    assert main([*argv, "--json", str(out)]) == 0
    decode, prefill, long = json.loads(out.read_text())
    assert [r["phase"] for r in (decode, prefill, long)] == [
        "decode",
        "prefill",
        "prefill-16k",
    ]
    assert decode["candidates"] == 2 * 256 and decode["tokens"] == 2
    assert prefill["candidates"] == sum((i + 1) // 4 for i in range(300))
    assert long["tokens"] == 520 and long["batch"] == 1
    assert long["candidates"] == sum((i + 1) // 4 for i in range(520))
    # The BLAS peer's chunks: 256 tokens up to bound 64, 256 up to 128,
    # 8 up to 130.
    assert long["blas_flops"] == 2 * 128 * 32 * (256 * 64 + 256 * 128 + 8 * 130)
    for r in (decode, prefill, long):
        assert r["calls"] >= bench.INDEX_MIN_CALLS
        assert r["min_us"] <= r["median_us"] <= r["max_us"]
        assert r["flops"] == 2 * r["candidates"] * 32 * 128
        assert r["gflops"] == pytest.approx(r["flops"] / r["median_us"] / 1e3)
        assert r["blas_gflops"] > 0 and r["numpy_median_us"] > 0
        assert (r["heads"], r["top_k"], r["width"], r["page_size"]) == (
            32,
            512,
            32,
            128,
        )
        assert "blas" in r and r["git_commit"] == head_commit()
    captured = capsys.readouterr()
    assert "3 configurations, 1 graph to compile" in captured.err
    head, rows = table_cells(captured.out)
    assert head[0] == "phase"
    assert [r[0] for r in rows] == ["decode", "prefill", "prefill-16k"]
    assert [r[2] for r in rows] == ["2", "300", "520"]
    # What a call held, from the run's records: GLM-5-Next's indexer.
    call = legend_lines(captured.out)[0]
    assert call.startswith("call: tokens query tokens over batch requests")
    assert "(kpool 4) with 32 heads of head_dim 128" in call
    assert call.endswith("selects the top 512.")

"""The benchmark's writers: NumPy twins, byte counts, options, a tiny
run and where a run was measured."""

from __future__ import annotations

import importlib.metadata
import itertools
import json
import os
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from max import driver

from mla_kpool import _sysinfo, bench
from mla_kpool import reference as ref
from mla_kpool.__main__ import main
from mla_kpool._paths import KERNELS, NOOP_KERNELS, compiled_kernels
from mla_kpool.bench import workload
from mla_kpool.runner import model_key
from support.bench_helpers import (
    cases,
    head_commit,
    legend_lines,
    num,
    table_cells,
)
from support.kpool_cases import F32, TOLERANCE

CASES = [
    workload.Case(op, dtype, batch, kpool, 16, "cpu")
    for op in workload.OPS
    for dtype in (
        (workload.EXPAND_DTYPE,)
        if op == "expand_topk"
        else ("float32", "bfloat16")
    )
    for batch, kpool in ((1, 4), (5, 16), (3, 1))
]
WRITERS = [op for op in workload.OPS if op != "expand_topk"]
ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize(
    "case", CASES, ids=lambda c: f"{c.op}-{c.dtype}-b{c.batch}-k{c.kpool}"
)
def test_numpy_twin_matches_the_oracle(case):
    """The NumPy time is only meaningful if the twin computes the op."""
    w = workload.make_workload(case, seed=3)
    if case.op == "expand_topk":
        got = workload.numpy_expand_topk(w, case.kpool)
        want = ref.expand_topk(
            w.pool_ids, w.input_row_offsets, w.cache_lengths, case.kpool
        )
        np.testing.assert_array_equal(got, want)
        return
    args = (w.input_row_offsets, w.cache_lengths)
    scale = float(np.abs(w.k.astype(F32)).max(initial=1.0))
    tol = TOLERANCE[np.dtype(w.k.dtype)] * scale
    # Both step paths (fused and three-op) share one workload and twin.
    op = "step" if case.op == "step3" else case.op
    if op in ("ring_close", "step"):
        pooled, closed = workload.numpy_ring_close(w, case.kpool)
        want, want_closed = ref.ring_close(
            w.tail, w.k, w.gate, w.ape, *args, w.slot_idx, case.kpool
        )
        np.testing.assert_array_equal(closed, want_closed)
        np.testing.assert_allclose(pooled.astype(np.float64), want, atol=tol)
    if op in ("compress", "step"):
        pooled = workload.numpy_compress(w, case.kpool)
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
        ring = w.tail.copy()
        workload.numpy_seed_tail(w, case.kpool, ring)
        want = ref.seed_tail(w.tail, w.k, w.gate, *args, w.slot_idx, case.kpool)
        np.testing.assert_array_equal(ring.view(np.uint8), want.view(np.uint8))


@pytest.mark.parametrize("kpool", [1, 3, 4, 16])
def test_numpy_expand_twin_skips_what_the_op_skips(kpool):
    """The twin on a selection with every kind of id the op must skip, on
    requests bringing several tokens and rows past the last offset."""
    rng = np.random.default_rng(kpool)
    new_tokens = [3, 0, 7, 1, 2 * kpool + 1]
    cache = rng.integers(0, 6 * kpool, len(new_tokens))
    offsets = np.concatenate([[0], np.cumsum(new_tokens)])
    rows, topk = int(offsets[-1]) + 2, 6
    ids = rng.integers(-3, 10, (rows, topk))
    ids[rng.random((rows, topk)) < 0.2] = 2**31 - 1
    w = workload.Workload(
        tail=np.zeros(0),
        k=np.zeros((0, 1)),
        gate=np.zeros((0, 1)),
        ape=np.zeros(0),
        input_row_offsets=offsets.astype(np.uint32),
        cache_lengths=cache.astype(np.uint32),
        slot_idx=np.zeros(0),
        pool_row_offsets=np.zeros(0),
        pool_ids=ids.astype(np.int32),
    )
    want = ref.expand_topk(w.pool_ids, offsets, cache, kpool)
    # The selection exercises both: expanded ids and skipped ones.
    assert (want[:, :1] >= 0).any() and (want[:, -1] == -1).any()
    np.testing.assert_array_equal(workload.numpy_expand_topk(w, kpool), want)


@pytest.mark.parametrize("kpool", [1, 4, 16, 128])
def test_expand_workload_selects_distinct_complete_pools(kpool):
    batch = 6
    case = workload.Case(
        "expand_topk", workload.EXPAND_DTYPE, batch, kpool, 8, "cpu"
    )
    w = workload.make_workload(case)
    topk = workload.expand_pool_topk(kpool)
    assert topk * kpool == 2048 or (kpool > 2048 and topk == 1)
    assert w.pool_ids.shape == (batch, topk)
    # One query per request, which sees c + 1 positions.
    np.testing.assert_array_equal(np.diff(w.input_row_offsets), 1)
    complete = (w.cache_lengths.astype(np.int64) + 1) // kpool
    assert (w.pool_ids >= 0).all()
    assert (w.pool_ids < complete[:, None]).all()
    for row in w.pool_ids:
        assert len(set(row.tolist())) == topk
    # Not sorted: the selection order is the indexer's.
    assert (np.diff(w.pool_ids, axis=1) < 0).any()
    # Every query's row is full: topk pools and the pool still filling.
    out = ref.expand_topk(
        w.pool_ids, w.input_row_offsets, w.cache_lengths, kpool
    )
    filling = (w.cache_lengths.astype(np.int64) + 1) % kpool
    np.testing.assert_array_equal(
        (out >= 0).sum(axis=1), topk * kpool + filling
    )


def test_op_bytes_expand_topk_by_hand():
    # batch 2 queries, kpool 4: 512 int32 ids read and 512 * 4 + 3 int32
    # positions written per query.
    case = workload.Case("expand_topk", "int32", 2, 4, 128, "cpu")
    assert workload.op_bytes(case) == 2 * (512 * 4 + 2051 * 4)


@pytest.mark.parametrize("op", WRITERS)
def test_workload_does_what_the_docstring_says(op):
    """Every request closes / builds / stashes exactly what the byte count
    assumes (checked with the oracle's own pool arithmetic)."""
    kpool, batch = 16, 6
    w = workload.make_workload(
        workload.Case(op, "float32", batch, kpool, 8, "cpu")
    )
    pools = ref.pool_row_offsets(w.input_row_offsets, w.cache_lengths, kpool)
    _, closed = ref.ring_close(
        w.tail,
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
    case = workload.Case("ring_close", "float32", 2, 4, 8, "cpu")
    assert workload.op_bytes(case) == 2 * (2 * 4 * 32 + 32 + 4) + 128


def test_tiny_bench_run_writes_its_json(tmp_path, capsys):
    """End to end through the CLI on the smallest configuration."""
    out = tmp_path / "bench.json"
    status = main(
        [
            "bench",
            "--ops",
            "ring_close",
            "expand_topk",
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
    record, expand = json.loads(out.read_text())
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
    # Where it ran, on every record.
    for r in (record, expand):
        assert r["max_version"] == importlib.metadata.version("max")
        assert r["mojo_version"] == importlib.metadata.version("mojo")
        assert r["cores"] == os.cpu_count()
        assert r["cpu_model"] and r["device_name"] == r["cpu_model"]
        assert r["git_commit"] == head_commit()
        assert isinstance(r["command"], str) and r["command"]
    assert record["bytes"] == workload.op_bytes(
        workload.Case("ring_close", "float32", 3, 4, 128, "cpu")
    )
    assert record["median_us"] > 0 and record["floor_median_us"] > 0
    assert record["gbps"] == pytest.approx(
        record["bytes"] / record["median_us"] / 1e3
    )
    # expand_topk: int32 pool ids whatever --dtypes says, GLM-5-Next's 512
    # ids per query at kpool 4.
    assert expand["op"] == "expand_topk" and expand["dtype"] == "int32"
    assert expand["bytes"] == workload.op_bytes(
        workload.Case("expand_topk", "int32", 3, 4, 128, "cpu")
    )
    assert expand["median_us"] > 0 and expand["floor_median_us"] > 0
    # The printed table: a row per record, its ratios from those numbers.
    captured = capsys.readouterr()
    assert "2 configurations, 4 graphs to compile" in captured.err
    head, rows = table_cells(captured.out)
    assert head[4:] == [
        "op us",
        "GB/s",
        "% of memcpy",
        "floor us",
        "op/floor",
        "numpy us",
        "numpy/op",
    ]
    assert [row[:4] for row in rows] == [
        ["ring_close", "float32", "3", "4"],
        ["expand_topk", "int32", "3", "4"],
    ]
    for row, r in zip(rows, (record, expand), strict=True):
        assert row[8] == num(r["median_us"] / r["floor_median_us"])
        assert row[10] == num(r["numpy_median_us"] / r["median_us"])
    # The legend's first line says what one call held: ring_close at kpool
    # 4 closes a pool from 2 ring members and 2 new tokens per request (the
    # workload that ran), expand_topk's query selects 2048 / 4 pools.
    ran = workload.make_workload(
        workload.Case("ring_close", "float32", 3, 4, 128, "cpu")
    )
    assert set(np.diff(ran.input_row_offsets)) == {2}
    assert set(ran.cache_lengths % 4) == {2} and ran.k.shape[1] == 128
    legend = legend_lines(captured.out)
    assert legend[0] == (
        "call: batch requests; per request, ring_close at kpool 4, head_dim"
        " 128: 2 new tokens onto 2 pending in its ring; expand_topk at kpool"
        " 4, head_dim 128: 1 query token selecting 512 pools."
    )
    assert legend[1].startswith("op us: the op's median")


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--kpools", "0"], "argument --kpools: must be >= 1, got 0"),
        (["--kpools", "4", "-3"], "argument --kpools: must be >= 1, got -3"),
        (["--batches", "0"], "argument --batches: must be >= 1, got 0"),
        (["--batches", "two"], "argument --batches: must be an integer"),
        (["--head-dim", "0"], "argument --head-dim: must be >= 1, got 0"),
        (["--min-seconds", "-1"], "argument --min-seconds: must be a finite"),
        (["--min-seconds", "nan"], "argument --min-seconds: must be a finite"),
        (["--ops", "pool"], "argument --ops: invalid choice"),
    ],
    ids=lambda x: " ".join(x) if isinstance(x, list) else None,
)
def test_bad_options_exit_2_before_compiling(argv, message, capsys):
    with pytest.raises(SystemExit) as exc:
        main(["bench", *argv])
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


def test_default_is_the_short_set():
    """With no preset: the fused step and expand_topk at kpool 4, four
    batches, bfloat16: 8 configurations on 4 compiled graphs."""
    todo = cases()
    assert [(c.op, c.dtype, c.batch, c.kpool) for c in todo] == [
        (op, dtype, batch, 4)
        for op, dtype in (("step", "bfloat16"), ("expand_topk", "int32"))
        for batch in (1, 64, 512, 4096)
    ]
    assert {(c.head_dim, c.device) for c in todo} == {(128, "cpu")}
    assert bench.graphs_to_compile(todo) == 4
    # An option narrows or widens only its own axis.
    todo = cases("--kpools", "16", "--ops", "ring_close")
    assert {(c.op, c.dtype, c.kpool) for c in todo} == {
        ("ring_close", "bfloat16", 16)
    }


def test_sweep_and_quick_presets():
    """--sweep: every op, float32 and bfloat16 (expand_topk: int32 ids),
    kpool 4 16 128, batch 1 64 512 4096: 5 * 2 * 3 * 4 + 3 * 4 = 132
    configurations on 5 * 2 * 3 + 3 = 33 op instances, two graphs each
    (op and floor). --quick: the fused step at three batches, on one op
    instance: fewer graphs to compile than the default set, and no
    configuration the default set does not time."""
    todo = cases("--sweep")
    assert len(todo) == len(set(todo)) == 132
    assert {c.op for c in todo} == set(workload.OPS)
    assert {c.kpool for c in todo} == {4, 16, 128}
    assert {c.batch for c in todo} == {1, 64, 512, 4096}
    assert {c.dtype for c in todo if c.op != "expand_topk"} == {
        "float32",
        "bfloat16",
    }
    assert bench.graphs_to_compile(todo) == 66
    assert len(cases("--sweep", "--dtypes", "float32")) == 72
    quick = cases("--quick")
    assert [(c.op, c.dtype, c.batch, c.kpool, c.head_dim) for c in quick] == [
        ("step", "bfloat16", batch, 4, 128) for batch in (1, 64, 4096)
    ]
    assert bench.graphs_to_compile(quick) == 2
    assert bench.graphs_to_compile(quick) < bench.graphs_to_compile(cases())
    assert set(quick) <= set(cases())
    # The grid options do not widen it again.
    assert cases("--quick", "--kpools", "16", "128", "--ops", "compress") == (
        quick
    )
    with pytest.raises(SystemExit):
        cases("--quick", "--sweep")


def test_help_states_each_presets_cold_cost(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["bench", "--help"])
    assert exc.value.code == 0
    text = " ".join(capsys.readouterr().out.split())
    assert (
        "8 configurations, 4 graphs to compile: on 2 CPU cores alone about"
        " 1.5 min" in text
    )
    assert "132 configurations, 66 graphs, about 22 min cold" in text
    assert "3 configurations, 2 graphs, about 40 s cold" in text
    # Why a command-line run starts again without two OpenBLAS variables.
    assert (
        "restarts itself without OPENBLAS_CORETYPE and OPENBLAS_L2_SIZE: they"
        " slow NumPy's BLAS, which the NumPy peers run on" in text
    )


def test_runners_load_precompiled_packages():
    """Each kernel package is precompiled once; the runners' graphs load
    the .mojoc rather than the source directory MAX would rebuild."""
    runners = bench.make_runners("cpu")
    assert set(runners) == {"ours", "floor"}
    key = model_key("ring_close", 4, dtype=np.float32, head_dim=8, ring_len=4)
    for name, package in (("ours", KERNELS), ("floor", NOOP_KERNELS)):
        assert runners[name].kernels == package
        graph, _ = runners[name]._build([key])  # builds, compiles nothing
        mojoc = compiled_kernels(package)
        assert mojoc.suffix == ".mojoc" and mojoc.is_file()
        assert graph.kernel_libraries_paths == [mojoc]
    assert compiled_kernels(NOOP_KERNELS) != compiled_kernels()


@pytest.mark.skipif(
    driver.accelerator_count() > 0, reason="this machine has an accelerator"
)
def test_gpu_without_accelerator_exits_2(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["bench", "--device", "gpu", "--quick"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "argument --device: gpu: no accelerator found" in err


def test_cpu_model_reads_proc_cpuinfo(tmp_path):
    info = tmp_path / "cpuinfo"
    info.write_text(
        "processor\t: 0\nvendor_id\t: GenuineIntel\n"
        "model name\t: Intel(R) Xeon(R) Platinum 8480+\nflags\t: fpu\n"
    )
    assert _sysinfo.cpu_model(info) == "Intel(R) Xeon(R) Platinum 8480+"
    # No file (macOS, Windows) or no model line: platform's answer.
    fallback = _sysinfo.cpu_model(tmp_path / "missing")
    assert fallback and fallback != "Intel(R) Xeon(R) Platinum 8480+"
    (tmp_path / "bare").write_text("processor\t: 0\n")
    assert _sysinfo.cpu_model(tmp_path / "bare") == fallback


def test_git_commit_only_for_this_package_checkout(tmp_path):
    found = _sysinfo.git_commit()
    want = head_commit()
    assert (found[0] if found else None) == want
    # A directory that is not python/mla_kpool of a checkout: no commit.
    assert _sysinfo.git_commit(tmp_path) is None
    assert _sysinfo.git_commit(ROOT / "tests") is None


def test_command_line_names_the_module():
    main_py = str(Path(_sysinfo.__file__).with_name("__main__.py"))
    assert (
        _sysinfo.command_line([main_py, "bench", "--ops", "step 3"])
        == "python -m mla_kpool bench --ops 'step 3'"
    )
    assert _sysinfo.command_line(["mla-kpool", "bench"]) == "mla-kpool bench"


def test_run_info_names_the_accelerator_on_gpu():
    cpu = _sysinfo.run_info("cpu")
    gpu = _sysinfo.run_info("gpu", "NVIDIA H100 80GB HBM3")
    assert cpu["device_name"] == cpu["cpu_model"] == gpu["cpu_model"]
    assert gpu["device_name"] == "NVIDIA H100 80GB HBM3"
    assert cpu["max_version"] == importlib.metadata.version("max")
    assert cpu["command"] == _sysinfo.command_line(sys.argv)


def test_cpu_isa_reads_the_flags(tmp_path):
    info = tmp_path / "cpuinfo"
    info.write_text(
        "processor\t: 0\nflags\t\t: fpu sse avx avx2 fma bmi2\n"
        "processor\t: 1\nflags\t\t: fpu avx512f avx512_bf16 amx_tile\n"
    )
    # The first CPU's flags; AVX-512 named by avx512f, not by avx alone.
    assert _sysinfo.cpu_isa(info) == ["AVX2", "FMA"]
    info.write_text("flags : avx2 fma avx512f avx512_bf16 amx_tile amx_bf16\n")
    assert _sysinfo.cpu_isa(info) == [
        "AVX2",
        "FMA",
        "AVX-512",
        "AVX512-BF16",
        "AMX",
    ]
    info.write_text("Processor : ARMv8\nFeatures : fp asimd\n")
    assert _sysinfo.cpu_isa(info) == []
    assert _sysinfo.cpu_isa(tmp_path / "missing") == []


def test_cpu_amx_needs_both_flags_and_no_veto(tmp_path, monkeypatch):
    info = tmp_path / "cpuinfo"
    monkeypatch.delenv(_sysinfo.CPU_AMX_ENV, raising=False)
    info.write_text("flags : avx2 fma avx512f amx_tile\n")  # no amx_bf16
    assert not _sysinfo.cpu_amx(info)
    info.write_text("flags : avx2 fma avx512f amx_tile amx_bf16\n")
    monkeypatch.setenv(_sysinfo.CPU_AMX_ENV, "0")
    assert not _sysinfo.cpu_amx(info)
    real = Path("/proc/cpuinfo")
    if not {"amx_tile", "amx_bf16"} <= _sysinfo.cpu_flags(real):
        return  # the last case needs a CPU with AMX
    monkeypatch.setenv(_sysinfo.CPU_AMX_ENV, "1")
    assert _sysinfo.cpu_amx(real)


def test_time_calls_settles_before_each_round():
    # Each round's first call starts at least ``settle`` after the previous
    # round's last call ended; the second follows at once; warm-up rounds
    # are not paused.
    calls: list[tuple[str, float, float]] = []

    def timed(name: str):
        def call() -> None:
            calls.append((name, time.perf_counter(), time.perf_counter()))

        return call

    first, second = bench.time_calls(
        timed("a"),
        timed("b"),
        warmup=2,
        min_reps=3,
        min_seconds=0.0,
        settle=0.05,
    )
    assert len(first) == len(second) == 3
    # The pause is not timed: a call that returns at once takes far less.
    assert max(first) < 50_000 and max(second) < 50_000
    assert [name for name, _, _ in calls] == ["a", "b"] * 5
    gaps = [b[1] - a[2] for a, b in itertools.pairwise(calls)]
    # Gaps after warm-up round 2 and timed rounds 1 and 2 end a round.
    assert min(gaps[i] for i in (3, 5, 7)) >= 0.05
    assert max(gaps[i] for i in (0, 1, 2, 4, 6, 8)) < 0.05


def test_index_legend_states_the_pause():
    from mla_kpool.bench import report

    line = report.INDEX_LEGEND[0]
    assert f"{bench.INDEX_SETTLE_S} s pause" in line

"""The benchmark's pieces: NumPy twins, byte counts, and one tiny run."""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import subprocess
import sys
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
from max import driver

from kpool_cases import F32, TOLERANCE
from mla_kpool import _sysinfo, bench
from mla_kpool import reference as ref
from mla_kpool.__main__ import main
from mla_kpool._paths import KERNELS, NOOP_KERNELS, compiled_kernels
from mla_kpool.bench import blas, index, workload
from mla_kpool.index_cache import PagedIndexCache
from mla_kpool.runner import model_key

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
ROOT = Path(__file__).resolve().parents[1]


def _num(value: float) -> str:
    """The table's number format: 3 significant digits, whole from 1000."""
    return f"{value:.0f}" if abs(value) >= 1000 else f"{value:.3g}"


def _table(out: str) -> tuple[list[str], list[list[str]]]:
    """The header and body cells of the markdown table printed in ``out``."""
    lines = [line for line in out.splitlines() if line.startswith("|")]
    cells = [[c.strip() for c in line.strip("|").split("|")] for line in lines]
    return cells[0], cells[2:]


def _legend(out: str) -> list[str]:
    """The legend's lines under the table, without their ``- ``."""
    return [line[2:] for line in out.splitlines() if line.startswith("- ")]


def _head_commit() -> str | None:
    """HEAD of the checkout the package is imported from, read from git."""
    package = Path(bench.__file__).resolve().parent
    done = subprocess.run(
        ["git", "-C", str(package), "rev-parse", "HEAD"],
        capture_output=True,
        text=True,
        check=False,
    )
    return done.stdout.strip() if done.returncode == 0 else None


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
        assert r["git_commit"] == _head_commit()
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
    head, rows = _table(captured.out)
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
        assert row[8] == _num(r["median_us"] / r["floor_median_us"])
        assert row[10] == _num(r["numpy_median_us"] / r["median_us"])
    assert _legend(captured.out)[0].startswith("op us: the op's median")


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


def _cases(*argv: str) -> list[workload.Case]:
    """The configurations ``bench *argv`` would measure (nothing compiles)."""
    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    return bench.cases(parser.parse_args(argv))


def test_default_is_the_short_set():
    """With no preset: the fused step and expand_topk at kpool 4, four
    batches, bfloat16: 8 configurations on 4 compiled graphs."""
    todo = _cases()
    assert [(c.op, c.dtype, c.batch, c.kpool) for c in todo] == [
        (op, dtype, batch, 4)
        for op, dtype in (("step", "bfloat16"), ("expand_topk", "int32"))
        for batch in (1, 64, 512, 4096)
    ]
    assert {(c.head_dim, c.device) for c in todo} == {(128, "cpu")}
    assert bench.graphs_to_compile(todo) == 4
    # An option narrows or widens only its own axis.
    todo = _cases("--kpools", "16", "--ops", "ring_close")
    assert {(c.op, c.dtype, c.kpool) for c in todo} == {
        ("ring_close", "bfloat16", 16)
    }


def test_sweep_and_quick_presets():
    """--sweep: every op, float32 and bfloat16 (expand_topk: int32 ids),
    kpool 4 16 128, batch 1 64 512 4096: 5 * 2 * 3 * 4 + 3 * 4 = 132
    configurations on 5 * 2 * 3 + 3 = 33 op instances, two graphs each
    (op and floor). --quick: docs/performance.md's 10 on 9 instances."""
    todo = _cases("--sweep")
    assert len(todo) == len(set(todo)) == 132
    assert {c.op for c in todo} == set(workload.OPS)
    assert {c.kpool for c in todo} == {4, 16, 128}
    assert {c.batch for c in todo} == {1, 64, 512, 4096}
    assert {c.dtype for c in todo if c.op != "expand_topk"} == {
        "float32",
        "bfloat16",
    }
    assert bench.graphs_to_compile(todo) == 66
    assert len(_cases("--sweep", "--dtypes", "float32")) == 72
    quick = _cases("--quick")
    assert len(quick) == 10 and {c.op for c in quick} == set(workload.OPS)
    assert bench.graphs_to_compile(quick) == 18
    with pytest.raises(SystemExit):
        _cases("--quick", "--sweep")


def test_help_states_each_presets_cold_cost(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["bench", "--help"])
    assert exc.value.code == 0
    text = " ".join(capsys.readouterr().out.split())
    assert "8 configurations, 4 graphs to compile: about 1.5 min" in text
    assert "132 configurations, 66 graphs, about 22 min cold" in text
    assert "18 graphs, about 6 min and 4 GB of memory cold" in text


def test_runners_load_precompiled_packages():
    """Each kernel package is precompiled once; the runners' graphs load
    the .mojoc rather than the source directory MAX would rebuild."""
    runners = bench.make_runners("cpu")
    assert set(runners) == {"ours", "floor"}
    key = model_key("ring_close", 4, dtype=np.float32, head_dim=8, ring_len=4)
    for name, package in (("ours", KERNELS), ("floor", NOOP_KERNELS)):
        assert runners[name].kernels == package
        graph = runners[name]._build(key)  # builds, compiles nothing
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
    want = _head_commit()
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


# --------------------------------------------------------------------------
# Reading results back: --markdown and --plot (nothing compiles)
# --------------------------------------------------------------------------

#: Two records as --json writes them (the second from an older run, with
#: no provenance fields and MAX's builtin timed).
RECORDS = [
    {
        "op": "ring_close",
        "dtype": "float32",
        "batch": 4096,
        "kpool": 128,
        "median_us": 32721.4,
        "gbps": 16.48,
        "memcpy_gbps": 27.5,
        "floor_median_us": 341.2,
        "numpy_median_us": 903796.0,
        "builtin_median_us": None,
        "p10_us": 30000.0,
        "p90_us": 35210.0,
        "device_name": "AMD EPYC 9R14",
        "cores": 2,
        "max_version": "26.7.0",
        "mojo_version": "1.2.0",
        "git_commit": "0123456789abcdef0123",
        "git_dirty": True,
        "command": "python -m mla_kpool bench --quick",
    },
    {
        "op": "expand_topk",
        "dtype": "int32",
        "batch": 64,
        "kpool": 4,
        "median_us": 40.0,
        "gbps": 16.4,
        "memcpy_gbps": 82.0,
        "floor_median_us": 25.0,
        "numpy_median_us": 1000.0,
        "builtin_median_us": 10.0,
    },
]


@pytest.fixture
def no_runner(monkeypatch):
    """Makes precompiling the kernels or building a Runner fail the test."""

    def refuse(*args, **kwargs):
        raise AssertionError("the kernels were precompiled or compiled")

    monkeypatch.setattr(bench, "make_runners", refuse)


def test_markdown_prints_the_table_and_its_legend(tmp_path, capsys, no_runner):
    path = tmp_path / "bench.json"
    path.write_text(json.dumps(RECORDS))
    assert main(["bench", "--markdown", str(path)]) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[:2] == [
        "Measured on AMD EPYC 9R14 (2 cores), MAX 26.7.0, Mojo 1.2.0, "
        "commit 0123456789ab with local changes: "
        "`python -m mla_kpool bench --quick`.",
        "",
    ]
    # 16.48 / 27.5 GB/s = 59.9% of memcpy; 32721.4 / 341.2 = 95.9 times
    # the floor; 903796 / 32721.4: NumPy 27.6 times slower; 40 / 10: the
    # builtin 0.25 times the op's time. p10-p90 in brackets where known.
    head, rows = _table(out)
    assert head == [
        "op",
        "dtype",
        "batch",
        "kpool",
        "op us",
        "GB/s",
        "% of memcpy",
        "floor us",
        "op/floor",
        "numpy us",
        "numpy/op",
        "builtin us",
        "builtin/op",
    ]
    assert rows == [
        [
            "ring_close",
            "float32",
            "4096",
            "128",
            "32721 (30000-35210)",
            "16.5",
            "60%",
            "341",
            "95.9",
            "903796",
            "27.6",
            "-",
            "-",
        ],
        "expand_topk int32 64 4 40 16.4 20% 25 1.6 1000 25 10 0.25".split(),
    ]
    # Columns line up: every table line is as long as the header.
    lines = [line for line in out.splitlines() if line.startswith("|")]
    assert len({len(line) for line in lines}) == 1
    assert lines[1].startswith("| ---") and lines[1].endswith(": |")
    legend = _legend(out)
    assert [line.split(":")[0] for line in legend] == [
        "op us",
        "GB/s",
        "floor us",
        "numpy us",
        "builtin us",
    ]
    assert "op/floor: op us / floor us" in legend[2]
    assert "numpy/op: numpy us / op us (above 1: the op is" in legend[3]


def test_markdown_of_several_runs_gives_medians_and_ranges(
    tmp_path, capsys, no_runner
):
    # Three runs of one configuration; only the times move. Per run:
    #   op us       100, 300, 200         -> 200 (100-300)
    #   GB/s        10, 5, 8              -> 8 (5-10)
    #   % memcpy    10/40, 5/40, 8/40 = 25%, 12.5%, 20%
    #               -> 20% (12%-25%)  (12.5 printed without decimals)
    #   floor us    50, 100, 40           -> 50 (40-100)
    #   op/floor    100/50, 300/100, 200/40 = 2, 3, 5 -> 3 (2-5)
    #   numpy us    400, 600, 1000        -> 600 (400-1000)
    #   numpy/op    400/100, 600/300, 1000/200 = 4, 2, 5 -> 4 (2-5)
    # A second configuration, with a builtin time, appears in the first
    # run only.
    base = {k: v for k, v in RECORDS[0].items()}
    runs = []
    for i, (median, gbps, floor, numpy_us) in enumerate(
        [(100, 10, 50, 400), (300, 5, 100, 600), (200, 8, 40, 1000)]
    ):
        record = {
            **base,
            "median_us": median,
            "gbps": gbps,
            "memcpy_gbps": 40.0,
            "floor_median_us": floor,
            "numpy_median_us": numpy_us,
        }
        records = [record] + ([RECORDS[1]] if i == 0 else [])
        path = tmp_path / f"run{i}.json"
        path.write_text(json.dumps(records))
        runs.append(str(path))
    assert main(["bench", "--markdown", *runs]) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[0].endswith("; 3 runs, medians and (ranges).")
    head, rows = _table(out)
    assert head[4:7] == ["runs", "op us", "GB/s"]
    assert rows == [
        [
            "ring_close",
            "float32",
            "4096",
            "128",
            "3",
            "200 (100-300)",
            "8 (5-10)",
            "20% (12%-25%)",
            "50 (40-100)",
            "3 (2-5)",
            "600 (400-1000)",
            "4 (2-5)",
            "-",
            "-",
        ],
        "expand_topk int32 64 4 1 40 16.4 20% 25 1.6 1000 25 10 0.25".split(),
    ]
    image = tmp_path / "runs.png"
    assert main(["bench", "--markdown", *runs, "--plot", str(image)]) == 0
    assert image.read_bytes().startswith(b"\x89PNG\r\n\x1a\n")


@pytest.mark.parametrize(
    "content, message",
    [
        (None, "cannot read"),
        ("[{", "not valid JSON"),
        ('{"op": "ring_close"}', "must be a JSON list of records"),
        ('[{"op": "ring_close"}]', "record 0 lacks 'dtype', 'batch'"),
    ],
    ids=["missing", "not-json", "not-list", "lacks-fields"],
)
def test_markdown_bad_file_exits_2(
    tmp_path, capsys, no_runner, content, message
):
    path = tmp_path / "bench.json"
    if content is not None:
        path.write_text(content)
    assert main(["bench", "--markdown", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"mla-kpool bench: error: {path}: ")
    assert message in err


def test_markdown_with_json_exits_2(tmp_path, capsys, no_runner):
    path = tmp_path / "bench.json"
    path.write_text(json.dumps(RECORDS))
    argv = ["bench", "--markdown", str(path), "--json", str(tmp_path / "o")]
    assert main(argv) == 2
    assert "--markdown reads a --json file" in capsys.readouterr().err


def test_plot_without_matplotlib_exits_2_before_compiling(
    monkeypatch, capsys, no_runner, tmp_path
):
    # None in sys.modules makes `import matplotlib` raise ImportError.
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    image = tmp_path / "bench.png"
    assert main(["bench", "--quick", "--plot", str(image)]) == 2
    err = capsys.readouterr().err
    assert "--plot needs matplotlib" in err
    assert "pip install matplotlib" in err
    assert not image.exists()


def test_plot_draws_the_markdown_file(tmp_path, capsys, no_runner):
    pytest.importorskip("matplotlib")
    path = tmp_path / "bench.json"
    path.write_text(json.dumps(RECORDS))
    image = tmp_path / "bench.png"
    assert main(["bench", "--markdown", str(path), "--plot", str(image)]) == 0
    assert image.read_bytes().startswith(b"\x89PNG\r\n\x1a\n")


@pytest.mark.parametrize(
    "argv",
    [
        ["--json", "/no-such-folder-mla-kpool/run.json"],
        ["--plot", "/no-such-folder-mla-kpool/plot.png"],
    ],
    ids=["json", "plot"],
)
def test_output_in_a_missing_folder_exits_2_first(argv, capsys, no_runner):
    """A path the results cannot be written to is refused before the
    run, not after it (a --sweep run takes over 20 minutes)."""
    with pytest.raises(SystemExit) as exc:
        main(["bench", *argv])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert f"argument {argv[0]}: must be a file in an existing folder" in err


def test_plot_format_is_checked_first(tmp_path, capsys, no_runner):
    pytest.importorskip("matplotlib")
    records = tmp_path / "bench.json"
    records.write_text(json.dumps(RECORDS))
    image = tmp_path / "plot.txt"
    argv = ["bench", "--markdown", str(records), "--plot", str(image)]
    assert main(argv) == 2
    assert "--plot IMAGE must end in one of" in capsys.readouterr().err
    assert not image.exists()


# --------------------------------------------------------------------------
# NumPy's BLAS: a clean environment, and which kernel ran
# --------------------------------------------------------------------------


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
    """--ops index_top_k: the two phases, one graph, whatever the grid."""
    todo = _cases("--ops", "index_top_k", "--batches", "3")
    assert [(c.op, c.phase, c.batch, c.kpool, c.head_dim) for c in todo] == [
        ("index_top_k", "decode", 16, 4, 128),
        ("index_top_k", "prefill", 1, 4, 128),
    ]
    assert bench.graphs_to_compile(todo) == 1
    both = _cases("--ops", "step", "index_top_k", "--batches", "3")
    assert [c.op for c in both] == ["step", "index_top_k", "index_top_k"]
    assert bench.graphs_to_compile(both) == 3
    assert "index_top_k" not in {c.op for c in _cases("--sweep")}


INDEX_RECORD = {
    "op": "index_top_k",
    "dtype": "float8_e4m3fn",
    "phase": "decode",
    "batch": 16,
    "kpool": 4,
    "head_dim": 128,
    "device": "cpu",
    "tokens": 16,
    "candidates": 131072,
    "flops": 1073741824,
    "median_us": 25000.0,
    "min_us": 24000.0,
    "max_us": 31000.0,
    "gflops": 42.94967296,
    "numpy_median_us": 200000.0,
    "blas_gflops": 60.0,
    "blas": {
        "internal_api": "openblas",
        "architecture": "Haswell",
        "version": "0.3.31",
        "num_threads": 2,
    },
    "device_name": "AMD EPYC",
}


def test_markdown_prints_the_index_table(tmp_path, capsys, no_runner):
    path = tmp_path / "run.json"
    path.write_text(json.dumps([RECORDS[1], INDEX_RECORD]))
    assert main(["bench", "--markdown", str(path)]) == 0
    out = capsys.readouterr().out
    assert "NumPy's BLAS openblas 0.3.31 with its Haswell kernel on 2" in out
    tables = out.split("\n\n")
    index_table = next(t for t in tables if "GFLOP/s" in t)
    head, rows = _table(index_table)
    assert head == [
        "phase",
        "batch",
        "tokens",
        "candidates",
        "op ms",
        "GFLOP/s",
        "numpy ms",
        "numpy/op",
        "BLAS GFLOP/s",
        "% of BLAS",
    ]
    assert rows == [
        [
            "decode",
            "16",
            "16",
            "131072",
            "25 (24-31)",
            "42.9",
            "200",
            "8",
            "60",
            "72%",
        ]
    ]
    assert any(line.startswith("GFLOP/s: 2 * H * D") for line in _legend(out))
    # The writers' table is still there, and a record lacking a field of
    # its table is refused.
    assert _table(out)[0][0] == "op"
    bad = dict(INDEX_RECORD)
    del bad["blas_gflops"]
    path.write_text(json.dumps([bad]))
    assert main(["bench", "--markdown", str(path)]) == 2
    assert "lacks 'blas_gflops'" in capsys.readouterr().err


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


def test_markdown_adds_the_gpu_columns_for_a_gpu_record(
    tmp_path, capsys, no_runner
):
    record = dict(INDEX_RECORD, device="gpu", pct_fp32_peak=12.5)
    record |= {"pct_fp8_peak": 0.5, "pct_hbm": 40.0}
    path = tmp_path / "run.json"
    path.write_text(json.dumps([record]))
    assert main(["bench", "--markdown", str(path)]) == 0
    out = capsys.readouterr().out
    head, rows = _table(out)
    assert head[-3:] == ["% FP32 peak", "% FP8 peak", "% HBM"]
    assert rows[0][-3:] == ["12%", "0%", "40%"]
    assert any(
        line.startswith("% FP32 peak, % FP8 peak") for line in _legend(out)
    )


@pytest.mark.gpu
@pytest.mark.skipif(
    driver.accelerator_count() == 0,
    reason="no accelerator (max.driver.accelerator_count() == 0)",
)
def test_tiny_index_bench_run_on_gpu(tmp_path, monkeypatch):
    """This package's GPU path timed, with the GPU's peak fractions."""
    monkeypatch.setitem(index.INDEX_PHASES, "decode", (2, 1023, 1))
    monkeypatch.setitem(index.INDEX_PHASES, "prefill", (1, 0, 300))
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
    out = tmp_path / "index.json"
    argv = ["bench", "--ops", "index_top_k", "--min-seconds", "0"]
    assert main([*argv, "--json", str(out)]) == 0
    decode, prefill = json.loads(out.read_text())
    assert (decode["phase"], prefill["phase"]) == ("decode", "prefill")
    assert decode["candidates"] == 2 * 256 and decode["tokens"] == 2
    assert prefill["candidates"] == sum((i + 1) // 4 for i in range(300))
    for r in (decode, prefill):
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
        assert "blas" in r and r["git_commit"] == _head_commit()
    captured = capsys.readouterr()
    assert "2 configurations, 1 graphs to compile" in captured.err
    head, rows = _table(captured.out)
    assert head[0] == "phase" and [r[0] for r in rows] == ["decode", "prefill"]

"""The bench's results read back: --markdown tables, legends, --plot."""

from __future__ import annotations

import json
import sys

import pytest

from mla_kpool import bench
from mla_kpool.__main__ import main
from support.bench_helpers import legend_lines, table_cells

#: Two records as --json writes them (the second from an older run, with
#: no provenance fields and MAX's builtin timed).
RECORDS = [
    {
        "op": "ring_close",
        "dtype": "float32",
        "batch": 4096,
        "kpool": 128,
        "head_dim": 128,
        "median_us": 32721.4,
        "gbps": 16.48,
        "memcpy_gbps": 27.5,
        "floor_median_us": 341.2,
        "numpy_median_us": 903796.0,
        "builtin_median_us": None,
        "p10_us": 30000.0,
        "p90_us": 35210.0,
        "device_name": "AMD EPYC 9R14",
        "cpu_model": "AMD EPYC 9R14",
        "cpu_isa": ["AVX2", "FMA", "AVX-512", "AVX512-BF16"],
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
        "Measured on AMD EPYC 9R14 (2 cores; AVX2, FMA, AVX-512,"
        " AVX512-BF16), MAX 26.7.0, Mojo 1.2.0, "
        "commit 0123456789ab with local changes: "
        "`python -m mla_kpool bench --quick`.",
        "",
    ]
    # 16.48 / 27.5 GB/s = 59.9% of memcpy; 32721.4 / 341.2 = 95.9 times
    # the floor; 903796 / 32721.4: NumPy 27.6 times slower; 40 / 10: the
    # builtin 0.25 times the op's time. p10-p90 in brackets where known.
    head, rows = table_cells(out)
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
    legend = legend_lines(out)
    assert [line.split(":")[0] for line in legend] == [
        "call",
        "op us",
        "GB/s",
        "floor us",
        "numpy us",
        "builtin us",
    ]
    # ring_close at kpool 128: 64 ring members and 64 new tokens close a
    # pool; the older expand_topk record names no head_dim.
    assert legend[0] == (
        "call: batch requests; per request, ring_close at kpool 128, head_dim"
        " 128: 64 new tokens onto 64 pending in its ring; expand_topk at kpool"
        " 4: 1 query token selecting 512 pools."
    )
    assert "op/floor: op us / floor us" in legend[3]
    assert "numpy/op: numpy us / op us (above 1: the op is" in legend[4]


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
    head, rows = table_cells(out)
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
        ('{"op": "ring_close"}', "must be a non-empty JSON list of records"),
        ('[{"op": "ring_close"}]', "record 0 lacks 'dtype', 'batch'"),
        ("[]", "must be a non-empty JSON list of records"),
        ("\xff", "not UTF-8 text (byte 0)"),
    ],
    ids=["missing", "not-json", "not-list", "lacks-fields", "empty", "binary"],
)
def test_markdown_bad_file_exits_2(
    tmp_path, capsys, no_runner, content, message
):
    path = tmp_path / "bench.json"
    if content is not None:
        path.write_bytes(content.encode("latin-1"))
    # The program name as it was started, as argparse's own errors say.
    assert main(["bench", "--markdown", str(path)], prog="mla-kpool") == 2
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
    assert (
        "argument --plot: IMAGE must end in one of" in capsys.readouterr().err
    )
    assert not image.exists()


INDEX_RECORD = {
    "op": "index_top_k",
    "dtype": "float8_e4m3fn",
    "phase": "decode",
    "batch": 16,
    "kpool": 4,
    "head_dim": 128,
    "device": "cpu",
    "heads": 32,
    "top_k": 512,
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


def test_markdown_refuses_runs_of_both_cpu_forms(tmp_path, capsys, no_runner):
    # An AMX run and a vector-block run are not repeats of one run: their
    # medians would mix two forms of the op, so --markdown refuses them.
    on, off = tmp_path / "on.json", tmp_path / "off.json"
    on.write_text(json.dumps([INDEX_RECORD | {"cpu_amx": True}]))
    off.write_text(json.dumps([INDEX_RECORD | {"cpu_amx": False}]))
    assert main(["bench", "--markdown", str(on), str(off)]) == 2
    err = capsys.readouterr().err
    assert "different forms of the CPU path" in err
    assert str(on) in err and str(off) in err
    assert main(["bench", "--markdown", str(on), str(on)]) == 0


def test_markdown_prints_the_index_table(tmp_path, capsys, no_runner):
    path = tmp_path / "run.json"
    path.write_text(json.dumps([RECORDS[1], INDEX_RECORD]))
    assert main(["bench", "--markdown", str(path)]) == 0
    out = capsys.readouterr().out
    assert "NumPy's BLAS openblas 0.3.31 with its Haswell kernel on 2" in out
    tables = out.split("\n\n")
    index_table = next(t for t in tables if "GFLOP/s" in t)
    head, rows = table_cells(index_table)
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
    legend = legend_lines(out)
    assert any(line.startswith("GFLOP/s: 2 * H * D") for line in legend)
    assert (
        "call: tokens query tokens over batch requests; each token scores its"
        " request's visible pools (kpool 4) with 32 heads of head_dim 128 and"
        " selects the top 512." in legend
    )
    # The writers' table is still there, and a record lacking a field of
    # its table is refused.
    assert table_cells(out)[0][0] == "op"
    bad = dict(INDEX_RECORD)
    del bad["blas_gflops"]
    path.write_text(json.dumps([bad]))
    assert main(["bench", "--markdown", str(path)]) == 2
    assert "lacks 'blas_gflops'" in capsys.readouterr().err


def test_markdown_adds_the_gpu_columns_for_a_gpu_record(
    tmp_path, capsys, no_runner
):
    record = dict(INDEX_RECORD, device="gpu", pct_fp32_peak=12.5)
    record |= {"pct_fp8_peak": 0.5, "pct_hbm": 40.0}
    path = tmp_path / "run.json"
    path.write_text(json.dumps([record]))
    assert main(["bench", "--markdown", str(path)]) == 0
    out = capsys.readouterr().out
    head, rows = table_cells(out)
    assert head[-3:] == ["% FP32 peak", "% FP8 peak", "% HBM"]
    assert rows[0][-3:] == ["12%", "0%", "40%"]
    assert any(
        line.startswith("% FP32 peak, % FP8 peak") for line in legend_lines(out)
    )

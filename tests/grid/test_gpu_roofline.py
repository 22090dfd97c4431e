"""The roofline model against hand-computed bytes, flops and grids."""

import pytest

from mla_kpool.bench import bounds, index
from mla_kpool.gpu_report import roofline


def _row(results, workload, gpu):
    return next(
        r for r in results if r["workload"] == workload and r["gpu"] == gpu
    )


def test_glm5_next_decode_by_hand():
    # 16 requests, 1 token after 32,767 cached, kpool 4: each row sees
    # 32,768 // 4 = 8,192 pools. Keys: 16 * 8,192 * (128 FP8 bytes + a
    # 4-byte scale) = 17,301,504; queries: 16 rows * 32 heads * (128 + 4)
    # = 67,584; output: 16 * 512 * 4 = 32,768. Flops: 2 * 32 * 128 per
    # (row, pool): 8,192 * 16,384 = 134,217,728 per row, x16.
    w = bounds.WORKLOADS["glm5-next-decode"]
    assert w["bytes"] == 17_301_504 + 67_584 + 32_768
    assert w["flops"] == 16 * 2 * 32 * 128 * 8192
    assert w["candidates"] == 8192
    results = roofline.rooflines([])
    h200 = _row(results, "glm5-next-decode", "H200")
    # FP32: 1,073,741,824 flops / 67e12 = 16.03 us > 17.4 MB / 4.8 TB/s =
    # 3.63 us: compute-bound. FP8: / 1,979e12 = 0.54 us < 3.63 us.
    assert h200["bound_s_fp32"] == pytest.approx(1_073_741_824 / 67e12)
    assert h200["binding_fp32"] == h200["binding"] == "compute"
    assert h200["bound_s_fp8"] == pytest.approx(17_401_856 / 4.8e12)
    assert h200["binding_fp8"] == "memory"


def test_deepseek_v32_decode_by_hand():
    # H 64, D 128, kpool 1, k 2048: each row sees 32,768 keys. Keys: 16 *
    # 32,768 * 132; queries 16 * 64 * 132; output 16 * 2,048 * 4.
    w = bounds.WORKLOADS["deepseek-v3.2-decode"]
    assert w["bytes"] == 16 * 32768 * 132 + 16 * 64 * 132 + 16 * 2048 * 4
    assert w["flops"] == 16 * 2 * 64 * 128 * 32768
    mi = _row(roofline.rooflines([]), "deepseek-v3.2-decode", "MI300X")
    # FP8: 8.59 GFLOP / 2,614.9e12 = 3.3 us < 69.5 MB / 5.3 TB/s = 13.1 us.
    assert mi["bound_s_fp8"] == pytest.approx(w["bytes"] / 5.3e12)


def test_step_b64_by_hand():
    # bfloat16 rows of 128 channels: 256 B. Per request, r = 2 pending,
    # 8 new tokens. ring_close: 2 ring members x (key + gate), 2 new rows
    # x (key + gate), the pooled row, a 4-byte closed_pool: 2,308 B; ape
    # 4 x 128 x 4 = 2,048 once. Compress builds one pool: 4 members x
    # (key + gate) read, and writes its 8 // 4 = 2 output rows (the second
    # zeroed): 2,560 B. seed_tail stashes 2 rows x (key + gate), read and
    # written: 2,048 B.
    w = bounds.WORKLOADS["step-b64"]
    assert w["bytes"] == 64 * (2308 + 2560 + 2048) + 2048
    # 2 pools per request (1 closed, 1 built) x 128 channels x (6 x 4
    # members + 1 division).
    assert w["flops"] == 64 * 2 * 128 * 25
    b200 = _row(roofline.rooflines([]), "step-b64", "B200")
    assert b200["binding"] == "memory"
    assert b200["bound_s_fp32"] == pytest.approx(w["bytes"] / 7.7e12)


#: A manifest's launch facts for GLM-5-Next's indexer on sm_90a, written
#: here by hand from the kernels' documented launches (a plan thread per
#: row, 256 per block; a simt score block of 256 candidates per window
#: row; a wgmma tile of 64; a select block per window row).
def _glm_rows(registers: int | None = None) -> list[dict]:
    params = {"num_heads": 32, "depth": 128, "k": 512, "kpool": 4}

    def row(kernel, threads, rows, per_row, columns, per_column, **extra):
        r = {
            "op": "index_top_k",
            "kernel": kernel,
            "arch": "sm_90a",
            "params": params,
            "block_threads": threads,
            "shared_words": 0,
            "grid": {
                "rows": rows,
                "rows_per_block": per_row,
                "columns": columns,
                "columns_per_block": per_column,
            },
            **extra,
        }
        if registers is not None:
            r["registers"] = registers
        return r

    return [
        row("plan", 256, "tokens", 256, "1", 1),
        row(
            "score_simt",
            256,
            "window_rows",
            1,
            "candidates",
            256,
            column_flops=2 * 32 * 128,
            padded_tile=0,
            flops_peak="fp32",
        ),
        row(
            "score_wgmma",
            128,
            "window_rows",
            1,
            "candidates",
            64,
            column_flops=2 * 32 * 128,
            padded_tile=64,
            flops_peak="fp8",
        ),
        row("select", 512, "window_rows", 1, "1", 1),
    ]


def test_grids_follow_the_rows_rules():
    results = roofline.rooflines(_glm_rows())
    # Decode: 16 rows; plan 1 block of 256; score 16 x 8,192 / 256 tiles;
    # wgmma 16 x 8,192 / 64; select a block per row.
    decode = _row(results, "glm5-next-decode", "H200")["kernels"]
    assert [(k["kernel"], k["grid"], k["launches"]) for k in decode] == [
        ("plan", 1, 1),
        ("score_simt", 512, 1),
        ("score_wgmma", 2048, 1),
        ("select", 16, 1),
    ]
    # Prefill: 4,096 rows over 1,024 candidates (4 tiles of 256), one
    # window.
    prefill = _row(results, "glm5-next-prefill", "H100")["kernels"]
    assert [k["grid"] for k in prefill] == [16, 16384, 65536, 4096]
    # The rows are for sm_90a: the B200 (sm_100a) has none, and DeepSeek's
    # shape (64 heads) does not take the GLM rows' params.
    assert _row(results, "glm5-next-decode", "B200")["kernels"] == []
    assert _row(results, "deepseek-v3.2-decode", "H200")["kernels"] == []


def test_grid_rule_counts_and_windows():
    counts = {"batch": 5, "out_rows": 12, "tokens": 700, "candidates": 65}
    rule = {"rows": "batch + out_rows", "rows_per_block": 1}
    assert (
        roofline.grid_blocks(
            {**rule, "columns": "1", "columns_per_block": 1}, counts
        )
        == 17
    )
    tiles = {
        "rows": "tokens",
        "rows_per_block": 256,
        "columns": "candidates",
        "columns_per_block": 64,
    }
    assert roofline.grid_blocks(tiles, counts) == 3 * 2
    with pytest.raises(KeyError):
        roofline.grid_blocks({**tiles, "rows": "requests"}, counts)
    # A workload of several windows launches a window kernel once per
    # window, the largest window's grid reported.
    w = bounds.index_workload("long", 1, 0, 1 << 20, index.GLM5_NEXT)
    assert w["counts"]["windows"] == -(-(1 << 20) // w["counts"]["window_rows"])
    assert w["counts"]["windows"] > 1
    fill = roofline._kernel_fill(w, _glm_rows()[3], "H200")
    assert (fill["grid"], fill["launches"]) == (
        w["counts"]["window_rows"],
        w["counts"]["windows"],
    )


def test_fill_takes_the_rows_residency():
    rows = _glm_rows()
    rows[3]["resident_blocks"] = {"H100": 4, "H200": 4}
    decode = _row(roofline.rooflines(rows), "glm5-next-decode", "H200")
    select = decode["kernels"][3]
    assert (select["block_threads"], select["resident_blocks"]) == (512, 4)
    assert select["fill"] == pytest.approx(16 / (132 * 4))
    assert select["resident_from"] == "kernel row"
    # Without resident blocks and registers: the model, no register limit.
    assert decode["kernels"][0]["resident_from"] == "model, no regs"


def test_scorer_bounds_read_the_rows():
    decode = _row(roofline.rooflines(_glm_rows()), "glm5-next-decode", "H200")
    got = {s["scorer"]: s for s in decode["scorers"]}
    w = bounds.WORKLOADS["glm5-next-decode"]
    # simt: the candidates seen, 2 * 32 * 128 flops each, at 67 TFLOPS.
    seen = 16 * 8192
    assert got["simt"]["issue_s"] == pytest.approx(seen * 8192 / 67e12)
    assert got["simt"]["binding"] == "issue"
    # wgmma: whole tiles of 64 (8,192 is a multiple), at 1,979 TFLOPS:
    # 0.54 us, below the 3.63 us of memory.
    assert got["wgmma"]["issue_s"] == pytest.approx(seen * 8192 / 1979e12)
    assert got["wgmma"]["bound_s"] == pytest.approx(w["bytes"] / 4.8e12)
    assert got["wgmma"]["binding"] == "memory"


def test_bound_seconds_for_names_and_gpus():
    w = bounds.WORKLOADS["glm5-next-prefill"]
    got = bounds.bound_seconds("glm5-next-prefill", "NVIDIA H100 80GB HBM3")
    assert got == pytest.approx(w["flops"] / 67e12)
    assert bounds.bound_seconds("glm5-next-prefill", "Some GPU") is None
    with pytest.raises(KeyError):
        bounds.bound_seconds("no such workload", "H200")


def test_bench_case_workloads_match_the_named_ones():
    case = index.INDEX_PHASES  # the bench's own phases
    assert case["decode"] == (16, 32 * 1024 - 1, 1)
    from mla_kpool.bench.workload import Case

    decode = bounds.workload_for_case(
        Case("index_top_k", "float8_e4m3fn", 16, 4, 128, "gpu", "decode")
    )
    named = bounds.WORKLOADS["glm5-next-decode"]
    assert (decode["bytes"], decode["flops"]) == (
        named["bytes"],
        named["flops"],
    )
    step = bounds.workload_for_case(
        Case("step3", "bfloat16", 64, 4, 128, "gpu")
    )
    assert step["bytes"] == bounds.WORKLOADS["step-b64"]["bytes"]
    assert (
        bounds.workload_for_case(
            Case("expand_topk", "int32", 64, 4, 128, "gpu")
        )
        is None
    )


def test_format_rooflines_has_a_row_per_result():
    results = roofline.rooflines([])
    table = roofline.format_rooflines(results).splitlines()
    # 4 GPUs x (3 steps, 4 writers at 3 batches, 3 indexer workloads).
    assert len(table) == 2 + len(results) == 2 + 18 * 4
    assert table[2].startswith("| step-b1 | H200 |")
    # No kernel rows: no fills, and the table says so.
    assert table[0].endswith("| resident blocks from |")
    assert all(line.endswith("| - | no kernel rows |") for line in table[2:])


def test_the_table_says_which_fills_come_from_compiled_kernels():
    # The GLM rows on sm_90a with registers, all but the plan resident as
    # compiled.
    rows = _glm_rows(registers=32)
    for r in rows[1:]:
        r["resident_blocks"] = {"H100": 4, "H200": 4}
    results = roofline.rooflines(rows)
    source = {
        (r["workload"], r["gpu"]): roofline.residency_source(r) for r in results
    }
    assert source["glm5-next-decode", "H200"] == "compiled sm_90a; model: plan"
    # B200 is sm_100a, MI300X gfx942: no rows of theirs.
    assert source["glm5-next-decode", "B200"] == "no kernel rows"
    assert source["glm5-next-decode", "MI300X"] == "no kernel rows"
    rows[0]["resident_blocks"] = {"H100": 8, "H200": 8}
    h100 = _row(roofline.rooflines(rows), "glm5-next-decode", "H100")
    assert roofline.residency_source(h100) == "compiled sm_90a"
    line = roofline.format_rooflines([h100]).splitlines()[2]
    assert line.startswith("| glm5-next-decode | H100 |")
    assert "| plan 1 (" in line and "score_wgmma 2048 (" in line
    assert line.endswith("| compiled sm_90a |")


def test_bench_bound_beside_the_time():
    from mla_kpool import bench
    from mla_kpool.bench.workload import Case

    decode = Case("index_top_k", "float8_e4m3fn", 16, 4, 128, "gpu", "decode")
    # H200: 1,073,741,824 flops / 67e12 = 16.026 us; 160.26 us is 10x.
    got = bench.gpu_bound(decode, 160.26, "NVIDIA H200")
    assert got["bound_us"] == pytest.approx(1_073_741_824 / 67e6)
    assert got["bound_fp8_us"] == pytest.approx(17_401_856 / 4.8e6)
    assert got["x_bound"] == pytest.approx(10.0, rel=1e-4)
    assert bench.gpu_bound(decode, 1.0, "Fake GPU 9000") == {}
    assert bench.gpu_bound(decode, 1.0, None) == {}
    expand = Case("expand_topk", "int32", 64, 4, 128, "gpu")
    assert bench.gpu_bound(expand, 1.0, "NVIDIA H200") == {}


def _cells(table: str, header: str) -> list[str]:
    lines = [line for line in table.splitlines() if line.startswith("|")]
    head = [c.strip() for c in lines[0].strip("|").split("|")]
    col = head.index(header)
    return [line.strip("|").split("|")[col].strip() for line in lines[2:]]


def test_bench_tables_show_the_bound_columns():
    from mla_kpool.bench import report

    step = {
        "op": "step",
        "dtype": "bfloat16",
        "batch": 64,
        "kpool": 4,
        "head_dim": 128,
        "device": "gpu",
        "median_us": 9.0,
        "gbps": 49.4,
        "memcpy_gbps": 100.0,
        "floor_median_us": 5.0,
        "numpy_median_us": 300.0,
        "bound_us": 0.09,
        "x_bound": 100.0,
    }
    index_record = {
        "op": "index_top_k",
        "phase": "decode",
        "batch": 16,
        "kpool": 4,
        "tokens": 16,
        "candidates": 131072,
        "median_us": 160.0,
        "gflops": 6710.0,
        "numpy_median_us": 1e5,
        "blas_gflops": 60.0,
        "bound_us": 16.0,
        "x_bound": 10.0,
    }
    out = report.format_table([[step, index_record]])
    ops, index_table = out.split("\n\n- ")[0], out.split("\n\n")[-2]
    assert _cells(ops, "bound us") == ["0.09"]
    assert _cells(ops, "x bound") == ["100"]
    assert _cells(index_table, "bound ms") == ["0.016"]
    assert _cells(index_table, "x bound") == ["10"]
    assert "x bound: the op's time over it" in out
    # A CPU record has no bound: no columns.
    cpu = {k: v for k, v in step.items() if "bound" not in k}
    assert "x bound" not in report.format_table([[cpu]])

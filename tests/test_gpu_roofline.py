"""The roofline model against hand-computed bytes, flops and grids."""

import pytest

from mla_kpool.bench import index
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
    w = roofline.WORKLOADS["glm5-next-decode"]
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
    w = roofline.WORKLOADS["deepseek-v3.2-decode"]
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
    w = roofline.WORKLOADS["step-b64"]
    assert w["bytes"] == 64 * (2308 + 2560 + 2048) + 2048
    # 2 pools per request (1 closed, 1 built) x 128 channels x (6 x 4
    # members + 1 division).
    assert w["flops"] == 64 * 2 * 128 * 25
    b200 = _row(roofline.rooflines([]), "step-b64", "B200")
    assert b200["binding"] == "memory"
    assert b200["bound_s_fp32"] == pytest.approx(w["bytes"] / 7.7e12)


def test_grids_mirror_the_launches():
    results = roofline.rooflines([])
    # Decode: 16 rows; plan 1 block of 256; score 16 x 8,192 / 256 tiles
    # (32 heads x 128 dims = 4,096 query words: 4 waves of 64 threads);
    # select a block of 512 per row.
    decode = _row(results, "glm5-next-decode", "H200")["kernels"]
    assert [(k["kernel"], k["grid"], k["block_threads"]) for k in decode] == [
        ("plan", 1, 256),
        ("score_tiled", 512, 256),
        ("select", 16, 512),
    ]
    # Prefill: 4,096 rows over 1,024 candidates (4 tiles of 256), one
    # window.
    prefill = _row(results, "glm5-next-prefill", "H100")["kernels"]
    assert [k["grid"] for k in prefill] == [16, 16384, 4096]
    # Step at batch 4096: a block per request and per output row (2 per
    # request), 128 threads.
    step = _row(results, "step-b4096", "MI300X")["kernels"]
    assert [(k["kernel"], k["grid"]) for k in step] == [
        ("scan", 1),
        ("main", 3 * 4096),
    ]


def test_fill_takes_the_rows_block_size_and_residency():
    # A select at 64 threads resident 4 per SM on H200: 16 blocks /
    # (132 x 4) = 3.0%; a score row of 256 threads halves the tiles.
    rows = [
        {
            "op": "index_top_k",
            "kernel": "select",
            "config": "glm5next-k512",
            "arch": "sm_90a",
            "block_threads": 64,
            "resident_blocks": {"H100": 4, "H200": 4},
        },
        {
            "op": "index_top_k",
            "kernel": "score_tiled",
            "config": "glm5next-k512",
            "params": {"num_heads": 32, "depth": 128, "k": 512, "kpool": 4},
            "arch": "sm_90a",
            "block_threads": 256,
            "resident_blocks": {"H100": 8, "H200": 8},
        },
    ]
    decode = _row(roofline.rooflines(rows), "glm5-next-decode", "H200")
    select = decode["kernels"][2]
    assert (select["block_threads"], select["resident_blocks"]) == (64, 4)
    assert select["fill"] == pytest.approx(16 / (132 * 4))
    assert select["resident_from"] == "kernel row"
    score = decode["kernels"][1]
    assert score["grid"] == 16 * 8192 // 256
    assert score["fill"] == pytest.approx(512 / (132 * 8))
    # The rows are for sm_90a: B200 keeps today's sizes.
    b200 = _row(roofline.rooflines(rows), "glm5-next-decode", "B200")
    assert b200["kernels"][2]["block_threads"] == 512
    # DeepSeek's scorer (64 heads) does not take the GLM row's params: its
    # 64 x 128 query words make 8 waves of 64 threads.
    ds = _row(roofline.rooflines(rows), "deepseek-v3.2-decode", "H200")
    assert ds["kernels"][1]["block_threads"] == 512


@pytest.mark.parametrize(
    "heads, depth, threads",
    [
        (32, 128, 256),  # 4,096 query words: 4 waves
        (64, 128, 512),  # 8,192 words: 8 waves
        (8, 64, 128),  # 512 words: one wave, at least 128
        (3, 100, 128),  # 4 padded heads x 100 = 400 words
        (16, 640, 1024),  # 10,240 words: 10 waves, the next power 1,024
        (128, 128, 128),  # past 64 heads: the untiled scorer's 128
        (64, 256, 128),  # 16,384 words > 12,288: untiled
    ],
)
def test_score_threads_follow_the_query(heads: int, depth: int, threads: int):
    assert roofline.score_threads(heads, depth) == threads


def test_bound_seconds_for_names_and_gpus():
    w = roofline.WORKLOADS["glm5-next-prefill"]
    got = roofline.bound_seconds("glm5-next-prefill", "NVIDIA H100 80GB HBM3")
    assert got == pytest.approx(w["flops"] / 67e12)
    assert roofline.bound_seconds("glm5-next-prefill", "Some GPU") is None
    with pytest.raises(KeyError):
        roofline.bound_seconds("no such workload", "H200")


def test_bench_case_workloads_match_the_named_ones():
    case = index.INDEX_PHASES  # the bench's own phases
    assert case["decode"] == (16, 32 * 1024 - 1, 1)
    from mla_kpool.bench.workload import Case

    decode = roofline.workload_for_case(
        Case("index_top_k", "float8_e4m3fn", 16, 4, 128, "gpu", "decode")
    )
    named = roofline.WORKLOADS["glm5-next-decode"]
    assert (decode["bytes"], decode["flops"]) == (
        named["bytes"],
        named["flops"],
    )
    step = roofline.workload_for_case(
        Case("step3", "bfloat16", 64, 4, 128, "gpu")
    )
    assert step["bytes"] == roofline.WORKLOADS["step-b64"]["bytes"]
    assert (
        roofline.workload_for_case(
            Case("expand_topk", "int32", 64, 4, 128, "gpu")
        )
        is None
    )


def test_format_rooflines_has_a_row_per_result():
    results = roofline.rooflines([])
    table = roofline.format_rooflines(results).splitlines()
    assert len(table) == 2 + len(results) == 2 + 5 * 4
    assert table[2].startswith("| step-b64 | H200 |")
    # No kernel rows: every fill is the model's.
    assert table[0].endswith("| resident blocks from |")
    assert all(line.endswith("| model |") for line in table[2:])


def test_the_table_says_which_fills_come_from_compiled_kernels():
    # Rows for the select and the tiled scorer on sm_90a, with registers.
    rows = [
        {
            "op": "index_top_k",
            "kernel": kernel,
            "arch": "sm_90a",
            "block_threads": threads,
            "registers": 32,
            "shared_bytes": 0,
            "resident_blocks": {"H100": 4, "H200": 4},
        }
        for kernel, threads in (("select", 512), ("score_tiled", 256))
    ]
    results = roofline.rooflines(rows)
    source = {
        (r["workload"], r["gpu"]): roofline.residency_source(r) for r in results
    }
    # The plan has no row: its fill is the model's.
    assert source["glm5-next-decode", "H200"] == "compiled sm_90a; model: plan"
    # B200 is sm_100a, MI300X gfx942: no rows of theirs.
    assert source["glm5-next-decode", "B200"] == "model"
    assert source["glm5-next-decode", "MI300X"] == "model"
    rows.append({**rows[0], "kernel": "plan", "block_threads": 256})
    h100 = _row(roofline.rooflines(rows), "deepseek-v3.2-decode", "H100")
    assert roofline.residency_source(h100) == "compiled sm_90a"
    line = roofline.format_rooflines([h100]).splitlines()[2]
    assert line.startswith("| deepseek-v3.2-decode | H100 |")
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

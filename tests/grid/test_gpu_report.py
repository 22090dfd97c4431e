"""``python -m mla_kpool gpu-report``: every kernel compiled, read and checked.

One session fixture runs the report once for sm_90a, sm_100a and gfx942 and
keeps the code; the tests check its rows against independent reads of that
code (their own ``ptxas -v`` runs and regular expressions), and the rules
the kernels must keep: no spills, a parameter block equal to the host's
operand bytes, a quarter of the GPU's warps resident at least.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import mla_kpool.gpu_report as gpu_report
from mla_kpool.__main__ import main
from mla_kpool.gpu_report import tools
from mla_kpool.gpu_report.asm import (
    ptx_entries,
    ptx_entry_text,
    ptx_facts,
)
from mla_kpool.gpu_report.report import (
    COLUMNS,
    LEGEND,
)

ARCHS = ["sm_90a", "sm_100a", "gfx942"]
OPS = {"ring_close", "compress", "seed_tail", "step", "expand_topk"}
OPS |= {"index_top_k"}
INDEX_CONFIGS = {"glm5next-k512", "glm5next-k2048", "dsv32-k2048", "h128-k2048"}
INDEX_KERNELS = {"plan", "score_simt", "select", "split_select"}
#: The config whose query is too large for the tiled FP32 scorer.
UNTILED = "h128-k2048"
#: Kernels built only for the GPUs that run them: the tensor scorers.
ARCH_KERNELS = {"sm_90a": {"score_wgmma"}, "gfx942": {"score_mfma"}}
#: The wgmma scorer's grouped tiles (several query rows a tile), for the
#: configs whose heads fit one product (at most 64).
GROUPED = {
    "sm_90a": {("score_wgmma_rows", c) for c in INDEX_CONFIGS if c != UNTILED}
}
#: Writers' kernels: one per op, and the step's scan.
WRITER_KERNELS = 6
PTXAS = tools.find_ptxas()
needs_ptxas = pytest.mark.skipif(PTXAS is None, reason="no ptxas installed")


class Report:
    """The report's run: exit status, output, JSON and code directory."""

    def __init__(self, tmp: Path):
        self.asm_dir = tmp / "asm"
        json_path = tmp / "report.json"
        proc = subprocess.run(
            [
                sys.executable,
                "-m",
                "mla_kpool",
                "gpu-report",
                *[a for arch in ARCHS for a in ("--arch", arch)],
                "--json",
                str(json_path),
                "--asm-dir",
                str(self.asm_dir),
            ],
            capture_output=True,
            text=True,
            timeout=900,
        )
        self.returncode = proc.returncode
        self.stdout, self.stderr = proc.stdout, proc.stderr
        assert json_path.is_file(), proc.stderr
        self.doc = json.loads(json_path.read_text())
        self.rows = self.doc["kernels"]

    def arch_rows(self, arch: str) -> list[dict]:
        return [r for r in self.rows if r["arch"] == arch]

    def code(self, row: dict) -> str:
        return (self.asm_dir / row["asm"]).read_text()

    def configs(self) -> list[str]:
        """Every row's config, once each, in the rows' order."""
        return list(dict.fromkeys(r["config"] for r in self.rows))


@pytest.fixture(scope="session")
def report(tmp_path_factory: pytest.TempPathFactory) -> Report:
    return Report(tmp_path_factory.mktemp("gpu_report"))


def _name(row: dict) -> str:
    return f"{row['arch']} {row['op']}/{row['kernel']} [{row['config']}]"


@pytest.mark.parametrize("arch", ARCHS)
def test_every_kernel_of_every_op_is_reported(report: Report, arch: str):
    rows = report.arch_rows(arch)
    assert {r["op"] for r in rows} == OPS
    index = {
        (r["kernel"], r["config"]) for r in rows if r["op"] == "index_top_k"
    }
    kernels = INDEX_KERNELS | ARCH_KERNELS.get(arch, set())
    want = {(k, c) for k in kernels for c in INDEX_CONFIGS}
    assert index == want | GROUPED.get(arch, set())
    assert len(rows) == WRITER_KERNELS + len(index)
    for row in rows:
        code = report.code(row)
        assert re.fullmatch(r"\w+_kernel_[0-9a-f]+", row["entry"]), row
        if arch.startswith("sm_"):
            assert f".target {arch}" in code
            assert row["entry"] in ptx_entries(code)
        else:
            assert f".amdhsa_kernel {row['entry']}" in code
    # The table: a header, then one line per row naming its arch and config.
    lines = [ln for ln in report.stdout.splitlines() if ln.startswith(arch)]
    assert len(lines) == len(rows)


def test_report_exits_zero_with_a_roofline(report: Report):
    assert report.returncode == 0, report.stderr
    assert "Traceback" not in report.stderr
    assert report.doc["rooflines"], "no roofline rows"


def _ptxas_v(ptx_file: Path, arch: str) -> dict[str, int]:
    """An independent ``ptxas -v`` of a one-entry PTX file."""
    proc = subprocess.run(
        [PTXAS, f"-arch={arch}", "-v", str(ptx_file), "-o", "/dev/null"],
        capture_output=True,
        text=True,
        check=True,
    )
    out = proc.stdout + proc.stderr
    frame = re.search(
        r"(\d+) bytes stack frame, (\d+) bytes spill stores, "
        r"(\d+) bytes spill loads",
        out,
    )
    regs = re.search(r"Used (\d+) registers", out)
    assert frame and regs, out
    return {
        "stack_bytes": int(frame[1]),
        "spill_store_bytes": int(frame[2]),
        "spill_load_bytes": int(frame[3]),
        "registers": int(regs[1]),
    }


@needs_ptxas
@pytest.mark.parametrize("arch", ["sm_90a", "sm_100a"])
def test_nvidia_rows_are_what_ptxas_says(report: Report, arch: str):
    for row in report.arch_rows(arch):
        facts = _ptxas_v(report.asm_dir / row["asm"], arch)
        got = {k: row[k] for k in facts}
        assert got == facts, _name(row)


def test_amd_rows_are_what_the_code_says(report: Report):
    for row in report.arch_rows("gfx942"):
        code = report.code(row)
        start = code.index(f".amdhsa_kernel {row['entry']}")
        desc = code[start : code.index(".end_amdhsa_kernel", start)]

        def field(name: str, desc: str = desc) -> int:
            return int(re.search(rf"\.amdhsa_{name}\s+(\d+)", desc)[1])

        assert row["registers"] == field("next_free_vgpr"), _name(row)
        # One kernel per file: its metadata entry's fields follow its name.
        meta = code[code.index(f".name:           {row['entry']}") :]
        vgpr_spills = int(re.search(r"\.vgpr_spill_count:\s+(\d+)", meta)[1])
        assert row["spill_store_bytes"] == 4 * vgpr_spills, _name(row)
        assert row["spill_load_bytes"] == 4 * vgpr_spills, _name(row)
        assert row["stack_bytes"] == field("private_segment_fixed_size")
        # Shared memory sized at launch is not in the code: the report adds
        # the most a launch asks (the declaration's words).
        dynamic = 4 * row["shared_words"] if row["dynamic_shared"] else 0
        static = field("group_segment_fixed_size")
        assert row["shared_bytes"] == static + dynamic


def test_no_kernel_spills(report: Report):
    spilled = []
    for row in report.rows:
        code = report.code(row)
        local = re.findall(r"\b(?:ld|st)\.local", code)
        if row["spill_store_bytes"] or row["spill_load_bytes"] or local:
            spilled.append(
                f"{_name(row)}: {row['spill_store_bytes']} B stored, "
                f"{row['spill_load_bytes']} B loaded, {len(local)} local ops"
            )
    assert not spilled, spilled


NVDISASM = tools.find_nvdisasm()


@needs_ptxas
@pytest.mark.parametrize("arch", ARCHS)
def test_no_kernel_calls_out_of_line_or_uses_scratch(report: Report, arch: str):
    # Every phase of a phased kernel is inlined into it: no call and no
    # scratch memory (a call's arguments and saved registers, spills, a
    # stack array), read here from the code apart from the report's readers.
    rows = report.arch_rows(arch)
    assert rows
    found = []
    for row in rows:
        code = report.code(row)
        if arch.startswith("sm_"):
            calls = len(re.findall(r"^\s*(?:@!?%\w+\s+)?call\b", code, re.M))
            scratch = _ptxas_v(report.asm_dir / row["asm"], arch)["stack_bytes"]
            if NVDISASM is not None:
                assert row["calls_from"] == "sass", _name(row)
                cubin = (report.asm_dir / row["asm"]).with_suffix(".cubin")
                sass = subprocess.run(
                    [NVDISASM, str(cubin)],
                    capture_output=True,
                    text=True,
                    check=True,
                ).stdout
                assert "EXIT" in sass, _name(row)
                # Not ptxas's own division subroutines (the row lists
                # them apart): a slow path of one PTX instruction.
                sites = re.findall(r"\bCALL\.(?:REL|ABS)\S*\s+(\S+)", sass)
                ptxas_own = [t for t in sites if "$__cuda_" in t]
                assert sum(row["subroutine_calls"].values()) == len(
                    ptxas_own
                ), _name(row)
                calls = len(sites) - len(ptxas_own)
        else:
            assert row["calls_from"] == "asm", _name(row)
            # A call, or a jump that is not a return (a tail call).
            calls = len(re.findall(r"\bs_swappc_b64\b", code))
            calls += len(re.findall(r"\bs_setpc_b64\s+s\[(?!30:31\])", code))
            private = re.findall(
                r"\.amdhsa_private_segment_fixed_size\s+(\d+)", code
            )
            assert len(private) == 1, _name(row)
            scratch = int(private[0])
            assert "s_endpgm" in code, _name(row)
        assert row["calls"] == calls, _name(row)
        assert row["scratch_bytes"] == scratch, _name(row)
        # The memory instructions by barrier segment: no local memory.
        ops = row["memory_ops"]
        if ops is not None:
            assert ops["local"] == 0, _name(row)
            assert sum(seg["instructions"] for seg in ops["segments"]) > 0
        if calls or scratch:
            found.append(f"{_name(row)}: {calls} calls, {scratch} B scratch")
    assert not found, found


@needs_ptxas
def test_no_kernel_has_a_ptxas_advisory(report: Report):
    nvidia = [row for row in report.rows if row["arch"].startswith("sm_")]
    assert nvidia and all(row["advisories"] is not None for row in nvidia)
    found = gpu_report.advisory_lines(report.rows)
    assert not found, found
    assert "advisory:" not in report.stdout


def test_parameter_blocks_are_the_hosts_operand_bytes(report: Report):
    for row in report.rows:
        assert row["param_bytes"] == row["host_bytes"], _name(row)
    # The operand structs' sizes (pointers and Ints, 8 bytes each): a
    # phased kernel's phases are compiled in, not passed.
    sizes = {
        ("ring_close", "main"): 104,
        ("compress", "main"): 80,
        ("seed_tail", "main"): 80,
        ("step", "scan"): 136,
        ("step", "main"): 136,
        ("expand_topk", "main"): 48,
        ("index_top_k", "plan"): 216,
        ("index_top_k", "score_simt"): 216,
        ("index_top_k", "score_wgmma"): 216,
        ("index_top_k", "score_wgmma_rows"): 216,
        ("index_top_k", "score_mfma"): 216,
        ("index_top_k", "select"): 216,
        ("index_top_k", "split_select"): 216,
    }
    for row in report.rows:
        assert row["host_bytes"] == sizes[row["op"], row["kernel"]], _name(row)


@pytest.mark.parametrize("gpu", ["H200", "MI300X"])
def test_every_kernel_keeps_a_quarter_of_the_gpu_busy(report: Report, gpu: str):
    low = [
        f"{_name(r)}: {r['occupancy'][gpu]:.3f} ({r['limited_by'][gpu]})"
        for r in report.rows
        if gpu in r["occupancy"] and r["occupancy"][gpu] < 0.25
    ]
    assert any(gpu in r["occupancy"] for r in report.rows)
    assert not low, low


def test_tiled_scorer_ptx_has_no_local_memory(report: Report):
    for row in report.arch_rows("sm_90a"):
        if row["kernel"] in ("score_simt", "score_wgmma", "score_wgmma_rows"):
            facts = ptx_facts(report.code(row), row["entry"])
            assert facts["local"] == {}, _name(row)
            assert facts["global_loads"], _name(row)


def test_step_kernel_reads_the_ring_it_overwrites_without_nc_loads(
    report: Report,
):
    """The fused step closes a ring slot and then seeds it in one kernel:
    none of its loads may take the read-only path (``ld.global.nc``), which
    is only valid for memory the kernel never writes."""
    rows = [
        r
        for r in report.rows
        if r["arch"].startswith("sm_")
        and (r["op"], r["kernel"]) == ("step", "main")
    ]
    assert rows
    for row in rows:
        code = report.code(row)
        assert "ld.global." in code, _name(row)
        assert "ld.global.nc" not in code, _name(row)


#: The wgmma scorer's instructions per block: D = 128 in four k32 steps.
#: A row and a tile a block: all heads in one product (32 or 64 of them as
#: N). Grouped: 4 rows of 32 heads or 2 of 64 (N = 128), a product per
#: (segment, tile) pair, 4 tiles a block, a segment per row at most.
WGMMA_PER_TILE = {
    ("score_wgmma", "glm5next-k512"): (
        "wgmma.mma_async.sync.aligned.m64n32k32.f32.e4m3.e4m3",
        4,
    ),
    ("score_wgmma", "dsv32-k2048"): (
        "wgmma.mma_async.sync.aligned.m64n64k32.f32.e4m3.e4m3",
        4,
    ),
    ("score_wgmma_rows", "glm5next-k512"): (
        "wgmma.mma_async.sync.aligned.m64n128k32.f32.e4m3.e4m3",
        4 * 4 * 4,
    ),
    ("score_wgmma_rows", "dsv32-k2048"): (
        "wgmma.mma_async.sync.aligned.m64n128k32.f32.e4m3.e4m3",
        4 * 4 * 2,
    ),
}


def test_wgmma_scorer_issues_fp8_wgmma_and_keeps_off_local_memory(
    report: Report,
):
    seen = set()
    for row in report.arch_rows("sm_90a"):
        key = (row["kernel"], row["config"])
        if key not in WGMMA_PER_TILE:
            continue
        seen.add(key)
        facts = ptx_facts(report.code(row), row["entry"])
        instruction, count = WGMMA_PER_TILE[key]
        assert facts["tensor"] == {instruction: count}, _name(row)
        # What the emulation cannot see: the stores made visible to the
        # async proxy (after each staging: the grouped kernel has its
        # staging twice per phase, where a product runs and where none
        # does), the register fence before each chain, and the wait for it
        # before the registers are read (once per product: 4 k32 steps).
        code = ptx_entry_text(report.code(row), row["entry"])
        assert code.count("fence.proxy.async.shared::cta") >= 1, _name(row)
        for sync in (
            "wgmma.fence.sync.aligned",
            "wgmma.commit_group.sync.aligned",
            "wgmma.wait_group.sync.aligned 0",
        ):
            assert code.count(sync) == count // 4, (sync, _name(row))
        assert facts["local"] == {}, _name(row)
        assert row["spill_store_bytes"] == row["spill_load_bytes"] == 0, row
    assert seen == set(WGMMA_PER_TILE)


def _replay(report: Report):
    """A `compile_kernels` that copies the session's code instead."""

    def copy(arch: str, out_dir: Path, timeout: float = 0) -> None:
        shutil.copytree(report.asm_dir / arch, out_dir, dirs_exist_ok=True)

    return copy


def test_without_ptxas_the_ptx_alone_is_reported(
    report: Report, monkeypatch, capsys, tmp_path
):
    monkeypatch.setattr(gpu_report, "find_ptxas", lambda: None)
    monkeypatch.setattr(gpu_report, "compile_kernels", _replay(report))
    args = ["gpu-report", "--arch", "sm_90a", "--asm-dir", str(tmp_path)]
    json_path = tmp_path / "r.json"
    assert main([*args, "--json", str(json_path)]) == 0
    captured = capsys.readouterr()
    err = captured.err.splitlines()
    hints = [line for line in err if "[gpu-report]" in line]
    assert len(hints) == 1 and "ptxas" in hints[0]
    # Run from this checkout: the editable install, run at its root.
    root = Path(__file__).resolve().parents[2]
    assert f"`pip install -e '.[gpu-report]'` in {root}" in hints[0]
    # Under the table, a note says why its cells read ?.
    table = [ln for ln in captured.out.splitlines() if ln.startswith("sm_")]
    assert table and all(ln.split()[4] == "?" for ln in table)
    notes = [ln for ln in captured.out.splitlines() if ln.startswith("note:")]
    assert notes == [
        "note: regs, spill, scratch, matrix: ? and occupancy empty on sm_* ="
        " ptxas not"
        f" found; install it with `pip install -e '.[gpu-report]'` in {root}"
        " (the nvidia-cuda-nvcc wheel)"
    ]
    rows = json.loads(json_path.read_text())["kernels"]
    expected = {r["asm"]: r for r in report.arch_rows("sm_90a")}
    for row in rows:
        assert row["registers"] is None and row["occupancy"] == {}
        assert row["param_bytes"] == expected[row["asm"]]["param_bytes"]
        assert row["shared_bytes"] == expected[row["asm"]]["shared_bytes"]


@needs_ptxas
def test_without_nvdisasm_a_note_says_why_matrix_is_unknown(
    report: Report, monkeypatch, capsys, tmp_path
):
    monkeypatch.setattr(gpu_report, "find_nvdisasm", lambda: None)
    monkeypatch.setattr(gpu_report, "compile_kernels", _replay(report))
    argv = ["gpu-report", "--arch", "sm_90a", "gfx942"]
    assert main([*argv, "--asm-dir", str(tmp_path)]) == 0
    out = capsys.readouterr().out.splitlines()
    matrix = out[0].split().index("matrix")  # no column before has spaces
    cells: dict[str, list[str]] = {"sm_90a": [], "gfx942": []}
    for ln in out:
        if ln.startswith(("sm_", "gfx")):
            words = ln.split()
            cells[words[0]].append(words[matrix])
    assert set(cells["sm_90a"]) == {"?"}
    assert "?" not in cells["gfx942"] and "mfma" in cells["gfx942"]
    root = Path(__file__).resolve().parents[2]
    notes = [ln for ln in out if ln.startswith("note:")]
    assert notes == [
        "note: matrix: ? and calls read from the PTX on sm_* = nvdisasm not"
        " found; install it with"
        f" `pip install -e '.[gpu-report]'` in {root} (the"
        " nvidia-cuda-nvdisasm wheel)"
    ]


@needs_ptxas
def test_the_table_has_a_legend_and_no_note_when_every_tool_is_found(
    report: Report,
):
    out = report.stdout.splitlines()
    assert not any(ln.startswith("note:") for ln in out)
    legend = [ln[2:] for ln in out if ln.startswith("- ")]
    assert legend[: len(LEGEND)] == list(LEGEND)
    # Then a line per config, each explained, in the table's order.
    configs = [ln.split(":")[0] for ln in legend[len(LEGEND) :]]
    assert configs == [f"config {c}" for c in report.configs()]
    # Under the table: after its last row; the verdict closes the output.
    rows = [i for i, ln in enumerate(out) if ln.startswith(("sm_", "gfx"))]
    assert out.index("- " + LEGEND[0]) > max(rows)
    assert out[-1].startswith(f"verdict: {len(rows)} of {len(rows)} kernels")
    assert out[-1].endswith(
        "clean: no spills, no calls, no scratch, no ptxas advisories, every"
        " parameter block the host's bytes"
    )


def test_the_legend_explains_every_column():
    columns = list(COLUMNS[4:])  # past arch, op, kernel, config
    assert columns == [
        "regs",
        "spill",
        "calls",
        "scratch",
        "smem",
        "thr",
        "param/host",
        "matrix",
        "adv",
        "occupancy",
    ]
    text = " ".join(LEGEND)
    for column in columns:
        assert f"{column}: " in text, column


def test_mfma_scorer_issues_fp8_mfma_without_scratch(report: Report):
    rows = [
        r for r in report.arch_rows("gfx942") if r["kernel"] == "score_mfma"
    ]
    assert {r["config"] for r in rows} == INDEX_CONFIGS
    for row in rows:
        code = report.code(row)
        assert "v_mfma_f32_16x16x32_fp8_fp8" in code, _name(row)
        assert row["spill_store_bytes"] == row["spill_load_bytes"] == 0, row


def test_wgmma_scorer_bound_is_near_the_fp8_roofline_on_hopper(report: Report):
    # From the compiled kernels' own counts (the manifest's params): the
    # FP32 scorer is bound by its fmas at the FP32 peak, the wgmma scorer
    # by memory (decode) or by its padded tiles at the FP8 peak (prefill).
    rows = {
        (r["workload"], r["gpu"]): r
        for r in report.doc["rooflines"]
        if r.get("scorers")
    }
    for workload in ("glm5-next-decode", "glm5-next-prefill"):
        for gpu in ("H100", "H200"):
            r = rows[workload, gpu]
            bound = {x["scorer"]: x["bound_s"] for x in r["scorers"]}
            assert bound["simt"] == pytest.approx(r["bound_s_fp32"]), r
            assert r["bound_s_fp8"] <= bound["wgmma"] <= 1.5 * r["bound_s_fp8"]
    decode = rows["glm5-next-decode", "H200"]["scorers"]
    assert [x["binding"] for x in decode] == ["issue", "memory"]


def test_rooflines_grids_come_from_the_kernels_declarations(report: Report):
    # The manifest's grid rules, evaluated on the workloads' counts, give
    # the launches the kernels' docs describe. GLM-5-Next decode (16 rows
    # of 8,192 candidates): a plan block per request; simt tiles of 256
    # candidates (its 32 x 128 query: 4 waves of 64); wgmma tiles of 64;
    # the select's 16 rows split over 16 blocks each, by the split
    # kernel; a prefill's 4,096 rows
    # a block each, by the unsplit one. The step at batch 4096: one scan
    # block, then its requests and output rows (2 per request), 2 rows a
    # block (32 threads of 4 channels a row). expand_topk: a
    # block of 256 threads per token row.
    rows = {
        (r["workload"], r["gpu"]): r["kernels"] for r in report.doc["rooflines"]
    }
    decode = rows["glm5-next-decode", "H200"]
    assert [(k["kernel"], k["grid"], k["block_threads"]) for k in decode] == [
        ("plan", 16, 256),
        ("score_simt", 16 * 8192 // 256, 256),
        ("score_wgmma", 16 * 8192 // 64, 128),
        ("split_select", 16 * 16, 512),
    ]
    # DeepSeek-V3.2's 64 x 128 query: 8 waves, 512 threads; its select
    # splits the same way (32,768 candidates, 16 blocks a row).
    ds = rows["deepseek-v3.2-decode", "MI300X"]
    assert [(k["kernel"], k["grid"], k["block_threads"]) for k in ds] == [
        ("plan", 16, 256),
        ("score_simt", 16 * 32768 // 512, 512),
        ("score_mfma", 16 * 32768 // 64, 256),
        ("split_select", 16 * 16, 512),
    ]
    # A prefill's 4,096 rows of 1,024 candidates: wgmma blocks of 4 rows
    # and 4 tiles of 64 (the grouped kernel), a select block per row.
    prefill = rows["glm5-next-prefill", "H100"]
    assert [(k["kernel"], k["grid"]) for k in prefill][-2:] == [
        ("score_wgmma_rows", 4096 // 4 * 1024 // 256),
        ("select", 4096),
    ]
    step = rows["step-b4096", "B200"]
    assert [(k["kernel"], k["grid"], k["block_threads"]) for k in step] == [
        ("scan", 1, 1024),
        ("main", 3 * 4096 // 2, 64),
    ]
    for batch in (1, 64, 4096):
        close = rows[f"ring_close-b{batch}", "H200"]
        assert [(k["grid"], k["block_threads"]) for k in close] == [
            ((batch + 1) // 2, 64)
        ]
        expand = rows[f"expand_topk-b{batch}", "H200"]
        assert [(k["grid"], k["block_threads"]) for k in expand] == [
            (batch, 256)
        ]


NVDISASM = tools.find_nvdisasm()


@pytest.mark.skipif(
    PTXAS is None or NVDISASM is None, reason="needs ptxas and nvdisasm"
)
def test_tensor_scorers_machine_code_counts_match_the_manifest(report: Report):
    # The SASS holds the wgmma scorer's QGMMA, as many per block as the
    # manifest's count that the rooflines use, and no FP32 FMA chain; the
    # gfx942 code one MFMA per k-step (the head chunks are a loop).
    for row in report.rows:
        if row["kernel"] not in (
            "score_wgmma",
            "score_wgmma_rows",
            "score_mfma",
        ):
            continue
        ops = row["machine_ops"]
        params = row["params"]
        steps = -(-params["depth"] // 32)
        if row["kernel"] == "score_wgmma":
            # A k32 step per 32 dims for each chunk of up to 64 heads.
            chunks = -(-params["num_heads"] // 64)
            assert ops["matrix"] == {"QGMMA": chunks * steps}, row
        elif row["kernel"] == "score_wgmma_rows":
            # A product per (segment, tile) pair: rows x tiles of them.
            grid = row["grid"]
            pairs = grid["rows_per_block"] * grid["columns_per_block"] // 64
            assert ops["matrix"] == {"QGMMA": pairs * steps}, row
        else:
            assert ops["matrix"] == {"v_mfma_f32_16x16x32_fp8_fp8": steps}
    tiled = [
        r
        for r in report.arch_rows("sm_90a")
        if r["kernel"] == "score_simt" and r["config"] != UNTILED
    ]
    assert all(r["machine_ops"]["matrix"] == {} for r in tiled)
    assert all(r["machine_ops"]["fma"].get("FFMA", 0) > 0 for r in tiled)


def test_no_tool_is_made_executable_inside_site_packages(tmp_path, monkeypatch):
    # A wheel unpacked without modes: the tool is copied into this user's
    # cache, not chmodded where it is.
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    tool = tmp_path / "nvidia" / "cu13" / "bin" / "nvdisasm"
    tool.parent.mkdir(parents=True)
    tool.write_bytes(b"#!/bin/sh\necho ok\n")
    tool.chmod(0o644)
    monkeypatch.setattr(
        tools.importlib.util,
        "find_spec",
        lambda name: type(
            "S", (), {"submodule_search_locations": [str(tmp_path / "nvidia")]}
        ),
    )
    found = tools.find_nvdisasm()
    assert found is not None and found != str(tool)
    assert tool.stat().st_mode & 0o777 == 0o644
    assert (
        subprocess.run([found], capture_output=True, text=True).stdout == "ok\n"
    )


def test_a_tool_cache_others_can_write_is_refused(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    folder = tmp_path / "mla-kpool" / "tools"
    folder.mkdir(parents=True)
    folder.chmod(0o777)
    tool = tmp_path / "nvidia" / "cu13" / "bin" / "ptxas"
    tool.parent.mkdir(parents=True)
    tool.write_bytes(b"#!/bin/sh\n")
    tool.chmod(0o644)
    with pytest.raises(tools.ToolError, match="only you can write"):
        tools._executable(tool)

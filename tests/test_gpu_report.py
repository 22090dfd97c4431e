"""``python -m mla_kpool gpu-report``: every kernel compiled, read and checked.

One session fixture runs the report once for sm_90a, sm_100a and gfx942 and
keeps the code; the tests check its rows against independent reads of that
code (their own ``ptxas -v`` runs and regular expressions), and the rules
the kernels must keep: no spills, a parameter block equal to the host's
operand bytes, a quarter of the GPU's warps resident at least.
"""

from __future__ import annotations

import argparse
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
    amd_kernels,
    ptx_entries,
    ptx_entry_text,
    ptx_facts,
    ptx_param_bytes,
    ptx_shared_bytes,
)
from mla_kpool.gpu_report.report import param_mismatches

ARCHS = ["sm_90a", "sm_100a", "gfx942"]
OPS = {"ring_close", "compress", "seed_tail", "step", "expand_topk"}
OPS |= {"index_top_k"}
INDEX_CONFIGS = {"glm5next-k512", "glm5next-k2048", "dsv32-k2048", "h128-k2048"}
INDEX_KERNELS = {"plan", "score_simt", "select"}
#: The config whose query is too large for the tiled FP32 scorer.
UNTILED = "h128-k2048"
#: Kernels built only for the GPUs that run them: the tensor scorers.
ARCH_KERNELS = {"sm_90a": {"score_wgmma"}, "gfx942": {"score_mfma"}}
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
    assert index == {(k, c) for k in kernels for c in INDEX_CONFIGS}
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
        assert row["shared_bytes"] == field("group_segment_fixed_size")


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


def test_parameter_blocks_are_the_hosts_operand_bytes(report: Report):
    for row in report.rows:
        assert row["param_bytes"] == row["host_bytes"], _name(row)
    # The operand structs' sizes (pointers and Ints, 8 bytes each); a
    # phased kernel adds its Int64 phase count.
    sizes = {
        ("ring_close", "main"): 104,
        ("compress", "main"): 80,
        ("seed_tail", "main"): 80,
        ("step", "scan"): 136,
        ("step", "main"): 136,
        ("expand_topk", "main"): 48,
        ("index_top_k", "plan"): 200,
        ("index_top_k", "score_simt"): 200 + 8,
        ("index_top_k", "score_wgmma"): 200 + 8,
        ("index_top_k", "score_mfma"): 200 + 8,
        ("index_top_k", "select"): 200 + 8,
    }
    for row in report.rows:
        want = sizes[row["op"], row["kernel"]]
        if (row["kernel"], row["config"]) == ("score_simt", UNTILED):
            want = 200  # the untiled scorer: no phases
        assert row["host_bytes"] == want, _name(row)


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
        if row["kernel"] in ("score_simt", "score_wgmma"):
            facts = ptx_facts(report.code(row), row["entry"])
            assert facts["local"] == {}, _name(row)
            assert facts["global_loads"], _name(row)


#: The wgmma scorer's instructions per 64-candidate tile: D = 128 in four
#: k32 steps, all heads in one product (32 or 64 of them as N).
WGMMA_PER_TILE = {
    "glm5next-k512": (
        "wgmma.mma_async.sync.aligned.m64n32k32.f32.e4m3.e4m3",
        4,
    ),
    "dsv32-k2048": ("wgmma.mma_async.sync.aligned.m64n64k32.f32.e4m3.e4m3", 4),
}


def test_wgmma_scorer_issues_fp8_wgmma_and_keeps_off_local_memory(
    report: Report,
):
    seen = set()
    for row in report.arch_rows("sm_90a"):
        if (
            row["kernel"] != "score_wgmma"
            or row["config"] not in WGMMA_PER_TILE
        ):
            continue
        seen.add(row["config"])
        facts = ptx_facts(report.code(row), row["entry"])
        instruction, count = WGMMA_PER_TILE[row["config"]]
        assert facts["tensor"] == {instruction: count}, _name(row)
        # What the emulation cannot see: the stores made visible to the
        # async proxy, the register fence before the chain, and the wait
        # for it before the registers are read (once each).
        code = ptx_entry_text(report.code(row), row["entry"])
        for sync in (
            "fence.proxy.async.shared::cta",
            "wgmma.fence.sync.aligned",
            "wgmma.commit_group.sync.aligned",
            "wgmma.wait_group.sync.aligned 0",
        ):
            assert code.count(sync) == 1, (sync, _name(row))
        assert facts["local"] == {}, _name(row)
        assert row["spill_store_bytes"] == row["spill_load_bytes"] == 0, row
    assert seen == set(WGMMA_PER_TILE)


def _row(**fields) -> dict:
    row = {
        "arch": "sm_90a",
        "op": "ring_close",
        "kernel": "main",
        "config": "bf16-d128-kpool4",
        "entry": "kpool_ring_close_kernel_0",
        "param_bytes": 104,
        "host_bytes": 104,
    }
    return row | fields


def test_a_parameter_mismatch_names_the_kernel_and_both_sizes():
    rows = [_row(), _row(op="step", kernel="scan", param_bytes=144)]
    (message,) = param_mismatches(rows)
    assert "step/scan" in message and "144" in message and "104" in message


def test_a_parameter_mismatch_fails_the_command(monkeypatch, capsys, tmp_path):
    bad = _row(op="compress", param_bytes=88, host_bytes=80)
    monkeypatch.setattr(gpu_report, "report", lambda archs, d: [_row(), bad])
    assert main(["gpu-report", "--asm-dir", str(tmp_path)]) == 1
    err = capsys.readouterr().err
    assert "compress/main" in err and "88" in err and "80" in err


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
    err = capsys.readouterr().err.splitlines()
    hints = [line for line in err if "[gpu-report]" in line]
    assert len(hints) == 1 and "ptxas" in hints[0]
    # Run from this checkout: the editable install, run at its root.
    root = Path(__file__).resolve().parents[1]
    assert f"`pip install -e '.[gpu-report]'` in {root}" in hints[0]
    rows = json.loads(json_path.read_text())["kernels"]
    expected = {r["asm"]: r for r in report.arch_rows("sm_90a")}
    for row in rows:
        assert row["registers"] is None and row["occupancy"] == {}
        assert row["param_bytes"] == expected[row["asm"]]["param_bytes"]
        assert row["shared_bytes"] == expected[row["asm"]]["shared_bytes"]


def test_a_missing_mojo_is_one_line(monkeypatch, capsys, tmp_path):
    monkeypatch.setattr(tools, "mojo_command", lambda: None)
    assert main(["gpu-report", "--asm-dir", str(tmp_path)]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("gpu-report: the mojo command is not found")
    assert not any("Traceback" in line for line in err)


PTX = """
.visible .entry k_1(
\t.param .u32 k_1_param_0,
\t.param .align 8 .b8 k_1_param_1[20],
\t.param .b64 k_1_param_2
)
{
\t.shared .align 4 .b8 k_1_smem[100];
\tld.global.nc.v2.u32 {%r1, %r2}, [%rd1];
\tld.global.u8 %rs1, [%rd2];
\tld.global.u8 %rs2, [%rd3];
\tcvt.rn.f16x2.e4m3x2 %r3, %rs1;
\tst.local.u32 [%rd4], %r3;
\tret;
}
.visible .entry k_2(
\t.param .u8 k_2_param_0
)
{
\tld.local.u32 %r1, [%rd1];
}
"""


def test_ptx_readers_on_a_written_module():
    assert ptx_entries(PTX) == ["k_1", "k_2"]
    # u32 at 0, 20 bytes aligned to 8 at 8..28, b64 aligned to 8 at 32..40.
    assert ptx_param_bytes(PTX, "k_1") == 40
    assert ptx_param_bytes(PTX, "k_2") == 1
    assert ptx_shared_bytes(PTX, "k_1") == 100
    facts = ptx_facts(PTX, "k_1")
    assert facts["local"] == {"st.local.u32": 1}
    assert facts["cvt"] == {"cvt.rn.f16x2.e4m3x2": 1}
    assert facts["global_loads"] == {
        "ld.global.nc.v2.u32": 1,
        "ld.global.u8": 2,
    }
    assert ptx_facts(PTX, "k_2")["local"] == {"ld.local.u32": 1}


AMD = """
\t.amdhsa_kernel k_1
\t\t.amdhsa_group_segment_fixed_size 512
\t\t.amdhsa_private_segment_fixed_size 16
\t\t.amdhsa_kernarg_size 272
\t\t.amdhsa_next_free_vgpr 40
\t\t.amdhsa_next_free_sgpr 20
\t.end_amdhsa_kernel
\t.amdgpu_metadata
---
amdhsa.kernels:
  - .agpr_count:     0
    .args:
      - .offset:         0
        .size:           200
        .value_kind:     by_value
      - .offset:         200
        .size:           8
        .value_kind:     by_value
      - .offset:         208
        .size:           4
        .value_kind:     hidden_block_count_x
    .name:           k_1
    .sgpr_count:     26
    .sgpr_spill_count: 3
    .vgpr_count:     37
    .vgpr_spill_count: 2
...
\t.end_amdgpu_metadata
"""


def test_amd_reader_counts_only_explicit_arguments():
    (facts,) = amd_kernels(AMD).values()
    assert facts == {
        "registers": 40,
        "vgpr_count": 37,
        "agprs": 0,
        "sgprs": 26,
        "shared_bytes": 512,
        "private_bytes": 16,
        "vgpr_spills": 2,
        "sgpr_spills": 3,
        "kernarg_bytes": 272,
        "param_bytes": 208,
    }


@pytest.mark.parametrize(
    "argv",
    [
        ["--arch", "sm_90a", "gfx942"],
        ["--arch", "sm_90a", "--arch", "gfx942"],
    ],
)
def test_arch_takes_several_targets(argv: list[str]):
    parser = argparse.ArgumentParser()
    gpu_report.add_arguments(parser)
    assert parser.parse_args(argv).arch == ["sm_90a", "gfx942"]


def test_the_ptxas_hint_names_the_extra(monkeypatch, tmp_path):
    hint = tools.ptxas_hint(checkout=Path("/src/mla-kpool"))
    assert "`pip install -e '.[gpu-report]'` in /src/mla-kpool" in hint
    assert "\n" not in hint
    # Installed from a wheel: no pyproject.toml three folders up.
    monkeypatch.setattr(tools, "_CHECKOUT", tmp_path)
    hint = tools.ptxas_hint()
    assert "`pip install 'mla-kpool[gpu-report]'`" in hint
    (tmp_path / "pyproject.toml").write_text("")
    assert (
        f"`pip install -e '.[gpu-report]'` in {tmp_path}" in tools.ptxas_hint()
    )


#: Mojo's output for an architecture its GPU table lacks (abridged).
UNKNOWN_ARCH_STDERR = """\
kernel_asm.mojo:336:5: error: function instantiation failed
def main() raises:
    ^
kernel_asm.mojo:140:9: note: function instantiation failed
Mojo/stdlib/std/_gpu/host/info.mojo:126:13: note: constraint failed: \
Unknown GPU architecture detected.

Supported GPU architectures:
/venv/bin/mojo: error: failed to run the pass manager
"""


def test_a_failed_compile_names_the_constraint(monkeypatch):
    def mojo(argv, **kwargs):
        return subprocess.CompletedProcess(argv, 1, "", UNKNOWN_ARCH_STDERR)

    monkeypatch.setattr(tools.subprocess, "run", mojo)
    with pytest.raises(tools.ToolError) as e:
        tools.compile_kernels("sm_90a", Path("unused"))
    assert str(e.value) == (
        "compiling the kernels for sm_90a failed: kernel_asm.mojo:336:5: "
        "error: function instantiation failed (constraint failed: Unknown "
        "GPU architecture detected.)"
    )
    # Without a note, the first error line alone.
    assert tools.compile_error("a\nx: error: bad\ny: error: worse\n", 1) == (
        "x: error: bad"
    )
    assert tools.compile_error("", 3) == "exit status 3"


def _no_compile(arch: str, out_dir: Path, timeout: float = 0) -> None:
    raise AssertionError(f"compiled for {arch}")


def _usage_error(capsys, argv: list[str]) -> str:
    """The one-line error of a command line refused with exit status 2."""
    with pytest.raises(SystemExit) as e:
        main(["gpu-report", *argv])
    assert e.value.code == 2
    captured = capsys.readouterr()
    assert captured.out == "" and "Traceback" not in captured.err
    return captured.err.strip().splitlines()[-1]


@pytest.mark.parametrize("arch", ["gfx950", "sm_80", "nonsense", "sm_90"])
def test_an_arch_the_report_does_not_know_is_a_usage_error(
    monkeypatch, capsys, arch: str
):
    monkeypatch.setattr(gpu_report, "compile_kernels", _no_compile)
    line = _usage_error(capsys, ["--arch", "sm_90a", arch])
    assert line.endswith(
        "error: argument --arch: must be one of sm_90a, sm_100a, gfx942 (the "
        f"targets whose GPUs the occupancy model knows), got {arch!r}"
    )


def test_json_in_a_missing_folder_is_a_usage_error(
    monkeypatch, capsys, tmp_path
):
    monkeypatch.setattr(gpu_report, "compile_kernels", _no_compile)
    path = tmp_path / "missing" / "x.json"
    line = _usage_error(capsys, ["--json", str(path)])
    assert line.endswith(
        f"error: argument --json: must be a file in an existing folder, "
        f"got {str(path)!r}"
    )
    assert list(tmp_path.iterdir()) == []


def test_asm_dir_under_a_file_is_a_usage_error(monkeypatch, capsys, tmp_path):
    monkeypatch.setattr(gpu_report, "compile_kernels", _no_compile)
    file = tmp_path / "file"
    file.write_text("x")
    line = _usage_error(capsys, ["--asm-dir", str(file / "asm")])
    assert line.endswith(
        f"error: argument --asm-dir: cannot create {str(file / 'asm')!r}: "
        f"{str(file)!r} is not a folder"
    )
    line = _usage_error(capsys, ["--asm-dir", str(file)])
    assert line.endswith(
        f"error: argument --asm-dir: must be a folder, got the file "
        f"{str(file)!r}"
    )
    assert file.read_text() == "x" and list(tmp_path.iterdir()) == [file]


def test_an_asm_dir_that_cannot_be_created_fails_before_compiling(
    monkeypatch, capsys, tmp_path
):
    # Paths the option check passes but mkdir refuses (as root, /proc/x):
    # without the check, a path under a file stands in for them.
    monkeypatch.setattr(gpu_report, "output_dir", str)
    monkeypatch.setattr(gpu_report, "compile_kernels", _no_compile)
    file = tmp_path / "file"
    file.write_text("x")
    assert main(["gpu-report", "--asm-dir", str(file / "asm")]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.strip() == (
        f"gpu-report: argument --asm-dir: cannot create {file / 'asm'}: "
        "Not a directory"
    )


def test_a_json_path_that_cannot_be_written_fails_before_compiling(
    monkeypatch, capsys, tmp_path
):
    # A folder, an empty path, and a file under /proc (a folder os.access
    # calls writable, where no file can be made): each a usage error,
    # before the report compiles anything, leaving nothing behind.
    monkeypatch.setattr(gpu_report, "compile_kernels", _no_compile)
    for path, why in (
        (str(tmp_path), f"cannot write {str(tmp_path)!r}: a folder"),
        ("", "must be a file path, got ''"),
        ("/proc/x.json", "cannot write '/proc/x.json': "),
    ):
        line = _usage_error(capsys, ["--json", path])
        assert f"error: argument --json: {why}" in line, line
    assert sorted(tmp_path.iterdir()) == []


def test_a_written_json_says_where(monkeypatch, capsys, tmp_path):
    monkeypatch.setattr(gpu_report, "report", lambda archs, d: [_row()])
    monkeypatch.setattr(
        gpu_report, "_write_json", lambda p, r: p.write_text("{}")
    )
    path = tmp_path / "r.json"
    assert (
        main(["gpu-report", "--asm-dir", str(tmp_path), "--json", str(path)])
        == 0
    )
    assert capsys.readouterr().err.strip().endswith(f"gpu-report: wrote {path}")


def test_a_failed_compile_prints_no_table(monkeypatch, capsys, tmp_path):
    def fail(arch: str, out_dir: Path, timeout: float = 0) -> None:
        raise tools.ToolError(f"compiling the kernels for {arch} failed: x")

    monkeypatch.setattr(gpu_report, "compile_kernels", fail)
    assert main(["gpu-report", "--asm-dir", str(tmp_path)]) == 1
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.strip().splitlines()[-1] == (
        "gpu-report: compiling the kernels for sm_90a failed: x"
    )


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
    # of 8,192 candidates): a plan block of 256 rows; simt tiles of 256
    # candidates (its 32 x 128 query: 4 waves of 64); wgmma tiles of 64;
    # a select block per row. The step at batch 4096: one scan thread,
    # then a block per request and per output row (2 per request).
    rows = {
        (r["workload"], r["gpu"]): r["kernels"] for r in report.doc["rooflines"]
    }
    decode = rows["glm5-next-decode", "H200"]
    assert [(k["kernel"], k["grid"], k["block_threads"]) for k in decode] == [
        ("plan", 1, 256),
        ("score_simt", 16 * 8192 // 256, 256),
        ("score_wgmma", 16 * 8192 // 64, 128),
        ("select", 16, 512),
    ]
    # DeepSeek-V3.2's 64 x 128 query: 8 waves, 512 threads.
    ds = rows["deepseek-v3.2-decode", "MI300X"]
    assert [(k["kernel"], k["grid"], k["block_threads"]) for k in ds] == [
        ("plan", 1, 256),
        ("score_simt", 16 * 32768 // 512, 512),
        ("score_mfma", 16 * 32768 // 64, 256),
        ("select", 16, 512),
    ]
    step = rows["step-b4096", "B200"]
    assert [(k["kernel"], k["grid"]) for k in step] == [
        ("scan", 1),
        ("main", 3 * 4096),
    ]


NVDISASM = tools.find_nvdisasm()


@pytest.mark.skipif(
    PTXAS is None or NVDISASM is None, reason="needs ptxas and nvdisasm"
)
def test_tensor_scorers_machine_code_counts_match_the_manifest(report: Report):
    # The SASS holds the wgmma scorer's QGMMA, as many per tile as the
    # manifest's count that the rooflines use, and no FP32 FMA chain; the
    # gfx942 code one MFMA per k-step (the head chunks are a loop).
    for row in report.rows:
        if row["kernel"] not in ("score_wgmma", "score_mfma"):
            continue
        ops = row["machine_ops"]
        params = row["params"]
        steps = -(-params["depth"] // 32)
        if row["kernel"] == "score_wgmma":
            # A k32 step per 32 dims for each chunk of up to 64 heads.
            chunks = -(-params["num_heads"] // 64)
            assert ops["matrix"] == {"QGMMA": chunks * steps}, row
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

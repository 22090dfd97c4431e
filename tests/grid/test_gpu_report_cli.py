"""``gpu-report`` without compiling: its command line and its readers.

Usage errors (exit 2 before anything compiles, in argparse's form), how a
missing tool or a failed compile is reported, the notes under the table, and
the readers of PTX, AMDGPU code and ``ptxas`` output on written samples.
The compiled report itself is tests/grid/test_gpu_report.py's.
"""

from __future__ import annotations

import argparse
import subprocess
from pathlib import Path

import pytest

import mla_kpool.gpu_report as gpu_report
from mla_kpool.__main__ import main
from mla_kpool._argtypes import output_dir
from mla_kpool.gpu_report import tools
from mla_kpool.gpu_report.asm import (
    amd_calls,
    amd_kernels,
    memory_ops,
    ptx_calls,
    ptx_entries,
    ptx_facts,
    ptx_param_bytes,
    ptx_shared_bytes,
    ptxas_advisories,
    sass_calls,
    sass_subroutine_calls,
)
from mla_kpool.gpu_report.report import (
    COLUMNS,
    config_legend,
    param_mismatches,
    table_lines,
    table_notes,
    verdict,
)

#: ptxas 13.0's words for the wgmma scorer before it broadcast its idle
#: predicate and fenced its accumulators after the wait.
ADVISORY_SAMPLE = """\
ptxas info    : 0 bytes gmem
ptxas info    : Compiling entry function 'score_7' for 'sm_90a'
ptxas info    : (C7517) wgmma.wait_group is injected in around line 352 by \
compiler to allow use of registers defined by GMMA in function 'score_7'
ptxas info    : (C7518) Potential Performance Loss: wgmma.mma_async \
instructions are serialized due to program dependence on compiler-inserted \
WG.DP in divergent path in the function 'score_7' in line 349
ptxas info    : (C7514) Potential Performance Loss: wgmma.mma_async \
instructions are serialized due to non wgmma instructions reading \
accumulator registers of  a wgmma between start and end of the pipeline \
stage in the function 'other_2' in line 0
ptxas info    : Used 54 registers, used 1 barriers, 13312 bytes smem
"""


def test_ptxas_advisories_are_read_per_function():
    found = ptxas_advisories(ADVISORY_SAMPLE)
    assert list(found) == ["score_7", "other_2"]
    assert [a.split(":")[0] for a in found["score_7"]] == ["C7517", "C7518"]
    assert found["score_7"][1].startswith("C7518: Potential Performance Loss")
    assert found["other_2"][0].startswith("C7514: ")
    assert ptxas_advisories("ptxas info    : Used 54 registers") == {}
    row = {"arch": "sm_90a", "op": "index_top_k", "kernel": "score_wgmma"}
    row |= {"config": "glm5next-k512", "advisories": found["score_7"]}
    lines = gpu_report.advisory_lines([row, {**row, "advisories": None}])
    assert lines == [
        f"sm_90a index_top_k/score_wgmma [glm5next-k512]: {a}"
        for a in found["score_7"]
    ]


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


def test_table_notes_name_the_missing_tool(monkeypatch, tmp_path):
    monkeypatch.setattr(tools, "_CHECKOUT", tmp_path)  # not a checkout
    nvidia = _row(registers=30, machine_ops=None)
    amd = _row(arch="gfx942", registers=30, machine_ops={"matrix": {}})
    assert table_notes([nvidia, amd], "ptxas", "nvdisasm") == []
    (note,) = table_notes([nvidia, amd], "ptxas", None)
    assert note.startswith(
        "matrix: ? and calls read from the PTX on sm_* = nvdisasm not found"
    )
    assert "`pip install 'mla-kpool[gpu-report]'`" in note
    no_regs = _row(registers=None, machine_ops=None)
    (note,) = table_notes([no_regs], None, None)
    assert note.startswith("regs, spill, scratch, matrix: ? and occupancy")
    assert "ptxas not found" in note
    # AMD rows alone need neither tool.
    assert table_notes([amd], None, None) == []


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


#: A gfx942 kernel that calls a phase out of line (its arguments through
#: 104 bytes of scratch), then the callee, which calls on and returns.
AMD_CALLS = """
k_1:
\ts_getpc_b64 s[16:17]
\ts_add_u32 s16, s16, phase_3@rel32@lo+4
\ts_addc_u32 s17, s17, phase_3@rel32@hi+12
\tscratch_store_dword off, v4, s33 offset:8
\ts_swappc_b64 s[30:31], s[16:17]
\ts_swappc_b64 s[30:31], s[18:19]
\ts_endpgm
\t.amdhsa_kernel k_1
\t\t.amdhsa_private_segment_fixed_size 104
\t.end_amdhsa_kernel
phase_3:
\ts_swappc_b64 s[30:31], s[4:5]
\ts_setpc_b64 s[30:31]
tail_4:
\ts_setpc_b64 s[6:7]
"""

#: nvdisasm's listing of a cubin that calls a function of its own and an
#: absolute address, predicated once, and ptxas's division subroutines
#: (as ptxas 13 names them); the callee's return is no call.
SASS_CALLS = """
        /*0080*/                   CALL.REL.NOINC `(phase_3) ;
        /*0090*/              @P0  CALL.REL.NOINC `(phase_4) ;
        /*00a0*/                   CALL.ABS.NOINC 0x0 ;
        /*00b0*/              @!P1 CALL.REL.NOINC \
`($__internal_0_$__cuda_sm20_div_s64) ;
        /*00c0*/                   CALL.REL.NOINC \
`($__internal_1_$__cuda_sm3x_div_rn_noftz_f32_slowpath) ;
        /*00d0*/                   CALL.REL.NOINC \
`($__internal_0_$__cuda_sm20_div_s64) ;
        /*00e0*/                   EXIT ;
        .text.phase_3:
        /*0000*/                   RET.REL.NODEC R20 `(k_1) ;
"""

#: PTX with a callee (a call prototype is no call) and two calls.
PTX_CALLS = """
.func phase_3(.param .b64 phase_3_param_0)
{
\tret;
}
.visible .entry k_1(
\t.param .b64 k_1_param_0
)
{
\tprototype_0 : .callprototype ()_ (.param .b64 _);
\t{ // callseq 0, 0
\tcall.uni phase_3, (param0);
\t} // callseq 0
\t@%p1 call phase_3, (param0);
\tret;
}
"""


def test_call_readers_count_calls_not_returns():
    assert amd_calls(AMD_CALLS) == 4  # 3 s_swappc_b64, 1 tail s_setpc_b64
    assert amd_calls(AMD) == 0
    (facts,) = amd_kernels(AMD_CALLS).values()
    assert facts["private_bytes"] == 104
    assert sass_calls(SASS_CALLS) == 3
    assert sass_subroutine_calls(SASS_CALLS) == {
        "__cuda_sm20_div_s64": 2,
        "__cuda_sm3x_div_rn_noftz_f32_slowpath": 1,
    }
    assert sass_subroutine_calls(SASS_CALLS.replace("$__internal", "x")) == {}
    assert sass_calls("        /*0000*/   EXIT ;") == 0
    assert ptx_calls(PTX_CALLS) == 2
    assert ptx_calls(PTX) == 0


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
    # A path the option check passes but mkdir refuses (a race): without
    # the check, a path under a file stands in for it. The report says so
    # as argparse says it of a refused option: usage, then the error.
    monkeypatch.setattr(gpu_report, "output_dir", str)
    monkeypatch.setattr(gpu_report, "compile_kernels", _no_compile)
    file = tmp_path / "file"
    file.write_text("x")
    assert main(["gpu-report", "--asm-dir", str(file / "asm")]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    first, *_, last = captured.err.strip().splitlines()
    assert first.startswith("usage: ") and "gpu-report" in first
    assert last.endswith(
        f"gpu-report: error: argument --asm-dir: cannot create "
        f"{str(file / 'asm')!r}: Not a directory"
    )


def test_asm_dir_errors_take_the_form_of_json_errors(
    monkeypatch, capsys, tmp_path
):
    # /proc/nope: refused while parsing (as root os.access passes /proc, but
    # no folder can be made there), in the same form as --json /proc/x.json.
    monkeypatch.setattr(gpu_report, "compile_kernels", _no_compile)
    forms = []
    for option, path in (
        ("--asm-dir", "/proc/nope"),
        ("--json", "/proc/x.json"),
    ):
        with pytest.raises(SystemExit) as e:
            main(["gpu-report", option, path])
        assert e.value.code == 2
        captured = capsys.readouterr()
        assert captured.out == ""
        lines = captured.err.strip().splitlines()
        assert lines[0].startswith("usage: ")
        assert f"error: argument {option}: cannot " in lines[-1]
        assert repr(path) in lines[-1]
        forms.append(lines[-1].split(" error: ")[0])
    assert forms[0] == forms[1]
    assert not Path("/proc/nope").exists()


def test_asm_dir_check_leaves_nothing_behind(tmp_path):
    deep = tmp_path / "a" / "b"
    assert output_dir(str(deep)) == str(deep)
    assert list(tmp_path.iterdir()) == []
    (tmp_path / "kept").mkdir()
    assert output_dir(str(tmp_path / "kept")) == str(tmp_path / "kept")
    assert [p.name for p in tmp_path.iterdir()] == ["kept"]
    assert list((tmp_path / "kept").iterdir()) == []


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


def _full_row(**fields) -> dict:
    """A row with every field the table reads (ptxas and nvdisasm ran)."""
    return (
        _row(
            registers=40,
            spill_store_bytes=0,
            spill_load_bytes=0,
            calls=0,
            scratch_bytes=0,
            shared_bytes=1024,
            block_threads=256,
            machine_ops={"matrix": {}},
            advisories=[],
            occupancy={"H100": 1.0},
            limited_by={"H100": "blocks"},
            params={"dtype": "bfloat16", "head_dim": 128, "kpool": 4},
        )
        | fields
    )


def test_the_table_columns_fit_their_widest_cell():
    long = "score_wgmma_rows_and_then_some"
    lines = table_lines([_full_row(), _full_row(kernel=long)])
    assert len(lines) == 3
    # Every column starts where its name starts in the header.
    starts = [lines[0].index(name) for name in COLUMNS[:4]]
    for line in lines[1:]:
        for start in starts[1:]:
            assert line[start - 1] == " " and line[start] != " "
    assert lines[2].split()[2] == long
    assert lines[1].split()[4] == "40"  # regs, after the long kernel name
    # calls and scratch after spill, each under its name.
    header = lines[0].split()
    assert header[4:8] == ["regs", "spill", "calls", "scratch"]
    assert lines[1].split()[6:8] == ["0", "0"]
    lines = table_lines([_full_row(calls=66, scratch_bytes=104)])
    assert lines[1].split()[6:8] == ["66", "104"]
    lines = table_lines([_full_row(calls=None, scratch_bytes=None)])
    assert lines[1].split()[6:8] == ["?", "?"]
    assert lines[1].endswith("  H100 1.00 (blocks)")


def test_every_config_is_explained_from_its_parameters():
    rows = [
        _full_row(),
        _full_row(kernel="scan"),
        _full_row(
            op="index_top_k",
            config="dsv32-k2048",
            params={"num_heads": 64, "k": 2048, "spread": False},
        ),
    ]
    assert config_legend(rows) == [
        "config bf16-d128-kpool4: the writers; dtype bfloat16, head dim"
        " 128, kpool 4",
        "config dsv32-k2048: DeepSeek-V3.2's indexer; num heads 64, k 2048,"
        " spread false",
    ]


def test_the_verdict_names_each_kernel_that_is_not_clean():
    clean = [_full_row(), _full_row(arch="gfx942")]
    assert verdict(clean) == (
        "verdict: 2 of 2 kernels (sm_90a, gfx942) clean: no spills, no"
        " calls, no scratch, no ptxas advisories, every parameter block the"
        " host's bytes"
    )
    bad = [
        *clean,
        _full_row(op="step", spill_store_bytes=8, spill_load_bytes=8),
        _full_row(kernel="x", advisories=["C7518: serialized"]),
        _full_row(op="compress", param_bytes=88, host_bytes=80),
        _full_row(
            arch="gfx942",
            op="index_top_k",
            kernel="select",
            config="glm5next-k2048",
            calls=66,
            scratch_bytes=104,
        ),
    ]
    assert verdict(bad) == (
        "verdict: 4 of 6 kernels (sm_90a, gfx942) need a look:"
        " sm_90a step/main [bf16-d128-kpool4]: spills 8/8 B;"
        " sm_90a ring_close/x [bf16-d128-kpool4]: advisories C7518;"
        " sm_90a compress/main [bf16-d128-kpool4]: parameter block 88 B,"
        " host 80 B;"
        " gfx942 index_top_k/select [glm5next-k2048]: calls 66, scratch"
        " 104 B"
    )
    # A stack frame without calls (a local array) is not clean either.
    assert verdict([_full_row(scratch_bytes=16)]) == (
        "verdict: 1 of 1 kernels (sm_90a) need a look: sm_90a"
        " ring_close/main [bf16-d128-kpool4]: scratch 16 B"
    )
    unknown = _full_row(
        registers=None,
        spill_store_bytes=None,
        spill_load_bytes=None,
        scratch_bytes=None,
        advisories=None,
    )
    assert verdict([*clean, unknown]).endswith(
        "; 1 with spills, scratch or advisories unknown (no ptxas: see the"
        " note)"
    )
    assert verdict([*clean, unknown]).startswith("verdict: 2 of 3 kernels")


SASS_SEGMENTS = """
        /*0000*/                   LDG.E R3, desc[UR10][R6.64+0x4] ;
        /*0010*/               @P1 LDG.E.128 R8, desc[UR10][R6.64] ;
        /*0020*/                   STS.64 [R2], R4 ;
        /*0030*/                   BAR.SYNC.DEFER_BLOCKING 0x0 ;
        /*0040*/                   LDS.U8 R1, [R2+0x3] ;
        /*0050*/                   ATOMS.POPC.INC.32 RZ, [R8+URZ+0x1810] ;
        /*0060*/              @!P0 ATOMG.E.ADD.STRONG.GPU PT, RZ, [R6.64], R17 ;
        /*0070*/                   STL [R1+0x8], R3 ;
        /*0080*/                   IADD3 R1, R1, 0x1, RZ ;
        /*0090*/                   BAR.SYNC.DEFER_BLOCKING 0x0 ;
        /*00a0*/                   STG.E desc[UR10][R6.64], R3 ;
"""

AMD_SEGMENTS = """
\tglobal_load_dwordx4 v[0:3], v[4:5], off
\tds_write_b64 v1, v[2:3]
\ts_barrier
\tds_read2st64_b32 v[6:7], v1 offset1:4
\tds_bpermute_b32 v8, v9, v10
\tds_add_u32 v1, v2
\tbuffer_wbl2
\tscratch_store_dword off, v1, s33
\ts_barrier
\tglobal_store_dword v[4:5], v1, off
"""


def test_memory_instructions_by_barrier_segment():
    sass = memory_ops(SASS_SEGMENTS)
    assert [seg["instructions"] for seg in sass["segments"]] == [3, 5, 1]
    assert sass["segments"][0]["ops"] == {
        "LDG.32": 1, "LDG.128": 1, "STS.64": 1,
    }  # fmt: skip
    assert sass["segments"][1]["ops"] == {
        "LDS.8": 1, "ATOMS": 1, "ATOMG": 1, "STL.32": 1,
    }  # fmt: skip
    assert sass["ops"]["STG.32"] == 1
    assert sass["local"] == 1
    amd = memory_ops(AMD_SEGMENTS)
    assert [seg["instructions"] for seg in amd["segments"]] == [2, 5, 1]
    assert amd["segments"][1]["ops"] == {
        "ds_read2.32": 1, "ds_permute": 1, "ds_atomic": 1, "local": 1,
    }  # fmt: skip
    assert amd["ops"]["global_load.128"] == 1
    assert amd["ops"]["global_store.32"] == 1
    assert amd["local"] == 1

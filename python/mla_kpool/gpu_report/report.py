"""One row per (kernel, config, arch): what the compiled code says.

:func:`kernel_rows` reads the driver's manifest and code for one target and
adds, per kernel, what the code and (on NVIDIA) ``ptxas -v`` say: entry
symbol, registers, spills, stack, out-of-line calls and scratch memory,
barriers, shared memory, parameter block, then the theoretical occupancy on
each GPU of the target (:mod:`mla_kpool.gpu_report.occupancy`).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from .asm import (
    amd_calls,
    amd_kernels,
    machine_ops,
    memory_ops,
    parse_ptxas,
    ptx_calls,
    ptx_entries,
    ptx_param_bytes,
    ptx_shared_bytes,
    ptxas_advisories,
    sass_calls,
    sass_subroutine_calls,
)
from .tools import ToolError, install_command, run_nvdisasm, run_ptxas

Row = dict[str, Any]

#: What ``ptxas -v`` adds to a PTX row (``None`` without ptxas).
PTXAS_FIELDS = (
    "registers",
    "spill_store_bytes",
    "spill_load_bytes",
    "stack_bytes",
    "barriers",
)


def is_nvidia(arch: str) -> bool:
    """Whether ``arch`` is an NVIDIA target (PTX), else AMDGPU."""
    return arch.startswith("sm_")


def read_manifest(out_dir: Path) -> list[Row]:
    """The driver's ``manifest.jsonl``: one dict per kernel."""
    text = (out_dir / "manifest.jsonl").read_text()
    return [json.loads(line) for line in text.splitlines() if line.strip()]


def _entry(symbols: list[str], prefix: str, asm: str) -> str:
    """The one symbol named ``<prefix>_<hash>``."""
    found = [s for s in symbols if s.startswith(prefix + "_")]
    if len(found) != 1:
        raise ToolError(f"{asm}: {len(found)} kernels named {prefix}_*")
    return found[0]


def _nvidia_facts(
    arch: str,
    path: Path,
    prefix: str,
    ptxas: str | None,
    nvdisasm: str | None = None,
) -> Row:
    ptx = path.read_text()
    entry = _entry(ptx_entries(ptx), prefix, path.name)
    row: Row = {
        "entry": entry,
        "param_bytes": ptx_param_bytes(ptx, entry),
        "shared_bytes": ptx_shared_bytes(ptx, entry),
        "machine_ops": None,
        "memory_ops": None,
        # The PTX's calls until the SASS says what ptxas kept.
        "calls": ptx_calls(ptx),
        "calls_from": "ptx",
        "subroutine_calls": None,
    }
    row.update(dict.fromkeys(PTXAS_FIELDS))
    row["advisories"] = None
    row["scratch_bytes"] = None
    if ptxas is not None:
        cubin = path.with_suffix(".cubin") if nvdisasm else None
        output = run_ptxas(ptxas, arch, path, cubin)
        facts = parse_ptxas(output)[entry]
        row.update({k: facts[k] for k in PTXAS_FIELDS})
        row["advisories"] = ptxas_advisories(output).get(entry, [])
        row["shared_bytes"] = facts["shared_bytes"]
        # Local memory per thread: the stack frame (spills included).
        row["scratch_bytes"] = facts["stack_bytes"]
        if cubin is not None and nvdisasm is not None:
            sass = run_nvdisasm(nvdisasm, cubin)
            row["machine_ops"] = machine_ops(sass)
            row["memory_ops"] = memory_ops(sass)
            row["calls"], row["calls_from"] = sass_calls(sass), "sass"
            row["subroutine_calls"] = sass_subroutine_calls(sass)
    return row


def _amd_facts(path: Path, prefix: str) -> Row:
    code = path.read_text()
    kernels = amd_kernels(code)
    entry = _entry(list(kernels), prefix, path.name)
    facts = kernels[entry]
    same = "param_bytes kernarg_bytes shared_bytes registers vgpr_count agprs"
    return {
        "entry": entry,
        **{key: facts[key] for key in [*same.split(), "sgprs"]},
        # The metadata's own spill counts: a spilled VGPR takes 4 bytes of
        # scratch per lane (stored and loaded back); SGPRs spill into VGPR
        # lanes, counted apart. Scratch also holds the stack.
        "spill_store_bytes": 4 * facts["vgpr_spills"],
        "spill_load_bytes": 4 * facts["vgpr_spills"],
        "vgpr_spills": facts["vgpr_spills"],
        "sgpr_spills": facts["sgpr_spills"],
        "stack_bytes": facts["private_bytes"],
        # Scratch per lane: the private segment (spills, stack, and the
        # arguments and saved registers of out-of-line calls).
        "scratch_bytes": facts["private_bytes"],
        "calls": amd_calls(code),
        "calls_from": "asm",
        "subroutine_calls": {},  # LLVM inlines AMDGPU's divisions
        "barriers": None,
        "machine_ops": machine_ops(code),
        "memory_ops": memory_ops(code),
        "advisories": [],  # the AMDGPU assembler prints none
    }


def add_occupancy(row: Row) -> None:
    """Sets ``occupancy``, ``limited_by`` and ``resident_blocks`` per GPU.

    Empty dicts when the row has no register count (PTX without ptxas).
    """
    from .occupancy import occupancy_by_gpu

    row["occupancy"], row["limited_by"], row["resident_blocks"] = {}, {}, {}
    if row["registers"] is None:
        return
    by_gpu = occupancy_by_gpu(
        row["arch"], row["registers"], row["shared_bytes"], row["block_threads"]
    )
    for gpu, occ in by_gpu.items():
        row["occupancy"][gpu] = occ["fraction"]
        row["limited_by"][gpu] = occ["limited_by"]
        row["resident_blocks"][gpu] = occ["resident_blocks"]


def kernel_rows(
    arch: str, out_dir: Path, ptxas: str | None, nvdisasm: str | None = None
) -> list[Row]:
    """The rows of one target, from the driver's output in ``out_dir``.

    Args:
        arch: The target the driver compiled for.
        out_dir: The driver's output directory (named ``arch``; a row's
            ``asm`` is ``<arch>/<file>``).
        ptxas: The assembler for NVIDIA targets, or ``None`` (registers,
            spills, stack, barriers and occupancy are then unknown).
        nvdisasm: NVIDIA's disassembler, or ``None`` (an NVIDIA row's
            ``machine_ops`` and ``memory_ops`` are then unknown; they need
            ptxas too).

    Returns:
        One dict per kernel: the manifest's fields, ``arch``, ``entry``,
        the code's facts (module docs), ``machine_ops``
        (:func:`.asm.machine_ops` of its SASS or AMDGPU assembly, or
        ``None``), ``memory_ops`` (:func:`.asm.memory_ops`: its memory
        instructions by barrier segment, kind and width, or ``None``),
        ``calls`` (out-of-line calls: :func:`.asm.sass_calls` of the SASS,
        else :func:`.asm.ptx_calls` of the PTX, or :func:`.asm.amd_calls`;
        ``calls_from`` says which code: ``"sass"``, ``"ptx"`` or
        ``"asm"``), ``subroutine_calls``
        (:func:`.asm.sass_subroutine_calls`: ptxas's division
        subroutines, not counted in ``calls``; ``None`` without SASS, empty
        on AMDGPU), ``scratch_bytes`` (per
        thread: the ptxas stack frame, ``None`` without ptxas, or the
        AMDGPU private segment) and the occupancy per GPU.

    Raises:
        ToolError: If a kernel's symbol is not found once, or ptxas or
            nvdisasm fails.
    """
    rows = []
    for kernel in read_manifest(out_dir):
        path = out_dir / kernel["asm"]
        if is_nvidia(arch):
            facts = _nvidia_facts(arch, path, kernel["entry"], ptxas, nvdisasm)
        else:
            facts = _amd_facts(path, kernel["entry"])
        row = {**kernel, "arch": arch, **facts}
        if kernel.get("dynamic_shared") and row["shared_bytes"] is not None:
            # Sized at launch: the code declares none; the most a launch
            # asks is the declaration's.
            row["shared_bytes"] += 4 * kernel["shared_words"]
        row["asm"] = f"{out_dir.name}/{kernel['asm']}"
        add_occupancy(row)
        rows.append(row)
    return rows


def param_mismatches(rows: list[Row]) -> list[str]:
    """One message per kernel whose parameter block is not the host's bytes.

    A kernel takes its operand struct by value: the bytes the host copies
    (``host_bytes``: ``size_of`` the struct) must be the parameter block
    the compiled kernel reads (``param_bytes``), or the kernel reads fields
    at the wrong offsets.
    """
    return [
        f"{r['arch']} {r['op']}/{r['kernel']} [{r['config']}] ({r['entry']}): "
        f"param_bytes {r['param_bytes']} != host_bytes {r['host_bytes']}"
        for r in rows
        if r["param_bytes"] != r["host_bytes"]
    ]


def advisory_lines(rows: list[Row]) -> list[str]:
    """One line per ``ptxas`` performance advisory of a kernel (``C75xx``).

    Each is a finding: the assembler slowed the kernel down (serialized
    ``wgmma``, an injected wait, ...). Rows without ptxas have none to say.
    """
    return [
        f"{r['arch']} {r['op']}/{r['kernel']} [{r['config']}]: {advisory}"
        for r in rows
        for advisory in r.get("advisories") or ()
    ]


def _advisory_cell(row: Row) -> str:
    """``-`` for none, the codes (``C7518,C7517``), ``?`` without ptxas."""
    found = row.get("advisories")
    if found is None:
        return "?"
    codes = dict.fromkeys(a.split(":", 1)[0] for a in found)
    return ",".join(codes) or "-"


def _cell(value: Any) -> str:
    return "?" if value is None else str(value)


def _occupancy_cell(row: Row) -> str:
    return " ".join(
        f"{gpu} {frac:.2f} ({row['limited_by'][gpu]})"
        for gpu, frac in row["occupancy"].items()
    )


#: The table's columns, in order; the first four (text) are left-aligned,
#: the numbers right-aligned, occupancy last and unpadded.
COLUMNS = (
    "arch",
    "op",
    "kernel",
    "config",
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
)


def _matrix_cell(row: Row) -> str:
    """The kernel's matrix instructions, as the table shows them.

    ``QGMMA 4`` (mnemonic and static count), ``mfma 4`` for AMD's, ``-``
    for none, ``?`` when unknown (no disassembler).
    """
    ops = row.get("machine_ops")
    if ops is None:
        return "?"
    matrix = ops["matrix"]
    if not matrix:
        return "-"
    return ", ".join(
        f"{'mfma' if name.startswith('v_mfma') else name} {n}"
        for name, n in matrix.items()
    )


#: What each column of the table holds, printed under it (``- `` lines).
LEGEND = (
    "regs: registers per thread (sm_*: ptxas -v; gfx942: the VGPRs its"
    " kernel descriptor asks for). spill: spill bytes stored/loaded per"
    " thread (gfx942: 4 per spilled VGPR). smem: shared memory (LDS) per"
    " block, bytes. thr: threads per block of the op's launch.",
    "calls: out-of-line calls in the machine code (CALL.REL/CALL.ABS in"
    " the SASS on sm_*, the PTX's call when there is no SASS; s_swappc_b64"
    " and tail-call s_setpc_b64 on gfx942), callees' own calls included;"
    " not the calls to the subroutines ptxas adds for a 64-bit integer or"
    " IEEE FP32 division's rare operands (the JSON's subroutine_calls)."
    " scratch: local memory per thread, bytes (sm_*: the ptxas stack"
    " frame; gfx942: the private segment, which holds a call's arguments"
    " and saved registers as well as spills).",
    "param/host: the kernel's parameter block / the bytes the host passes"
    " it (its operand struct by value); the report fails (exit 1) if they"
    " differ.",
    "matrix: matrix instructions in the machine code, by static count"
    " (QGMMA from the SASS through nvdisasm on sm_*, mfma on gfx942);"
    " - for none.",
    "adv: the ptxas performance advisories of the kernel (C75xx codes,"
    " each printed in full under the table); - for none.",
    "occupancy: per GPU, the theoretical share of an SM's (CU's) warp"
    " (wave) slots the kernel's blocks fill, and the limit that binds"
    " (registers, shared memory, block size or blocks per SM).",
)


def table_notes(
    rows: list[Row], ptxas: str | None, nvdisasm: str | None
) -> list[str]:
    """Why cells of the table read ``?`` (or occupancy is empty), if any.

    Args:
        rows: The rows printed.
        ptxas: What :func:`.tools.find_ptxas` found.
        nvdisasm: What :func:`.tools.find_nvdisasm` found.

    Returns:
        A line per missing tool that left NVIDIA rows without facts:
        without ptxas, regs, spill, scratch, matrix and occupancy;
        without nvdisasm (ptxas found), matrix (and calls are then the
        PTX's). Each names the command that installs it.
    """
    nvidia = [row for row in rows if is_nvidia(row["arch"])]
    how = f"install it with {install_command()}"
    if ptxas is None and any(row["registers"] is None for row in nvidia):
        return [
            "regs, spill, scratch, matrix: ? and occupancy empty on sm_* ="
            f" ptxas not found; {how} (the nvidia-cuda-nvcc wheel)"
        ]
    if nvdisasm is None and any(row["machine_ops"] is None for row in nvidia):
        return [
            "matrix: ? and calls read from the PTX on sm_* = nvdisasm not"
            f" found; {how} (the nvidia-cuda-nvdisasm wheel)"
        ]
    return []


def _cells(row: Row) -> list[str]:
    """A row's cells, in :data:`COLUMNS` order.

    Registers, spill bytes (stores/loads), out-of-line calls, scratch
    bytes, shared bytes, threads per block, parameter and host bytes,
    matrix instructions in the code (:func:`_matrix_cell`), ptxas
    advisories (:func:`_advisory_cell`), occupancy per GPU.
    """
    spill = (
        f"{_cell(row['spill_store_bytes'])}/{_cell(row['spill_load_bytes'])}"
    )
    return [
        row["arch"],
        row["op"],
        row["kernel"],
        row["config"],
        _cell(row["registers"]),
        spill,
        _cell(row.get("calls")),
        _cell(row.get("scratch_bytes")),
        str(row["shared_bytes"]),
        str(row["block_threads"]),
        f"{row['param_bytes']}/{row['host_bytes']}",
        _matrix_cell(row),
        _advisory_cell(row),
        _occupancy_cell(row),
    ]


def table_lines(rows: list[Row]) -> list[str]:
    """The table: a header, then a line per row.

    Each column is as wide as its widest cell (or its name), so a long
    kernel name never shifts the columns after it.
    """
    cells = [_cells(row) for row in rows]
    widths = [
        max([len(name)] + [len(c[i]) for c in cells])
        for i, name in enumerate(COLUMNS)
    ]

    def line(values: list[str]) -> str:
        text = [
            v.ljust(w) if i < 4 else v.rjust(w)
            for i, (v, w) in enumerate(zip(values[:-1], widths, strict=False))
        ]
        return " ".join(text) + "  " + values[-1]

    return [line(list(COLUMNS))] + [line(c) for c in cells]


#: What the start of a ``config`` name stands for (the rest, after the
#: first ``-``, is read from the instance's parameters in
#: :func:`config_legend`).
CONFIG_MODELS = {
    "glm5next": "GLM-5-Next's indexer",
    "dsv32": "DeepSeek-V3.2's indexer",
    "h128": "a 128-head indexer (the widest the scorers take)",
    "bf16": "the writers",
    "i32": "expand_topk",
}


def config_legend(rows: list[Row]) -> list[str]:
    """A line per ``config`` of the table, in the table's order.

    What the name stands for (:data:`CONFIG_MODELS`) and the parameters
    of its instance, from the manifest.
    """
    seen: dict[str, Row] = {}
    for row in rows:
        seen.setdefault(row["config"], row)
    lines = []
    for config, row in seen.items():
        model = CONFIG_MODELS.get(config.split("-")[0], "an instance")
        params = ", ".join(
            f"{name.replace('_', ' ')} {str(value).lower()}"
            for name, value in (row.get("params") or {}).items()
            if name not in ("grouped", "split")
        )
        lines.append(f"config {config}: {model}; {params}")
    return lines


def verdict(rows: list[Row]) -> str:
    """One closing line: whether every kernel is clean, or which are not.

    Clean: no spill bytes, no out-of-line call, no scratch bytes, no
    ptxas advisory, a parameter block of the host's bytes. Kernels whose
    spills, scratch or advisories are unknown (no ptxas) are counted as
    such, never as clean.
    """
    archs = ", ".join(dict.fromkeys(row["arch"] for row in rows))
    dirty, unknown = [], 0
    for row in rows:
        spills = (row["spill_store_bytes"], row["spill_load_bytes"])
        found = []
        if any(spills):
            found.append(f"spills {_cell(spills[0])}/{_cell(spills[1])} B")
        if row.get("calls"):
            found.append(f"calls {row['calls']}")
        if row.get("scratch_bytes"):
            found.append(f"scratch {row['scratch_bytes']} B")
        if row.get("advisories"):
            found.append(f"advisories {_advisory_cell(row)}")
        if row["param_bytes"] != row["host_bytes"]:
            found.append(
                f"parameter block {row['param_bytes']} B, host"
                f" {row['host_bytes']} B"
            )
        if found:
            name = f"{row['arch']} {row['op']}/{row['kernel']}"
            dirty.append(f"{name} [{row['config']}]: {', '.join(found)}")
        elif (
            None in spills
            or row.get("scratch_bytes") is None
            or row.get("calls") is None
            or row.get("advisories") is None
        ):
            unknown += 1
    if dirty:
        return (
            f"verdict: {len(dirty)} of {len(rows)} kernels ({archs}) need a"
            f" look: {'; '.join(dirty)}"
        )
    clean = len(rows) - unknown
    text = (
        f"verdict: {clean} of {len(rows)} kernels ({archs}) clean: no"
        " spills, no calls, no scratch, no ptxas advisories, every"
        " parameter block the host's bytes"
    )
    if unknown:
        text += (
            f"; {unknown} with spills, scratch or advisories unknown (no"
            " ptxas: see the note)"
        )
    return text

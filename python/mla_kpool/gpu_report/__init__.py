"""``gpu-report``: every GPU kernel compiled for each target, with no GPU.

For each target (``--arch``; ``sm_90a sm_100a gfx942`` by default) the
package's Mojo driver (``kernel_asm.mojo``) compiles every kernel of every
op at the model shapes it names, then each kernel's code is read: PTX and
``ptxas -v`` on NVIDIA, the kernel descriptor and metadata on AMD. A table
row and a JSON object per (kernel, config, arch) give registers, spills,
shared memory, threads per block, the parameter block, the host's operand
bytes and the theoretical occupancy per GPU; ``--json`` adds the
rooflines (:mod:`mla_kpool.gpu_report.roofline`).

The run fails (exit status 1) when a kernel's parameter block differs from
the bytes the host passes for it, since the kernels take their operand
structs by value. Without ``ptxas`` (the ``gpu-report`` extra), the NVIDIA
rows carry only what the PTX says, and one line says what to install.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

from .asm import ptx_facts
from .report import (
    HEADER,
    Row,
    is_nvidia,
    kernel_rows,
    param_mismatches,
    table_line,
)
from .tools import PTXAS_HINT, ToolError, compile_kernels, find_ptxas

__all__ = [
    "DEFAULT_ARCHS",
    "DESCRIPTION",
    "add_arguments",
    "param_mismatches",
    "ptx_facts",
    "report",
    "run",
]

DESCRIPTION = (
    "Compile every GPU kernel for each target (no GPU needed) and report "
    "registers, spills, shared memory, parameter bytes and occupancy."
)

#: Targets reported when ``--arch`` is not given.
DEFAULT_ARCHS = ("sm_90a", "sm_100a", "gfx942")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Adds ``--arch``, ``--json`` and ``--asm-dir`` to ``parser``."""
    parser.add_argument(
        "--arch",
        action="extend",
        nargs="+",
        metavar="ARCH",
        help="targets to compile for (one or more, repeatable; default: "
        + " ".join(DEFAULT_ARCHS)
        + ")",
    )
    parser.add_argument(
        "--json", type=Path, metavar="PATH", help="write the rows as JSON"
    )
    parser.add_argument(
        "--asm-dir",
        type=Path,
        metavar="DIR",
        help="keep each kernel's code under DIR/<arch>/ (default: a "
        "temporary directory, removed)",
    )


def report(archs: list[str], asm_dir: Path, out=None, err=None) -> list[Row]:
    """Compiles and reads every kernel for each target; prints the table.

    Args:
        archs: Targets (``sm_90a``, ``sm_100a``, ``gfx942``, ...).
        asm_dir: Directory for the code (one subdirectory per target).
        out: Stream for the table (``sys.stdout`` if ``None``).
        err: Stream for progress and the missing-ptxas hint
            (``sys.stderr`` if ``None``).

    Returns:
        Every row, target by target.

    Raises:
        ToolError: If ``mojo`` is missing or a compile or ptxas run fails.
    """
    out = sys.stdout if out is None else out
    err = sys.stderr if err is None else err
    ptxas = find_ptxas()
    if ptxas is None and any(is_nvidia(a) for a in archs):
        print(PTXAS_HINT, file=err)
    rows: list[Row] = []
    print(HEADER, file=out)
    for arch in archs:
        out_dir = asm_dir / arch
        out_dir.mkdir(parents=True, exist_ok=True)
        start = time.perf_counter()
        compile_kernels(arch, out_dir)
        arch_rows = kernel_rows(arch, out_dir, ptxas)
        for row in arch_rows:
            print(table_line(row), file=out)
        seconds = time.perf_counter() - start
        print(f"{arch}: {len(arch_rows)} kernels, {seconds:.1f} s", file=err)
        rows += arch_rows
    return rows


def _write_json(path: Path, rows: list[Row]) -> None:
    from .roofline import rooflines

    doc = {"kernels": rows, "rooflines": rooflines(rows)}
    path.write_text(json.dumps(doc, indent=1) + "\n")


def run(args: argparse.Namespace) -> int:
    """Runs the report; exit status 0, or 1 on a failure or a mismatch.

    Every failure is one line on stderr: a missing ``mojo``, a failed
    compile, and one line per kernel whose ``param_bytes`` is not its
    ``host_bytes``.
    """
    archs = args.arch or list(DEFAULT_ARCHS)
    try:
        if args.asm_dir is not None:
            rows = report(archs, args.asm_dir)
        else:
            with tempfile.TemporaryDirectory() as tmp:
                rows = report(archs, Path(tmp))
    except ToolError as e:
        print(f"gpu-report: {e}", file=sys.stderr)
        return 1
    if args.json is not None:
        _write_json(args.json, rows)
    mismatches = param_mismatches(rows)
    for line in mismatches:
        print(f"gpu-report: parameter block mismatch: {line}", file=sys.stderr)
    return 1 if mismatches else 0

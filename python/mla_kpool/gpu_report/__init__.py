"""``gpu-report``: every GPU kernel compiled for each target, with no GPU.

For each target (``--arch``: ``sm_90a``, ``sm_100a`` and ``gfx942``, the
targets whose GPUs the occupancy and roofline models know; all three by
default) the
package's Mojo driver (``kernel_asm.mojo``) compiles every kernel of every
op at the model shapes it names, then each kernel's code is read: PTX and
``ptxas -v`` on NVIDIA, the kernel descriptor and metadata on AMD. A table
row and a JSON object per (kernel, config, arch) give registers, spills,
out-of-line calls and scratch bytes, shared memory, threads per block,
the parameter block, the host's operand bytes and the theoretical
occupancy per GPU; ``--json`` adds the rooflines
(:mod:`mla_kpool.gpu_report.roofline`).

The run fails (exit status 1) when a kernel's parameter block differs from
the bytes the host passes for it, since the kernels take their operand
structs by value. Without ``ptxas`` (the ``gpu-report`` extra), the NVIDIA
rows carry only what the PTX says, and one line says what to install.
Under the table come an ``advisory:`` line for each ``ptxas`` performance
advisory of a kernel (``C75xx``: serialized ``wgmma``, an injected wait;
findings, which the test suite refuses), a note that says why cells read
``?`` (ptxas or nvdisasm not found, and how to install it) and a legend of
the columns (:data:`.report.LEGEND`).

A usage error exits with status 2 before anything compiles or prints, in
argparse's form (``usage: ...`` then ``...: error: argument ...``): a
target other than those three, a ``--json`` file in a missing or
read-only folder, an ``--asm-dir`` that cannot be created or written
(:func:`mla_kpool._argtypes.output_dir`).
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
import tempfile
import time
from pathlib import Path

from .._argtypes import output_dir, output_file, usage_error
from ..gpu_specs import ARCH_GPUS
from .asm import ptx_facts
from .report import (
    LEGEND,
    Row,
    advisory_lines,
    config_legend,
    is_nvidia,
    kernel_rows,
    param_mismatches,
    table_lines,
    table_notes,
    verdict,
)
from .tools import (
    ToolError,
    compile_kernels,
    find_nvdisasm,
    find_ptxas,
    ptxas_hint,
)

__all__ = [
    "ARCHS",
    "DEFAULT_ARCHS",
    "DESCRIPTION",
    "add_arguments",
    "advisory_lines",
    "param_mismatches",
    "ptx_facts",
    "report",
    "run",
]

#: How long one target's compile takes, as the report says before it:
#: ``python -m mla_kpool gpu-report`` on 2-core VMs, 16-20 s a target
#: alone, 125 s (load 7) and 207 s (load 4-8) for sm_90a beside other
#: compiles.
COMPILE_TIME = "16-20 s on 2 cores alone, 1-4 min beside other compiles"

DESCRIPTION = (
    "Compile every GPU kernel for each target (no GPU needed) and report "
    "registers, spills, out-of-line calls, scratch, shared memory, "
    f"parameter bytes and occupancy (each target {COMPILE_TIME})."
)

#: The targets the report takes: those whose GPUs (H100 and H200, B200,
#: MI300X) the occupancy and roofline models know.
ARCHS = tuple(ARCH_GPUS)

#: Targets reported when ``--arch`` is not given.
DEFAULT_ARCHS = ARCHS


class OutputError(ToolError):
    """An output path the report cannot write (a usage error, status 2)."""


def known_arch(text: str) -> str:
    """An argparse type: one of :data:`ARCHS`."""
    if text not in ARCHS:
        raise argparse.ArgumentTypeError(
            f"must be one of {', '.join(ARCHS)} (the targets whose GPUs "
            f"the occupancy model knows), got {text!r}"
        )
    return text


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Adds ``--arch``, ``--json`` and ``--asm-dir`` to ``parser``.

    Also sets ``prog`` and ``usage`` (the parser's ``format_usage``) as
    defaults, so that :func:`run` reports a path it cannot write as the
    parser reports a refused option.
    """
    parser.set_defaults(prog=parser.prog, usage=parser.format_usage)
    parser.add_argument(
        "--arch",
        action="extend",
        nargs="+",
        type=known_arch,
        metavar="ARCH",
        help="targets to compile for, one or more of "
        + " ".join(ARCHS)
        + " (repeatable; default: all). Other targets are refused: the "
        "occupancy model has no limits for their GPUs",
    )
    parser.add_argument(
        "--json",
        type=output_file,
        metavar="PATH",
        help="write the rows and the rooflines as JSON (its folder must exist)",
    )
    parser.add_argument(
        "--asm-dir",
        type=output_dir,
        metavar="DIR",
        help="keep each kernel's code under DIR/<arch>/, created if needed "
        "(default: a temporary directory, removed)",
    )


def report(archs: list[str], asm_dir: Path, out=None, err=None) -> list[Row]:
    """Compiles and reads every kernel for each target; prints the table.

    Args:
        archs: Targets (``sm_90a``, ``sm_100a``, ``gfx942``, ...).
        asm_dir: Directory for the code (one subdirectory per target).
        out: Stream for the table, then the notes on its ``?`` cells
            (:func:`.report.table_notes`) and its legend
            (:data:`.report.LEGEND`) (``sys.stdout`` if ``None``).
        err: Stream for progress and the missing-ptxas hint
            (``sys.stderr`` if ``None``).

    Returns:
        Every row, target by target.

    Raises:
        OutputError: If a target's directory cannot be created (checked
            for every target before anything compiles or prints).
        ToolError: If ``mojo`` is missing or a compile or ptxas run fails.
    """
    out = sys.stdout if out is None else out
    err = sys.stderr if err is None else err
    out_dirs = [asm_dir / arch for arch in archs]
    for out_dir in (asm_dir, *out_dirs):
        try:
            out_dir.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise OutputError(
                f"cannot create {str(out_dir)!r}: {e.strerror}"
            ) from e
    ptxas = find_ptxas()
    nvdisasm = find_nvdisasm()
    if ptxas is None and any(is_nvidia(a) for a in archs):
        print(ptxas_hint(), file=err)
    rows: list[Row] = []
    for arch, out_dir in zip(archs, out_dirs, strict=True):
        start = time.perf_counter()
        print(
            f"{arch}: compiling every GPU kernel ({COMPILE_TIME})...", file=err
        )
        compile_kernels(arch, out_dir)
        arch_rows = kernel_rows(arch, out_dir, ptxas, nvdisasm)
        seconds = time.perf_counter() - start
        print(f"{arch}: {len(arch_rows)} kernels, {seconds:.1f} s", file=err)
        rows += arch_rows
    # The table once every target compiled (its columns fit every row), so
    # a failed compile prints one line and no table.
    for line in table_lines(rows):
        print(line, file=out)
    print(file=out)
    for line in advisory_lines(rows):
        print(f"advisory: {line}", file=out)
    for line in table_notes(rows, ptxas, nvdisasm):
        print(f"note: {line}", file=out)
    for line in LEGEND:
        print(f"- {line}", file=out)
    for line in config_legend(rows):
        print(f"- {line}", file=out)
    print(verdict(rows), file=out)
    return rows


def _write_json(path: Path, rows: list[Row]) -> None:
    from .roofline import rooflines

    doc = {"kernels": rows, "rooflines": rooflines(rows)}
    path.write_text(json.dumps(doc, indent=1) + "\n")


def _usage_error(args: argparse.Namespace, message: str) -> int:
    """Prints ``message`` as argparse prints a usage error; returns 2.

    The usage lines, then ``<prog>: error: <message>``, as for an option
    refused while parsing, for a path found unwritable only later.
    """
    usage = getattr(args, "usage", None)
    if usage is not None:
        sys.stderr.write(usage())
    return usage_error(args, message)


def run(args: argparse.Namespace) -> int:
    """Runs the report and returns its exit status.

    0 when every kernel compiled and matches; 1 on a failure or a
    mismatch; 2 when an ``--asm-dir`` or ``--json`` path that passed the
    option checks still cannot be written (such as a folder under
    ``/proc``, which ``os.access`` does not catch), printed as argparse
    prints a usage error (:func:`_usage_error`). Every other failure is
    one line on stderr: a missing ``mojo``, a failed compile, and one line
    per kernel whose ``param_bytes`` is not its ``host_bytes``.
    """
    say = functools.partial(print, "gpu-report:", file=sys.stderr)
    archs = list(dict.fromkeys(args.arch or DEFAULT_ARCHS))
    try:
        if args.asm_dir is not None:
            rows = report(archs, Path(args.asm_dir))
        else:
            with tempfile.TemporaryDirectory() as tmp:
                rows = report(archs, Path(tmp))
    except OutputError as e:
        return _usage_error(args, f"argument --asm-dir: {e}")
    except ToolError as e:
        say(e)
        return 1
    if args.json is not None:
        try:
            _write_json(Path(args.json), rows)
        except OSError as e:
            return _usage_error(
                args,
                f"argument --json: cannot write {args.json!r}: {e.strerror}",
            )
        say(f"wrote {Path(args.json).resolve()}")
    mismatches = param_mismatches(rows)
    for line in mismatches:
        say(f"parameter block mismatch: {line}")
    return 1 if mismatches else 0

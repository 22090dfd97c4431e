"""Command line: ``python -m mla_kpool {demo,bench,gpu-report,gpu-profile}``.

The console script ``mla-kpool`` is the same. ``--version`` prints the
package version. ``bench`` started from the command
line re-executes itself without ``OPENBLAS_CORETYPE`` and
``OPENBLAS_L2_SIZE`` (:mod:`mla_kpool.bench.blas`), so its NumPy peers get
OpenBLAS's own choice of kernel. Usage and help name the program
the way it was started: ``mla-kpool`` for the console script,
``python -m mla_kpool`` otherwise.

``demo`` runs a serving workload through the writer ops and
``index_top_k`` and checks every pool and every selection against the
oracle; ``bench`` times the writer ops, and ``index_top_k`` with ``--ops
index_top_k``; ``gpu-report`` compiles every GPU kernel for sm_90a,
sm_100a and gfx942 with no GPU and reports its resources and occupancy;
``gpu-profile`` emulates the GPU launches, counts what they ask of
memory and estimates their time.

Each subcommand lives in a module of this package (``mla_kpool.demo``,
``mla_kpool.bench``, ``mla_kpool.gpu_report``, ``mla_kpool.gpu_profile``)
that provides
``DESCRIPTION`` (a sentence), ``add_arguments(parser)`` and
``run(args) -> int`` (the exit status).
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from collections.abc import Sequence

from . import __version__
from ._argtypes import program_defaults

#: Subcommand name -> (module, one-line help).
COMMANDS = {
    "demo": (
        "mla_kpool.demo",
        "run a serving workload through the writers and index_top_k, check "
        "every pool and every selection",
    ),
    "bench": (
        "mla_kpool.bench",
        "time the writers (--ops index_top_k: the indexer too)",
    ),
    "gpu-report": (
        "mla_kpool.gpu_report",
        "compile every GPU kernel (no GPU needed): registers, occupancy",
    ),
    "gpu-profile": (
        "mla_kpool.gpu_profile",
        "emulate the GPU launches (no GPU needed): bank conflicts, atomics"
        " per address, global sectors and bytes, an estimated time",
    ),
}


def program_name(argv0: str | None = None) -> str:
    """How the user started the command, for usage and help lines.

    Args:
        argv0: The program path (``sys.argv[0]`` if ``None``).

    Returns:
        ``"python -m mla_kpool"`` when run as a module (``argv0`` is this
        package's ``__main__.py``, or empty), else the file name of
        ``argv0``, such as ``mla-kpool`` for the console script.
    """
    name = os.path.basename(sys.argv[0] if argv0 is None else argv0)
    as_module = name in ("", "__main__.py", "-m", "-c")
    return "python -m mla_kpool" if as_module else name


def main(argv: Sequence[str] | None = None, prog: str | None = None) -> int:
    """Parses the command line and runs the subcommand.

    Args:
        argv: Arguments after the program name (``sys.argv[1:]`` if ``None``).
        prog: Program name in usage and help (:func:`program_name` if
            ``None``).

    Returns:
        The subcommand's exit status; ``--help`` and ``--version`` exit 0
        and a usage error 2, through ``SystemExit``. An option the
        subcommand does not know is that subcommand's usage error (its
        usage, ``<prog> <command>: error: ...``), not the top level's.
        Ctrl-C ends a run with one line and status 130, no traceback.
    """
    parser = argparse.ArgumentParser(
        prog=program_name() if prog is None else prog,
        description="k-pooled indexer kernels for MAX, on CPU and GPU.",
    )
    parser.add_argument(
        "--version", action="version", version=f"%(prog)s {__version__}"
    )
    sub = parser.add_subparsers(dest="command", required=True)
    sub_parsers = {}
    for command, (module_name, help_text) in COMMANDS.items():
        module = importlib.import_module(module_name)
        sub_parser = sub.add_parser(
            command, help=help_text, description=module.DESCRIPTION
        )
        module.add_arguments(sub_parser)
        program_defaults(sub_parser)
        sub_parser.set_defaults(run=module.run)
        sub_parsers[command] = sub_parser
    args, unknown = parser.parse_known_args(argv)
    if unknown:
        # argparse hands a subcommand's unknown options up to the top-level
        # parser, whose error shows the top-level usage; the subcommand's
        # usage lists the options the user meant to type.
        sub_parsers[args.command].error(
            f"unrecognized arguments: {' '.join(unknown)}"
        )
    if argv is None and args.command == "bench" and not args.markdown:
        # The command line only (tests pass argv): NumPy's BLAS reads these
        # variables once, at import, so the bench starts again without them.
        from .bench.blas import reexec_without_slow_blas

        reexec_without_slow_blas()
    try:
        return int(args.run(args))
    except KeyboardInterrupt:
        # Ctrl-C: one line, and the shell's status for an interrupt.
        print(f"\n{args.prog}: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        # The reader left (`| head`): stop writing, quietly. Python would
        # flush stdout again at exit and fail the same way: point it at
        # /dev/null first.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 0


if __name__ == "__main__":
    sys.exit(main())

"""Command line: ``python -m mla_kpool {demo,bench}`` (also ``mla-kpool``).

Each subcommand lives in a module of this package (``mla_kpool.demo``,
``mla_kpool.bench``) that provides ``DESCRIPTION`` (a sentence),
``add_arguments(parser)`` and ``run(args) -> int`` (the exit status).
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence
from types import ModuleType

#: Subcommand name -> (module, one-line help).
COMMANDS = {
    "demo": (
        "mla_kpool.demo",
        "run a serving workload through the writers, check every pool",
    ),
    "bench": ("mla_kpool.bench", "time the writers"),
}


def main(argv: Sequence[str] | None = None) -> int:
    """Parses the command line and runs the subcommand.

    Args:
        argv: Arguments after the program name (``sys.argv[1:]`` if ``None``).

    Returns:
        The subcommand's exit status (2 for a usage error).
    """
    parser = argparse.ArgumentParser(
        prog="python -m mla_kpool",
        description="k-pooled indexer kernels for MAX, on CPU and GPU.",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    modules: dict[str, ModuleType] = {}
    for command, (module_name, help_text) in COMMANDS.items():
        module = importlib.import_module(module_name)
        modules[command] = module
        sub_parser = sub.add_parser(
            command,
            help=help_text,
            description=getattr(module, "DESCRIPTION", help_text),
        )
        module.add_arguments(sub_parser)
    args = parser.parse_args(argv)
    return int(modules[args.command].run(args))


if __name__ == "__main__":
    sys.exit(main())

"""Command line: ``python -m mla_kpool {demo,bench}`` (placeholder)."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence


def main(argv: Sequence[str] | None = None) -> int:
    """Parses the command line; every subcommand is still a stub.

    Returns:
        The process exit status: 2, since nothing is implemented yet.
    """
    parser = argparse.ArgumentParser(
        prog="mla-kpool", description="k-pool indexer kernels for MAX."
    )
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("demo", help="run the writers on a small example")
    sub.add_parser("bench", help="time the writers")
    args = parser.parse_args(argv)
    print(f"mla-kpool {args.command}: not implemented yet", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())

"""What the bench tests share: reading its printed table and legend."""

from __future__ import annotations

import argparse
import subprocess
from pathlib import Path

from mla_kpool import bench
from mla_kpool.bench import workload


def num(value: float) -> str:
    """The table's number format: 3 significant digits, whole from 1000."""
    return f"{value:.0f}" if abs(value) >= 1000 else f"{value:.3g}"


def table_cells(out: str) -> tuple[list[str], list[list[str]]]:
    """The header and body cells of the markdown table printed in ``out``."""
    lines = [line for line in out.splitlines() if line.startswith("|")]
    cells = [[c.strip() for c in line.strip("|").split("|")] for line in lines]
    return cells[0], cells[2:]


def legend_lines(out: str) -> list[str]:
    """The legend's lines under the table, without their ``- ``."""
    return [line[2:] for line in out.splitlines() if line.startswith("- ")]


def head_commit() -> str | None:
    """HEAD of the checkout the package is imported from, read from git."""
    package = Path(bench.__file__).resolve().parent
    done = subprocess.run(
        ["git", "-C", str(package), "rev-parse", "HEAD"],
        capture_output=True,
        text=True,
        check=False,
    )
    return done.stdout.strip() if done.returncode == 0 else None


def cases(*argv: str) -> list[workload.Case]:
    """The configurations ``bench *argv`` would measure (nothing compiles)."""
    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    return bench.cases(parser.parse_args(argv))

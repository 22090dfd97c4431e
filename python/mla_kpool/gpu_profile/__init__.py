"""``python -m mla_kpool gpu-profile``: index_top_k's shared-memory costs.

What index_top_k's GPU launches ask of shared memory, counted on the
emulated grid, no GPU needed. The driver (``launches.mojo``, run with
``mojo``) builds an index_top_k call at each documented workload
(GLM-5-Next's decode of 16 requests at 32K tokens and 4,096-token
prefill, DeepSeek-V3.2's decode), emulates each launch with every shared
access recorded (``kernels/model/profile.mojo``) and prints one JSON line
a launch. This module prints them as a table, in Nsight Compute's words:
shared requests and wavefronts (banks of 4 bytes, 32 of them; a 16-byte
access served a quarter warp at a time), the worst site's ways (a bank
conflict's degree), the most lanes of one request on one atomic word,
barriers per block, and closes with a verdict: which launches have a
site past 2-way.

Launches of many blocks run a sample of them (``--sample``); a select
runs that many blocks' worth of whole rows. Counts are those of the
blocks emulated: per request, they are the launch's.
"""

from __future__ import annotations

import argparse
import functools
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from .._argtypes import int_in, output_file, usage_error
from .._paths import KERNELS
from .._progress import progress_for
from ..gpu_report.tools import compile_error, mojo_command

__all__ = [
    "ARCH_WARPS",
    "DESCRIPTION",
    "DRIVER",
    "add_arguments",
    "format_table",
    "parse_lines",
    "run",
    "verdict",
]

#: The driver: a JSON line per launch on stdout.
DRIVER = Path(__file__).resolve().parent / "launches.mojo"

#: Lanes per warp of each target profiled: its scorers follow the warp
#: (wgmma on sm_90a, mfma on gfx942).
ARCH_WARPS = {"sm_90a": 32, "gfx942": 64}

#: Most ways a site may have and be called clean.
CLEAN_WAYS = 2

#: Most blocks a launch may emulate (``--sample``): each emulated block
#: runs every thread on the host, a second or more for a scorer's.
MAX_SAMPLE = 256

#: Launches the driver profiles: plan, SIMT scorer, the target's tensor
#: scorer and select, at each of 3 workloads.
LAUNCHES = 12

#: How long the driver takes, as the command says before it runs.
RUN_TIME = (
    "about 1 min to compile and 1-2 min to run on 2 cores alone, 2-4 min"
    " beside other work"
)

DESCRIPTION = (
    "Count what index_top_k's GPU launches ask of shared memory (requests,"
    " wavefronts, bank conflicts, atomics per address, barriers) by"
    f" emulating them at the documented workloads; no GPU needed ({RUN_TIME})."
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Adds ``--arch``, ``--sample`` and ``--json`` to ``parser``."""
    parser.add_argument(
        "--arch",
        choices=list(ARCH_WARPS),
        default="sm_90a",
        help="target whose warps and scorers are profiled: sm_90a (32"
        " lanes, wgmma) or gfx942 (64 lanes, mfma) (sm_90a)",
    )
    parser.add_argument(
        "--sample",
        type=int_in(1, MAX_SAMPLE, "each block is emulated thread by thread"),
        default=16,
        help="blocks a launch emulates at most (16; at most"
        f" {MAX_SAMPLE}); a select runs that many blocks' worth of whole"
        " rows",
    )
    parser.add_argument(
        "--json",
        metavar="FILE",
        type=output_file,
        help="also write every launch's record, sites included, as JSON",
    )


def parse_lines(text: str) -> list[dict[str, Any]]:
    """The driver's launches: one JSON object per non-empty line."""
    return [json.loads(line) for line in text.splitlines() if line.strip()]


def _worst(launch: dict[str, Any]) -> dict[str, Any] | None:
    sites = launch["profile"]["shared"]["sites"]
    return max(sites, key=lambda s: (s["ways"], s["wavefronts"]), default=None)


def format_table(launches: list[dict[str, Any]]) -> list[str]:
    """A line per launch, then a line per site past :data:`CLEAN_WAYS`.

    Columns: workload, kernel, blocks emulated of the grid, barriers per
    block, shared requests, wavefronts per request, the worst site's ways,
    the most lanes of a request on one atomic word.
    """
    rows = [
        ("workload", "kernel", "blocks", "bar", "requests", "wf/req", "ways",
         "atomic", "worst site"),
    ]  # fmt: skip
    notes = []
    for launch in launches:
        p = launch["profile"]
        shared = p["shared"]
        worst = _worst(launch)
        atomic = max(
            (s["max_lanes_per_address"] for s in shared["sites"]), default=0
        )
        per = shared["wavefronts"] / max(shared["requests"], 1)
        rows.append(
            (
                launch["workload"],
                p["kernel"].removeprefix("mla_kpool_index_"),
                f"{p['blocks']}/{p['grid']}",
                str(p["barriers_per_block"]),
                f"{shared['requests']:,}",
                f"{per:.2f}",
                str(worst["ways"]) if worst else "-",
                str(atomic) if atomic else "-",
                worst["site"] if worst else "-",
            )
        )
        for s in shared["sites"]:
            if s["ways"] > CLEAN_WAYS:
                notes.append(
                    f"  {s['ways']}-way: {s['site']} ({s['access']},"
                    f" {4 * s['width_words']} bytes a lane; {s['requests']:,}"
                    f" requests, {s['wavefronts']:,} wavefronts for"
                    f" {s['ideal_wavefronts']:,}) in {launch['workload']}"
                    f" {p['kernel']}"
                )
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = [
        "  ".join(
            cell.ljust(w) if i in (0, 1, 8) else cell.rjust(w)
            for i, (cell, w) in enumerate(zip(row, widths, strict=True))
        ).rstrip()
        for row in rows
    ]
    return lines + notes


def verdict(launches: list[dict[str, Any]]) -> str:
    """One line: every launch at most :data:`CLEAN_WAYS` ways, or which not."""
    over = sorted(
        {
            launch["profile"]["kernel"]
            for launch in launches
            if (w := _worst(launch)) is not None and w["ways"] > CLEAN_WAYS
        }
    )
    if not over:
        return (
            f"verdict: {len(launches)} launches, every shared site at most"
            f" {CLEAN_WAYS}-way"
        )
    return (
        f"verdict: {len(over)} kernels with a shared site past"
        f" {CLEAN_WAYS}-way: {', '.join(over)}"
    )


def run(args: argparse.Namespace) -> int:
    """Runs the driver for ``--arch`` and prints the table.

    Returns:
        0 with the table printed; 1 if ``mojo`` is missing or the driver
        fails (one line on stderr); 2 for an unwritable ``--json`` path.
    """
    say = functools.partial(print, "gpu-profile:", file=sys.stderr, flush=True)
    mojo = mojo_command()
    if mojo is None:
        say("the mojo command is not found; install the `mojo` package")
        return 1
    warp = ARCH_WARPS[args.arch]
    say(f"emulating index_top_k's launches for {args.arch} ({RUN_TIME})...")
    start = time.perf_counter()
    argv = [mojo, "run", "-I", str(KERNELS.parent), str(DRIVER)]
    proc = subprocess.Popen(
        [*argv, str(warp), str(args.sample)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    progress = progress_for(
        LAUNCHES, sys.stderr, desc="gpu-profile", unit="launches"
    )
    lines = []
    assert proc.stdout is not None and proc.stderr is not None
    for line in proc.stdout:  # a line a launch, as each one finishes
        lines.append(line)
        progress.update(1)
    stderr = proc.stderr.read()
    progress.close()
    if proc.wait() != 0:
        say(f"the driver failed: {compile_error(stderr, proc.returncode)}")
        return 1
    launches = parse_lines("".join(lines))
    say(f"{len(launches)} launches in {time.perf_counter() - start:.0f} s")
    for line in format_table(launches):
        print(line)
    print(verdict(launches))
    if args.json:
        try:
            Path(args.json).write_text(
                json.dumps({"arch": args.arch, "launches": launches}, indent=1)
                + "\n"
            )
        except OSError as e:
            return usage_error(
                args, f"argument --json: cannot write {args.json!r}: {e}"
            )
    return 0

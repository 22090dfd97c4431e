"""``python -m mla_kpool gpu-profile``: the GPU launches, counted.

What index_top_k's and the writers' GPU launches ask of memory, counted
on the emulated grid, no GPU needed. The driver (``launches.mojo``, run
with ``mojo``) builds an index_top_k call at each documented workload
(GLM-5-Next's decode of 16 requests at 32K tokens and 4,096-token
prefill, DeepSeek-V3.2's decode) and each writer's call at the bench's
workloads (ring_close, compress, seed_tail and expand_topk at batch 64
and 4,096, the fused step's scan and rows at 4,096; ``op`` the op's
registered name, ``workload`` its name in
:data:`mla_kpool.bench.bounds.WORKLOADS`), emulates each launch with
every shared access and every global access made through the thread's
view recorded (``kernels/grid/profile.mojo``) and prints one JSON line
a launch. This
module makes each a record (:func:`launch_record`) and prints them as a
table, in Nsight Compute's words: shared requests and wavefronts (banks
of 4 bytes, 32 of them; a 16-byte access served a quarter warp at a
time), the worst site's ways (a bank conflict's degree), the most lanes
of one request on one atomic word, global sectors per request and their
efficiency (bytes asked for over 32 bytes a sector), the distinct bytes
moved beside the roofline's for the call
(:data:`mla_kpool.bench.bounds.WORKLOADS`), barriers per block, and an
estimated time per GPU of the target (:mod:`.estimate`). It closes with a
verdict: which launches have a shared site past 2-way or global loads
under 80% sector efficiency.

Launches of many blocks run a sample of them (``--sample``); a select
runs that many blocks' worth of whole rows. Counts are those of the
blocks emulated: per request, they are the launch's.
"""

from __future__ import annotations

import argparse
import functools
import json
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from .._argtypes import int_in, output_file, usage_error
from .._paths import KERNELS
from .._progress import progress_for
from ..bench.bounds import WORKLOADS
from ..gpu_report.tools import compile_error, mojo_command
from ..gpu_specs import ARCH_GPUS
from .estimate import COST_MODELS, estimate_us, launch_counts

__all__ = [
    "ARCH_WARPS",
    "DESCRIPTION",
    "DRIVER",
    "PROFILE_DEFINE",
    "add_arguments",
    "format_table",
    "launch_record",
    "parse_lines",
    "run",
    "verdict",
]

#: The driver: a JSON line per launch on stdout.
DRIVER = Path(__file__).resolve().parent / "launches.mojo"

#: The define that compiles the recording in (``block_phases.PROFILE_BUILD``):
#: no other build has it.
PROFILE_DEFINE = "MLA_KPOOL_PROFILE"

#: Lanes per warp of each target profiled: its scorers follow the warp
#: (wgmma on sm_90a, mfma on gfx942).
ARCH_WARPS = {"sm_90a": 32, "gfx942": 64}

#: Most ways a site may have and be called clean.
CLEAN_WAYS = 2

#: Least sector efficiency of a launch's global loads called clean.
CLEAN_SECTOR_EFFICIENCY = 0.8

#: Worst shared sites a record lists.
WORST_SITES = 3

#: Most blocks a launch may emulate (``--sample``): each emulated block
#: runs every thread on the host, a second or more for a scorer's.
MAX_SAMPLE = 256

#: Launches the driver profiles: index_top_k's plan, SIMT scorer, the
#: target's tensor scorer and select at each of 3 workloads (12); the
#: writers' ring_close, compress, seed_tail and expand_topk at 2 batches
#: and the fused step's 2 launches at one (10).
LAUNCHES = 12 + 10

#: How long the driver takes, as the command says before it runs.
RUN_TIME = (
    "about 1 min to compile and 1-2 min to run on 2 cores alone, 2-4 min"
    " beside other work"
)

DESCRIPTION = (
    "Count what index_top_k's and the writers' GPU launches ask of memory"
    " (shared wavefronts and bank conflicts, atomics per address, global"
    " sectors per request and bytes, barriers) by emulating them at the"
    " documented workloads, and estimate each launch's time on the"
    f" target's GPUs; no GPU needed ({RUN_TIME})."
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
        "--report",
        metavar="FILE",
        help="a gpu-report --json file: its registers per kernel set the"
        " occupancy of the estimate (without it, registers do not limit"
        " the resident blocks)",
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
    sites = launch["shared"]["sites"]
    return max(sites, key=lambda s: (s["ways"], s["wavefronts"]), default=None)


def site_label(site: dict[str, Any]) -> str:
    """A shared site as people read it.

    Its source place and, when the kernel names the buffer it accesses,
    the buffer: ``pick.mojo:420:28 (histogram)``.
    """
    buffer = site.get("buffer", "")
    return f"{site['site']} ({buffer})" if buffer else site["site"]


def _efficiency(sites: list[dict[str, Any]]) -> float | None:
    """Bytes asked for over the sectors' bytes, ``None`` without sectors.

    Over ``sites``' requests that are not uniform: a uniform request
    (every lane on the same bytes) is one sector of a value the whole
    warp needs, not a stream to coalesce.
    """
    sectors = sum(s["sectors"] - s["uniform_sectors"] for s in sites)
    if not sectors:
        return None
    asked = sum(s["bytes_requested"] - s["uniform_bytes"] for s in sites)
    return asked / (32 * sectors)


def launch_record(
    line: dict[str, Any], registers: dict[str, int] | None = None
) -> dict[str, Any]:
    """One launch's record from the driver's line.

    Args:
        line: The driver's JSON object (``op``, ``workload``, ``arch``,
            ``window_rows`` (0 for a writer: no windows), ``profile``).
        registers: Registers per thread by kernel name (gpu-report's),
            for the estimate's occupancy; a kernel missing is not limited
            by registers.

    Returns:
        ``op``, ``kernel``, ``workload``, ``arch``, ``window_rows``,
        ``blocks`` (the grid), ``sampled_blocks`` (blocks emulated, 0 if
        all), ``barriers_per_block``, ``block_threads``, ``shared``
        (``requests``, ``wavefronts``, ``worst``: the worst sites' ``site``
        and ``ways``, ``sites``), ``atomics`` (``max_lanes_per_address``,
        ``mean_lanes_per_address``), ``global`` (``requests``,
        ``sectors``, ``cold_sectors`` (first touched by their block),
        ``bytes_requested``, ``bytes_read``, ``bytes_written``: the
        emulated blocks'; ``load_efficiency`` (of the requests that are
        not uniform);
        ``launch_bytes``: distinct bytes scaled to the grid;
        ``bound_bytes``: the roofline's for the whole call; ``sites``),
        ``busiest_block_accesses`` and ``idlest_block_accesses`` (shared
        accesses of the emulated blocks: the imbalance), ``phase_path``,
        ``phase_global``, ``waves`` and ``estimate_us`` per
        GPU of the arch, and ``estimate_parts_us``.
    """
    p = line["profile"]
    shared = p["shared"]
    glob = p["global"]
    atomics = [s for s in shared["sites"] if s["access"] == "atomic"]
    lanes = sum(s["atomic_lanes"] for s in atomics)
    addresses = sum(s["atomic_addresses"] for s in atomics)
    worst = sorted(
        shared["sites"], key=lambda s: (-s["ways"], -s["wavefronts"])
    )
    loads = [s for s in glob["sites"] if s["access"] == "load"]
    workload = WORKLOADS.get(line["workload"])
    estimates, parts, waves = {}, {}, {}
    for gpu in ARCH_GPUS[line["arch"]]:
        est = estimate_us(
            p, COST_MODELS[gpu], (registers or {}).get(p["kernel"], 0)
        )
        estimates[gpu] = round(est["us"], 2)
        waves[gpu] = est["waves"]
        parts[gpu] = {
            k: round(est[k], 2) for k in ("dram", "l2", "shared", "latency")
        }
    return {
        "op": line["op"],
        "kernel": p["kernel"],
        "workload": line["workload"],
        "arch": line["arch"],
        "window_rows": line["window_rows"],
        "blocks": p["grid"],
        "sampled_blocks": p["sampled_blocks"],
        "barriers_per_block": p["barriers_per_block"],
        "block_threads": p["block_threads"],
        "shared": {
            "requests": shared["requests"],
            "wavefronts": shared["wavefronts"],
            "worst": [
                {
                    "site": s["site"],
                    "buffer": s.get("buffer", ""),
                    "ways": s["ways"],
                }
                for s in worst[:WORST_SITES]
            ],
            "sites": shared["sites"],
        },
        "atomics": {
            "max_lanes_per_address": max(
                (s["max_lanes_per_address"] for s in atomics), default=0
            ),
            "mean_lanes_per_address": round(lanes / addresses, 2)
            if addresses
            else 0,
        },
        "global": {
            **{k: glob[k] for k in (
                "requests", "sectors", "cold_sectors", "bytes_requested",
                "bytes_read", "bytes_written",
            )},
            "load_efficiency": _efficiency(loads),
            "launch_bytes": round(launch_counts(p)["dram_bytes"]),
            "bound_bytes": workload["bytes"] if workload else None,
            "sites": glob["sites"],
        },
        "busiest_block_accesses": p["busiest_block_accesses"],
        "idlest_block_accesses": p["idlest_block_accesses"],
        "phase_path": p["phase_path"],
        "phase_global": p["phase_global"],
        "waves": waves,
        "estimate_us": estimates,
        "estimate_parts_us": parts,
    }  # fmt: skip


def _estimate_cell(launch: dict[str, Any], gpu: str) -> str:
    us = launch["estimate_us"].get(gpu)
    return "-" if us is None else f"{us:.1f}"


#: What the table's columns are, printed under it.
LEGEND = (
    "columns: blocks emulated/launched; bar: barriers a block; requests,"
    " wf/req: shared-memory warp requests and wavefronts a request; ways:"
    " the worst shared site's bank conflict (1: none); atomic: most lanes"
    " on one shared word; sec/req: 32-byte global sectors a request; ld"
    " eff: bytes asked for over sectors moved (uniform loads apart); MB:"
    " distinct bytes; us: estimated launch time (a model, not a"
    " measurement); worst site: file:line (its named buffer)"
)


def format_table(launches: list[dict[str, Any]]) -> list[str]:
    """A line per launch (:func:`launch_record`), then one per flaw.

    A flaw is a shared site past :data:`CLEAN_WAYS` or a global load site
    under :data:`CLEAN_SECTOR_EFFICIENCY`.

    Columns: workload, kernel, blocks emulated of the grid, barriers per
    block, shared requests, wavefronts per request, the worst site's ways,
    the most lanes of a request on one atomic word, global sectors per
    request, the loads' sector efficiency, the launch's distinct MB (the
    grid's), the estimated microseconds on each GPU of the target.
    """
    gpus = sorted({g for launch in launches for g in launch["estimate_us"]})
    rows = [
        ("workload", "kernel", "blocks", "bar", "requests", "wf/req", "ways",
         "atomic", "sec/req", "ld eff", "MB", *(f"{g} us" for g in gpus),
         "worst site"),
    ]  # fmt: skip
    notes = []
    for launch in launches:
        shared, glob = launch["shared"], launch["global"]
        worst = _worst(launch)
        atomic = launch["atomics"]["max_lanes_per_address"]
        per = shared["wavefronts"] / max(shared["requests"], 1)
        sectors = glob["sectors"] / max(glob["requests"], 1)
        eff = glob["load_efficiency"]
        emulated = launch["sampled_blocks"] or launch["blocks"]
        rows.append(
            (
                launch["workload"],
                launch["kernel"].removeprefix("mla_kpool_index_"),
                f"{emulated}/{launch['blocks']}",
                str(launch["barriers_per_block"]),
                f"{shared['requests']:,}",
                f"{per:.2f}",
                str(worst["ways"]) if worst else "-",
                str(atomic) if atomic else "-",
                f"{sectors:.1f}" if glob["requests"] else "-",
                f"{eff:.0%}" if eff is not None else "-",
                f"{glob['launch_bytes'] / 1e6:.2f}",
                *(_estimate_cell(launch, g) for g in gpus),
                site_label(worst) if worst else "-",
            )
        )
        where = f"in {launch['workload']} {launch['kernel']}"
        for s in shared["sites"]:
            if s["ways"] > CLEAN_WAYS:
                notes.append(
                    f"  {s['ways']}-way: {site_label(s)} ({s['access']},"
                    f" {4 * s['width_words']} bytes a lane; {s['requests']:,}"
                    f" requests, {s['wavefronts']:,} wavefronts for"
                    f" {s['ideal_wavefronts']:,}) {where}"
                )
        for s in glob["sites"]:
            e = _efficiency([s])
            if s["access"] == "load" and e is not None:
                if e < CLEAN_SECTOR_EFFICIENCY:
                    notes.append(
                        f"  {e:.0%} of sectors used: {s['site']} (load,"
                        f" {s['bytes_per_lane']} bytes a lane;"
                        f" {s['requests']:,} requests,"
                        f" {s['sectors'] / s['requests']:.1f} sectors each)"
                        f" {where}"
                    )
    last = len(rows[0]) - 1
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = [
        "  ".join(
            cell.ljust(w) if i in (0, 1, last) else cell.rjust(w)
            for i, (cell, w) in enumerate(zip(row, widths, strict=True))
        ).rstrip()
        for row in rows
    ]
    return lines + notes


def verdict(launches: list[dict[str, Any]]) -> str:
    """One line: every launch clean, or which are not.

    Clean: every shared site at most :data:`CLEAN_WAYS` ways, the loads at
    least :data:`CLEAN_SECTOR_EFFICIENCY` of their sectors.
    """
    ways = sorted(
        {
            launch["kernel"]
            for launch in launches
            if (w := _worst(launch)) is not None and w["ways"] > CLEAN_WAYS
        }
    )
    loads = sorted(
        {
            launch["kernel"]
            for launch in launches
            if (e := launch["global"]["load_efficiency"]) is not None
            and e < CLEAN_SECTOR_EFFICIENCY
        }
    )
    if not ways and not loads:
        return (
            f"verdict: {len(launches)} launches, every shared site at most"
            f" {CLEAN_WAYS}-way, every launch's loads at least"
            f" {CLEAN_SECTOR_EFFICIENCY:.0%} of their sectors"
        )
    parts = []
    if ways:
        parts.append(
            f"{len(ways)} kernels with a shared site past {CLEAN_WAYS}-way:"
            f" {', '.join(ways)}"
        )
    if loads:
        parts.append(
            f"{len(loads)} kernels whose loads use under"
            f" {CLEAN_SECTOR_EFFICIENCY:.0%} of their sectors:"
            f" {', '.join(loads)}"
        )
    return "verdict: " + "; ".join(parts)


def launch_name(row: dict[str, Any]) -> str:
    """The kernel a gpu-report row compiled, as a profile names it.

    Its entry point less the compiler's ``_<8 hex>`` suffix:
    ``mla_kpool_index_select_kernel_01dd432a`` is
    ``mla_kpool_index_select_kernel``.
    """
    entry = str(row.get("entry", ""))
    return re.sub(r"_[0-9a-f]{8}$", "", entry)


def report_registers(path: str, arch: str) -> dict[str, int]:
    """Registers per thread by kernel, from gpu-report's ``--json``.

    Keyed as a profile names its launches' kernels (`launch_name`); the
    most of any of a kernel's configurations compiled for ``arch``.

    Raises:
        ValueError: Naming the file, if it cannot be read, is not JSON, is
            not gpu-report's (rows under ``kernels``) or has no row of
            ``arch`` with registers.
    """
    try:
        doc = json.loads(Path(path).read_text(encoding="utf-8"))
    except OSError as err:
        raise ValueError(f"cannot read it: {err.strerror}") from err
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ValueError("not JSON") from err
    rows = doc.get("kernels") if isinstance(doc, dict) else None
    if not isinstance(rows, list) or not all(isinstance(r, dict) for r in rows):
        raise ValueError(
            "not gpu-report's JSON (no list of kernel rows under"
            ' "kernels"); write one with gpu-report --json'
        )
    out: dict[str, int] = {}
    for row in rows:
        registers = row.get("registers")
        name = launch_name(row)
        if row.get("arch") == arch and isinstance(registers, int) and name:
            out[name] = max(out.get(name, 0), registers)
    if not out:
        found = sorted({str(r.get("arch")) for r in rows})
        raise ValueError(
            f"no {arch} kernel with registers in it (it has"
            f" {', '.join(found) or 'none'}); run gpu-report --arch {arch}"
            " --json"
        )
    return out


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
    registers = None
    if args.report:
        try:
            registers = report_registers(args.report, args.arch)
        except ValueError as e:
            return usage_error(args, f"argument --report: {args.report}: {e}")
    say(f"emulating the GPU launches for {args.arch} ({RUN_TIME})...")
    start = time.perf_counter()
    argv = [mojo, "run", "-D", PROFILE_DEFINE, "-I", str(KERNELS.parent)]
    argv.append(str(DRIVER))
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
    launches = [
        launch_record(line, registers) for line in parse_lines("".join(lines))
    ]
    say(f"{len(launches)} launches in {time.perf_counter() - start:.0f} s")
    for line in format_table(launches):
        print(line)
    print(LEGEND)
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

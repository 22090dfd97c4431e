"""Each documented workload's lower bounds and how full its kernels' grids are.

The workloads, their bytes, flops and bounds are the bench's
(:mod:`mla_kpool.bench.bounds`). This module adds what the compiled
kernels say: ``gpu-report``'s kernel rows (its manifest, written by
``kernel_asm.mojo`` from each kernel's own declaration in the Mojo
package) carry each launch's threads per block, shared memory and **grid
rule**: ``ceil(rows / rows_per_block) * ceil(columns /
columns_per_block)`` blocks, ``rows`` and ``columns`` named counts of the
call (``"batch"``, ``"tokens"``, ``"batch + out_rows"``, ``"window_rows"``,
``"candidates"``, ``"1"``), which are evaluated here on the workload's
``counts``. A kernel over ``window_rows`` runs once per window. Nothing of
the kernels' launch arithmetic is repeated here: a workload whose op has no
kernel row for a GPU's target (a report not compiled for it) gets no fill
and no scorer bound for that GPU.

``fill = min(1, blocks / (units * resident blocks per unit))``: the share
of the GPU's resident block slots one launch occupies, the resident blocks
from the row's own occupancy (its registers and shared memory as
compiled) or, for a row without registers, the occupancy model with no
register limit.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from ..bench.bounds import WORKLOADS
from ..gpu_specs import GPUS, lower_bound_seconds
from .occupancy import occupancy_by_gpu

__all__ = [
    "format_rooflines",
    "grid_blocks",
    "kernel_rows_for",
    "residency_source",
    "rooflines",
    "scorer_bounds",
]


def _count(counts: dict[str, int], name: str) -> int:
    """A named count (``"tokens"``, ``"1"``) or a sum of them."""
    return sum(
        1 if part == "1" else counts[part]
        for part in (p.strip() for p in name.split("+"))
    )


def grid_blocks(grid: dict[str, Any], counts: dict[str, int]) -> int:
    """Blocks of one launch by a kernel row's grid rule.

    Args:
        grid: The row's ``grid``: ``rows``, ``rows_per_block``,
            ``columns``, ``columns_per_block``.
        counts: The workload's ``counts``.

    Returns:
        ``ceil(rows / rows_per_block) * ceil(columns / columns_per_block)``.

    Raises:
        KeyError: If the rule names a count the workload lacks.
    """
    rows = _count(counts, grid["rows"])
    columns = _count(counts, grid["columns"])
    return math.ceil(rows / grid["rows_per_block"]) * math.ceil(
        columns / grid["columns_per_block"]
    )


def _arch(arch: str | None) -> str | None:
    return arch + "a" if arch in ("sm_90", "sm_100") else arch


def kernel_rows_for(
    rows: list[dict[str, Any]], w: dict[str, Any], arch: str
) -> list[dict[str, Any]]:
    """The kernel rows of ``w``'s op for ``arch``, one per kernel.

    Rows whose ``params`` (a dict) disagree with ``w``'s on a key both
    have are skipped; of the others, the first of each kernel, in the
    manifest's (launch) order.
    """
    out: dict[str, dict[str, Any]] = {}
    for r in rows:
        if (
            r.get("op") == w["op"]
            and _arch(r.get("arch")) == arch
            and _agrees(r.get("params"), w["params"])
            and "grid" in r
        ):
            out.setdefault(r["kernel"], r)
    return list(out.values())


def _agrees(params: Any, mine: dict[str, Any]) -> bool:
    """Whether a row's ``params`` (if a dict) agree with ``mine``."""
    if not isinstance(params, dict):
        return True
    return all(params[k] == v for k, v in mine.items() if k in params)


def _kernel_fill(
    w: dict[str, Any], row: dict[str, Any], gpu: str
) -> dict[str, Any]:
    """One kernel's grid and fill on ``gpu`` (see :func:`rooflines`)."""
    spec = GPUS[gpu]
    threads = row["block_threads"]
    resident = (row.get("resident_blocks") or {}).get(gpu)
    source = "kernel row"
    if resident is None:
        shared = row.get("shared_bytes", 4 * row.get("shared_words", 0))
        occ = occupancy_by_gpu(
            spec.arch, int(row.get("registers") or 0), int(shared), threads
        )
        resident = occ[gpu]["resident_blocks"]
        source = "model" if row.get("registers") else "model, no regs"
    counts = w["counts"]
    blocks = grid_blocks(row["grid"], counts)
    windowed = "window_rows" in (row["grid"]["rows"], row["grid"]["columns"])
    slots = spec.units * resident
    return {
        "kernel": row["kernel"],
        "grid": blocks,
        "launches": counts["windows"] if windowed else 1,
        "block_threads": threads,
        "resident_blocks": resident,
        "resident_from": source,
        "fill": min(1.0, blocks / slots) if slots else 0.0,
    }


def rooflines(kernels: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each documented workload's lower bounds and grid fill, per GPU.

    Args:
        kernels: Kernel rows, as ``gpu-report`` builds them: ``op``,
            ``kernel``, ``arch``, ``params`` (a dict: picks among
            configs), ``block_threads``, ``grid`` (the rule, see the module
            docstring), and ``resident_blocks`` (``{gpu: blocks per SM}``)
            or ``registers`` and ``shared_bytes`` for the occupancy model;
            a score kernel's also ``column_flops``, ``padded_tile``,
            ``flops_peak`` (:func:`scorer_bounds`).

    Returns:
        One dict per (workload, GPU), workloads in
        :data:`mla_kpool.bench.bounds.WORKLOADS`' order: ``workload``,
        ``gpu``, ``arch``, ``bytes``, ``flops``, ``bound_s_fp32`` and
        ``bound_s_fp8`` (seconds), ``binding_fp32`` and ``binding_fp8``
        (``"memory"`` or ``"compute"``; ``binding`` is the FP32 one),
        ``kernels``: per kernel row of the workload's op on the GPU's
        target, ``kernel``, ``grid`` (blocks of its largest launch),
        ``launches``, ``block_threads``, ``resident_blocks`` (per SM or
        CU), ``resident_from`` and ``fill`` (none without rows); for the
        indexer's workloads, ``scorers`` (:func:`scorer_bounds`).
    """
    out = []
    for w in WORKLOADS.values():
        for gpu, spec in GPUS.items():
            peak = spec.peak
            memory_s = w["bytes"] / (peak.hbm_tbps * 1e12)
            result: dict[str, Any] = {
                "workload": w["name"],
                "gpu": gpu,
                "arch": spec.arch,
                "bytes": w["bytes"],
                "flops": w["flops"],
            }
            for precision in ("fp32", "fp8"):
                bound = lower_bound_seconds(
                    w["bytes"], w["flops"], peak, precision
                )
                result[f"bound_s_{precision}"] = bound
                result[f"binding_{precision}"] = (
                    "memory" if bound == memory_s else "compute"
                )
            result["binding"] = result["binding_fp32"]
            mine = kernel_rows_for(kernels, w, spec.arch)
            if w["op"] == "index_top_k":
                result["scorers"] = scorer_bounds(w, spec, memory_s, mine)
            result["kernels"] = [_kernel_fill(w, r, gpu) for r in mine]
            out.append(result)
    return out


def scorer_bounds(
    w: dict[str, Any], spec: Any, memory_s: float, rows: list[dict[str, Any]]
) -> list[dict[str, Any]]:
    """Each scorer's bound on one index workload: memory or instruction issue.

    A score kernel's row (``score_<scorer>``, ``score_<scorer>_rows``
    for the kernel whose blocks take several rows; its ``scorer``) says
    what it computes: ``column_flops`` per candidate at the
    ``flops_peak`` (``"fp32"`` or ``"fp8"``) of the GPU; with a
    ``padded_tile`` a block computes whole tiles of that many candidates,
    a row's last one padded (a tensor-core tile), else only those a row
    sees. The bound of a scorer is ``max(memory, issue)``; it leaves the
    plan and select launches out.

    Args:
        w: An index workload (:func:`mla_kpool.bench.bounds.index_workload`).
        spec: The GPU's :class:`mla_kpool.gpu_specs.GpuSpec`.
        memory_s: ``w``'s bytes over the GPU's bandwidth.
        rows: ``w``'s kernel rows on the GPU's target
            (:func:`kernel_rows_for`).

    Returns:
        ``[{"scorer", "kernel", "bound_s", "issue_s", "binding"}]``.
    """
    out = []
    seen = np.asarray(w["row_bounds"], np.int64)
    peak = spec.peak
    for row in rows:
        if not row["kernel"].startswith("score_") or not row.get(
            "column_flops"
        ):
            continue
        tile = row.get("padded_tile") or 0
        if tile:
            columns = int((-(-seen // tile)).sum()) * tile
        else:
            columns = int(seen.sum())
        tflops = (
            peak.fp8_tflops if row["flops_peak"] == "fp8" else peak.fp32_tflops
        )
        issue_s = row["column_flops"] * columns / (tflops * 1e12)
        out.append(
            {
                "scorer": row.get("scorer")
                or row["kernel"].removeprefix("score_"),
                "kernel": row["kernel"],
                "bound_s": max(memory_s, issue_s),
                "issue_s": issue_s,
                "binding": "memory" if memory_s >= issue_s else "issue",
            }
        )
    return out


def _us(seconds: float) -> str:
    us = seconds * 1e6
    return f"{us:.0f}" if us >= 100 else f"{us:.3g}"


def residency_source(result: dict[str, Any]) -> str:
    """Where one :func:`rooflines` result's resident blocks come from.

    ``"compiled <arch>"`` when every kernel's come from a kernel row of
    the GPU's target (its registers and shared memory as compiled),
    ``"model"`` when none do (rows without registers: the occupancy model
    with no register limit), ``"no kernel rows"`` without any row, else
    ``"compiled <arch>; model: <kernels>"``.
    """
    if not result["kernels"]:
        return "no kernel rows"
    model = [
        k["kernel"]
        for k in result["kernels"]
        if k["resident_from"] != "kernel row"
    ]
    if not model:
        return f"compiled {result['arch']}"
    if len(model) == len(result["kernels"]):
        return "model"
    return f"compiled {result['arch']}; model: {', '.join(model)}"


def format_rooflines(results: list[dict[str, Any]]) -> str:
    """A markdown table of :func:`rooflines`' results, a row each.

    Columns: workload, GPU, MB moved, GFLOP, the FP32 and FP8 bounds in
    microseconds with what binds each, each kernel's ``grid`` and
    ``fill`` (``kernel grid (fill%)``), and where the fills' resident
    blocks come from (:func:`residency_source`).
    """
    head = (
        "| workload | GPU | MB | GFLOP | FP32 bound us | FP8 bound us |"
        " scorer bounds us | kernels: grid (fill) | resident blocks from |"
    )
    lines = [
        head,
        "| --- | --- | ---: | ---: | ---: | ---: | --- | --- | --- |",
    ]
    for r in results:
        kernels = ", ".join(
            f"{k['kernel']} {k['grid']} ({100 * k['fill']:.0f}%)"
            for k in r["kernels"]
        )
        scorers = ", ".join(
            f"{x['scorer']} {_us(x['bound_s'])} {x['binding']}"
            for x in r.get("scorers", [])
        )
        lines.append(
            f"| {r['workload']} | {r['gpu']} | {r['bytes'] / 1e6:.3g} |"
            f" {r['flops'] / 1e9:.3g} | {_us(r['bound_s_fp32'])}"
            f" {r['binding_fp32']} | {_us(r['bound_s_fp8'])}"
            f" {r['binding_fp8']} | {scorers or '-'} | {kernels or '-'} |"
            f" {residency_source(r)} |"
        )
    return "\n".join(lines)

"""Lower bounds on each documented workload's time, and how full its grids are.

The bench's documented workloads (:data:`WORKLOADS`):

- ``step-b64``, ``step-b4096``: the writers' fused step (``mla_kpool.step``)
  at bfloat16, head_dim 128, kpool 4 and batch 64 or 4096, as the bench
  times it (:mod:`mla_kpool.bench.workload`: each request brings
  ``2 * kpool`` tokens with ``kpool // 2`` pending, closes one pool,
  builds one and stashes ``kpool // 2`` tokens);
- ``glm5-next-decode``: GLM-5-Next's indexer (H 32, D 128, kpool 4, top
  512, rows of W 32, pages of 128 rows, causal), 16 requests of one new
  token after 32,767 cached (:data:`mla_kpool.bench.index.INDEX_PHASES`);
- ``glm5-next-prefill``: the same indexer, one request of 4,096 new
  tokens from an empty cache;
- ``deepseek-v3.2-decode``: DeepSeek-V3.2's indexer shape (H 64, D 128,
  kpool 1, top 2048, whole rows of 128 bytes), on the GLM decode's calls:
  16 requests of one token after 32,767 cached.

**Model.** ``bytes`` is the compulsory HBM traffic of one call, the
bench's own count: for the indexer each request's visible keys read once
(``D`` FP8 bytes and a float32 scale per candidate its last row sees), the
FP8 queries and float32 head weights, the int32 output
(:func:`mla_kpool.bench.index.index_bytes`); for the step the ring
members, the new ``k`` and ``gate`` rows, ``ape``, the pooled rows,
``closed_pool`` and the ring rows seeded
(:func:`mla_kpool.bench.workload.op_bytes`). ``flops``: the indexer's
``2 * H * D`` per (query row, visible candidate)
(:func:`mla_kpool.bench.index.score_flops`); the step's
:func:`step_flops`. The bound on a GPU is the roofline's
``max(bytes / HBM bandwidth, flops / peak)``
(:func:`mla_kpool.gpu_specs.lower_bound_seconds`), with the FP32 peak (what
the kernels compute in) and with the dense FP8 tensor peak (what a
tensor-core scorer could reach); it ignores launch latency, so a call of a
few microseconds cannot reach it.

**Grids.** Each kernel's grid mirrors its op's launch formula
(``kernels/index_gpu.mojo``, ``kernels/step.mojo``): plan
``ceil(T / plan threads)``; score ``rows * ceil(candidates / score
threads)`` per window of rows (a thread per candidate); select ``rows``
per window; the step's scan ``1`` and its main kernel ``batch + T //
kpool``. ``candidates`` is the most a row can see (the lookup tables'
pages times their rows, per candidate) and a window holds what 256 MiB of
float32 scores allow. ``fill = min(1, blocks / (units * resident blocks
per unit))``: the share of the GPU's resident block slots one launch
occupies.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ..bench import index as bench_index
from ..bench import workload as bench_workload
from ..gpu_specs import GPUS, gpu_spec, lower_bound_seconds
from .occupancy import occupancy_by_gpu

__all__ = [
    "WORKLOADS",
    "bound_seconds",
    "format_rooflines",
    "index_workload",
    "residency_source",
    "rooflines",
    "scorer_bounds",
    "score_threads",
    "step_flops",
    "step_workload",
    "workload_for_case",
]

#: Scores workspace of one index_top_k call (``GPU_WORKSPACE_BYTES``).
WORKSPACE_BYTES = 1 << 28
#: Threads per block of each kernel as the ops launch them today, used when
#: no kernel row names them (``PLAN_THREADS``, ``SCORE_THREADS`` for the
#: untiled scorer, ``SELECT_THREADS``; the step's scan is one thread; the
#: tiled scorer's follow its query, :func:`score_threads`).
DEFAULT_BLOCK_THREADS = {
    "plan": 256,
    "score_untiled": 128,
    "select": 512,
    "scan": 1,
}
#: Shared words the tiled scorer may use (``SCORE_SHARED_LIMIT``).
SCORE_SHARED_WORDS = 12 * 1024
#: Shared words per 64 threads of a tiled-score block (``SCORE_WAVE_WORDS``).
SCORE_WAVE_WORDS = 1024
#: Shared bytes of one select block (``SELECT_WORDS`` words: a counter per
#: thread for 15 of the 16 digits of a 4-bit radix pass, the 15 totals and
#: 4 words of state).
SELECT_SHARED_BYTES = 4 * (15 * 512 + 15 + 4)
#: Flops per pooled member and channel of a writer: gate + ape, minus the
#: max, exp (counted as one), the weight sum, the weighted key (mul, add).
POOL_FLOPS_PER_MEMBER = 6


def step_flops(batch: int, kpool: int, head_dim: int) -> int:
    """Flops of one step call of the bench's workload.

    Each pooled channel costs :data:`POOL_FLOPS_PER_MEMBER` per member and
    one division. A request of the workload (``kpool // 2`` pending, then
    ``2 * kpool`` new tokens) makes two pools: it closes one from its ring
    and builds one, or, with nothing pending (kpool 1), builds two.

    Args:
        batch: Requests.
        kpool: Tokens per pool.
        head_dim: Channels.

    Returns:
        The flops.
    """
    pools = 2 * batch
    return pools * head_dim * (POOL_FLOPS_PER_MEMBER * kpool + 1)


def step_workload(
    name: str, batch: int, dtype: str, kpool: int, head_dim: int
) -> dict[str, Any]:
    """The fused step on the bench's workload (:mod:`.bench.workload`).

    Returns:
        ``name``, ``op`` (``"step"``), ``params``, ``bytes``
        (:func:`mla_kpool.bench.workload.op_bytes`), ``flops``
        (:func:`step_flops`), ``batch``, ``tokens``, ``out_rows``,
        ``head_dim``.
    """
    case = bench_workload.Case("step", dtype, batch, kpool, head_dim, "gpu")
    tokens = batch * 2 * kpool
    return {
        "name": name,
        "op": "step",
        "params": {"dtype": dtype, "kpool": kpool, "head_dim": head_dim},
        "bytes": bench_workload.op_bytes(case),
        "flops": step_flops(batch, kpool, head_dim),
        "batch": batch,
        "tokens": tokens,
        "out_rows": tokens // kpool,
        "head_dim": head_dim,
    }


def index_workload(
    name: str,
    requests: int,
    cached: int,
    new: int,
    shape: bench_index.IndexShape,
) -> dict[str, Any]:
    """One index_top_k call: ``requests`` of ``new`` tokens after ``cached``.

    The cache holds each request's ``(cached + new) // kpool`` pools (a
    prefill's own pools too: the step runs first), in pages of
    ``shape.page_size`` rows, as :func:`.bench.index.make_index_workload`
    builds it.

    Returns:
        ``name``, ``op`` (``"index_top_k"``), ``params``, ``bytes``
        (:func:`.bench.index.index_bytes`), ``flops``
        (:func:`.bench.index.score_flops`), ``tokens``, ``candidates`` (a
        workspace row: the lookup tables' pages times rows per page, per
        candidate), ``window`` (rows per window of launches), ``heads``,
        ``depth``.
    """
    offsets = np.arange(requests + 1, dtype=np.int64) * new
    lengths = np.full(requests, cached, dtype=np.int64)
    rows_per = shape.depth // shape.width
    pools = (cached + new) // shape.kpool
    pages = -(-pools * rows_per // shape.page_size)
    candidates = pages * shape.page_size // rows_per
    tokens = requests * new
    return {
        "name": name,
        "op": "index_top_k",
        "params": {
            "num_heads": shape.heads,
            "depth": shape.depth,
            "k": shape.top_k,
            "kpool": shape.kpool,
        },
        "bytes": bench_index.index_bytes(offsets, lengths, shape),
        "flops": bench_index.score_flops(offsets, lengths, shape),
        "tokens": tokens,
        "candidates": candidates,
        "window": max(
            1, min(tokens, WORKSPACE_BYTES // (max(candidates, 1) * 4))
        ),
        "heads": shape.heads,
        "depth": shape.depth,
        "row_bounds": bench_index.bounds(
            offsets, lengths, shape.kpool, shape.causal
        ),
    }


#: DeepSeek-V3.2's indexer: 64 heads of 128, no pooling, top 2048.
DEEPSEEK_V32 = bench_index.IndexShape(
    heads=64, depth=128, kpool=1, top_k=2048, width=128
)


def _workloads() -> dict[str, dict[str, Any]]:
    decode = bench_index.INDEX_PHASES["decode"]
    prefill = bench_index.INDEX_PHASES["prefill"]
    glm = bench_index.GLM5_NEXT
    named = [
        step_workload("step-b64", 64, "bfloat16", 4, 128),
        step_workload("step-b4096", 4096, "bfloat16", 4, 128),
        index_workload("glm5-next-decode", *decode, glm),
        index_workload("glm5-next-prefill", *prefill, glm),
        index_workload("deepseek-v3.2-decode", *decode, DEEPSEEK_V32),
    ]
    return {w["name"]: w for w in named}


#: The documented workloads by name (see the module docstring).
WORKLOADS = _workloads()


def workload_for_case(case: bench_workload.Case) -> dict[str, Any] | None:
    """The workload a bench configuration times, if it has a bound.

    The fused step (``step``, and ``step3``, the same work in three ops)
    at the case's batch, dtype, kpool and head_dim; index_top_k's phase at
    GLM-5-Next's shape (:data:`.bench.index.INDEX_PHASES`, read when
    called); ``None`` for the other ops.
    """
    if case.op in ("step", "step3"):
        name = f"{case.op}-b{case.batch}"
        return step_workload(
            name, case.batch, case.dtype, case.kpool, case.head_dim
        )
    if case.op == bench_workload.INDEX_OP and case.phase:
        requests, cached, new = bench_index.INDEX_PHASES[case.phase]
        return index_workload(
            f"index_top_k-{case.phase}",
            requests,
            cached,
            new,
            bench_index.GLM5_NEXT,
        )
    return None


def bound_seconds(
    workload: str | dict[str, Any],
    gpu_name: str | None,
    precision: str = "fp32",
) -> float | None:
    """The roofline lower bound of one call of ``workload`` on a GPU.

    Args:
        workload: A name of :data:`WORKLOADS` or a workload dict
            (:func:`step_workload`, :func:`index_workload`,
            :func:`workload_for_case`).
        gpu_name: A driver model name or :data:`mla_kpool.gpu_specs.GPUS`
            key, matched by substring (``"NVIDIA H200"``).
        precision: ``"fp32"`` or ``"fp8"`` (which compute peak).

    Returns:
        Seconds, or ``None`` when the GPU is not in the table.

    Raises:
        KeyError: If ``workload`` names no workload of :data:`WORKLOADS`.
        ValueError: If ``precision`` is neither.
    """
    w = WORKLOADS[workload] if isinstance(workload, str) else workload
    spec = gpu_spec(gpu_name)
    if spec is None:
        return None
    return lower_bound_seconds(w["bytes"], w["flops"], spec.peak, precision)


def _heads_pow2(heads: int) -> int:
    return 1 << (heads - 1).bit_length()


def _tiled(heads: int, depth: int) -> bool:
    """Whether the tiled scorer serves ``heads`` x ``depth``.

    Mirrors ``tiled_scorer`` in ``kernels/index_gpu_shape.mojo``.
    """
    hp = _heads_pow2(heads)
    return hp <= 64 and hp * depth <= SCORE_SHARED_WORDS


def score_threads(heads: int, depth: int) -> int:
    """Threads per block of the score launch (index_gpu_shape.score_threads).

    The untiled scorer's 128; the tiled scorer's a wave of 64 per
    :data:`SCORE_WAVE_WORDS` of its float32 query, a power of two from
    128 to 1024 (256 for 32 heads x 128 dims, 512 for 64 x 128).
    """
    if not _tiled(heads, depth):
        return DEFAULT_BLOCK_THREADS["score_untiled"]
    waves = -(-_heads_pow2(heads) * depth // SCORE_WAVE_WORDS)
    return min(max(1 << (waves * 64 - 1).bit_length(), 128), 1024)


def _kernels(w: dict[str, Any]) -> list[tuple[str, int]]:
    """``(kernel, default shared bytes)`` of each launch of ``w``'s op."""
    if w["op"] == "step":
        return [("scan", 0), ("main", 0)]
    if _tiled(w["heads"], w["depth"]):
        score = ("score_tiled", _heads_pow2(w["heads"]) * w["depth"] * 4)
    else:
        score = ("score_untiled", 0)
    return [("plan", 0), score, ("select", SELECT_SHARED_BYTES)]


def _grid(w: dict[str, Any], kernel: str, threads: int) -> tuple[int, int]:
    """``(blocks of the largest launch, launches)`` of ``kernel``."""
    if kernel == "scan":
        return 1, 1
    if kernel == "main":
        return w["batch"] + w["out_rows"], 1
    if kernel == "plan":
        return -(-w["tokens"] // threads), 1
    rows = min(w["window"], w["tokens"])
    launches = -(-w["tokens"] // w["window"])
    if kernel == "select":
        return rows, launches
    return rows * -(-w["candidates"] // threads), launches


def _default_threads(w: dict[str, Any], kernel: str) -> int:
    if kernel == "main":
        return min(w["head_dim"], 1024)
    if kernel == "score_tiled":
        return score_threads(w["heads"], w["depth"])
    return DEFAULT_BLOCK_THREADS[kernel]


def _arch(arch: str | None) -> str | None:
    return arch + "a" if arch in ("sm_90", "sm_100") else arch


def _row_for(
    rows: list[dict[str, Any]], w: dict[str, Any], kernel: str, arch: str
) -> dict[str, Any] | None:
    """The kernel row of ``w``'s op, ``kernel`` and ``arch``, if any.

    Rows whose ``params`` (a dict) disagree with ``w``'s on a key both
    have are skipped; of the others, the first.
    """
    mine = [
        r
        for r in rows
        if r.get("op") == w["op"]
        and r.get("kernel") == kernel
        and _arch(r.get("arch")) in (None, arch)
        and _agrees(r.get("params"), w["params"])
    ]
    return mine[0] if mine else None


def _agrees(params: Any, mine: dict[str, Any]) -> bool:
    """Whether a row's ``params`` (if a dict) agree with ``mine``."""
    if not isinstance(params, dict):
        return True
    return all(params[k] == v for k, v in mine.items() if k in params)


def _kernel_fill(
    w: dict[str, Any], kernel: str, shared: int, gpu: str, rows: list
) -> dict[str, Any]:
    """One kernel's grid and fill on ``gpu`` (see :func:`rooflines`)."""
    spec = GPUS[gpu]
    row = _row_for(rows, w, kernel, spec.arch)
    threads = (row or {}).get("block_threads") or _default_threads(w, kernel)
    resident = ((row or {}).get("resident_blocks") or {}).get(gpu)
    source = "kernel row"
    if resident is None:
        occ = occupancy_by_gpu(
            spec.arch,
            int((row or {}).get("registers") or 0),
            int((row or {}).get("shared_bytes", shared)),
            threads,
        )
        resident = occ[gpu]["resident_blocks"]
        source = "model" if row and row.get("registers") else "model, no regs"
    blocks, launches = _grid(w, kernel, threads)
    slots = spec.units * resident
    return {
        "kernel": kernel,
        "grid": blocks,
        "launches": launches,
        "block_threads": threads,
        "resident_blocks": resident,
        "resident_from": source,
        "fill": min(1.0, blocks / slots) if slots else 0.0,
    }


def rooflines(kernels: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each documented workload's lower bounds and grid fill, per GPU.

    Args:
        kernels: Kernel rows, as ``gpu-report`` builds them: ``op``
            (``"step"``, ``"index_top_k"``), ``kernel`` (``"scan"``,
            ``"main"``, ``"plan"``, ``"score_tiled"``, ``"score_untiled"``,
            ``"select"``), ``config``, ``arch``, ``block_threads`` and
            ``resident_blocks`` (``{gpu: blocks per SM}``); ``params`` (a
            dict) picks among configs, and ``registers`` and
            ``shared_bytes`` serve when ``resident_blocks`` lacks a GPU.
            A kernel with no row gets the ops' block sizes of today and
            an occupancy with no register limit (an upper bound on its
            residency, so a lower bound on its fill).

    Returns:
        One dict per (workload, GPU), workloads in :data:`WORKLOADS`'
        order: ``workload``, ``gpu``, ``arch``, ``bytes``, ``flops``,
        ``bound_s_fp32`` and ``bound_s_fp8`` (seconds), ``binding_fp32``
        and ``binding_fp8`` (``"memory"`` or ``"compute"``; ``binding`` is
        the FP32 one, the kernels' precision), and ``kernels``: per
        launch, ``kernel``, ``grid`` (blocks of its largest launch),
        ``launches``, ``block_threads``, ``resident_blocks`` (per SM or
        CU), ``resident_from`` and ``fill``; for the indexer's workloads,
        ``scorers`` (:func:`scorer_bounds`).
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
            if w["op"] == "index_top_k":
                result["scorers"] = scorer_bounds(w, spec, memory_s, kernels)
            result["kernels"] = [
                _kernel_fill(w, kernel, shared, gpu, kernels)
                for kernel, shared in _kernels(w)
            ]
            out.append(result)
    return out


def scorer_bounds(
    w: dict[str, Any], spec: Any, memory_s: float, rows: list[dict[str, Any]]
) -> list[dict[str, Any]]:
    """Each scorer's bound on one index workload: memory or instruction issue.

    The issue bound counts what the scorer's compiled kernel computes per
    candidate, read from its kernel row's ``params`` (the manifest of
    ``kernel_asm.mojo``, which takes them from the kernels' own shape
    functions): the FP32 scorer's ``simt_fma_per_candidate`` fmas (its
    padded heads times the depth) at the GPU's FP32 peak; a tensor
    scorer's ``<scorer>_flops_per_tile`` (``wgmma``, ``mfma``) for every
    tile of ``<scorer>_tile`` candidates a row sees (the last one padded),
    at the dense FP8 peak.
    A scorer whose kernel has no row for the GPU's target (not compiled
    for it, or not its GPU) gets none. The bound of a scorer is
    ``max(memory, issue)``; it leaves the plan and select launches out.

    Returns:
        ``[{"scorer", "kernel", "bound_s", "issue_s", "binding"}]``.
    """
    out = []
    seen = np.asarray(w["row_bounds"], np.int64)
    peak = spec.peak
    for scorer, kernels in (
        ("simt", ("score_tiled", "score_untiled")),
        ("wgmma", ("score_wgmma",)),
        ("mfma", ("score_mfma",)),
    ):
        row = next(
            (
                r
                for k in kernels
                if (r := _row_for(rows, w, k, spec.arch)) is not None
                and isinstance(r.get("params"), dict)
            ),
            None,
        )
        if row is None:
            continue
        params = row["params"]
        if scorer == "simt":
            if "simt_fma_per_candidate" not in params:
                continue
            flops = 2 * params["simt_fma_per_candidate"] * int(seen.sum())
            issue_s = flops / (peak.fp32_tflops * 1e12)
        else:
            tile = params[f"{scorer}_tile"]
            tiles = int((-(-seen // tile)).sum())
            flops = tiles * params[f"{scorer}_flops_per_tile"]
            issue_s = flops / (peak.fp8_tflops * 1e12)
        out.append(
            {
                "scorer": scorer,
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
    ``"model"`` when none do (no row, or a row without registers: the
    occupancy model with no register limit), else ``"compiled <arch>;
    model: <kernels>"``.
    """
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
            f" {r['binding_fp8']} | {scorers or '-'} | {kernels} |"
            f" {residency_source(r)} |"
        )
    return "\n".join(lines)

"""The bench's documented workloads and their roofline lower bounds.

The workloads (:data:`WORKLOADS`):

- ``step-b64``, ``step-b4096``: the writers' fused step (``mla_kpool.step``)
  at bfloat16, head_dim 128, kpool 4 and batch 64 or 4096, as the bench
  times it (:mod:`mla_kpool.bench.workload`: each request brings
  ``2 * kpool`` tokens with ``kpool // 2`` pending, closes one pool,
  builds one and stashes ``kpool // 2`` tokens);
- ``<op>-b1``, ``<op>-b64``, ``<op>-b4096`` for ``ring_close``,
  ``compress``, ``seed_tail`` (bfloat16, head_dim 128, kpool 4) and
  ``expand_topk`` (int32 ids, top 512, kpool 4), and ``step-b1``: each
  writer alone on the bench's workload (:func:`writer_workload`);
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
(:func:`mla_kpool.gpu_specs.lower_bound_seconds`), with the FP32 peak and
with the dense FP8 tensor peak; it ignores launch latency, so a call of a
few microseconds cannot reach it.

**Counts.** Each workload also carries ``counts``: the call's sizes that
the kernels' grid rules name (``batch``, ``tokens``, ``out_rows``;
``candidates``, the most a row can see, a workspace row; ``window_rows``,
the rows of the largest window, and ``windows``, the windows of a call:
``index_top_k`` scores rows in windows of what ``WORKSPACE_BYTES`` of
float32 scores hold). :mod:`mla_kpool.gpu_report.roofline` evaluates the
compiled kernels' grid rules on them.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from .._limits import (
    GPU_WORKSPACE_BYTES,
    select_slices,
    wgmma_groups_rows,
    window_rows,
)
from ..gpu_specs import gpu_spec, lower_bound_seconds
from . import index as bench_index
from . import workload as bench_workload

__all__ = [
    "DEEPSEEK_V32",
    "WORKLOADS",
    "WORKSPACE_BYTES",
    "bound_seconds",
    "index_workload",
    "pool_flops",
    "step_flops",
    "step_workload",
    "workload_for_case",
    "writer_workload",
]

#: Scores workspace of one index_top_k call on a GPU (256 MiB, the op's
#: contract in docs/ops.md): a window holds as many rows as fit
#: (:func:`mla_kpool._limits.window_rows`).
WORKSPACE_BYTES = GPU_WORKSPACE_BYTES
#: Flops per pooled member and channel of a writer: gate + ape, minus the
#: max, exp (counted as one), the weight sum, the weighted key (mul, add).
POOL_FLOPS_PER_MEMBER = 6


def pool_flops(pools: int, kpool: int, head_dim: int) -> int:
    """Flops of pooling ``pools`` pools of ``kpool`` members.

    :data:`POOL_FLOPS_PER_MEMBER` per member and channel, and one division
    per channel.
    """
    return pools * head_dim * (POOL_FLOPS_PER_MEMBER * kpool + 1)


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
    return pool_flops(2 * batch, kpool, head_dim)


def step_workload(
    name: str, batch: int, dtype: str, kpool: int, head_dim: int
) -> dict[str, Any]:
    """The fused step on the bench's workload (:mod:`.workload`).

    Returns:
        ``name``, ``op`` (``"step"``), ``params``, ``bytes``
        (:func:`mla_kpool.workload.op_bytes`), ``flops``
        (:func:`step_flops`), ``batch``, ``tokens``, ``out_rows``,
        ``head_dim``, ``counts``.
    """
    case = bench_workload.Case("step", dtype, batch, kpool, head_dim, "gpu")
    tokens = batch * 2 * kpool
    counts = {"batch": batch, "tokens": tokens, "out_rows": tokens // kpool}
    return {
        "name": name,
        "op": "step",
        "params": {"dtype": dtype, "kpool": kpool, "head_dim": head_dim},
        "bytes": bench_workload.op_bytes(case),
        "flops": step_flops(batch, kpool, head_dim),
        **counts,
        "head_dim": head_dim,
        "counts": dict(counts),
    }


def writer_workload(name: str, op: str, batch: int) -> dict[str, Any]:
    """One writer op alone on the bench's workload at ``batch`` requests.

    ``ring_close``, ``compress`` and ``seed_tail`` at bfloat16, head_dim
    128, kpool 4; ``expand_topk`` on int32 ids, top 512, kpool 4, one
    query row per request (:mod:`.workload`). ``flops``: the pooling's
    (:func:`pool_flops`) for the ops that pool, else 0.

    Returns:
        ``name``, ``op``, ``params`` (as the kernel rows' ``params`` name
        them), ``bytes`` (:func:`mla_kpool.bench.workload.op_bytes`),
        ``flops``, ``counts``.
    """
    kpool, head_dim = 4, 128
    dtype = "int32" if op == "expand_topk" else "bfloat16"
    case = bench_workload.Case(op, dtype, batch, kpool, head_dim, "gpu")
    _, new = bench_workload.tokens_per_request(op, kpool)
    tokens = batch * new
    pools = {"ring_close": batch, "compress": tokens // kpool}.get(op, 0)
    counts = {"batch": batch, "tokens": tokens, "out_rows": tokens // kpool}
    params: dict[str, Any] = (
        {"pool_ids": dtype, "kpool": kpool, "pool_topk": 512}
        if op == "expand_topk"
        else {"dtype": dtype, "kpool": kpool, "head_dim": head_dim}
    )
    return {
        "name": name,
        "op": op,
        "params": params,
        "bytes": bench_workload.op_bytes(case),
        "flops": pool_flops(pools, kpool, head_dim),
        "counts": counts,
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
    ``shape.page_size`` rows, as :func:`.index.make_index_workload`
    builds it.

    Returns:
        ``name``, ``op`` (``"index_top_k"``), ``params``, ``bytes``
        (:func:`.index.index_bytes`), ``flops``
        (:func:`.index.score_flops`), ``tokens``, ``candidates`` (a
        workspace row: the lookup tables' pages times rows per page, per
        candidate), ``window`` (rows per window of launches), ``heads``,
        ``depth``, ``row_bounds`` (candidates each row sees),
        ``counts``.
    """
    offsets = np.arange(requests + 1, dtype=np.int64) * new
    lengths = np.full(requests, cached, dtype=np.int64)
    rows_per = shape.depth // shape.width
    pools = (cached + new) // shape.kpool
    pages = -(-pools * rows_per // shape.page_size)
    candidates = pages * shape.page_size // rows_per
    tokens = requests * new
    window = window_rows(candidates, tokens)
    slices = select_slices(candidates, tokens, shape.top_k)
    return {
        "name": name,
        "op": "index_top_k",
        "params": {
            "num_heads": shape.heads,
            "depth": shape.depth,
            "k": shape.top_k,
            "kpool": shape.kpool,
            # Which select kernel runs: rows split over blocks or not.
            "split": slices > 1,
            # Which wgmma score kernel runs: several rows a tile or one.
            "grouped": wgmma_groups_rows(tokens, requests),
        },
        "bytes": bench_index.index_bytes(offsets, lengths, shape),
        "flops": bench_index.score_flops(offsets, lengths, shape),
        "tokens": tokens,
        "candidates": candidates,
        "window": window,
        "heads": shape.heads,
        "depth": shape.depth,
        "row_bounds": bench_index.bounds(
            offsets, lengths, shape.kpool, shape.causal
        ),
        "counts": {
            "batch": requests,
            "tokens": tokens,
            "candidates": candidates,
            "window_rows": window,
            "windows": -(-tokens // window),
            "select_slices": slices,
        },
    }


#: DeepSeek-V3.2's indexer: 64 heads of 128, no pooling, top 2048.
DEEPSEEK_V32 = bench_index.IndexShape(
    heads=64, depth=128, kpool=1, top_k=2048, width=128
)


#: The batches each writer's workload is documented at: one request, a
#: decode batch, a large batch.
WRITER_BATCHES = (1, 64, 4096)


def _workloads() -> dict[str, dict[str, Any]]:
    decode = bench_index.INDEX_PHASES["decode"]
    prefill = bench_index.INDEX_PHASES["prefill"]
    glm = bench_index.GLM5_NEXT
    writers = [
        writer_workload(f"{op}-b{batch}", op, batch)
        for op in ("ring_close", "compress", "seed_tail", "expand_topk")
        for batch in WRITER_BATCHES
    ]
    named = [
        step_workload("step-b1", 1, "bfloat16", 4, 128),
        step_workload("step-b64", 64, "bfloat16", 4, 128),
        step_workload("step-b4096", 4096, "bfloat16", 4, 128),
        *writers,
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
    GLM-5-Next's shape (:data:`.index.INDEX_PHASES`, read when
    called); ``None`` for the other ops.
    """
    if case.op in ("step", "step3"):
        name = f"{case.op}-b{case.batch}"
        return step_workload(
            name, case.batch, case.dtype, case.kpool, case.head_dim
        )
    if case.op == bench_workload.INDEX_OP and case.phase:
        return index_workload(
            f"index_top_k-{case.phase}",
            *bench_index.INDEX_PHASES[case.phase],
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

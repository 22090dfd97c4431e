"""index_top_k's limits, written once in Python: top k, GPU work, its kernels.

A leaf module (it imports nothing) so that :mod:`mla_kpool.reference`,
written from the contract, can take the limit the contract states without
importing the product's code; the product (:mod:`mla_kpool._index_op`,
the demo, the bench) imports it too. Each value mirrors its definition in
the Mojo kernels, and tests/docs_and_layout/test_kernel_constants.py
checks that they agree.
"""

from __future__ import annotations

#: Largest ``top_k`` of index_top_k: MAX's limit for its indexer (the
#: capacity of its bounded top-k), and ours (``TOP_K_LIMIT`` in
#: kernels/index/operands.mojo).
MAX_TOP_K = 2048

#: Scores workspace of one index_top_k call on a GPU, 256 MiB
#: (``GPU_WORKSPACE_BYTES`` in kernels/index/gpu/launches.mojo): the op
#: scores its rows in windows of as many rows as this holds.
GPU_WORKSPACE_BYTES = 1 << 28


def window_rows(candidates: int, total_tokens: int) -> int:
    """Rows per window of index_top_k's GPU path.

    As many float32 workspace rows of ``candidates`` scores as
    :data:`GPU_WORKSPACE_BYTES` holds, at least one, at most
    ``total_tokens`` (``window_rows`` in kernels/index/gpu/launches.mojo).
    """
    per_row = max(candidates, 1) * 4
    return max(1, min(total_tokens, GPU_WORKSPACE_BYTES // per_row))


def select_slices(candidates: int, total_tokens: int, k: int) -> int:
    """Blocks each row's select is split over on a GPU.

    One for a call of at least 128 rows or rows shorter than 4,096 and
    ``4 k`` candidates; else 16, at most ``256 // total_tokens``
    (``select_slices`` in kernels/index/gpu/select.mojo).
    """
    if total_tokens >= 128 or candidates < max(4096, 4 * k):
        return 1
    return min(16, 256 // max(total_tokens, 1))


def wgmma_groups_rows(total_tokens: int, requests: int) -> bool:
    """Whether index_top_k's wgmma tiles score several query rows each.

    At two rows a request or more on average (a prefill), a tile stages
    its keys once for several rows of a request; at decode a tile takes a
    row (``wgmma_groups_rows`` in kernels/index/gpu/wgmma.mojo).
    """
    return total_tokens >= 2 * max(requests, 1)

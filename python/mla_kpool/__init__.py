"""MAX graph custom ops for the k-pooled sparse-attention indexer.

Drop-in, CPU+GPU replacements for MAX's GPU-only
``max.nn.kernels.mla_kpool_*`` writers, with the same Python signatures.
Build the graph with this package's kernels loaded, then call the writers
(or :func:`kpool_step`, all three in order) inside it::

    graph = Graph("indexer", input_types=..., custom_extensions=[KERNELS])
    with graph:
        step = kpool_step(tail, k, gate, ape, row_offsets, cache, slots, 4)

Attributes:
    KERNELS: The Mojo package directory (it holds ``__init__.mojo``), to pass
        as ``custom_extensions=[KERNELS]`` to ``Graph`` or
        ``InferenceSession``. A wheel carries it as ``mla_kpool/kernels``; an
        editable install or a source checkout uses the repository's
        top-level ``kernels/``.
"""

from __future__ import annotations

from . import buffers, reference
from ._metadata import check_metadata
from ._paths import KERNELS
from .graph import (
    KPoolStep,
    compress,
    expand_topk,
    kpool_step,
    pool_row_offsets,
    ring_close,
    seed_tail,
)
from .ring import ring_length

__all__ = [
    "KERNELS",
    "KPoolStep",
    "buffers",
    "check_metadata",
    "compress",
    "expand_topk",
    "kpool_step",
    "pool_row_offsets",
    "reference",
    "ring_close",
    "ring_length",
    "seed_tail",
]

"""MAX graph custom ops for the k-pooled sparse-attention indexer.

Drop-in, CPU+GPU replacements for MAX's GPU-only
``max.nn.kernels.mla_kpool_*`` writers, with the same Python signatures.
Call the writers (or :func:`kpool_step`, all three in order) inside a
graph; each loads this package's kernels into the graph if it lacks them::

    with Graph("indexer", input_types=...) as graph:
        step = kpool_step(tail, k, gate, ape, row_offsets, cache, slots, 4)

Graphs that call MAX's own wrappers (an unchanged MAX pipeline) get the
kernels when built inside :func:`kernels_loaded`.

Attributes:
    KERNELS: The Mojo package directory (it holds ``__init__.mojo``), which
        can also be passed as ``custom_extensions=[KERNELS]`` to ``Graph``
        or ``InferenceSession``. A wheel carries it as
        ``mla_kpool/kernels``; an editable install or a source checkout uses
        the repository's top-level ``kernels/``.
"""

from __future__ import annotations

from . import buffers, reference
from ._metadata import check_metadata
from ._paths import KERNELS, kernels_loaded
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
    "kernels_loaded",
    "kpool_step",
    "pool_row_offsets",
    "reference",
    "ring_close",
    "ring_length",
    "seed_tail",
]

"""NumPy oracle for the k-pooled indexer ops, from docs/ops.md's contracts.

Each pool of ``kpool`` consecutive tokens collapses to one key, per channel::

    s[q, ch]    = gate[q, ch] + ape[q, ch]
    w[q, ch]    = exp(s[q, ch] - max_q s[q, ch])
    pooled[ch]  = sum_q w[q, ch] * key[q, ch] / sum_q w[q, ch]

Everything here runs in float64 (the kernels compute in float32; tests compare
with a tolerance derived from the output dtype). Subtracting the per-channel
maximum keeps gates of magnitude 100 or more finite, and ``np.max`` propagates
NaN, so a NaN score poisons its channel exactly as a softmax would.

The three writers mirror the graph ops, in the order a serving step runs them:

1. :func:`ring_close` closes each request's pending pool (the one the tail ring
   partly holds) when this call brings enough new tokens.
2. :func:`compress` builds every pool made entirely of this call's tokens.
3. :func:`seed_tail` stashes the trailing incomplete tokens into the ring.

:func:`expand_topk` mirrors the op that reads the pools back: it widens the
pool ids an indexer selected for each query token into the token positions
attention reads. :func:`index_top_k` is the indexer itself (score every
visible pooled key of the paged FP8 cache, keep each row's top k) and
:func:`check_selection` compares an op's selection with it at the k-th
score, within :func:`index_tolerance`. :func:`step` runs the three
writers in serving order on one
:class:`mla_kpool.calls.CallInputs`, :func:`tolerance` says how close a
kernel's pooled key must come to the oracle's (:func:`pool_errors` applies
it), and :func:`check_step` compares a kernel's step outputs with
:func:`step` within it.

Modules: ``numerics`` (the pooling formula, the tolerance), ``writers``
(ring_close, compress, seed_tail), ``expand`` (expand_topk), ``fused`` (the
step and its check), ``indexer`` (index_top_k); everything public is
re-exported here.

Index values are read one by one as Python ``int`` so that ``c + n`` never
wraps, whatever the index dtype (uint32 by MAX convention). Bad runtime
metadata (offsets out of order or past ``total_tokens``, a slot outside the
ring, a negative cache length) never raises here: it gives the documented
"no result" answer for that request, as the kernels must.
"""

from __future__ import annotations

from .expand import (
    expand_topk,
    expand_topk_ambiguous_rows,
    expand_topk_candidates,
    expand_topk_width,
)
from .fused import StepReport, check_step, step
from .indexer import (
    RowScores,
    SelectionReport,
    check_selection,
    decode_fp8,
    index_scores,
    index_tolerance,
    index_top_k,
)
from .numerics import (
    TOLERANCE,
    PoolErrors,
    pool,
    pool_errors,
    pool_sequence,
    tolerance,
)
from .writers import (
    compress,
    compress_ambiguous_rows,
    compress_candidates,
    pool_row_offsets,
    ring_close,
    seed_tail,
)

__all__ = [
    "PoolErrors",
    "RowScores",
    "SelectionReport",
    "StepReport",
    "TOLERANCE",
    "check_selection",
    "check_step",
    "compress",
    "compress_ambiguous_rows",
    "compress_candidates",
    "expand_topk",
    "expand_topk_ambiguous_rows",
    "expand_topk_candidates",
    "expand_topk_width",
    "decode_fp8",
    "index_scores",
    "index_tolerance",
    "index_top_k",
    "pool",
    "pool_errors",
    "pool_row_offsets",
    "pool_sequence",
    "ring_close",
    "seed_tail",
    "step",
    "tolerance",
]

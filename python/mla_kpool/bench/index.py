"""The index_top_k benchmark: GLM-5-Next's indexer at serving sizes.

Three workloads at GLM-5-Next's indexer shape (H 32, D 128, kpool 4,
top-k 512, rows of W 32 in the spread layout, pages of 128 rows), causal
mask:

- ``decode``: 16 requests, each one new token after a 32,767-token context,
  so each query sees 8,192 complete pools;
- ``prefill``: one request, 4,096 new tokens from an empty cache; the
  call's 1,024 pools are in the cache (the step runs first) and token ``i``
  sees ``(i + 1) // 4`` of them;
- ``prefill-16k``: the same with 16,384 new tokens (4,096 pools, about
  33.5M candidates): a long prompt, where the causal triangle's scoring
  dominates. The peers stay bounded (the twin and BLAS work in chunks of
  256 tokens: a 128 MiB score buffer).

The keys are seeded normal pooled keys quantized by the producer
(:func:`mla_kpool.index_cache.quantize_pooled_keys`) into a packed paged
cache whose pages sit in shuffled blocks; queries are seeded e4m3fn bytes
and signed head weights.

The op is timed against two NumPy peers in the same run:

- the **twin** (:func:`numpy_index_top_k`), what a user would write: decode
  the FP8 bytes with ml_dtypes, one BLAS matmul per request (in token
  chunks for a prefill), ReLU, the weighted head sum, the key scales, the
  causal mask, ``argpartition`` and a sort of the ``k`` kept;
- **BLAS** (:func:`blas_matmul`): a float32 matmul of the dense score
  shape (``[T * H, D] @ [D, pools]`` per request), NumPy's BLAS at its
  best on this work, in GFLOP/s.

The op's score GFLOP/s counts ``2 * H * D`` per visible candidate, summed
over the query tokens (:func:`score_flops`). The GPU peaks
(:data:`GPU_PEAKS`, :class:`GpuPeak`, :func:`gpu_peak`) live in
:mod:`mla_kpool.gpu_specs` and are re-exported here.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import ml_dtypes
import numpy as np

from ..gpu_specs import GPU_PEAKS, GpuPeak, gpu_peak
from ..index_cache import PagedIndexCache

__all__ = [
    "GLM5_NEXT",
    "GPU_PEAKS",
    "INDEX_PHASES",
    "GpuPeak",
    "IndexShape",
    "IndexWorkload",
    "blas_matmul",
    "bounds",
    "gpu_peak",
    "index_bytes",
    "make_index_workload",
    "numpy_index_top_k",
    "numpy_twin",
    "score_flops",
]


@dataclass(frozen=True)
class IndexShape:
    """The indexer's compile-time shape.

    Attributes:
        heads: Query heads ``H``.
        depth: Channels ``D``.
        kpool: Tokens per pool.
        top_k: Ids per query row.
        width: Cache row width ``W`` (``D // kpool``: spread; ``D``: whole).
        page_size: Rows per page.
        causal: Causal mask (else null).
    """

    heads: int = 32
    depth: int = 128
    kpool: int = 4
    top_k: int = 512
    width: int = 32
    page_size: int = 128
    causal: bool = True


#: GLM-5-Next's indexer.
GLM5_NEXT = IndexShape()

#: The benchmark's workloads: phase -> (requests, context tokens cached
#: before the call, new tokens per request).
INDEX_PHASES = {
    "decode": (16, 32 * 1024 - 1, 1),
    "prefill": (1, 0, 4096),
    "prefill-16k": (1, 0, 16384),
}


@dataclass
class IndexWorkload:
    """One index_top_k call's operands, as NumPy arrays.

    Attributes:
        shape: The indexer's shape.
        q: ``[T, H, D]`` uint8 e4m3fn bytes.
        qs: ``[T, H]`` float32 head weights.
        input_row_offsets: ``[B + 1]`` uint32.
        cache: The paged cache holding every request's pools; its
            ``cache_lengths`` are the tokens cached before the call.
        layer: The layer scored.
    """

    shape: IndexShape
    q: np.ndarray
    qs: np.ndarray
    input_row_offsets: np.ndarray
    cache: PagedIndexCache
    layer: int = 0

    @property
    def mask(self) -> str:
        """``"causal"`` or ``"null"``."""
        return "causal" if self.shape.causal else "null"

    @property
    def candidates(self) -> int:
        """Visible candidates summed over the query tokens."""
        seen = bounds(
            self.input_row_offsets,
            self.cache.cache_lengths,
            self.shape.kpool,
            self.shape.causal,
        )
        return int(seen.sum())


def make_index_workload(
    phase: str, shape: IndexShape = GLM5_NEXT, seed: int = 0
) -> IndexWorkload:
    """One call of ``phase`` (:data:`INDEX_PHASES`) at ``shape``.

    Pooled keys and queries are seeded normals: the keys quantized by the
    producer into a packed cache whose pages sit in shuffled blocks (every
    request's pages distinct), the queries rounded to e4m3fn, the head
    weights signed. A prefill's cache holds the call's own pools (the step
    runs before the indexer), which its causal rows see one by one.
    """
    requests, cached, new = INDEX_PHASES[phase]
    rng = np.random.default_rng([seed, 7])
    pools = (cached + new) // shape.kpool
    per_pool = shape.depth // shape.width
    pages = -(-pools * per_pool // shape.page_size)
    cache = PagedIndexCache(
        num_blocks=requests * pages,
        num_layers=1,
        page_size=shape.page_size,
        head_dim=shape.depth,
        kpool=shape.kpool,
        width=shape.width,
        batch=requests,
        max_pages=pages,
    )
    cache.map_pages(rng)
    cache.cache_lengths[:] = cached
    for b in range(requests):
        keys = rng.standard_normal((pools, shape.depth), np.float32)
        cache.store_keys(b, 0, 0, keys)
    tokens = requests * new
    q = rng.standard_normal((tokens, shape.heads, shape.depth), np.float32)
    qs = rng.standard_normal((tokens, shape.heads), np.float32)
    return IndexWorkload(
        shape=shape,
        q=q.astype(ml_dtypes.float8_e4m3fn).view(np.uint8),
        qs=qs,
        input_row_offsets=(np.arange(requests + 1) * new).astype(np.uint32),
        cache=cache,
    )


def bounds(
    input_row_offsets: np.ndarray,
    cache_lengths: np.ndarray,
    kpool: int,
    causal: bool,
) -> np.ndarray:
    """Candidates each query row sees: ``bound(t)``, int64 ``[T]``.

    ``(c + n - (n - 1 - i) * causal) // kpool`` for row ``i`` of a request
    with ``c`` cached and ``n`` new tokens (valid metadata assumed).
    """
    offsets = np.asarray(input_row_offsets, np.int64)
    n = np.diff(offsets)
    owner = np.repeat(np.arange(len(n)), n)
    i = np.arange(offsets[-1]) - offsets[owner]
    c = np.asarray(cache_lengths, np.int64)[owner]
    return (c + n[owner] - (n[owner] - 1 - i) * int(causal)) // kpool


def score_flops(
    input_row_offsets: np.ndarray, cache_lengths: np.ndarray, shape: IndexShape
) -> int:
    """Score flops of one call: ``2 * H * D`` per visible candidate."""
    seen = bounds(input_row_offsets, cache_lengths, shape.kpool, shape.causal)
    return 2 * int(seen.sum()) * shape.heads * shape.depth


def index_bytes(
    input_row_offsets: np.ndarray, cache_lengths: np.ndarray, shape: IndexShape
) -> int:
    """The least memory traffic of one call, in bytes.

    Each request's visible keys read once (``D`` FP8 bytes and a float32
    scale per candidate its last row sees), the FP8 queries, the float32
    head weights and the int32 output: what a scorer that reads every key
    once per request moves, a floor for any other.
    """
    seen = bounds(input_row_offsets, cache_lengths, shape.kpool, shape.causal)
    offsets = np.asarray(input_row_offsets, np.int64)
    last = offsets[1:][np.diff(offsets) > 0] - 1
    keys = int(seen[last].sum()) * (shape.depth + 4)
    tokens = int(offsets[-1])
    queries = tokens * shape.heads * (shape.depth + 4)
    return keys + queries + tokens * shape.top_k * 4


def numpy_index_top_k(
    q: np.ndarray,
    qs: np.ndarray,
    input_row_offsets: np.ndarray,
    cache_lengths: np.ndarray,
    k_blocks: np.ndarray,
    k_scales: np.ndarray,
    lookup: np.ndarray,
    scales_lookup: np.ndarray,
    *,
    layer: int,
    top_k: int,
    kpool: int,
    causal: bool,
    chunk: int = 256,
) -> np.ndarray:
    """index_top_k as a NumPy user would write it (the benchmark's twin).

    Per request: decode its keys from FP8 with ml_dtypes (spread rows
    concatenate into ``[pools, D]``), then per chunk of ``chunk`` query
    tokens one BLAS matmul ``[tokens * H, D] @ [D, pools]``, ReLU, the
    weighted head sum, the key scales, the causal mask, ``argpartition``
    for the top ``k`` and a sort of those by score. Ties at the k-th score
    fall where ``argpartition`` puts them (the set is what the op
    promises; the tests check it against the oracle).

    Valid metadata and a packed cache (``page_stride`` -1) assumed.

    Args:
        q: ``[T, H, D]`` uint8 e4m3fn bytes.
        qs: ``[T, H]`` float32 head weights.
        input_row_offsets: ``[B + 1]`` row offsets.
        cache_lengths: ``[B]`` tokens cached before the call.
        k_blocks: uint8 ``[blocks, 1, layers, page, 1, W]``.
        k_scales: float32 ``[blocks, 1, layers, page, 1, 1]``.
        lookup: ``[B, max_pages]`` key blocks.
        scales_lookup: ``[B, max_pages]`` scale blocks.
        layer: The layer.
        top_k: Ids per row.
        kpool: Tokens per pool.
        causal: Causal mask (else null).
        chunk: Query tokens per matmul (bounds the score buffer).

    Returns:
        int32 ``[T, top_k]``: ids by descending score, then -1.
    """
    tokens, heads, depth = q.shape
    queries = q.view(ml_dtypes.float8_e4m3fn).astype(np.float32)
    weights = np.asarray(qs, np.float32)
    offsets = np.asarray(input_row_offsets, np.int64)
    seen = bounds(offsets, cache_lengths, kpool, causal)
    out = np.full((tokens, top_k), -1, dtype=np.int32)
    width, page = k_blocks.shape[-1], k_blocks.shape[3]
    per_pool = depth // width
    for b in range(len(offsets) - 1):
        start, end = int(offsets[b]), int(offsets[b + 1])
        if end == start or seen[start:end].max() == 0:
            continue
        # The request's first keys and scales, decoded from the paged cache.
        rows = int(seen[start:end].max()) * per_pool
        pages = -(-rows // page)
        blocks = np.asarray(lookup[b, :pages], np.int64)
        raw = k_blocks[blocks, 0, layer, :, 0, :].reshape(-1, width)[:rows]
        keys = raw.view(ml_dtypes.float8_e4m3fn).astype(np.float32)
        keys = keys.reshape(-1, depth)
        blocks = np.asarray(scales_lookup[b, :pages], np.int64)
        scales = k_scales[blocks, 0, layer, :, 0, 0].reshape(-1)
        scales = scales[:rows:per_pool]
        for t0 in range(start, end, chunk):
            t1 = min(end, t0 + chunk)
            bound = seen[t0:t1]
            pools = int(bound.max())
            if pools == 0:
                continue
            scores = queries[t0:t1].reshape(-1, depth) @ keys[:pools].T
            np.maximum(scores, 0, out=scores)
            scores = scores.reshape(t1 - t0, heads, pools)
            total = np.matmul(weights[t0:t1, None, :], scores)[:, 0, :]
            total *= scales[:pools]
            total[np.arange(pools)[None, :] >= bound[:, None]] = -np.inf
            kept = min(top_k, pools)
            if pools > kept:
                ids = np.argpartition(-total, kept - 1, axis=1)[:, :kept]
            else:
                ids = np.broadcast_to(np.arange(pools), (t1 - t0, pools))
            best = np.take_along_axis(total, ids, axis=1)
            order = np.argsort(-best, axis=1, kind="stable")
            ids = np.take_along_axis(ids, order, axis=1).astype(np.int32)
            ids[np.take_along_axis(best, order, axis=1) == -np.inf] = -1
            out[t0:t1, :kept] = ids
    return out


def numpy_twin(w: IndexWorkload) -> Callable[[], np.ndarray]:
    """A zero-argument callable running :func:`numpy_index_top_k` on ``w``."""
    cache = w.cache
    return functools.partial(
        numpy_index_top_k,
        w.q,
        w.qs,
        w.input_row_offsets,
        cache.cache_lengths,
        cache.blocks(),
        cache.scales(),
        cache.lookup_table,
        cache.scales_lookup_table,
        layer=w.layer,
        top_k=w.shape.top_k,
        kpool=w.shape.kpool,
        causal=w.shape.causal,
    )


def blas_matmul(
    input_row_offsets: np.ndarray,
    cache_lengths: np.ndarray,
    shape: IndexShape,
    *,
    chunk: int = 256,
    seed: int = 0,
) -> tuple[Callable[[], object], int]:
    """NumPy's BLAS on the twin's score matmuls alone, float32.

    The matmuls :func:`numpy_index_top_k` makes, with the same shapes: per
    request and chunk of ``chunk`` query tokens, ``[tokens * H, D] @ [D,
    pools]`` with ``pools`` the most candidates a row of the chunk sees,
    into preallocated outputs; no FP8 decode, mask or selection. Its
    GFLOP/s is what NumPy's BLAS reaches on this work.

    Returns:
        ``(call, flops)``: a zero-argument callable and the flops of one
        call.
    """
    rng = np.random.default_rng(seed)
    offsets = np.asarray(input_row_offsets, np.int64)
    seen = bounds(offsets, cache_lengths, shape.kpool, shape.causal)
    shapes = []
    for start, end in zip(offsets[:-1], offsets[1:], strict=True):
        for t0 in range(int(start), int(end), chunk):
            t1 = min(int(end), t0 + chunk)
            pools = int(seen[t0:t1].max())
            if pools:
                shapes.append(((t1 - t0) * shape.heads, pools))
    d = shape.depth
    # Operands of their own per matmul (as the twin's requests have their
    # own keys); one output buffer, viewed at each shape.
    operands = [
        (
            rng.standard_normal((rows, d), np.float32),
            rng.standard_normal((d, pools), np.float32),
        )
        for rows, pools in shapes
    ]
    buffer = np.empty(max((r * p for r, p in shapes), default=0), np.float32)
    flops = sum(2 * rows * d * pools for rows, pools in shapes)

    def call() -> None:
        for a, b in operands:
            size = a.shape[0] * b.shape[1]
            np.matmul(a, b, out=buffer[:size].reshape(a.shape[0], -1))

    return call, flops

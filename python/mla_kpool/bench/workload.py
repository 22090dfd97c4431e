"""What the benchmark times: each op's workload, its bytes and its NumPy twin.

Workloads (per request, ``r = kpool // 2``): ``ring_close`` closes one pool
with ``r`` members in the ring and ``kpool - r`` new tokens; ``compress``
builds one pool from ``kpool`` new tokens; ``seed_tail`` stashes
``kpool - 1`` new tokens; the step brings ``2 * kpool`` tokens to a request
with ``r`` pending (ring_close closes one pool, compress builds one,
seed_tail stashes ``r``), as the fused ``mla_kpool.step`` op (``step``) or
the three writers and the offsets helper (``step3``); ``expand_topk``
expands one query per request (a decode step) that selected
:func:`expand_pool_topk` distinct complete pools (512 at kpool 4,
GLM-5-Next's shape), on int32 ``pool_ids`` and no keys.

The NumPy twin of each op is the vectorised float32 code a user would
write instead of the op (valid metadata assumed); the tests check it
against the oracle, so its time is that of the same work.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
from max.dtype import DType

from ..buffers import to_numpy_dtype

OPS = ("ring_close", "compress", "seed_tail", "step", "step3", "expand_topk")
#: The indexer op: its own workloads, peers and table (:mod:`.index`).
INDEX_OP = "index_top_k"
#: The dtype an index_top_k case names: that of ``q`` and the key cache.
INDEX_DTYPE = "float8_e4m3fn"
#: The dtype of an expand_topk case: that of ``pool_ids`` (MAX's int32).
EXPAND_DTYPE = "int32"
#: Positions an expand_topk row selects: GLM-5-Next's 512 pools of 4.
EXPAND_POSITIONS = 2048


@dataclass(frozen=True)
class Case:
    """One benchmark configuration.

    ``phase`` is a key of ``index.INDEX_PHASES`` (``"decode"``,
    ``"prefill"``, ``"prefill-16k"``) for index_top_k (whose ``batch`` is
    its requests and ``head_dim`` its depth ``D``), empty for the other
    ops.
    """

    op: str
    dtype: str
    batch: int
    kpool: int
    head_dim: int
    device: str
    phase: str = ""
    scorer: str = ""


@dataclass
class Workload:
    """One call's inputs (NumPy) for a :class:`Case`, by operand name.

    ``tail`` is the ring's contents ``[batch, 2, kpool, head_dim]`` (empty
    for expand_topk), ``pool_ids`` ``[batch, topk]`` int32 (expand_topk
    only); the rest are the ops' operands of the same names.
    """

    tail: np.ndarray
    k: np.ndarray
    gate: np.ndarray
    ape: np.ndarray
    input_row_offsets: np.ndarray
    cache_lengths: np.ndarray
    slot_idx: np.ndarray
    pool_row_offsets: np.ndarray
    pool_ids: np.ndarray | None = None


def expand_pool_topk(kpool: int) -> int:
    """Pool ids an expand_topk query selects: ``2048 // kpool``, at least 1."""
    return max(1, EXPAND_POSITIONS // kpool)


def tokens_per_request(op: str, kpool: int) -> tuple[int, int]:
    """``(pending ring members r, new tokens n)`` per request for ``op``."""
    r = kpool // 2
    special = {
        "ring_close": (r, kpool - r),
        "compress": (0, kpool),
        "seed_tail": (0, kpool - 1),
        "expand_topk": (r, 1),
    }
    return special.get(op, (r, 2 * kpool))


def numpy_dtype(name: str) -> np.dtype:
    """NumPy dtype (``ml_dtypes.bfloat16`` included) for a dtype name."""
    return to_numpy_dtype(getattr(DType, name))


def make_workload(case: Case, seed: int = 0) -> Workload:
    """Builds the inputs of one call of ``case`` (see the module docstring).

    Requests sit at pool ids 1000 + b (expand_topk: at least its top-k
    count + b, so every query has that many complete pools to choose
    from) and use a shuffled slot each, so slots are not the batch index.
    """
    rng = np.random.default_rng(seed)
    dtype = numpy_dtype(case.dtype)
    r, n = tokens_per_request(case.op, case.kpool)
    batch, kpool, hd = case.batch, case.kpool, case.head_dim
    expand = case.op == "expand_topk"
    base = max(1000, expand_pool_topk(kpool)) if expand else 1000
    cache = (base + np.arange(batch, dtype=np.int64)) * kpool + r
    counts = np.maximum((cache + n) // kpool - -(-cache // kpool), 0)
    slots = 0 if expand else batch
    rows = slots * n
    w = Workload(
        tail=rng.standard_normal((slots, 2, kpool, hd)).astype(dtype),
        k=rng.standard_normal((rows, hd)).astype(dtype),
        gate=(4 * rng.standard_normal((rows, hd))).astype(dtype),
        ape=rng.standard_normal((kpool, hd)).astype(np.float32),
        input_row_offsets=(np.arange(batch + 1) * n).astype(np.uint32),
        cache_lengths=cache.astype(np.uint32),
        slot_idx=rng.permutation(batch).astype(np.uint32),
        pool_row_offsets=np.append(0, np.cumsum(counts)).astype(np.uint32),
    )
    if expand:
        # Each query selects distinct complete pools among `base`, in a
        # random order (as an indexer's top-k comes out).
        topk = expand_pool_topk(kpool)
        keys = rng.random((batch, base))
        ids = np.argpartition(keys, topk - 1, axis=1)[:, :topk]
        w.pool_ids = rng.permuted(ids, axis=1).astype(np.int32)
    return w


def op_bytes(case: Case) -> int:
    """Bytes ``case.op`` must read plus write for its workload.

    Ring members read, rows of ``k`` and ``gate`` read, ``ape``, the pooled
    rows and ``closed_pool`` written (``compress`` writes every output row:
    rows past the last pool are zeroed), ring rows written by ``seed_tail``;
    for ``expand_topk`` the int32 ``pool_ids`` read and every int32 output
    column written. Index operands are left out (a few bytes per request).
    """
    batch, kpool = case.batch, case.kpool
    row = case.head_dim * numpy_dtype(case.dtype).itemsize
    ape = kpool * case.head_dim * 4
    r, n = tokens_per_request(case.op, kpool)
    if case.op == "expand_topk":
        topk = expand_pool_topk(kpool)
        return batch * n * 4 * (topk + topk * kpool + kpool - 1)
    close = batch * (2 * r * row + 2 * (kpool - r) * row + row + 4) + ape
    if case.op == "ring_close":
        return close
    if case.op == "compress":
        return batch * (2 * n * row + row) + ape
    if case.op == "seed_tail":
        return batch * (2 * n * row) * 2
    build = batch * 2 * kpool * row + (batch * n) // kpool * row
    return close + build + batch * 2 * r * row * 2


def _pool_np(
    keys: np.ndarray, gates: np.ndarray, ape: np.ndarray
) -> np.ndarray:
    """Pools ``[pools, kpool, head_dim]`` members in float32."""
    score = gates.astype(np.float32) + ape
    weight = np.exp(score - score.max(axis=1, keepdims=True))
    return (weight * keys.astype(np.float32)).sum(axis=1) / weight.sum(axis=1)


def _requests(w: Workload) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per request: cache length, first new row and new tokens (int64)."""
    c = w.cache_lengths.astype(np.int64)
    start = w.input_row_offsets[:-1].astype(np.int64)
    return c, start, w.input_row_offsets[1:].astype(np.int64) - start


def numpy_ring_close(w: Workload, kpool: int) -> tuple[np.ndarray, np.ndarray]:
    """Vectorised ring_close: ``(pooled [batch, head_dim], closed_pool)``."""
    c, start, n = _requests(w)
    r, p = c % kpool, c // kpool
    closes = (r > 0) & (c + n >= (p + 1) * kpool)
    q = np.arange(kpool)
    from_ring = (q[None, :] < r[:, None])[..., None]
    ring_idx = (p[:, None] * kpool + q[None, :]) % w.tail.shape[2]
    rows = np.clip(start[:, None] + q[None, :] - r[:, None], 0, len(w.k) - 1)
    # [batch, kpool, 2, head_dim]: each request's members, keys and gates.
    ring = w.tail[w.slot_idx.astype(np.int64)[:, None], :, ring_idx]
    keys = np.where(from_ring, ring[..., 0, :], w.k[rows])
    gates = np.where(from_ring, ring[..., 1, :], w.gate[rows])
    pooled = _pool_np(keys, gates, w.ape)
    pooled[~closes] = 0
    closed = np.where(closes, p, -1).astype(np.int32)
    return pooled.astype(w.k.dtype), closed


def numpy_compress(w: Workload, kpool: int) -> np.ndarray:
    """Vectorised compress: ``[tokens // kpool, head_dim]`` pooled rows."""
    c, start, _ = _requests(w)
    offsets = w.pool_row_offsets.astype(np.int64)
    out = np.zeros((len(w.k) // kpool, w.k.shape[1]), dtype=w.k.dtype)
    owner = np.repeat(np.arange(len(c)), np.diff(offsets))
    j = np.arange(offsets[-1]) - offsets[owner]
    first_row = start[owner] + (-(-c[owner] // kpool) + j) * kpool - c[owner]
    rows = first_row[:, None] + np.arange(kpool)[None, :]
    out[: offsets[-1]] = _pool_np(w.k[rows], w.gate[rows], w.ape)
    return out


def numpy_seed_tail(w: Workload, kpool: int, ring: np.ndarray) -> None:
    """Vectorised seed_tail, in place on ``ring`` (shaped like ``w.tail``)."""
    c, start, n = _requests(w)
    ring_len = ring.shape[2]
    lo = np.maximum(c, ((c + n) // kpool) * kpool - (ring_len - kpool))
    count = np.maximum(c + n - lo, 0)
    req = np.repeat(np.arange(len(c)), count)
    before = np.repeat(np.cumsum(count) - count, count)
    pos = lo[req] + np.arange(count.sum()) - before
    src = start[req] + pos - c[req]
    slot = w.slot_idx.astype(np.int64)[req]
    ring[slot, 0, pos % ring_len] = w.k[src]
    ring[slot, 1, pos % ring_len] = w.gate[src]


def numpy_expand_topk(w: Workload, kpool: int) -> np.ndarray:
    """Vectorised expand_topk with the tail: int32 positions per row.

    Valid metadata: ``input_row_offsets`` starts at 0, never decreases
    and ends at most at the row count; every ``visible`` fits int32.
    """
    assert w.pool_ids is not None
    ids = w.pool_ids.astype(np.int64)
    rows, topk = ids.shape
    offsets = w.input_row_offsets.astype(np.int64)
    cache = w.cache_lengths.astype(np.int64)
    out = np.full((rows, topk * kpool + kpool - 1), -1, dtype=np.int32)
    owned = int(offsets[-1])
    owner = np.repeat(np.arange(len(cache)), np.diff(offsets))
    visible = cache[owner] + np.arange(owned) - offsets[owner] + 1
    ids = ids[:owned]
    valid = (ids >= 0) & ((ids + 1) * kpool <= visible[:, None])
    pools = valid.sum(axis=1)
    # Valid ids first, in selection order; each widens into kpool columns.
    order = np.argsort(~valid, axis=1, kind="stable")
    packed = np.take_along_axis(ids, order, axis=1)
    packed[np.arange(topk)[None, :] >= pools[:, None]] = -1
    expanded = packed[:, :, None] * kpool + np.arange(kpool)
    expanded[packed < 0] = -1
    out[:owned, : topk * kpool] = expanded.reshape(owned, topk * kpool)
    filling = visible % kpool
    for m in range(kpool - 1):
        has = np.flatnonzero(m < filling)
        out[has, pools[has] * kpool + m] = visible[has] - filling[has] + m
    return out


def numpy_call(case: Case, w: Workload) -> Callable[[], object]:
    """A zero-argument callable running the NumPy twin of ``case.op``.

    Both step paths run the three twins; seed_tail writes a copy of the
    ring.
    """
    ring = w.tail.copy()
    twins: dict[str, Callable[[], object]] = {
        "expand_topk": lambda: numpy_expand_topk(w, case.kpool),
        "ring_close": lambda: numpy_ring_close(w, case.kpool),
        "compress": lambda: numpy_compress(w, case.kpool),
        "seed_tail": lambda: numpy_seed_tail(w, case.kpool, ring),
    }
    step = [twins["ring_close"], twins["compress"], twins["seed_tail"]]
    return twins.get(case.op, lambda: [twin() for twin in step])

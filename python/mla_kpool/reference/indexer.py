"""index_top_k: score every visible pooled key, keep each token row's top k.

Written from the contract in docs/ops.md (section "index_top_k"), never from
the kernel. For token row ``t`` of request ``b`` and candidate ``j``::

    score[t, j] = k_scale[j] * sum_h max(sum_d q[t,h,d] * k[j,d], 0) * q_s[t,h]
    bound(t)    = (c + n - (n - 1 - i) * causal) // kpool,   j in [0, bound)

with ``c = k_cache_lengths[b]``, ``n`` the request's new tokens and ``i =
t - input_row_offsets[b]``. FP8 bytes decode exactly (ml_dtypes) and every
product of two e4m3fn values is exact in float64; the sums here are float64.
NaN propagates through the ReLU (``np.maximum``), and a NaN score ranks
below every number.

Output row ``t``: ``m = min(k, bound)`` distinct ids by descending score,
ties by ascending id, then ``-1``.

Metadata is not trusted: requests are scored while ``input_row_offsets``
is well formed (``off[0] == 0``, then non-decreasing and at most ``T``); from
the first bad offset on, every row is ``-1``. A request whose cache length
reads negative, or any of whose rows needs a page with a key or scale lookup
entry past its arena (or past the table's width), is ``-1`` too. A
``layer_idx`` past the cache's layers raises, as the op does.

Tolerance (:func:`index_tolerance`): the kernel accumulates in float32. The
products ``q * k`` of two e4m3fn values (4 significant bits each) are exact;
the dot over ``D`` terms adds at most ``D - 1`` roundings, the ReLU none,
the ``q_s`` product one, the head sum ``H - 1`` and the scale one: ``D + H``
roundings of unit ``2^-24``, each bounded by the magnitude ``mag_j = |scale_j|
* sum_h |q_s_h| * sum_d |q_hd k_jd|`` that every partial result stays under,
in any summation order. Four more units cover second-order terms (``(D + H)
* 2^-24 < 2^-11``) and the float64 oracle's own rounding, so ``tol_j = (D + H
+ 4) * 2^-24 * mag_j``, plus ``(H + 4) * 2^-126`` for float32 underflow.

The tensor-core scorer (``scorer="wgmma"``) sums each head's dot on
Hopper's FP8 ``wgmma``, 32 products per instruction, whose adder keeps 13
fraction bits and truncates (DeepSeek-V3 technical report; the bit-level
model of microsoft/MMA-Sim, arXiv 2511.10909). Model: each of an
instruction's at most 33 addends (32 products and the accumulator) loses
less than ``2^-13`` of the largest addend, which is at most the head's
``sum_d |q_hd k_jd|``. Over ``ceil(D / 32)`` instructions a head's dot is
off by less than ``33 * ceil(D / 32) * 2^-13`` of that sum, and weighting
and summing the heads and scaling keep the bound in units of ``mag_j``: the
float32 tolerance plus ``33 * ceil(D / 32) * 2^-13 * mag_j``
(:data:`TENSOR_CORE_MODELS`). The MI300 scorer (``scorer="mfma"``) feeds
CDNA3's FP8 MFMA, which sums each instruction's products in two groups of
16, rounds each group down to float32 and adds it to the accumulator
(MMA-Sim's model): 3 roundings of at most ``2^-23`` per instruction (the
two group sums, then their sum with the accumulator; should the groups be
added to the accumulator one after the other, the fourth rounding is
within the float32 term's margin), so ``3 * ceil(D / 32) * 2^-23 * mag_j``
more.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

import ml_dtypes
import numpy as np

from .._limits import MAX_TOP_K
from .._renamed import renamed_keyword
from ._checks import _check_kpool, _index_values, _offsets_ok

#: Float32 unit roundoff, the kernel's accumulation precision.
UNIT = 2.0**-24
#: Per tensor scorer, ``(roundings, unit)`` of one 32-deep instruction:
#: each of that many roundings errs by less than ``unit`` of the head's
#: ``sum_d |q k|`` (module docs).
TENSOR_CORE_MODELS = {
    # Hopper FP8 wgmma: 32 products and the accumulator aligned to the
    # largest and truncated to 13 fraction bits.
    "wgmma": (33, 2.0**-13),
    # CDNA3 FP8 MFMA: two groups of 16 products summed, each rounded down
    # to float32, then added to the accumulator.
    "mfma": (3, 2.0**-23),
}
#: The error models :func:`index_tolerance` knows, by scorer.
ERROR_MODELS = ("simt", *TENSOR_CORE_MODELS)
#: Smallest normal float32: an absolute floor for underflow.
TINY = 2.0**-126
#: Rows of scores computed at once (bounds the oracle's memory).
_CHUNK_ELEMENTS = 1 << 22


def decode_fp8(values: np.ndarray) -> np.ndarray:
    """e4m3fn bytes (``uint8``) or ``float8_e4m3fn`` -> exact float64."""
    arr = np.asarray(values)
    if arr.dtype == np.uint8:
        arr = arr.view(ml_dtypes.float8_e4m3fn)
    elif arr.dtype != np.dtype(ml_dtypes.float8_e4m3fn):
        raise ValueError(
            f"FP8 operands must be uint8 bytes or float8_e4m3fn, got"
            f" {arr.dtype}"
        )
    return arr.astype(np.float64)


def mask_name(mask: object, argument: str = "mask") -> str:
    """The indexer's mask as ``"causal"`` or ``"null"``.

    Every entry point takes both spellings: the op's strings and MAX's
    ``MHAMaskVariant.CAUSAL_MASK`` / ``NULL_MASK`` (read by member name, so
    this module needs no ``max.nn`` import).

    Args:
        mask: ``"causal"``, ``"null"`` or one of those two variants.
        argument: The argument's name, for the message.

    Returns:
        ``"causal"`` or ``"null"``.

    Raises:
        ValueError: For anything else, naming ``argument``.
    """
    name = mask.name if isinstance(mask, Enum) else mask
    if name in ("causal", "CAUSAL_MASK"):
        return "causal"
    if name in ("null", "NULL_MASK"):
        return "null"
    raise ValueError(
        f"{argument} must be 'causal', 'null', MHAMaskVariant.CAUSAL_MASK or"
        f" MHAMaskVariant.NULL_MASK, got {mask!r}"
    )


def is_causal(mask: object) -> bool:
    """Whether ``mask`` (as :func:`mask_name` takes it) is the causal one."""
    return mask_name(mask) == "causal"


def index_tolerance(
    mag: np.ndarray, num_heads: int, depth: int, scorer: str = "simt"
) -> np.ndarray:
    """Largest error of a score of magnitude ``mag`` (module docs).

    Args:
        mag: The scores' error magnitudes ``mag_j``.
        num_heads: ``H``.
        depth: ``D``.
        scorer: ``"simt"`` (float32 FMAs), ``"wgmma"`` or ``"mfma"``
            (FP8 tensor cores, :data:`TENSOR_CORE_MODELS`): the scorer
            that ran (``"auto"`` is a choice, not a model).

    Raises:
        TypeError: If ``scorer`` is not a string.
        ValueError: For another scorer name (``"auto"`` included: name
            the scorer it chose, ``"simt"`` on the CPU and the emulated
            grid, the tensor scorer of an sm_90 or gfx942 GPU).
    """
    if not isinstance(scorer, str):
        raise TypeError(f"scorer must be a str, got {type(scorer).__name__}")
    if scorer not in ERROR_MODELS:
        hint = (
            "; name the scorer 'auto' chose: 'simt' on the CPU and the"
            " emulated grid, 'wgmma' on sm_90, 'mfma' on gfx942"
            if scorer == "auto"
            else ""
        )
        raise ValueError(
            f"scorer must be one of {', '.join(ERROR_MODELS)}, got"
            f" {scorer!r}{hint}"
        )
    tol = (depth + num_heads + 4) * UNIT * mag + (num_heads + 4) * TINY
    if scorer == "simt":
        return tol
    roundings, unit = TENSOR_CORE_MODELS[scorer]
    steps = -(-depth // 32)
    return tol + roundings * steps * unit * mag


@dataclass(frozen=True)
class RowScores:
    """One token row's candidates, as the oracle scores them.

    Attributes:
        request: The request that owns the row.
        bound: Visible candidates, ids ``[0, bound)``.
        scores: float64 ``[bound]`` exact scores (NaN where garbage).
        mag: float64 ``[bound]`` the magnitude bounding float32 error.
        tol: float64 ``[bound]`` the tolerance (:func:`index_tolerance`).
    """

    request: int
    bound: int
    scores: np.ndarray
    mag: np.ndarray
    tol: np.ndarray


@dataclass(frozen=True)
class _Plan:
    """What row ``t`` may hold: ``answers`` (request, bound) or all -1."""

    answers: tuple[tuple[int, int], ...]
    may_be_empty: bool


def _layout(depth: int, width: int, kpool: int) -> bool:
    """Whether the cache is spread (pool over ``kpool`` rows); checks W."""
    if width == depth:
        return False
    if kpool > 1 and depth % kpool == 0 and width == depth // kpool:
        return True
    raise ValueError(
        f"k_blocks row width must be depth={depth} or depth/kpool, got {width}"
        f" (kpool={kpool})"
    )


class _Inputs:
    """The operands, checked and decoded once."""

    def __init__(
        self, q, q_s, input_row_offsets, k_blocks, k_cache_lengths,
        k_lookup_table, k_scales, k_scales_lookup_table, layer_idx,
        top_k, kpool, mask,
    ) -> None:  # fmt: skip
        self.scorer = "simt"  # the error model (index_tolerance)
        self.q = decode_fp8(q)
        if self.q.ndim != 3:
            raise ValueError(f"q must be [T, H, D], got {self.q.shape}")
        self.tokens, self.heads, self.depth = self.q.shape
        self.q_s = np.asarray(q_s, dtype=np.float64)
        if self.q_s.shape != (self.tokens, self.heads):
            raise ValueError(f"q_s must be [T, H], got {self.q_s.shape}")
        self.blocks = np.asarray(k_blocks)
        self.scales = np.asarray(k_scales, dtype=np.float64)
        if self.blocks.ndim != 6 or self.blocks.shape[1] != 1:
            raise ValueError(
                f"k_blocks must be rank 6, got {self.blocks.shape}"
            )
        if self.scales.ndim != 6 or self.scales.shape[-1] != 1:
            raise ValueError(
                f"k_scales must be rank 6, got {self.scales.shape}"
            )
        self.layers, self.page = self.blocks.shape[2], self.blocks.shape[3]
        self.spread = _layout(self.depth, self.blocks.shape[5], kpool)
        self.offsets = _index_values("input_row_offsets", input_row_offsets)
        self.cache = _index_values("k_cache_lengths", k_cache_lengths)
        self.lookup = np.asarray(k_lookup_table).astype(np.int64)
        self.slookup = np.asarray(k_scales_lookup_table).astype(np.int64)
        batch = len(self.cache)
        if len(self.offsets) != batch + 1:
            raise ValueError(
                f"input_row_offsets must have batch + 1 = {batch + 1} entries"
            )
        for name, table in (("k", self.lookup), ("k_scales", self.slookup)):
            if table.ndim != 2 or table.shape[0] != batch:
                raise ValueError(
                    f"{name} lookup table must be [batch, pages], got"
                    f" {table.shape}"
                )
        if not 1 <= top_k <= MAX_TOP_K:
            raise ValueError(f"top_k must be in 1..{MAX_TOP_K}, got {top_k}")
        self.top_k = int(top_k)
        self.kpool = _check_kpool(kpool)
        self.causal = is_causal(mask)
        self.layer = int(layer_idx)
        if not 0 <= self.layer < self.layers:
            # The op raises too: a layer is a graph's constant, not data.
            raise ValueError(
                f"layer_idx={self.layer} is past the cache's {self.layers}"
                " layers"
            )

    def bound(self, b: int, i: int) -> int:
        c, n = self.cache[b], self.offsets[b + 1] - self.offsets[b]
        return (c + n - (n - 1 - i) * self.causal) // self.kpool

    def readable(self, b: int) -> int:
        """Candidates of request ``b`` before its first unreadable page."""
        pages = min(self.lookup.shape[1], self.slookup.shape[1])
        bad = (self.lookup[b, :pages] >= self.blocks.shape[0]) | (
            self.slookup[b, :pages] >= self.scales.shape[0]
        )
        bad |= (self.lookup[b, :pages] < 0) | (self.slookup[b, :pages] < 0)
        first_bad = int(np.argmax(bad)) if bad.any() else pages
        rows = first_bad * self.page
        return rows // self.kpool if self.spread else rows

    def plans(self) -> list[_Plan]:
        """Per token row, the answer the contract gives.

        Requests are scored while the offsets are well formed (the first
        is 0, then non-decreasing and at most ``T``); from the first bad
        offset on, nothing. A scored request is skipped when its cache
        length is negative or a page its rows need is unreadable.
        """
        plans = [_Plan((), True) for _ in range(self.tokens)]
        offsets = self.offsets
        if not offsets or offsets[0] != 0:
            return plans
        for b in range(len(self.cache)):
            start, end = offsets[b], offsets[b + 1]
            if not _offsets_ok(start, end, self.tokens):
                break
            if self.cache[b] < 0:
                continue
            bounds = [self.bound(b, i) for i in range(end - start)]
            if bounds and max(bounds) > self.readable(b):
                continue
            for i, bd in enumerate(bounds):
                plans[start + i] = _Plan(((b, bd),), False)
        return plans

    def keys(self, b: int, count: int) -> tuple[np.ndarray, np.ndarray]:
        """Request ``b``'s first ``count`` keys ``[count, D]`` and scales."""
        kp = self.kpool if self.spread else 1
        rows = np.arange(count * kp)
        page, slot = rows // self.page, rows % self.page
        blocks = self.lookup[b, page]
        data = self.blocks[blocks, 0, self.layer, slot, 0, :]
        keys = decode_fp8(data).reshape(count, self.depth)
        first = rows[::kp]
        sblocks = self.slookup[b, first // self.page]
        scales = self.scales[sblocks, 0, self.layer, first % self.page, 0, 0]
        return keys, scales


def _scores(
    inp: _Inputs, rows: list[int], keys: np.ndarray, scales: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """Scores and magnitudes ``[len(rows), J]`` of token ``rows``.

    The dots are one BLAS matmul (exact: products of two e4m3fn values and
    their sums over ``D`` fit float64's mantissa); NaN survives
    ``np.maximum``.
    """
    q = inp.q[rows]  # [n, H, D]
    n, heads, depth = q.shape
    dots = (q.reshape(-1, depth) @ keys.T).reshape(n, heads, -1)
    mag_dots = (np.abs(q).reshape(-1, depth) @ np.abs(keys).T).reshape(
        n, heads, -1
    )
    q_s = inp.q_s[rows]  # [n, H]
    weighted = np.zeros(dots.shape[::2])
    mag = np.zeros(dots.shape[::2])
    with np.errstate(invalid="ignore"):
        # Head by head, so every candidate's sum runs in the same order and
        # identical keys score identically (exact ties stay exact).
        for h in range(heads):
            weighted += q_s[:, h, None] * np.maximum(dots[:, h], 0.0)
            mag += np.abs(q_s[:, h, None]) * mag_dots[:, h]
        return scales * weighted, np.abs(scales) * mag


def _scored_chunks(inp: _Inputs, plans: list[_Plan]):
    """Yields ``(request, rows, score, mag)`` over every allowed answer.

    ``rows`` is a list of ``(t, bound)`` of one request; ``score`` and
    ``mag`` are float64 ``[len(rows), width]`` with ``width`` the largest
    bound among them (columns past a row's own bound are not its
    candidates). Chunks hold at most about ``_CHUNK_ELEMENTS`` products.
    """
    by_request: dict[int, list[tuple[int, int]]] = {}
    for t, plan in enumerate(plans):
        for b, bd in plan.answers:
            by_request.setdefault(b, []).append((t, bd))
    for b, rows in by_request.items():
        count = max(bd for _, bd in rows)
        keys, scales = inp.keys(b, count)
        step = max(1, _CHUNK_ELEMENTS // max(1, inp.heads * count))
        for first in range(0, len(rows), step):
            part = rows[first : first + step]
            width = max(bd for _, bd in part)
            score, mag = _scores(
                inp, [t for t, _ in part], keys[:width], scales[:width]
            )
            yield b, part, score, mag


def _row_scores(inp: _Inputs, plans: list[_Plan]) -> list[dict]:
    """Per row, ``{(request, bound): RowScores}`` for each allowed answer."""
    out: list[dict] = [{} for _ in plans]
    for b, part, score, mag in _scored_chunks(inp, plans):
        for i, (t, bd) in enumerate(part):
            out[t][(b, bd)] = _row(inp, b, bd, score[i], mag[i])
    return out


def _row(
    inp: _Inputs, b: int, bound: int, score: np.ndarray, mag: np.ndarray
) -> RowScores:
    """One row's :class:`RowScores` from its (possibly wider) score row."""
    tol = index_tolerance(mag[:bound], inp.heads, inp.depth, inp.scorer)
    return RowScores(b, bound, score[:bound], mag[:bound], tol)


def _order(scores: np.ndarray) -> np.ndarray:
    """Ids by descending score, NaN last, ties by ascending id."""
    nan = np.isnan(scores)
    filled = np.where(nan, 0.0, scores)
    return np.lexsort((np.arange(len(scores)), -filled, nan))


@renamed_keyword("qs", "q_s")
def index_scores(  # noqa: D417 (the operands are index_top_k's)
    q: np.ndarray,
    q_s: np.ndarray,
    input_row_offsets: np.ndarray,
    k_blocks: np.ndarray,
    k_cache_lengths: np.ndarray,
    k_lookup_table: np.ndarray,
    k_scales: np.ndarray,
    k_scales_lookup_table: np.ndarray,
    layer_idx: int,
    *,
    top_k: int,
    kpool: int = 1,
    mask: object = "causal",
    scorer: str = "simt",
) -> list[RowScores | None]:
    """Every token row's candidate scores and error magnitudes.

    Args:
        q, q_s, input_row_offsets, k_blocks, k_cache_lengths, k_lookup_table,
        k_scales, k_scales_lookup_table, layer_idx, top_k, kpool, mask: As
            for :func:`index_top_k`.
        scorer: The error model of the scorer that ran
            (:func:`index_tolerance`).

    Returns:
        Per token row, its :class:`RowScores`, or ``None`` for a row that
        is all ``-1``.
    """
    inp = _Inputs(
        q, q_s, input_row_offsets, k_blocks, k_cache_lengths, k_lookup_table,
        k_scales, k_scales_lookup_table, layer_idx, top_k, kpool, mask,
    )  # fmt: skip
    inp.scorer = scorer
    plans = inp.plans()
    scored = _row_scores(inp, plans)
    rows: list[RowScores | None] = []
    for plan, by_answer in zip(plans, scored, strict=True):
        rows.append(by_answer[plan.answers[-1]] if plan.answers else None)
    return rows


@renamed_keyword("qs", "q_s")
def index_top_k(
    q: np.ndarray,
    q_s: np.ndarray,
    input_row_offsets: np.ndarray,
    k_blocks: np.ndarray,
    k_cache_lengths: np.ndarray,
    k_lookup_table: np.ndarray,
    k_scales: np.ndarray,
    k_scales_lookup_table: np.ndarray,
    layer_idx: int,
    *,
    top_k: int,
    kpool: int = 1,
    mask: object = "causal",
) -> np.ndarray:
    """The op's output, deterministic: the contract's order.

    Args:
        q: ``[T, H, D]`` uint8 e4m3fn bytes (or ``float8_e4m3fn``).
        q_s: ``[T, H]`` float32 per (token, head) weights, signed (``qs=``,
            its former keyword, still works for a release, with a
            ``DeprecationWarning``).
        input_row_offsets: ``[B + 1]`` integer.
        k_blocks: ``[num_blocks, 1, num_layers, page_size, 1, W]`` uint8 (or
            ``float8_e4m3fn``): the *logical* blocks (a padded arena's
            blocks without their padding, ``PagedIndexCache.blocks()``).
        k_cache_lengths: ``[B]`` tokens cached before this call.
        k_lookup_table: ``[B, max_pages]`` (request, page) -> block.
        k_scales: ``[num_scale_blocks, 1, num_layers, page_size, 1, 1]`` f32.
        k_scales_lookup_table: ``[B, max_pages]`` -> scale block.
        layer_idx: The layer to read.
        top_k: Slots per row, 1..2048.
        kpool: Tokens per pooled key; ``W`` picks the layout (``D`` whole,
            ``D / kpool`` spread).
        mask: ``"causal"`` or ``"null"`` (or an ``MHAMaskVariant``).

    Returns:
        int32 ``[T, top_k]``.

    Raises:
        TypeError, ValueError: On structurally wrong operands (rank, dtype,
            shape, ``top_k``, ``kpool``, ``W``, mask) or a ``layer_idx`` past
            the cache's layers, or both ``q_s`` and ``qs``; bad metadata
            *values* give ``-1`` rows instead.
    """
    inp = _Inputs(
        q, q_s, input_row_offsets, k_blocks, k_cache_lengths, k_lookup_table,
        k_scales, k_scales_lookup_table, layer_idx, top_k, kpool, mask,
    )  # fmt: skip
    plans = inp.plans()
    scored = _row_scores(inp, plans)
    out = np.full((inp.tokens, inp.top_k), -1, dtype=np.int32)
    for t, (plan, by_answer) in enumerate(zip(plans, scored, strict=True)):
        if plan.answers:
            row = by_answer[plan.answers[-1]]
            ids = _order(row.scores)[: inp.top_k]
            out[t, : len(ids)] = ids
    return out


@dataclass(frozen=True)
class SelectionReport:
    """What :func:`check_selection` checked.

    Attributes:
        rows: Token rows checked.
        cut_rows: Rows with more visible candidates than ``top_k`` (where a
            selection was actually made).
        worst_margin: Smallest ``min_selected(score + tol) -
            max_unselected(score - tol)`` over the cut rows, in score units
            (``inf`` when none); never negative for a passing check.
        worst_row: The row of ``worst_margin`` (-1 when none).
    """

    rows: int
    cut_rows: int
    worst_margin: float
    worst_row: int


def _check_row(got: np.ndarray, row: RowScores, k: int) -> float | str:
    """The row's margin, or why it is wrong."""
    m = min(k, row.bound)
    ids = got[:m].astype(np.int64)
    if np.any(got[m:] != -1):
        return f"slots {m}.. must be -1 (m = min(k, bound={row.bound}))"
    if np.any((ids < 0) | (ids >= row.bound)):
        return f"ids must be in [0, {row.bound}), got {ids.tolist()[:16]}..."
    if len(np.unique(ids)) != m:
        return "ids repeat"
    nan = np.isnan(row.scores)
    hi = np.where(nan, -np.inf, row.scores + row.tol)
    lo = np.where(nan, -np.inf, row.scores - row.tol)
    with np.errstate(invalid="ignore"):
        step = np.nan_to_num(hi[ids[:-1]] - lo[ids[1:]], nan=0.0)
    if m > 1 and np.min(step) < 0:
        s = int(np.argmin(step))
        return (
            f"slot {s} id {ids[s]} score {float(row.scores[ids[s]])!r}"
            f" ranks above slot {s + 1} id {ids[s + 1]} score"
            f" {float(row.scores[ids[s + 1]])!r}"
        )
    if m == row.bound:
        return np.inf
    chosen = np.zeros(row.bound, dtype=bool)
    chosen[ids] = True
    worst_in = ids[int(np.argmin(hi[ids]))]
    rest = np.flatnonzero(~chosen)
    best_out = rest[int(np.argmax(lo[rest]))]
    with np.errstate(invalid="ignore"):
        margin = float(hi[worst_in] - lo[best_out])
    if np.isnan(margin):  # NaN selected over NaN: both rank last
        margin = np.inf
    if margin < 0:
        return (
            f"selected id {worst_in} score {float(row.scores[worst_in])!r}"
            f" but not id {best_out} score {float(row.scores[best_out])!r}"
            " (tolerance"
            f" {row.tol[worst_in]:.3g} / {row.tol[best_out]:.3g})"
        )
    return margin


def _chunk_margins(
    got: np.ndarray, bounds: np.ndarray, hi: np.ndarray, lo: np.ndarray
) -> np.ndarray:
    """:func:`_check_row` over many rows at once: margins, NaN where wrong.

    Args:
        got: int64 ``[n, k]`` the rows' output.
        bounds: int64 ``[n]`` each row's bound.
        hi: float64 ``[n, width]`` score plus tolerance, ``-inf`` where
            the score is NaN; ``width >= bounds.max()``.
        lo: The same for score minus tolerance.

    Returns:
        float64 ``[n]``: each row's margin (``inf`` where nothing was cut),
        or NaN for a row that :func:`_check_row` would reject.
    """
    n, k = got.shape
    width = hi.shape[1]
    # A spare column, so that unused slots may point somewhere (width 0).
    spare = np.full((n, 1), -np.inf)
    hi, lo = np.hstack([hi, spare]), np.hstack([lo, spare])
    m = np.minimum(k, bounds)[:, None]
    slot = np.arange(k)[None, :]
    used = slot < m
    bad = np.any(~used & (got != -1), axis=1)
    inside = (got >= 0) & (got < bounds[:, None])
    bad |= np.any(used & ~inside, axis=1)
    ids = np.where(used & inside, got, 0)
    # Distinct: unused slots become distinct negatives, then sort.
    ordered = np.sort(np.where(used, got, -1 - slot), axis=1)
    bad |= np.any(ordered[:, 1:] == ordered[:, :-1], axis=1)
    hi_got = np.take_along_axis(hi, ids, axis=1)
    lo_got = np.take_along_axis(lo, ids, axis=1)
    with np.errstate(invalid="ignore"):
        step = np.nan_to_num(hi_got[:, :-1] - lo_got[:, 1:], nan=0.0)
    bad |= np.any((step < 0) & used[:, 1:], axis=1)
    # The set: the worst selected against the best left out.
    chosen = np.zeros((n, width + 1), dtype=bool)
    np.put_along_axis(chosen, np.where(used, ids, width), True, axis=1)
    left_out = ~chosen & (np.arange(width + 1)[None, :] < bounds[:, None])
    worst_in = np.min(np.where(used, hi_got, np.inf), axis=1)
    best_out = np.max(np.where(left_out, lo, -np.inf), axis=1)
    with np.errstate(invalid="ignore"):
        margin = worst_in - best_out
    margin[np.isnan(margin)] = np.inf  # NaN selected over NaN: both last
    margin[m[:, 0] == bounds] = np.inf
    bad |= margin < 0
    return np.where(bad, np.nan, margin)


@renamed_keyword("qs", "q_s")
def check_selection(  # noqa: D417 (the operands are index_top_k's)
    got: np.ndarray,
    q: np.ndarray,
    q_s: np.ndarray,
    input_row_offsets: np.ndarray,
    k_blocks: np.ndarray,
    k_cache_lengths: np.ndarray,
    k_lookup_table: np.ndarray,
    k_scales: np.ndarray,
    k_scales_lookup_table: np.ndarray,
    layer_idx: int,
    *,
    top_k: int,
    kpool: int = 1,
    mask: object = "causal",
    scorer: str = "simt",
) -> SelectionReport:
    """Checks an op output row by row: sets at the k-th score, with tolerance.

    Each row must hold ``m = min(k, bound)`` distinct ids in ``[0, bound)``
    then ``-1``; in non-increasing score order within the tolerance; and the
    selected set must be the top ``m`` within the tolerance: every selected
    id's ``score + tol`` is at least every unselected id's ``score - tol``
    (NaN scores rank below every number). Rows of skipped requests (module
    docs) must be all ``-1``.

    Args:
        got: int32 ``[T, top_k]`` from the op.
        q, q_s, input_row_offsets, k_blocks, k_cache_lengths, k_lookup_table,
        k_scales, k_scales_lookup_table, layer_idx, top_k, kpool, mask: As
            for :func:`index_top_k`.
        scorer: The error model of the scorer that ran
            (:func:`index_tolerance`).

    Returns:
        A :class:`SelectionReport`.

    Raises:
        AssertionError: On the first wrong row, naming the row, its request,
            bound, the offending ids and their scores.
        TypeError, ValueError: As :func:`index_top_k`, for the operands.
    """
    inp = _Inputs(
        q, q_s, input_row_offsets, k_blocks, k_cache_lengths, k_lookup_table,
        k_scales, k_scales_lookup_table, layer_idx, top_k, kpool, mask,
    )  # fmt: skip
    inp.scorer = scorer
    got = np.asarray(got)
    if got.shape != (inp.tokens, inp.top_k):
        raise AssertionError(
            f"output must be [T, top_k] = {(inp.tokens, inp.top_k)}, got"
            f" {got.shape}"
        )
    plans = inp.plans()
    got64 = got.astype(np.int64)
    margins: list[dict] = [{} for _ in plans]
    for b, part, score, mag in _scored_chunks(inp, plans):
        rows = np.array([t for t, _ in part])
        bounds = np.array([bd for _, bd in part], dtype=np.int64)
        tol = index_tolerance(mag, inp.heads, inp.depth, inp.scorer)
        nan = np.isnan(score)
        hi = np.where(nan, -np.inf, score + tol)
        lo = np.where(nan, -np.inf, score - tol)
        found = _chunk_margins(got64[rows], bounds, hi, lo)
        for i, (t, bd) in enumerate(part):
            margins[t][(b, bd)] = (found[i], score[i], mag[i])
    worst, worst_row, cut = np.inf, -1, 0
    for t, plan in enumerate(plans):
        if plan.may_be_empty and np.all(got[t] == -1):
            continue
        if not plan.answers:
            raise AssertionError(
                f"row {t}: must be all -1 (no valid request, bad page or"
                f" layer), got {got[t].tolist()[:16]}..."
            )
        passing = [
            (bound, margin)
            for (_, bound), (margin, _, _) in margins[t].items()
            if not np.isnan(margin)
        ]
        if not passing:
            reasons = []
            for (b, bound), (_, sc, mg) in margins[t].items():
                row = _row(inp, b, bound, sc, mg)
                why = _check_row(got[t], row, inp.top_k)
                reasons.append(f"request {b} bound {bound}: {why}")
            raise AssertionError(f"row {t}: " + "; ".join(reasons))
        bound, margin = passing[0]
        if bound > inp.top_k:
            cut += 1
            if margin < worst:
                worst, worst_row = margin, t
    return SelectionReport(inp.tokens, cut, float(worst), worst_row)

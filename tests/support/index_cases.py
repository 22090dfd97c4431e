"""Cases for the index_top_k tests: shapes, metadata and data, as data.

A :class:`Shape` is what one compiled model is specialized on (heads,
depth, row width, layers, page size, ``top_k``, ``kpool``, mask); the suite
keeps to the few in :data:`SHAPES`, since each costs a cold compile. A
:class:`Case` is one call on a shape: per-request cached and new token
counts plus how the cache is laid out (padded strides, a scale table of its
own, garbage around the data). :func:`build` turns a case into arrays.

Every byte the op may not read is garbage on purpose: other layers, unused
blocks, rows past a request's last complete pool, lookup entries past its
pages. Garbage keys are large finite FP8 values with scales of +-1e4, so a
kernel that reads one almost surely ranks it first and fails the check.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

import numpy as np

from mla_kpool import reference as ref
from mla_kpool.index_cache import PagedIndexCache, quantize_pooled_keys
from mla_kpool.index_runner import IndexKey

#: Garbage key scale magnitude.
GARBAGE_SCALE = 1.0e4


@dataclass(frozen=True)
class Shape:
    """One compiled model's specialization (see ``IndexKey``)."""

    name: str
    heads: int
    depth: int
    kpool: int
    top_k: int
    page_size: int
    mask: str
    width: int | None = None  # None: spread when kpool > 1
    layers: int = 2

    @property
    def row_width(self) -> int:
        """``W``."""
        if self.width is not None:
            return self.width
        return self.depth // self.kpool if self.kpool > 1 else self.depth

    @property
    def spread(self) -> bool:
        """Whether a pool spans ``kpool`` rows."""
        return self.row_width != self.depth


#: GLM-5-Next's shape (its pipeline calls with the null mask), DeepSeek-V3.2's
#: and three small ones: a whole layout, a spread one and a causal GLM twin.
GLM = Shape("glm5", 32, 128, 4, 512, 128, "null")
GLM_CAUSAL = replace(GLM, name="glm5-causal", mask="causal")
DSV32 = Shape("dsv32", 64, 128, 1, 2048, 64, "causal")
WHOLE = Shape("whole", 4, 32, 4, 64, 16, "causal", width=32)
SMALL = Shape("small", 2, 16, 4, 2048, 128, "null")
SHAPES = (GLM, GLM_CAUSAL, DSV32, WHOLE, SMALL)


def index_key(shape: Shape, device: str, scorer: str = "auto") -> IndexKey:
    """The model key of ``shape`` on a host device (``cpu``, emulated)."""
    return IndexKey(
        num_heads=shape.heads,
        depth=shape.depth,
        width=shape.row_width,
        num_layers=shape.layers,
        page_size=shape.page_size,
        top_k=shape.top_k,
        kpool=shape.kpool,
        mask=shape.mask,
        emulate_gpu=device == "gpu-emulated",
        scorer=scorer,
    )


@dataclass(frozen=True)
class Case:
    """One call: requests ``(cached, new)`` tokens and the cache layout.

    Attributes:
        name: Test id.
        shape: The model.
        cached: ``k_cache_lengths`` per request.
        new: New tokens per request (``input_row_offsets`` is their sum).
        layer: ``layer_idx``.
        key_pad: Elements of padding after each key block (a
            ``page_stride`` of packed + pad); 0 packed.
        scale_pad: The same for scale blocks.
        separate_scales: Scale blocks paged by a table of their own, in an
            arena of a different size.
        spare_blocks: Blocks no request maps (garbage).
        extra_pages: Lookup columns past the pages needed (garbage).
        tie_from: Pools from this id on share one key (0: no ties).
        seed: Data seed.
        offsets: Explicit ``input_row_offsets`` (malformed cases).
        tokens: Explicit ``T``: with ``offsets``, or past the sum of
            ``new`` for a padded batch (rows no request owns).
    """

    name: str
    shape: Shape
    cached: tuple[int, ...]
    new: tuple[int, ...]
    layer: int = 1
    key_pad: int = 0
    scale_pad: int = 0
    separate_scales: bool = False
    spare_blocks: int = 3
    extra_pages: int = 2
    tie_from: int = 0
    seed: int = 0
    offsets: tuple[int, ...] | None = None
    tokens: int | None = None
    tweaks: tuple = field(default=())


@dataclass
class Call:
    """A built case: the op's host operands and the oracle's kwargs."""

    case: Case
    q: np.ndarray
    qs: np.ndarray
    offsets: np.ndarray
    cache: PagedIndexCache

    @property
    def shape(self) -> Shape:
        """The case's model shape."""
        return self.case.shape

    def oracle_args(self) -> tuple[tuple, dict]:
        """``(args, kwargs)`` for the oracle's functions."""
        s = self.shape
        args = (self.q, self.qs, self.offsets)
        kwargs = dict(
            **self.cache.oracle_operands(),
            layer_idx=self.case.layer,
            top_k=s.top_k,
            kpool=s.kpool,
            mask=s.mask,
        )
        return args, kwargs

    def expected(self) -> np.ndarray:
        """The oracle's deterministic output."""
        args, kwargs = self.oracle_args()
        return ref.index_top_k(*args, **kwargs)

    def check(
        self, got: np.ndarray, scorer: str = "simt"
    ) -> ref.SelectionReport:
        """:func:`mla_kpool.reference.check_selection` on ``got``, within
        ``scorer``'s error bound."""
        args, kwargs = self.oracle_args()
        return ref.check_selection(got, *args, **kwargs, scorer=scorer)

    def run_kwargs(self) -> dict:
        """Keyword arguments of ``Runner.index_top_k`` for this call."""
        s = self.shape
        return dict(top_k=s.top_k, kpool=s.kpool, mask=s.mask)


def _garbage_bytes(rng: np.random.Generator, n: int) -> np.ndarray:
    """Random FP8 bytes of large magnitude, never NaN."""
    exp_mantissa = rng.integers(0x60, 0x7F, size=n)  # 2^5 .. 448
    sign = rng.integers(0, 2, size=n) << 7
    return (exp_mantissa | sign).astype(np.uint8)


def scales_on_first_rows_only(call: Call) -> None:
    """Negates every spread pool's scale on rows 1.. of the pool.

    The producer replicates a pool's scale on its ``kpool`` rows; the
    contract has the op read row ``kpool * p``, so this must not change
    the result.
    """
    if call.shape.spread:
        scales = call.cache.scales()
        for j in range(1, call.shape.kpool):
            scales[:, :, :, j :: call.shape.kpool] *= -1


def cache_rows(shape: Shape, pools: int) -> int:
    """Cache rows that ``pools`` pooled keys occupy."""
    return pools * shape.kpool if shape.spread else pools


def build(case: Case) -> Call:
    """Builds a case's arrays: a garbage-filled cache with the pools stored.

    Request ``b`` stores every complete pool of its ``cached + new`` tokens,
    so that rows past them (the pool still filling) keep garbage.
    """
    s, rng = case.shape, np.random.default_rng(case.seed)
    batch = len(case.cached)
    pools = [
        (c + n) // s.kpool for c, n in zip(case.cached, case.new, strict=True)
    ]
    pages = [math.ceil(cache_rows(s, p) / s.page_size) for p in pools]
    used = sum(pages)
    max_pages = max(pages, default=0) + case.extra_pages
    num_blocks = used + case.spare_blocks
    packed = s.layers * s.page_size * s.row_width
    cache = PagedIndexCache(
        num_blocks=num_blocks,
        num_layers=s.layers,
        page_size=s.page_size,
        head_dim=s.depth,
        kpool=s.kpool,
        width=s.row_width,
        batch=batch,
        max_pages=max(max_pages, 1),
        page_stride=packed + case.key_pad if case.key_pad else -1,
        num_scale_blocks=num_blocks + 5 if case.separate_scales else None,
        scales_page_stride=(
            s.layers * s.page_size + case.scale_pad if case.scale_pad else -1
        ),
    )
    cache.arena[:] = _garbage_bytes(rng, cache.arena.size)
    cache.scale_arena[:] = GARBAGE_SCALE * rng.choice(
        [-1.0, 1.0], size=cache.scale_arena.size
    )
    cache.lookup_table[:] = rng.integers(
        num_blocks, 2**32, size=cache.lookup_table.shape, dtype=np.uint64
    ).astype(np.uint32)
    cache.scales_lookup_table[:] = rng.integers(
        cache.num_scale_blocks,
        2**32,
        size=cache.lookup_table.shape,
        dtype=np.uint64,
    ).astype(np.uint32)
    blocks = rng.permutation(num_blocks)
    sblocks = rng.permutation(cache.num_scale_blocks)
    start = 0
    for b in range(batch):
        cache.lookup_table[b, : pages[b]] = blocks[start : start + pages[b]]
        if case.separate_scales:
            cache.scales_lookup_table[b, : pages[b]] = sblocks[
                start : start + pages[b]
            ]
        else:
            cache.scales_lookup_table[b, : pages[b]] = blocks[
                start : start + pages[b]
            ]
        start += pages[b]
        keys = rng.standard_normal((pools[b], s.depth)).astype(np.float32)
        keys *= rng.uniform(0.5, 3.0, size=(pools[b], 1)).astype(np.float32)
        if case.tie_from and pools[b] > case.tie_from:
            keys[case.tie_from :] = keys[case.tie_from]
        cache.store_keys(b, case.layer, 0, keys)
    cache.cache_lengths[:] = case.cached
    tokens = case.tokens if case.tokens is not None else sum(case.new)
    if case.offsets is not None:
        offsets = np.array(case.offsets, dtype=np.uint32)
    else:
        offsets = np.concatenate([[0], np.cumsum(case.new)]).astype(np.uint32)
    q_vals = rng.standard_normal((tokens * s.heads, s.depth))
    q = quantize_pooled_keys(q_vals)[0].reshape(tokens, s.heads, s.depth)
    qs = rng.standard_normal((tokens, s.heads)).astype(np.float32)
    call = Call(case, q, qs, offsets, cache)
    for tweak in case.tweaks:
        tweak(call)
    return call


def run(runner, call: Call, **options) -> np.ndarray:
    """``runner.index_top_k`` on ``call``'s operands, int32 ``[T, top_k]``.

    The metadata goes to the op unchecked: cases plant bad metadata to see
    the op's ``-1`` rows.
    """
    return runner.index_top_k(
        call.q,
        call.qs,
        call.offsets,
        call.cache,
        call.case.layer,
        check=False,
        **call.run_kwargs(),
        **options,
    )


#: The calls every index_top_k test file runs: each shape's decode, prefill
#: and layout corners.
CASES = [
    # GLM-5-Next: decode rows of long and short contexts (8,192 pools), the
    # null mask its pipeline passes.
    Case("glm-decode", GLM, cached=(4095, 32767, 2047, 9), new=(1, 1, 1, 1)),
    Case("glm-chunked-prefill", GLM, cached=(256, 0, 2400), new=(37, 20, 5)),
    Case("glm-bound-below-k", GLM, cached=(100, 1500), new=(3, 1)),
    Case("glm-bound-zero", GLM, cached=(0, 1, 2), new=(2, 1, 1)),
    Case("glm-no-tokens", GLM, cached=(40, 8), new=(0, 0)),
    Case("glm-empty-request", GLM, cached=(40, 3000, 8), new=(2, 0, 1)),
    Case(
        "glm-padded-strides",
        GLM,
        cached=(700, 2100),
        new=(3, 1),
        key_pad=96,
        scale_pad=7,
    ),
    Case(
        "glm-separate-scale-table",
        GLM,
        cached=(1200, 64),
        new=(1, 9),
        separate_scales=True,
        scale_pad=1,
    ),
    Case("glm-layer0", GLM, cached=(3000,), new=(2,), layer=0),
    # A batch padded to a captured graph's 8 rows: rows 4..7 are -1.
    Case("glm-batch-padded", GLM, cached=(2300, 40), new=(1, 3), tokens=8),
    Case(
        "glm-scale-read-from-row-0",
        GLM,
        cached=(1300, 70),
        new=(1, 4),
        tweaks=(scales_on_first_rows_only,),
    ),
    # The causal twin: each new row sees up to itself.
    Case("glm-causal-prefill", GLM_CAUSAL, cached=(13, 0, 510), new=(40, 9, 6)),
    Case("glm-causal-decode", GLM_CAUSAL, cached=(2051, 4), new=(1, 1)),
    Case("glm-causal-prefill-4096", GLM_CAUSAL, cached=(0,), new=(4096,)),
    # DeepSeek-V3.2: kpool 1, k 2048, causal.
    Case("dsv32-decode", DSV32, cached=(3000, 100), new=(1, 1)),
    Case("dsv32-prefill-at-k", DSV32, cached=(2030,), new=(30,)),
    Case("dsv32-padded", DSV32, cached=(2500,), new=(2,), key_pad=64),
    # One pooled key per row (W == D) with kpool 4.
    Case("whole", WHOLE, cached=(300, 7, 0), new=(5, 11, 3)),
    Case(
        "whole-padded-separate",
        WHOLE,
        cached=(515, 60),
        new=(2, 1),
        key_pad=32,
        scale_pad=3,
        separate_scales=True,
    ),
    # More than 2^18 candidate pools in one row (small H and D).
    Case("small-262k-pools", SMALL, cached=(4 * 262_144 + 37,), new=(3,)),
]


def nan_keys(sign: float):
    """Tweak: non-negative q, keys and scales, ``qs`` of one sign; NaN
    bytes in candidates 1 and 4 of request 0 and a NaN scale on 2."""

    def tweak(call: Call) -> None:
        call.q &= np.uint8(0x7F)
        call.qs[...] = sign * np.abs(call.qs)
        call.cache.arena &= np.uint8(0x7F)
        call.cache.scale_arena[...] = np.abs(call.cache.scale_arena)
        blocks, scales = call.cache.blocks(), call.cache.scales()
        for j in (1, 2, 4):
            page, slot = divmod(j, WHOLE.page_size)
            block = call.cache.lookup_table[0, page]
            if j == 2:
                scales[block, 0, call.case.layer, slot, 0, 0] = np.nan
            else:
                blocks[block, 0, call.case.layer, slot, 0, 5] = 0x7F

    return tweak

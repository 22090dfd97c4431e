"""The expand_topk cases and checks shared by two test files.

- :data:`CONFIGS`: the three compiled configurations the cases share;
- :data:`CASES`: each call's metadata and how its ``pool_ids`` are drawn;
- :func:`check_expansion`: one result against the oracle (or a candidate
  row where the contract leaves it open);
- :func:`run_case`: one case on one runner, checked.

tests/writers/test_expand_topk.py runs every case on every device;
tests/grid/test_gpu_emulation.py runs one on planted faults, which must
fail it.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass

import numpy as np

from mla_kpool import reference as ref
from mla_kpool.runner import Runner

I32, I64, U32 = np.dtype(np.int32), np.dtype(np.int64), np.dtype(np.uint32)
INT32_MAX = 2**31 - 1

# --------------------------------------------------------------------------
# Configurations and cases
# --------------------------------------------------------------------------


@dataclass(frozen=True)
class ExpandConfig:
    """One compiled expand_topk configuration."""

    kpool: int
    pool_topk: int
    always_select_tail: bool
    id_dtype: np.dtype
    index_dtype: np.dtype

    @property
    def id(self) -> str:
        tail = "tail" if self.always_select_tail else "notail"
        return (
            f"k{self.kpool}-top{self.pool_topk}-{tail}-{self.id_dtype.name}"
            f"-{self.index_dtype.name}"
        )

    @property
    def width(self) -> int:
        return ref.expand_topk_width(
            self.pool_topk, self.kpool, self.always_select_tail
        )


#: MAX's production shape (GLM-5-Next: kpool 4, 512 pools, width 2051),
#: MAX's index dtypes.
PRODUCTION = ExpandConfig(4, 512, True, I32, U32)
#: One token per pool: the tail is 0 columns even when asked for.
KPOOL_1 = ExpandConfig(1, 8, True, I32, I32)
#: No tail, a kpool that is not a power of two, 64-bit ids and metadata.
NO_TAIL = ExpandConfig(3, 5, False, I64, I64)
CONFIGS = [PRODUCTION, KPOOL_1, NO_TAIL]


@dataclass(frozen=True)
class Case:
    """One call: metadata, plus how its ``pool_ids`` are chosen.

    Attributes:
        name: Test id; its CRC seeds the selection.
        config: The compiled configuration it runs on.
        cache: ``cache_lengths``.
        new_tokens: Tokens per request; ``offsets`` is their prefix sum.
        offsets: Explicit ``input_row_offsets`` (bad metadata), instead.
        extra_rows: Token rows past the last offset (no request owns them).
        total_tokens: Explicit token row count (offsets past it), instead.
        selection: ``"mixed"`` (valid ids among ``-1``, other negatives,
            pools not yet complete or in the future, huge ids and
            repeats), ``"valid"`` (distinct visible pools, then ``-1``) or
            ``"unused"`` (all ``-1``).
        ids: Explicit ``pool_ids`` rows, instead of a selection.
        expected: Hand-computed leading columns of each output row (the
            rest ``-1``), checking the oracle itself.
    """

    name: str
    config: ExpandConfig
    cache: tuple[int, ...]
    new_tokens: tuple[int, ...] = ()
    offsets: tuple[int, ...] | None = None
    extra_rows: int = 0
    total_tokens: int | None = None
    selection: str = "mixed"
    ids: tuple[tuple[int, ...], ...] | None = None
    expected: tuple[tuple[int, ...], ...] | None = None

    def row_offsets(self) -> list[int]:
        if self.offsets is not None:
            return list(self.offsets)
        return [0, *np.cumsum(self.new_tokens, dtype=np.int64).tolist()]

    def operands(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``(pool_ids, input_row_offsets, cache_lengths)``."""
        cfg = self.config
        offsets = self.row_offsets()
        total = self.total_tokens
        if total is None:
            total = max([0, *offsets[-1:]]) + self.extra_rows
        if self.ids is not None:
            ids = np.array(self.ids, dtype=cfg.id_dtype)
            ids = ids.reshape(-1, cfg.pool_topk)
        else:
            rng = np.random.default_rng(zlib.crc32(self.name.encode()))
            ids = draw_pool_ids(
                rng, cfg, offsets, list(self.cache), total, self.selection
            )
        return (
            ids,
            np.array(offsets, dtype=cfg.index_dtype),
            np.array(self.cache, dtype=cfg.index_dtype),
        )


def _visible_counts(
    offsets: list[int], cache: list[int], total_tokens: int
) -> list[int]:
    """Each row's visible count under well-formed metadata, else a guess."""
    visible = [64] * total_tokens
    for b, c in enumerate(cache):
        for t in range(max(offsets[b], 0), min(offsets[b + 1], total_tokens)):
            visible[t] = max(c + t - offsets[b] + 1, 0)
    return visible


def draw_pool_ids(
    rng: np.random.Generator,
    cfg: ExpandConfig,
    offsets: list[int],
    cache: list[int],
    total_tokens: int,
    selection: str,
) -> np.ndarray:
    """``pool_ids`` for one call, drawn around each row's visible pools."""
    ids = np.full((total_tokens, cfg.pool_topk), -1, dtype=np.int64)
    huge = np.iinfo(cfg.id_dtype).max
    for t, visible in enumerate(_visible_counts(offsets, cache, total_tokens)):
        complete = visible // cfg.kpool
        if selection == "unused":
            continue
        if selection == "valid":
            count = min(complete, cfg.pool_topk)
            ids[t, :count] = rng.permutation(min(complete, 1 << 20))[:count]
            continue
        width = cfg.pool_topk
        kind = rng.integers(10, size=width)
        choices = [
            (kind < 4) & (complete > 0),
            kind == 4,
            kind == 5,
            kind == 6,
            kind == 7,
        ]
        values = [
            rng.integers(max(min(complete, 1 << 40), 1), size=width),
            -1 - rng.integers(3, size=width) * rng.integers(1000, size=width),
            complete + rng.integers(2, size=width),  # filling, or after it
            np.full(width, complete - 1),  # the newest complete pool
            np.full(width, huge) - rng.integers(3, size=width),
        ]
        ids[t] = np.select(choices, values, -1)
        # Kind 8 repeats an earlier column.
        for j in np.flatnonzero(kind[1:] == 8) + 1:
            ids[t, j] = ids[t, rng.integers(j)]
    return ids.astype(cfg.id_dtype)


P = PRODUCTION
CASES = [
    # Decode: one new token per request, across pool boundaries and up to
    # a context that fills all 512 selections.
    Case("decode", P, (0, 1, 3, 4, 7, 100, 2047, 2048), (1,) * 8),
    Case(
        "decode_valid", P, (3, 64, 2047, 4098, 9), (1,) * 5, selection="valid"
    ),
    # Chunked prefill: visible grows along the chunk, so pools complete
    # mid-chunk and the tail shrinks and regrows.
    Case("chunked_prefill", P, (5, 0, 1022, 12), (11, 9, 7, 0)),
    Case("prefill_valid", P, (0, 30), (13, 6), selection="valid"),
    Case("all_unused", P, (0, 9, 4000), (1, 5, 2), selection="unused"),
    Case("empty_batch", P, (), ()),
    Case("rows_no_request_owns", P, (), (), extra_rows=3),
    Case("rows_past_last_offset", P, (8, 3), (2, 1), extra_rows=4),
    Case(
        "offsets_past_tokens",
        P,
        (4, 8, 1),
        offsets=(0, 2, 5, 40),
        total_tokens=7,
    ),
    Case("span_past_tokens", P, (9, 2), offsets=(0, 5, 6), total_tokens=3),
    Case("offsets_decrease", P, (4, 8, 1, 6), offsets=(0, 4, 2, 6, 7)),
    # uint32 cache lengths near and past the int32 position limit: a query
    # may see up to 2^31 positions.
    Case(
        "positions_past_int32",
        P,
        (INT32_MAX - 3, 2**32 - 2, INT32_MAX, 2**31),
        (4, 1, 1, 1),
    ),
    Case(
        "kpool1_decode_and_prefill",
        KPOOL_1,
        (0, 5, 9, 1),
        (1, 6, 3, 0),
    ),
    Case("kpool1_valid", KPOOL_1, (0, 3, 20), (4, 1, 2), selection="valid"),
    Case("negative_cache_length", KPOOL_1, (-3, 4, -1), (2, 2, 1)),
    Case(
        "kpool1_by_hand",
        KPOOL_1,
        (2,),
        (2,),
        ids=((0, 2, 1, -1, 3, 2, -9, 0), (3, 2, 4, 0, 0, -1, 7, 1)),
        expected=((0, 2, 1, 2, 0), (3, 2, 0, 0, 1)),
    ),
    Case("no_tail_mixed", NO_TAIL, (2, 6, 30, 0), (5, 1, 4, 7)),
    Case("no_tail_valid", NO_TAIL, (1, 14), (3, 4), selection="valid"),
    # kpool 3, visible 8 then 9: pool 2 completes on the second row.
    Case(
        "no_tail_by_hand",
        NO_TAIL,
        (7,),
        (2,),
        ids=((2, 1, -1, 0, 5), (-5, 2, 2, 2**63 - 1, 3)),
        expected=((3, 4, 5, 0, 1, 2), (6, 7, 8, 6, 7, 8)),
    ),
    Case(
        "int64_cache_past_int32",
        NO_TAIL,
        (2**40, INT32_MAX - 1, -(2**62)),
        (1, 3, 1),
    ),
    Case("no_tail_decrease", NO_TAIL, (3, 9, 0), offsets=(0, 5, 1, 3)),
]


# --------------------------------------------------------------------------
# Checking one call
# --------------------------------------------------------------------------


def check_expansion(
    got: np.ndarray,
    cfg: ExpandConfig,
    pool_ids: np.ndarray,
    offsets: np.ndarray,
    cache: np.ndarray,
    what: str,
) -> np.ndarray:
    """Asserts ``got`` is the oracle's answer (or a candidate where open).

    Returns:
        The oracle's answer.
    """
    args = (pool_ids, offsets, cache, cfg.kpool, cfg.always_select_tail)
    want = ref.expand_topk(*args)
    assert got.dtype == np.int32, what
    assert got.shape == (pool_ids.shape[0], cfg.width), what
    open_rows = ref.expand_topk_ambiguous_rows(offsets, cache, len(pool_ids))
    if not open_rows.any():
        bad = np.flatnonzero((got != want).any(axis=1))
        assert not bad.size, (
            f"{what}: {bad.size} row(s) differ from the oracle, first row "
            f"{bad[0]}:\n got  {got[bad[0]][:24]}\n want {want[bad[0]][:24]}"
        )
        return want
    for t, candidates in enumerate(ref.expand_topk_candidates(*args)):
        assert (candidates == got[t]).all(axis=1).any(), (
            f"{what}: row {t} is neither all -1 nor any owner's expansion:"
            f" {got[t][:24]}"
        )
    return want


def run_case(runner: Runner, case: Case) -> None:
    """Runs ``case`` on ``runner``; checks it against the oracle."""
    cfg = case.config
    pool_ids, offsets, cache = case.operands()
    (got,) = runner.run(
        "expand_topk",
        cfg.kpool,
        pool_ids=pool_ids,
        input_row_offsets=offsets,
        cache_lengths=cache,
        always_select_tail=cfg.always_select_tail,
    )
    want = check_expansion(
        got,
        cfg,
        pool_ids,
        offsets,
        cache,
        f"{case.name} on {runner.device_name}",
    )
    if case.expected is not None:
        for t, lead in enumerate(case.expected):
            row = np.full(cfg.width, -1)
            row[: len(lead)] = lead
            np.testing.assert_array_equal(want[t], row, f"oracle row {t}")

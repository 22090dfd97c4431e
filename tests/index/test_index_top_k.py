"""index_top_k on the CPU against the float64 oracle.

tests/index/test_index_top_k_emulated.py runs every test here again on the
op's GPU path over the emulated grid (the ``runner`` fixture is the only
difference).

Cases are data (:mod:`index_cases`); the five shapes compile as one graph
per device (``COMPILED_TOGETHER``; tokens, requests, blocks and pages are
symbolic dims). Every row is checked as a set at the k-th score within
the oracle's float32 tolerance (``check_selection``), which also checks the
packing (valid ids first, ``-1`` after) and that no id reaches past the
row's bound. Expected values come from the oracle, never from the kernel.
"""

from __future__ import annotations

import math
from dataclasses import replace

import numpy as np
import pytest

from mla_kpool import reference as ref
from mla_kpool._sysinfo import cpu_flags
from mla_kpool.index_runner import IndexKey
from support.index_cases import (
    CASES,
    DSV32,
    GLM,
    GLM_CAUSAL,
    SHAPES,
    WHOLE,
    Call,
    Case,
    build,
    index_key,
    nan_keys,
    run,
)


@pytest.fixture(scope="module")
def runner(runners):
    """Where the op runs: the CPU kernel here."""
    return runners("cpu")


def COMPILED_TOGETHER(device: str) -> list[IndexKey]:  # noqa: N802
    """Every shape's model, compiled as one graph per host device.

    See the ``runners`` fixture in conftest.py.
    """
    return [index_key(shape, device) for shape in SHAPES]


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_matches_the_oracle(runner, case):
    call = build(case)
    got = run(runner, call)
    assert got.shape == (len(call.q), case.shape.top_k)
    assert got.dtype == np.int32
    report = call.check(got)
    assert report.rows == len(call.q)


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_without_amx_matches_the_oracle(runner, case, monkeypatch):
    # The same compiled graph with the AMX blocks turned off: on a host
    # with AMX-BF16 the test above scores calls of more than a core's work
    # on AMX tiles, this one on the vector blocks.
    if runner.device_name != "cpu" or not {"amx_tile", "amx_bf16"} <= (
        cpu_flags()
    ):
        pytest.skip("the CPU path without AMX is the test above's here")
    monkeypatch.setenv("MLA_KPOOL_CPU_AMX", "0")
    call = build(case)
    report = call.check(run(runner, call))
    assert report.rows == len(call.q)


def test_a_padded_batch_passes_the_check_and_its_padding_is_minus_one(runner):
    (case,) = [c for c in CASES if c.name == "glm-batch-padded"]
    call = build(case)
    used = int(call.offsets[-1])
    assert used < len(call.q)
    # The metadata check is on (the default): a padded batch passes it.
    got = runner.index_top_k(
        call.q, call.qs, call.offsets, call.cache, case.layer,
        **call.run_kwargs(),
    )  # fmt: skip
    assert (got[used:] == -1).all()
    assert (got[:used] != -1).any()
    call.check(got)  # the other rows: the oracle's selection
    # ... and exactly what the call gives without the padding.
    alone = runner.index_top_k(
        call.q[:used], call.qs[:used], call.offsets, call.cache, case.layer,
        **call.run_kwargs(),
    )  # fmt: skip
    np.testing.assert_array_equal(got[:used], alone)


def test_ties_at_the_kth_score_go_to_the_lowest_ids(runner):
    # 6,500 visible keys, all from id 100 on identical: > 4,096 candidates
    # tie at the k-th score. Identical bytes and scales score identically
    # in any arithmetic, so the order is exact: ties by ascending id.
    case = Case("dsv32-ties", DSV32, cached=(6500,), new=(2,), tie_from=100)
    call = build(case)
    rows = ref.index_scores(*call.oracle_args()[0], **call.oracle_args()[1])
    for row in rows:
        order = np.sort(row.scores)[::-1]
        assert np.sum(row.scores == order[DSV32.top_k - 1]) > 4096
    got = run(runner, call)
    call.check(got)
    np.testing.assert_array_equal(got, call.expected())


def test_same_output_on_every_run(runner):
    call = build(CASES[0])
    first = run(runner, call)
    for _ in range(2):
        np.testing.assert_array_equal(run(runner, call), first)


def test_growing_k_max_leaves_the_result_unchanged(runner):
    call = build(CASES[1])
    base = run(runner, call)
    for prompt, length in ((64, 3000), (10**6, 2**31), (2**32 - 1, 2**32 - 1)):
        got = run(
            runner, call, k_max_prompt_length=prompt, k_max_cache_length=length
        )
        np.testing.assert_array_equal(got, base)


def test_a_page_stride_smaller_than_a_block_raises(runner):
    call = build(
        Case("glm-short-stride", GLM, cached=(300,), new=(1,), key_pad=8)
    )
    packed = math.prod(call.cache.block_shape)
    call.cache.page_stride = packed - 1
    with pytest.raises(ValueError, match="stride"):
        run(runner, call)


def test_a_layer_past_the_cache_raises(runner):
    call = build(Case("glm-layer2", GLM, cached=(30,), new=(1,)))
    call.case = replace(call.case, layer=2)
    with pytest.raises(ValueError, match="below the cache's 2 layers, got 2"):
        run(runner, call)


def test_the_op_itself_refuses_a_layer_past_the_cache(runner):
    # A graph built another way reaches the op's own check.
    from mla_kpool import index_runner
    from mla_kpool.buffers import to_buffer

    call = build(Case("glm-layer2-op", GLM, cached=(30,), new=(1,)))
    model, args, _ = index_runner.prepare(
        runner, call.q, call.qs, call.offsets, call.cache, 0,
        **call.run_kwargs(),
    )  # fmt: skip
    args[-1] = to_buffer(np.uint32(2))
    with pytest.raises(ValueError, match="layer_idx=2 is past the cache's"):
        model.execute(*args)


def _rows_all_minus_one(got, rows):
    for t in rows:
        assert (got[t] == -1).all(), f"row {t}: {got[t][:8]}"


def _bad_lookup(name: str, b: int, page: int, value: int):
    def tweak(call: Call) -> None:
        getattr(call.cache, name)[b, page] = value

    return tweak


BASE = Case("bad", GLM_CAUSAL, cached=(600, 40, 900), new=(3, 2, 4))
MALFORMED = [
    # (case, rows that must be -1); the oracle checks the rest.
    (replace(BASE, name="offsets-not-from-0", offsets=(1, 3, 5, 9)), "all"),
    (
        replace(BASE, name="offsets-decrease", offsets=(0, 3, 2, 9)),
        [3, 4, 5, 6, 7, 8],
    ),
    (replace(BASE, name="offsets-past-T", offsets=(0, 3, 5, 12)), [5, 6, 7, 8]),
    # Well formed, but the last request ends before T: no request holds
    # rows 7 and 8.
    (
        replace(BASE, name="rows-past-the-last-end", offsets=(0, 3, 5, 7)),
        [7, 8],
    ),
    (
        replace(
            BASE,
            name="key-page-past-arena",
            tweaks=(_bad_lookup("lookup_table", 0, 2, 10**6),),
        ),
        [0, 1, 2],
    ),
    (
        replace(
            BASE,
            name="middle-request-page-past-arena",
            tweaks=(_bad_lookup("lookup_table", 1, 0, 10**6),),
        ),
        [3, 4],
    ),
    (
        replace(
            BASE,
            name="scale-page-past-arena",
            tweaks=(_bad_lookup("scales_lookup_table", 2, 0, 2**32 - 1),),
        ),
        [5, 6, 7, 8],
    ),
    (
        replace(
            BASE,
            name="page-past-the-table",
            cached=(600, 40, 4000),
            extra_pages=0,
            tweaks=(
                lambda call: call.cache.cache_lengths.__setitem__(2, 4700),
            ),
        ),
        [5, 6, 7, 8],
    ),
]


@pytest.mark.parametrize(
    "case, minus_one", MALFORMED, ids=[c.name for c, _ in MALFORMED]
)
def test_malformed_metadata_gives_minus_one_rows(runner, case, minus_one):
    call = build(case)
    got = run(runner, call)
    rows = range(len(call.q)) if minus_one == "all" else minus_one
    _rows_all_minus_one(got, rows)
    call.check(got)
    assert (got != -1).any() or minus_one == "all"


def test_nan_scores_rank_below_every_number(runner):
    # Positive queries, weights, keys and scales: every score is positive,
    # so a NaN candidate ranks last whether or not the ReLU keeps the NaN.
    def positive(call: Call) -> None:
        call.q &= np.uint8(0x7F)
        call.qs[...] = np.abs(call.qs)
        call.cache.arena &= np.uint8(0x7F)
        call.cache.scale_arena[...] = np.abs(call.cache.scale_arena)
        blocks = call.cache.blocks()
        for b, j in ((0, 1), (0, 4), (1, 0), (1, 70)):
            page, slot = divmod(j, WHOLE.page_size)
            block = call.cache.lookup_table[b, page]
            blocks[block, 0, call.case.layer, slot, 0, 5] = 0x7F

    case = Case("nan", WHOLE, cached=(25, 400), new=(1, 2), tweaks=(positive,))
    call = build(case)
    got = run(runner, call)
    call.check(got)
    assert got[0, 4:7].tolist() == [1, 4, -1]  # bound 6: NaNs last
    assert 0 not in got[1:] and 70 not in got[1:]


def test_a_nan_key_ranks_below_negative_scores(runner):
    # Every finite score is negative here, so a key whose NaN byte became
    # a 0 score would rank first; the contract ranks it last.
    case = Case(
        "nan-neg", WHOLE, cached=(25,), new=(1,), tweaks=(nan_keys(-1),)
    )
    call = build(case)
    got = run(runner, call)
    assert set(got[0, 3:6].tolist()) == {1, 2, 4}
    call.check(got)


# --------------------------------------------------------------------------
# Guarded-buffer fuzz
# --------------------------------------------------------------------------

#: Guard elements before and after each arena.
GUARD = 4096
#: Guard fill: 448 (the largest e4m3fn) keys with huge scales, so a read of
#: a guard ranks first and fails the check.
KEY_SENTINEL = np.uint8(0x7E)
SCALE_SENTINEL = np.float32(1e20)
FUZZ_SEEDS = 24


def _corrupt(rng: np.random.Generator, call: Call) -> str:
    """Breaks one piece of metadata (or none); says what."""
    cache, batch = call.cache, len(call.cache.cache_lengths)
    what = rng.choice(
        ["none", "none", "offsets", "key-page", "scale-page", "huge-cache"]
    )
    if batch == 0 or what == "none":
        return "none"
    b = int(rng.integers(batch))
    if what == "offsets":
        call.offsets = call.offsets.copy()
        call.offsets[int(rng.integers(batch + 1))] = rng.integers(0, 50)
    elif what in ("key-page", "scale-page"):
        table = (
            cache.lookup_table
            if what == "key-page"
            else cache.scales_lookup_table
        )
        table[b, int(rng.integers(table.shape[1]))] = rng.integers(
            cache.num_blocks, 2**32, dtype=np.uint64
        )
    else:
        cache.cache_lengths[b] = rng.integers(2**20, 2**32, dtype=np.uint64)
    return f"{what} (request {b})"


def _guarded(flat: np.ndarray, sentinel) -> np.ndarray:
    guard = np.full(GUARD, sentinel, dtype=flat.dtype)
    return np.concatenate([guard, flat, guard])


@pytest.mark.parametrize("shape", [WHOLE, GLM], ids=lambda s: s.name)
def test_guarded_fuzz(runner, shape):
    from mla_kpool import index_runner
    from mla_kpool.buffers import to_numpy

    for seed in range(FUZZ_SEEDS):
        rng = np.random.default_rng([7, seed])
        batch = int(rng.integers(0, 5))
        case = Case(
            f"fuzz-{shape.name}-{seed}",
            shape,
            cached=tuple(int(c) for c in rng.integers(0, 700, size=batch)),
            new=tuple(int(n) for n in rng.integers(0, 7, size=batch)),
            layer=int(rng.integers(0, shape.layers)),
            key_pad=int(rng.choice([0, 40])),
            scale_pad=int(rng.choice([0, 3])),
            separate_scales=bool(rng.integers(0, 2)),
            seed=seed,
        )
        call = build(case)
        broken = _corrupt(rng, call)
        keys = _guarded(call.cache.arena, KEY_SENTINEL)
        scales = _guarded(call.cache.scale_arena, SCALE_SENTINEL)
        model, args, (key_buf, scale_buf) = index_runner.prepare(
            runner, call.q, call.qs, call.offsets, call.cache, case.layer,
            **call.run_kwargs(),
            key_arena=(keys, GUARD), scale_arena=(scales, GUARD),
        )  # fmt: skip
        got = to_numpy(model.execute(*args)[0])
        where = f"{case.name}, {broken}: {case}"
        try:
            call.check(got)
        except AssertionError as error:
            raise AssertionError(f"{where}: {error}") from None
        # Bytes, not values: a GPU arena comes back as float8_e4m3fn.
        key_bytes = to_numpy(key_buf).view(np.uint8)
        assert np.array_equal(key_bytes, keys), f"{where}: keys"
        assert np.array_equal(to_numpy(scale_buf), scales, equal_nan=True), (
            f"{where}: scales written"
        )


def test_runner_views_float8_queries_and_refuses_other_dtypes(runner):
    import ml_dtypes

    call = build(Case("q-dtypes", WHOLE, cached=(80, 9), new=(3, 2)))
    want = run(runner, call)
    got = runner.index_top_k(
        call.q.view(ml_dtypes.float8_e4m3fn), call.qs, call.offsets,
        call.cache, call.case.layer, **call.run_kwargs(),
    )  # fmt: skip
    np.testing.assert_array_equal(got, want)
    bad = {
        "q must be uint8": dict(q=call.q.astype(np.float32)),
        "q must be rank 3": dict(q=call.q.reshape(len(call.q), -1)),
        "q_s must be": dict(q_s=call.qs[:, :1]),
        "layer_idx must be": dict(layer_idx=-1),
        "gpu_op must be": dict(gpu_op="bogus"),
    }
    for match, change in bad.items():
        args = dict(
            q=call.q, q_s=call.qs, input_row_offsets=call.offsets,
            cache=call.cache, layer_idx=call.case.layer,
            **call.run_kwargs(),
        )  # fmt: skip
        args.update(change)
        with pytest.raises(ValueError, match=match):
            runner.index_top_k(**args)


def test_a_cache_length_near_2_to_32_gives_minus_one_rows(runner):
    # The default k_max_cache_length saturates at 2^32 - 1; the request
    # whose length reads that large is skipped, the other one scored.
    call = build(Case("huge-length", WHOLE, cached=(80, 9), new=(3, 2)))
    call.cache.cache_lengths[1] = 2**32 - 16
    got = run(runner, call)
    assert (got[3:] == -1).all() and (got[:3, 0] >= 0).all()
    call.check(got)

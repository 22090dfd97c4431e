"""Tests of the index_top_k oracle and the host-side cache producer.

Expected values are worked out by hand from the contract in docs/ops.md
("index_top_k"), on FP8-exact inputs, never from a kernel.
"""

from __future__ import annotations

import warnings

import ml_dtypes
import numpy as np
import pytest

from mla_kpool import reference as ref
from mla_kpool.index_cache import PagedIndexCache, quantize_pooled_keys

F8 = ml_dtypes.float8_e4m3fn


def _bytes(values) -> np.ndarray:
    arr = np.asarray(values, dtype=np.float32).astype(F8)
    assert np.array_equal(arr.astype(np.float32), np.float32(values))
    return arr.view(np.uint8)


def _whole_cache(keys, scales, *, page_size=2, kpool=1, cached=None):
    """One request, keys on reversed pages of layer 1, garbage around.

    `cached` defaults to one less than the keys: a decode row (n = 1) then
    sees every key.
    """
    keys = np.asarray(keys, dtype=np.float32)
    n, depth = keys.shape
    pages = -(-n // page_size)
    cache = PagedIndexCache(
        num_blocks=pages + 2,
        num_layers=2,
        page_size=page_size,
        head_dim=depth,
        kpool=kpool,
        width=depth,
        max_pages=pages + 1,
        fill=0x7E,
        scale_fill=1e4,
    )
    cache.lookup_table[0] = np.arange(pages + 1)[::-1] + 1
    cache.lookup_table[0, -1] = 2**32 - 1  # unused entry
    cache.scales_lookup_table[...] = cache.lookup_table
    cache.store(0, 1, 0, _bytes(keys), np.float32(scales))
    cache.cache_lengths[0] = n - 1 if cached is None else cached
    return cache


def _call(cache, q, qs, new=1, top_k=4, kpool=1, mask="causal", layer=1):
    q = _bytes(q).reshape(np.shape(q))
    qs = np.asarray(qs, dtype=np.float32)
    return (q, qs, np.array([0, new], np.uint32)), dict(
        **cache.oracle_operands(),
        layer_idx=layer,
        top_k=top_k,
        kpool=kpool,
        mask=mask,
    )


# Hand example: H 2, D 2, keys k0 [1, 1], k1 [2, -1], k2 [0, 0.5], scales
# 0.5, 1, 2; q = [[1, 2], [-1, 0.5]], qs = [1, -2].
#   head 0 dots 3, 0, 1; head 1 dots -0.5, -2.5, 0.25
#   ReLU then weight: 1*[3, 0, 1] - 2*[0, 0, 0.25] = [3, 0, 0.5]
#   times scales: [1.5, 0, 1.0]  ->  order 0, 2, 1
KEYS = [[1, 1], [2, -1], [0, 0.5]]
SCALES = [0.5, 1, 2]
Q = [[[1, 2], [-1, 0.5]]]
QS = [[1, -2]]


def test_scores_apply_relu_per_head_before_the_signed_weight():
    cache = _whole_cache(KEYS, SCALES, cached=2)
    args, kwargs = _call(cache, Q, QS)
    (row,) = ref.index_scores(*args, **kwargs)
    assert row.bound == 3
    np.testing.assert_array_equal(row.scores, [1.5, 0.0, 1.0])
    # mag = |s| * sum_h |qs_h| sum_d |q k|; per head [3, 4, 1], [1.5, 2.5, .25]
    np.testing.assert_array_equal(row.mag, [0.5 * 6, 1 * 9, 2 * 1.5])
    np.testing.assert_array_equal(
        row.tol, ref.index_tolerance(row.mag, num_heads=2, depth=2)
    )


@pytest.mark.parametrize(
    "top_k, expected",
    [(1, [0]), (2, [0, 2]), (3, [0, 2, 1]), (5, [0, 2, 1, -1, -1])],
)
def test_top_k_orders_by_descending_score_then_pads(top_k, expected):
    cache = _whole_cache(KEYS, SCALES, cached=2)
    args, kwargs = _call(cache, Q, QS, top_k=top_k)
    got = ref.index_top_k(*args, **kwargs)
    assert got.dtype == np.int32
    assert got.tolist() == [expected]
    report = ref.check_selection(got, *args, **kwargs)
    assert report.rows == 1 and report.cut_rows == (top_k < 3)


def test_causal_bound_hides_the_rest_of_the_new_tokens():
    # c = 1 cached, n = 2 new (keys 1 and 2 are this call's): causal row 0
    # sees keys [0, 2), row 1 sees [0, 3); null: both see 3.
    cache = _whole_cache(KEYS, SCALES, cached=1)
    q = Q + Q
    qs = QS + QS
    args, kwargs = _call(cache, q, qs, new=2)
    assert ref.index_top_k(*args, **kwargs).tolist() == [
        [0, 1, -1, -1],
        [0, 2, 1, -1],
    ]
    kwargs["mask"] = "null"
    assert ref.index_top_k(*args, **kwargs).tolist() == [[0, 2, 1, -1]] * 2


@pytest.mark.parametrize(
    "mask, bounds", [("causal", [1, 1, 2]), ("null", [2, 2, 2])]
)
def test_pool_bounds_follow_the_contract_example(mask, bounds):
    # kpool 4, c 5, n 3 (docs/ops.md): causal 1, 1, 2; null 2, 2, 2.
    keys = np.ones((2, 8), np.float32)
    cache = _whole_cache(keys, [1, 1], page_size=4, kpool=4, cached=5)
    q = np.ones((3, 1, 8))
    args, kwargs = _call(cache, q, np.ones((3, 1)), new=3, kpool=4, mask=mask)
    rows = ref.index_scores(*args, **kwargs)
    assert [r.bound for r in rows] == bounds


def test_ties_break_by_ascending_id_and_nan_ranks_last():
    keys = [[1, 0], [-1, 0], [1, 0], [1, 0], [2, 0]]
    cache = _whole_cache(keys, [1, 1, 1, 1, 1], page_size=2)
    # Key 1 gets a NaN byte: its dot is NaN, and NaN survives the ReLU.
    blocks = cache.blocks()
    blk = cache.lookup_table[0, 0]
    blocks[blk, 0, 1, 1, 0, 1] = 0x7F
    args, kwargs = _call(cache, [[[1, 0]]], [[1]], top_k=5)
    (row,) = ref.index_scores(*args, **kwargs)
    assert np.isnan(row.scores[1])
    got = ref.index_top_k(*args, **kwargs)
    assert got.tolist() == [[4, 0, 2, 3, 1]]
    ref.check_selection(got, *args, **kwargs)
    with pytest.raises(AssertionError, match="ranks above"):
        ref.check_selection(np.array([[4, 0, 2, 1, 3]]), *args, **kwargs)


def test_spread_and_whole_layouts_score_the_same_pools():
    rng = np.random.default_rng(3)
    keys = rng.standard_normal((7, 8)).astype(np.float32)
    key_bytes, scales = quantize_pooled_keys(keys)
    q = quantize_pooled_keys(rng.standard_normal((6, 8)))[0].reshape(2, 3, 8)
    qs = rng.standard_normal((2, 3)).astype(np.float32)
    got = {}
    for width, stride in ((2, -1), (8, 1000)):
        cache = PagedIndexCache(
            num_blocks=9, num_layers=1, page_size=4, head_dim=8, kpool=4,
            width=width, max_pages=8, page_stride=stride, fill=0x7E,
        )  # fmt: skip
        cache.map_pages(rng, separate=True)
        cache.store(0, 0, 0, key_bytes, scales)
        cache.cache_lengths[0] = 28
        offsets = np.array([0, 2], np.uint32)
        got[width] = ref.index_top_k(
            q, qs, offsets, **cache.oracle_operands(), layer_idx=0,
            top_k=5, kpool=4, mask="null",
        )  # fmt: skip
    assert got[2].tolist() == got[8].tolist()
    assert (got[2] >= 0).sum() == 2 * 5  # (28 + 2) // 4 = 7 pools visible


def _bad_case(**edit):
    cache = _whole_cache(KEYS, SCALES, cached=2)
    args, kwargs = _call(cache, Q, QS)
    args = list(args)
    for name, value in edit.items():
        if name == "offsets":
            args[2] = np.array(value, np.uint32)
        else:
            kwargs[name] = value
    return args, kwargs


@pytest.mark.parametrize(
    "edit",
    [
        {"offsets": [1, 1]},  # row 0 before the first offset
        {"offsets": [0, 2]},  # past T
        {"k_lookup_table": np.array([[2**31, 0]], np.uint32)},
        {"k_scales_lookup_table": np.array([[9, 9]], np.uint32)},
    ],
    ids=["offset0", "past_T", "key_page", "scale_page"],
)
def test_bad_metadata_gives_all_minus_one(edit):
    args, kwargs = _bad_case(**edit)
    assert ref.index_top_k(*args, **kwargs).tolist() == [[-1] * 4]
    ref.check_selection(np.full((1, 4), -1), *args, **kwargs)
    with pytest.raises(AssertionError, match="all -1"):
        ref.check_selection(np.array([[0, -1, -1, -1]]), *args, **kwargs)


def test_a_layer_past_the_cache_raises():
    args, kwargs = _bad_case(layer_idx=2)
    with pytest.raises(ValueError, match="layer_idx=2 is past"):
        ref.index_top_k(*args, **kwargs)


def test_requests_after_the_first_bad_offset_are_minus_one():
    # Three requests on the same pages; offsets [0, 1, 0, 2]: request 1
    # decreases, so requests 1 and 2 are not scored though 2's span is fine.
    cache = _whole_cache(KEYS, SCALES, cached=2)
    cache.cache_lengths = np.array([2, 2, 1], np.uint32)
    for name in ("lookup_table", "scales_lookup_table"):
        table = getattr(cache, name)
        setattr(cache, name, np.vstack([table] * 3))
    q = np.array(Q * 2, np.float32).astype(F8).view(np.uint8)
    kw = dict(**cache.oracle_operands(), layer_idx=1, top_k=4, kpool=1)
    qs = np.float32(QS * 2)
    for offsets, expected in (
        ([0, 1, 1, 2], [[0, 2, 1, -1], [0, 1, -1, -1]]),
        ([0, 1, 0, 2], [[0, 2, 1, -1], [-1] * 4]),
        ([1, 1, 1, 2], [[-1] * 4] * 2),
    ):
        offsets = np.array(offsets, np.uint32)
        got = ref.index_top_k(q, qs, offsets, **kw)
        assert got.tolist() == expected
        ref.check_selection(got, q, qs, offsets, **kw)


def test_a_bad_page_for_the_last_row_skips_the_whole_request():
    # c = 1, n = 2, causal, page_size 2: row 0 needs page 0 only, row 1
    # needs page 1 too, whose entry is past the arena: both rows are -1.
    cache = _whole_cache(KEYS, SCALES, cached=1)
    cache.lookup_table[0, 1] = 99
    args, kwargs = _call(cache, Q + Q, QS + QS, new=2)
    assert ref.index_top_k(*args, **kwargs).tolist() == [[-1] * 4] * 2


@pytest.mark.parametrize(
    "got, match",
    [
        ([[0, 1, -1, -1]], "selected id 1"),  # 1 (score 0) over 2 (score 1)
        ([[0, 3, -1, -1]], r"ids must be in \[0, 3\)"),
        ([[0, 0, -1, -1]], "ids repeat"),
        ([[0, 2, 1, 1]], "must be -1"),
        ([[2, 0, -1, -1]], "ranks above"),
    ],
)
def test_check_selection_names_what_is_wrong(got, match):
    cache = _whole_cache(KEYS, SCALES, cached=2)
    args, kwargs = _call(cache, Q, QS, top_k=4)
    kwargs["top_k"] = 4
    if match != "must be -1":
        kwargs["top_k"] = 2
        got = [got[0][:2]]
    with pytest.raises(AssertionError, match=match):
        ref.check_selection(np.array(got), *args, **kwargs)


def test_check_selection_accepts_a_swap_within_tolerance():
    # Two keys whose exact scores differ by less than the float32 tolerance.
    keys = [[1, 0], [1, 0]]
    cache = _whole_cache(keys, [1.0, 1.0 + 2.0**-23], cached=2)
    args, kwargs = _call(cache, [[[1, 0]]], [[1]], top_k=1, new=0)
    args = (args[0], args[1], np.array([0, 1], np.uint32))
    cache.cache_lengths[0] = 1  # causal row 0 sees c + n - 0 = 2 keys
    assert ref.index_top_k(*args, **kwargs).tolist() == [[1]]
    report = ref.check_selection(np.array([[0]]), *args, **kwargs)
    assert report.cut_rows == 1 and 0 <= report.worst_margin


@pytest.mark.parametrize(
    "function", [ref.index_top_k, ref.index_scores, ref.check_selection]
)
def test_q_s_keyword_and_its_former_name_qs(function):
    cache = _whole_cache(KEYS, SCALES, cached=2)
    (q, q_s, offsets), kwargs = _call(cache, Q, QS, top_k=2)
    # The hand example's order (0, 2, 1): [0, 2] is right for every one.
    head = (
        (np.array([[0, 2]], np.int32),)
        if function is ref.check_selection
        else ()
    )
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        new = function(*head, q, q_s=q_s, input_row_offsets=offsets, **kwargs)
    with pytest.warns(DeprecationWarning, match="renamed q_s=") as record:
        old = function(*head, q, qs=q_s, input_row_offsets=offsets, **kwargs)
    assert record[0].filename == __file__
    if function is ref.index_scores:
        np.testing.assert_array_equal(old[0].scores, [1.5, 0.0, 1.0])
        np.testing.assert_array_equal(new[0].scores, [1.5, 0.0, 1.0])
    elif function is ref.index_top_k:
        assert old.tolist() == new.tolist() == [[0, 2]]
    else:
        assert old == new and new.cut_rows == 1
    with pytest.raises(TypeError, match="got both q_s= and its former"):
        function(*head, q, q_s, offsets, qs=q_s, **kwargs)
    with pytest.raises(TypeError, match="got both q_s= and its former"):
        function(*head, q, q_s=q_s, qs=q_s, input_row_offsets=offsets, **kwargs)


def test_a_q_s_of_the_wrong_shape_is_named_q_s():
    cache = _whole_cache(KEYS, SCALES, cached=2)
    (q, _, offsets), kwargs = _call(cache, Q, QS)
    with pytest.raises(ValueError, match=r"q_s must be \[T, H\], got \(1, 3\)"):
        ref.index_top_k(q, np.ones((1, 3), np.float32), offsets, **kwargs)


def test_rows_of_a_padded_batch_are_minus_one():
    # The hand example's row, then two padding rows no request owns
    # (input_row_offsets [0, 1], T 3).
    cache = _whole_cache(KEYS, SCALES, cached=2)
    (q, q_s, offsets), kwargs = _call(cache, Q * 3, QS * 3)
    got = ref.index_top_k(q, q_s, offsets, **kwargs)
    assert got.tolist() == [[0, 2, 1, -1], [-1] * 4, [-1] * 4]
    assert ref.index_scores(q, q_s, offsets, **kwargs)[1:] == [None, None]
    ref.check_selection(got, q, q_s, offsets, **kwargs)
    got[2, 0] = 0
    with pytest.raises(AssertionError, match="row 2: must be all -1"):
        ref.check_selection(got, q, q_s, offsets, **kwargs)


def test_tolerance_is_d_plus_h_plus_4_units():
    tol = ref.index_tolerance(np.array([1.0, 0.0]), num_heads=32, depth=128)
    assert tol[0] == pytest.approx(164 * 2.0**-24, rel=1e-12)
    assert tol[1] == 36 * 2.0**-126


def test_quantize_pooled_keys_hand_values():
    keys = np.array(
        [[1, -2, 0.5, 0], [0, 0, 0, 0], [2400, 1, -2400, 3000]], np.float32
    )
    key_bytes, scales = quantize_pooled_keys(keys)
    assert key_bytes.dtype == np.uint8 and scales.dtype == np.float32
    assert scales[0] == np.float32(2) / np.float32(448)
    assert scales[1] == 0 and not key_bytes[1].any()
    assert scales[2] == np.float32(1200) / np.float32(448)
    values = key_bytes.view(F8).astype(np.float64)
    np.testing.assert_array_equal(values[0], [224, -448, 112, 0])
    np.testing.assert_array_equal(values[2, [0, 2, 3]], [448, -448, 448])


def test_store_spreads_a_pool_over_kpool_rows_with_its_scale_on_each():
    cache = PagedIndexCache(
        num_blocks=3, num_layers=2, page_size=4, head_dim=8, kpool=4,
        max_pages=2, page_stride=40, scales_page_stride=9, fill=0xAA,
    )  # fmt: skip
    cache.lookup_table[0] = [2, 0]
    cache.scales_lookup_table[0] = [1, 2]
    key_bytes = np.arange(16, dtype=np.uint8).reshape(2, 8)
    cache.store(0, 1, 0, key_bytes, np.float32([3, 5]))
    blocks, scales = cache.blocks(), cache.scales()
    np.testing.assert_array_equal(
        blocks[2, 0, 1, :, 0], key_bytes[0].reshape(4, 2)
    )
    np.testing.assert_array_equal(
        blocks[0, 0, 1, :, 0], key_bytes[1].reshape(4, 2)
    )
    assert scales[1, 0, 1, :, 0, 0].tolist() == [3] * 4
    assert scales[2, 0, 1, :, 0, 0].tolist() == [5] * 4
    # Layer 0 and the padding between blocks are untouched.
    assert (blocks[:, 0, 0] == 0xAA).all()
    pad = cache.arena.reshape(3, 40)[:, 32:]
    assert (pad == 0xAA).all()
    with pytest.raises(ValueError, match="past the lookup table"):
        cache.store(0, 1, 2, key_bytes[:1], np.float32([1]))


def test_cache_refuses_bad_layouts_and_strides():
    with pytest.raises(ValueError, match="width"):
        PagedIndexCache(
            num_blocks=1, num_layers=1, page_size=4, head_dim=8, kpool=4,
            width=4,
        )  # fmt: skip
    with pytest.raises(ValueError, match="multiple of kpool"):
        PagedIndexCache(
            num_blocks=1, num_layers=1, page_size=6, head_dim=8, kpool=4
        )
    with pytest.raises(ValueError, match="page_stride"):
        PagedIndexCache(
            num_blocks=1, num_layers=1, page_size=4, head_dim=8, kpool=4,
            page_stride=7,
        )  # fmt: skip


@pytest.mark.parametrize("fault", ["head-weight", "mask", "layer", "scale-row"])
def test_check_selection_catches_planted_faults(fault):
    # The oracle's output on planted-fault inputs must fail the check on the
    # true inputs: the check is sharp enough to see a wrong kernel.
    from support.index_cases import GLM_CAUSAL, Case, build

    call = build(Case("f", GLM_CAUSAL, cached=(900, 30), new=(6, 9)))
    args, kwargs = call.oracle_args()
    bad_args, bad_kwargs = list(args), dict(kwargs)
    if fault == "head-weight":
        qs = args[1].copy()
        qs[:, 3] *= -1
        bad_args[1] = qs
    elif fault == "mask":
        bad_kwargs["mask"] = "null"
    elif fault == "layer":
        bad_kwargs["layer_idx"] = 0
    else:  # scales read from the pool's last row, not its first
        scales = kwargs["k_scales"]
        scales[:, :, :, 3::4] = -scales[:, :, :, 3::4]  # in place: the truth
        bad_scales = scales.copy()
        bad_scales[:, :, :, 0::4] = scales[:, :, :, 3::4]
        bad_kwargs["k_scales"] = bad_scales
    wrong = ref.index_top_k(*bad_args, **bad_kwargs)
    with pytest.raises(AssertionError, match="row"):
        ref.check_selection(wrong, *args, **kwargs)


def _mutations(rng, got, bounds, k):
    """Random single-row edits of a correct output: each may or may not
    break it (a swap of near-equal scores is still right)."""
    for _ in range(120):
        wrong = got.copy()
        t = int(rng.integers(len(got)))
        m = min(k, int(bounds[t]))
        kind = rng.integers(6)
        if m == 0:
            wrong[t, int(rng.integers(k))] = int(rng.integers(-1, 3))
        elif kind == 0 and m > 1:  # swap two slots
            i, j = rng.choice(m, 2, replace=False)
            wrong[t, [i, j]] = wrong[t, [j, i]]
        elif kind == 1:  # an id left out (or past the bound)
            wrong[t, int(rng.integers(m))] = int(rng.integers(bounds[t] + 1))
        elif kind == 2 and m > 1:  # a repeat
            wrong[t, int(rng.integers(1, m))] = wrong[t, 0]
        elif kind == 3:  # -1 too early
            wrong[t, int(rng.integers(m))] = -1
        elif kind == 4 and m < k:  # an id after the last slot
            wrong[t, m] = int(rng.integers(bounds[t] + 1))
        else:  # a neighbour swap, often within the tolerance
            i = int(rng.integers(max(1, m - 1)))
            wrong[t, [i, i + 1 if m > 1 else i]] = wrong[
                t, [i + 1 if m > 1 else i, i]
            ]
        yield wrong


def test_check_selection_agrees_with_the_row_by_row_check():
    # check_selection checks many rows at once; each of its verdicts and its
    # worst margin must be what the plain row-by-row check gives.
    from mla_kpool.reference.indexer import _check_row
    from support.index_cases import WHOLE, Case, build

    call = build(
        Case("v", WHOLE, cached=(400, 0, 40), new=(7, 3, 5), tie_from=60)
    )
    args, kwargs = call.oracle_args()
    rows = ref.index_scores(*args, **kwargs)
    bounds = np.array([r.bound for r in rows])
    k = WHOLE.top_k
    rng = np.random.default_rng(7)
    verdicts = set()
    for got in [call.expected(), *_mutations(rng, call.expected(), bounds, k)]:
        per_row = [_check_row(got[t], r, k) for t, r in enumerate(rows)]
        wrong = [t for t, v in enumerate(per_row) if isinstance(v, str)]
        if wrong:
            with pytest.raises(AssertionError, match=f"row {wrong[0]}: "):
                ref.check_selection(got, *args, **kwargs)
        else:
            report = ref.check_selection(got, *args, **kwargs)
            cut = [v for t, v in enumerate(per_row) if bounds[t] > k]
            assert report.cut_rows == len(cut)
            assert report.worst_margin == min(cut, default=np.inf)
        verdicts.add(bool(wrong))
    assert verdicts == {True, False}
    assert (bounds > k).sum() >= 7 and (bounds == 0).any()


def test_importing_the_package_does_not_import_max_nn():
    # max.nn takes seconds to import; index_top_k loads it on first use.
    import os
    import subprocess
    import sys

    code = (
        "import sys, mla_kpool; assert 'max.nn' not in sys.modules;"
        " mla_kpool.index_top_k; assert 'max.nn' in sys.modules"
    )
    subprocess.run(
        [sys.executable, "-c", code], check=True, env=dict(os.environ)
    )

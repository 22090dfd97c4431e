"""The Runner refuses mismatched operands by name, before MAX sees them.

No test here compiles a graph: a ``Runner("cpu")`` compiles nothing until a
call, and every call below fails its checks first (``Runner.model`` and
``Runner.index_model`` are replaced by a stand-in that fails the test if
reached, except where a test shows the checks *passed* by reaching it).
Each refused call must leave the ring byte for byte as it was.
"""

from __future__ import annotations

import warnings

import ml_dtypes
import numpy as np
import pytest
from max.nn.attention.mask_config import MHAMaskVariant

import mla_kpool
from mla_kpool import runner as runner_module
from mla_kpool.index_cache import PagedIndexCache
from mla_kpool.reference import tolerance
from mla_kpool.runner import Runner

KPOOL, HEAD_DIM, SLOTS = 4, 8, 3
BF16 = ml_dtypes.bfloat16


class Compiled(Exception):
    """Raised by the stand-in for compiling: the checks let a call through."""


@pytest.fixture
def runner(monkeypatch) -> Runner:
    def compile_model(self, key):
        raise Compiled(key)

    monkeypatch.setattr(Runner, "model", compile_model)
    monkeypatch.setattr(Runner, "index_model", compile_model)
    runner = Runner("cpu")
    assert runner._models == {} and runner._index_models == {}
    return runner


def operands(runner: Runner) -> dict:
    """A good step call: two requests of 4 and 2 tokens, slots 2 and 0."""
    rng = np.random.default_rng(7)
    ring = rng.standard_normal((SLOTS, 2, KPOOL, HEAD_DIM)).astype(BF16)
    return dict(
        tail=runner.to_device(ring),
        k=rng.standard_normal((6, HEAD_DIM)).astype(BF16),
        gate=rng.standard_normal((6, HEAD_DIM)).astype(BF16),
        ape=rng.standard_normal((KPOOL, HEAD_DIM)).astype(np.float32),
        input_row_offsets=np.array([0, 4, 6], np.uint32),
        pool_row_offsets=np.array([0, 1, 1], np.uint32),
        cache_lengths=np.array([0, 1], np.uint32),
        slot_idx=np.array([2, 0], np.uint32),
        pool_ids=np.zeros((6, 2), np.int32),
    )


def _bf16(*shape: int) -> np.ndarray:
    return np.ones(shape, BF16)


def _u32(*values: int) -> np.ndarray:
    return np.array(values, np.uint32)


#: (id, op, changed operands, error, message); messages as the user reads
#: them, written out here rather than derived from the code under test.
BAD = [
    ("slot-idx-length", "step", dict(slot_idx=_u32(2, 0, 1)), ValueError,
     "slot_idx must be [batch] = [2] to match cache_lengths [2], got [3]"),
    ("slot-idx-rank", "step", dict(slot_idx=_u32(2, 0).reshape(2, 1)),
     ValueError, "slot_idx must be rank 1 [batch], got rank 2 [2, 1]"),
    ("slot-idx-float", "seed_tail", dict(slot_idx=np.array([2.0, 0.0])),
     ValueError,
     "slot_idx dtype must be one of uint32, int32, int64, uint64, got"
     " float64"),
    ("cache-lengths-rank", "step",
     dict(cache_lengths=_u32(0, 1).reshape(1, 2)), ValueError,
     "cache_lengths must be rank 1 [batch], got rank 2 [1, 2]"),
    ("offsets-length", "ring_close", dict(input_row_offsets=_u32(0, 6)),
     ValueError,
     "input_row_offsets must be [batch + 1] = [3] to match cache_lengths"
     " [2], got [2]"),
    ("pool-offsets-length", "compress", dict(pool_row_offsets=_u32(0, 1)),
     ValueError,
     "pool_row_offsets must be [batch + 1] = [3] to match cache_lengths"
     " [2], got [2]"),
    ("gate-rows", "step", dict(gate=_bf16(5, HEAD_DIM)), ValueError,
     "gate must have the shape of k [6, 8], got [5, 8]"),
    ("gate-dtype", "compress", dict(gate=np.ones((6, 8), np.float16)),
     ValueError, "gate dtype must match k (bfloat16), got float16"),
    ("k-float32-on-bf16-ring", "step",
     dict(k=np.ones((6, 8), np.float32), gate=np.ones((6, 8), np.float32)),
     ValueError, "k dtype must be the ring's (tail) bfloat16, got float32"),
    ("k-head-dim", "seed_tail", dict(k=_bf16(6, 16), gate=_bf16(6, 16)),
     ValueError,
     "k must be [tokens, head_dim=8] to match the ring (tail [3, 2, 4, 8]),"
     " got [6, 16]"),
    ("k-rank", "step", dict(k=_bf16(6, 8, 1)), ValueError,
     "k must be rank 2 [total_tokens, head_dim], got rank 3 [6, 8, 1]"),
    ("k-list", "step", dict(k=[[0.0] * 8] * 6), TypeError,
     "k must be a NumPy array, got list"),
    ("gate-complex", "compress", dict(gate=np.ones((6, 8), np.complex64)),
     ValueError, "gate dtype must be one MAX has, got complex64"),
    ("ape-float64", "step", dict(ape=np.zeros((KPOOL, HEAD_DIM))),
     ValueError, "ape must be [kpool=4, head_dim=8] float32, got [4, 8]"
     " float64"),
    ("ape-shape", "ring_close", dict(ape=np.zeros((2, 8), np.float32)),
     ValueError, "ape must be [kpool=4, head_dim=8] float32, got [2, 8]"
     " float32"),
    ("ring-numpy", "step", dict(tail=np.zeros((3, 2, 4, 8), BF16)),
     TypeError, "tail must be a max.driver.Buffer (Runner.new_ring), got"
     " ndarray"),
    ("pool-ids-float", "expand_topk", dict(pool_ids=np.zeros((6, 2))),
     ValueError, "pool_ids must be int32 or int64"),
    ("pool-ids-rank", "expand_topk",
     dict(pool_ids=np.zeros(6, np.int32)), ValueError,
     "pool_ids must be rank 2 [total_tokens, pool_topk], got rank 1 [6]"),
]  # fmt: skip


def _message(text: str) -> str:
    """``text`` as a regular expression matching it literally."""
    import re

    return re.escape(text)


@pytest.mark.parametrize(
    "kind, change, error, message",
    [pytest.param(*case[1:], id=case[0]) for case in BAD],
)
def test_a_mismatched_operand_is_refused_by_name(
    runner, kind, change, error, message
):
    ops = operands(runner)
    before = runner.read(ops["tail"]).view(np.uint16).copy()
    with pytest.raises(error, match=_message(message)):
        runner.run(kind, KPOOL, **{**ops, **change})
    after = runner.read(ops["tail"]).view(np.uint16)
    np.testing.assert_array_equal(after, before)


@pytest.mark.parametrize(
    "shape, given",
    [((SLOTS, 2, 32), "[3, 2, 32]"), ((SLOTS, 2, 3, 8), "[3, 2, 3, 8]")],
    ids=["rank-3", "ring-not-a-multiple-of-kpool"],
)
def test_a_ring_of_the_wrong_shape_is_refused_unchanged(runner, shape, given):
    ring = np.arange(np.prod(shape), dtype=np.float32).reshape(shape)
    tail = runner.to_device(ring.astype(BF16))
    with pytest.raises(
        ValueError,
        match=_message(
            "tail must be [max_slots, 2, kpool=4 (or a multiple of 4),"
            f" head_dim=8], got {given}"
        ),
    ):
        runner.run("step", KPOOL, **{**operands(runner), "tail": tail})
    np.testing.assert_array_equal(
        runner.read(tail).astype(np.float32), ring.astype(BF16)
    )


def test_a_non_integer_kpool_is_refused(runner):
    with pytest.raises(TypeError, match="kpool must be an int, got str '4'"):
        runner.run("step", "4", **operands(runner))


def test_good_operands_pass_the_checks_and_reach_the_compile(runner):
    # The stand-in for compiling is reached: the checks refuse nothing good.
    ops = operands(runner)
    for kind in runner_module.OPS:
        with pytest.raises(Compiled):
            runner.run(kind, KPOOL, **ops)
    # Lists still become uint32 index operands (and a list ape, float32).
    listed = {
        **ops,
        "input_row_offsets": [0, 4, 6],
        "ape": ops["ape"].tolist(),
    }
    with pytest.raises(Compiled) as compiled:
        runner.run("step", KPOOL, **listed)
    key = compiled.value.args[0]
    assert key.dtype.name == "bfloat16" and key.head_dim == HEAD_DIM
    assert key.ring_len == KPOOL


# --------------------------------------------------------------------------
# Runner.index_top_k
# --------------------------------------------------------------------------


def index_call() -> dict:
    """A good index_top_k call: 2 requests of 3 and 2 new tokens."""
    cache = PagedIndexCache(
        num_blocks=4, num_layers=2, page_size=8, head_dim=16, kpool=4,
        batch=2, max_pages=2,
    )  # fmt: skip
    cache.map_pages()
    cache.cache_lengths[:] = [5, 9]
    return dict(
        q=np.zeros((5, 2, 16), np.uint8),
        q_s=np.ones((5, 2), np.float32),
        input_row_offsets=np.array([0, 3, 5], np.uint32),
        cache=cache,
        layer_idx=1,
        top_k=2,
        kpool=4,
        mask="null",
    )


INDEX_BAD = [
    ("offsets-length", dict(input_row_offsets=_u32(0, 5)), ValueError,
     "input_row_offsets must be rank 1 [B + 1] = [3] (B from"
     " cache.cache_lengths), got shape [2]"),
    ("offsets-rank", dict(input_row_offsets=_u32(0, 3, 5).reshape(1, 3)),
     ValueError, "input_row_offsets must be rank 1 [B + 1] = [3]"),
    ("offsets-float", dict(input_row_offsets=np.array([0.0, 3.0, 5.0])),
     ValueError, "input_row_offsets must have an integer dtype, got float64"),
    ("q_s-float64", dict(q_s=np.ones((5, 2))), ValueError,
     "q_s dtype must be float32, got float64"),
    # Without these checks MAX would say only that a symbolic dim of
    # input 1 does not match.
    ("q_s-rows", dict(q_s=np.ones((4, 2), np.float32)), ValueError,
     "q_s must be [T, num_heads] = [5, 2] to match q [5, 2, 16], got [4, 2]"),
    ("q_s-heads", dict(q_s=np.ones((5, 3), np.float32)), ValueError,
     "q_s must be [T, num_heads] = [5, 2] to match q [5, 2, 16], got [5, 3]"),
    ("layer-past-the-cache", dict(layer_idx=2), ValueError,
     "layer_idx must be below the cache's 2 layers, got 2"),
    ("layer-array", dict(layer_idx=np.array([1], np.uint32)), TypeError,
     "layer_idx must be an int, got ndarray"),
    ("top-k-float", dict(top_k=2.5), TypeError,
     "top_k must be an int, got float 2.5"),
    ("top-k-zero", dict(top_k=0), ValueError,
     "top_k must be in 1..2048, got 0"),
    ("kpool-zero", dict(kpool=0), ValueError,
     "kpool must be at least 1, got 0"),
    ("max-prompt-negative", dict(k_max_prompt_length=-1), ValueError,
     "k_max_prompt_length must be in 0..4294967295, got -1"),
    ("max-cache-float", dict(k_max_cache_length=9.0), TypeError,
     "k_max_cache_length must be an int, got float 9.0"),
    # The op would name only the rows' width (16 of 64).
    ("kpool-not-the-caches", dict(kpool=2), ValueError,
     "kpool must be the cache's kpool=4 (its spread rows of W=4), got 2"),
    ("mask", dict(mask="sliding"), ValueError,
     "mask must be 'causal', 'null', MHAMaskVariant.CAUSAL_MASK or"
     " MHAMaskVariant.NULL_MASK, got 'sliding'"),
    ("mask-chunked", dict(mask=MHAMaskVariant.CHUNKED_CAUSAL_MASK),
     ValueError, "mask must be 'causal', 'null', MHAMaskVariant.CAUSAL_MASK"),
    ("cache", dict(cache=object()), TypeError,
     "cache must be a mla_kpool.index_cache.PagedIndexCache, got object"),
]  # fmt: skip


def _bad_metadata(field: str) -> dict:
    """index_call() with one bad metadata value in ``field``."""
    call = index_call()
    if field == "offsets-past-t":
        call["input_row_offsets"] = np.array([0, 3, 7], np.uint32)
    elif field == "offsets-down":
        call["input_row_offsets"] = np.array([0, 4, 3], np.int64)
    elif field == "cache-past-pages":
        call["cache"].cache_lengths[1] = 60
    else:
        call["cache"].lookup_table[0, 0] = 10**6
    return call


@pytest.mark.parametrize(
    ("field", "message"),
    [
        ("offsets-past-t", r"input_row_offsets.*5"),
        ("offsets-down", r"request 1: input_row_offsets"),
        ("cache-past-pages", r"request 1"),
        ("table-past-arena", r"request 0.*lookup_table"),
    ],
)
def test_index_top_k_refuses_bad_metadata_before_compiling(
    runner, field, message
):
    with pytest.raises(ValueError, match=message):
        runner.index_top_k(**_bad_metadata(field))
    # check=False hands it to the op (here: the stand-in compile).
    with pytest.raises(Compiled):
        runner.index_top_k(**_bad_metadata(field), check=False)


@pytest.mark.parametrize(
    "change, error, message",
    [pytest.param(*case[1:], id=case[0]) for case in INDEX_BAD],
)
def test_index_top_k_refuses_mismatched_operands(
    runner, change, error, message
):
    with pytest.raises(error, match=_message(message)):
        runner.index_top_k(**{**index_call(), **change})


@pytest.mark.parametrize(
    "mask, want",
    [
        ("causal", "causal"),
        ("null", "null"),
        (MHAMaskVariant.CAUSAL_MASK, "causal"),
        (MHAMaskVariant.NULL_MASK, "null"),
    ],
)
def test_index_top_k_takes_the_mask_as_a_string_or_maxs_variant(
    runner, mask, want
):
    with pytest.raises(Compiled) as compiled:
        runner.index_top_k(**{**index_call(), "mask": mask})
    key = compiled.value.args[0]
    assert key.mask == want and key.top_k == 2 and key.kpool == 4


def _with_former_name(call: dict) -> dict:
    """``call`` with ``q_s`` passed by its former keyword ``qs``."""
    call = dict(call)
    call["qs"] = call.pop("q_s")
    return call


def test_index_top_k_takes_q_s_without_a_warning(runner):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(Compiled):
            runner.index_top_k(**index_call())


def test_index_top_k_takes_the_former_keyword_qs_with_a_warning(runner):
    with (
        pytest.warns(DeprecationWarning, match="renamed q_s=") as record,
        pytest.raises(Compiled),
    ):
        runner.index_top_k(**_with_former_name(index_call()))
    # The warning points at the caller's line, not at the package.
    assert record[0].filename == __file__
    # The value reaches the checks as q_s: a wrong shape is named so.
    bad = {**index_call(), "q_s": np.ones((4, 2), np.float32)}
    with (
        pytest.warns(DeprecationWarning),
        pytest.raises(ValueError, match=r"q_s must be \[T, num_heads\]"),
    ):
        runner.index_top_k(**_with_former_name(bad))


def test_index_top_k_refuses_q_s_and_qs_together(runner):
    call = index_call()
    with pytest.raises(TypeError, match="got both q_s= and its former"):
        runner.index_top_k(**call, qs=call["q_s"])
    # q_s by position counts too.
    q, q_s = call.pop("q"), call.pop("q_s")
    with pytest.raises(TypeError, match="got both q_s= and its former"):
        runner.index_top_k(q, q_s, qs=q_s, **call)


def test_prepare_takes_the_former_keyword_qs_with_a_warning(runner):
    from mla_kpool import index_runner

    with (
        pytest.warns(DeprecationWarning, match="renamed q_s="),
        pytest.raises(Compiled),
    ):
        index_runner.prepare(runner, **_with_former_name(index_call()))
    with pytest.raises(TypeError, match="got both q_s= and its former"):
        index_runner.prepare(runner, **index_call(), qs=np.ones((5, 2)))


# --------------------------------------------------------------------------
# check_index_metadata
# --------------------------------------------------------------------------


def test_check_index_metadata_passes_a_good_call():
    call = index_call()
    mla_kpool.check_index_metadata(
        call["input_row_offsets"], call["cache"], 1, total_tokens=5, kpool=4
    )


def test_a_padded_batch_passes_the_check():
    # 8 query rows, the requests' 3 + 2 first: rows 5..7 are padding (a
    # batch padded to a captured graph's size), which the op gives -1.
    call = index_call()
    mla_kpool.check_index_metadata(
        call["input_row_offsets"], call["cache"], 1, total_tokens=8
    )
    mla_kpool.check_index_metadata([0, 0, 0], call["cache"], 1, total_tokens=8)


def test_offsets_past_the_query_rows_are_named():
    call = index_call()
    with pytest.raises(
        ValueError,
        match=_message("request 1: input_row_offsets[2]=7 > total_tokens=5"),
    ):
        mla_kpool.check_index_metadata(
            [0, 3, 7], call["cache"], 1, total_tokens=5
        )
    with pytest.raises(
        ValueError,
        match=_message("request 0: input_row_offsets[1]=6 > total_tokens=5"),
    ):
        mla_kpool.check_index_metadata(
            [0, 6, 6], call["cache"], 1, total_tokens=5
        )


def test_index_top_k_takes_a_padded_batch(runner):
    call = {
        **index_call(),
        "q": np.zeros((8, 2, 16), np.uint8),
        "q_s": np.ones((8, 2), np.float32),
    }
    with pytest.raises(Compiled):  # the checks passed
        runner.index_top_k(**call)


def test_too_narrow_a_lookup_table_is_named():
    # Request 1: c 9 + n 30 = 39 tokens, 9 pools, spread over 36 rows:
    # ceil(36 / 8) = 5 pages; the tables have 2.
    call = index_call()
    with pytest.raises(
        ValueError,
        match=_message(
            "request 1: cache.lookup_table must have at least 5 pages per"
            " request (9 keys for c=9, n=30, kpool=4, page_size=8), got 2"
        ),
    ):
        mla_kpool.check_index_metadata(
            [0, 3, 33], call["cache"], 0, total_tokens=33
        )


def test_a_block_past_the_arena_is_named():
    # Request 0: c 5 + n 3 = 8 tokens, 2 pools, 8 rows: page 0 only.
    call = index_call()
    cache = call["cache"]
    cache.scales_lookup_table[0, 1] = 99  # never read: request 0 needs 1 page
    mla_kpool.check_index_metadata([0, 3, 5], cache, 0, total_tokens=5)
    cache.scales_lookup_table[0, 0] = 4
    with pytest.raises(
        ValueError,
        match=_message(
            "request 0: cache.scales_lookup_table[0, 0]=4 must be < 4"
        ),
    ):
        mla_kpool.check_index_metadata([0, 3, 5], cache, 0, total_tokens=5)


@pytest.mark.parametrize(
    "offsets, layer, kpool, message",
    [
        ([0, 3], 0, None, "input_row_offsets has 2 entries, expected batch"
         " + 1 = 3"),
        ([1, 3, 5], 0, None, "input_row_offsets[0]=1, expected 0"),
        ([0, 4, 3], 0, None, "request 1: input_row_offsets[2]=3 <"
         " input_row_offsets[1]=4"),
        ([0, 3, 5], 2, None, "layer_idx must be < num_layers=2, got 2"),
        ([0, 3, 5], 0, 1, "kpool must be the cache's kpool=4, got 1"),
    ],
)  # fmt: skip
def test_check_index_metadata_names_each_field(offsets, layer, kpool, message):
    total = max(offsets)
    with pytest.raises(ValueError, match=_message(message)):
        mla_kpool.check_index_metadata(
            offsets, index_call()["cache"], layer, total_tokens=total,
            kpool=kpool,
        )  # fmt: skip


# --------------------------------------------------------------------------
# The small things
# --------------------------------------------------------------------------


def test_tolerance_of_an_unsupported_dtype_says_which_it_takes():
    with pytest.raises(
        ValueError,
        match="dtype must be one of float32, float16, bfloat16, got int8",
    ):
        tolerance(np.int8)


def test_dir_shows_the_api_not_the_standard_library():
    names = set(dir(mla_kpool))
    assert not names & {"tomllib", "annotations", "Any"}
    assert set(mla_kpool.__all__) - {"index_top_k"} <= names


def test_no_accelerator_gives_maxs_hint_once(monkeypatch):
    hint = "To get more accurate error information, set MODULAR_DEBUG=x."
    said = (
        'failed to create device: No supported "gpu" device available.\n'
        f"  CUDA information: none\n{hint}\n{hint}\n{hint}\n"
        f"  HIP information: none\n{hint}\n{hint}\n{hint}"
    )

    def no_gpu():
        raise ValueError(said)

    monkeypatch.setattr(runner_module.driver, "Accelerator", no_gpu)
    with pytest.raises(ValueError) as error:
        Runner("gpu")
    text = str(error.value)
    assert text.startswith("device 'gpu' needs an accelerator: failed to")
    assert text.count(hint) == 1
    assert "CUDA information: none" in text and "HIP information" in text

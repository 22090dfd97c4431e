"""Graph-build checks of mla_kpool.index_top_k (no compile).

Each bad operand must fail where the graph is built, with a message that
names it; the good graphs must carry the op with MAX's parameters, and on a
GPU be exactly the graph MAX's own wrapper builds.
"""

from __future__ import annotations

import max.nn  # noqa: F401  (index_top_k imports it; first, as conftest does)
import pytest
from max.dtype import DType
from max.graph import BufferType, DeviceRef, Graph, TensorType
from max.nn.attention.mask_config import MHAMaskVariant
from max.nn.kv_cache import PagedCacheValues

import mla_kpool
from mla_kpool.index_runner import IndexKey, build_graph

GLM_KEY = IndexKey(32, 128, 32, 2, 128, 512, 4, "null")
CPU, GPU = DeviceRef.CPU(), DeviceRef.GPU()
F8, U8, U32 = DType.float8_e4m3fn, DType.uint8, DType.uint32

#: Operand positions in IndexKey.input_types().
Q, QS, OFF, BLOCKS, STRIDE, LENS, TABLE, MP, MC, SCALES, SSTRIDE, STABLE = (
    range(12)
)
LAYER = 12
PAGE = [2, 128, 1]


def _graph(types=None, gpu=False, scales=True, width=None, **kwargs):
    """Builds a graph calling index_top_k; returns it."""
    key = IndexKey(
        **{**GLM_KEY.__dict__, "gpu": gpu, "width": width or GLM_KEY.width}
    )
    all_types = key.input_types()
    for i, t in (types or {}).items():
        all_types[i] = t
    with Graph("index_validation", input_types=all_types) as g:
        v = [
            x.buffer if isinstance(x.type, BufferType) else x.tensor
            for x in g.inputs
        ]
        cache = PagedCacheValues(
            kv_blocks=v[BLOCKS],
            cache_lengths=v[LENS],
            lookup_table=v[TABLE],
            max_prompt_length=v[MP],
            max_cache_length=v[MC],
            page_stride=v[STRIDE],
            kv_scales=v[SCALES] if scales else None,
            scales_page_stride=v[SSTRIDE] if scales else None,
            scales_lookup_table=v[STABLE] if scales else None,
        )
        args = dict(
            top_k=512,
            quantization_granularity=128,
            mask_variant=MHAMaskVariant.NULL_MASK,
            kpool=4,
        )
        args.update(kwargs)
        k_collection = args.pop("k_collection", cache)
        out = mla_kpool.index_top_k(
            v[Q], v[QS], v[OFF], k_collection, v[LAYER], **args
        )
        g.output(out)
    return g


def _t(dtype, shape, device=CPU):
    return TensorType(dtype, shape, device)


def _b(dtype, shape, device=CPU):
    return BufferType(dtype, shape, device)


BAD = [
    # (id, input types, keyword arguments, error, message)
    (
        "q-f32",
        {Q: _t(DType.float32, ["T", 32, 128])},
        {},
        ValueError,
        "q dtype must be uint8",
    ),
    (
        "q-fp8-on-cpu",
        {Q: _t(F8, ["T", 32, 128])},
        {},
        ValueError,
        "q dtype must be uint8",
    ),
    ("q-rank", {Q: _t(U8, ["T", 4096])}, {}, ValueError, "q must be rank 3"),
    (
        "q-dynamic-heads",
        {Q: _t(U8, ["T", "H", 128])},
        {},
        ValueError,
        "q must have a static dim 1",
    ),
    (
        "qs-heads",
        {QS: _t(DType.float32, ["T", 16])},
        {},
        ValueError,
        r"q_s must be \[T, num_heads\]",
    ),
    (
        "qs-tokens",
        {QS: _t(DType.float32, [3, 32]), Q: _t(U8, [4, 32, 128])},
        {},
        ValueError,
        "q_s must be",
    ),
    (
        "qs-dtype",
        {QS: _t(DType.bfloat16, ["T", 32])},
        {},
        ValueError,
        "q_s dtype must be float32",
    ),
    (
        "offsets-dtype",
        {OFF: _t(DType.int32, ["B1"])},
        {},
        ValueError,
        "input_row_offsets dtype must be uint32",
    ),
    (
        "blocks-tensor",
        {BLOCKS: _t(U8, ["n", 1, *PAGE, 32])},
        {},
        TypeError,
        "k_collection.kv_blocks must be a max.graph.BufferValue",
    ),
    (
        "blocks-dtype",
        {BLOCKS: _b(DType.float32, ["n", 1, *PAGE, 32])},
        {},
        ValueError,
        "k_collection.kv_blocks dtype must be uint8",
    ),
    (
        "blocks-rank",
        {BLOCKS: _b(U8, ["n", 2, 128, 32])},
        {},
        ValueError,
        "kv_blocks must be rank 6",
    ),
    (
        "blocks-kv-axis",
        {BLOCKS: _b(U8, ["n", 2, *PAGE, 32])},
        {},
        ValueError,
        r"kv_blocks must be \[num_blocks, 1",
    ),
    (
        "width",
        {BLOCKS: _b(U8, ["n", 1, *PAGE, 16])},
        {},
        ValueError,
        "row width W must be depth=128",
    ),
    (
        "width-dynamic",
        {BLOCKS: _b(U8, ["n", 1, *PAGE, "W"])},
        {},
        ValueError,
        "static dim 5",
    ),
    (
        "spread-page",
        {
            BLOCKS: _b(U8, ["n", 1, 2, 126, 1, 32]),
            SCALES: _b(DType.float32, ["s", 1, 2, 126, 1, 1]),
        },
        {},
        ValueError,
        "page_size must be a multiple of kpool=4",
    ),
    (
        "scales-layers",
        {SCALES: _b(DType.float32, ["s", 1, 3, 128, 1, 1])},
        {},
        ValueError,
        "kv_scales must be",
    ),
    (
        "scales-dtype",
        {SCALES: _b(DType.bfloat16, ["s", 1, *PAGE, 1])},
        {},
        ValueError,
        "kv_scales dtype must be float32",
    ),
    (
        "stride-dtype",
        {STRIDE: _t(DType.int32, [1])},
        {},
        ValueError,
        "page_stride dtype must be int64",
    ),
    (
        "lengths-dtype",
        {LENS: _t(DType.int64, ["B"])},
        {},
        ValueError,
        "cache_lengths dtype must be uint32",
    ),
    (
        "table-rank",
        {TABLE: _t(U32, ["B"])},
        {},
        ValueError,
        "lookup_table must be rank 2",
    ),
    (
        "batch",
        {OFF: _t(U32, [5]), LENS: _t(U32, [3])},
        {},
        ValueError,
        "input_row_offsets dim 0 must be B \\+ 1",
    ),
    (
        "scale-table-batch",
        {STABLE: _t(U32, [2, "p"]), LENS: _t(U32, [3])},
        {},
        ValueError,
        "scales_lookup_table dim 0 must be B",
    ),
    (
        "max-length-rank",
        {MP: _t(U32, [1, 1])},
        {},
        ValueError,
        "max_prompt_length must be a scalar or",
    ),
    (
        "layer-dtype",
        {LAYER: _t(DType.int32, [])},
        {},
        ValueError,
        "layer_idx dtype must be uint32",
    ),
    ("top-k-0", {}, {"top_k": 0}, ValueError, "top_k must be in 1..2048"),
    ("top-k-2049", {}, {"top_k": 2049}, ValueError, "top_k must be in 1..2048"),
    ("top-k-str", {}, {"top_k": "8"}, TypeError, "top_k must be an int"),
    ("kpool-0", {}, {"kpool": 0}, ValueError, "kpool must be at least 1"),
    (
        "granularity",
        {},
        {"quantization_granularity": 1.5},
        TypeError,
        "quantization_granularity must be an int",
    ),
    (
        "mask",
        {},
        {"mask_variant": MHAMaskVariant.CHUNKED_CAUSAL_MASK},
        ValueError,
        "mask_variant must be 'causal', 'null', MHAMaskVariant.CAUSAL_MASK"
        " or MHAMaskVariant.NULL_MASK, got <MHAMaskVariant.CHUNKED",
    ),
    (
        "mask-str",
        {},
        {"mask_variant": "sliding"},
        ValueError,
        "mask_variant must be 'causal', 'null', .* got 'sliding'",
    ),
    (
        "layer-rank",
        {LAYER: _t(U32, [1])},
        {},
        ValueError,
        r"layer_idx must be a scalar, got rank 1 \[1\]",
    ),
    (
        "collection",
        {},
        {"k_collection": object()},
        TypeError,
        "k_collection must be a max.nn.kv_cache.PagedCacheValues",
    ),
]


@pytest.mark.parametrize(
    "types, kwargs, error, match",
    [pytest.param(*case[1:], id=case[0]) for case in BAD],
)
def test_bad_operands_fail_at_graph_build(types, kwargs, error, match):
    with pytest.raises(error, match=match):
        _graph(types, **kwargs)


def test_missing_scales_fail_at_graph_build():
    with pytest.raises(ValueError, match="k_collection.kv_scales must be set"):
        _graph(scales=False)


def test_gpu_operands_must_be_fp8_and_on_the_gpu():
    with pytest.raises(ValueError, match="float8_e4m3fn on a GPU"):
        _graph({Q: _t(U8, ["T", 32, 128], GPU)}, gpu=True)
    with pytest.raises(ValueError, match="q_s must be on gpu"):
        _graph({QS: _t(DType.float32, ["T", 32], CPU)}, gpu=True)
    with pytest.raises(ValueError, match="page_stride must be on cpu"):
        _graph({STRIDE: _t(DType.int64, [1], GPU)}, gpu=True)


@pytest.mark.parametrize("gpu", [False, True], ids=["cpu", "gpu"])
def test_mask_strings_build_the_graph_the_variants_build(monkeypatch, gpu):
    _arch(monkeypatch, "sm_100a")  # on a GPU: MAX's op, given the variant
    graphs = []
    for text, variant in (
        ("null", MHAMaskVariant.NULL_MASK),
        ("causal", MHAMaskVariant.CAUSAL_MASK),
    ):
        graphs.append(str(_graph(gpu=gpu, mask_variant=text)))
        assert graphs[-1] == str(_graph(gpu=gpu, mask_variant=variant))
    assert graphs[0] != graphs[1]  # the string picked the mask


def test_cpu_graph_carries_the_op_with_maxs_parameters():
    text = str(_graph())
    assert "mla_kpool.index_top_k" in text
    for name in ("num_heads", "depth", "quantization_granularity", "mask_str"):
        assert name in text


def _arch(monkeypatch, arch: str | None) -> None:
    """Makes the wrapper see a GPU of ``arch`` (``None``: no accelerator)."""
    from max import driver

    def name() -> str:
        if arch is None:
            raise ValueError("Not implemented for device: cpu")
        return arch

    monkeypatch.setattr(driver, "accelerator_architecture_name", name)


@pytest.mark.parametrize(
    "arch, kpool", [("sm_100a", 4), ("gfx950", 4), ("sm_90a", 1), (None, 1)]
)
def test_gpu_graph_is_maxs_own_where_max_scores(monkeypatch, arch, kpool):
    # Where MAX scores the shape, the wrapper adds MAX's builtin op exactly
    # as MAX does.
    from max.nn.kernels import mla_fp8_index_top_k

    _arch(monkeypatch, arch)
    width = 128 if kpool == 1 else None  # kpool 1: one key per row
    ours = str(_graph(gpu=True, kpool=kpool, width=width))
    monkeypatch.setattr(mla_kpool, "index_top_k", mla_fp8_index_top_k)
    theirs = str(_graph(gpu=True, kpool=kpool, width=width))
    assert "mo.mla.indexer.ragged.float8.paged" in ours
    assert ours == theirs


@pytest.mark.parametrize("arch", ["sm_90a", "sm_80", "gfx942", None])
def test_gpu_graph_takes_our_op_where_max_has_no_pooled_scorer(
    monkeypatch, arch
):
    _arch(monkeypatch, arch)
    text = str(_graph(gpu=True, kpool=4))
    assert "mla_kpool.index_top_k" in text
    assert "mo.mla.indexer.ragged.float8.paged" not in text


@pytest.mark.parametrize(
    "scorer, error, match",
    [
        (
            "tensor",
            ValueError,
            r"scorer must be one of auto, simt, wgmma, mfma",
        ),
        (3, TypeError, r"scorer must be a str, got int"),
        ("wgmma", ValueError, r"scorer 'wgmma' runs on an sm_90 GPU"),
        ("mfma", ValueError, r"scorer 'mfma' runs on a gfx942 GPU"),
    ],
)
def test_a_scorer_the_cpu_cannot_run_fails_at_graph_build(scorer, error, match):
    with pytest.raises(error, match=match):
        _graph(scorer=scorer)


@pytest.mark.parametrize("scorer", ["wgmma", "mfma"])
def test_the_cpu_scorer_error_suggests_what_works(scorer):
    with pytest.raises(ValueError, match="emulate_gpu=True") as refused:
        _graph(scorer=scorer)
    assert "Runner('gpu-emulated')" in str(refused.value)
    # The op's own keyword, as the message gives it, builds the graph ...
    text = str(_graph(scorer=scorer, emulate_gpu=True))
    assert f'scorer = "{scorer}"' in text
    assert "emulate_gpu = true" in text
    # ... and so does the runner's device (its graph, not compiled here).
    fields = {**GLM_KEY.__dict__, "scorer": scorer, "emulate_gpu": True}
    key = IndexKey(**fields)
    assert f'scorer = "{scorer}"' in str(build_graph(key, []))


@pytest.mark.parametrize(
    "arch, scorer, ok",
    [
        ("sm_90a", "wgmma", True),
        ("sm_100a", "wgmma", False),
        ("gfx942", "mfma", True),
        ("sm_90a", "mfma", False),
        ("gfx950", "simt", True),
        (None, "wgmma", True),  # no GPU answers: the op checks its target
    ],
)
def test_a_gpu_scorer_is_checked_against_the_gpu(monkeypatch, arch, scorer, ok):
    _arch(monkeypatch, arch)
    if not ok:
        with pytest.raises(ValueError, match=f"this GPU is {arch}"):
            _graph(gpu=True, scorer=scorer)
        return
    text = str(_graph(gpu=True, scorer=scorer))
    # A named scorer runs this package's op, the scorer among its parameters.
    assert "mla_kpool.index_top_k" in text
    assert f'scorer = "{scorer}"' in text


def test_a_tensor_scorer_refuses_a_depth_past_its_tiles(monkeypatch):
    _arch(monkeypatch, "sm_90a")
    key = IndexKey(32, 512, 128, 2, 128, 512, 4, "null", gpu=True)
    with Graph("deep", input_types=key.input_types()) as g:
        v = [
            x.buffer if isinstance(x.type, BufferType) else x.tensor
            for x in g.inputs
        ]
        from mla_kpool._index_op import add_op, check_operands

        operands = check_operands(
            *v, top_k=512, quantization_granularity=128, mask_str="null",
            kpool=4, prefix="",
        )  # fmt: skip
        with pytest.raises(ValueError, match="takes depth up to 256, got 512"):
            add_op(operands, scorer="wgmma")
        add_op(operands, scorer="simt")  # the FP32 scorer takes any depth


def test_the_default_scorer_leaves_the_graph_as_before(monkeypatch):
    _arch(monkeypatch, "sm_90a")
    assert "scorer" not in str(_graph(gpu=True))

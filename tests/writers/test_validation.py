"""Graph-build validation of the op wrappers (docs/ops.md, build-time checks).

Every rejected case builds a graph whose operands are all good except one,
calls each wrapper that takes that operand, and checks the exception type and
that the message starts with the operand's name. Nothing here compiles or runs
a kernel: the checks raise before any op is created.

The acceptance tests build graphs too, without ``custom_extensions``: the
wrappers load this package's kernels into each graph (precompiled once per
process), and adding a custom op only verifies its signature, so nothing
here compiles a model.
"""

from __future__ import annotations

import functools
import inspect
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pytest
from max.dtype import DType
from max.graph import BufferType, DeviceRef, Dim, Graph, TensorType

import mla_kpool

CPU = DeviceRef.CPU()
GPU = DeviceRef.GPU()
HEAD_DIM = 16
KPOOL = 4


def tensor(dtype: DType, shape: list[Any], device: DeviceRef = CPU):
    return TensorType(dtype, shape, device=device)


def good_operands(dtype: DType = DType.float32) -> dict[str, Any]:
    """Valid operands with symbolic batch and token dims."""
    return {
        "tail": BufferType(
            dtype, ["max_slots", 2, KPOOL, HEAD_DIM], device=CPU
        ),
        "k": tensor(dtype, ["total_tokens", HEAD_DIM]),
        "gate": tensor(dtype, ["total_tokens", HEAD_DIM]),
        "ape": tensor(DType.float32, [KPOOL, HEAD_DIM]),
        "input_row_offsets": tensor(DType.uint32, ["offsets_len"]),
        "pool_row_offsets": tensor(DType.uint32, ["pool_offsets_len"]),
        "cache_lengths": tensor(DType.uint32, ["batch"]),
        "slot_idx": tensor(DType.uint32, ["batch"]),
    }


OPS = {
    "ring_close": mla_kpool.ring_close,
    "compress": mla_kpool.compress,
    "seed_tail": mla_kpool.seed_tail,
    "pool_row_offsets": mla_kpool.pool_row_offsets,
    "kpool_step": mla_kpool.kpool_step,
    # The three-op form of the step checks the same operands the same way.
    "kpool_step3": functools.partial(mla_kpool.kpool_step, fused=False),
}


def op_params(op: str) -> list[str]:
    """The wrapper's positional parameters (MAX's signature), in order."""
    return [
        name
        for name, p in inspect.signature(OPS[op]).parameters.items()
        if p.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD
    ]


def call_op(
    op: str, operands: Mapping[str, Any], kpool: Any = KPOOL, **keywords: Any
):
    """Builds a graph from ``operands`` and calls ``op`` inside it.

    Graph types become graph inputs; anything else (a NumPy array, a
    tensor where a buffer belongs) is passed to the op as it is.
    """
    names = [n for n in op_params(op) if n != "kpool"]
    types = {
        n: operands[n]
        for n in names
        if isinstance(operands[n], TensorType | BufferType)
    }
    with Graph(f"validate_{op}", input_types=list(types.values())) as graph:
        inputs = dict(zip(types, graph.inputs, strict=True))
        args = []
        for name in names:
            if name not in inputs:
                args.append(operands[name])
            elif isinstance(types[name], BufferType):
                args.append(inputs[name].buffer)
            else:
                args.append(inputs[name].tensor)
        return OPS[op](*args, kpool, **keywords), graph


@dataclass(frozen=True)
class Reject:
    """One bad operand (or kpool) and what the wrappers must raise."""

    id: str
    arg: str
    error: type[Exception]
    overrides: Mapping[str, Any] = field(default_factory=dict)
    kpool: Any = KPOOL
    #: Ops this case applies to; by default every op taking ``arg``.
    only: tuple[str, ...] = ()

    def ops(self) -> list[str]:
        if self.only:
            return list(self.only)
        return [op for op in OPS if self.arg in op_params(op)]


F32, BF16, F16 = DType.float32, DType.bfloat16, DType.float16
U32 = DType.uint32

REJECTS = [
    # kpool
    Reject("kpool_zero", "kpool", ValueError, kpool=0),
    Reject("kpool_negative", "kpool", ValueError, kpool=-4),
    Reject("kpool_float", "kpool", TypeError, kpool=4.0),
    Reject("kpool_bool", "kpool", TypeError, kpool=True),
    # k
    Reject("k_numpy", "k", TypeError, {"k": np.zeros((8, HEAD_DIM))}),
    Reject("k_rank3", "k", ValueError, {"k": tensor(F32, [8, 2, HEAD_DIM])}),
    Reject("k_rank1", "k", ValueError, {"k": tensor(F32, [8])}),
    Reject(
        "k_symbolic_head_dim", "k", ValueError, {"k": tensor(F32, [8, "hd"])}
    ),
    Reject(
        "k_float64",
        "k",
        ValueError,
        {
            "k": tensor(DType.float64, [8, HEAD_DIM]),
            "gate": tensor(DType.float64, [8, HEAD_DIM]),
        },
    ),
    Reject(
        "k_int32",
        "k",
        ValueError,
        {
            "k": tensor(DType.int32, [8, HEAD_DIM]),
            "gate": tensor(DType.int32, [8, HEAD_DIM]),
        },
    ),
    # gate
    Reject("gate_numpy", "gate", TypeError, {"gate": np.zeros((8, HEAD_DIM))}),
    Reject("gate_rank1", "gate", ValueError, {"gate": tensor(F32, [8])}),
    Reject(
        "gate_head_dim",
        "gate",
        ValueError,
        {"gate": tensor(F32, ["total_tokens", 2 * HEAD_DIM])},
    ),
    Reject(
        "gate_static_tokens",
        "gate",
        ValueError,
        {"k": tensor(F32, [8, HEAD_DIM]), "gate": tensor(F32, [9, HEAD_DIM])},
    ),
    Reject(
        "gate_dtype",
        "gate",
        ValueError,
        {"gate": tensor(BF16, ["total_tokens", HEAD_DIM])},
    ),
    # tail
    Reject(
        "tail_tensor",
        "tail",
        TypeError,
        {"tail": tensor(F32, [8, 2, KPOOL, HEAD_DIM])},
    ),
    Reject("tail_numpy", "tail", TypeError, {"tail": np.zeros((8, 2, 4, 16))}),
    Reject(
        "tail_rank3",
        "tail",
        ValueError,
        {"tail": BufferType(F32, [8, KPOOL, HEAD_DIM], device=CPU)},
    ),
    Reject(
        "tail_three_planes",
        "tail",
        ValueError,
        {"tail": BufferType(F32, [8, 3, KPOOL, HEAD_DIM], device=CPU)},
    ),
    Reject(
        "tail_ring_not_multiple",
        "tail",
        ValueError,
        {"tail": BufferType(F32, [8, 2, 6, HEAD_DIM], device=CPU)},
    ),
    Reject(
        "tail_ring_short",
        "tail",
        ValueError,
        {"tail": BufferType(F32, [8, 2, KPOOL - 1, HEAD_DIM], device=CPU)},
    ),
    Reject(
        "tail_ring_zero",
        "tail",
        ValueError,
        {"tail": BufferType(F32, [8, 2, 0, HEAD_DIM], device=CPU)},
    ),
    Reject(
        "tail_ring_symbolic",
        "tail",
        ValueError,
        {"tail": BufferType(F32, [8, 2, "ring", HEAD_DIM], device=CPU)},
    ),
    Reject(
        "tail_head_dim",
        "tail",
        ValueError,
        {"tail": BufferType(F32, [8, 2, KPOOL, 2 * HEAD_DIM], device=CPU)},
    ),
    Reject(
        "tail_dtype",
        "tail",
        ValueError,
        {"tail": BufferType(F16, [8, 2, KPOOL, HEAD_DIM], device=CPU)},
    ),
    # ape
    Reject("ape_numpy", "ape", TypeError, {"ape": np.zeros((KPOOL, HEAD_DIM))}),
    Reject("ape_rank1", "ape", ValueError, {"ape": tensor(F32, [HEAD_DIM])}),
    Reject(
        "ape_rows",
        "ape",
        ValueError,
        {"ape": tensor(F32, [KPOOL + 1, HEAD_DIM])},
    ),
    Reject("ape_head_dim", "ape", ValueError, {"ape": tensor(F32, [KPOOL, 8])}),
    Reject(
        "ape_symbolic_rows",
        "ape",
        ValueError,
        {"ape": tensor(F32, ["kp", HEAD_DIM])},
    ),
    Reject(
        "ape_bfloat16",
        "ape",
        ValueError,
        {"ape": tensor(BF16, [KPOOL, HEAD_DIM])},
    ),
    # index tensors: kind, rank, dtype
    *[
        case
        for name, extent in [
            ("input_row_offsets", "offsets_len"),
            ("pool_row_offsets", "pool_offsets_len"),
            ("cache_lengths", "batch"),
            ("slot_idx", "batch"),
        ]
        for case in [
            Reject(
                f"{name}_numpy", name, TypeError, {name: np.zeros(3, np.uint32)}
            ),
            Reject(
                f"{name}_rank2",
                name,
                ValueError,
                {name: tensor(U32, [extent, 1])},
            ),
            Reject(
                f"{name}_float32",
                name,
                ValueError,
                {name: tensor(F32, [extent])},
            ),
            Reject(
                f"{name}_int8",
                name,
                ValueError,
                {name: tensor(DType.int8, [extent])},
            ),
            Reject(
                f"{name}_gpu",
                name,
                ValueError,
                {name: tensor(U32, [extent], device=GPU)},
                only=tuple(
                    op
                    for op in OPS
                    # pool_row_offsets() checks devices against cache_lengths
                    if name in op_params(op) and op != "pool_row_offsets"
                ),
            ),
        ]
    ],
    # devices
    Reject(
        "gate_gpu",
        "gate",
        ValueError,
        {"gate": tensor(F32, ["total_tokens", HEAD_DIM], device=GPU)},
    ),
    Reject(
        "ape_gpu",
        "ape",
        ValueError,
        {"ape": tensor(F32, [KPOOL, HEAD_DIM], device=GPU)},
    ),
    Reject(
        "tail_gpu",
        "tail",
        ValueError,
        {"tail": BufferType(F32, [8, 2, KPOOL, HEAD_DIM], device=GPU)},
    ),
    Reject(
        "helper_offsets_gpu",
        "input_row_offsets",
        ValueError,
        {"input_row_offsets": tensor(U32, ["offsets_len"], device=GPU)},
        only=("pool_row_offsets",),
    ),
    # batch sizes that provably disagree
    Reject(
        "offsets_static_batch",
        "input_row_offsets",
        ValueError,
        {
            "input_row_offsets": tensor(U32, [5]),
            "cache_lengths": tensor(U32, [3]),
            "slot_idx": tensor(U32, [3]),
        },
    ),
    Reject(
        "offsets_same_symbol_as_batch",
        "input_row_offsets",
        ValueError,
        {"input_row_offsets": tensor(U32, ["batch"])},
    ),
    Reject(
        "slot_idx_static_batch",
        "slot_idx",
        ValueError,
        {"cache_lengths": tensor(U32, [3]), "slot_idx": tensor(U32, [4])},
    ),
    Reject(
        "slot_idx_batch_plus_one",
        "slot_idx",
        ValueError,
        {"slot_idx": tensor(U32, [Dim("batch") + 1])},
    ),
    Reject(
        "pool_offsets_static_batch",
        "pool_row_offsets",
        ValueError,
        {
            "pool_row_offsets": tensor(U32, [3]),
            "cache_lengths": tensor(U32, [3]),
        },
    ),
]


@pytest.mark.parametrize(
    ("case", "op"),
    [
        pytest.param(case, op, id=f"{case.id}-{op}")
        for case in REJECTS
        for op in case.ops()
    ],
)
def test_rejects(case: Reject, op: str) -> None:
    operands = {**good_operands(), **case.overrides}
    with pytest.raises(case.error) as excinfo:
        call_op(op, operands, case.kpool)
    message = str(excinfo.value)
    assert message.startswith(f"{case.arg} "), message


@pytest.mark.parametrize(
    "dtype", [DType.int8, DType.uint16, DType.float32], ids=lambda d: d.name
)
def test_index_dtype_message_names_the_accepted_dtypes(dtype: DType) -> None:
    """int8 is an integer too: the message lists what the kernels read."""
    operands = {**good_operands(), "slot_idx": tensor(dtype, ["batch"])}
    with pytest.raises(ValueError) as excinfo:
        call_op("ring_close", operands)
    assert str(excinfo.value) == (
        "slot_idx dtype must be one of uint32, int32, int64, uint64, got"
        f" {dtype.name}"
    )


def test_tail_message_format() -> None:
    operands = {
        **good_operands(),
        "k": tensor(F32, [8, 128]),
        "gate": tensor(F32, [8, 128]),
        "ape": tensor(F32, [KPOOL, 128]),
        "tail": BufferType(F32, [8, 2, 6, 128], device=CPU),
    }
    with pytest.raises(ValueError) as excinfo:
        call_op("ring_close", operands)
    message = str(excinfo.value)
    assert message.startswith("tail must be [max_slots, 2, kpool=4"), message
    assert "head_dim=128]" in message
    assert message.endswith("got [8, 2, 6, 128]"), message


# --------------------------------------------------------------------------
# Acceptance: good operands build one custom op with the documented types.
# --------------------------------------------------------------------------


def custom_ops(graph: Graph) -> list[str]:
    return re.findall(
        r'symbol = "((?:mo\.mla\.kpool|mla_kpool)\.\w+)"', str(graph)
    )


@pytest.mark.parametrize("dtype", [F32, BF16, F16], ids=lambda d: d.name)
@pytest.mark.parametrize(
    "index_dtype",
    [DType.uint32, DType.int32, DType.int64, DType.uint64],
    ids=lambda d: d.name,
)
def test_accepts_dtypes(dtype: DType, index_dtype: DType) -> None:
    operands = good_operands(dtype)
    for name in ("input_row_offsets", "pool_row_offsets"):
        operands[name] = tensor(index_dtype, [3])
    for name in ("cache_lengths", "slot_idx"):
        operands[name] = tensor(index_dtype, [2])

    (pooled, closed), graph = call_op("ring_close", operands)
    assert custom_ops(graph) == ["mo.mla.kpool.ring_close"]
    assert (pooled.dtype, list(pooled.shape)) == (dtype, [2, HEAD_DIM])
    assert (closed.dtype, list(closed.shape)) == (DType.int32, [2])

    pooled, graph = call_op("compress", operands)
    assert custom_ops(graph) == ["mo.mla.kpool.compress"]
    assert pooled.dtype == dtype
    assert pooled.shape[1] == HEAD_DIM

    result, graph = call_op("seed_tail", operands)
    assert result is None
    assert custom_ops(graph) == ["mo.mla.kpool.seed_tail"]


@pytest.mark.parametrize("ring", [KPOOL, 2 * KPOOL, 3 * KPOOL])
def test_accepts_ring_multiple_of_kpool(ring: int) -> None:
    operands = {
        **good_operands(),
        "tail": BufferType(F32, ["max_slots", 2, ring, HEAD_DIM], device=CPU),
    }
    call_op("ring_close", operands)
    call_op("seed_tail", operands)


def test_accepts_kpool_one_and_numpy_int() -> None:
    operands = {**good_operands(), "ape": tensor(F32, [1, HEAD_DIM])}
    operands["tail"] = BufferType(F32, [4, 2, 1, HEAD_DIM], device=CPU)
    call_op("ring_close", operands, kpool=1)
    call_op("ring_close", good_operands(), kpool=np.int64(KPOOL))


def test_compress_rows_are_an_upper_bound() -> None:
    operands = {
        **good_operands(),
        "k": tensor(F32, [10, HEAD_DIM]),
        "gate": tensor(F32, [10, HEAD_DIM]),
    }
    pooled, _ = call_op("compress", operands)
    assert list(pooled.shape) == [10 // KPOOL, HEAD_DIM]


def test_parameters_are_head_dim_and_kpool() -> None:
    _, graph = call_op("compress", good_operands())
    assert f"head_dim = {HEAD_DIM} : index, kpool = {KPOOL} : index" in str(
        graph
    )
    # What MAX's own wrappers pass, nothing more: the CPU kernel runs.
    assert "emulate_gpu" not in str(graph)


#: The fused step is left out here: staging it needs the kernels loaded
#: (``test_step_fused.py`` checks its parameters); it is checked for its
#: operand device below, which raises before the op is staged.
EMULATED_OPS = ["ring_close", "compress", "seed_tail", "kpool_step3"]


@pytest.mark.parametrize("op", EMULATED_OPS)
def test_emulate_gpu_is_a_parameter_of_every_custom_op(op: str) -> None:
    _, graph = call_op(op, good_operands(), emulate_gpu=True)
    text = str(graph)
    ops = re.findall(r'"mo\.custom".*symbol = "', text)
    assert ops, text
    emulated = re.findall(
        r'"mo\.custom".*parameters = \{[^}]*emulate_gpu = true[^}]*\}', text
    )
    assert len(emulated) == len(ops), text


@pytest.mark.parametrize("op", [*EMULATED_OPS, "kpool_step"])
def test_emulate_gpu_needs_cpu_operands(op: str) -> None:
    on_gpu = {
        name: (
            BufferType(t.dtype, t.shape, device=GPU)
            if isinstance(t, BufferType)
            else tensor(t.dtype, t.shape, GPU)
        )
        for name, t in good_operands().items()
    }
    with pytest.raises(ValueError, match="^emulate_gpu .* on the CPU, got gpu"):
        call_op(op, on_gpu, emulate_gpu=True)
    with pytest.raises(TypeError, match="^emulate_gpu must be a bool, got int"):
        call_op(op, good_operands(), emulate_gpu=1)


def test_kpool_step_orders_ring_close_before_seed_tail() -> None:
    step, graph = call_op("kpool_step3", good_operands())
    text = str(graph)
    assert custom_ops(graph) == [
        "mo.mla.kpool.ring_close",
        "mo.mla.kpool.compress",
        "mo.mla.kpool.seed_tail",
    ]
    # seed_tail consumes the chain that ring_close produces (its last
    # result), which is what stops the compiler from reordering them.
    lines = text.splitlines()
    ring = next(line for line in lines if "kpool.ring_close" in line)
    seed = next(line for line in lines if "kpool.seed_tail" in line)
    chain = re.match(r"\s*(%\d+):3 = ", ring)
    assert chain, ring
    assert f"{chain.group(1)}#2)" in seed, text

    assert isinstance(step, mla_kpool.KPoolStep)
    assert list(step.ring_pooled.shape) == ["batch", HEAD_DIM]
    assert step.ring_closed_pool.dtype == DType.int32
    assert step.pool_row_offsets.dtype == DType.uint32
    assert list(step.pool_row_offsets.shape) == [
        good_operands()["cache_lengths"].shape[0] + 1
    ]
    assert step.first_pool.dtype == DType.int64
    assert list(step.first_pool.shape) == ["batch"]


def test_fused_kpool_step_loads_the_kernels_it_needs() -> None:
    """MAX has no builtin ``mla_kpool.step``; the wrapper loads KERNELS."""
    step, graph = call_op("kpool_step", good_operands())
    assert custom_ops(graph) == ["mla_kpool.step"]
    assert len(graph.kernel_libraries_paths) == 1
    assert isinstance(step, mla_kpool.KPoolStep)


# --------------------------------------------------------------------------
# Static batch sizes that disagree while cache_lengths is symbolic
# --------------------------------------------------------------------------
# The cases above compare each tensor against ``cache_lengths``. What that
# misses is two per-request tensors whose *static* lengths disagree with
# each other while ``cache_lengths`` has a symbolic length:
# ``input_row_offsets`` ``[5]`` next to ``slot_idx`` ``[3]`` cannot both be
# right for any batch, yet neither is provably different from ``batch + 1``
# / ``batch`` alone. Unchecked, such a graph would build and fail only when
# it runs.


@dataclass(frozen=True)
class Disagree:
    """Per-request tensors whose static lengths cannot all be right."""

    id: str
    ops: tuple[str, ...]
    overrides: dict[str, Any]
    #: Either name may be the one the message starts with.
    names: tuple[str, ...]


CASES = [
    Disagree(
        "offsets_5_slots_3",
        ("ring_close", "seed_tail", "kpool_step"),
        {
            "input_row_offsets": tensor(U32, [5]),
            "slot_idx": tensor(U32, [3]),
        },
        ("input_row_offsets", "slot_idx"),
    ),
    Disagree(
        "offsets_4_pool_offsets_5",
        ("compress",),
        {
            "input_row_offsets": tensor(U32, [4]),
            "pool_row_offsets": tensor(U32, [5]),
        },
        ("input_row_offsets", "pool_row_offsets"),
    ),
]


@pytest.mark.parametrize(
    ("case", "op"),
    [
        pytest.param(case, op, id=f"{case.id}-{op}")
        for case in CASES
        for op in case.ops
    ],
)
def test_rejects_static_lengths_that_disagree(case: Disagree, op: str) -> None:
    operands = {**good_operands(), **case.overrides}
    # cache_lengths keeps its symbolic ["batch"] from good_operands().
    try:
        call_op(op, operands)
    except ValueError as error:
        message = str(error)
        assert message.startswith(tuple(f"{n} " for n in case.names)), message
        return
    raise AssertionError(f"{op} accepted {case.id}")


@pytest.mark.parametrize(
    ("op", "overrides"),
    [
        pytest.param(
            "ring_close",
            {
                "input_row_offsets": tensor(U32, [4]),
                "slot_idx": tensor(U32, [3]),
            },
            id="ring_close-offsets_4_slots_3",
        ),
        pytest.param(
            "compress",
            {
                "input_row_offsets": tensor(U32, [4]),
                "pool_row_offsets": tensor(U32, [4]),
            },
            id="compress-offsets_4_pool_offsets_4",
        ),
    ],
)
def test_accepts_static_lengths_that_agree(
    op: str, overrides: dict[str, Any]
) -> None:
    call_op(op, {**good_operands(), **overrides})

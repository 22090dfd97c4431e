"""Run-time operand shape checks: each op names the operand it rejects.

The graph functions reject bad shapes before a graph is built
(tests/writers/test_validation.py). A graph that calls the ops another way, with
``ops.custom`` over dynamic dimensions as here, reaches the ops' own checks
at run time: the error must name the op, the operand, the shape it must
have and the one it got, and the model must keep working afterwards.
``tests/mojo/test_operands.mojo`` unit-tests the message format for every
kind of dimension.
"""

from __future__ import annotations

import re
from typing import Any

import numpy as np
import pytest
from max.driver import CPU
from max.dtype import DType
from max.engine import InferenceSession
from max.graph import BufferType, DeviceRef, Graph, TensorType, ops

from mla_kpool import reference as ref
from mla_kpool._paths import compiled_kernels
from mla_kpool.buffers import to_buffer, to_numpy
from support.kpool_cases import (
    assert_pooled_close,
    needs_mojo,
    random_ape,
    random_rows,
    run_mojo_suite,
)

KPOOL, HEAD_DIM = 4, 16
F32 = np.float32


@needs_mojo
def test_message_format_in_mojo() -> None:
    run_mojo_suite("tests/mojo/test_operands.mojo")


@pytest.fixture(scope="module")
def ring_close_any_shape() -> Any:
    """``mo.mla.kpool.ring_close`` with every operand dimension dynamic.

    Each operand gets dimensions of its own name, so MAX lets any
    combination through to the op's own check.
    """
    cpu = DeviceRef.CPU()

    def t(dtype: DType, *shape: Any) -> TensorType:
        return TensorType(dtype, list(shape), device=cpu)

    input_types = [
        BufferType(DType.float32, ["slots", "planes", "ring", "hd"], cpu),
        t(DType.float32, "k_rows", "k_cols"),
        t(DType.float32, "gate_rows", "gate_cols"),
        t(DType.float32, "ape_rows", "ape_cols"),
        t(DType.uint32, "offsets"),
        t(DType.uint32, "cached"),
        t(DType.uint32, "batch"),
    ]
    with Graph(
        "ring_close_any_shape",
        input_types=input_types,
        custom_extensions=[compiled_kernels()],
    ) as graph:
        tail, *rest = graph.inputs
        outs = ops.inplace_custom(
            "mo.mla.kpool.ring_close",
            device=cpu,
            values=[tail.buffer, *(v.tensor for v in rest)],
            out_types=[
                t(DType.float32, "batch", HEAD_DIM),
                t(DType.int32, "batch"),
            ],
            parameters={"head_dim": HEAD_DIM, "kpool": KPOOL},
        )
        graph.output(*outs)
    return InferenceSession(devices=[CPU()]).load(graph)


def _good_call(rng: np.random.Generator) -> dict[str, np.ndarray]:
    """Two requests: request 0 closes pool 1 from slot 2, request 1 none."""
    k, gate = random_rows(rng, 6, HEAD_DIM, np.dtype(F32))
    tail = rng.standard_normal((3, 2, KPOOL, HEAD_DIM)).astype(F32)
    return {
        "tail": tail,
        "k": k,
        "gate": gate,
        "ape": random_ape(rng, KPOOL, HEAD_DIM),
        "input_row_offsets": np.array([0, 3, 6], np.uint32),
        "cache_lengths": np.array([5, 8], np.uint32),
        "slot_idx": np.array([2, 0], np.uint32),
    }


#: (operand, bad value from a good call's, the message's tail).
BAD_SHAPES = [
    pytest.param(
        "ape",
        lambda a: np.zeros((8, HEAD_DIM), F32),
        "ape must be [kpool=4, head_dim=16], got [8, 16]",
        id="ape-rows",
    ),
    pytest.param(
        "gate",
        lambda a: a[:5],
        "gate must be [total_tokens=6, head_dim=16], got [5, 16]",
        id="gate-rows",
    ),
    pytest.param(
        "k",
        lambda a: np.zeros((6, 8), F32),
        "k must be [total_tokens, head_dim=16], got [6, 8]",
        id="k-head_dim",
    ),
    pytest.param(
        "tail",
        lambda a: np.zeros((3, 2, 6, HEAD_DIM), F32),
        "tail's ring length (dimension 2) must be a positive multiple of"
        " kpool=4, got 6",
        id="tail-ring_length",
    ),
    pytest.param(
        "tail",
        lambda a: np.zeros((3, 3, KPOOL, HEAD_DIM), F32),
        "tail must be [max_slots, 2, ring_len, head_dim=16], got [3, 3, 4, 16]",
        id="tail-planes",
    ),
    pytest.param(
        "input_row_offsets",
        lambda a: a[:2],
        "input_row_offsets must be [batch + 1=3], got [2]",
        id="offsets-length",
    ),
    pytest.param(
        "cache_lengths",
        lambda a: np.array([5, 8, 0], np.uint32),
        "cache_lengths must be [batch=2], got [3]",
        id="cache_lengths-length",
    ),
]


def _run(model: Any, call: dict[str, np.ndarray]) -> list[np.ndarray]:
    return [to_numpy(o) for o in model.execute(*map(to_buffer, call.values()))]


@pytest.mark.parametrize(("operand", "bad", "message"), BAD_SHAPES)
def test_execute_names_the_operand_and_both_shapes(
    ring_close_any_shape: Any, operand: str, bad: Any, message: str
) -> None:
    rng = np.random.default_rng(7)
    call = _good_call(rng)
    call[operand] = bad(call[operand])
    expected = "mo.mla.kpool.ring_close: " + message
    with pytest.raises(ValueError, match=re.escape(expected)):
        _run(ring_close_any_shape, call)


def test_model_keeps_working_after_a_rejected_call(
    ring_close_any_shape: Any,
) -> None:
    rng = np.random.default_rng(8)
    call = _good_call(rng)
    bad = {**call, "ape": np.zeros((KPOOL + 1, HEAD_DIM), F32)}
    with pytest.raises(ValueError, match="ape must be"):
        _run(ring_close_any_shape, bad)
    pooled, closed = _run(ring_close_any_shape, call)
    want_pooled, want_closed = ref.ring_close(
        call["tail"],
        call["k"],
        call["gate"],
        call["ape"],
        call["input_row_offsets"],
        call["cache_lengths"],
        call["slot_idx"],
        KPOOL,
    )
    np.testing.assert_array_equal(closed, want_closed)
    assert list(closed) == [1, -1]
    scale = max(np.abs(call["k"]).max(), np.abs(call["tail"][:, 0]).max())
    assert_pooled_close(pooled, want_pooled, np.dtype(F32), float(scale))

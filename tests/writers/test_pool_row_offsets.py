"""The ``pool_row_offsets`` graph helper against hand-computed offsets.

The helper is built from MAX's own ops only (no custom kernel), so this runs
without the Mojo package. One graph per (device, kpool), holding the helper
for both index dtypes, is compiled with symbolic lengths and reused for
every case.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np
import pytest
from max.dtype import DType
from max.engine import InferenceSession
from max.graph import DeviceRef, Graph, TensorType

import mla_kpool
from mla_kpool.buffers import to_buffer, to_numpy, to_numpy_dtype


@dataclass(frozen=True)
class Case:
    id: str
    kpool: int
    offsets: tuple[int, ...]
    cache: tuple[int, ...]
    expected: tuple[int, ...]
    signed_only: bool = False


CASES = [
    Case("empty_batch", 4, (0,), (), (0,)),
    Case("one_fresh_request", 4, (0, 10), (0,), (0, 2)),
    # c=3: pool 0 is the ring's (ring_close), pools 1.. are compress's.
    Case("pending_pool_is_not_counted", 4, (0, 10), (3,), (0, 2)),
    Case("decode_steps", 4, (0, 1, 2, 3), (3, 4, 7), (0, 0, 0, 0)),
    Case("aligned_cache", 4, (0, 8, 8, 13), (4, 9, 0), (0, 2, 2, 3)),
    Case("zero_new_tokens", 4, (0, 0, 0), (5, 8), (0, 0, 0)),
    Case("offsets_going_down", 4, (0, 8, 4, 12), (0, 0, 0), (0, 2, 2, 4)),
    # c + n passes 2^32 even though every input fits uint32.
    Case("past_uint32", 4, (0, 8), (2**32 - 2,), (0, 1)),
    Case("negative_cache", 4, (0, 12), (-3,), (0, 0), signed_only=True),
]


#: The index dtypes the helper is checked with, one graph for both.
DTYPES = (DType.uint32, DType.int64)


@functools.cache
def compiled(device: DeviceRef, kpool: int):
    """One model of the helper for each of :data:`DTYPES`.

    One graph, since a graph costs a compile whatever it holds; :func:`run`
    feeds one dtype's inputs and leaves the other an empty batch.
    """
    session = InferenceSession(devices=[device.to_device()])
    with Graph(
        f"pool_row_offsets_{kpool}",
        input_types=[
            TensorType(dtype, [f"{dim}_{dtype.name}"], device=device)
            for dtype in DTYPES
            for dim in ("offsets_len", "batch")
        ],
    ) as graph:
        values = [value.tensor for value in graph.inputs]
        graph.output(
            *(
                mla_kpool.pool_row_offsets(offsets, cache, kpool)
                for offsets, cache in zip(
                    values[::2], values[1::2], strict=True
                )
            )
        )
    return session.load(graph)


def run(device: DeviceRef, driver_device, dtype: DType, kpool, offsets, cache):
    """The helper's offsets for ``dtype`` inputs (the other dtype idle)."""
    inputs = []
    for each in DTYPES:
        np_dtype = to_numpy_dtype(each)
        o, c = (offsets, cache) if each == dtype else ((0,), ())
        inputs += [
            to_buffer(np.array(v, np_dtype), driver_device) for v in (o, c)
        ]
    results = compiled(device, kpool).execute(*inputs)
    return to_numpy(results[DTYPES.index(dtype)])


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_pool_row_offsets(
    case: Case, dtype: DType, device_ref: DeviceRef, driver_device
) -> None:
    if case.signed_only and dtype == DType.uint32:
        pytest.skip("values do not fit uint32")
    got = run(
        device_ref, driver_device, dtype, case.kpool, case.offsets, case.cache
    )
    assert got.dtype == np.uint32
    np.testing.assert_array_equal(got, np.array(case.expected, np.uint32))
    oracle = mla_kpool.reference.pool_row_offsets(
        np.array(case.offsets, np.int64),
        np.array(case.cache, np.int64),
        case.kpool,
    )
    np.testing.assert_array_equal(got, oracle)


def test_rebind_reports_bad_lengths(device_ref: DeviceRef, driver_device):
    """Offsets one entry short fail at run time, not silently."""
    if not device_ref.is_cpu():
        pytest.skip("the error path is only checked on CPU")
    with pytest.raises(Exception, match="batch"):
        run(device_ref, driver_device, DType.uint32, 4, (0, 4), (0, 0))

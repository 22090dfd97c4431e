"""Quickstart: the k-pool step in bfloat16 on the CPU, checked against NumPy.

One graph calls :func:`mla_kpool.kpool_step`; it needs no
``custom_extensions``, because the wrapper loads this package's kernels into
the graph. Two calls run on one ring: a prefill of 6 and 3 tokens, then 2
and 1 more tokens, which close the pools the ring was holding. bfloat16
crosses into and out of MAX with :func:`mla_kpool.buffers.to_buffer` and
:func:`~mla_kpool.buffers.to_numpy` (``Buffer.from_numpy`` and
``Buffer.to_numpy`` reject it). Every output and the ring are compared with
the float64 oracle (:func:`mla_kpool.reference.check_step`).

Run it with ``python examples/quickstart.py``; exit status 0 when
everything matches, 1 otherwise.
"""

from __future__ import annotations

import sys

import ml_dtypes
import numpy as np
from max.driver import CPU
from max.dtype import DType
from max.engine import InferenceSession
from max.graph import BufferType, DeviceRef, Graph, TensorType

import mla_kpool
from mla_kpool import reference
from mla_kpool.buffers import to_buffer, to_numpy
from mla_kpool.calls import CallInputs

KPOOL, HEAD_DIM, MAX_SLOTS = 4, 64, 2
BF16 = ml_dtypes.bfloat16


def build_graph() -> Graph:
    """One ``kpool_step`` over a bfloat16 ring; batch and tokens symbolic."""
    cpu = DeviceRef.CPU()
    rows = TensorType(DType.bfloat16, ["tokens", HEAD_DIM], cpu)
    types = [
        BufferType(DType.bfloat16, ["slots", 2, KPOOL, HEAD_DIM], cpu),
        rows,  # k
        rows,  # gate
        TensorType(DType.float32, [KPOOL, HEAD_DIM], cpu),  # ape
        TensorType(DType.uint32, ["batch_plus_1"], cpu),  # input_row_offsets
        TensorType(DType.uint32, ["batch"], cpu),  # cache_lengths
        TensorType(DType.uint32, ["batch"], cpu),  # slot_idx
    ]
    with Graph("quickstart", input_types=types) as graph:
        tail, *tensors = graph.inputs
        step = mla_kpool.kpool_step(
            tail.buffer, *(t.tensor for t in tensors), KPOOL
        )
        graph.output(*step)
    return graph


def main() -> int:
    """Runs two calls and checks them; returns the exit status."""
    rng = np.random.default_rng(0)
    model = InferenceSession(devices=[CPU()]).load(build_graph())
    ape = rng.standard_normal((KPOOL, HEAD_DIM)).astype(np.float32)
    tail = to_buffer(np.zeros((MAX_SLOTS, 2, KPOOL, HEAD_DIM), BF16))
    slots = np.array([1, 0], np.uint32)  # request b lives in ring slot[b]
    failures = []
    for call, (new, seen) in enumerate([([6, 3], [0, 0]), ([2, 1], [6, 3])]):
        offsets = np.cumsum([0, *new]).astype(np.uint32)
        cache = np.array(seen, np.uint32)
        k = rng.standard_normal((offsets[-1], HEAD_DIM)).astype(BF16)
        gate = (4 * rng.standard_normal(k.shape)).astype(BF16)
        ring = to_numpy(tail)
        args = (k, gate, ape, offsets, cache, slots)
        outs = model.execute(tail, *(to_buffer(a) for a in args))
        got = mla_kpool.KPoolStep(*(to_numpy(o) for o in outs))

        # Every pooled key within bfloat16's tolerance of the oracle's, the
        # pool ids and row offsets exact, the ring bit for bit.
        inputs = CallInputs(k, gate, offsets, cache, slots)
        try:
            reference.check_step(
                got, ring, inputs, ape, KPOOL, ring_after=to_numpy(tail)
            )
        except AssertionError as error:
            failures.append(f"call {call}: {error}")
        closed = got.ring_closed_pool.tolist()  # pool id per request, or -1
        built = np.diff(got.pool_row_offsets).tolist()  # pools per request
        print(f"call {call}: closed from the ring {closed}, new pools {built}")
    print("FAILED: " + "; ".join(failures) if failures else "OK: matches")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())

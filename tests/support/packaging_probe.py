"""Runs one ring_close graph from an installed mla_kpool (not the checkout).

``tests/docs_and_layout/test_packaging.py`` runs this file in a subprocess whose
``PYTHONPATH`` holds only the wheel's install target, so ``import mla_kpool``
finds the installed copy and its ``KERNELS``. Usage::

    python packaging_probe.py INPUTS.npz OUTPUTS.npz

It prints one JSON line (where the package and its kernels were found) and
writes the graph's outputs. The same graph also calls MAX's own wrapper,
``max.nn.kernels.mla_kpool_ring_close``: with the extension loaded the op
name resolves to this package's kernel, so the drop-in path that keeps
MAX's wrapper works on CPU too.
"""

from __future__ import annotations

import json
import sys

import numpy as np


def main(inputs_path: str, outputs_path: str) -> int:
    """Builds, compiles and runs the graph; returns the exit status."""
    from max.driver import CPU
    from max.dtype import DType
    from max.engine import InferenceSession
    from max.graph import BufferType, DeviceRef, Graph, TensorType
    from max.nn.kernels import mla_kpool_ring_close

    import mla_kpool
    from mla_kpool.buffers import to_buffer, to_numpy

    data = np.load(inputs_path)
    kpool, head_dim = data["ape"].shape
    dev = DeviceRef.CPU()
    rows = TensorType(DType.float32, ["tokens", head_dim], dev)
    input_types = [
        BufferType(DType.float32, ["slots", 2, kpool, head_dim], dev),
        rows,
        rows,
        TensorType(DType.float32, [kpool, head_dim], dev),
        TensorType(DType.uint32, ["offsets"], dev),
        TensorType(DType.uint32, ["batch"], dev),
        TensorType(DType.uint32, ["batch"], dev),
    ]
    with Graph(
        "packaging_ring_close",
        input_types=input_types,
        custom_extensions=[mla_kpool.KERNELS],
    ) as graph:
        tail = graph.inputs[0].buffer
        rest = [value.tensor for value in graph.inputs[1:]]
        ours = mla_kpool.ring_close(tail, *rest, int(kpool))
        theirs = mla_kpool_ring_close(tail, *rest, int(kpool))
        graph.output(*ours, *theirs)

    model = InferenceSession(devices=[CPU()]).load(graph)
    names = ["tail", "k", "gate", "ape", "offsets", "cache", "slots"]
    outputs = model.execute(*(to_buffer(data[name]) for name in names))
    pooled, closed, max_pooled, max_closed = (to_numpy(o) for o in outputs)
    np.savez(
        outputs_path,
        pooled=pooled,
        closed=closed,
        max_pooled=max_pooled,
        max_closed=max_closed,
    )
    print(
        json.dumps(
            {
                "module": str(mla_kpool.__file__),
                "kernels": str(mla_kpool.KERNELS),
            }
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:]))

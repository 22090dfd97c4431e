"""Compiles the k-pool ops for a GPU that is not there (MAX virtual device).

Run as a script, one target per process (MAX's virtual-device settings are
process-global and must be set before any device exists)::

    python tests/gpu_compile_check.py cuda sm_90a
    python tests/gpu_compile_check.py hip gfx942 [KERNELS_DIR]

It builds one graph on ``DeviceRef.GPU()`` holding the whole op (a
``kpool_step``: ring_close, pool_row_offsets, compress, seed_tail; bfloat16,
kpool 4, head_dim 128), a float32 ``ring_close`` with kpool 128 and head_dim
1088 (above the 1024-thread block limit) and a float16 ``compress``
(kpool 16, head_dim 32), and asks MAX to compile it for the target. Nothing
runs. On success it prints :data:`MARKER` followed by the target. A CPU graph
never reaches GPU-only constraints (``Int`` captured in a kernel closure is
not ``DevicePassable``, say); this does. ``KERNELS_DIR`` (default
``mla_kpool.KERNELS``) lets a copy of the kernels with a planted bug be
checked to fail.

The default graph also holds an ``expand_topk`` in MAX's production shape
(kpool 4, 512 pools, int32 ids, the step's metadata).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

MARKER = "MLA_KPOOL_GPU_COMPILE_OK"


def main(argv: list[str]) -> int:
    """Compiles the graph for ``argv = [api, arch, (kernels_dir)]``.

    Returns:
        0 after a successful compile (a failure raises).
    """
    api, arch = argv[0], argv[1]
    # Before anything creates a device: these settings are read once.
    from max import driver

    driver.set_virtual_device_api(api)
    driver.set_virtual_device_target_arch(arch)
    driver.set_virtual_device_count(1)

    from max.dtype import DType
    from max.engine import InferenceSession
    from max.graph import BufferType, DeviceRef, Graph, TensorType

    import mla_kpool

    kernels = Path(argv[2]) if len(argv) > 2 else mla_kpool.KERNELS
    gpu = DeviceRef.GPU()

    def tensor(dtype: DType, shape: list) -> TensorType:
        return TensorType(dtype, shape, device=gpu)

    u32 = DType.uint32
    bf16, f32, f16 = DType.bfloat16, DType.float32, DType.float16
    inputs = [
        # kpool_step, bfloat16, kpool 4, head_dim 128.
        BufferType(bf16, ["slots", 2, 4, 128], gpu),
        tensor(bf16, ["tokens", 128]),
        tensor(bf16, ["tokens", 128]),
        tensor(f32, [4, 128]),
        tensor(u32, ["offsets"]),
        tensor(u32, ["batch"]),
        tensor(u32, ["batch"]),
        # ring_close, float32, kpool 128, head_dim 1088 (> 1024 threads).
        BufferType(f32, ["wide_slots", 2, 128, 1088], gpu),
        tensor(f32, ["wide_tokens", 1088]),
        tensor(f32, ["wide_tokens", 1088]),
        tensor(f32, [128, 1088]),
        # compress, float16, kpool 16, head_dim 32.
        tensor(f16, ["h_tokens", 32]),
        tensor(f16, ["h_tokens", 32]),
        tensor(f32, [16, 32]),
        tensor(u32, ["h_offsets"]),
        tensor(u32, ["h_offsets"]),
        tensor(u32, ["h_batch"]),
        # expand_topk, kpool 4, pool_topk 512 (the step's metadata).
        tensor(DType.int32, ["tokens", 512]),
    ]
    with Graph(
        "gpu_compile_check", input_types=inputs, custom_extensions=[kernels]
    ) as graph:
        x = [
            value.buffer if i in (0, 7) else value.tensor
            for i, value in enumerate(graph.inputs)
        ]
        step = mla_kpool.kpool_step(*x[0:7], 4)
        wide = mla_kpool.ring_close(x[7], *x[8:11], *x[4:7], 128)
        half = mla_kpool.compress(*x[11:17], 16)
        positions = mla_kpool.expand_topk(x[17], x[4], x[5], 4)
        graph.output(*step, *wide, half, positions)

    session = InferenceSession(devices=[driver.CPU(), driver.Accelerator()])
    session.load(graph)
    print(MARKER, api, arch, flush=True)
    return 0


if __name__ == "__main__":
    status = main(sys.argv[1:])
    # Skip interpreter teardown: with a virtual sm_100a device, MAX's
    # teardown has aborted after a successful compile ("terminate called
    # without an active exception", or a fatal PyGILState_Release error).
    # Only the compile is under test.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)

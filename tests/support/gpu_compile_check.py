"""Compiles the k-pool ops for a GPU that is not there (MAX virtual device).

Run as a script, one target per process (MAX's virtual-device settings are
process-global and must be set before any device exists)::

    python tests/support/gpu_compile_check.py cuda sm_90a
    python tests/support/gpu_compile_check.py hip gfx942 [KERNELS_DIR]
    python tests/support/gpu_compile_check.py cuda sm_90a --devices 2

By default it builds one graph on ``DeviceRef.GPU()`` holding the whole op (a
``kpool_step``, both the fused ``mla_kpool.step`` and the three-op form:
ring_close, pool_row_offsets, compress, seed_tail; bfloat16, kpool 4, head_dim
128), a float32 ``ring_close`` and fused step with kpool 128 and head_dim 4100
(1,025 threads of 4 channels: above the 1024-thread block limit) and a float16
``compress`` (kpool 16, head_dim 32), and asks MAX to compile it for the
target. Nothing runs. On success it prints :data:`MARKER` followed by the
target. A CPU graph never reaches GPU-only constraints (``Int`` captured in a
kernel closure is not ``DevicePassable``, say); this does. ``KERNELS_DIR``
(default ``mla_kpool.KERNELS``) lets a copy of the kernels with a planted bug
be checked to fail.

The default graph also holds an ``expand_topk`` in MAX's production shape
(kpool 4, 512 pools, int32 ids, the step's metadata) and this package's
``mla_kpool.index_top_k`` op at GLM-5-Next's indexer shape (H 32, D 128,
kpool 4, top 512, W 32, pages of 128, null mask), added directly so that its
own GPU path compiles for every target (the Python wrapper would pick MAX's
builtin on sm_100a).

With ``--devices N`` (N at least 2) it instead sets up N virtual GPUs and
builds one graph with a ``kpool_step`` (bfloat16, kpool 4, head_dim 128) on
each of ``DeviceRef.GPU(0)`` to ``DeviceRef.GPU(N - 1)``, every replica with
its own inputs and its own ring buffer, the way a sharded indexer runs one
replica of the ops per GPU, and one ``mla_kpool.index_top_k`` (the shape
above) on each. The marker line then ends in ``devices=N``.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

MARKER = "MLA_KPOOL_GPU_COMPILE_OK"


def _parse(argv: list[str]) -> argparse.Namespace:
    """Reads ``api arch [kernels_dir] [--devices N]``."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("api", help='virtual device API, "cuda" or "hip"')
    parser.add_argument("arch", help='target architecture, e.g. "sm_90a"')
    parser.add_argument(
        "kernels_dir",
        nargs="?",
        type=Path,
        help="Mojo kernel package (default: mla_kpool.KERNELS)",
    )
    parser.add_argument(
        "--devices",
        type=int,
        default=1,
        help="virtual GPUs; 2 or more compiles one kpool_step per GPU",
    )
    args = parser.parse_args(argv)
    if args.devices < 1:
        parser.error("--devices must be at least 1")
    return args


#: The indexer call compiled for each GPU (see the module docs).
GLM_INDEX = dict(
    num_heads=32, depth=128, width=32, num_layers=2, page_size=128, top_k=512,
    kpool=4, mask="null", gpu=True,
)  # fmt: skip


def _index_inputs(device, suffix: str = "") -> list:
    """The indexer call's 13 input types on ``device``."""
    from mla_kpool.index_runner import IndexKey

    return IndexKey(**GLM_INDEX).input_types(device, suffix)


#: The tensor scorer each target runs, named in the graph as well as
#: ``"auto"``: a name the kernels do not match to the target fails the build.
TENSOR_SCORER = {"sm_90a": "wgmma", "gfx942": "mfma"}


def _index_op(values: list, scorer: str = "auto"):
    """This package's index_top_k op on the 13 graph values."""
    from mla_kpool._index_op import add_op, check_operands

    values = [
        x.buffer if i in (3, 9) else x.tensor for i, x in enumerate(values)
    ]
    key = GLM_INDEX
    return add_op(
        check_operands(
            *values,
            top_k=key["top_k"],
            quantization_granularity=128,
            mask_str=key["mask"],
            kpool=key["kpool"],
            prefix="",
        ),
        scorer=scorer,
    )


def _whole_op_graph(kernels: Path, arch: str = ""):
    """The default graph: every op and dtype above, on ``DeviceRef.GPU()``.

    Args:
        kernels: The Mojo kernel package to load the ops from.
        arch: The target: index_top_k is added a second time with its
            tensor scorer named (:data:`TENSOR_SCORER`), where it has one.

    Returns:
        The :class:`max.graph.Graph`.
    """
    from max.dtype import DType
    from max.graph import BufferType, DeviceRef, Graph, TensorType

    import mla_kpool

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
        # ring_close, float32, kpool 128, head_dim 4100 (> 1024 threads).
        BufferType(f32, ["wide_slots", 2, 128, 4100], gpu),
        tensor(f32, ["wide_tokens", 4100]),
        tensor(f32, ["wide_tokens", 4100]),
        tensor(f32, [128, 4100]),
        # compress, float16, kpool 16, head_dim 32.
        tensor(f16, ["h_tokens", 32]),
        tensor(f16, ["h_tokens", 32]),
        tensor(f32, [16, 32]),
        tensor(u32, ["h_offsets"]),
        tensor(u32, ["h_offsets"]),
        tensor(u32, ["h_batch"]),
        # expand_topk, kpool 4, pool_topk 512 (the step's metadata).
        tensor(DType.int32, ["tokens", 512]),
        # index_top_k, GLM-5-Next's shape (inputs 18 .. 30).
        *_index_inputs(gpu, "_index"),
    ]
    with Graph(
        "gpu_compile_check", input_types=inputs, custom_extensions=[kernels]
    ) as graph:
        x = [
            value.buffer if i in (0, 7) else value.tensor
            for i, value in enumerate(graph.inputs[:18])
        ]
        step = mla_kpool.kpool_step(*x[0:7], 4)
        step3 = mla_kpool.kpool_step(*x[0:7], 4, fused=False)
        wide = mla_kpool.ring_close(x[7], *x[8:11], *x[4:7], 128)
        wide_step = mla_kpool.kpool_step(x[7], *x[8:11], *x[4:7], 128)
        half = mla_kpool.compress(*x[11:17], 16)
        positions = mla_kpool.expand_topk(x[17], x[4], x[5], 4)
        ids = [_index_op(list(graph.inputs[18:31]))]
        if arch in TENSOR_SCORER:
            scorer = TENSOR_SCORER[arch]
            ids.append(_index_op(list(graph.inputs[18:31]), scorer))
        graph.output(*step, *step3, *wide, *wide_step, half, positions, *ids)
    return graph


def _replica_graph(kernels: Path, count: int):
    """One ``kpool_step`` per GPU, ``DeviceRef.GPU(0)`` to ``GPU(count - 1)``.

    Each replica has its own inputs on its own device, ring buffer included
    (bfloat16, kpool 4, head_dim 128), and its own symbolic dimensions, as
    the shards of a sharded indexer do.

    Args:
        kernels: The Mojo kernel package to load the ops from.
        count: How many GPUs, hence replicas.

    Returns:
        The :class:`max.graph.Graph`.
    """
    from max.dtype import DType
    from max.graph import BufferType, DeviceRef, Graph, TensorType

    import mla_kpool

    u32, bf16, f32 = DType.uint32, DType.bfloat16, DType.float32
    inputs = []
    for i in range(count):
        gpu = DeviceRef.GPU(i)
        tokens, batch = f"tokens_{i}", f"batch_{i}"
        inputs += [
            BufferType(bf16, [f"slots_{i}", 2, 4, 128], gpu),
            TensorType(bf16, [tokens, 128], device=gpu),
            TensorType(bf16, [tokens, 128], device=gpu),
            TensorType(f32, [4, 128], device=gpu),
            TensorType(u32, [f"offsets_{i}"], device=gpu),
            TensorType(u32, [batch], device=gpu),
            TensorType(u32, [batch], device=gpu),
            *_index_inputs(gpu, f"_index_{i}"),
        ]
    with Graph(
        "gpu_compile_check_replicas",
        input_types=inputs,
        custom_extensions=[kernels],
    ) as graph:
        outputs = []
        for i in range(count):
            ring, *rest = graph.inputs[20 * i : 20 * i + 7]
            x = [ring.buffer, *(value.tensor for value in rest)]
            outputs += mla_kpool.kpool_step(*x, 4)
            outputs.append(
                _index_op(list(graph.inputs[20 * i + 7 : 20 * i + 20]))
            )
        graph.output(*outputs)
    return graph


def main(argv: list[str]) -> int:
    """Compiles the graph for ``argv = [api, arch, (kernels_dir)]``.

    ``--devices N`` anywhere in ``argv`` compiles the replica graph on N
    virtual GPUs instead.

    Returns:
        0 after a successful compile (a failure raises).
    """
    args = _parse(argv)
    # Before anything creates a device: these settings are read once.
    from max import driver

    driver.set_virtual_device_api(args.api)
    driver.set_virtual_device_target_arch(args.arch)
    driver.set_virtual_device_count(args.devices)

    from max.engine import InferenceSession

    import mla_kpool

    kernels = args.kernels_dir or mla_kpool.KERNELS
    if args.devices == 1:
        graph = _whole_op_graph(kernels, args.arch)
        accelerators = [driver.Accelerator()]
        suffix = ""
    else:
        graph = _replica_graph(kernels, args.devices)
        accelerators = [driver.Accelerator(i) for i in range(args.devices)]
        suffix = f" devices={args.devices}"

    session = InferenceSession(devices=[driver.CPU(), *accelerators])
    session.load(graph)
    print(MARKER, args.api, args.arch + suffix, flush=True)
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

"""Graph-build checks and this package's op of :func:`mla_kpool.index_top_k`.

Kept apart from :mod:`mla_kpool.indexer` because that module imports
``max.nn`` (for ``MHAMaskVariant`` and ``PagedCacheValues``), which takes
many seconds; the runner builds its graphs from the flat operands here
without it. Every check raises before an op is added, with a message that
starts with the argument's name (``k_collection.kv_blocks`` for a field of
the cache), in the words of :mod:`mla_kpool._validate`.
"""

from __future__ import annotations

import numbers
from dataclasses import dataclass
from typing import Any

from max.dtype import DType
from max.graph import BufferValue, DeviceRef, TensorType, TensorValue, ops
from max.graph.dim import Dim, StaticDim

from . import _validate as v
from ._limits import MAX_TOP_K
from ._paths import ensure_kernels
from ._validate import mask_name

#: The registered name of this package's indexer (CPU and GPU paths).
OP_NAME = "mla_kpool.index_top_k"
#: Mask strings the op takes (``mask_str``).
MASKS = ("causal", "null")


@dataclass(frozen=True)
class IndexOperands:
    """Checked operands of one index_top_k call.

    Attributes:
        values: The 13 operands in the op's order (q, qs, offsets, kv_blocks,
            page_stride, cache_lengths, lookup_table, max_prompt_length,
            max_cache_length, kv_scales, scales_page_stride,
            scales_lookup_table, layer_idx).
        parameters: The op's compile-time parameters, MAX's names.
        device: The graph device (that of ``q``).
    """

    values: tuple[Any, ...]
    parameters: dict[str, int | str]
    device: DeviceRef


def check_int(
    name: str, value: object, low: int, high: int | None = None
) -> int:
    """``value`` as an ``int`` in ``low..high`` (``high`` ``None``: no top).

    Raises:
        TypeError: If it is not an integer (``bool`` is not).
        ValueError: If it is out of range.
    """
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(
            f"{name} must be an int, got {type(value).__name__} {value!r}"
        )
    if value < low or (high is not None and value > high):
        span = f"in {low}..{high}" if high is not None else f"at least {low}"
        raise ValueError(f"{name} must be {span}, got {value}")
    return int(value)


def _static(name: str, value: TensorValue | BufferValue, axis: int) -> int:
    dim = value.shape[axis]
    if not isinstance(dim, StaticDim):
        raise ValueError(
            f"{name} must have a static dim {axis} (a kernel parameter), got"
            f" {v.fmt_shape(value.shape)}"
        )
    return int(dim)


def _tensor(
    name: str,
    value: object,
    dtype: DType,
    ranks: tuple[int, ...],
    device: DeviceRef | None,
    what: str,
) -> TensorValue:
    value = v.check_tensor(name, value)
    if value.rank not in ranks:
        raise ValueError(
            f"{name} must be {what}, got rank {value.rank}"
            f" {v.fmt_shape(value.shape)}"
        )
    if value.dtype != dtype:
        raise ValueError(
            f"{name} dtype must be {dtype.name}, got {value.dtype.name}"
        )
    if device is not None and value.device != device:
        raise ValueError(f"{name} must be on {device}, got {value.device}")
    return value


def _buffer(name: str, value: object, dtype: DType, device: DeviceRef):
    if not isinstance(value, BufferValue):
        raise TypeError(
            f"{name} must be a max.graph.BufferValue (the paged cache), got"
            f" {type(value).__name__}"
        )
    if value.rank != 6:
        raise ValueError(
            f"{name} must be rank 6 [num_blocks, 1, num_layers, page_size, 1,"
            f" W], got rank {value.rank} {v.fmt_shape(value.shape)}"
        )
    if value.dtype != dtype:
        raise ValueError(
            f"{name} dtype must be {dtype.name}, got {value.dtype.name}"
        )
    if value.device != device:
        raise ValueError(
            f"{name} must be on {device} (the device of q), got {value.device}"
        )
    return value


def _fp8(device: DeviceRef) -> DType:
    """The FP8 key dtype on ``device``: uint8 e4m3fn bytes on the CPU."""
    return DType.uint8 if device.is_cpu() else DType.float8_e4m3fn


def _validate_q(q: object) -> tuple[TensorValue, int, int]:
    """``q``, rank 3 ``[T, num_heads, depth]`` FP8; its static heads, depth."""
    q = v.check_tensor("q", q)
    device = q.device
    if q.rank != 3:
        raise ValueError(
            f"q must be rank 3 [T, num_heads, depth], got rank {q.rank}"
            f" {v.fmt_shape(q.shape)}"
        )
    if q.dtype != _fp8(device):
        where = (
            "uint8 holding e4m3fn bytes on the CPU (MAX has no FP8 tensors"
            " there)"
            if device.is_cpu()
            else "float8_e4m3fn on a GPU"
        )
        raise ValueError(f"q dtype must be {where}, got {q.dtype.name}")
    return q, _static("q", q, 1), _static("q", q, 2)


def _validate_q_s(q_s: object, q: TensorValue, heads: int) -> TensorValue:
    """``q_s``, float32 ``[T, num_heads]`` with ``q``'s ``T`` and heads."""
    q_s = _tensor(
        "q_s", q_s, DType.float32, (2,), q.device, "rank 2 [T, num_heads]"
    )
    if q_s.shape[1] != heads or v._differ(q_s.shape[0], q.shape[0]):
        raise ValueError(
            f"q_s must be [T, num_heads] = {v.fmt_shape([q.shape[0], heads])}"
            f" to match q, got {v.fmt_shape(q_s.shape)}"
        )
    return q_s


def _validate_kv_blocks(
    name: str, kv_blocks: object, device: DeviceRef, depth: int, kpool: int
) -> tuple[BufferValue, int, int]:
    """The key arena ``[num_blocks, 1, num_layers, page_size, 1, W]``.

    ``W`` is ``depth`` (whole rows) or ``depth / kpool`` (spread rows,
    whose pages then hold whole pools).

    Returns:
        The buffer, its static ``num_layers`` and ``page_size``.
    """
    blocks = _buffer(name, kv_blocks, _fp8(device), device)
    layers = _static(name, blocks, 2)
    page = _static(name, blocks, 3)
    width = _static(name, blocks, 5)
    if blocks.shape[1] != 1 or blocks.shape[4] != 1:
        raise ValueError(
            f"{name} must be [num_blocks, 1, num_layers, page_size,"
            f" 1, W], got {v.fmt_shape(blocks.shape)}"
        )
    spread = width != depth
    if spread and (kpool == 1 or depth % kpool or width != depth // kpool):
        rows = depth // width if width and depth % width == 0 else 0
        hint = f" (the spread rows of kpool={rows})" if rows > 1 else ""
        raise ValueError(
            f"{name} row width W must be depth={depth} (whole) or"
            f" depth/kpool (spread, kpool={kpool}), got {width}{hint}"
        )
    if spread and page % kpool:
        raise ValueError(
            f"{name} page_size must be a multiple of kpool={kpool}"
            f" in the spread layout, got {page}"
        )
    return blocks, layers, page


def _validate_kv_scales(
    name: str, kv_scales: object, device: DeviceRef, layers: int, page: int
) -> BufferValue:
    """The scale arena: float32, one scale per key row of ``kv_blocks``."""
    if kv_scales is None:
        raise ValueError(
            f"{name} must be set: FP8 keys need their per-row scales"
        )
    scales = _buffer(name, kv_scales, DType.float32, device)
    want = [1, layers, page, 1, 1]
    if any(a != b for a, b in zip(scales.shape[1:], want, strict=True)):
        raise ValueError(
            f"{name} must be [num_blocks, 1, {layers}, {page}, 1, 1]"
            f" to match kv_blocks, got {v.fmt_shape(scales.shape)}"
        )
    return scales


def _validate_batch(
    prefix: str,
    lengths: TensorValue,
    offsets: TensorValue,
    lookup_table: TensorValue,
    scales_lookup_table: TensorValue,
) -> None:
    """The per-request operands agree on ``B``, ``cache_lengths``' length.

    ``input_row_offsets`` has ``B + 1`` entries, the two tables ``B`` rows.
    """
    batch = Dim(lengths.shape[0])
    for name, value, extra in (
        ("input_row_offsets", offsets, 1),
        (f"{prefix}lookup_table", lookup_table, 0),
        (f"{prefix}scales_lookup_table", scales_lookup_table, 0),
    ):
        if v._differ(value.shape[0], batch + extra):
            raise ValueError(
                f"{name} dim 0 must be B{' + 1' if extra else ''} to match"
                f" {prefix}cache_lengths {v.fmt_shape(lengths.shape)}, got"
                f" {v.fmt_shape(value.shape)}"
            )


def check_operands(
    q: object,
    q_s: object,
    input_row_offsets: object,
    kv_blocks: object,
    page_stride: object,
    cache_lengths: object,
    lookup_table: object,
    max_prompt_length: object,
    max_cache_length: object,
    kv_scales: object,
    scales_page_stride: object,
    scales_lookup_table: object,
    layer_idx: object,
    *,
    top_k: object,
    quantization_granularity: object,
    mask_str: object,
    kpool: object,
    prefix: str = "k_collection.",
) -> IndexOperands:
    """Checks every operand of the indexer; see :func:`mla_kpool.index_top_k`.

    ``prefix`` names the cache fields in messages
    (``k_collection.kv_blocks``).

    Raises:
        TypeError: A value of the wrong kind (not a tensor or buffer, a
            non-integer ``top_k`` / ``kpool``).
        ValueError: A wrong dtype, rank, shape, device or parameter value.
    """
    top_k = check_int("top_k", top_k, 1, MAX_TOP_K)
    kpool = check_int("kpool", kpool, 1)
    granularity = check_int(
        "quantization_granularity", quantization_granularity, 1
    )
    mask_str = mask_name(mask_str)
    q, heads, depth = _validate_q(q)
    device, cpu = q.device, DeviceRef.CPU()
    q_s = _validate_q_s(q_s, q, heads)
    u32, i64 = DType.uint32, DType.int64
    offsets = _tensor(
        "input_row_offsets",
        input_row_offsets,
        u32,
        (1,),
        device,
        "rank 1 [B + 1]",
    )
    blocks, layers, page = _validate_kv_blocks(
        f"{prefix}kv_blocks", kv_blocks, device, depth, kpool
    )
    scales = _validate_kv_scales(
        f"{prefix}kv_scales", kv_scales, device, layers, page
    )
    strides = [
        _tensor(f"{prefix}{n}", s, i64, (1,), cpu, "rank 1 [1]")
        for n, s in (
            ("page_stride", page_stride),
            ("scales_page_stride", scales_page_stride),
        )
    ]
    lengths = _tensor(
        f"{prefix}cache_lengths", cache_lengths, u32, (1,), device, "rank 1 [B]"
    )
    tables = [
        _tensor(f"{prefix}{n}", t, u32, (2,), device, "rank 2 [B, max_pages]")
        for n, t in (
            ("lookup_table", lookup_table),
            ("scales_lookup_table", scales_lookup_table),
        )
    ]
    maxima = [
        _tensor(f"{prefix}{n}", m, u32, (0, 1), cpu, "a scalar or [1]")
        for n, m in (
            ("max_prompt_length", max_prompt_length),
            ("max_cache_length", max_cache_length),
        )
    ]
    layer = _tensor("layer_idx", layer_idx, u32, (0,), cpu, "a scalar")
    _validate_batch(prefix, lengths, offsets, *tables)
    values = (
        q, q_s, offsets, blocks, strides[0], lengths, tables[0], maxima[0],
        maxima[1], scales, strides[1], tables[1], layer,
    )  # fmt: skip
    parameters: dict[str, int | str] = {
        "num_heads": heads,
        "depth": depth,
        "k": top_k,
        "quantization_granularity": granularity,
        "mask_str": mask_str,
        "kpool": kpool,
    }
    return IndexOperands(values, parameters, device)


#: The GPU path's scorers: ``"auto"`` (the tensor scorer of an sm_90 or
#: gfx942 GPU, else FP32 FMAs), ``"simt"`` (FP32 FMAs on every GPU), ``"wgmma"``
#: (Hopper's FP8 tensor cores, sm_90) and ``"mfma"`` (MI300's FP8 matrix
#: cores, gfx942). Kernels: ``AUTO`` and ``GPU_SCORERS`` in
#: kernels/index/scorers.mojo.
SCORERS = ("auto", "simt", "wgmma", "mfma")

#: Largest depth the tensor scorers take: their tiles of keys and query
#: heads must fit a block's static shared memory (``TENSOR_MAX_DEPTH`` in
#: kernels/index/gpu/score.mojo; the op refuses a larger one too).
TENSOR_MAX_DEPTH = 256

#: The tensor scorers and the architecture names (``max.driver``'s) of
#: the GPUs that run them (``scorer_gpu`` in kernels/index/scorers.mojo).
_TENSOR_ARCH = {
    "wgmma": ("sm_90", "an sm_90 GPU (Hopper)"),
    "mfma": ("gfx942", "a gfx942 GPU (MI300)"),
}


def check_scorer(
    scorer: object,
    device: DeviceRef,
    emulate_gpu: bool,
    depth: int | None = None,
) -> str:
    """``scorer`` checked against where the op runs and the call's depth.

    ``"wgmma"`` runs on an sm_90 GPU and ``"mfma"`` on a gfx942 one, each
    also on the host with ``emulate_gpu`` (the emulated grid runs its tile
    code). A GPU graph built where no
    accelerator answers (virtual-device compiles) is not checked here:
    the op checks its target when it is compiled.

    Raises:
        TypeError: If ``scorer`` is not a string.
        ValueError: For a name not in :data:`SCORERS` (listing them), or
            a tensor scorer where it cannot run (naming the device) or for
            a ``depth`` past :data:`TENSOR_MAX_DEPTH`.
    """
    if not isinstance(scorer, str):
        raise TypeError(f"scorer must be a str, got {type(scorer).__name__}")
    if scorer not in SCORERS:
        raise ValueError(
            f"scorer must be one of {', '.join(SCORERS)}, got {scorer!r}"
        )
    if scorer not in _TENSOR_ARCH:
        return scorer
    if depth is not None and depth > TENSOR_MAX_DEPTH:
        raise ValueError(
            f"scorer {scorer!r} takes depth up to {TENSOR_MAX_DEPTH}, got"
            f" {depth}; 'simt' (or 'auto') takes any"
        )
    prefix, gpu = _TENSOR_ARCH[scorer]
    if device.is_cpu():
        if not emulate_gpu:
            raise ValueError(
                f"scorer {scorer!r} runs on {gpu}, or on the host's emulated"
                " grid: Runner('gpu-emulated'), or"
                " mla_kpool.index_top_k(..., emulate_gpu=True); q is on the"
                " CPU without it"
            )
        return scorer
    arch = accelerator_arch()
    if arch is not None and not arch.startswith(prefix):
        raise ValueError(f"scorer {scorer!r} needs {gpu}; this GPU is {arch}")
    return scorer


def gpu_scorers() -> list[str]:
    """The scorers this machine's GPU runs (:data:`SCORERS`).

    ``"simt"`` and the tensor scorer of its architecture; ``[]`` without
    a GPU.
    """
    arch = accelerator_arch()
    if arch is None:
        return []
    tensor = [
        s for s, (prefix, _) in _TENSOR_ARCH.items() if arch.startswith(prefix)
    ]
    return ["simt", *tensor]


def accelerator_arch() -> str | None:
    """The accelerator's architecture name, or None where none answers.

    ``sm_90a``, ``gfx942``, ...: ``max.driver``'s name (in virtual-device
    mode, the virtual target).
    """
    from max import driver

    try:
        return driver.accelerator_architecture_name()
    except ValueError:  # no accelerator: "not implemented for device: cpu"
        return None


def add_op(
    operands: IndexOperands, emulate_gpu: bool = False, scorer: str = "auto"
) -> TensorValue:
    """Adds this package's ``mla_kpool.index_top_k`` on checked operands.

    On the CPU it runs the CPU kernel, or with ``emulate_gpu`` the GPU path
    over an emulated grid (CPU operands only); on a GPU, the GPU path, its
    scores from ``scorer`` (:data:`SCORERS`).

    Returns:
        int32 ``[T, top_k]``.

    Raises:
        TypeError: If ``scorer`` is not a string.
        ValueError: If ``emulate_gpu`` is asked of GPU operands, or from
            :func:`check_scorer`.
    """
    ensure_kernels("index_top_k")
    q = operands.values[0]
    if emulate_gpu and not operands.device.is_cpu():
        raise ValueError(
            "emulate_gpu runs the GPU path on the host: q must be on the CPU,"
            f" got {operands.device}"
        )
    scorer = check_scorer(
        scorer, operands.device, emulate_gpu, int(operands.parameters["depth"])
    )
    out = TensorType(
        DType.int32, [q.shape[0], operands.parameters["k"]], device=q.device
    )
    parameters = dict(operands.parameters)
    if emulate_gpu:
        parameters["emulate_gpu"] = True
    if scorer != "auto":  # the default graph stays the one MAX has cached
        parameters["scorer"] = scorer
    return ops.inplace_custom(
        OP_NAME,
        device=q.device,
        values=list(operands.values),
        out_types=[out],
        parameters=parameters,
    )[0].tensor

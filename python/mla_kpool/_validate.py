"""Graph-build checks shared by the op wrappers in :mod:`mla_kpool.graph`.

Every check raises before any op is added to the graph, with a message that
starts with the offending argument's name, so a wrong operand fails where the
caller wrote it instead of deep inside the graph compiler or, worse, as an
out-of-bounds access at run time.

Error kinds: ``TypeError`` when a value is the wrong kind of thing (not a
graph value, a tensor where a buffer is needed, a non-integer ``kpool``);
``ValueError`` for a wrong rank, shape, dtype (float or index) or device,
as ``max.nn.kernels`` raises for a wrong dtype.
"""

from __future__ import annotations

import numbers
from collections.abc import Iterable
from enum import Enum

from max.dtype import DType
from max.graph import BufferValue, DeviceRef, Dim, TensorValue
from max.graph.dim import StaticDim

#: Key/gate/tail dtypes the kernels are instantiated for.
FLOAT_DTYPES: tuple[DType, ...] = (DType.float32, DType.bfloat16, DType.float16)

#: Index dtypes the kernels read (uint32 is MAX's convention).
INDEX_DTYPES: tuple[DType, ...] = (
    DType.uint32,
    DType.int32,
    DType.int64,
    DType.uint64,
)


def fmt_shape(shape: Iterable[Dim]) -> str:
    """Formats a graph shape as ``[8, 2, 4, head_dim]``."""
    return "[" + ", ".join(str(d) for d in shape) + "]"


def _dtype_names(dtypes: Iterable[DType]) -> str:
    return ", ".join(d.name for d in dtypes)


def check_kpool(kpool: object) -> int:
    """Returns ``kpool`` as an ``int``, checked to be a positive integer."""
    if isinstance(kpool, bool) or not isinstance(kpool, numbers.Integral):
        raise TypeError(
            f"kpool must be an int, got {type(kpool).__name__} {kpool!r}"
        )
    if kpool < 1:
        raise ValueError(f"kpool must be at least 1, got {kpool}")
    return int(kpool)


#: index_top_k's ``mask_str`` for each spelling a caller may pass: the
#: op's own strings and the member names of MAX's ``MHAMaskVariant``.
_MASK_SPELLINGS = {
    "causal": "causal",
    "CAUSAL_MASK": "causal",
    "null": "null",
    "NULL_MASK": "null",
}


def mask_name(mask: object, argument: str = "mask") -> str:
    """index_top_k's mask as its ``mask_str``: ``"causal"`` or ``"null"``.

    Takes the op's strings and MAX's ``MHAMaskVariant.CAUSAL_MASK`` /
    ``NULL_MASK``, read by member name so that callers need no ``max.nn``
    import.

    Raises:
        ValueError: For anything else, naming ``argument``.
    """
    key = mask.name if isinstance(mask, Enum) else mask
    if isinstance(key, str) and key in _MASK_SPELLINGS:
        return _MASK_SPELLINGS[key]
    raise ValueError(
        f"{argument} must be 'causal', 'null', MHAMaskVariant.CAUSAL_MASK or"
        f" MHAMaskVariant.NULL_MASK, got {mask!r}"
    )


def check_tensor(name: str, value: object) -> TensorValue:
    """Checks that ``value`` is a graph tensor (not a buffer or array)."""
    if not isinstance(value, TensorValue):
        raise TypeError(
            f"{name} must be a max.graph.TensorValue, got"
            f" {type(value).__name__}"
        )
    return value


def check_buffer(name: str, value: object) -> BufferValue:
    """Checks that ``value`` is a graph buffer.

    The ring must be a ``BufferValue``: it persists across calls, so the
    writers mutate it in place, which MAX only allows on buffers.
    """
    if not isinstance(value, BufferValue):
        raise TypeError(
            f"{name} must be a max.graph.BufferValue (the ring is updated in"
            f" place), got {type(value).__name__}"
        )
    return value


def check_keys(k: object, gate: object) -> tuple[TensorValue, TensorValue, int]:
    """Checks ``k`` and ``gate`` and returns them with the static head_dim.

    Raises:
        TypeError: If either is not a ``TensorValue``.
        ValueError: If either is not rank 2, head_dim is not static, the
            dtype is not float32/bfloat16/float16, or ``gate`` differs from
            ``k`` in shape or dtype.
    """
    k = check_tensor("k", k)
    gate = check_tensor("gate", gate)
    if k.rank != 2:
        raise ValueError(
            f"k must be rank 2 [total_tokens, head_dim], got rank {k.rank}"
            f" {fmt_shape(k.shape)}"
        )
    head_dim_dim = k.shape[1]
    if not isinstance(head_dim_dim, StaticDim):
        raise ValueError(
            "k must have a static head_dim (it is a kernel parameter), got"
            f" {fmt_shape(k.shape)}"
        )
    head_dim = int(head_dim_dim)
    if head_dim < 1:
        raise ValueError(f"k must have head_dim >= 1, got {fmt_shape(k.shape)}")
    if k.dtype not in FLOAT_DTYPES:
        raise ValueError(
            f"k dtype must be one of {_dtype_names(FLOAT_DTYPES)}, got"
            f" {k.dtype.name}"
        )
    if (
        gate.rank != 2
        or gate.shape[1] != head_dim
        or _differ(gate.shape[0], k.shape[0])
    ):
        raise ValueError(
            f"gate must have the shape of k {fmt_shape(k.shape)}, got"
            f" {fmt_shape(gate.shape)}"
        )
    if gate.dtype != k.dtype:
        raise ValueError(
            f"gate dtype must match k ({k.dtype.name}), got {gate.dtype.name}"
        )
    return k, gate, head_dim


def check_tail(
    tail: object, kpool: int, head_dim: int, dtype: DType
) -> BufferValue:
    """Checks the ring ``[max_slots, 2, ring, head_dim]``.

    ``ring`` is ``kpool`` as for MAX's builtins; a positive multiple of
    ``kpool`` (a ring of several pools) is accepted as well.
    """
    tail = check_buffer("tail", tail)
    shape = tail.shape
    ring = shape[2] if tail.rank == 4 else None
    ok = (
        tail.rank == 4
        and shape[1] == 2
        and shape[3] == head_dim
        and isinstance(ring, StaticDim)
        and int(ring) > 0
        and int(ring) % kpool == 0
    )
    if not ok:
        ring_text = f"kpool={kpool}"
        if kpool > 1:
            ring_text += f" (or a multiple of {kpool})"
        raise ValueError(
            f"tail must be [max_slots, 2, {ring_text}, head_dim={head_dim}],"
            f" got {fmt_shape(shape)}"
        )
    if tail.dtype != dtype:
        raise ValueError(
            f"tail dtype must match k ({dtype.name}), got {tail.dtype.name}"
        )
    return tail


def check_ape(ape: object, kpool: int, head_dim: int) -> TensorValue:
    """Checks the within-pool position embedding ``[kpool, head_dim]`` f32."""
    ape = check_tensor("ape", ape)
    if (
        ape.rank != 2
        or ape.shape[0] != kpool
        or ape.shape[1] != head_dim
        or ape.dtype != DType.float32
    ):
        raise ValueError(
            f"ape must be [kpool={kpool}, head_dim={head_dim}] float32, got"
            f" {fmt_shape(ape.shape)} {ape.dtype.name}"
        )
    return ape


def check_index(name: str, value: object, what: str) -> TensorValue:
    """Checks a rank-1 index tensor of an :data:`INDEX_DTYPES` dtype.

    ``what`` names its extent, for the rank message.

    Raises:
        TypeError: If ``value`` is not a ``TensorValue``.
        ValueError: If it is not rank 1 or its dtype is not one of
            :data:`INDEX_DTYPES`.
    """
    value = check_tensor(name, value)
    if value.rank != 1:
        raise ValueError(
            f"{name} must be rank 1 [{what}], got rank {value.rank}"
            f" {fmt_shape(value.shape)}"
        )
    if value.dtype not in INDEX_DTYPES:
        # Name the accepted dtypes: "an integer dtype" would not explain
        # why int8 or uint16 (integers the kernels are not built for) fail.
        raise ValueError(
            f"{name} dtype must be one of {_dtype_names(INDEX_DTYPES)}, got"
            f" {value.dtype.name}"
        )
    return value


def _differ(a: Dim, b: Dim) -> bool:
    """Whether two dims are provably different.

    Static dims compare by value; symbolic ones only when their difference
    folds to a constant (``batch + 1`` vs ``batch``). Unrelated symbols may be
    equal at run time, so they never count as different.
    """
    diff = Dim(a) - Dim(b)
    return isinstance(diff, StaticDim) and int(diff) != 0


def check_batch(
    cache_lengths: TensorValue, **others: tuple[TensorValue, int]
) -> None:
    """Checks that every per-request tensor implies the same ``batch``.

    Each tensor is compared with ``cache_lengths`` and with every other one,
    so two static lengths that contradict each other are caught even when
    ``cache_lengths`` has a symbolic batch.

    Args:
        cache_lengths: The reference: its length is ``batch``.
        **others: ``name=(tensor, extra)`` where the tensor should be
            ``[batch + extra]`` (1 for row-offset arrays, 0 otherwise).

    Raises:
        ValueError: Naming the first tensor whose length provably disagrees.
    """
    seen = [("cache_lengths", cache_lengths, 0)]
    for name, (value, extra) in others.items():
        want = "[batch + 1]" if extra else "[batch]"
        for ref_name, ref_value, ref_extra in seen:
            expected = Dim(ref_value.shape[0]) - ref_extra + extra
            if _differ(value.shape[0], expected):
                if isinstance(expected, StaticDim):
                    want += f" = [{expected}]"
                raise ValueError(
                    f"{name} must be {want} to match {ref_name}"
                    f" {fmt_shape(ref_value.shape)}, got"
                    f" {fmt_shape(value.shape)}"
                )
        seen.append((name, value, extra))


def check_devices(
    device: DeviceRef, reference: str, **values: TensorValue | BufferValue
) -> None:
    """Checks that every operand lives on ``device`` (that of ``reference``)."""
    for name, value in values.items():
        if value.device != device:
            raise ValueError(
                f"{name} must be on {device} (the device of {reference}), got"
                f" {value.device}"
            )


def kernel_parameters(
    head_dim: int | None, kpool: int, emulate_gpu: object, device: DeviceRef
) -> dict[str, bool | int]:
    """The compile-time parameters of one ``mo.mla.kpool.*`` op.

    ``emulate_gpu`` is added only when set, so a default graph carries
    exactly the parameters MAX's own wrappers pass.

    Raises:
        TypeError: If ``emulate_gpu`` is not a bool.
        ValueError: If ``emulate_gpu`` is set for a graph device that is not
            the CPU (the emulated grid runs on the host).
    """
    if not isinstance(emulate_gpu, bool):
        raise TypeError(
            f"emulate_gpu must be a bool, got {type(emulate_gpu).__name__}"
        )
    params: dict[str, bool | int] = {"kpool": kpool}
    if head_dim is not None:
        params = {"head_dim": head_dim, **params}
    if emulate_gpu:
        if not device.is_cpu():
            raise ValueError(
                "emulate_gpu runs the GPU kernels on the host, so the"
                f" operands must be on the CPU, got {device}"
            )
        params["emulate_gpu"] = True
    return params

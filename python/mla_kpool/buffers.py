"""NumPy <-> ``max.driver.Buffer`` conversion, bfloat16 included.

MAX moves host arrays through DLPack, which has no bfloat16: both
``Buffer.from_numpy`` on an ``ml_dtypes.bfloat16`` array and
``Buffer.to_numpy`` on a bfloat16 buffer raise. The bits are the same as a
uint16 array's, so bfloat16 crosses as uint16 and is relabelled with
``Buffer.view`` on the MAX side and ``ndarray.view`` on the NumPy side.
"""

from __future__ import annotations

from collections.abc import Sequence

import ml_dtypes
import numpy as np
import numpy.typing as npt
from max.driver import CPU, Buffer, Device
from max.dtype import DType

_BFLOAT16 = np.dtype(ml_dtypes.bfloat16)


def to_max_dtype(dtype: npt.DTypeLike) -> DType:
    """Maps a NumPy (or ``ml_dtypes``) dtype to the MAX ``DType``.

    Raises:
        ValueError: If MAX has no such dtype.
    """
    dtype = np.dtype(dtype)
    if dtype == _BFLOAT16:
        return DType.bfloat16
    return DType.from_numpy(dtype)


def to_numpy_dtype(dtype: DType) -> np.dtype:
    """Maps a MAX ``DType`` to the NumPy dtype (``ml_dtypes.bfloat16`` too).

    Raises:
        ValueError: If NumPy has no such dtype.
    """
    if dtype == DType.bfloat16:
        return _BFLOAT16
    return np.dtype(dtype.to_numpy())


def to_buffer(array: npt.ArrayLike, device: Device | None = None) -> Buffer:
    """Copies a NumPy array into a new ``Buffer`` on ``device``.

    The data is always copied: ``Buffer.from_numpy`` would otherwise alias
    the array on CPU (but not on a GPU), so an in-place op such as
    ``seed_tail`` would write through to the caller's array on one device
    and not the other.

    Args:
        array: The data; ``ml_dtypes.bfloat16`` arrays are supported.
        device: Where the buffer lives; the host CPU when ``None``.

    Returns:
        A contiguous buffer with the array's shape and dtype.
    """
    host = np.array(array, copy=True, order="C")
    if host.dtype == _BFLOAT16:
        buffer = Buffer.from_numpy(host.view(np.uint16)).view(DType.bfloat16)
    else:
        buffer = Buffer.from_numpy(host)
    return buffer if device is None else buffer.to(device)


def zeros(
    shape: Sequence[int], dtype: DType, device: Device | None = None
) -> Buffer:
    """A new buffer of zeros on ``device``, its zeros written on return.

    MAX 26.7's ``Buffer.zeros`` enqueues the fill on the device's queue and
    returns before it runs, and ``Model.execute`` does not wait for it: a
    scalar operand (``layer_idx``) passed to a model right after
    ``Buffer.zeros`` was read by the kernel as the allocation's stale bytes
    (``layer_idx=4292902920``), more often behind a large fill queued
    before it. This waits for the device's queue, so every later reader,
    a model's launch included, sees the zeros.

    Args:
        shape: The buffer's shape.
        dtype: Its MAX dtype.
        device: Where it lives; the host CPU when ``None``.

    Returns:
        A buffer whose elements are all zero.
    """
    device = CPU() if device is None else device
    buffer = Buffer.zeros(shape, dtype, device=device)
    device.synchronize()
    return buffer


def to_numpy(buffer: Buffer) -> np.ndarray:
    """Copies a ``Buffer`` (on any device) into a new NumPy array.

    The copy keeps the array valid when the buffer is later mutated in
    place or freed.

    Args:
        buffer: The data; bfloat16 comes back as ``ml_dtypes.bfloat16``.

    Returns:
        An array with the buffer's shape and dtype.
    """
    host = buffer.to(CPU())
    if host.dtype == DType.bfloat16:
        return host.view(DType.uint16).to_numpy().view(_BFLOAT16).copy()
    return host.to_numpy().copy()

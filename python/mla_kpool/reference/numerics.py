"""The pooling formula in float64, and how close a kernel must come to it."""

from __future__ import annotations

from typing import NamedTuple

import ml_dtypes
import numpy as np
import numpy.typing as npt

from ._checks import _ape, _check_kpool, _keys_and_gates


def _pool_blocks(
    keys: np.ndarray, gates: np.ndarray, ape: np.ndarray
) -> np.ndarray:
    """Pools along axis -2: `[..., kpool, head_dim]` -> `[..., head_dim]`."""
    scores = np.asarray(gates, dtype=np.float64) + ape
    weights = np.exp(scores - np.max(scores, axis=-2, keepdims=True))
    weighted = weights * np.asarray(keys, dtype=np.float64)
    return weighted.sum(axis=-2) / weights.sum(axis=-2)


def pool(keys: np.ndarray, gates: np.ndarray, ape: np.ndarray) -> np.ndarray:
    """Collapses one pool's members to one key (per-channel softmax pooling).

    ``pooled[ch] = sum_q softmax_q(gates[q, ch] + ape[q, ch]) * keys[q, ch]``
    with the per-channel maximum subtracted before ``exp``.

    Args:
        keys: Member keys `[kpool, head_dim]`, any float dtype (float32,
            float16, ml_dtypes.bfloat16, float64).
        gates: Member gate scores `[kpool, head_dim]`, any float dtype.
        ape: Within-pool position embedding `[kpool, head_dim]`; row `q` is
            added to member `q`'s gate.

    Returns:
        float64 `[head_dim]`. A NaN score or key makes its channel NaN.

    Raises:
        ValueError: if the shapes are not all `[kpool, head_dim]` with
            `kpool >= 1`.
    """
    keys = np.asarray(keys)
    if keys.ndim != 2 or keys.shape[0] < 1:
        raise ValueError(
            f"keys must be [kpool >= 1, head_dim], got {keys.shape}"
        )
    if np.shape(gates) != keys.shape:
        raise ValueError(
            f"gates must have the shape of keys {keys.shape}, "
            f"got {np.shape(gates)}"
        )
    ape = _ape(ape, keys.shape[0], keys.shape[1])
    return _pool_blocks(keys, gates, ape)


def pool_sequence(
    keys: np.ndarray, gates: np.ndarray, ape: np.ndarray, kpool: int
) -> np.ndarray:
    """Pools a whole sequence in one shot.

    Pool `p` is tokens `[p*kpool, (p+1)*kpool)`.

    This is what the three streaming writers must reproduce, pool for pool,
    however the sequence is split across calls.

    Args:
        keys: Keys `[length, head_dim]`, any float dtype.
        gates: Gate scores `[length, head_dim]`, any float dtype.
        ape: Position embedding `[kpool, head_dim]`.
        kpool: Tokens per pool, `>= 1`.

    Returns:
        float64 `[length // kpool, head_dim]`; a trailing incomplete pool is
        not emitted.

    Raises:
        TypeError: if `kpool` is not an int.
        ValueError: if `kpool < 1` or the shapes disagree.
    """
    kpool = _check_kpool(kpool)
    keys, gates = _keys_and_gates(keys, gates)
    head_dim = keys.shape[1]
    ape = _ape(ape, kpool, head_dim)
    count = keys.shape[0] // kpool
    used = count * kpool
    return _pool_blocks(
        keys[:used].reshape(count, kpool, head_dim),
        gates[:used].reshape(count, kpool, head_dim),
        ape,
    )


#: Tolerance against the float64 oracle (see :func:`tolerance`), by key
#: dtype.
TOLERANCE = {
    np.dtype(np.float32): 1e-5,
    np.dtype(np.float16): 2e-3,
    np.dtype(ml_dtypes.bfloat16): 1.6e-2,
}


def tolerance(dtype: npt.DTypeLike) -> float:
    """Relative tolerance of a pooled key against the float64 oracle.

    A pooled key is a convex combination of its members, so its rounding
    error lives on the scale of the largest member magnitude: a result is
    right when ``|got - want| <= tolerance(dtype) * max |k|`` over the
    pool's members. float32 1e-5, float16 2e-3, bfloat16 1.6e-2 (about
    2^-6: two bfloat16 ulps at 1, whose epsilon is 2^-7).

    Args:
        dtype: The key dtype the kernel ran in (NumPy, or
            ``ml_dtypes.bfloat16``).

    Returns:
        The relative tolerance.

    Raises:
        ValueError: If ``dtype`` is not a key dtype (float32, float16,
            bfloat16).
    """
    key = np.dtype(dtype)
    if key not in TOLERANCE:
        names = ", ".join(str(d) for d in TOLERANCE)
        raise ValueError(f"dtype must be one of {names}, got {key}")
    return TOLERANCE[key]


class PoolErrors(NamedTuple):
    """How far pooled keys are from the oracle's (:func:`pool_errors`).

    Attributes:
        error: float64 ``[pools]``: each pool's largest ``|got - want|`` over
            its channels; NaN where one of the two is NaN and the other not.
        allowed: float64 ``[pools]``: its allowed error, ``rel * scale``
            (``scale`` at least the smallest normal float64).
        channel: int64 ``[pools]``: the channel of ``error`` (the first NaN
            mismatch, if any).
        bad: int64 indices of the pools whose ``error`` is not within
            ``allowed`` (NaN counts as bad).
    """

    error: np.ndarray
    allowed: np.ndarray
    channel: np.ndarray
    bad: np.ndarray


def pool_errors(
    got: npt.ArrayLike,
    want: npt.ArrayLike,
    scale: npt.ArrayLike,
    rel: float,
) -> PoolErrors:
    """Each pooled key's error against the oracle, and the error allowed.

    The rule of :func:`tolerance`: a pool is right when every channel is
    within ``rel * scale``, with ``scale`` its members' largest ``|k|``.
    A channel NaN in both ``got`` and ``want`` (the oracle's NaN
    propagation) counts as equal.

    Args:
        got: ``[pools, head_dim]`` the kernel's keys, any float dtype.
        want: ``[pools, head_dim]`` the oracle's.
        scale: ``[pools]`` each pool's largest member ``|k|``.
        rel: The relative tolerance (:func:`tolerance` of the key dtype).

    Returns:
        A :class:`PoolErrors`.

    Raises:
        ValueError: If ``got`` and ``want`` differ in shape, are not rank
            2, or ``scale`` is not ``[pools]``.
    """
    got = np.asarray(got, dtype=np.float64)
    want = np.asarray(want, dtype=np.float64)
    if got.shape != want.shape or got.ndim != 2:
        raise ValueError(
            f"got must be [pools, head_dim] like want {want.shape}, got"
            f" {got.shape}"
        )
    scale = np.asarray(scale, dtype=np.float64)
    if scale.shape != got.shape[:1]:
        raise ValueError(
            f"scale must be [pools] = [{got.shape[0]}], got {scale.shape}"
        )
    both_nan = np.isnan(got) & np.isnan(want)
    diff = np.where(both_nan, 0.0, np.abs(got - want))
    ranked = np.where(np.isnan(diff), np.inf, diff)
    channel = (
        np.argmax(ranked, axis=1)
        if got.shape[1]
        else np.zeros(len(got), np.int64)
    )
    error = diff.max(axis=1, initial=0.0)
    allowed = rel * np.maximum(scale, np.finfo(np.float64).tiny)
    bad = np.flatnonzero(~(error <= allowed))
    return PoolErrors(error, allowed, channel.astype(np.int64), bad)

"""What the oracle's tests share: small arrays, closed forms, and a
two-request batch with its bad-metadata variants."""

from __future__ import annotations

import dataclasses
import math

import ml_dtypes
import numpy as np

NAN = np.nan
U32_TOP = 2**32


def arr(values, dtype=np.int64) -> np.ndarray:
    return np.array(values, dtype=dtype)


def dominant(keys: list[float], m: int, gap: float = 100.0) -> float:
    """Closed form: member m scores `gap` above every other member."""
    others = sum(key for q, key in enumerate(keys) if q != m)
    tiny = math.exp(-gap)
    return (keys[m] + tiny * others) / (1.0 + tiny * (len(keys) - 1))


FLOAT_DTYPES = [np.float64, np.float32, np.float16, ml_dtypes.bfloat16]


def two_closing_requests():
    """kpool 2, ring 2, max_slots 4, total_tokens 4, equal scores.

    Request 0: c=1, n=2, slot 3, rows 0-1. ring_close: ring index 0 [2, 4] +
    row 0 [6, 8] -> [4, 6]. seed_tail: position 2 -> index 0 from row 1.
    Request 1: c=3, n=2, slot 1, rows 2-3. ring_close: ring index 0 [1, 1] +
    row 2 [3, 5] -> [2, 3]. seed_tail: position 4 -> index 0 from row 3.
    """
    tail = np.full((4, 2, 2, 2), NAN, dtype=np.float32)
    tail[3, :, 0] = [[2, 4], [0, 0]]
    tail[1, :, 0] = [[1, 1], [0, 0]]
    k = np.array([[6, 8], [7, 9], [3, 5], [100, 100]], dtype=np.float32)
    return tail, k, dict(offsets=[0, 2, 4], cache=[1, 3], slots=[3, 1])


@dataclasses.dataclass(frozen=True)
class BadMeta:
    name: str
    field: str
    value: list[int]
    dtype: type = np.int64


BAD_REQUEST1 = [
    BadMeta("slot-eq-max", "slots", [3, 4]),
    BadMeta("slot-negative", "slots", [3, -1], np.int32),
    BadMeta("slot-huge-u32", "slots", [3, U32_TOP - 1], np.uint32),
    BadMeta("end-past-total", "offsets", [0, 2, 5]),
    BadMeta("decreasing", "offsets", [0, 2, 1]),
    BadMeta("cache-negative", "cache", [1, -1], np.int32),
]

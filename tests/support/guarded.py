"""Seeded runtime-metadata vectors and sentinel-guarded device buffers.

Shared by the fuzz tests (``test_fuzz.py``, ``test_step_fused.py``,
``test_check_metadata.py``):

- :func:`draw_meta` draws one call's runtime metadata (``input_row_offsets``,
  ``cache_lengths``, ``slot_idx``, and for compress ``pool_row_offsets``),
  mostly plausible and often broken on purpose, tagged with what it
  exercises; :func:`draw_data` draws the float operands for it.
- :class:`Guarded` puts an operand inside a larger device buffer whose
  guard regions hold :data:`SENTINEL`, a quiet NaN: read, it poisons an
  output; overwritten, :func:`check_guards` reports the first changed
  element by its index past the operand.

Everything is at ``MAIN`` (float32, so the sentinel is a float32 bit
pattern).
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass

import numpy as np
from max.driver import Buffer, Device
from max.dtype import DType

from mla_kpool import reference as ref
from mla_kpool.buffers import to_buffer, to_numpy

from .kpool_cases import MAIN, random_ape, random_rows

U32_MAX = 2**32 - 1
KPOOL = MAIN.kpool
HEAD_DIM = MAIN.head_dim
DTYPE = MAIN.dtype  # float32: the sentinel is a float32 bit pattern

#: Guard fill: a quiet NaN with a recognisable payload. Read, it poisons
#: a pooled channel; overwritten, its bits change.
SENTINEL = np.uint32(0x7FC5A5A5)
#: Ring slots of guard before and after the ring.
GUARD_SLOTS = 3
#: Rows of guard before and after ``k`` and ``gate``.
GUARD_ROWS = 2 * KPOOL

MAX_BATCH = 8
MAX_TOKENS = 40
#: Vectors per op in the main fuzz.
FUZZ_VECTORS = 2000
#: Streams of seeds, one per op, so the ops see different vectors.
STREAMS = {"ring_close": 1, "compress": 2, "seed_tail": 3}


# --------------------------------------------------------------------------
# Metadata vectors
# --------------------------------------------------------------------------


@dataclass(frozen=True)
class Meta:
    """One call's runtime metadata, as Python ints (sent as uint32).

    Attributes:
        name: Seed or case name, shown in failure messages.
        tags: What the vector exercises (for coverage counts).
        total_tokens: Rows of ``k`` and ``gate``.
        max_slots: Ring slots.
        offsets: ``input_row_offsets``, ``[batch + 1]``.
        cache: ``cache_lengths``, ``[batch]``.
        slots: ``slot_idx``, ``[batch]``.
        pool_offsets: ``pool_row_offsets`` for compress, ``[batch + 1]``;
            ``None`` means the true prefix sum.
    """

    name: str
    tags: tuple[str, ...]
    total_tokens: int
    max_slots: int
    offsets: tuple[int, ...]
    cache: tuple[int, ...]
    slots: tuple[int, ...]
    pool_offsets: tuple[int, ...] | None = None

    def arrays(self) -> dict[str, np.ndarray]:
        """The index operands as uint32 arrays."""
        u32 = np.uint32
        return {
            "input_row_offsets": np.array(self.offsets, u32),
            "cache_lengths": np.array(self.cache, u32),
            "slot_idx": np.array(self.slots, u32),
            "pool_row_offsets": np.array(self.pool_row_offsets(), u32),
        }

    def pool_row_offsets(self) -> tuple[int, ...]:
        """``pool_offsets``, or the oracle's prefix sum when not given."""
        if self.pool_offsets is not None:
            return self.pool_offsets
        true = ref.pool_row_offsets(
            np.array(self.offsets, np.int64),
            np.array(self.cache, np.int64),
            KPOOL,
        )
        return tuple(int(v) for v in true)

    def describe(self) -> str:
        """Everything needed to replay the vector."""
        return (
            f"vector {self.name} [{', '.join(self.tags)}]: "
            f"total_tokens={self.total_tokens} max_slots={self.max_slots} "
            f"input_row_offsets={list(self.offsets)} "
            f"cache_lengths={list(self.cache)} slot_idx={list(self.slots)} "
            f"pool_row_offsets={list(self.pool_row_offsets())}"
        )


def _new_tokens(rng: np.random.Generator, batch: int) -> list[int]:
    """New tokens per request: zero, within a pool, or a few pools."""
    n = []
    for _ in range(batch):
        u = rng.random()
        if u < 0.25:
            n.append(0)
        elif u < 0.6:
            n.append(int(rng.integers(1, KPOOL + 1)))
        else:
            n.append(int(rng.integers(0, 3 * KPOOL + 3)))
    while sum(n) > MAX_TOKENS:
        n[int(np.argmax(n))] //= 2
    return n


def _cache_length(rng: np.random.Generator, tags: set[str]) -> int:
    """A cached-prefix length: small, past 500k, or near 2^31 / 2^32."""
    u = rng.random()
    if u < 0.4:
        return int(rng.integers(0, 3 * KPOOL + 1))
    if u < 0.6:
        tags.add("c_past_500k")
        return int(rng.integers(500_000, 50_000_000))
    if u < 0.8:
        tags.add("c_near_2^32")
        return U32_MAX - int(rng.integers(0, 3 * KPOOL + 1))
    tags.add("c_near_2^31")
    return 2**31 - int(rng.integers(-3 * KPOOL, 3 * KPOOL + 1))


def _pool_offsets(
    rng: np.random.Generator, meta: Meta, tags: set[str]
) -> tuple[int, ...] | None:
    """``pool_row_offsets``: true, wrong but non-decreasing, or decreasing."""
    true = list(meta.pool_row_offsets())
    batch = len(meta.cache)
    out_rows = meta.total_tokens // KPOOL
    u = rng.random()
    if u < 0.4:
        return None
    if u < 0.6:
        tags.add("pool_offsets_wrong_counts")
        counts = [
            max(0, b - a + int(rng.integers(-2, 3)))
            for a, b in zip(true[:-1], true[1:], strict=True)
        ]
        values = [int(rng.integers(0, 2))]
        for count in counts:
            values.append(values[-1] + count)
    elif u < 0.7:
        tags.add("pool_offsets_past_rows")
        shift = int(rng.integers(1, out_rows + 4))
        values = [v + shift * (i > 0) for i, v in enumerate(true)]
    elif u < 0.75:
        tags.add("pool_offsets_near_2^32")
        values = sorted(
            int(v) if rng.random() < 0.5 else U32_MAX - int(rng.integers(0, 8))
            for v in true
        )
    else:
        values = [int(rng.integers(0, out_rows + 3)) for _ in range(batch + 1)]
        if batch == 0:
            return tuple(values)
        i = int(rng.integers(0, batch))
        if values[i] == 0:
            values[i] = int(rng.integers(1, out_rows + 3))
        values[i + 1] = int(rng.integers(0, values[i]))
    if any(b < a for a, b in zip(values[:-1], values[1:], strict=True)):
        tags.add("pool_offsets_decreasing")
    return tuple(min(max(v, 0), U32_MAX) for v in values)


def draw_meta(stream: int, index: int, slot_eq_max: float = 0.12) -> Meta:
    """Draws one seeded metadata vector.

    Args:
        stream: Seed stream (one per op).
        index: Vector number within the stream.
        slot_eq_max: Probability that one request's slot is exactly
            ``max_slots`` (the first slot past the ring).

    Returns:
        The vector, named ``"(stream, index)"``.
    """
    rng = np.random.default_rng([stream, index])
    tags: set[str] = set()
    batch = 0 if rng.random() < 0.04 else int(rng.integers(1, MAX_BATCH + 1))
    if batch == 0:
        tags.add("batch0")
    if batch and rng.random() < 0.08:
        tags.add("all_zero_tokens")
        n = [0] * batch
    else:
        n = _new_tokens(rng, batch)
    offsets = [0, *np.cumsum(n, dtype=np.int64).tolist()]
    total = offsets[-1]
    if rng.random() < 0.3:
        total += int(rng.integers(1, KPOOL + 1))  # unused trailing rows
    cache = [_cache_length(rng, tags) for _ in range(batch)]

    if rng.random() < 0.7:
        max_slots = int(rng.integers(max(batch, 1), batch + 5))
    else:
        max_slots = int(rng.integers(0, 9))
    # Valid slots are distinct (two requests on one slot is a caller error
    # with no defined order) and not the batch index.
    perm = rng.permutation(max_slots).tolist()
    slots = [
        perm[b] if b < max_slots else max_slots + int(rng.integers(0, 50))
        for b in range(batch)
    ]
    if batch > max_slots:
        tags.add("slot_past_max")

    if batch:
        if rng.random() < 0.12:
            tags.add("offsets_decreasing")
            b = int(rng.integers(0, batch))
            offsets[b] = offsets[b + 1] + int(rng.integers(1, 6))
        if rng.random() < 0.12:
            i = int(rng.integers(1, batch + 1))
            if rng.random() < 0.5:
                tags.add("offsets_past_total")
                offsets[i] = total + int(rng.integers(1, 10))
            else:
                tags.add("offsets_near_2^32")
                offsets[i] = U32_MAX - int(rng.integers(0, 4))
        if rng.random() < slot_eq_max:
            tags.add("slot_eq_max")
            slots[int(rng.integers(0, batch))] = max_slots
        if rng.random() < 0.1:
            tags.add("slot_page_id")
            slots[int(rng.integers(0, batch))] = int(
                rng.integers(4096, 2_000_000)
            )
        if rng.random() < 0.08:
            tags.add("slot_near_2^32")
            slots[int(rng.integers(0, batch))] = U32_MAX - int(
                rng.integers(0, 4)
            )
        if rng.random() < 0.04:
            tags.add("slot_2^31")
            slots[int(rng.integers(0, batch))] = 2**31
    meta = Meta(
        name=f"({stream}, {index})",
        tags=(),
        total_tokens=total,
        max_slots=max_slots,
        offsets=tuple(offsets),
        cache=tuple(cache),
        slots=tuple(slots),
    )
    pool_offsets = _pool_offsets(rng, meta, tags)
    return Meta(
        name=meta.name,
        tags=tuple(sorted(tags)),
        total_tokens=total,
        max_slots=max_slots,
        offsets=meta.offsets,
        cache=meta.cache,
        slots=meta.slots,
        pool_offsets=pool_offsets,
    )


@dataclass(frozen=True)
class Data:
    """The float operands of one call (host copies)."""

    k: np.ndarray
    gate: np.ndarray
    ape: np.ndarray
    ring: np.ndarray

    @property
    def scale(self) -> float:
        """Largest key magnitude (this call's rows and the ring's keys)."""
        keys = [np.abs(self.k).ravel(), np.abs(self.ring[:, 0]).ravel()]
        return float(max((a.max() for a in keys if a.size), default=1.0))


def draw_data(meta: Meta, seed: object) -> Data:
    """Random finite ``k``, ``gate``, ``ape`` and ring contents for ``meta``."""
    rng = np.random.default_rng(zlib.crc32(repr((meta.name, seed)).encode()))
    k, gate = random_rows(rng, meta.total_tokens, HEAD_DIM, DTYPE)
    ape = random_ape(rng, KPOOL, HEAD_DIM)
    ring = np.empty((meta.max_slots, 2, KPOOL, HEAD_DIM), DTYPE)
    ring[:, 0] = rng.standard_normal(ring[:, 0].shape)
    ring[:, 1] = 4.0 * rng.standard_normal(ring[:, 1].shape)
    return Data(k, gate, ape, ring)


# --------------------------------------------------------------------------
# Guarded buffers
# --------------------------------------------------------------------------


class Guarded:
    """A device buffer ``[guard | body | guard]`` and a view of its body.

    The guards hold :data:`SENTINEL`; the kernels get :attr:`view`, which
    shares memory with :attr:`parent` (see
    ``test_view_writes_land_in_the_parent``).

    Args:
        body: Host contents of the operand (float32).
        guard: Guard elements on each side.
        device: Where the buffers live.
    """

    def __init__(self, body: np.ndarray, guard: int, device: Device) -> None:
        assert body.dtype == np.float32, body.dtype
        self.shape = body.shape
        self.guard = guard
        flat = np.empty(2 * guard + body.size, np.float32)
        flat.view(np.uint32)[:] = SENTINEL
        flat[guard : guard + body.size] = body.ravel()
        self.parent: Buffer = to_buffer(flat, device)
        self.view: Buffer = self.parent[guard : guard + body.size].view(
            DType.float32, body.shape
        )

    def read(self) -> np.ndarray:
        """The whole parent, guards included, as a flat host array."""
        return to_numpy(self.parent)

    def body(self, flat: np.ndarray) -> np.ndarray:
        """The operand's part of a :meth:`read` result, in its shape."""
        size = int(np.prod(self.shape))
        return flat[self.guard : self.guard + size].reshape(self.shape)


def _locate(offset: int, shape: tuple[int, ...]) -> str:
    """Names element ``offset`` (from the body start; may be outside it)."""
    inner = int(np.prod(shape[1:]))
    lead, rest = divmod(offset, inner)
    idx = np.unravel_index(rest, shape[1:]) if inner else ()
    return "[" + ", ".join(str(int(i)) for i in (lead, *idx)) + "]"


def check_guards(
    flat: np.ndarray,
    guard: int,
    shape: tuple[int, ...],
    name: str,
    where: str = "",
) -> None:
    """Asserts that both guard regions of a guarded buffer hold the sentinel.

    Args:
        flat: The whole parent buffer, read back (float32, flat).
        guard: Guard elements on each side of the body.
        shape: The body's shape (``tail``: ``[max_slots, 2, kpool,
            head_dim]``), used to name the first overwritten element as an
            index that runs past the body, e.g. ``[8, 0, 1, 0]`` for slot
            ``max_slots``.
        name: Operand name for the message (``"tail"``).
        where: The call (its metadata), appended to the message.

    Raises:
        AssertionError: If any guard element's bits changed; the message
            says which guard, how many elements, the first one's index and
            bits.
    """
    bits = np.ascontiguousarray(flat).view(np.uint32)
    size = int(np.prod(shape))
    regions = {
        "before": (0, bits[:guard]),
        "after": (guard + size, bits[guard + size :]),
    }
    problems = []
    for side, (start, region) in regions.items():
        bad = np.flatnonzero(region != SENTINEL)
        if bad.size:
            first = start + int(bad[0])
            problems.append(
                f"out-of-bounds write into the guard {side} {name}: "
                f"{bad.size} element(s) changed, first at "
                f"{_locate(first - guard, shape)} "
                f"(bits {int(bits[first]):#010x}, "
                f"sentinel {int(SENTINEL):#010x})"
            )
    if problems:
        raise AssertionError("; ".join([*problems, where]).rstrip("; "))

"""The ring_close cases and checks shared by two test files.

- :func:`mixed_batch`: every kind of request ring_close meets, as one ragged
  batch, and :func:`check_step_mixed_batch`, which runs it through the whole
  (fused) step and checks every output against the oracle;
- :data:`CORNERS`: batches at ``MAIN`` with hand-computed ``closed_pool``,
  run by :func:`check_corner` on the single-op ``"ring_close"`` model;
- :func:`check_ring_close`: one ring_close result against the oracle;
- :class:`RingCloseData` and :func:`corner_data`: one call's data.

tests/writers/test_ring_close.py runs them in its normal parametrization;
tests/grid/test_gpu_emulation.py runs :func:`check_step_mixed_batch` and
:func:`check_corner` on planted faults, which must fail them.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass

import numpy as np
from max.driver import Buffer

from mla_kpool import reference as ref
from mla_kpool.calls import CallInputs
from mla_kpool.runner import Runner

from .kpool_cases import (
    MAIN,
    Config,
    assert_pooled_close,
    bits,
    random_ape,
    random_rows,
)

U32_TOP = 2**32


def case_seed(*parts: object) -> int:
    """A stable per-case seed (shown in every failure message).

    Args:
        *parts: What names the case (their ``repr`` is hashed).

    Returns:
        The CRC-32 of the parts' ``repr``.
    """
    return zlib.crc32(repr(parts).encode())


def key_scale(k: np.ndarray, ring: np.ndarray) -> float:
    """Largest key magnitude among this call's rows and the ring's keys.

    Args:
        k: The call's keys ``[total_tokens, head_dim]``.
        ring: Host ring ``[max_slots, 2, kpool, head_dim]``.

    Returns:
        The scale the pooled-key tolerance is relative to (1.0 when both
        are empty).
    """
    keys = [np.abs(k.astype(np.float64)).ravel()]
    keys.append(np.abs(ring[:, 0].astype(np.float64)).ravel())
    return float(max((a.max() for a in keys if a.size), default=1.0))


@dataclass(frozen=True)
class RingCloseData:
    """One ring_close call's data: what the kernel and the oracle get.

    Attributes:
        seed: The seed it was drawn from (for failure messages).
        ring: Host ring ``[max_slots, 2, kpool, head_dim]``.
        ape: ``[kpool, head_dim]`` float32.
        call: The call's keys, gates and metadata.
    """

    seed: int
    ring: np.ndarray
    ape: np.ndarray
    call: CallInputs

    def run(
        self, runner: Runner, tail: Buffer, ape: np.ndarray | None = None
    ) -> tuple[np.ndarray, np.ndarray]:
        """ring_close on ``tail`` (and ``ape``, else this data's).

        Args:
            runner: Runs the single-op ``"ring_close"`` model at ``MAIN``.
            tail: Device ring the op reads.
            ape: ``[kpool, head_dim]`` float32 to use instead of this
                data's.

        Returns:
            ``(ring_pooled, closed_pool)`` as host arrays.
        """
        pooled, closed = runner.run(
            "ring_close",
            MAIN.kpool,
            tail=tail,
            ape=self.ape if ape is None else ape,
            **self.call.operands(),
        )
        return pooled, closed


def check_ring_close(
    pooled: np.ndarray,
    closed: np.ndarray,
    ring: np.ndarray,
    call: CallInputs,
    ape: np.ndarray,
    kpool: int,
    what: str,
) -> np.ndarray:
    """Asserts one ring_close result against the oracle.

    ``closed_pool`` must equal the oracle's exactly, rows it marks -1 must
    be exactly zero, and the other rows within the dtype's tolerance.

    Args:
        pooled: The kernel's ``ring_pooled`` ``[batch, head_dim]``.
        closed: The kernel's ``closed_pool`` ``[batch]`` int32.
        ring: Host ring before the call ``[max_slots, 2, kpool, head_dim]``.
        call: The call's keys, gates and metadata.
        ape: ``[kpool, head_dim]`` float32.
        kpool: Tokens per pool.
        what: Names the case in failure messages.

    Returns:
        The oracle's ``closed_pool``, for case-specific checks.

    Raises:
        AssertionError: When the result differs from the oracle's.
    """
    k = call.k
    want, want_closed = ref.ring_close(
        ring,
        k,
        call.gate,
        ape,
        call.input_row_offsets,
        call.cache_lengths,
        call.slot_idx,
        kpool,
    )
    assert closed.dtype == np.int32, what
    np.testing.assert_array_equal(closed, want_closed, err_msg=what)
    assert pooled.shape == want.shape and pooled.dtype == k.dtype, what
    open_rows = want_closed < 0
    assert not np.any(bits(pooled[open_rows])), (
        f"{what}: rows with closed_pool -1 are not exactly zero"
    )
    assert np.all(np.isfinite(pooled.astype(np.float64))), what
    assert_pooled_close(
        pooled, want, k.dtype, key_scale(k, ring), what=f"{what} pooled"
    )
    return want_closed


# --------------------------------------------------------------------------
# The mixed batch, through the whole step
# --------------------------------------------------------------------------


@dataclass(frozen=True)
class BatchRow:
    """One row of a hand-built batch: ``c`` cached tokens, ``n`` new ones.

    A request's part of one call, named for what it exercises (a workload's
    request is the serving model's ``Request``).
    """

    name: str
    c: int
    n: int


def mixed_batch(kpool: int) -> list[BatchRow]:
    """Every kind of request ring_close meets, for one ``kpool``.

    With ``kpool`` 1 nothing is ever pending (``c % 1 == 0``); with 2 a
    pending pool has one member, so any decode closes it.

    Args:
        kpool: Tokens per pool (at least 1).

    Returns:
        The batch's rows, in batch order.
    """
    kp = kpool
    half = max(1, kp // 2)
    return [
        BatchRow("decode_closes", 5 * kp + kp - 1, 1),
        BatchRow("decode_stays_open", 7 * kp + 1, 1),
        BatchRow("nothing_pending_prefill", 3 * kp, 3 * kp + 1),
        # Closes pool 2, compresses pool 3 and (kpool > 1) seeds one token
        # over ring index 0, which holds member 0 of the pool being closed.
        BatchRow(
            "chunk_closes_and_runs_past", 2 * kp + half, 2 * kp - half + 1
        ),
        BatchRow("zero_new_tokens", 4 * kp + kp - 1, 0),
        BatchRow("fresh", 0, kp + 1),
        BatchRow("chunk_exactly_closes", 9 * kp + 1, kp - 1),
    ]


def batch_arrays(
    requests: list[BatchRow], max_slots: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(input_row_offsets, cache_lengths, slot_idx)`` as uint32.

    Slots run backwards from the top of the ring, so no request uses the
    slot numbered like its batch index.

    Args:
        requests: The batch's rows.
        max_slots: Ring slots (more than ``len(requests)``).

    Returns:
        The batch's metadata arrays.
    """
    offsets = np.cumsum([0] + [r.n for r in requests]).astype(np.uint32)
    cache = np.array([r.c for r in requests], dtype=np.uint32)
    slots = np.arange(max_slots - 1, max_slots - 1 - len(requests), -1)
    assert not np.any(slots == np.arange(len(requests)))
    return offsets, cache, slots.astype(np.uint32)


def random_ring(
    rng: np.random.Generator, max_slots: int, kpool: int, head_dim: int, dtype
) -> np.ndarray:
    """A random host ring of keys and gates.

    Args:
        rng: Source of the values.
        max_slots: Ring slots.
        kpool: Tokens per pool.
        head_dim: Channels per key.
        dtype: Key and gate dtype.

    Returns:
        ``[max_slots, 2, kpool, head_dim]`` of ``dtype``, contiguous.
    """
    keys, gates = random_rows(rng, max_slots * kpool, head_dim, dtype)
    ring = np.stack([keys, gates]).reshape(2, max_slots, kpool, head_dim)
    return np.ascontiguousarray(ring.transpose(1, 0, 2, 3))


def check_step_mixed_batch(runner: Runner, cfg: Config, seed: int) -> None:
    """One step over :func:`mixed_batch`, every output against the oracle.

    tests/grid/test_gpu_emulation.py runs it on planted faults with a seed of
    its own: an output buffer MAX reuses from this test's run (same shapes, same
    seed) would already hold the right values where a faulty kernel writes
    nothing.

    Args:
        runner: Runs the fused step at ``cfg``.
        cfg: The step configuration.
        seed: Seed of the batch's keys, gates, ape and ring.

    Raises:
        AssertionError: When an output differs from the oracle's.
    """
    what = f"{cfg.id} on {runner.device_name}, seed {seed}"
    rng = np.random.default_rng(seed)
    requests = mixed_batch(cfg.kpool)
    max_slots = len(requests) + 3
    offsets, cache, slots = batch_arrays(requests, max_slots)
    tokens = int(offsets[-1])
    k, gate = random_rows(rng, tokens, cfg.head_dim, cfg.dtype)
    ape = random_ape(rng, cfg.kpool, cfg.head_dim)
    ring = random_ring(rng, max_slots, cfg.kpool, cfg.head_dim, cfg.dtype)

    tail = runner.new_ring(
        max_slots, cfg.kpool, cfg.head_dim, cfg.dtype, fill=ring
    )
    call = CallInputs(k, gate, offsets, cache, slots)
    out = runner.step(tail, call, ape, cfg.kpool)

    closed = check_ring_close(
        out.ring_pooled, out.ring_closed_pool, ring, call, ape, cfg.kpool, what
    )
    by_name = dict(zip((r.name for r in requests), closed, strict=True))
    if cfg.kpool == 1:
        assert np.all(closed == -1), what
    else:
        # The batch must exercise both outcomes, else it proves little.
        for name in (
            "decode_closes",
            "chunk_closes_and_runs_past",
            "chunk_exactly_closes",
        ):
            assert by_name[name] >= 0, f"{what}: {name} did not close"
        for name in ("nothing_pending_prefill", "zero_new_tokens", "fresh"):
            assert by_name[name] == -1, f"{what}: {name} closed"
    if cfg.kpool >= 3:
        assert by_name["decode_stays_open"] == -1, what

    # The rest of the step: every new-token pool, and the ring it leaves.
    want_rows = ref.pool_row_offsets(offsets, cache, cfg.kpool)
    np.testing.assert_array_equal(out.pool_row_offsets, want_rows, what)
    want_pooled = ref.compress(
        k, gate, ape, offsets, want_rows, cache, cfg.kpool
    )
    used = int(want_rows[-1])
    assert used > 0, what
    assert_pooled_close(
        out.pooled[:used],
        want_pooled[:used],
        cfg.dtype,
        key_scale(k, ring),
        what=f"{what} compressed pools",
    )
    assert not np.any(bits(out.pooled[used:])), f"{what}: rows past pools"
    want_ring = ref.seed_tail(ring, k, gate, offsets, cache, slots, cfg.kpool)
    got_ring = runner.read(tail)
    assert np.array_equal(bits(got_ring), bits(want_ring)), (
        f"{what}: ring after the step differs from the oracle's seed_tail"
    )


# --------------------------------------------------------------------------
# Corners at MAIN on the single-op model
# --------------------------------------------------------------------------


@dataclass(frozen=True)
class Corner:
    """A batch at MAIN with hand-computed ``closed_pool``.

    Attributes:
        id: pytest id.
        offsets: ``input_row_offsets``.
        cache: ``cache_lengths``.
        slots: ``slot_idx``.
        closed: Expected ``closed_pool`` (worked out by hand).
        tokens: Rows of ``k``; ``offsets[-1]`` when ``None``.
        max_slots: Ring slots.
    """

    id: str
    offsets: tuple[int, ...]
    cache: tuple[int, ...]
    slots: tuple[int, ...]
    closed: tuple[int, ...]
    tokens: int | None = None
    max_slots: int = 4


# kpool is 4 throughout: c = 4p + r.
CORNERS = [
    Corner("batch0_no_tokens", (0,), (), (), (), tokens=0),
    Corner("batch0_with_tokens", (0,), (), (), (), tokens=5),
    Corner(
        # Slot 4 == max_slots and 2^32 - 1 are outside the ring; the valid
        # request between them still closes.
        "slot_out_of_range",
        (0, 1, 2, 3),
        (3, 7, 11),
        (4, 1, U32_TOP - 1),
        (-1, 1, -1),
    ),
    Corner(
        # Request 1's offsets go down (5 -> 2); its neighbours are fine.
        "offsets_decreasing",
        (0, 5, 2, 8),
        (1, 2, 3),
        (3, 2, 1),
        (0, -1, 0),
    ),
    Corner(
        # Request 1 ends past total_tokens (8); request 2 starts past it.
        "offsets_past_total_tokens",
        (0, 3, 9, 12),
        (5, 1, 6),
        (2, 0, 3),
        (1, -1, -1),
        tokens=8,
    ),
    Corner(
        # c + n passes 2^32: a 32-bit c + n would wrap to a small number.
        # c = 2^32 - 3 = 4 * (2^30 - 1) + 1, so p = 2^30 - 1 for the
        # first three; 2^32 - 2 + 1 = 2^32 - 1 stays short of 2^32.
        "cache_near_2_32",
        (0, 5, 8, 9, 10, 12),
        (U32_TOP - 3, U32_TOP - 3, U32_TOP - 1, U32_TOP - 2, U32_TOP - 6),
        (3, 0, 1, 2, 3),
        (2**30 - 1, 2**30 - 1, 2**30 - 1, -1, 2**30 - 2),
    ),
]


def corner_data(case: Corner, index_dtype=np.uint32) -> RingCloseData:
    """Random keys, gates, ape and ring for one corner case.

    Args:
        case: The corner (its metadata and shapes).
        index_dtype: Dtype of the three index tensors.

    Returns:
        The call's data, seeded from ``case.id``.
    """
    seed = case_seed("corner", case.id)
    rng = np.random.default_rng(seed)
    tokens = case.offsets[-1] if case.tokens is None else case.tokens
    k, gate = random_rows(rng, tokens, MAIN.head_dim, MAIN.dtype)
    ape = random_ape(rng, MAIN.kpool, MAIN.head_dim)
    ring = random_ring(
        rng, case.max_slots, MAIN.kpool, MAIN.head_dim, MAIN.dtype
    )
    index = [
        np.array(v, dtype=index_dtype)
        for v in (case.offsets, case.cache, case.slots)
    ]
    return RingCloseData(seed, ring, ape, CallInputs(k, gate, *index))


def check_corner(runner: Runner, case: Corner) -> None:
    """Runs one :data:`CORNERS` case on the single-op model and checks it.

    ``closed_pool`` must equal the hand-computed ``case.closed``, the
    pooled keys the oracle's, and the ring must be left bitwise unchanged.

    Args:
        runner: Runs the single-op ``"ring_close"`` model at ``MAIN``.
        case: One of :data:`CORNERS`.

    Raises:
        AssertionError: When the kernel's result differs.
    """
    data = corner_data(case)
    ring = data.ring
    what = f"{case.id} on {runner.device_name}, seed {data.seed}"
    tail = runner.new_ring(
        case.max_slots, MAIN.kpool, MAIN.head_dim, MAIN.dtype, fill=ring
    )
    pooled, closed = data.run(runner, tail)
    np.testing.assert_array_equal(
        closed, np.array(case.closed, np.int32), err_msg=what
    )
    assert pooled.shape == (len(case.cache), MAIN.head_dim), what
    check_ring_close(
        pooled, closed, ring, data.call, data.ape, MAIN.kpool, what
    )
    assert np.array_equal(bits(runner.read(tail)), bits(ring)), what

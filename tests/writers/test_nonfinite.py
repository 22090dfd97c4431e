"""Non-finite inputs reach only their own pool's channel (ops.md, numerics).

A NaN or infinity in one member's key or gate, or in a row of ``ape``, must
do to the pooled key exactly what the oracle's softmax does: a NaN key, NaN
gate or ``+inf`` gate (``inf - inf`` after the max subtraction) makes that
pool's channel NaN, an infinite key makes it infinite, a ``-inf`` gate just
drops the member (weight 0) and leaves a finite answer. Nothing spreads to
other channels, other pools or other requests, and a poisoned entry that no
pool of the call uses changes nothing. An ``ape`` row is shared by every
pool, so it affects that channel of every pool built in the call.

Each case poisons one member (two channels, one of them the last, so SIMD
tails are covered) and compares with :mod:`mla_kpool.reference`: NaN
positions equal, infinity positions and signs equal, finite entries within
tolerance. The oracle's non-finite positions are also checked against what
the case predicts, so a case cannot silently poison nothing.

Runs at ``MAIN`` on the single-op ``ring_close``, ``compress`` and
``seed_tail`` models and the ``MAIN`` step model, all compiled by the suite.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass

import numpy as np
import pytest

from mla_kpool import reference as ref
from mla_kpool.calls import CallInputs
from mla_kpool.runner import Runner
from support.kpool_cases import (
    MAIN,
    assert_pooled_close,
    random_ape,
    random_rows,
)

#: The oracle computes inf - inf on purpose here (a +inf score).
pytestmark = pytest.mark.filterwarnings(
    "ignore:invalid value encountered in subtract:RuntimeWarning"
)

KPOOL, HEAD_DIM, DTYPE = MAIN.kpool, MAIN.head_dim, MAIN.dtype
CHANNELS = (5, HEAD_DIM - 1)
NAN, INF = float("nan"), float("inf")

# ring_close batch: slots are not the batch index.
#   b0: c = 6 (pool 1 pending, r = 2: ring members q = 0, 1 in slot 2),
#       n = 5 (rows 0-4; q = 2, 3 are rows 0, 1).
#   b1: c = 9 (pool 2, r = 1: ring member q = 0 in slot 0),
#       n = 3 (rows 5-7 are q = 1, 2, 3).
#   b2: c = 3 (pool 0, r = 3, slot 1), n = 0: closes nothing.
RC_OFFSETS = np.array([0, 5, 8, 8], np.uint32)
RC_CACHE = np.array([6, 9, 3], np.uint32)
RC_SLOTS = np.array([2, 0, 1], np.uint32)
RC_MAX_SLOTS = 3

# compress batch (total 20 rows, 5 output rows):
#   b0: c = 0, n = 9 (rows 0-8): pools 0, 1 from rows 0-3, 4-7 -> out 0, 1;
#       row 8 is a trailing token (seed_tail's).
#   b1: c = 2, n = 11 (rows 9-19): rows 9, 10 finish pool 0 (ring_close's);
#       pools 1, 2 from rows 11-14, 15-18 -> out 2, 3; row 19 trailing.
#   out row 4 stays zero.
CP_OFFSETS = np.array([0, 9, 20], np.uint32)
CP_CACHE = np.array([0, 2], np.uint32)


@dataclass(frozen=True)
class Target:
    """Where a poisoned value goes and which output cells it reaches.

    Attributes:
        id: Readable name.
        source: ``"ring"`` (an entry ``tail[slot, plane, member]``), ``"row"``
            (row ``index`` of ``k``/``gate``) or ``"ape"`` (row ``index``).
        index: Ring ``(slot, member)`` or row number.
        reaches: Output rows (ring_close: request; compress: pooled row)
            whose ``CHANNELS`` the poison reaches; empty if no pool uses it.
    """

    id: str
    source: str
    index: tuple[int, ...]
    reaches: tuple[int, ...]


RING_CLOSE_TARGETS = [
    Target("b0_ring_member", "ring", (2, 1), (0,)),
    Target("b0_new_member", "row", (1,), (0,)),
    Target("b1_ring_member", "ring", (0, 0), (1,)),
    Target("b1_new_member", "row", (7,), (1,)),
    # Slot 1 belongs to b2, which closes nothing: the ring is not read.
    Target("ring_of_idle_request", "ring", (1, 0), ()),
    # Row 2 of b0 is member q = 4: past the pending pool.
    Target("row_past_pending_pool", "row", (2,), ()),
    Target("ape_row", "ape", (3,), (0, 1)),
]

COMPRESS_TARGETS = [
    Target("b0_pool1_member2", "row", (6,), (1,)),
    Target("b1_pool2_member0", "row", (15,), (3,)),
    Target("ring_close_row", "row", (9,), ()),
    Target("trailing_row", "row", (19,), ()),
    Target("ape_row", "ape", (0,), (0, 1, 2, 3)),
]


@dataclass(frozen=True)
class Poison:
    """A value, the field it goes into, and the oracle's resulting channel.

    Attributes:
        field: ``"key"`` or ``"gate"`` (for an ``ape`` target, ``"gate"``:
            ape adds to the score).
        value: The injected value.
        effect: What the reached channels become: ``"nan"``, ``"+inf"``,
            ``"-inf"`` or ``"finite"`` (the member is dropped).
    """

    field: str
    value: float
    effect: str

    @property
    def id(self) -> str:
        return f"{self.field}_{self.value}"


POISONS = [
    Poison("key", NAN, "nan"),
    Poison("key", INF, "+inf"),
    Poison("key", -INF, "-inf"),
    Poison("gate", NAN, "nan"),
    # exp(inf - max) = exp(inf - inf) = NaN.
    Poison("gate", INF, "nan"),
    # exp(-inf - max) = 0: the member drops out, the channel stays finite.
    Poison("gate", -INF, "finite"),
]


def _cases(op: str, targets: list[Target]) -> list[pytest.param]:
    return [
        pytest.param(op, t, p, id=f"{op}-{t.id}-{p.id}")
        for t in targets
        for p in POISONS
        if t.source != "ape" or p.field == "gate"
    ]


CASES = _cases("ring_close", RING_CLOSE_TARGETS) + _cases(
    "compress", COMPRESS_TARGETS
)


def _poison(
    target: Target,
    poison: Poison,
    k: np.ndarray,
    gate: np.ndarray,
    ape: np.ndarray,
    ring: np.ndarray,
) -> None:
    """Writes the poison into the operands in place."""
    plane = 0 if poison.field == "key" else 1
    for ch in CHANNELS:
        if target.source == "ring":
            slot, member = target.index
            ring[slot, plane, member, ch] = poison.value
        elif target.source == "row":
            (k if poison.field == "key" else gate)[target.index[0], ch] = (
                poison.value
            )
        else:
            ape[target.index[0], ch] = poison.value


def _expected_mask(shape: tuple[int, ...], target: Target) -> np.ndarray:
    mask = np.zeros(shape, bool)
    for row in target.reaches:
        mask[row, list(CHANNELS)] = True
    return mask


def assert_nonfinite_like_oracle(
    actual: np.ndarray,
    expected: np.ndarray,
    scale: float,
    what: str,
) -> None:
    """NaN and infinity positions equal the oracle's; the rest is close.

    Args:
        actual: Kernel output.
        expected: Oracle output (float64).
        scale: Largest finite member key magnitude.
        what: Case description for the messages.
    """
    actual = np.asarray(actual, np.float64)
    np.testing.assert_array_equal(
        np.isnan(actual), np.isnan(expected), err_msg=f"NaN positions, {what}"
    )
    for name, test in (("+inf", np.isposinf), ("-inf", np.isneginf)):
        np.testing.assert_array_equal(
            test(actual), test(expected), err_msg=f"{name} positions, {what}"
        )
    finite = np.isfinite(expected)
    assert_pooled_close(actual[finite], expected[finite], DTYPE, scale, what)


def _check_oracle_effect(
    expected: np.ndarray, target: Target, poison: Poison, what: str
) -> None:
    """The oracle's non-finite cells are exactly those the case predicts."""
    reached = _expected_mask(expected.shape, target)
    if poison.effect == "finite":
        reached[:] = False
    assert np.array_equal(~np.isfinite(expected), reached), what
    kind = {"nan": np.isnan, "+inf": np.isposinf, "-inf": np.isneginf}
    if reached.any():
        assert kind[poison.effect](expected[reached]).all(), what


@pytest.mark.parametrize(("op", "target", "poison"), CASES)
def test_nonfinite_member(
    request: pytest.FixtureRequest,
    runner: Runner,
    op: str,
    target: Target,
    poison: Poison,
) -> None:
    rng = np.random.default_rng(zlib.crc32(f"{op}-{target.id}".encode()))
    what = (
        f"{op} {target.id} {poison.field}={poison.value} ({runner.device_name})"
    )
    ape = random_ape(rng, KPOOL, HEAD_DIM)
    if op == "ring_close":
        k, gate = random_rows(rng, int(RC_OFFSETS[-1]), HEAD_DIM, DTYPE)
        ring = random_rows(rng, RC_MAX_SLOTS * 2 * KPOOL, HEAD_DIM, DTYPE)[0]
        ring = ring.reshape(RC_MAX_SLOTS, 2, KPOOL, HEAD_DIM)
    else:
        k, gate = random_rows(rng, int(CP_OFFSETS[-1]), HEAD_DIM, DTYPE)
        ring = np.zeros((0, 2, KPOOL, HEAD_DIM), DTYPE)
    scale = float(max(np.abs(k).max(), np.abs(ring[:, 0]).max(initial=0)))
    _poison(target, poison, k, gate, ape, ring)

    if op == "ring_close":
        meta = (RC_OFFSETS, RC_CACHE, RC_SLOTS)
        expected, expected_closed = ref.ring_close(
            ring, k, gate, ape, *meta, KPOOL
        )
        tail = runner.new_ring(RC_MAX_SLOTS, KPOOL, HEAD_DIM, DTYPE, ring)
        pooled, closed = runner.run(
            "ring_close",
            KPOOL,
            tail=tail,
            ape=ape,
            **CallInputs(k, gate, *meta).operands(),
        )
        np.testing.assert_array_equal(closed, [1, 2, -1], err_msg=what)
        np.testing.assert_array_equal(expected_closed, [1, 2, -1])
    else:
        pool_offsets = ref.pool_row_offsets(CP_OFFSETS, CP_CACHE, KPOOL)
        np.testing.assert_array_equal(pool_offsets, [0, 2, 4])
        meta = (CP_OFFSETS, pool_offsets.astype(np.uint32), CP_CACHE)
        expected = ref.compress(k, gate, ape, *meta, KPOOL)
        (pooled,) = runner.run(
            "compress",
            KPOOL,
            k=k,
            gate=gate,
            ape=ape,
            input_row_offsets=meta[0],
            pool_row_offsets=meta[1],
            cache_lengths=meta[2],
        )

    _check_oracle_effect(expected, target, poison, what)
    assert_nonfinite_like_oracle(pooled, expected, scale, what)


def test_seed_tail_stores_nonfinite_members_bitwise(runner: Runner) -> None:
    """seed_tail copies NaN (payload kept) and infinities bit for bit."""
    rng = np.random.default_rng(23)
    k, gate = random_rows(rng, 6, HEAD_DIM, DTYPE)
    payload_nan = np.array([0x7FC12345], np.uint32).view(np.float32)[0]
    # c = 1, n = 6: positions 4, 5, 6 (rows 3, 4, 5) are stashed; row 5 is
    # position 6, ring member 2.
    k[5, 0], k[5, 1], gate[5, 2], gate[5, 3] = payload_nan, INF, -INF, NAN
    before = rng.standard_normal((2, 2, KPOOL, HEAD_DIM)).astype(DTYPE)
    meta = (np.array([0, 6], np.uint32), np.array([1], np.uint32))
    slots = np.array([1], np.uint32)
    tail = runner.new_ring(2, KPOOL, HEAD_DIM, DTYPE, before)
    runner.run(
        "seed_tail",
        KPOOL,
        tail=tail,
        **CallInputs(k, gate, *meta, slots).operands(),
    )
    got = runner.read(tail)
    expected = ref.seed_tail(before, k, gate, *meta, slots, KPOOL)
    np.testing.assert_array_equal(got.view(np.uint32), expected.view(np.uint32))
    assert got.view(np.uint32)[1, 0, 2, 0] == 0x7FC12345
    assert np.isposinf(got[1, 0, 2, 1]) and np.isneginf(got[1, 1, 2, 2])


def test_nan_member_poisons_one_pool_across_calls(runner: Runner) -> None:
    """A NaN seeded into the ring reaches only its pool's channel, later.

    Two step calls at MAIN. Call 1 stashes request 0's positions 4, 5
    (position 5 has a NaN key in channel 9) into the ring; call 2 closes
    pool 1 from the ring and builds pool 2 from new rows. Only request 0's
    pool 1, channel 9, may be NaN; its pools 0 and 2 and all of request 1's
    pools must match one-shot pooling of the sequences.
    """
    rng = np.random.default_rng(29)
    lengths = (12, 12)
    seqs = [random_rows(rng, n, HEAD_DIM, DTYPE) for n in lengths]
    seqs[0][0][5, 9] = NAN
    ape = random_ape(rng, KPOOL, HEAD_DIM)
    tail = runner.new_ring(2, KPOOL, HEAD_DIM, DTYPE)
    slots = np.array([1, 0], np.uint32)
    got: list[dict[int, np.ndarray]] = [{}, {}]
    for start, stop in (((0, 0), (6, 7)), ((6, 7), (12, 12))):
        k = np.concatenate(
            [s[0][a:b] for s, a, b in zip(seqs, start, stop, strict=False)]
        )
        g = np.concatenate(
            [s[1][a:b] for s, a, b in zip(seqs, start, stop, strict=False)]
        )
        counts = [b - a for a, b in zip(start, stop, strict=True)]
        offsets = np.array([0, *np.cumsum(counts)], np.uint32)
        cache = np.array(start, np.uint32)
        call = CallInputs(k, g, offsets, cache, slots)
        res = runner.step(tail, call, ape, KPOOL)
        for b, pools in enumerate(res.pools()):
            got[b].update({p: row.key for p, row in pools.items()})
    scale = max(float(np.nanmax(np.abs(s[0]))) for s in seqs)
    for b, (keys, gates) in enumerate(seqs):
        expected = ref.pool_sequence(keys, gates, ape, KPOOL)
        assert sorted(got[b]) == [0, 1, 2], (b, sorted(got[b]))
        actual = np.stack([got[b][p] for p in range(3)])
        assert_nonfinite_like_oracle(
            actual, expected, scale, f"request {b} ({runner.device_name})"
        )
    # The case itself: exactly one NaN, in request 0's pool 1, channel 9.
    nan_cells = [
        (b, p, int(ch))
        for b in range(2)
        for p in range(3)
        for ch in np.flatnonzero(np.isnan(got[b][p]))
    ]
    assert nan_cells == [(0, 1, 9)], nan_cells

"""compress and seed_tail against their contract, and writer against writer.

compress is checked pool by pool against :func:`reference.pool_sequence` of
each request's whole sequence (its cached prefix, never read, plus this
call's rows), so a pool landing on the wrong row or built from the wrong
rows shows, and against :func:`reference.compress` for the full output.
seed_tail runs on a ring filled with a distinct sentinel in every entry;
afterwards the ring must equal, bit for bit, the sentinel with exactly the
trailing positions overwritten (docs/ops.md, seed_tail), so a write below
``cache_lengths`` or into a neighbouring slot cannot hide.

The writer-against-writer test builds the same pool twice in one step call,
once by ring_close (``r`` members pre-seeded in the ring, the rest new) and
once by compress (all members new), and requires bitwise equality
(docs/ops.md, numerics), for every dtype.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import pytest

from conftest import DEVICE_NAMES
from mla_kpool import reference
from mla_kpool.calls import CallInputs
from mla_kpool.runner import ModelKey, Runner, model_key
from support.kpool_cases import (
    BF16,
    F16,
    MAIN,
    STEP_CONFIGS,
    Config,
    assert_pooled_close,
    bits,
    random_ape,
    random_rows,
    step_keys,
)


def _offsets(counts: list[int]) -> np.ndarray:
    return np.concatenate([[0], np.cumsum(counts)]).astype(np.uint32)


@dataclass(frozen=True)
class Batch:
    """A call's requests as ``(cache_length, new_tokens, slot)`` triples."""

    id: str
    requests: tuple[tuple[int, int, int], ...]

    @property
    def cache(self) -> np.ndarray:
        return np.array([c for c, _, _ in self.requests], np.uint32)

    @property
    def counts(self) -> list[int]:
        return [n for _, n, _ in self.requests]

    @property
    def slots(self) -> np.ndarray:
        return np.array([s for _, _, s in self.requests], np.uint32)


U32_EDGE = 2**32 - 2  # c fits uint32, c + n does not

# --------------------------------------------------------------------------
# compress
# --------------------------------------------------------------------------

COMPRESS_CASES = [
    Batch("aligned_one_request", ((0, 16, 0),)),
    # ceil(1/4) = 1: pool 0 is ring_close's, so pools 1, 2 land at rows 0, 1
    # and row 2 (of 15 // 4 = 3) stays zero.
    Batch("c_mid_pool", ((1, 14, 0),)),
    Batch(
        "c_not_multiple_several",
        ((3, 9, 0), (6, 11, 0), (5, 3, 0), (2, 2, 0), (7, 30, 0)),
    ),
    Batch(
        "mixed_with_zero_pool_requests",
        ((0, 4, 0), (1, 2, 0), (0, 0, 0), (3, 9, 0), (6, 1, 0), (9, 12, 0)),
    ),
    Batch("only_zero_pool_requests", ((1, 2, 0), (0, 3, 0), (5, 0, 0))),
    Batch("exact_fill_after_mid_pool", ((2, 6, 0), (4, 4, 0))),
    Batch("past_uint32", ((U32_EDGE, 9, 0), (1, 7, 0))),
]


@pytest.mark.parametrize("batch", COMPRESS_CASES, ids=lambda b: b.id)
@pytest.mark.parametrize("device", DEVICE_NAMES)
def test_compress_places_every_pool(
    batch: Batch, device: str, runners: Callable[[str], Runner]
) -> None:
    cfg, seed = MAIN, 11
    kp = cfg.kpool
    rng = np.random.default_rng(seed)
    ape = random_ape(rng, kp, cfg.head_dim)
    offsets = _offsets(batch.counts)
    total = int(offsets[-1])
    k, gate = random_rows(rng, total, cfg.head_dim, cfg.dtype)
    pool_rows = reference.pool_row_offsets(offsets, batch.cache, kp)

    (got,) = runners(device).run(
        "compress",
        kp,
        k=k,
        gate=gate,
        ape=ape,
        input_row_offsets=offsets,
        pool_row_offsets=pool_rows.astype(np.uint32),
        cache_lengths=batch.cache,
    )

    where = f"{batch.id} (seed {seed}, {cfg.id}, {device})"
    assert got.shape == (total // kp, cfg.head_dim), where
    assert got.dtype == cfg.dtype, where
    scale = float(np.abs(k.astype(np.float64)).max(initial=0.0))
    for b, (c, n, _) in enumerate(batch.requests):
        # The request's sequence from the start of its first full pool: the
        # cached tokens of that pool are not this call's, so pad with
        # garbage that a correct kernel never reads.
        start = int(offsets[b])
        first = -(-c // kp)
        count = max(0, (c + n) // kp - first)
        lead = first * kp - c  # this call's tokens that finish pool first-1
        rows = slice(start + lead, start + lead + count * kp)
        expected = reference.pool_sequence(k[rows], gate[rows], ape, kp)
        o = int(pool_rows[b])
        assert_pooled_close(
            got[o : o + count],
            expected,
            cfg.dtype,
            scale,
            what=f"{where}: request {b} (c={c}, n={n}) rows {o}..",
        )
    used = int(pool_rows[-1])
    assert np.all(got[used:] == 0), (
        f"{where}: rows from pool_row_offsets[batch] = {used} are not zero"
    )
    assert_pooled_close(
        got,
        reference.compress(k, gate, ape, offsets, pool_rows, batch.cache, kp),
        cfg.dtype,
        scale,
        what=f"{where}: compress output",
    )


# --------------------------------------------------------------------------
# seed_tail
# --------------------------------------------------------------------------

SEED_SLOTS = 6

SEED_CASES = [
    # c = 5: position 4 (index 0) is a pending member below c, kept.
    Batch("decode_one_token_mid_pool", ((5, 1, 3),)),
    Batch("stays_inside_pool", ((1, 2, 4),)),
    # c + n = 8 fills the pool: nothing is left to stash.
    Batch("fills_pool_exactly", ((6, 2, 0),)),
    Batch("crosses_into_next_pool", ((2, 7, 5),)),
    Batch("aligned_start_partial", ((8, 3, 1),)),
    Batch("zero_tokens", ((3, 0, 2),)),
    Batch("long_prefill", ((0, 23, 2),)),
    Batch(
        "several_requests_slots_not_rows",
        ((5, 1, 4), (0, 7, 0), (9, 0, 5), (13, 2, 1), (2, 9, 3), (7, 1, 2)),
    ),
    Batch("past_uint32", ((U32_EDGE, 5, 1), (U32_EDGE - 1, 1, 3))),
]


def _sentinel_ring(dtype: np.dtype, head_dim: int, kpool: int) -> np.ndarray:
    """A ring whose entries all hold distinct, exactly representable values."""
    shape = (SEED_SLOTS, 2, kpool, head_dim)
    values = -1000.0 - np.arange(np.prod(shape), dtype=np.float64) / 8
    return values.reshape(shape).astype(dtype)


def _expected_ring(
    ring: np.ndarray,
    k: np.ndarray,
    gate: np.ndarray,
    batch: Batch,
    offsets: np.ndarray,
    kpool: int,
) -> tuple[np.ndarray, list[list[int]]]:
    """seed_tail's contract written out: the ring after seed_tail, and the
    positions each request writes."""
    out = ring.copy()
    written = []
    for b, (c, n, s) in enumerate(batch.requests):
        lo = max(c, (c + n) // kpool * kpool)
        positions = list(range(lo, c + n))
        for pos in positions:
            row = int(offsets[b]) + pos - c
            out[s, 0, pos % kpool] = k[row]
            out[s, 1, pos % kpool] = gate[row]
        written.append(positions)
    return out, written


def _run_seed_tail(
    runner: Runner, batch: Batch, seed: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    cfg = MAIN
    rng = np.random.default_rng(seed)
    offsets = _offsets(batch.counts)
    k, gate = random_rows(rng, int(offsets[-1]), cfg.head_dim, cfg.dtype)
    before = _sentinel_ring(cfg.dtype, cfg.head_dim, cfg.kpool)
    ring = runner.new_ring(
        SEED_SLOTS, cfg.kpool, cfg.head_dim, cfg.dtype, fill=before
    )
    call = CallInputs(k, gate, offsets, batch.cache, batch.slots)
    runner.run("seed_tail", cfg.kpool, tail=ring, **call.operands())
    return before, runner.read(ring), k, gate, offsets


@pytest.mark.parametrize("batch", SEED_CASES, ids=lambda b: b.id)
@pytest.mark.parametrize("device", DEVICE_NAMES)
def test_seed_tail_writes_exactly_the_trailing_positions(
    batch: Batch, device: str, runners: Callable[[str], Runner]
) -> None:
    seed, kp = 5, MAIN.kpool
    before, after, k, gate, offsets = _run_seed_tail(
        runners(device), batch, seed
    )
    expected, written = _expected_ring(before, k, gate, batch, offsets, kp)
    where = f"{batch.id} (seed {seed}, {MAIN.id}, {device})"

    for b, (c, n, s) in enumerate(batch.requests):
        if c + n >= (c // kp + 1) * kp:
            continue  # the pending pool closes: later positions reuse it
        # The pending pool's members below c must survive this call.
        below = [i % kp for i in range(c // kp * kp, c)]
        np.testing.assert_array_equal(
            bits(after[s, :, below]),
            bits(before[s, :, below]),
            err_msg=f"{where}: request {b} (c={c}) overwrote ring positions "
            f"below cache_length (slot {s}, indices {below})",
        )
    changed = np.argwhere(np.any(bits(after) != bits(expected), axis=-1))
    assert changed.size == 0, (
        f"{where}: ring entries [slot, plane, index] differ from the "
        f"expected writes {written}: {changed.tolist()}"
    )
    ref = reference.seed_tail(
        before, k, gate, offsets, batch.cache, batch.slots, kp
    )
    np.testing.assert_array_equal(bits(after), bits(ref), err_msg=where)


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("device", DEVICE_NAMES)
def test_seed_tail_random_batches_leave_other_entries(
    seed: int, device: str, runners: Callable[[str], Runner]
) -> None:
    """Random ``(c, n)`` on distinct random slots; the whole ring is checked."""
    rng = np.random.default_rng(1000 + seed)
    batch_size = 6
    slots = rng.permutation(SEED_SLOTS)[:batch_size]
    batch = Batch(
        f"random-{seed}",
        tuple(
            (int(rng.integers(0, 40)), int(rng.integers(0, 12)), int(s))
            for s in slots
        ),
    )
    before, after, k, gate, offsets = _run_seed_tail(
        runners(device), batch, seed
    )
    expected, _ = _expected_ring(before, k, gate, batch, offsets, MAIN.kpool)
    np.testing.assert_array_equal(
        bits(after),
        bits(expected),
        err_msg=f"seed {seed}, {MAIN.id}, {device}: requests "
        f"(c, n, slot) = {batch.requests}",
    )


# --------------------------------------------------------------------------
# ring_close against compress, bitwise
# --------------------------------------------------------------------------

#: One step model per dtype, all already in STEP_CONFIGS.
WRITER_CONFIGS = [MAIN, Config(BF16, 4, 128), Config(F16, 16, 32)]
assert all(c in STEP_CONFIGS for c in WRITER_CONFIGS)


def COMPILED_TOGETHER(device: str) -> list[ModelKey]:  # noqa: N802
    """This file's models, compiled as one graph per host device.

    compress and seed_tail at ``MAIN``, and the step of every
    ``WRITER_CONFIGS`` entry, on rings of one pool (see the ``runners``
    fixture in conftest.py).
    """
    writers = [
        model_key(
            op,
            MAIN.kpool,
            dtype=MAIN.dtype,
            head_dim=MAIN.head_dim,
            ring_len=ring,
        )
        for op, ring in (("compress", 0), ("seed_tail", MAIN.kpool))
    ]
    return writers + step_keys(WRITER_CONFIGS)


@pytest.mark.parametrize("cfg", WRITER_CONFIGS, ids=lambda c: c.id)
@pytest.mark.parametrize("device", DEVICE_NAMES)
def test_ring_close_and_compress_agree_bitwise(
    cfg: Config, device: str, runners: Callable[[str], Runner]
) -> None:
    """For every ``r`` in ``1..kpool-1``, one request closes a pool from ``r``
    ring members plus new tokens (ring_close) while another request brings
    the same ``kpool`` members as new tokens (compress), in the same call.
    """
    seed, kp, hd = 21, cfg.kpool, cfg.head_dim
    rng = np.random.default_rng(seed)
    ape = random_ape(rng, kp, hd)
    members = [random_rows(rng, kp, hd, cfg.dtype) for _ in range(1, kp)]
    max_slots = 2 * (kp - 1)
    slots = rng.permutation(max_slots)
    ring_host = np.full((max_slots, 2, kp, hd), np.nan, dtype=cfg.dtype)

    # Row 2i closes via the ring (c = p*kpool + r), row 2i+1 via compress
    # (c = p'*kpool aligned); odd r use pool 0 (c = r and c = 0), even r
    # later pools. Extra tokens after the pool exercise compress and
    # seed_tail in the same call without touching the pool compared.
    cache, keys, gates, counts = [], [], [], []
    for i, r in enumerate(range(1, kp)):
        mk, mg = members[i]
        p = 0 if r % 2 else int(rng.integers(1, 50))
        ring_slot = int(slots[2 * i])
        ring_host[ring_slot, 0, :r] = mk[:r]
        ring_host[ring_slot, 1, :r] = mg[:r]
        extra_k, extra_g = random_rows(
            rng, int(rng.integers(0, kp)), hd, cfg.dtype
        )
        cache += [p * kp + r, 0 if r % 2 else int(rng.integers(0, 50)) * kp]
        keys += [mk[r:], extra_k, mk, extra_k]
        gates += [mg[r:], extra_g, mg, extra_g]
        counts += [kp - r + len(extra_k), kp + len(extra_k)]
    slot_idx = np.array(slots[: 2 * (kp - 1)], np.uint32)
    offsets = _offsets(counts)

    runner = runners(device)
    ring = runner.new_ring(max_slots, kp, hd, cfg.dtype, fill=ring_host)
    call = CallInputs(
        np.concatenate(keys),
        np.concatenate(gates),
        offsets,
        np.array(cache, np.uint32),
        slot_idx,
    )
    res = runner.step(ring, call, ape, kp)
    pools = [{p: row.key for p, row in got.items()} for got in res.pools()]
    where = f"seed {seed}, {cfg.id}, {device}"
    for i, r in enumerate(range(1, kp)):
        via_ring, via_compress = pools[2 * i], pools[2 * i + 1]
        p_ring, p_fresh = cache[2 * i] // kp, cache[2 * i + 1] // kp
        assert p_ring in via_ring and p_fresh in via_compress, (
            f"{where}: r={r}: pools {sorted(via_ring)} / {sorted(via_compress)}"
        )
        assert int(res.ring_closed_pool[2 * i]) == p_ring, f"{where}: r={r}"
        np.testing.assert_array_equal(
            bits(via_ring[p_ring]),
            bits(via_compress[p_fresh]),
            err_msg=f"{where}: r={r}: ring_close and compress built the same "
            "members into different bits",
        )
        mk, mg = members[i]
        assert_pooled_close(
            via_ring[p_ring],
            reference.pool(mk, mg, ape),
            cfg.dtype,
            float(np.abs(mk.astype(np.float64)).max()),
            what=f"{where}: r={r}",
        )

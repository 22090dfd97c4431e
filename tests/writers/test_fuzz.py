"""Seeded fuzzing of runtime metadata, with guarded memory around the kernels.

As docs/ops.md (bad metadata) promises, bad runtime metadata never reads or
writes out of bounds, and gives the documented answer (a skipped request, a
zero row, ``-1``, a truncated span). Each vector below is a random call's
metadata (``input_row_offsets``, ``cache_lengths``, ``slot_idx``, and for
compress ``pool_row_offsets``), mostly plausible and often broken on purpose:
decreasing offsets, offsets past ``total_tokens`` or near 2^32, slots at or
far past ``max_slots`` (a physical cache-page id, say) or near 2^32, cache
lengths past 500,000 and near 2^32 (``c + n`` wraps in 32 bits), batch 0,
zero-token requests, and ``pool_row_offsets`` that disagree with the true
counts, non-decreasing or not. Every call is compared with the oracle
(:mod:`mla_kpool.reference`).

Memory guards: MAX allocates the outputs, so only operands can be guarded.
Each call gets

- the ring as a view into a larger device buffer whose guard regions, a few
  slots before and after, hold a sentinel bit pattern that must be bitwise
  untouched afterwards (an out-of-bounds write), and
- ``k`` and ``gate`` as views into larger buffers whose guard rows hold the
  same pattern, a NaN, so an out-of-bounds read poisons an output, which
  the oracle comparison (and the no-NaN check) catches; an out-of-bounds
  ring read by ``ring_close`` lands in the ring's NaN guards the same way.

The vectors, the guarded buffers and the sentinel check
(:func:`guarded.check_guards`) live in ``guarded.py``, shared with the other
fuzz tests. A test compiles a copy of the kernels with an off-by-one
planted in the slot check and shows that the harness reports it.

A zero-element operand (an empty ring, a call with no rows) cannot be
guarded: MAX hands the kernel such a buffer without its address in the
parent. Those vectors still run and are still checked against the oracle.

The fuzz runs at ``MAIN`` on the single-op models (``ring_close``,
``compress``, ``seed_tail``), compiled as one graph per device
(``COMPILED_TOGETHER``); the 6,000 vectors take about 10 s on two CPU
cores, mostly the oracle and buffer copies.
"""

from __future__ import annotations

import shutil
import time
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

from mla_kpool import KERNELS
from mla_kpool import reference as ref
from mla_kpool.buffers import to_numpy
from mla_kpool.runner import ModelKey, Runner, model_key
from support.guarded import (
    DTYPE,
    FUZZ_VECTORS,
    GUARD_ROWS,
    GUARD_SLOTS,
    HEAD_DIM,
    KPOOL,
    SENTINEL,
    STREAMS,
    U32_MAX,
    Data,
    Guarded,
    Meta,
    check_guards,
    draw_data,
    draw_meta,
)
from support.kpool_cases import TOLERANCE, bits

# --------------------------------------------------------------------------
# One call per op, checked against the oracle
# --------------------------------------------------------------------------


def _close(actual: np.ndarray, expected: np.ndarray, scale: float) -> bool:
    tol = TOLERANCE[np.dtype(DTYPE)]
    return bool(
        np.all(np.abs(actual - expected) <= tol * (np.abs(expected) + scale))
    )


def _assert_close(
    actual: np.ndarray, expected: np.ndarray, scale: float, what: str
) -> None:
    tol = TOLERANCE[np.dtype(DTYPE)]
    np.testing.assert_allclose(
        actual.astype(np.float64),
        expected,
        rtol=tol,
        atol=tol * scale,
        err_msg=what,
    )


@dataclass
class Call:
    """One op call on guarded operands, ready for :meth:`run`."""

    runner: Runner
    op: str
    meta: Meta
    data: Data

    def run(self) -> tuple[list[np.ndarray], Guarded, Guarded, Guarded]:
        """Executes the op; returns outputs and the guarded ring, k, gate."""
        device = self.runner.device
        d, idx = self.data, self.meta.arrays()
        ring = Guarded(d.ring, GUARD_SLOTS * 2 * KPOOL * HEAD_DIM, device)
        k = Guarded(d.k, GUARD_ROWS * HEAD_DIM, device)
        gate = Guarded(d.gate, GUARD_ROWS * HEAD_DIM, device)
        operands = {
            "k": d.k,
            "gate": d.gate,
            "input_row_offsets": idx["input_row_offsets"],
            "cache_lengths": idx["cache_lengths"],
        }
        if self.op == "compress":
            operands["ape"] = d.ape
            operands["pool_row_offsets"] = idx["pool_row_offsets"]
        else:
            operands["tail"] = ring.view
            operands["slot_idx"] = idx["slot_idx"]
            if self.op == "ring_close":
                operands["ape"] = d.ape
        model, args = self.runner.prepare(self.op, KPOOL, **operands)
        first = 0 if self.op == "compress" else 1
        args[first], args[first + 1] = k.view, gate.view
        outs = [to_numpy(out) for out in model.execute(*args)]
        return outs, ring, k, gate


def _check_inputs(call: Call, k: Guarded, gate: Guarded, where: str) -> None:
    """k and gate (read-only operands) are untouched, guards included."""
    for name, guarded, host in (
        ("k", k, call.data.k),
        ("gate", gate, call.data.gate),
    ):
        flat = guarded.read()
        check_guards(flat, guarded.guard, guarded.shape, name, where)
        assert np.array_equal(bits(guarded.body(flat)), bits(host)), (
            f"{name} was written, {where}"
        )


def _assert_finite_like_oracle(
    actual: np.ndarray, expected: np.ndarray, where: str
) -> None:
    """No NaN or infinity where the oracle's answer is finite.

    All fuzz data is finite, so a non-finite output means a guard (NaN) was
    read. Checked on its own because a NaN gate pools to +-inf on CPU (see
    test_nonfinite.py), which a NaN-only check would miss.
    """
    poisoned = ~np.isfinite(actual) & np.isfinite(expected)
    assert not poisoned.any(), (
        f"non-finite output where the oracle is finite (an out-of-bounds "
        f"read of a NaN guard?) at {np.argwhere(poisoned)[:4].tolist()}, "
        f"{where}"
    )


def run_ring_close(runner: Runner, meta: Meta, data: Data) -> dict[str, int]:
    """ring_close on guarded operands against :func:`reference.ring_close`.

    Returns:
        Coverage counts: pools closed.
    """
    where = meta.describe()
    call = Call(runner, "ring_close", meta, data)
    (pooled, closed), ring, k, gate = call.run()
    idx = meta.arrays()
    expected, expected_closed = ref.ring_close(
        data.ring,
        data.k,
        data.gate,
        data.ape,
        idx["input_row_offsets"],
        idx["cache_lengths"],
        idx["slot_idx"],
        KPOOL,
    )
    flat = ring.read()
    check_guards(flat, ring.guard, ring.shape, "tail", where)
    assert np.array_equal(bits(ring.body(flat)), bits(data.ring)), (
        f"ring_close wrote the ring, {where}"
    )
    _check_inputs(call, k, gate, where)
    batch = len(meta.cache)
    assert pooled.shape == (batch, HEAD_DIM), (pooled.shape, where)
    np.testing.assert_array_equal(
        closed, expected_closed, err_msg=f"closed_pool, {where}"
    )
    _assert_finite_like_oracle(pooled, expected, where)
    open_rows = expected_closed < 0
    assert not pooled[open_rows].any(), (
        f"rows with closed_pool -1 must be zero: "
        f"{np.flatnonzero(open_rows & pooled.any(axis=1)).tolist()}, {where}"
    )
    _assert_close(pooled, expected, data.scale, f"pooled, {where}")
    return {"closed": int((~open_rows).sum())}


def run_compress(runner: Runner, meta: Meta, data: Data) -> dict[str, int]:
    """compress on guarded operands against :func:`reference.compress`.

    With non-decreasing ``pool_row_offsets`` the output must match the
    oracle row for row (rows nobody writes exactly zero); with decreasing
    ones every row must be exactly zero or one of
    :func:`reference.compress_candidates` within tolerance.

    Returns:
        Coverage counts: non-zero rows written.
    """
    where = meta.describe()
    call = Call(runner, "compress", meta, data)
    (out,), _, k, gate = call.run()
    idx = meta.arrays()
    args = (
        idx["input_row_offsets"],
        idx["pool_row_offsets"],
        idx["cache_lengths"],
        KPOOL,
    )
    _check_inputs(call, k, gate, where)
    assert out.shape == (meta.total_tokens // KPOOL, HEAD_DIM), (
        out.shape,
        where,
    )
    ambiguous = ref.compress_ambiguous_rows(*args, meta.total_tokens)
    if not ambiguous.any():
        expected = ref.compress(data.k, data.gate, data.ape, *args)
        _assert_finite_like_oracle(out, expected, where)
        unwritten = ~expected.any(axis=1)
        assert not out[unwritten].any(), (
            f"rows nobody writes must be zero: "
            f"{np.flatnonzero(unwritten & out.any(axis=1)).tolist()}, {where}"
        )
        _assert_close(out, expected, data.scale, f"pooled, {where}")
    else:
        candidates = ref.compress_candidates(
            data.k,
            data.gate,
            data.ape,
            idx["input_row_offsets"],
            idx["cache_lengths"],
            KPOOL,
        )
        _assert_finite_like_oracle(out, candidates[:1], where)
        for row, value in enumerate(out):
            if not value.any():
                continue
            assert any(_close(value, c, data.scale) for c in candidates[1:]), (
                f"row {row} is neither zero nor any request's pool, {where}"
            )
    return {"rows": int(out.any(axis=1).sum())}


def run_seed_tail(runner: Runner, meta: Meta, data: Data) -> dict[str, int]:
    """seed_tail on a guarded ring against :func:`reference.seed_tail`.

    The guards are checked first, so an out-of-bounds write is reported as
    such (by :func:`check_guards`) even when the ring itself is right.

    Returns:
        Coverage counts: ring entries changed.
    """
    where = meta.describe()
    call = Call(runner, "seed_tail", meta, data)
    _, ring, k, gate = call.run()
    idx = meta.arrays()
    expected = ref.seed_tail(
        data.ring,
        data.k,
        data.gate,
        idx["input_row_offsets"],
        idx["cache_lengths"],
        idx["slot_idx"],
        KPOOL,
    )
    flat = ring.read()
    check_guards(flat, ring.guard, ring.shape, "tail", where)
    got = ring.body(flat)
    wrong = np.argwhere((bits(got) != bits(expected)).any(axis=-1))
    assert not wrong.size, (
        f"ring entries [slot, plane, member] differ from the oracle: "
        f"{wrong[:6].tolist()}, {where}"
    )
    _check_inputs(call, k, gate, where)
    changed = (bits(expected) != bits(data.ring)).any(axis=-1)
    return {"stashed": int(changed.sum())}


RUN: dict[str, Callable[[Runner, Meta, Data], dict[str, int]]] = {
    "ring_close": run_ring_close,
    "compress": run_compress,
    "seed_tail": run_seed_tail,
}


def COMPILED_TOGETHER(device: str) -> list[ModelKey]:  # noqa: N802
    """The three writers at ``MAIN``, compiled as one graph per host device.

    See the ``runners`` fixture in conftest.py.
    """
    return [
        model_key(
            op,
            KPOOL,
            dtype=DTYPE,
            head_dim=HEAD_DIM,
            ring_len=0 if op == "compress" else KPOOL,
        )
        for op in RUN
    ]


def fuzz(
    runner: Runner, op: str, metas: Iterable[Meta]
) -> tuple[dict[str, str], Counter[str]]:
    """Runs ``op`` on every vector; collects failures and coverage.

    Returns:
        ``(failures, coverage)``: the failing vectors' names mapped to their
        messages (which describe the vector in full), and counts of each tag
        and of each coverage figure over the passing vectors.
    """
    failures: dict[str, str] = {}
    coverage: Counter[str] = Counter()
    for meta in metas:
        try:
            counts = RUN[op](runner, meta, draw_data(meta, op))
        except AssertionError as error:
            failures[meta.name] = str(error)
            continue
        coverage["vectors"] += 1
        coverage.update(meta.tags)
        coverage.update({k: v for k, v in counts.items() if v})
    return failures, coverage


# --------------------------------------------------------------------------
# The view mechanism itself
# --------------------------------------------------------------------------


def test_view_writes_land_in_the_parent(runner: Runner) -> None:
    """A Buffer view passed to model.execute aliases its parent.

    Without that, the guards would sit in memory the kernels never see and
    the whole harness would be vacuous. seed_tail writes slot 1 (of 3)
    through the view; the writes must show in the parent at the view's
    offset, exactly where the oracle puts them, with both guards intact.
    """
    meta = Meta(
        name="view",
        tags=(),
        total_tokens=6,
        max_slots=3,
        offsets=(0, 6),
        cache=(1,),
        slots=(1,),
    )
    data = draw_data(meta, "view")
    _, ring, _, _ = Call(runner, "seed_tail", meta, data).run()
    flat = ring.read()
    check_guards(flat, ring.guard, ring.shape, "tail")
    got = ring.body(flat)
    idx = meta.arrays()
    expected = ref.seed_tail(
        data.ring,
        data.k,
        data.gate,
        idx["input_row_offsets"],
        idx["cache_lengths"],
        idx["slot_idx"],
        KPOOL,
    )
    # c = 1, n = 6: positions 4, 5, 6 (members 0, 1, 2 of slot 1) change.
    changed = (bits(got) != bits(data.ring)).any(axis=-1)
    assert np.argwhere(changed).tolist() == [
        [1, p, q] for p in range(2) for q in range(3)
    ]
    np.testing.assert_array_equal(bits(got), bits(expected))


def test_check_guards_reports_a_write_past_the_end() -> None:
    """check_guards fails, naming the element, on a corrupted guard."""
    shape = (2, 2, KPOOL, HEAD_DIM)
    guard = GUARD_SLOTS * 2 * KPOOL * HEAD_DIM
    flat = np.zeros(2 * guard + int(np.prod(shape)), np.float32)
    flat.view(np.uint32)[:guard] = SENTINEL
    flat.view(np.uint32)[-guard:] = SENTINEL
    check_guards(flat, guard, shape, "tail")
    # Member 1 of slot max_slots = 2, key plane, channel 3.
    size = int(np.prod(shape))
    flat[guard + size + HEAD_DIM + 3] = 1.0
    with pytest.raises(
        AssertionError, match=r"guard after tail.*\[2, 0, 1, 3\]"
    ):
        check_guards(flat, guard, shape, "tail")
    flat.view(np.uint32)[guard - 1] = 0
    with pytest.raises(
        AssertionError, match=r"guard before.*\[-1, 1, 3, 127\]"
    ):
        check_guards(flat, guard, shape, "tail")


# --------------------------------------------------------------------------
# Named cases: the failure shapes reported from serving
# --------------------------------------------------------------------------

NAMED = [
    # A caller passed physical KV-cache page ids instead of ring slots.
    Meta(
        "slot_is_page_id",
        ("slot_page_id",),
        total_tokens=21,
        max_slots=4,
        offsets=(0, 7, 14, 21),
        cache=(3, 6, 1),
        slots=(2, 40961, 0),
    ),
    # Long-context decode and chunked prefill past 500,000 tokens.
    Meta(
        "positions_past_500k",
        ("c_past_500k",),
        total_tokens=19,
        max_slots=5,
        offsets=(0, 1, 6, 17, 19),
        cache=(500_003, 731_233, 1_000_001, 524_287),
        slots=(4, 1, 3, 0),
    ),
    # A scheduler tick where no request has new tokens (rows unused).
    Meta(
        "every_request_zero_tokens",
        ("all_zero_tokens",),
        total_tokens=8,
        max_slots=4,
        offsets=(0, 0, 0, 0, 0),
        cache=(3, 4, 0, 7),
        slots=(1, 2, 3, 0),
    ),
    Meta(
        "every_request_zero_tokens_no_rows",
        ("all_zero_tokens",),
        total_tokens=0,
        max_slots=2,
        offsets=(0, 0, 0),
        cache=(1, 2),
        slots=(0, 1),
    ),
    Meta(
        "batch0",
        ("batch0",),
        total_tokens=5,
        max_slots=3,
        offsets=(0,),
        cache=(),
        slots=(),
    ),
    Meta(
        "slot_eq_max",
        ("slot_eq_max",),
        total_tokens=14,
        max_slots=3,
        offsets=(0, 7, 14),
        cache=(2, 5),
        slots=(3, 1),
    ),
    Meta(
        "slot_near_2^32",
        ("slot_near_2^32",),
        total_tokens=14,
        max_slots=3,
        offsets=(0, 7, 14),
        cache=(2, 5),
        slots=(U32_MAX, 0),
    ),
    # c + n passes 2^32: a 32-bit sum would wrap to a small position.
    Meta(
        "c_plus_n_wraps_2^32",
        ("c_near_2^32",),
        total_tokens=18,
        max_slots=2,
        offsets=(0, 9, 18),
        cache=(U32_MAX - 2, U32_MAX - 5),
        slots=(1, 0),
    ),
    Meta(
        "offsets_decreasing",
        ("offsets_decreasing",),
        total_tokens=20,
        max_slots=3,
        offsets=(0, 12, 5, 20),
        cache=(1, 2, 3),
        slots=(0, 1, 2),
    ),
    Meta(
        "offsets_past_total_and_near_2^32",
        ("offsets_past_total", "offsets_near_2^32"),
        total_tokens=12,
        max_slots=3,
        offsets=(0, 6, 13, U32_MAX),
        cache=(3, 1, 2),
        slots=(0, 1, 2),
    ),
    Meta(
        "pool_offsets_too_small",
        ("pool_offsets_wrong_counts",),
        total_tokens=24,
        max_slots=2,
        offsets=(0, 12, 24),
        cache=(0, 0),
        slots=(0, 1),
        pool_offsets=(0, 1, 2),
    ),
    Meta(
        "pool_offsets_decreasing",
        ("pool_offsets_decreasing",),
        total_tokens=24,
        max_slots=2,
        offsets=(0, 12, 24),
        cache=(0, 0),
        slots=(0, 1),
        pool_offsets=(0, 5, 1),
    ),
]


@pytest.mark.parametrize("op", list(RUN))
@pytest.mark.parametrize("meta", NAMED, ids=lambda m: m.name)
def test_named_metadata(runner: Runner, meta: Meta, op: str) -> None:
    RUN[op](runner, meta, draw_data(meta, op))


# --------------------------------------------------------------------------
# The fuzz
# --------------------------------------------------------------------------

#: Tags every op's fuzz must have exercised at least this often.
MIN_TAG_COUNT = 40
#: Coverage figures per op that must be non-zero in many vectors.
EFFECT = {"ring_close": "closed", "compress": "rows", "seed_tail": "stashed"}


@pytest.mark.parametrize("op", list(RUN))
def test_fuzz_metadata(runner: Runner, op: str) -> None:
    """2,000 seeded vectors per op: oracle answer, guards intact, no NaN."""
    stream = STREAMS[op]
    metas = (draw_meta(stream, i) for i in range(FUZZ_VECTORS))
    start = time.perf_counter()
    failures, coverage = fuzz(runner, op, metas)
    seconds = time.perf_counter() - start
    assert not failures, (
        f"{len(failures)} of {FUZZ_VECTORS} vectors failed "
        f"({runner.device_name}, {op}); first: "
        + "\n".join(list(failures.values())[:3])
    )
    assert coverage["vectors"] == FUZZ_VECTORS
    tags = {
        "batch0",
        "all_zero_tokens",
        "c_past_500k",
        "c_near_2^32",
        "c_near_2^31",
        "offsets_decreasing",
        "offsets_past_total",
        "offsets_near_2^32",
        "slot_past_max",
        "slot_eq_max",
        "slot_page_id",
        "slot_near_2^32",
    }
    if op == "compress":
        tags |= {
            "pool_offsets_wrong_counts",
            "pool_offsets_past_rows",
            "pool_offsets_near_2^32",
            "pool_offsets_decreasing",
        }
    thin = {t: coverage[t] for t in tags if coverage[t] < MIN_TAG_COUNT}
    assert not thin, f"fuzz barely exercised {thin} ({op})"
    # Enough vectors do real work, so "skip everything" cannot pass.
    assert coverage[EFFECT[op]] >= FUZZ_VECTORS // 4, dict(coverage)
    print(f"{op}, {runner.device_name}: {FUZZ_VECTORS} in {seconds:.2f} s")


# --------------------------------------------------------------------------
# The harness catches a planted bug
# --------------------------------------------------------------------------

PLANTED_VECTORS = 300


def _hits_slot_max(meta: Meta) -> bool:
    """Whether a slot-check off-by-one makes seed_tail write slot max_slots.

    Some request has ``slot == max_slots``, good offsets, new tokens, and a
    trailing incomplete pool to stash (``(c + n) % kpool != 0``).
    """
    for b, (c, s) in enumerate(zip(meta.cache, meta.slots, strict=True)):
        start, end = meta.offsets[b], meta.offsets[b + 1]
        good = 0 <= start <= end <= meta.total_tokens
        n = end - start
        if s == meta.max_slots and good and n and (c + n) % KPOOL:
            return True
    return False


def test_guard_catches_planted_slot_off_by_one(
    tmp_path: Path, runners: Callable[[str], Runner]
) -> None:
    """seed_tail compiled with ``slot <= max_slots`` fails the guard check.

    One extra compile (seed_tail at MAIN, CPU, from a copy of the kernels).
    The guard check must fail on exactly the vectors that reach the bug and
    pass the rest; the real kernels pass all of them.
    """
    kernels = tmp_path / "kernels"
    shutil.copytree(KERNELS, kernels)
    ragged = kernels / "grid" / "ragged.mojo"
    source = ragged.read_text()
    good, bad = "slot < max_slots", "slot <= max_slots"
    assert source.count(good) == 1, "the planted line moved; update the test"
    ragged.write_text(source.replace(good, bad))

    # Not max_slots == 0: MAX passes a zero-element buffer to the kernel
    # without its address in the parent, so the planted write to slot 0 of
    # an empty ring crashes the process instead of landing in a guard.
    metas = [draw_meta(9, i, slot_eq_max=0.5) for i in range(PLANTED_VECTORS)]
    metas = [m for m in metas if m.max_slots > 0]
    reached = {m.name for m in metas if _hits_slot_max(m)}
    assert len(reached) >= 50, len(reached)

    failures, _ = fuzz(runners("cpu"), "seed_tail", metas)
    assert not failures, list(failures.values())[:3]

    buggy = Runner("cpu", kernels=kernels)
    failures, _ = fuzz(buggy, "seed_tail", metas)
    messages = list(failures.values())
    assert set(failures) == reached, (
        sorted(set(failures) ^ reached)[:5],
        messages[:2],
    )
    assert all("guard after tail" in m for m in messages), messages[:2]

    # The reusable check itself raises on one such vector.
    meta = next(m for m in metas if m.name in reached)
    _, ring, _, _ = Call(buggy, "seed_tail", meta, draw_data(meta, "x")).run()
    with pytest.raises(AssertionError, match=r"guard after tail.*\[\d+, 0,"):
        check_guards(ring.read(), ring.guard, ring.shape, "tail")

"""``mo.mla.kpool.ring_close`` against the float64 oracle.

Two families, both on every device (``runner`` fixture):

- **Sweep** over the step models of ``STEP_CONFIGS`` (every key dtype, kpool
  1 to 128, head_dim 1 to 1089): one mixed ragged batch per configuration
  through the whole (fused) step. ``ring_pooled``/``ring_closed_pool``
  are the closing writer's outputs; the step's compressed pools and the
  ring it leaves behind are checked too, which also shows the pending pool
  was read from the ring before the seeding overwrote it.
- **Corners** at ``MAIN`` on the single-op ``"ring_close"`` model: empty
  batch, bad metadata, cache lengths near 2^32, gates of magnitude 100, the
  ape ablation, the ring left bitwise unchanged, and int32/int64 index
  tensors (two extra models).

All of them compile as one graph per host device (``COMPILED_TOGETHER``).

Expected ``closed_pool`` values of the corner cases are written out by hand
from the contract in docs/ops.md, so they check the oracle as much as the
kernel; pooled keys come from the oracle (``mla_kpool.reference``), never
from a kernel. The batches, corners and checks live in
``ring_close_cases``, which tests/grid/test_gpu_emulation.py shares.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from mla_kpool import reference as ref
from mla_kpool.calls import CallInputs
from mla_kpool.runner import ModelKey, Runner, model_key
from support.kpool_cases import (
    MAIN,
    STEP_CONFIGS,
    TOLERANCE,
    Config,
    bits,
    random_ape,
    random_rows,
    step_keys,
)
from support.ring_close_cases import (
    CORNERS,
    U32_TOP,
    Corner,
    RingCloseData,
    batch_arrays,
    case_seed,
    check_corner,
    check_ring_close,
    check_step_mixed_batch,
    corner_data,
    key_scale,
    mixed_batch,
    random_ring,
)


def COMPILED_TOGETHER(device: str) -> list[ModelKey]:  # noqa: N802
    """This file's models, compiled as one graph on each host device.

    The step of every ``STEP_CONFIGS`` entry and the single-op ring_close
    at ``MAIN`` with each index dtype, all on a ring of one pool (see the
    ``runners`` fixture in conftest.py).
    """
    steps = step_keys(STEP_CONFIGS)
    return steps + [
        model_key(
            "ring_close",
            MAIN.kpool,
            dtype=MAIN.dtype,
            head_dim=MAIN.head_dim,
            ring_len=MAIN.kpool,
            index_dtypes=index_dtype,
        )
        for index_dtype in (np.uint32, np.int32, np.int64)
    ]


# --------------------------------------------------------------------------
# Sweep: one mixed ragged batch per step configuration
# --------------------------------------------------------------------------


@pytest.mark.parametrize("cfg", STEP_CONFIGS, ids=lambda c: c.id)
def test_step_mixed_batch(runner: Runner, cfg: Config) -> None:
    check_step_mixed_batch(runner, cfg, case_seed("mixed", cfg.id))


# --------------------------------------------------------------------------
# Corners at MAIN on the single-op model
# --------------------------------------------------------------------------


@pytest.mark.parametrize("case", CORNERS, ids=lambda c: c.id)
def test_corner_metadata(runner: Runner, case: Corner) -> None:
    check_corner(runner, case)


#: One closing decode, one closing chunk and one that stays open, at MAIN.
SIMPLE = Corner(
    "simple",
    (0, 1, 4, 5),
    (7, 9, 10),
    (2, 0, 3),
    (1, 2, -1),
)


@pytest.mark.parametrize(
    "center",
    [100.0, -100.0, 0.0],
    ids=["near_plus_100", "near_minus_100", "plus_minus_100"],
)
def test_gates_of_magnitude_100(runner: Runner, center: float) -> None:
    """Scores near +-100 overflow or underflow a softmax without max
    subtraction; ``plus_minus_100`` mixes +100 and -100 members."""
    data = corner_data(SIMPLE)
    ring = data.ring
    rng = np.random.default_rng(data.seed)
    what = f"gates {center:+} on {runner.device_name}, seed {data.seed}"

    def gates(shape: tuple[int, ...]) -> np.ndarray:
        if center == 0.0:
            base = 100.0 * rng.choice([-1.0, 1.0], size=shape)
        else:
            base = np.full(shape, center)
        return (base + rng.uniform(-3, 3, size=shape)).astype(MAIN.dtype)

    data = replace(
        data, call=replace(data.call, gate=gates(data.call.gate.shape))
    )
    ring[:, 1] = gates(ring[:, 1].shape)
    tail = runner.new_ring(
        SIMPLE.max_slots, MAIN.kpool, MAIN.head_dim, MAIN.dtype, fill=ring
    )
    pooled, closed = data.run(runner, tail)
    np.testing.assert_array_equal(closed, SIMPLE.closed, err_msg=what)
    check_ring_close(
        pooled, closed, ring, data.call, data.ape, MAIN.kpool, what
    )


def test_ape_ablation(runner: Runner) -> None:
    """Zeroing ``ape`` changes the answer, and the kernel follows both."""
    data = corner_data(SIMPLE)
    ring, ape, call = data.ring, data.ape, data.call
    what = f"ape ablation on {runner.device_name}, seed {data.seed}"
    tail = runner.new_ring(
        SIMPLE.max_slots, MAIN.kpool, MAIN.head_dim, MAIN.dtype, fill=ring
    )
    closing = np.array(SIMPLE.closed) >= 0
    results = {}
    for label, a in (("ape", ape), ("zero_ape", np.zeros_like(ape))):
        pooled, closed = data.run(runner, tail, a)
        np.testing.assert_array_equal(closed, SIMPLE.closed, err_msg=what)
        check_ring_close(
            pooled, closed, ring, call, a, MAIN.kpool, f"{what} ({label})"
        )
        results[label] = pooled[closing].astype(np.float64)
    k, gate = call.k, call.gate
    meta = (call.input_row_offsets, call.cache_lengths, call.slot_idx)
    want = ref.ring_close(ring, k, gate, ape, *meta, MAIN.kpool)[0]
    zero = ref.ring_close(ring, k, gate, np.zeros_like(ape), *meta, MAIN.kpool)[
        0
    ]
    # The ape must matter far beyond tolerance, in the oracle and the kernel.
    gap = TOLERANCE[MAIN.dtype] * key_scale(k, ring)
    assert np.max(np.abs(want[closing] - zero[closing])) > 1000 * gap, what
    assert np.max(np.abs(results["ape"] - results["zero_ape"])) > 1000 * gap


def test_ring_is_not_written(runner: Runner) -> None:
    """ring_close leaves every ring byte as it was, on a batch whose
    trailing tokens seed_tail *would* write (and with ring-like keys)."""
    seed = case_seed("ring unchanged")
    rng = np.random.default_rng(seed)
    what = f"ring unchanged on {runner.device_name}, seed {seed}"
    requests = mixed_batch(MAIN.kpool)
    max_slots = len(requests) + 3
    offsets, cache, slots = batch_arrays(requests, max_slots)
    k, gate = random_rows(rng, int(offsets[-1]), MAIN.head_dim, MAIN.dtype)
    ape = random_ape(rng, MAIN.kpool, MAIN.head_dim)
    ring = random_ring(rng, max_slots, MAIN.kpool, MAIN.head_dim, MAIN.dtype)
    tail = runner.new_ring(
        max_slots, MAIN.kpool, MAIN.head_dim, MAIN.dtype, fill=ring
    )
    data = RingCloseData(
        seed, ring, ape, CallInputs(k, gate, offsets, cache, slots)
    )
    for _ in range(2):
        pooled, closed = data.run(runner, tail)
        assert np.array_equal(bits(runner.read(tail)), bits(ring)), what
    assert np.any(closed >= 0), what
    check_ring_close(pooled, closed, ring, data.call, ape, MAIN.kpool, what)


#: At MAIN with int32/int64 indices: the mixed batch's metadata plus values
#: only a signed or 64-bit index can hold.
SIGNED = {
    np.int32: Corner(
        # c = -1, slot -1 and an end offset of -2 are bad metadata.
        "int32_negative",
        (0, 1, 3, 4, 7, -2),
        (3, -1, 7, 5, 1),
        (2, 0, -1, 1, 3),
        (0, -1, -1, 1, -1),
        tokens=7,
    ),
    np.int64: Corner(
        # Cache lengths only a 64-bit index holds: 2^32 + 5 =
        # 4 * (2^30 + 1) + 1 and 2^33 - 5 = 4 * (2^31 - 2) + 3 (the largest
        # pool ids here still fit closed_pool's int32).
        "int64_past_2_32",
        (0, 3, 4, 5),
        (U32_TOP + 5, 2 * U32_TOP - 5, 6),
        (3, 0, 1),
        (2**30 + 1, 2**31 - 2, -1),
    ),
}


@pytest.mark.parametrize(
    "index_dtype", [np.int32, np.int64], ids=["int32", "int64"]
)
def test_index_dtypes(runner: Runner, index_dtype) -> None:
    seed = case_seed("index dtypes", np.dtype(index_dtype).name)
    rng = np.random.default_rng(seed)
    what = f"{np.dtype(index_dtype).name} on {runner.device_name}, seed {seed}"
    requests = mixed_batch(MAIN.kpool)
    max_slots = len(requests) + 3
    offsets, cache, slots = batch_arrays(requests, max_slots)
    k, gate = random_rows(rng, int(offsets[-1]), MAIN.head_dim, MAIN.dtype)
    ape = random_ape(rng, MAIN.kpool, MAIN.head_dim)
    ring = random_ring(rng, max_slots, MAIN.kpool, MAIN.head_dim, MAIN.dtype)
    tail = runner.new_ring(
        max_slots, MAIN.kpool, MAIN.head_dim, MAIN.dtype, fill=ring
    )
    cast = [a.astype(index_dtype) for a in (offsets, cache, slots)]
    data = RingCloseData(seed, ring, ape, CallInputs(k, gate, *cast))
    pooled, closed = data.run(runner, tail)
    check_ring_close(pooled, closed, ring, data.call, ape, MAIN.kpool, what)
    assert np.any(closed >= 0), what

    case = SIGNED[index_dtype]
    data = corner_data(case, index_dtype)
    what = f"{case.id} on {runner.device_name}, seed {data.seed}"
    tail = runner.new_ring(
        case.max_slots, MAIN.kpool, MAIN.head_dim, MAIN.dtype, fill=data.ring
    )
    pooled, closed = data.run(runner, tail)
    np.testing.assert_array_equal(closed, case.closed, err_msg=what)
    check_ring_close(
        pooled, closed, data.ring, data.call, data.ape, MAIN.kpool, what
    )

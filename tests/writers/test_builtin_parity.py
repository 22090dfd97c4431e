"""Our kernels against MAX's own GPU builtins of the same names (GPU only).

MAX 26.7 ships ``mo.mla.kpool.ring_close``, ``compress`` and ``seed_tail``
as GPU-only builtins (``max.nn.kernels.mla_kpool_*``). The same three-op
graph is built twice: once with ``max.nn.kernels`` and no
``custom_extensions`` (the builtins), once with :mod:`mla_kpool` and
``custom_extensions=[mla_kpool.KERNELS]`` (ours, which takes precedence).
Both run on the same inputs and a copy of the same ring.

The two may round differently, so pooled keys are compared within the
tolerance of docs/ops.md, ours against the builtin and both against the
float64 oracle;
``closed_pool`` and the ring after ``seed_tail`` must be exactly equal.
The builtin documents its pooled row as meaningful only where
``closed_pool >= 0`` and leaves compress rows past the pool count
unwritten, so those are not compared.

On a machine without an accelerator the comparisons skip visibly; graph
construction (no compile) is still checked there.
"""

from __future__ import annotations

import functools
import zlib

import numpy as np
import pytest
from max import driver
from max.dtype import DType
from max.engine import InferenceSession, Model
from max.graph import BufferType, DeviceRef, Graph, TensorType

import mla_kpool
from mla_kpool import reference as ref
from mla_kpool.buffers import to_buffer, to_max_dtype, to_numpy
from support.kpool_cases import (
    BF16,
    F32,
    TOLERANCE,
    Config,
    assert_pooled_close,
    max_nn_kernels,
    random_ape,
    random_rows,
)

HAS_GPU = driver.accelerator_count() > 0

#: The indexer shape in both key dtypes the builtin's users run.
CONFIGS = [Config(F32, 4, 128), Config(BF16, 4, 128)]

#: ``(cache_length, new_tokens)`` per request, kpool 4: decode that closes,
#: decode that stays open, aligned prefill, a chunk that closes and runs past
#: (seeding over the ring members it closed), zero new tokens, fresh.
BATCH = [(7, 1), (9, 1), (8, 13), (10, 7), (11, 0), (0, 6)]


def _build(cfg: Config, ours: bool) -> Graph:
    """ring_close, then compress, then seed_tail on one ring, on the GPU."""
    gpu = DeviceRef.GPU()
    dt = to_max_dtype(cfg.dtype)
    kp, hd = cfg.kpool, cfg.head_dim

    def tensor(dtype: DType, shape: list) -> TensorType:
        return TensorType(dtype, shape, device=gpu)

    inputs = [
        BufferType(dt, ["slots", 2, kp, hd], gpu),
        tensor(dt, ["tokens", hd]),
        tensor(dt, ["tokens", hd]),
        tensor(DType.float32, [kp, hd]),
        tensor(DType.uint32, ["offsets"]),
        tensor(DType.uint32, ["offsets"]),
        tensor(DType.uint32, ["batch"]),
        tensor(DType.uint32, ["batch"]),
    ]
    if ours:
        api = (mla_kpool.ring_close, mla_kpool.compress, mla_kpool.seed_tail)
        extensions = [mla_kpool.KERNELS]
    else:
        builtin = max_nn_kernels()
        api = (
            builtin.mla_kpool_ring_close,
            builtin.mla_kpool_compress,
            builtin.mla_kpool_seed_tail,
        )
        extensions = []
    ring_close, compress, seed_tail = api
    name = f"parity_{'ours' if ours else 'builtin'}_{cfg.id}"
    with Graph(name, input_types=inputs, custom_extensions=extensions) as g:
        tail = g.inputs[0].buffer
        k, gate, ape, offsets, pool_offsets, cache, slots = (
            value.tensor for value in g.inputs[1:]
        )
        pooled, closed = ring_close(
            tail, k, gate, ape, offsets, cache, slots, kp
        )
        pools = compress(k, gate, ape, offsets, pool_offsets, cache, kp)
        seed_tail(tail, k, gate, offsets, cache, slots, kp)
        g.output(pooled, closed, pools)
    return g


@functools.cache
def _model(cfg: Config, ours: bool) -> Model:
    session = InferenceSession(devices=[driver.CPU(), driver.Accelerator()])
    return session.load(_build(cfg, ours))


@pytest.mark.parametrize("cfg", CONFIGS, ids=lambda c: c.id)
def test_parity_graphs_build(cfg: Config) -> None:
    """Both graphs build with the same three ops (no compile, any host)."""
    ops = []
    for ours in (True, False):
        text = str(_build(cfg, ours))
        ops.append(
            [
                op
                for op in ("ring_close", "compress", "seed_tail")
                if f"mo.mla.kpool.{op}" in text
            ]
        )
    assert ops == [["ring_close", "compress", "seed_tail"]] * 2


@pytest.mark.gpu
@pytest.mark.skipif(
    not HAS_GPU,
    reason="MAX's mla_kpool builtins are GPU-only and there is no "
    "accelerator (max.driver.accelerator_count() == 0)",
)
@pytest.mark.parametrize("cfg", CONFIGS, ids=lambda c: c.id)
def test_matches_max_builtin(cfg: Config) -> None:
    seed = zlib.crc32(f"parity {cfg.id}".encode())
    what = f"{cfg.id}, seed {seed}"
    rng = np.random.default_rng(seed)
    kp, hd = cfg.kpool, cfg.head_dim
    max_slots = len(BATCH) + 2
    offsets = np.cumsum([0] + [n for _, n in BATCH]).astype(np.uint32)
    cache = np.array([c for c, _ in BATCH], np.uint32)
    slots = np.arange(max_slots - 1, 1, -1).astype(np.uint32)
    pool_offsets = ref.pool_row_offsets(offsets, cache, kp).astype(np.uint32)
    k, gate = random_rows(rng, int(offsets[-1]), hd, cfg.dtype)
    ape = random_ape(rng, kp, hd)
    keys, gates = random_rows(rng, max_slots * kp, hd, cfg.dtype)
    ring = np.stack(
        [keys.reshape(max_slots, kp, hd), gates.reshape(max_slots, kp, hd)],
        axis=1,
    )

    gpu = driver.Accelerator()
    results = {}
    for label, ours in (("ours", True), ("builtin", False)):
        tail = to_buffer(ring, gpu)
        operands = [k, gate, ape, offsets, pool_offsets, cache, slots]
        outs = _model(cfg, ours).execute(
            tail, *(to_buffer(a, gpu) for a in operands)
        )
        results[label] = [to_numpy(o) for o in outs] + [to_numpy(tail)]

    want_pooled, want_closed = ref.ring_close(
        ring, k, gate, ape, offsets, cache, slots, kp
    )
    want_pools = ref.compress(k, gate, ape, offsets, pool_offsets, cache, kp)
    want_ring = ref.seed_tail(ring, k, gate, offsets, cache, slots, kp)
    closing = want_closed >= 0
    used = int(pool_offsets[-1])
    assert closing.any() and (~closing).any() and used > 0, what
    scale = float(np.abs(np.concatenate([k, keys]).astype(np.float64)).max())

    ours, theirs = results["ours"], results["builtin"]
    for label, (pooled, closed, pools, tail) in results.items():
        np.testing.assert_array_equal(closed, want_closed, f"{label} {what}")
        assert_pooled_close(
            pooled[closing],
            want_pooled[closing],
            cfg.dtype,
            scale,
            what=f"{label} ring_close, {what}",
        )
        assert_pooled_close(
            pools[:used],
            want_pools[:used],
            cfg.dtype,
            scale,
            what=f"{label} compress, {what}",
        )
        assert np.array_equal(tail.view(np.uint8), want_ring.view(np.uint8)), (
            f"{label} ring after seed_tail differs from the oracle, {what}"
        )
    tol = TOLERANCE[cfg.dtype]
    pairs = ((0, closing, "ring_close"), (2, slice(used), "compress"))
    for i, rows, part in pairs:
        np.testing.assert_allclose(
            ours[i][rows].astype(np.float64),
            theirs[i][rows].astype(np.float64),
            rtol=tol,
            atol=tol * scale,
            err_msg=f"ours vs builtin {part}, {what}",
        )
    np.testing.assert_array_equal(ours[1], theirs[1], f"closed_pool, {what}")
    assert np.array_equal(ours[3].view(np.uint8), theirs[3].view(np.uint8)), (
        f"ring after seed_tail: ours and builtin differ, {what}"
    )

"""Seeded serving schedules through the (fused) step, pool for pool.

Each schedule (see :mod:`schedules`: named workloads planned by the
serving model, :mod:`mla_kpool.demo`) knows every request's whole
sequence first, then feeds it through :meth:`Runner.step` over many calls:
chunked prefill, single- and multi-token decode, rows with no tokens,
requests joining late and leaving early, ring slots handed from a finished
request to a new one, and requests resuming from a cached prefix that ends
mid-pool (the prefix's trailing members restored into the ring on
admission). Per schedule:

- every call produces exactly the pools it completes, per request
  (:func:`schedules.replay`), so every pool comes out exactly once;
- after every call the device ring equals, bit for bit, the ring of the
  float64 oracle served the same calls (unused entries start NaN, so a
  stale read poisons a pool and a stray write shows);
- every pool matches :func:`reference.pool_sequence` on the request's
  whole sequence within the key dtype's tolerance, and is bitwise equal to
  the same step model run once on the whole sequence with
  ``cache_lengths = 0`` (compress builds every pool then), whichever
  writer built it streaming.

The last test shows the ordering hazard is real: a step that runs seed_tail
before ring_close on the same ring closes a pool from overwritten members.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import pytest
from max import driver
from max.dtype import DType
from max.engine import InferenceSession, Model
from max.graph import BufferType, DeviceRef, Graph, TensorType

import mla_kpool
from conftest import DEVICE_NAMES
from mla_kpool import reference
from mla_kpool._paths import compiled_kernels
from mla_kpool.calls import CallInputs, first_pool_ids
from mla_kpool.runner import ModelKey, Runner, StepResult
from support import schedules as sch
from support.kpool_cases import (
    BF16,
    F16,
    F32,
    MAIN,
    STEP_CONFIGS,
    TOLERANCE,
    Config,
    assert_pooled_close,
    bits,
    step_keys,
)

#: Step models the schedules run on (all from STEP_CONFIGS): every dtype,
#: kpool 1, 3, 4, 16, 128 and head_dim 32 and 128.
STREAM_CONFIGS = [
    MAIN,
    Config(BF16, 4, 128),
    Config(F16, 16, 32),
    Config(F32, 1, 32),
    Config(F32, 3, 32),
    Config(BF16, 128, 32),
]
assert all(c in STEP_CONFIGS for c in STREAM_CONFIGS)
KPOOL_128 = Config(BF16, 128, 32)


def COMPILED_TOGETHER(device: str) -> list[ModelKey]:  # noqa: N802
    """The step models the schedules run, compiled as one graph.

    Every schedule's ring holds one pool (see the ``runners`` fixture in
    conftest.py).
    """
    return step_keys(STREAM_CONFIGS)


SERVING = frozenset(
    {
        "chunked_prefill",
        "single_token_decode",
        "multi_token_decode",
        "late_join",
        "early_leave",
        "slot_reuse",
        "slot_not_row",
    }
)


@dataclass(frozen=True)
class Scenario:
    """A family of schedules: how to build one, and what it must exercise."""

    id: str
    build: Callable[[int, Config], sch.Schedule]
    seeds: tuple[int, ...]
    configs: tuple[Config, ...]
    features: frozenset[str]


def _random(params: sch.ScheduleParams, name: str):
    def build(seed: int, cfg: Config) -> sch.Schedule:
        return sch.random_schedule(
            seed, cfg.dtype, cfg.kpool, cfg.head_dim, params, name
        )

    return build


def _interleaved(seed: int, cfg: Config) -> sch.Schedule:
    return sch.interleaved_pair(seed, cfg.dtype, cfg.kpool, cfg.head_dim)


SCENARIOS = [
    Scenario(
        "random",
        _random(sch.ScheduleParams(), "random"),
        tuple(range(6)),
        tuple(STREAM_CONFIGS),
        SERVING,
    ),
    # A prefix cache with 64-token blocks in front of kpool 128: resumed
    # prefixes end mid-pool, the ring carrying 64 members (forced for the
    # first two requests: 64 and 192).
    Scenario(
        "prefix_cache_64",
        _random(
            sch.ScheduleParams(
                prefix_prob=0.7,
                prefix_granularity=64,
                max_prefix=640,
                first_prefixes=(64, 192, 128),
            ),
            "prefix_cache_64",
        ),
        (0, 1),
        (KPOOL_128,),
        SERVING | {"mid_pool_prefix"},
    ),
    # Two requests in every call; row 0 on slot 5, row 1 on slot 0.
    Scenario(
        "interleaved",
        _interleaved,
        (0,),
        tuple(STREAM_CONFIGS),
        frozenset({"slot_not_row"}),
    ),
    # Request 0 resumes near position 5000 (pre-seeded ring, a few tokens
    # short of a pool boundary) and decodes in multi-token chunks while
    # other requests start fresh around it.
    Scenario(
        "long_decode",
        _random(
            sch.ScheduleParams(long_prefix=5000, prefix_prob=0.0),
            "long_decode",
        ),
        (0,),
        tuple(STREAM_CONFIGS),
        frozenset({"past_4096", "multi_token_decode", "late_join"}),
    ),
]

CASES = [
    pytest.param(scn, cfg, seed, id=f"{scn.id}-{cfg.id}-seed{seed}")
    for scn in SCENARIOS
    for cfg in scn.configs
    for seed in scn.seeds
]


def whole_sequence_pools(
    runner: Runner, schedule: sch.Schedule
) -> dict[int, dict[int, np.ndarray]]:
    """Every request's pools from one step call with ``cache_lengths = 0``."""
    s = schedule
    inputs = s.whole_sequence_inputs()
    scratch = runner.new_ring(
        len(s.requests), s.kpool, s.head_dim, s.dtype, fill=np.nan
    )
    result = runner.step(scratch, inputs, s.ape, s.kpool)
    assert np.all(result.ring_closed_pool == -1), s.describe()
    pools = result.pools()
    return {
        i: {p: row.key for p, row in got.items()} for i, got in enumerate(pools)
    }


def _stack(pools: dict[int, np.ndarray], ids: range, head_dim: int):
    if not ids:
        return np.zeros((0, head_dim))
    return np.stack([pools[p] for p in ids])


def check_schedule(runner: Runner, schedule: sch.Schedule) -> int:
    """Replays ``schedule`` and checks every pool; returns the pool count."""
    s = schedule
    streamed = sch.replay(s, sch.DeviceServer(runner, s))
    one_shot = whole_sequence_pools(runner, s)
    total = 0
    for rid, r in enumerate(s.requests):
        keys, gates = s.sequences[rid]
        ids = s.pool_ids(rid)
        total += len(ids)
        got = _stack(streamed[rid], ids, s.head_dim)
        where = (
            f"{s.describe()}: request {rid} (slot {s.slots[rid]}, prefix "
            f"{r.cached_prefix}, fed to {r.end}) pools "
            f"{ids.start}..{ids.stop - 1}"
        )
        expected = reference.pool_sequence(keys, gates, s.ape, s.kpool)
        assert_pooled_close(
            got,
            expected[ids.start : ids.stop],
            s.dtype,
            float(np.abs(keys.astype(np.float64)).max()),
            what=where,
        )
        whole = _stack(one_shot[rid], ids, s.head_dim)
        differ = [
            p
            for p, a, b in zip(ids, got, whole, strict=True)
            if not np.array_equal(bits(a), bits(b))
        ]
        assert not differ, (
            f"{where}: pools {differ} differ bitwise from compress on the "
            "whole sequence"
        )
    return total


@pytest.mark.parametrize(("scenario", "cfg", "seed"), CASES)
@pytest.mark.parametrize("device", DEVICE_NAMES)
def test_schedule(
    scenario: Scenario,
    cfg: Config,
    seed: int,
    device: str,
    runners: Callable[[str], Runner],
) -> None:
    schedule = scenario.build(seed, cfg)
    features = schedule.features()
    if cfg.kpool == 1:
        features |= {"mid_pool_prefix"}  # no pool has a middle
    missing = scenario.features - features
    assert not missing, f"{schedule.describe()} never exercises {missing}"
    assert check_schedule(runners(device), schedule) > 0


def test_scenarios_cover_the_reported_patterns() -> None:
    """The schedules do contain the cases they are named for."""
    prefix = SCENARIOS[1].build(0, KPOOL_128)
    assert any(r.cached_prefix % 128 == 64 for r in prefix.requests)
    pair = _interleaved(0, MAIN)
    for call in pair.calls:
        assert [(e.request, e.slot) for e in call] == [(0, 5), (1, 0)]
    long = SCENARIOS[3].build(0, KPOOL_128)
    head = long.requests[0]
    assert head.cached_prefix > 5000 and head.cached_prefix % 128
    assert head.end // 128 > head.cached_prefix // 128, (
        "no pool closed past 5000"
    )
    assert sum(1 for r in long.requests if r.cached_prefix == 0) >= 3


# --------------------------------------------------------------------------
# The harness itself, on the oracle (no kernels)
# --------------------------------------------------------------------------


@pytest.mark.parametrize("seed", range(8))
def test_oracle_replay_matches_pool_sequence(seed: int) -> None:
    """The three oracle writers served a schedule reproduce pool_sequence."""
    cfg = STREAM_CONFIGS[seed % len(STREAM_CONFIGS)]
    s = sch.random_schedule(100 + seed, cfg.dtype, cfg.kpool, cfg.head_dim)
    pools = sch.replay(s, sch.ReferenceServer(s))
    for rid, (keys, gates) in enumerate(s.sequences):
        ids = s.pool_ids(rid)
        expected = reference.pool_sequence(keys, gates, s.ape, s.kpool)
        np.testing.assert_allclose(
            _stack(pools[rid], ids, s.head_dim),
            expected[ids.start : ids.stop],
            rtol=1e-12,
            atol=1e-12,
            err_msg=f"{s.describe()}: request {rid}",
        )


def test_replay_rejects_missing_and_duplicate_pools() -> None:
    s = sch.interleaved_pair(3, F32, 4, 8)
    oracle = sch.ReferenceServer(s)

    def dropping(index):
        rows = oracle(index)
        for row in rows:
            row.pop(min(row, default=None), None)
        return rows

    with pytest.raises(sch.PoolAccountingError, match="seed=3"):
        sch.replay(s, dropping)

    oracle2 = sch.ReferenceServer(s)

    def repeating(index):
        rows = oracle2(index)
        for b, e in enumerate(s.calls[index]):
            if e.cache_length >= 4:  # an old pool again
                rows[b][e.cache_length // 4 - 1] = np.zeros(8)
        return rows

    with pytest.raises(sch.PoolAccountingError, match="produced pools"):
        sch.replay(s, repeating)


# --------------------------------------------------------------------------
# The ordering hazard (docs/serving.md, ordering the writers)
# --------------------------------------------------------------------------


@functools.cache
def swapped_step_model(device: str, cfg: Config) -> Model:
    """A step that runs seed_tail BEFORE ring_close on the same ring."""
    from mla_kpool.buffers import to_max_dtype

    ref = DeviceRef.GPU() if device == "gpu" else DeviceRef.CPU()
    emulate = device == "gpu-emulated"
    dt, kp, hd = to_max_dtype(cfg.dtype), cfg.kpool, cfg.head_dim
    rows = TensorType(dt, ["tokens", hd], ref)
    index = [TensorType(DType.uint32, [d], ref) for d in ("offsets", "batch")]
    inputs = [
        BufferType(dt, ["slots", 2, kp, hd], ref),
        rows,
        rows,
        TensorType(DType.float32, [kp, hd], ref),
        index[0],
        index[1],
        index[1],
    ]
    with Graph(
        f"mla_kpool_swapped_step_{cfg.id}_{device.replace('-', '_')}",
        input_types=inputs,
        custom_extensions=[compiled_kernels()],
    ) as g:
        tail = g.inputs[0].buffer
        k, gate, ape, offsets, cache, slots = (v.tensor for v in g.inputs[1:])
        mla_kpool.seed_tail(
            tail, k, gate, offsets, cache, slots, kp, emulate_gpu=emulate
        )
        ring_pooled, closed = mla_kpool.ring_close(
            tail, k, gate, ape, offsets, cache, slots, kp, emulate_gpu=emulate
        )
        pool_rows = mla_kpool.pool_row_offsets(offsets, cache, kp)
        pooled = mla_kpool.compress(
            k, gate, ape, offsets, pool_rows, cache, kp, emulate_gpu=emulate
        )
        g.output(ring_pooled, closed, pooled, pool_rows)
    devices = [driver.CPU()]
    if device == "gpu":
        devices.append(driver.Accelerator())
    # The graph carries the kernels; naming them to the session as well
    # registers every op twice, which MAX refuses to compile.
    return InferenceSession(devices=devices).load(g)


def _swapped_step(runner: Runner, cfg: Config):
    model = swapped_step_model(runner.device_name, cfg)

    def step(tail, call: CallInputs, ape, kpool):
        args = [
            call.k,
            call.gate,
            np.asarray(ape, np.float32),
            call.input_row_offsets,
            call.cache_lengths,
            call.slot_idx,
        ]
        outs = model.execute(tail, *(runner.to_device(a) for a in args))
        ring_pooled, closed, pooled, pool_rows = (runner.read(o) for o in outs)
        first = first_pool_ids(call.cache_lengths, kpool)
        return StepResult(ring_pooled, closed, pooled, pool_rows, first)

    return step


@pytest.mark.parametrize("device", DEVICE_NAMES)
def test_seed_tail_before_ring_close_breaks_pools(
    device: str, runners: Callable[[str], Runner]
) -> None:
    """Swapping the writers is caught: the pool closed from the ring is wrong.

    Hand case: kpool 4, ``c = 2`` (positions 0, 1 in the ring), 5 new
    tokens (positions 2..6). Pool 0 is ``{0, 1, 2, 3}``; seed_tail stashes
    positions 4..6 at ring indices 0..2 first, so ring_close then builds
    ``{4, 5, 2, 3}``. Then a whole random schedule on the swapped step: some
    pool misses the oracle by far more than the tolerance.
    """
    cfg, seed = MAIN, 7
    kp, hd = cfg.kpool, cfg.head_dim
    runner = runners(device)
    step = _swapped_step(runner, cfg)
    rng = np.random.default_rng(seed)
    ape = (2.0 * rng.standard_normal((kp, hd))).astype(np.float32)
    seq_k = rng.standard_normal((7, hd)).astype(cfg.dtype)
    seq_g = (4.0 * rng.standard_normal((7, hd))).astype(cfg.dtype)
    host = np.full((3, 2, kp, hd), np.nan, dtype=cfg.dtype)
    host[2, 0, :2], host[2, 1, :2] = seq_k[:2], seq_g[:2]
    args = (
        CallInputs(
            k=seq_k[2:],
            gate=seq_g[2:],
            input_row_offsets=np.array([0, 5], np.uint32),
            cache_lengths=np.array([2], np.uint32),
            slot_idx=np.array([2], np.uint32),
        ),
        ape,
        kp,
    )
    where = f"seed {seed}, {cfg.id}, {device}"
    right = runner.step(runner.new_ring(3, kp, hd, cfg.dtype, host), *args)
    wrong = step(runner.new_ring(3, kp, hd, cfg.dtype, host), *args)
    assert int(right.ring_closed_pool[0]) == int(wrong.ring_closed_pool[0]) == 0
    scale = float(np.abs(seq_k.astype(np.float64)).max())
    truth = reference.pool(seq_k[:4], seq_g[:4], ape)
    assert_pooled_close(right.ring_pooled[0], truth, cfg.dtype, scale, where)
    clobbered = [4, 5, 2, 3]
    assert_pooled_close(
        wrong.ring_pooled[0],
        reference.pool(seq_k[clobbered], seq_g[clobbered], ape),
        cfg.dtype,
        scale,
        what=f"{where}: swapped step should pool positions {clobbered}",
    )
    err = np.abs(wrong.ring_pooled[0].astype(np.float64) - truth).max()
    assert err > 100 * TOLERANCE[cfg.dtype] * scale, where

    schedule = sch.random_schedule(seed, cfg.dtype, kp, hd)
    streamed = sch.replay(
        schedule,
        sch.DeviceServer(runner, schedule, step=step, check_ring=False),
    )
    worst = 0.0
    for rid, (keys, gates) in enumerate(schedule.sequences):
        ids = schedule.pool_ids(rid)
        expected = reference.pool_sequence(keys, gates, schedule.ape, kp)
        got = _stack(streamed[rid], ids, hd).astype(np.float64)
        if ids:
            err = np.abs(got - expected[ids.start : ids.stop])
            worst = max(worst, float(np.nan_to_num(err, nan=np.inf).max()))
    assert worst > 100 * TOLERANCE[cfg.dtype], (
        f"{schedule.describe()}: the swapped step matched the oracle "
        f"(worst error {worst})"
    )

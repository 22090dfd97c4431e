"""Speculative decoding through the step: the one-pool ring hazard, and rings
of several pools.

A verify call brings a request's next true token followed by ``d`` draft
tokens. The target model keeps the first ``a`` of the ``n = d + 1`` tokens
(``1 <= a <= n``: the first token is always the true next token), and the
request's next call resumes at ``c + a`` with the true tokens. The writers
run before anyone knows ``a``, so a verify call may produce pools with draft
members (ring_close closing the pending pool from drafts, compress pooling
drafts) and stashes drafts into the ring. A pipeline stores a pool row only
from the latest call that produced that pool id: every pool with a rejected
member is produced again, from true members, by a later call.

With a one-pool ring (``R = kpool``) that later call reads wrong members:
seed_tail stashed only the positions past the last complete pool, so the
accepted tokens of the pending pool are missing from the ring, and drafts
have overwritten the pending pool's older members. A ring of
``R = mla_kpool.ring_length(kpool, d + 1)`` entries keeps them. Tests:

- the hand scenario (kpool 4, positions 0-5 one per call, a verify of 8
  tokens at position 6 keeping 1, then true tokens from 7): pool 1 comes out
  wrong with ``R = 4`` and with ``R = 8`` (one pool less than needed), right
  with ``R = ring_length(4, 8) = 12``;
- seeded speculative schedules from the serving model's scheduler
  (:func:`mla_kpool.demo.scheduling.schedule`: 1-8 tokens per verify,
  none to all drafts accepted, several requests per call on slots that
  are not their rows, slots reused) on ``R = 12``: every pool's final row
  matches :func:`reference.pool_sequence` of the accepted stream and is
  bitwise equal to the same model's one-shot compress of that stream; the
  same schedules on ``R = kpool`` break a pool;
- without rejection, ``R = kpool`` and ``R = 3 * kpool`` give bitwise
  identical outputs (the deeper ring only changes what the ring holds).

Every call is mirrored on the float64 oracle (:mod:`mla_kpool.reference`)
served the same inputs on a ring of the same length: the device ring must
equal the oracle's bit for bit after every call, and every pool the call
produced (drafts included) must match the oracle's within the key dtype's
tolerance.
Unwritten ring entries start NaN, so a read of one poisons its pool.

Models: the ``R = kpool`` step models of float32 k4 d128, bfloat16 k4 d128
and float16 k4 d96 (from ``STEP_CONFIGS``, shared with the suite), the same
three at ``R = 12``, and float32 k4 d128 at ``R = 8``.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pytest

from mla_kpool import reference, ring_length
from mla_kpool.calls import pools_completed
from mla_kpool.demo.checks import PoolRecord, keep_latest
from mla_kpool.demo.scheduling import plan, schedule
from mla_kpool.demo.workload import Request
from mla_kpool.runner import ModelKey, Runner, StepResult, model_key
from support import schedules as sch
from support.kpool_cases import (
    BF16,
    F16,
    MAIN,
    STEP_CONFIGS,
    TOLERANCE,
    Config,
    assert_pooled_close,
    bits,
)

KPOOL = 4
#: Most drafts per verify call: 8 tokens, vLLM's kpool-4 production case.
MAX_DRAFTS = 7
#: The ring the helper asks for: ``kpool + 8 - 1 = 11`` rounded up to 12.
DEEP = ring_length(KPOOL, MAX_DRAFTS + 1)
assert DEEP == 12

#: One step model per dtype at kpool 4 (all in STEP_CONFIGS at R = kpool).
DTYPE_CONFIGS = [MAIN, Config(BF16, 4, 128), Config(F16, 4, 96)]
assert all(c in STEP_CONFIGS for c in DTYPE_CONFIGS)


def COMPILED_TOGETHER(device: str) -> list[ModelKey]:  # noqa: N802
    """This file's step models, compiled as one graph per host device.

    Each of ``DTYPE_CONFIGS`` on rings of one pool and of ``DEEP``, and
    ``MAIN`` on the ring one pool short of ``DEEP`` (see the ``runners``
    fixture in conftest.py).
    """
    rings = [(c, r) for c in DTYPE_CONFIGS for r in (KPOOL, DEEP)]
    return [
        model_key(
            "step", c.kpool, dtype=c.dtype, head_dim=c.head_dim, ring_len=r
        )
        for c, r in [*rings, (MAIN, DEEP - KPOOL)]
    ]


# --------------------------------------------------------------------------
# Speculative schedules: plans of the serving model
# --------------------------------------------------------------------------


@dataclass(frozen=True)
class SpecSchedule(sch.Schedule):
    """A :class:`schedules.Schedule` of speculative decoding.

    Its entries at or past the prompt are verify steps: ``tokens`` brought,
    the first ``accepted`` kept, the rest drafts (the serving model's
    :func:`mla_kpool.demo.workload.draft_rows`, never the true keys).
    """

    @property
    def cfg(self) -> Config:
        return Config(self.dtype, self.kpool, self.head_dim)

    def accepted_length(self, rid: int) -> int:
        """Length of the request's accepted stream after the last call."""
        return self.requests[rid].end

    def features(self) -> frozenset[str]:
        """What the schedule exercises (checked, so no case is vacuous)."""
        kp = self.cfg.kpool
        out = set()
        for call in self.calls:
            for row, e in enumerate(call):
                c, n, a = e.cache_length, e.tokens, e.accepted
                if e.slot != row:
                    out.add("slot_not_row")
                if len(call) > 1:
                    out.add("batched")
                if c < self.plan.requests[e.request].prompt:
                    out.add("prefill")
                    continue
                if n == 1:
                    out.add("verify_no_drafts")
                elif a == 1:
                    out.add("no_draft_accepted")
                elif a == n:
                    out.add("all_drafts_accepted")
                else:
                    out.add("some_drafts_accepted")
                if n == MAX_DRAFTS + 1:
                    out.add("verify_8_tokens")
                pending = c // kp
                # ring_close closes the pending pool from a draft member:
                # the case a one-pool ring gets wrong on the redo.
                if c % kp and c + n >= (pending + 1) * kp > c + a:
                    out.add("pending_pool_rejected")
                if (c + n) // kp > -(-c // kp) and (c + n) // kp * kp > c + a:
                    out.add("compress_pool_rejected")
        if self.plan.slot_reuses:
            out.add("slot_reuse")
        return frozenset(out)


#: The hand scenario, one request: ``(tokens, accepted)`` per call. Positions
#: 0-5 one per call (pool 0 closes at 3; 4 and 5 wait in the ring), a
#: verify at 6 with 7 drafts keeping only position 6 (ring_close closes pool
#: 1 from draft 7, compress pools drafts 8-11, seed_tail stashes drafts
#: 12-13), then the true tokens from 7 on: 7-9 (pool 1 again, from the
#: ring), 10-13 (pool 2), 14-19 (pools 3 and 4).
HAND_CALLS = ((1, 1),) * 6 + ((8, 1), (3, 3), (4, 4), (6, 6))
HAND_LENGTH = sum(a for _, a in HAND_CALLS)
assert HAND_LENGTH == 20


def hand_scenario(cfg: Config, seed: int = 7) -> SpecSchedule:
    """The hand scenario: a 6-token prompt, then verify steps, 3 slots."""
    request = Request(prompt=6, generate=HAND_LENGTH - 6)
    calls = [[(0, n, a)] for n, a in HAND_CALLS]
    rng = np.random.default_rng(seed)
    plan_ = plan([request], calls, 3, rng)
    return SpecSchedule("hand", seed, cfg.dtype, cfg.kpool, cfg.head_dim, plan_)


def random_spec_schedule(
    seed: int,
    cfg: Config,
    requests: int = 6,
    max_batch: int = 3,
) -> SpecSchedule:
    """A seeded speculative serving loop of the serving model's scheduler.

    Each request has a prompt of 1 to ``3 * kpool + 5`` tokens, prefilled
    in chunks of at most ``2 * kpool + 3``, then ``6 * kpool`` to
    ``12 * kpool - 1`` tokens decoded through verify steps of ``1 + d``
    tokens, ``d`` uniform in ``0..MAX_DRAFTS``, each draft kept with the
    scheduler's acceptance after the ones before it (never past the
    request's end; drafts may run past it). At most ``max_batch`` requests
    run at once, so later ones join in slots earlier ones freed.
    """
    rng = np.random.default_rng(seed)
    kp = cfg.kpool
    reqs = [
        Request(
            prompt=int(rng.integers(1, 3 * kp + 6)),
            generate=int(rng.integers(6 * kp, 12 * kp)),
        )
        for _ in range(requests)
    ]
    calls = schedule(
        reqs,
        rng,
        token_budget=4 * (MAX_DRAFTS + 1) * max_batch,
        max_running=max_batch,
        chunk=2 * kp + 3,
        spec_tokens=MAX_DRAFTS,
        min_spec_tokens=0,
    )
    plan_ = plan(reqs, calls, max_batch, rng)
    return SpecSchedule(
        "random", seed, cfg.dtype, cfg.kpool, cfg.head_dim, plan_
    )


# --------------------------------------------------------------------------
# Serving a schedule like a pipeline, mirrored on the oracle
# --------------------------------------------------------------------------


@dataclass
class Served:
    """What a served schedule left: per request, pool id -> kept row."""

    final: dict[int, dict[int, PoolRecord]]
    rewrites: int = 0


def serve(runner: Runner, s: SpecSchedule, ring_len: int) -> Served:
    """Runs every call through the step on a ``ring_len`` ring.

    Checks, per call: each row produces exactly the pools its ``n`` tokens
    complete; those pools match the oracle served the same calls; the ring
    equals the oracle's bit for bit. Keeps, per pool id, the latest call's
    row, and fails if a row whose members were all accepted is produced
    again (only rows with a rejected member may be redone).
    """
    cfg, kp = s.cfg, s.cfg.kpool
    server = sch.DeviceServer(runner, s, ring_len)
    scale = max(
        float(np.abs(keys.astype(np.float64)).max()) for keys, _ in s.sequences
    )
    served = Served({rid: {} for rid in range(len(s.requests))})
    for index, call in enumerate(s.calls):
        # Checks the device ring against the oracle's, bit for bit.
        produced_pools, want = server.run(index)
        where = f"{s.describe()}, R={ring_len}, call {index}"
        for b, (p, got) in enumerate(zip(call, produced_pools, strict=True)):
            row = (
                f"{where}, row {b} (request {p.request}, slot "
                f"{p.slot}, c={p.cache_length}, "
                f"n={p.tokens}, a={p.accepted})"
            )
            expected = pools_completed(p.cache_length, p.tokens, kp)
            assert sorted(got) == list(expected), (
                f"{row}: produced pools {sorted(got)}, expected "
                f"{list(expected)}"
            )
            for pool, produced in got.items():
                assert_pooled_close(
                    produced.key,
                    want[b][pool].key,
                    cfg.dtype,
                    scale,
                    what=f"{row}: pool {pool} vs the oracle's step",
                )
            rewritten, twice = keep_latest(
                served.final[p.request],
                got,
                index,
                p.cache_length + p.accepted,
                kp,
            )
            assert not twice, (
                f"{row}: pools {twice} again, but an earlier call already "
                f"produced them from accepted tokens"
            )
            served.rewrites += rewritten
    return served


def one_shot(
    runner: Runner, s: SpecSchedule, ring_len: int
) -> dict[int, dict[int, np.ndarray]]:
    """Each accepted stream in one step call with ``c = 0`` (compress)."""
    cfg = s.cfg
    inputs = s.whole_sequence_inputs()
    scratch = runner.new_ring(
        len(s.requests), ring_len, cfg.head_dim, cfg.dtype, fill=np.nan
    )
    result: StepResult = runner.step(scratch, inputs, s.ape, cfg.kpool)
    assert np.all(result.ring_closed_pool == -1), s.describe()
    pools = result.pools()
    return {
        i: {p: row.key for p, row in got.items()} for i, got in enumerate(pools)
    }


def error_ratios(
    s: SpecSchedule, served: Served, rid: int
) -> tuple[np.ndarray, range]:
    """Per pool of the accepted stream: final row's error over tolerance.

    NaN counts as infinitely wrong. Also checks that every pool id of the
    accepted stream has a kept row, and that the kept row came from a call
    that accepted all of its members.
    """
    cfg, kp = s.cfg, s.cfg.kpool
    keys, gates = s.sequences[rid]
    length = s.accepted_length(rid)
    ids = range(length // kp)
    final = served.final[rid]
    where = (
        f"{s.describe()}: request {rid} (slot {s.slots[rid]}, length {length})"
    )
    missing = [p for p in ids if p not in final]
    assert not missing, f"{where}: pools {missing} never came out"
    stale = [p for p in ids if not final[p].accepted]
    assert not stale, f"{where}: final rows of pools {stale} hold drafts"
    # Pool ids past the accepted stream can only hold drafts (dropped).
    assert all(not final[p].accepted for p in final if p not in ids), where
    got = np.stack([final[p].key for p in ids]).astype(np.float64)
    want = reference.pool_sequence(keys[:length], gates[:length], s.ape, kp)
    scale = float(np.abs(keys[:length].astype(np.float64)).max())
    err = np.abs(got - want).max(axis=1) / (TOLERANCE[cfg.dtype] * scale)
    return np.where(np.isnan(err), np.inf, err), ids


def assert_accepted_stream(
    runner: Runner, s: SpecSchedule, served: Served, ring_len: int
) -> int:
    """Every kept row is the accepted stream's pool, bitwise the one-shot's.

    Returns:
        The number of pools checked.
    """
    whole = one_shot(runner, s, ring_len)
    total = 0
    for rid in range(len(s.requests)):
        ratios, ids = error_ratios(s, served, rid)
        where = f"{s.describe()}, R={ring_len}: request {rid}"
        wrong = [p for p, e in zip(ids, ratios, strict=True) if not e <= 1.0]
        assert not wrong, (
            f"{where}: pools {wrong} differ from pool_sequence of the "
            f"accepted stream (error / tolerance "
            f"{[round(float(ratios[p]), 1) for p in wrong]})"
        )
        differ = [
            p
            for p in ids
            if not np.array_equal(
                bits(served.final[rid][p].key), bits(whole[rid][p])
            )
        ]
        assert not differ, (
            f"{where}: pools {differ} differ bitwise from the one-shot "
            f"compress of the accepted stream"
        )
        total += len(ids)
    return total


# --------------------------------------------------------------------------
# The hand scenario
# --------------------------------------------------------------------------


@dataclass(frozen=True)
class HandCase:
    cfg: Config
    ring_len: int
    #: Pools whose final row is wrong: [1] for the hazard, [] when fixed.
    wrong: tuple[int, ...]

    @property
    def id(self) -> str:
        verdict = "breaks_pool_1" if self.wrong else "correct"
        return f"{self.cfg.id}-R{self.ring_len}-{verdict}"


HAND_CASES = [
    *(HandCase(cfg, KPOOL, (1,)) for cfg in DTYPE_CONFIGS),
    *(HandCase(cfg, DEEP, ()) for cfg in DTYPE_CONFIGS),
    # One pool less than ring_length asks for breaks it again.
    HandCase(MAIN, DEEP - KPOOL, (1,)),
]


@pytest.mark.parametrize("case", HAND_CASES, ids=lambda c: c.id)
def test_hand_scenario(runner: Runner, case: HandCase) -> None:
    s = hand_scenario(case.cfg)
    assert s.features() >= {"pending_pool_rejected", "compress_pool_rejected"}
    served = serve(runner, s, case.ring_len)
    # The verify call (call 6) produced pools 1 and 2 with drafts; calls 7
    # and 8 produced them again.
    assert served.rewrites == 2
    assert [served.final[0][p].call for p in range(5)] == [3, 7, 8, 9, 9]
    ratios, _ = error_ratios(s, served, 0)
    wrong = tuple(p for p, e in enumerate(ratios) if not e <= 1.0)
    assert wrong == case.wrong, (
        f"{s.describe()}, R={case.ring_len}: pools {wrong} differ from "
        f"pool_sequence of the accepted stream, expected {case.wrong} "
        f"(error / tolerance {np.round(ratios, 1).tolist()})"
    )
    if not case.wrong:
        assert assert_accepted_stream(runner, s, served, case.ring_len) == 5


def test_ring_length_of_the_hand_scenario() -> None:
    """The ring sizes the scenario uses, from the helper's bound."""
    assert ring_length(KPOOL, 1) == KPOOL
    assert ring_length(KPOOL, MAX_DRAFTS + 1) == 12
    assert ring_length(KPOOL, 5) == 8  # what R = 8 would be enough for


# --------------------------------------------------------------------------
# Random speculative schedules
# --------------------------------------------------------------------------

SPEC_FEATURES = frozenset(
    {
        "slot_not_row",
        "slot_reuse",
        "batched",
        "prefill",
        "verify_no_drafts",
        "no_draft_accepted",
        "all_drafts_accepted",
        "some_drafts_accepted",
        "verify_8_tokens",
        "pending_pool_rejected",
        "compress_pool_rejected",
    }
)

SPEC_CASES = [
    pytest.param(cfg, seed, id=f"{cfg.id}-seed{seed}")
    for cfg in DTYPE_CONFIGS
    for seed in (0, 1, 2)
]


@pytest.mark.parametrize(("cfg", "seed"), SPEC_CASES)
def test_random_spec_schedule_on_deep_ring(
    runner: Runner, cfg: Config, seed: int
) -> None:
    s = random_spec_schedule(seed, cfg)
    missing = SPEC_FEATURES - s.features()
    assert not missing, f"{s.describe()} never exercises {sorted(missing)}"
    served = serve(runner, s, DEEP)
    assert served.rewrites > 0, s.describe()
    assert assert_accepted_stream(runner, s, served, DEEP) > 20


@pytest.mark.parametrize("cfg", DTYPE_CONFIGS, ids=lambda c: c.id)
def test_random_spec_schedule_breaks_one_pool_ring(
    runner: Runner, cfg: Config
) -> None:
    """The same schedules on R = kpool: some final row is wrong."""
    s = random_spec_schedule(0, cfg)
    served = serve(runner, s, KPOOL)
    wrong = 0
    for rid in range(len(s.requests)):
        ratios, _ = error_ratios(s, served, rid)
        wrong += int(np.sum(~(ratios <= 1.0)))
    assert wrong > 0, f"{s.describe()}: R = kpool got every pool right"


# --------------------------------------------------------------------------
# Without rejection, a deeper ring changes nothing but the ring
# --------------------------------------------------------------------------


NO_REJECTION_CASES = [
    pytest.param(cfg, seed, id=f"{cfg.id}-seed{seed}")
    for cfg in DTYPE_CONFIGS
    for seed in (0, 1)
]


@pytest.mark.parametrize(("cfg", "seed"), NO_REJECTION_CASES)
def test_deep_ring_bitwise_equal_without_rejection(
    runner: Runner, cfg: Config, seed: int
) -> None:
    """R = kpool and R = 3 * kpool: same outputs bit for bit, every call.

    Serving schedules of :mod:`schedules` (chunked prefill, 1-8 token
    decode, mid-pool prefixes restored into the ring, slot reuse), no
    token ever rejected. Both rings are mirrored on the oracle, so the deep
    one does hold its extra pools.
    """
    s = sch.random_schedule(
        seed, cfg.dtype, cfg.kpool, cfg.head_dim, name="no_rejection"
    )
    need = {"mid_pool_prefix", "multi_token_decode", "chunked_prefill"}
    assert s.features() >= need, s.describe()
    lengths = (cfg.kpool, 3 * cfg.kpool)
    rings = {
        n: runner.new_ring(s.max_slots, n, cfg.head_dim, cfg.dtype, fill=np.nan)
        for n in lengths
    }
    mirrors = {
        n: np.full((s.max_slots, 2, n, cfg.head_dim), np.nan, cfg.dtype)
        for n in lengths
    }
    deep_used = False
    for index in range(len(s.calls)):
        inputs = s.call_inputs(index)
        outs = {}
        for n in lengths:
            if s.restores(index):
                host = runner.read(rings[n])
                s.restore(index, host)
                s.restore(index, mirrors[n])
                rings[n] = runner.to_device(host)
            outs[n] = runner.step(rings[n], inputs, s.ape, cfg.kpool)
            mirrors[n] = reference.seed_tail(
                mirrors[n],
                inputs.k,
                inputs.gate,
                inputs.input_row_offsets,
                inputs.cache_lengths,
                inputs.slot_idx,
                cfg.kpool,
            )
            host = runner.read(rings[n])
            assert np.array_equal(bits(host), bits(mirrors[n])), (
                f"{s.describe()}: R={n} ring differs from the oracle's "
                f"after call {index}"
            )
        short, deep = outs[lengths[0]], outs[lengths[1]]
        for name in (
            "ring_pooled",
            "ring_closed_pool",
            "pooled",
            "pool_row_offsets",
            "first_pool",
        ):
            a, b = getattr(short, name), getattr(deep, name)
            assert np.array_equal(bits(a), bits(b)), (
                f"{s.describe()}: call {index}: {name} differs between "
                f"R={lengths[0]} and R={lengths[1]}"
            )
        deep_host = runner.read(rings[lengths[1]])
        deep_used |= bool(
            np.any(~np.isnan(deep_host[:, :, cfg.kpool :].astype(np.float64)))
        )
    assert deep_used, f"{s.describe()}: the deep ring's extra pools unused"

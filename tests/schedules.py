"""Named serving schedules for the streaming tests: serving-model plans.

A schedule is a seeded workload (requests as data: prompt, tokens generated,
cached prefix, where the client aborts) run through the serving model's own
scheduler and slot planner (:func:`mla_kpool.serving.schedule` and
:func:`mla_kpool.serving.plan`): chunked prefill, single- and multi-token
decode, rows that bring no tokens, requests joining late, leaving early and
handing their ring slot to a later request, and requests resuming from a
cached prefix that ends mid-pool (ring restored on admission with
:func:`mla_kpool.serving.restore_prefix`).

Each request's keys and gate scores are the serving model's seeded ones
(:func:`mla_kpool.serving.request_rows`), drawn for its whole sequence
independently of how it is batched, so the pools it must produce are known
in advance: pool ``p`` is tokens ``[p*kpool, (p+1)*kpool)``
(:func:`mla_kpool.reference.pool_sequence`). A request resuming at
``prefix`` and fed to ``fed`` owns pools ``prefix // kpool`` up to
``fed // kpool``.

:func:`replay` feeds a schedule call by call through any ``step`` function
(the compiled step, or :class:`ReferenceServer`, the float64 oracle) and
checks the pool accounting: every call must produce exactly the pools it
completes (:func:`mla_kpool.serving.pools_completed`), so over the schedule
every pool comes out exactly once.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from kpool_cases import bits
from mla_kpool import calls, reference
from mla_kpool.calls import pools_completed
from mla_kpool.demo import scheduling, workload
from mla_kpool.demo.checked_run import restore_prefix

if TYPE_CHECKING:
    from mla_kpool.runner import Runner

__all__ = [
    "CallInputs",
    "CallPools",
    "DeviceServer",
    "PoolAccountingError",
    "ReferenceServer",
    "Request",
    "RingSeed",
    "Schedule",
    "ScheduleParams",
    "StepFn",
    "bits",
    "interleaved_pair",
    "random_schedule",
    "replay",
]


@dataclass(frozen=True)
class Request:
    """One request of a schedule: its slot, its span and its whole sequence.

    Attributes:
        rid: Request id (its index in :attr:`Schedule.requests`).
        slot: Ring slot it holds while in flight.
        prefix: Tokens already cached when it joins (0 for a fresh request).
        keys: ``[length, head_dim]`` keys of positions ``0..length-1``,
            prefix included; an aborted request stops being fed before the
            end.
        gates: ``[length, head_dim]`` gate scores, same dtype.
        fed: Length reached when the schedule ends.
        left_early: Whether its client aborted it before its sequence ended.
    """

    rid: int
    slot: int
    prefix: int
    keys: np.ndarray = field(repr=False)
    gates: np.ndarray = field(repr=False)
    fed: int
    left_early: bool = False

    def pool_ids(self, kpool: int) -> range:
        """The pools this request must produce over the schedule."""
        return range(self.prefix // kpool, self.fed // kpool)


@dataclass(frozen=True)
class RingSeed:
    """A resumed prefix's pending members, to restore before a call.

    Attributes:
        rid: The request resuming.
        slot: Its ring slot.
        prefix: Length of its cached prefix.
        keys: ``[length, head_dim]`` its whole key sequence.
        gates: ``[length, head_dim]`` its gate scores.
        kpool: Tokens per pool.
    """

    rid: int
    slot: int
    prefix: int
    keys: np.ndarray = field(repr=False)
    gates: np.ndarray = field(repr=False)
    kpool: int

    def apply(self, ring: np.ndarray) -> None:
        """Restores the members into a host ring ``[slots, 2, R, head_dim]``.

        Member ``pos`` goes to ring index ``pos % R``
        (:func:`mla_kpool.serving.restore_prefix`).
        """
        restore_prefix(
            ring, self.slot, self.prefix, self.keys, self.gates, self.kpool
        )


@dataclass(frozen=True)
class CallInputs:
    """The operands of one step call, plus what to do before it.

    Attributes:
        k: ``[total_tokens, head_dim]`` keys, rows of the batch in order.
        gate: ``[total_tokens, head_dim]`` gate scores.
        input_row_offsets: ``[batch + 1]`` uint32.
        cache_lengths: ``[batch]`` uint32.
        slot_idx: ``[batch]`` uint32.
        rids: Request of each batch row.
        ring_seeds: Ring entries to restore before the call.
    """

    k: np.ndarray
    gate: np.ndarray
    input_row_offsets: np.ndarray
    cache_lengths: np.ndarray
    slot_idx: np.ndarray
    rids: tuple[int, ...]
    ring_seeds: tuple[RingSeed, ...] = ()

    @property
    def call(self) -> calls.CallInputs:
        """The operands as the runner and the oracle take them."""
        return calls.CallInputs(
            self.k,
            self.gate,
            self.input_row_offsets,
            self.cache_lengths,
            self.slot_idx,
        )


@dataclass(frozen=True)
class Schedule:
    """A named, seeded serving plan on one writer configuration.

    Attributes:
        name: Scenario name.
        seed: The seed (reproduces the plan and its data exactly).
        dtype: Key dtype.
        kpool: Tokens per pool.
        head_dim: Channels per key.
        plan: The serving model's plan: requests, and every call's entries
            (request, slot, cache length, tokens) in batch order.
    """

    name: str
    seed: int
    dtype: np.dtype
    kpool: int
    head_dim: int
    plan: scheduling.Plan = field(repr=False)

    @property
    def max_slots(self) -> int:
        """Ring slots the plan uses (``[0, max_slots)``)."""
        return self.plan.max_slots

    @property
    def calls(self) -> tuple[scheduling.Call, ...]:
        """Every call's entries, in batch order."""
        return self.plan.calls

    @functools.cached_property
    def ape(self) -> np.ndarray:
        """``[kpool, head_dim]`` float32 position embedding."""
        return workload.make_ape(self.seed, self.kpool, self.head_dim)

    @functools.cached_property
    def requests(self) -> tuple[Request, ...]:
        """Every request with its slot and whole sequence, by id."""
        slots = {e.request: e.slot for call in self.calls for e in call}
        out = []
        for rid, r in enumerate(self.plan.requests):
            keys, gates = workload.request_rows(
                self.seed, rid, r.length, self.head_dim, self.dtype
            )
            out.append(
                Request(
                    rid,
                    slots[rid],
                    r.cached_prefix,
                    keys,
                    gates,
                    r.end,
                    r.abort_at is not None,
                )
            )
        return tuple(out)

    def describe(self) -> str:
        """One line naming the schedule: scenario, seed and configuration."""
        return (
            f"schedule {self.name!r} seed={self.seed} "
            f"{np.dtype(self.dtype).name}-k{self.kpool}-d{self.head_dim} "
            f"({len(self.calls)} calls, {len(self.requests)} requests)"
        )

    def ring_seed(self, rid: int) -> RingSeed:
        """The ring restore of request ``rid`` resuming from its prefix."""
        r = self.requests[rid]
        return RingSeed(rid, r.slot, r.prefix, r.keys, r.gates, self.kpool)

    def call_inputs(self, index: int) -> CallInputs:
        """The operands of call ``index``, with the ring seeds to apply."""
        call = self.calls[index]
        seeds = tuple(
            self.ring_seed(e.request)
            for e in call
            if e.admitted and e.cache_length % self.kpool
        )
        sequences = {r.rid: (r.keys, r.gates) for r in self.requests}
        packed = scheduling.plan_call_inputs(
            self.seed, index, call, sequences, self.head_dim, self.dtype
        )
        return CallInputs(
            **packed.operands(),
            rids=tuple(e.request for e in call),
            ring_seeds=seeds,
        )

    def whole_sequence_inputs(self) -> CallInputs:
        """One call feeding every request's sequence from position 0.

        Each request brings its tokens up to ``fed``. With every
        ``cache_length`` 0, ring_close has nothing to close and compress
        builds every pool of every request: the one-shot result the
        streamed pools must match bit for bit. Request ``r`` is batch row
        ``r`` on slot ``r``, so the call needs a scratch ring of
        ``len(requests)`` slots.
        """
        rows = [
            ([r.keys[: r.fed]], [r.gates[: r.fed]], 0, r.rid)
            for r in self.requests
        ]
        packed = calls.pack_call(rows, self.head_dim, self.dtype)
        return CallInputs(
            **packed.operands(), rids=tuple(r.rid for r in self.requests)
        )

    def features(self) -> frozenset[str]:
        """Which serving patterns the schedule exercises.

        Returns:
            A subset of ``chunked_prefill``, ``single_token_decode``,
            ``multi_token_decode``, ``idle_piece``, ``late_join``,
            ``early_leave``, ``slot_reuse``, ``mid_pool_prefix``,
            ``slot_not_row`` (a request's slot differs from its batch row)
            and ``past_4096`` (a position above 4096).
        """
        out = set()
        reqs = self.plan.requests
        for index, call in enumerate(self.calls):
            for row, e in enumerate(call):
                r = reqs[e.request]
                if index > 0 and e.admitted:
                    out.add("late_join")
                if e.tokens == 0:
                    out.add("idle_piece")
                elif e.cache_length < r.prompt:
                    prefill = min(r.prompt, r.end) - r.cached_prefix
                    if e.tokens < prefill:
                        out.add("chunked_prefill")
                else:
                    out.add(
                        "single_token_decode"
                        if e.tokens == 1
                        else "multi_token_decode"
                    )
                if e.slot != row:
                    out.add("slot_not_row")
                if e.cache_length + e.tokens > 4096:
                    out.add("past_4096")
        if self.plan.slot_reuses:
            out.add("slot_reuse")
        if any(r.cached_prefix % self.kpool for r in reqs):
            out.add("mid_pool_prefix")
        if any(r.abort_at is not None for r in reqs):
            out.add("early_leave")
        return frozenset(out)


# --------------------------------------------------------------------------
# Named workloads
# --------------------------------------------------------------------------


@dataclass(frozen=True)
class ScheduleParams:
    """Knobs of :func:`random_schedule`.

    Attributes:
        requests: Requests in the workload (besides the long one).
        max_running: Most requests in flight at once, which is the number
            of ring slots; later requests take the slots earlier ones free.
        token_budget: Most tokens per call (0: ``3 * kpool + 16``), so
            requests sit out calls when it runs short.
        prefix_prob: Chance a request resumes from a cached prefix.
        prefix_granularity: Prefix lengths are multiples of this (a prefix
            cache's block size).
        max_prefix: Longest random prefix.
        first_prefixes: Prefixes of the first requests, fixed.
        prompt_max: Longest prompt past the prefix (0: ``4 * kpool + 8``).
        chunk: Largest prefill chunk (0: ``2 * kpool + 3``).
        decode_max: Most tokens generated per request.
        max_decode: Most decode tokens per request per call.
        idle_prob: Chance a request still in prefill brings no tokens in a
            call.
        leave_prob: Chance a request's client aborts it midway (the first
            request that can be aborted always is).
        long_prefix: If nonzero, request 0 resumes a few tokens short of
            the pool boundary past this position and decodes past it.
    """

    requests: int = 22
    max_running: int = 8
    token_budget: int = 0
    prefix_prob: float = 0.35
    prefix_granularity: int = 1
    max_prefix: int = 300
    first_prefixes: tuple[int, ...] = ()
    prompt_max: int = 0
    chunk: int = 0
    decode_max: int = 24
    max_decode: int = 8
    idle_prob: float = 0.05
    leave_prob: float = 0.1
    long_prefix: int = 0


def _workload(
    rng: np.random.Generator, kpool: int, p: ScheduleParams
) -> list[workload.Request]:
    """The requests of :func:`random_schedule`, drawn from ``rng``."""
    requests = []
    if p.long_prefix:
        # End the prefix a few tokens short of a pool boundary, so the
        # ring carries most of a pool and the first tokens close it.
        short = 1 + int(rng.integers(min(kpool, 24)))
        prefix = (p.long_prefix // kpool + 1) * kpool - short
        requests.append(
            workload.Request(prefix + 1, kpool + 40, cached_prefix=prefix)
        )
    prompt_max = p.prompt_max or 4 * kpool + 8
    aborted = False
    for i in range(p.requests):
        if i < len(p.first_prefixes):
            prefix = p.first_prefixes[i]
        elif rng.random() < p.prefix_prob:
            g = p.prefix_granularity
            prefix = g * int(rng.integers(1, max(1, p.max_prefix // g) + 1))
        else:
            prefix = 0
        prompt = prefix + int(rng.integers(1, prompt_max + 1))
        generate = int(rng.integers(0, p.decode_max + 1))
        abort_at = None
        if prompt + generate - prefix > 1 and (
            not aborted or rng.random() < p.leave_prob
        ):
            abort_at = int(rng.integers(prefix + 1, prompt + generate))
            aborted = True
        requests.append(
            workload.Request(prompt, generate, prefix, abort_at=abort_at)
        )
    return requests


def random_schedule(
    seed: int,
    dtype: np.dtype,
    kpool: int,
    head_dim: int,
    params: ScheduleParams | None = None,
    name: str = "random",
) -> Schedule:
    """A seeded workload through the serving model's scheduler.

    The requests (:class:`ScheduleParams`) arrive at once; the scheduler
    batches them under the token budget, decodes running requests first
    (1 to ``max_decode`` tokens), gives the others their next prefill chunk
    (or, now and then, nothing), and admits waiting requests while ring
    slots are free; the planner hands out random free slots.

    Args:
        seed: Seed of the workload, the batching, the slots and the data.
        dtype: Key dtype (NumPy, or ``ml_dtypes.bfloat16``).
        kpool: Tokens per pool.
        head_dim: Channels per key.
        params: Workload knobs; defaults of :class:`ScheduleParams`.
        name: Scenario name, for messages.

    Returns:
        The schedule.
    """
    p = params or ScheduleParams()
    rng = np.random.default_rng(seed)
    requests = _workload(rng, kpool, p)
    calls = scheduling.schedule(
        requests,
        rng,
        token_budget=p.token_budget or 3 * kpool + 16,
        max_running=p.max_running,
        chunk=p.chunk or 2 * kpool + 3,
        max_decode=p.max_decode,
        idle_prob=p.idle_prob,
    )
    plan = scheduling.plan(requests, calls, p.max_running, rng)
    return Schedule(name, seed, np.dtype(dtype), kpool, head_dim, plan)


def interleaved_pair(
    seed: int,
    dtype: np.dtype,
    kpool: int,
    head_dim: int,
    calls: int = 16,
    slots: tuple[int, int] = (5, 0),
) -> Schedule:
    """Two requests fed together call by call, on slots that are not their rows.

    Request 0 is batch row 0 on ``slots[0]``, request 1 is row 1 on
    ``slots[1]`` (5 and 0 by default), every call; each brings 1 to
    ``kpool + 2`` tokens, so their pools straddle calls at different phases.
    A wrong slot or row mapping mixes up their rings.

    Args:
        seed: Seed of the token counts and the data.
        dtype: Key dtype.
        kpool: Tokens per pool.
        head_dim: Channels per key.
        calls: Calls in the schedule.
        slots: Ring slots of requests 0 and 1.

    Returns:
        The schedule, with ``max_slots = max(slots) + 1``.
    """
    rng = np.random.default_rng(seed)
    counts = rng.integers(1, kpool + 3, size=(calls, 2))
    lengths = counts.sum(axis=0)
    requests = [workload.Request(int(n)) for n in lengths]
    explicit = [[(0, int(a)), (1, int(b))] for a, b in counts]
    plan = scheduling.plan(
        requests, explicit, max(slots) + 1, rng, slots=dict(enumerate(slots))
    )
    return Schedule("interleaved", seed, np.dtype(dtype), kpool, head_dim, plan)


# --------------------------------------------------------------------------
# Replay
# --------------------------------------------------------------------------


#: One call's pools per batch row, with their writers.
CallPools = list[dict[int, calls.PoolRow]]


class PoolAccountingError(Exception):
    """A step produced a pool twice, out of turn, or not at all."""


#: What :func:`replay` calls per call: the call's inputs (apply its
#: ``ring_seeds`` first) to the pools of each batch row, ``{pool_id: key}``.
StepFn = Callable[[CallInputs], Sequence[Mapping[int, np.ndarray]]]


def replay(
    schedule: Schedule, step: StepFn
) -> dict[int, dict[int, np.ndarray]]:
    """Feeds a schedule through ``step`` and collects every request's pools.

    Each call must produce, for each batch row, exactly the pools that call
    completes for that request; so over the schedule each pool comes out
    exactly once and none is missing.

    Args:
        schedule: The schedule.
        step: Runs one call (restoring the ring first); returns per batch
            row ``{pool_id: key}``.

    Returns:
        ``{rid: {pool_id: key}}`` for every request.

    Raises:
        PoolAccountingError: If a call's pools are not exactly the ones it
            completes; the message names the schedule, call and request.
    """
    kp = schedule.kpool
    pools: dict[int, dict[int, np.ndarray]] = {
        r.rid: {} for r in schedule.requests
    }
    for index, call in enumerate(schedule.calls):
        rows = step(schedule.call_inputs(index))
        if len(rows) != len(call):
            raise PoolAccountingError(
                f"{schedule.describe()}: call {index} returned "
                f"{len(rows)} rows for {len(call)} requests"
            )
        for row, (e, got) in enumerate(zip(call, rows, strict=True)):
            want = pools_completed(e.cache_length, e.tokens, kp)
            if sorted(got) != list(want):
                raise PoolAccountingError(
                    f"{schedule.describe()}: call {index} row {row} "
                    f"(request {e.request}, slot {e.slot}, cache_length "
                    f"{e.cache_length}, tokens {e.tokens}) produced "
                    f"pools {sorted(got)}, expected {list(want)}"
                )
            for pool_id, key in got.items():
                pools[e.request][pool_id] = np.asarray(key)
    for r in schedule.requests:
        if sorted(pools[r.rid]) != list(r.pool_ids(kp)):
            raise PoolAccountingError(
                f"{schedule.describe()}: request {r.rid} produced pools "
                f"{sorted(pools[r.rid])}, expected {list(r.pool_ids(kp))}"
            )
    return pools


class ReferenceServer:
    """A :data:`StepFn` on the float64 oracle, with its own host ring.

    Runs :func:`mla_kpool.serving.reference_step` (the oracle's ring_close,
    compress and seed_tail in serving order) on a ring of the schedule's
    dtype, initially NaN (so a stale read poisons the pool that makes it).

    Args:
        schedule: The schedule to serve (gives shapes and ``ape``).
        ring: Host ring ``[slots, 2, R, head_dim]`` to start from; a NaN
            ring of ``schedule.max_slots`` slots and ``R = kpool`` if None.
    """

    def __init__(
        self, schedule: Schedule, ring: np.ndarray | None = None
    ) -> None:
        self.schedule = schedule
        if ring is None:
            ring = np.full(
                (schedule.max_slots, 2, schedule.kpool, schedule.head_dim),
                np.nan,
                dtype=schedule.dtype,
            )
        self.ring = ring

    def run(self, inputs: CallInputs) -> CallPools:
        """Runs one call on the oracle; returns per row its pools."""
        for seed in inputs.ring_seeds:
            seed.apply(self.ring)
        pools, self.ring = reference.step(
            self.ring, inputs.call, self.schedule.ape, self.schedule.kpool
        )
        return pools

    def __call__(self, inputs: CallInputs) -> list[dict[int, np.ndarray]]:
        """Runs one call on the oracle; returns per row ``{pool_id: key}``."""
        return _keys(self.run(inputs))


def _keys(pools: CallPools) -> list[dict[int, Any]]:
    return [{p: row.key for p, row in got.items()} for got in pools]


class DeviceServer:
    """A :data:`StepFn` on a compiled step, mirrored by the oracle.

    The device ring and the oracle's (:class:`ReferenceServer`) have the same
    length, start NaN and receive the same restores and tokens; after each
    call the device ring must equal the oracle's bit for bit.

    Args:
        runner: Where the step runs.
        schedule: The schedule to serve.
        ring_len: Ring length ``R``; ``kpool`` if None.
        step: A step with :meth:`mla_kpool.runner.Runner.step`'s arguments
            and result; ``runner.step`` if None.
        check_ring: Whether to compare the rings after each call.
    """

    def __init__(
        self,
        runner: Runner,
        schedule: Schedule,
        ring_len: int | None = None,
        step: Callable[..., Any] | None = None,
        check_ring: bool = True,
    ) -> None:
        s = schedule
        self.runner, self.schedule = runner, schedule
        self.step = step or runner.step
        self.ring_len = ring_len or s.kpool
        self.ring = runner.new_ring(
            s.max_slots, self.ring_len, s.head_dim, s.dtype, fill=np.nan
        )
        shape = (s.max_slots, 2, self.ring_len, s.head_dim)
        self.oracle = ReferenceServer(s, np.full(shape, np.nan, s.dtype))
        self.check_ring = check_ring
        self.calls = 0

    def run(
        self, inputs: CallInputs
    ) -> tuple[list[dict[int, calls.PoolRow]], list[dict[int, calls.PoolRow]]]:
        """Runs one call on the device and on the oracle.

        Returns:
            ``(device pools, oracle pools)``, per batch row.
        """
        if inputs.ring_seeds:
            host = self.runner.read(self.ring)
            for seed in inputs.ring_seeds:
                seed.apply(host)
            self.ring = self.runner.to_device(host)
        want = self.oracle.run(inputs)
        result = self.step(
            self.ring, inputs.call, self.schedule.ape, self.schedule.kpool
        )
        if self.check_ring:
            ring = self.runner.read(self.ring)
            bad = np.argwhere(
                np.any(bits(ring) != bits(self.oracle.ring), axis=-1)
            )
            assert bad.size == 0, (
                f"{self.schedule.describe()}, R={self.ring_len}: after call "
                f"{self.calls} the ring differs from the oracle's at [slot, "
                f"plane, index] {bad.tolist()[:8]}; batch rows (request, "
                f"slot, cache_length, tokens): {self._rows(inputs)}"
            )
        self.calls += 1
        return result.pools(), want

    def __call__(self, inputs: CallInputs) -> list[dict[int, np.ndarray]]:
        """Runs one call; returns per row ``{pool_id: key}`` of the device."""
        return _keys(self.run(inputs)[0])

    @staticmethod
    def _rows(inputs: CallInputs) -> list[tuple[int, int, int, int]]:
        off = inputs.input_row_offsets
        return [
            (
                rid,
                int(inputs.slot_idx[b]),
                int(inputs.cache_lengths[b]),
                int(off[b + 1] - off[b]),
            )
            for b, rid in enumerate(inputs.rids)
        ]

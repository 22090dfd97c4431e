"""Named serving schedules for the streaming tests, on the serving model.

A schedule is a seeded workload run through the serving model's own
scheduler and slot planner (:func:`schedule` and :func:`plan`): chunked
prefill, single- and multi-token decode, rows that bring no tokens,
requests joining late, leaving early and handing their ring slot to a later
request, and requests resuming from a cached prefix that ends mid-pool
(ring restored on admission with :func:`restore_prefix`). Its requests are
the serving model's (:class:`Request`), its calls the plan's entries, each
call's operands the serving model's packing (:func:`plan_call_inputs`),
and each request's keys and gate scores its seeded ones
(:func:`request_rows`), drawn for the whole sequence independently of how
it is batched. So the pools a request must produce are known in advance:
pool ``p`` is tokens ``[p*kpool, (p+1)*kpool)``
(:func:`mla_kpool.reference.pool_sequence`), and a request resuming at
``cached_prefix`` and fed to ``end`` owns pools ``cached_prefix // kpool``
up to ``end // kpool``.

What the tests add to the serving model:

- workloads the demo does not draw (:class:`ScheduleParams`): clients that
  abort, prefix-cache block sizes, a prefix resumed past position 4096, and
  a fixed two-request interleaving (:func:`interleaved_pair`);
- :meth:`Schedule.features`, what a schedule exercises, so no case is
  vacuous;
- :func:`replay`, which feeds a schedule call by call through any ``step``
  function and checks the pool accounting: every call must produce exactly
  the pools it completes (:func:`pools_completed`), so over the schedule
  every pool comes out exactly once;
- :class:`ReferenceServer` (the float64 oracle step) and
  :class:`DeviceServer` (a compiled step whose ring must equal the
  oracle's bit for bit after every call).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from mla_kpool import reference
from mla_kpool.calls import (
    CallInputs,
    PoolRow,
    pack_call,
    pools_completed,
)
from mla_kpool.demo.checked_run import restore_prefix
from mla_kpool.demo.scheduling import (
    Call,
    Entry,
    Plan,
    plan,
    plan_call_inputs,
    schedule,
)
from mla_kpool.demo.workload import Request, make_ape, request_rows

from .kpool_cases import bits

if TYPE_CHECKING:
    from mla_kpool.runner import Runner

__all__ = [
    "CallPools",
    "DeviceServer",
    "PoolAccountingError",
    "ReferenceServer",
    "Schedule",
    "ScheduleParams",
    "StepFn",
    "interleaved_pair",
    "random_schedule",
    "replay",
]


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
    plan: Plan = field(repr=False)

    @property
    def max_slots(self) -> int:
        """Ring slots the plan uses (``[0, max_slots)``)."""
        return self.plan.max_slots

    @property
    def calls(self) -> tuple[Call, ...]:
        """Every call's entries, in batch order."""
        return self.plan.calls

    @property
    def requests(self) -> tuple[Request, ...]:
        """The requests, by id."""
        return self.plan.requests

    @functools.cached_property
    def ape(self) -> np.ndarray:
        """``[kpool, head_dim]`` float32 position embedding."""
        return make_ape(self.seed, self.kpool, self.head_dim)

    @functools.cached_property
    def sequences(self) -> tuple[tuple[np.ndarray, np.ndarray], ...]:
        """Per request, ``(keys, gates)`` of its whole sequence.

        Each ``[length, head_dim]`` in the key dtype, positions from 0
        (cached prefix included); an aborted request is fed only up to its
        ``end``.
        """
        return tuple(
            request_rows(self.seed, rid, r.length, self.head_dim, self.dtype)
            for rid, r in enumerate(self.requests)
        )

    @functools.cached_property
    def slots(self) -> tuple[int, ...]:
        """The ring slot each request holds, by id."""
        slot_of = {e.request: e.slot for call in self.calls for e in call}
        return tuple(slot_of[rid] for rid in range(len(self.requests)))

    def pool_ids(self, rid: int) -> range:
        """The pools request ``rid`` must produce over the schedule."""
        r = self.requests[rid]
        return range(r.cached_prefix // self.kpool, r.end // self.kpool)

    def describe(self) -> str:
        """One line naming the schedule: scenario, seed and configuration."""
        return (
            f"schedule {self.name!r} seed={self.seed} "
            f"{np.dtype(self.dtype).name}-k{self.kpool}-d{self.head_dim} "
            f"({len(self.calls)} calls, {len(self.requests)} requests)"
        )

    def call_inputs(self, index: int) -> CallInputs:
        """The step operands of call ``index`` (besides the ring and ape)."""
        return plan_call_inputs(
            self.seed,
            index,
            self.calls[index],
            dict(enumerate(self.sequences)),
            self.head_dim,
            self.dtype,
        )

    def restores(self, index: int) -> tuple[Entry, ...]:
        """Entries of call ``index`` whose ring must be restored first.

        A request admitted with a cached prefix that ends mid-pool.
        """
        return tuple(
            e
            for e in self.calls[index]
            if e.admitted and e.cache_length % self.kpool
        )

    def restore(self, index: int, ring: np.ndarray) -> None:
        """Restores the :meth:`restores` of call ``index`` into a host ring.

        Args:
            index: The call.
            ring: Host ring ``[slots, 2, R, head_dim]``, written in place:
                member ``pos`` goes to ring index ``pos % R``.
        """
        for e in self.restores(index):
            keys, gates = self.sequences[e.request]
            restore_prefix(
                ring, e.slot, e.cache_length, keys, gates, self.kpool
            )

    def whole_sequence_inputs(self) -> CallInputs:
        """One call feeding every request's sequence from position 0.

        Each request brings its tokens up to ``end``. With every
        ``cache_length`` 0, ring_close has nothing to close and compress
        builds every pool of every request: the one-shot result the
        streamed pools must match bit for bit. Request ``r`` is batch row
        ``r`` on slot ``r``, so the call needs a scratch ring of
        ``len(requests)`` slots.
        """
        rows = [
            ([keys[: r.end]], [gates[: r.end]], 0, rid)
            for rid, (r, (keys, gates)) in enumerate(
                zip(self.requests, self.sequences, strict=True)
            )
        ]
        return pack_call(rows, self.head_dim, self.dtype)

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
        reqs = self.requests
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
) -> list[Request]:
    """The requests of :func:`random_schedule`, drawn from ``rng``."""
    requests = []
    if p.long_prefix:
        # End the prefix a few tokens short of a pool boundary, so the
        # ring carries most of a pool and the first tokens close it.
        short = 1 + int(rng.integers(min(kpool, 24)))
        prefix = (p.long_prefix // kpool + 1) * kpool - short
        requests.append(Request(prefix + 1, kpool + 40, cached_prefix=prefix))
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
        requests.append(Request(prompt, generate, prefix, abort_at=abort_at))
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
    calls = schedule(
        requests,
        rng,
        token_budget=p.token_budget or 3 * kpool + 16,
        max_running=p.max_running,
        chunk=p.chunk or 2 * kpool + 3,
        max_decode=p.max_decode,
        idle_prob=p.idle_prob,
    )
    plan_ = plan(requests, calls, p.max_running, rng)
    return Schedule(name, seed, np.dtype(dtype), kpool, head_dim, plan_)


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
    requests = [Request(int(n)) for n in lengths]
    explicit = [[(0, int(a)), (1, int(b))] for a, b in counts]
    plan_ = plan(
        requests, explicit, max(slots) + 1, rng, slots=dict(enumerate(slots))
    )
    return Schedule(
        "interleaved", seed, np.dtype(dtype), kpool, head_dim, plan_
    )


# --------------------------------------------------------------------------
# Replay
# --------------------------------------------------------------------------


#: One call's pools per batch row, with their writers.
CallPools = list[dict[int, PoolRow]]


class PoolAccountingError(Exception):
    """A step produced a pool twice, out of turn, or not at all."""


#: What :func:`replay` calls per call: the call's index (the step restores
#: the ring first, :meth:`Schedule.restore`) to the pools of each batch row,
#: ``{pool_id: key}``.
StepFn = Callable[[int], Sequence[Mapping[int, np.ndarray]]]


def replay(s: Schedule, step: StepFn) -> dict[int, dict[int, np.ndarray]]:
    """Feeds a schedule through ``step`` and collects every request's pools.

    Each call must produce, for each batch row, exactly the pools that call
    completes for that request; so over the schedule each pool comes out
    exactly once and none is missing.

    Args:
        s: The schedule.
        step: Runs call ``index`` (restoring the ring first); returns per
            batch row ``{pool_id: key}``.

    Returns:
        ``{rid: {pool_id: key}}`` for every request.

    Raises:
        PoolAccountingError: If a call's pools are not exactly the ones it
            completes; the message names the schedule, call and request.
    """
    pools: dict[int, dict[int, np.ndarray]] = {
        rid: {} for rid in range(len(s.requests))
    }
    for index, call in enumerate(s.calls):
        rows = step(index)
        if len(rows) != len(call):
            raise PoolAccountingError(
                f"{s.describe()}: call {index} returned "
                f"{len(rows)} rows for {len(call)} requests"
            )
        for row, (e, got) in enumerate(zip(call, rows, strict=True)):
            want = pools_completed(e.cache_length, e.tokens, s.kpool)
            if sorted(got) != list(want):
                raise PoolAccountingError(
                    f"{s.describe()}: call {index} row {row} "
                    f"(request {e.request}, slot {e.slot}, cache_length "
                    f"{e.cache_length}, tokens {e.tokens}) produced "
                    f"pools {sorted(got)}, expected {list(want)}"
                )
            for pool_id, key in got.items():
                pools[e.request][pool_id] = np.asarray(key)
    for rid, got in pools.items():
        if sorted(got) != list(s.pool_ids(rid)):
            raise PoolAccountingError(
                f"{s.describe()}: request {rid} produced pools "
                f"{sorted(got)}, expected {list(s.pool_ids(rid))}"
            )
    return pools


def _keys(pools: CallPools) -> list[dict[int, Any]]:
    return [{p: row.key for p, row in got.items()} for got in pools]


class ReferenceServer:
    """A :data:`StepFn` on the float64 oracle, with its own host ring.

    Runs :func:`mla_kpool.reference.step` (the oracle's ring_close,
    compress and seed_tail in serving order) on a ring of the schedule's
    dtype, initially NaN (so a stale read poisons the pool that makes it).

    Args:
        s: The schedule to serve (gives shapes and ``ape``).
        ring: Host ring ``[slots, 2, R, head_dim]`` to start from; a NaN
            ring of ``s.max_slots`` slots and ``R = kpool`` if None.
    """

    def __init__(self, s: Schedule, ring: np.ndarray | None = None) -> None:
        self.schedule = s
        if ring is None:
            shape = (s.max_slots, 2, s.kpool, s.head_dim)
            ring = np.full(shape, np.nan, dtype=s.dtype)
        self.ring = ring

    def run(self, index: int) -> CallPools:
        """Runs call ``index`` on the oracle; returns per row its pools."""
        s = self.schedule
        s.restore(index, self.ring)
        inputs = s.call_inputs(index)
        pools, self.ring = reference.step(self.ring, inputs, s.ape, s.kpool)
        return pools

    def __call__(self, index: int) -> list[dict[int, np.ndarray]]:
        """Runs call ``index`` on the oracle; per row ``{pool_id: key}``."""
        return _keys(self.run(index))


class DeviceServer:
    """A :data:`StepFn` on a compiled step, mirrored by the oracle.

    The device ring and the oracle's (:class:`ReferenceServer`) have the same
    length, start NaN and receive the same restores and tokens; after each
    call the device ring must equal the oracle's bit for bit.

    Args:
        runner: Where the step runs.
        s: The schedule to serve.
        ring_len: Ring length ``R``; ``kpool`` if None.
        step: A step with :meth:`mla_kpool.runner.Runner.step`'s arguments
            and result; ``runner.step`` if None.
        check_ring: Whether to compare the rings after each call.
    """

    def __init__(
        self,
        runner: Runner,
        s: Schedule,
        ring_len: int | None = None,
        step: Callable[..., Any] | None = None,
        check_ring: bool = True,
    ) -> None:
        self.runner, self.schedule = runner, s
        self.step = step or runner.step
        self.ring_len = ring_len or s.kpool
        self.ring = runner.new_ring(
            s.max_slots, self.ring_len, s.head_dim, s.dtype, fill=np.nan
        )
        shape = (s.max_slots, 2, self.ring_len, s.head_dim)
        self.oracle = ReferenceServer(s, np.full(shape, np.nan, s.dtype))
        self.check_ring = check_ring

    def run(self, index: int) -> tuple[CallPools, CallPools]:
        """Runs call ``index`` on the device and on the oracle.

        Returns:
            ``(device pools, oracle pools)``, per batch row.
        """
        s = self.schedule
        if s.restores(index):
            host = self.runner.read(self.ring)
            s.restore(index, host)
            self.ring = self.runner.to_device(host)
        want = self.oracle.run(index)
        inputs = s.call_inputs(index)
        result = self.step(self.ring, inputs, s.ape, s.kpool)
        if self.check_ring:
            ring = self.runner.read(self.ring)
            bad = np.argwhere(
                np.any(bits(ring) != bits(self.oracle.ring), axis=-1)
            )
            rows = [
                (e.request, e.slot, e.cache_length, e.tokens)
                for e in s.calls[index]
            ]
            assert bad.size == 0, (
                f"{s.describe()}, R={self.ring_len}: after call {index} the "
                f"ring differs from the oracle's at [slot, plane, index] "
                f"{bad.tolist()[:8]}; batch rows (request, slot, "
                f"cache_length, tokens): {rows}"
            )
        got = result.pools()
        return got, want

    def __call__(self, index: int) -> list[dict[int, np.ndarray]]:
        """Runs call ``index``; per row ``{pool_id: key}`` of the device."""
        return _keys(self.run(index)[0])

"""Seeded serving schedules for the k-pool writers, and a pool-exact replay.

A schedule is a deterministic (seeded) story of a serving loop: requests join,
are fed through many calls (chunked prefill, single- and multi-token decode,
calls where they sit out or bring no tokens), and leave, finished or aborted;
a freed ring slot is handed to a later request. A request may resume from a
cached prefix, in which case its ring slot is seeded with the prefix's
trailing members first, as a prefix cache would restore it.

Each request's whole sequence of keys and gate scores is drawn when it is
created, before any of it is fed, so the pools it must produce are known
independently of how the schedule splits it: pool ``p`` is tokens
``[p*kpool, (p+1)*kpool)`` of that sequence (:func:`mla_kpool.reference.
pool_sequence`). A request resuming at ``prefix`` owns pools
``prefix // kpool`` up to ``fed // kpool`` (the first one closed from its ring
when the prefix ends mid-pool).

:func:`replay` feeds a schedule call by call through any ``step`` function
(the compiled step, or :class:`ReferenceServer`, the float64
oracle) and checks the pool accounting: every call must produce exactly the
pools it completes, so over the schedule every pool comes out exactly once.

The module depends on NumPy and :mod:`mla_kpool.reference` only (not on
pytest or MAX), so a demo can build and replay the same schedules.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from mla_kpool.serving import (
    pack_call,
    pools_completed,
    reference_step,
    restore_prefix,
)

__all__ = [
    "Call",
    "CallInputs",
    "Piece",
    "PoolAccountingError",
    "ReferenceServer",
    "Request",
    "RingSeed",
    "Schedule",
    "ScheduleParams",
    "StepFn",
    "interleaved_pair",
    "pools_completed",
    "random_schedule",
    "replay",
]


# --------------------------------------------------------------------------
# Data
# --------------------------------------------------------------------------


@dataclass(frozen=True)
class Request:
    """One request: its slot, where it resumes, and its whole sequence.

    Attributes:
        rid: Request id (its index in :attr:`Schedule.requests`).
        slot: Ring slot it holds while in flight.
        prefix: Tokens already cached when it joins (0 for a fresh request).
        keys: ``[length, head_dim]`` keys of positions ``0..length-1``,
            prefix included; the schedule may stop feeding before the end
            (the request left early).
        gates: ``[length, head_dim]`` gate scores, same dtype.
        fed: Length reached when the schedule ends (``prefix`` plus every
            token fed).
        left_early: Whether it was aborted before its sequence ended.
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
class Piece:
    """One request's part of one call (one batch row).

    Attributes:
        rid: The request.
        cache_length: Its length before the call (``cache_lengths[b]``).
        tokens: New tokens this call brings (may be 0).
        phase: ``"prefill"``, ``"decode"`` or ``"idle"`` (0 tokens); for
            describing schedules only.
    """

    rid: int
    cache_length: int
    tokens: int
    phase: str


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
        ring_seeds: Ring entries to write before the call.
    """

    k: np.ndarray
    gate: np.ndarray
    input_row_offsets: np.ndarray
    cache_lengths: np.ndarray
    slot_idx: np.ndarray
    rids: tuple[int, ...]
    ring_seeds: tuple[RingSeed, ...] = ()


@dataclass(frozen=True)
class Call:
    """One call of a schedule.

    Attributes:
        pieces: Batch rows in order.
        joins: Requests that join before this call (their ring seeds, if
            any, are applied before it).
    """

    pieces: tuple[Piece, ...]
    joins: tuple[int, ...]


@dataclass(frozen=True)
class Schedule:
    """A seeded serving schedule on one writer configuration.

    Attributes:
        name: Scenario name.
        seed: The generator seed (reproduces the schedule exactly).
        dtype: Key dtype.
        kpool: Tokens per pool.
        head_dim: Channels per key.
        max_slots: Ring slots the schedule uses (``[0, max_slots)``).
        ape: ``[kpool, head_dim]`` float32 position embedding.
        requests: Every request, by id.
        calls: The calls in order.
    """

    name: str
    seed: int
    dtype: np.dtype
    kpool: int
    head_dim: int
    max_slots: int
    ape: np.ndarray = field(repr=False)
    requests: tuple[Request, ...] = field(repr=False)
    calls: tuple[Call, ...] = field(repr=False)

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
            self.ring_seed(rid)
            for rid in call.joins
            if self.requests[rid].prefix % self.kpool
        )
        rows = [
            (p.rid, p.cache_length, p.cache_length + p.tokens)
            for p in call.pieces
        ]
        return self._inputs(
            rows, seeds, [self.requests[p.rid].slot for p in call.pieces]
        )

    def whole_sequence_inputs(self) -> CallInputs:
        """One call feeding every request's whole sequence from position 0.

        With every ``cache_length`` 0, ring_close has nothing to close and
        compress builds every pool of every request: the one-shot result the
        streamed pools must match bit for bit. Request ``r`` is batch row
        ``r`` on slot ``r``, so the call needs a scratch ring of
        ``len(requests)`` slots.
        """
        rows = [(r.rid, 0, r.keys.shape[0]) for r in self.requests]
        return self._inputs(rows, (), list(range(len(self.requests))))

    def _inputs(
        self,
        rows: Sequence[tuple[int, int, int]],
        seeds: tuple[RingSeed, ...],
        slots: Sequence[int],
    ) -> CallInputs:
        packed = pack_call(
            [
                (
                    [self.requests[rid].keys[lo:hi]],
                    [self.requests[rid].gates[lo:hi]],
                    lo,
                    slot,
                )
                for (rid, lo, hi), slot in zip(rows, slots, strict=True)
            ],
            self.head_dim,
            self.dtype,
        )
        return CallInputs(
            **packed.operands(),
            rids=tuple(rid for rid, _, _ in rows),
            ring_seeds=seeds,
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
        kp = self.kpool
        for index, call in enumerate(self.calls):
            if index > 0 and call.joins:
                out.add("late_join")
            for row, p in enumerate(call.pieces):
                if p.phase == "prefill" and p.tokens < (
                    self.requests[p.rid].fed - self.requests[p.rid].prefix
                ):
                    out.add("chunked_prefill")
                if p.phase == "decode":
                    out.add(
                        "single_token_decode"
                        if p.tokens == 1
                        else "multi_token_decode"
                    )
                if p.tokens == 0:
                    out.add("idle_piece")
                if self.requests[p.rid].slot != row:
                    out.add("slot_not_row")
                if p.cache_length + p.tokens > 4096:
                    out.add("past_4096")
        slots = [r.slot for r in self.requests]
        if len(set(slots)) < len(slots):
            out.add("slot_reuse")
        for r in self.requests:
            if r.prefix % kp:
                out.add("mid_pool_prefix")
            if r.left_early:
                out.add("early_leave")
        return frozenset(out)


# --------------------------------------------------------------------------
# Generation
# --------------------------------------------------------------------------


@dataclass(frozen=True)
class ScheduleParams:
    """Knobs of :func:`random_schedule` (probabilities are per call).

    Attributes:
        calls: Calls in the schedule.
        max_batch: Most requests in flight at once.
        max_slots: Ring slots (``>= max_batch``); slots are drawn at random,
            a freed one usually handed to the next request.
        join_prob: Chance per call (up to twice) that a request joins.
        prefix_prob: Chance a joining request resumes from a cached prefix.
        prefix_granularity: Prefix lengths are multiples of this (a prefix
            cache's block size).
        max_prefix: Longest random prefix.
        first_prefixes: Prefixes of requests forced to join at call 0.
        prompt_max: Longest prompt (tokens fed in prefill).
        chunk_max: Largest prefill chunk (0: ``2 * kpool + 3``).
        decode_max: Most decode tokens per request.
        multi_decode_prob: Chance a decode piece brings 2-8 tokens.
        skip_prob: Chance a request sits out a call.
        idle_prob: Chance a request is in the batch with 0 tokens.
        leave_prob: Chance a request is aborted after a call.
        long_prefix: If nonzero, request 0 resumes near this position and
            decodes in multi-token chunks through the whole schedule.
    """

    calls: int = 24
    max_batch: int = 8
    max_slots: int = 10
    join_prob: float = 0.45
    prefix_prob: float = 0.35
    prefix_granularity: int = 1
    max_prefix: int = 300
    first_prefixes: tuple[int, ...] = ()
    prompt_max: int = 0
    chunk_max: int = 0
    decode_max: int = 24
    multi_decode_prob: float = 0.5
    skip_prob: float = 0.1
    idle_prob: float = 0.04
    leave_prob: float = 0.04
    long_prefix: int = 0


def _draw_sequence(
    rng: np.random.Generator, length: int, head_dim: int, dtype: np.dtype
) -> tuple[np.ndarray, np.ndarray]:
    """Keys ~ N(0, 1); gates ~ N(0, 4^2), wide so that every member counts."""
    keys = rng.standard_normal((length, head_dim)).astype(dtype)
    gates = (4.0 * rng.standard_normal((length, head_dim))).astype(dtype)
    return keys, gates


@dataclass
class _Live:
    rid: int
    slot: int
    prefix: int
    prompt_end: int
    length: int
    pos: int
    long: bool = False
    aborted: bool = False


class _Builder:
    """Mutable state while :func:`random_schedule` simulates the loop."""

    def __init__(
        self,
        rng: np.random.Generator,
        kpool: int,
        head_dim: int,
        dtype: np.dtype,
        params: ScheduleParams,
    ) -> None:
        self.rng = rng
        self.kpool = kpool
        self.head_dim = head_dim
        self.dtype = dtype
        self.p = params
        self.free = [int(s) for s in rng.permutation(params.max_slots)]
        self.live: list[_Live] = []
        self.seqs: list[tuple[np.ndarray, np.ndarray]] = []
        self.meta: list[_Live] = []

    def admit(self, prefix: int | None = None, long: bool = False) -> int:
        rng, p, kp = self.rng, self.p, self.kpool
        if prefix is None:
            prefix = 0
            if rng.random() < p.prefix_prob:
                g = p.prefix_granularity
                prefix = g * int(rng.integers(1, max(1, p.max_prefix // g) + 1))
        prompt_max = p.prompt_max or 4 * kp + 8
        prompt = 0 if long else int(rng.integers(1, prompt_max + 1))
        decode = (
            p.calls * (kp + 8)
            if long
            else int(rng.integers(0, p.decode_max + 1))
        )
        # Hand over the most recently freed slot most of the time, so that a
        # ring slot still holding a finished request's members gets reused.
        pick = -1 if rng.random() < 0.6 else int(rng.integers(len(self.free)))
        slot = self.free.pop(pick)
        live = _Live(
            rid=len(self.meta),
            slot=slot,
            prefix=prefix,
            prompt_end=prefix + prompt,
            length=prefix + prompt + decode,
            pos=prefix,
            long=long,
        )
        self.seqs.append(
            _draw_sequence(rng, live.length, self.head_dim, self.dtype)
        )
        self.meta.append(live)
        self.live.append(live)
        return live.rid

    def piece(self, live: _Live) -> Piece | None:
        rng, p = self.rng, self.p
        remaining = live.length - live.pos
        if live.long:
            big = rng.random() < 0.15
            hi = self.kpool + 8 if big else 8
            n = min(remaining, int(rng.integers(2, max(hi, 2) + 1)))
            phase = "decode"
        elif rng.random() < p.skip_prob:
            return None
        elif rng.random() < p.idle_prob:
            n, phase = 0, "idle"
        elif live.pos < live.prompt_end:
            chunk_max = p.chunk_max or 2 * self.kpool + 3
            n = min(
                live.prompt_end - live.pos, int(rng.integers(1, chunk_max + 1))
            )
            phase = "prefill"
        else:
            n = 1
            if rng.random() < p.multi_decode_prob:
                n = int(rng.integers(2, 9))
            n = min(n, remaining)
            phase = "decode"
        piece = Piece(live.rid, live.pos, n, phase if n else "idle")
        live.pos += n
        return piece

    def retire(self, force_abort: bool = False) -> None:
        """Drops finished and aborted requests; frees their slots.

        With ``force_abort``, the first unfinished request that has been fed
        something leaves early if none has yet.
        """
        if force_abort and not any(m.aborted for m in self.meta):
            for live in self.live:
                if not live.long and live.prefix < live.pos < live.length:
                    live.aborted = True
                    break
        still = []
        for live in self.live:
            done = live.pos >= live.length
            aborted = live.aborted or (
                not live.long and self.rng.random() < self.p.leave_prob
            )
            if done or aborted:
                live.aborted = not done
                self.free.append(live.slot)
            else:
                still.append(live)
        self.live = still


def random_schedule(
    seed: int,
    dtype: np.dtype,
    kpool: int,
    head_dim: int,
    params: ScheduleParams | None = None,
    name: str = "random",
) -> Schedule:
    """Draws a random serving schedule.

    Call 0 starts with the forced requests (``params.first_prefixes``, and
    the long request if ``params.long_prefix``) and one to half the batch of
    random ones; each later call may admit up to two more while slots and
    batch room remain. Every call shuffles the requests in flight into batch
    rows; each brings a prefill chunk, one decode token, 2-8 decode tokens,
    nothing, or sits out. After a call, finished requests leave and a few
    are aborted early (one at least by mid-schedule, if one is in flight).

    Args:
        seed: Seed of the generator; the same seed gives the same schedule.
        dtype: Key dtype (NumPy, or ``ml_dtypes.bfloat16``).
        kpool: Tokens per pool.
        head_dim: Channels per key.
        params: Generator knobs; defaults of :class:`ScheduleParams`.
        name: Scenario name, for messages.

    Returns:
        The schedule.

    Raises:
        ValueError: If ``max_slots < max_batch`` or ``calls < 1``.
    """
    p = params or ScheduleParams()
    if p.max_slots < p.max_batch or p.calls < 1:
        raise ValueError(f"need calls >= 1 and max_slots >= max_batch, got {p}")
    dtype = np.dtype(dtype)
    rng = np.random.default_rng(seed)
    ape = (2.0 * rng.standard_normal((kpool, head_dim))).astype(np.float32)
    b = _Builder(rng, kpool, head_dim, dtype, p)
    calls = []
    for index in range(p.calls):
        joins = []
        if index == 0:
            if p.long_prefix:
                # End the prefix a few tokens short of a pool boundary, so
                # the ring carries most of a pool and the first chunks close it.
                short = 1 + int(rng.integers(min(kpool, 24)))
                boundary = (p.long_prefix // kpool + 1) * kpool
                joins.append(b.admit(prefix=boundary - short, long=True))
            joins += [b.admit(prefix=f) for f in p.first_prefixes]
            for _ in range(int(rng.integers(1, max(1, p.max_batch // 2) + 1))):
                if len(b.live) < p.max_batch:
                    joins.append(b.admit())
        else:
            for _ in range(2):
                if (
                    len(b.live) < p.max_batch
                    and b.free
                    and rng.random() < p.join_prob
                ):
                    joins.append(b.admit())
        pieces = []
        for i in rng.permutation(len(b.live)):
            piece = b.piece(b.live[int(i)])
            if piece is not None:
                pieces.append(piece)
        calls.append(Call(tuple(pieces), tuple(joins)))
        # Halfway through, make sure some request has left early.
        b.retire(force_abort=index == p.calls // 2)
    requests = tuple(
        Request(m.rid, m.slot, m.prefix, *b.seqs[m.rid], m.pos, m.aborted)
        for m in b.meta
    )
    return Schedule(
        name,
        seed,
        dtype,
        kpool,
        head_dim,
        p.max_slots,
        ape,
        requests,
        tuple(calls),
    )


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
        seed: Generator seed.
        dtype: Key dtype.
        kpool: Tokens per pool.
        head_dim: Channels per key.
        calls: Calls in the schedule.
        slots: Ring slots of requests 0 and 1.

    Returns:
        The schedule, with ``max_slots = max(slots) + 1``.
    """
    dtype = np.dtype(dtype)
    rng = np.random.default_rng(seed)
    ape = (2.0 * rng.standard_normal((kpool, head_dim))).astype(np.float32)
    counts = rng.integers(1, kpool + 3, size=(calls, 2))
    lengths = counts.sum(axis=0)
    requests = tuple(
        Request(
            rid,
            slots[rid],
            0,
            *_draw_sequence(rng, int(lengths[rid]), head_dim, dtype),
            fed=int(lengths[rid]),
        )
        for rid in range(2)
    )
    pos = [0, 0]
    schedule_calls = []
    for index in range(calls):
        pieces = []
        for rid in range(2):
            n = int(counts[index, rid])
            pieces.append(Piece(rid, pos[rid], n, "prefill"))
            pos[rid] += n
        schedule_calls.append(Call(tuple(pieces), (0, 1) if index == 0 else ()))
    return Schedule(
        "interleaved",
        seed,
        dtype,
        kpool,
        head_dim,
        max(slots) + 1,
        ape,
        requests,
        tuple(schedule_calls),
    )


# --------------------------------------------------------------------------
# Replay
# --------------------------------------------------------------------------


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
    completes for that request (:func:`pools_completed`); so over the
    schedule each pool comes out exactly once and none is missing.

    Args:
        schedule: The schedule.
        step: Runs one call (seeding the ring first); returns per batch row
            ``{pool_id: key}``.

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
        inputs = schedule.call_inputs(index)
        rows = step(inputs)
        if len(rows) != len(call.pieces):
            raise PoolAccountingError(
                f"{schedule.describe()}: call {index} returned "
                f"{len(rows)} rows for {len(call.pieces)} requests"
            )
        for row, (piece, got) in enumerate(zip(call.pieces, rows, strict=True)):
            want = pools_completed(piece.cache_length, piece.tokens, kp)
            if sorted(got) != list(want):
                raise PoolAccountingError(
                    f"{schedule.describe()}: call {index} row {row} "
                    f"(request {piece.rid}, slot "
                    f"{schedule.requests[piece.rid].slot}, cache_length "
                    f"{piece.cache_length}, tokens {piece.tokens}) produced "
                    f"pools {sorted(got)}, expected {list(want)}"
                )
            for pool_id, key in got.items():
                pools[piece.rid][pool_id] = np.asarray(key)
    for r in schedule.requests:
        if sorted(pools[r.rid]) != list(r.pool_ids(kp)):
            raise PoolAccountingError(
                f"{schedule.describe()}: request {r.rid} produced pools "
                f"{sorted(pools[r.rid])}, expected {list(r.pool_ids(kp))}"
            )
    return pools


class ReferenceServer:
    """A :data:`StepFn` on the float64 oracle, with its own host ring.

    Runs :func:`mla_kpool.reference.ring_close`, ``compress`` and
    ``seed_tail`` in serving order on a ring of the schedule's dtype,
    initially NaN (so a stale read poisons the pool that makes it).

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

    def __call__(self, inputs: CallInputs) -> list[dict[int, np.ndarray]]:
        """Runs one call on the oracle; returns per row ``{pool_id: key}``."""
        for seed in inputs.ring_seeds:
            seed.apply(self.ring)
        pools, self.ring = reference_step(
            self.ring,
            inputs.k,
            inputs.gate,
            self.schedule.ape,
            inputs.input_row_offsets,
            inputs.cache_lengths,
            inputs.slot_idx,
            self.schedule.kpool,
        )
        return [{p: row.key for p, row in got.items()} for got in pools]

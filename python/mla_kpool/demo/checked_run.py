"""The checked run: every call through the indexer, every result checked.

:func:`serve` (what ``python -m mla_kpool demo`` runs) sends every call of a
plan through the fused step on one persistent ring; a request admitted with
a cached prefix that ends mid-pool gets the prefix's pending members restored
into its new slot first (:func:`restore_ring`). After each step the call's
pools are filed, stored into the paged FP8 key cache, every query token of
the call is scored with index_top_k and its selection checked, the
selection is widened with expand_topk and checked
(:func:`index_and_expand`, :mod:`mla_kpool.demo.indexing`), and each
finished request's pools are checked against the oracle
(:mod:`mla_kpool.demo.checks`).

With speculation the ring is ``mla_kpool.ring_length(kpool, N + 1)``
entries deep (``N`` drafts per verify step), so drafts never overwrite a
member of a pool that must be redone.
"""

from __future__ import annotations

import functools
import os
import statistics
import time
import timeit
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from .. import reference
from ..calls import COMPRESS, RING_CLOSE, CallInputs
from ..index_runner import IndexKey
from ..reference import tolerance
from ..ring import ring_length
from ..runner import ModelKey, Runner, SharedModel, model_key
from .checks import (
    LiveRequest,
    Totals,
    check_expansion,
    check_request,
    keep_latest,
)
from .faults import Fault, corrupt_selection, corrupt_weight
from .indexing import (
    INDEX_LAYER,
    IndexCache,
    check_call,
    index_key,
    make_queries,
)
from .scheduling import Entry, Plan, plan, plan_call_inputs, schedule
from .workload import (
    DEFAULT_POOL_TOPK,
    Request,
    generate_requests,
    make_ape,
    request_rows,
)

__all__ = [
    "Config",
    "compile_models",
    "graph_cache_files",
    "idle_model_seconds",
    "make_plan",
    "model_keys",
    "restore_prefix",
    "serve",
]


@dataclass(frozen=True)
class Config:
    """What one serving run does.

    Attributes:
        dtype: Key dtype.
        kpool: Tokens per pool.
        head_dim: Channels per key.
        device: ``"cpu"``, ``"gpu"`` or ``"gpu-emulated"``.
        seed: Seed of the workload, the keys and the slot choice.
        token_budget: Most tokens per call (generated batching only).
        max_running: Ring slots: most requests in flight.
        chunk: Prefill chunk (generated batching only).
        schedule: The ``--schedule`` file, if any.
        spec_tokens: Drafts per verify step; 0 without speculation.
        pool_topk: Pool ids each query token's indexer row selects (its
            ``top_k``), which expand_topk widens.
        index_mask: The indexer's mask, ``"null"`` (GLM-5-Next's) or
            ``"causal"``.
    """

    dtype: np.dtype
    kpool: int
    head_dim: int
    device: str
    seed: int
    token_budget: int
    max_running: int
    chunk: int
    schedule: str | None
    spec_tokens: int = 0
    pool_topk: int = DEFAULT_POOL_TOPK
    index_mask: str = "null"

    @property
    def ring_len(self) -> int:
        """Ring entries per slot: ``kpool``, deeper with speculation."""
        return ring_length(self.kpool, self.spec_tokens + 1)


def make_plan(
    config: Config,
    requests: int | Sequence[Request],
    calls: Sequence[Sequence[tuple[int, ...]]] | None = None,
) -> Plan:
    """The plan of a run: requests, batching and slots, from the seed.

    One random stream, seeded ``[config.seed, 0]``, draws in turn the
    requests (when only their count is given), the batching (when
    ``calls`` is ``None``; :func:`schedule` with the config's token budget,
    ring slots, chunk and speculative tokens) and the slots (:func:`plan`).

    Args:
        config: The run's configuration.
        requests: The requests, or how many to generate
            (:func:`generate_requests`).
        calls: Per call, ``(request, tokens)`` pairs in batch order; ``None``
            to batch with :func:`schedule`.

    Returns:
        The plan, on ``config.max_running`` ring slots.

    Raises:
        ScheduleError: As :func:`plan`.
    """
    rng = np.random.default_rng([config.seed, 0])
    if isinstance(requests, int):
        requests = generate_requests(
            rng, requests, config.kpool, chunk=config.chunk
        )
    if calls is None:
        calls = schedule(
            requests,
            rng,
            token_budget=config.token_budget,
            max_running=config.max_running,
            chunk=config.chunk,
            spec_tokens=config.spec_tokens,
        )
    return plan(requests, calls, config.max_running, rng)


def restore_prefix(
    ring: np.ndarray,
    slot: int,
    cache_length: int,
    k: np.ndarray,
    gate: np.ndarray,
    kpool: int,
) -> None:
    """Puts a cached prefix's pending members back into a host ring.

    A prefix cache keeps the complete pools of a prefix, but the members
    of a partial last pool live only in the ring, so an engine admitting a
    request whose cached prefix ends mid-pool must restore them into the
    request's new slot: positions ``[cache_length // kpool * kpool,
    cache_length)``, member ``pos`` at ring index ``pos % R``.

    Args:
        ring: Host ring ``[max_slots, 2, R, head_dim]``, written in place.
        slot: The request's ring slot.
        cache_length: Length of the cached prefix.
        k: ``[>= cache_length, head_dim]`` the request's keys from
            position 0.
        gate: Its gate scores, same shape.
        kpool: Tokens per pool.
    """
    positions = np.arange(cache_length // kpool * kpool, cache_length)
    index = positions % ring.shape[2]
    ring[slot, 0, index] = k[positions]
    ring[slot, 1, index] = gate[positions]


def restore_ring(
    runner: Runner,
    ring: Any,
    restores: list[tuple[Entry, LiveRequest]],
    fault: tuple[int, int, float] | None,
    kpool: int,
) -> Any:
    """Writes cached-prefix members (and a ring fault) into the ring.

    The engine's restore on admission (:func:`restore_prefix`), done
    host-side: read, patch, upload.
    """
    host = runner.read(ring)
    ring_len = host.shape[2]
    for e, live in restores:
        restore_prefix(host, e.slot, e.cache_length, live.k, live.gate, kpool)
    if fault is not None:
        slot, pos, delta = fault
        member = host[slot, 0, pos % ring_len].astype(np.float64)
        host[slot, 0, pos % ring_len] = (member + delta).astype(host.dtype)
    return runner.to_device(host)


def serve(
    config: Config,
    plan_: Plan,
    runner: Runner,
    fault: Fault | None,
    progress: Any,
) -> Totals:
    """Runs every call of the plan through the step and the indexer.

    Each call's indexer rows are checked after it, each request's pools
    when it finishes.

    Args:
        config: The run's configuration.
        plan_: The calls.
        runner: Where the step, index_top_k and expand_topk run.
        fault: A fault to inject, or ``None``.
        progress: Progress display (a ``tqdm`` bar or anything with its
            ``set_postfix_str``, ``update`` and ``close``).

    Returns:
        Counts, errors, timings and problems.
    """
    kpool, head_dim, dtype = config.kpool, config.head_dim, config.dtype
    ape = make_ape(config.seed, kpool, head_dim)
    rel_tol = tolerance(dtype)
    ring = runner.new_ring(plan_.max_slots, config.ring_len, head_dim, dtype)
    cache = IndexCache(plan_, kpool, head_dim, config.seed)
    live: dict[int, LiveRequest] = {}
    totals = Totals()
    finished = 0
    for c, call in enumerate(plan_.calls):
        for e in call:
            if e.admitted:
                request = plan_.requests[e.request]
                k, gate = request_rows(
                    config.seed, e.request, request.length, head_dim, dtype
                )
                live[e.request] = LiveRequest(e.slot, k, gate)
                cache.admit(e.request, request.end // kpool + 1)
        here = fault if fault is not None and fault.call == c else None
        delta = 0.0
        if here is not None:
            rows = live[here.request].k.astype(np.float64)
            delta = 8.0 * max(1.0, float(np.abs(rows).max()))
        restores = [
            (e, live[e.request])
            for e in call
            if e.admitted and e.cache_length % kpool
        ]
        ring_fault = None
        if here is not None and here.kind == "ring":
            ring_fault = (here.slot, here.position, delta)
        if restores or ring_fault:
            ring = restore_ring(runner, ring, restores, ring_fault, kpool)

        sequences = {
            e.request: (live[e.request].k, live[e.request].gate) for e in call
        }
        inputs = plan_call_inputs(
            config.seed, c, call, sequences, head_dim, dtype
        )
        if here is not None and here.kind == "key":
            row = int(inputs.input_row_offsets[here.entry])
            k_row = inputs.k[row].astype(np.float64)
            inputs.k[row] = (k_row + delta).astype(dtype)

        start = time.perf_counter()
        out = runner.step(ring, inputs, ape, kpool)
        totals.call_seconds.append(time.perf_counter() - start)

        collect_pools(c, call, out, live, totals, kpool)
        cache.bind(call)
        store_prefixes(cache, call, live, ape, kpool, dtype)
        try:
            for b, pools in enumerate(out.pools()):
                cache.store_pools(b, pools)
        except ValueError:
            pass  # collect_pools reported it
        index_and_expand(config, c, call, inputs, cache, runner, here, totals)
        for e in call:
            if not e.finished:
                continue
            cache.release(e.request)
            state = live.pop(e.request)
            err, ratio, checked, problems = check_request(
                e.request, plan_.requests[e.request], state, ape, kpool, rel_tol
            )
            totals.max_abs_error = max(totals.max_abs_error, err)
            totals.worst_ratio = max(totals.worst_ratio, ratio)
            totals.checked_pools += checked
            totals.dropped += sum(
                1
                for p in state.pools
                if p >= plan_.requests[e.request].end // kpool
                and not state.pools[p].accepted
            )
            totals.problems += problems
            finished += 1
        progress.set_postfix_str(
            f"{finished}/{len(plan_.requests)} requests checked", refresh=False
        )
        progress.update(1)
    progress.close()
    return totals


def store_prefixes(
    cache: IndexCache,
    call: Sequence[Entry],
    live: dict[int, LiveRequest],
    ape: np.ndarray,
    kpool: int,
    dtype: np.dtype,
) -> None:
    """Stores the complete pools of each newly admitted cached prefix.

    A prefix-cache hit skips the prefix's tokens, so its pools are never
    produced by a call; an engine's cache holds them from earlier. Here
    they come from the oracle, in the key dtype the step outputs.
    """
    for b, e in enumerate(call):
        pools = e.cache_length // kpool
        if e.admitted and pools:
            state = live[e.request]
            rows = pools * kpool
            keys = reference.pool_sequence(
                state.k[:rows], state.gate[:rows], ape, kpool
            )
            cache.store(b, 0, keys.astype(dtype))


def index_and_expand(
    config: Config,
    c: int,
    call: Sequence[Entry],
    inputs: CallInputs,
    cache: IndexCache,
    runner: Runner,
    fault: Fault | None,
    totals: Totals,
) -> None:
    """Scores the call's queries, checks the selection, expands and checks.

    index_top_k gets the call's queries and the cache (with the ``"head"``
    or ``"bound"`` fault applied, if it is this call's); the oracle gets
    the true ones. expand_topk then widens the op's selection (with the
    ``"topk"`` fault applied), the oracle the selection as the op gave it.
    """
    tokens = len(inputs.k)
    q, qs = make_queries(config.seed, c, tokens, config.head_dim)
    picks = dict(
        top_k=config.pool_topk, kpool=config.kpool, mask=config.index_mask
    )
    sent_qs, lengths = qs, cache.cache.cache_lengths
    if fault is not None and fault.kind == "head":
        sent_qs = qs.copy()
        corrupt_weight(sent_qs, fault.pool)
    if fault is not None and fault.kind == "bound":
        cache.cache.cache_lengths = lengths.copy()
        cache.cache.cache_lengths[fault.entry] += config.kpool
    start = time.perf_counter()
    # A planted bound fault is bad metadata on purpose: it must reach the
    # op for the checks to catch what it does.
    planted = fault is not None and fault.kind == "bound"
    ids = runner.index_top_k(
        q,
        sent_qs,
        inputs.input_row_offsets,
        cache.cache,
        INDEX_LAYER,
        check=not planted,
        **picks,
    )
    totals.index_seconds.append(time.perf_counter() - start)
    cache.cache.cache_lengths = lengths
    checked = check_call(c, call, ids, q, qs, cache.cache, **picks)
    totals.index_rows += tokens
    totals.index_checked += checked.rows
    totals.index_selections += checked.selections
    totals.index_worst_margin = min(
        totals.index_worst_margin, checked.worst_margin
    )
    if checked.problem is not None:
        totals.index_failures += 1
        totals.problems.append(checked.problem)

    sent = ids
    if fault is not None and fault.kind == "topk":
        sent = ids.copy()
        corrupt_selection(
            sent, fault.pool, (fault.position + 1) // config.kpool
        )
    offsets, lengths = inputs.input_row_offsets, inputs.cache_lengths
    start = time.perf_counter()
    (got,) = runner.run(
        "expand_topk",
        config.kpool,
        pool_ids=sent,
        input_row_offsets=offsets,
        cache_lengths=lengths,
    )
    totals.expand_seconds.append(time.perf_counter() - start)
    want = reference.expand_topk(ids, offsets, lengths, config.kpool)
    mismatches, problems = check_expansion(c, call, got, want)
    totals.expand_rows += len(ids)
    totals.expand_checked += len(want) if got.shape == want.shape else 0
    totals.expand_mismatches += mismatches
    totals.expand_skipped_ids += skipped_ids(ids, call, config.kpool)
    totals.problems += problems


def skipped_ids(ids: np.ndarray, call: Sequence[Entry], kpool: int) -> int:
    """Selected ids that name a pool not complete and visible to the query.

    With the null mask a prefill row sees the call's later pools too;
    expand_topk must skip those.
    """
    local = np.concatenate([np.arange(e.tokens) for e in call] or [[]])
    base = np.repeat([e.cache_length for e in call], [e.tokens for e in call])
    complete = (base + local + 1).astype(np.int64) // kpool
    return int(((ids >= 0) & (ids >= complete[:, None])).sum())


def collect_pools(
    c: int,
    call: Sequence[Entry],
    out: Any,
    live: dict[int, LiveRequest],
    totals: Totals,
    kpool: int,
) -> None:
    """Files one call's pools under their requests, noting duplicates.

    A pool id produced again replaces its row only if the earlier row held
    a rejected draft (counted as rewritten); a row of kept tokens produced
    twice is a problem.
    """
    try:
        rows = out.pools()
    except ValueError as err:
        totals.problems.append(f"call {c}: {err}")
        return
    for e, got in zip(call, rows, strict=True):
        state = live[e.request]
        writers = [row.writer for row in got.values()]
        totals.ring_close += writers.count(RING_CLOSE)
        totals.compress += writers.count(COMPRESS)
        earlier = {p: state.pools[p] for p in got if p in state.pools}
        rewritten, twice = keep_latest(
            state.pools, got, c, e.cache_length + e.accepted, kpool
        )
        totals.rewritten += rewritten
        for pool in twice:
            state.problems.append(
                f"request {e.request} (slot {e.slot}): pool {pool} came out "
                f"twice: {earlier[pool].writer} in call {earlier[pool].call}, "
                f"{got[pool].writer} in call {c}"
            )


def model_keys(runner: Runner, config: Config) -> list[ModelKey | IndexKey]:
    """The models :func:`serve` runs: the step, expand_topk, index_top_k.

    The fused step on a ``config.ring_len`` ring, expand_topk at
    ``config.pool_topk`` (both with uint32 index operands) and index_top_k
    (:func:`mla_kpool.demo.indexing.index_key`, on the runner's device).
    """
    return [
        model_key(
            "step",
            config.kpool,
            dtype=config.dtype,
            head_dim=config.head_dim,
            ring_len=config.ring_len,
        ),
        model_key(
            "expand_topk",
            config.kpool,
            dtype=np.int32,
            pool_topk=config.pool_topk,
        ),
        index_key(
            config.kpool,
            config.head_dim,
            config.pool_topk,
            config.index_mask,
            runner.device_name,
        ),
    ]


def compile_models(runner: Runner, config: Config) -> float:
    """Compiles (or loads from MAX's cache) the models :func:`serve` uses.

    The models of :func:`model_keys`, so that the first call is not charged
    with compiling. On the host devices the three compile as one graph
    (:meth:`Runner.compile_together`), so each op's call runs the other
    two on idle operands (:func:`idle_model_seconds`).

    Args:
        runner: Where the step, index_top_k and expand_topk run.
        config: The run's dtype, kpool, head_dim, ring, top-k and mask.

    Returns:
        The seconds it took.
    """
    start = time.perf_counter()
    runner.compile_together(model_keys(runner, config))
    return time.perf_counter() - start


def idle_model_seconds(
    runner: Runner, config: Config, runs: int = 5
) -> float | None:
    """Median seconds of the shared model with all three ops idle.

    Where :func:`compile_models` compiled the three ops as one model, each
    op's call (and its time in the summary) runs the other two on idle
    operands (no ring slots, tokens, requests or pages), which do nothing
    but still launch. This runs that model with all three ops idle, after
    one untimed run, so it bounds from above what the two idle ops add to
    an op's time.

    Args:
        runner: The runner :func:`compile_models` compiled on.
        config: The run's configuration.
        runs: Timed runs.

    Returns:
        The median of ``runs`` timed runs, or ``None`` where each op's
        model was compiled alone (a ``"gpu"`` runner), so that no call runs
        an idle op.
    """
    shared = runner.model(model_keys(runner, config)[0])
    if not isinstance(shared, SharedModel):
        return None
    shared.model.execute(*shared.idle)
    run = functools.partial(shared.model.execute, *shared.idle)
    return statistics.median(timeit.repeat(run, number=1, repeat=runs))


def graph_cache_files() -> int | None:
    """Files in MAX's cache of compiled graphs, ``None`` if it has no folder.

    MAX 26.7 writes each graph it compiles as one file under ``.max_cache``
    in the Modular cache folder: ``$MODULAR_CACHE_DIR`` if set, else
    ``$XDG_CACHE_HOME/modular``, else ``~/.cache/modular``. Counting them
    before and after :func:`compile_models` tells whether it compiled (the
    count grew) or loaded every model from the cache (it did not); another
    process compiling into the same cache at the same time would be
    counted too.
    """
    root = os.environ.get("MODULAR_CACHE_DIR") or Path(
        os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache", "modular"
    )
    folder = Path(root) / ".max_cache"
    if not folder.is_dir():
        return None
    return sum(1 for path in folder.rglob("*") if path.is_file())

"""``python -m mla_kpool demo``: a serving workload, checked pool by pool.

The demo plays a serving engine's indexer for a batch of requests: chunked
prefill and multi-token decode steps, batched under a token budget, with
requests joining as ring slots free up. Every call goes through the fused
step (:meth:`mla_kpool.runner.Runner.step`: one ``mla_kpool.step`` op that
closes, compresses and seeds on one persistent ring, the work of ring_close,
compress and seed_tail). Each request's keys and gates are drawn from a seed
of its own, so when a request finishes the NumPy oracle
(:func:`mla_kpool.reference.pool_sequence`) recomputes its whole sequence in
one shot and every pool the calls produced is checked against it: each pool
exactly once, none missing, none extra, each within the SPEC tolerance of
the key dtype, relative to the largest ``|k|`` among the pool's members.

After each call's step, the demo also reads the pools back the way the
indexer does: every query token of the call gets a seeded selection of up to
``--pool-topk`` ids among the pools complete and visible to it (``-1``
padding where fewer exist, and now and then an id the op must skip: the
pool still filling, one in the query's future, a negative one), one
``mo.mla.kpool.expand_topk`` call widens them into token positions, and
every row is compared with :func:`mla_kpool.reference.expand_topk`. One
compiled model serves every call (token and batch dims are dynamic).

Exit status: 0 when every check passes, 1 when one fails (the failures are
printed), 2 for a usage error such as a bad ``--schedule`` file.
``--inject-fault`` corrupts one ring member, one key or one selected pool id
behind the oracle's back, so a run that exits 0 with it would prove the
check blind.

``--spec-tokens N`` turns decode steps into speculative verify steps: each
brings the request's next token and ``N`` drafts (keys drawn apart from the
true ones), the target model keeps a seeded number of them, and the next
call resumes after the last token kept. A verify step may produce pools
with draft members; a later call produces those pool ids again from true
members, and the demo keeps, per pool id, the row of the latest call that
produced it, as a pipeline storing pool rows must. The ring is
``mla_kpool.ring_length(kpool, N + 1)`` entries deep so that drafts never
overwrite a member of a pool that must be redone. The check is then on the
final row of every pool id against the oracle of the accepted stream.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import ml_dtypes
import numpy as np
from tqdm import tqdm

from . import reference
from .ring import ring_length
from .runner import DEVICES
from .workload import (
    Entry,
    Plan,
    Request,
    ScheduleError,
    generate_requests,
    load_schedule,
    plan,
    schedule,
)

if TYPE_CHECKING:
    from .runner import Runner

#: Key dtypes by their command-line name.
DTYPES = {
    "float32": np.dtype(np.float32),
    "bfloat16": np.dtype(ml_dtypes.bfloat16),
    "float16": np.dtype(np.float16),
}

#: SPEC section 6: tolerance against the float64 oracle, relative to the
#: largest member magnitude of the pool (a pooled key is a convex
#: combination of its members, so that is the scale its rounding lives on).
TOLERANCE = {
    DTYPES["float32"]: 1e-5,
    DTYPES["float16"]: 2e-3,
    DTYPES["bfloat16"]: 1.6e-2,
}

#: GLM-5-Next indexer shapes, the default configuration.
DEFAULT_DTYPE = "bfloat16"
DEFAULT_KPOOL = 4
DEFAULT_HEAD_DIM = 128
DEFAULT_REQUESTS = 32
DEFAULT_MAX_RUNNING = 16

#: Gate scores spread this wide (standard deviations) so that pool members
#: get clearly different softmax weights and a wrong member shows.
GATE_SCALE = 3.0

#: Failures listed per request before the rest are only counted.
MAX_LISTED = 5

#: Pool ids an indexer query selects: GLM-5-Next's 512 (2051 positions per
#: row at kpool 4).
DEFAULT_POOL_TOPK = 512

#: Share of query rows whose selection gets one id that expand_topk must
#: skip (a pool not complete or not visible yet, or a negative id).
SKIPPED_ID_SHARE = 0.25

#: Fault kinds ``--inject-fault`` takes, the first the default.
FAULT_KINDS = ("ring", "key", "topk")


def plural(count: int, noun: str) -> str:
    """``count`` and ``noun``, with an ``s`` unless ``count`` is 1."""
    return f"{count} {noun}{'' if count == 1 else 's'}"


class DemoError(Exception):
    """A usage problem: bad option combination, no GPU, bad schedule."""


# --------------------------------------------------------------------------
# Command line
# --------------------------------------------------------------------------


def _int_at_least(minimum: int):
    """An argparse type: an integer no smaller than ``minimum``."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"must be an integer, got {text!r}"
            ) from None
        if value < minimum:
            raise argparse.ArgumentTypeError(
                f"must be >= {minimum}, got {value}"
            )
        return value

    return parse


_positive = _int_at_least(1)
_non_negative = _int_at_least(0)


DESCRIPTION = (
    "Run a seeded serving workload (chunked prefill, decode steps, requests "
    "joining and leaving) through the three k-pool writers, check every "
    "pool of every request against the float64 oracle, and expand a seeded "
    "top-k pool selection per query token with expand_topk, checking every "
    "row against the oracle."
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Adds the demo's options to ``parser``.

    Args:
        parser: The ``demo`` subcommand's parser (or a standalone one).
    """
    parser.add_argument(
        "--seed", type=_non_negative, default=0, help="workload seed (0)"
    )
    parser.add_argument(
        "--dtype",
        choices=list(DTYPES),
        help=f"key dtype ({DEFAULT_DTYPE})",
    )
    parser.add_argument(
        "--kpool", type=_positive, help=f"tokens per pool ({DEFAULT_KPOOL})"
    )
    parser.add_argument(
        "--head-dim",
        type=_positive,
        help=f"channels per key ({DEFAULT_HEAD_DIM})",
    )
    parser.add_argument(
        "--requests",
        type=_positive,
        help=f"requests to generate ({DEFAULT_REQUESTS}); not with --schedule",
    )
    parser.add_argument(
        "--device",
        choices=list(DEVICES),
        default="cpu",
        help=(
            "where the kernels run (cpu); gpu-emulated runs the GPU kernels"
            " on the host, thread by thread"
        ),
    )
    parser.add_argument(
        "--token-budget",
        type=_positive,
        default=2048,
        help="most tokens per call (2048)",
    )
    parser.add_argument(
        "--max-running",
        type=_positive,
        help=(
            "most requests in flight at once, which is the number of ring "
            f"slots ({DEFAULT_MAX_RUNNING})"
        ),
    )
    parser.add_argument(
        "--chunk",
        type=_positive,
        default=512,
        help="prefill chunk size (512)",
    )
    parser.add_argument(
        "--schedule",
        metavar="FILE",
        help="JSON workload: requests and, optionally, every call's batch",
    )
    parser.add_argument(
        "--pool-topk",
        type=_positive,
        default=DEFAULT_POOL_TOPK,
        help=(
            "pool ids each query token selects for expand_topk "
            f"({DEFAULT_POOL_TOPK})"
        ),
    )
    parser.add_argument(
        "--inject-fault",
        nargs="?",
        const=FAULT_KINDS[0],
        choices=FAULT_KINDS,
        help=(
            "corrupt one ring member (ring, the default), one key row (key) "
            "or one selected pool id sent to expand_topk (topk) that the "
            "kernels see but the oracle does not; the check must then fail"
        ),
    )
    parser.add_argument(
        "--spec-tokens",
        type=_positive,
        metavar="N",
        help=(
            "speculative decoding: every decode step verifies the next "
            "token and N drafts, keeps a seeded number of them, and the ring "
            "is ring_length(kpool, N + 1) deep; not with a schedule that "
            "lists its calls"
        ),
    )
    parser.add_argument(
        "--json", metavar="FILE", help="also write the summary as JSON"
    )
    parser.add_argument(
        "--no-progress",
        action="store_true",
        help="no progress bar (it is shown only when stderr is a terminal)",
    )


def main(
    argv: Sequence[str] | None = None, *, runner: Runner | None = None
) -> int:
    """Runs the demo with its own argument parser.

    Args:
        argv: The options (``sys.argv[1:]`` when ``None``).
        runner: A runner to reuse (tests share one so models compile once);
            a new one on ``--device`` when ``None``.

    Returns:
        The exit status: 0 all checks passed, 1 a check failed, 2 a usage
        error.
    """
    parser = argparse.ArgumentParser(
        prog="python -m mla_kpool demo", description=DESCRIPTION
    )
    add_arguments(parser)
    return run(parser.parse_args(argv), runner=runner)


# --------------------------------------------------------------------------
# Configuration and plan
# --------------------------------------------------------------------------


@dataclass(frozen=True)
class Config:
    """What one demo run does.

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
        pool_topk: Pool ids each query token selects for expand_topk.
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

    @property
    def ring_len(self) -> int:
        """Ring entries per slot: ``kpool``, deeper with speculation."""
        return ring_length(self.kpool, self.spec_tokens + 1)


def _pick(name: str, option: Any, in_file: Any, default: Any, path: Any) -> Any:
    """The command line's value, else the schedule file's, else the default."""
    if option is not None and in_file is not None and option != in_file:
        flag = "--" + name.replace("_", "-")
        raise DemoError(
            f"{flag} {option} disagrees with {path}, which has "
            f'"{name}": {json.dumps(in_file)}'
        )
    for value in (option, in_file):
        if value is not None:
            return value
    return default


def build_plan(args: argparse.Namespace) -> tuple[Config, Plan]:
    """Resolves the options (and the schedule file) into a config and plan.

    Args:
        args: Parsed options (see :func:`add_arguments`).

    Returns:
        ``(config, plan)``.

    Raises:
        DemoError: If options conflict or the schedule is bad.
    """
    loaded = None
    if args.schedule is not None:
        if args.requests is not None:
            raise DemoError(
                "--requests and --schedule exclude each other (the schedule "
                "lists its requests)"
            )
        try:
            loaded = load_schedule(args.schedule)
        except ScheduleError as err:
            raise DemoError(str(err)) from err

    def pick(name: str, default: Any) -> Any:
        in_file = getattr(loaded, name) if loaded else None
        return _pick(name, getattr(args, name), in_file, default, args.schedule)

    config = Config(
        dtype=DTYPES[pick("dtype", DEFAULT_DTYPE)],
        kpool=pick("kpool", DEFAULT_KPOOL),
        head_dim=pick("head_dim", DEFAULT_HEAD_DIM),
        device=args.device,
        seed=args.seed,
        token_budget=args.token_budget,
        max_running=pick("max_running", DEFAULT_MAX_RUNNING),
        chunk=args.chunk,
        schedule=args.schedule,
        spec_tokens=getattr(args, "spec_tokens", None) or 0,
        pool_topk=getattr(args, "pool_topk", None) or DEFAULT_POOL_TOPK,
    )
    if config.spec_tokens and loaded is not None and loaded.calls is not None:
        raise DemoError(
            f"--spec-tokens needs generated batching, but {args.schedule} "
            f'lists every call\'s tokens in "calls"'
        )
    rng = np.random.default_rng([config.seed, 0])
    if loaded is None:
        requests: Sequence[Request] = generate_requests(
            rng,
            args.requests or DEFAULT_REQUESTS,
            config.kpool,
            chunk=config.chunk,
        )
    else:
        requests = loaded.requests
    if loaded is not None and loaded.calls is not None:
        calls: Sequence[Sequence[tuple[int, ...]]] = loaded.calls
    else:
        calls = schedule(
            requests,
            rng,
            token_budget=config.token_budget,
            max_running=config.max_running,
            chunk=config.chunk,
            spec_tokens=config.spec_tokens,
        )
    try:
        return config, plan(requests, calls, config.max_running, rng)
    except ScheduleError as err:
        where = f"{args.schedule}: " if args.schedule else ""
        raise DemoError(f"{where}{err}") from err


# --------------------------------------------------------------------------
# Keys and faults
# --------------------------------------------------------------------------


def request_rows(
    seed: int, index: int, length: int, head_dim: int, dtype: np.dtype
) -> tuple[np.ndarray, np.ndarray]:
    """The keys and gates of request ``index``'s whole sequence.

    Drawn from a seed of their own, so the oracle can recompute them and a
    request's data does not depend on how it is batched.

    Returns:
        ``(k, gate)``, each ``[length, head_dim]`` in ``dtype``.
    """
    rng = np.random.default_rng([seed, 1, index])
    k = rng.standard_normal((length, head_dim)).astype(dtype)
    gate = GATE_SCALE * rng.standard_normal((length, head_dim))
    return k, gate.astype(dtype)


def draft_rows(
    seed: int,
    index: int,
    call: int,
    count: int,
    true_k: np.ndarray,
    dtype: np.dtype,
) -> tuple[np.ndarray, np.ndarray]:
    """Keys and gates of the drafts a verify step rejects.

    Args:
        seed: The run's seed.
        index: The request.
        call: The call (each verify step drafts afresh).
        count: Drafts rejected.
        true_k: ``[m, head_dim]`` true keys of the drafts' positions,
            ``m < count`` where the drafts run past the request's end.
        dtype: Key dtype.

    Returns:
        ``(k, gate)``, each ``[count, head_dim]``; no draft key equals the
        true key of its position (a key equal to the truth would be
        accepted).
    """
    rng = np.random.default_rng([seed, 3, index, call])
    head_dim = true_k.shape[1]
    k = rng.standard_normal((count, head_dim)).astype(dtype)
    gate = (GATE_SCALE * rng.standard_normal((count, head_dim))).astype(dtype)
    m = len(true_k)
    same = np.flatnonzero(np.all(k[:m] == true_k, axis=1))
    k[same] = (k[same].astype(np.float64) + 1.0).astype(dtype)
    return k, gate


def make_ape(seed: int, kpool: int, head_dim: int) -> np.ndarray:
    """The float32 within-pool position embedding ``[kpool, head_dim]``."""
    rng = np.random.default_rng([seed, 2])
    return rng.standard_normal((kpool, head_dim)).astype(np.float32)


@dataclass(frozen=True)
class Fault:
    """One deliberate corruption the oracle does not know about.

    Attributes:
        kind: ``"ring"``: a ring member's key is changed just before the
            call that closes its pool; ``"key"``: one row of ``k`` is
            changed in the call that brings it; ``"topk"``: one selected
            pool id of one query token is changed in the ``pool_ids`` sent
            to expand_topk.
        call: The call it happens in.
        entry: The request's batch position in that call.
        request: The request.
        position: The token position whose key is changed, or (``"topk"``)
            the position of the query whose selection is changed.
        pool: The pool that must then fail the check; for ``"topk"``, the
            token row (in the call) that must fail.
    """

    kind: str
    call: int
    entry: int
    request: int
    position: int
    pool: int

    def describe(self, slot: int) -> str:
        """A one-line account of the fault."""
        if self.kind == "topk":
            return (
                f"pool id selected by the query at position {self.position}"
                f" as sent to expand_topk, request {self.request}, call "
                f"{self.call}: token row {self.pool} must fail"
            )
        where = (
            f"ring member at position {self.position} (slot {slot}), read "
            f"by ring_close"
            if self.kind == "ring"
            else f"key row of position {self.position} as sent to the step"
        )
        return (
            f"{where}, request {self.request}, call {self.call}: pool "
            f"{self.pool} must fail"
        )

    def caught_by(self, problem: str) -> bool:
        """Whether a reported problem is the failure this fault must cause."""
        if not problem.startswith(f"request {self.request} "):
            return False
        if self.kind == "topk":
            return f"call {self.call}: expand_topk row {self.pool} " in problem
        return f"pool {self.pool} " in problem


def place_fault(plan_: Plan, kind: str, kpool: int) -> Fault | None:
    """Finds where to inject a fault that the check must see.

    Calls are searched from the middle of the run on, then from the start.

    Args:
        plan_: The run.
        kind: ``"ring"`` (a call where ring_close closes a pending pool),
            ``"key"`` (a call bringing a token of a complete pool) or
            ``"topk"`` (a call whose last token of a request sees at least
            two complete pools, so a selected id can be swapped for another
            valid one).
        kpool: Tokens per pool.

    Returns:
        The fault, or ``None`` if the run offers no such place.
    """
    count = len(plan_.calls)
    for c in [*range(count // 2, count), *range(count // 2)]:
        row = 0
        for b, e in enumerate(plan_.calls[c]):
            length = plan_.requests[e.request].length
            cl, n = e.cache_length, e.tokens
            row += n
            if kind == "ring":
                pending = cl // kpool
                if cl % kpool and cl + n >= (pending + 1) * kpool:
                    pos = pending * kpool
                    return Fault(kind, c, b, e.request, pos, pending)
            elif kind == "topk":
                if n and (cl + n) // kpool >= 2:
                    return Fault(kind, c, b, e.request, cl + n - 1, row - 1)
            elif n and cl < length // kpool * kpool:
                return Fault(kind, c, b, e.request, cl, cl // kpool)
    return None


# --------------------------------------------------------------------------
# Running and checking
# --------------------------------------------------------------------------


@dataclass(frozen=True)
class _Row:
    """The row kept for one pool id: the latest call's output.

    Attributes:
        key: The pooled key.
        call: The call that produced it.
        writer: ``"ring_close"`` or ``"compress"``.
        accepted: Whether every member was a kept token (not a rejected
            draft); only such a row is final.
    """

    key: np.ndarray
    call: int
    writer: str
    accepted: bool = True


@dataclass
class _Live:
    """What the demo tracks for a request in flight."""

    slot: int
    k: np.ndarray
    gate: np.ndarray
    #: pool id -> the row kept for it: the latest call that produced it
    pools: dict[int, _Row] = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)


@dataclass
class _Totals:
    ring_close: int = 0
    compress: int = 0
    max_abs_error: float = 0.0
    worst_ratio: float = 0.0
    checked_pools: int = 0
    rewritten: int = 0
    expand_rows: int = 0
    expand_checked: int = 0
    expand_mismatches: int = 0
    expand_skipped_ids: int = 0
    expand_seconds: list[float] = field(default_factory=list)
    dropped: int = 0
    problems: list[str] = field(default_factory=list)
    call_seconds: list[float] = field(default_factory=list)


def check_request(
    index: int,
    request: Request,
    live: _Live,
    ape: np.ndarray,
    kpool: int,
    tolerance: float,
) -> tuple[float, float, int, list[str]]:
    """Checks one finished request's pools against the one-shot oracle.

    The row checked for a pool id is the last one a call produced for it.
    Pool ids past the request's end whose row holds rejected drafts are
    dropped (a pipeline discards them with the request); a pool id of the
    request whose last row holds a rejected draft is a problem.

    Args:
        index: The request's number (for messages).
        request: The request.
        live: Its keys, gates and the pools the calls produced.
        ape: The position embedding.
        kpool: Tokens per pool.
        tolerance: Relative tolerance of the key dtype.

    Returns:
        ``(max_abs_error, worst error / allowed error, pools checked,
        problems)``; ``problems`` is empty when the request passed.
    """
    name = f"request {index} (slot {live.slot})"
    problems = list(live.problems)
    first = request.cached_prefix // kpool
    last = request.length // kpool  # exclusive
    expected = reference.pool_sequence(live.k, live.gate, ape, kpool)
    extra = sorted(
        p
        for p, row in live.pools.items()
        if not first <= p < last and (row.accepted or p < first)
    )
    missing = [p for p in range(first, last) if p not in live.pools]
    for p in extra:
        row = live.pools[p]
        problems.append(
            f"{name}: pool {p} from {row.writer} in call {row.call} does not "
            f"exist (the request owns pools {first}..{last - 1})"
        )
    for p in range(first, last):
        row = live.pools.get(p)
        if row is not None and not row.accepted:
            problems.append(
                f"{name}: pool {p}'s last row ({row.writer}, call "
                f"{row.call}) holds a rejected draft; no later call "
                f"produced it again"
            )
    if missing:
        shown = ", ".join(map(str, missing[:10]))
        more = f" and {len(missing) - 10} more" if len(missing) > 10 else ""
        problems.append(
            f"{name}: {plural(len(missing), 'pool')} never came out: "
            f"{shown}{more}"
        )
    ids = [p for p in range(first, last) if p in live.pools]
    if not ids:
        return 0.0, 0.0, 0, problems
    got = np.stack([live.pools[p].key for p in ids]).astype(np.float64)
    want = expected[ids]
    members = np.abs(live.k[: last * kpool].astype(np.float64))
    scale = members.reshape(last, kpool, -1).max(axis=(1, 2))[ids]
    allowed = tolerance * np.maximum(scale, np.finfo(np.float64).tiny)
    err = np.abs(got - want).max(axis=1)
    ratio = err / allowed
    bad = np.flatnonzero(~(err <= allowed))  # NaN counts as bad
    for j in bad[:MAX_LISTED]:
        p = ids[j]
        row = live.pools[p]
        problems.append(
            f"{name}: pool {p} (positions {p * kpool}..{(p + 1) * kpool - 1}"
            f", {row.writer}, call {row.call}) differs from the oracle: "
            f"max |err| {err[j]:.4g} > {allowed[j]:.4g} ({tolerance:g} x "
            f"max |k| {scale[j]:.4g})"
        )
    if len(bad) > MAX_LISTED:
        problems.append(
            f"{name}: {plural(len(bad) - MAX_LISTED, 'more pool')} differ"
            f"{'s' if len(bad) - MAX_LISTED == 1 else ''} from the oracle"
        )
    max_err = float(np.nanmax(err)) if not np.isnan(err).all() else np.nan
    worst = float(np.max(ratio)) if not np.isnan(ratio).any() else np.inf
    return max_err, worst, len(ids), problems


def select_pools(
    seed: int,
    call_index: int,
    call: Sequence[Entry],
    pool_topk: int,
    kpool: int,
) -> tuple[np.ndarray, int]:
    """A seeded indexer selection for every query token of one call.

    Token row ``t`` is the query at position ``c + local`` of its request
    (``c`` the entry's cache length), which sees ``visible = c + local + 1``
    positions and so ``visible // kpool`` complete pools. Its row holds
    ``min(pool_topk, complete)`` distinct complete pool ids in a random
    order, then ``-1``. In about :data:`SKIPPED_ID_SHARE` of the rows one
    column (at random) is then replaced by an id the op must skip: the
    pool still filling, a pool in the query's future (up to ``2^31 - 1``)
    or a negative id other than ``-1``.

    Args:
        seed: The run's seed.
        call_index: The call (each call draws afresh).
        call: The call's entries, in batch order.
        pool_topk: Columns per row.
        kpool: Tokens per pool.

    Returns:
        ``(pool_ids, skipped)``: int32 ``[tokens, pool_topk]`` and how many
        ids other than ``-1`` padding the op must skip.
    """
    rng = np.random.default_rng([seed, 4, call_index])
    total = sum(e.tokens for e in call)
    ids = np.full((total, pool_topk), -1, dtype=np.int32)
    skipped = 0
    t = 0
    for e in call:
        for local in range(e.tokens):
            complete = (e.cache_length + local + 1) // kpool
            m = min(pool_topk, complete)
            ids[t, :m] = rng.choice(complete, m, replace=False)
            if rng.random() < SKIPPED_ID_SHARE:
                kind = rng.integers(3)
                if kind == 0:
                    bad = complete
                elif kind == 1:
                    bad = rng.integers(complete + 1, 2**31, endpoint=False)
                else:
                    bad = -rng.integers(2, 2**31, endpoint=True)
                ids[t, rng.integers(pool_topk)] = bad
                skipped += 1
            t += 1
    return ids, skipped


def _corrupt_selection(ids: np.ndarray, row: int, complete: int) -> None:
    """Changes one id of ``ids[row]`` so that the row's expansion differs.

    The first valid id is swapped for another complete pool; a row with no
    valid id gets pool 0 in its first column.
    """
    valid = np.flatnonzero((ids[row] >= 0) & (ids[row] < complete))
    if len(valid):
        j = int(valid[0])
        ids[row, j] = (int(ids[row, j]) + 1) % complete
    else:
        ids[row, 0] = 0


def check_expansion(
    c: int,
    call: Sequence[Entry],
    got: np.ndarray,
    want: np.ndarray,
) -> tuple[int, list[str]]:
    """Compares one call's expand_topk rows with the oracle's.

    Args:
        c: The call's number (for messages).
        call: Its entries, in batch order (token rows follow them).
        got: ``[tokens, width]`` int32 rows from the op.
        want: ``[tokens, width]`` int32 rows from
            :func:`mla_kpool.reference.expand_topk`.

    Returns:
        ``(rows that differ, problems)``; a row is named by its request,
        slot, call, token row and query position.
    """
    if got.shape != want.shape:
        return len(want), [
            f"call {c}: expand_topk gave shape {got.shape}, the oracle "
            f"{want.shape}"
        ]
    bad = np.flatnonzero((got != want).any(axis=1))
    owner = np.repeat(np.arange(len(call)), [e.tokens for e in call])
    starts = np.cumsum([0] + [e.tokens for e in call])
    problems = []
    for t in bad[:MAX_LISTED]:
        e = call[owner[t]]
        position = e.cache_length + int(t - starts[owner[t]])
        col = int(np.flatnonzero(got[t] != want[t])[0])
        problems.append(
            f"request {e.request} (slot {e.slot}): call {c}: expand_topk "
            f"row {t} (query position {position}) differs from the oracle "
            f"at column {col}: got {int(got[t, col])}, want "
            f"{int(want[t, col])}"
        )
    if len(bad) > MAX_LISTED:
        problems.append(
            f"call {c}: "
            f"{plural(len(bad) - MAX_LISTED, 'more expand_topk row')} differ"
            f"{'s' if len(bad) - MAX_LISTED == 1 else ''} from the oracle"
        )
    return len(bad), problems


def _restore_ring(
    runner: Runner,
    ring: Any,
    restores: list[tuple[Entry, _Live]],
    fault: tuple[int, int, float] | None,
    kpool: int,
) -> Any:
    """Writes cached-prefix members (and a ring fault) into the ring.

    A prefix cache keeps the complete pools of a prefix, but the members
    of a partial last pool live only in the ring, so an engine admitting a
    request whose cached prefix ends mid-pool must put them back into the
    request's new slot, member ``pos`` at ring index ``pos % R``. The demo
    does it host-side: read, patch, upload.
    """
    host = runner.read(ring)
    ring_len = host.shape[2]
    for e, live in restores:
        for pos in range(
            e.cache_length - e.cache_length % kpool, e.cache_length
        ):
            host[e.slot, 0, pos % ring_len] = live.k[pos]
            host[e.slot, 1, pos % ring_len] = live.gate[pos]
    if fault is not None:
        slot, pos, delta = fault
        member = host[slot, 0, pos % ring_len].astype(np.float64)
        host[slot, 0, pos % ring_len] = (member + delta).astype(host.dtype)
    return runner.to_device(host)


def execute(
    config: Config,
    plan_: Plan,
    runner: Runner,
    fault: Fault | None,
    progress: tqdm,
) -> _Totals:
    """Runs every call of the plan through the step and checks each request.

    Args:
        config: The run's configuration.
        plan_: The calls.
        runner: Where the step runs.
        fault: A fault to inject, or ``None``.
        progress: Progress display.

    Returns:
        Counts, errors, timings and problems.
    """
    kpool, head_dim, dtype = config.kpool, config.head_dim, config.dtype
    ape = make_ape(config.seed, kpool, head_dim)
    tolerance = TOLERANCE[dtype]
    ring = runner.new_ring(plan_.max_slots, config.ring_len, head_dim, dtype)
    live: dict[int, _Live] = {}
    totals = _Totals()
    finished = 0
    for c, call in enumerate(plan_.calls):
        for e in call:
            if e.admitted:
                length = plan_.requests[e.request].length
                k, gate = request_rows(
                    config.seed, e.request, length, head_dim, dtype
                )
                live[e.request] = _Live(e.slot, k, gate)
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
            ring_fault = (call[here.entry].slot, here.position, delta)
        if restores or ring_fault:
            ring = _restore_ring(runner, ring, restores, ring_fault, kpool)

        k_parts, gate_parts = [], []
        for e in call:
            state = live[e.request]
            kept = slice(e.cache_length, e.cache_length + e.accepted)
            k_parts.append(state.k[kept])
            gate_parts.append(state.gate[kept])
            if e.rejected:
                drafted = slice(kept.stop, kept.stop + e.rejected)
                dk, dg = draft_rows(
                    config.seed,
                    e.request,
                    c,
                    e.rejected,
                    state.k[drafted],
                    dtype,
                )
                k_parts.append(dk)
                gate_parts.append(dg)
        k = np.concatenate(k_parts)
        gate = np.concatenate(gate_parts)
        offsets = np.zeros(len(call) + 1, np.uint32)
        offsets[1:] = np.cumsum([e.tokens for e in call])
        if here is not None and here.kind == "key":
            row = int(offsets[here.entry])
            k[row] = (k[row].astype(np.float64) + delta).astype(dtype)
        cache = np.array([e.cache_length for e in call], np.uint32)
        slots = np.array([e.slot for e in call], np.uint32)

        start = time.perf_counter()
        out = runner.step(ring, k, gate, ape, offsets, cache, slots, kpool)
        totals.call_seconds.append(time.perf_counter() - start)

        _collect(c, call, out, live, totals, kpool)
        _expand_and_check(config, c, call, runner, here, totals)
        for e in call:
            if not e.finished:
                continue
            state = live.pop(e.request)
            err, ratio, checked, problems = check_request(
                e.request,
                plan_.requests[e.request],
                state,
                ape,
                kpool,
                tolerance,
            )
            totals.max_abs_error = max(totals.max_abs_error, err)
            totals.worst_ratio = max(totals.worst_ratio, ratio)
            totals.checked_pools += checked
            totals.dropped += sum(
                1
                for p in state.pools
                if p >= plan_.requests[e.request].length // kpool
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


def _expand_and_check(
    config: Config,
    c: int,
    call: Sequence[Entry],
    runner: Runner,
    fault: Fault | None,
    totals: _Totals,
) -> None:
    """Expands a seeded selection for the call's queries and checks it.

    The kernel gets the selection (with the ``"topk"`` fault applied, if
    it is this call's); the oracle gets the selection as drawn.
    """
    ids, skipped = select_pools(
        config.seed, c, call, config.pool_topk, config.kpool
    )
    sent = ids
    if fault is not None and fault.kind == "topk":
        sent = ids.copy()
        _corrupt_selection(
            sent, fault.pool, (fault.position + 1) // config.kpool
        )
    offsets = np.zeros(len(call) + 1, np.uint32)
    offsets[1:] = np.cumsum([e.tokens for e in call])
    cache = np.array([e.cache_length for e in call], np.uint32)
    start = time.perf_counter()
    got = runner.expand_topk(sent, offsets, cache, config.kpool)
    totals.expand_seconds.append(time.perf_counter() - start)
    want = reference.expand_topk(ids, offsets, cache, config.kpool)
    mismatches, problems = check_expansion(c, call, got, want)
    totals.expand_rows += len(ids)
    totals.expand_checked += len(want) if got.shape == want.shape else 0
    totals.expand_mismatches += mismatches
    totals.expand_skipped_ids += skipped
    totals.problems += problems


def _collect(
    c: int,
    call: Sequence[Entry],
    out: Any,
    live: dict[int, _Live],
    totals: _Totals,
    kpool: int,
) -> None:
    """Files one call's pools under their requests, noting duplicates.

    A pool id produced again replaces its row only if the earlier row held
    a rejected draft (counted as rewritten); a row of kept tokens produced
    twice is a problem.
    """
    closed = out.ring_closed_pool
    offsets = [int(o) for o in out.pool_row_offsets]
    rows = out.pooled.shape[0]
    for b, e in enumerate(call):
        state = live[e.request]
        name = f"request {e.request} (slot {e.slot})"
        produced: list[tuple[int, np.ndarray, str]] = []
        if int(closed[b]) >= 0:
            produced.append((int(closed[b]), out.ring_pooled[b], "ring_close"))
            totals.ring_close += 1
        lo, hi = offsets[b], offsets[b + 1]
        if not 0 <= lo <= hi <= rows:
            state.problems.append(
                f"{name}: call {c}: pool_row_offsets[{b}:{b + 2}] = "
                f"[{lo}, {hi}] is outside the {rows} output rows"
            )
            continue
        first = int(out.first_pool[b])
        for j in range(hi - lo):
            produced.append((first + j, out.pooled[lo + j], "compress"))
        totals.compress += hi - lo
        kept_end = e.cache_length + e.accepted
        for pool, key, writer in produced:
            before = state.pools.get(pool)
            if before is not None and before.accepted:
                state.problems.append(
                    f"{name}: pool {pool} came out twice: {before.writer} in "
                    f"call {before.call}, {writer} in call {c}"
                )
                continue
            totals.rewritten += before is not None
            accepted = (pool + 1) * kpool <= kept_end
            state.pools[pool] = _Row(key, c, writer, accepted)


# --------------------------------------------------------------------------
# Summary
# --------------------------------------------------------------------------


def summarize(
    config: Config,
    plan_: Plan,
    totals: _Totals,
    compile_s: float,
    wall_s: float,
    fault: str | None,
) -> dict[str, Any]:
    """The run's numbers, as written by ``--json``."""
    reqs = plan_.requests
    prefill = decode = 0
    for call in plan_.calls:
        for e in call:
            prompt = reqs[e.request].prompt
            end = e.cache_length + e.accepted
            prefill += max(0, min(end, prompt) - e.cache_length)
            decode += max(0, end - max(e.cache_length, prompt))
    tokens = prefill + decode
    step_s = sum(totals.call_seconds)
    calls = len(plan_.calls)
    summary = {
        "ok": not totals.problems,
        "config": {
            "dtype": config.dtype.name,
            "kpool": config.kpool,
            "head_dim": config.head_dim,
            "device": config.device,
            "seed": config.seed,
            "token_budget": None if config.schedule else config.token_budget,
            "max_running": config.max_running,
            "chunk": None if config.schedule else config.chunk,
            "schedule": config.schedule,
            "pool_topk": config.pool_topk,
        },
        "requests": len(reqs),
        "requests_with_cached_prefix": sum(r.cached_prefix > 0 for r in reqs),
        "tokens": tokens,
        "prefill_tokens": prefill,
        "decode_tokens": decode,
        "cached_prefix_tokens": sum(r.cached_prefix for r in reqs),
        "calls": calls,
        "max_batch": max(len(call) for call in plan_.calls),
        "max_call_tokens": max(
            sum(e.tokens for e in call) for call in plan_.calls
        ),
        "slot_reuses": plan_.slot_reuses,
        "pools": totals.ring_close + totals.compress,
        "pools_expected": sum(
            r.length // config.kpool - r.cached_prefix // config.kpool
            for r in reqs
        ),
        "pools_ring_close": totals.ring_close,
        "pools_compress": totals.compress,
        "pools_checked": totals.checked_pools,
        "max_abs_error": totals.max_abs_error,
        "max_error_over_tolerance": totals.worst_ratio,
        "tolerance": TOLERANCE[config.dtype],
        "expand_topk": {
            "rows_expanded": totals.expand_rows,
            "rows_checked": totals.expand_checked,
            "mismatches": totals.expand_mismatches,
            "skipped_ids": totals.expand_skipped_ids,
            "mean_call_seconds": (
                statistics.fmean(totals.expand_seconds)
                if totals.expand_seconds
                else None
            ),
        },
        "mean_call_seconds": step_s / calls,
        "median_call_seconds": statistics.median(totals.call_seconds),
        "tokens_per_second": tokens / step_s if step_s > 0 else None,
        "compile_seconds": compile_s,
        "wall_seconds": wall_s,
        "fault": fault,
        "problems": totals.problems,
    }
    if config.spec_tokens:
        verify = [
            e
            for call in plan_.calls
            for e in call
            if e.cache_length >= reqs[e.request].prompt
        ]
        drafts = sum(e.tokens - 1 for e in verify)
        accepted = sum(e.accepted - 1 for e in verify)
        summary["speculative"] = {
            "spec_tokens": config.spec_tokens,
            "ring_len": config.ring_len,
            "verify_steps": len(verify),
            "draft_tokens": drafts,
            "accepted_drafts": accepted,
            "rejected_drafts": drafts - accepted,
            "verify_steps_all_rejected": sum(
                e.accepted == 1 < e.tokens for e in verify
            ),
            "verify_steps_all_accepted": sum(
                e.accepted == e.tokens > 1 for e in verify
            ),
            "pools_rewritten": totals.rewritten,
            "pools_dropped": totals.dropped,
        }
    return summary


def format_summary(s: dict[str, Any]) -> str:
    """The summary table the demo prints."""
    cfg = s["config"]
    head = (
        f"mla-kpool demo: {cfg['dtype']}, kpool {cfg['kpool']}, head_dim "
        f"{cfg['head_dim']}, {cfg['device']}, seed {cfg['seed']}"
    )
    if cfg["schedule"]:
        head += f", schedule {cfg['schedule']}"
    spec = s.get("speculative")
    if spec:
        head += (
            f", {spec['spec_tokens']} speculative tokens, ring "
            f"{spec['ring_len']}"
        )
    batching = (
        f"token budget {cfg['token_budget']}, chunk {cfg['chunk']}, "
        if cfg["token_budget"]
        else ""
    )
    tps = s["tokens_per_second"]
    rows = [
        (
            "requests",
            f"{s['requests']}",
            f"{s['requests_with_cached_prefix']} with a cached prefix, "
            f"{plural(cfg['max_running'], 'ring slot')}, "
            f"{plural(s['slot_reuses'], 'slot reuse')}",
        ),
        (
            "tokens",
            f"{s['tokens']}",
            f"prefill {s['prefill_tokens']}, decode {s['decode_tokens']}; "
            f"cached prefix {s['cached_prefix_tokens']} not sent",
        ),
        (
            "calls",
            f"{s['calls']}",
            f"{batching}max batch {s['max_batch']}, max tokens "
            f"{s['max_call_tokens']}",
        ),
        (
            "pools",
            f"{s['pools']}",
            f"expected {s['pools_expected']}, checked {s['pools_checked']}",
        ),
        ("  closed by ring_close", f"{s['pools_ring_close']}", ""),
        ("  built by compress", f"{s['pools_compress']}", ""),
    ]
    if spec:
        rows[3] = (
            "pools",
            f"{s['pools']}",
            f"rows written; expected {s['pools_expected']} pool ids, final "
            f"rows checked {s['pools_checked']}",
        )
        rows.insert(
            3,
            (
                "verify steps",
                f"{spec['verify_steps']}",
                f"{spec['draft_tokens']} drafts, {spec['accepted_drafts']} "
                f"accepted; {spec['verify_steps_all_rejected']} kept no "
                f"draft, {spec['verify_steps_all_accepted']} kept all",
            ),
        )
        rows += [
            (
                "  rewritten after a rejection",
                f"{spec['pools_rewritten']}",
                "a later call produced the pool id again; that row is kept",
            ),
            (
                "  dropped",
                f"{spec['pools_dropped']}",
                "pools of drafts past the request's end",
            ),
        ]
    ex = s["expand_topk"]
    rows += [
        (
            "expand_topk rows",
            f"{ex['rows_expanded']}",
            f"checked {ex['rows_checked']}, {ex['mismatches']} "
            f"differ{'s' if ex['mismatches'] == 1 else ''} from "
            f"the oracle; top {cfg['pool_topk']} pool ids per query, "
            f"{ex['skipped_ids']} ids the op must skip",
        ),
    ]
    rows += [
        (
            "max abs error vs oracle",
            f"{s['max_abs_error']:.3g}",
            f"worst pool at {s['max_error_over_tolerance']:.3g} of its "
            f"tolerance ({s['tolerance']:g} x max |k|)",
        ),
        (
            "mean time per call",
            f"{1e3 * s['mean_call_seconds']:.3f} ms",
            f"median {1e3 * s['median_call_seconds']:.3f} ms",
        ),
        (
            "tokens per second",
            f"{tps:,.0f}" if tps else "-",
            "tokens / time in Runner.step (copies in and out included)",
        ),
        (
            "compile",
            f"{s['compile_seconds']:.1f} s",
            "step and expand_topk models, once each",
        ),
        ("wall time", f"{s['wall_seconds']:.1f} s", "everything"),
    ]
    width = max(len(r[0]) for r in rows)
    value = max(len(r[1]) for r in rows)
    lines = [head, "-" * len(head)]
    for label, val, note in rows:
        note = f"  ({note})" if note else ""
        lines.append(f"{label:<{width}}  {val:>{value}}{note}")
    lines.append("-" * len(head))
    if s["ok"] and spec:
        lines.append(
            "result: OK, the last row of every pool id of every request "
            "holds kept tokens only and matches the oracle of the accepted "
            "stream; every expand_topk row matches the oracle"
        )
    elif s["ok"]:
        lines.append(
            "result: OK, every pool of every request came out exactly once "
            "and matches the oracle; every expand_topk row matches the oracle"
        )
    else:
        lines.append(
            f"result: FAILED, {plural(len(s['problems']), 'problem')} (above)"
        )
    return "\n".join(lines)


# --------------------------------------------------------------------------
# Entry point
# --------------------------------------------------------------------------


def run(args: argparse.Namespace, *, runner: Runner | None = None) -> int:
    """Runs the demo for parsed options.

    Args:
        args: Options from :func:`add_arguments`.
        runner: A runner to reuse; a new one on ``args.device`` when
            ``None``. Its device must match ``args.device``.

    Returns:
        The exit status: 0 all checks passed, 1 a check failed, 2 a usage
        error (printed to stderr).
    """
    started = time.perf_counter()
    out, err = sys.stdout, sys.stderr
    try:
        config, plan_ = build_plan(args)
        fault = None
        if args.inject_fault:
            fault = place_fault(plan_, args.inject_fault, config.kpool)
            if fault is None:
                raise DemoError(
                    f"--inject-fault {args.inject_fault}: no call in this "
                    f"workload offers a place for it"
                )
        runner = _get_runner(config.device, runner)
    except DemoError as e:
        print(f"mla-kpool demo: error: {e}", file=err)
        return 2

    from max.dtype import DType

    from .buffers import to_max_dtype
    from .runner import ModelKey

    ring = f", ring {config.ring_len}" if config.spec_tokens else ""
    print(
        f"compiling the step model ({config.dtype.name}, kpool "
        f"{config.kpool}, head_dim {config.head_dim}{ring}) and the "
        f"expand_topk model (top {config.pool_topk}) on {config.device}...",
        file=err,
        flush=True,
    )
    t0 = time.perf_counter()
    runner.model(
        ModelKey(
            kind="step",
            dtype=to_max_dtype(config.dtype),
            kpool=config.kpool,
            head_dim=config.head_dim,
            ring_len=config.ring_len,
            index_dtypes=(DType.uint32,) * 3,
        )
    )
    runner.model(
        ModelKey(
            kind="expand_topk",
            dtype=DType.int32,
            kpool=config.kpool,
            head_dim=0,
            ring_len=0,
            index_dtypes=(DType.uint32,) * 2,
            pool_topk=config.pool_topk,
            always_select_tail=True,
        )
    )
    compile_s = time.perf_counter() - t0

    described = None
    if fault is not None:
        slot = plan_.calls[fault.call][fault.entry].slot
        described = fault.describe(slot)
        print(f"injecting a fault: {described}", file=err)
    progress = tqdm(
        total=len(plan_.calls),
        desc="demo",
        unit="call",
        file=err,
        disable=args.no_progress or not err.isatty(),
    )
    totals = execute(config, plan_, runner, fault, progress)
    summary = summarize(
        config,
        plan_,
        totals,
        compile_s,
        time.perf_counter() - started,
        described,
    )
    for problem in totals.problems:
        print(f"FAIL {problem}", file=out)
    print(format_summary(summary), file=out)
    if fault is not None:
        caught = any(fault.caught_by(p) for p in totals.problems)
        print(
            f"injected fault {'caught' if caught else 'NOT caught'}: "
            f"{described}",
            file=out,
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(summary, f, indent=2)
            f.write("\n")
    return 0 if summary["ok"] else 1


def _get_runner(device: str, runner: Runner | None) -> Runner:
    if runner is not None:
        if runner.device_name != device:
            raise DemoError(
                f"the runner given is on {runner.device_name}, not {device}"
            )
        return runner
    from max import driver

    from .runner import Runner

    if device == "gpu" and driver.accelerator_count() == 0:
        raise DemoError("--device gpu: no accelerator found (try --device cpu)")
    return Runner(device)

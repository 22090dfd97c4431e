"""``python -m mla_kpool bench``: per-call time of each writer, with its floors.

For every configuration (op, dtype, batch, kpool, head_dim, device) one run
measures, on the same inputs:

- ``median_us`` (and ``p10_us``/``p90_us``): the op's per-call time through
  MAX after warm-up (``Model.execute`` on operands already on the device);
- ``bytes``: what the op must read plus write (see :func:`op_bytes`), and
  ``gbps = bytes / median``;
- ``numpy_median_us``: a vectorized NumPy twin of the op (float32 math);
- ``floor_median_us``: the same graph with no-op kernels of the same names
  and signatures (``mla_kpool/bench_noop``): MAX's own per-call cost;
- ``memcpy_gbps``: ``np.copyto`` of a float32 buffer of ``bytes / 2``
  bytes, counted as read plus write, the machine's copy bandwidth;
- on a GPU, ``builtin_median_us``: MAX's own GPU builtins on the same graph.

Workloads (per request, ``r = kpool // 2``): ``ring_close`` closes one pool
with ``r`` members in the ring and ``kpool - r`` new tokens; ``compress``
builds one pool from ``kpool`` new tokens; ``seed_tail`` stashes
``kpool - 1`` new tokens; ``step`` brings ``2 * kpool`` tokens to a request
with ``r`` pending (ring_close closes one pool, compress builds one, seed_tail
stashes ``r`` tokens); ``expand_topk`` expands one query token per request
(a decode step, so ``batch`` is the row count) that selected
:func:`expand_pool_topk` distinct complete pools (512 at kpool 4, GLM-5-Next's
shape: about 2048 positions a row at every kpool), with the ``r + 1``
positions of the pool still filling appended. Its ``dtype`` is that of
``pool_ids``, int32; it reads no keys.

Every ``--json`` record also says where it was measured (MAX and Mojo
versions, CPU model and cores, device name, git commit, command line).
``--markdown FILE`` prints docs/performance.md's table from such a file and
``--plot IMAGE`` draws GB/s against batch per op with the memcpy line
(matplotlib, an optional dependency); neither needs a compile when it reads
a file.

The step has two paths, each its own ``op`` in the records: ``step`` is the
fused ``mla_kpool.step`` op (``kpool_step()``, one op per call) and
``step3`` the three writers plus the offsets helper
(``kpool_step(fused=False)``). Same workload, same ``bytes``; each is timed
against its own floor (one no-op op for ``step``; three no-op ops and the
helper's MAX ops for ``step3``). MAX has no builtin of the fused op, so
``builtin_median_us`` is only measured for ``step3``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
from max.dtype import DType
from tqdm import tqdm

from . import runner as kpool_runner
from ._argtypes import int_at_least, non_negative_float
from ._paths import NOOP_KERNELS
from ._sysinfo import run_info
from .buffers import to_numpy_dtype
from .runner import Runner

DESCRIPTION = (
    "Time ring_close, compress, seed_tail, the step (fused, or step3:"
    " the three ops) and expand_topk against MAX's no-op floor, a NumPy twin"
    " and memcpy bandwidth."
)

OPS = ("ring_close", "compress", "seed_tail", "step", "step3", "expand_topk")
#: Ops that MAX also ships as GPU builtins (the fused step is ours only).
BUILTIN_OPS = ("ring_close", "compress", "seed_tail", "step3", "expand_topk")
#: The dtype of an expand_topk case: that of ``pool_ids`` (MAX's int32).
EXPAND_DTYPE = "int32"
#: Positions an expand_topk row selects: GLM-5-Next's 512 pools of 4.
EXPAND_POSITIONS = 2048
BATCHES = (1, 64, 512, 4096)
KPOOLS = (4, 16, 128)
DTYPES = ("float32", "bfloat16")
HEAD_DIM = 128


@dataclass(frozen=True)
class Case:
    """One benchmark configuration."""

    op: str
    dtype: str
    batch: int
    kpool: int
    head_dim: int
    device: str


@dataclass
class Workload:
    """One call's inputs (NumPy) for a :class:`Case`."""

    ring: np.ndarray
    k: np.ndarray
    gate: np.ndarray
    ape: np.ndarray
    input_row_offsets: np.ndarray
    cache_lengths: np.ndarray
    slot_idx: np.ndarray
    pool_row_offsets: np.ndarray
    pool_ids: np.ndarray | None = None


def expand_pool_topk(kpool: int) -> int:
    """Pool ids an expand_topk query selects: ``2048 // kpool``, at least 1."""
    return max(1, EXPAND_POSITIONS // kpool)


def _tokens_per_request(op: str, kpool: int) -> tuple[int, int]:
    """``(pending ring members r, new tokens n)`` per request for ``op``."""
    r = kpool // 2
    if op == "expand_topk":
        return r, 1
    if op == "ring_close":
        return r, kpool - r
    if op == "compress":
        return 0, kpool
    if op == "seed_tail":
        return 0, kpool - 1
    return r, 2 * kpool


def make_workload(case: Case, seed: int = 0) -> Workload:
    """Builds the inputs of one call of ``case`` (see the module docstring).

    Requests sit at pool ids 1000 + b (expand_topk: at least its top-k
    count + b, so every query has that many complete pools to choose
    from) and use a shuffled slot each, so slots are not the batch index.
    """
    rng = np.random.default_rng(seed)
    dtype = to_numpy_dtype_name(case.dtype)
    r, n = _tokens_per_request(case.op, case.kpool)
    batch, kpool, hd = case.batch, case.kpool, case.head_dim
    tokens = batch * n
    base = 1000
    if case.op == "expand_topk":
        base = max(base, expand_pool_topk(kpool))
    cache = (base + np.arange(batch, dtype=np.int64)) * kpool + r
    offsets = np.arange(batch + 1, dtype=np.int64) * n
    first = -(-cache // kpool)
    counts = np.maximum((cache + n) // kpool - first, 0)
    if case.op == "expand_topk":
        # Each query sees at least `base` complete pools; it selects
        # distinct ones in a random order (as an indexer's top-k comes out).
        topk = expand_pool_topk(kpool)
        keys = rng.random((tokens, base))
        ids = np.argpartition(keys, topk - 1, axis=1)[:, :topk]
        ids = rng.permuted(ids, axis=1)
        none = np.zeros((0, hd), dtype)
        return Workload(
            ring=np.zeros((0, 2, kpool, hd), dtype),
            k=none,
            gate=none,
            ape=np.zeros((kpool, hd), np.float32),
            input_row_offsets=offsets.astype(np.uint32),
            cache_lengths=cache.astype(np.uint32),
            slot_idx=np.arange(batch, dtype=np.uint32),
            pool_row_offsets=np.zeros(batch + 1, np.uint32),
            pool_ids=ids.astype(np.int32),
        )
    return Workload(
        ring=rng.standard_normal((batch, 2, kpool, hd)).astype(dtype),
        k=rng.standard_normal((tokens, hd)).astype(dtype),
        gate=(4 * rng.standard_normal((tokens, hd))).astype(dtype),
        ape=rng.standard_normal((kpool, hd)).astype(np.float32),
        input_row_offsets=offsets.astype(np.uint32),
        cache_lengths=cache.astype(np.uint32),
        slot_idx=rng.permutation(batch).astype(np.uint32),
        pool_row_offsets=np.concatenate([[0], np.cumsum(counts)]).astype(
            np.uint32
        ),
    )


def to_numpy_dtype_name(name: str) -> np.dtype:
    """NumPy dtype (``ml_dtypes.bfloat16`` included) for a dtype name."""
    return to_numpy_dtype(getattr(DType, name))


def op_bytes(case: Case) -> int:
    """Bytes ``case.op`` must read plus write for its workload.

    Ring members read, rows of ``k`` and ``gate`` read, ``ape``, the pooled
    rows and ``closed_pool`` written (``compress`` writes every output row:
    rows past the last pool are zeroed), ring rows written by ``seed_tail``;
    for ``expand_topk`` the ``pool_ids`` read and every output column
    written. Index operands are left out (a few bytes per request).
    """
    es = to_numpy_dtype_name(case.dtype).itemsize
    batch, kpool, hd = case.batch, case.kpool, case.head_dim
    row = hd * es
    ape = kpool * hd * 4
    r, n = _tokens_per_request(case.op, kpool)
    if case.op == "expand_topk":
        # int32 pool ids read, int32 positions written (the full row,
        # -1 padding included), per query.
        topk = expand_pool_topk(kpool)
        return batch * n * 4 * (topk + topk * kpool + kpool - 1)
    if case.op == "ring_close":
        return batch * (2 * r * row + 2 * n * row + row + 4) + ape
    if case.op == "compress":
        return batch * (2 * n * row + row) + ape
    if case.op == "seed_tail":
        return batch * (2 * n * row) * 2
    out_rows = (batch * n) // kpool
    close = batch * (2 * r * row + 2 * (kpool - r) * row + row + 4)
    build = batch * 2 * kpool * row + out_rows * row
    stash = batch * 2 * r * row * 2
    return close + build + stash + ape


# -- vectorized NumPy twin --------------------------------------------------


def _pool_np(
    keys: np.ndarray, gates: np.ndarray, ape: np.ndarray
) -> np.ndarray:
    """Pools ``[pools, kpool, head_dim]`` members in float32."""
    score = gates.astype(np.float32) + ape
    score -= score.max(axis=1, keepdims=True)
    weight = np.exp(score)
    total = weight.sum(axis=1)
    return (weight * keys.astype(np.float32)).sum(axis=1) / total


def numpy_ring_close(w: Workload, kpool: int) -> tuple[np.ndarray, np.ndarray]:
    """Vectorized ring_close (float32), valid metadata assumed."""
    batch, hd = w.cache_lengths.shape[0], w.k.shape[1]
    c = w.cache_lengths.astype(np.int64)
    start = w.input_row_offsets[:-1].astype(np.int64)
    n = w.input_row_offsets[1:].astype(np.int64) - start
    r, p = c % kpool, c // kpool
    closes = (r > 0) & (c + n >= (p + 1) * kpool)
    q = np.arange(kpool)
    from_ring = q[None, :] < r[:, None]
    ring_len = w.ring.shape[2]
    ring_idx = (p[:, None] * kpool + q[None, :]) % ring_len
    rows = np.clip(start[:, None] + q[None, :] - r[:, None], 0, len(w.k) - 1)
    slot = w.slot_idx.astype(np.int64)[:, None]
    keys = np.where(from_ring[..., None], w.ring[slot, 0, ring_idx], w.k[rows])
    gates = np.where(
        from_ring[..., None], w.ring[slot, 1, ring_idx], w.gate[rows]
    )
    pooled = _pool_np(keys, gates, w.ape)
    pooled[~closes] = 0
    closed = np.where(closes, p, -1).astype(np.int32)
    return pooled.astype(w.k.dtype).reshape(batch, hd), closed


def numpy_compress(w: Workload, kpool: int) -> np.ndarray:
    """Vectorized compress (float32), valid metadata assumed."""
    c = w.cache_lengths.astype(np.int64)
    start = w.input_row_offsets[:-1].astype(np.int64)
    offsets = w.pool_row_offsets.astype(np.int64)
    counts = np.diff(offsets)
    out = np.zeros((len(w.k) // kpool, w.k.shape[1]), dtype=w.k.dtype)
    owner = np.repeat(np.arange(len(c)), counts)
    j = np.arange(offsets[-1]) - offsets[owner]
    first_row = start[owner] + (-(-c[owner] // kpool) + j) * kpool - c[owner]
    rows = first_row[:, None] + np.arange(kpool)[None, :]
    out[: offsets[-1]] = _pool_np(w.k[rows], w.gate[rows], w.ape)
    return out


def numpy_seed_tail(w: Workload, kpool: int, ring: np.ndarray) -> None:
    """Vectorized seed_tail (in place on ``ring``), valid metadata assumed."""
    c = w.cache_lengths.astype(np.int64)
    start = w.input_row_offsets[:-1].astype(np.int64)
    n = w.input_row_offsets[1:].astype(np.int64) - start
    ring_len = ring.shape[2]
    lo = np.maximum(c, ((c + n) // kpool) * kpool - (ring_len - kpool))
    count = np.maximum(c + n - lo, 0)
    req = np.repeat(np.arange(len(c)), count)
    pos = (
        lo[req]
        + np.arange(count.sum())
        - np.repeat(np.cumsum(count) - count, count)
    )
    src = start[req] + pos - c[req]
    slot = w.slot_idx.astype(np.int64)[req]
    ring[slot, 0, pos % ring_len] = w.k[src]
    ring[slot, 1, pos % ring_len] = w.gate[src]


def numpy_expand_topk(w: Workload, kpool: int) -> np.ndarray:
    """Vectorized expand_topk with the tail, valid metadata assumed.

    Valid metadata: ``input_row_offsets`` starts at 0, never decreases
    and ends at most at the row count; every ``visible`` fits int32.
    """
    assert w.pool_ids is not None
    ids = w.pool_ids.astype(np.int64)
    rows, topk = ids.shape
    offsets = w.input_row_offsets.astype(np.int64)
    cache = w.cache_lengths.astype(np.int64)
    width = topk * kpool + kpool - 1
    out = np.full((rows, width), -1, dtype=np.int32)
    owned = int(offsets[-1])
    owner = np.repeat(np.arange(len(cache)), np.diff(offsets))
    visible = cache[owner] + np.arange(owned) - offsets[owner] + 1
    ids = ids[:owned]
    valid = (ids >= 0) & ((ids + 1) * kpool <= visible[:, None])
    pools = valid.sum(axis=1)
    # Valid ids first, in selection order; each widens into kpool columns.
    order = np.argsort(~valid, axis=1, kind="stable")
    packed = np.take_along_axis(ids, order, axis=1)
    packed[np.arange(topk)[None, :] >= pools[:, None]] = -1
    expanded = packed[:, :, None] * kpool + np.arange(kpool)
    expanded[packed < 0] = -1
    out[:owned, : topk * kpool] = expanded.reshape(owned, topk * kpool)
    filling = visible % kpool
    for m in range(kpool - 1):
        has = np.flatnonzero(m < filling)
        out[has, pools[has] * kpool + m] = visible[has] - filling[has] + m
    return out


def numpy_call(case: Case, w: Workload) -> Callable[[], object]:
    """A zero-argument callable running the NumPy twin of ``case.op``."""
    if case.op == "expand_topk":
        return lambda: numpy_expand_topk(w, case.kpool)
    ring = w.ring.copy()
    if case.op == "ring_close":
        return lambda: numpy_ring_close(w, case.kpool)
    if case.op == "compress":
        return lambda: numpy_compress(w, case.kpool)
    if case.op == "seed_tail":
        return lambda: numpy_seed_tail(w, case.kpool, ring)

    def step() -> None:
        numpy_ring_close(w, case.kpool)
        numpy_compress(w, case.kpool)
        numpy_seed_tail(w, case.kpool, ring)

    return step


# -- timing -----------------------------------------------------------------


def time_call(
    fn: Callable[[], object], *, warmup: int, min_reps: int, min_seconds: float
) -> np.ndarray:
    """Per-call seconds of ``fn`` after ``warmup`` calls.

    Runs at least ``min_reps`` calls and at least ``min_seconds`` in all.
    """
    for _ in range(warmup):
        fn()
    times: list[float] = []
    began = time.perf_counter()
    while len(times) < min_reps or time.perf_counter() - began < min_seconds:
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return np.asarray(times)


def time_pair(
    first: Callable[[], object],
    second: Callable[[], object],
    *,
    warmup: int,
    min_reps: int,
    min_seconds: float,
) -> tuple[np.ndarray, np.ndarray]:
    """Per-call seconds of two callables timed in alternation.

    Alternating the op and its floor call by call exposes both to the same
    machine state (frequency, caches, a neighbour's load), so their ratio is
    steadier than two back-to-back series give.
    """
    for _ in range(warmup):
        first()
        second()
    times: tuple[list[float], list[float]] = ([], [])
    began = time.perf_counter()
    while len(times[0]) < min_reps or time.perf_counter() - began < min_seconds:
        for fn, out in ((first, times[0]), (second, times[1])):
            t0 = time.perf_counter()
            fn()
            out.append(time.perf_counter() - t0)
    return np.asarray(times[0]), np.asarray(times[1])


def memcpy_gbps(nbytes: int, **timing: float) -> float:
    """``np.copyto`` bandwidth for a float32 buffer of ``nbytes / 2`` bytes."""
    count = max(nbytes // 8, 1)
    src = np.ones(count, dtype=np.float32)
    dst = np.empty_like(src)
    seconds = np.median(time_call(lambda: np.copyto(dst, src), **timing))
    return 2 * src.nbytes / seconds / 1e9


class _ModelCall:
    """A compiled op and its device operands, callable for timing."""

    def __init__(self, runner: Runner, case: Case, w: Workload) -> None:
        self._runner = runner
        self._sync = runner.device_name == "gpu"
        ring = None
        if kpool_runner.OPS[case.op].in_place:
            ring = runner.new_ring(
                case.batch, case.kpool, case.head_dim, w.k.dtype, fill=w.ring
            )
        self._model, self._args = runner.prepare(
            case.op,
            case.kpool,
            tail=ring,
            k=w.k,
            gate=w.gate,
            ape=w.ape,
            pool_ids=w.pool_ids,
            input_row_offsets=w.input_row_offsets,
            cache_lengths=w.cache_lengths,
            slot_idx=w.slot_idx,
            pool_row_offsets=w.pool_row_offsets,
        )

    def __call__(self) -> None:
        self._model.execute(*self._args)
        if self._sync:
            self._runner.device.synchronize()


@dataclass
class Record:
    """One configuration's measurements (the ``--json`` record)."""

    op: str
    device: str
    dtype: str
    batch: int
    kpool: int
    head_dim: int
    median_us: float
    p10_us: float
    p90_us: float
    bytes: int
    gbps: float
    numpy_median_us: float
    floor_median_us: float
    memcpy_gbps: float
    builtin_median_us: float | None
    cores: int
    max_version: str | None = None
    mojo_version: str | None = None
    cpu_model: str | None = None
    device_name: str | None = None
    git_commit: str | None = None
    git_dirty: bool | None = None
    command: str | None = None


def measure(
    case: Case,
    runners: dict[str, Runner | None],
    timing: dict[str, float],
    info: dict[str, Any] | None = None,
) -> Record:
    """Measures one configuration: the op, its floors and the NumPy twin.

    Args:
        case: The configuration.
        runners: ``"ours"``, ``"floor"`` (the no-op kernels) and, on a GPU,
            ``"builtin"`` (MAX's own kernels).
        timing: :func:`time_call` options.
        info: Where it runs (:func:`mla_kpool._sysinfo.run_info`); the
            record's ``cores`` is ``os.cpu_count()`` when ``None``.

    Returns:
        The record.
    """
    info = {"cores": os.cpu_count() or 1, **(info or {})}
    w = make_workload(case)
    ours, floor = time_pair(
        _ModelCall(runners["ours"], case, w),
        _ModelCall(runners["floor"], case, w),
        **timing,
    )
    ours, floor = ours * 1e6, floor * 1e6
    builtin = None
    if runners.get("builtin") is not None and case.op in BUILTIN_OPS:
        builtin = float(
            np.median(
                time_call(_ModelCall(runners["builtin"], case, w), **timing)
            )
            * 1e6
        )
    numpy_us = time_call(numpy_call(case, w), **timing) * 1e6
    nbytes = op_bytes(case)
    median = float(np.median(ours))
    return Record(
        op=case.op,
        device=case.device,
        dtype=case.dtype,
        batch=case.batch,
        kpool=case.kpool,
        head_dim=case.head_dim,
        median_us=median,
        p10_us=float(np.percentile(ours, 10)),
        p90_us=float(np.percentile(ours, 90)),
        bytes=nbytes,
        gbps=nbytes / median / 1e3,
        numpy_median_us=float(np.median(numpy_us)),
        floor_median_us=float(np.median(floor)),
        memcpy_gbps=memcpy_gbps(nbytes, **timing),
        builtin_median_us=builtin,
        **info,
    )


#: ``--quick``: the three ring_close targets, one mid-size case per
#: other writer, the fused step's two targets (with the three-op step
#: it is compared to) and expand_topk at GLM-5-Next's shape for a large
#: and a decode-sized batch, so CI-sized runs still exercise every op.
QUICK = [
    ("ring_close", "float32", 4096, 128),
    ("ring_close", "float32", 64, 4),
    ("ring_close", "float32", 4096, 16),
    ("compress", "float32", 512, 16),
    ("seed_tail", "float32", 512, 16),
    ("step", "bfloat16", 64, 4),
    ("step3", "bfloat16", 64, 4),
    ("step", "float32", 4096, 16),
    ("expand_topk", EXPAND_DTYPE, 4096, 4),
    ("expand_topk", EXPAND_DTYPE, 64, 4),
]


def cases(args: argparse.Namespace, device: str) -> list[Case]:
    """The configurations a run measures, from the command line."""
    if args.quick:
        return [Case(o, d, b, k, HEAD_DIM, device) for o, d, b, k in QUICK]
    return [
        Case(op, dtype, batch, kpool, args.head_dim, device)
        for op in args.ops
        for dtype in ([EXPAND_DTYPE] if op == "expand_topk" else args.dtypes)
        for kpool in args.kpools
        for batch in args.batches
    ]


def format_table(records: list[Record]) -> str:
    """The human-readable results table."""
    head = (
        f"{'op':<11} {'dtype':<8} {'batch':>5} {'kpool':>5} "
        f"{'median us':>10} {'p10-p90 us':>15} {'GB/s':>7} {'memcpy%':>7} "
        f"{'floor us':>9} {'x floor':>7} {'numpy us':>10} {'x numpy':>8}"
    )
    lines = [head, "-" * len(head)]
    for r in records:
        lines.append(
            f"{r.op:<11} {r.dtype:<8} {r.batch:>5} {r.kpool:>5} "
            f"{r.median_us:>10.1f} {f'{r.p10_us:.0f}-{r.p90_us:.0f}':>15} "
            f"{r.gbps:>7.2f} {100 * r.gbps / r.memcpy_gbps:>6.0f}% "
            f"{r.floor_median_us:>9.1f} "
            f"{r.median_us / r.floor_median_us:>7.2f} "
            f"{r.numpy_median_us:>10.1f} "
            f"{r.numpy_median_us / r.median_us:>8.1f}"
            + (
                f"  builtin {r.builtin_median_us:.1f} us"
                if r.builtin_median_us is not None
                else ""
            )
        )
    return "\n".join(lines)


_positive = int_at_least(1)


def _device(text: str) -> str:
    """An argparse type: ``cpu``, or ``gpu`` when MAX sees an accelerator.

    Checked while parsing, so a run asking for a missing GPU stops with a
    usage error before it compiles anything.
    """
    if text == "gpu":
        from max import driver

        if driver.accelerator_count() == 0:
            raise argparse.ArgumentTypeError(
                "gpu: no accelerator found (max.driver.accelerator_count() "
                "is 0); use --device cpu"
            )
    return text


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Adds the ``bench`` options to ``parser``.

    Every value is checked while parsing (integers ``>= 1``, a GPU that
    exists), so a bad option is an argparse error, exit status 2, before
    anything compiles.
    """
    parser.add_argument(
        "--device",
        type=_device,
        choices=("cpu", "gpu"),
        default="cpu",
        help="where the ops run; gpu also times MAX's builtins (cpu)",
    )
    parser.add_argument(
        "--ops",
        nargs="+",
        choices=OPS,
        default=list(OPS),
        help=(
            "ops to time (all); step is the fused op, step3 the three ops"
            " it replaces; expand_topk runs on int32 pool ids whatever"
            " --dtypes says"
        ),
    )
    parser.add_argument(
        "--dtypes",
        nargs="+",
        choices=DTYPES + ("float16",),
        default=list(DTYPES),
        help="key dtypes (float32 bfloat16)",
    )
    parser.add_argument(
        "--batches",
        nargs="+",
        type=_positive,
        default=list(BATCHES),
        help="requests per call (1 64 512 4096)",
    )
    parser.add_argument(
        "--kpools",
        nargs="+",
        type=_positive,
        default=list(KPOOLS),
        help="tokens per pool (4 16 128); each compiles a model per op",
    )
    parser.add_argument(
        "--head-dim",
        type=_positive,
        default=HEAD_DIM,
        help="channels (128)",
    )
    quick = ", ".join(f"{o} {d} b{b} k{k}" for o, d, b, k in QUICK)
    parser.add_argument(
        "--quick",
        action="store_true",
        help=f"only these configurations, CI-sized: {quick}",
    )
    parser.add_argument(
        "--json", metavar="FILE", help="write one record per configuration"
    )
    parser.add_argument(
        "--markdown",
        metavar="FILE",
        nargs="+",
        help=(
            "print the markdown table of a file --json wrote, and stop: "
            "nothing compiles or runs; given several files (repeated runs), "
            "each configuration's median and range over them"
        ),
    )
    parser.add_argument(
        "--plot",
        metavar="IMAGE",
        help=(
            "draw GB/s against batch per op, with the memcpy line, to IMAGE "
            "(.png, .svg, .pdf), from this run or the --markdown file; "
            "needs matplotlib"
        ),
    )
    parser.add_argument(
        "--min-seconds",
        type=non_negative_float,
        default=0.3,
        help="measure each configuration at least this long (0.3)",
    )


# -- reading results back: markdown and plot -------------------------------

#: Record fields the markdown table and the plot need.
TABLE_FIELDS = (
    "op",
    "dtype",
    "batch",
    "kpool",
    "median_us",
    "gbps",
    "memcpy_gbps",
    "floor_median_us",
    "numpy_median_us",
)

PLOT_MISSING = (
    "--plot needs matplotlib, which is not installed: pip install "
    "matplotlib (or pip install 'mla-kpool[plot]')"
)


class ResultsError(Exception):
    """A ``--markdown`` file that cannot be read as benchmark records."""


def load_records(path: str) -> list[dict[str, Any]]:
    """Reads the records a ``--json`` run wrote.

    Args:
        path: The JSON file: a list of objects.

    Returns:
        The records, as dicts.

    Raises:
        ResultsError: If the file cannot be read, is not JSON, is not a
            list of objects, or a record lacks a field of
            :data:`TABLE_FIELDS`.
    """
    try:
        with open(path) as f:
            data = json.load(f)
    except OSError as err:
        raise ResultsError(f"{path}: cannot read: {err.strerror}") from err
    except json.JSONDecodeError as err:
        raise ResultsError(f"{path}: not valid JSON: {err}") from err
    if not isinstance(data, list) or not all(isinstance(r, dict) for r in data):
        raise ResultsError(
            f"{path}: must be a JSON list of records, as --json writes"
        )
    for i, record in enumerate(data):
        missing = [k for k in TABLE_FIELDS if k not in record]
        if missing:
            raise ResultsError(
                f"{path}: record {i} lacks {', '.join(map(repr, missing))}"
            )
    return data


def _num(value: float) -> str:
    """Three significant digits, whole numbers from 1000 on (no exponent)."""
    if abs(value) >= 1000:
        return f"{value:.0f}"
    return f"{value:.3g}"


def format_markdown(records: list[dict[str, Any]]) -> str:
    """The results table of docs/performance.md for ``records``.

    ``records`` come from :func:`load_records`. One row per record:
    ``median us``, ``GB/s``, ``of memcpy`` (GB/s over the run's memcpy
    GB/s), the no-op ``floor us`` and ``x floor`` (median over floor),
    ``NumPy us`` and ``x NumPy`` (NumPy over median),
    plus ``builtin us`` and ``x builtin`` when a record has MAX's builtin
    time. A line above the table says where it was measured, from the
    first record's ``device_name``, ``cores``, versions and commit, where
    present.
    """
    builtin = any(r.get("builtin_median_us") is not None for r in records)
    head = [
        "op",
        "dtype",
        "batch",
        "kpool",
        "median us",
        "GB/s",
        "of memcpy",
        "floor us",
        "x floor",
        "NumPy us",
        "x NumPy",
    ]
    if builtin:
        head += ["builtin us", "x builtin"]
    right = {"batch", "kpool"} | set(head[4:])
    lines = [
        "| " + " | ".join(head) + " |",
        "| " + " | ".join("---:" if h in right else "---" for h in head) + " |",
    ]
    for r in records:
        median = r["median_us"]
        row = [
            str(r["op"]),
            str(r["dtype"]),
            str(r["batch"]),
            str(r["kpool"]),
            _num(median),
            _num(r["gbps"]),
            f"{100 * r['gbps'] / r['memcpy_gbps']:.0f}%",
            _num(r["floor_median_us"]),
            _num(median / r["floor_median_us"]),
            _num(r["numpy_median_us"]),
            _num(r["numpy_median_us"] / median),
        ]
        if builtin:
            b = r.get("builtin_median_us")
            row += ["-", "-"] if b is None else [_num(b), _num(b / median)]
        lines.append("| " + " | ".join(row) + " |")
    where = _provenance(records[0]) if records else ""
    return (where + "\n\n" if where else "") + "\n".join(lines)


#: Per-run quantities the several-runs table reports, as (column, value of
#: one record). Ratios are taken within each run, then summarised.
RUN_COLUMNS: tuple[tuple[str, Callable[[dict[str, Any]], float]], ...] = (
    ("median us", lambda r: r["median_us"]),
    ("of memcpy", lambda r: 100 * r["gbps"] / r["memcpy_gbps"]),
    ("x floor", lambda r: r["median_us"] / r["floor_median_us"]),
    ("x NumPy", lambda r: r["numpy_median_us"] / r["median_us"]),
)


def _by_config(
    runs: list[list[dict[str, Any]]],
) -> dict[tuple[Any, ...], list[dict[str, Any]]]:
    """Records of several runs grouped by configuration, in first-seen order.

    A configuration is (op, dtype, batch, kpool, head_dim, device).
    """
    keys = ("op", "dtype", "batch", "kpool", "head_dim", "device")
    grouped: dict[tuple[Any, ...], list[dict[str, Any]]] = {}
    for records in runs:
        for r in records:
            grouped.setdefault(tuple(r.get(k) for k in keys), []).append(r)
    return grouped


def format_markdown_runs(runs: list[list[dict[str, Any]]]) -> str:
    """The results table over repeated runs: median and range per column.

    Each configuration (op, dtype, batch, kpool, head_dim, device) found in
    any run gets one row. For every column of :data:`RUN_COLUMNS` the value
    is computed within each run that measured the configuration (so a ratio
    compares an op with its floor, NumPy twin or memcpy from the same run)
    and reported as ``median (min-max)`` over those runs; ``runs`` says how
    many there were.

    Args:
        runs: One list of records (from :func:`load_records`) per run.

    Returns:
        Markdown: a line saying where and how often it was measured, then
        the table.
    """
    grouped = _by_config(runs)
    head = ["op", "dtype", "batch", "kpool", "runs"]
    head += [name for name, _ in RUN_COLUMNS]
    right = set(head[2:])
    lines = [
        "| " + " | ".join(head) + " |",
        "| " + " | ".join("---:" if h in right else "---" for h in head) + " |",
    ]
    for (op, dtype, batch, kpool, _, _), rs in grouped.items():
        row = [str(op), str(dtype), str(batch), str(kpool), str(len(rs))]
        for name, value in RUN_COLUMNS:
            values = [value(r) for r in rs]
            unit = "%" if name == "of memcpy" else ""
            lo, mid, hi = min(values), float(np.median(values)), max(values)
            fmt = (lambda x: f"{x:.0f}") if unit else _num
            row.append(
                f"{fmt(mid)}{unit} ({fmt(lo)}-{fmt(hi)}{unit})"
                if len(values) > 1
                else f"{fmt(mid)}{unit}"
            )
        lines.append("| " + " | ".join(row) + " |")
    first = next((records[0] for records in runs if records), None)
    where = _provenance(first) if first is not None else ""
    if where:
        where = where[:-1] + f"; {len(runs)} runs, medians and (ranges)."
    return (where + "\n\n" if where else "") + "\n".join(lines)


def median_records(runs: list[list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """One record per configuration, its numbers the medians over ``runs``.

    For :func:`plot` when it is given several runs.
    """
    grouped = _by_config(runs)
    merged = []
    for rs in grouped.values():
        record = dict(rs[0])
        for key in ("median_us", "gbps", "memcpy_gbps"):
            record[key] = float(np.median([r[key] for r in rs]))
        merged.append(record)
    return merged


def _provenance(record: dict[str, Any]) -> str:
    """One sentence: device, cores, versions, commit and command."""
    parts = []
    if record.get("device_name"):
        cores = record.get("cores")
        parts.append(
            str(record["device_name"]) + (f" ({cores} cores)" if cores else "")
        )
    for key, name in (("max_version", "MAX"), ("mojo_version", "Mojo")):
        if record.get(key):
            parts.append(f"{name} {record[key]}")
    if record.get("git_commit"):
        dirty = " with local changes" if record.get("git_dirty") else ""
        parts.append(f"commit {record['git_commit'][:12]}{dirty}")
    text = "Measured on " + ", ".join(parts) if parts else ""
    if record.get("command"):
        text += (": " if text else "") + f"`{record['command']}`"
    return text + "." if text else ""


def _import_pyplot() -> Any:
    """``matplotlib.pyplot`` on the file-only Agg backend.

    Raises:
        ImportError: If matplotlib is not installed.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot(records: list[dict[str, Any]], path: str) -> None:
    """Draws GB/s against batch, one panel per op, to an image file.

    Each panel has a line per (dtype, kpool) and a dashed line of the
    memcpy bandwidth measured for those records (median per batch): how
    close to the machine's copy speed the op runs at each batch.

    Args:
        records: Benchmark records (dicts with :data:`TABLE_FIELDS`).
        path: Image file; the format follows its suffix (``.png``,
            ``.svg``, ``.pdf``).

    Raises:
        ImportError: If matplotlib is not installed.
    """
    plt = _import_pyplot()
    ops = list(dict.fromkeys(r["op"] for r in records))
    fig, axes = plt.subplots(
        1,
        max(len(ops), 1),
        figsize=(4.2 * max(len(ops), 1), 3.8),
        squeeze=False,
        sharey=True,
    )
    for ax, op in zip(axes[0], ops, strict=False):
        mine = [r for r in records if r["op"] == op]
        series = dict.fromkeys((r["dtype"], r["kpool"]) for r in mine)
        for dtype, kpool in series:
            points = sorted(
                (r["batch"], r["gbps"])
                for r in mine
                if (r["dtype"], r["kpool"]) == (dtype, kpool)
            )
            ax.plot(
                *zip(*points, strict=True),
                marker="o",
                label=f"{dtype}, kpool {kpool}",
            )
        batches = sorted({r["batch"] for r in mine})
        memcpy = [
            float(
                np.median(
                    [r["memcpy_gbps"] for r in mine if r["batch"] == batch]
                )
            )
            for batch in batches
        ]
        ax.plot(batches, memcpy, "k--", label="memcpy")
        ax.set_xscale("log", base=2)
        ax.set_xticks(batches, [str(b) for b in batches])
        ax.set_title(op)
        ax.set_xlabel("batch (requests per call)")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7)
    axes[0][0].set_ylabel("GB/s (bytes read + written / median)")
    if records and records[0].get("device_name"):
        fig.suptitle(f"mla-kpool bench on {records[0]['device_name']}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def run(args: argparse.Namespace) -> int:
    """Runs the benchmark described by ``args``; returns the exit status.

    With ``--markdown FILE`` it only reads ``FILE`` (written by ``--json``)
    and prints its table (and draws ``--plot``): nothing compiles or runs.
    Several files are repeated runs: the table then gives each
    configuration's median and range over them.
    A usage problem (``--plot`` without matplotlib, an unreadable
    ``--markdown`` file, ``--markdown`` with ``--json``) is reported before
    anything compiles, with exit status 2.
    """
    markdown = getattr(args, "markdown", None)
    plot_path = getattr(args, "plot", None)
    try:
        if plot_path:
            try:
                _import_pyplot()
            except ImportError:
                raise ResultsError(PLOT_MISSING) from None
        if markdown and args.json:
            raise ResultsError(
                "--markdown reads a --json file; it does not run, so it "
                "writes none"
            )
        loaded = [load_records(path) for path in markdown or []]
    except ResultsError as err:
        print(f"mla-kpool bench: error: {err}", file=sys.stderr)
        return 2
    if len(loaded) == 1:
        print(format_markdown(loaded[0]))
        if plot_path:
            plot(loaded[0], plot_path)
        return 0
    if loaded:
        print(format_markdown_runs(loaded))
        if plot_path:
            plot(median_records(loaded), plot_path)
        return 0
    device = args.device
    runners: dict[str, Runner | None] = {
        "ours": Runner(device),
        "floor": Runner(device, kernels=NOOP_KERNELS),
        "builtin": Runner(device, kernels=None) if device == "gpu" else None,
    }
    timing = {"warmup": 3, "min_reps": 10, "min_seconds": args.min_seconds}
    todo = cases(args, device)
    records: list[Record] = []
    bar = tqdm(
        todo,
        desc="bench",
        unit="config",
        file=sys.stderr,
        disable=not sys.stderr.isatty(),
    )
    ours = runners["ours"]
    info = run_info(
        device,
        ours.device.model_name
        if ours is not None and device == "gpu"
        else None,
    )
    for case in bar:
        records.append(measure(case, runners, timing, info))
    print(
        f"mla-kpool bench on {device} ({info['device_name']}; "
        f"{info['cpu_model']}, {info['cores']} cores; MAX "
        f"{info['max_version']}, Mojo {info['mojo_version']})"
    )
    print(format_table(records))
    if args.json:
        with open(args.json, "w") as f:
            json.dump([asdict(r) for r in records], f, indent=1)
    if plot_path:
        plot([asdict(r) for r in records], plot_path)
    return 0

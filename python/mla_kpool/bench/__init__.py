"""``python -m mla_kpool bench``: per-call time of each op, with its peers.

Every configuration (op, dtype, batch, kpool, head_dim, device) is timed on
one set of inputs (:mod:`.workload`) against the peers its ratios divide by:

- the op: ``median_us`` (and ``p10_us``/``p90_us``) per ``Model.execute``
  on operands already on the device, after warm-up; ``bytes`` is what it
  must read plus write and ``gbps = bytes / median``;
- the **floor** (``floor_median_us``): the same graph with no-op kernels of
  the same names and signatures (``mla_kpool/bench_noop``), MAX's own
  per-call cost, timed call by call in alternation with the op;
- the **NumPy twin** (``numpy_median_us``): the vectorised code a user
  would write instead;
- **memcpy** (``memcpy_gbps``): ``np.copyto`` of ``bytes / 2`` bytes,
  counted as read plus write, the machine's copy bandwidth;
- on a GPU, MAX's own GPU builtins on the same graph
  (``builtin_median_us``; MAX has no fused step, so not for ``step``).

``--ops index_top_k`` times the indexer at GLM-5-Next's shape, a decode
call and prefills of 4,096 and 16,384 tokens (:mod:`.index`), against its
own peers: the NumPy twin
and NumPy's BLAS GFLOP/s on the same score shapes (:func:`measure_index`);
its records go to a table of their own. With ``--device gpu`` it times this
package's GPU path (whatever the GPU) and adds its share of the GPU's
published FP32, FP8 and memory-bandwidth peaks (:func:`gpu_fractions`).
On a GPU the bench knows (:data:`mla_kpool.gpu_specs.GPUS`), index_top_k
and the step (``step``, ``step3``) also get their roofline lower bound and
the measured time over it (:func:`gpu_bound`).
Started from the command line the bench runs without
``OPENBLAS_CORETYPE`` and ``OPENBLAS_L2_SIZE`` (:mod:`.blas`), and each
record names the BLAS kernel NumPy used.

With no preset a run measures a short set (:data:`DEFAULT_GRID`);
``--sweep`` widens the grid to every op, dtype and kpool and ``--quick``
narrows it to the fused step at three batches (:data:`QUICK`: 2 graphs,
the fastest cold run). Both kernel packages are
precompiled once per process (a few seconds) and MAX caches each compiled
graph (``~/.cache/modular``), so a second run compiles no graph. Records
(``--json``) say where they were measured (:mod:`mla_kpool._sysinfo`);
``--markdown`` and ``--plot`` read them back (:mod:`.report`).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

import numpy as np

from .. import index_runner
from .. import runner as kpool_runner
from .._argtypes import (
    MAX_HEAD_DIM,
    MAX_KPOOL,
    available_memory,
    float_in,
    head_dim_option,
    int_in,
    kpool_option,
    output_file,
    usage_error,
)
from .._index_op import gpu_scorers
from .._paths import NOOP_KERNELS
from .._progress import LINE_INTERVAL_S, progress_for
from .._sysinfo import run_info
from ..runner import Runner
from . import index, report, workload
from .blas import blas_info
from .report import Record
from .workload import EXPAND_DTYPE, INDEX_DTYPE, INDEX_OP, OPS, Case

DESCRIPTION = (
    "Time the k-pool ops against MAX's no-op floor, a NumPy twin and memcpy"
    " bandwidth. With no preset: the fused step and expand_topk, bfloat16,"
    " kpool 4, batch 1 64 512 4096 (8 configurations, 4 graphs to compile:"
    " on 2 CPU cores alone about 1.5 min with a cold compile cache and 20 s"
    " warm; 3-5 min cold beside other compiles)."
    " From the command line it restarts itself without OPENBLAS_CORETYPE"
    " and OPENBLAS_L2_SIZE: they slow NumPy's BLAS, which the NumPy peers"
    " run on, so the peers get their best."
)

#: Ops that MAX also ships as GPU builtins (the fused step is ours only).
BUILTIN_OPS = tuple(op for op in OPS if op != "step")
HEAD_DIM = 128
#: The grid options' values with no preset: the op a decode step runs and
#: the one its attention reads pools through, at GLM-5-Next's kpool.
DEFAULT_GRID = {
    "ops": ["step", "expand_topk"],
    "dtypes": ["bfloat16"],
    "batches": [1, 64, 512, 4096],
    "kpools": [4],
}
#: ``--sweep``: every op, dtype and kpool.
SWEEP_GRID = DEFAULT_GRID | {
    "ops": list(OPS),
    "dtypes": ["float32", "bfloat16"],
    "kpools": [4, 16, 128],
}
#: ``--quick``: the fused step only (the op a decode step runs), bfloat16,
#: kpool 4, at a decode-sized, a mid-size and a large batch: 3
#: configurations on one op instance, so 2 graphs to compile (the op and
#: its floor; batches share a graph), half the default set's 4.
QUICK_BATCHES = (1, 64, 4096)
QUICK = [("step", "bfloat16", batch, 4) for batch in QUICK_BATCHES]


def time_calls(
    *fns: Callable[[], object],
    warmup: int = 3,
    min_reps: int = 10,
    min_seconds: float = 0.3,
    settle: float = 0.0,
) -> list[np.ndarray]:
    """Per-call microseconds of each callable, called in turn.

    Alternating an op with its floor call by call exposes both to the same
    machine state (frequency, caches, a neighbour's load), so their ratio
    is steadier than back-to-back series give. After ``warmup`` rounds it
    runs at least ``min_reps`` rounds and at least ``min_seconds``.
    ``settle`` seconds of sleep before each timed round (not timed, but
    counted in ``min_seconds``) let the previous round's worker threads
    stop spinning before the first callable runs: OpenBLAS's threads wait
    for work for about 2^28 cycles after a call (0.1 s at 2.6 GHz), which
    takes a core from whatever runs next. The other callables follow at
    once, as without it.
    """
    for _ in range(warmup):
        for fn in fns:
            fn()
    times: list[list[float]] = [[] for _ in fns]
    began = time.perf_counter()
    while len(times[0]) < min_reps or time.perf_counter() - began < min_seconds:
        if settle:
            time.sleep(settle)
        for fn, out in zip(fns, times, strict=True):
            t0 = time.perf_counter()
            fn()
            out.append(time.perf_counter() - t0)
    return [np.asarray(t) * 1e6 for t in times]


def memcpy_gbps(nbytes: int, **timing: Any) -> float:
    """``np.copyto`` bandwidth for a float32 buffer of ``nbytes / 2`` bytes."""
    src = np.ones(max(nbytes // 8, 1), dtype=np.float32)
    dst = np.empty_like(src)
    (us,) = time_calls(lambda: np.copyto(dst, src), **timing)
    return 2 * src.nbytes / float(np.median(us)) / 1e3


def model_call(
    runner: Runner, case: Case, w: workload.Workload
) -> Callable[[], None]:
    """``case.op`` as ``runner`` compiles it, its operands on the device."""
    operands = vars(w) | {"tail": None}
    if kpool_runner.OPS[case.op].in_place:
        operands["tail"] = runner.new_ring(
            case.batch, case.kpool, case.head_dim, w.k.dtype, fill=w.tail
        )
    return _synced(runner, *runner.prepare(case.op, case.kpool, **operands))


def index_call(
    runner: Runner, w: index.IndexWorkload, scorer: str = ""
) -> Callable[[], None]:
    """index_top_k as ``runner`` compiles it, its operands bound once.

    On a GPU this package's GPU path (``gpu_op="ours"``) with the case's
    scorer (``"auto"`` when it names none), synchronized after each call.
    """
    model, args, _ = index_runner.prepare(
        runner,
        w.q,
        w.qs,
        w.input_row_offsets,
        w.cache,
        w.layer,
        top_k=w.shape.top_k,
        kpool=w.shape.kpool,
        mask=w.mask,
        gpu_op="ours",
        scorer=scorer or "auto",
    )
    return _synced(runner, model, args)


def _synced(runner: Runner, model: Any, args: list[Any]) -> Callable[[], None]:
    """``model.execute(*args)``, synchronized after each call on a GPU."""
    gpu = runner.device_name == "gpu"

    def call() -> None:
        model.execute(*args)
        if gpu:
            runner.device.synchronize()

    return call


def _gpu_name(runner: Runner) -> str | None:
    """The runner's GPU model name, ``None`` off a GPU."""
    return runner.device.model_name if runner.device_name == "gpu" else None


def gpu_fractions(
    flops: int, nbytes: int, median_us: float, model_name: str | None
) -> Record:
    """The op's share of its GPU's published peaks (empty off a known GPU).

    Returns:
        ``gpu_peak`` (the peaks used) and ``pct_fp32_peak``,
        ``pct_fp8_peak``, ``pct_hbm`` (percent of FP32 and FP8 TFLOP/s and
        of memory bandwidth), or ``{}``.
    """
    peak = index.gpu_peak(model_name)
    if peak is None:
        return {}
    tflops = flops / median_us / 1e6
    tbps = nbytes / median_us / 1e6
    return {
        "gpu_peak": asdict(peak),
        "pct_fp32_peak": 100 * tflops / peak.fp32_tflops,
        "pct_fp8_peak": 100 * tflops / peak.fp8_tflops,
        "pct_hbm": 100 * tbps / peak.hbm_tbps,
    }


def gpu_bound(case: Case, median_us: float, model_name: str | None) -> Record:
    """The roofline lower bound of ``case`` on its GPU, beside its time.

    :func:`mla_kpool.bench.bounds.bound_seconds` of the case's
    workload (:func:`~mla_kpool.bench.bounds.workload_for_case`:
    the step and index_top_k): ``max(bytes / HBM bandwidth, flops /
    peak)``, the same bytes and flops as the record's.

    Returns:
        ``bound_us`` (FP32 peak), ``bound_fp8_us`` (dense FP8 peak) and
        ``x_bound`` (``median_us / bound_us``), or ``{}`` off a known GPU
        or for an op without a bound.
    """
    if index.gpu_peak(model_name) is None:
        return {}
    from . import bounds

    w = bounds.workload_for_case(case)
    if w is None:
        return {}
    bound = bounds.bound_seconds(w, model_name)
    fp8 = bounds.bound_seconds(w, model_name, "fp8")
    assert bound is not None and fp8 is not None
    return {
        "bound_us": bound * 1e6,
        "bound_fp8_us": fp8 * 1e6,
        "x_bound": median_us / (bound * 1e6),
    }


#: Largest ``--batches`` value: a call's token rows and pools are uint32
#: offsets, and a million requests are 250 times the default grid's
#: largest batch.
MAX_BATCH = 1 << 20
#: Largest ``--min-seconds``: a configuration measured for a minute is
#: already far past a stable median.
MAX_MIN_SECONDS = 60.0
#: Grid size past which a run needs ``--long-run``: ``--sweep``'s (132
#: configurations, 66 graphs, about 22 min cold on 2 CPU cores).
LONG_RUN_CONFIGS = 132
LONG_RUN_GRAPHS = 66
#: Memory a configuration takes per byte its op moves (its inputs drawn
#: in float64, the NumPy twin's temporaries, the memcpy peer's buffers;
#: an upper estimate), for :func:`check_size`.
BYTES_PER_OP_BYTE = 8

#: Calls each index_top_k peer makes at least (after one warm-up call):
#: the medians are over this many.
INDEX_MIN_CALLS = 5

#: Seconds of pause before each round of index_top_k, twin and BLAS, so
#: the op does not share the cores with OpenBLAS's threads, which spin
#: for about 0.1 s after the previous round's BLAS call. The twin and BLAS
#: follow the op at once: a pause before the twin made it slower, not
#: faster (NumPy's page faults on its large temporaries grew).
INDEX_SETTLE_S = 0.25


def measure_index(
    case: Case, runner: Runner, info: Record, **timing: Any
) -> Record:
    """Measures index_top_k on one phase against its NumPy peers.

    The op (operands bound once, on the runner's device; on a GPU this
    package's GPU path, whatever the GPU), the NumPy twin and NumPy's
    BLAS on the twin's score matmuls (:mod:`.index`), called in turn, round
    after round (so a neighbour's load hits all three alike), at least
    :data:`INDEX_MIN_CALLS` rounds after one warm-up round, each round after
    a pause of :data:`INDEX_SETTLE_S` (so the op does not share the cores
    with the previous round's spinning BLAS threads).

    Args:
        case: An index_top_k case (its ``phase``).
        runner: The runner (``"cpu"`` or ``"gpu"``).
        info: Where it runs, copied into the record.
        **timing: :func:`time_calls` options (``min_seconds``).

    Returns:
        The record: the case's fields, the shape (``heads``, ``top_k``,
        ``width``, ``page_size``, ``mask``), ``tokens``, ``candidates``
        (visible, summed over tokens), ``flops`` and ``gflops``, the op's
        ``median_us`` with ``p10_us``, ``p90_us``, ``min_us``, ``max_us``
        and ``calls``; ``numpy_median_us``, ``numpy_min_us``,
        ``numpy_max_us``; ``blas_flops``, ``blas_median_us``,
        ``blas_gflops``; ``bytes`` (:func:`.index.index_bytes`); on a GPU
        whose peaks :data:`.index.GPU_PEAKS` knows, :func:`gpu_fractions`
        and :func:`gpu_bound`;
        what :func:`.blas.blas_info` says; ``info``.
    """
    w = index.make_index_workload(case.phase)
    timing = {
        "warmup": 1,
        "min_reps": INDEX_MIN_CALLS,
        "settle": INDEX_SETTLE_S,
    } | timing
    offsets, lengths = w.input_row_offsets, w.cache.cache_lengths
    flops = index.score_flops(offsets, lengths, w.shape)
    blas_call, blas_flops = index.blas_matmul(offsets, lengths, w.shape)
    op_us, numpy_us, blas_us = time_calls(
        index_call(runner, w, case.scorer),
        index.numpy_twin(w),
        blas_call,
        **timing,
    )
    median = float(np.median(op_us))
    p10, p90 = np.percentile(op_us, [10, 90])
    blas_median = float(np.median(blas_us))
    shape = w.shape
    nbytes = index.index_bytes(offsets, lengths, shape)
    model_name = _gpu_name(runner)
    return asdict(case) | {
        "heads": shape.heads,
        "top_k": shape.top_k,
        "width": shape.width,
        "page_size": shape.page_size,
        "mask": w.mask,
        "tokens": int(len(w.q)),
        "candidates": w.candidates,
        "flops": flops,
        "bytes": nbytes,
        "median_us": median,
        "p10_us": float(p10),
        "p90_us": float(p90),
        "min_us": float(op_us.min()),
        "max_us": float(op_us.max()),
        "calls": len(op_us),
        "gflops": flops / median / 1e3,
        "numpy_median_us": float(np.median(numpy_us)),
        "numpy_min_us": float(numpy_us.min()),
        "numpy_max_us": float(numpy_us.max()),
        "blas_flops": blas_flops,
        "blas_median_us": blas_median,
        "blas_gflops": blas_flops / blas_median / 1e3,
        **gpu_fractions(flops, nbytes, median, model_name),
        **gpu_bound(case, median, model_name),
        **blas_info(),
        **info,
    }


def make_runners(device: str) -> dict[str, Runner]:
    """``"ours"``, ``"floor"`` and, on a GPU, ``"builtin"`` runners.

    Each Mojo package is precompiled here, once, rather than by MAX for
    every graph that names its source directory (about 4 s a graph).

    Raises:
        mojo.paths.MojoCompilationError: If a package does not compile.
    """
    runners = {
        "ours": Runner(device),
        "floor": Runner(device, kernels=NOOP_KERNELS),
    }
    if device == "gpu":
        runners["builtin"] = Runner(device, kernels=None)
    return runners


def measure(
    case: Case, runners: dict[str, Runner], info: Record, **timing: Any
) -> Record:
    """Measures one configuration: the op and its peers.

    index_top_k goes to :func:`measure_index` (its own peers and record).

    Args:
        case: The configuration.
        runners: From :func:`make_runners`.
        info: Where it runs (:func:`mla_kpool._sysinfo.run_info`), copied
            into the record.
        **timing: :func:`time_calls` options.

    Returns:
        The ``--json`` record: the case's fields, then ``median_us``,
        ``p10_us``, ``p90_us``, ``bytes``, ``gbps``, ``floor_median_us``,
        ``numpy_median_us``, ``memcpy_gbps``, ``builtin_median_us`` (or
        ``None``), on a known GPU :func:`gpu_bound` (the step) and
        ``info``'s fields.
    """
    if case.op == INDEX_OP:
        return measure_index(case, runners["ours"], info, **timing)
    w = workload.make_workload(case)
    names = [n for n in runners if n != "builtin" or case.op in BUILTIN_OPS]
    calls = [model_call(runners[name], case, w) for name in names]
    us = dict(zip(names, time_calls(*calls, **timing), strict=True))
    (us["numpy"],) = time_calls(workload.numpy_call(case, w), **timing)
    median = {name: float(np.median(t)) for name, t in us.items()}
    p10, p90 = np.percentile(us["ours"], [10, 90])
    nbytes = workload.op_bytes(case)
    model_name = _gpu_name(runners["ours"])
    return asdict(case) | {
        "median_us": median["ours"],
        "p10_us": float(p10),
        "p90_us": float(p90),
        "bytes": nbytes,
        "gbps": nbytes / median["ours"] / 1e3,
        "floor_median_us": median["floor"],
        "numpy_median_us": median["numpy"],
        "memcpy_gbps": memcpy_gbps(nbytes, **timing),
        "builtin_median_us": median.get("builtin"),
        **gpu_bound(case, median["ours"], model_name),
        **info,
    }


def cases(args: argparse.Namespace) -> list[Case]:
    """The configurations a run measures, from the command line.

    ``--quick`` is its fixed list; otherwise the grid of ``--ops``,
    ``--dtypes``, ``--batches`` and ``--kpools``, each defaulting to
    :data:`DEFAULT_GRID`'s value, or :data:`SWEEP_GRID`'s with ``--sweep``.
    """
    if args.quick:
        return [Case(*c, HEAD_DIM, args.device) for c in QUICK]
    grid = SWEEP_GRID if args.sweep else DEFAULT_GRID
    ops, dtypes, batches, kpools = (getattr(args, k) or grid[k] for k in grid)
    todo = [
        Case(op, dtype, batch, kpool, args.head_dim, args.device)
        for op in ops
        if op != INDEX_OP
        for dtype in ([EXPAND_DTYPE] if op == "expand_topk" else dtypes)
        for kpool in kpools
        for batch in batches
    ]
    if INDEX_OP in ops:
        todo += index_cases(args.device)
    return todo


def index_cases(device: str) -> list[Case]:
    """index_top_k's configurations (one per phase), whatever the grid says.

    GLM-5-Next's indexer (:data:`.index.GLM5_NEXT`) on each phase of
    :data:`.index.INDEX_PHASES`; ``batch`` is the phase's requests. On a
    GPU, a row per scorer it has (:func:`mla_kpool._index_op.gpu_scorers`).
    """
    shape = index.GLM5_NEXT
    scorers = (gpu_scorers() or [""]) if device == "gpu" else [""]
    sizes = (shape.kpool, shape.depth, device)
    return [
        Case(INDEX_OP, INDEX_DTYPE, requests, *sizes, phase, scorer)
        for phase, (requests, _, _) in index.INDEX_PHASES.items()
        for scorer in scorers
    ]


def graphs_to_compile(todo: list[Case]) -> int:
    """Graphs a run of ``todo`` compiles: per op instance, one per runner.

    index_top_k has no floor: one graph per scorer serves all its phases.
    """
    models = {
        (c.op, c.dtype, c.kpool, c.head_dim, c.scorer, c.device) for c in todo
    }
    return sum(
        1 if op == INDEX_OP else 2 + (dev == "gpu" and op in BUILTIN_OPS)
        for op, *_, dev in models
    )


def measure_all(args: argparse.Namespace) -> list[Record]:
    """Compiles and measures every configuration of ``args``, with progress.

    Progress goes to stderr (:func:`mla_kpool._progress.progress_for`): a
    bar on a terminal, else a line every
    :data:`~mla_kpool._progress.LINE_INTERVAL_S` seconds, also while one
    configuration compiles; nothing with ``--no-progress``.
    """
    todo = cases(args)
    print(
        f"bench: {describe_size(todo)}, 10-40 s a graph the first time on"
        " a quiet 2-core machine, up to 2 min a graph on a busy one (MAX"
        " caches them in ~/.cache/modular)",
        file=sys.stderr,
    )
    runners = make_runners(args.device)
    info = run_info(args.device, _gpu_name(runners["ours"]))
    records = []
    progress = progress_for(
        len(todo),
        sys.stderr,
        not args.no_progress,
        desc="bench",
        unit="configurations",
    )
    for case in todo:
        progress.set_postfix_str(
            f"{case.op} {case.phase or case.dtype} b{case.batch} k{case.kpool}"
        )
        records.append(
            measure(case, runners, info, min_seconds=args.min_seconds)
        )
        progress.update(1)
    progress.close()
    return records


def describe_size(todo: list[Case]) -> str:
    """``"<n> configurations, <g> graphs to compile"`` for a run of ``todo``."""
    graphs = graphs_to_compile(todo)
    configs = "configuration" if len(todo) == 1 else "configurations"
    noun = "graph" if graphs == 1 else "graphs"
    return f"{len(todo)} {configs}, {graphs} {noun} to compile"


def check_size(args: argparse.Namespace, todo: list[Case]) -> str | None:
    """What is wrong with the size of a run of ``todo``, or ``None``.

    Past --sweep's size (:data:`LONG_RUN_GRAPHS`,
    :data:`LONG_RUN_CONFIGS`) a run needs ``--long-run``; and each
    configuration's workload must fit in the memory this machine has
    available (:data:`BYTES_PER_OP_BYTE` times the bytes the op moves,
    :func:`.workload.op_bytes`).

    Returns:
        The usage error's message (naming the options to change), or
        ``None`` when the run may start.
    """
    graphs = graphs_to_compile(todo)
    if (
        graphs > LONG_RUN_GRAPHS or len(todo) > LONG_RUN_CONFIGS
    ) and not args.long_run:
        return (
            f"this grid is {describe_size(todo)}, more than --sweep's"
            f" {LONG_RUN_CONFIGS} configurations and {LONG_RUN_GRAPHS}"
            " graphs; add --long-run to run it, or name fewer --ops,"
            " --dtypes, --batches or --kpools"
        )
    have = available_memory()
    sized = [c for c in todo if c.op != INDEX_OP]
    if have is None or not sized:
        return None
    case = max(sized, key=workload.op_bytes)
    need = BYTES_PER_OP_BYTE * workload.op_bytes(case)
    if need <= have:
        return None
    return (
        f"--batches {case.batch} needs about {need / 2**30:.1f} GiB for"
        f" {case.op} (kpool {case.kpool}, head_dim {case.head_dim},"
        f" {case.dtype}), more than the {have / 2**30:.1f} GiB this machine"
        " has available; lower --batches (or --kpools, --head-dim)"
    )


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
    add = parser.add_argument
    add(
        "--device",
        type=_device,
        choices=("cpu", "gpu"),
        default="cpu",
        help="where the ops run; gpu also times MAX's builtins (cpu)",
    )
    preset = parser.add_mutually_exclusive_group()
    preset.add_argument(
        "--sweep",
        action="store_true",
        help="the grid options default to every op but index_top_k,"
        " float32 and bfloat16, kpool 4 16 128: 132 configurations, 66"
        " graphs, about 22 min cold on 2 CPU cores alone, 45 min to 1.5 h"
        " beside other compiles",
    )
    preset.add_argument(
        "--quick",
        action="store_true",
        help="only the fused step, bfloat16, kpool 4, batch 1 64 4096 (the"
        " grid options are ignored): 3 configurations, 2 graphs, about 40 s"
        " cold and 15 s warm on 2 CPU cores alone (1 min 15 s cold, 18 s warm"
        " beside other compiles), half the default's cold time",
    )
    add(
        "--ops",
        nargs="+",
        choices=(*OPS, INDEX_OP),
        metavar="OP",
        help=f"ops to time: {' '.join(OPS)} {INDEX_OP} (step expand_topk;"
        " --sweep: all but index_top_k); step is the fused op, step3 the"
        " three ops it replaces; expand_topk runs on int32 pool ids whatever"
        " --dtypes says; index_top_k runs GLM-5-Next's indexer (H 32, D 128,"
        " kpool 4, top-k 512) on a decode call (16 requests, 8,192 pools"
        " each) and prefills of 4,096 and 16,384 tokens, whatever the grid"
        " options say, against a NumPy twin and NumPy's BLAS (1 graph, about"
        " 1.5 min cold and 1 min warm on 2 CPU cores alone, several minutes"
        " beside other compiles); with --device gpu,"
        " this package's GPU path, with its share of the GPU's published"
        " FP32, FP8 and memory peaks (H200, H100, B200, MI300X) and its"
        " roofline bound",
    )
    add(
        "--dtypes",
        nargs="+",
        choices=("float32", "bfloat16", "float16"),
        help="key dtypes (bfloat16; --sweep: float32 bfloat16)",
    )
    add(
        "--batches",
        nargs="+",
        type=int_in(1, MAX_BATCH, "a call's rows are counted in 32 bits"),
        help=f"requests per call (1 64 512 4096; at most {MAX_BATCH:,}, and"
        " what this machine's memory holds); batches share a graph",
    )
    add(
        "--kpools",
        nargs="+",
        type=kpool_option,
        help=f"tokens per pool (4; --sweep: 4 16 128; at most {MAX_KPOOL});"
        " each compiles graphs",
    )
    add(
        "--head-dim",
        type=head_dim_option,
        default=HEAD_DIM,
        help=f"channels ({HEAD_DIM}; at most {MAX_HEAD_DIM})",
    )
    add(
        "--json",
        metavar="FILE",
        type=output_file,
        help="write one record per configuration",
    )
    add(
        "--markdown",
        metavar="FILE",
        nargs="+",
        help="print the table of a file --json wrote, and stop: nothing"
        " compiles or runs; given several files (repeated runs), each"
        " configuration's median and range over them",
    )
    add(
        "--plot",
        metavar="IMAGE",
        type=output_file,
        help="draw GB/s against batch per op, with the memcpy line, to IMAGE"
        " (.png, .svg, .pdf), from this run or the --markdown files; needs"
        " matplotlib",
    )
    add(
        "--min-seconds",
        type=float_in(
            0,
            MAX_MIN_SECONDS,
            "a minute a configuration is far past a stable median",
        ),
        default=0.3,
        help="measure each configuration at least this long (0.3; at most"
        f" {MAX_MIN_SECONDS:g})",
    )
    add(
        "--long-run",
        action="store_true",
        help=f"run a grid of more than {LONG_RUN_GRAPHS} graphs or"
        f" {LONG_RUN_CONFIGS} configurations (--sweep's size); without it"
        " such a run stops before compiling and says its size",
    )
    add(
        "--no-progress",
        action="store_true",
        help="no progress display (a bar when stderr is a terminal, else a"
        f" line every {LINE_INTERVAL_S:.0f} s at most)",
    )


def run(args: argparse.Namespace) -> int:
    """Runs the benchmark described by ``args``; returns the exit status.

    With ``--markdown FILE...`` it only reads the files (written by
    ``--json``) and prints their table (and draws ``--plot``): nothing
    compiles or runs. A usage problem (``--plot`` without matplotlib, an
    unreadable ``--markdown`` file, ``--markdown`` with ``--json``) is
    reported before anything compiles, with exit status 2.
    """
    try:
        if args.plot:
            try:
                plt = report.import_pyplot()
            except ImportError:
                raise report.ResultsError(report.PLOT_MISSING) from None
            figure = plt.figure()
            kinds = figure.canvas.get_supported_filetypes()
            plt.close(figure)
            suffix = os.path.splitext(args.plot)[1].lstrip(".").lower()
            if suffix not in kinds:
                raise report.ResultsError(
                    f"argument --plot: IMAGE must end in one of "
                    f"{', '.join('.' + k for k in sorted(kinds))}, "
                    f"got {args.plot!r}"
                )
        if args.markdown and args.json:
            raise report.ResultsError(
                "--markdown reads a --json file; it does not run, so it "
                "writes none"
            )
        runs = [report.load_records(path) for path in args.markdown or []]
        report.check_same_form(runs, args.markdown or [])
    except report.ResultsError as err:
        return usage_error(args, str(err))
    if not runs:
        problem = check_size(args, cases(args))
        if problem is not None:
            return usage_error(args, problem)
        runs = [measure_all(args)]
        if args.json:
            Path(args.json).write_text(json.dumps(runs[0], indent=1))
    print(report.format_table(runs))
    if args.plot:
        report.plot(report.median_records(runs), args.plot)
    return 0

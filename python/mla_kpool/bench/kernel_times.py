"""Kernel time per launch of the ops and of MAX's peers on a GPU, one JSON.

``benchmarks/gpu_run.sh`` runs this after the GPU tests (``python -m
mla_kpool.bench.kernel_times --out-dir DIR`` writes
``DIR/<gpu>-<commit>.json``). Each *item* below times one call,
``CALLS`` times after ``WARMUP``, and adds medians in microseconds to the
run's ``us``:

- ``index.<workload>.{plan,score,select,launches}``: ``index_top_k``'s
  GPU path on GLM-5-Next's decode (16 x 32K tokens) and 4,096-token
  causal prefill and DeepSeek-V3.2's decode shape (:mod:`.index`), each
  launch's own time and their sum per call; ``.max_select``: MAX's select
  (``persistent_topk_block_split``, through ``benchmarks/peers``) on score
  rows of the same count, width and bounds, its output checked against a
  NumPy sort of those rows;
- ``<op>.b<batch>.{ours,builtin}`` (kernel time, the sum of the call's
  launches) and ``.ours_graph`` / ``.builtin_graph`` (``Model.execute``
  time, the two alternated call by call) for ``ring_close``,
  ``compress``, ``seed_tail`` and ``expand_topk`` at batches 64 and 4096
  (bfloat16, head_dim 128, kpool 4: :mod:`.workload`);
- ``step.b4096.{kernel,bound,ours_graph,builtin,builtin_graph}``: the
  fused step's kernel time and roofline bound (:mod:`.bounds`), and MAX's
  three builtins in one graph (``step3``).

**Kernel time** is CUPTI's record of every kernel the process launches,
read through PyTorch's profiler (``torch.profiler``, its Chrome trace's
``kernel`` events): MAX's per-execute cost (tens of microseconds) hides a
kernel's own time in a one-op graph. A call's kernels are told apart
from the next call's by count: ``CALLS`` calls of one graph launch the
same kernels each time. Without PyTorch the run records graph times only
and says why in ``errors``.

``--compile`` builds the items' graphs and exits, so the GPU script can
fill MAX's compile cache from several processes at once first.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import tempfile
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import numpy as np
from max.dtype import DType
from max.graph import DeviceRef, Graph, TensorType, ops

from .._paths import compiled_kernels
from .._sysinfo import command_line, git_commit
from . import (
    HEAD_DIM,
    _synced,
    bounds,
    index,
    index_call,
    make_runners,
    model_call,
    time_calls,
    workload,
)

__all__ = [
    "CALLS",
    "ITEMS",
    "call_kernel_us",
    "check_select",
    "main",
    "max_select_graph",
    "phase_us",
    "result_name",
    "run_items",
    "split_calls",
]

#: Timed calls per item (after :data:`WARMUP`).
CALLS = 20
#: Untimed calls first (compiled code loaded, caches warm).
WARMUP = 3
#: index_top_k's launches by a word of their kernels' names.
INDEX_LAUNCHES = {"plan": "index_plan", "score": "score", "select": "select"}
#: Workloads (name in the JSON -> (phase, shape)).
INDEX_WORKLOADS = {
    "glm5next-decode": ("decode", index.GLM5_NEXT),
    "glm5next-prefill": ("prefill", index.GLM5_NEXT),
    "dsv32-decode": ("decode", bounds.DEEPSEEK_V32),
}
WRITER_OPS = ("ring_close", "compress", "seed_tail", "expand_topk")
WRITER_BATCHES = (64, 4096)
#: MAX's select as a graph op (``benchmarks/peers``, not in the wheel).
PEERS = Path(__file__).resolve().parents[3] / "benchmarks" / "peers"

Kernels = list[tuple[str, float]]
"""A call's kernels in launch order: (name, microseconds)."""


def split_calls(events: Iterable[dict[str, Any]], calls: int) -> list[Kernels]:
    """The kernel events of ``calls`` calls of one graph, call by call.

    Args:
        events: Chrome-trace events (``cat``, ``name``, ``ts``, ``dur`` in
            microseconds); only ``cat == "kernel"`` ones count.
        calls: Calls made while they were recorded.

    Returns:
        Per call, its kernels in launch order.

    Raises:
        ValueError: If no kernel was recorded or the count is not a
            multiple of ``calls`` (the calls did not launch alike).
    """
    kernels = sorted(
        (e for e in events if e.get("cat") == "kernel"), key=lambda e: e["ts"]
    )
    if not kernels or len(kernels) % calls:
        raise ValueError(
            f"{len(kernels)} kernels recorded over {calls} calls: the"
            " profiler saw no kernels, or the calls launched differently"
        )
    per = len(kernels) // calls
    return [
        [(e["name"], float(e["dur"])) for e in kernels[i * per : (i + 1) * per]]
        for i in range(calls)
    ]


def call_kernel_us(per_call: list[Kernels]) -> float:
    """Median over calls of a call's summed kernel time (microseconds)."""
    return phase_us(per_call, "")


def phase_us(per_call: list[Kernels], word: str) -> float:
    """Median over calls of the kernels named with ``word`` (microseconds)."""
    return float(
        np.median(
            [sum(us for name, us in call if word in name) for call in per_call]
        )
    )


def profile_calls(fn: Callable[[], None], calls: int = CALLS) -> list[Kernels]:
    """``fn`` called ``WARMUP + calls`` times; the last ``calls``' kernels.

    Raises:
        ImportError: Without PyTorch.
        ValueError: From :func:`split_calls`.
    """
    from torch.profiler import ProfilerActivity, profile

    for _ in range(WARMUP):
        fn()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
    with tempfile.TemporaryDirectory() as tmp:
        trace = Path(tmp) / "trace.json"
        prof.export_chrome_trace(str(trace))
        events = json.loads(trace.read_text())["traceEvents"]
    return split_calls(events, calls)


def _graph_us(*fns: Callable[[], None]) -> list[float]:
    """Median ``Model.execute`` microseconds of each, alternated."""
    return [float(np.median(t)) for t in time_calls(*fns, warmup=WARMUP)]


class Run:
    """One run's results: ``us`` by name and ``errors`` by item."""

    def __init__(self) -> None:
        self.us: dict[str, float] = {}
        self.errors: dict[str, str] = {}

    def fail(self, name: str, error: Exception) -> None:
        """Keeps why ``name`` could not be timed."""
        self.errors[name] = f"{type(error).__name__}: {error}"

    def kernels(self, name: str, fn: Callable[[], None]) -> list[Kernels]:
        """``fn``'s kernels per call, or ``[]`` with the error kept."""
        try:
            return profile_calls(fn)
        except (ImportError, ValueError) as error:
            self.fail(name, error)
            return []


def _index_items(run: Run, runner: Any, compile_only: bool) -> None:
    """index_top_k's launches and MAX's select per workload."""
    for name, (phase, shape) in INDEX_WORKLOADS.items():
        w = index.make_index_workload(phase, shape)
        call = index_call(runner, w)
        key = f"index.{name}"
        doc = bounds.index_workload(key, *index.INDEX_PHASES[phase], shape)
        try:
            select = _max_select(runner, doc)
        except Exception as error:  # noqa: BLE001 (kept in the JSON)
            run.fail(f"{key}.max_select", error)
            select = None
        if compile_only:
            continue
        per_call = run.kernels(key, call)
        if per_call:
            run.us[f"{key}.launches"] = call_kernel_us(per_call)
            for launch, word in INDEX_LAUNCHES.items():
                run.us[f"{key}.{launch}"] = phase_us(per_call, word)
        if select is not None:
            per_call = run.kernels(f"{key}.max_select", select)
            if per_call:
                run.us[f"{key}.max_select"] = call_kernel_us(per_call)


def max_select_graph(k: int, device: Any) -> Any:
    """A graph of ``mla_kpool.max_select`` (``benchmarks/peers``).

    Inputs ``scores [rows, n]`` float32 and ``bounds [rows]`` int32 on
    ``device`` (a ``DeviceRef``); output ``[rows, k]`` int32. On a CPU the
    op raises when run (MAX's select is GPU code).
    """
    with Graph(
        f"max_select_k{k}",
        input_types=[
            TensorType(DType.float32, ["rows", "n"], device),
            TensorType(DType.int32, ["rows"], device),
        ],
        custom_extensions=[compiled_kernels(PEERS)],
    ) as g:
        rows = g.inputs[0].tensor.shape[0]
        (ids,) = ops.custom(
            "mla_kpool.max_select",
            device,
            [g.inputs[0].tensor, g.inputs[1].tensor],
            [TensorType(DType.int32, [rows, k], device)],
        )
        g.output(ids)
    return g


def _max_select(runner: Any, doc: dict[str, Any]) -> Callable[[], None]:
    """MAX's select on seeded normal scores shaped as a workload's rows.

    ``doc`` (:func:`.bounds.index_workload`) gives the rows' bounds, width
    (``candidates``, the workspace's) and ``k``; the output is checked
    once against a NumPy sort of the same rows.
    """
    seen = doc["row_bounds"]
    k = doc["params"]["k"]
    rng = np.random.default_rng(3)
    scores = rng.standard_normal((len(seen), doc["candidates"]), np.float32)
    model = runner.load(max_select_graph(k, DeviceRef.GPU()))
    args = [runner.to_device(scores), runner.to_device(seen.astype(np.int32))]
    got = runner.read(model.execute(*args)[0])
    check_select(got, scores, seen, k)
    return _synced(runner, model, args)


def check_select(
    got: np.ndarray, scores: np.ndarray, seen: np.ndarray, k: int
) -> None:
    """Checks each row: ``min(k, bound)`` ids best first, then -1.

    Best first: score descending, ties by ascending id.

    Raises:
        AssertionError: Naming the first wrong row.
    """
    for r, bound in enumerate(seen):
        row = scores[r, :bound]
        order = np.lexsort((np.arange(bound), -row))[:k]
        want = np.full(k, -1, np.int32)
        want[: len(order)] = order
        if not np.array_equal(got[r], want):
            raise AssertionError(f"MAX's select: row {r} differs")


def _writer_items(
    runners: dict[str, Any], compile_only: bool, run: Run
) -> None:
    """The four writers at each batch; the step against MAX's three ops."""
    todo = [(op, batch) for op in WRITER_OPS for batch in WRITER_BATCHES]
    for op, batch in [*todo, ("step", 4096)]:
        dtype = workload.EXPAND_DTYPE if op == "expand_topk" else "bfloat16"
        case = workload.Case(op, dtype, batch, 4, HEAD_DIM, "gpu")
        w = workload.make_workload(case)
        # MAX has no fused step: its three builtins in one graph instead.
        peer = dataclasses.replace(case, op="step3") if op == "step" else case
        ours = model_call(runners["ours"], case, w)
        builtin = model_call(runners["builtin"], peer, w)
        if compile_only:
            continue
        key = f"{op}.b{batch}"
        mine, theirs = f"{key}.ours", f"{key}.builtin"
        if op == "step":
            mine = f"{key}.kernel"
            bound = bounds.bound_seconds(
                f"step-b{batch}", runners["ours"].device.model_name
            )
            if bound is not None:
                run.us[f"{key}.bound"] = bound * 1e6
        for name, fn in ((mine, ours), (theirs, builtin)):
            per_call = run.kernels(name, fn)
            if per_call:
                run.us[name] = call_kernel_us(per_call)
        graph = _graph_us(ours, builtin)
        run.us[f"{key}.ours_graph"], run.us[f"{key}.builtin_graph"] = graph


ITEMS = ("index", "writers")
"""Item groups, each compiled by its own process with ``--compile``."""


def run_items(items: Iterable[str], compile_only: bool = False) -> Run:
    """Builds (and unless ``compile_only`` times) the items' graphs."""
    runners = make_runners("gpu")
    run = Run()
    for item in items:
        if item == "index":
            _index_items(run, runners["ours"], compile_only)
        elif item == "writers":
            _writer_items(runners, compile_only, run)
        else:
            raise ValueError(f"item must be one of {ITEMS}, got {item!r}")
    return run


def result_name(device: str, commit: str | None) -> str:
    """A results file's name: ``nvidia-h200-4f9c1a2.json`` for an H200.

    Args:
        device: The GPU's model name (``"NVIDIA H200"``).
        commit: The 40-hex commit measured (or ``None``).
    """
    gpu = "-".join(device.lower().replace("_", " ").split())
    return f"{gpu}-{(commit or 'nocommit')[:7]}.json"


def main(argv: list[str] | None = None) -> int:
    """The command line (``--help``)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--out-dir",
        type=Path,
        help="write the results to <gpu>-<short commit>.json here",
    )
    parser.add_argument("--items", nargs="+", default=list(ITEMS))
    parser.add_argument(
        "--compile", action="store_true", help="build the graphs and exit"
    )
    parser.add_argument(
        "--tests", default="", help="the GPU tests' summary line, recorded"
    )
    args = parser.parse_args(argv)
    run = run_items(args.items, compile_only=args.compile)
    if args.compile:
        return 0
    from max import driver

    commit = git_commit()
    device = driver.Accelerator().model_name
    record = {
        "device": device,
        "commit": commit[0] if commit else None,
        "dirty": commit[1] if commit else None,
        "date": datetime.date.today().isoformat(),
        "command": os.environ.get("GPU_RUN_COMMAND") or command_line(argv),
        "calls": CALLS,
        "tests": args.tests,
        "us": run.us,
        "errors": run.errors,
    }
    text = json.dumps(record, indent=1, sort_keys=True)
    if args.out_dir:
        path = args.out_dir / result_name(device, record["commit"])
        path.write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

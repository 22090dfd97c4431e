"""Kernel time per launch of the ops and of MAX's peers on a GPU, one JSON.

``benchmarks/gpu_run.sh`` runs this after the GPU tests (``python -m
mla_kpool.bench.kernel_times --json DIR/<gpu>-<commit>.json``, the
script's record; alone, ``--out-dir DIR`` writes that file). Each
*item* below times one call, ``CALLS`` times after ``WARMUP``, and adds
medians in microseconds to the run's ``us``:

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
  three builtins in one graph (``step3``);
- ``constants.<kernel>``: the kernel times of ``mla_kpool.gpu_constants``
  (``benchmarks/peers/gpu_constants.mojo``), and under the record's
  ``constants`` the cost model's constants they give, each a ``value``
  and its ``unit`` (:data:`CONSTANTS`): DRAM bandwidth, L2 latency, a
  32-way shared-memory bank conflict's and same-address atomics' time
  ratios, and a block barrier's cost.

The record is written after every item (``--json PATH``, or ``--out-dir``),
each time whole (a temporary file renamed over it), so a run killed
between items keeps what it measured; an existing file at that path (the
GPU script's record with its tests and steps) is updated, not replaced.

**Kernel time** is CUPTI's record of every kernel the process launches,
read through PyTorch's profiler (``torch.profiler``, its Chrome trace's
``kernel`` events): MAX's per-execute cost (tens of microseconds) hides a
kernel's own time in a one-op graph. A call's kernels are told apart
from the next call's by count: ``CALLS`` calls of one graph launch the
same kernels each time. Without PyTorch the run records graph times only
and says why in ``errors``.

``--compile`` builds the items' graphs and exits, so the GPU script can
fill MAX's compile cache from several processes at once first. ``--fake``
runs every item's bookkeeping with made-up numbers and no GPU (each item
sleeps ``MLA_KPOOL_FAKE_ITEM_S`` seconds, 0.05 by default): the GPU
script's CPU test runs it in place of the timings.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import tempfile
import time
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
    "CONSTANTS",
    "ITEMS",
    "Run",
    "call_kernel_us",
    "constants_from_us",
    "constants_graph",
    "check_select",
    "main",
    "max_select_graph",
    "phase_us",
    "result_name",
    "run_items",
    "split_calls",
    "write_json",
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
#: Where the profiler's trace is written for a moment (``None``: the
#: system's temporary directory); ``main`` sets it beside the record.
TRACE_DIR: Path | None = None
#: The environment variable of ``--fake``'s seconds per item.
FAKE_ITEM_ENV = "MLA_KPOOL_FAKE_ITEM_S"

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
    with tempfile.TemporaryDirectory(dir=TRACE_DIR) as tmp:
        trace = Path(tmp) / "trace.json"
        prof.export_chrome_trace(str(trace))
        events = json.loads(trace.read_text())["traceEvents"]
    return split_calls(events, calls)


def _graph_us(*fns: Callable[[], None]) -> list[float]:
    """Median ``Model.execute`` microseconds of each, alternated."""
    return [float(np.median(t)) for t in time_calls(*fns, warmup=WARMUP)]


def write_json(path: Path, record: dict[str, Any]) -> None:
    """Writes ``record`` to ``path`` whole.

    A sibling file renamed over it, so a reader (or a kill) never meets
    half a file.
    """
    tmp = path.with_name(path.name + ".part")
    tmp.write_text(json.dumps(record, indent=1, sort_keys=True) + "\n")
    os.replace(tmp, path)


class Run:
    """One run's results, kept in ``record``.

    ``us`` by name, ``errors`` by item, the cost model's ``constants`` and
    the ``items`` done; :meth:`item_done` writes the record to ``path``
    (when set) after every item.
    """

    def __init__(
        self, record: dict[str, Any] | None = None, path: Path | None = None
    ) -> None:
        self.record = record if record is not None else {}
        self.path = path
        self.us: dict[str, float] = self.record.setdefault("us", {})
        self.errors: dict[str, str] = self.record.setdefault("errors", {})
        self.constants: dict[str, Any] = self.record.setdefault("constants", {})
        self.items: list[str] = self.record.setdefault("items", [])

    def fail(self, name: str, error: Exception) -> None:
        """Keeps why ``name`` could not be timed."""
        self.errors[name] = f"{type(error).__name__}: {error}"

    def item_done(self, name: str) -> None:
        """Records that item ``name`` is done and writes the record."""
        self.items.append(name)
        if self.path is not None:
            write_json(self.path, self.record)

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
        run.item_done(key)


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
        run.item_done(key)


#: The constants item's sizes: the copy's buffers (each, far past an
#: H100's or H200's 50 MB L2), the chase's buffer (within it), the chase's
#: dependent loads and the barrier kernels' rounds.
COPY_BYTES = 256 << 20
CHAIN_BYTES = 8 << 20
CHASE_STEPS = 200_000
BARRIER_ROUNDS = 4096
#: Multiprocessors when PyTorch cannot say (an H100 SXM's 132).
DEFAULT_SMS = 132
#: Atomic words the op needs per multiprocessor (``BLOCKS_PER_SM *
#: ATOMIC_THREADS`` in ``gpu_constants.mojo``).
ATOMIC_WORDS_PER_SM = 2 * 256
#: The constants' names and units, in the order the JSON lists them.
CONSTANTS = {
    "dram_bandwidth": "GB/s (a device-to-device copy, bytes read + written)",
    "l2_latency": "ns per dependent load (pointer chase within the L2)",
    "smem_bank_conflict_32way": (
        "x (time of a 32-way shared-memory bank conflict over the same"
        " loads conflict-free)"
    ),
    "atomic_same_address_32lanes": (
        "x (time of 32 lanes' global atomics on one word over 32 words)"
    ),
    "block_barrier": "ns per barrier (1024-thread blocks, 2 per SM)",
}


def constants_graph(
    words: int, chain_words: int, sms: int, device: Any
) -> Graph:
    """A graph of ``mla_kpool.gpu_constants`` (``benchmarks/peers``).

    Inputs ``src [words]`` and ``chain [chain_words]`` uint32 on
    ``device``; outputs the copy, a sink and the atomics' words. The op
    raises on a CPU (its kernels are GPU code).
    """
    with Graph(
        "gpu_constants",
        input_types=[
            TensorType(DType.uint32, [words], device),
            TensorType(DType.uint32, [chain_words], device),
        ],
        custom_extensions=[compiled_kernels(PEERS)],
    ) as g:
        outs = ops.custom(
            "mla_kpool.gpu_constants",
            device,
            [g.inputs[0].tensor, g.inputs[1].tensor],
            [
                TensorType(DType.uint32, [words], device),
                TensorType(DType.uint32, [4], device),
                TensorType(DType.uint32, [sms * ATOMIC_WORDS_PER_SM], device),
            ],
            parameters={
                "steps": CHASE_STEPS,
                "rounds": BARRIER_ROUNDS,
                "sms": sms,
            },
        )
        g.output(*outs)
    return g


def chase_chain(chain_words: int, seed: int = 11) -> np.ndarray:
    """A random cycle through the lines of ``chain_words`` uint32 words.

    Word ``32 * line`` holds the index of the next line's first word, the
    lines in a seeded random order, so each load's address is the value
    the load before returned and no prefetcher can guess it.
    """
    lines = chain_words // 32
    order = np.random.default_rng(seed).permutation(lines).astype(np.uint32)
    order = order[np.argsort(order == 0, kind="stable")[::-1]]  # 0 first
    chain = np.zeros(chain_words, np.uint32)
    chain[order * 32] = np.roll(order, -1) * 32
    return chain


def constants_from_us(us: dict[str, float]) -> dict[str, dict[str, Any]]:
    """The cost model's constants from the op's kernel times.

    Args:
        us: Median microseconds by kernel word (``copy``, ``chase``,
            ``bank_free``, ``bank_conflict``, ``atomic_same``,
            ``atomic_distinct``, ``barrier_on``, ``barrier_off``).

    Returns:
        Each of :data:`CONSTANTS` as ``{"value": ..., "unit": ...}``; a
        constant whose kernels took no time is left out.
    """
    values = {}
    if us.get("copy"):
        values["dram_bandwidth"] = 2 * COPY_BYTES / us["copy"] / 1e3
    if us.get("chase"):
        values["l2_latency"] = us["chase"] * 1e3 / CHASE_STEPS
    if us.get("bank_free"):
        values["smem_bank_conflict_32way"] = (
            us["bank_conflict"] / us["bank_free"]
        )
    if us.get("atomic_distinct"):
        values["atomic_same_address_32lanes"] = (
            us["atomic_same"] / us["atomic_distinct"]
        )
    if "barrier_on" in us and "barrier_off" in us:
        values["block_barrier"] = (
            (us["barrier_on"] - us["barrier_off"]) * 1e3 / BARRIER_ROUNDS
        )
    return {
        name: {"value": values[name], "unit": unit}
        for name, unit in CONSTANTS.items()
        if name in values
    }


#: The op's kernels, each named ``mla_kpool_constants_<word>``.
CONSTANT_KERNELS = (
    "copy",
    "warm",
    "chase",
    "bank_free",
    "bank_conflict",
    "atomic_same",
    "atomic_distinct",
    "barrier_on",
    "barrier_off",
)


def _sm_count() -> int:
    """The GPU's multiprocessors (PyTorch's count, else :data:`DEFAULT_SMS`)."""
    try:
        import torch

        return int(torch.cuda.get_device_properties(0).multi_processor_count)
    except Exception:  # noqa: BLE001 (a default is as good here)
        return DEFAULT_SMS


def _constants_item(run: Run, runner: Any, compile_only: bool) -> None:
    """The cost model's constants, timed on the GPU (see :data:`CONSTANTS`)."""
    sms = _sm_count()
    words, chain_words = COPY_BYTES // 4, CHAIN_BYTES // 4
    model = runner.load(
        constants_graph(words, chain_words, sms, DeviceRef.GPU())
    )
    if compile_only:
        return
    args = [
        runner.to_device(np.zeros(words, np.uint32)),
        runner.to_device(chase_chain(chain_words)),
    ]
    per_call = run.kernels("constants", _synced(runner, model, args))
    if per_call:
        us = {w: phase_us(per_call, f"constants_{w}") for w in CONSTANT_KERNELS}
        for word, value in us.items():
            run.us[f"constants.{word}"] = value
        run.constants.update(constants_from_us(us))
        run.constants["sms"] = sms
    run.item_done("constants")


ITEMS = ("constants", "index", "writers")
"""Item groups, each compiled by its own process with ``--compile``."""


def _fake_items(run: Run, items: Iterable[str]) -> None:
    """``--fake``: every item's names and writes, made-up times, no GPU."""
    pause = float(os.environ.get(FAKE_ITEM_ENV, "0.05"))
    names = {
        "constants": ["constants"],
        "index": [f"index.{name}" for name in INDEX_WORKLOADS],
        "writers": [
            f"{op}.b{batch}" for op in WRITER_OPS for batch in WRITER_BATCHES
        ]
        + ["step.b4096"],
    }
    for item in items:
        for name in names[item]:
            time.sleep(pause)
            if name == "constants":
                us = {w: 100.0 + i for i, w in enumerate(CONSTANT_KERNELS)}
                run.constants.update(constants_from_us(us))
            run.us[f"{name}.fake"] = 1.0
            run.item_done(name)


def run_items(
    items: Iterable[str], compile_only: bool = False, run: Run | None = None
) -> Run:
    """Builds (and unless ``compile_only`` times) the items' graphs.

    Args:
        items: Item groups of :data:`ITEMS`, timed in that order.
        compile_only: Build the graphs only.
        run: Where results go (written after each item when it has a
            path); a new one when ``None``.
    """
    runners = make_runners("gpu")
    run = run if run is not None else Run()
    for item in items:
        if item == "index":
            _index_items(run, runners["ours"], compile_only)
        elif item == "writers":
            _writer_items(runners, compile_only, run)
        elif item == "constants":
            try:
                _constants_item(run, runners["ours"], compile_only)
            except Exception as error:  # noqa: BLE001 (kept in the JSON)
                run.fail("constants", error)
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


def _new_record(argv: list[str] | None, tests: str, fake: bool) -> dict:
    """A record's header: the GPU, commit, date, command and call count."""
    if fake:
        device = "FAKE GPU"
    else:
        from max import driver

        device = driver.Accelerator().model_name
    commit = git_commit()
    return {
        "device": device,
        "commit": commit[0] if commit else None,
        "dirty": commit[1] if commit else None,
        "date": datetime.date.today().isoformat(),
        "command": os.environ.get("GPU_RUN_COMMAND") or command_line(argv),
        "tests": tests,
    }


def main(argv: list[str] | None = None) -> int:
    """The command line (``--help``)."""
    global TRACE_DIR
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--out-dir",
        type=Path,
        help="write the results to <gpu>-<short commit>.json here",
    )
    parser.add_argument(
        "--json",
        type=Path,
        help="write (or update) the results in this file, after every item",
    )
    parser.add_argument("--items", nargs="+", default=list(ITEMS))
    parser.add_argument(
        "--compile", action="store_true", help="build the graphs and exit"
    )
    parser.add_argument(
        "--fake",
        action="store_true",
        help="made-up times, no GPU (the GPU script's CPU test)",
    )
    parser.add_argument(
        "--tests", default="", help="the GPU tests' summary line, recorded"
    )
    args = parser.parse_args(argv)
    if args.compile:
        run_items(args.items, compile_only=True)
        return 0
    path = args.json
    record = None
    if path is not None and path.is_file():
        record = json.loads(path.read_text())
    if record is None:
        record = _new_record(argv, args.tests, args.fake)
    if path is None and args.out_dir is not None:
        path = args.out_dir / result_name(record["device"], record["commit"])
    if path is not None:
        TRACE_DIR = path.parent
    record["calls"] = CALLS
    run = Run(record, path)
    if path is not None:
        write_json(path, record)
    if args.fake:
        _fake_items(run, args.items)
    else:
        run_items(args.items, run=run)
    if path is not None:
        write_json(path, record)
    print(json.dumps(record, indent=1, sort_keys=True))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

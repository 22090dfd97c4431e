"""Benchmark records read back: the ``--json`` file, the table, the plot.

A record is one configuration's measurements, as ``--json`` writes it
(see :func:`mla_kpool.bench.measure`). The table has one row per
configuration and a legend under it; its ratio columns are named for
what they divide, so each reads on its own. index_top_k records (compute,
not bytes: :func:`mla_kpool.bench.measure_index`) get a table of their own
after the writers'.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import numpy as np

from .workload import expand_pool_topk, tokens_per_request

Record = dict[str, Any]
#: Table value columns: (header, the value of one record or None).
Columns = tuple[tuple[str, Callable[[Record], float | None]], ...]

#: Record fields the table and the plot need.
TABLE_FIELDS = tuple(
    "op dtype batch kpool median_us gbps memcpy_gbps floor_median_us"
    " numpy_median_us".split()
)

#: Record fields the index_top_k table needs.
INDEX_TABLE_FIELDS = tuple(
    "op phase batch kpool tokens candidates median_us gflops"
    " numpy_median_us blas_gflops".split()
)

#: What makes two records the same configuration (across runs).
CONFIG = (
    "op", "dtype", "batch", "kpool", "head_dim", "device", "phase", "scorer",
)  # fmt: skip


def is_index(record: Record) -> bool:
    """Whether ``record`` is an index_top_k measurement."""
    return record.get("op") == "index_top_k"


def _builtin_over_op(r: Record) -> float | None:
    builtin = r.get("builtin_median_us")
    return None if builtin is None else builtin / r["median_us"]


#: The table's value columns: (header, the value of one record or None).
COLUMNS: Columns = (
    ("op us", lambda r: r["median_us"]),
    ("GB/s", lambda r: r["gbps"]),
    ("% of memcpy", lambda r: 100 * r["gbps"] / r["memcpy_gbps"]),
    ("floor us", lambda r: r["floor_median_us"]),
    ("op/floor", lambda r: r["median_us"] / r["floor_median_us"]),
    ("numpy us", lambda r: r["numpy_median_us"]),
    ("numpy/op", lambda r: r["numpy_median_us"] / r["median_us"]),
    ("builtin us", lambda r: r.get("builtin_median_us")),
    ("builtin/op", _builtin_over_op),
)

#: The bound columns, shown when a record has a bound (a GPU the bench
#: knows; :func:`mla_kpool.bench.gpu_bound`), for each table.
BOUND_COLUMNS: Columns = (
    ("bound us", lambda r: r.get("bound_us")),
    ("x bound", lambda r: r.get("x_bound")),
)
INDEX_BOUND_COLUMNS: Columns = (
    ("bound ms", lambda r: r.get("bound_us") and r["bound_us"] * 1e-3),
    ("x bound", lambda r: r.get("x_bound")),
)

#: The legend's line for the bound columns.
BOUND_LEGEND = (
    "bound: the roofline's lower bound on this GPU, max(bytes / its HBM"
    " bandwidth, flops / its FP32 peak) (mla_kpool.bench.bounds)."
    " x bound: the op's time over it (1: at the bound)."
)


def _has_bound(runs: list[list[Record]]) -> bool:
    return any(r.get("bound_us") is not None for rs in runs for r in rs)


#: The legend printed under the table (the builtin line with its columns).
LEGEND = (
    "op us: the op's median time per call, in microseconds. In brackets:"
    " its p10-p90 over the calls of one run; over several runs, the range"
    " of the runs' values (every column).",
    "GB/s: bytes the op must read and write / op us. % of memcpy: that"
    " GB/s over np.copyto's on this machine.",
    "floor us: the same graph with no-op kernels, MAX's own cost per call."
    " op/floor: op us / floor us (1: the op adds nothing to that cost).",
    "numpy us: the same work as vectorised NumPy. numpy/op: numpy us / op"
    " us (above 1: the op is that many times faster).",
    "builtin us: MAX's own GPU kernel. builtin/op: builtin us / op us"
    " (above 1: the op is that many times faster).",
)

#: The index_top_k table's value columns.
INDEX_COLUMNS: Columns = (
    ("op ms", lambda r: r["median_us"] / 1e3),
    ("GFLOP/s", lambda r: r["gflops"]),
    ("numpy ms", lambda r: r["numpy_median_us"] / 1e3),
    ("numpy/op", lambda r: r["numpy_median_us"] / r["median_us"]),
    ("BLAS GFLOP/s", lambda r: r["blas_gflops"]),
    ("% of BLAS", lambda r: 100 * r["gflops"] / r["blas_gflops"]),
    ("% FP32 peak", lambda r: r.get("pct_fp32_peak")),
    ("% FP8 peak", lambda r: r.get("pct_fp8_peak")),
    ("% HBM", lambda r: r.get("pct_hbm")),
)

#: The last columns of :data:`INDEX_COLUMNS`, shown when a record has them
#: (a run on a GPU whose peaks the bench knows).
INDEX_GPU_COLUMNS = 3

#: The legend under the index_top_k table.
INDEX_LEGEND = (
    "op ms: index_top_k's median time per call. In brackets: the fastest"
    " and slowest of the run's calls (at least 5); over several runs, the"
    " range of the runs' values (every column). The op, the twin and BLAS"
    " take turns, each timed round after a 0.25 s pause that lets"
    " OpenBLAS's threads stop spinning (about 0.1 s after a call) before"
    " the op runs.",
    "GFLOP/s: 2 * H * D flops per visible candidate, summed over the query"
    " tokens (candidates), / op ms.",
    "numpy ms: the NumPy twin (FP8 decoded with ml_dtypes, a BLAS matmul,"
    " ReLU, weighted head sum, argpartition). numpy/op: numpy ms / op ms"
    " (above 1: the op is that many times faster).",
    "BLAS GFLOP/s: NumPy's float32 matmul on the twin's score shapes alone,"
    " this run. % of BLAS: GFLOP/s over it.",
)

#: The legend's line for the GPU columns.
INDEX_GPU_LEGEND = (
    "% FP32 peak, % FP8 peak: GFLOP/s over the GPU's published FP32 and"
    " dense FP8 TFLOP/s. % HBM: the least bytes a call moves (each"
    " request's visible keys and scales once, the queries, the output) /"
    " op ms, over its published memory bandwidth."
)

PLOT_MISSING = (
    "--plot needs matplotlib, which is not installed: pip install "
    "matplotlib (or pip install 'mla-kpool[plot]')"
)


class ResultsError(Exception):
    """A ``--markdown`` file that cannot be read as benchmark records."""


def check_same_form(runs: list[list[Record]], paths: list[str]) -> None:
    """Refuses runs of different CPU path forms as repeats of one another.

    Args:
        runs: Each file's records.
        paths: The files, for the message.

    Raises:
        ResultsError: If the files disagree in ``cpu_amx`` (one timed the
            AMX blocks, another the vector blocks): their medians would mix
            two forms of the op.
    """
    forms = {
        path: {r.get("cpu_amx") for r in records}
        for path, records in zip(paths, runs, strict=True)
    }
    seen = set().union(*forms.values()) if forms else set()
    if len(seen) > 1:
        listed = "; ".join(
            f"{path}: cpu_amx {', '.join(map(str, sorted(form, key=str)))}"
            for path, form in forms.items()
        )
        raise ResultsError(
            "the files timed different forms of the CPU path (AMX blocks on"
            f" and off), so they are not repeats of one run: {listed}"
        )


def load_records(path: str) -> list[Record]:
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
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except OSError as err:
        raise ResultsError(f"{path}: cannot read: {err.strerror}") from err
    except UnicodeDecodeError as err:
        raise ResultsError(
            f"{path}: not UTF-8 text (byte {err.start}): --json writes JSON"
        ) from err
    except json.JSONDecodeError as err:
        raise ResultsError(f"{path}: not valid JSON: {err}") from err
    if not data or not isinstance(data, list):
        raise ResultsError(
            f"{path}: must be a non-empty JSON list of records, as --json"
            " writes"
        )
    if not all(isinstance(r, dict) for r in data):
        raise ResultsError(
            f"{path}: must be a JSON list of records, as --json writes"
        )
    for i, record in enumerate(data):
        fields = INDEX_TABLE_FIELDS if is_index(record) else TABLE_FIELDS
        missing = [k for k in fields if k not in record]
        if missing:
            raise ResultsError(
                f"{path}: record {i} lacks {', '.join(map(repr, missing))}"
            )
    return data


def _num(value: float) -> str:
    """Three significant digits, whole numbers from 1000 on (no exponent)."""
    return f"{value:.0f}" if abs(value) >= 1000 else f"{value:.3g}"


def _cell(values: list[float], percent: bool) -> str:
    """``median (min-max)`` of ``values``; the value alone if only one."""
    fmt = (lambda x: f"{x:.0f}%") if percent else _num
    mid = fmt(float(np.median(values)))
    if len(values) < 2:
        return mid
    return f"{mid} ({fmt(min(values))}-{fmt(max(values))})"


def _by_config(runs: list[list[Record]]) -> dict[tuple[Any, ...], list[Record]]:
    """Records of all runs grouped by :data:`CONFIG`, in first-seen order."""
    grouped: dict[tuple[Any, ...], list[Record]] = {}
    for records in runs:
        for r in records:
            grouped.setdefault(tuple(r.get(k) for k in CONFIG), []).append(r)
    return grouped


def format_table(runs: list[list[Record]]) -> str:
    """The results tables of one run's records, or of repeated runs'.

    The writers' and expand_topk's table (:func:`format_op_table`), then
    index_top_k's (:func:`format_index_table`), each with its legend; the
    sentence saying where it was measured comes first, once.
    """
    ops = [[r for r in rs if not is_index(r)] for rs in runs]
    index = [[r for r in rs if is_index(r)] for rs in runs]
    first = next((records[0] for records in runs if records), {})
    blas = next((r["blas"] for rs in runs for r in rs if r.get("blas")), None)
    where = _provenance(first | {"blas": blas})
    if where and len(runs) > 1:
        where = where[:-1] + f"; {len(runs)} runs, medians and (ranges)."
    parts = [where]
    if any(ops) or not any(index):
        parts.append(format_op_table(ops))
    if any(index):
        parts.append(format_index_table(index))
    return "\n\n".join(part for part in parts if part)


def _lined_up(head: list[str], body: list[list[str]], text: int) -> str:
    """A markdown table, the first ``text`` columns left-aligned."""
    widths = [max(map(len, cells)) for cells in zip(head, *body, strict=True)]
    rule = [
        "-" * w if i < text else "-" * (w - 1) + ":"
        for i, w in enumerate(widths)
    ]
    lines = []
    for row in [head, rule, *body]:
        cells = [
            cell.ljust(w) if i < text else cell.rjust(w)
            for i, (cell, w) in enumerate(zip(row, widths, strict=True))
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def call_legend(records: list[Record]) -> str:
    """The legend's line saying what one row's call holds, per op and kpool.

    From :func:`.workload.tokens_per_request`: the tokens each request
    brings and those pending in its ring; expand_topk's selections.
    """
    held = {}
    for r in records:
        pending, new = tokens_per_request(r["op"], r["kpool"])
        what = f"{new} new tokens onto {pending} pending in its ring"
        if r["op"] == "expand_topk":
            what = (
                f"1 query token selecting {expand_pool_topk(r['kpool'])} pools"
            )
        dim = f", head_dim {r['head_dim']}" if "head_dim" in r else ""
        held[f"{r['op']} at kpool {r['kpool']}{dim}: {what}"] = None
    return "call: batch requests; per request, " + "; ".join(held) + "."


def index_call_legend(records: list[Record]) -> str:
    """The index table's line saying what one row's call holds."""
    r = records[0]
    heads, dim, top_k = (r.get(k, "?") for k in ("heads", "head_dim", "top_k"))
    return (
        "call: tokens query tokens over batch requests; each token scores its"
        f" request's visible pools (kpool {r['kpool']}) with {heads} heads of"
        f" head_dim {dim} and selects the top {top_k}."
    )


def format_index_table(runs: list[list[Record]]) -> str:
    """index_top_k's table: one row per phase (and GPU scorer), then its legend.

    As :func:`format_op_table`: each value computed within its run, the
    median over runs with their range; a single run's ``op ms`` shows the
    fastest and slowest call in brackets.
    """
    several = len(runs) > 1
    gpu = any(r.get("pct_fp32_peak") is not None for r in sum(runs, []))
    columns = INDEX_COLUMNS if gpu else INDEX_COLUMNS[:-INDEX_GPU_COLUMNS]
    bound = _has_bound(runs)
    columns += INDEX_BOUND_COLUMNS if bound else ()
    head = ["phase", "batch", "tokens", "candidates", *["runs"] * several]
    head += [name for name, _ in columns]
    body = []
    for rs in _by_config(runs).values():
        r = rs[0]
        phase = r["phase"] + (f" ({r['scorer']})" if r.get("scorer") else "")
        row = [phase, str(r["batch"]), str(r["tokens"])]
        row += [str(r["candidates"])] + [str(len(rs))] * several
        for name, value in columns:
            values = [v for v in map(value, rs) if v is not None]
            row.append(_cell(values, name[0] == "%") if values else "-")
        if not several and r.get("min_us") is not None:
            row[4] += f" ({_num(r['min_us'] / 1e3)}-{_num(r['max_us'] / 1e3)})"
        body.append(row)
    lines = (index_call_legend(sum(runs, [])), *INDEX_LEGEND)
    lines += (INDEX_GPU_LEGEND,) if gpu else ()
    lines += (BOUND_LEGEND,) if bound else ()
    legend = "\n".join(f"- {text}" for text in lines)
    return _lined_up(head, body, 1) + "\n\n" + legend


def format_op_table(runs: list[list[Record]]) -> str:
    """The writers' and expand_topk's table of one run or repeated runs.

    One row per configuration. Every value is computed within each run (a
    ratio compares an op with its floor, NumPy twin or memcpy of the same
    run) and shown as the median over the runs that measured it, with
    their range in brackets and a ``runs`` column saying how many; a
    single run's ``op us`` shows its p10-p90 in brackets instead, when the
    record has them. The builtin columns appear when a record has a
    builtin time.

    Args:
        runs: One list of records per run.

    Returns:
        Markdown, its columns padded to line up in a terminal: the table,
        then the legend (:data:`LEGEND`).
    """
    several = len(runs) > 1
    builtin = any(r.get("builtin_median_us") is not None for r in sum(runs, []))
    columns = COLUMNS if builtin else COLUMNS[:-2]
    bound = _has_bound(runs)
    columns += BOUND_COLUMNS if bound else ()
    head = ["op", "dtype", "batch", "kpool", *["runs"] * several]
    head += [name for name, _ in columns]
    body = []
    for config, rs in _by_config(runs).items():
        row = [str(v) for v in config[:4]] + [str(len(rs))] * several
        for name, value in columns:
            values = [v for v in map(value, rs) if v is not None]
            row.append(_cell(values, name[0] == "%") if values else "-")
        if not several and rs[0].get("p10_us") is not None:
            row[4] += f" ({_num(rs[0]['p10_us'])}-{_num(rs[0]['p90_us'])})"
        body.append(row)
    lines = (call_legend(sum(runs, [])), *LEGEND[: 5 if builtin else 4])
    lines += (BOUND_LEGEND,) if bound else ()
    legend = [f"- {text}" for text in lines]
    return _lined_up(head, body, 2) + "\n\n" + "\n".join(legend)


def median_records(runs: list[list[Record]]) -> list[Record]:
    """One record per configuration, its numbers the medians over ``runs``."""
    merged = []
    for rs in _by_config(runs).values():
        record = dict(rs[0])
        for key in ("median_us", "gbps", "memcpy_gbps", "gflops"):
            if all(key in r for r in rs):
                record[key] = float(np.median([r[key] for r in rs]))
        merged.append(record)
    return merged


def _provenance(r: Record) -> str:
    """One sentence: where and how a record was measured.

    Device, cores, the CPU's instruction sets (on a CPU), versions,
    commit, NumPy's BLAS kernel (when a record names it) and command.
    """
    about = [f"{r['cores']} cores"] if r.get("cores") else []
    if r.get("cpu_isa") and r.get("device_name") == r.get("cpu_model"):
        about.append(", ".join(r["cpu_isa"]))
        if "AMX" in r["cpu_isa"] and "cpu_amx" in r:
            about.append("AMX blocks on" if r["cpu_amx"] else "AMX blocks off")
    detail = f" ({'; '.join(about)})" if about else ""
    parts = [f"{r['device_name']}{detail}"] if r.get("device_name") else []
    for key, name in (("max_version", "MAX"), ("mojo_version", "Mojo")):
        parts += [f"{name} {r[key]}"] if r.get(key) else []
    if r.get("git_commit"):
        dirty = " with local changes" if r.get("git_dirty") else ""
        parts.append(f"commit {r['git_commit'][:12]}{dirty}")
    blas = r.get("blas")
    if blas and blas.get("architecture"):
        threads = blas.get("num_threads")
        parts.append(
            f"NumPy's BLAS {blas.get('internal_api') or ''} "
            f"{blas.get('version') or ''} with its {blas['architecture']}"
            f" kernel{f' on {threads} threads' if threads else ''}".replace(
                "  ", " "
            )
        )
    text = "Measured on " + ", ".join(parts) if parts else ""
    if r.get("command"):
        text += (": " if text else "") + f"`{r['command']}`"
    return text + "." if text else ""


def import_pyplot() -> Any:
    """``matplotlib.pyplot`` on the file-only Agg backend.

    Raises:
        ImportError: If matplotlib is not installed.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot(records: list[Record], path: str) -> None:
    """Draws GB/s against batch, one panel per op, to an image file.

    index_top_k records (GFLOP/s, its phases, no batch axis) are left out.

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
    plt = import_pyplot()
    records = [r for r in records if not is_index(r)]
    ops = list(dict.fromkeys(r["op"] for r in records)) or [""]
    fig, axes = plt.subplots(
        1, len(ops), figsize=(4.2 * len(ops), 3.8), squeeze=False, sharey=True
    )
    for ax, op in zip(axes[0], ops, strict=True):
        mine = [r for r in records if r["op"] == op]
        for series in dict.fromkeys((r["dtype"], r["kpool"]) for r in mine):
            points = sorted(
                (r["batch"], r["gbps"])
                for r in mine
                if (r["dtype"], r["kpool"]) == series
            )
            label = f"{series[0]}, kpool {series[1]}"
            ax.plot(*zip(*points, strict=True), marker="o", label=label)
        batches = sorted({r["batch"] for r in mine})
        memcpy = [
            np.median([r["memcpy_gbps"] for r in mine if r["batch"] == b])
            for b in batches
        ]
        ax.plot(batches, memcpy, "k--", label="memcpy")
        ax.set_xscale("log", base=2)
        ax.set_xticks(batches, [str(b) for b in batches])
        ax.set(title=op, xlabel="batch (requests per call)")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7)
    axes[0][0].set_ylabel("GB/s (bytes read + written / median)")
    if records and records[0].get("device_name"):
        fig.suptitle(f"mla-kpool bench on {records[0]['device_name']}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)

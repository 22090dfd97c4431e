"""A run's numbers: the dict ``--json`` writes, and the table printed."""

from __future__ import annotations

import math
import statistics
from dataclasses import asdict
from typing import Any

from ..reference import tolerance
from .checked_run import Config
from .checks import Totals, plural
from .indexing import (
    INDEX_HEADS,
    INDEX_PAGE_SIZE,
    index_layout,
    index_scorer,
)
from .scheduling import Plan

__all__ = ["format_summary", "summarize"]


def summarize(
    config: Config,
    plan_: Plan,
    totals: Totals,
    compile_s: float,
    wall_s: float,
    fault: str | None,
    package_s: float = 0.0,
    *,
    models: str | None = None,
    cache_files_added: int | None = None,
    idle_s: float | None = None,
) -> dict[str, Any]:
    """The run's numbers, as the demo prints them and writes with ``--json``.

    Args:
        config: The run's configuration.
        plan_: Its plan.
        totals: What :func:`serve` counted.
        compile_s: Seconds spent compiling: the Mojo kernels and the
            models.
        wall_s: Seconds the whole run took.
        fault: The injected fault's description, or ``None``.
        package_s: Of ``compile_s``, the seconds the Mojo kernels took to
            precompile (paid by every run; the models come from MAX's
            compile cache once compiled).
        models: Where the models came from
            (:func:`mla_kpool.demo.cli.models_source`): ``"compiled"``,
            ``"loaded"`` (from MAX's cache), ``"in runner"``, or ``None``
            (not known).
        cache_files_added: Files MAX's graph cache gained while the
            models were compiled or loaded; ``None`` if not known.
        idle_s: :func:`mla_kpool.demo.checked_run.idle_model_seconds`:
            the shared model with every op idle, ``None`` where each op's
            model is its own.

    Returns:
        A JSON-ready dict: configuration, token, call and pool counts, the
        worst error against the oracle, index_top_k's scorer (op, code path
        and grid: :func:`mla_kpool.demo.indexing.index_scorer`), counts
        and worst margin, expand_topk counts, timings (each op's mean is
        the wall time of its ``Runner`` call: copies in and out, and the
        model's other ops idle where the three share one model), where the
        models came from, the problems, and (with speculation) verify-step
        counts.
    """
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
    layout, _ = index_layout(config.kpool, config.head_dim, INDEX_PAGE_SIZE)
    margin = totals.index_worst_margin
    fields = asdict(config) | {"dtype": config.dtype.name}
    del fields["spec_tokens"]  # under "speculative"
    if config.schedule:  # the file's calls, or its requests, set batching
        fields |= {"token_budget": None, "chunk": None}
    summary = {
        "ok": not totals.problems,
        "config": fields,
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
            r.end // config.kpool - r.cached_prefix // config.kpool
            for r in reqs
        ),
        "pools_ring_close": totals.ring_close,
        "pools_compress": totals.compress,
        "pools_checked": totals.checked_pools,
        "max_abs_error": totals.max_abs_error,
        "max_error_over_tolerance": totals.worst_ratio,
        "tolerance": tolerance(config.dtype),
        "index_top_k": {
            **index_scorer(config.device, config.kpool),
            "heads": INDEX_HEADS,
            "layout": layout,
            "page_size": INDEX_PAGE_SIZE,
            "rows": totals.index_rows,
            "rows_checked": totals.index_checked,
            "selections_checked": totals.index_selections,
            "worst_margin": margin if math.isfinite(margin) else None,
            "failed_calls": totals.index_failures,
            "mean_call_seconds": _mean(totals.index_seconds),
        },
        "expand_topk": {
            "rows_expanded": totals.expand_rows,
            "rows_checked": totals.expand_checked,
            "mismatches": totals.expand_mismatches,
            "skipped_ids": totals.expand_skipped_ids,
            "mean_call_seconds": _mean(totals.expand_seconds),
        },
        "mean_call_seconds": step_s / calls,
        "median_call_seconds": statistics.median(totals.call_seconds),
        "tokens_per_second": tokens / step_s if step_s > 0 else None,
        "idle_model_seconds": idle_s,
        "compile_seconds": compile_s,
        "kernel_package_seconds": package_s,
        "models": models,
        "graph_cache_files_added": cache_files_added,
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


def _mean(seconds: list[float]) -> float | None:
    return statistics.fmean(seconds) if seconds else None


#: The scorer row's note, by ``(op, grid)`` of
#: :func:`mla_kpool.demo.indexing.index_scorer`.
_SCORERS = {
    ("mla_kpool", "-"): "mla_kpool.index_top_k's CPU kernel",
    ("mla_kpool", "device"): "mla_kpool.index_top_k's GPU kernels",
    ("mla_kpool", "emulated"): (
        "mla_kpool.index_top_k's GPU kernels over the emulated grid, on the "
        "host"
    ),
    ("max", "device"): "MAX's builtin GPU op, which scores this shape here",
}


def _ms(seconds: float | None) -> str:
    return f"{1e3 * seconds:.3f} ms" if seconds is not None else "-"


def _idle_row(idle_s: float | None) -> tuple[str, str, str]:
    """The row that says what the times above hold besides each op."""
    if idle_s is None:
        return (
            "  idle ops in them",
            "none",
            "each op's model is compiled alone on this device",
        )
    return (
        "  idle ops at most",
        _ms(idle_s),
        "the three ops are one compiled model, so each call above also "
        "runs the other two on idle operands; this is that model with all "
        "three idle (median of 5 runs)",
    )


def _models_note(models: str | None, added: int | None) -> str:
    """The compile row's word on where the models came from."""
    if models == "compiled":
        files = plural(added or 0, "file")
        return f"compiled now (MAX's graph cache gained {files})"
    if models == "loaded":
        return "loaded from MAX's graph cache (it gained no file)"
    if models == "in runner":
        return "already compiled in the runner given"
    return "compiled or loaded (not known)"


def format_summary(s: dict[str, Any]) -> str:
    """The summary table the demo prints."""
    cfg, spec, ex = s["config"], s.get("speculative"), s["expand_topk"]
    ix = s["index_top_k"]
    head = (
        f"mla-kpool demo: {cfg['dtype']}, kpool {cfg['kpool']}, head_dim "
        f"{cfg['head_dim']}, {cfg['device']}, seed {cfg['seed']}"
    )
    if cfg["schedule"]:
        head += f", schedule {cfg['schedule']}"
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
    ]
    pools = f"expected {s['pools_expected']}, checked {s['pools_checked']}"
    if spec:
        rows.append(
            (
                "verify steps",
                f"{spec['verify_steps']}",
                f"{spec['draft_tokens']} drafts, {spec['accepted_drafts']} "
                f"accepted; {spec['verify_steps_all_rejected']} kept no "
                f"draft, {spec['verify_steps_all_accepted']} kept all",
            )
        )
        pools = (
            f"rows written; expected {s['pools_expected']} pool ids, final "
            f"rows checked {s['pools_checked']}"
        )
    rows += [
        ("pools", f"{s['pools']}", pools),
        ("  closed by ring_close", f"{s['pools_ring_close']}", ""),
        ("  built by compress", f"{s['pools_compress']}", ""),
    ]
    if spec:
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
    tps = s["tokens_per_second"]
    margin = ix["worst_margin"]
    rows += [
        ("index_top_k scorer", ix["path"], _SCORERS[ix["op"], ix["grid"]]),
        (
            "index_top_k rows",
            f"{ix['rows']}",
            f"checked {ix['rows_checked']}: "
            f"{plural(ix['selections_checked'], 'selection')} of the top "
            f"{cfg['pool_topk']} among more pools, the rest every visible "
            f"pool; H {ix['heads']}, {ix['layout']} FP8 cache, "
            f"{cfg['index_mask']} mask",
        ),
        (
            "  worst margin",
            f"{margin:.3g}" if margin is not None else "-",
            "at the k-th score, tolerance included (score units; below 0 "
            "fails)",
        ),
        (
            "expand_topk rows",
            f"{ex['rows_expanded']}",
            f"checked {ex['rows_checked']}, {ex['mismatches']} "
            f"differ{'s' if ex['mismatches'] == 1 else ''} from "
            f"the oracle; {ex['skipped_ids']} selected ids past the query "
            "that the op must skip",
        ),
        (
            "max abs error vs oracle",
            f"{s['max_abs_error']:.3g}",
            f"worst pool at {s['max_error_over_tolerance']:.3g} of its "
            f"tolerance ({s['tolerance']:g} x max |k|)",
        ),
        (
            "mean time per call",
            f"{1e3 * s['mean_call_seconds']:.3f} ms",
            f"the step: median {1e3 * s['median_call_seconds']:.3f} ms; "
            f"mean index_top_k {_ms(ix['mean_call_seconds'])}, expand_topk "
            f"{_ms(ex['mean_call_seconds'])}; each the wall time of its "
            "Runner call: operand checks, copies in and out, the model run",
        ),
        _idle_row(s["idle_model_seconds"]),
        (
            "tokens per second",
            f"{tps:,.0f}" if tps else "-",
            "tokens / time in Runner.step",
        ),
        (
            "compile",
            f"{s['compile_seconds']:.1f} s",
            f"Mojo kernels {s['kernel_package_seconds']:.1f} s, every run; "
            "step, expand_topk and index_top_k models "
            + _models_note(s["models"], s["graph_cache_files_added"]),
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
            "stream; every index_top_k row selects the oracle's top "
            f"{cfg['pool_topk']}; every expand_topk row matches the oracle"
        )
    elif s["ok"]:
        lines.append(
            "result: OK, every pool of every request came out exactly once "
            "and matches the oracle; every index_top_k row selects the "
            f"oracle's top {cfg['pool_topk']}; every expand_topk row matches "
            "the oracle"
        )
    else:
        problems = plural(len(s["problems"]), "problem")
        lines.append(f"result: FAILED, {problems} (above)")
    return "\n".join(lines)

"""The command line: ``python -m mla_kpool demo`` runs and their counts.

The demo runs in-process on small workloads with the suite's shared CPU runner,
which compiles each configuration's step, expand_topk and index_top_k as one
graph (bfloat16 and float32 at kpool 4, head_dim 128). Its counts are checked
against numbers derived here from the schedule and the op contracts (pools per
request, pools ring_close must close, indexer rows that must choose), not
against the demo's own bookkeeping. Every run also scores every query token
with index_top_k on one indexer model (GLM-5-Next's: H 32, W 32, top 512, null
mask), on the step's device: the gpu-emulated run scores with the op's GPU
path, and its summary must say so. ``--inject-fault`` must make it fail on
exactly the corrupted pool or row. ``--spec-tokens 7`` runs on the bfloat16
step model with a 12-entry ring; its pool counts (rows written, rewritten after
a rejection, dropped past the end) are derived from the plan's accepted counts
and the contracts' pool rule.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
from max import driver

from mla_kpool import __main__ as cli
from mla_kpool.demo import cli as demo
from mla_kpool.demo import scheduling, workload
from mla_kpool.runner import Runner
from support.demo_cases import KPOOL, LONG, SMALL, demo_plan, write


def expected_counts(sched: dict[str, Any]) -> dict[str, int]:
    """Counts a correct run must report, from the op contracts alone."""
    kpool = sched["kpool"]
    reqs = sched["requests"]
    seen = [r.get("cached_prefix", 0) for r in reqs]
    ring_close = 0
    for call in sched["calls"]:
        for i, n in call:
            c = seen[i]
            # ring_close: a pending pool (c % kpool != 0) closes when the call
            # brings the rest of it.
            if c % kpool and c + n >= (c // kpool + 1) * kpool:
                ring_close += 1
            seen[i] += n
    length = [r["prompt"] + r.get("generate", 0) for r in reqs]
    prefix = [r.get("cached_prefix", 0) for r in reqs]
    pools = sum(
        length[i] // kpool - prefix[i] // kpool for i in range(len(reqs))
    )
    return {
        "requests": len(reqs),
        "tokens": sum(length) - sum(prefix),
        "calls": len(sched["calls"]),
        "pools": pools,
        "ring_close": ring_close,
        "compress": pools - ring_close,
    }


def table(stdout: str) -> dict[str, str]:
    """The summary table's rows: label -> value (first column)."""
    rows = {}
    for line in stdout.splitlines():
        m = re.match(r"^\s*([a-z_ ]+?)\s{2,}(\S+( ms| s)?)", line)
        if m:
            rows[m.group(1).strip()] = m.group(2)
    return rows


@pytest.fixture
def run_demo(runners: Callable[[str], Runner]) -> Callable[..., int]:
    """``run_demo(argv, device="cpu")``: the demo on the session's runner."""

    def run(argv: list[str], device: str = "cpu") -> int:
        return demo.main(
            ["--no-progress", "--device", device, *argv],
            runner=runners(device),
        )

    return run


# --------------------------------------------------------------------------
# Demo runs
# --------------------------------------------------------------------------


def test_small_schedule_counts_every_pool(tmp_path, capsys, run_demo):
    path = write(tmp_path, SMALL)
    out_json = tmp_path / "summary.json"
    status = run_demo(["--schedule", str(path), "--json", str(out_json)])
    out = capsys.readouterr().out
    assert status == 0, out
    want = expected_counts(SMALL)
    rows = table(out)
    assert int(rows["requests"]) == want["requests"]
    assert int(rows["tokens"]) == want["tokens"] == 728
    assert int(rows["calls"]) == want["calls"]
    assert int(rows["pools"]) == want["pools"] == 180
    assert int(rows["closed by ring_close"]) == want["ring_close"]
    assert int(rows["built by compress"]) == want["compress"]
    # expand_topk: one row per query token the calls brought.
    assert int(rows["expand_topk rows"]) == want["tokens"]
    assert f"checked {want['tokens']}, 0 differ" in out
    assert "result: OK" in out
    assert "FAIL" not in out

    summary = json.loads(out_json.read_text())
    assert summary["ok"] is True
    assert summary["pools_checked"] == want["pools"]
    assert summary["pools_expected"] == want["pools"]
    # Request 3 joins after request 2 left, in the only free slot.
    assert summary["slot_reuses"] == 1
    assert summary["decode_tokens"] == 5 + 3 + 4
    assert summary["max_error_over_tolerance"] < 1.0
    assert summary["config"]["dtype"] == "bfloat16"
    expand = summary["expand_topk"]
    assert expand["rows_expanded"] == expand["rows_checked"] == 728
    assert expand["mismatches"] == 0
    # The null mask: a prefill row's selection names the call's later
    # pools, which expand_topk must skip.
    assert expand["skipped_ids"] == null_mask_skips(SMALL)
    index = summary["index_top_k"]
    assert index["rows"] == index["rows_checked"] == 728
    assert index["selections_checked"] == 0  # no request sees 512 pools
    assert index["worst_margin"] is None and index["failed_calls"] == 0
    assert (index["heads"], index["layout"]) == (32, "spread")
    assert "index_top_k rows" in rows and rows["worst margin"] == "-"
    # On cpu the scorer is the op's CPU kernel.
    assert (index["op"], index["path"], index["grid"]) == (
        "mla_kpool",
        "cpu",
        "-",
    )
    assert rows["index_top_k scorer"] == "cpu"


def test_second_run_says_its_models_were_in_the_runner(
    tmp_path, capsys, run_demo
):
    # Two runs on the session's runner: the second finds the three models
    # compiled already, so it neither compiles nor loads them.
    path = write(tmp_path, SMALL)
    first, second = tmp_path / "first.json", tmp_path / "second.json"
    assert run_demo(["--schedule", str(path), "--json", str(first)]) == 0
    capsys.readouterr()
    assert run_demo(["--schedule", str(path), "--json", str(second)]) == 0
    out = capsys.readouterr().out
    s = json.loads(second.read_text())
    assert s["models"] == "in runner" and s["graph_cache_files_added"] == 0
    assert "models already compiled in the runner given" in out
    assert json.loads(first.read_text())["models"] in (
        "compiled",
        "loaded",
        "in runner",
    )
    # On the CPU the three ops are one model: its all-idle run was timed,
    # and is a small part of a step call.
    idle = s["idle_model_seconds"]
    assert 0 < idle < s["mean_call_seconds"]
    assert f"{1e3 * idle:.3f} ms" in table(out)["idle ops at most"]


def test_progress_lines_when_stderr_is_not_a_terminal(
    tmp_path, capsys, runners
):
    # Without --no-progress and with stderr captured (not a terminal): the
    # compile message with its honest range, a line once the models are
    # ready, and a progress line when the last call is done.
    path = write(tmp_path, SMALL)
    status = demo.main(["--schedule", str(path)], runner=runners("cpu"))
    assert status == 0
    text = capsys.readouterr().err
    # No bar: it would redraw its line with carriage returns.
    assert "\r" not in text
    err = text.splitlines()
    (compiling,) = [line for line in err if line.startswith("compiling")]
    assert compiling.endswith(
        "the first run compiles them into MAX's cache (~/.cache/modular by "
        "default), about 15 s on a 2-core machine alone, 1-3 min on a busy "
        "or slower one; later runs load them from it in a few seconds..."
    )
    calls, requests = len(SMALL["calls"]), len(SMALL["requests"])
    ready = err.index(next(line for line in err if line.startswith("models ")))
    assert re.fullmatch(
        r"models (compiled into MAX's cache|loaded from MAX's cache|already "
        r"compiled in the runner given) \(\d+\.\d s\); "
        rf"running {calls} calls, a progress line every 10 s\.\.\.",
        err[ready],
    ), err[ready]
    lines = [line for line in err[ready + 1 :] if line.startswith("demo: ")]
    assert lines, err
    assert re.fullmatch(
        rf"demo: {calls}/{calls} calls, {requests}/{requests} requests "
        r"checked, \d+ s",
        lines[-1],
    ), lines[-1]
    # --no-progress: no progress line.
    status = demo.main(
        ["--schedule", str(path), "--no-progress"], runner=runners("cpu")
    )
    assert status == 0
    err = capsys.readouterr().err
    assert "demo: " not in err and "a progress line" not in err


def null_mask_skips(sched: dict[str, Any]) -> int:
    """Selected ids expand_topk must skip with the null mask, for a
    schedule where no row sees more than 512 pools: each row of a request
    selects every pool complete after the call, and those past the pools
    complete at the query are not visible to it."""
    seen = [r.get("cached_prefix", 0) for r in sched["requests"]]
    skips = 0
    for call in sched["calls"]:
        for request, n in call:
            c = seen[request]
            end = (c + n) // KPOOL
            assert end <= 512
            skips += sum(end - (c + i + 1) // KPOOL for i in range(n))
            seen[request] += n
    return skips


def test_long_request_checks_real_selections(tmp_path, capsys, run_demo):
    """Rows that see more than 512 pools: the op chooses, the oracle checks
    the set at the k-th score, and the summary says how many and the worst
    margin."""
    path = write(tmp_path, LONG)
    out_json = tmp_path / "summary.json"
    status = run_demo(["--schedule", str(path), "--json", str(out_json)])
    out = capsys.readouterr().out
    assert status == 0, out
    index = json.loads(out_json.read_text())["index_top_k"]
    # Null mask: every row of a call sees (c + n) // 4 pools; the long
    # request's rows see 512 in call 3 (all of them: no choice), then 525
    # (52 rows in call 4, one each in calls 5 and 6).
    assert index["selections_checked"] == 52 + 1 + 1
    assert index["rows_checked"] == index["rows"] == 2102 + 9
    assert 0 < index["worst_margin"] < float("inf")
    assert f"{index['selections_checked']} selections" in out
    assert "every index_top_k row selects the oracle's top 512" in out


@pytest.mark.parametrize("kind", ["head", "bound"])
def test_injected_index_fault_fails_on_that_row(
    tmp_path, capsys, kind, run_demo
):
    """A wrong head weight (on a row that must choose) or a bound one pool
    too far (on a row that sees fewer than 512) fails that row's check."""
    path = write(tmp_path, LONG)
    status = run_demo(["--schedule", str(path), "--inject-fault", kind])
    captured = capsys.readouterr()
    assert status == 1, captured.out
    m = re.search(
        r"injecting a fault: .*request (\d+).* call (\d+).*token row "
        r"(\d+)(?: \(position (\d+)\))? must fail",
        captured.err,
    )
    assert m, captured.err
    request, call, row, _ = m.groups()
    fails = [
        line for line in captured.out.splitlines() if line.startswith("FAIL ")
    ]
    # Only the indexer's check fails: pools and expansions are right.
    assert len(fails) == 1, fails
    assert fails[0].startswith(f"FAIL request {request} (slot ")
    assert f"call {call}: index_top_k row {row} " in fails[0]
    assert "differs from the oracle: bound " in fails[0]
    assert "injected fault caught" in captured.out
    assert "result: FAILED, 1 problem (above)" in captured.out


@pytest.mark.emulated
def test_demo_on_emulated_gpu_kernels(tmp_path, capsys, run_demo):
    # The main job through the GPU kernels, index_top_k's included, on the
    # step and indexer models the gpu-emulated kernel tests compile anyway
    # (bfloat16, kpool 4; GLM-5-Next's indexer).
    path = write(tmp_path, SMALL)
    out_json = tmp_path / "summary.json"
    argv = ["--schedule", str(path), "--json", str(out_json)]
    status = run_demo(argv, device="gpu-emulated")
    captured = capsys.readouterr()
    out = captured.out
    assert status == 0, out
    summary = json.loads(out_json.read_text())
    assert summary["config"]["device"] == "gpu-emulated"
    assert summary["ok"] is True
    assert summary["pools_checked"] == expected_counts(SMALL)["pools"] == 180
    assert summary["expand_topk"]["rows_checked"] == 728
    assert summary["expand_topk"]["mismatches"] == 0
    index = summary["index_top_k"]
    assert index["rows"] == index["rows_checked"] == 728
    assert index["failed_calls"] == 0
    # The scorer was this package's GPU path over the emulated grid.
    assert (index["op"], index["path"], index["grid"]) == (
        "mla_kpool",
        "gpu",
        "emulated",
    )
    assert table(out)["index_top_k scorer"] == "gpu"
    assert "GPU kernels over the emulated grid" in out
    # An explicit schedule keeps its size: no smaller default announced.
    assert "smaller default workload" not in captured.err


@pytest.mark.gpu
@pytest.mark.skipif(driver.accelerator_count() == 0, reason="no accelerator")
def test_demo_on_the_gpu_scores_with_a_gpu_path(tmp_path, capsys, run_demo):
    # The whole indexer on the accelerator, on rows that must choose (see
    # test_long_request_checks_real_selections for the counts).
    path = write(tmp_path, LONG)
    out_json = tmp_path / "summary.json"
    argv = ["--schedule", str(path), "--json", str(out_json)]
    status = run_demo(argv, device="gpu")
    out = capsys.readouterr().out
    assert status == 0, out
    summary = json.loads(out_json.read_text())
    index = summary["index_top_k"]
    assert summary["config"]["device"] == "gpu"
    assert index["selections_checked"] == 52 + 1 + 1
    assert index["rows_checked"] == index["rows"] == 2102 + 9
    assert (index["path"], index["grid"]) == ("gpu", "device")
    # MAX 26.7 scores pooled keys only on sm_10x and gfx950 GPUs.
    arch = driver.accelerator_architecture_name()
    mine = not arch.startswith(("sm_10", "gfx950"))
    assert index["op"] == ("mla_kpool" if mine else "max")
    assert table(out)["index_top_k scorer"] == "gpu"


def test_generated_workload_float32(tmp_path, capsys, run_demo):
    out_json = tmp_path / "summary.json"
    argv = ["--requests", "4", "--seed", "7", "--dtype", "float32"]
    status = run_demo([*argv, "--json", str(out_json)])
    out = capsys.readouterr().out
    assert status == 0, out
    s = json.loads(out_json.read_text())
    assert s["requests"] == 4
    assert s["config"] == {
        "dtype": "float32",
        "kpool": 4,
        "head_dim": 128,
        "device": "cpu",
        "seed": 7,
        "token_budget": 2048,
        "max_running": 16,
        "chunk": 512,
        "schedule": None,
        "pool_topk": 512,
        "index_mask": "null",
    }
    assert s["pools"] == s["pools_expected"] == s["pools_checked"] > 0
    assert s["pools_ring_close"] > 0
    assert s["tokens"] == s["prefill_tokens"] + s["decode_tokens"]
    assert s["max_call_tokens"] <= 2048
    # float32 keys: the oracle's tolerance is 1e-5 relative.
    assert s["max_error_over_tolerance"] < 1.0
    assert int(table(out)["pools"]) == s["pools_expected"]
    assert s["expand_topk"]["rows_checked"] == s["tokens"]
    assert s["expand_topk"]["mismatches"] == 0


@pytest.mark.parametrize("kind", ["ring", "key"])
def test_injected_fault_fails_on_that_pool(tmp_path, capsys, kind, run_demo):
    path = write(tmp_path, SMALL)
    status = run_demo(["--schedule", str(path), "--inject-fault", kind])
    captured = capsys.readouterr()
    assert status == 1, captured.out
    m = re.search(
        r"injecting a fault: .*request (\d+), call \d+: pool (\d+) must fail",
        captured.err,
    )
    assert m, captured.err
    request, pool = m.groups()
    lines = captured.out.splitlines()
    fails = [line for line in lines if line.startswith("FAIL ")]
    # One corrupted member or key spoils exactly one pool.
    assert len(fails) == 1, fails
    assert fails[0].startswith(f"FAIL request {request} (slot ")
    assert f"pool {pool} (" in fails[0]
    assert "differs from the oracle" in fails[0]
    assert "injected fault caught" in captured.out
    assert "result: FAILED" in captured.out


def test_injected_topk_fault_fails_on_that_row(tmp_path, capsys, run_demo):
    path = write(tmp_path, SMALL)
    status = run_demo(["--schedule", str(path), "--inject-fault", "topk"])
    captured = capsys.readouterr()
    assert status == 1, captured.out
    m = re.search(
        r"injecting a fault: .*query at position (\d+) .*request (\d+), "
        r"call (\d+): token row (\d+) must fail",
        captured.err,
    )
    assert m, captured.err
    position, request, call, row = m.groups()
    fails = [
        line for line in captured.out.splitlines() if line.startswith("FAIL ")
    ]
    # One changed pool id spoils exactly one expanded row, and no pool.
    assert len(fails) == 1, fails
    assert fails[0].startswith(f"FAIL request {request} (slot ")
    assert f"call {call}: expand_topk row {row} " in fails[0]
    assert f"(query position {position})" in fails[0]
    assert "1 differs from the oracle" in captured.out
    assert "injected fault caught" in captured.out
    assert "result: FAILED, 1 problem (above)" in captured.out


# --------------------------------------------------------------------------
# Speculative decoding: --spec-tokens
# --------------------------------------------------------------------------

#: A small generated workload with speculative verify steps of 8 tokens.
SPEC_ARGV = ["--requests", "3", "--seed", "5", "--spec-tokens", "7"]


def spec_counts(plan: scheduling.Plan, kpool: int) -> dict[str, int]:
    """Pool rows a correct speculative run writes, from the contracts' rule.

    A call completes pools ``c // kpool`` to ``(c + n) // kpool``
    (exclusive) for a row of ``n`` tokens at cache length ``c``, drafts
    included; a pool id the calls complete more than once is rewritten;
    pool ids past a request's end can only hold drafts (dropped).
    """
    writes = 0
    ids: set[tuple[int, int]] = set()
    for call in plan.calls:
        for e in call:
            done = range(
                e.cache_length // kpool, (e.cache_length + e.tokens) // kpool
            )
            writes += len(done)
            ids |= {(e.request, p) for p in done}
    expected = sum(
        r.length // kpool - r.cached_prefix // kpool for r in plan.requests
    )
    return {
        "pools": writes,
        "pools_expected": expected,
        "pools_rewritten": writes - len(ids),
        "pools_dropped": len(ids) - expected,
    }


def test_spec_tokens_keeps_the_latest_row_of_each_pool(
    tmp_path, capsys, run_demo
):
    out_json = tmp_path / "summary.json"
    status = run_demo([*SPEC_ARGV, "--json", str(out_json)])
    out = capsys.readouterr().out
    assert status == 0, out
    s = json.loads(out_json.read_text())
    plan = demo_plan(SPEC_ARGV)
    verify = [
        e
        for call in plan.calls
        for e in call
        if e.cache_length >= plan.requests[e.request].prompt
    ]
    # Verify steps bring the next token and 7 drafts, keep 1 to 8 of them;
    # the seeded acceptance gives both extremes.
    assert verify and all(e.tokens == 8 for e in verify)
    assert all(1 <= e.accepted <= 8 for e in verify)
    assert any(e.accepted == 1 for e in verify)
    assert any(e.accepted == 8 for e in verify)
    want = spec_counts(plan, KPOOL)
    spec = s["speculative"]
    assert spec["spec_tokens"] == 7
    assert spec["ring_len"] == 12  # ring_length(4, 8)
    assert spec["verify_steps"] == len(verify)
    assert spec["draft_tokens"] == 7 * len(verify)
    assert spec["accepted_drafts"] == sum(e.accepted - 1 for e in verify)
    assert s["pools"] == want["pools"]
    assert s["pools_expected"] == s["pools_checked"] == want["pools_expected"]
    assert spec["pools_rewritten"] == want["pools_rewritten"] > 0
    assert spec["pools_dropped"] == want["pools_dropped"]
    assert s["max_error_over_tolerance"] < 1.0
    rows = table(out)
    assert int(rows["verify steps"]) == len(verify)
    assert int(rows["pools"]) == want["pools"]
    assert int(rows["rewritten after a rejection"]) == want["pools_rewritten"]
    assert int(rows["dropped"]) == want["pools_dropped"]
    assert "7 speculative tokens, ring 12" in out
    assert "result: OK" in out and "FAIL" not in out


@pytest.mark.parametrize("kind", ["ring", "key"])
def test_spec_tokens_injected_fault_fails(capsys, kind, run_demo):
    status = run_demo([*SPEC_ARGV, "--inject-fault", kind])
    captured = capsys.readouterr()
    assert status == 1, captured.out
    m = re.search(
        r"injecting a fault: .*request (\d+), call \d+: pool (\d+) must fail",
        captured.err,
    )
    assert m, captured.err
    request, pool = m.groups()
    fails = [
        line for line in captured.out.splitlines() if line.startswith("FAIL ")
    ]
    assert len(fails) == 1, fails
    assert fails[0].startswith(f"FAIL request {request} (slot ")
    assert f"pool {pool} (" in fails[0]
    assert "injected fault caught" in captured.out
    assert "result: FAILED" in captured.out


def test_spec_tokens_with_listed_calls_is_a_usage_error(tmp_path, capsys):
    path = write(tmp_path, SMALL)
    assert (
        cli.main(["demo", "--schedule", str(path), "--spec-tokens", "3"]) == 2
    )
    err = capsys.readouterr().err
    assert "--spec-tokens needs generated batching" in err


def test_spec_schedule_keeps_the_drafts_it_accepts():
    """schedule() with spec_tokens gives verify steps that plan() resolves."""
    rng = np.random.default_rng(3)
    reqs = workload.generate_requests(rng, 12, KPOOL, chunk=64, max_prompt=80)
    calls = scheduling.schedule(
        reqs, rng, token_budget=96, max_running=4, chunk=64, spec_tokens=5
    )
    plan = scheduling.plan(reqs, calls, 4, rng)
    done = [r.cached_prefix for r in reqs]
    for call in plan.calls:
        for e in call:
            r = reqs[e.request]
            assert e.cache_length == done[e.request]
            if e.cache_length >= r.prompt:
                assert e.tokens <= 6 and 1 <= e.accepted <= e.tokens
            else:
                assert e.rejected == 0
            done[e.request] += e.accepted
            assert e.finished == (done[e.request] == r.length)
    assert done == [r.length for r in reqs]

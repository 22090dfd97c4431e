"""The command line: ``python -m mla_kpool demo`` and its workloads.

The demo runs in-process on small workloads with the suite's shared CPU runner,
on two step models the suite compiles anyway (bfloat16 and float32 at kpool 4,
head_dim 128), so it adds no compile. Its counts are checked against numbers
derived here from the schedule and the op contracts (pools per request, pools
ring_close must close, indexer rows that must choose), not against the demo's
own bookkeeping. Every run also scores every query token with index_top_k on
one indexer model (GLM-5-Next's: H 32, W 32, top 512, null mask), on the
step's device: the gpu-emulated run scores with the op's GPU path, and its
summary must say so. ``--inject-fault`` must make it fail on
exactly the corrupted pool or row; bad schedule files
must give a usage error that says what is wrong. ``--spec-tokens 7`` runs on
the bfloat16 step model with the 12-entry ring that tests/test_spec_decode.py
compiles too; its pool counts (rows written, rewritten after a rejection,
dropped past the end) are derived from the plan's accepted counts and the
contracts' pool rule. The scheduler and slot planner are checked directly, with
no kernels.
"""

from __future__ import annotations

import argparse
import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
from max import driver

from mla_kpool import __main__ as cli
from mla_kpool import reference
from mla_kpool.demo import (
    checked_run,
    checks,
    faults,
    indexing,
    schedule_file,
    scheduling,
    workload,
)
from mla_kpool.demo import cli as demo
from mla_kpool.demo.summary import format_summary, summarize
from mla_kpool.runner import Runner

KPOOL = 4

#: A small bfloat16 / kpool 4 / head_dim 128 workload that covers what the
#: generated one does: a cached prefix ending mid-pool (ring restored on
#: admission), a prompt shorter than a pool, a request joining in a slot
#: another one freed (max_running 3), an entry bringing no tokens, and
#: decode steps of 1-4 tokens mixed with prefill chunks.
SMALL = {
    "kpool": KPOOL,
    "head_dim": 128,
    "dtype": "bfloat16",
    "max_running": 3,
    "requests": [
        {"prompt": 10, "generate": 5},
        {"prompt": 700, "generate": 3, "cached_prefix": 6},
        {"prompt": 3},
        {"prompt": 9, "generate": 4},
    ],
    "calls": [
        [[0, 6], [1, 512], [2, 3]],
        [[0, 4], [1, 182], [3, 5]],
        [[0, 2], [1, 2], [3, 0]],
        [[3, 4], [0, 3], [1, 1]],
        [[3, 4]],
    ],
}

#: A bfloat16 workload whose long request sees more than 512 pools (2,100
#: prompt tokens in chunks of 512, then decode), so index_top_k has to
#: choose, beside a short one.
LONG = {
    "kpool": KPOOL,
    "head_dim": 128,
    "dtype": "bfloat16",
    "max_running": 2,
    "requests": [{"prompt": 2100, "generate": 2}, {"prompt": 7, "generate": 2}],
    "calls": [
        [[0, 512], [1, 7]],
        [[0, 512], [1, 1]],
        [[0, 512], [1, 1]],
        [[0, 512]],
        [[0, 52]],
        [[0, 1]],
        [[0, 1]],
    ],
}


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


def write(tmp_path: Path, data: Any, name: str = "schedule.json") -> Path:
    path = tmp_path / name
    path.write_text(data if isinstance(data, str) else json.dumps(data))
    return path


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


def spec_plan(argv: list[str]) -> scheduling.Plan:
    """The demo's plan for ``argv`` (what each call brings and keeps)."""
    parser = argparse.ArgumentParser()
    demo.add_arguments(parser)
    return demo.build_plan(parser.parse_args(argv))[1]


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
    plan = spec_plan(SPEC_ARGV)
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


# --------------------------------------------------------------------------
# Usage errors: clear message, exit status 2, nothing compiled or run
# --------------------------------------------------------------------------


@dataclass(frozen=True)
class BadSchedule:
    id: str
    data: Any
    message: str


def _small(**changes: Any) -> dict[str, Any]:
    return {**SMALL, **changes}


BAD_SCHEDULES = [
    BadSchedule("not-json", '{"requests": [', "not valid JSON"),
    BadSchedule("not-object", "[1, 2]", "must be a JSON object"),
    BadSchedule("no-requests", {"calls": []}, 'needs "requests"'),
    BadSchedule(
        "unknown-key",
        {"requests": [{"promt": 3}]},
        "requests[0]: unknown key 'promt'",
    ),
    BadSchedule(
        "prompt-zero",
        {"requests": [{"prompt": 0}]},
        "requests[0].prompt must be an integer >= 1, got 0",
    ),
    BadSchedule(
        "prefix-not-below-prompt",
        {"requests": [{"prompt": 8, "cached_prefix": 8}]},
        "requests[0].cached_prefix must be < prompt (8)",
    ),
    BadSchedule(
        "bad-dtype",
        {"dtype": "int8", "requests": [{"prompt": 8}]},
        "dtype must be one of",
    ),
    BadSchedule(
        "pair-not-pair",
        {"requests": [{"prompt": 8}], "calls": [[[0]]]},
        "calls[0][0] must be a [request, tokens] pair",
    ),
    BadSchedule(
        "unknown-request",
        {"requests": [{"prompt": 8}], "calls": [[[0, 8], [1, 1]]]},
        "calls[0][1]: request 1 does not exist",
    ),
    BadSchedule(
        "too-many-tokens",
        {"requests": [{"prompt": 8}], "calls": [[[0, 9]]]},
        "calls[0][0]: request 0 brings 9 tokens but has 8 left",
    ),
    BadSchedule(
        "unfinished",
        {"requests": [{"prompt": 8, "generate": 2}], "calls": [[[0, 8]]]},
        "request 0 gets 8 of its 10 new tokens",
    ),
    BadSchedule(
        "twice-in-a-call",
        {"requests": [{"prompt": 8}], "calls": [[[0, 4], [0, 4]]]},
        "calls[0][1]: request 0 is already in calls[0]",
    ),
    BadSchedule(
        "after-finishing",
        {"requests": [{"prompt": 8}], "calls": [[[0, 8]], [[0, 0]]]},
        "calls[1][0]: request 0 has already finished",
    ),
    BadSchedule(
        "empty-call",
        {"requests": [{"prompt": 8}], "calls": [[[0, 8]], []]},
        "calls[1] is empty",
    ),
    BadSchedule(
        "no-free-slot",
        _small(max_running=2),
        "calls[0][2]: request 2 needs a ring slot but all 2 are held",
    ),
]


@pytest.mark.parametrize("case", BAD_SCHEDULES, ids=lambda c: c.id)
def test_bad_schedule_is_a_usage_error(tmp_path, capsys, case):
    path = write(tmp_path, case.data)
    status = cli.main(["demo", "--schedule", str(path)])
    captured = capsys.readouterr()
    assert status == 2
    assert captured.err.startswith(f"mla-kpool demo: error: {path}: ")
    assert case.message in captured.err
    assert captured.out == ""


def test_missing_schedule_file(tmp_path, capsys):
    path = tmp_path / "nowhere.json"
    assert cli.main(["demo", "--schedule", str(path)]) == 2
    assert "cannot read: No such file" in capsys.readouterr().err


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--requests", "3"], "--requests and --schedule exclude each other"),
        (
            ["--kpool", "8"],
            '--kpool 8 disagrees with {path}, which has "kpool"',
        ),
        (["--dtype", "float32"], "--dtype float32 disagrees with {path}"),
    ],
    ids=["requests", "kpool", "dtype"],
)
def test_options_conflicting_with_schedule(tmp_path, capsys, argv, message):
    path = write(tmp_path, SMALL)
    assert cli.main(["demo", "--schedule", str(path), *argv]) == 2
    assert message.format(path=path) in capsys.readouterr().err


@pytest.mark.skipif(
    driver.accelerator_count() > 0, reason="this machine has an accelerator"
)
def test_gpu_without_accelerator(capsys):
    assert cli.main(["demo", "--device", "gpu", "--requests", "1"]) == 2
    assert "no accelerator found" in capsys.readouterr().err


@pytest.mark.parametrize(
    "argv",
    [
        ["--kpool", "0"],
        ["--dtype", "int8"],
        ["--spec-tokens", "0"],
        ["--json", "/no-such-folder-mla-kpool/summary.json"],
    ],
)
def test_bad_option_values_exit_2(argv, capsys):
    with pytest.raises(SystemExit) as exc:
        cli.main(["demo", *argv])
    assert exc.value.code == 2
    assert "error: argument" in capsys.readouterr().err


# --------------------------------------------------------------------------
# Scheduler and slot planner (no kernels)
# --------------------------------------------------------------------------


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_generated_schedule_is_a_serving_loop(seed):
    rng = np.random.default_rng(seed)
    reqs = workload.generate_requests(rng, 40, KPOOL, chunk=512)
    budget, running, chunk = 1024, 6, 256
    calls = scheduling.schedule(
        reqs, rng, token_budget=budget, max_running=running, chunk=chunk
    )
    plan = scheduling.plan(reqs, calls, running, rng)
    where = f"seed {seed}"
    done = [0] * len(reqs)
    holder: dict[int, int] = {}  # slot -> request holding it
    slot_is_position = 0
    mixed_calls = 0
    for call in plan.calls:
        assert sum(e.tokens for e in call) <= budget, where
        assert len({e.slot for e in call}) == len(call), where
        kinds = set()
        for b, e in enumerate(call):
            r = reqs[e.request]
            assert 0 <= e.slot < running, where
            assert e.cache_length == r.cached_prefix + done[e.request], where
            if e.admitted:
                assert e.slot not in holder, f"{where}: slot {e.slot} busy"
                holder[e.slot] = e.request
            assert holder[e.slot] == e.request, where
            if e.cache_length >= r.prompt:  # decoding
                assert 1 <= e.tokens <= 4, where
                kinds.add("decode")
            else:  # prefill never runs past the prompt
                assert 1 <= e.tokens <= chunk, where
                assert e.cache_length + e.tokens <= r.prompt, where
                kinds.add("prefill")
            done[e.request] += e.tokens
            slot_is_position += e.slot == b
            assert e.finished == (done[e.request] == r.new_tokens), where
        mixed_calls += kinds == {"decode", "prefill"}
        for e in call:
            if e.finished:
                del holder[e.slot]
    assert done == [r.new_tokens for r in reqs], where
    assert not holder, where
    assert plan.slot_reuses >= len(reqs) - running, where
    assert mixed_calls > 0, where
    entries = sum(len(call) for call in plan.calls)
    assert slot_is_position < entries / 2, where


def test_generated_requests_span_short_and_long():
    rng = np.random.default_rng(0)
    reqs = workload.generate_requests(rng, 32, KPOOL, chunk=512)
    prompts = sorted(r.prompt for r in reqs)
    assert prompts[0] == 1
    assert KPOOL - 1 in prompts and 512 in prompts
    assert prompts[-1] >= 2000
    cached = [r for r in reqs if r.cached_prefix]
    assert cached and all(r.cached_prefix < r.prompt for r in cached)
    again = workload.generate_requests(np.random.default_rng(0), 32, KPOOL)
    assert again == reqs


def test_fault_placement_targets_a_closing_pool():
    sched = schedule_file.parse_schedule(SMALL)
    plan = scheduling.plan(
        sched.requests, sched.calls, 3, np.random.default_rng(0)
    )
    fault = faults.place_fault(plan, "ring", KPOOL)
    e = plan.calls[fault.call][fault.entry]
    c, n = e.cache_length, e.tokens
    assert c % KPOOL and c + n >= (c // KPOOL + 1) * KPOOL
    assert fault.pool == c // KPOOL
    assert fault.position == fault.pool * KPOOL  # member 0, in the ring
    key = faults.place_fault(plan, "key", KPOOL)
    e = plan.calls[key.call][key.entry]
    assert key.position == e.cache_length
    assert key.pool == e.cache_length // KPOOL


def test_fault_placement_for_expand_topk():
    sched = schedule_file.parse_schedule(SMALL)
    plan = scheduling.plan(
        sched.requests, sched.calls, 3, np.random.default_rng(0)
    )
    fault = faults.place_fault(plan, "topk", KPOOL)
    call = plan.calls[fault.call]
    e = call[fault.entry]
    # The request's last token row of that call, which sees two or more
    # complete pools, so one selected id can be swapped for another.
    assert fault.position == e.cache_length + e.tokens - 1
    assert (fault.position + 1) // KPOOL >= 2
    assert fault.pool == sum(x.tokens for x in call[: fault.entry + 1]) - 1


def test_fault_placement_for_the_indexer():
    sched = schedule_file.parse_schedule(LONG)
    plan = scheduling.plan(
        sched.requests, sched.calls, 2, np.random.default_rng(0)
    )
    head = faults.place_fault(plan, "head", KPOOL, 512)
    e = plan.calls[head.call][head.entry]
    # The request's last row of the call, which sees more than 512 pools.
    assert head.position == e.cache_length + e.tokens - 1
    assert (e.cache_length + e.tokens) // KPOOL > 512
    bound = faults.place_fault(plan, "bound", KPOOL, 512)
    e = plan.calls[bound.call][bound.entry]
    # Its first row, which sees fewer than 512 (null mask: all its rows).
    assert bound.position == e.cache_length
    assert (e.cache_length + e.tokens) // KPOOL < 512
    before = plan.calls[bound.call][: bound.entry]
    assert bound.pool == sum(x.tokens for x in before)
    causal = faults.place_fault(plan, "bound", KPOOL, 512, causal=True)
    e = plan.calls[causal.call][causal.entry]
    assert (e.cache_length + 1) // KPOOL < 512
    # SMALL has no row that must choose: no place for a head fault.
    small = schedule_file.parse_schedule(SMALL)
    plan = scheduling.plan(
        small.requests, small.calls, 3, np.random.default_rng(0)
    )
    assert faults.place_fault(plan, "head", KPOOL, 512) is None
    weights = np.array([[0.5, -2.0, 1.0]], np.float32)
    faults.corrupt_weight(weights, 0)
    assert weights.tolist() == [[0.5, 16.0, 1.0]]


def test_index_cache_hands_out_pages_and_takes_them_back():
    """Pages for every pool a request will have plus one, distinct blocks
    per request, key and scale tables apart, stale columns in the arena;
    released blocks go back (bytes kept)."""
    sched = schedule_file.parse_schedule(LONG)
    plan = scheduling.plan(
        sched.requests, sched.calls, 2, np.random.default_rng(0)
    )
    cache = indexing.IndexCache(plan, KPOOL, 128, seed=3)
    assert cache.rows_per_pool == 4 and cache.max_pages == 17  # 526 pools
    assert cache.cache.num_blocks == 2 * 17
    cache.admit(0, 526)
    cache.admit(1, 3)
    call = plan.calls[1]
    cache.bind(call)
    keys, scales = cache.held[0]
    assert len(keys) == 17 and len(cache.held[1][0]) == 1
    b = [e.request for e in call].index(0)
    assert cache.cache.lookup_table[b].tolist() == keys
    assert cache.cache.scales_lookup_table[b].tolist() == scales
    assert cache.cache.cache_lengths.tolist() == [e.cache_length for e in call]
    assert (cache.cache.lookup_table < cache.cache.num_blocks).all()
    free = len(cache.free_keys)
    cache.release(0)
    assert len(cache.free_keys) == free + 17 and 0 not in cache.held


@pytest.mark.parametrize(
    "argv, requests",
    [
        (["--device", "gpu-emulated"], 9),
        (["--device", "gpu-emulated", "--requests", "32"], 32),
        (["--device", "cpu"], 32),
        (["--device", "gpu"], 32),
    ],
)
def test_emulated_grid_defaults_to_fewer_requests(argv, requests):
    assert len(spec_plan(argv).requests) == requests


def test_emulated_default_workload_makes_index_top_k_choose():
    # Null mask: every row of an entry sees the pools complete after the
    # call, (cache_length + tokens) // kpool; more than 512 is a choice.
    plan = spec_plan(["--device", "gpu-emulated"])
    choosing = sum(
        e.tokens
        for call in plan.calls
        for e in call
        if (e.cache_length + e.tokens) // workload.DEFAULT_KPOOL > 512
    )
    assert choosing > 0


@pytest.mark.parametrize("device", ["cpu", "gpu-emulated"])
def test_precompiled_index_model_is_the_one_the_calls_use(device):
    # Runner.index_top_k asks its runner for the model of the key
    # index_runner.prepare builds; the demo compiles index_key's ahead.
    from mla_kpool import index_runner

    asked = []
    recorder = SimpleNamespace(
        device_name=device, device=driver.CPU(), index_model=asked.append
    )

    cache = indexing.IndexCache(spec_plan(["--requests", "2"]), KPOOL, 128, 0)
    cache.admit(0, 1)
    cache.bind([scheduling.Entry(0, 0, 0, 3, True, False)])
    q, qs = indexing.make_queries(0, 0, 3, 128)
    index_runner.prepare(
        recorder, q, qs, [0, 3], cache.cache, 1, top_k=512, kpool=KPOOL,
        mask="null",
    )  # fmt: skip
    want = indexing.index_key(KPOOL, 128, 512, "null", device)
    assert asked == [want]
    assert want.emulate_gpu is (device == "gpu-emulated") and not want.gpu


def test_index_scorer_names_the_path():
    assert indexing.index_scorer("cpu", KPOOL) == {
        "op": "mla_kpool",
        "path": "cpu",
        "grid": "-",
    }
    assert indexing.index_scorer("gpu-emulated", KPOOL) == {
        "op": "mla_kpool",
        "path": "gpu",
        "grid": "emulated",
    }
    # MAX 26.7's GPU op scores kpool 1 on every GPU it supports.
    assert indexing.index_scorer("gpu", 1)["op"] == "max"


def test_skipped_ids_counts_pools_past_each_query():
    e = scheduling.Entry(0, 0, 6, 3, False, False)
    ids = np.array([[0, 1, 2, -1], [2, 1, 0, -1], [2, 0, 1, -1]], np.int32)
    # Queries at positions 6, 7, 8 see 1, 2, 2 complete pools.
    assert checked_run.skipped_ids(ids, [e], KPOOL) == 2 + 1 + 1


def test_summary_counts_problems_in_singular_and_plural():
    parser = argparse.ArgumentParser()
    demo.add_arguments(parser)
    config, plan = demo.build_plan(parser.parse_args(["--requests", "2"]))
    for problems, text in [
        (["a"], "result: FAILED, 1 problem (above)"),
        (["a", "b", "c"], "result: FAILED, 3 problems (above)"),
    ]:
        totals = checks.Totals(problems=problems, call_seconds=[1e-3])
        numbers = summarize(config, plan, totals, 1.0, 2.0, None)
        assert numbers["ok"] is False
        assert format_summary(numbers).splitlines()[-1] == text


@pytest.mark.parametrize(
    "dtype, rel",
    [("float32", 1e-5), ("float16", 2e-3), ("bfloat16", 1.6e-2)],
)
def test_tolerance_per_key_dtype(dtype, rel):
    # The oracle tolerances of the contract: float32 1e-5, float16 2e-3,
    # bfloat16 1.6e-2 (about one bfloat16 ulp, 2^-6 = 1.5625e-2).
    assert reference.tolerance(workload.DTYPES[dtype]) == rel


def test_tolerance_rejects_a_non_key_dtype():
    with pytest.raises(ValueError, match="got int32"):
        reference.tolerance(np.int32)


@pytest.mark.parametrize(
    "count, noun, text",
    [
        (0, "problem", "0 problems"),
        (1, "problem", "1 problem"),
        (2, "slot reuse", "2 slot reuses"),
        (1, "more pool", "1 more pool"),
    ],
)
def test_plural(count, noun, text):
    assert checks.plural(count, noun) == text

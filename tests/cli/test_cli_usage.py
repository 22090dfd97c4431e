"""The demo's usage errors and its scheduler, with no kernels.

Bad schedule files and options must give a usage error (exit status 2) that
says what is wrong, before anything compiles; the scheduler, slot planner,
fault placement and summary are checked directly.
"""

from __future__ import annotations

import argparse
import re
from dataclasses import dataclass
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
from support.demo_cases import KPOOL, LONG, SMALL, demo_plan, write


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
    # Sizes past the command line's bounds, refused before any planning
    # (a prompt of 10^20 tokens planned for minutes in ever more memory).
    BadSchedule(
        "huge-prompt",
        {"requests": [{"prompt": 10**20}]},
        "requests[0].prompt must be at most 16,777,216, got 100,000,000,000"
        ",000,000,000: a request's tokens are planned in memory",
    ),
    BadSchedule(
        "huge-generate",
        {"requests": [{"prompt": 8, "generate": 10**12}]},
        "requests[0].generate must be at most 16,777,216",
    ),
    BadSchedule(
        "kpool-past-the-kernels",
        {"requests": [{"prompt": 8}], "kpool": 100000},
        "kpool must be at most 1,024, got 100,000: kpool is a compile-time"
        " parameter of the kernels",
    ),
    BadSchedule(
        "head-dim-past-the-kernels",
        {"requests": [{"prompt": 8}], "head_dim": 5000},
        "head_dim must be at most 1,024",
    ),
]


@pytest.mark.parametrize("case", BAD_SCHEDULES, ids=lambda c: c.id)
def test_bad_schedule_is_a_usage_error(tmp_path, capsys, case):
    path = write(tmp_path, case.data)
    # The error names the program as it was started, as the usage line.
    status = cli.main(["demo", "--schedule", str(path)], prog="mla-kpool")
    captured = capsys.readouterr()
    assert status == 2
    assert captured.err.startswith(f"mla-kpool demo: error: {path}: ")
    assert case.message in captured.err
    assert captured.out == ""
    assert cli.main(["demo", "--schedule", str(path)], prog="python -m x") == 2
    assert capsys.readouterr().err.startswith("python -m x demo: error: ")


def test_missing_schedule_file(tmp_path, capsys):
    path = tmp_path / "nowhere.json"
    assert cli.main(["demo", "--schedule", str(path)]) == 2
    assert "cannot read: No such file" in capsys.readouterr().err


def test_a_schedule_file_that_is_not_text(tmp_path, capsys):
    path = tmp_path / "binary.json"
    path.write_bytes(b"\xff\xfe")
    assert cli.main(["demo", "--schedule", str(path)]) == 2
    err = capsys.readouterr().err
    assert f"{path}: not UTF-8 text (byte 0): a schedule is JSON" in err
    assert "Traceback" not in err


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
    assert len(demo_plan(argv).requests) == requests


def test_emulated_default_workload_makes_index_top_k_choose():
    # Null mask: every row of an entry sees the pools complete after the
    # call, (cache_length + tokens) // kpool; more than 512 is a choice.
    plan = demo_plan(["--device", "gpu-emulated"])
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

    cache = indexing.IndexCache(demo_plan(["--requests", "2"]), KPOOL, 128, 0)
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


@pytest.mark.parametrize(
    "in_runner, before, after, want",
    [
        (True, 4, 4, ("in runner", 0)),
        (False, 4, 5, ("compiled", 1)),
        (False, None, 2, ("compiled", 2)),  # the folder was made now
        (False, 4, 4, ("loaded", 0)),
        (False, None, None, (None, None)),  # no cache folder: not known
    ],
)
def test_models_source(in_runner, before, after, want):
    assert demo.models_source(in_runner, before, after) == want


def test_graph_cache_files_counts_maxs_graph_files(tmp_path, monkeypatch):
    root = tmp_path / "modular"
    monkeypatch.setenv("MODULAR_CACHE_DIR", str(root))
    assert checked_run.graph_cache_files() is None
    graphs = root / ".max_cache" / "mof" / "mef" / "26.7.0"
    graphs.mkdir(parents=True)
    assert checked_run.graph_cache_files() == 0
    (graphs / "graph-a").write_bytes(b"a")
    (graphs / "graph-b").write_bytes(b"b")
    (root / ".mojo_cache").mkdir()
    (root / ".mojo_cache" / "package").write_bytes(b"c")  # not a graph
    assert checked_run.graph_cache_files() == 2
    # Without MODULAR_CACHE_DIR: $XDG_CACHE_HOME/modular.
    monkeypatch.delenv("MODULAR_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert checked_run.graph_cache_files() is None
    (tmp_path / "xdg" / "modular" / ".max_cache").mkdir(parents=True)
    (tmp_path / "xdg" / "modular" / ".max_cache" / "graph").write_bytes(b"")
    assert checked_run.graph_cache_files() == 1


def _summary_rows(**numbers) -> dict[str, str]:
    """The summary table's rows, label -> the rest of the line."""
    parser = argparse.ArgumentParser()
    demo.add_arguments(parser)
    config, plan = demo.build_plan(parser.parse_args(["--requests", "2"]))
    totals = checks.Totals(
        call_seconds=[3e-3] * len(plan.calls),
        index_seconds=[4e-3, 6e-3],
        expand_seconds=[1e-3],
    )
    text = format_summary(
        summarize(config, plan, totals, 9.0, 20.0, None, 2.0, **numbers)
    )
    rows = {}
    for line in text.splitlines():
        m = re.match(r"^\s*(\S.*?)\s{2,}(\S.*)$", line)
        if m:
            rows[m.group(1)] = m.group(2)
    return rows


@pytest.mark.parametrize(
    "models, added, note",
    [
        (
            "compiled",
            1,
            "models compiled now (MAX's graph cache gained 1 file))",
        ),
        (
            "compiled",
            3,
            "models compiled now (MAX's graph cache gained 3 files))",
        ),
        (
            "loaded",
            0,
            "models loaded from MAX's graph cache (it gained no file))",
        ),
        ("in runner", 0, "models already compiled in the runner given)"),
        (
            None,
            None,
            "models compiled or loaded (not known))",
        ),
    ],
)
def test_compile_row_says_where_the_models_came_from(models, added, note):
    row = _summary_rows(models=models, cache_files_added=added)["compile"]
    assert row.startswith("9.0 s  (Mojo kernels 2.0 s, every run; step, ")
    assert row.endswith(note)


def test_time_rows_say_what_each_time_holds():
    rows = _summary_rows(idle_s=5e-5)
    assert rows["mean time per call"] == (
        "3.000 ms  (the step: median 3.000 ms; mean index_top_k 5.000 ms,"
        " expand_topk 1.000 ms; each the wall time of its Runner call:"
        " operand checks, copies in and out, the model run)"
    )
    assert rows["idle ops at most"].startswith("0.050 ms  (the three ops are")
    alone = _summary_rows(idle_s=None)
    assert alone["idle ops in them"] == (
        "none  (each op's model is compiled alone on this device)"
    )


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
    # bfloat16 1.6e-2 (about 2^-6 = 1.5625e-2: two bfloat16 ulps at 1,
    # whose epsilon is 2^-7).
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

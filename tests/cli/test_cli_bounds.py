"""Every numeric option of the command line has an upper bound, every
subcommand answers its own unknown options, and a run far larger than the
default states its size and asks before it compiles.

No kernel compiles here: each refusal happens while parsing or while
planning, before anything is compiled.
"""

from __future__ import annotations

import argparse
import io
import subprocess
import sys
import time

import pytest

from mla_kpool import __main__ as cli
from mla_kpool import _argtypes
from mla_kpool import bench as bench_cli
from mla_kpool._progress import LineProgress
from mla_kpool.demo import cli as demo
from mla_kpool.demo.indexing import index_layout

PROG = "python -m mla_kpool"


def _refused(argv: list[str], capsys) -> str:
    """The stderr of ``argv``, which must be a usage error (exit 2)."""
    with pytest.raises(SystemExit) as exc:
        cli.main(argv, prog=PROG)
    assert exc.value.code == 2
    return capsys.readouterr().err


@pytest.mark.parametrize(
    "argv, limit",
    [
        (["demo", "--kpool", "1025"], "must be at most 1,024, got 1,025"),
        (["demo", "--head-dim", "1025"], "must be at most 1,024, got 1,025"),
        (["demo", "--requests", "4097"], "must be at most 4,096, got 4,097"),
        (["demo", "--token-budget", "65537"], "must be at most 65,536"),
        (["demo", "--chunk", "65537"], "must be at most 65,536"),
        (["demo", "--max-running", "1025"], "must be at most 1,024"),
        (["demo", "--pool-topk", "2049"], "must be at most 2,048"),
        (["demo", "--spec-tokens", "65"], "must be at most 64"),
        (["demo", "--seed", str(2**53)], "must be at most"),
        (["bench", "--batches", "1", str(2**20 + 1)], "must be at most"),
        (["bench", "--kpools", "4", "1025"], "must be at most 1,024"),
        (["bench", "--head-dim", "1025"], "must be at most 1,024"),
        (["bench", "--min-seconds", "61"], "must be at most 60, got 61"),
    ],
    ids=lambda x: " ".join(x) if isinstance(x, list) else None,
)
def test_each_number_has_an_upper_bound(argv, limit, capsys):
    err = _refused(argv, capsys)
    option = argv[1]
    last = err.strip().splitlines()[-1]
    # The subcommand's program name, the option, the limit with the value
    # given, and why (after the colon that follows the value).
    assert last.startswith(f"{PROG} {argv[0]}: error: argument {option}: ")
    assert limit in last
    assert len(last.split(limit, 1)[1].lstrip(":").strip()) > 10


@pytest.mark.parametrize(
    "parse, value",
    [(_argtypes.kpool_option, 1024), (_argtypes.head_dim_option, 1024)],
)
def test_the_bound_itself_is_accepted(parse, value):
    assert parse("1") == 1
    assert parse(str(value)) == value


@pytest.mark.parametrize("command", ["demo", "bench", "gpu-report"])
def test_an_unknown_option_gets_the_subcommands_usage(command, capsys):
    err = _refused([command, "--bogus"], capsys)
    assert err.startswith(f"usage: {PROG} {command} [-h]")
    assert err.endswith(
        f"{PROG} {command}: error: unrecognized arguments: --bogus\n"
    )


def test_bench_has_no_progress_as_the_demo_has():
    parser = argparse.ArgumentParser()
    bench_cli.add_arguments(parser)
    assert parser.parse_args(["--no-progress"]).no_progress
    assert not parser.parse_args([]).no_progress


def _demo_args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog=f"{PROG} demo")
    demo.add_arguments(parser)
    return parser.parse_args(list(argv))


def test_a_long_demo_states_its_size_and_asks(capsys):
    """One token a call: 29,928 calls, past the 2,000 asked for on cpu."""
    assert demo.run(_demo_args("--token-budget", "1")) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"{PROG} demo: error: this workload is 32 requests")
    assert "in 29,928 calls" in err
    assert "more than the 2,000 calls a run on cpu makes unasked" in err
    assert "--long-run" in err
    assert "lower --requests" in err
    config, plan_ = demo.build_plan(_demo_args("--token-budget", "1"))
    demo.check_size(config, plan_, long_run=True)  # no error: asked for
    # Requests from a schedule file: the advice names the file's requests.
    with pytest.raises(demo.DemoError) as refused:
        demo.check_size(config, plan_, long_run=False, scheduled=True)
    assert "fewer requests in the schedule" in str(refused.value)
    assert "--requests" not in str(refused.value)


def test_the_default_workloads_run_unasked():
    for device in demo.LONG_RUN_CALLS:
        if device == "gpu":
            continue  # the plan is the cpu one
        config, plan_ = demo.build_plan(_demo_args("--device", device))
        assert 2 * len(plan_.calls) <= demo.LONG_RUN_CALLS[device]
        demo.check_size(config, plan_, long_run=False)


def test_a_demo_past_this_machines_memory_is_refused(monkeypatch, capsys):
    monkeypatch.setattr(demo, "available_memory", lambda: 2**30)
    args = _demo_args("--max-running", "64", "--head-dim", "1024")
    assert demo.run(args) == 2
    err = capsys.readouterr().err
    assert "--max-running 64 and --head-dim 1024 need about" in err
    assert "more than the 1.0 GiB this machine has available" in err


def test_a_demo_widening_past_this_machines_memory(monkeypatch, capsys):
    """kpool 1024: each row of expand_topk is 512 * 1024 + 1023 positions."""
    monkeypatch.setattr(demo, "available_memory", lambda: 4 * 2**30)
    assert demo.run(_demo_args("--kpool", "1024", "--long-run")) == 2
    err = capsys.readouterr().err
    assert "--kpool 1024 and --pool-topk 512 widen each query row to" in err
    assert "525,311 positions" in err
    assert "lower --token-budget" in err


def test_a_bench_grid_past_the_sweep_asks(capsys):
    batches = [str(b) for b in range(1, 41)]
    argv = ["--ops", "ring_close", "compress", "--kpools", "4", "16"]
    parser = argparse.ArgumentParser(prog=f"{PROG} bench")
    bench_cli.add_arguments(parser)
    args = parser.parse_args([*argv, "--batches", *batches])
    problem = bench_cli.check_size(args, bench_cli.cases(args))
    assert problem is not None
    assert problem.startswith("this grid is 160 configurations")
    assert "--long-run" in problem
    args = parser.parse_args([*argv, "--long-run", "--batches", *batches])
    assert bench_cli.check_size(args, bench_cli.cases(args)) is None
    for preset in ("--sweep", "--quick"):
        args = parser.parse_args([preset])
        assert bench_cli.check_size(args, bench_cli.cases(args)) is None


def test_a_bench_batch_past_this_machines_memory(monkeypatch):
    monkeypatch.setattr(bench_cli, "available_memory", lambda: 2**30)
    parser = argparse.ArgumentParser()
    bench_cli.add_arguments(parser)
    args = parser.parse_args(["--ops", "step", "--batches", "1", "1000000"])
    problem = bench_cli.check_size(args, bench_cli.cases(args))
    assert problem is not None
    assert problem.startswith("--batches 1000000 needs about")
    assert "for step (kpool 4, head_dim 128, bfloat16)" in problem
    args = parser.parse_args(["--ops", "step", "--batches", "1", "64"])
    assert bench_cli.check_size(args, bench_cli.cases(args)) is None


@pytest.mark.parametrize(
    "argv, says",
    [
        (["demo", "--kpool", "1000000"], "argument --kpool: must be at most"),
        (["demo", "--requests", "100000000"], "argument --requests"),
        (["bench", "--batches", "100000000"], "argument --batches"),
        (["demo", "--token-budget", "1"], "add --long-run"),
        (["demo", "--bogus"], "demo: error: unrecognized arguments"),
        (["bench", "--no-progress", "--bogus"], "bench: error: unrecog"),
    ],
    ids=lambda x: " ".join(x) if isinstance(x, list) else None,
)
def test_the_command_line_refuses_at_once(argv, says):
    """As a user types them: exit 2, one message, no traceback."""
    done = subprocess.run(
        [sys.executable, "-m", "mla_kpool", *argv],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2
    assert says in done.stderr
    assert "Traceback" not in done.stderr
    assert done.stdout == ""


@pytest.mark.parametrize(
    "kpool, head_dim, want",
    [
        (4, 128, ("spread", "")),
        (1, 128, ("whole", "")),
        (4, 7, ("whole", "head_dim 7 is not a multiple of kpool 4")),
        (
            256,
            512,
            ("whole", "page size 128 is not a multiple of kpool 256"),
        ),
    ],
)
def test_the_header_says_why_keys_do_not_spread(kpool, head_dim, want):
    assert index_layout(kpool, head_dim, 128) == want


def test_a_line_every_interval_while_an_item_takes_long():
    """The heartbeat: lines while the first configuration compiles."""
    log = io.StringIO()
    progress = LineProgress(
        3, log, "bench", 0.05, unit="configurations", heartbeat=True
    )
    progress.set_postfix_str("step bfloat16 b1 k4")
    time.sleep(0.4)
    progress.close()
    lines = log.getvalue().splitlines()
    assert len(lines) >= 2
    assert lines[0].startswith("bench: 0/3 configurations, step bfloat16")
    after = log.getvalue()
    time.sleep(0.15)
    assert log.getvalue() == after  # closed: no more lines


def test_a_demo_widening_past_the_default_many_times_asks(capsys):
    """kpool 1024: expand_topk writes 256 times the default's positions."""
    assert demo.run(_demo_args("--kpool", "1024")) == 2
    err = capsys.readouterr().err
    assert "query rows to 525,311 positions each in expand_topk" in err
    assert "add --long-run" in err


def test_ctrl_c_is_one_line_and_status_130(monkeypatch, capsys):
    import mla_kpool.demo as demo_package

    def interrupted(args):
        raise KeyboardInterrupt

    monkeypatch.setattr(demo_package, "run", interrupted)
    assert cli.main(["demo"], prog=PROG) == 130
    assert capsys.readouterr().err == f"\n{PROG} demo: interrupted\n"

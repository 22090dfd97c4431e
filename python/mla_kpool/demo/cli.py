"""``python -m mla_kpool demo``: options, the run, and the summary it prints."""

from __future__ import annotations

import argparse
import functools
import json
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from max import driver

from .._argtypes import (
    MAX_HEAD_DIM,
    MAX_KPOOL,
    available_memory,
    head_dim_option,
    int_in,
    kpool_option,
    output_file,
    usage_error,
)
from .._limits import MAX_TOP_K
from .._paths import compiled_kernels
from .._progress import LINE_INTERVAL_S, LineProgress, progress_for
from ..reference import expand_topk_width
from ..runner import DEVICES, Runner
from . import workload
from .checked_run import (
    Config,
    compile_models,
    graph_cache_files,
    idle_model_seconds,
    make_plan,
    model_keys,
    serve,
)
from .checks import plural
from .faults import FAULT_KINDS, place_fault
from .indexing import (
    INDEX_HEADS,
    INDEX_MASKS,
    INDEX_PAGE_SIZE,
    index_layout,
    index_width,
)
from .schedule_file import load_schedule
from .scheduling import Plan
from .summary import format_summary, summarize
from .workload import ScheduleError

__all__ = [
    "DESCRIPTION",
    "EMULATED_REQUESTS",
    "add_arguments",
    "default_requests",
    "main",
    "models_source",
    "run",
]


class DemoError(Exception):
    """A usage problem: bad option combination, no GPU, bad schedule."""


#: How long the three models take to compile with an empty MAX cache, as
#: the demo says before it compiles them. The compile row less the Mojo
#: kernels' precompile, ``MODULAR_CACHE_DIR=$(mktemp -d) python -m
#: mla_kpool demo`` on 2-core VMs, MAX 26.7: 12.5-19 s on a quiet machine,
#: 40-110 s beside other compiles or on a slower one, 57.2 s at load 5-7
#: (docs/demo.md has the runs). A warm cache loads them in a few seconds.
COLD_COMPILE = (
    "about 15 s on a 2-core machine alone, 1-3 min on a busy or slower one"
)

#: What the line after the compile says the models' source was
#: (:func:`models_source`).
MODELS_SOURCE = {
    "compiled": "compiled into MAX's cache",
    "loaded": "loaded from MAX's cache",
    "in runner": "already compiled in the runner given",
    None: "compiled or loaded",
}

#: Requests ``--device gpu-emulated`` generates without ``--requests`` (or
#: a schedule): the emulated grid runs every GPU thread on the host, and the
#: default workload's index_top_k calls take minutes there. Nine requests of
#: seed 0 still bring rows that see more than 512 pools (index_top_k has to
#: choose).
EMULATED_REQUESTS = 9

#: Most requests a demo generates: the plan alone takes about 0.3 ms a
#: request (1.4 s for 4,096 requests on a 2-core VM), and 4,096 requests
#: are already 13,850 calls, past :data:`LONG_RUN_CALLS`.
MAX_REQUESTS = 4096
#: Most ring slots, tokens per call and tokens per prefill chunk: the
#: demo's sequences of every running request and one call's indexer
#: oracle (a float64 score per query row and candidate) stay in memory.
MAX_RUNNING = 1024
MAX_CALL_TOKENS = 65536
#: Most speculative drafts a verify step checks: the ring is
#: ``ring_length(kpool, N + 1)`` deep, a compile-time shape of the step.
MAX_SPEC_TOKENS = 64
#: Seeds are NumPy seeds, kept to what a JSON summary stores exactly.
MAX_SEED = 2**53 - 1
#: Calls past which a run asks for ``--long-run`` before it compiles, per
#: device: about 13 times the default workload's 152 calls on the host
#: devices (a minute or two), and on the emulated grid, where a call takes
#: seconds, about twice its default 88.
LONG_RUN_CALLS = {"cpu": 2000, "gpu": 2000, "gpu-emulated": 200}
#: Positions expand_topk may write in a run before it asks for
#: ``--long-run``: each query row widens to ``pool_topk * kpool + kpool -
#: 1`` of them, and the oracle checks each. The default workload writes
#: about 61 million (29,928 rows of 2,051) in well under a minute; at
#: ``--kpool 1024`` it would write 256 times as many (an hour or more).
LONG_RUN_POSITIONS = {
    "cpu": 1_000_000_000,
    "gpu": 1_000_000_000,
    "gpu-emulated": 100_000_000,
}
#: Bytes the demo keeps per element of ``head_dim`` of each token of each
#: running request (its keys and gates, their float64 draws, the FP8 key
#: cache and the oracle's float64 sequence; an upper estimate), for the
#: memory check of :func:`check_size`.
BYTES_PER_TOKEN_CHANNEL = 48
#: Bytes per position of a call's expand_topk rows (int32: the op's
#: output, the oracle's and the comparison's copies), for the same check.
BYTES_PER_EXPANDED_ID = 12


DESCRIPTION = (
    "Run a seeded serving workload (chunked prefill, decode steps, requests "
    "joining and leaving) through the k-pooled indexer: the fused step "
    "pools the keys (every pool of every request checked against the "
    "float64 oracle), the pools go into a paged FP8 key cache, index_top_k "
    "scores every query token against it (every row's selection checked "
    "against the oracle at the k-th score), and expand_topk widens the "
    "selection into token positions (every row checked)."
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Adds the demo's options to ``parser``.

    Args:
        parser: The ``demo`` subcommand's parser (or a standalone one).
    """
    # Errors found after parsing (a schedule file, --pool-topk past
    # index_top_k's limit) name the program as the usage line does.
    parser.set_defaults(prog=parser.prog)
    add = parser.add_argument
    add(
        "--seed",
        type=int_in(0, MAX_SEED, "a seed a JSON summary keeps exactly"),
        default=0,
        help="workload seed (0; below 2^53)",
    )
    add(
        "--dtype",
        choices=list(workload.DTYPES),
        help=f"key dtype ({workload.DEFAULT_DTYPE})",
    )
    add(
        "--kpool",
        type=kpool_option,
        help=f"tokens per pool ({workload.DEFAULT_KPOOL}; at most {MAX_KPOOL})",
    )
    add(
        "--head-dim",
        type=head_dim_option,
        help=f"channels per key ({workload.DEFAULT_HEAD_DIM}; at most"
        f" {MAX_HEAD_DIM}); the indexer's keys spread over kpool cache rows"
        " when kpool divides head_dim and the page size (128), else take"
        " whole rows (the run's header says which)",
    )
    add(
        "--requests",
        type=int_in(
            1,
            MAX_REQUESTS,
            f"{MAX_REQUESTS:,} requests plan about 14,000 calls already",
        ),
        help=f"requests to generate ({workload.DEFAULT_REQUESTS}; "
        f"{EMULATED_REQUESTS} on gpu-emulated; at most {MAX_REQUESTS});"
        " not with --schedule",
    )
    add(
        "--device",
        choices=list(DEVICES),
        default="cpu",
        help="where the kernels run (cpu); gpu-emulated runs the GPU kernels"
        " on the host, thread by thread",
    )
    add(
        "--token-budget",
        type=int_in(1, MAX_CALL_TOKENS, "a call's oracle is held in memory"),
        default=2048,
        help=f"most tokens per call (2048; at most {MAX_CALL_TOKENS})",
    )
    add(
        "--max-running",
        type=int_in(1, MAX_RUNNING, "every running request is in memory"),
        help="most requests in flight at once, which is the number of ring "
        f"slots ({workload.DEFAULT_MAX_RUNNING}; at most {MAX_RUNNING})",
    )
    add(
        "--chunk",
        type=int_in(1, MAX_CALL_TOKENS, "a chunk is at most a call's tokens"),
        default=512,
        help=f"prefill chunk size (512; at most {MAX_CALL_TOKENS})",
    )
    add(
        "--schedule",
        metavar="FILE",
        help="JSON workload: requests and, optionally, every call's batch",
    )
    add(
        "--pool-topk",
        type=int_in(1, MAX_TOP_K, "index_top_k's top_k is at most that"),
        default=workload.DEFAULT_POOL_TOPK,
        help="pool ids each query token's indexer row selects (index_top_k's"
        f" top_k, at most {MAX_TOP_K}), which expand_topk widens"
        f" ({workload.DEFAULT_POOL_TOPK})",
    )
    add(
        "--index-mask",
        choices=INDEX_MASKS,
        default=INDEX_MASKS[0],
        help="index_top_k's mask: null (GLM-5-Next's pipeline: every query "
        "of a call sees all the call's pools, and expand_topk drops those "
        "past the query) or causal (null)",
    )
    add(
        "--inject-fault",
        nargs="?",
        const=FAULT_KINDS[0],
        choices=FAULT_KINDS,
        help="corrupt one ring member (ring, the default), one key row "
        "(key), one selected pool id sent to expand_topk (topk), one head "
        "weight of one indexer query (head) or one request's indexer bound, "
        "one pool too many (bound), that the kernels see but the oracle "
        "does not; the check must then fail",
    )
    add(
        "--spec-tokens",
        type=int_in(1, MAX_SPEC_TOKENS, "the ring's depth grows with it"),
        metavar="N",
        help="speculative decoding: every decode step verifies the next "
        "token and N drafts, keeps a seeded number of them, and the ring "
        "is ring_length(kpool, N + 1) deep; not with a schedule that "
        "lists its calls",
    )
    add(
        "--json",
        metavar="FILE",
        type=output_file,
        help="also write the summary as JSON",
    )
    add(
        "--long-run",
        action="store_true",
        help="run a workload larger than a run makes unasked: more calls"
        f" ({LONG_RUN_CALLS['cpu']:,} on cpu and gpu,"
        f" {LONG_RUN_CALLS['gpu-emulated']} on gpu-emulated, several times"
        " the default workload's) or more expand_topk positions"
        f" ({LONG_RUN_POSITIONS['cpu']:,}, 16 times the default's); without"
        " it such a run stops before compiling and says its size",
    )
    add(
        "--no-progress",
        action="store_true",
        help="no progress display (a bar when stderr is a terminal, else a"
        f" line every {LINE_INTERVAL_S:.0f} s at most)",
    )


def main(
    argv: Sequence[str] | None = None, *, runner: Runner | None = None
) -> int:
    """Runs the demo with its own argument parser.

    Args:
        argv: The options (``sys.argv[1:]`` when ``None``).
        runner: A runner to reuse (tests share one so models compile once);
            a new one on ``--device`` when ``None``.

    Returns:
        The exit status: 0 all checks passed, 1 a check failed, 2 a usage
        error.
    """
    parser = argparse.ArgumentParser(
        prog="python -m mla_kpool demo", description=DESCRIPTION
    )
    add_arguments(parser)
    return run(parser.parse_args(argv), runner=runner)


def build_plan(args: argparse.Namespace) -> tuple[Config, Plan]:
    """Resolves the options (and the schedule file) into a config and plan.

    Args:
        args: Parsed options (see :func:`add_arguments`).

    Returns:
        ``(config, plan)``.

    Raises:
        DemoError: If options conflict or the schedule is bad.
        ScheduleError: If the schedule file cannot be read or parsed.
    """
    loaded = None
    if args.schedule is not None:
        if args.requests is not None:
            raise DemoError(
                "--requests and --schedule exclude each other (the schedule "
                "lists its requests)"
            )
        loaded = load_schedule(args.schedule)

    def pick(name: str, default: Any) -> Any:
        """The option's value, else the schedule file's, else ``default``."""
        option = getattr(args, name)
        in_file = loaded.settings.get(name) if loaded else None
        if option is not None and in_file is not None and option != in_file:
            raise DemoError(
                f"--{name.replace('_', '-')} {option} disagrees with "
                f'{args.schedule}, which has "{name}": {json.dumps(in_file)}'
            )
        return next((v for v in (option, in_file) if v is not None), default)

    as_given = "device seed token_budget chunk schedule pool_topk index_mask"
    config = Config(
        dtype=workload.DTYPES[pick("dtype", workload.DEFAULT_DTYPE)],
        kpool=pick("kpool", workload.DEFAULT_KPOOL),
        head_dim=pick("head_dim", workload.DEFAULT_HEAD_DIM),
        max_running=pick("max_running", workload.DEFAULT_MAX_RUNNING),
        spec_tokens=args.spec_tokens or 0,
        **{name: getattr(args, name) for name in as_given.split()},
    )
    if config.spec_tokens and loaded is not None and loaded.calls is not None:
        raise DemoError(
            f"--spec-tokens needs generated batching, but {args.schedule} "
            f'lists every call\'s tokens in "calls"'
        )
    try:
        requests = args.requests or default_requests(args.device)
        return config, make_plan(
            config,
            loaded.requests if loaded else requests,
            loaded.calls if loaded else None,
        )
    except ScheduleError as err:
        where = f"{args.schedule}: " if args.schedule else ""
        raise DemoError(f"{where}{err}") from err


def describe_size(plan_: Plan) -> str:
    """One line on a plan's size: requests, tokens, calls."""
    tokens = sum(e.tokens for call in plan_.calls for e in call)
    return (
        f"{plural(len(plan_.requests), 'request', grouped=True)},"
        f" {plural(tokens, 'token', grouped=True)} in"
        f" {plural(len(plan_.calls), 'call', grouped=True)},"
        f" {plural(plan_.max_slots, 'ring slot')}"
    )


def check_size(
    config: Config, plan_: Plan, long_run: bool, scheduled: bool = False
) -> None:
    """Refuses a run too large for this machine, or larger than asked for.

    Args:
        config: The run's configuration.
        plan_: Its calls.
        long_run: Whether ``--long-run`` was given.
        scheduled: Whether the requests come from ``--schedule`` (the
            advice then names the file, not ``--requests``).

    Raises:
        DemoError: If, without ``long_run``, the plan makes more calls
            than :data:`LONG_RUN_CALLS` or widens its rows to more
            expand_topk positions than :data:`LONG_RUN_POSITIONS` allow on
            the device; or if the running requests' sequences (about
            :data:`BYTES_PER_TOKEN_CHANNEL` bytes per token and channel of
            every ring slot at the longest request's length) or a call's
            widened rows (:data:`BYTES_PER_EXPANDED_ID` a position) would
            not fit in the memory this machine has available.
    """
    fewer = (
        "fewer requests in the schedule" if scheduled else "lower --requests"
    )
    limit = LONG_RUN_CALLS[config.device]
    calls = len(plan_.calls)
    if calls > limit and not long_run:
        raise DemoError(
            f"this workload is {describe_size(plan_)}, more than the"
            f" {limit:,} calls a run on {config.device} makes unasked; add"
            " --long-run"
            f" to run it, or {fewer}, or raise --token-budget"
        )
    rows = [sum(e.tokens for e in call) for call in plan_.calls]
    width = expand_topk_width(config.pool_topk, config.kpool)
    limit = LONG_RUN_POSITIONS[config.device]
    if sum(rows) * width > limit and not long_run:
        raise DemoError(
            f"this workload widens {sum(rows):,} query rows to {width:,}"
            f" positions each in expand_topk ({sum(rows) * width:,} in all,"
            f" with --kpool {config.kpool} and --pool-topk"
            f" {config.pool_topk}), more than the {limit:,} a run on"
            f" {config.device} writes unasked (hours); add --long-run to run"
            f" it, or lower --kpool or --pool-topk, or {fewer}"
        )
    have = available_memory()
    if have is None:
        return
    longest = max(r.end for r in plan_.requests)
    need = plan_.max_slots * longest * config.head_dim * BYTES_PER_TOKEN_CHANNEL
    if need > have:
        raise DemoError(
            f"--max-running {plan_.max_slots} and --head-dim"
            f" {config.head_dim} need about {need / 2**30:.1f} GiB for the"
            f" running requests' sequences (up to {longest:,} tokens each),"
            f" more than the {have / 2**30:.1f} GiB this machine has"
            " available; lower either"
        )
    need = max(rows) * width * BYTES_PER_EXPANDED_ID
    if need > have:
        raise DemoError(
            f"--kpool {config.kpool} and --pool-topk {config.pool_topk} widen"
            f" each query row to {width:,} positions: about"
            f" {need / 2**30:.1f} GiB for a call of {max(rows):,} tokens, more"
            f" than the {have / 2**30:.1f} GiB this machine has available;"
            " lower --token-budget (or --kpool, --pool-topk)"
        )


def default_requests(device: str) -> int:
    """Requests generated on ``device`` when no option or schedule says.

    Fewer on the emulated grid (:data:`EMULATED_REQUESTS`).
    """
    if device == "gpu-emulated":
        return EMULATED_REQUESTS
    return workload.DEFAULT_REQUESTS


def run(args: argparse.Namespace, *, runner: Runner | None = None) -> int:
    """Runs the demo for parsed options.

    Every op runs on ``--device``: the step, expand_topk and index_top_k,
    whose scorer is the CPU kernel on ``cpu``, on ``gpu`` MAX's builtin
    where it scores the shape and this package's GPU path elsewhere, and on
    ``gpu-emulated`` this package's GPU path over the emulated grid
    (:func:`mla_kpool.demo.indexing.index_scorer`; the summary names it).

    Args:
        args: Options from :func:`add_arguments`.
        runner: A runner to reuse; a new one on ``args.device`` when
            ``None``. Its device must match ``args.device``.

    Returns:
        The exit status: 0 all checks passed, 1 a check failed, 2 a usage
        error (printed to stderr).
    """
    started = time.perf_counter()
    out, err = sys.stdout, sys.stderr
    say = functools.partial(print, file=err, flush=True)
    try:
        config, plan_ = build_plan(args)
        fault = None
        if args.inject_fault:
            fault = place_fault(
                plan_,
                args.inject_fault,
                config.kpool,
                config.pool_topk,
                config.index_mask == "causal",
            )
            if fault is None:
                raise DemoError(
                    f"--inject-fault {args.inject_fault}: no call in this "
                    f"workload offers a place for it"
                )
        check_size(config, plan_, args.long_run, args.schedule is not None)
        runner = _runner_on(config.device, runner)
    except (DemoError, ScheduleError) as e:
        return usage_error(args, str(e))

    smaller = default_requests(config.device) != workload.DEFAULT_REQUESTS
    if smaller and args.requests is None and args.schedule is None:
        say(
            f"{config.device}: a smaller default workload, "
            f"{EMULATED_REQUESTS} requests instead of "
            f"{workload.DEFAULT_REQUESTS} (the emulated grid runs every GPU "
            "thread on the host); --requests sets the count"
        )
    say(f"workload: {describe_size(plan_)}")
    say("precompiling the Mojo kernels (2-7 s on 2 cores, every run)...")
    start = time.perf_counter()
    compiled_kernels()
    package_s = time.perf_counter() - start
    ring = f", ring {config.ring_len}" if config.spec_tokens else ""
    width = index_width(config.kpool, config.head_dim, INDEX_PAGE_SIZE)
    layout, why = index_layout(config.kpool, config.head_dim, INDEX_PAGE_SIZE)
    layout += f" layout: {why}" if why else " layout"
    say(
        f"compiling the step model ({config.dtype.name}, kpool "
        f"{config.kpool}, head_dim {config.head_dim}{ring}), the "
        f"expand_topk model (top {config.pool_topk}) and the index_top_k "
        f"model (H {INDEX_HEADS}, W {width}, {layout}, top {config.pool_topk}, "
        f"{config.index_mask} mask) on {config.device}: the first run "
        "compiles them into MAX's cache (~/.cache/modular by default), "
        f"{COLD_COMPILE}; later runs load them from it in a few seconds..."
    )
    in_runner = all(runner.has_model(k) for k in model_keys(runner, config))
    files_before = graph_cache_files()
    compile_s = package_s + compile_models(runner, config)
    models, files_added = models_source(
        in_runner, files_before, graph_cache_files()
    )
    idle_s = idle_model_seconds(runner, config)
    progress = progress_for(len(plan_.calls), err, not args.no_progress)
    every = (
        f", a progress line every {LINE_INTERVAL_S:.0f} s"
        if isinstance(progress, LineProgress)
        else ""
    )
    say(
        f"models {MODELS_SOURCE[models]} ({compile_s - package_s:.1f} s); "
        f"running {plural(len(plan_.calls), 'call')}{every}..."
    )
    described = fault.describe() if fault is not None else None
    if fault is not None:
        say(f"injecting a fault: {described}")
    totals = serve(config, plan_, runner, fault, progress)
    wall_s = time.perf_counter() - started
    summary = summarize(
        config,
        plan_,
        totals,
        compile_s,
        wall_s,
        described,
        package_s,
        models=models,
        cache_files_added=files_added,
        idle_s=idle_s,
    )
    for problem in totals.problems:
        print(f"FAIL {problem}", file=out)
    print(format_summary(summary), file=out)
    if fault is not None:
        caught = "caught" if fault.caught(totals.problems) else "NOT caught"
        print(f"injected fault {caught}: {described}", file=out)
    if args.json:
        Path(args.json).write_text(json.dumps(summary, indent=2) + "\n")
    return 0 if summary["ok"] else 1


def models_source(
    in_runner: bool, files_before: int | None, files_after: int | None
) -> tuple[str | None, int | None]:
    """Where the demo's models came from, and the files MAX's cache gained.

    Judged from :func:`graph_cache_files` around :func:`compile_models`.

    Args:
        in_runner: Whether the runner held all three models before.
        files_before: :func:`graph_cache_files` before the compile.
        files_after: The same after it.

    Returns:
        ``("in runner", 0)`` if the runner had them; else ``("compiled",
        n)`` if the cache gained ``n > 0`` files, ``("loaded", 0)`` if it
        gained none, and ``(None, None)`` if it has no folder after the
        compile (caching off or elsewhere: not known).
    """
    if in_runner:
        return "in runner", 0
    if files_after is None:
        return None, None
    added = files_after - (files_before or 0)
    return ("compiled" if added > 0 else "loaded"), added


def _runner_on(device: str, runner: Runner | None) -> Runner:
    """``runner`` if it is on ``device``, else a new runner there."""
    if runner is None:
        if device == "gpu" and driver.accelerator_count() == 0:
            raise DemoError(
                "--device gpu: no accelerator found (try --device cpu)"
            )
        return Runner(device)
    if runner.device_name != device:
        raise DemoError(
            f"the runner given is on {runner.device_name}, not {device}"
        )
    return runner

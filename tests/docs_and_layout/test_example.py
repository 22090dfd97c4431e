"""The examples run: ``examples/indexer_layer.py`` and ``quickstart.py``.

``indexer_layer.py`` compiles two models (its layer: two Linear projections, a
LayerNorm and the fused step at float32, kpool 4, head_dim 32; and its scorer,
``mla_kpool.index_top_k`` at 4 heads, top 2) and runs them in-process here.
What it prints is checked against pool events derived from its schedule with
the writers' arithmetic of docs/ops.md alone (which call
completes which pool of which request, and which writer builds it), so a run
that completes the wrong pools, or checks nothing, fails. The example's own
oracle check is tested separately on hand-made results, with no compile.

``examples/quickstart.py`` (the README's first graph: one bfloat16
``kpool_step`` with no ``custom_extensions``) compiles one more model; what
it prints per call is checked against the pool arithmetic.
"""

from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path
from types import ModuleType

import numpy as np
import pytest

REPO = Path(__file__).resolve().parents[2]
KPOOL = 4

#: The example's schedule: (name, slot, prompt) and the decode batch order.
REQUESTS = [("A", 2, 7), ("B", 0, 5), ("C", 3, 10)]
DECODE_ORDER = ["C", "A", "B"]
DECODE_STEPS = 5

EVENT = re.compile(r"^  (\w) pool (\d+) \(\s*(ring_close|compress)\): \[")


def _load(name: str) -> ModuleType:
    path = REPO / "examples" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses resolve it by name
    spec.loader.exec_module(module)
    return module


def _load_example() -> ModuleType:
    return _load("indexer_layer")


@pytest.fixture(scope="module")
def example() -> ModuleType:
    return _load_example()


def expected_events() -> list[list[tuple[str, int, str]]]:
    """Per call, the (request, pool, writer) events the contract implies."""
    calls = [[(name, prompt) for name, _, prompt in REQUESTS]]
    calls += [[(name, 1) for name in DECODE_ORDER]] * DECODE_STEPS
    seen = {name: 0 for name, _, _ in REQUESTS}
    events = []
    for batch in calls:
        step = []
        for name, n in batch:
            c = seen[name]
            p, r = divmod(c, KPOOL)
            if r and c + n >= (p + 1) * KPOOL:
                step.append((name, p, "ring_close"))
            first = -(-c // KPOOL)
            for pool in range(first, (c + n) // KPOOL):
                step.append((name, pool, "compress"))
            seen[name] = c + n
        events.append(step)
    return events


def test_example_runs_and_prints_every_pool(example, capsys):
    status = example.main([])
    out = capsys.readouterr().out
    assert status == 0, out
    got: list[list[tuple[str, int, str]]] = []
    for line in out.splitlines():
        if line.startswith("step "):
            got.append([])
        elif match := EVENT.match(line):
            name, pool, writer = match.groups()
            got[-1].append((name, int(pool), writer))
    want = expected_events()
    assert got == want, out
    pools = sum(len(step) for step in want)
    assert f"OK: {pools} pools of 3 requests match" in out, out
    # Every token scored, null mask: a row sees the (c + n) // kpool pools
    # complete after its call, and chooses when that is more than top 2.
    calls = [[(name, prompt) for name, _, prompt in REQUESTS]]
    calls += [[(name, 1) for name in DECODE_ORDER]] * DECODE_STEPS
    seen = {name: 0 for name, _, _ in REQUESTS}
    rows = chose = 0
    for batch in calls:
        for name, n in batch:
            seen[name] += n
            rows += n
            chose += n * (seen[name] // KPOOL > example.TOP_K)
    assert (
        f"{rows} index_top_k rows ({chose} chose 2 of more pools) match"
        " mla_kpool.reference.check_selection"
    ) in out, out
    picks = [line for line in out.splitlines() if "select pools:" in line]
    assert len(picks) == len(calls)
    # The schedule exercises both writers and a call that completes nothing.
    writers = {writer for step in want for _, _, writer in step}
    assert writers == {"ring_close", "compress"} and [] in want


def test_example_check_catches_wrong_missing_and_duplicate_pools(example):
    rng = np.random.default_rng(3)
    weights = example.random_weights(rng)
    request = example.Request("R", 1, 9, example.random_hidden(rng, 9))
    request.seen = 9
    want = example.expected_pools(request, weights)
    assert want.shape == (2, example.HEAD_DIM)

    request.pools = {0: [(0, want[0].astype(np.float32))]}
    assert example.check([request], weights) == ["R: pools [0], expected 0..1"]

    wrong = want[1] + 1e-3 * np.abs(want).max()
    request.pools[1] = [(2, wrong.astype(np.float32))]
    (failure,) = example.check([request], weights)
    assert failure.startswith("R pool 1 (step 2): max error"), failure

    request.pools[1] = [(1, want[1]), (2, want[1])]
    assert example.check([request], weights) == [
        "R pool 1: produced in steps [1, 2]"
    ]

    request.pools[1] = [(1, want[1])]
    assert example.check([request], weights) == []


# --------------------------------------------------------------------------
# examples/quickstart.py: the README's first graph (bfloat16, no extensions)
# --------------------------------------------------------------------------


def quickstart_lines(kpool: int) -> list[str]:
    """What each quickstart call must print, from the pool arithmetic."""
    calls = [([6, 3], [0, 0]), ([2, 1], [6, 3])]
    lines = []
    for i, (new, seen) in enumerate(calls):
        closed, built = [], []
        for n, c in zip(new, seen, strict=True):
            p, r = divmod(c, kpool)
            closed.append(p if r and c + n >= (p + 1) * kpool else -1)
            built.append(max(0, (c + n) // kpool - -(-c // kpool)))
        lines.append(
            f"call {i}: closed from the ring {closed}, new pools {built}"
        )
    return lines


def test_quickstart_runs_without_custom_extensions(capsys):
    """Its graph passes no custom_extensions: kpool_step loads the kernels."""
    quickstart = _load("quickstart")
    assert (
        "custom_extensions"
        not in (REPO / "examples" / "quickstart.py")
        .read_text()
        .split('"""', 2)[2]
    )
    status = quickstart.main()
    out = capsys.readouterr().out
    assert status == 0, out
    want = quickstart_lines(quickstart.KPOOL)
    # Both calls do something: a pool from new tokens, then two from the ring.
    assert want[0].endswith("[1, 0]") and "[1, 0], new" in want[1]
    assert out.splitlines() == [*want, "OK: matches"], out

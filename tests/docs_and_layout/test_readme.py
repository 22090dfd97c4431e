"""Every Python block of README.md runs as written.

The blocks run in order in one namespace, as a reader pasting them into one
session would: the bfloat16 graph and the ``check_metadata`` call after it
are one script, the ``kernels_loaded`` block and the imports block stand
alone (the first builds everything it uses; its graph compiles too). What
the first block prints is checked against the output block the README shows
right after it, and the ``kernels_loaded`` model against the oracle.
"""

from __future__ import annotations

import contextlib
import io
import re
from pathlib import Path

import numpy as np

README = (Path(__file__).resolve().parents[2] / "README.md").read_text()

#: Fenced blocks: (language, body).
BLOCKS = re.findall(r"^```(\w*)\n(.*?)^```$", README, re.M | re.S)


def python_blocks() -> list[str]:
    return [body for lang, body in BLOCKS if lang == "python"]


DOCS = Path(__file__).resolve().parents[2] / "docs"


def test_the_docs_are_ones_a_newcomer_finishes():
    """The README at most 250 lines, docs/ at most 3,000 in all and
    performance.md, today's figures only, at most 500 (history goes to
    benchmarks/results/LOG.md)."""
    assert len(README.splitlines()) <= 250
    lines = {p.name: len(p.read_text().splitlines()) for p in DOCS.glob("*.md")}
    assert lines["performance.md"] <= 500, lines
    assert sum(lines.values()) <= 3000, lines


def test_every_python_block_runs_as_written():
    blocks = python_blocks()
    assert len(blocks) == 4, [b.splitlines()[0] for b in blocks]
    # The output the README shows after the first block.
    after = README.split(blocks[0] + "```\n", 1)[1]
    shown = re.search(r"^```\n(.*?)^```$", after, re.M | re.S).group(1)
    namespace: dict = {"__name__": "readme"}
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        exec(compile(blocks[0], "README.md block 1", "exec"), namespace)
    assert printed.getvalue() == shown
    # check_metadata on the first block's call passes (returns None) ...
    exec(compile(blocks[1], "README.md block 2", "exec"), namespace)
    # ... the kernels_loaded block stands alone: a fresh namespace.
    alone: dict = {"__name__": "readme"}
    exec(compile(blocks[2], "README.md block 3", "exec"), alone)
    # kpool 4, rows packed as pools in selection order, then the pool still
    # filling (visible % 4 newest positions), then -1; 11 columns.
    # Request 0 (c 5): row 0 sees 6 positions; pool 1 (4..7) is not
    # complete, so only its tail 4, 5. Request 1 (c 9): row 1 sees 10
    # (pools 0 and 1, tail 8, 9); row 2 sees 11 (pool 2 is not complete:
    # skipped; tail 8, 9, 10).
    ids = np.array([[1, -1], [0, 1], [0, 2]], np.int32)
    offsets = np.array([0, 1, 3], np.uint32)
    lengths = np.array([5, 9], np.uint32)
    (out,) = alone["model"].execute(ids, offsets, lengths)
    pad = [-1] * 11
    want = [
        ([4, 5] + pad)[:11],
        ([0, 1, 2, 3, 4, 5, 6, 7, 8, 9] + pad)[:11],
        ([0, 1, 2, 3, 8, 9, 10] + pad)[:11],
    ]
    np.testing.assert_array_equal(out.to_numpy(), want)
    exec(compile(blocks[3], "README.md block 4", "exec"), {})

"""The emulated GPU grid catches faults that only the GPU code has.

Every kernel test parametrized over devices also runs on ``gpu-emulated``:
the ops' GPU kernel bodies (``*_thread`` in ``kernels/``) run on the host
for every block and thread of the launch the GPU path computes. This file
checks that those runs can fail: each case copies the kernels, plants one
fault in code that only the GPU path executes, builds a ``gpu-emulated``
runner on the copy and runs an existing test of the suite with it. The test
must fail; with the real kernels the same test passes in its normal
parametrization. One compile per mutant.

The launch-shape checks of the emulator itself (empty grid, a block over
1024 threads, a grid past 2^31 - 1) are unit-tested in Mojo, in
``tests/mojo/test_gpu_kernels.mojo``.
"""

from __future__ import annotations

import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest

from mla_kpool import KERNELS
from mla_kpool.runner import Runner
from support import expand_topk_cases as expand
from support import ring_close_cases as rc
from support.kpool_cases import BF16, MAIN, STEP_CONFIGS, Config

#: Seed of the planted-fault runs, unlike any the suite's own tests use: a
#: faulty kernel that leaves output channels unwritten is only seen if the
#: buffer MAX hands it does not already hold the right answer (MAX reuses
#: freed buffers, and the suite runs the same test on good kernels).
MUTANT_SEED = 0xBAD5EED

#: The step configuration whose head (1089 channels: odd, so a channel a
#: thread) is wider than a block (1024 threads), so threads stride over a
#: second channel.
WIDE = Config(BF16, 2, 1089)
assert WIDE in STEP_CONFIGS


def _expand_decode(runner: Runner) -> None:
    expand.run_case(
        runner, next(c for c in expand.CASES if c.name == "decode_valid")
    )


def _empty_batch(runner: Runner) -> None:
    case = next(c for c in rc.CORNERS if c.id == "batch0_with_tokens")
    rc.check_corner(runner, case)


@dataclass(frozen=True)
class Mutant:
    """One planted GPU-only fault and the suite test that must catch it.

    Attributes:
        id: pytest id.
        file: Kernel file to change.
        good: The exact source text replaced (must occur once).
        bad: Its faulty replacement.
        run: Runs an existing test with the given runner.
        raises: What the test must fail with.
        match: Regular expression the failure message must match.
    """

    id: str
    file: str
    good: str
    bad: str
    run: Callable[[Runner], None]
    raises: type[Exception]
    match: str


MUTANTS = [
    Mutant(
        # Threads skip every other stride of channels: with 1089 channels
        # and 1024 threads, channels 1024..1088 are never written, so they
        # hold whatever the output buffer held: wrong pooled keys, or
        # non-zero rows where nothing closed (the fused step pools through
        # the same loop).
        "writer_channel_stride",
        "writers/pooling.mojo",
        "range(lane.first, head_dim, lane.stride)",
        "range(lane.first, head_dim, lane.stride * 2)",
        lambda runner: rc.check_step_mixed_batch(runner, WIDE, MUTANT_SEED),
        AssertionError,
        "pooled|closed_pool -1 are not exactly zero",
    ),
    Mutant(
        # Blocks overlap instead of taking rows_per_block rows each: the
        # rows past the first block's few are never written (float32 x 128
        # channels: 32 threads a row, two rows a block).
        "writer_rows_per_block",
        "writers/gpu_rows.mojo",
        "block * rows + thread // threads",
        "block + thread // threads",
        lambda runner: rc.check_step_mixed_batch(runner, MAIN, MUTANT_SEED),
        AssertionError,
        "pooled|closed_pool|compressed pools|first_pool",
    ),
    Mutant(
        # The owner search looks one output row ahead: the last row of each
        # request's span goes to the next request, which has no such pool.
        "compress_owner_off_by_one",
        "writers/compress.mojo",
        "last_span_at(op.pool_row_offsets, op.call.batch, row)",
        "last_span_at(op.pool_row_offsets, op.call.batch, row + 1)",
        lambda runner: rc.check_step_mixed_batch(runner, MAIN, MUTANT_SEED),
        AssertionError,
        "compressed pools",
    ),
    Mutant(
        # Every thread compacts its valid ids from slot 0 instead of from
        # its exclusive prefix: the threads' writes collide in one phase.
        "expand_topk_prefix_ignored",
        "writers/expand_topk.mojo",
        "var at = Int(lane.result())",
        "var at = 0",
        _expand_decode,
        ValueError,
        "kpool_expand_topk_kernel",
    ),
    Mutant(
        # Without the launcher's guard an empty batch launches an empty
        # grid, which a GPU refuses and the emulator refuses the same way.
        "launch_missing_empty_grid_guard",
        "grid/parallel.mojo",
        "    if grid == 0:\n        return\n",
        "",
        _empty_batch,
        ValueError,
        "kpool_ring_close_kernel: empty grid",
    ),
]


@pytest.mark.emulated
@pytest.mark.parametrize("mutant", MUTANTS, ids=lambda m: m.id)
def test_emulation_catches_planted_gpu_fault(
    mutant: Mutant, tmp_path: Path
) -> None:
    kernels = tmp_path / "kernels"
    shutil.copytree(KERNELS, kernels)
    path = kernels / mutant.file
    source = path.read_text()
    assert source.count(mutant.good) == 1, (
        f"{mutant.id}: the planted line moved in {mutant.file}; update it"
    )
    path.write_text(source.replace(mutant.good, mutant.bad))

    with pytest.raises(mutant.raises, match=mutant.match):
        mutant.run(Runner("gpu-emulated", kernels=kernels))

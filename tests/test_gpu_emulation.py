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

import ring_close_cases as rc
from kpool_cases import BF16, MAIN, STEP_CONFIGS, Config
from mla_kpool import KERNELS
from mla_kpool.runner import Runner

#: Seed of the planted-fault runs, unlike any the suite's own tests use: a
#: faulty kernel that leaves output channels unwritten is only seen if the
#: buffer MAX hands it does not already hold the right answer (MAX reuses
#: freed buffers, and the suite runs the same test on good kernels).
MUTANT_SEED = 0xBAD5EED

#: The step configuration whose head (1088 channels) is wider than a block
#: (1024 threads), so each thread strides over a second channel.
WIDE = Config(BF16, 2, 1088)
assert WIDE in STEP_CONFIGS


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
        # Threads skip every other block-width of channels: with 1088
        # channels and 1024 threads, channels 1024..1087 are never written,
        # so they hold whatever the output buffer held: wrong pooled keys,
        # or non-zero rows where nothing closed (the fused step runs this
        # thread body too).
        "ring_close_thread_stride",
        "writers/ring_close.mojo",
        "range(thread, head_dim, stride)",
        "range(thread, head_dim, stride * 2)",
        lambda runner: rc.check_step_mixed_batch(runner, WIDE, MUTANT_SEED),
        AssertionError,
        "pooled|closed_pool -1 are not exactly zero",
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
        # Without the launcher's guard an empty batch launches an empty
        # grid, which a GPU refuses and the emulator refuses the same way.
        "launch_missing_empty_grid_guard",
        "model/parallel.mojo",
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

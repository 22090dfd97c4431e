"""The tensor-core scorer's phases on the emulated grid, exact.

The call of `exact_scorer_call.mojo` (six query rows of two requests and
none, 70 candidates at most: the last 64-candidate tile partly empty),
through `emulate_kernel`, every shared-memory access checked:

- 72 heads of depth 48 (padded to 64 bytes of K), a row per tile: two
  products per tile (64 heads, then 8);
- 24 heads of depth 48 in grouped blocks (4 rows and 4 tiles a block,
  N = 96 padded to 128; a row of 300 candidates, so a group takes two
  blocks): a block whose rows belong to two requests (two segments, each
  with its own keys), one with a row of no request and one past the
  call's rows.

Inputs are small integers in e4m3fn and the weights and scales small
powers of two, so every score is exact in float32 whatever the order of
the sums, and each must equal the host's product exactly.
tests/grid/test_gpu_kernels.py plants faults in the scorer (a wrong register
row, a wrong descriptor stride, the product in the staging phase, a
segment's keys taken from the group's first request) and requires this
file to fail.
"""

from std.testing import TestSuite

from exact_scorer_call import ExactCall

from kernels.index.gpu.wgmma_tiles import group_rows, groups_blocks

# Small e4m3fn integers: 0, +-1 .. +-4.
comptime CODES = SIMD[DType.uint8, 8](
    0x00, 0x38, 0x40, 0x44, 0x48, 0xB8, 0xC0, 0x38
)


def test_scores_are_exact() raises:
    var call = ExactCall[72, 48](CODES)
    call.score["wgmma"]()
    call.check("")


def test_grouped_blocks_fit_shared_memory() raises:
    # Grouped where one row's double-buffered tiles fit 48 KiB: 4 rows at
    # 32 heads of 128, 2 at 64, 1 row (and 4 tiles) at 32 heads of 256;
    # not 64 heads of 256 (one row takes 51,200 B), nor more heads than one
    # product takes.
    comptime assert group_rows[32, 128]() == 4
    comptime assert group_rows[32, 256]() == 1
    comptime assert group_rows[64, 128]() == 2
    comptime assert groups_blocks[64, 224]()
    comptime assert not groups_blocks[64, 256]()
    comptime assert not groups_blocks[72, 48]()


def test_grouped_rows_are_exact() raises:
    comptime assert group_rows[24, 48]() == 4, "four rows a tile"
    # Row 0 sees 300 candidates: a second block of 4 tiles for its group.
    var call = ExactCall[24, 48, 300](CODES)
    call.score["wgmma", grouped=True]()
    call.check("grouped ")


def main() raises:
    TestSuite.discover_tests[__functions_in_module()]().run()

"""The tensor-core scorer's phases on the emulated grid, exact.

Two query rows of one request score 70 and 40 candidates (the last tile
partly empty; `exact_scorer_call.mojo`) with 72 heads (two products: 64 heads, then 8) of depth 48
(padded to 64 bytes of K), through `emulate_kernel`, every shared-memory
access checked. Inputs are small integers in e4m3fn and the weights and
scales small powers of two, so every score is exact in float32 whatever
the order of the sums, and each must equal the host's product exactly.
tests/test_gpu_kernels.py plants faults in the scorer (a wrong register
row, a wrong descriptor stride, the product in the staging phase) and
requires this file to fail.
"""

from std.testing import TestSuite

from exact_scorer_call import ROWS, ExactCall

comptime H = 72
comptime D = 48


def test_scores_are_exact() raises:
    # Small e4m3fn integers: 0, +-1 .. +-4.
    var call = ExactCall[H, D](
        SIMD[DType.uint8, 8](0x00, 0x38, 0x40, 0x44, 0x48, 0xB8, 0xC0, 0x38)
    )
    call.score["wgmma"]()
    call.check("")


def main() raises:
    TestSuite.discover_tests[__functions_in_module()]().run()

"""The MFMA scorer's phases on the emulated grid, exact.

The call of `exact_scorer_call.mojo` (six query rows of two requests and
none; 70 candidates at most, the last tile partly empty) through
`emulate_kernel`, every shared-memory access
checked, at two shapes: 40 heads (three head chunks, the last 8 heads
padding) of depth 48 (two instructions per chunk, lane groups 2 and 3
partly and wholly padding), and 16 heads of depth 132 (five
instructions; keys at odd candidates unaligned, so the byte loads run).
Inputs are small integers in e4m3fn, `0x80` (-0, e4m3fnuz's NaN) among
them, and the weights and scales small powers of two, so every score is
exact in float32 whatever the order of the sums, and each must equal the
host's product over the e4m3fn values exactly: the e4m3fn -> e4m3fnuz
byte mapping (halved values, times 4, `0x80` cleared) included.
"""

from std.testing import TestSuite

from exact_scorer_call import ExactCall


def _scores_are_exact[H: Int, D: Int]() raises:
    # Small e4m3fn integers, -0 (0x80, e4m3fnuz's NaN) among them.
    var call = ExactCall[H, D](
        SIMD[DType.uint8, 8](0x00, 0x38, 0x40, 0x44, 0x48, 0xB8, 0xC0, 0x80)
    )
    call.score["mfma"]()
    call.check(String("H ", H, " D ", D, " "))


def test_scores_are_exact_three_head_chunks() raises:
    _scores_are_exact[40, 48]()


def test_scores_are_exact_five_steps_unaligned_keys() raises:
    _scores_are_exact[16, 132]()


def main() raises:
    TestSuite.discover_tests[__functions_in_module()]().run()

"""The writers' pooling arithmetic, unit-tested in Mojo.

``tests/mojo/test_pooling.mojo`` checks the CPU's bfloat16 conversion in
vector integer ops against the compiler's own float32 to bfloat16 cast, bit
for bit, for every high half of a float32 with low halves around the
rounding tie; and the GPU writers' element accesses (tensors not 16-byte
aligned, which the suite's MAX buffers never are) against the CPU path,
emulated, bit for bit.
"""

from __future__ import annotations

from support.kpool_cases import needs_mojo, run_mojo_suite


@needs_mojo
def test_pooling_units() -> None:
    run_mojo_suite("tests/mojo/test_pooling.mojo")

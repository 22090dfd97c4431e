"""The CPU prefill scorer's parts, unit-tested in Mojo.

``tests/mojo/test_index_cpu_prefill.mojo`` checks the radix sort and the
radix select of rank keys against ``sort``, the bounded pool's kept keys
against the heap's bit for bit, the register-blocked head blocks (keys
transposed, heads padded to whole blocks, a NaN key) against the row
scorer, and the bfloat16 pair blocks against the float32 blocks.
"""

from __future__ import annotations

from kpool_cases import needs_mojo, run_mojo_suite


@needs_mojo
def test_prefill_scorer_parts() -> None:
    run_mojo_suite("tests/mojo/test_index_cpu_prefill.mojo")

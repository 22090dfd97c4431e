"""The indexer kernel's FP8 decode and ranking key, unit-tested in Mojo.

``tests/mojo/test_index_top_k.mojo`` checks the kernel's integer-SIMD
e4m3fn decode against Mojo's own float8 conversion for all 256 bytes, the
row decoder's SIMD steps and tail, and that the ranking key orders by score
(``-0.0`` as ``0.0``, NaN as ``-inf``) and then by lower id.
"""

from __future__ import annotations

from support.kpool_cases import needs_mojo, run_mojo_suite


@needs_mojo
def test_decode_and_rank_key() -> None:
    run_mojo_suite("tests/mojo/test_index_top_k.mojo")

"""Runs tests/mojo/test_index_score_asm.mojo: the GPU scorers' machine code.

The Mojo test compiles index_top_k's tiled and untiled scorers for sm_90a,
sm_100a (PTX) and gfx942 (AMDGCN) at GLM-5-Next's and DeepSeek-V3.2's
indexer shapes, without a GPU, and checks no local memory or scratch, the
hardware FP8 decode (``cvt.rn.f16x2.e4m3x2``), 16-byte key loads, the tiled
scorer's LDS and block threads, and that the float8 cast the NVIDIA path
uses equals the integer decode on all 256 bytes.
"""

from __future__ import annotations

from support.kpool_cases import needs_mojo, run_mojo_suite


@needs_mojo
def test_index_scorers_machine_code():
    run_mojo_suite("tests/mojo/test_index_score_asm.mojo")

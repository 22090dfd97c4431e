"""Host models of the tensor-core instructions the GPU scorers issue,
written from the ISA tables, so that the tensor scorers run on the
emulated grid: `wgmma` (Hopper's FP8 `wgmma`, for `gpu/wgmma.mojo`) and
`mfma` (CDNA3's FP8 `mfma`, for `gpu/mfma.mojo`).
"""

"""The pooled indexer `mla_kpool.index_top_k`: its registration
(`top_k`), its operands (`operands`), the rows each query
scores (`plan`), the FP8 decode (`fp8`), the candidate order
(`rank`) and the scorer choice (`scorers`), shared by its CPU
path (`cpu/`) and its GPU path (`gpu/`).

It scores each query token against a paged FP8 key cache and keeps the
ids of its best `k` keys or pools. Its CPU path (`cpu/tasks.mojo`,
scoring in `cpu/score.mojo`) and its GPU path (`gpu/launches.mojo`: the
plan, score and select launches; the scorers in `gpu/score.mojo` with
`gpu/shape.mojo`, `gpu/wgmma.mojo` and `gpu/mfma.mojo`, picked in
`scorers.mojo`; the select in `gpu/select.mojo`) share the operand
struct (`operands.mojo`), the rows scored and their bounds (`plan.mojo`),
the FP8 decode (`fp8.mojo`) and the candidate order (`rank.mojo`).
"""

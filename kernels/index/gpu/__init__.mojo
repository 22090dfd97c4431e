"""`index_top_k`'s GPU path: the plan, score and select launches
(`launches`), the FP32 scorer (`score`, `shape`), the
tensor-core scorers (`wgmma`, `mfma`) with the host models of
their instructions (`emulated.wgmma`, `emulated.mfma`), and the select
(`select`, its `pick` and a split row's `compaction`).
"""

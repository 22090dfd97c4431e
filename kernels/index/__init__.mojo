"""The pooled indexer `mla_kpool.index_top_k`: its registration
(`index_top_k`), its operands (`operands`), the rows each query
scores (`plan`), the FP8 decode (`fp8`), the candidate order
(`rank`) and the scorer choice (`scorers`), shared by its CPU
path (`cpu/`) and its GPU path (`gpu/`).
"""

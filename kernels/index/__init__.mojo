"""The pooled indexer `mla_kpool.index_top_k`: its registration
(`index_top_k`), its operands (`index_operands`), the rows each query
scores (`index_plan`), the FP8 decode (`index_fp8`), the candidate order
(`index_rank`) and the scorer choice (`index_scorers`), shared by its CPU
path (`cpu/`) and its GPU path (`gpu/`).
"""

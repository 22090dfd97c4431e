"""`index_top_k`'s CPU path: the driver (`index_cpu`), the decode scorer
(`index_cpu_score`), the register-blocked prefill scorer
(`index_cpu_prefill`, `index_cpu_block`).
"""

"""`index_top_k`'s CPU path: the tasks over the cores (`tasks`), the decode scorer
(`score`), the register-blocked prefill scorer
(`prefill`, `block`).
"""

"""No-op stand-ins for the k-pool ops, for measuring MAX's per-call floor.

Registers `mo.mla.kpool.ring_close`, `mo.mla.kpool.compress`,
`mo.mla.kpool.seed_tail`, the fused `mla_kpool.step` and
`mo.mla.kpool.expand_topk` with the real ops' signatures and empty bodies. A graph built exactly like the real one but
loaded with this package instead of `mla_kpool.KERNELS` costs what MAX
itself costs per call with the same operands: the benchmark's framework
floor. Never load both packages in one graph.
"""

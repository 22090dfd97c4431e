"""The mla-kpool Mojo package: CPU and GPU kernels of the k-pooled sparse-attention indexer.

Registers four graph ops under the names MAX 26.7 gives its GPU-only
builtins, so that a graph loading this package runs them on CPU and GPU:

- `mo.mla.kpool.ring_close` (`ring_close.mojo`): closes each request's
  pending pool from the tail ring plus this call's leading tokens.
- `mo.mla.kpool.compress` (`compress.mojo`): pools every pool made entirely
  of this call's tokens.
- `mo.mla.kpool.seed_tail` (`seed_tail.mojo`): stashes the trailing
  incomplete tokens into the ring.
- `mo.mla.kpool.expand_topk` (`expand_topk.mojo`): widens the pool ids an
  indexer selected per query token into the token positions attention
  reads.

`ring_close`, `compress` and the fused step share the per-channel pooling
routine in `pooling.mojo`, so a pool comes out bitwise identical whichever
of them builds it; `seed_tail` only copies rows into the ring.

`mla_kpool.step` (`step.mojo`, under a name of this package's own) does the
three writers' work and the pool row offsets for one call in one op, bitwise
equal to the three-op sequence.

`mla_kpool.index_top_k` (`top_k.mojo`, also under a name of this
package's own) is the indexer that consumes the pooled keys: MAX 26.7's
`mo.mla.indexer.ragged.float8.paged` (same parameters and operands) on the
CPU, where MAX has none. It scores each query token against a paged FP8 key
cache and keeps the ids of its best `k` keys or pools. Under `index/`,
its CPU path (`cpu/tasks.mojo`, scoring in `cpu/score.mojo`) and its GPU
path (`gpu/launches.mojo`: the plan, score and select launches; the
scorers in `gpu/score.mojo` with `gpu/shape.mojo`, `gpu/wgmma.mojo` and
`gpu/mfma.mojo`, picked in `scorers.mojo`; the select in
`gpu/select.mojo`) share the operand struct (`operands.mojo`), the rows
scored and their bounds (`plan.mojo`), the FP8 decode (`fp8.mojo`) and the
candidate order (`rank.mojo`).

Every GPU kernel is declared once, next to its body, as a
`gpu_kernel.GpuKernel` (name, operands, threads, shared words, phases,
grid rule), and launched by `gpu_kernel.launch_kernel`: as
`parallel.gpu_kernel` when its threads never communicate (the writers,
the plan), as `gpu_kernel.gpu_block_kernel` when they cooperate (phases
separated by barriers, registers across them, shared memory, atomics,
collectives: the scorers, the select, the step's scan); on the CPU both
run over an emulated grid, the phased one with an emulation that refuses a
missing barrier, a race with an atomic or a lane left out of a collective. `gpu-report` and the compile tests compile the
same declarations.
"""

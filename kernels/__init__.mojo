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
`mla_kpool.step` (`step.mojo`, a name of this package's own) does the three
writers' work and the pool row offsets for one call in one op, bitwise equal
to the three-op sequence. The writers are in `writers/`.

`mla_kpool.index_top_k` (`index/top_k.mojo`, also under a name of this
package's own) is the indexer that consumes the pooled keys: MAX 26.7's
`mo.mla.indexer.ragged.float8.paged` (same parameters and operands) on the
CPU, where MAX has none; `index/` holds it (its docstring maps the files).

Each GPU kernel is declared once (`grid/`), run on a GPU or an emulated
grid on the CPU, and compiled by `gpu-report` and the compile tests.
"""

"""The profile's driver: index_top_k's and the writers' launches at the
documented workloads, emulated with every shared access and every global
access made through the thread's view recorded (`profile_kernel`), each
printed as one JSON line.

`mojo run -I <package parent> launches.mojo WARP SAMPLE [OPS]` profiles, in
warps of `WARP` lanes (32 for sm_*, 64 for gfx942), with `OPS` `index`,
`writers` or `all` (the default):

- index_top_k (12 launches): the plan, each scorer the target builds and
  the select of GLM-5-Next's decode (16 requests of 32K tokens) and
  4,096-token prefill and DeepSeek-V3.2's decode;
- the writers (10 launches): ring_close, compress, seed_tail and
  expand_topk at batch 64 and 4,096, and both launches of the fused step
  (its scan, then its rows) at batch 4,096, on the bench's workloads
  (`mla_kpool.bench.workload`: bfloat16, head_dim 128, kpool 4; int32
  pool ids, top 512, for expand_topk), built here in host memory as the
  bench builds them (`WriterCall`).

Workloads are
named as `mla_kpool.bench.bounds.WORKLOADS` names them. A launch of
more than `SAMPLE` blocks runs `SAMPLE` of them (`sampled_blocks` in its
line; its counts are those blocks'; a select runs as many whole rows as
`SAMPLE` blocks hold, `window_rows` in its line). The call is the op's own
(`IndexOperands`) over a paged cache built here: random FP8 bytes and
scales, pages in a shuffled order; a select reads random scores (its work
follows the scores, not the scorer that wrote them). A writer's line has
`"window_rows": 0` (no windows).
"""

from std.math import ceildiv, max, min
from std.random import random_float64, random_ui64, seed
from std.sys import argv

from kernels.index.gpu.launches import PlanKernel, SelectKernel
from kernels.index.gpu.select import select_slices, split_words
from kernels.index.operands import IndexOperands, IndexWorkspace
from kernels.index.scorers import MFMA, SIMT, WGMMA, ScoreKernel
from kernels.index.gpu.wgmma import wgmma_groups_rows
from kernels.grid.gpu_kernel import GpuKernel, grid_blocks, profile_kernel
from kernels.grid.ragged import RaggedCall, Ring
from kernels.writers.compress import CompressKernel, CompressOperands
from kernels.writers.expand_topk import (
    ExpandTopKKernel,
    ExpandTopKOperands,
    row_width,
)
from kernels.writers.gpu_rows import gpu_aligned
from kernels.writers.ring_close import RingCloseKernel, RingCloseOperands
from kernels.writers.seed_tail import SeedTailKernel, SeedTailOperands
from kernels.writers.step import StepKernel, StepOperands, StepScanKernel

comptime U32 = DType.uint32
comptime PAGE_SIZE = 128
comptime BF16 = DType.bfloat16
comptime KPOOL = 4
"""The writers' workloads: bfloat16 keys of 128 channels, pools of 4."""
comptime HEAD_DIM = 128
comptime EXPAND_TOPK = 512
"""Pool ids an expand_topk row selects (`bench.workload.expand_pool_topk`)."""
comptime POOL_BASE = 1000
"""Request `b` sits at pool `POOL_BASE + b` (`bench.workload.make_workload`)."""


def _ptr[
    dtype: DType
](mut values: List[Scalar[dtype]]) -> Pointer[Scalar[dtype], MutAnyOrigin]:
    return values.unsafe_ptr().unsafe_origin_cast[MutAnyOrigin]()


struct IndexCall[H: Int, D: Int, K: Int, P: Int, S: Bool](Movable):
    """Host memory of one call: `B` requests of `cached` tokens bringing
    `new` each, null mask, one layer."""

    comptime Op = IndexOperands[
        U32,
        U32,
        U32,
        U32,
        Self.H,
        Self.D,
        Self.K,
        Self.P,
        False,
        Self.S,
        MutAnyOrigin,
    ]
    comptime W = Self.D // Self.P if Self.S else Self.D
    comptime rows_per_candidate = Self.P if Self.S else 1

    var output: List[Int32]
    var q: List[UInt8]
    var qs: List[Float32]
    var offsets: List[UInt32]
    var k_blocks: List[UInt8]
    var lengths: List[UInt32]
    var table: List[UInt32]
    var scales: List[Float32]
    var plan: List[Int64]
    var scores: List[Float32]
    var split: List[UInt32]
    var tokens: Int
    var requests: Int
    var pages: Int
    var blocks: Int
    var candidates: Int

    def __init__(out self, requests: Int, cached: Int, new: Int):
        seed(11)
        self.requests = requests
        self.tokens = requests * new
        var rows = (cached + new) // Self.P * Self.rows_per_candidate
        self.pages = max(ceildiv(rows, PAGE_SIZE), 1)
        self.blocks = requests * self.pages
        self.candidates = self.pages * PAGE_SIZE // Self.rows_per_candidate
        self.output = List[Int32](length=self.tokens * Self.K, fill=-1)
        self.q = List[UInt8](length=self.tokens * Self.H * Self.D, fill=0)
        for i in range(len(self.q)):
            self.q[i] = _e4m3()
        self.qs = List[Float32](length=self.tokens * Self.H, fill=0)
        for i in range(len(self.qs)):
            self.qs[i] = Float32(random_float64(-1.0, 1.0))
        self.offsets = List[UInt32](length=requests + 1, fill=0)
        for b in range(requests + 1):
            self.offsets[b] = UInt32(b * new)
        self.lengths = List[UInt32](length=requests, fill=UInt32(cached))
        # Pages in a shuffled order of the arena's blocks, as a cache
        # that has served other requests hands them out.
        self.table = List[UInt32](length=self.blocks, fill=0)
        for i in range(self.blocks):
            self.table[i] = UInt32(i)
        for i in reversed(range(1, self.blocks)):
            var j = Int(random_ui64(0, UInt64(i)))
            var moved = self.table[i]
            self.table[i] = self.table[j]
            self.table[j] = moved
        self.k_blocks = List[UInt8](
            length=self.blocks * PAGE_SIZE * Self.W, fill=0
        )
        for i in range(len(self.k_blocks)):
            self.k_blocks[i] = _e4m3()
        self.scales = List[Float32](length=self.blocks * PAGE_SIZE, fill=0)
        for i in range(len(self.scales)):
            self.scales[i] = Float32(random_float64(0.01, 1.0))
        self.plan = List[Int64](length=2 * self.tokens, fill=0)
        self.scores = List[Float32](
            length=self.tokens * self.candidates, fill=0
        )
        for i in range(len(self.scores)):
            self.scores[i] = Float32(random_float64(-4.0, 4.0))
        var slices = select_slices(self.candidates, self.tokens, Self.K)
        self.split = List[UInt32](
            length=max(self.tokens * split_words(slices), 1), fill=0
        )

    def slices(self) -> Int:
        return select_slices(self.candidates, self.tokens, Self.K)

    def op(mut self) -> Self.Op:
        var work = IndexWorkspace[MutAnyOrigin](
            _ptr(self.plan),
            _ptr(self.scores),
            _ptr(self.split),
            self.slices(),
            self.candidates,
            0,
            self.tokens,
        )
        return Self.Op(
            _ptr(self.output),
            _ptr(self.q),
            _ptr(self.qs),
            _ptr(self.offsets),
            _ptr(self.k_blocks),
            _ptr(self.lengths),
            _ptr(self.table),
            _ptr(self.scales),
            _ptr(self.table),
            self.tokens,
            self.requests,
            PAGE_SIZE,
            self.pages,
            self.pages,
            self.blocks,
            self.blocks,
            PAGE_SIZE * Self.W,
            PAGE_SIZE,
            0,
            0,
            work,
        )


def _e4m3() -> UInt8:
    """A random finite e4m3fn byte (not NaN: `0x7F`, `0xFF`)."""
    var byte = UInt8(random_ui64(0, 254))
    return byte if byte != 0x7F else 0x7E


def _print[
    K: GpuKernel
](
    workload: String,
    arch: String,
    op: K.Operands,
    rows: Int,
    warp: Int,
    sample: Int,
    op_name: String = "index_top_k",
) raises:
    var grid = grid_blocks[K](op)
    var line = profile_kernel[K](op, grid, warp, sample).json()
    var head = String('{"op": "', op_name, '", "workload": "', workload)
    head += String('", "arch": "', arch, '", "window_rows": ', rows)
    print(String(head, ', "profile": ', line, "}"))


def _call[
    H: Int, D: Int, K: Int, P: Int, S: Bool
](
    workload: String,
    requests: Int,
    cached: Int,
    new: Int,
    warp: Int,
    sample: Int,
) raises:
    """Profiles one call's launches for the target of `warp` lanes."""
    var call = IndexCall[H, D, K, P, S](requests, cached, new)
    var op = call.op()
    comptime Op = IndexCall[H, D, K, P, S].Op
    var arch = String("sm_90a") if warp == 32 else String("gfx942")
    _print[PlanKernel[Op]](workload, arch, op, op.work.rows, warp, sample)
    # The plan wrote each row's request and bound; the scorers read them.
    comptime Simt = ScoreKernel[SIMT, Op]
    _print[Simt](
        workload, arch, rebind[Simt.Operands](op), op.work.rows, warp, sample
    )
    if warp == 32:
        comptime Rows = ScoreKernel[WGMMA, Op, True]
        comptime Row = ScoreKernel[WGMMA, Op]
        if wgmma_groups_rows(op.total_tokens, op.scored_requests):
            _print[Rows](
                workload,
                arch,
                rebind[Rows.Operands](op),
                op.work.rows,
                warp,
                sample,
            )
        else:
            _print[Row](
                workload,
                arch,
                rebind[Row.Operands](op),
                op.work.rows,
                warp,
                sample,
            )
    else:
        comptime Mfma = ScoreKernel[MFMA, Op]
        _print[Mfma](
            workload,
            arch,
            rebind[Mfma.Operands](op),
            op.work.rows,
            warp,
            sample,
        )
    # The scorers overwrote some rows' scores: random ones again. The
    # select runs whole rows (a split row's blocks meet in its last one):
    # as many as `sample` blocks hold, every block of each.
    for i in range(len(call.scores)):
        call.scores[i] = Float32(random_float64(-4.0, 4.0))
    op.work.rows = max(1, min(call.tokens, sample // call.slices()))
    if call.slices() > 1:
        _print[SelectKernel[Op, True]](
            workload, arch, op, op.work.rows, warp, 0
        )
    else:
        _print[SelectKernel[Op, False]](
            workload, arch, op, op.work.rows, warp, 0
        )


def _bf16() -> BFloat16:
    return BFloat16(Float32(random_float64(-2.0, 2.0)))


struct WriterCall(Movable):
    """Host memory of one writer call of the bench's workload
    (`bench.workload.make_workload`): `batch` requests, each at pool
    `POOL_BASE + b` with `pending` tokens of it in the ring and bringing
    `new` tokens, in a shuffled ring slot of its own; the pools made only
    of new tokens counted into `pool_row_offsets`. Keys and gates are
    random (pooling does the same work for any values)."""

    comptime RaggedCall = RaggedCall[BF16, U32, U32, MutAnyOrigin]
    comptime Ring = Ring[BF16, U32, MutAnyOrigin]

    var tail: List[BFloat16]
    var k: List[BFloat16]
    var gate: List[BFloat16]
    var ape: List[Float32]
    var offsets: List[UInt32]
    var lengths: List[UInt32]
    var slots: List[UInt32]
    var pool_offsets: List[UInt32]
    var pooled: List[BFloat16]
    var ring_pooled: List[BFloat16]
    var closed: List[Int32]
    var first_pool: List[Int64]
    var pool_ids: List[Int32]
    var positions: List[Int32]
    var batch: Int
    var tokens: Int
    var out_rows: Int

    def __init__(
        out self, batch: Int, pending: Int, new: Int, ring: Bool = True
    ) raises:
        seed(7)
        self.batch = batch
        self.tokens = batch * new
        self.out_rows = self.tokens // KPOOL
        var slots = batch if ring else 0
        self.tail = List[BFloat16](capacity=slots * 2 * KPOOL * HEAD_DIM)
        for _ in range(slots * 2 * KPOOL * HEAD_DIM):
            self.tail.append(_bf16())
        # expand_topk reads no keys (`make_workload`: no rows of k).
        var rows = self.tokens if ring else 0
        self.k = List[BFloat16](capacity=rows * HEAD_DIM)
        self.gate = List[BFloat16](capacity=rows * HEAD_DIM)
        for _ in range(rows * HEAD_DIM):
            self.k.append(_bf16())
            self.gate.append(BFloat16(Float32(4) * Float32(_bf16())))
        self.ape = List[Float32](length=KPOOL * HEAD_DIM, fill=0)
        for i in range(len(self.ape)):
            self.ape[i] = Float32(random_float64(-2.0, 2.0))
        self.offsets = List[UInt32](length=batch + 1, fill=0)
        self.lengths = List[UInt32](length=batch, fill=0)
        self.pool_offsets = List[UInt32](length=batch + 1, fill=0)
        for b in range(batch):
            var c = (POOL_BASE + b) * KPOOL + pending
            self.offsets[b + 1] = UInt32((b + 1) * new)
            self.lengths[b] = UInt32(c)
            var count = max((c + new) // KPOOL - ceildiv(c, KPOOL), 0)
            self.pool_offsets[b + 1] = self.pool_offsets[b] + UInt32(count)
        # A shuffled slot per request: slots are not the batch index.
        self.slots = List[UInt32](length=batch, fill=0)
        for b in range(batch):
            self.slots[b] = UInt32(b)
        for i in reversed(range(1, batch)):
            var j = Int(random_ui64(0, UInt64(i)))
            var moved = self.slots[i]
            self.slots[i] = self.slots[j]
            self.slots[j] = moved
        self.pooled = List[BFloat16](
            length=max(self.out_rows, 1) * HEAD_DIM, fill=0
        )
        self.ring_pooled = List[BFloat16](length=batch * HEAD_DIM, fill=0)
        self.closed = List[Int32](length=batch, fill=0)
        self.first_pool = List[Int64](length=batch, fill=0)
        # expand_topk: each row selects EXPAND_TOPK distinct complete pools
        # among the POOL_BASE its query sees, in a random order.
        self.pool_ids = List[Int32]()
        self.positions = List[Int32]()
        if not ring:
            self.pool_ids = List[Int32](length=batch * EXPAND_TOPK, fill=0)
            var pools = List[Int32](length=POOL_BASE, fill=0)
            for b in range(batch):
                for i in range(POOL_BASE):
                    pools[i] = Int32(i)
                for i in range(EXPAND_TOPK):
                    var j = Int(random_ui64(UInt64(i), UInt64(POOL_BASE - 1)))
                    var moved = pools[i]
                    pools[i] = pools[j]
                    pools[j] = moved
                    self.pool_ids[b * EXPAND_TOPK + i] = pools[i]
            self.positions = List[Int32](
                length=batch * row_width[KPOOL, EXPAND_TOPK, True](), fill=0
            )
        var bases = (
            Int(_ptr(self.tail))
            | Int(_ptr(self.k))
            | Int(_ptr(self.gate))
            | Int(_ptr(self.ape))
            | Int(_ptr(self.pooled))
            | Int(_ptr(self.ring_pooled))
        )
        if ring and not gpu_aligned(bases):
            raise Error("a writer operand is not 16-byte aligned")

    def call(mut self) -> Self.RaggedCall:
        return Self.RaggedCall(
            _ptr(self.k),
            _ptr(self.gate),
            _ptr(self.offsets),
            _ptr(self.lengths),
            self.batch,
            self.tokens,
        )

    def ring(mut self) -> Self.Ring:
        return Self.Ring(_ptr(self.tail), _ptr(self.slots), self.batch, KPOOL)


comptime RingCloseOp = RingCloseOperands[
    BF16, U32, U32, U32, KPOOL, HEAD_DIM, MutAnyOrigin
]
comptime CompressOp = CompressOperands[
    BF16, U32, U32, U32, KPOOL, HEAD_DIM, MutAnyOrigin
]
comptime SeedTailOp = SeedTailOperands[
    BF16, U32, U32, U32, KPOOL, HEAD_DIM, MutAnyOrigin
]
comptime StepOp = StepOperands[
    BF16, U32, U32, U32, KPOOL, HEAD_DIM, MutAnyOrigin
]
comptime ExpandOp = ExpandTopKOperands[
    DType.int32, U32, U32, KPOOL, EXPAND_TOPK, True, MutAnyOrigin
]


def _writers(batch: Int, warp: Int, sample: Int) raises:
    """Profiles ring_close, compress, seed_tail and expand_topk at `batch`
    requests (the bench's `tokens_per_request` each), and the fused step's
    two launches at batch 4,096."""
    var arch = String("sm_90a") if warp == 32 else String("gfx942")
    var tag = String("-b", batch)
    var close = WriterCall(batch, KPOOL // 2, KPOOL - KPOOL // 2)
    _print[RingCloseKernel[RingCloseOp]](
        String("ring_close", tag),
        arch,
        RingCloseOp(
            _ptr(close.ring_pooled),
            _ptr(close.closed),
            _ptr(close.ape),
            close.call(),
            close.ring(),
        ),
        0,
        warp,
        sample,
        "mo.mla.kpool.ring_close",
    )
    var compress = WriterCall(batch, 0, KPOOL)
    _print[CompressKernel[CompressOp]](
        String("compress", tag),
        arch,
        CompressOp(
            _ptr(compress.pooled),
            _ptr(compress.ape),
            _ptr(compress.pool_offsets),
            compress.call(),
            compress.out_rows,
        ),
        0,
        warp,
        sample,
        "mo.mla.kpool.compress",
    )
    var stash = WriterCall(batch, 0, KPOOL - 1)
    _print[SeedTailKernel[SeedTailOp]](
        String("seed_tail", tag),
        arch,
        SeedTailOp(stash.call(), stash.ring()),
        0,
        warp,
        sample,
        "mo.mla.kpool.seed_tail",
    )
    var expand = WriterCall(batch, KPOOL // 2, 1, ring=False)
    _print[ExpandTopKKernel[ExpandOp]](
        String("expand_topk", tag),
        arch,
        ExpandOp(
            _ptr(expand.positions),
            _ptr(expand.pool_ids),
            _ptr(expand.offsets),
            _ptr(expand.lengths),
            batch,
            expand.tokens,
        ),
        0,
        warp,
        sample,
        "mo.mla.kpool.expand_topk",
    )


def _step(batch: Int, warp: Int, sample: Int) raises:
    """Profiles the fused step's scan, then its rows (the scan wrote the
    offsets they read), at `batch` requests of `2 * kpool` tokens."""
    var arch = String("sm_90a") if warp == 32 else String("gfx942")
    var w = WriterCall(batch, KPOOL // 2, 2 * KPOOL)
    var op = StepOp(
        RingCloseOp(
            _ptr(w.ring_pooled),
            _ptr(w.closed),
            _ptr(w.ape),
            w.call(),
            w.ring(),
        ),
        _ptr(w.pooled),
        _ptr(w.pool_offsets),
        _ptr(w.first_pool),
        w.out_rows,
    )
    var workload = String("step-b", batch)
    _print[StepScanKernel[StepOp]](
        workload, arch, op, 0, warp, sample, "mla_kpool.step"
    )
    _print[StepKernel[StepOp]](
        workload, arch, op, 0, warp, sample, "mla_kpool.step"
    )


def _index(warp: Int, sample: Int) raises:
    """index_top_k's launches at its three workloads."""
    # GLM-5-Next (H 32, D 128, kpool 4 spread, top 512): decode of 16
    # requests at 32K tokens, and a 4,096-token prefill (null mask).
    _call[32, 128, 512, 4, True](
        "glm5-next-decode", 16, 32 * 1024 - 1, 1, warp, sample
    )
    _call[32, 128, 512, 4, True]("glm5-next-prefill", 1, 0, 4096, warp, sample)
    # DeepSeek-V3.2 (H 64, D 128, kpool 1, top 2048): decode, 16 x 32K.
    _call[64, 128, 2048, 1, False](
        "deepseek-v3.2-decode", 16, 32 * 1024 - 1, 1, warp, sample
    )


def main() raises:
    var args = argv()
    var warp = Int(args[1]) if len(args) > 1 else 32
    var sample = Int(args[2]) if len(args) > 2 else 64
    var ops = String(args[3]) if len(args) > 3 else String("all")
    if ops != "index" and ops != "writers" and ops != "all":
        raise Error("OPS must be index, writers or all, got ", ops)
    if ops != "writers":
        _index(warp, sample)
    if ops != "index":
        for batch in [64, 4096]:
            _writers(batch, warp, sample)
        _step(4096, warp, sample)

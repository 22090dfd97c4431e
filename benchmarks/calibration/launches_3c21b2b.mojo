"""Calibration driver for commit 3c21b2b: the writers the H200 measured
there (the fused step's two launches at batch 4,096, expand_topk at batch
64 and 4,096), emulated with the calibration patch's recording
(`gpu_kernel.profile_kernel`, today's `LaunchProfile`), one JSON line per
launch in the shape of today's `python/mla_kpool/gpu_profile/launches.mojo`
(whose `WriterCall`, the bench's workload in host memory, is copied here).

`mojo run -I . benchmarks/calibration/launches_3c21b2b.mojo SAMPLE`
(in a worktree of 3c21b2b with `3c21b2b.patch` applied).
"""

from std.math import ceildiv, max, min
from std.random import random_float64, random_ui64, seed
from std.sys import argv

from kernels.gpu_kernel import GpuKernel, grid_blocks, profile_kernel
from kernels.ragged import RaggedCall, Ring
from kernels.expand_topk import ExpandTopKKernel, ExpandTopKOperands, row_width
from kernels.ring_close import RingCloseOperands
from kernels.step import StepKernel, StepOperands, StepScanKernel

comptime U32 = DType.uint32
comptime BF16 = DType.bfloat16
comptime KPOOL = 4
comptime HEAD_DIM = 128
comptime EXPAND_TOPK = 512
comptime POOL_BASE = 1000


def _ptr[
    dtype: DType
](mut values: List[Scalar[dtype]]) -> Pointer[Scalar[dtype], MutAnyOrigin]:
    return values.unsafe_ptr().unsafe_origin_cast[MutAnyOrigin]()


def _print[
    K: GpuKernel
](workload: String, op: K.Operands, sample: Int, op_name: String, launch: String) raises:
    var grid = grid_blocks[K](op)
    var line = profile_kernel[K](op, grid, 32, sample).json()
    var head = String('{"op": "', op_name, '", "commit": "3c21b2b", "launch": "', launch)
    head += String('", "workload": "', workload, '", "arch": "sm_90a", "window_rows": 0')
    print(String(head, ', "profile": ', line, "}"))


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
comptime StepOp = StepOperands[
    BF16, U32, U32, U32, KPOOL, HEAD_DIM, MutAnyOrigin
]
comptime ExpandOp = ExpandTopKOperands[
    DType.int32, U32, U32, KPOOL, EXPAND_TOPK, True, MutAnyOrigin
]


def _expand(batch: Int, sample: Int) raises:
    var expand = WriterCall(batch, KPOOL // 2, 1, ring=False)
    _print[ExpandTopKKernel[ExpandOp]](
        String("expand_topk-b", batch),
        ExpandOp(
            _ptr(expand.positions),
            _ptr(expand.pool_ids),
            _ptr(expand.offsets),
            _ptr(expand.lengths),
            batch,
            expand.tokens,
        ),
        sample,
        "mo.mla.kpool.expand_topk",
        "expand_topk",
    )


def _step(batch: Int, sample: Int) raises:
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
    _print[StepScanKernel[StepOp]](workload, op, sample, "mla_kpool.step", "scan")
    _print[StepKernel[StepOp]](workload, op, sample, "mla_kpool.step", "rows")


def main() raises:
    var args = argv()
    var sample = Int(args[1]) if len(args) > 1 else 64
    _expand(64, sample)
    _expand(4096, sample)
    _step(4096, sample)

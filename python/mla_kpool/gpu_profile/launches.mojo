"""The profile's driver: index_top_k's launches at the documented
workloads, emulated with every shared access recorded (`profile_kernel`),
each printed as one JSON line.

`mojo run -I <package parent> launches.mojo WARP SAMPLE` profiles, in warps
of `WARP` lanes (32 for sm_*, 64 for gfx942), the plan, each scorer the
target builds and the select of GLM-5-Next's decode (16 requests of 32K
tokens) and 4,096-token prefill and DeepSeek-V3.2's decode. Workloads are
named as `mla_kpool.bench.bounds.WORKLOADS` names them. A launch of
more than `SAMPLE` blocks runs `SAMPLE` of them (`sampled_blocks` in its
line; its counts are those blocks'; a select runs as many whole rows as
`SAMPLE` blocks hold, `window_rows` in its line). The call is the op's own
(`IndexOperands`) over a paged cache built here: random FP8 bytes and
scales, pages in a shuffled order; a select reads random scores (its work
follows the scores, not the scorer that wrote them).
"""

from std.math import ceildiv, max, min
from std.random import random_float64, random_ui64, seed
from std.sys import argv

from kernels.index.gpu.index_gpu import PlanKernel, SelectKernel
from kernels.index.gpu.index_select import select_slices, split_words
from kernels.index.index_operands import IndexOperands, IndexWorkspace
from kernels.index.index_scorers import MFMA, SIMT, WGMMA, ScoreKernel
from kernels.index.gpu.index_wgmma import wgmma_groups_rows
from kernels.model.gpu_kernel import GpuKernel, grid_blocks, profile_kernel

comptime U32 = DType.uint32
comptime PAGE_SIZE = 128


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
) raises:
    var grid = grid_blocks[K](op)
    var line = profile_kernel[K](op, grid, warp, sample).json()
    var head = String('{"op": "index_top_k", "workload": "', workload)
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


def main() raises:
    var args = argv()
    var warp = Int(args[1]) if len(args) > 1 else 32
    var sample = Int(args[2]) if len(args) > 2 else 64
    # GLM-5-Next (H 32, D 128, kpool 4 spread, top 512): decode of 16
    # requests at 32K tokens, and a 4,096-token prefill (null mask).
    _call[32, 128, 512, 4, True](
        "glm5-next-decode", 16, 32 * 1024 - 1, 1, warp, sample
    )
    _call[32, 128, 512, 4, True](
        "glm5-next-prefill", 1, 0, 4096, warp, sample
    )
    # DeepSeek-V3.2 (H 64, D 128, kpool 1, top 2048): decode, 16 x 32K.
    _call[64, 128, 2048, 1, False](
        "deepseek-v3.2-decode", 16, 32 * 1024 - 1, 1, warp, sample
    )

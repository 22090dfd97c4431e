"""Calibration driver for commit 4d86e1d: index_top_k's three launches
(plan, score with the SIMT or the wgmma scorer, select) at GLM-5-Next's
decode (16 requests x 32K) and 4,096-token prefill, emulated with the
calibration patch's recording (`block_phases.profile_phases`, today's
`LaunchProfile`), one JSON line per launch in the shape of today's
`python/mla_kpool/gpu_profile/launches.mojo`.

`mojo run -I . benchmarks/calibration/launches_4d86e1d.mojo SAMPLE`
(in a worktree of 4d86e1d with `4d86e1d.patch` applied). Launches of more
than `SAMPLE` blocks run `SAMPLE` of them (a fixed shuffle); the select of
a prefill runs `SAMPLE // 4` rows. The call's memory is built as today's
driver builds it (random FP8 keys and scales, pages in a shuffled order,
random scores for the select).
"""

from std.math import ceildiv, max, min
from std.random import random_float64, random_ui64, seed
from std.sys import argv

from kernels.block_phases import Shared, profile_phases
from kernels.index_gpu import PLAN_THREADS, index_plan_thread, index_select_phase
from kernels.index_gpu_score import index_score_phase
from kernels.index_gpu_shape import score_threads, score_tiles, tile_words, tiled_scorer
from kernels.index_operands import IndexOperands
from kernels.index_select_layout import SELECT_THREADS, SELECT_WORDS, select_phases
from kernels.index_wgmma import WGMMA_THREADS, index_wgmma_phase, wgmma_phases, wgmma_tiles, wgmma_words

comptime U32 = DType.uint32
comptime PAGE_SIZE = 128


def _ptr[
    dtype: DType
](mut values: List[Scalar[dtype]]) -> Pointer[Scalar[dtype], MutAnyOrigin]:
    return values.unsafe_ptr().unsafe_origin_cast[MutAnyOrigin]()


def _e4m3() -> UInt8:
    var byte = UInt8(random_ui64(0, 254))
    return byte if byte != 0x7F else 0x7E


struct IndexCall[H: Int, D: Int, K: Int, P: Int, S: Bool](Movable):
    comptime Op = IndexOperands[
        U32, U32, U32, U32, Self.H, Self.D, Self.K, Self.P, False, Self.S,
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
        # The window: every row (2^28 bytes of scores hold them all here).
        self.scores = List[Float32](
            length=self.tokens * self.candidates, fill=0
        )

    def random_scores(mut self):
        for i in range(len(self.scores)):
            self.scores[i] = Float32(random_float64(-4.0, 4.0))

    def op(mut self) -> Self.Op:
        # The operand order of 4d86e1d's IndexOperands (index_top_k.mojo's
        # execute): scored_requests = batch on the GPU path.
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
            _ptr(self.plan),
            _ptr(self.scores),
            self.candidates,
            0,
        )


def _emit(workload: String, scorer: String, launch: String, rows: Int, profile: String):
    var head = String('{"op": "index_top_k", "commit": "4d86e1d", "launch": "', launch)
    head += String('", "scorer": "', scorer, '", "workload": "', workload)
    head += String('", "arch": "sm_90a", "window_rows": ', rows)
    print(String(head, ', "profile": ', profile, "}"))


def _call[
    H: Int, D: Int, K: Int, P: Int, S: Bool
](
    workload: String, requests: Int, cached: Int, new: Int, sample: Int,
    select_sample: Int,
) raises:
    var call = IndexCall[H, D, K, P, S](requests, cached, new)
    var op = call.op()
    var rows = op.total_tokens
    comptime warp = 32

    def plan_body(p: Int, b: Int, t: Int, s: Shared) {imm}:
        index_plan_thread(b, t, op, s)

    var plan = profile_phases(
        "mla_kpool_index_plan_kernel", ceildiv(rows, PLAN_THREADS),
        PLAN_THREADS, 1, 0, plan_body, warp, sample,
    )
    _emit(workload, "any", "plan", rows, plan.json())

    comptime assert tiled_scorer[H, D](), "the tiled SIMT scorer"

    def tile_body(p: Int, b: Int, t: Int, s: Shared) {imm}:
        index_score_phase(p, b, t, s, op)

    var simt = profile_phases(
        "mla_kpool_index_score_kernel", rows * score_tiles(op),
        score_threads[H, D](), 2, tile_words[H, D](), tile_body, warp, sample,
    )
    _emit(workload, "simt", "score", rows, simt.json())

    def wgmma_body(p: Int, b: Int, t: Int, s: Shared) {imm}:
        index_wgmma_phase(p, b, t, s, op)

    var wg = profile_phases(
        "mla_kpool_index_wgmma_score_kernel", rows * wgmma_tiles(op),
        WGMMA_THREADS, wgmma_phases[H](), wgmma_words[H, D](), wgmma_body,
        warp, sample,
    )
    _emit(workload, "wgmma", "score", rows, wg.json())

    call.random_scores()

    def select_body(p: Int, b: Int, t: Int, s: Shared) {imm}:
        index_select_phase(p, b, t, s, op)

    var sel = profile_phases(
        "mla_kpool_index_select_kernel", rows, SELECT_THREADS,
        select_phases(K), SELECT_WORDS, select_body, warp, select_sample,
    )
    _emit(workload, "any", "select", rows, sel.json())
    _ = call^


def main() raises:
    var args = argv()
    var sample = Int(args[1]) if len(args) > 1 else 64
    var which = String(args[2]) if len(args) > 2 else String("all")
    if which != "prefill":
        _call[32, 128, 512, 4, True](
            "glm5-next-decode", 16, 32 * 1024 - 1, 1, sample, sample
        )
    if which != "decode":
        _call[32, 128, 512, 4, True](
            "glm5-next-prefill", 1, 0, 4096, sample, max(sample // 4, 1)
        )

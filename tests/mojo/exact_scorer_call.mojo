"""One exactly-scorable index_top_k call, for the tensor scorers' emulated tests.

Six query rows: three of request 0 see `C` (70 by default: the last
64-candidate tile partly empty; up to a page of 320), 40 and 1 of its
page's candidates, two of request 1 (its own page of other keys) see 65
and 64, and the last row belongs to no request (`-1` in the plan). A
tile of four rows thus holds rows of two requests, and one of a request
and a row of none. Queries and keys are small integers
in e4m3fn, drawn from `codes`; head weights are +-1, 2, 4 and key scales 1
or 1/2, so every score is exact in float32 whatever the order of its sums,
and `check` requires each workspace score to equal the host's product
exactly, and every score past a row's bound to stay unwritten.
"""

from std.testing import assert_equal

from kernels.index.fp8 import decode_e4m3
from max.gpu.host import DeviceContext

from kernels.grid.gpu_kernel import launch_kernel
from kernels.index.operands import IndexOperands, IndexWorkspace
from kernels.index.scorers import ScoreKernel
from kernels.grid.ragged import Ptr

comptime ROWS = 6
"""Query rows of the call."""
comptime REQUESTS = 2
"""Requests of the call (a page of keys each)."""
comptime PAGE = 320
"""Cache rows per page (one key per row)."""
comptime CANDIDATES = 70
"""Workspace row by default: the most candidates a row sees (`C`)."""
comptime U32 = DType.uint32

comptime ExactOp[H: Int, D: Int] = IndexOperands[
    U32, U32, U32, U32, H, D, 16, 1, True, False, MutAnyOrigin
]
"""The call's operand struct: `H` heads of depth `D`, kpool 1, top 16."""


def _byte(codes: SIMD[DType.uint8, 8], i: Int, salt: Int) -> UInt8:
    return codes[(i * 5 + salt * 3 + i // 7) % 8]


def _value(b: UInt8) -> Float32:
    return decode_e4m3[1](SIMD[DType.uint8, 1](b))[0]


struct ExactCall[H: Int, D: Int, C: Int = CANDIDATES](Movable):
    """The call's tensors, owned here, and the check of its scores.

    Parameters:
        H: Query heads.
        D: Depth.
        C: Candidates row 0 sees, the workspace row (at most `PAGE`).
    """

    var q: List[UInt8]
    var qs: List[Float32]
    var keys: List[UInt8]
    var scales: List[Float32]
    var offsets: List[UInt32]
    var lengths: List[UInt32]
    var table: List[UInt32]
    var output: List[Int32]
    var plan: List[Int64]
    var scores: List[Float32]

    def __init__(out self, codes: SIMD[DType.uint8, 8]):
        """Fills the call from `codes`, eight e4m3fn bytes."""
        self.q = List[UInt8](length=ROWS * Self.H * Self.D, fill=0)
        for i in range(len(self.q)):
            self.q[i] = _byte(codes, i, 1)
        self.qs = List[Float32](length=ROWS * Self.H, fill=0.0)
        for i in range(len(self.qs)):
            self.qs[i] = Float32(1 << (i % 3)) * Float32(1 if i % 5 else -1)
        self.keys = List[UInt8](length=REQUESTS * PAGE * Self.D, fill=0)
        for i in range(len(self.keys)):
            self.keys[i] = _byte(codes, i, 2 + i // (PAGE * Self.D))
        self.scales = List[Float32](length=REQUESTS * PAGE, fill=0.0)
        for j in range(REQUESTS * PAGE):
            self.scales[j] = 0.5 if (j + j // PAGE) % 2 else 1.0
        self.offsets = [0, 3, 5]
        self.lengths = [UInt32(Self.C - 1), 64]
        self.table = [0, 1]
        self.output = List[Int32](length=ROWS * 16, fill=-1)
        # (request, bound) per row.
        self.plan = [0, Int64(Self.C), 0, 40, 0, 1, 1, 65, 1, 64, -1, 0]
        self.scores = List[Float32](length=ROWS * Self.C, fill=-1.0)

    def op(mut self) -> ExactOp[Self.H, Self.D]:
        """The operand struct over this call's tensors (valid while it is)."""
        var none = 0  # the split select's words: a scorer never reads them
        return ExactOp[Self.H, Self.D](
            output=self.output.unsafe_ptr().unsafe_origin_cast[MutAnyOrigin](),
            q=self.q.unsafe_ptr().unsafe_origin_cast[MutAnyOrigin](),
            qs=self.qs.unsafe_ptr().unsafe_origin_cast[MutAnyOrigin](),
            input_row_offsets=self.offsets.unsafe_ptr().unsafe_origin_cast[
                MutAnyOrigin
            ](),
            k_blocks=self.keys.unsafe_ptr().unsafe_origin_cast[MutAnyOrigin](),
            k_cache_lengths=self.lengths.unsafe_ptr().unsafe_origin_cast[
                MutAnyOrigin
            ](),
            k_lookup_table=self.table.unsafe_ptr().unsafe_origin_cast[
                MutAnyOrigin
            ](),
            k_scales=self.scales.unsafe_ptr().unsafe_origin_cast[
                MutAnyOrigin
            ](),
            k_scales_lookup_table=self.table.unsafe_ptr().unsafe_origin_cast[
                MutAnyOrigin
            ](),
            total_tokens=ROWS,
            scored_requests=REQUESTS,
            page_size=PAGE,
            key_pages=1,
            scale_pages=1,
            key_blocks=REQUESTS,
            scale_blocks=REQUESTS,
            block_stride=PAGE * Self.D,
            scale_block_stride=PAGE,
            layer_offset=0,
            scale_layer_offset=0,
            work=IndexWorkspace[MutAnyOrigin](
                plan=self.plan.unsafe_ptr().unsafe_origin_cast[MutAnyOrigin](),
                scores=self.scores.unsafe_ptr().unsafe_origin_cast[
                    MutAnyOrigin
                ](),
                split=Ptr[DType.uint32](unsafe_from_address=none),
                slices=1,
                candidates=Self.C,
                first_row=0,
                rows=ROWS,
            ),
        )

    def score[scorer: StaticString, grouped: Bool = False](mut self) raises:
        """Runs `scorer`'s score launch (its declaration, `ScoreKernel`,
        `grouped` as given) over the emulated grid: every row in one
        window."""
        comptime K = ScoreKernel[scorer, ExactOp[Self.H, Self.D], grouped]
        launch_kernel[K, True](
            rebind[K.Operands](self.op()), DeviceContext(api="cpu")
        )

    def check(self, label: String) raises:
        """Every score the exact one, none past a row's bound written.

        Raises:
            Error: Naming `label`, the row and the candidate.
        """
        for t in range(ROWS):
            var b = Int(self.plan[2 * t])
            var bound = Int(self.plan[2 * t + 1])
            for j in range(Self.C):
                var got = self.scores[t * Self.C + j]
                if j >= bound:
                    assert_equal(
                        got, -1.0, "a score past the bound was written"
                    )
                    continue
                var want = Float32(0)
                for h in range(Self.H):
                    var dot = Float32(0)
                    for d in range(Self.D):
                        dot += _value(
                            self.q[(t * Self.H + h) * Self.D + d]
                        ) * _value(self.keys[(b * PAGE + j) * Self.D + d])
                    var relu = Float32(0) if dot < 0 else dot
                    want += relu * self.qs[t * Self.H + h]
                assert_equal(
                    got,
                    want * self.scales[b * PAGE + j],
                    String(label, "row ", t, " id ", j),
                )

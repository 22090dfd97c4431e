"""The CPU prefill scorer's AMX block: Intel AMX-BF16 tile products.

On a Xeon with AMX (Sapphire Rapids and later) one `tdpbf16ps` multiplies
a 16 x 32 bfloat16 tile by a 32 x 16 one into 16 x 16 float32 sums: 16,384
flops an instruction, about 16 times the float32 FMA rate of the same core
(3.2 TFLOP/s against 0.2 on one core of a Sapphire Rapids VM). e4m3fn
queries and keys are exact in bfloat16 and their products exact in
float32 (`block.mojo`), so a tile product differs from the
float32 walk only in the float32 rounding of its sums, as the pair form
does; AMX reads its bfloat16 inputs with denormals as zero, and no e4m3fn
value is a bfloat16 denormal.

The block (`score_row_amx`): one query row's 32 heads against the prefill
tile's 32 candidates, on four float32 C tiles.

The host's compilation target does not name AMX (MAX and `mojo` build for
a target without `amx-tile` even where the CPU has it), so the tile
instructions are inline assembly, which the target's features do not
gate, and the op takes them only after `amx_ready` has checked the CPU
(CPUID) and Linux has granted the process the tile state
(`arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)`). The tile
registers are the only state the blocks share between instructions, and
the compiler never allocates them.

Source: Intel's Software Developer's Manual, vol. 1 ch. 18 (AMX) and
vol. 2 (LDTILECFG, TILELOADD, TDPBF16PS, TILESTORED); Linux's
Documentation/arch/x86/xstate.rst (the permission request).
"""

from std.ffi import external_call
from std.math import ceildiv, min
from std.memory import bitcast, stack_allocation
from std.os import getenv
from std.sys import inlined_assembly, llvm_intrinsic
from std.sys.info import CompilationTarget

from .block import PREFILL_HEADS, PREFILL_TILE, fold_heads
from ..fp8 import decode_e4m3
from ..operands import F32_WIDTH
from ...grid.ragged import Ptr


comptime AMX_HEADS = 32
"""Query heads per AMX block: two A tiles of 16 heads."""

comptime AMX_DIMS = 32
"""Dims per tile step: a tile row holds 32 bfloat16 (64 bytes)."""

comptime AMX_BUILT = (
    CompilationTarget.is_x86()
    and CompilationTarget.is_linux()
    and CompilationTarget._has_feature["avx512bw"]()
    and F32_WIDTH == 16
    and PREFILL_TILE == 2 * 16
)
"""Whether the AMX blocks are compiled: an x86-64 Linux target with
AVX-512 BW (every AMX CPU has it; the bfloat16 table's `vpermi2w` needs
it) whose prefill tile is two C tiles of 16 candidates. Elsewhere the
AMX instructions compile to nothing and `amx_ready()` is false."""

comptime AMX_ENV = "MLA_KPOOL_CPU_AMX"
"""Environment variable that turns the AMX blocks off when it is `0` (to
time or test the vector blocks on an AMX host)."""


@always_inline
def amx_depth_of[depth: Int]() -> Int:
    """Dims per query head in the AMX layout: `depth` rounded up to whole
    tile steps (padding dims zero in queries and keys)."""
    return ceildiv(depth, AMX_DIMS) * AMX_DIMS


@always_inline
def amx_heads_of[num_heads: Int]() -> Int:
    """Heads per row in the AMX layout: whole blocks of `AMX_HEADS`
    (padding heads have a zero query and weight)."""
    return ceildiv(num_heads, AMX_HEADS) * AMX_HEADS


def _cpuid_leaf7_edx() -> UInt32:
    """CPUID leaf 7, subleaf 0: the EDX feature word (0 where `AMX_BUILT`
    is false)."""
    comptime if AMX_BUILT:
        return inlined_assembly[
            "movl $$7, %eax\n\txorl %ecx, %ecx\n\tcpuid\n\tmovl %edx, $0",
            UInt32,
            constraints="=r,~{eax},~{ebx},~{ecx},~{edx}",
        ]()
    else:
        return 0


def amx_ready() -> Bool:
    """Whether this process may run the AMX block now.

    True on an x86-64 Linux host whose CPU has AMX-TILE and AMX-BF16
    (CPUID leaf 7: EDX bits 24 and 22), unless `MLA_KPOOL_CPU_AMX` is `0`,
    once the kernel has granted the process the tile data state (the
    request is idempotent; a kernel before Linux 5.16 or a hypervisor that
    hides the state refuses it, and the op keeps its other blocks). Costs
    a CPUID and a system call: call it once per op call.
    """
    comptime if not AMX_BUILT:
        return False
    else:
        var edx = _cpuid_leaf7_edx()
        if (edx >> 24) & 1 == 0 or (edx >> 22) & 1 == 0:
            return False
        if getenv(AMX_ENV) == "0":
            return False
        # arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)
        return external_call["syscall", Int](158, 0x1023, 18) == 0


@always_inline
def _asm[text: StaticString]():
    """One AMX instruction without operands; nothing where `AMX_BUILT` is
    false (the other targets' assemblers do not know it)."""
    comptime if AMX_BUILT:
        inlined_assembly[text, NoneType, constraints="~{memory}"]()


@always_inline
def _tile_load[tile: Int](address: Int, stride: Int):
    """`tileloadd` of tile `tile` (a no-op where `AMX_BUILT` is false)."""
    comptime if AMX_BUILT:
        inlined_assembly[
            "tileloadd ($0,$1,1), %tmm" + String(tile),
            NoneType,
            constraints="r,r,~{memory}",
        ](address, stride)


@always_inline
def _tile_store[tile: Int](address: Int, stride: Int):
    """`tilestored` of tile `tile` (a no-op where `AMX_BUILT` is false)."""
    comptime if AMX_BUILT:
        inlined_assembly[
            "tilestored %tmm" + String(tile) + ", ($0,$1,1)",
            NoneType,
            constraints="r,r,~{memory}",
        ](address, stride)


@always_inline
def _product[
    steps: Int, a_stride: Int, a_step: Int, b_stride: Int, b_step: Int
](a_at: Int, b_at: Int, c_at: Int):
    """A 32 x 32 float32 block of `A B` on four C tiles, stored to `c_at`.

    A is 32 rows (two tiles of 16, `a_stride` bytes apart) of `steps` x 32
    bfloat16 dims (`a_step` bytes a step); B is `steps` x 16 pair rows
    (`b_stride` bytes apart, `b_step` bytes a step) of 32 columns (two
    tiles of 16 words). C row `i`, column `j` lands at `c_at + i * 128 +
    j * 4`. Uses all eight tiles.
    """
    comptime c_stride = 32 * 4
    _asm["tilezero %tmm0"]()
    _asm["tilezero %tmm1"]()
    _asm["tilezero %tmm2"]()
    _asm["tilezero %tmm3"]()
    comptime for step in range(steps):
        _tile_load[4](a_at + step * a_step, a_stride)
        _tile_load[5](a_at + 16 * a_stride + step * a_step, a_stride)
        _tile_load[6](b_at + step * b_step, b_stride)
        _tile_load[7](b_at + step * b_step + 64, b_stride)
        # tmm(2a + v) += A(a) B(v): A's rows 16a.., B's columns 16v..
        _asm["tdpbf16ps %tmm6, %tmm4, %tmm0"]()
        _asm["tdpbf16ps %tmm7, %tmm4, %tmm1"]()
        _asm["tdpbf16ps %tmm6, %tmm5, %tmm2"]()
        _asm["tdpbf16ps %tmm7, %tmm5, %tmm3"]()
    _tile_store[0](c_at, c_stride)
    _tile_store[1](c_at + 64, c_stride)
    _tile_store[2](c_at + 16 * c_stride, c_stride)
    _tile_store[3](c_at + 16 * c_stride + 64, c_stride)


def amx_begin():
    """Configures this thread's eight tiles as 16 rows x 64 bytes (palette
    1). Call once per task before `score_row_amx` or `score_tile_amx`;
    `amx_end` after."""
    var config = stack_allocation[64, DType.uint8, alignment=64]()
    for x in range(64):
        config[unsafe_offset=x] = 0
    config[unsafe_offset=0] = 1
    for tile in range(8):
        config[unsafe_offset=16 + 2 * tile] = 64
        config[unsafe_offset=48 + tile] = 16
    comptime if AMX_BUILT:
        inlined_assembly["ldtilecfg ($0)", NoneType, constraints="r,~{memory}"](
            Int(config)
        )


def amx_end():
    """Returns this thread's tiles to their initial state (`tilerelease`),
    so the kernel need not save them at every context switch."""
    _asm["tilerelease"]()


@always_inline
def score_row_amx[
    depth: Int, padded: Int
](
    queries: Ptr[DType.uint16],
    weights: Ptr[DType.float32],
    keys: Ptr[DType.uint32],
    sums: Ptr[DType.float32],
    totals: Ptr[DType.float32],
):
    """Adds one row's weighted ReLU head dots over a key tile to its totals.

    For one query row, 32 heads (two A tiles of 16 heads x 32 dims,
    rows of the row's `[heads, depth]` bfloat16 query) against the prefill
    tile's 32 candidates (two B tiles of 16 dim pairs x 16 candidates: the
    pair form's transposed key words, as they are), four float32 C tiles over
    the depth, stored to a `[32 heads, 32 candidates]` scratch and folded into
    the row's totals by `fold_heads` (ReLU keeping a NaN, times the weights).


    Needs `amx_begin` on this thread and `amx_ready()` in this process.

    Args:
        queries: `[padded, amx_depth_of[depth]()]` the row's query heads'
            bfloat16 bits (padding heads and dims zero).
        weights: `[padded]` the heads' weights (padding zero).
        keys: `[amx_depth_of[depth]() / 2, PREFILL_TILE]` the tile's key
            pair words (`transpose_tile_pairs`; padding dims zero).
        sums: `[AMX_HEADS, PREFILL_TILE]` float32 scratch.
        totals: `[PREFILL_TILE]` the row's running weighted head sums.
    """
    # Where AMX_BUILT is false the block is compiled but never runs.
    comptime assert (
        not AMX_BUILT or PREFILL_TILE == 32
    ), "a prefill tile is two C tiles"
    comptime assert AMX_HEADS % PREFILL_HEADS == 0, "whole fold blocks"
    comptime assert padded % AMX_HEADS == 0, "whole head blocks"
    comptime dims = amx_depth_of[depth]()
    comptime query_stride = dims * 2
    comptime key_stride = PREFILL_TILE * 4
    var key_at = Int(keys)
    var sums_at = Int(sums)
    for block in range(0, padded, AMX_HEADS):
        # A: heads `block ..` x dims (the query rows); B: pair rows x the
        # tile's 32 candidates. Head h, candidate vector v lands at
        # sums[(h * 2 + v) * 16]: the layout `fold_heads` reads, one
        # register of candidates per head.
        _product[
            dims // AMX_DIMS,
            query_stride,
            64,
            key_stride,
            16 * key_stride,
        ](Int(queries) + block * query_stride, key_at, sums_at)
        comptime for group in range(AMX_HEADS // PREFILL_HEADS):
            fold_heads(
                sums.unsafe_offset(group * PREFILL_HEADS * PREFILL_TILE),
                weights.unsafe_offset(block + group * PREFILL_HEADS),
                totals,
            )


@always_inline
def amx_usable[depth: Int]() -> Bool:
    """Whether the AMX block is built for `depth`: `AMX_BUILT` and the dims
    split into whole bfloat16 pairs."""
    return AMX_BUILT and depth % 2 == 0


comptime BF16_LANES = 32
"""e4m3fn bytes decoded to bfloat16 per step (a 512-bit vector of words)."""

comptime Words = SIMD[DType.uint16, BF16_LANES]


struct E4m3ToBf16(Copyable, TrivialRegisterPassable):
    """e4m3fn bytes to their (exact) bfloat16 bits by table lookup.

    A byte's magnitude (its low 7 bits) indexes a 128-entry table of
    bfloat16 bits, held in four vectors of 32 words; two `vpermi2w`
    (AVX-512 BW) look up 32 magnitudes in each half of the table, the
    magnitude's bit 6 picks the half, and the sign bit moves to bit 15.
    About 7 instructions per 32 values, where the float32 decode
    (`decode_e4m3`) spends about 12 per 16 and the bfloat16 bits are one
    narrowing step more. NaN (`S.1111.111`) becomes a bfloat16 NaN.
    """

    var low: Words
    """Magnitudes 0-31."""
    var low_high: Words
    """Magnitudes 32-63."""
    var high_low: Words
    """Magnitudes 64-95."""
    var high: Words
    """Magnitudes 96-127."""

    def __init__(out self, built: Bool):
        """The table, from `decode_e4m3` (128 scalar decodes, about a
        microsecond), or all zeros (unused) when not `built`."""
        self.low = Words(0)
        self.low_high = Words(0)
        self.high_low = Words(0)
        self.high = Words(0)
        for m in range(128 if built else 0):
            var value = decode_e4m3[1](SIMD[DType.uint8, 1](UInt8(m)))[0]
            var bits = UInt16(bitcast[DType.uint32, 1](value) >> 16)
            var lane = m % BF16_LANES
            if m < 32:
                self.low[lane] = bits
            elif m < 64:
                self.low_high[lane] = bits
            elif m < 96:
                self.high_low[lane] = bits
            else:
                self.high[lane] = bits

    @always_inline
    def decode(self, bytes: SIMD[DType.uint8, BF16_LANES]) -> Words:
        """32 e4m3fn bytes to their bfloat16 bits."""
        comptime permute = "llvm.x86.avx512.vpermi2var.hi.512"
        var x = bytes.cast[DType.uint16]()
        var index = x & 0x3F
        var low = llvm_intrinsic[permute, Words](self.low, index, self.low_high)
        var high = llvm_intrinsic[permute, Words](
            self.high_low, index, self.high
        )
        return (x & 0x40).ne(0).select(high, low) | ((x & 0x80) << 8)

    @always_inline
    def decode_row[
        count: Int
    ](self, src: Ptr[DType.uint8], dest: Ptr[DType.uint16]):
        """Decodes `count` consecutive e4m3fn bytes into bfloat16 bits."""
        comptime full = count // BF16_LANES
        comptime for i in range(full):
            dest.unsafe_store[width=BF16_LANES](
                i * BF16_LANES,
                self.decode(src.unsafe_load[width=BF16_LANES](i * BF16_LANES)),
            )
        comptime for i in range(full * BF16_LANES, count):
            var value = decode_e4m3[1](
                SIMD[DType.uint8, 1](src[unsafe_offset=i])
            )[0]
            dest[unsafe_offset=i] = UInt16(
                bitcast[DType.uint32, 1](value) >> 16
            )


comptime AMX_ROW_TILE = 32
"""Candidates per AMX pass of the decode scorer (two A tiles of 16)."""


@always_inline
def score_tile_amx[
    depth: Int, padded: Int
](
    queries: Ptr[DType.uint32],
    weights: Ptr[DType.float32],
    keys: Ptr[DType.uint16],
    scales: Ptr[DType.float32],
    count: Int,
    sums: Ptr[DType.float32],
    scores: Ptr[DType.float32],
):
    """Scores one query row against `count` candidates on AMX tiles.

    The decode form: the keys are the A tiles, in the row layout they are
    decoded in (16 candidates x 32 dims a tile), so a tile of keys costs
    no transposition; the row's query is the B tiles (pair words `[dims /
    2, padded]`, built once per row). Per 32 candidates and 32 heads, four
    C tiles (16 candidates x 16 heads) over the depth, stored to `sums`;
    then per candidate its heads' ReLU (keeping a NaN) times the weights,
    summed across the vector, times the key scale.

    Needs `amx_begin` on this thread and `amx_ready()` in this process.

    Args:
        queries: `[amx_depth_of[depth]() / 2, padded]` the row's query
            pair words (dims `2p`, `2p + 1` of head `h` at `[p, h]`;
            padding heads and dims zero).
        weights: `[padded]` the heads' weights (padding zero).
        keys: `[count rounded up to AMX_ROW_TILE, amx_depth_of[depth]()]`
            (a caller's buffer of whole `AMX_ROW_TILE` rows)
            the candidates' bfloat16 bits (padding dims zero; rows past
            `count` any finite or NaN values, never read back).
        scales: `[count]` the key scales.
        count: Candidates to score.
        sums: `[AMX_ROW_TILE, AMX_HEADS]` float32 scratch.
        scores: `[>= count rounded up to AMX_ROW_TILE]` float32 scores out.
    """
    comptime assert padded % AMX_HEADS == 0, "whole head blocks"
    comptime dims = amx_depth_of[depth]()
    comptime key_stride = dims * 2
    comptime query_stride = padded * 4
    comptime Lanes = SIMD[DType.float32, 16]
    var sums_at = Int(sums)
    for first in range(0, count, AMX_ROW_TILE):
        var key_at = Int(keys) + first * key_stride
        comptime for c in range(AMX_ROW_TILE):
            scores[unsafe_offset=first + c] = 0
        for block in range(0, padded, AMX_HEADS):
            # A: the 32 candidates x dims (the key rows); B: pair rows x
            # heads `block ..`. Candidate c's heads land at
            # sums[c * AMX_HEADS :].
            _product[
                dims // AMX_DIMS,
                key_stride,
                64,
                query_stride,
                16 * query_stride,
            ](key_at, Int(queries) + block * 4, sums_at)
            var low = weights.unsafe_load[width=16](block)
            var high = weights.unsafe_load[width=16](block + 16)
            comptime for c in range(AMX_ROW_TILE):
                var a = sums.unsafe_load[width=16](c * AMX_HEADS)
                var b = sums.unsafe_load[width=16](c * AMX_HEADS + 16)
                var total = (
                    a.lt(0).select(Lanes(0), a) * low
                    + b.lt(0).select(Lanes(0), b) * high
                )
                scores[unsafe_offset=first + c] += total.reduce_add()
        for c in range(first, min(first + AMX_ROW_TILE, count)):
            scores[unsafe_offset=c] *= scales[unsafe_offset=c]

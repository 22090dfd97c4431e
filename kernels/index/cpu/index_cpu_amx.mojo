"""The CPU prefill scorer's AMX block: Intel AMX-BF16 tile products.

On a Xeon with AMX (Sapphire Rapids and later) one `tdpbf16ps` multiplies
a 16 x 32 bfloat16 tile by a 32 x 16 one into 16 x 16 float32 sums: 16,384
flops an instruction, about 16 times the float32 FMA rate of the same core
(3.2 TFLOP/s against 0.2 on one core of a Sapphire Rapids VM). e4m3fn
queries and keys are exact in bfloat16 and their products exact in
float32 (`index_cpu_block.mojo`), so a tile product differs from the
float32 walk only in the float32 rounding of its sums, as the pair form
does; AMX reads its bfloat16 inputs with denormals as zero, and no e4m3fn
value is a bfloat16 denormal.

The block: for one query row, 32 heads (two A tiles of 16 heads x 32 dims,
rows of the row's `[heads, depth]` bfloat16 query) against the prefill
tile's 32 candidates (two B tiles of 16 dim pairs x 16 candidates: the
pair form's transposed key words, as they are), four float32 C tiles over
the depth, stored to a `[32 heads, 32 candidates]` scratch and folded into
the row's totals by `fold_heads` (ReLU keeping a NaN, times the weights).

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
from std.math import ceildiv
from std.memory import bitcast, stack_allocation
from std.os import getenv
from std.sys import inlined_assembly
from std.sys.info import CompilationTarget

from .index_cpu_block import PREFILL_HEADS, PREFILL_TILE, fold_heads
from ..index_operands import F32_WIDTH
from ...model.ragged import Ptr


comptime AMX_HEADS = 32
"""Query heads per AMX block: two A tiles of 16 heads."""

comptime AMX_DIMS = 32
"""Dims per tile step: a tile row holds 32 bfloat16 (64 bytes)."""

comptime AMX_BUILT = CompilationTarget.is_x86() and CompilationTarget.is_linux() and F32_WIDTH == 16 and PREFILL_TILE == 2 * 16
"""Whether the AMX block is compiled: an x86-64 Linux target whose prefill
tile is two C tiles of 16 candidates (AVX-512 widths; every AMX CPU has
AVX-512)."""

comptime AMX_ENV = "MLA_KPOOL_CPU_AMX"
"""Environment variable that turns the AMX block off when it is `0` (to
time or test the other CPU blocks on an AMX host)."""


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
    """CPUID leaf 7, subleaf 0: the EDX feature word."""
    return inlined_assembly[
        "movl $$7, %eax\n\txorl %ecx, %ecx\n\tcpuid\n\tmovl %edx, $0",
        UInt32,
        constraints="=r,~{eax},~{ebx},~{ecx},~{edx}",
    ]()


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
def to_bfloat16_bits[
    depth: Int
](values: Ptr[DType.float32], bits: Ptr[DType.uint16]):
    """`[depth]` float32 values that are exact bfloat16 (decoded e4m3fn) to
    their bfloat16 bits: the high half of each float32."""
    comptime width = 16
    comptime full = depth // width
    comptime for i in range(full):
        var words = bitcast[DType.uint32, width](
            values.unsafe_load[width=width](i * width)
        )
        bits.unsafe_store[width=width](
            i * width, (words >> 16).cast[DType.uint16]()
        )
    comptime for d in range(full * width, depth):
        bits[unsafe_offset=d] = UInt16(
            bitcast[DType.uint32, 1](values[unsafe_offset=d]) >> 16
        )


@always_inline
def _asm[text: StaticString]():
    inlined_assembly[text, NoneType, constraints="~{memory}"]()


@always_inline
def _tile_load[tile: Int](address: Int, stride: Int):
    inlined_assembly[
        "tileloadd ($0,$1,1), %tmm" + String(tile),
        NoneType,
        constraints="r,r,~{memory}",
    ](address, stride)


@always_inline
def _tile_store[tile: Int](address: Int, stride: Int):
    inlined_assembly[
        "tilestored %tmm" + String(tile) + ", ($0,$1,1)",
        NoneType,
        constraints="r,r,~{memory}",
    ](address, stride)


def amx_begin():
    """Configures this thread's eight tiles as 16 rows x 64 bytes (palette
    1). Call once per task before `score_row_amx`; `amx_end` after."""
    var config = stack_allocation[64, DType.uint8, alignment=64]()
    for x in range(64):
        config[unsafe_offset=x] = 0
    config[unsafe_offset=0] = 1
    for tile in range(8):
        config[unsafe_offset=16 + 2 * tile] = 64
        config[unsafe_offset=48 + tile] = 16
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
    comptime dims = amx_depth_of[depth]()
    comptime query_stride = dims * 2
    comptime key_stride = PREFILL_TILE * 4
    comptime sum_stride = PREFILL_TILE * 4
    var key_at = Int(keys)
    var sums_at = Int(sums)
    for block in range(0, padded, AMX_HEADS):
        var query_at = Int(queries) + block * query_stride
        _asm["tilezero %tmm0"]()
        _asm["tilezero %tmm1"]()
        _asm["tilezero %tmm2"]()
        _asm["tilezero %tmm3"]()
        comptime for step in range(dims // AMX_DIMS):
            # A tiles: heads 0-15 and 16-31, dims [32 step, 32 step + 32).
            _tile_load[4](query_at + step * 64, query_stride)
            _tile_load[5](
                query_at + 16 * query_stride + step * 64, query_stride
            )
            # B tiles: pair rows [16 step, 16 step + 16), candidates 0-15
            # and 16-31.
            comptime row = step * 16 * PREFILL_TILE * 4
            _tile_load[6](key_at + row, key_stride)
            _tile_load[7](key_at + row + 64, key_stride)
            # tmm(2a + v) += A(a) B(v): heads 16a.., candidates 16v..
            _asm["tdpbf16ps %tmm6, %tmm4, %tmm0"]()
            _asm["tdpbf16ps %tmm7, %tmm4, %tmm1"]()
            _asm["tdpbf16ps %tmm6, %tmm5, %tmm2"]()
            _asm["tdpbf16ps %tmm7, %tmm5, %tmm3"]()
        # Head h, candidate vector v at sums[(h * 2 + v) * 16]: the layout
        # `fold_heads` reads, one register of candidates per head.
        _tile_store[0](sums_at, sum_stride)
        _tile_store[1](sums_at + 64, sum_stride)
        _tile_store[2](sums_at + 16 * sum_stride, sum_stride)
        _tile_store[3](sums_at + 16 * sum_stride + 64, sum_stride)
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

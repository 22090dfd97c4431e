"""One `mla_kpool.index_top_k` call as its kernels see it: `IndexOperands`.

The call's tensor pointers, sizes and cache geometry, shared by the CPU
path (`cpu/tasks.mojo`) and the GPU path (`gpu/launches.mojo`). The op's
contract and the checks that fill the struct are in `top_k.mojo`;
how the offsets and pages are read is in `plan.mojo`.
"""

from std.math import ceildiv
from std.sys import simd_width_of

from ..grid.operands import KernelOperands
from ..grid.ragged import Field, Ptr


comptime TOP_K_LIMIT = 2048
"""Largest `k` the op accepts (MAX's limit for this op; the GPU select's
pair area holds this many ids). `mla_kpool._limits.MAX_TOP_K` is its
Python twin (tests/docs_and_layout/test_kernel_constants.py checks they
agree)."""

comptime F32_WIDTH = simd_width_of[DType.float32]()
"""Lanes of one float32 SIMD register."""


@always_inline
def head_vectors_of[num_heads: Int]() -> Int:
    """SIMD registers one query dim's `num_heads` heads fill."""
    return ceildiv(num_heads, F32_WIDTH)


@always_inline
def padded_heads_of[num_heads: Int]() -> Int:
    """Heads rounded up to whole registers: the decoded queries' row width,
    shared by the tasks that lay them out and the kernel that reads them."""
    return head_vectors_of[num_heads]() * F32_WIDTH


@fieldwise_init
struct IndexWorkspace[origin: MutOrigin](Copyable, TrivialRegisterPassable):
    """The GPU path's workspace and window: not operands of the call.

    Parameters:
        origin: Origin of the pointers (`MutAnyOrigin` in kernels).
    """

    var plan: Field[DType.int64, Self.origin]
    """`[2 * T]` each row's request and bound (`gpu/launches.mojo`)."""
    var scores: Field[DType.float32, Self.origin]
    """`[window, candidates]` score workspace."""
    var split: Field[DType.uint32, Self.origin]
    """`[window, split_words(slices)]` the split select's words (zero
    before the first window; each row's last block re-zeroes its counter
    and histogram)."""
    var slices: Int
    """Blocks each row's select is split over (`select_slices`)."""
    var candidates: Int
    """The most candidates a row can see: a workspace row."""
    var first_row: Int
    """The window's first row."""
    var rows: Int
    """Rows in the window."""


def no_workspace() -> IndexWorkspace[MutAnyOrigin]:
    """No workspace (null pointers, never read; no rows): the CPU path's."""
    var none = 0
    return IndexWorkspace[MutAnyOrigin](
        Ptr[DType.int64](unsafe_from_address=none),
        Ptr[DType.float32](unsafe_from_address=none),
        Ptr[DType.uint32](unsafe_from_address=none),
        1,
        0,
        0,
        0,
    )


@fieldwise_init
struct IndexOperands[
    offset_dtype: DType,
    length_dtype: DType,
    table_dtype: DType,
    scale_table_dtype: DType,
    num_heads: Int,
    depth: Int,
    k: Int,
    kpool: Int,
    causal: Bool,
    spread: Bool,
    origin: MutOrigin,
](KernelOperands):
    """One index_top_k call: its tensors, sizes and cache geometry.

    Parameters:
        offset_dtype: Integer dtype of `input_row_offsets`.
        length_dtype: Integer dtype of `k_cache_lengths`.
        table_dtype: Integer dtype of `k_lookup_table`.
        scale_table_dtype: Integer dtype of `k_scales_lookup_table`.
        num_heads: Query heads `H`.
        depth: Dims per head and per key `D`.
        k: Ids kept per query row.
        kpool: Tokens per candidate.
        causal: Causal mask (else null).
        spread: A candidate spreads over `kpool` rows of `D / kpool`.
        origin: Origin of the tensor pointers (`MutAnyOrigin` in kernels).
    """

    var output: Field[DType.int32, Self.origin]
    """`[T, k]` int32 result."""
    var q: Field[DType.uint8, Self.origin]
    """`[T, H, D]` e4m3fn query bytes."""
    var qs: Field[DType.float32, Self.origin]
    """`[T, H]` head weights."""
    var input_row_offsets: Field[Self.offset_dtype, Self.origin]
    """`[B + 1]` query row offsets."""
    var k_blocks: Field[DType.uint8, Self.origin]
    """Key block 0's first byte."""
    var k_cache_lengths: Field[Self.length_dtype, Self.origin]
    """`[B]` rows cached before this call."""
    var k_lookup_table: Field[Self.table_dtype, Self.origin]
    """`[B, key_pages]` key block per (request, page)."""
    var k_scales: Field[DType.float32, Self.origin]
    """Scale block 0's first value."""
    var k_scales_lookup_table: Field[Self.scale_table_dtype, Self.origin]
    """`[B, scale_pages]` scale block per (request, page)."""
    var total_tokens: Int
    """Query rows `T`."""
    var scored_requests: Int
    """Requests `0 .. scored_requests - 1` have well-formed offsets."""
    var page_size: Int
    """Cache rows per page."""
    var key_pages: Int
    """Columns of `k_lookup_table`."""
    var scale_pages: Int
    """Columns of `k_scales_lookup_table`."""
    var key_blocks: Int
    """Blocks of the bound `k_blocks` view."""
    var scale_blocks: Int
    """Blocks of the bound `k_scales` view."""
    var block_stride: Int
    """Elements from one key block to the next."""
    var scale_block_stride: Int
    """Elements from one scale block to the next."""
    var layer_offset: Int
    """Elements from a key block's start to `layer_idx`'s slot 0."""
    var scale_layer_offset: Int
    """Elements from a scale block's start to `layer_idx`'s slot 0."""
    var work: IndexWorkspace[Self.origin]
    """GPU path: its device workspace and the window of rows being run
    (`no_workspace()` on the CPU)."""

    comptime width = Self.depth // Self.kpool if Self.spread else Self.depth
    """Bytes per cache row, `W`."""
    comptime rows_per_candidate = Self.kpool if Self.spread else 1
    """Cache rows one candidate spans."""
    comptime padded_heads = padded_heads_of[Self.num_heads]()
    """Heads rounded up to whole registers (padding heads weigh 0)."""


comptime IndexTopK = IndexOperands[..., origin=MutAnyOrigin]
"""`IndexOperands` over the kernels' raw tensor pointers."""

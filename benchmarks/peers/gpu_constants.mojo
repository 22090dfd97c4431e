"""`mla_kpool.gpu_constants`: kernels that measure the cost model's constants.

One call of the op launches each kernel below once, in this order; the GPU
run (`python/mla_kpool/bench/kernel_times.py`, item `constants`) times
every launch with PyTorch's profiler (CUPTI kernel records), as it times
the ops, and turns the kernel times into constants:

- `mla_kpool_constants_copy`: a grid-stride copy of `src` into `dst`
  (16-byte accesses), both far past the L2 cache: DRAM bandwidth is
  `2 * bytes / time`;
- `mla_kpool_constants_warm`, then `mla_kpool_constants_chase`: one
  thread follows `chain` (a random cycle of 32-bit indices, one per
  128-byte line, that fits the L2), once around to bring it into the L2,
  then for `steps` dependent loads: L2 latency is the chase's `time /
  steps` (its launch cost included, microseconds over milliseconds);
- `mla_kpool_constants_bank_free` / `_bank_conflict`: every thread of
  full blocks does `BANK_ITERS` dependent shared-memory loads, lane `l`
  at word `l` (32 banks, no conflict) or at word `32 * l` (all 32 lanes
  on one bank: a 32-way conflict); their time ratio is the conflict's cost;
- `mla_kpool_constants_atomic_same` / `_atomic_distinct`: every warp
  adds `ATOMIC_ITERS` times to global words, its 32 lanes on one word or
  each on its own; the time ratio is what same-address atomics cost;
- `mla_kpool_constants_barrier_on` / `_barrier_off`: blocks of
  `BARRIER_THREADS` threads run `rounds` rounds of the same
  arithmetic with and without a block barrier after each; the difference
  over the rounds is one barrier's cost.

GPU only: on a CPU the op raises.
"""

import extensibility
from extensibility import InputTensor, OutputTensor
from max.gpu import barrier, block_dim, block_idx, grid_dim, thread_idx
from max.gpu.host import DeviceContext
from max.gpu.memory import AddressSpace
from std.atomic import Atomic, Ordering
from std.memory import stack_allocation

comptime U32Ptr = Pointer[UInt32, MutAnyOrigin]
"""The kernels' buffers."""

comptime COPY_THREADS = 256
"""Threads per block of the copy."""
comptime COPY_BLOCKS_PER_SM = 8
"""Copy blocks per multiprocessor (enough loads in flight for DRAM)."""
comptime LINE_WORDS = 32
"""32-bit words in a 128-byte line: the chase's step between lines."""
comptime BANK_THREADS = 1024
"""Threads per block of the bank kernels (32 warps on one SM's banks)."""
comptime BANK_ITERS = 4096
"""Dependent shared loads per thread."""
comptime ATOMIC_THREADS = 256
"""Threads per block of the atomic kernels."""
comptime ATOMIC_ITERS = 256
"""Atomic adds per thread."""
comptime BARRIER_THREADS = 1024
"""Threads per block of the barrier kernels."""
comptime BLOCKS_PER_SM = 2
"""Blocks per multiprocessor of the shared, atomic and barrier kernels."""


@__name("mla_kpool_constants_copy")
def constants_copy(dst: U32Ptr, src: U32Ptr, vectors: Int64):
    """Copies `vectors` 16-byte vectors from `src` to `dst` (grid stride)."""
    var stride = Int(grid_dim.x) * Int(block_dim.x)
    var i = Int(block_idx.x) * Int(block_dim.x) + Int(thread_idx.x)
    var n = Int(vectors)
    while i < n:
        var v = src.unsafe_load[width=4, alignment=16](4 * i)
        dst.unsafe_store[width=4, alignment=16](4 * i, v)
        i += stride


@always_inline
def _follow(sink: U32Ptr, chain: U32Ptr, steps: Int):
    """One thread follows `chain` from index 0 for `steps` dependent loads;
    the index reached goes to `sink[0]`, so no load can be dropped."""
    if thread_idx.x != 0 or block_idx.x != 0:
        return
    var at = UInt32(0)
    for _ in range(steps):
        at = chain.unsafe_load(Int(at))
    sink[unsafe_offset=0] = at


@__name("mla_kpool_constants_warm")
def constants_warm(sink: U32Ptr, chain: U32Ptr, lines: Int64):
    """Once around the cycle (`lines` loads): every line into the L2."""
    _follow(sink, chain, Int(lines))


@__name("mla_kpool_constants_chase")
def constants_chase(sink: U32Ptr, chain: U32Ptr, steps: Int64):
    """`steps` dependent loads around the cycle, now in the L2."""
    _follow(sink, chain, Int(steps))


@always_inline
def _bank_loads[spread: Int](sink: U32Ptr):
    """`BANK_ITERS` dependent shared loads per thread, lane `l` at word
    `spread * l` (the warps share the words; a conflict is within one
    warp's access). The words hold zeros, which the compiler cannot know,
    so each address waits on the load before."""
    var words = stack_allocation[
        32 * LINE_WORDS,
        UInt32,
        alignment=128,
        address_space=AddressSpace.SHARED,
    ]()
    var t = Int(thread_idx.x)
    var lane = t % 32
    for i in range(t, 32 * LINE_WORDS, BANK_THREADS):
        words[unsafe_offset=i] = 0
    barrier()
    var at = UInt32(0)
    for _ in range(BANK_ITERS):
        at = words[unsafe_offset=spread * lane + Int(at)]
    if at != 0:
        sink[unsafe_offset=1] = at


@__name("mla_kpool_constants_bank_free")
def constants_bank_free(sink: U32Ptr):
    """Lane `l` reads word `l`: 32 lanes on 32 banks."""
    _bank_loads[1](sink)


@__name("mla_kpool_constants_bank_conflict")
def constants_bank_conflict(sink: U32Ptr):
    """Lane `l` reads word `32 * l`: 32 lanes on one bank."""
    _bank_loads[LINE_WORDS](sink)


@always_inline
def _atomic_adds[same: Bool](counters: U32Ptr, sink: U32Ptr):
    """`ATOMIC_ITERS` relaxed device-scope adds per thread: a warp's lanes
    on one word (`same`) or on 32 adjacent words; the results are summed
    so the adds cannot be combined away."""
    var t = Int(block_idx.x) * Int(block_dim.x) + Int(thread_idx.x)
    var warp = t // 32
    var word = warp if same else t
    var total = UInt32(0)
    for _ in range(ATOMIC_ITERS):
        total += Atomic[UInt32, scope="device"].fetch_add[
            ordering=Ordering.RELAXED
        ](counters.unsafe_offset(word), 1)
    if total == 0xFFFFFFFF:
        sink[unsafe_offset=2] = total


@__name("mla_kpool_constants_atomic_same")
def constants_atomic_same(counters: U32Ptr, sink: U32Ptr):
    """A warp's 32 lanes add to one word."""
    _atomic_adds[True](counters, sink)


@__name("mla_kpool_constants_atomic_distinct")
def constants_atomic_distinct(counters: U32Ptr, sink: U32Ptr):
    """Each lane adds to its own word."""
    _atomic_adds[False](counters, sink)


@always_inline
def _rounds[sync: Bool](sink: U32Ptr, rounds: Int64):
    """`rounds` rounds of a multiply-add, a block barrier after each when
    `sync`."""
    var x = UInt32(thread_idx.x) | 1
    for _ in range(Int(rounds)):
        x = x * 1664525 + 1013904223
        comptime if sync:
            barrier()
    if x == 0:
        sink[unsafe_offset=3] = x


@__name("mla_kpool_constants_barrier_on")
def constants_barrier_on(sink: U32Ptr, rounds: Int64):
    """Rounds with a block barrier after each."""
    _rounds[True](sink, rounds)


@__name("mla_kpool_constants_barrier_off")
def constants_barrier_off(sink: U32Ptr, rounds: Int64):
    """The same rounds without barriers."""
    _rounds[False](sink, rounds)


@extensibility.register("mla_kpool.gpu_constants")
struct GpuConstants:
    """Registers `mla_kpool.gpu_constants` (GPU only)."""

    @staticmethod
    def execute[
        *, target: StaticString, steps: Int, rounds: Int, sms: Int
    ](
        dst: OutputTensor[dtype=DType.uint32, rank=1, ...],
        sink: OutputTensor[dtype=DType.uint32, rank=1, ...],
        counters: OutputTensor[dtype=DType.uint32, rank=1, ...],
        src: InputTensor[dtype=DType.uint32, rank=1, ...],
        chain: InputTensor[dtype=DType.uint32, rank=1, ...],
        ctx: DeviceContext,
    ) raises:
        """Launches each measuring kernel once (see the module).

        Parameters:
            target: `"gpu"` (a CPU target raises).
            steps: Dependent loads the chase times.
            rounds: Rounds of the barrier kernels.
            sms: The GPU's multiprocessors (sizes the grids).

        Args:
            dst: `[n]` uint32: the copy's destination (`n` a multiple of
                4, its bytes far past the L2).
            sink: `[4]` uint32: values kept so no kernel is optimized away.
            counters: `[w]` uint32 global words for the atomics (their
                values unused), `w` at least the atomic launches' threads
                (`sms * BLOCKS_PER_SM * ATOMIC_THREADS`).
            src: `[n]` uint32: the copy's source.
            chain: `[m]` uint32: a cycle of indices for the chase, one per
                line (`m` a multiple of 32, its bytes within the L2).
            ctx: The GPU's device context.

        Raises:
            Error: On a CPU target, or operands of the wrong sizes.
        """
        comptime if target == "cpu":
            raise Error("mla_kpool.gpu_constants: runs on a GPU only")
        else:
            var n = src.dim_size(0)
            var m = chain.dim_size(0)
            var blocks = sms * BLOCKS_PER_SM
            if (
                n % 4
                or dst.dim_size(0) != n
                or m % LINE_WORDS
                or counters.dim_size(0) < blocks * ATOMIC_THREADS
                or sink.dim_size(0) < 4
            ):
                raise Error("mla_kpool.gpu_constants: operand sizes")
            var d = dst.unsafe_ptr()
            var s = sink.unsafe_ptr()
            var c = counters.unsafe_ptr()
            ctx.enqueue_function[constants_copy](
                d,
                src.unsafe_ptr().unsafe_origin_cast[MutAnyOrigin](),
                Int64(n // 4),
                grid_dim=sms * COPY_BLOCKS_PER_SM,
                block_dim=COPY_THREADS,
            )
            var links = chain.unsafe_ptr().unsafe_origin_cast[MutAnyOrigin]()
            ctx.enqueue_function[constants_warm](
                s, links, Int64(m // LINE_WORDS), grid_dim=1, block_dim=1
            )
            ctx.enqueue_function[constants_chase](
                s, links, Int64(steps), grid_dim=1, block_dim=1
            )
            ctx.enqueue_function[constants_bank_free](
                s, grid_dim=blocks, block_dim=BANK_THREADS
            )
            ctx.enqueue_function[constants_bank_conflict](
                s, grid_dim=blocks, block_dim=BANK_THREADS
            )
            ctx.enqueue_function[constants_atomic_same](
                c, s, grid_dim=blocks, block_dim=ATOMIC_THREADS
            )
            ctx.enqueue_function[constants_atomic_distinct](
                c, s, grid_dim=blocks, block_dim=ATOMIC_THREADS
            )
            ctx.enqueue_function[constants_barrier_on](
                s, Int64(rounds), grid_dim=blocks, block_dim=BARRIER_THREADS
            )
            ctx.enqueue_function[constants_barrier_off](
                s, Int64(rounds), grid_dim=blocks, block_dim=BARRIER_THREADS
            )

"""How the blocks that split a row meet through global memory.

Each block writes its part of the row (plain stores, or `publish_add` to
words several blocks add to), every writing thread calls `publish_fence`,
and after the block's barrier one thread `arrive`s at the row's counter;
the thread that sees every other block arrived calls `acquire_fence` and
reads the parts (`read_published`). Everything is at GPU scope (`.gpu` in
PTX, the agent on AMD): the blocks of one launch, not the system.
"""

from std.atomic import Atomic, Ordering, fence
from std.sys import is_amd_gpu, is_nvidia_gpu


@always_inline
def _gpu_scope() -> StaticString:
    """The scope of blocks meeting through global memory: the GPU (`.gpu`
    in PTX, the agent on AMD), not the system a fence would otherwise
    wait for."""
    comptime if is_nvidia_gpu():
        return "device"
    elif is_amd_gpu():
        return "agent"
    return ""


@always_inline
def publish_fence():
    """Orders this thread's global writes before a later `arrive` of its
    block (a release fence): each thread that wrote a block's part calls it
    before the barrier that precedes the arrival."""
    fence[Ordering.RELEASE, scope=_gpu_scope()]()


@always_inline
def publish_add(ptr: Pointer[UInt32, MutAnyOrigin], i: Int, value: UInt32):
    """Adds `value` to word `i` of global memory that several blocks add to
    (a relaxed atomic at GPU scope: `atom.relaxed.gpu.global.add` on
    NVIDIA). Like a plain write of a block's part, it is ordered before
    the block's `arrive` by `publish_fence`, and the last block to arrive
    reads the sum with `read_published`.

    Args:
        ptr: The words, in global memory.
        i: The word.
        value: What to add.
    """
    _ = Atomic[UInt32, scope=_gpu_scope()].fetch_add[ordering=Ordering.RELAXED](
        ptr.unsafe_offset(i), value
    )


@always_inline
def read_published(ptr: Pointer[UInt32, MutAnyOrigin], i: Int) -> UInt32:
    """Word `i` another block published: a strong (relaxed) load, served
    from the L2 cache rather than a stale line of this SM's L1. The last
    block to `arrive` reads the others' parts this way, after an acquire
    fence (`acquire_fence`)."""
    return Atomic[UInt32, scope=_gpu_scope()].load[ordering=Ordering.RELAXED](
        ptr.unsafe_offset(i)
    )


@always_inline
def acquire_fence():
    """Orders the arrival the block observed (through its barrier) before
    this thread's reads of the other blocks' parts."""
    fence[Ordering.ACQUIRE, scope=_gpu_scope()]()


@always_inline
def arrive(counter: Pointer[UInt32, MutAnyOrigin]) -> UInt32:
    """Adds one to a global counter (acquire-release); the count before.

    How blocks that split a row meet through global memory: each block
    writes its part, then one thread arrives; the thread that sees
    `blocks - 1` arrived last and may read every part (the release of the
    others' arrivals orders their writes before its acquire). The caller
    resets the counter for the next launch.

    Args:
        counter: A word in global memory, zero before the launch.
    """
    return Atomic[UInt32, scope=_gpu_scope()].fetch_add[
        ordering=Ordering.ACQUIRE_RELEASE
    ](counter, 1)

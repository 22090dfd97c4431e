"""What a block's threads share, and how the emulation checks it.

A GPU kernel whose threads cooperate (`gpu_kernel.GpuKernel` with shared
words or several phases) is written as phases: `run_phase[p]` for `p` in
`0 ..< phases`, a block barrier after each. The phase is a compile-time
parameter, so the compiler sees straight-line code between barriers, and a
thread keeps a declared per-thread state (`GpuKernel.State`, a struct) in
registers across barriers. This module holds what one phase of one thread
touches besides its state:

- **`BlockShared`** (`Shared`): the block's shared memory as `UInt32`
  words (32-bit values of other types by bit pattern, `load_f32` /
  `store_f32`), with plain loads and stores and **atomics** (`atomic_add`,
  `atomic_max`: relaxed, through `std.atomic.Atomic` on the shared address
  space on a GPU).
- **`Lane`** (in `collectives`, re-exported here with the collective
  kinds): the thread's value in a **collective** that runs after a phase
  (`GpuKernel.phase_table`).
- **Blocks that meet through global memory** (`publish`, re-exported
  here): `publish_add`, `publish_fence`, `arrive`, `acquire_fence`,
  `read_published`, at GPU scope.

**The emulation** runs a block's phase `p` for every thread (in
descending order) before phase `p + 1`, exact for barrier-separated code,
and blocks in a shuffled order (`block_order`), so code that depends on
block order fails. It fails a launch on a race, a read of a word never
written, an index out of range or a collective lane left out
(`BlockShared` lists the rules). A profiled launch (`profile_kernel`)
records every access by source location; the GPU build records nothing.
"""

from max.gpu.memory import AddressSpace
from std.atomic import Atomic, Ordering
from std.math import max, min
from std.memory import bitcast
from std.reflection import SourceLocation, call_location
from std.sys import (
    align_of,
    is_amd_gpu,
    is_defined,
    is_gpu,
    is_nvidia_gpu,
    size_of,
)

# The collectives, for the kernels that import them with the shared view.
from .collectives import (
    BLOCK_EXCLUSIVE_SUM,
    BLOCK_MAX,
    BLOCK_SUM,
    EMULATED_WARP,
    NO_COLLECTIVE,
    WARP_BALLOT,
    WARP_BROADCAST,
    WARP_EXCLUSIVE_SUM,
    WARP_MAX,
    WARP_SUM,
    Lane,
    check_lanes,
    collective_scratch_words,
    emulate_collective,
    gpu_collective,
    is_block_collective,
    scratch_start,
    warp_lanes,
)
from .profile import ACCESS_ATOMIC, ACCESS_LOAD, ACCESS_STORE, LaunchProfile

# How blocks meet through global memory, for the kernels that import it
# with the shared view.
from .publish import (
    acquire_fence,
    arrive,
    publish_add,
    publish_fence,
    read_published,
)

comptime PROFILE_BUILD = is_defined["MLA_KPOOL_PROFILE"]()
"""Whether this build records profiles: `mojo run -D MLA_KPOOL_PROFILE`,
as gpu-profile's driver and the profile's tests run. Every other build
(the package's, the suite's, every GPU build) has no recording code at
all: a branch on `is_gpu()` alone stayed in the GPU build long enough to
change ptxas's allocation (ring_close 64 registers to 74 on sm_90a)."""

comptime SHARED_CHECKED = not is_gpu()
"""Whether shared accesses are checked: on the host (the emulation), never
on a GPU, whose build has no checking code."""

comptime Shared = BlockShared[MutAnyOrigin, SHARED_CHECKED]
"""The view a phased body receives."""

comptime _NONE: Int64 = 0
"""A stamp no access has set."""

comptime _MANY: Int64 = 0xFFFFFFFF
"""The thread field of a stamp that several threads set."""

comptime _KIND_READ_RACE = 1
comptime _KIND_WRITE_RACE = 2
comptime _KIND_UNWRITTEN = 3
comptime _KIND_OUT_OF_RANGE = 4
comptime _KIND_MIXED_ATOMIC = 5
comptime _KIND_UNWRITTEN_ATOMIC = 6

comptime _SHADOWS = 3
"""Stamps per shared word: last write, reads, atomics."""

comptime REPORT_WORDS = 5
"""Words after the stamps that hold the first violation: kind, word,
thread, the other thread, phase."""


def shadow_words(shared_words: Int) -> Int:
    """`Int64` words of the emulation's shadow of `shared_words` words."""
    return _SHADOWS * shared_words + REPORT_WORDS


@always_inline
def _block_scope() -> StaticString:
    """The atomics' scope for shared memory: the block (`.cta` in PTX)."""
    comptime if is_nvidia_gpu():
        return "block"
    elif is_amd_gpu():
        return "workgroup"
    return ""


@always_inline
def _stamp(phase: Int, thread: Int) -> Int64:
    """`(phase + 1) << 32 | (thread + 1)`: never `_NONE`."""
    return (Int64(phase + 1) << 32) | Int64(thread + 1)


@always_inline
def _stamp_phase(stamp: Int64) -> Int:
    return Int(stamp >> 32) - 1


@always_inline
def _stamp_thread(stamp: Int64) -> Int:
    return Int(stamp & 0xFFFFFFFF) - 1


struct BlockShared[origin: MutOrigin, checked: Bool](TrivialRegisterPassable):
    """One thread's view of its block's shared memory in one phase.

    On a GPU, `words` is the block's shared memory and `checked` is false
    (`SHARED_CHECKED`): loads, stores and atomics are plain, with no
    checking code. Emulated,
    `shadow` holds each word's last write stamp, then its read stamps, its
    atomic stamps and the report (`shadow_words`); an access that breaks the
    phase model is recorded there (the first one) and the launch fails after
    the phase.

    A missing barrier would still give the right answer in some thread
    order, so the emulation does not rely on order: it stamps every shared
    word with its last writer, readers and atomic users (phase, thread) and
    fails the launch on

    - a read of a word another thread wrote in the same phase,
    - a write to a word another thread read or wrote in the same phase,
    - a plain read or write of a word another thread used atomically in the
      same phase (atomics among themselves are exact in any order),
    - a read (or atomic) of a word no phase of this block has written (shared
      memory starts undefined on a GPU),
    - an index outside the launch's shared words,
    - a collective one of whose lanes offered no value in that phase, and
    - a thread reading a collective's result that no collective gave it.

    The race check idea is the one of GPU race detectors (NVIDIA's
    compute-sanitizer racecheck): shadow state per shared word, checked at
    each access between two barriers.

    Parameters:
        origin: Origin of the pointers (`MutAnyOrigin` in kernels, as
            `Shared`).
        checked: Whether each access is checked against `shadow`.
    """

    var words: Pointer[UInt32, Self.origin]
    var shadow: Pointer[Int64, Self.origin]
    var size: Int
    var phase: Int
    var thread: Int
    var profile: Pointer[LaunchProfile, Self.origin]
    """Where the emulation records each access (`profile.LaunchProfile`);
    address 0 for none. Never read on a GPU."""

    def __init__(
        out self,
        words: Pointer[UInt32, Self.origin],
        shadow: Pointer[Int64, Self.origin],
        size: Int,
        phase: Int,
        thread: Int,
        profile: Pointer[LaunchProfile, MutAnyOrigin] = no_profile(),
    ):
        """A view of `size` words; `shadow` is read only when `checked`,
        `profile` only when its address is not 0 (host code only)."""
        self.words = words
        self.shadow = shadow
        self.size = size
        self.phase = phase
        self.thread = thread
        self.profile = profile.unsafe_origin_cast[Self.origin]()

    @always_inline
    def _note[
        width: Int, kind: Int
    ](self, site: SourceLocation, i: Int, buffer: StaticString = ""):
        """Records an access at `site` (of the named `buffer`, if any) in
        the launch's profile, if any.

        Compiled for the host only: the GPU build has no recording code.
        """
        comptime if PROFILE_BUILD:
            comptime if not is_gpu():
                if Int(self.profile) != 0:
                    self.profile[].record(
                        site, kind, self.thread, i, width, buffer
                    )

    def _report(self, kind: Int, word: Int, other: Int):
        var report = self.shadow.unsafe_offset(_SHADOWS * self.size)
        if report[unsafe_offset=0] != 0:
            return
        report[unsafe_offset=0] = Int64(kind)
        report[unsafe_offset=1] = Int64(word)
        report[unsafe_offset=2] = Int64(self.thread)
        report[unsafe_offset=3] = Int64(other)
        report[unsafe_offset=4] = Int64(self.phase)

    def _in_range(self, i: Int) -> Bool:
        if 0 <= i < self.size:
            return True
        self._report(_KIND_OUT_OF_RANGE, i, -1)
        return False

    def _other(self, stamp: Int64) -> Bool:
        """Whether `stamp` is another thread's in this phase."""
        return (
            stamp != _NONE
            and _stamp_phase(stamp) == self.phase
            and _stamp_thread(stamp) != self.thread
        )

    def _join(self, at: Int):
        """Adds this thread to the stamp at shadow word `at`."""
        var stamp = self.shadow[unsafe_offset=at]
        var mine = _stamp(self.phase, self.thread)
        if stamp == _NONE or _stamp_phase(stamp) != self.phase:
            self.shadow[unsafe_offset=at] = mine
        elif stamp != mine:
            self.shadow[unsafe_offset=at] = (
                Int64(self.phase + 1) << 32
            ) | _MANY

    def _check_defined(self, i: Int, kind: Int = _KIND_UNWRITTEN):
        if self.shadow[unsafe_offset=i] == _NONE:
            self._report(kind, i, -1)

    def _check_atomics(self, i: Int):
        var atomic = self.shadow[unsafe_offset=2 * self.size + i]
        if self._other(atomic):
            self._report(_KIND_MIXED_ATOMIC, i, _stamp_thread(atomic))

    def _check_read(self, i: Int):
        var written = self.shadow[unsafe_offset=i]
        self._check_defined(i)
        if self._other(written):
            self._report(_KIND_READ_RACE, i, _stamp_thread(written))
        self._check_atomics(i)
        self._join(self.size + i)

    def _check_write(self, i: Int):
        var written = self.shadow[unsafe_offset=i]
        if self._other(written):
            self._report(_KIND_WRITE_RACE, i, _stamp_thread(written))
        var read = self.shadow[unsafe_offset=self.size + i]
        if self._other(read):
            self._report(_KIND_WRITE_RACE, i, _stamp_thread(read))
        self._check_atomics(i)
        self.shadow[unsafe_offset=i] = _stamp(self.phase, self.thread)

    def _check_atomic(self, i: Int):
        self._check_defined(i, _KIND_UNWRITTEN_ATOMIC)
        var written = self.shadow[unsafe_offset=i]
        var read = self.shadow[unsafe_offset=self.size + i]
        if self._other(written):
            self._report(_KIND_MIXED_ATOMIC, i, _stamp_thread(written))
        elif self._other(read):
            self._report(_KIND_MIXED_ATOMIC, i, _stamp_thread(read))
        self._join(2 * self.size + i)

    @always_inline
    def _load(self, i: Int) -> UInt32:
        """Word `i`, checked when emulated, not recorded."""
        comptime if Self.checked:
            if not self._in_range(i):
                return 0
            self._check_read(i)
        return self.words[unsafe_offset=i]

    @always_inline
    def _store(self, i: Int, value: UInt32):
        """Sets word `i`, checked when emulated, not recorded."""
        comptime if Self.checked:
            if not self._in_range(i):
                return
            self._check_write(i)
        self.words[unsafe_offset=i] = value

    @always_inline
    def load(self, i: Int) -> UInt32:
        """Word `i` (0 if the emulation refused the access)."""
        return self.load_at(call_location(), i)

    @always_inline
    def load_at(
        self, site: SourceLocation, i: Int, buffer: StaticString = ""
    ) -> UInt32:
        """`load`, recorded at `site` as an access of `buffer` (what a
        named buffer, `shared_buffer.SharedBuffer`, calls)."""
        self._note[1, ACCESS_LOAD](site, i, buffer)
        return self._load(i)

    @always_inline
    def unrecorded(self) -> Self:
        """This view, not recorded by a profile (an emulator gathering
        other lanes' registers: their loads are theirs to record)."""
        var quiet = self
        quiet.profile = no_profile().unsafe_origin_cast[Self.origin]()
        return quiet

    @always_inline
    def tensor_operand_load(self, i: Int) -> UInt32:
        """Word `i` as a tensor-core instruction reads its shared operand
        (wgmma's descriptor): checked when emulated like any read, but
        not a thread's request, so a profile does not record it (the
        instruction emulators in `index/gpu` read through this)."""
        return self._load(i)

    @always_inline
    def store(self, i: Int, value: UInt32):
        """Sets word `i` (dropped if the emulation refused the access)."""
        self.store_at(call_location(), i, value)

    @always_inline
    def store_at(
        self,
        site: SourceLocation,
        i: Int,
        value: UInt32,
        buffer: StaticString = "",
    ):
        """`store`, recorded at `site` as an access of `buffer`."""
        self._note[1, ACCESS_STORE](site, i, buffer)
        self._store(i, value)

    @always_inline
    def store_words[width: Int](self, i: Int, value: SIMD[DType.uint32, width]):
        """Stores words `i ..< i + width`: one vector store on a GPU.

        Parameters:
            width: Words (a power of two, at most 4); `i` must be a
                multiple of it.
        """
        self.store_words_at[width](call_location(), i, value)

    @always_inline
    def store_words_at[
        width: Int
    ](
        self,
        site: SourceLocation,
        i: Int,
        value: SIMD[DType.uint32, width],
        buffer: StaticString = "",
    ):
        """`store_words`, recorded at `site` as an access of `buffer`."""
        self._note[width, ACCESS_STORE](site, i, buffer)
        comptime if Self.checked:
            comptime for w in range(width):
                self._store(i + w, value[w])
        else:
            self.words.unsafe_offset(i).unsafe_store[
                width=width, alignment=min(4 * width, 16)
            ](0, value)

    @always_inline
    def atomic_add(self, i: Int, value: UInt32) -> UInt32:
        """Adds `value` to word `i` atomically (relaxed); the old word.

        Other threads may add to the same word in the same phase (a
        histogram); a plain access of it by another thread in that phase
        is a race the emulation reports.
        """
        return self.atomic_add_at(call_location(), i, value)

    @always_inline
    def atomic_add_at(
        self,
        site: SourceLocation,
        i: Int,
        value: UInt32,
        buffer: StaticString = "",
    ) -> UInt32:
        """`atomic_add`, recorded at `site` as an access of `buffer`."""
        self._note[1, ACCESS_ATOMIC](site, i, buffer)
        comptime if Self.checked:
            if not self._in_range(i):
                return 0
            self._check_atomic(i)
        comptime if is_gpu():
            return Atomic[UInt32, scope=_block_scope()].fetch_add[
                ordering=Ordering.RELAXED
            ](
                self.words.unsafe_offset(i).unsafe_address_space_cast[
                    AddressSpace.SHARED
                ](),
                value,
            )
        var old = self.words[unsafe_offset=i]
        self.words[unsafe_offset=i] = old + value
        return old

    @always_inline
    def atomic_max(self, i: Int, value: UInt32):
        """Raises word `i` to `value` atomically (relaxed) if it is lower."""
        self._note[1, ACCESS_ATOMIC](call_location(), i)
        comptime if Self.checked:
            if not self._in_range(i):
                return
            self._check_atomic(i)
        comptime if is_gpu():
            _ = Atomic[UInt32, scope=_block_scope()].max[
                ordering=Ordering.RELAXED
            ](
                self.words.unsafe_offset(i).unsafe_address_space_cast[
                    AddressSpace.SHARED
                ](),
                value,
            )
        else:
            var old = self.words[unsafe_offset=i]
            self.words[unsafe_offset=i] = max(old, value)

    @always_inline
    def load_f32(self, i: Int) -> Float32:
        """Word `i` as a float32 bit pattern."""
        self._note[1, ACCESS_LOAD](call_location(), i)
        return bitcast[DType.float32, 1](self._load(i))

    @always_inline
    def load_f32x[width: Int](self, i: Int) -> SIMD[DType.float32, width]:
        """Words `i ..< i + width` as float32 lanes, one vector load on a GPU.

        Parameters:
            width: Lanes (a power of two); `i` must be a multiple of it.
        """
        return self.load_f32x_at[width](call_location(), i)

    @always_inline
    def load_f32x_at[
        width: Int
    ](self, site: SourceLocation, i: Int, buffer: StaticString = "") -> SIMD[
        DType.float32, width
    ]:
        """`load_f32x`, recorded at `site` as an access of `buffer`."""
        self._note[width, ACCESS_LOAD](site, i, buffer)
        comptime if Self.checked:
            var lanes = SIMD[DType.float32, width]()
            comptime for w in range(width):
                lanes[w] = bitcast[DType.float32, 1](self._load(i + w))
            return lanes
        return (
            self.words.unsafe_offset(i)
            .unsafe_bitcast[Float32]()
            .unsafe_load[width=width, alignment=min(4 * width, 16)](0)
        )

    @always_inline
    def store_f32(self, i: Int, value: Float32):
        """Stores `value`'s bit pattern in word `i`."""
        self.store_at(call_location(), i, bitcast[DType.uint32, 1](value))

    @always_inline
    def _note_global[
        dtype: DType, at: Origin, //, kind: Int
    ](
        self,
        site: SourceLocation,
        ptr: Pointer[Scalar[dtype], at],
        i: Int,
        bytes: Int,
    ):
        """Records `bytes` bytes at element `i` of `ptr`, if profiled (host
        only, as `_note`). The address is computed in the guard: an unused
        cast outside it changed ptxas's registers."""
        comptime if PROFILE_BUILD:
            comptime if not is_gpu():
                if Int(self.profile) != 0:
                    var address = Int(ptr) + i * size_of[dtype]()
                    self.profile[].record_global(
                        site, kind, self.thread, address, bytes
                    )

    @always_inline
    def global_load[
        dtype: DType,
        at: Origin,
        //,
        width: Int = 1,
        alignment: Int = align_of[Scalar[dtype]](),
    ](self, ptr: Pointer[Scalar[dtype], at], i: Int) -> SIMD[dtype, width]:
        """Elements `i ..< i + width` of `ptr`, in global memory: one load of
        `width` elements on a GPU, recorded by a profiled emulation.

        Parameters:
            dtype: Element type.
            at: Origin of `ptr`.
            width: Elements (a power of two; the profile counts a load
                wider than 16 bytes as the 16-byte loads a GPU makes).
            alignment: Bytes `ptr + i` is a multiple of.
        """
        return self.global_load_at[width=width, alignment=alignment](
            call_location(), ptr, i
        )

    @always_inline
    def global_load_at[
        dtype: DType,
        at: Origin,
        //,
        width: Int = 1,
        alignment: Int = align_of[Scalar[dtype]](),
    ](
        self, site: SourceLocation, ptr: Pointer[Scalar[dtype], at], i: Int
    ) -> SIMD[dtype, width]:
        """`global_load` (its parameters), recorded at `site`: a helper that
        loads for its callers passes its `call_location()`, so that each
        caller is a site."""
        self._note_global[ACCESS_LOAD](site, ptr, i, width * size_of[dtype]())
        comptime if width == 1:
            # As `ptr[i]` makes it: a one-lane vector load kept the wgmma
            # scorer's byte loads apart (42 -> 48 registers on sm_90a).
            return ptr[unsafe_offset=i]
        return ptr.unsafe_offset(i).unsafe_load[
            width=width, alignment=alignment
        ](0)

    @always_inline
    def note_global_load[
        dtype: DType, at: Origin, //, width: Int = 1
    ](self, ptr: Pointer[Scalar[dtype], at], i: Int):
        """Records the load of elements `i ..< i + width` of `ptr` that the
        caller makes itself, without loading: `global_load`'s record for a
        load in code shared with the CPU path, which takes no view (the
        writers' member loads, `pooling._member`, and their metadata reads).

        Host code only, as `_note_global`: a GPU build has nothing of it
        (the profile counts a load wider than 16 bytes as the 16-byte
        loads a GPU makes of it).

        Parameters:
            dtype: Element type.
            at: Origin of `ptr`.
            width: Elements (a power of two).
        """
        self._note_global[ACCESS_LOAD](
            call_location(), ptr, i, width * size_of[dtype]()
        )

    @always_inline
    def note_span[
        dtype: DType, at: Origin, //
    ](self, offsets: Pointer[Scalar[dtype], at], b: Int):
        """Records the reads of request `b`'s row span, `offsets[b]` and
        `offsets[b + 1]`, by code shared with the CPU path (`token_span`,
        `plan.end_well_formed`), at the caller's line."""
        var site = call_location()
        self._note_global[ACCESS_LOAD](site, offsets, b, size_of[dtype]())
        self._note_global[ACCESS_LOAD](site, offsets, b + 1, size_of[dtype]())

    @always_inline
    def global_store[
        dtype: DType,
        at: MutOrigin,
        //,
        width: Int = 1,
        alignment: Int = align_of[Scalar[dtype]](),
    ](
        self,
        ptr: Pointer[Scalar[dtype], at],
        i: Int,
        value: SIMD[dtype, width],
    ):
        """Stores `value` at elements `i ..< i + width` of `ptr`, in global
        memory: one store on a GPU, recorded by a profiled emulation.

        Parameters:
            dtype: Element type.
            at: Origin of `ptr`.
            width: Elements (a power of two, at most 16 bytes in all).
            alignment: Bytes `ptr + i` is a multiple of.
        """
        self._note_global[ACCESS_STORE](
            call_location(), ptr, i, width * size_of[dtype]()
        )
        ptr.unsafe_offset(i).unsafe_store[width=width, alignment=alignment](
            0, value
        )


@always_inline
def no_profile() -> Pointer[LaunchProfile, MutAnyOrigin]:
    """The profile pointer of a view that records nothing (address 0)."""
    var none = 0
    return Pointer[LaunchProfile, MutAnyOrigin](unsafe_from_address=none)


def violation(
    kernel: StaticString, block: Int, report: Pointer[Int64, MutAnyOrigin]
) -> String:
    """The emulation's message for the violation recorded in `report`."""
    var kind = Int(report[unsafe_offset=0])
    var word = report[unsafe_offset=1]
    # A stamp several threads share names no one thread.
    var other = String("thread ", report[unsafe_offset=3])
    if report[unsafe_offset=3] >= _MANY - 1:
        other = "several threads"
    var place = String(
        kernel,
        ": block ",
        block,
        " phase ",
        report[unsafe_offset=4],
        " thread ",
        report[unsafe_offset=2],
    )
    if kind == _KIND_OUT_OF_RANGE:
        if word < 0:
            return String(place, " used a word outside its shared buffer")
        return String(place, " used shared word ", word, " out of range")
    if kind == _KIND_UNWRITTEN:
        return String(
            place, " read shared word ", word, " before any thread wrote it"
        )
    if kind == _KIND_UNWRITTEN_ATOMIC:
        return String(
            place,
            " used shared word ",
            word,
            " atomically before any thread wrote it",
        )
    if kind == _KIND_MIXED_ATOMIC:
        return String(
            place,
            " mixed a plain access of shared word ",
            word,
            " with that of ",
            other,
            " in the same phase, one of them atomic (a race)",
        )
    var what = "read" if kind == _KIND_READ_RACE else "wrote"
    return String(
        place,
        " ",
        what,
        " shared word ",
        word,
        " that ",
        other,
        " used in the same phase (a missing barrier)",
    )


def block_order(grid: Int) -> List[Int]:
    """The order the emulation runs `grid` blocks in: a fixed shuffle.

    A Fisher-Yates shuffle driven by a 64-bit linear congruential generator
    (Knuth's MMIX constants) with a fixed seed: the same order on every
    run, unrelated to the block index, so a kernel whose blocks depend on
    each other's order gives a wrong answer or fails here.

    Args:
        grid: Blocks.
    """
    var order = List[Int](capacity=grid)
    for b in range(grid):
        order.append(b)
    var state: UInt64 = 0x9E3779B97F4A7C15
    for i in reversed(range(1, grid)):
        state = state * 6364136223846793005 + 1442695040888963407
        var j = Int((state >> 33) % UInt64(i + 1))
        var moved = order[i]
        order[i] = order[j]
        order[j] = moved
    return order^
